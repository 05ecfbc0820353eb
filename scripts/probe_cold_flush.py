"""What the cold-L2 penalty of the fused call is made of (notes/fused.md, "Cold L2 after a write flush"): the call's
config of `megamoe bench fused` (flash shape, seed 0) and the expert-FFN unit kernel on the same rows, timed after the
bench's 256 MB write flush, after a 256 MB read (an L2 without dirty lines), after both, and warm; then the phase
marks of one call after each.

  device:  PYTHONPATH=python python3 scripts/probe_cold_flush.py 8,128,1024"""
from __future__ import annotations

import sys

import torch

from megamoe.bench.fused import FUSED_SHAPES, bench_setup, expected_load, load_routed_inputs, unit_kernel_runner
from megamoe.bench.timing import L2_FLUSH_BYTES, time_queued_us
from megamoe.fused.launch import PHASES
from megamoe.fused.launch import run as fused_run
from megamoe.jit.diagnostics import PhaseTimes


def main(tokens: list[int]) -> None:
    dev = torch.device("cuda")
    spec = FUSED_SHAPES["flash"]
    e, h = spec.num_experts, spec.hidden
    _, l1, l2, buf, write_flush = bench_setup(spec, dev)
    scratch = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=dev).fill_(1.0)
    sink = torch.empty(1, dtype=torch.float32, device=dev)

    def read_flush() -> None:
        """Reads L2_FLUSH_BYTES: evicts what L2 held and leaves no dirty lines behind."""
        torch.sum(scratch, dim=0, out=sink[0])

    def write_read() -> None:
        write_flush()
        read_flush()

    flushes = {"write": write_flush, "read": read_flush, "write+read": write_read, "none": None}
    for t in tokens:
        _, _, idx, _ = load_routed_inputs(buf, spec, t, 0, dev)
        y = torch.empty((t, h), dtype=torch.bfloat16, device=dev)
        expected = expected_load(spec, t)

        def call(**kwargs: object) -> object:
            return fused_run(y, l1, l2, buf, t, expected_tokens_per_expert=expected, **kwargs)

        config = call()
        counts = torch.bincount(idx.flatten(), minlength=e).tolist()
        unit = unit_kernel_runner(buf, spec, config.block_m, counts, (l1, l2))
        for _ in range(2):
            line = []
            for fname, f in flushes.items():
                fused = time_queued_us(call, warmup=3, iters=30, before=f)["median_us"]
                ffn = time_queued_us(unit, warmup=3, iters=30, before=f)["median_us"]
                line.append(f"{fname} {fused:.1f}/{ffn:.1f}")
            print(f"T {t}: fused/FFN " + " | ".join(line), flush=True)
        for fname in ("write", "read", "none"):
            for _ in range(3):  # the marks of the last of three calls
                if flushes[fname] is not None:
                    flushes[fname]()
                timer = PhaseTimes(PHASES, dev)
                call(phase_times=timer)
                torch.cuda.synchronize()
            print(f"T {t} phases after {fname}: {timer.ends_us()}", flush=True)


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1].split(",")])
