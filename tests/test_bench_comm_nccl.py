"""The NCCL baseline of `megamoe bench comm` (megamoe.bench.comm_nccl.NcclRoundTrip): its data movement over gloo
on the CPU, 2 ranks spawned through megamoe.testing.ranks."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe.bench import comm as bench_comm  # noqa: E402
from megamoe.bench import comm_nccl as bench_comm_nccl  # noqa: E402
from megamoe.layout import SymmLayout  # noqa: E402
from megamoe.testing.ranks import RankContext, spawn_ranks  # noqa: E402


def _gloo_round_trip(ranks: RankContext) -> tuple:
    import torch.distributed as dist

    from megamoe.testing import dispatch_combine as dcc

    rank = ranks.rank
    layout = SymmLayout.create(2, 16, 64, 6, 256, 128)
    counts = [[37, 0], [0, 64]][rank]
    mine = dcc.random_inputs(layout, counts, "uniform", seed=rank)[rank]
    baseline = bench_comm_nccl.NcclRoundTrip(mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights, 2,
                                             layout.num_local_experts, ranks.group)
    error = baseline.check()
    order, recv, in_splits, out_splits = baseline.dispatch(fixed=True)
    # the rows that arrive carry the expert ids of this rank's experts only
    expert_ids = recv[:, -4:].contiguous().view(torch.int32).flatten()
    owned = bool(((expert_ids // layout.num_local_experts) == rank).all())
    remote = bench_comm.count_remote_rows(mine.topk_idx, rank, layout.num_local_experts)
    dist.barrier()
    return error, in_splits, out_splits, owned, remote


def test_nccl_baseline_moves_the_right_rows_over_gloo() -> None:
    got = spawn_ranks(2, _gloo_round_trip, backend="gloo", what="NCCL baseline over gloo", timeout_s=120)
    for rank in range(2):
        error, in_splits, out_splits, owned, remote = got[rank]
        assert error is None, error
        assert owned
        assert sum(in_splits) == [37, 64][rank] * 6 and in_splits[1 - rank] == remote
    # what rank 0 sends rank 1 is what rank 1 receives from rank 0, and back
    assert got[0][1][1] == got[1][2][0] and got[1][1][0] == got[0][2][1]
