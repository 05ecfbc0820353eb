"""`megamoe bench gemm`: the GEMM component (megamoe.kernels.gemm) against cuBLAS (`torch._scaled_mm` blockwise
per group) and BF16 `torch._grouped_mm`, one GPU; every case and implementation CUDA-graphed and timed in shuffled
rounds (megamoe.bench.timing.time_rounds); the GEMM issue's targets judged on the run.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from rich.table import Table

from megamoe.bench.results import CaseResult, Measurement, first_line, fmt, fmt_met, results_table
from megamoe.bench.timing import FP8_DENSE_TFLOPS, HBM_READ_TBPS, graphed, time_rounds
from megamoe.testing.gemm import GemmProblem, make_problem, run_problem


@dataclass(kw_only=True)
class GemmMeasurement(Measurement):
    rounds_us: list[float] = field(default_factory=list)  # per-round medians (time_us: their median)


@dataclass(kw_only=True)
class GemmCaseResult(CaseResult[GemmMeasurement]):
    flops: float
    weight_bytes: float

    def add(self, impl: str, time: float | None, note: str = "", rounds_us: Sequence[float] = ()) -> None:
        self.record(GemmMeasurement(impl=impl, time_us=time, **Measurement.rates(time, self.flops, self.weight_bytes),
                                    note=note, rounds_us=list(rounds_us)))


@dataclass(frozen=True)
class GemmCase:
    name: str
    num_groups: int
    rows: int
    n: int
    k: int
    mode: str
    block_m: int
    cluster_n: int = 1  # GemmConfig.cluster_n


# L1 mode at BLOCK_M 128 runs with A shared by 2-CTA clusters (+2-8% on an H100, notes/gemm.md); L2 mode, which it
# slowed by 4-5%, and the L1 row of the L2 row's shape (the two modes compared like for like) without.
GEMM_CASES = [
    GemmCase("decode 32x24", 32, 24, 4096, 4096, "l1", 64),
    GemmCase("prefill 32x768", 32, 768, 4096, 4096, "l1", 128, 2),  # the T = 4096 per-rank load of 8 GPUs
    GemmCase("prefill 32x1536", 32, 1536, 4096, 4096, "l1", 128, 2),
    GemmCase("4x8192 K7168", 4, 8192, 4096, 7168, "l1", 128, 2),
    GemmCase("L2 32x768 K2048", 32, 768, 4096, 2048, "l2", 128),
    GemmCase("L2 32x1536 K2048", 32, 1536, 4096, 2048, "l2", 128),
    GemmCase("L1 32x1536 K2048", 32, 1536, 4096, 2048, "l1", 128),  # the L2 row's shape in L1 mode
]


def gemm_targets(results: list[GemmCaseResult]) -> list[dict[str, Any]]:
    """The GEMM issue's targets, judged on one run's results (ours = each case's first measurement)."""
    by_case = {r.case: r.measurements for r in results}

    def ours(case: str) -> GemmMeasurement | None:
        ms = by_case.get(case)
        return ms[0] if ms and ms[0].time_us is not None else None

    def cublas(case: str) -> GemmMeasurement | None:
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


def cublas_blockwise(problem: GemmProblem) -> Callable[[], None]:
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


def _bf16_grouped(problem: GemmProblem) -> Callable[[], None]:
    cfg = problem.config
    a = torch.cat([problem.a[problem.rows(e)] for e in range(cfg.num_experts)]).to(torch.bfloat16)
    b = problem.b.to(torch.bfloat16).transpose(1, 2)  # [G, K, N], K contiguous
    offs = torch.tensor(problem.counts, device=a.device, dtype=torch.int32).cumsum(0).to(torch.int32)
    return lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)


def bench_gemm(cases: list[GemmCase] = GEMM_CASES, *, rounds: int = 9, iters: int = 20) -> list[GemmCaseResult]:
    """Every case and implementation graphed first, then `rounds` rounds that each time all of them once
    (time_rounds): ours, the baselines and the cases the targets compare (L2 against L1 on the same shape) see the
    same power state. Each time is the median over the rounds of the per-round medians."""
    from megamoe.kernels import gemm

    results: list[GemmCaseResult] = []
    runners: dict[str, Callable[[], None]] = {}
    failed: dict[str, str] = {}
    keys: list[list[tuple[str, str]]] = []  # per case: (impl, runner key)
    for case in cases:
        config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups, cluster_n=case.cluster_n)
        problem = make_problem(config, [case.rows] * case.num_groups, small_int=False)
        d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
        results.append(GemmCaseResult(case=case.name, flops=2.0 * case.num_groups * case.rows * case.n * case.k,
                                      weight_bytes=float(case.num_groups * case.n * case.k)))
        case_keys = []
        multicast = f" A x{case.cluster_n} CTAs" if case.cluster_n > 1 else ""
        for impl, make in ((f"megamoe {case.mode} BM{case.block_m}{multicast} (graphed)",
                            lambda p, d=d: (lambda: run_problem(p, d))),
                           ("cuBLAS blockwise loop (graphed)", cublas_blockwise),
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


def _cells(m: GemmMeasurement) -> list[str]:
    return [m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"),
            fmt(None if m.tflops is None else 100 * m.tflops / FP8_DENSE_TFLOPS, ".0f"), fmt(m.weight_gbps, ".0f"),
            fmt(None if m.weight_gbps is None else m.weight_gbps / HBM_READ_TBPS / 10, ".0f"), m.note]


def gemm_results_table(title: str, results: list[GemmCaseResult]) -> Table:
    table = results_table(title, ("case", "implementation", "time (us)", "TFLOP/s", "% of FP8 1350", "weights GB/s",
                                  "% of HBM 4.36 TB/s", "note"), left=("case", "implementation", "note"))
    for result in results:
        result.add_rows(table, _cells)
    return table


def gemm_report(results: list[GemmCaseResult]) -> tuple[dict[str, Any], Table]:
    """The JSON's fields besides the results, and the table (megamoe.bench.main)."""
    device = torch.cuda.get_device_name()
    targets = gemm_targets(results)
    table = gemm_results_table(f"megamoe bench gemm on {device}", results)
    table.caption = "targets: " + "; ".join(f"{t['target']} {fmt(t['value'], '.2f')} ({t['goal']}: {fmt_met(t['met'])})"
                                           for t in targets)
    return {"device": device, "targets": targets}, table
