"""Compare GEMM schedule knobs (GemmConfig fields, e.g. num_stages) on `megamoe bench gemm` cases, with the cuBLAS
blockwise loop timed in the same rounds: each round times every variant once (graphed, median of `iters`), so
clock drift and thermal state hit all of them alike; the table gives the median, min and max over the rounds.
Every variant's output is compared bit for bit with the first variant's (schedules must not change results).
For choosing defaults; the targets are judged by `megamoe bench gemm`.

Usage: PYTHONPATH=python python3 scripts/sweep_gemm.py [--cases 1 2 3] [--knobs "" num_stages=5 ...]
           [--rounds 5] [--compile-only]
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table

from megamoe.bench.gemm import GEMM_CASES, cublas_blockwise
from megamoe.bench.timing import graphed, time_rounds
from megamoe.kernels import gemm
from megamoe.testing.gemm import make_problem, run_problem

DEFAULT_KNOBS = ("", "num_stages=5")  # "" is the default config


def parse_knobs(text: str) -> dict[str, object]:
    knobs: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        knobs[key] = int(value) if value.isdigit() else value
    return knobs


def configs(index: int, knobs: list[str]) -> list[gemm.GemmConfig]:
    case = GEMM_CASES[index]
    base = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups)
    return [replace(base, **parse_knobs(k)) for k in knobs]


def sweep_case(index: int, knobs: list[str], rounds: int, iters: int, console: Console) -> None:
    case = GEMM_CASES[index]
    variants = configs(index, knobs)
    problem = make_problem(variants[0], [case.rows] * case.num_groups, small_int=False)
    flops = 2.0 * case.num_groups * case.rows * case.n * case.k
    outputs, runners = [], {}
    for knob, config in zip(knobs, variants):
        d = torch.full((problem.num_pool_rows, case.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        problem.config = config
        run_problem(problem, d)
        torch.cuda.synchronize()
        outputs.append(d)
        runners[knob or "default"] = graphed(lambda p=replace(problem), d=d: run_problem(p, d))
    problem.config = variants[0]
    mismatched = {k or "default": int((o.view(torch.int16) != outputs[0].view(torch.int16)).sum().item())
                  for k, o in zip(knobs, outputs)}
    runners["cuBLAS blockwise loop"] = graphed(cublas_blockwise(problem))
    times = time_rounds(runners, rounds=rounds, iters=iters)
    table = Table(title=f"{case.name} ({rounds} rounds x median of {iters})")
    for col in ("variant", "median us", "TFLOP/s", "min..max us", "spread", "outputs != first"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med:.1f}", f"{flops / med / 1e6:.0f}", f"{min(ts):.1f}..{max(ts):.1f}",
                      f"{100 * (max(ts) - min(ts)) / med:.1f}%", str(mismatched.get(name, "")))
    console.print(table)
    del problem, outputs, runners
    torch.cuda.empty_cache()


def sweep_main(configs: Callable[[int, list[str]], list], compile_fn: Callable[[Any], Any],
               sweep_case: Callable[[int, list[str], int, int, Console], None], *, default_cases: list[int],
               default_knobs: list[str]) -> None:
    """The command line of a sweep script: compile every (case, knob) variant, then (unless --compile-only)
    sweep each case. Shared by this script and scripts/sweep_ffn.py."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, nargs="+", default=default_cases)
    parser.add_argument("--knobs", nargs="+", default=default_knobs)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    for index in args.cases:
        for config in configs(index, args.knobs):
            compile_fn(config)
    if args.compile_only:
        return
    console = Console(width=140)
    for index in args.cases:
        sweep_case(index, args.knobs, args.rounds, args.iters, console)


def main() -> None:
    sweep_main(configs, gemm.compile_gemm, sweep_case, default_cases=[1, 2, 3], default_knobs=list(DEFAULT_KNOBS))


if __name__ == "__main__":
    main()
