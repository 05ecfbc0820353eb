"""FP8 (e4m3) quantization of DESIGN section 4, and the random generators the tests share.

Every function follows the device of its inputs (CPU or CUDA). Scale factors are plain float32 (never UE8M0).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "FP8_MAX",
    "REQUANT_GROUP",
    "SF_EPS",
    "dequant_per_block",
    "dequant_per_token",
    "fp8_e4m3_satfinite",
    "per_block_cast_to_fp8",
    "per_token_cast_to_fp8",
    "random_pow2_scales",
    "random_routing",
    "random_small_int_fp8",
    "random_topk_weights",
    "requant_per64",
]

FP8_MAX = 448.0
BLOCK = 128
REQUANT_GROUP = 64
# Lower bound of the amax before it becomes a scale: an all-zero group gets sf = SF_EPS / FP8_MAX and zero codes.
SF_EPS = 1e-10

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FP8 = torch.float8_e4m3fn


def _check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float32/bfloat16/float16/float64), got {t.dtype}")


def _check_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def _check_divisible(name: str, size: int, group: int) -> None:
    if size % group != 0:
        raise ValueError(f"{name} must be a multiple of {group}, got {size}")


def fp8_e4m3_satfinite(v: Tensor) -> Tensor:
    """Round to nearest even into float8_e4m3fn, saturating to +-448 (inf too); NaN stays NaN.

    Same as PTX `cvt.rn.satfinite.e4m3x2.f32`. The clamp runs in float32 before the cast, because a plain torch
    cast is not guaranteed to saturate.
    """
    _check_float("v", v)
    return torch.clamp(v.float(), -FP8_MAX, FP8_MAX).to(_FP8)


def _scales_from_amax(amax: Tensor) -> tuple[Tensor, Tensor]:
    """(sf, inv) for a float32 amax: a = max(amax, 1e-10), sf = a / 448, inv = 448 / a (IEEE fp32 divisions).

    `448.0 / a` in torch is `a.reciprocal() * 448` (two roundings, differs in about a quarter of the cases), so
    both quotients are true tensor divisions.
    """
    a = torch.clamp_min(amax.float(), SF_EPS)
    sf = torch.div(a, a.new_tensor(FP8_MAX))
    inv = torch.div(a.new_tensor(FP8_MAX), a)
    return sf, inv


def _quantize_groups(v: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Quantize the last dimension of `v` in groups of `group` columns: (e4m3 [..., K], f32 [..., K/group])."""
    v = v.float()
    grouped = v.unflatten(-1, (v.shape[-1] // group, group))
    sf, inv = _scales_from_amax(grouped.abs().amax(dim=-1))
    q = fp8_e4m3_satfinite(grouped * inv.unsqueeze(-1))
    return q.flatten(-2), sf


def per_token_cast_to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per 1x128 block of `x` [T, H]: sf = max(amax, 1e-10) / 448, q = satfinite(x * (448 / a)).

    Returns (e4m3 [T, H], float32 [T, H/128]).
    """
    _check_float("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    _check_divisible("x.shape[1] (hidden)", x.shape[1], BLOCK)
    return _quantize_groups(x, BLOCK)


def per_block_cast_to_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per 128x128 block of `w` [..., N, K], same formula as `per_token_cast_to_fp8`.

    Returns (e4m3 [..., N, K], float32 [..., N/128, K/128]).
    """
    _check_float("w", w)
    if w.dim() < 2:
        raise ValueError(f"w must have at least 2 dims [..., N, K], got shape {tuple(w.shape)}")
    n, k = w.shape[-2], w.shape[-1]
    _check_divisible("w.shape[-2] (N)", n, BLOCK)
    _check_divisible("w.shape[-1] (K)", k, BLOCK)
    if w.dim() > 2:
        # One [N, K] matrix at a time: the temporaries of a whole expert stack (e.g. 256 x 4096 x 7168 fp32, 30 GB
        # each) do not fit beside it on an 80 GB GPU; every block is quantized on its own, so the result is the same
        flat = w.reshape(-1, n, k)
        q = torch.empty(flat.shape, dtype=_FP8, device=w.device)
        sf = torch.empty(flat.shape[0], n // BLOCK, k // BLOCK, dtype=torch.float32, device=w.device)
        for i in range(flat.shape[0]):
            q[i], sf[i] = per_block_cast_to_fp8(flat[i])
        return q.view(w.shape), sf.view(*w.shape[:-2], n // BLOCK, k // BLOCK)
    blocks = w.float().unflatten(-1, (k // BLOCK, BLOCK)).unflatten(-3, (n // BLOCK, BLOCK))
    # blocks: [N/128, 128, K/128, 128]
    sf, inv = _scales_from_amax(blocks.abs().amax(dim=(-3, -1)))
    q = fp8_e4m3_satfinite(blocks * inv[..., :, None, :, None])
    return q.flatten(-2).flatten(-3, -2), sf


def dequant_per_token(q: Tensor, sf: Tensor, group: int = BLOCK) -> Tensor:
    """float32 q[..., k] * sf[..., k // group]; `group` is 128 for inputs, 64 (REQUANT_GROUP) for the L1 output."""
    _check_dtype("q", q, _FP8)
    _check_dtype("sf", sf, torch.float32)
    _check_divisible("q.shape[-1]", q.shape[-1], group)
    expected = (*q.shape[:-1], q.shape[-1] // group)
    if tuple(sf.shape) != expected:
        raise ValueError(f"sf must have shape {expected} for q of shape {tuple(q.shape)}, got {tuple(sf.shape)}")
    grouped = q.float().unflatten(-1, (q.shape[-1] // group, group))
    return (grouped * sf.unsqueeze(-1)).flatten(-2)


def dequant_per_block(q: Tensor, sf: Tensor) -> Tensor:
    """float32 q[..., n, k] * sf[..., n // 128, k // 128]."""
    _check_dtype("q", q, _FP8)
    _check_dtype("sf", sf, torch.float32)
    if q.dim() < 2:
        raise ValueError(f"q must have at least 2 dims [..., N, K], got shape {tuple(q.shape)}")
    n, k = q.shape[-2], q.shape[-1]
    _check_divisible("q.shape[-2] (N)", n, BLOCK)
    _check_divisible("q.shape[-1] (K)", k, BLOCK)
    expected = (*q.shape[:-2], n // BLOCK, k // BLOCK)
    if tuple(sf.shape) != expected:
        raise ValueError(f"sf must have shape {expected} for q of shape {tuple(q.shape)}, got {tuple(sf.shape)}")
    blocks = q.float().unflatten(-1, (k // BLOCK, BLOCK)).unflatten(-3, (n // BLOCK, BLOCK))
    return (blocks * sf[..., :, None, :, None]).flatten(-2).flatten(-3, -2)


def requant_per64(v: Tensor) -> tuple[Tensor, Tensor]:
    """The L1 -> L2 requant of DESIGN section 4, per row and per 64 columns of `v` [M, I] float32.

    amax = max|v| over the group, a = max(amax, 1e-10), sf = a / 448, q = satfinite(v * (448 / a)), where 448 / a
    is one IEEE fp32 division and the product one fp32 multiply. Returns (e4m3 [M, I], float32 [M, I/64]).
    """
    _check_dtype("v", v, torch.float32)
    if v.dim() != 2:
        raise ValueError(f"v must be 2-D [M, I], got shape {tuple(v.shape)}")
    _check_divisible("v.shape[1] (intermediate)", v.shape[1], REQUANT_GROUP)
    return _quantize_groups(v, REQUANT_GROUP)


# ---------------------------------------------------------------------------------------------------------------
# Random generators. They draw on the generator's device (CPU when none is given) and then move the result to
# `device`, so one seed gives the same values on every device.
# ---------------------------------------------------------------------------------------------------------------


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


def _gen_device(generator: torch.Generator | None) -> torch.device:
    return torch.device("cpu") if generator is None else generator.device


def _randint(low: int, high: int, shape: tuple[int, ...], generator: torch.Generator | None,
             device: torch.device | str) -> Tensor:
    """Integers in [low, high) drawn on the generator's device, moved to `device`."""
    out = torch.randint(low, high, shape, generator=generator, device=_gen_device(generator))
    return out.to(device)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> Tensor:
    """Uniform [0, 1) float32 drawn on the generator's device, moved to `device`."""
    return torch.rand(shape, generator=generator, device=_gen_device(generator)).to(device)


def random_small_int_fp8(shape: int | Sequence[int], max_abs: int = 4, *, generator: torch.Generator | None = None,
                         device: torch.device | str = "cpu") -> Tensor:
    """float8_e4m3fn tensor of uniform integers in [-max_abs, max_abs] (every integer up to 16 is exact in e4m3).

    Bound (DESIGN section 4, check 0): with |values| <= 4 on both GEMM operands every product is an integer of
    magnitude <= 16, so a 128-K block partial is an integer of magnitude <= 128 * 16 = 2048 = 2^11 < 2^13: exact in
    the tensor cores' ~14-bit-mantissa accumulator, and of course in fp32. Larger `max_abs` keeps that guarantee
    only while 128 * max_abs^2 <= 2^13, i.e. max_abs <= 8.
    """
    if not isinstance(max_abs, int) or not 1 <= max_abs <= 16:
        raise ValueError(f"max_abs must be an int in [1, 16] (integers exact in e4m3), got {max_abs!r}")
    values = _randint(-max_abs, max_abs + 1, _shape(shape), generator, device)
    return values.float().to(_FP8)


def random_pow2_scales(shape: int | Sequence[int], lo_exp: int = -2, hi_exp: int = 1, *,
                       generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> Tensor:
    """float32 tensor of powers of two 2^e, e uniform in [lo_exp, hi_exp] (both ends included).

    Bound with the default [-2, 1] and `random_small_int_fp8(max_abs=4)`: a promoted block term is an integer
    <= 2^11 times x_sf * w_sf in [2^-4, 2^2]; over K = 7168 (56 blocks) |h| < 56 * 2^11 * 2^2 < 2^19, a multiple
    of 2^-4, i.e. at most 23 significant bits: every partial and full sum is exact in fp32 (24 bits). In general
    the sums stay exact while 17 + 2 * (hi_exp - lo_exp) <= 24, i.e. hi_exp - lo_exp <= 3.
    """
    if lo_exp > hi_exp:
        raise ValueError(f"lo_exp must be <= hi_exp, got lo_exp={lo_exp}, hi_exp={hi_exp}")
    if lo_exp < -126 or hi_exp > 127:
        raise ValueError(f"exponents must lie in [-126, 127] (normal fp32), got [{lo_exp}, {hi_exp}]")
    exps = _randint(lo_exp, hi_exp + 1, _shape(shape), generator, device)
    # Build the IEEE bits directly (biased exponent, zero mantissa): exact by construction.
    return ((exps.to(torch.int32) + 127) << 23).view(torch.float32)


def random_routing(num_tokens: int, num_experts: int, num_topk: int, *, mask_prob: float = 0.0,
                   generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> Tensor:
    """int64 [T, topk]: distinct uniformly chosen experts per token; each slot is -1 with probability mask_prob."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    idx = _rand((num_tokens, num_experts), generator, "cpu").argsort(dim=1)[:, :num_topk]
    if mask_prob > 0.0:
        idx = torch.where(_rand((num_tokens, num_topk), generator, "cpu") < mask_prob, -1, idx)
    return idx.to(torch.int64).to(device)


def random_topk_weights(num_tokens: int, num_topk: int, *, generator: torch.Generator | None = None,
                        device: torch.device | str = "cpu") -> Tensor:
    """float32 [T, topk] of positive weights, each row summing to 1 (like a softmax over the chosen experts)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_topk < 1:
        raise ValueError(f"num_topk must be >= 1, got {num_topk}")
    w = _rand((num_tokens, num_topk), generator, device) + 0.1
    return w / w.sum(dim=1, keepdim=True)
