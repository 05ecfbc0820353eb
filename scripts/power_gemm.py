"""Power and SM clock of GEMM variants under sustained load: each variant runs back to back for `--seconds` while
nvidia-smi samples power and clocks; the table gives the steady-state medians and the energy per GEMM. On the H200
the GEMMs run into the software power cap (~690 W, throttle reason 0x4), so the rate a variant sustains is
power / (energy per GEMM): this shows which part of the energy the data movement takes (feed_only: the producers'
TMA traffic alone, no math) against the math, and how cuBLAS's dense FP8 GEMM (no block scales) compares.

Usage: PYTHONPATH=python python3 scripts/power_gemm.py [--cases 2] [--knobs "" ...] [--seconds 4]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from dataclasses import replace
from datetime import datetime

import torch
from rich.console import Console
from rich.table import Table

from megamoe.bench.gemm import GEMM_CASES, cublas_blockwise
from megamoe.bench.timing import graphed
from megamoe.kernels import gemm
from megamoe.testing.gemm import GemmProblem, make_problem, run_problem
from sweep_gemm import configs


def _cublas_dense_fp8(problem: GemmProblem):
    """torch._scaled_mm per group with one scale per tensor: cuBLAS's dense FP8 GEMM (no promotion)."""
    one = torch.ones((), dtype=torch.float32, device="cuda")
    calls = [(problem.a[problem.rows(e)], problem.b[e].t()) for e in range(problem.config.num_experts)]
    outs = [torch.empty(a.shape[0], problem.config.n, dtype=torch.bfloat16, device="cuda") for a, _ in calls]

    def run() -> None:
        for (a, b), out in zip(calls, outs):
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, out=out)

    return run


def _sustain(fn, seconds: float) -> tuple[float, float, float]:
    """Run fn back to back for `seconds` (after 1 s of warm-up); returns (wall start, wall end, us per call)."""
    start = time.time()
    while time.time() - start < 1.0:
        fn()
        torch.cuda.synchronize()
    t0 = time.time()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    begin.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        end.record()
        end.synchronize()
    return t0, time.time(), begin.elapsed_time(end) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, nargs="+", default=[2])
    parser.add_argument("--knobs", nargs="+", default=[""])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    for index in args.cases:
        for config in configs(index, args.knobs):
            gemm.compile_gemm(config)
            gemm.compile_gemm(replace(config, feed_only=True))
    if args.compile_only:
        return

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    console = Console(width=140)
    windows: list[tuple[str, str, float, float, float, float]] = []
    for index in args.cases:
        case = GEMM_CASES[index]
        flops = 2.0 * case.num_groups * case.rows * case.n * case.k
        variants = configs(index, args.knobs)
        problem = make_problem(variants[0], [case.rows] * case.num_groups, small_int=False)
        d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
        runners = {}
        for knob, config in zip(args.knobs, variants):
            runners[knob or "default"] = graphed(lambda p=replace(problem, config=config): run_problem(p, d))
        runners["feed_only"] = graphed(
            lambda p=replace(problem, config=replace(variants[0], feed_only=True)): run_problem(p, d))
        runners["cuBLAS blockwise loop"] = graphed(cublas_blockwise(problem))
        runners["cuBLAS dense FP8 loop"] = graphed(_cublas_dense_fp8(problem))
        for name, fn in runners.items():
            console.log(f"{case.name}: {name}")
            t0, t1, us = _sustain(fn, args.seconds)
            windows.append((case.name, name, t0, t1, us, flops))
            time.sleep(1.0)  # cool-down gap between windows
        del problem, runners
        torch.cuda.empty_cache()
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        stamp, clock, power = (x.strip() for x in line.split(","))
        samples.append((datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(clock), float(power)))

    table = Table(title=f"sustained load, {args.seconds:.0f} s per variant (nvidia-smi every 100 ms)")
    for col in ("case", "variant", "us / GEMM", "TFLOP/s", "median W", "median SM MHz", "J / GEMM", "pJ / FLOP"):
        table.add_column(col, justify="left" if col in ("case", "variant") else "right")
    for case_name, name, t0, t1, us, flops in windows:
        inside = [(c, p) for t, c, p in samples if t0 + 0.5 <= t <= t1]
        clock = statistics.median(c for c, _ in inside) if inside else float("nan")
        power = statistics.median(p for _, p in inside) if inside else float("nan")
        joules = power * us * 1e-6
        table.add_row(case_name, name, f"{us:.1f}", f"{flops / us / 1e6:.0f}", f"{power:.0f}", f"{clock:.0f}",
                      f"{joules:.3f}", f"{joules / flops * 1e12:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
