"""Inputs and the reference of the fused kernel across real ranks (the multigpu tier, tests/test_fused_multigpu.py).

Each rank draws only its own tokens and its own local experts' weights (from the case seed and its rank), so no rank
holds the whole model: at DSV4-Pro's 384 experts of 7168 x 3072 the float weights alone are ~100 GB. The reference of
each rank's y is computed where the weights live: every rank gathers every rank's tokens, runs the reference's expert
forward (`reference._expert_forward`, DESIGN section 4) for the rows its local experts receive, in the reference's
(source rank, token, slot) order, and sends each source rank its per-slot outputs as a sum over the ranks in which
each (token, slot) has one non-zero contributor (exact: x + 0 = x); the source rank then combines them in slot order
(`reference._combine`). Collective over the group: every rank calls `reference_y` with its own case.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megamoe import reference as ref
from megamoe.quant import per_block_cast_to_fp8, per_token_cast_to_fp8, random_routing, random_topk_weights
from megamoe.testing.dispatch_combine import RankInputs
from megamoe.weights import WeightPair

ROUTINGS = ("uniform", "masked", "hot_expert")
MASK_PROB = 0.1  # "masked": each slot unused (-1) with this probability
WEIGHT_CHUNK = 16  # experts drawn (in float) at once: bounds the transient float weights


def _generators(seed: int, rank: int, device: torch.device | str) -> tuple[torch.Generator, torch.Generator]:
    """(device generator for the large tensors, CPU generator for the routing) of one rank's draw."""
    stream = seed * 1_000_003 + rank
    return (torch.Generator(device=device).manual_seed(stream), torch.Generator().manual_seed(stream))


def draw_local_weights(seed: int, rank: int, num_local_experts: int, hidden: int, intermediate: int,
                       device: torch.device | str) -> tuple[WeightPair, WeightPair]:
    """This rank's experts as `reference.random_case` draws them (w1 ~ N(0, 1/H), w2 ~ N(0, 1/I), per-block FP8), in
    chunks of WEIGHT_CHUNK experts. Natural layout: ((w1 [E_local, 2I, H], sf), (w2 [E_local, H, I], sf))."""
    gen, _ = _generators(seed, rank, device)
    parts: list[list[Tensor]] = [[], [], [], []]
    for first in range(0, num_local_experts, WEIGHT_CHUNK):
        n = min(WEIGHT_CHUNK, num_local_experts - first)
        w1 = torch.randn(n, 2 * intermediate, hidden, generator=gen, device=device) / math.sqrt(hidden)
        w2 = torch.randn(n, hidden, intermediate, generator=gen, device=device) / math.sqrt(intermediate)
        for i, t in enumerate((*per_block_cast_to_fp8(w1), *per_block_cast_to_fp8(w2))):
            parts[i].append(t)
        del w1, w2
    w1_q, w1_sf, w2_q, w2_sf = (torch.cat(p) for p in parts)
    return (w1_q, w1_sf), (w2_q, w2_sf)


def draw_tokens(seed: int, rank: int, num_tokens: int, num_experts: int, num_topk: int, hidden: int,
                routing: str, device: torch.device | str) -> RankInputs:
    """This rank's tokens: x ~ N(0, 1) cast per token; routing (ROUTINGS): distinct uniform experts; the same with
    slots masked (-1) at MASK_PROB; or slot 0 of every token on one hot expert (the same on every rank: seed %
    num_experts) and the other slots uniform among the rest. Top-k weights positive, each row summing to 1."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen, cpu_gen = _generators(seed, rank, device)
    x, x_sf = per_token_cast_to_fp8(torch.randn(num_tokens, hidden, generator=gen, device=device))
    if routing == "hot_expert":
        hot = seed % num_experts
        rest = random_routing(num_tokens, num_experts - 1, num_topk - 1, generator=cpu_gen)
        rest = rest + (rest >= hot).to(rest.dtype)  # skip the hot expert's id
        topk_idx = torch.cat([torch.full((num_tokens, 1), hot, dtype=torch.int64), rest], dim=1)
    else:
        topk_idx = random_routing(num_tokens, num_experts, num_topk, generator=cpu_gen,
                                  mask_prob=MASK_PROB if routing == "masked" else 0.0)
    topk_weights = random_topk_weights(num_tokens, num_topk, generator=cpu_gen)
    return RankInputs(x, x_sf, topk_idx.to(device), topk_weights.to(device))


def _gather(group: Any, t: Tensor, counts: list[int]) -> list[Tensor]:
    """Every rank's `t` (first dim = its count), padded to the largest count for the collective."""
    import torch.distributed as dist

    padded = torch.zeros((max(max(counts), 1), *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded, group=group)
    return [o[:n] for o, n in zip(out, counts)]


def reference_y(group: Any, rank: int, num_ranks: int, tokens: RankInputs, l1: WeightPair, l2: WeightPair, *,
                activation_clamp: float | None = None, fast_math: bool = True) -> tuple[Tensor, Tensor]:
    """(y_ref bfloat16 [T, H] of this rank's tokens, int32 [E_local]: the rows each local expert receives from every
    rank). l1 / l2: this rank's local experts in the natural layout. Collective over `group` (NCCL or gloo)."""
    import torch.distributed as dist

    device = tokens.x.device
    (w1, w1_sf), (w2, w2_sf) = l1, l2
    num_local, hidden, num_topk = w1.shape[0], tokens.x.shape[1], tokens.topk_idx.shape[1]
    num_experts = num_local * num_ranks
    count = torch.tensor([tokens.x.shape[0]], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(count) for _ in range(num_ranks)]
    dist.all_gather(all_counts, count, group=group)
    counts = [int(c.item()) for c in all_counts]
    xs = [q.view(torch.float8_e4m3fn) for q in _gather(group, tokens.x.view(torch.uint8), counts)]
    x_sfs = _gather(group, tokens.x_sf, counts)
    idxs = _gather(group, tokens.topk_idx, counts)
    weights = _gather(group, tokens.topk_weights, counts)

    routings = [ref._route(idx, num_experts) for idx in idxs]
    slot_outs: list[Tensor | None] = [torch.zeros(n, num_topk, hidden, dtype=torch.bfloat16, device=device)
                                      for n in counts]
    recv = torch.zeros(num_local, dtype=torch.int32, device=device)
    for local in range(num_local):
        expert = rank * num_local + local
        pulled = [(s, *routing.pairs(expert)) for s, routing in enumerate(routings)]
        num_rows = sum(tok.numel() for _, tok, _ in pulled)
        recv[local] = num_rows
        if num_rows == 0:
            continue
        src = torch.cat([torch.stack([torch.full_like(tok, s), tok, slot], dim=1) for s, tok, slot in pulled])
        inter = ref._expert_forward(src, torch.cat([xs[s][tok] for s, tok, _ in pulled]),
                                    torch.cat([x_sfs[s][tok] for s, tok, _ in pulled]),
                                    torch.cat([weights[s][tok, slot] for s, tok, slot in pulled]),
                                    w1[local], w1_sf[local], w2[local], w2_sf[local], activation_clamp, fast_math)
        start = 0
        for s, tok, slot in pulled:
            out = slot_outs[s]
            assert out is not None
            out[tok, slot] = inter.out[start:start + tok.numel()]
            start += tok.numel()
    # Each source rank's per-slot outputs: one rank computed each (token, slot), the others hold zeros
    mine = None
    for s in range(num_ranks):
        out = slot_outs[s]
        assert out is not None
        total = out.float()
        slot_outs[s] = out = None  # freed as the reduces go
        dist.reduce(total, dst=dist.get_global_rank(group, s), group=group)
        if s == rank:
            mine = total.to(torch.bfloat16)
        del total
    assert mine is not None
    return ref._combine(mine, tokens.topk_idx), recv
