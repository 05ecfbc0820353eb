"""Public API (DESIGN section 7): get_symm_buffer, transform_weights, fused. Every function validates its
arguments and raises ValueError/TypeError naming the argument before any kernel launch."""
from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Real
from typing import Any

import torch

from megamoe import buffer as _buffer
from megamoe import envs
from megamoe.layout import SymmLayout, validate_moe_shape
from megamoe.weights import check_transformed, transform_weights, validate_weights

__all__ = ["get_symm_buffer", "transform_weights", "fused", "prepare", "validate_fused_args"]


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return value


def _check_tensor(name: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the symmetric buffer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got address {t.data_ptr():#x}")


def get_symm_buffer(group: Any, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                    intermediate_hidden: int, *, device: torch.device | str | None = None) -> _buffer.SymmBuffer:
    """Allocate this rank's symmetric buffer (collective over `group`; `group=None` or size 1: one rank).

    `device` defaults to the current CUDA device.
    """
    if group is not None:
        import torch.distributed as dist

        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    for name, value in (("num_experts", num_experts), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("num_topk", num_topk), ("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        if _check_int(name, value) <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if intermediate_hidden % 128:
        raise ValueError(f"intermediate_hidden must be a multiple of 128, got {intermediate_hidden}")
    _, num_ranks = _buffer._group_rank_size(group)
    validate_moe_shape(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    layout = SymmLayout.create(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                               intermediate_hidden)
    return _buffer.allocate(group, layout, device)


def validate_fused_args(y: Any, l1_weights: Any, l2_weights: Any, buf: Any, num_tokens: int | None = None,
                        cumulative_local_expert_recv_stats: Any = None, activation_clamp: float | None = None,
                        fast_math: bool = True, expected_tokens_per_expert: float | None = None,
                        check_inputs: bool = True) -> int:
    """Every check of `fused`, returning the token count T. `check_inputs` also reads the routing in the buffer
    (a device sync; turn it off under CUDA-graph capture)."""
    _check_buffer(buf)
    layout, device = buf.layout, buf.device
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 2:
        raise ValueError(f"y must be 2-D [num_tokens, hidden], got shape {tuple(y.shape)}")
    num_tokens = y.shape[0] if num_tokens is None else _check_int("num_tokens", num_tokens)
    if not 0 <= num_tokens <= layout.num_max_tokens_per_rank:
        raise ValueError(f"num_tokens must be in [0, num_max_tokens_per_rank={layout.num_max_tokens_per_rank}], "
                         f"got {num_tokens}")
    _check_tensor("y", y, torch.bfloat16, (num_tokens, layout.hidden), device)

    shapes = validate_weights(l1_weights, l2_weights)
    expected = (layout.num_local_experts, layout.hidden, layout.intermediate)
    got = (shapes.num_local_experts, shapes.hidden, shapes.intermediate)
    if got != expected:
        raise ValueError(f"l1_weights/l2_weights must hold (E_local, hidden, intermediate) = {expected} to match the "
                         f"symmetric buffer, got {got}")
    if shapes.device != device:
        raise ValueError(f"l1_weights/l2_weights must be on {device} (the symmetric buffer's device), "
                         f"got {shapes.device}")
    check_transformed(l1_weights, l2_weights)
    if cumulative_local_expert_recv_stats is not None:
        _check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32,
                      (layout.num_local_experts,), device)
    _check_variant_args(activation_clamp, fast_math, expected_tokens_per_expert)
    if check_inputs and num_tokens > 0:
        _check_routing(buf, num_tokens)
    return num_tokens


def _check_buffer(buf: Any) -> None:
    if not isinstance(buf, _buffer.SymmBuffer):
        raise TypeError(f"buf must be a SymmBuffer from megamoe.get_symm_buffer, got {type(buf).__name__}")
    buf._check_alive()


def _check_variant_args(activation_clamp: Any, fast_math: Any, expected_tokens_per_expert: Any) -> None:
    """The arguments that pick the kernel variant (with the buffer's layout)."""
    if activation_clamp is not None:
        if isinstance(activation_clamp, bool) or not isinstance(activation_clamp, Real):
            raise TypeError(f"activation_clamp must be a float or None, got {type(activation_clamp).__name__}")
        if not (math.isfinite(activation_clamp) and activation_clamp > 0):
            raise ValueError(f"activation_clamp must be a finite positive number, got {activation_clamp}")
    if not isinstance(fast_math, bool):
        raise TypeError(f"fast_math must be a bool, got {type(fast_math).__name__}")
    if expected_tokens_per_expert is not None:
        if isinstance(expected_tokens_per_expert, bool) or not isinstance(expected_tokens_per_expert, Real):
            raise TypeError(f"expected_tokens_per_expert must be a number or None, "
                            f"got {type(expected_tokens_per_expert).__name__}")
        if not (math.isfinite(expected_tokens_per_expert) and expected_tokens_per_expert > 0):
            raise ValueError(f"expected_tokens_per_expert must be a finite positive number, "
                             f"got {expected_tokens_per_expert}")


def _check_sm90(buf: _buffer.SymmBuffer, name: str) -> None:
    if buf.device.type != "cuda" or torch.cuda.get_device_capability(buf.device) != (9, 0):
        raise RuntimeError(f"megamoe.{name} needs the symmetric buffer on an SM90 GPU (H100, H200, H20), got "
                           f"{buf.device}")


def prepare(buf: _buffer.SymmBuffer, *,
            expected_tokens_per_expert: float | None | Iterable[float | None] = (None,),
            activation_clamp: float | None = None, fast_math: bool = True) -> None:
    """Compile and load the kernel variant `fused` launches on `buf` for each `expected_tokens_per_expert` value
    (None: the default config) with this clamp and math, then meet the group's other ranks. Collective: every rank
    calls it with the same arguments. A `fused` call with prepared arguments compiles nothing, so no rank compiles
    while its peers wait at the kernel's NVLink barrier (a compile takes seconds; the peers time out after
    MEGAMOE_TIMEOUT_S), and CUDA graphs can be captured without an eager call first."""
    _check_buffer(buf)
    expected = ([expected_tokens_per_expert] if expected_tokens_per_expert is None or
                isinstance(expected_tokens_per_expert, (Real, str)) else list(expected_tokens_per_expert))
    for value in expected:
        _check_variant_args(activation_clamp, fast_math, value)
    _check_sm90(buf, "prepare")
    from megamoe.fused.launch import prepare as prepare_variant

    for value in expected:
        prepare_variant(buf, activation_clamp=activation_clamp, fast_math=fast_math,
                        expected_tokens_per_expert=value)
    buf.barrier()


def _check_routing(buf: _buffer.SymmBuffer, num_tokens: int) -> None:
    """The routing the kernel will read: expert ids in [-1, E), valid ids distinct per token (the pool is sized
    for that), finite weights, finite positive x_sf of every token with an expert (a token whose slots are all -1
    is never read: a caller that pads its batch leaves those rows as they are). The four conditions are reduced on
    the device and read back in one sync; the error message is built only when one fails."""
    num_experts = buf.num_experts
    idx = buf.topk_idx[:num_tokens]
    bad = (idx < -1) | (idx >= num_experts)
    ordered = idx.sort(dim=1).values
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    weights = buf.topk_weights[:num_tokens]
    x_sf = buf.x_sf[:num_tokens]
    routed = (idx >= 0).any(dim=1, keepdim=True)
    failed = torch.stack([bad.any(), dup.any(), ~torch.isfinite(weights).all(),
                          ~(torch.isfinite(x_sf) & (x_sf > 0) | ~routed).all()]).tolist()
    if failed[0]:
        t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"buf.topk_idx must hold expert ids in [-1, {num_experts}), got {int(idx[t, j])} at "
                         f"[{t}, {j}]")
    if failed[1]:
        t = int(dup.nonzero()[0, 0])
        raise ValueError(f"buf.topk_idx must route a token to distinct experts, got {idx[t].tolist()} for token {t}")
    if failed[2]:
        raise ValueError("buf.topk_weights must be finite for the first num_tokens rows")
    if failed[3]:
        raise ValueError("buf.x_sf must be finite and positive for the first num_tokens rows (those with an expert)")


def fused(y: torch.Tensor, l1_weights: tuple[torch.Tensor, torch.Tensor],
          l2_weights: tuple[torch.Tensor, torch.Tensor], buf: _buffer.SymmBuffer, num_tokens: int | None = None,
          cumulative_local_expert_recv_stats: torch.Tensor | None = None, activation_clamp: float | None = None,
          fast_math: bool = True, expected_tokens_per_expert: float | None = None, *,
          check_inputs: bool | None = None, num_sms: int | None = None) -> None:
    """Run the MoE layer for this rank's first `num_tokens` tokens in `buf` into `y` (collective over buf.group:
    every rank calls it, with the same `expected_tokens_per_expert` and `num_sms`). Weights come from
    `transform_weights`. `check_inputs=False` skips the routing checks that read device memory (a device sync);
    the default skips them while the current stream is capturing a CUDA graph, and always where the environment
    sets MEGAMOE_CHECK_INPUTS=0 (serving frameworks that call DeepGEMM's `fp8_mega_moe` eagerly and cannot pass it).
    `num_sms`: the grid size (default: every SM). The launch is cooperative: a full grid starts only once every
    other kernel on the GPU has drained; with fewer SMs it runs beside them. `prepare` compiles and loads the
    variants ahead of the first call.
    """
    if check_inputs is None:
        check_inputs = envs.check_inputs_default() and not (torch.cuda.is_available() and
                                                             torch.cuda.is_current_stream_capturing())
    num_tokens = validate_fused_args(y, l1_weights, l2_weights, buf, num_tokens, cumulative_local_expert_recv_stats,
                                     activation_clamp, fast_math, expected_tokens_per_expert, check_inputs)
    _check_sm90(buf, "fused")
    from megamoe.jit.runtime import num_sms as device_num_sms

    max_sms = device_num_sms(buf.device)
    if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or
                                not 1 <= num_sms <= max_sms):
        raise ValueError(f"num_sms must be an int in [1, {max_sms}], got {num_sms!r}")
    from megamoe.fused.launch import run

    run(y, l1_weights, l2_weights, buf, num_tokens, recv_stats=cumulative_local_expert_recv_stats,
        activation_clamp=activation_clamp, fast_math=fast_math,
        expected_tokens_per_expert=expected_tokens_per_expert, num_sms=num_sms)
