"""Compare expert-FFN schedule knobs (ExpertFfnConfig fields, e.g. band_m, prefetch) on the `megamoe bench ffn`
cases: every variant runs the same problem, graphed, in the shuffled rounds of megamoe.bench.timing.time_rounds
(the same power state for all); the table gives the median, min and max over the rounds. Every variant's output
must equal the first variant's bit for bit (schedules must not change results). For choosing defaults; the targets
are judged by `megamoe bench ffn`.

Usage: PYTHONPATH=python python3 scripts/sweep_ffn.py [--cases 0 1] [--knobs "" band_m=16 ...] [--rounds 5]
           [--compile-only]
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch
from rich.console import Console
from rich.table import Table

from megamoe.bench.ffn import FFN_CASES
from megamoe.bench.timing import graphed, time_rounds
from megamoe.kernels import expert_ffn as ef
from megamoe.testing.expert_ffn import FfnProblem, make_problem, run_problem
from sweep_gemm import parse_knobs, sweep_main


def configs(index: int, knobs: list[str]) -> list[ef.ExpertFfnConfig]:
    return [replace(FFN_CASES[index].config, **parse_knobs(k)) for k in knobs]


def sweep_case(index: int, knobs: list[str], rounds: int, iters: int, console: Console) -> None:
    case = FFN_CASES[index]
    variants = configs(index, knobs)
    problem = make_problem(variants[0], case.counts, small_int=False)
    runners, outputs = {}, []
    for knob, config in zip(knobs, variants):
        out = ef.new_outputs(config, problem.inputs.num_pool_rows)
        variant = replace(problem, config=config)

        def launch(variant: FfnProblem = variant, out: ef.FfnOutputs = out) -> None:
            out.l1_done_count.zero_()  # the L1 -> L2 counters start at zero (a memset node in the graph)
            run_problem(variant, out)

        launch()
        torch.cuda.synchronize()
        outputs.append(out.out.clone())
        runners[knob or "default"] = graphed(launch)
    mismatched = {k or "default": int((o.view(torch.int16) != outputs[0].view(torch.int16)).sum().item())
                  for k, o in zip(knobs, outputs)}
    times = time_rounds(runners, rounds=rounds, iters=iters)
    table = Table(title=f"expert FFN {case.name} ({rounds} rounds x median of {iters})")
    for col in ("variant", "median us", "TFLOP/s", "x weight floor", "min..max us", "outputs != first"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med:.1f}", f"{case.flops / med / 1e6:.0f}", f"{med / case.floor_us:.2f}",
                      f"{min(ts):.1f}..{max(ts):.1f}", str(mismatched[name]))
    console.print(table)
    del problem, outputs, runners
    torch.cuda.empty_cache()


def main() -> None:
    sweep_main(configs, ef.compile_expert_ffn, sweep_case, default_cases=[0, 1], default_knobs=["", "band_m=16"])


if __name__ == "__main__":
    main()
