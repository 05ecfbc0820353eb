"""The numerical contract of DESIGN section 4, computed on the host or the GPU (device follows the inputs).

Weights are the natural, pre-transform ones (gate rows [0, I), up rows [I, 2I) of w1). Exactness choices:

- A block dot (128 K for L1, 64 K for L2) of FP8 values is computed in float64, where it is exact (each product
  of two e4m3 values is a multiple of 2^-18 below 2^18, so a sum of <= 2^16 of them needs < 53 bits), then
  rounded once to fp32: the correctly rounded `dot_fp32`, independent of the order of summation and of which
  other rows share the batch. Hence the reference is bitwise invariant under token permutation, expert
  relabelling and rank splitting.
- Promotion: `acc += partial * (a_sf * b_sf)` in fp32, blocks in increasing K order (the scales are multiplied
  first, as the kernel does). With power-of-two scales the order of the two multiplies does not matter.
- Activation, requant, combine: exactly the formulas of section 4 in fp32 (`quant.requant_per64`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .quant import (
    BLOCK,
    REQUANT_GROUP,
    dequant_per_block,
    dequant_per_token,
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
    random_pow2_scales,
    random_routing,
    random_small_int_fp8,
    random_topk_weights,
    requant_per64,
)
from .weights import WeightPair, WeightShapes, validate_weights

__all__ = [
    "ExpertIntermediates",
    "MoeCase",
    "RankIntermediates",
    "block_scaled_matmul",
    "moe",
    "moe_fp32",
    "random_case",
    "rel_l2",
    "swiglu",
]

_FP8 = torch.float8_e4m3fn
# Upper bound on the float64 block partials held at once by block_scaled_matmul (elements): 256 MiB.
_PARTIAL_BUDGET = 1 << 25


@dataclass(frozen=True)
class ExpertIntermediates:
    """What one local expert received and computed, rows in canonical order sorted by (src_rank, token, slot)."""

    src: Tensor          # int64 [n, 3]: (source rank, token, slot)
    x: Tensor            # float8_e4m3fn [n, H], the pulled tokens
    x_sf: Tensor         # float32 [n, H/128]
    topk_weight: Tensor  # float32 [n]
    l1_acc: Tensor       # float32 [n, 2I]: pre-transform row order, after promotion, before the activation
    act: Tensor          # float32 [n, I]: v = silu(gate) * up * topk_weight
    l2_act: Tensor       # float8_e4m3fn [n, I]
    l2_act_sf: Tensor    # float32 [n, I/64]
    out: Tensor          # bfloat16 [n, H]: the per-slot L2 output sent to the source rank


@dataclass(frozen=True)
class RankIntermediates:
    """One rank's result: its output `y` and, per local expert, the received rows and their intermediates."""

    y: Tensor                   # bfloat16 [T, H]
    num_recv_per_expert: Tensor  # int64 [E_local]
    experts: tuple[ExpertIntermediates, ...]


# ---------------------------------------------------------------------------------------------------------------
# Math shared by the quantized and the fp32 reference
# ---------------------------------------------------------------------------------------------------------------


def rel_l2(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64 (b is the reference); 0 when both are all zero, inf when only b is."""
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a64, b64 = a.double(), b.to(a.device).double()
    num = torch.linalg.vector_norm(a64 - b64).item()
    den = torch.linalg.vector_norm(b64).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def block_scaled_matmul(a_q: Tensor, a_sf: Tensor, b_q: Tensor, b_sf: Tensor, group: int) -> Tensor:
    """fp32 [M, N] = sum over K groups g, in order, of fp32(dot(a_q[m, g], b_q[n, g])) * (a_sf[m, g] * b_sf[n, g]).

    a_q float8_e4m3fn [M, K], a_sf float32 [M, K/group], b_q float8_e4m3fn [N, K], b_sf float32 [N, K/group] (one
    scale per row of b and group: expand block scales before calling). The dots are exact (float64) and rounded
    once to fp32; the promotion is fp32, accumulated over g in increasing order.
    """
    for name, t, dtype in (("a_q", a_q, _FP8), ("a_sf", a_sf, torch.float32), ("b_q", b_q, _FP8),
                           ("b_sf", b_sf, torch.float32)):
        _check_tensor(name, t, dtype)
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    m, k = a_q.shape
    n = b_q.shape[0]
    num_groups = k // group
    if b_q.shape[1] != k or k % group != 0:
        raise ValueError(f"a_q [M, K] and b_q [N, K] need equal K divisible by {group}, got "
                         f"{tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if tuple(a_sf.shape) != (m, num_groups) or tuple(b_sf.shape) != (n, num_groups):
        raise ValueError(f"a_sf must be {(m, num_groups)} and b_sf {(n, num_groups)}, got {tuple(a_sf.shape)} "
                         f"and {tuple(b_sf.shape)}")
    out = torch.zeros((m, n), dtype=torch.float32, device=a_q.device)
    if m == 0 or n == 0:
        return out
    b64 = b_q.to(torch.float64).reshape(n, num_groups, group).permute(1, 2, 0)  # [G, group, N]
    chunk = max(1, _PARTIAL_BUDGET // (num_groups * n))
    for start in range(0, m, chunk):
        rows = slice(start, min(m, start + chunk))
        a64 = a_q[rows].to(torch.float64).reshape(-1, num_groups, group).transpose(0, 1)  # [G, rows, group]
        partials = torch.bmm(a64, b64).to(torch.float32)  # [G, rows, N], each an exact dot rounded once
        partials *= a_sf[rows].t()[:, :, None] * b_sf.t()[:, None, :]  # times (a_sf * b_sf), one fp32 rounding
        acc = out[rows]
        for g in range(num_groups):
            acc += partials[g]
    return out


def swiglu(h: Tensor, topk_weight: Tensor, *, activation_clamp: float | None = None,
           fast_math: bool = False) -> Tensor:
    """v = silu(gate) * up * topk_weight in fp32 for h = [gate | up] of shape [n, 2I]; `topk_weight` is [n].

    With a clamp c: gate = min(gate, c), up = clamp(up, -c, c). Default: gate * sigmoid(gate) * up * w.
    fast_math: gate / (1 + exp(-gate)) * up * w, the formula the kernel evaluates with __expf and an approximate
    reciprocal (those differ from this by a few ulps).
    """
    intermediate = h.shape[1] // 2
    gate, up = h[:, :intermediate].float(), h[:, intermediate:].float()
    if activation_clamp is not None:
        gate = torch.clamp(gate, max=activation_clamp)
        up = torch.clamp(up, -activation_clamp, activation_clamp)
    silu = gate / (1.0 + torch.exp(-gate)) if fast_math else gate * torch.sigmoid(gate)
    return silu * up * topk_weight.float()[:, None]


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


def _check_tensor(name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...] | None = None,
                  device: torch.device | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of x), got {t.device}")
    return t


def _check_routing(label: str, topk_idx: object, topk_weights: object, num_tokens: int, num_experts: int,
                   device: torch.device, num_topk: int | None = None) -> int:
    """Validate topk_idx int64 [T, topk] in [-1, E) and topk_weights float32 [T, topk]; return topk."""
    idx = _check_tensor(f"topk_idx{label}", topk_idx, torch.int64, device=device)
    if idx.dim() != 2 or idx.shape[0] != num_tokens or idx.shape[1] < 1:
        raise ValueError(f"topk_idx{label} must have shape ({num_tokens}, topk >= 1), got {tuple(idx.shape)}")
    if num_topk is not None and idx.shape[1] != num_topk:
        raise ValueError(f"topk_idx{label} must have topk = {num_topk} like rank 0, got {idx.shape[1]}")
    _check_tensor(f"topk_weights{label}", topk_weights, torch.float32, tuple(idx.shape), device)
    if idx.numel() > 0:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"topk_idx{label} values must be in [-1, {num_experts}) (num_experts = {num_experts}), "
                             f"got range [{lo}, {hi}]")
    return idx.shape[1]


@dataclass(frozen=True)
class _Rank:
    x: Tensor
    x_sf: Tensor
    topk_idx: Tensor
    topk_weights: Tensor
    w1: Tensor
    w1_sf: Tensor
    w2: Tensor
    w2_sf: Tensor
    stats: Tensor | None


def _as_list(name: str, value: object, num_ranks: int) -> list:
    if not isinstance(value, (list, tuple)) or len(value) != num_ranks:
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else \
            type(value).__name__
        raise TypeError(f"{name} must be a list of {num_ranks} entries (one per rank, like x), got {got}")
    return list(value)


def _collect_ranks(x: object, x_sf: object, topk_idx: object, topk_weights: object, l1_weights: object,
                   l2_weights: object, stats: object, activation_clamp: float | None) -> tuple[list[_Rank], int]:
    """Validate the arguments of `moe` (single- or multi-rank) and return (ranks, num_experts)."""
    if activation_clamp is not None and not (isinstance(activation_clamp, (int, float)) and activation_clamp > 0):
        raise ValueError(f"activation_clamp must be None or a number > 0, got {activation_clamp!r}")
    multi = not isinstance(x, Tensor)
    if multi:
        if not isinstance(x, (list, tuple)):
            raise TypeError(f"x must be a Tensor (single rank) or a list of Tensors (one per rank), got "
                            f"{type(x).__name__}")
        xs = list(x)
        num_ranks = len(xs)
        if num_ranks == 0:
            raise ValueError("x must hold at least one rank's tokens, got an empty list")
        x_sfs = _as_list("x_sf", x_sf, num_ranks)
        idxs = _as_list("topk_idx", topk_idx, num_ranks)
        ws = _as_list("topk_weights", topk_weights, num_ranks)
        l1s = _as_list("l1_weights", l1_weights, num_ranks)
        l2s = _as_list("l2_weights", l2_weights, num_ranks)
        statss = [None] * num_ranks if stats is None else _as_list("cumulative_local_expert_recv_stats", stats,
                                                                    num_ranks)
    else:
        xs, x_sfs, idxs, ws, l1s, l2s, statss = [x], [x_sf], [topk_idx], [topk_weights], [l1_weights], \
            [l2_weights], [stats]
        num_ranks = 1
    shapes: WeightShapes | None = None
    num_topk: int | None = None
    ranks: list[_Rank] = []
    for r in range(num_ranks):
        label = f"[{r}]" if multi else ""
        rank_shapes = validate_weights(l1s[r], l2s[r], require_contiguous=False, label=label)
        if shapes is None:
            shapes = rank_shapes
        elif (rank_shapes.num_local_experts, rank_shapes.hidden, rank_shapes.intermediate) != \
                (shapes.num_local_experts, shapes.hidden, shapes.intermediate):
            raise ValueError(f"l1_weights{label}/l2_weights{label} must have E_local={shapes.num_local_experts}, "
                             f"hidden={shapes.hidden}, intermediate={shapes.intermediate} like rank 0, got "
                             f"{rank_shapes.num_local_experts}, {rank_shapes.hidden}, {rank_shapes.intermediate}")
        num_experts = shapes.num_local_experts * num_ranks
        xr = _check_tensor(f"x{label}", xs[r], _FP8)
        if xr.dim() != 2 or xr.shape[1] != shapes.hidden:
            raise ValueError(f"x{label} must have shape (T, {shapes.hidden}), got {tuple(xr.shape)}")
        num_tokens = xr.shape[0]
        _check_tensor(f"x_sf{label}", x_sfs[r], torch.float32, (num_tokens, shapes.hidden // BLOCK), xr.device)
        num_topk = _check_routing(label, idxs[r], ws[r], num_tokens, num_experts, xr.device, num_topk)
        if statss[r] is not None:
            _check_tensor(f"cumulative_local_expert_recv_stats{label}", statss[r], torch.int32,
                          (shapes.num_local_experts,))
        (w1, w1_sf), (w2, w2_sf) = l1s[r], l2s[r]
        ranks.append(_Rank(xr, x_sfs[r], idxs[r], ws[r], w1, w1_sf, w2, w2_sf, statss[r]))
    assert shapes is not None
    return ranks, shapes.num_local_experts * num_ranks


# ---------------------------------------------------------------------------------------------------------------
# The quantized reference
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Routing:
    """A source rank's valid (token, slot) pairs grouped by expert, (token, slot) ascending inside each group."""

    positions: Tensor  # int64 [P]: flat index t * topk + j, sorted by (expert, t, j); -1 slots last
    offsets: list[int]  # [E + 1] start of each expert's group in `positions`
    num_topk: int

    def pairs(self, expert: int) -> tuple[Tensor, Tensor]:
        pos = self.positions[self.offsets[expert]:self.offsets[expert + 1]]
        return pos // self.num_topk, pos % self.num_topk


def _route(topk_idx: Tensor, num_experts: int) -> _Routing:
    flat = topk_idx.flatten()
    key = torch.where(flat >= 0, flat, num_experts)
    positions = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    return _Routing(positions, offsets, topk_idx.shape[1])


def _l1_scales(w1_sf: Tensor) -> Tensor:
    """Per-row L1 weight scales [2I, H/128]: row n takes w1_sf[n // 128]."""
    return w1_sf.repeat_interleave(BLOCK, dim=0)


def _l2_scales(w2_sf: Tensor) -> Tensor:
    """Per-row, per-64-K L2 weight scales [H, I/64]: (n, g) takes w2_sf[n // 128, g // 2]."""
    return w2_sf.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK // REQUANT_GROUP, dim=1)


def _expert_forward(src: Tensor, x: Tensor, x_sf: Tensor, topk_weight: Tensor, w1: Tensor, w1_sf: Tensor,
                    w2: Tensor, w2_sf: Tensor, activation_clamp: float | None,
                    fast_math: bool) -> ExpertIntermediates:
    """L1 GEMM + promotion, SwiGLU x weight, per-64 requant, L2 GEMM + promotion, BF16, for one expert's rows."""
    l1_acc = block_scaled_matmul(x, x_sf, w1, _l1_scales(w1_sf), BLOCK)
    act = swiglu(l1_acc, topk_weight, activation_clamp=activation_clamp, fast_math=fast_math)
    l2_act, l2_act_sf = requant_per64(act)
    out = block_scaled_matmul(l2_act, l2_act_sf, w2, _l2_scales(w2_sf), REQUANT_GROUP).to(torch.bfloat16)
    return ExpertIntermediates(src, x, x_sf, topk_weight, l1_acc, act, l2_act, l2_act_sf, out)


def _combine(slot_out: Tensor, topk_idx: Tensor) -> Tensor:
    """y[t] = bf16(sum over valid slots j, in slot order, of fp32(slot_out[t, j])); no valid slot gives 0."""
    acc = torch.zeros(slot_out.shape[0], slot_out.shape[2], dtype=torch.float32, device=slot_out.device)
    for j in range(slot_out.shape[1]):
        acc = torch.where((topk_idx[:, j] >= 0)[:, None], acc + slot_out[:, j].float(), acc)
    return acc.to(torch.bfloat16)


def _moe_ranks(ranks: list[_Rank], num_experts: int, activation_clamp: float | None,
               fast_math: bool) -> list[RankIntermediates]:
    num_local = num_experts // len(ranks)
    hidden = ranks[0].x.shape[1]
    routings = [_route(rk.topk_idx, num_experts) for rk in ranks]
    slot_outs = [torch.zeros(rk.topk_idx.shape[0], rk.topk_idx.shape[1], hidden, dtype=torch.bfloat16,
                             device=rk.x.device) for rk in ranks]
    per_rank_experts: list[list[ExpertIntermediates]] = [[] for _ in ranks]
    for expert in range(num_experts):
        owner = ranks[expert // num_local]
        local = expert % num_local
        dev = owner.w1.device
        # Pull this expert's pairs from every source rank, in (src_rank, token, slot) order.
        pulled = [(s, *routing.pairs(expert)) for s, routing in enumerate(routings)]
        src = torch.cat([torch.stack([torch.full_like(tok, s), tok, slot], dim=1).to(dev) for s, tok, slot in pulled])
        x = torch.cat([ranks[s].x[tok].to(dev) for s, tok, _ in pulled])
        x_sf = torch.cat([ranks[s].x_sf[tok].to(dev) for s, tok, _ in pulled])
        weight = torch.cat([ranks[s].topk_weights[tok, slot].to(dev) for s, tok, slot in pulled])
        inter = _expert_forward(src, x, x_sf, weight, owner.w1[local], owner.w1_sf[local], owner.w2[local],
                                owner.w2_sf[local], activation_clamp, fast_math)
        # Scatter the per-slot outputs back to their source ranks.
        start = 0
        for s, tok, slot in pulled:
            stop = start + tok.numel()
            slot_outs[s][tok, slot] = inter.out[start:stop].to(slot_outs[s].device)
            start = stop
        per_rank_experts[expert // num_local].append(inter)
    results = []
    for rk, slot_out, experts in zip(ranks, slot_outs, per_rank_experts):
        counts = torch.tensor([e.src.shape[0] for e in experts], dtype=torch.int64, device=rk.w1.device)
        if rk.stats is not None:
            rk.stats.add_(counts.to(device=rk.stats.device, dtype=torch.int32))
        results.append(RankIntermediates(_combine(slot_out, rk.topk_idx), counts, tuple(experts)))
    return results


def moe(x: Tensor | Sequence[Tensor], x_sf: Tensor | Sequence[Tensor], topk_idx: Tensor | Sequence[Tensor],
        topk_weights: Tensor | Sequence[Tensor], l1_weights: WeightPair | Sequence[WeightPair],
        l2_weights: WeightPair | Sequence[WeightPair], *, activation_clamp: float | None = None,
        fast_math: bool = False, cumulative_local_expert_recv_stats: Tensor | Sequence[Tensor | None] | None = None,
        return_intermediates: bool = False) -> Tensor | list[Tensor] | RankIntermediates | list[RankIntermediates]:
    """The FP8 MoE of DESIGN section 4 on natural (pre-transform) weights.

    Single rank: x float8_e4m3fn [T, H], x_sf float32 [T, H/128], topk_idx int64 [T, topk] (-1 = unused slot),
    topk_weights float32 [T, topk], l1_weights = (w1 [E, 2I, H], w1_sf [E, 2I/128, H/128]), l2_weights =
    (w2 [E, H, I], w2_sf [E, H/128, I/128]); returns y bfloat16 [T, H].
    Multi-rank: x, x_sf, topk_idx, topk_weights, l1_weights, l2_weights (and the stats, if given) are lists with
    one entry per rank; expert e lives on rank e // E_local; returns a list of y.
    `cumulative_local_expert_recv_stats` (int32 [E_local] per rank) gets += the rows each local expert received.
    `return_intermediates=True` returns `RankIntermediates` (holding y) instead of y, per rank.
    fast_math uses exp-based SiLU (see `swiglu`).
    """
    ranks, num_experts = _collect_ranks(x, x_sf, topk_idx, topk_weights, l1_weights, l2_weights,
                                        cumulative_local_expert_recv_stats, activation_clamp)
    results = _moe_ranks(ranks, num_experts, activation_clamp, bool(fast_math))
    if not return_intermediates:
        ys = [res.y for res in results]
        return ys[0] if isinstance(x, Tensor) else ys
    return results[0] if isinstance(x, Tensor) else results


# ---------------------------------------------------------------------------------------------------------------
# The unquantized fp32 MoE (single rank): measures the FP8 recipe's own error
# ---------------------------------------------------------------------------------------------------------------


def moe_fp32(x_float: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1_float: Tensor, w2_float: Tensor, *,
             activation_clamp: float | None = None) -> Tensor:
    """float32 [T, H]: the same MoE with no quantization (x [T, H], w1 [E, 2I, H], w2 [E, H, I], any float)."""
    for name, t in (("x_float", x_float), ("w1_float", w1_float), ("w2_float", w2_float)):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == _FP8:
            raise TypeError(f"{name} must be a float32/bfloat16/float16/float64 tensor, got "
                            f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    if x_float.dim() != 2:
        raise ValueError(f"x_float must be 2-D [T, H], got shape {tuple(x_float.shape)}")
    num_tokens, hidden = x_float.shape
    if w1_float.dim() != 3 or w1_float.shape[2] != hidden or w1_float.shape[1] % 2 != 0:
        raise ValueError(f"w1_float must have shape (E, 2I, {hidden}), got {tuple(w1_float.shape)}")
    num_experts, intermediate = w1_float.shape[0], w1_float.shape[1] // 2
    if tuple(w2_float.shape) != (num_experts, hidden, intermediate):
        raise ValueError(f"w2_float must have shape {(num_experts, hidden, intermediate)}, got "
                         f"{tuple(w2_float.shape)}")
    if activation_clamp is not None and not (isinstance(activation_clamp, (int, float)) and activation_clamp > 0):
        raise ValueError(f"activation_clamp must be None or a number > 0, got {activation_clamp!r}")
    _check_routing("", topk_idx, topk_weights, num_tokens, num_experts, x_float.device)
    routing = _route(topk_idx, num_experts)
    y = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x_float.device)
    for expert in range(num_experts):
        tok, slot = routing.pairs(expert)
        if tok.numel() == 0:
            continue
        h = x_float[tok].float() @ w1_float[expert].float().t()
        act = swiglu(h, topk_weights[tok, slot], activation_clamp=activation_clamp)
        y.index_add_(0, tok, act @ w2_float[expert].float().t())
    return y


# ---------------------------------------------------------------------------------------------------------------
# Random cases
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeCase:
    """Per-rank quantized inputs and natural weights, plus their float originals.

    For a float case `x_float`/`w1_float`/`w2_float` are the unquantized tensors the FP8 ones came from; for a
    small-integer case they are the exact dequantized values. Expert ids in `topk_idx` are global.
    """

    x: list[Tensor]
    x_sf: list[Tensor]
    topk_idx: list[Tensor]
    topk_weights: list[Tensor]
    l1_weights: list[WeightPair]
    l2_weights: list[WeightPair]
    x_float: list[Tensor]
    w1_float: Tensor  # [E, 2I, H], all experts
    w2_float: Tensor  # [E, H, I]

    @property
    def num_ranks(self) -> int:
        return len(self.x)

    def merged(self) -> MoeCase:
        """The same tokens and experts on one rank: tokens concatenated in rank order, all experts local."""
        def cat_pairs(pairs: list[WeightPair]) -> WeightPair:
            return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])

        return replace(self, x=[torch.cat(self.x)], x_sf=[torch.cat(self.x_sf)], topk_idx=[torch.cat(self.topk_idx)],
                       topk_weights=[torch.cat(self.topk_weights)], l1_weights=[cat_pairs(self.l1_weights)],
                       l2_weights=[cat_pairs(self.l2_weights)], x_float=[torch.cat(self.x_float)])


def random_case(num_tokens: int | Sequence[int], hidden: int, intermediate: int, num_experts: int, num_topk: int,
                *, num_ranks: int = 1, mask_prob: float = 0.0, small_int: bool = False,
                generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> MoeCase:
    """Fresh random inputs for `moe` (num_tokens per rank: one int for all or a list).

    Float case: x ~ N(0, 1), w1 ~ N(0, 1/H), w2 ~ N(0, 1/I), quantized with `per_token_cast_to_fp8` and
    `per_block_cast_to_fp8`. small_int: FP8 values from `random_small_int_fp8` with `random_pow2_scales`
    (DESIGN section 4, check 0). Routing from `random_routing`, weights from `random_topk_weights`.
    """
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be a multiple of num_ranks={num_ranks}, got {num_experts}")
    tokens = [num_tokens] * num_ranks if isinstance(num_tokens, int) else list(num_tokens)
    if len(tokens) != num_ranks:
        raise ValueError(f"num_tokens must be an int or a list of num_ranks={num_ranks} ints, got {num_tokens!r}")
    gen_dev = torch.device("cpu") if generator is None else generator.device

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=generator, device=gen_dev).to(device)

    if small_int:
        def fp8(*shape: int) -> Tensor:
            return random_small_int_fp8(shape, generator=generator, device=device)

        def scales(*shape: int) -> Tensor:
            return random_pow2_scales(shape, generator=generator, device=device)

        w1_q, w1_sf = fp8(num_experts, 2 * intermediate, hidden), scales(num_experts, 2 * intermediate // BLOCK,
                                                                           hidden // BLOCK)
        w2_q, w2_sf = fp8(num_experts, hidden, intermediate), scales(num_experts, hidden // BLOCK,
                                                                     intermediate // BLOCK)
        w1_float, w2_float = dequant_per_block(w1_q, w1_sf), dequant_per_block(w2_q, w2_sf)
        xs = [(fp8(t, hidden), scales(t, hidden // BLOCK)) for t in tokens]
        x_float = [dequant_per_token(q, sf) for q, sf in xs]
    else:
        w1_float = randn(num_experts, 2 * intermediate, hidden) / math.sqrt(hidden)
        w2_float = randn(num_experts, hidden, intermediate) / math.sqrt(intermediate)
        (w1_q, w1_sf), (w2_q, w2_sf) = per_block_cast_to_fp8(w1_float), per_block_cast_to_fp8(w2_float)
        x_float = [randn(t, hidden) for t in tokens]
        xs = [per_token_cast_to_fp8(xf) for xf in x_float]
    num_local = num_experts // num_ranks
    local = [slice(r * num_local, (r + 1) * num_local) for r in range(num_ranks)]
    return MoeCase(
        x=[q for q, _ in xs], x_sf=[sf for _, sf in xs],
        topk_idx=[random_routing(t, num_experts, num_topk, mask_prob=mask_prob, generator=generator, device=device)
                  for t in tokens],
        topk_weights=[random_topk_weights(t, num_topk, generator=generator, device=device) for t in tokens],
        l1_weights=[(w1_q[s].contiguous(), w1_sf[s].contiguous()) for s in local],
        l2_weights=[(w2_q[s].contiguous(), w2_sf[s].contiguous()) for s in local],
        x_float=x_float, w1_float=w1_float, w2_float=w2_float,
    )
