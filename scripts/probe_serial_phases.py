"""Where the fused call's GEMM phases lose against the expert-FFN unit kernel at prefill (notes/fused.md): the call's
config overlapped and phase-serial (every pool block pulled before the first tile), cold and warm medians and the
warm phase marks, beside the unit kernel on the same rows (flash shape, `megamoe bench fused` routing).

  device:  PYTHONPATH=python python3 scripts/probe_serial_phases.py 1024,4096"""
from __future__ import annotations

import sys

import torch

from megamoe.bench.fused import FUSED_SHAPES, bench_setup, expected_load, load_routed_inputs, unit_kernel_runner
from megamoe.bench.timing import time_queued_us
from megamoe.fused.launch import PHASES
from megamoe.fused.launch import run as fused_run
from megamoe.jit.diagnostics import PhaseTimes


def main(tokens: list[int], seeds: list[int]) -> None:
    dev = torch.device("cuda")
    spec = FUSED_SHAPES["flash"]
    e, h = spec.num_experts, spec.hidden
    _, l1, l2, buf, flush = bench_setup(spec, dev)
    for t in tokens:
        for seed in seeds:
            _, _, idx, _ = load_routed_inputs(buf, spec, t, seed, dev)
            y = torch.empty((t, h), dtype=torch.bfloat16, device=dev)
            expected = expected_load(spec, t)
            block_m = 0
            for serial in (False, True, False, True):
                def call(**kwargs: object) -> object:
                    return fused_run(y, l1, l2, buf, t, expected_tokens_per_expert=expected, serial=serial,
                                     **kwargs)

                block_m = call().block_m
                cold = time_queued_us(call, warmup=3, iters=20, before=flush)["median_us"]
                warm = time_queued_us(call, warmup=3, iters=20)["median_us"]
                for _ in range(3):  # the marks of the last of three calls
                    timer = PhaseTimes(PHASES, dev)
                    call(phase_times=timer)
                torch.cuda.synchronize()
                marks = " ".join(f"{n}={lo:.0f}/{hi:.0f}" for n, lo, hi in timer.ends_us())
                print(f"T {t} seed {seed} {'serial' if serial else 'overlapped'}: cold {cold:.1f} warm {warm:.1f} | "
                      f"{marks}", flush=True)
            counts = torch.bincount(idx.flatten(), minlength=e).tolist()
            unit = unit_kernel_runner(buf, spec, block_m, counts, (l1, l2))
            cold = time_queued_us(unit, warmup=3, iters=20, before=flush)["median_us"]
            warm = time_queued_us(unit, warmup=3, iters=20)["median_us"]
            print(f"T {t} seed {seed} expert-FFN unit kernel: cold {cold:.1f} warm {warm:.1f}", flush=True)


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1].split(",")], [0, 1])
