"""Benchmarks (not tests): median of many runs after warm-up, timed with CUDA events, side by side in one run
with the baselines and the measured ceilings of the H200. `megamoe bench <name>` prints a rich table and writes
JSON.

gemm: the grouped GEMM component against cuBLAS, one GPU (here).
comm: the dispatch -> trivial expert -> combine unit kernel against an NCCL all_to_all_single round trip, one
process per GPU (spawned here; every visible GPU is a rank); `megamoe bench comm --compile-only` fills the JIT
cache with every variant it launches, on a machine without a GPU (megamoe.bench_comm).
ffn: the local expert FFN unit kernel against the same recipe run unfused through cuBLAS, one GPU
(megamoe.bench_ffn).

This module: the shared framework (timers, CUDA graphs, result records, table cells, the H200 ceilings, the
registry of benches and `main`) and the gemm bench. bench_comm and bench_ffn import it; it names them only in
BENCHES / REPORTS, imported when run.
"""
from __future__ import annotations

import importlib
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

# Ceilings measured on the H200s of this project (README "Benchmarks").
HBM_READ_TBPS = 4.36
FP8_DENSE_TFLOPS = 1350.0
BF16_DENSE_TFLOPS = 780.0
MAX_SLEEP_US = 200_000.0  # time_queued_us: the longest sleep it queues ahead of the timed runs
GPU_CYCLES_PER_US = 2000  # torch.cuda._sleep spins in SM cycles; the H200 clocks at most 1.98 GHz: errs long


def time_us(fn: Callable[[], None], *, warmup: int = 5, iters: int = 30) -> float:
    """Median over `iters` runs of fn, each timed with its own CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def time_rounds(runners: dict[str, Callable[[], None]], *, rounds: int, iters: int) -> dict[str, list[float]]:
    """Each round times every runner once (time_us: median of `iters`), so that the GPU's clock and power state (the
    H200 runs into its power cap under load and clocks between 1.3 and 1.98 GHz) hits all of them alike instead of
    favouring whichever runs after a pause. The first round goes in the given order, every later one in its own
    (seeded, so repeatable) shuffle: the power state a runner meets depends on what ran just before it (measured:
    in a fixed order, the runner that always follows the heaviest case ran 5-10% slower than elsewhere).
    Returns each runner's per-round medians."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for round_idx in range(rounds):
        order = names if round_idx == 0 else random.Random(round_idx).sample(names, len(names))
        for name in order:
            times[name].append(time_us(runners[name], iters=iters))
    return times


def graphed(fn: Callable[[], None], capture_error_mode: str = "global") -> Callable[[], None]:
    """Capture fn (e.g. a per-group loop of launches) in a CUDA graph; returns its replay. capture_error_mode as
    torch.cuda.graph ("thread_local" for NCCL: its watchdog thread queries events during the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        fn()

    # The replay holds fn: the tensors only its closure references (outputs, scales allocated before the capture)
    # must live as long as the graph that reads and writes them; dropped, the allocator hands their memory on.
    def replay(fn: Callable[[], None] = fn) -> None:
        graph.replay()

    return replay


def time_stages_us(stages: Sequence[Callable[[Any], Any]], *, warmup: int = 5, iters: int = 30) -> list[float]:
    """[round trip, stage 0, stage 1, ...] medians (us). Stage i gets stage i - 1's return value (the first gets
    None). Each iteration has its own CUDA events and is waited for (for chains with host syncs inside)."""

    def chain(events: list[Any] | None) -> None:
        value = None
        for i, stage in enumerate(stages):
            if events:
                events[i].record()
            value = stage(value)
        if events:
            events[-1].record()

    for _ in range(warmup):
        chain(None)
    torch.cuda.synchronize()
    totals: list[float] = []
    per_stage: list[list[float]] = [[] for _ in stages]
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        chain(events)
        events[-1].synchronize()
        totals.append(events[0].elapsed_time(events[-1]) * 1e3)
        for i in range(len(stages)):
            per_stage[i].append(events[i].elapsed_time(events[i + 1]) * 1e3)
    return [statistics.median(totals)] + [statistics.median(t) for t in per_stage]


def time_queued_us(fn: Callable[[], Any], *, warmup: int = 5, iters: int = 30) -> dict[str, float]:
    """`iters` back-to-back runs of fn, each between its own CUDA events, enqueued behind a sleep kernel long
    enough for the host to enqueue them all: the intervals are GPU time, not launch overhead (collective kernels
    keep their ranks in step by themselves). Returns median/mean/min/max (us), the host's time per call, the sleep
    and host_bound = 1.0 when the host still fell behind (the numbers then include launch overhead)."""
    host = []
    for _ in range(warmup):
        wall = time.perf_counter()
        fn()
        host.append((time.perf_counter() - wall) * 1e6)
    torch.cuda.synchronize()
    # The median ignores the first call's module load / JIT; the cap keeps the ranks' sleeps (and so their start
    # skew, which a peer spends spinning in the kernel's barrier) far below MEGAMOE_TIMEOUT_S.
    sleep_us = min(1.5 * statistics.median(host) * (iters + 1) + 500.0, MAX_SLEEP_US)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda._sleep(int(sleep_us * GPU_CYCLES_PER_US))
    wall = time.perf_counter()
    for i in range(iters):
        events[i].record()
        fn()
    events[-1].record()
    enqueue_us = (time.perf_counter() - wall) * 1e6
    events[-1].synchronize()
    times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(iters)]
    return {"median_us": statistics.median(times), "mean_us": events[0].elapsed_time(events[-1]) * 1e3 / iters,
            "min_us": min(times), "max_us": max(times), "host_us_per_call": enqueue_us / iters,
            "sleep_us": sleep_us, "host_bound": float(enqueue_us > sleep_us)}


def first_line(exc: BaseException, limit: int = 100) -> str:
    """"Type: first line of the message" (at most `limit` characters of it), for the tables' notes."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:limit]}"


def fmt(value: float | None, spec: str) -> str:
    """A table cell: the value formatted, "n/a" without one."""
    return "n/a" if value is None else format(value, spec)


def fmt_met(met: bool | None) -> str:
    """A table cell of a target: "-" when not judged."""
    return "-" if met is None else ("[green]yes[/]" if met else "[red]NO[/]")


@dataclass
class Measurement:
    impl: str
    time_us: float | None
    tflops: float | None = None
    weight_gbps: float | None = None
    note: str = ""
    rounds_us: list[float] = field(default_factory=list)  # per-round medians (time_us: their median)


@dataclass
class CaseResult:
    case: str
    flops: float
    weight_bytes: float
    measurements: list[Measurement] = field(default_factory=list)

    def add(self, impl: str, time: float | None, note: str = "", rounds_us: Sequence[float] = ()) -> None:
        self.measurements.append(Measurement(
            impl, time, None if time is None else self.flops / time / 1e6,
            None if time is None else self.weight_bytes / time / 1e3, note, list(rounds_us)))


# ---------------------------------------------------------------------------------------------------------------
# GEMM component
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmCase:
    name: str
    num_groups: int
    rows: int
    n: int
    k: int
    mode: str
    block_m: int


GEMM_CASES = [
    GemmCase("decode 32x24", 32, 24, 4096, 4096, "l1", 64),
    GemmCase("prefill 32x1536", 32, 1536, 4096, 4096, "l1", 128),
    GemmCase("4x8192 K7168", 4, 8192, 4096, 7168, "l1", 128),
    GemmCase("L2 32x1536 K2048", 32, 1536, 4096, 2048, "l2", 128),
    GemmCase("L1 32x1536 K2048", 32, 1536, 4096, 2048, "l1", 128),  # the L2 row's shape in L1 mode
]


def gemm_targets(results: list[CaseResult]) -> list[dict[str, Any]]:
    """The GEMM issue's targets, judged on one run's results (ours = each case's first measurement)."""
    by_case = {r.case: r.measurements for r in results}

    def ours(case: str) -> Measurement | None:
        ms = by_case.get(case)
        return ms[0] if ms and ms[0].time_us is not None else None

    def cublas(case: str) -> Measurement | None:
        return next((m for m in by_case.get(case, []) if m.impl.startswith("cuBLAS") and m.time_us), None)

    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: str, met: bool | None) -> None:
        targets.append({"target": name, "value": value, "goal": goal, "met": met})

    decode, prefill, big = ours("decode 32x24"), ours("prefill 32x1536"), ours("4x8192 K7168")
    l2, l1_same = ours("L2 32x1536 K2048"), ours("L1 32x1536 K2048")
    add("decode weight TB/s", decode and decode.weight_gbps / 1e3, ">= 3.3", decode and decode.weight_gbps >= 3300)
    base = cublas("prefill 32x1536")
    add("prefill / cuBLAS loop (speedup)", prefill and base and base.time_us / prefill.time_us, "> 1",
        prefill and base and prefill.time_us < base.time_us)
    add("4x8192 K7168 TFLOP/s", big and big.tflops, ">= 1100", big and big.tflops >= 1100)
    for name, ref in (("L2 / L1 same shape (K2048)", l1_same), ("L2 / L1 prefill (K4096)", prefill)):
        ratio = l2 and ref and l2.tflops / ref.tflops
        add(name, ratio, ">= 0.80", ratio and ratio >= 0.80)
    return targets


def _cublas_blockwise(problem) -> Callable[[], None]:
    """torch._scaled_mm per group with blockwise scales (1x128 for A, 128x128 for B): the same recipe as our L1
    mode (L2 mode: approximated with per-128 A scales, the closest blockwise recipe cuBLAS offers)."""
    cfg = problem.config
    calls = []
    for e in range(cfg.num_experts):
        rows = problem.rows(e)
        a = problem.a[rows]
        sf = problem.a_sf[:, rows] if cfg.mode == "l1" else problem.a_sf[::2, rows]
        scale_a = sf.contiguous().t()  # (M, K/128), M-major
        scale_b = problem.b_sf[e].t()  # (K/128, N/128)
        out = torch.empty(a.shape[0], cfg.n, dtype=torch.bfloat16, device=a.device)
        calls.append((a, problem.b[e].t(), scale_a, scale_b, out))

    def run() -> None:
        for a, b, scale_a, scale_b, out in calls:
            torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, out=out)

    return run


def _bf16_grouped(problem) -> Callable[[], None]:
    cfg = problem.config
    a = torch.cat([problem.a[problem.rows(e)] for e in range(cfg.num_experts)]).to(torch.bfloat16)
    b = problem.b.to(torch.bfloat16).transpose(1, 2)  # [G, K, N], K contiguous
    offs = torch.tensor(problem.counts, device=a.device, dtype=torch.int32).cumsum(0).to(torch.int32)
    return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)


def bench_gemm(cases: list[GemmCase] = GEMM_CASES, *, rounds: int = 9, iters: int = 20) -> list[CaseResult]:
    """Every case and implementation graphed first, then `rounds` rounds that each time all of them once
    (time_rounds): ours, the baselines and the cases the targets compare (L2 against L1 on the same shape) see the
    same power state. Each time is the median over the rounds of the per-round medians."""
    from megamoe.kernels import gemm

    results: list[CaseResult] = []
    runners: dict[str, Callable[[], None]] = {}
    failed: dict[str, str] = {}
    keys: list[list[tuple[str, str]]] = []  # per case: (impl, runner key)
    for case in cases:
        config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups)
        problem = gemm.make_problem(config, [case.rows] * case.num_groups, small_int=False)
        d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
        results.append(CaseResult(case.name, 2.0 * case.num_groups * case.rows * case.n * case.k,
                                  float(case.num_groups * case.n * case.k)))
        case_keys = []
        for impl, make in ((f"megamoe {case.mode} BM{case.block_m} (graphed)",
                            lambda p, d=d: (lambda: gemm.run_problem(p, d))),
                           ("cuBLAS blockwise loop (graphed)", _cublas_blockwise),
                           ("torch._grouped_mm BF16 (graphed)", _bf16_grouped)):
            key = f"{case.name}: {impl}"
            case_keys.append((impl, key))
            try:  # the graph's replay holds the closure, hence the problem and outputs it reads and writes
                runners[key] = graphed(make(problem))
            except Exception as exc:  # a baseline this torch build lacks is reported, not fatal
                failed[key] = first_line(exc, 80)
        keys.append(case_keys)
    times = time_rounds(runners, rounds=rounds, iters=iters)
    for result, case_keys in zip(results, keys):
        for impl, key in case_keys:
            if key in failed:
                result.add(impl, None, note=failed[key])
            else:
                ts = times[key]
                result.add(impl, statistics.median(ts), note=f"rounds {min(ts):.0f}..{max(ts):.0f} us",
                           rounds_us=ts)
    del runners
    torch.cuda.empty_cache()
    return results


def results_table(title: str, results: list[CaseResult]) -> Table:
    table = Table(title=title)
    for col in ("case", "implementation", "time (us)", "TFLOP/s", "% of FP8 1350", "weights GB/s",
                "% of HBM 4.36 TB/s", "note"):
        table.add_column(col, justify="right" if col not in ("case", "implementation", "note") else "left")
    for result in results:
        for i, m in enumerate(result.measurements):
            table.add_row(result.case if i == 0 else "", m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"),
                          fmt(None if m.tflops is None else 100 * m.tflops / FP8_DENSE_TFLOPS, ".0f"),
                          fmt(m.weight_gbps, ".0f"),
                          fmt(None if m.weight_gbps is None else m.weight_gbps / HBM_READ_TBPS / 10, ".0f"), m.note)
        table.add_section()
    return table


def gemm_report(results: list[CaseResult]) -> tuple[dict[str, Any], Table]:
    """The JSON's fields besides the results, and the table."""
    device = torch.cuda.get_device_name()
    targets = gemm_targets(results)
    table = results_table(f"megamoe bench gemm on {device}", results)
    table.caption = "targets: " + "; ".join(f"{t['target']} {fmt(t['value'], '.2f')} ({t['goal']}: {fmt_met(t['met'])})"
                                           for t in targets)
    return {"device": device, "targets": targets}, table


# ---------------------------------------------------------------------------------------------------------------
# The benches: name -> "module:function", imported when run (bench_comm and bench_ffn import this module)
# ---------------------------------------------------------------------------------------------------------------
BENCHES: dict[str, str] = {"gemm": "megamoe.bench:bench_gemm", "comm": "megamoe.bench_comm:bench_comm",
                           "ffn": "megamoe.bench_ffn:bench_ffn"}
# Each bench's report: results -> (the JSON's fields besides the results, the table)
REPORTS: dict[str, str] = {"gemm": "megamoe.bench:gemm_report", "comm": "megamoe.bench_comm:comm_report",
                           "ffn": "megamoe.bench_ffn:ffn_report"}


def resolve(target: str) -> Any:
    """"module:function" -> the function."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def main(name: str, json_path: str | None = None, **options: Any) -> list:
    """Run one bench (options: its keyword arguments), print its table, write its JSON."""
    if name not in BENCHES:
        raise ValueError(f"bench must be one of {sorted(BENCHES)}, got {name!r}")
    if not torch.cuda.is_available():
        raise SystemExit("megamoe bench needs a CUDA GPU")
    results = resolve(BENCHES[name])(**options)
    console = Console()
    fields, table = resolve(REPORTS[name])(results)
    payload: dict[str, Any] = {"bench": name, **fields}
    console.print(table)
    path = Path(json_path or f"megamoe-bench-{name}.json")
    payload["results"] = [asdict(r) for r in results]
    path.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {path}")
    return results
