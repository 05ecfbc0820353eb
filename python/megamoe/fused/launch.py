"""Launch of the fused kernel: tensor maps over the symmetric buffer and the weights, one params struct."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from megamoe.fused.config import BLOCK_K, BLOCK_N, L1_OUTPUT_COLS, FusedConfig, config_for
from megamoe.fused.source import compile_fused
from megamoe.heuristics import NUM_THREADS

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer
    from megamoe.weights import WeightPair

DEBUG_HANG_AT_DISPATCH_BARRIER = 1  # assembler/fused_traits.cuh: kDebugHangAtDispatchBarrier


class FusedParamsStruct(ctypes.Structure):
    """Mirror of assembler/fused_traits.cuh: FusedParams."""

    _fields_ = [("w1_sf", ctypes.c_uint64), ("w2_sf", ctypes.c_uint64), ("y", ctypes.c_uint64),
                ("recv_stats", ctypes.c_uint64), ("num_tokens", ctypes.c_uint32), ("debug_flags", ctypes.c_uint32),
                ("clamp", ctypes.c_float), ("reserved", ctypes.c_uint32)]


assert ctypes.sizeof(FusedParamsStruct) == 48


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def tensor_maps(config: FusedConfig, buf: SymmBuffer, l1: WeightPair, l2: WeightPair) -> list:
    """The seven maps of FusedMaps, in its order."""
    from megamoe.jit.runtime import TensorMap

    bm, lay = config.block_m, buf.layout
    l2_acts = buf.view("l2_acts")
    return [
        TensorMap(buf.view("l1_acts"), bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(buf.view("l1_acts_sf"), 1, bm),
        TensorMap(l1[0].view(-1, lay.hidden), BLOCK_N, BLOCK_K, swizzle_bytes=128),
        TensorMap(l2_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(buf.view("l2_acts_sf"), 2, bm),
        TensorMap(l2[0].view(-1, lay.intermediate), BLOCK_N, BLOCK_K, swizzle_bytes=128),
        TensorMap(l2_acts, bm, L1_OUTPUT_COLS),
    ]


def run(y: torch.Tensor, l1: WeightPair, l2: WeightPair, buf: SymmBuffer, num_tokens: int, *,
        recv_stats: torch.Tensor | None = None, activation_clamp: float | None = None, fast_math: bool = True,
        expected_tokens_per_expert: float | None = None, serial: bool = True, num_sms: int | None = None,
        debug_hang: bool = False, timeout_s: float | None = None,
        stream: torch.cuda.Stream | None = None) -> FusedConfig:
    """Launch the fused kernel for this rank's first `num_tokens` tokens in `buf` (arguments already validated:
    megamoe.api.validate_fused_args). Collective over buf.group: every rank launches the same variant."""
    from megamoe.jit import runtime
    from megamoe.jit.diagnostics import timeout_records
    from megamoe.kernels.dispatch_combine import sym_buffer_struct

    grid = num_sms or runtime.num_sms(buf.device)
    config = config_for(buf.layout, expected_tokens_per_expert=expected_tokens_per_expert,
                        clamp=activation_clamp is not None, fast_math=fast_math, serial=serial)
    kernel = runtime.kernel_for(compile_fused, config, NUM_THREADS)
    params = FusedParamsStruct(_ptr(l1[1]), _ptr(l2[1]), _ptr(y) if num_tokens else 0, _ptr(recv_stats), num_tokens,
                               DEBUG_HANG_AT_DISPATCH_BARRIER if debug_hang else 0,
                               activation_clamp if activation_clamp is not None else 0.0, 0)
    env = timeout_records().device_env(rank=buf.rank, timeout_s=timeout_s)
    args = [*tensor_maps(config, buf, l1, l2), sym_buffer_struct(buf), params, env]
    kernel.launch(grid, args, config.smem_bytes, device=buf.device, stream=stream)
    return config
