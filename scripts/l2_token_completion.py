"""When the tokens' rows complete in the fused kernel's L2 phase (CPU only; notes/fused.md, "When the tokens' rows
complete in the L2 phase"): the scheduler model's L2 order at the call's config (megamoe.scheduler, static
striding), and orders that take the L2 tasks pool-block band major across the wave's experts. For each order: the
10th / 50th / 90th percentile of the tokens' completion (the position of the last L2 task covering one of the
token's rows, as a fraction of the L2 tasks), the shares of the tokens completing after 0.8 / 0.9 / 0.95 / 0.98 of
the L2 tasks, and the w2 bytes it streams (each band rereads every banded expert's w2). `--tail-experts k`: the
call's order, but the last k experts' L2 tiles band major (bands of 1 m-block), so that their rereads might hit the
L2 cache (notes/fused.md, "Reduce tasks between the last L2 tiles"). `--lag u`: a second table on the time axis of
the whole GEMM work (an L1 task weighs K_L1 / K_L2 = H / I L2 tasks), the call's order (every L1 task, then every L2
task) against an order that issues each unit's (expert, m-block) L2 tasks once the L1 tasks of the unit u units later
are issued (the lag order of a public SM90 fused kernel, notes/fused.md, "How the public SM90 MegaMoE kernels ..."):
the same quantiles and the shares of the tokens completing in the last 5 / 10 / 20 / 30% of the work.
Routing as `megamoe bench fused` draws it (bench.fused.routed_inputs); pool rows of an expert in token order.
Usage: PYTHONPATH=python python3 scripts/l2_token_completion.py [--tokens 4096] [--bands 1 2 3]
       [--tail-experts 4 6 8] [--lag 16 32 64]"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

from megamoe import heuristics, scheduler
from megamoe.bench.fused import FUSED_SEEDS, FUSED_SHAPES, expected_load, routed_inputs
from megamoe.fused import config_for
from megamoe.layout import SymmLayout, ceil_div

QUANTILES = (0.1, 0.5, 0.9)
LATE_POSITIONS = (0.8, 0.9, 0.95, 0.98)
LAST_SHARES = (0.05, 0.1, 0.2, 0.3)


def token_completions(unit_done: dict[tuple[int, int], float], total: float, pool_rank: dict[tuple[int, int], int],
                      topk_idx: torch.Tensor, block_m: int) -> list[float]:
    """Each token's completion (the latest `unit_done` of the (expert, m-block) units holding its rows) / `total`,
    sorted."""
    return sorted(max(unit_done[(e, pool_rank[(e, token)] // block_m)] for e in experts) / total
                  for token, experts in enumerate(topk_idx.tolist()))


def completion_stats(order: Sequence[scheduler.Task], pool_rank: dict[tuple[int, int], int],
                     topk_idx: torch.Tensor, block_m: int) -> list[float]:
    """Quantiles of the tokens' completion positions in `order` (L2 tasks only), as fractions of its length, then
    the shares of the tokens completing after each of LATE_POSITIONS."""
    last = {(task.expert_idx, task.m_block_idx): float(i) for i, task in enumerate(order)}
    done = token_completions(last, len(order), pool_rank, topk_idx, block_m)
    return ([done[int(q * len(done))] for q in QUANTILES] +
            [sum(1 for d in done if d > p) / len(done) for p in LATE_POSITIONS])


def lag_order(sequence: Sequence[scheduler.Task], lag: int) -> list[scheduler.Task]:
    """The call's tasks reordered: each unit's L2 tasks right after the L1 tasks of the unit `lag` units later
    (units in the call's L1 order), the rest of the L2 tasks after the last L1 task."""
    units: dict[tuple[int, int], tuple[list[scheduler.Task], list[scheduler.Task]]] = {}
    for task in sequence:
        units.setdefault((task.expert_idx, task.m_block_idx), ([], []))[task.phase == "l2"].append(task)
    keys = list(units)
    order: list[scheduler.Task] = []
    for i, key in enumerate(keys):
        order += units[key][0]
        if i >= lag:
            order += units[keys[i - lag]][1]
    for key in keys[max(0, len(keys) - lag):]:
        order += units[key][1]
    return order


def timed_completion_stats(order: Sequence[scheduler.Task], pool_rank: dict[tuple[int, int], int],
                           topk_idx: torch.Tensor, block_m: int, l1_weight: float) -> list[float]:
    """Quantiles of the tokens' completion times (the end of the last L2 task covering one of their rows, as a
    fraction of the whole work, an L1 task weighing `l1_weight` L2 tasks), then the shares of the tokens completing
    in the last 5 / 10 / 20 / 30% of it."""
    ends, t = {}, 0.0
    for task in order:
        t += l1_weight if task.phase == "l1" else 1.0
        if task.phase == "l2":
            ends[(task.expert_idx, task.m_block_idx)] = t
    done = token_completions(ends, t, pool_rank, topk_idx, block_m)
    return ([done[int(q * len(done))] for q in QUANTILES] +
            [sum(1 for d in done if d > 1.0 - p) / len(done) for p in LAST_SHARES])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--shape", default="flash", choices=sorted(FUSED_SHAPES))
    parser.add_argument("--bands", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tail-experts", type=int, nargs="*", default=[4, 6, 8])
    parser.add_argument("--lag", type=int, nargs="*", default=[],
                        help="units (expert, m-block) between a unit's L1 and its L2 tasks (second table)")
    args = parser.parse_args()
    spec = FUSED_SHAPES[args.shape]
    if any(k < 1 or k > spec.num_experts for k in args.tail_experts):
        parser.error(f"--tail-experts: each k in 1..{spec.num_experts}")
    lay = SymmLayout.create(1, spec.num_experts, spec.max_tokens, spec.num_topk, spec.hidden, spec.intermediate)
    config = config_for(lay, expected_tokens_per_expert=expected_load(spec, args.tokens))
    num_l1_n, num_l2_n = 2 * spec.intermediate // heuristics.BLOCK_N, spec.hidden // heuristics.BLOCK_N
    w2_expert_bytes = spec.hidden * spec.intermediate
    w2_bytes = spec.num_experts * w2_expert_bytes

    table = Table(title=f"L2 completion of the tokens, T {args.tokens}, BLOCK_M {config.block_m}, "
                        f"{'N' if config.n_major_l2 else 'M'}-major L2 (fractions of the L2 tasks)")
    for column in ("seed", "order", *(f"p{int(q * 100)}" for q in QUANTILES),
                   *(f">{p}" for p in LATE_POSITIONS), "w2 streamed (GB)"):
        table.add_column(column, justify="right", no_wrap=column == "order")
    timed = Table(title="Completion of the tokens on the whole GEMM work (an L1 task = "
                        f"{spec.hidden / spec.intermediate:g} L2 tasks; fractions of the work)")
    for column in ("seed", "order", *(f"p{int(q * 100)}" for q in QUANTILES),
                   *(f"last {int(p * 100)}%" for p in LAST_SHARES)):
        timed.add_column(column, justify="right", no_wrap=column == "order")
    for seed in FUSED_SEEDS:
        _, _, topk_idx, _ = routed_inputs(args.tokens, spec.num_experts, spec.num_topk, spec.hidden, seed,
                                          torch.device("cpu"))
        counts = torch.bincount(topk_idx.flatten(), minlength=spec.num_experts).tolist()
        # each expert's pool rows in token order
        pool_rank: dict[tuple[int, int], int] = {}
        next_row = [0] * spec.num_experts
        for token, experts in enumerate(topk_idx.tolist()):
            for e in experts:
                pool_rank[(e, token)] = next_row[e]
                next_row[e] += 1
        min_wave_l1_tiles = heuristics.min_wave_l1_tiles_for(heuristics.DEFAULT_NUM_SMS)
        sequence = scheduler.task_sequence(counts, block_m=config.block_m, num_l1_n_blocks=num_l1_n,
                                           num_l2_n_blocks=num_l2_n, n_major_l2=config.n_major_l2,
                                           min_wave_l1_tiles=min_wave_l1_tiles)
        l2 = [task for task in sequence if task.phase == "l2"]
        max_m = max(scheduler.num_m_blocks(c, config.block_m) for c in counts)
        orders = [("call's", l2, w2_bytes)]
        for band in args.bands:
            orders.append((f"bands of {band}",
                           sorted(l2, key=lambda t, b=band: (t.m_block_idx // b, t.expert_idx, t.n_block_idx,
                                                             t.m_block_idx)),
                           ceil_div(max_m, band) * w2_bytes))
        experts_in_order = list(dict.fromkeys(task.expert_idx for task in l2))
        for k in args.tail_experts:
            tail = experts_in_order[len(experts_in_order) - k:]
            banded = sorted((t for t in l2 if t.expert_idx in tail),
                            key=lambda t: (t.m_block_idx, tail.index(t.expert_idx), t.n_block_idx))
            max_tail_m = max(scheduler.num_m_blocks(counts[e], config.block_m) for e in tail)
            orders.append((f"last {k} banded",
                           [t for t in l2 if t.expert_idx not in tail] + banded,
                           w2_bytes + (max_tail_m - 1) * k * w2_expert_bytes))
        for name, order, streamed in orders:
            stats = completion_stats(order, pool_rank, topk_idx, config.block_m)
            table.add_row(str(seed), name, *(f"{q:.2f}" for q in stats), f"{streamed / 1e9:.2f}")
        for name, order in [("call's", sequence)] + [(f"lag {u}", lag_order(sequence, u)) for u in args.lag]:
            stats = timed_completion_stats(order, pool_rank, topk_idx, config.block_m,
                                           spec.hidden / spec.intermediate)
            timed.add_row(str(seed), name, *(f"{q:.2f}" for q in stats))
    Console(width=120).print(table)
    if args.lag:
        Console(width=120).print(timed)


if __name__ == "__main__":
    main()
