"""Launch of the fused kernel: tensor maps over the symmetric buffer and the weights, one params struct."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from megamoe.fused.config import BLOCK_K, DEFAULT_PULL_STAGES, L1_OUTPUT_COLS, FusedConfig, config_for
from megamoe.fused.source import compile_fused
from megamoe import heuristics
from megamoe.heuristics import NUM_THREADS

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer
    from megamoe.jit.diagnostics import PhaseTimes
    from megamoe.weights import WeightPair

DEBUG_HANG_AT_DISPATCH_BARRIER = 1  # assembler/fused_traits.cuh: kDebugHangAtDispatchBarrier
DEBUG_DELAY_PULL = 2  # assembler/fused_traits.cuh: kDebugDelayPull


class FusedParamsStruct(ctypes.Structure):
    """Mirror of assembler/fused_traits.cuh: FusedParams."""

    _fields_ = [("w1_sf", ctypes.c_uint64), ("w2_sf", ctypes.c_uint64), ("y", ctypes.c_uint64),
                ("recv_stats", ctypes.c_uint64), ("num_tokens", ctypes.c_uint32), ("debug_flags", ctypes.c_uint32),
                ("clamp", ctypes.c_float), ("task_dump_capacity", ctypes.c_uint32), ("task_dump", ctypes.c_uint64),
                ("min_wave_l1_tiles", ctypes.c_uint32), ("reserved", ctypes.c_uint32), ("phase_times", ctypes.c_uint64)]


assert ctypes.sizeof(FusedParamsStruct) == 72

# The phases the kernel marks into a PhaseTimes (assembler/fused_traits.cuh: FusedPhaseMark), each the earliest and
# the latest mark over the CTAs
PHASES = ("start", "head", "pull", "l1_start", "l2_start", "l2_done", "reduce", "end")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def tensor_maps(config: FusedConfig, buf: SymmBuffer, l1: WeightPair, l2: WeightPair) -> list:
    """The seven entries of FusedMaps, in its order: tensor maps, and the weights' addresses (tile layout)."""
    from megamoe.jit import runtime
    from megamoe.jit.runtime import TensorMap

    bm = config.block_m
    l2_acts = buf.view("l2_acts")
    return [
        TensorMap(buf.view("l1_acts"), bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(buf.view("l1_acts_sf"), 1, bm),
        runtime.ptr(l1[0]),
        TensorMap(l2_acts, bm, BLOCK_K, swizzle_bytes=128),
        TensorMap(buf.view("l2_acts_sf"), 2, bm),
        runtime.ptr(l2[0]),
        TensorMap(l2_acts, bm, L1_OUTPUT_COLS),
    ]


def _variant(buf: SymmBuffer, activation_clamp: float | None, fast_math: bool,
             expected_tokens_per_expert: float | None, serial: bool, pull_stages: int = DEFAULT_PULL_STAGES):
    from megamoe.jit import runtime

    config = config_for(buf.layout, expected_tokens_per_expert=expected_tokens_per_expert,
                        clamp=activation_clamp is not None, fast_math=fast_math, serial=serial,
                        pull_stages=pull_stages)
    return config, runtime.kernel_for(compile_fused, config, NUM_THREADS)


def prepare(buf: SymmBuffer, *, activation_clamp: float | None = None, fast_math: bool = True,
            expected_tokens_per_expert: float | None = None, serial: bool = False) -> FusedConfig:
    """Compile and load the variant `run` launches with these arguments, and allocate the timeout records, so
    that `run` does no driver work or allocation before its launch (megamoe.testing.virtual_ranks)."""
    from megamoe.jit.diagnostics import timeout_records

    config, kernel = _variant(buf, activation_clamp, fast_math, expected_tokens_per_expert, serial)
    kernel.load(buf.device, config.smem_bytes)
    timeout_records()
    return config


def run(y: torch.Tensor, l1: WeightPair, l2: WeightPair, buf: SymmBuffer, num_tokens: int, *,
        recv_stats: torch.Tensor | None = None, activation_clamp: float | None = None, fast_math: bool = True,
        expected_tokens_per_expert: float | None = None, serial: bool = False, num_sms: int | None = None,
        debug_hang: bool = False, debug_delay_pull: bool = False, timeout_s: float | None = None,
        task_dump: torch.Tensor | None = None,
        min_wave_l1_tiles: int | None = None, phase_times: PhaseTimes | None = None,
        pull_stages: int = DEFAULT_PULL_STAGES, stream: torch.cuda.Stream | None = None) -> FusedConfig:
    """Launch the fused kernel for this rank's first `num_tokens` tokens in `buf` (arguments already validated:
    megamoe.api.validate_fused_args). Collective over buf.group: every rank launches the same variant.
    debug_hang (debug): the dispatch barrier waits for an unreachable value (the timeout's report and trap).
    debug_delay_pull (stress): the odd CTAs' dispatch warps start their pulls 200 us late.
    task_dump (debug): int32 [grid, 1 + 4 capacity], filled with each CTA's task list (`dumped_tasks` reads it).
    min_wave_l1_tiles: the waves' fill target (default heuristics.min_wave_l1_tiles_for(grid)).
    phase_times (profiling): a jit.diagnostics.PhaseTimes(PHASES, device), filled with the phases' marks.
    pull_stages (tuning): the pull staging's stages per dispatch warp (fewer leave more shared memory to the GEMM
    ring)."""
    from megamoe.jit import runtime
    from megamoe.jit.diagnostics import timeout_records
    from megamoe.kernels.dispatch_combine import sym_buffer_struct

    grid = num_sms or runtime.num_sms(buf.device)
    config, kernel = _variant(buf, activation_clamp, fast_math, expected_tokens_per_expert, serial, pull_stages)
    if min_wave_l1_tiles is not None and not (isinstance(min_wave_l1_tiles, int) and 0 <= min_wave_l1_tiles < 2**32):
        raise ValueError(f"min_wave_l1_tiles must be an int in [0, 2**32), got {min_wave_l1_tiles!r}")
    capacity = 0
    if task_dump is not None:
        if task_dump.dtype != torch.int32 or task_dump.dim() != 2 or task_dump.shape[0] != grid or \
                (task_dump.shape[1] - 1) % 4 or not task_dump.is_contiguous() or task_dump.device != buf.device:
            raise ValueError(f"task_dump must be a contiguous int32 [{grid}, 1 + 4 capacity] tensor on {buf.device}, "
                             f"got {task_dump.dtype} {tuple(task_dump.shape)} on {task_dump.device}")
        capacity = (task_dump.shape[1] - 1) // 4
    params = FusedParamsStruct(_ptr(l1[1]), _ptr(l2[1]), _ptr(y) if num_tokens else 0, _ptr(recv_stats), num_tokens,
                               (DEBUG_HANG_AT_DISPATCH_BARRIER if debug_hang else 0) |
                               (DEBUG_DELAY_PULL if debug_delay_pull else 0),
                               activation_clamp if activation_clamp is not None else 0.0, capacity, _ptr(task_dump),
                               heuristics.min_wave_l1_tiles_for(grid) if min_wave_l1_tiles is None
                               else min_wave_l1_tiles, 0, phase_times.device_ptr if phase_times is not None else 0)
    env = timeout_records().device_env(rank=buf.rank, timeout_s=timeout_s)
    args = [*tensor_maps(config, buf, l1, l2), sym_buffer_struct(buf), params, env]
    kernel.launch(grid, args, config.smem_bytes, device=buf.device, stream=stream)
    return config


def dumped_tasks(task_dump: torch.Tensor) -> list[list[tuple[str, int, int, int, int]]]:
    """Each CTA's tasks from a task_dump filled by `run`: (phase, expert, m block, n block, pool block)."""
    out = []
    for row in task_dump.cpu().tolist():
        count, capacity = row[0], (len(row) - 1) // 4
        if count > capacity:
            raise ValueError(f"task_dump holds {capacity} tasks per CTA, a CTA had {count}")
        tasks = []
        for i in range(count):
            head, m, n, block = (v & 0xFFFFFFFF for v in row[1 + 4 * i: 5 + 4 * i])
            tasks.append(("l2" if head >> 31 else "l1", head & 0x7FFFFFFF, m, n, block))
        out.append(tasks)
    return out
