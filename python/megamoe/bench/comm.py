"""`megamoe bench comm`: the dispatch -> trivial expert -> combine unit kernel (megamoe.kernels.dispatch_combine)
against an NCCL all_to_all_single round trip (megamoe.bench.comm_nccl), one process per GPU (spawned through
megamoe.testing.ranks; every visible GPU is a rank). `megamoe bench comm --compile-only` fills the JIT cache with
every variant it launches (no GPU needed). Timers: megamoe.bench.timing; records and tables: megamoe.bench.results.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from megamoe.bench.comm_nccl import NcclRoundTrip
from megamoe.bench.results import CaseResult, first_line, fmt, fmt_met, results_table
from megamoe.bench.timing import graphed, time_queued_us, time_stages_us
from megamoe.testing.ranks import RankContext, RankFailure, spawn_ranks

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer

# NOTES: the NCCL baseline and our kernel never run at the same time: each is a phase of its own, between
# torch.cuda.synchronize() and a CPU (gloo) barrier on every rank. Our persistent cooperative kernel holds every SM
# while it waits for its peers; an NCCL kernel queued behind it on one GPU while a peer waits for that NCCL kernel
# would never finish.
NVLINK_COPY_GBPS = 360.0  # measured NVLink copy between two H200s, per direction (README "Benchmarks", issue)
COMM_BANDWIDTH_TARGET_GBPS = 290.0  # 80% of the copy
COMM_TOKENS = (8, 128, 4096)  # tokens per rank
COMM_LATENCY_TOKENS = 128  # the round-trip latency target applies here
COMM_BANDWIDTH_TOKENS = 4096  # the bandwidth target applies here
COMM_FORMULA = (
    "rows = the mean over ranks of the (token, slot) pairs whose expert lives on another rank; dispatch remote "
    "bytes = rows x (H FP8 + H/128 x 4 B SF + 4 B weight), combine remote bytes = rows x 2H (BF16), per direction; "
    "GB/s per direction = (dispatch remote bytes + combine remote bytes) / round trip. Round trip: the slowest "
    "rank's median over {iters} iterations after {warmup} warm-up, CUDA events, {ranks} ranks (one process per "
    "GPU). NCCL rows carry 4 B more (the expert id), not counted."
)


@dataclass(frozen=True)
class CommShape:
    name: str
    hidden: int
    num_topk: int
    num_experts: int
    intermediate: int  # sizes the buffer's L2 regions only (the unit kernel has no GEMM)
    latency_target_us: float  # round trip at COMM_LATENCY_TOKENS tokens per rank


COMM_SHAPES = (
    CommShape("H4096 topk6 E256", 4096, 6, 256, 2048, 40.0),
    CommShape("H7168 topk8 E384", 7168, 8, 384, 2048, 60.0),
)


@dataclass(frozen=True)
class CommTarget:
    max_round_trip_us: float | None = None
    min_gbps: float | None = None

    def describe(self) -> str:
        parts = ([f"< {self.max_round_trip_us:g} us"] if self.max_round_trip_us is not None else []) + \
                ([f">= {self.min_gbps:g} GB/s"] if self.min_gbps is not None else [])
        return ", ".join(parts) or "-"

    def met(self, round_trip_us: float | None, gbps: float | None) -> bool | None:
        if round_trip_us is None:
            return None
        ok = True
        if self.max_round_trip_us is not None:
            ok &= round_trip_us < self.max_round_trip_us
        if self.min_gbps is not None:
            ok &= gbps is not None and gbps >= self.min_gbps
        return ok


@dataclass(frozen=True)
class CommCase:
    shape: CommShape
    tokens: int  # per rank; also the buffer's num_max_tokens_per_rank

    @property
    def name(self) -> str:
        return f"{self.shape.name} T={self.tokens}"

    @property
    def target(self) -> CommTarget | None:
        if self.tokens == COMM_LATENCY_TOKENS:
            return CommTarget(max_round_trip_us=self.shape.latency_target_us)
        if self.tokens == COMM_BANDWIDTH_TOKENS:
            return CommTarget(min_gbps=COMM_BANDWIDTH_TARGET_GBPS)
        return None

    def layout(self, num_ranks: int) -> Any:
        from megamoe.layout import SymmLayout

        s = self.shape
        return SymmLayout.create(num_ranks, s.num_experts, self.tokens, s.num_topk, s.hidden, s.intermediate)


def comm_cases(tokens: Sequence[int] = COMM_TOKENS, shapes: Sequence[CommShape] = COMM_SHAPES) -> list[CommCase]:
    return [CommCase(shape, t) for shape in shapes for t in tokens]


def check_comm_options(tokens: Sequence[int], warmup: int, iters: int) -> None:
    if not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in tokens):
        raise ValueError(f"tokens must be positive integers, got {list(tokens)}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"tokens must be distinct, got {list(tokens)}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")


def comm_num_ranks(device_count: int, shapes: Sequence[CommShape] = COMM_SHAPES) -> int:
    """The rank count of `megamoe bench comm`: every visible GPU, at least 2, at most kMaxRanks, dividing E."""
    from megamoe.layout import MAX_RANKS

    if device_count < 2:
        raise SystemExit(f"megamoe bench comm needs at least 2 GPUs (one rank per GPU over NVLink), got "
                         f"{device_count}; run it where 2 or more GPUs are visible (CUDA_VISIBLE_DEVICES)")
    if device_count > MAX_RANKS:
        raise SystemExit(f"megamoe bench comm supports at most {MAX_RANKS} ranks (one NVLink domain), found "
                         f"{device_count} GPUs; set CUDA_VISIBLE_DEVICES to {MAX_RANKS} or fewer")
    bad = [s.name for s in shapes if s.num_experts % device_count]
    if bad:
        raise SystemExit(f"megamoe bench comm: {device_count} GPUs do not divide the experts of {bad}; use 2, 4 or "
                         f"8 GPUs (CUDA_VISIBLE_DEVICES)")
    return device_count


def comm_block_m(case: CommCase, num_ranks: int) -> int:
    """BLOCK_M of the launch: the buffer's own (heuristics.select_config, as SymmBuffer.config())."""
    from megamoe import heuristics

    s = case.shape
    return heuristics.select_config(num_ranks, s.num_experts, case.tokens, s.num_topk, s.hidden,
                                    s.intermediate).block_m


# The unit-kernel variants timed side by side, in table order: (record key, knob preset name, table label).
# Presets are dispatch_combine's: "legacy" = LEGACY_KNOBS (the first version), "default" = the config's field
# defaults (the predicted fastest; the targets are judged on it), "fused_pull" = FUSED_PULL_KNOBS (2 pulling warps
# per CTA with 4 rows in flight, as the fused kernel will have).
COMM_VARIANTS = (
    ("ours_legacy", "legacy", "megamoe unit kernel, previous config (legacy knobs)"),
    ("ours", "default", "megamoe unit kernel (dispatch + expert + combine)"),
    ("ours_fused_pull", "fused_pull", "megamoe unit kernel, 2 pull warps x 4 rows (fused kernel's pull)"),
)


def comm_variant_knobs(preset: str) -> dict[str, Any]:
    from megamoe.kernels import dispatch_combine as dc

    return {"legacy": dc.LEGACY_KNOBS, "default": {}, "fused_pull": dc.FUSED_PULL_KNOBS}[preset]


def comm_kernel_configs(num_ranks: int, tokens: Sequence[int] = COMM_TOKENS,
                        shapes: Sequence[CommShape] = COMM_SHAPES) -> list[tuple[CommCase, Any]]:
    """(case, DispatchCombineConfig) of every unit-kernel variant `megamoe bench comm` launches on num_ranks
    (every case x every COMM_VARIANTS knob preset)."""
    from megamoe.kernels import dispatch_combine as dc

    return [(case, dc.DispatchCombineConfig(case.layout(num_ranks), comm_block_m(case, num_ranks),
                                            **comm_variant_knobs(preset)))
            for case in comm_cases(tokens, shapes) for _, preset, _ in COMM_VARIANTS]


def precompile_comm(ranks: Sequence[int] = (2, 4, 8), tokens: Sequence[int] = COMM_TOKENS,
                    shapes: Sequence[CommShape] = COMM_SHAPES, console: Console | None = None) -> list[Any]:
    """Compile every variant the comm bench launches on each rank count into the JIT cache (no GPU needed)."""
    from megamoe.jit import checks
    from megamoe.kernels import dispatch_combine as dc

    table = Table(title="megamoe bench comm: unit kernel variants")
    for col in ("ranks", "case", "kernel", "cache", "compile checks"):
        table.add_column(col, overflow="fold")
    compiled = []
    for num_ranks in ranks:
        for case, config in comm_kernel_configs(comm_num_ranks(num_ranks, shapes), tokens, shapes):
            result = dc.compile_kernel(config)
            compiled.append(result)
            found = checks.violations(result)
            table.add_row(str(num_ranks), case.name, config.name,
                          "hit" if result.cache_hit else f"compiled {result.compile_seconds:.1f} s",
                          "[red]" + "; ".join(found) + "[/]" if found else "pass")
    if console is not None:
        console.print(table)
    return compiled


# Byte accounting ------------------------------------------------------------------------------------------------
def dispatch_row_bytes(hidden: int) -> int:
    """Bytes dispatch moves per remote (token, slot): the FP8 row, its SF (one float per 128), the top-k weight."""
    return hidden + hidden // 128 * 4 + 4


def combine_row_bytes(hidden: int) -> int:
    """Bytes combine moves per remote (token, slot): the expert's BF16 row."""
    return 2 * hidden


def count_remote_rows(topk_idx: torch.Tensor, rank: int, num_local_experts: int) -> int:
    """This rank's (token, slot) pairs whose expert lives on another rank (-1 slots are not sent)."""
    valid = topk_idx >= 0
    return int((valid & (topk_idx.div(num_local_experts, rounding_mode="floor") != rank)).sum())


def expected_remote_rows(tokens: int, num_topk: int, num_ranks: int) -> float:
    """Uniform routing: a slot's expert is remote with probability (R - 1) / R."""
    return tokens * num_topk * (num_ranks - 1) / num_ranks


def remote_bytes_per_direction(total_remote_rows: int | float, num_ranks: int, hidden: int) -> tuple[float, float]:
    """(dispatch, combine) remote bytes per rank and direction, from the remote rows summed over all ranks. Every
    remote row leaves one rank and enters another, so the mean over ranks is the same for what a rank sends and
    what it receives: dispatch pulls it in, combine pushes it back."""
    rows = total_remote_rows / num_ranks
    return rows * dispatch_row_bytes(hidden), rows * combine_row_bytes(hidden)


def gbps_per_direction(dispatch_bytes: float, combine_bytes: float, round_trip_us: float | None) -> float | None:
    if round_trip_us is None or round_trip_us <= 0:
        return None
    return (dispatch_bytes + combine_bytes) / round_trip_us / 1e3


# Results --------------------------------------------------------------------------------------------------------
@dataclass
class CommMeasurement:
    """One implementation's row of a comm case: the slowest rank's round trip and the GB/s per direction it gives
    (not results.Measurement: no FLOPs or weight bytes here, and the JSON keys stay round_trip_us / gbps)."""

    impl: str
    round_trip_us: float | None  # the slowest rank's median
    gbps: float | None
    per_rank_us: list[float | None] = field(default_factory=list)
    dispatch_us: float | None = None
    combine_us: float | None = None
    target: str = "-"
    met: bool | None = None
    note: str = ""


@dataclass(kw_only=True)
class CommCaseResult(CaseResult[CommMeasurement]):
    num_ranks: int
    tokens_per_rank: int
    hidden: int
    num_topk: int
    num_experts: int
    remote_rows: float  # per rank (mean)
    dispatch_bytes: float  # remote, per rank and direction
    combine_bytes: float
    target: CommTarget | None = None
    device: str = ""
    warmup: int = 0
    iters: int = 0

    @property
    def remote_bytes(self) -> float:
        return self.dispatch_bytes + self.combine_bytes

    def add(self, impl: str, per_rank_us: Sequence[float | None], note: str = "", *,
            dispatch_us: float | None = None, combine_us: float | None = None,
            apply_target: bool = False) -> CommMeasurement:
        times = list(per_rank_us)
        round_trip = None if not times or any(t is None for t in times) else max(times)
        gbps = gbps_per_direction(self.dispatch_bytes, self.combine_bytes, round_trip)
        target = self.target if apply_target else None
        return self.record(CommMeasurement(impl, round_trip, gbps, times, dispatch_us, combine_us,
                                           target.describe() if target else "-",
                                           target.met(round_trip, gbps) if target else None, note))


def _max(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) or not values else max(values)  # type: ignore[type-var]


def assemble_comm_results(cases: Sequence[CommCase], records: Sequence[Sequence[dict]], num_ranks: int, *,
                          device: str = "", warmup: int = 0, iters: int = 0) -> list[CommCaseResult]:
    """The table's rows from every rank's records (records[rank][case index], as _comm_case_on_rank returns)."""
    if len(records) != num_ranks or any(len(r) != len(cases) for r in records):
        raise ValueError(f"expected {num_ranks} ranks x {len(cases)} cases of records, got "
                         f"{[len(r) for r in records]}")
    results = []
    for i, case in enumerate(cases):
        recs = [records[rank][i] for rank in range(num_ranks)]
        total_rows = sum(int(r["remote_rows"]) for r in recs)
        dispatch_bytes, combine_bytes = remote_bytes_per_direction(total_rows, num_ranks, case.shape.hidden)
        result = CommCaseResult(case=case.name, num_ranks=num_ranks, tokens_per_rank=case.tokens,
                                hidden=case.shape.hidden, num_topk=case.shape.num_topk,
                                num_experts=case.shape.num_experts, remote_rows=total_rows / num_ranks,
                                dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, target=case.target,
                                device=device, warmup=warmup, iters=iters)
        eager = [r["nccl_eager"] for r in recs]
        d, c = _max([e["dispatch_us"] for e in eager]), _max([e["combine_us"] for e in eager])
        result.add("NCCL all_to_all_single, eager", [e["round_trip_us"] for e in eager],
                   "split sizes exchanged + host sync; " + ("" if d is None or c is None else
                                                           f"dispatch {d:.1f} / combine {c:.1f} us"),
                   dispatch_us=d, combine_us=c)
        graphed_runs = [r["nccl_graphed"] for r in recs]
        if all(g["graphed"] for g in graphed_runs):
            impl, note = "NCCL all_to_all_single, CUDA graph", "splits fixed at capture, count exchange kept"
        else:
            reason = next((g["note"] for g in graphed_runs if g["note"]), "")
            impl, note = "NCCL all_to_all_single, fixed splits", f"eager: graph capture failed ({reason})"
        if any(g.get("host_bound") for g in graphed_runs):
            note += "; host-bound"
        result.add(impl, [g["median_us"] for g in graphed_runs], note)
        for key, _, label in COMM_VARIANTS:  # the variants every rank timed (records without a key: not run)
            if not all(key in r for r in recs):
                continue
            ours = [r[key] for r in recs]
            note = (f"BLOCK_M {int(ours[0]['block_m'])}, mean {max(o['us_per_call'] for o in ours):.1f} us, "
                    f"host {max(o['host_us_per_call'] for o in ours):.0f} us/launch")
            if any(o.get("host_bound") for o in ours):
                note += "; host-bound (sleep too short)"
            result.add(label, [o["median_us"] for o in ours], note, apply_target=True)
        results.append(result)
    return results


def comm_formula(results: Sequence[CommCaseResult]) -> str:
    first = results[0] if results else None
    return COMM_FORMULA.format(iters=first.iters if first else 0, warmup=first.warmup if first else 0,
                               ranks=first.num_ranks if first else 0)


def comm_results_table(title: str, results: list[CommCaseResult]) -> Table:
    table = results_table(title, ("case", "implementation", "round trip (us)", "remote MB per direction",
                                  "GB/s per direction", f"% of {NVLINK_COPY_GBPS:g} GB/s", "target", "met?", "note"),
                          left=("case", "implementation", "target", "note"), caption=comm_formula(results))
    for result in results:
        remote_mb = format(result.remote_bytes / 1e6, ".2f")
        result.add_rows(table, lambda m, remote_mb=remote_mb: [
            m.impl, fmt(m.round_trip_us, ".1f"), remote_mb, fmt(m.gbps, ".0f"),
            fmt(None if m.gbps is None else 100 * m.gbps / NVLINK_COPY_GBPS, ".0f"), m.target, fmt_met(m.met),
            m.note])
    return table


def comm_report(results: list[CommCaseResult]) -> tuple[dict[str, Any], Table]:
    """The JSON's fields besides the results, and the table (megamoe.bench.main)."""
    first = results[0]
    device = f"{first.num_ranks} x {first.device}"
    return ({"device": device, "num_ranks": first.num_ranks, "nvlink_copy_gbps": NVLINK_COPY_GBPS,
             "formula": comm_formula(results)}, comm_results_table(f"megamoe bench comm on {device}", results))


# The unit kernel's round trip ------------------------------------------------------------------------------------
def bench_round_trip(buf: SymmBuffer, num_tokens: int, *, block_m: int | None = None, bulk_pull: bool = True,
                     knobs: Mapping[str, Any] | None = None, num_warmup: int = 10,
                     num_iters: int = 100) -> dict[str, float]:
    """Time dispatch -> trivial expert -> combine (collective: every rank calls it with the same arguments).
    The calls run back to back, each between its own CUDA events, enqueued behind a sleep kernel long enough for
    the host to enqueue them all (timing.time_queued_us): GPU time, not Python launch overhead.
    Returns {"median_us", "us_per_call" (mean), "min_us", "max_us", "host_us_per_call", "sleep_us",
    "host_bound" (1.0: the host fell behind anyway), "block_m"}; a record of assemble_comm_results."""
    from megamoe.kernels.dispatch_combine import config_for, run

    y = torch.empty(num_tokens, buf.hidden, dtype=torch.bfloat16, device=buf.device)
    config = config_for(buf, block_m, bulk_pull, knobs)
    with torch.cuda.device(buf.device):
        stats = time_queued_us(
            lambda: run(buf, num_tokens, y, block_m=config.block_m, bulk_pull=bulk_pull, knobs=knobs,
                        check_inputs=False),
            warmup=num_warmup, iters=num_iters)
    return dict(stats, us_per_call=stats["mean_us"], block_m=float(config.block_m))


# One process per GPU -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommPlan:
    cases: tuple[CommCase, ...]
    warmup: int
    iters: int
    seed: int = 0


def _comm_case_on_rank(case: CommCase, index: int, plan: CommPlan, ranks: RankContext) -> dict:
    """One case on one rank: the NCCL baseline eager, then graphed, then every unit-kernel variant, each phase
    between phase barriers (see the NOTES above). Returns this rank's record of the case."""
    import megamoe
    from megamoe.testing import dispatch_combine as dcc

    rank, num_ranks = ranks.rank, ranks.num_ranks
    shape, layout = case.shape, case.layout(num_ranks)
    counts = [case.tokens if r == rank else 0 for r in range(num_ranks)]  # only this rank's inputs are made
    mine = dcc.random_inputs(layout, counts, "uniform", seed=plan.seed + 7919 * index + rank)[rank]
    record: dict[str, Any] = {"remote_rows": count_remote_rows(mine.topk_idx, rank, layout.num_local_experts)}

    buf = megamoe.get_symm_buffer(ranks.group, shape.num_experts, case.tokens, shape.num_topk, shape.hidden,
                                  shape.intermediate)
    dcc.load_inputs(buf, mine)
    staged = [t.to(buf.device) for t in (mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights)]
    baseline = NcclRoundTrip(*staged, num_ranks, layout.num_local_experts, ranks.group)
    error = baseline.check()
    if error:
        raise RuntimeError(f"rank {rank} {case.name}: NCCL baseline: {error}")
    ranks.phase_barrier()

    # Phase 1: NCCL, eager (split sizes through the host)
    total, dispatch_us, _, combine_us = time_stages_us(baseline.stages(), warmup=plan.warmup, iters=plan.iters)
    record["nccl_eager"] = {"round_trip_us": total, "dispatch_us": dispatch_us, "combine_us": combine_us}
    ranks.phase_barrier()

    # Phase 2: NCCL, fixed splits, CUDA graph where the capture works (every rank must agree), else eager
    note = ""
    try:
        replay: Callable[[], Any] | None = graphed(lambda: baseline.round_trip(fixed=True),
                                                   capture_error_mode="thread_local")
    except Exception as exc:
        replay, note = None, f"rank {rank}: {first_line(exc)}"
    torch.cuda.synchronize()
    captured = ranks.all_agree(replay is not None)
    if not captured:
        replay = lambda: baseline.round_trip(fixed=True)  # noqa: E731
        note = note or "failed on another rank"
    ranks.phase_barrier()
    assert replay is not None
    record["nccl_graphed"] = {"graphed": captured, "note": note,
                              **time_queued_us(replay, warmup=plan.warmup, iters=plan.iters)}
    del replay
    ranks.phase_barrier()

    # Phase 3: ours, every variant on the same buffer and inputs, each in a phase of its own
    for key, preset, _ in COMM_VARIANTS:
        record[key] = bench_round_trip(buf, case.tokens, block_m=comm_block_m(case, num_ranks),
                                      knobs=comm_variant_knobs(preset), num_warmup=plan.warmup,
                                      num_iters=plan.iters)
        ranks.phase_barrier()
    buf.destroy()
    del baseline, staged
    torch.cuda.empty_cache()
    return record


def _comm_rank(ranks: RankContext, plan: CommPlan, case_fn: Callable[..., dict] | None = None,
               device_name: bool = True) -> list[CommCaseResult] | None:
    """One rank: time every case (case_fn: _comm_case_on_rank), gather the records on rank 0, which returns the
    assembled results (the other ranks None). A fake case_fn and device_name=False run it on a CPU (tests)."""
    from megamoe.testing.ranks import gather_case_records

    fn = case_fn or _comm_case_on_rank
    gathered = gather_case_records(ranks, plan.cases, lambda case, index: fn(case, index, plan, ranks),
                                   "megamoe bench comm")
    if gathered is None:
        return None
    return assemble_comm_results(plan.cases, gathered, ranks.num_ranks,
                                 device=torch.cuda.get_device_name() if device_name else "cpu",
                                 warmup=plan.warmup, iters=plan.iters)


def bench_comm(tokens: Sequence[int] = COMM_TOKENS, *, warmup: int = 10, iters: int = 50,
               shapes: Sequence[CommShape] = COMM_SHAPES, seed: int = 0,
               timeout_s: float = 480.0) -> list[CommCaseResult]:
    """Spawn one process per visible GPU; rank 0 gathers every rank's timings and returns the results."""
    check_comm_options(tokens, warmup, iters)
    num_ranks = comm_num_ranks(torch.cuda.device_count(), shapes)
    plan = CommPlan(tuple(comm_cases(tokens, shapes)), warmup, iters, seed)
    precompile_comm([num_ranks], tokens, shapes)  # once here (cache hits when warmed), not in every rank at once
    return spawn_comm_ranks(num_ranks, plan, timeout_s=timeout_s)


def spawn_comm_ranks(num_ranks: int, plan: CommPlan, *, backend: str = "nccl",
                     case_fn: Callable[..., dict] | None = None, timeout_s: float = 1200.0,
                     grace_s: float = 30.0) -> list[CommCaseResult]:
    """_comm_rank in num_ranks spawned processes (testing.ranks.spawn_ranks); rank 0's assembled results. Raises
    RuntimeError (RankFailure) with every rank's traceback when one fails."""
    results = spawn_ranks(num_ranks, _comm_rank, plan, case_fn, backend == "nccl", backend=backend,
                          what="megamoe bench comm", timeout_s=timeout_s, grace_s=grace_s)
    if results[0] is None:
        raise RankFailure("megamoe bench comm failed: rank 0 returned no results")
    return results[0]
