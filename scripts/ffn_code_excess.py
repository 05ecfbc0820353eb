"""Where the expert-FFN random tier's code excess comes from, over many seeds: the measurement behind
tests/test_expert_ffn_gpu.py's bounds on the L2 activation codes and SFs (check_random: a code's excess beyond the
rounding of the reference's unrounded value on the code's own SF scale, in units of the group amax; the SFs'
relative error).

Each seed draws the random tier's case (`testing.expert_ffn.make_case`, the test's counts, so a failing test's seed
reproduces its case) and runs the debug variant, which also stores the kernel's own L1 accumulators. Per seed: the
excess (the test's number), the same on the reference SF's scale (which adds the group amax's own error to every
code of the group), the SFs' largest relative error, the excess of the reference epilogue on the kernel's own
accumulators (the epilogue alone), the worst accumulator error in units of its expert's accumulator RMS (the GEMM's
accumulation error), and, at the worst code: its group's amax against that RMS (a group whose values are all small
magnifies the same absolute error), the gate / up errors there and its distance in FP8 steps.
Usage on the GPU machine: PYTHONPATH=python python3 scripts/ffn_code_excess.py [--seeds N] [--seed-list S,...]
[--shape 4096x2048] [--clamp] [--exact-math] [--compile-only]"""
from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from megamoe.kernels import catalog
from megamoe.kernels import expert_ffn as ef


@dataclass
class SeedResult:
    seed: int
    excess: float          # vs the reference (the test's check_random number), units of the group amax
    ref_scale_excess: float  # the same with the expected SF's scale (the group amax's error added)
    sf_rel_err: float      # the SFs' largest relative error
    own_excess: float      # the reference epilogue on the kernel's own L1 accumulators
    acc_err: float         # max |kernel acc - reference acc| / RMS of the expert's reference acc
    group_amax: float      # at the worst code: the group's amax / (|topk weight| x acc RMS^2)
    gate_err: float        # at the worst code: (kernel - reference) gate / acc RMS
    up_err: float          # ... up / acc RMS
    steps: int             # at the worst code: its distance in FP8 steps from the reference's code


def config_for(hidden: int, intermediate: int, clamp: bool, fast_math: bool) -> ef.ExpertFfnConfig:
    return ef.ExpertFfnConfig(32, hidden, intermediate, len(catalog.FFN_RANDOM_COUNTS), clamp, fast_math,
                              debug_l1_acc=True)


def measure(config: ef.ExpertFfnConfig, seed: int) -> SeedResult:
    import torch

    from megamoe.testing import expert_ffn as tef
    from megamoe.testing import expert_ffn_checks as efc

    case = tef.make_case(config.hidden, config.intermediate, catalog.FFN_RANDOM_COUNTS, small_int=False,
                         fast_math=config.fast_math, activation_clamp="auto" if config.clamp else None, seed=seed,
                         device="cuda")
    problem = tef.pack_problem(config, case)
    outputs = ef.new_outputs(config, problem.num_pool_rows)
    tef.run_problem(problem, outputs)
    torch.cuda.synchronize()
    report = efc.compare(problem, outputs)
    if report.errors:
        raise RuntimeError(f"seed {seed}: {report.errors}")
    inter_i = config.intermediate
    worst = SeedResult(seed, report.codes.excess, 0.0, report.codes.sf_max_rel_err, report.own_codes.excess, 0.0,
                       0.0, 0.0, 0.0, 0)
    worst_beyond = -float("inf")
    for e, inter in enumerate(case.reference.experts):
        if case.counts[e] == 0:
            continue
        rows = problem.rows(e)
        acc, ref_acc = outputs.l1_acc[rows].double(), inter.l1_acc.double()
        rms = ref_acc.pow(2).mean().sqrt().item()
        worst.acc_err = max(worst.acc_err, ((acc - ref_acc).abs().max() / rms).item())
        # The test's excess (on the code's own SF), located: (row, column) of its maximum in this expert; and the
        # same on the expected SF's scale
        q = outputs.l2_acts[rows]
        beyond, _ = efc.code_beyond(q, outputs.l2_acts_sf[:, rows].t(), inter.act)
        ref_beyond, _ = efc.code_beyond(q, inter.l2_act_sf, inter.act)
        amax = inter.act.double().unflatten(1, (-1, 64)).abs().amax(dim=2, keepdim=True)
        worst.ref_scale_excess = max(worst.ref_scale_excess, ref_beyond.max().item() / efc.FP8_MAX)
        flat = int(beyond.argmax())
        r, c = divmod(flat, inter_i)
        if beyond[r, c].item() <= worst_beyond:
            continue
        worst_beyond = beyond[r, c].item()
        weight = abs(inter.topk_weight[r].item())
        worst.group_amax = amax[r, c // 64, 0].item() / max(weight * rms * rms, 1e-30)
        worst.gate_err = ((acc[r, c] - ref_acc[r, c]) / rms).item()
        worst.up_err = ((acc[r, inter_i + c] - ref_acc[r, inter_i + c]) / rms).item()
        worst.steps = int((efc.fp8_ordinal(q[r:r + 1, c:c + 1]) - efc.fp8_ordinal(inter.l2_act[r:r + 1, c:c + 1]))
                          .abs().item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="fresh random seeds")
    parser.add_argument("--seed-list", default="", help="seeds to reproduce (a failing test's), comma-separated")
    parser.add_argument("--shape", default="4096x2048", help="H x I")
    parser.add_argument("--clamp", action="store_true")
    parser.add_argument("--exact-math", action="store_true", help="fast_math off")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    hidden, intermediate = (int(v) for v in args.shape.split("x"))
    config = config_for(hidden, intermediate, args.clamp, not args.exact_math)
    console = Console(width=160)
    build = catalog.compile_variant(config)
    console.print(f"{config.name}: {build.functions[0] if build.functions else build}")
    if args.compile_only:
        return

    seeds = [int(s) for s in args.seed_list.split(",") if s]
    seeds += [random.SystemRandom().randrange(1 << 31) for _ in range(args.seeds)]
    table = Table(title=f"{config.name}: L2 activation codes against the reference, random tier cases")
    for column in ("seed", "excess (amax)", "on the expected SF", "SF rel err", "epilogue alone", "max acc err (RMS)",
                   "worst code: group amax (w RMS^2)", "gate err (RMS)", "up err (RMS)", "steps"):
        table.add_column(column, justify="right")
    results = []
    for seed in seeds:
        res = measure(config, seed)
        results.append(res)
        table.add_row(str(res.seed), f"{res.excess:.2e}", f"{res.ref_scale_excess:.2e}", f"{res.sf_rel_err:.2e}",
                      f"{res.own_excess:.1e}", f"{res.acc_err:.2e}",
                      f"{res.group_amax:.3f}", f"{res.gate_err:+.2e}", f"{res.up_err:+.2e}", str(res.steps))
    console.print(table)
    excess = [r.excess for r in results]
    sf_err = [r.sf_rel_err for r in results]
    console.print(f"over {len(results)} seeds: excess median {statistics.median(excess):.2e}, max {max(excess):.2e}; "
                  f"on the expected SF max {max(r.ref_scale_excess for r in results):.2e}; SF rel err median "
                  f"{statistics.median(sf_err):.2e}, max {max(sf_err):.2e}; max acc err "
                  f"{max(r.acc_err for r in results):.2e} RMS")


if __name__ == "__main__":
    main()
