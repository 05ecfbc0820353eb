"""K-block timeline of CTA 0's math warpgroups (gemm/kblock_trace.cuh) for a `megamoe bench gemm` case, and the
same case with the producers alone (feed_only): where a K block's SM clocks go (WGMMA, promotion, the rest), and,
per tile, the gap between its last K block and the next tile's first (the epilogue and the task switch).

Usage: PYTHONPATH=python python3 scripts/trace_gemm.py [case index ...] [--knobs num_stages=5 ...] [--compile-only]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from megamoe.bench.gemm import GEMM_CASES
from megamoe.bench.timing import graphed, time_us
from megamoe.kernels import gemm
from megamoe.testing.gemm import make_problem, run_problem
from sweep_gemm import parse_knobs

def configs(index: int, knobs: list[str]) -> list[gemm.GemmConfig]:
    """The case traced under each knob setting, then its producers alone (feed_only)."""
    case = GEMM_CASES[index]
    base = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups, trace=True)
    return [replace(base, **parse_knobs(k)) for k in knobs] + [replace(base, feed_only=True)]


def summarize(name: str, trace: torch.Tensor, first: int = 40, count: int = 200) -> None:
    t = trace[:, first:first + count].double()  # [wg, block, event]
    print(f"{name}: K blocks {first}..{first + count} of CTA 0 (SM clocks)")
    for wg in range(t.shape[0]):
        e = t[wg]
        cycle = (e[1:, 1] - e[:-1, 1]).median().item()  # issue to issue
        parts = {"stage wait + SF reads (ready->issue)": (e[:, 1] - e[:, 0]),
                 "WGMMA + previous promotion (issue->done)": (e[:, 2] - e[:, 1]),
                 "release and loop (done->next ready)": (e[1:, 0] - e[:-1, 2])}
        print(f"  wg{wg}: median cycle per K block {cycle:.0f}; " +
              "; ".join(f"{k} {v.median().item():.0f}" for k, v in parts.items()))
    base = t[0, 0, 0].item()
    print("  first 6 blocks, (ready, issue, done) - wg0's first ready:")
    for i in range(6):
        print("   " + "   ".join(f"wg{wg} " + " ".join(f"{t[wg, i, j].item() - base:6.0f}" for j in range(3))
                                for wg in range(t.shape[0])))


def tile_gaps(trace: torch.Tensor, num_k_blocks: int) -> None:
    """Per tile of CTA 0's first warpgroup: its first ready and last done (SM clocks after the first ready), and
    the gap from the previous tile's last done to its first ready."""
    t = trace[0].double()
    base = t[0, 0].item()
    for tile in range(t.shape[0] // num_k_blocks):
        blocks = t[tile * num_k_blocks:(tile + 1) * num_k_blocks]
        if blocks[-1, 2] == 0:
            break
        gap = f"{(blocks[0, 0] - t[tile * num_k_blocks - 1, 2]).item():6.0f}" if tile else "     -"
        print(f"  tile {tile}: first ready {blocks[0, 0].item() - base:8.0f}, last done "
              f"{blocks[-1, 2].item() - base:8.0f}, gap after the previous tile {gap}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", type=int, nargs="*", default=[1, 3])
    parser.add_argument("--knobs", nargs="+", default=[""])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    for index in args.cases:
        for config in configs(index, args.knobs):
            gemm.compile_gemm(config)
    if args.compile_only:
        return
    for index in args.cases:
        case = GEMM_CASES[index]
        for config in configs(index, args.knobs):
            problem = make_problem(config, [case.rows] * case.num_groups, small_int=False)
            d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
            trace = torch.zeros(2, gemm.KBLOCK_TRACE_LEN, gemm.KBLOCK_TRACE_EVENTS, dtype=torch.int64,
                                device="cuda")
            for _ in range(3):  # warm: the last run's trace is read
                run_problem(problem, d, trace=trace)
            torch.cuda.synchronize()
            summarize(f"{case.name} {config.name}", trace.cpu())
            tile_gaps(trace.cpu(), case.k // 128)
            # graphed, as `megamoe bench gemm` times it (eager launches are host-bound)
            us = time_us(graphed(lambda: run_problem(problem, d)))  # noqa: B023
            print(f"  whole kernel {us:.1f} us = {2 * case.num_groups * case.rows * case.n * case.k / us / 1e6:.0f} "
                  f"TFLOP/s-equivalent")
            del problem, d


if __name__ == "__main__":
    main()
