"""cpu tier: megamoe.layer.MoELayer's host paths (the kernels themselves: tests/test_layer_gpu.py)."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

SHAPE = dict(num_experts=8, num_topk=6, hidden=1024, intermediate=512, max_tokens_per_rank=128)


def test_prepare_loads_every_kernel_of_its_hints_then_meets_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare: the input fill for both id types, then megamoe.prepare with each hint's load (None: the default
    config) and the layer's clamp and math, which compiles and loads each variant and then meets the ranks."""
    from megamoe import api, heuristics
    from megamoe.buffer import SymmBuffer
    from megamoe.fused import launch
    from megamoe.kernels import input_cast
    from megamoe.layer import MoELayer

    calls: list[tuple] = []
    monkeypatch.setattr(input_cast, "load", lambda buf, idx64: calls.append(("fill", idx64)))
    monkeypatch.setattr(api, "_check_sm90", lambda buf, name: None)  # the variants' loads are stood in for below
    monkeypatch.setattr(launch, "prepare", lambda buf, **kwargs: calls.append(("fused", kwargs)))
    monkeypatch.setattr(SymmBuffer, "barrier", lambda self: calls.append(("barrier",)))
    layer = MoELayer(**SHAPE, device="cpu", activation_clamp=7.0)
    layer.prepare([None, 8])
    expected = heuristics.default_expected_tokens_per_expert(1, SHAPE["num_experts"], 8, SHAPE["num_topk"])
    common: dict[str, Any] = dict(activation_clamp=7.0, fast_math=True)
    assert calls == [("fill", False), ("fill", True),
                     ("fused", dict(common, expected_tokens_per_expert=None)),
                     ("fused", dict(common, expected_tokens_per_expert=expected)), ("barrier",)]
    with pytest.raises(ValueError, match="num_tokens_hint must be in"):
        layer.prepare([129])
