"""One launch each of the fused call (overlapped, then phase-serial) and of the expert-FFN unit kernel on the same
rows (flash shape, `megamoe bench fused` routing, seed 0), for `ncu` to compare, e.g. the SM clock under the power cap:

  ncu -k regex:"megamoe_(fused|expert_ffn)" --launch-count 3 --clock-control none --section SpeedOfLight \\
      python3 scripts/ncu_fused_vs_ffn.py 4096"""
from __future__ import annotations

import sys

import torch

from megamoe.bench.fused import FUSED_SHAPES, bench_setup, expected_load, load_routed_inputs, unit_kernel_runner
from megamoe.fused.launch import run as fused_run


def main(num_tokens: int) -> None:
    dev = torch.device("cuda")
    spec = FUSED_SHAPES["flash"]
    _, l1, l2, buf, _ = bench_setup(spec, dev)
    _, _, idx, _ = load_routed_inputs(buf, spec, num_tokens, 0, dev)
    y = torch.empty((num_tokens, spec.hidden), dtype=torch.bfloat16, device=dev)
    expected = expected_load(spec, num_tokens)
    block_m = 0
    for serial in (False, True):
        block_m = fused_run(y, l1, l2, buf, num_tokens, expected_tokens_per_expert=expected, serial=serial).block_m
    counts = torch.bincount(idx.flatten(), minlength=spec.num_experts).tolist()
    unit_kernel_runner(buf, spec, block_m, counts, (l1, l2))()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
