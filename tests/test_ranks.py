"""The one-process-per-rank harness (megamoe.testing.ranks) over gloo on a CPU, as `megamoe bench comm` runs it
(bench.comm.spawn_comm_ranks) with fake timings: every rank's records gathered and assembled on rank 0, and a rank
that fails reported with its traceback while the rank waiting for it is killed instead of hanging."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe.bench import comm as bench_comm  # noqa: E402
from megamoe.testing.ranks import RankContext  # noqa: E402

from test_bench_comm import H4096, fake_record  # noqa: E402


def _fake_case(case: bench_comm.CommCase, index: int, plan: bench_comm.CommPlan, ranks: RankContext) -> dict:
    import torch.distributed as dist

    dist.barrier(group=ranks.cpu_group)
    return fake_record(100 * (index + 1) + ranks.rank, 100.0 + ranks.rank, 50.0, 30.0 + index + ranks.rank)


def _failing_case(case: bench_comm.CommCase, index: int, plan: bench_comm.CommPlan, ranks: RankContext) -> dict:
    if ranks.rank == 1:
        raise RuntimeError("rank 1 broke")
    import torch.distributed as dist

    dist.barrier(group=ranks.cpu_group)  # waits for rank 1 forever: the harness must kill it
    return fake_record(1, 1.0, 1.0, 1.0)


def test_harness_gathers_on_rank_zero() -> None:
    plan = bench_comm.CommPlan(tuple(bench_comm.comm_cases([8, 128], [H4096])), warmup=2, iters=3)
    results = bench_comm.spawn_comm_ranks(2, plan, backend="gloo", case_fn=_fake_case, timeout_s=120)
    assert [r.case for r in results] == ["H4096 topk6 E256 T=8", "H4096 topk6 E256 T=128"]
    assert results[0].remote_rows == 100.5 and results[1].remote_rows == 200.5
    assert results[1].measurements[0].per_rank_us == [100.0, 101.0]
    assert results[1].measurements[2].round_trip_us == 32.0 and results[1].measurements[2].met is True
    assert results[0].device == "cpu" and results[0].iters == 3 and results[0].num_ranks == 2


def test_harness_reports_a_failed_rank() -> None:
    plan = bench_comm.CommPlan(tuple(bench_comm.comm_cases([8], [H4096])), warmup=1, iters=1)
    with pytest.raises(RuntimeError, match="rank 1 broke") as info:
        bench_comm.spawn_comm_ranks(2, plan, backend="gloo", case_fn=_failing_case, timeout_s=120, grace_s=3)
    assert "still running 3 s after a failure" in str(info.value) or "rank 0" in str(info.value)
