"""Benchmarks (not tests): median of many runs after warm-up, timed with CUDA events, side by side in one run
with the baselines and the measured ceilings of the H200. `megamoe bench <name>` prints a rich table and writes
JSON."""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

# Ceilings measured on the H200s of this project (README "Benchmarks").
HBM_READ_TBPS = 4.36
FP8_DENSE_TFLOPS = 1350.0
BF16_DENSE_TFLOPS = 780.0


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


def graphed(fn: Callable[[], None]) -> Callable[[], None]:
    """Capture fn (e.g. a per-group loop of launches) in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass
class Measurement:
    impl: str
    time_us: float | None
    tflops: float | None = None
    weight_gbps: float | None = None
    note: str = ""


@dataclass
class CaseResult:
    case: str
    flops: float
    weight_bytes: float
    measurements: list[Measurement] = field(default_factory=list)

    def add(self, impl: str, time: float | None, note: str = "") -> None:
        self.measurements.append(Measurement(
            impl, time, None if time is None else self.flops / time / 1e6,
            None if time is None else self.weight_bytes / time / 1e3, note))


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
]


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


def bench_gemm(cases: list[GemmCase] = GEMM_CASES) -> list[CaseResult]:
    from megamoe.kernels import gemm

    results = []
    for case in cases:
        config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups)
        problem = gemm.make_problem(config, [case.rows] * case.num_groups, small_int=False)
        d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
        result = CaseResult(case.name, 2.0 * case.num_groups * case.rows * case.n * case.k,
                            float(case.num_groups * case.n * case.k))
        result.add(f"megamoe {case.mode} BM{case.block_m} (graphed)",
                   time_us(graphed(lambda: gemm.run_problem(problem, d))))
        for impl, make in (("cuBLAS blockwise loop (graphed)", _cublas_blockwise),
                           ("torch._grouped_mm BF16 (graphed)", _bf16_grouped)):
            try:
                result.add(impl, time_us(graphed(make(problem))))
            except Exception as exc:  # a baseline this torch build lacks is reported, not fatal
                result.add(impl, None, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
        results.append(result)
        del problem, d
        torch.cuda.empty_cache()
    return results


def results_table(title: str, results: list[CaseResult]) -> Table:
    table = Table(title=title)
    for col in ("case", "implementation", "time (us)", "TFLOP/s", "% of FP8 1350", "weights GB/s",
                "% of HBM 4.36 TB/s", "note"):
        table.add_column(col, justify="right" if col not in ("case", "implementation", "note") else "left")
    for result in results:
        for i, m in enumerate(result.measurements):
            fmt = (lambda v, f: "n/a" if v is None else format(v, f))
            table.add_row(result.case if i == 0 else "", m.impl, fmt(m.time_us, ".1f"), fmt(m.tflops, ".0f"),
                          fmt(None if m.tflops is None else 100 * m.tflops / FP8_DENSE_TFLOPS, ".0f"),
                          fmt(m.weight_gbps, ".0f"),
                          fmt(None if m.weight_gbps is None else m.weight_gbps / HBM_READ_TBPS / 10, ".0f"), m.note)
        table.add_section()
    return table


BENCHES = {"gemm": bench_gemm}


def main(name: str, json_path: str | None = None) -> list[CaseResult]:
    if name not in BENCHES:
        raise ValueError(f"bench must be one of {sorted(BENCHES)}, got {name!r}")
    if not torch.cuda.is_available():
        raise SystemExit("megamoe bench needs a CUDA GPU")
    results = BENCHES[name]()
    console = Console()
    console.print(results_table(f"megamoe bench {name} on {torch.cuda.get_device_name()}", results))
    path = Path(json_path or f"megamoe-bench-{name}.json")
    path.write_text(json.dumps({"bench": name, "device": torch.cuda.get_device_name(),
                                "results": [asdict(r) for r in results]}, indent=1))
    console.print(f"wrote {path}")
    return results
