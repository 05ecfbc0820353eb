"""One small fused call for compute-sanitizer (memcheck, racecheck, synccheck): E 8, H 1024, I 512, top-6, T 64 on
8 CTAs, y checked against the reference. Usage on the GPU machine (PYTHONPATH=python, MEGAMOE_TIMEOUT_S large: the
tools slow the spin-waits down):
  compute-sanitizer --tool racecheck python3 scripts/sanitize_fused.py [--expected-tokens-per-expert 8] [--seed S]
(the buffer's default variant is BLOCK_M 128; 8 expected rows per expert pick the decode variant, BLOCK_M 32).
The gpu tier runs it under each tool: tests/test_fused_sanitizers_gpu.py."""
from __future__ import annotations

import argparse

import torch

from megamoe import reference, weights
from megamoe.buffer import allocate
from megamoe.fused import compile_fused, config_for
from megamoe.fused.launch import run
from megamoe.layout import SymmLayout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expected-tokens-per-expert", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="the routing and inputs' draw")
    parser.add_argument("--max-rel-l2", type=float, default=1e-2,
                        help="y's bound against the reference (tests/test_fused_gpu.py: max_y_rel_l2)")
    parser.add_argument("--compile-only", action="store_true", help="build the variant the call launches, no GPU")
    args = parser.parse_args()
    num_tokens, hidden, intermediate, num_experts, num_topk = 64, 1024, 512, 8, 6
    layout = SymmLayout.create(1, num_experts, 128, num_topk, hidden, intermediate)
    if args.compile_only:
        config = config_for(layout, expected_tokens_per_expert=args.expected_tokens_per_expert)
        compile_fused(config)
        print(f"sanitize_fused: {config.name} compiled")
        return
    rc = reference.random_case(num_tokens, hidden, intermediate, num_experts, num_topk, mask_prob=0.1,
                               generator=torch.Generator().manual_seed(args.seed), device="cuda")
    buf = allocate(None, layout, torch.device("cuda"))
    l1, l2 = weights.transform_weights(rc.l1_weights[0], rc.l2_weights[0])
    for name, value in (("x", rc.x[0]), ("x_sf", rc.x_sf[0]), ("topk_idx", rc.topk_idx[0]),
                        ("topk_weights", rc.topk_weights[0])):
        getattr(buf, name)[:num_tokens].copy_(value)
    y = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    config = run(y, l1, l2, buf, num_tokens, num_sms=8, expected_tokens_per_expert=args.expected_tokens_per_expert)
    torch.cuda.synchronize()
    y_ref = reference.moe(rc.x[0], rc.x_sf[0], rc.topk_idx[0], rc.topk_weights[0], rc.l1_weights[0],
                          rc.l2_weights[0], fast_math=True)
    err = reference.rel_l2(y.float(), y_ref.float())
    print(f"sanitize_fused: {config.name} seed {args.seed} y rel-L2 {err:.3e}")
    assert err <= args.max_rel_l2, f"y rel-L2 {err:.3e} > {args.max_rel_l2}"


if __name__ == "__main__":
    main()
