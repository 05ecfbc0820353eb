"""`megamoe bench fused_multi`: the fused kernel on every visible GPU (2, 4 or 8 ranks, one process each;
megamoe.testing.ranks) at the DSV4-Flash and DSV4-Pro shapes, beside the pipeline a system without fused
communication runs (NCCL all-to-all dispatch, the cuBLAS FFN per local expert on the received rows, NCCL all-to-all
combine) and, at 8 ranks, the peer's published numbers (DeepGEMM #383 on 8 H200s, which include NVLink).

Every rank draws its own tokens (uniform routing) and experts (megamoe.testing.fused_ranks); each case's y of both
implementations is checked first against the reference computed across the ranks (`fused_ranks.reference_y`).
Times: each rank times each implementation with the same queued runs (bench.timing.time_queued_us: median of
`iters` after `warmup`, GPU time between CUDA events), warm and after a 256 MB L2 flush outside each interval; the
runs are collective, so the ranks stay in step; a case's time is its slowest rank's median.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from rich.table import Table

from megamoe.bench.results import CaseResult, Measurement, fmt, results_table

# name -> (experts, hidden, intermediate, top-k) of the whole model (E / R experts per rank)
MULTI_SHAPES = {"flash": (256, 4096, 2048, 6), "pro": (384, 7168, 3072, 6)}
MULTI_TOKENS = (8, 128, 4096)
MULTI_RANKS = (2, 4, 8)
# DeepGEMM #383's SM90 MegaMoE on 8 H200s, as published (us per call, tokens per rank)
PEER_8_H200_US = {("flash", 8): 225.0, ("flash", 128): 265.0, ("flash", 4096): 1739.0,
                  ("pro", 8): 636.6, ("pro", 128): 871.6, ("pro", 4096): 4217.0}
MULTI_MAX_Y_REL_L2 = 1e-2  # as the gpu tests (tests/test_fused_gpu.py: MAX_Y_REL_L2)
MULTI_FORMULA = ("Times: the slowest rank's median of {iters} queued runs after {warmup} warm-up (GPU time between "
                 "CUDA events); cold = after a 256 MB L2 flush outside each interval. TFLOP/s = 6 x rows x H x I over "
                 "all ranks / time / ranks (per GPU); rows = valid (token, slot) pairs. Peer: DeepGEMM #383's "
                 "published 8 x H200 times (compare only with a run on H200s). NCCL + cuBLAS: each local expert that "
                 "received rows, padded to the largest one's rows.")


@dataclass(frozen=True)
class MultiCase:
    shape: str
    tokens: int  # per rank

    @property
    def name(self) -> str:
        return f"{self.shape} T={self.tokens}"


@dataclass(frozen=True)
class MultiPlan:
    cases: tuple[MultiCase, ...]
    warmup: int
    iters: int
    seed: int = 0


@dataclass(kw_only=True)
class MultiMeasurement(Measurement):
    cold: bool = False
    per_rank_us: list[float] | None = None


@dataclass(kw_only=True)
class MultiCaseResult(CaseResult[MultiMeasurement]):
    shape: str
    tokens: int
    num_ranks: int
    rows: int  # valid (token, slot) pairs over all ranks
    y_rel_l2: float  # the fused kernel's, worst rank
    nccl_cublas_y_rel_l2: float | None
    warmup: int
    iters: int
    device: str


def multi_cases(tokens: Sequence[int] = MULTI_TOKENS, shapes: Sequence[str] = tuple(MULTI_SHAPES)) -> list[MultiCase]:
    for shape in shapes:
        if shape not in MULTI_SHAPES:
            raise ValueError(f"shape must be one of {sorted(MULTI_SHAPES)}, got {shape!r}")
    if not tokens or any(not isinstance(t, int) or t < 1 for t in tokens):
        raise ValueError(f"tokens per rank must be ints >= 1, got {list(tokens)!r}")
    return [MultiCase(shape, t) for shape in shapes for t in tokens]


def multi_layout(case: MultiCase, num_ranks: int) -> Any:
    from megamoe.layout import SymmLayout

    e, h, i, k = MULTI_SHAPES[case.shape]
    return SymmLayout.create(num_ranks, e, case.tokens, k, h, i)


def precompile_fused_multi(ranks: Sequence[int] = MULTI_RANKS, tokens: Sequence[int] = MULTI_TOKENS) -> None:
    """Every variant the bench launches (no GPU): the fused kernel of each case's buffer, per rank count."""
    from megamoe.fused import compile_fused, config_for

    for num_ranks in ranks:
        for case in multi_cases(tokens):
            compile_fused(config_for(multi_layout(case, num_ranks)))


class NcclCublas:
    """The unfused pipeline across ranks: dispatch (bench.comm_nccl.NcclRoundTrip: the rows, their SF, top-k weight
    and expert id, split sizes fixed by a first eager call), the cuBLAS FFN on the received rows
    (bench.ffn.UnfusedCublas through bench.fused.RoutedCublas's expert-major gather, each row one slot of its local
    expert, the top-k weight applied inside; only the local experts that received rows, each padded to the largest
    one's rows), the combine (all-to-all back, an fp32 sum per token, one BF16 cast). Collective; the routing must
    have no -1 slots. `scaled_mm` replaces `torch._scaled_mm` (CPU tests). Build it on every rank, agree that every
    rank built one, then `run` (collective)."""

    def __init__(self, tokens: Any, natural: tuple, num_ranks: int, rank: int, group: Any, *,
                 scaled_mm: Any = None) -> None:
        from megamoe.bench.comm_nccl import NcclRoundTrip
        from megamoe.bench.fused import RoutedCublas

        self.num_local = natural[0][0].shape[0]
        self.rank = rank
        self.trip = NcclRoundTrip(tokens.x, tokens.x_sf, tokens.topk_idx, tokens.topk_weights, num_ranks,
                                  self.num_local, group)
        self.hidden, self.num_topk = tokens.x.shape[1], tokens.topk_idx.shape[1]
        x, x_sf, weight, local = self._unpack(self.trip.dispatch()[1])
        # Only the experts that received rows (a system knows its counts after the dispatch): renumbered densely
        used = torch.unique(local) if local.numel() else torch.zeros(1, dtype=torch.long, device=local.device)
        dense = torch.searchsorted(used, local)
        (w1, w1_sf), (w2, w2_sf) = natural
        subset = ((w1[used], w1_sf[used]), (w2[used], w2_sf[used]))
        self.ffn: Any = None
        failures = []
        for dtype in (torch.float32, torch.bfloat16):  # fp32 GEMM outputs where this cuBLAS build has them
            try:
                self.ffn = RoutedCublas(x, x_sf, dense[:, None], weight[:, None], subset, used.numel(),
                                        out_dtype=dtype, scaled_mm=scaled_mm)
                self.ffn.expert_rows()
                break
            except Exception as exc:
                failures.append(f"{dtype}: {type(exc).__name__}: {exc}")
        if self.ffn is None:
            raise RuntimeError("RoutedCublas failed: " + "; ".join(failures))
        # Each received row's place in the expert-major padded output (no combine on this side: a row is one slot)
        n = x.shape[0]
        valid = self.ffn.src_token < n
        self.position = torch.empty(n, dtype=torch.long, device=x.device)
        self.position[self.ffn.src_token[valid]] = torch.nonzero(valid).flatten()
        self.y32 = torch.empty(tokens.x.shape[0], self.hidden, dtype=torch.float32, device=tokens.x.device)

    def _rows(self, recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The received rows' x bytes [n, H] (a view) and x_sf float32 [n, H/128] (NcclRoundTrip's packing)."""
        h = self.hidden
        return recv[:, :h], recv[:, h:h + h // 32].contiguous().view(torch.float32)

    def _unpack(self, recv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The received rows: x e4m3 [n, H], x_sf [n, H/128], top-k weight [n], local expert [n]."""
        x, x_sf = self._rows(recv)
        meta_at = self.hidden + self.hidden // 32
        meta = recv[:, meta_at:meta_at + 8].contiguous().view(torch.int32)
        return (x.contiguous().view(torch.float8_e4m3fn), x_sf, meta[:, 0].contiguous().view(torch.float32),
                (meta[:, 1] - self.rank * self.num_local).long())

    def run(self) -> torch.Tensor:
        import torch.distributed as dist

        order, recv, in_splits, out_splits = self.trip.dispatch(fixed=True)
        n, ffn = recv.shape[0], self.ffn
        # The received rows into the FFN's inputs, gathered expert-major there (padding rows read row n: zeros)
        x, x_sf = self._rows(recv)
        ffn.x_ext[:n].copy_(x)
        ffn.x_sf_ext[:n].copy_(x_sf)
        out = ffn.expert_rows().index_select(0, self.position).to(torch.bfloat16)
        back = torch.empty(sum(in_splits), self.hidden, dtype=torch.bfloat16, device=out.device)
        dist.all_to_all_single(back, out, in_splits, out_splits, group=self.trip.group)
        self.y32.zero_()
        self.y32.index_add_(0, order // self.num_topk, back.float())
        return self.y32.to(torch.bfloat16)


def _case_on_rank(case: MultiCase, index: int, plan: MultiPlan, ranks: Any) -> dict:
    """One case on one rank: both implementations checked against the reference, then timed warm and cold, each
    in a phase of its own. Returns this rank's record."""
    import megamoe
    from megamoe import reference, weights
    from megamoe.bench.timing import l2_flusher, time_queued_us
    from megamoe.testing import fused_ranks
    from megamoe.testing.dispatch_combine import load_inputs

    rank, num_ranks = ranks.rank, ranks.num_ranks
    e, h, i, k = MULTI_SHAPES[case.shape]
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()  # the symmetric buffer is allocated outside torch's cache: leave it the room
    buf = megamoe.get_symm_buffer(ranks.group, e, case.tokens, k, h, i)
    natural = fused_ranks.draw_local_weights(plan.seed, rank, e // num_ranks, h, i, device)
    l1, l2 = weights.transform_weights(*natural)
    tokens = fused_ranks.draw_tokens(plan.seed + 1 + index, rank, case.tokens, e, k, h, "uniform", device)
    load_inputs(buf, tokens)
    y = torch.full((case.tokens, h), float("nan"), dtype=torch.bfloat16, device=device)
    megamoe.fused(y, l1, l2, buf, case.tokens)
    torch.cuda.synchronize()
    y_ref, _ = fused_ranks.reference_y(ranks.group, rank, num_ranks, tokens, *natural)
    err = reference.rel_l2(y.float(), y_ref.float())
    record: dict[str, Any] = {"rows": int((tokens.topk_idx >= 0).sum()), "y_rel_l2": err}
    if not ranks.all_agree(err <= MULTI_MAX_Y_REL_L2):  # a wrong y is not timed (on any rank)
        raise RuntimeError(f"rank {rank} {case.name}: fused y rel-L2 {err:.2e} (limit {MULTI_MAX_Y_REL_L2}) here or "
                           f"on another rank")
    # The baseline: built on every rank first (a rank whose build failed must not enter its collectives alone)
    try:
        baseline: NcclCublas | None = NcclCublas(tokens, natural, num_ranks, rank, ranks.group)
    except Exception as exc:
        baseline, record["nccl_cublas_note"] = None, f"{type(exc).__name__}: {str(exc)[:100]}"
    if ranks.all_agree(baseline is not None):
        assert baseline is not None
        base_err = reference.rel_l2(baseline.run().float(), y_ref.float())
        record["nccl_cublas_y_rel_l2"] = base_err
        if not ranks.all_agree(base_err <= MULTI_MAX_Y_REL_L2):
            baseline, record["nccl_cublas_note"] = None, f"y rel-L2 {base_err:.2e} here or on another rank: not timed"
    else:
        baseline = None
        record.setdefault("nccl_cublas_note", "failed to build on another rank")
    flush = l2_flusher(device)
    runners: dict[str, Callable[[], Any]] = {
        "fused": lambda: megamoe.fused(y, l1, l2, buf, case.tokens, check_inputs=False)}
    if baseline is not None:
        runners["nccl_cublas"] = baseline.run
    for key, fn in runners.items():
        for cold in (False, True):
            ranks.phase_barrier()
            stats = time_queued_us(fn, warmup=plan.warmup, iters=plan.iters, before=flush if cold else None)
            record[f"{key}_{'cold' if cold else 'warm'}_us"] = stats["median_us"]
            if stats["host_bound"]:
                record[f"{key}_note"] = "host-bound: the times include launch overhead"
    ranks.phase_barrier()
    del baseline, runners
    buf.destroy()
    torch.cuda.empty_cache()
    return record


def assemble_multi_results(cases: Sequence[MultiCase], records: Sequence[Sequence[dict]], num_ranks: int, *,
                           device: str, warmup: int, iters: int) -> list[MultiCaseResult]:
    """records[rank][case] -> one result per case: each implementation's slowest rank, the worst y error."""
    results = []
    for index, case in enumerate(cases):
        per_rank = [records[r][index] for r in range(num_ranks)]
        e, h, i, _ = MULTI_SHAPES[case.shape]
        rows = sum(r["rows"] for r in per_rank)
        base_errors = [r.get("nccl_cublas_y_rel_l2") for r in per_rank]
        result = MultiCaseResult(case=case.name, shape=case.shape, tokens=case.tokens, num_ranks=num_ranks,
                                 rows=rows, y_rel_l2=max(r["y_rel_l2"] for r in per_rank),
                                 nccl_cublas_y_rel_l2=None if None in base_errors else max(base_errors),
                                 warmup=warmup, iters=iters, device=device)
        flops = 6.0 * rows * h * i / num_ranks  # per GPU
        for impl, key in (("fused", "fused"), ("NCCL + cuBLAS", "nccl_cublas")):
            for cold in (False, True):
                field_name = f"{key}_{'cold' if cold else 'warm'}_us"
                times = [r.get(field_name) for r in per_rank]
                slowest = None if None in times else max(times)
                note = next((r[f"{key}_note"] for r in per_rank if f"{key}_note" in r), "")
                result.record(MultiMeasurement(impl=impl, time_us=slowest, cold=cold, note=note,
                                               per_rank_us=None if slowest is None else list(times),
                                               **Measurement.rates(slowest, flops, 3.0 * h * i * e / num_ranks)))
        peer = PEER_8_H200_US.get((case.shape, case.tokens)) if num_ranks == 8 else None
        if peer is not None:
            result.record(MultiMeasurement(impl="peer (DeepGEMM #383, published)", time_us=peer, cold=True,
                                           **Measurement.rates(peer, flops, 3.0 * h * i * e / num_ranks)))
        results.append(result)
    return results


def _multi_rank(ranks: Any, plan: MultiPlan, case_fn: Callable[..., dict] | None = None,
                device_name: bool = True) -> list[MultiCaseResult] | None:
    """One rank: every case (case_fn: _case_on_rank), the records gathered on rank 0, which assembles them."""
    from megamoe.testing.ranks import gather_case_records

    fn = case_fn or _case_on_rank
    gathered = gather_case_records(ranks, plan.cases, lambda case, index: fn(case, index, plan, ranks),
                                   "megamoe bench fused_multi")
    if gathered is None:
        return None
    return assemble_multi_results(plan.cases, gathered, ranks.num_ranks,
                                  device=torch.cuda.get_device_name() if device_name else "cpu",
                                  warmup=plan.warmup, iters=plan.iters)


def spawn_multi_ranks(num_ranks: int, plan: MultiPlan, *, backend: str = "nccl",
                      case_fn: Callable[..., dict] | None = None, timeout_s: float = 540.0) -> list[MultiCaseResult]:
    from megamoe.testing.ranks import RankFailure, spawn_ranks

    results = spawn_ranks(num_ranks, _multi_rank, plan, case_fn, backend == "nccl", backend=backend,
                          what="megamoe bench fused_multi", timeout_s=timeout_s)
    if results[0] is None:
        raise RankFailure("megamoe bench fused_multi failed: rank 0 returned no results")
    return results[0]


def bench_fused_multi(tokens: Sequence[int] = MULTI_TOKENS, shapes: Sequence[str] = tuple(MULTI_SHAPES), *,
                      warmup: int = 5, iters: int = 20, seed: int = 0,
                      timeout_s: float = 540.0) -> list[MultiCaseResult]:
    """Spawn one process per visible GPU (2, 4 or 8); rank 0 gathers every rank's timings and returns the results."""
    num_ranks = torch.cuda.device_count()
    if num_ranks not in MULTI_RANKS:
        raise SystemExit(f"megamoe bench fused_multi needs 2, 4 or 8 GPUs, found {num_ranks}")
    plan = MultiPlan(tuple(multi_cases(tokens, shapes)), warmup, iters, seed)
    precompile_fused_multi([num_ranks], tokens)  # once here (cache hits when warmed), not in every rank at once
    return spawn_multi_ranks(num_ranks, plan, timeout_s=timeout_s)


def fused_multi_report(results: list[MultiCaseResult]) -> tuple[dict[str, Any], Table]:
    iters = results[0].iters if results else 0
    warmup = results[0].warmup if results else 0
    ranks = results[0].num_ranks if results else 0
    device = results[0].device if results else "no GPU"
    caption = MULTI_FORMULA.format(iters=iters, warmup=warmup)
    table = results_table(f"megamoe bench fused_multi: {ranks} ranks ({device}), tokens per rank",
                          ["case", "rows", "y rel-L2 fused / NCCL + cuBLAS", "implementation", "L2", "us",
                           "x fused", "TFLOP/s per GPU", "note"], left=["case", "implementation", "note"],
                          caption=caption)
    for r in results:
        fused = {m.cold: m.time_us for m in r.measurements if m.impl == "fused"}
        info = [str(r.rows), f"{r.y_rel_l2:.2e} / {fmt(r.nccl_cublas_y_rel_l2, '.2e')}"]
        for j, m in enumerate(r.measurements):
            ratio = None if m.time_us is None or not fused.get(m.cold) else m.time_us / fused[m.cold]
            table.add_row(r.case if j == 0 else "", *(info if j == 0 else ["", ""]), m.impl,
                          "cold" if m.cold else "warm", fmt(m.time_us, ".1f"), fmt(ratio, ".2f"),
                          fmt(m.tflops, ".0f"), m.note)
        table.add_section()
    return {"num_ranks": ranks, "formula": caption}, table
