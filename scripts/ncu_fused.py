"""One overlapped fused call of `megamoe bench fused`'s shape (E 32, H 4096, I 2048, top-6, buffer for T_max 4096),
after a warm-up call, for Nsight Compute. Usage on the GPU machine (PYTHONPATH=python):
  ncu -k regex:megamoe_fused --launch-skip 1 --launch-count 1 --section WarpStateStats --section SchedulerStats \
      --section SpeedOfLight python3 scripts/ncu_fused.py 4096 [expected_tokens_per_expert]"""
from __future__ import annotations

import sys

import torch

from megamoe import weights
from megamoe.bench.ffn import ffn_random_weights
from megamoe.bench.fused import FUSED_SHAPES, load_routed_inputs
from megamoe.buffer import allocate
from megamoe.fused.launch import run
from megamoe.layout import SymmLayout


def main() -> None:
    num_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    expected = float(sys.argv[2]) if len(sys.argv) > 2 else None  # None: the buffer's default config
    spec = FUSED_SHAPES["flash"]
    e, h, i, k = spec.num_experts, spec.hidden, spec.intermediate, spec.num_topk
    dev = torch.device("cuda")
    natural = ffn_random_weights(e, h, i, generator=torch.Generator(device=dev).manual_seed(12345), device=dev)
    l1, l2 = weights.transform_weights(*natural)
    buf = allocate(None, SymmLayout.create(1, e, spec.max_tokens, k, h, i), dev)
    load_routed_inputs(buf, spec, num_tokens, 0, dev)
    y = torch.empty(num_tokens, h, dtype=torch.bfloat16, device=dev)
    for _ in range(2):
        run(y, l1, l2, buf, num_tokens, expected_tokens_per_expert=expected)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
