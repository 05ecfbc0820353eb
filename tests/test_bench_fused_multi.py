"""`megamoe bench fused_multi` without a GPU: its NCCL + cuBLAS baseline over gloo on 2 CPU ranks (a CPU stand-in for
`torch._scaled_mm`) against the distributed reference, the one-process-per-rank harness with fake timings, the
results' assembly (slowest rank, the peer's row at 8 ranks) and the table."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe.bench import fused_multi as fm  # noqa: E402
from megamoe.testing.ranks import RankContext  # noqa: E402

from test_bench_ffn_cublas import FakeScaledMm  # noqa: E402

SMALL = (8, 512, 512, 3)  # experts, hidden, intermediate, top-k (K / 128 >= 4: the stand-in scale layouts)


def _gloo_baseline(ranks: RankContext, counts: list[int]) -> tuple[float, int]:
    from megamoe import reference
    from megamoe.testing import fused_ranks

    e, h, i, k = SMALL
    natural = fused_ranks.draw_local_weights(3, ranks.rank, e // ranks.num_ranks, h, i, "cpu")
    tokens = fused_ranks.draw_tokens(4, ranks.rank, counts[ranks.rank], e, k, h, "uniform", "cpu")
    y_ref, recv = fused_ranks.reference_y(ranks.group, ranks.rank, ranks.num_ranks, tokens, *natural)
    baseline = fm.NcclCublas(tokens, natural, ranks.num_ranks, ranks.rank, ranks.group, scaled_mm=FakeScaledMm())
    first = baseline.run()
    # The timed path (fixed splits) must take the received rows afresh: the FFN's own copies are spoiled first
    for t in (baseline.ffn.x_ext, baseline.ffn.inputs.x.view(torch.uint8)):
        t.fill_(0x7E)
    baseline.ffn.x_sf_ext.fill_(float("nan"))
    again = baseline.run()
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    # Only the local experts that received rows run (one, empty, where none did)
    assert baseline.ffn.pipeline.num_experts == max(int((recv > 0).sum()), 1), (recv.tolist(),)
    return reference.rel_l2(first.float(), y_ref.float()), int(first.shape[0])


@pytest.mark.parametrize("counts", [[9, 5], [16, 16], [1, 1]])
def test_nccl_cublas_baseline_matches_the_reference_over_gloo(counts: list[int]) -> None:
    from megamoe.testing.ranks import spawn_ranks

    got = spawn_ranks(2, _gloo_baseline, counts, backend="gloo", what="fused_multi baseline", timeout_s=180)
    for rank, (err, rows) in enumerate(got):
        assert rows == counts[rank]
        # the same recipe as the reference (exact dots, fp32 promotion); only the order of the fp32 sums differs
        assert err <= fm.MULTI_MAX_Y_REL_L2 / 10, f"rank {rank}: y rel-L2 {err:.2e}"


def _fake_case(case: fm.MultiCase, index: int, plan: fm.MultiPlan, ranks: RankContext) -> dict:
    import torch.distributed as dist

    dist.barrier(group=ranks.cpu_group)
    base = 100.0 * (index + 1) + ranks.rank
    return {"rows": case.tokens * 6, "y_rel_l2": 1e-3 * (ranks.rank + 1), "nccl_cublas_y_rel_l2": 2e-3,
            "fused_warm_us": base, "fused_cold_us": base + 10, "nccl_cublas_warm_us": 3 * base,
            "nccl_cublas_cold_us": 3 * base + 10}


def test_harness_gathers_on_rank_zero_over_gloo() -> None:
    plan = fm.MultiPlan(tuple(fm.multi_cases([8, 128], ["flash"])), warmup=1, iters=2)
    results = fm.spawn_multi_ranks(2, plan, backend="gloo", case_fn=_fake_case, timeout_s=120)
    assert [r.case for r in results] == ["flash T=8", "flash T=128"]
    first = results[0]
    assert first.rows == 2 * 8 * 6 and first.y_rel_l2 == 2e-3 and first.device == "cpu"
    fused_warm = first.measurements[0]
    assert fused_warm.impl == "fused" and not fused_warm.cold and fused_warm.time_us == 101.0
    assert fused_warm.per_rank_us == [100.0, 101.0]
    assert [m.impl for m in first.measurements] == ["fused", "fused", "NCCL + cuBLAS", "NCCL + cuBLAS"]
    _, table = fm.fused_multi_report(results)
    assert table.row_count == 8


def test_assembly_takes_the_slowest_rank_and_adds_the_peer_at_8_ranks() -> None:
    cases = fm.multi_cases([4096], ["pro"])
    records = [[{"rows": 4096 * 6, "y_rel_l2": 1e-3, "fused_warm_us": 3000.0 + r, "fused_cold_us": 3100.0 + r,
                 "nccl_cublas_note": "RuntimeError: no scaled_mm"}] for r in range(8)]
    (result,) = fm.assemble_multi_results(cases, records, 8, device="H200", warmup=1, iters=2)
    times = {(m.impl, m.cold): m.time_us for m in result.measurements}
    assert times[("fused", False)] == 3007.0 and times[("fused", True)] == 3107.0
    assert times[("NCCL + cuBLAS", False)] is None and result.nccl_cublas_y_rel_l2 is None
    assert times[("peer (DeepGEMM #383, published)", True)] == 4217.0
    note = next(m.note for m in result.measurements if m.impl == "NCCL + cuBLAS")
    assert note.startswith("RuntimeError")
    e, h, i, _ = fm.MULTI_SHAPES["pro"]
    fused = next(m for m in result.measurements if m.impl == "fused")
    assert fused.tflops == pytest.approx(6.0 * 8 * 4096 * 6 * h * i / 8 / 3007.0 / 1e6)


def test_cases_and_layouts() -> None:
    assert [c.name for c in fm.multi_cases()] == [f"{s} T={t}" for s in ("flash", "pro") for t in (8, 128, 4096)]
    for bad in ({"tokens": [0]}, {"shapes": ["e256"]}, {"tokens": []}):
        with pytest.raises(ValueError):
            fm.multi_cases(**bad)
    layout = fm.multi_layout(fm.MultiCase("pro", 128), 8)
    assert (layout.num_ranks, layout.num_experts, layout.num_local_experts) == (8, 384, 48)


def test_cli_options() -> None:
    from megamoe.cli import bench_options, parse_args

    assert bench_options(parse_args(["bench", "fused_multi"])) == {"tokens": [8, 128, 4096], "warmup": 5, "iters": 20}
    assert bench_options(parse_args(["bench", "fused_multi", "--tokens", "8,128", "--iters", "9"])) == {
        "tokens": [8, 128], "warmup": 5, "iters": 9}
    assert bench_options(parse_args(["bench", "fused_multi", "--compile-only", "--ranks", "8"])) == {
        "tokens": [8, 128, 4096], "ranks": [8]}
    for argv in (["--ranks", "2"], ["--shape", "pro"], ["--tokens", "0"], ["--phases"]):
        with pytest.raises(ValueError):
            bench_options(parse_args(["bench", "fused_multi", *argv]))
