"""Time unit-kernel knob combinations (DispatchCombineConfig fields) on one `megamoe bench comm` case, one process
per visible GPU, each combination on the same buffer and inputs. For choosing the defaults; the targets are judged
by `megamoe bench comm`.

Usage: PYTHONPATH=python python3 scripts/sweep_comm.py --shape 0 --tokens 4096 [--compile-only] \\
           [--knobs 'reduce_vecs=4' 'pull_stages=3,reduce_vecs=4' ...]   (no --knobs: the built-in list)
"""
from __future__ import annotations

import argparse
import sys

import torch

from megamoe.bench import comm as bc
from megamoe.testing.ranks import RankContext, spawn_ranks

DEFAULT_SWEEP = ("", "reduce_vecs=4", "pull_stages=3", "pull_stages=3,reduce_vecs=4", "pull_stages=4",
                 "pull_warps=8,pull_stages=4", "pull_stages=3,reduce_vecs=3")


def parse_knobs(text: str) -> dict[str, object]:
    knobs: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        knobs[key] = value if key in ("combine_store", "reduce") else (value == "True" if value in ("True", "False")
                                                                         else int(value))
    return knobs


def worker(ranks: RankContext, case: bc.CommCase, sweep: list[str], iters: int, phases: bool) -> None:
    """One rank (testing.ranks.spawn_ranks): every knob combination on the same buffer and inputs."""
    import torch.distributed as dist

    import megamoe
    from megamoe.testing import dispatch_combine as dcc

    rank, num_ranks, cpu_group = ranks.rank, ranks.num_ranks, ranks.cpu_group
    shape, layout = case.shape, case.layout(num_ranks)
    counts = [case.tokens if r == rank else 0 for r in range(num_ranks)]
    mine = dcc.random_inputs(layout, counts, "uniform", seed=11 + rank)[rank]
    remote_rows = bc.count_remote_rows(mine.topk_idx, rank, layout.num_local_experts)
    buf = megamoe.get_symm_buffer(ranks.group, shape.num_experts, case.tokens, shape.num_topk, shape.hidden,
                                  shape.intermediate)
    dcc.load_inputs(buf, mine)
    block_m = bc.comm_block_m(case, num_ranks)
    rows: list[tuple[str, float]] = []
    for text in sweep:
        torch.cuda.synchronize()
        dist.barrier(group=cpu_group)
        stats = bc.bench_round_trip(buf, case.tokens, block_m=block_m, knobs=parse_knobs(text), num_warmup=10,
                                    num_iters=iters)
        torch.cuda.synchronize()
        medians: list = [None] * num_ranks
        dist.all_gather_object(medians, stats["median_us"], group=cpu_group)
        rows.append((text or "default", max(medians)))
        if phases:  # one more call with phase timestamps
            from megamoe.jit.diagnostics import PhaseTimes
            from megamoe.kernels import dispatch_combine as dc

            timer = PhaseTimes(dc.PHASES, buf.device)
            y = torch.empty(case.tokens, shape.hidden, dtype=torch.bfloat16, device=buf.device)
            dc.run(buf, case.tokens, y, block_m=block_m, knobs=parse_knobs(text), phase_times=timer)
            torch.cuda.synchronize()
            ends: list = [None] * num_ranks
            dist.all_gather_object(ends, timer.ends_us(), group=cpu_group)
            if rank == 0:
                print(f"  phases of one call, {text or 'default'} (us after the rank's first warp started: earliest "
                      f"end / latest end, per rank):")
                for i, name in enumerate(dc.PHASES):
                    print(f"    {name:18s}" + "".join(f"  r{r} {e[i][1]:7.1f} / {e[i][2]:7.1f}"
                                                     for r, e in enumerate(ends)))
    all_rows: list = [None] * num_ranks
    dist.all_gather_object(all_rows, remote_rows, group=cpu_group)
    if rank == 0:
        dispatch_bytes, combine_bytes = bc.remote_bytes_per_direction(sum(all_rows), num_ranks, shape.hidden)
        print(f"{case.name}, {num_ranks} ranks, BLOCK_M {block_m}, slowest rank's median of {iters}:")
        for text, us in rows:
            print(f"  {text:40s} {us:8.1f} us  {bc.gbps_per_direction(dispatch_bytes, combine_bytes, us):6.1f} GB/s")
        sys.stdout.flush()
    buf.destroy()
    dist.barrier(group=cpu_group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=int, default=0, help="index into megamoe.bench.comm.COMM_SHAPES")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--knobs", nargs="*", default=list(DEFAULT_SWEEP))
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--phases", action="store_true", help="also time the kernel's phases in one call")
    args = parser.parse_args()
    from megamoe.kernels import dispatch_combine as dc

    case = bc.CommCase(bc.COMM_SHAPES[args.shape], args.tokens)
    for text in args.knobs:  # compile here (cache hits on the device when carried)
        dc.compile_kernel(dc.DispatchCombineConfig(case.layout(args.ranks), bc.comm_block_m(case, args.ranks),
                                                   **parse_knobs(text)))
    if args.compile_only:
        return
    spawn_ranks(args.ranks, worker, case, args.knobs, args.iters, args.phases, what="sweep_comm")


if __name__ == "__main__":
    main()
