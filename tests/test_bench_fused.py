"""`megamoe bench fused` on the CPU: the routing of its cases, its variant list, its command line (the run itself
needs a GPU: bench tier, not a test)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe.bench import fused as bf  # noqa: E402
from megamoe.cli import bench_options, parse_args  # noqa: E402


def test_routed_inputs_are_topk_of_randn() -> None:
    x, x_sf, idx, w = bf.routed_inputs(64, 32, 6, 256, seed=1, device=torch.device("cpu"))
    assert x.shape == (64, 256) and x.dtype == torch.float8_e4m3fn and x_sf.shape == (64, 2)
    assert idx.shape == (64, 6) and idx.dtype == torch.int64
    scores = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(idx, scores.topk(6, dim=1).indices)
    assert torch.allclose(w.sum(dim=1), torch.ones(64)) and bool((w > 0).all())
    # distinct experts per token, a different routing per seed
    assert all(len(set(row)) == 6 for row in idx.tolist())
    assert not torch.equal(idx, bf.routed_inputs(64, 32, 6, 256, seed=2, device=torch.device("cpu"))[2])


def test_variants_and_cli() -> None:
    configs = bf.fused_kernel_configs()
    assert [getattr(c, "serial", None) for c in configs[:2]] == [True, False]
    assert configs[2].block_m == configs[0].block_m
    assert bench_options(parse_args(["bench", "fused", "--compile-only"])) == {}
    with pytest.raises(ValueError, match="only apply to `megamoe bench comm`"):
        bench_options(parse_args(["bench", "fused", "--tokens", "8"]))
