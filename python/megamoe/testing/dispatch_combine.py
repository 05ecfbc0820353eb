"""Test and benchmark support of the dispatch and combine unit kernel (megamoe.kernels.dispatch_combine): every
rank's inputs, the exact expectations computed on the host from the inputs alone, views of the results in the
symmetric buffer, exact comparisons, the workspace's state after a number of calls, and one checked call. The tests
(tests/test_dispatch_combine*.py) and `megamoe bench comm` (its inputs; the timed round trip is
megamoe.bench.comm.bench_round_trip) share them."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from megamoe import scheduler
from megamoe.kernels.dispatch_combine import run
from megamoe.layout import SymmLayout

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer

ROUTINGS = ("uniform", "one_expert", "other_rank", "masked")


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs: x fp8 [T, H], x_sf float32 [T, H/128], topk_idx int64 [T, topk] (global expert ids, -1
    unused), topk_weights float32 [T, topk] (random_inputs: CPU tensors; testing.fused_ranks: on the rank's GPU)."""

    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def random_inputs(layout: SymmLayout, num_tokens: list[int], routing: str, seed: int) -> list[RankInputs]:
    """Every rank's inputs, identical in every process for one seed. Routings: uniform (distinct random experts),
    one_expert (every token also goes to expert E - 1), other_rank (only experts of rank r + 1), masked (half the
    slots -1, the first tokens with no valid slot)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen = torch.Generator().manual_seed(seed)
    lay, out = layout, []
    for rank, t in enumerate(num_tokens):
        values = torch.randn(t, lay.hidden, generator=gen) * torch.exp2(torch.randint(-6, 6, (t, 1), generator=gen))
        x = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        x_sf = torch.exp(torch.randn(t, lay.hidden // 128, generator=gen))
        experts = torch.rand(t, lay.num_experts, generator=gen).argsort(dim=1)
        if routing == "other_rank":
            dst = (rank + 1) % lay.num_ranks
            local = torch.rand(t, lay.num_local_experts, generator=gen).argsort(dim=1) + dst * lay.num_local_experts
            experts = torch.cat([local, torch.full((t, lay.num_topk), -1)], dim=1)
        idx = experts[:, : lay.num_topk].contiguous()
        if routing == "one_expert":
            hot = lay.num_experts - 1
            missing = ~(idx == hot).any(dim=1)
            slot = torch.randint(0, lay.num_topk, (t,), generator=gen)
            idx[missing, slot[missing]] = hot
        if routing == "masked":
            idx = torch.where(torch.rand(t, lay.num_topk, generator=gen) < 0.5, -1, idx)
            idx[: min(t, 3)] = -1
        weights = torch.rand(t, lay.num_topk, generator=gen) + 0.1
        out.append(RankInputs(x, x_sf, idx.to(torch.int64), weights / weights.sum(dim=1, keepdim=True)))
    return out


def load_inputs(buf: SymmBuffer, inputs: RankInputs) -> int:
    """Copy one rank's inputs into the first rows of its buffer; returns T."""
    t = inputs.x.shape[0]
    for name in ("x", "x_sf", "topk_idx", "topk_weights"):
        getattr(buf, name)[:t].copy_(getattr(inputs, name), non_blocking=True)
    return t


def expected_y(x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """y of the unit kernel for one rank's inputs, exactly: out[t, j] = bf16((fp32(x[t]) * sf) * w[t, j]) for each
    valid slot, y[t] = bf16(sum over valid j in slot order of fp32(out[t, j])), zeros without a valid slot."""
    xs = x.float() * x_sf.repeat_interleave(128, dim=1)
    acc = torch.zeros_like(xs)
    for j in range(topk_idx.shape[1]):
        out = (xs * topk_weights[:, j : j + 1]).to(torch.bfloat16).float()
        acc = torch.where((topk_idx[:, j] >= 0)[:, None], acc + out, acc)
    return acc.to(torch.bfloat16)


@dataclass(frozen=True)
class ExpertRows:
    """The rows one local expert received, sorted by (source rank, token, slot) (the reference's order)."""

    src: torch.Tensor          # int64 [n, 3]: (source rank, token, slot)
    x: torch.Tensor            # uint8 [n, H]: the FP8 codes
    x_sf: torch.Tensor         # float32 [n, H/128]
    topk_weight: torch.Tensor  # float32 [n]


def expected_dispatch(inputs: list[RankInputs], layout: SymmLayout, rank: int) -> list[ExpertRows]:
    """What each local expert of `rank` must receive (the reference's dispatch, from the inputs alone)."""
    out = []
    for e in range(rank * layout.num_local_experts, (rank + 1) * layout.num_local_experts):
        picks = [(s, (inp.topk_idx == e).nonzero()) for s, inp in enumerate(inputs)]  # (token, slot) row-major
        src = torch.cat([torch.cat([torch.full((p.shape[0], 1), s), p], dim=1) for s, p in picks]).to(torch.int64)
        out.append(ExpertRows(
            src, torch.cat([inputs[s].x.view(torch.uint8)[p[:, 0]] for s, p in picks]),
            torch.cat([inputs[s].x_sf[p[:, 0]] for s, p in picks]),
            torch.cat([inputs[s].topk_weights[p[:, 0], p[:, 1]] for s, p in picks])))
    return out


def dispatched_rows(buf: SymmBuffer, counts: list[int], block_m: int) -> list[ExpertRows]:
    """The pool read back per local expert (rows at scheduler.pool_offsets, sorted by their metadata), given the
    rows each expert received (e.g. recv_stats of one call)."""
    acts, acts_sf = buf.view("l1_acts").view(torch.uint8), buf.view("l1_acts_sf")
    weights, meta = buf.view("l1_topk_weights"), buf.view("pool_src_metadata").view(torch.int32)
    out = []
    for count, first in zip(counts, scheduler.pool_offsets(counts, block_m)):
        rows = torch.arange(first, first + count, device=buf.device)
        src = meta[rows, :3].to(torch.int64)
        rows = rows[torch.argsort((src[:, 0] * buf.num_max_tokens_per_rank + src[:, 1]) * buf.num_topk + src[:, 2])]
        out.append(ExpertRows(meta[rows, :3].to(torch.int64), acts[rows], acts_sf[:, rows].t(), weights[rows]))
    return out


def compare_dispatch(got: list[ExpertRows], expected: list[ExpertRows]) -> list[str]:
    """Exact comparison per local expert; returns the mismatches as readable strings."""
    errors = []
    for e, (g, x) in enumerate(zip(got, expected)):
        for field in ("src", "x", "x_sf", "topk_weight"):
            a, b = getattr(g, field).cpu(), getattr(x, field).cpu()
            if a.shape != b.shape or not torch.equal(a, b):
                errors.append(f"local expert {e}: {field} differs (got {tuple(a.shape)}, expected {tuple(b.shape)})")
    return errors


def call_errors(buf: SymmBuffer, inputs: list[RankInputs], y: torch.Tensor, recv_stats: torch.Tensor,
                block_m: int) -> list[str]:
    """Everything one call must have produced on this rank (after a poison and a zeroed recv_stats): the pool
    rows exactly, nothing written outside them, the per-expert counts and y, bit for bit."""
    expected = expected_dispatch(inputs, buf.layout, buf.rank)
    counts = [rows.src.shape[0] for rows in expected]
    errors = [] if recv_stats.tolist() == counts else [f"recv counts {recv_stats.tolist()}, expected {counts}"]
    errors += compare_dispatch(dispatched_rows(buf, counts, block_m), expected)
    written = buf.view("pool_src_metadata").view(torch.int32)[:, 0] != -1
    valid = torch.zeros_like(written)
    for count, first in zip(counts, scheduler.pool_offsets(counts, block_m)):
        valid[first : first + count] = True
    if not torch.equal(written, valid):
        errors.append(f"pool metadata written in {int(written.sum())} rows, {int(valid.sum())} received")
    mine = inputs[buf.rank]
    y_expected = expected_y(mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights)
    differ = int((y.view(torch.int16).cpu() != y_expected.view(torch.int16)).sum())
    if differ:
        errors.append(f"y: {differ} of {y.numel()} BF16 values differ")
    return errors


def poison(buf: SymmBuffer, y: torch.Tensor | None = None) -> None:
    """Fill the pool regions (and y) with garbage, so that rows the kernel fails to write are caught."""
    buf.view("l1_acts").view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    buf.view("l1_acts_sf").fill_(float("nan"))
    buf.view("l1_topk_weights").fill_(float("nan"))
    buf.view("pool_src_metadata").view(torch.int32).fill_(-1)
    if y is not None:
        y.fill_(float("nan"))


def workspace_errors(buf: SymmBuffer, num_calls: int) -> list[str]:
    """The state the workspace must be in after `num_calls` calls on a fresh buffer: counters zero, NVLink barrier
    counter 2 calls, each phase signal num_ranks after an odd number of calls and 0 after an even one."""
    errors = [f"{name} not zero after the call" for name in ("expert_send_count", "expert_recv_count",
                                                              "l1_arrival_count", "l1_done_count",
                                                              "combine_arrival_count")
              if bool((buf.view(name).view(torch.int32) != 0).any())]
    header = buf.view("workspace_header").view(torch.int32).cpu().tolist()
    signal = buf.num_ranks if num_calls % 2 else 0
    if header[4] != 2 * num_calls or header[5:7] != [signal, signal] or header[0] & 0x7FFFFFFF:
        errors.append(f"workspace header {header[:7]} after {num_calls} calls (expected grid counter low bits 0, "
                      f"nvl counter {2 * num_calls}, signals {signal})")
    return errors


def checked_call(buf: SymmBuffer, inputs: list, block_m: int, bulk: bool = True,
                 knobs: Mapping[str, Any] | None = None) -> list[str]:
    """Load this rank's inputs, poison, run one call, check it exactly (recv_stats zeroed: this call's counts).
    Returns the mismatches found (empty when the call is right)."""
    num_tokens = load_inputs(buf, inputs[buf.rank])
    y = torch.empty(num_tokens, buf.hidden, dtype=torch.bfloat16, device=buf.device)
    stats = torch.zeros(buf.layout.num_local_experts, dtype=torch.int32, device=buf.device)
    poison(buf, y)
    run(buf, num_tokens, y, block_m=block_m, recv_stats=stats, bulk_pull=bulk, knobs=knobs)
    torch.cuda.synchronize()
    return call_errors(buf, inputs, y, stats, block_m)


def queued_calls(buf: SymmBuffer, calls: list[tuple[list[RankInputs], int]], recv_stats: torch.Tensor,
                 ) -> list[torch.Tensor]:
    """Run (every rank's inputs, BLOCK_M) calls back to back with no host synchronization in between: this rank's
    inputs are staged on the device first, each y is NaN before its call; recv_stats accumulates over the calls.
    Returns the y of each call (the caller synchronizes)."""
    staged = [RankInputs(*(getattr(inputs[buf.rank], f.name).to(buf.device) for f in fields(RankInputs)))
              for inputs, _ in calls]
    ys = []
    for rank_inputs, (_, block_m) in zip(staged, calls):
        t = load_inputs(buf, rank_inputs)
        y = torch.full((t, buf.hidden), float("nan"), dtype=torch.bfloat16, device=buf.device)
        run(buf, t, y, block_m=block_m, recv_stats=recv_stats, check_inputs=False)
        ys.append(y)
    return ys
