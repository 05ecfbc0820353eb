"""The names DeepGEMM's SM90 MegaMoE callers use, with DeepGEMM's signatures, so that a serving framework can
import megamoe in its place (`import megamoe as deep_gemm`). What SGLang and vLLM call, and where (each function's
docstring cites the DeepGEMM source it mirrors; tests/test_serving_compat_gpu.py replays both call sequences):
  SGLang (--moe-a2a-backend megamoe)     get_symm_buffer_for_mega_moe, transform_sf_into_required_layout,
                                         transform_weights_for_mega_moe_sm90, mega_moe_pre_dispatch_sm90, fp8_mega_moe
  vLLM (moe_backend=deep_gemm_mega_moe)  get_symm_buffer_for_sm90_mega_moe, transform_weights_for_mega_moe_sm90,
                                         utils.per_token_cast_to_fp8, fp8_mega_moe_sm90
megamoe implements the FP8 x FP8 recipe (128, 128, 128) with SwiGLU only: the FP4 entry points raise
NotImplementedError saying so.
"""
from __future__ import annotations

from typing import Any

import torch

from megamoe import api
from megamoe import buffer as _buffer
from megamoe.layout import ceil_div

SUPPORTED_RECIPE = (128, 128, 128)
SUPPORTED_ACTIVATION = "swiglu"
# Token alignments of num_max_tokens_per_rank: DeepGEMM's SM90 buffer function rounds up to
# kSM90MegaMoETokenAlignment = 128 (deepseek-ai/DeepGEMM@0274ad7b csrc/apis/sm90_mega.hpp:19, applied in
# deep_gemm/mega/__init__.py:166-167); the generic buffer function of the DeepGEMM build SGLang runs on SM90
# (sgl-project/DeepGEMM, csrc/apis/sm90_mega.hpp@d45e0c9e) rounds up to kLCMCandidateBlockM = 384.
SM90_TOKEN_ALIGNMENT = 128
MEGA_MOE_TOKEN_ALIGNMENT = 384

__all__ = [
    "SUPPORTED_ACTIVATION", "SUPPORTED_RECIPE", "fp8_mega_moe", "fp8_mega_moe_sm90", "get_symm_buffer_for_mega_moe",
    "get_symm_buffer_for_sm90_mega_moe", "get_token_alignment_for_mega_moe", "get_token_alignment_for_sm90_mega_moe",
    "mega_moe_pre_dispatch_sm90", "transform_sf_into_required_layout", "transform_weights_for_mega_moe",
    "transform_weights_for_mega_moe_sm90", "fp8_fp4_mega_moe", "fp8_fp4_mega_moe_sm90", "fp4_fp4_mega_moe",
    "bf16_mega_moe", "transform_weights_for_mega_moe_sm90_fp4",
]


def _check_recipe_activation(recipe: Any = SUPPORTED_RECIPE, activation: Any = SUPPORTED_ACTIVATION) -> None:
    if activation != SUPPORTED_ACTIVATION:
        raise ValueError(f"activation must be {SUPPORTED_ACTIVATION!r} (the only one megamoe implements), got "
                         f"{activation!r}")
    if not isinstance(recipe, (tuple, list)) or tuple(recipe) != SUPPORTED_RECIPE:
        raise ValueError(f"recipe must be {SUPPORTED_RECIPE} (per-128 activation and 128x128 weight scales, the "
                         f"only recipe megamoe implements), got {recipe!r}")


def _aligned(name: str, value: Any, alignment: int) -> int:
    api._check_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return ceil_div(value, alignment) * alignment


def get_token_alignment_for_sm90_mega_moe() -> int:
    return SM90_TOKEN_ALIGNMENT


def get_token_alignment_for_mega_moe() -> int:
    return MEGA_MOE_TOKEN_ALIGNMENT


def get_symm_buffer_for_sm90_mega_moe(group: Any, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                                      hidden: int, intermediate_hidden: int, use_fp8_dispatch: bool = True,
                                      activation: str = SUPPORTED_ACTIVATION, *,
                                      device: torch.device | str | None = None) -> _buffer.SymmBuffer:
    """DeepGEMM's SM90 buffer function (deepseek-ai/DeepGEMM@0274ad7b deep_gemm/mega/__init__.py:160-173):
    num_max_tokens_per_rank rounded up to a multiple of 128 (buf.num_max_tokens_per_rank holds the rounded
    count), then `get_symm_buffer`. vLLM calls it with the first six arguments."""
    if use_fp8_dispatch is not True:
        raise ValueError(f"use_fp8_dispatch must be True (megamoe dispatches FP8 with per-128 SF only), got "
                         f"{use_fp8_dispatch!r}")
    _check_recipe_activation(activation=activation)
    return api.get_symm_buffer(group, num_experts,
                               _aligned("num_max_tokens_per_rank", num_max_tokens_per_rank, SM90_TOKEN_ALIGNMENT),
                               num_topk, hidden, intermediate_hidden, device=device)


def get_symm_buffer_for_mega_moe(group: Any, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                                 hidden: int, intermediate_hidden: int, num_shared_experts: int = 0,
                                 use_fp8_dispatch: bool | None = None, mma_type: str = "fp8xfp4",
                                 activation: str = SUPPORTED_ACTIVATION, *,
                                 device: torch.device | str | None = None) -> _buffer.SymmBuffer:
    """DeepGEMM's generic buffer function with its signature (deepseek-ai/DeepGEMM@0274ad7b
    deep_gemm/mega/__init__.py:135-157), as the DeepGEMM build SGLang runs answers it on an SM90 GPU: the SM90
    buffer (its mma_type must be an FP8-activation one; the FP4 weights it may name are refused where they are
    used) with num_max_tokens_per_rank rounded up to 384. Shared experts are not fused: num_shared_experts 0."""
    if num_shared_experts != 0:
        raise ValueError(f"num_shared_experts must be 0 (megamoe does not fuse shared experts: run them beside "
                         f"the layer), got {num_shared_experts!r}")
    if use_fp8_dispatch not in (None, True):
        raise ValueError(f"use_fp8_dispatch must be True or None (megamoe dispatches FP8 with per-128 SF only), got "
                         f"{use_fp8_dispatch!r}")
    if not isinstance(mma_type, str) or not mma_type.startswith("fp8"):
        raise ValueError(f"mma_type must be an FP8-activation type ('fp8xfp8', 'fp8xfp4'), got {mma_type!r}")
    _check_recipe_activation(activation=activation)
    return api.get_symm_buffer(group, num_experts,
                               _aligned("num_max_tokens_per_rank", num_max_tokens_per_rank, MEGA_MOE_TOKEN_ALIGNMENT),
                               num_topk, hidden, intermediate_hidden, device=device)


def transform_weights_for_mega_moe_sm90(l1_weights: tuple[torch.Tensor, torch.Tensor],
                                        l2_weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, Any]:
    """DeepGEMM's SM90 weight transform (deep_gemm/mega/__init__.py:234-285) with its argument format: w13 FP8
    [E, 2I, H] (gate rows, then up rows) with float32 [E, 2I/128, H/128] scales, w2 FP8 [E, H, I] with
    [E, H/128, I/128]; returns megamoe's kernel layout (megamoe.transform_weights)."""
    return api.transform_weights(l1_weights, l2_weights)


transform_weights_for_mega_moe = transform_weights_for_mega_moe_sm90


def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe: Any = (128, 128),
                                      num_groups: int | None = None, is_sfa: bool = False,
                                      disable_ue8m0_cast: bool = False) -> torch.Tensor:
    """DeepGEMM's SF layout helper as SGLang's SM90 MegaMoE weight path calls it (sgl-project/sglang@27c5bb78
    python/sglang/srt/layers/moe/mega_moe_sm90.py:156-171: recipe (128, 128), num_groups=E,
    disable_ue8m0_cast=True): megamoe's required layout of float32 128x128 weight scales is the checkpoint's own,
    contiguous [num_groups, ceil(mn/128), ceil(k/128)], so this checks and returns it contiguous."""
    if not isinstance(recipe, (tuple, list)) or tuple(recipe) != (128, 128):
        raise ValueError(f"recipe must be (128, 128) (128x128 weight scales), got {recipe!r}")
    if not disable_ue8m0_cast:
        raise ValueError("megamoe keeps float32 scale factors (never UE8M0): call with disable_ue8m0_cast=True")
    if is_sfa:
        raise ValueError("megamoe casts activations itself: only weight scales (is_sfa=False) take this path")
    expected = ((num_groups,) if num_groups is not None else ()) + (ceil_div(mn, 128), ceil_div(k, 128))
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or tuple(sf.shape) != expected:
        raise ValueError(f"sf must be float32 {expected}, got "
                         f"{(sf.dtype, tuple(sf.shape)) if isinstance(sf, torch.Tensor) else type(sf).__name__}")
    return sf.contiguous()


def mega_moe_pre_dispatch_sm90(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                               buf_x: torch.Tensor, buf_x_sf: torch.Tensor, buf_topk_idx: torch.Tensor,
                               buf_topk_weights: torch.Tensor, num_tokens: int, group_size: int = 128,
                               routed_scaling_factor: float = 1.0) -> None:
    """The buffer fill SGLang calls before fp8_mega_moe (sgl-project/sglang@27c5bb78 mega_moe_sm90.py:60-71;
    its kernel in sgl-project/DeepGEMM): BF16 x -> FP8 with one float SF per 128 columns into buf_x / buf_x_sf,
    the int32 or int64 ids widened into buf_topk_idx, the weights times routed_scaling_factor into
    buf_topk_weights, and every row past num_tokens of the routing set to -1 / 0. One kernel (megamoe.kernels
    .input_cast)."""
    from megamoe.kernels import input_cast

    if group_size != 128:
        raise ValueError(f"group_size must be 128 (the recipe's per-128 activation scales), got {group_size!r}")
    for name, t, dtype in (("buf_x", buf_x, torch.float8_e4m3fn), ("buf_x_sf", buf_x_sf, torch.float32),
                           ("buf_topk_idx", buf_topk_idx, torch.int64),
                           ("buf_topk_weights", buf_topk_weights, torch.float32)):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D {dtype} tensor (a symmetric buffer's region), got "
                             f"{(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__}")
    input_cast.fill(buf_x, buf_x_sf, buf_topk_idx, buf_topk_weights, x, topk_idx, topk_weights,
                    num_tokens=api._check_int("num_tokens", num_tokens),
                    routed_scaling_factor=float(routed_scaling_factor), clear_rows=True)


def fp8_mega_moe(y: torch.Tensor, l1_weights: tuple[torch.Tensor, torch.Tensor],
                 l2_weights: tuple[torch.Tensor, torch.Tensor], sym_buffer: _buffer.SymmBuffer,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                 recipe: tuple[int, int, int] = SUPPORTED_RECIPE, activation: str = SUPPORTED_ACTIVATION,
                 activation_clamp: float | None = None, fast_math: bool = True, **kwargs: Any) -> None:
    """DeepGEMM's `fp8_mega_moe` (deep_gemm/mega/__init__.py:401-428): `megamoe.fused` with the token count
    taken from `y.shape[0]` (the rows the caller filled in the buffer); extra keyword arguments go to `fused`
    (`check_inputs`, `num_sms`, `expected_tokens_per_expert`)."""
    _check_recipe_activation(recipe, activation)
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise TypeError(f"y must be a 2-D BF16 tensor [T, H], got "
                        f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    api.fused(y, l1_weights, l2_weights, sym_buffer, y.shape[0], cumulative_local_expert_recv_stats,
              activation_clamp, fast_math, **kwargs)


# vLLM's name for it (vllm-project/vllm@6cd8b6b4 vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py:363-371)
fp8_mega_moe_sm90 = fp8_mega_moe


def _fp4_unsupported(name: str):  # type: ignore[no-untyped-def]
    def entry(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name}: megamoe implements FP8 x FP8 weights only (recipe {SUPPORTED_RECIPE}, "
                                  f"fp8_mega_moe); FP4 / MXFP4 / BF16 expert weights are not supported")

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"DeepGEMM's {name}: not implemented by megamoe (raises NotImplementedError)."
    return entry


fp8_fp4_mega_moe = _fp4_unsupported("fp8_fp4_mega_moe")
fp8_fp4_mega_moe_sm90 = _fp4_unsupported("fp8_fp4_mega_moe_sm90")
fp4_fp4_mega_moe = _fp4_unsupported("fp4_fp4_mega_moe")
bf16_mega_moe = _fp4_unsupported("bf16_mega_moe")
transform_weights_for_mega_moe_sm90_fp4 = _fp4_unsupported("transform_weights_for_mega_moe_sm90_fp4")
