"""Inputs for the layer tests (megamoe.layer.MoELayer, megamoe.checkpoint): routed-expert weights in DeepSeek V3's
checkpoint format and a routing of BF16 hidden states."""
from __future__ import annotations

import math

import torch

from megamoe import quant

PREFIX = "model.layers.3.mlp.experts."


def synthetic_experts(num_experts: int, hidden: int, intermediate: int, seed: int,
                      prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down FP8 weights (N(0, 1/K) cast per 128x128) with their weight_scale_inv, CPU."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(num_experts):
        for proj, (n, k) in (("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)),
                             ("down_proj", (hidden, intermediate))):
            q, sf = quant.per_block_cast_to_fp8(torch.randn(n, k, generator=gen) / math.sqrt(k))
            tensors[f"{prefix}{e}.{proj}.weight"] = q
            tensors[f"{prefix}{e}.{proj}.weight_scale_inv"] = sf
    return tensors


def routed_hidden_states(num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int, *,
                         mask_every: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(BF16 hidden states [T, H], int64 top-k ids of randn scores [T, k], softmax float32 weights), CPU; every
    `mask_every`-th token's first slot set to -1."""
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    top = torch.randn(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1)
    idx, weights = top.indices, torch.softmax(top.values, dim=1).float()
    if mask_every:
        idx[::mask_every, 0] = -1
    return hidden_states, idx, weights
