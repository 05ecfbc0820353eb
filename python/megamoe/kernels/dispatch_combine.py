"""Dispatch and combine unit-test kernel (components/dispatch, components/combine): one persistent cooperative
kernel that dispatches this rank's tokens over NVLink into the experts' pools, runs a trivial expert on every
pulled row (dequantize the FP8 row with its SF, times its top-k weight, BF16: exactly computable on the host),
scatters the rows back to the source ranks' combine buffers and reduces them into y.

Kernel phases (every rank, all CTAs; barriers are common/grid_sync.cuh and common/nvlink_barrier.cuh):
  1. count + reserve + notify     dispatch/count.cuh: src_token_topk_idx and expert_recv_count on the destination
  2. NVLink barrier "dispatch"
  3. receive table, recv stats    dispatch/recv_table.cuh (every CTA, in shared memory)
  4. pull                         dispatch/pull.cuh: row, SF (MN-major), weight, metadata; l1_arrival_count += 1
  5. trivial expert               waits for its pool block's arrival count, scatters to combine (combine/scatter.cuh)
  6. grid sync, clean             combine/clean.cuh: the call's counters back to zero
  7. NVLink barrier "combine"     every rank's scatter has landed, every rank has cleaned
  8. reduce                       combine/reduce.cuh: y
  (reduce_overlap, the default: each scattered row is counted at its token's source rank; a warp goes from its
  scatter (5) straight to the reduce (8), waiting per token for its rows, and 6-7 come last)
The pool, its SF, weights and metadata stay in the symmetric buffer after the call (`SymmBuffer.view`).
The kernel body is assembler/dispatch_combine_kernel.cuh (its head and tail: assembler/dispatch_phases.cuh,
shared with the fused kernel). This module: the config, the source (the variant's constants and the entry point),
compile and launch; the tests' and the benchmark's inputs, expectations and
checked calls are in megamoe.testing.dispatch_combine, the timed round trip in megamoe.bench.comm.

Every performance choice is a compile-time knob of DispatchCombineConfig (notes/dispatch_combine.md has the
budget per phase); LEGACY_KNOBS reproduces the first version exactly, the field defaults are the fastest predicted:
  pull_stages     rows in flight per pulling warp (1: the legacy loop, one row at a time; >= 2: a ring of stages)
  pull_warps      warps per CTA that pull (12: all; the fused kernel has 2: FUSED_PULL_KNOBS)
  combine_store   "split": two 16 B stores per lane 32 B apart (legacy); "coalesced": lane i stores bytes
                  [16 i, 16 i + 16) of each 512 B of the row (full 128 B lines per instruction)
  reduce          "bulk": one warp per token, 2-stage ring of 1 KB bulk loads (legacy); "ldg": units of (token,
                  32 x reduce_vecs 16 B vectors), every valid slot's loads in flight before the adds
  lean_sync       False: grid sync, clean, NVLink barrier with two grid syncs (legacy); True: no clean grid sync,
                  one grid sync per NVLink barrier, every CTA waits for the signals itself, the clean folded into
                  the combine barrier (common/nvlink_barrier.cuh: nvlink_barrier_polled)
  table_prefetch  the receive counts loaded by the whole CTA at once, then scanned in shared memory
  reduce_overlap  (reduce "ldg", lean_sync) every scattered row counts itself at its token's source rank
                  (combine_arrival_count); a warp reduces right after its own scatter, waiting per token for its
                  rows, and the combine barrier (with the clean) moves after the reduce: the reduce overlaps the
                  scatter's tail instead of following every rank's last row
"""
from __future__ import annotations

import ctypes
import math
import string
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from megamoe.heuristics import SMEM_CAPACITY_BYTES
from megamoe.jit import compiler
from megamoe.jit.compiler import CompileResult
from megamoe.layout import BLOCK_M_CANDIDATES, MAX_RANKS, SymmLayout, align

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer
    from megamoe.jit.diagnostics import PhaseTimes

NUM_THREADS = 384
NUM_WARPS = NUM_THREADS // 32
NUM_COMBINE_STAGES = 2
COMBINE_STORES = ("split", "coalesced")
REDUCES = ("bulk", "ldg")
# The first version of the kernel, kept reachable for side-by-side benchmarks and tests
LEGACY_KNOBS: dict[str, Any] = {"pull_stages": 1, "pull_warps": NUM_WARPS, "combine_store": "split",
                                "reduce": "bulk", "lean_sync": False, "table_prefetch": False,
                                "reduce_overlap": False}
# What the fused kernel will have: 2 dispatch warps per CTA, so more rows in flight per warp
FUSED_PULL_KNOBS: dict[str, Any] = {"pull_warps": 2, "pull_stages": 4}
DEBUG_HANG_AT_DISPATCH_BARRIER = 1  # kernel debug flag: the first NVLink barrier waits for an unreachable value
# The phases the unit kernel marks when given a PhaseTimes buffer (run(..., phase_times=)), in order
PHASES = ("start", "count+notify", "dispatch barrier", "recv table", "pull", "expert+scatter",
          "combine barrier (reduce_overlap: the reduce)", "reduce (reduce_overlap: the combine barrier)")


class SymBufferStruct(ctypes.Structure):
    """Mirror of components/common/sym_buffer.cuh: SymBuffer (a __grid_constant__ kernel parameter)."""

    _fields_ = [("base_ptrs", ctypes.c_uint64 * MAX_RANKS), ("local_ptr", ctypes.c_uint64),
                ("rank_idx", ctypes.c_uint32), ("num_ranks", ctypes.c_uint32)]


assert ctypes.sizeof(SymBufferStruct) == 8 * MAX_RANKS + 16


def sym_buffer_struct(buf: SymmBuffer) -> SymBufferStruct:
    """Every rank's address of this buffer's first byte. Robust to handles whose buffer_ptrs are the bases of the
    allocations rather than of the tensor: the tensor sits at the same offset in every rank's allocation."""
    delta = buf.buffer.data_ptr() - buf.buffer_ptrs[buf.rank]
    if not 0 <= delta < (1 << 40):
        raise ValueError(f"buf.buffer_ptrs[{buf.rank}] = {buf.buffer_ptrs[buf.rank]:#x} does not lie at or below "
                         f"this rank's buffer {buf.buffer.data_ptr():#x}")
    ptrs = [p + delta for p in buf.buffer_ptrs] + [0] * (MAX_RANKS - len(buf.buffer_ptrs))
    return SymBufferStruct((ctypes.c_uint64 * MAX_RANKS)(*ptrs), ptrs[buf.rank], buf.rank, buf.num_ranks)


def pull_stage_bytes(hidden: int) -> int:
    """dispatch/pull.cuh kPullStageBytes: the row, then (when H % 512 == 0) its SF row, 128 B aligned."""
    sf = hidden // 128 * 4 if (hidden // 128) % 4 == 0 else 0
    return align(align(hidden, 16) + sf, 128)


def combine_chunk_bytes(hidden: int) -> int:
    """combine/reduce.cuh kChunkBytes: gcd(2 H, 1024) B. The bulk reduce (reduce="bulk") takes a token chunk by
    chunk through a 2-stage ring of 1D bulk loads per warp, one per valid top-k slot, and accumulates in fp32
    registers: 1 KB = 512 BF16 = 16 floats per lane."""
    return math.gcd(2 * hidden, 1024)


@dataclass(frozen=True)
class DispatchCombineConfig:
    """One variant of the unit kernel: the buffer's layout, the pool padding BLOCK_M, the pull path, and the
    performance knobs (module docstring; LEGACY_KNOBS is the first version)."""

    layout: SymmLayout
    block_m: int
    bulk_pull: bool = True  # False: the row is copied with 16 B loads/stores instead of 1D cp.async.bulk
    pull_stages: int = 2
    pull_warps: int = NUM_WARPS
    combine_store: str = "coalesced"
    reduce: str = "ldg"
    reduce_vecs: int = 2
    lean_sync: bool = True
    table_prefetch: bool = True
    reduce_overlap: bool = True

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CANDIDATES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {self.block_m!r}")
        if not 1 <= self.pull_stages <= 8:
            raise ValueError(f"pull_stages must be in [1, 8], got {self.pull_stages!r}")
        if not 1 <= self.pull_warps <= NUM_WARPS:
            raise ValueError(f"pull_warps must be in [1, {NUM_WARPS}], got {self.pull_warps!r}")
        if self.combine_store not in COMBINE_STORES:
            raise ValueError(f"combine_store must be one of {COMBINE_STORES}, got {self.combine_store!r}")
        if self.reduce not in REDUCES:
            raise ValueError(f"reduce must be one of {REDUCES}, got {self.reduce!r}")
        if not 1 <= self.reduce_vecs <= 4:
            raise ValueError(f"reduce_vecs must be in [1, 4], got {self.reduce_vecs!r}")
        if self.reduce_overlap and (self.reduce != "ldg" or not self.lean_sync):
            raise ValueError("reduce_overlap needs reduce='ldg' and lean_sync=True")
        if self.smem_bytes > SMEM_CAPACITY_BYTES:
            raise ValueError(f"hidden={self.layout.hidden}: the unit kernel needs {self.smem_bytes} B of shared "
                             f"memory, more than {SMEM_CAPACITY_BYTES} B (fewer pull_stages or pull_warps, or "
                             f"bulk_pull=False)")

    @property
    def pipelined_pull(self) -> bool:
        """The pull runs dispatch/pull.cuh: pull_rows_pipelined (else the legacy pull_rows)."""
        return self.bulk_pull and (self.pull_stages > 1 or self.pull_warps != NUM_WARPS)

    @property
    def knobs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("pull_stages", "pull_warps", "combine_store", "reduce",
                                                       "reduce_vecs", "lean_sync", "table_prefetch",
                                                       "reduce_overlap")}

    @property
    def is_legacy(self) -> bool:
        return all(getattr(self, k) == v for k, v in LEGACY_KNOBS.items())

    @property
    def knob_tag(self) -> str:
        """Part of the kernel name: empty for the legacy knobs (the first version's name)."""
        if self.is_legacy:
            return ""
        return (f"_p{self.pull_warps}x{self.pull_stages}_{self.combine_store[:2]}"
                f"_{self.reduce}{self.reduce_vecs if self.reduce == 'ldg' else ''}"
                f"{'_lean' if self.lean_sync else ''}{'_tp' if self.table_prefetch else ''}"
                f"{'_ov' if self.reduce_overlap else ''}")

    @property
    def name(self) -> str:
        lay = self.layout
        return (f"megamoe_dispatch_combine_r{lay.num_ranks}_e{lay.num_experts}_t{lay.num_max_tokens_per_rank}"
                f"_k{lay.num_topk}_h{lay.hidden}_i{lay.intermediate}_bm{self.block_m}"
                f"_{'bulk' if self.bulk_pull else 'ldst'}{self.knob_tag}")

    @property
    def smem_regions(self) -> dict[str, tuple[int, int]]:
        """{name: (offset, bytes)}: pull rows/stages, combine chunks, expert counts, receive table, mbarriers."""
        lay = self.layout
        if not self.bulk_pull:
            pull, pull_barriers = 0, 0
        elif self.pipelined_pull:
            pull = self.pull_warps * self.pull_stages * pull_stage_bytes(lay.hidden)
            pull_barriers = self.pull_warps * self.pull_stages
        else:
            pull, pull_barriers = NUM_WARPS * align(lay.hidden, 128), NUM_WARPS
        bulk_reduce = self.reduce == "bulk"
        sizes = (
            ("pull", pull),
            ("combine", NUM_WARPS * NUM_COMBINE_STAGES * combine_chunk_bytes(lay.hidden) if bulk_reduce else 0),
            ("expert_count", align(lay.num_experts * 4, 16)),
            ("recv_table", align((lay.num_local_experts * lay.num_ranks + 1 + lay.num_local_experts + 1) * 4, 16)),
            # legacy: one pull barrier per warp (also without bulk_pull) then the combine rings', as before
            ("barriers", ((NUM_WARPS if not self.pipelined_pull else pull_barriers)
                          + (NUM_WARPS * NUM_COMBINE_STAGES if bulk_reduce else 0)) * 8),
        )
        regions, offset = {}, 0
        for name, num_bytes in sizes:
            regions[name] = (offset, num_bytes)
            offset = align(offset + num_bytes, 128)
        return regions

    @property
    def smem_bytes(self) -> int:
        offset, num_bytes = self.smem_regions["barriers"]
        return offset + num_bytes


_KERNEL_TEMPLATE = string.Template(r"""// Generated by megamoe.kernels.dispatch_combine: the traits of one variant and the entry point of
// assembler/dispatch_combine_kernel.cuh (dispatch -> trivial expert -> combine, persistent, cooperative).
// The layout header (megamoe.layout.SymmLayout.to_cpp()) sits in the main file, where constants that this kernel
// does not use would draw "declared but never referenced" (#177).
#pragma nv_diag_suppress 177
${layout_header}
#pragma nv_diag_default 177
#include "dispatch_combine_kernel.cuh"

namespace variant {
constexpr uint32_t kNumThreads = ${num_threads};
constexpr uint32_t kBlockM = ${block_m};
constexpr bool kBulkPull = ${bulk_pull};
// Knobs (megamoe/kernels/dispatch_combine.py: DispatchCombineConfig)
constexpr bool kPipelinedPull = ${pipelined_pull};
constexpr uint32_t kPullStages = ${pull_stages};
constexpr uint32_t kPullWarps = ${pull_warps};
constexpr bool kCoalescedCombineStore = ${coalesced_store};
constexpr bool kBulkReduce = ${bulk_reduce};
constexpr uint32_t kReduceVecs = ${reduce_vecs};
constexpr bool kLeanSync = ${lean_sync};
constexpr bool kTablePrefetch = ${table_prefetch};
constexpr bool kReduceOverlap = ${reduce_overlap};
constexpr uint32_t kDebugHangAtDispatchBarrier = ${debug_hang_flag};
// Shared-memory plan (DispatchCombineConfig.smem_regions)
constexpr uint32_t kSmemPullOffset = ${pull_offset};
constexpr uint32_t kSmemCombineOffset = ${combine_offset};
constexpr uint32_t kSmemExpertCountOffset = ${expert_count_offset};
constexpr uint32_t kSmemRecvTableOffset = ${recv_table_offset};
constexpr uint32_t kSmemBarrierOffset = ${barrier_offset};
}  // namespace variant
using Traits = megamoe::unit::DispatchCombineTraits<
    variant::kNumThreads, variant::kBlockM, variant::kBulkPull, variant::kPipelinedPull, variant::kPullStages,
    variant::kPullWarps, variant::kCoalescedCombineStore, variant::kBulkReduce, variant::kReduceVecs,
    variant::kLeanSync, variant::kTablePrefetch, variant::kReduceOverlap, variant::kDebugHangAtDispatchBarrier,
    variant::kSmemPullOffset, variant::kSmemCombineOffset, variant::kSmemExpertCountOffset,
    variant::kSmemRecvTableOffset, variant::kSmemBarrierOffset>;
static_assert(megamoe::combine::kChunkBytes == ${chunk_bytes}, "Python and C++ agree on the combine chunk");
static_assert(megamoe::dispatch::kPullStageBytes == ${pull_stage_bytes}, "Python and C++ agree on the pull stage");

extern "C" __global__ void __launch_bounds__(Traits::kNumThreads, 1)
${name}(const __grid_constant__ megamoe::SymBuffer sym, uint32_t num_tokens, __nv_bfloat16* y,
        int32_t* recv_stats, uint32_t debug_flags, const megamoe::DeviceEnv env,
        unsigned long long* phase_times) {
    megamoe::unit::dispatch_combine_impl<Traits>(sym, num_tokens, y, recv_stats, debug_flags, env, phase_times);
}
""")


def source(config: DispatchCombineConfig) -> str:
    regions = config.smem_regions
    return _KERNEL_TEMPLATE.substitute(
        # pasted into the main file: `#pragma once` there only draws a warning
        layout_header=config.layout.to_cpp().replace("#pragma once\n", ""),
        name=config.name,
        num_threads=NUM_THREADS,
        block_m=config.block_m,
        bulk_pull="true" if config.bulk_pull else "false",
        pipelined_pull="true" if config.pipelined_pull else "false",
        pull_stages=config.pull_stages,
        pull_warps=config.pull_warps,
        coalesced_store="true" if config.combine_store == "coalesced" else "false",
        bulk_reduce="true" if config.reduce == "bulk" else "false",
        reduce_vecs=config.reduce_vecs,
        lean_sync="true" if config.lean_sync else "false",
        table_prefetch="true" if config.table_prefetch else "false",
        reduce_overlap="true" if config.reduce_overlap else "false",
        pull_stage_bytes=pull_stage_bytes(config.layout.hidden),
        debug_hang_flag=DEBUG_HANG_AT_DISPATCH_BARRIER,
        pull_offset=regions["pull"][0],
        combine_offset=regions["combine"][0],
        expert_count_offset=regions["expert_count"][0],
        recv_table_offset=regions["recv_table"][0],
        barrier_offset=regions["barriers"][0],
        chunk_bytes=combine_chunk_bytes(config.layout.hidden),
    )


def compile_kernel(config: DispatchCombineConfig) -> CompileResult:
    return compiler.build(config.name, source(config))


def config_for(buf: SymmBuffer, block_m: int | None = None, bulk_pull: bool = True,
               knobs: Mapping[str, Any] | None = None) -> DispatchCombineConfig:
    """The unit kernel variant for `buf` (BLOCK_M from the buffer's shared config unless given; knobs: fields of
    DispatchCombineConfig, e.g. LEGACY_KNOBS; the field defaults otherwise)."""
    return DispatchCombineConfig(buf.layout, buf.config().block_m if block_m is None else block_m, bulk_pull,
                                 **dict(knobs or {}))


def _check_tensor(name: str, t: Any, dtype: Any, shape: tuple[int, ...], device: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")
    if t.numel() and t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got address {t.data_ptr():#x}")


def check_routing(buf: SymmBuffer, num_tokens: int) -> None:
    """Expert ids in [-1, E) and distinct per token (the pool and src_token_topk_idx are sized for that)."""
    idx = buf.topk_idx[:num_tokens]
    if idx.numel() == 0:
        return
    if bool(((idx < -1) | (idx >= buf.num_experts)).any()):
        raise ValueError(f"buf.topk_idx must hold expert ids in [-1, {buf.num_experts})")
    ordered = idx.sort(dim=1).values
    if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError("buf.topk_idx must route each token to distinct experts")


def run(buf: SymmBuffer, num_tokens: int, y: torch.Tensor, *, block_m: int | None = None,
        recv_stats: torch.Tensor | None = None, bulk_pull: bool = True, knobs: Mapping[str, Any] | None = None,
        check_inputs: bool = True,
        debug_skip_launch: bool = False, debug_hang: bool = False, timeout_s: float | None = None,
        phase_times: PhaseTimes | None = None, stream: torch.cuda.Stream | None = None,
        num_sms: int | None = None) -> DispatchCombineConfig:
    """Launch the unit kernel for this rank's first `num_tokens` tokens in `buf` (collective over buf.group:
    every rank launches, in the same order, with the same block_m, bulk_pull and knobs). y: BF16 [num_tokens, H].
    recv_stats: optional int32 [E_local], += rows received per local expert.
    debug_skip_launch: this rank does not launch (its peers must time out); debug_hang: the dispatch barrier
    waits for an unreachable value (a timeout on one GPU). timeout_s overrides MEGAMOE_TIMEOUT_S.
    phase_times: a jit.diagnostics.PhaseTimes(PHASES, device) the kernel fills with when its warps ended each
    phase (profiling). num_sms: the grid size (default: every SM; virtual ranks share one GPU's SMs)."""
    from megamoe.jit import runtime
    from megamoe.jit.diagnostics import timeout_records

    layout = buf.layout
    if not 0 <= num_tokens <= layout.num_max_tokens_per_rank:
        raise ValueError(f"num_tokens must be in [0, {layout.num_max_tokens_per_rank}], got {num_tokens}")
    _check_tensor("y", y, torch.bfloat16, (num_tokens, layout.hidden), buf.device)
    if recv_stats is not None:
        _check_tensor("recv_stats", recv_stats, torch.int32, (layout.num_local_experts,), buf.device)
    if check_inputs:
        check_routing(buf, num_tokens)
    config = config_for(buf, block_m, bulk_pull, knobs)
    kernel = runtime.kernel_for(compile_kernel, config, NUM_THREADS)
    if debug_skip_launch:
        return config
    env = timeout_records().device_env(rank=buf.rank, timeout_s=timeout_s)
    args = [sym_buffer_struct(buf), runtime.u32(num_tokens), runtime.ptr(y if num_tokens else None),
            runtime.ptr(recv_stats), runtime.u32(DEBUG_HANG_AT_DISPATCH_BARRIER if debug_hang else 0), env,
            runtime.ptr(phase_times.times if phase_times is not None else None)]
    kernel.launch(num_sms or runtime.num_sms(buf.device), args, config.smem_bytes, device=buf.device, stream=stream)
    return config


def prepare(buf: SymmBuffer, block_m: int | None = None, bulk_pull: bool = True,
            knobs: Mapping[str, Any] | None = None) -> DispatchCombineConfig:
    """Compile and load the variant `run` launches with these arguments and allocate the timeout records, so that
    `run` does no driver work or allocation before its launch (megamoe.testing.virtual_ranks)."""
    from megamoe.jit import runtime
    from megamoe.jit.diagnostics import timeout_records

    config = config_for(buf, block_m, bulk_pull, knobs)
    runtime.kernel_for(compile_kernel, config, NUM_THREADS).load(buf.device, config.smem_bytes)
    timeout_records()
    return config
