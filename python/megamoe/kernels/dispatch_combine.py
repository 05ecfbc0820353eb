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
The pool, its SF, weights and metadata stay in the symmetric buffer after the call (`SymmBuffer.view`).
"""
from __future__ import annotations

import ctypes
import functools
import math
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megamoe import scheduler
from megamoe.heuristics import SMEM_CAPACITY_BYTES
from megamoe.jit import compiler
from megamoe.jit.compiler import CompileResult
from megamoe.layout import BLOCK_M_CANDIDATES, MAX_RANKS, SymmLayout, align

if TYPE_CHECKING:
    from megamoe.buffer import SymmBuffer

NUM_THREADS = 384
NUM_WARPS = NUM_THREADS // 32
NUM_COMBINE_STAGES = 2
DEBUG_HANG_AT_DISPATCH_BARRIER = 1  # kernel debug flag: the first NVLink barrier waits for an unreachable value


class SymBufferStruct(ctypes.Structure):
    """Mirror of components/common/sym_buffer.cuh: SymBuffer (a __grid_constant__ kernel parameter)."""

    _fields_ = [("base_ptrs", ctypes.c_uint64 * MAX_RANKS), ("rank_idx", ctypes.c_uint32),
                ("num_ranks", ctypes.c_uint32)]


assert ctypes.sizeof(SymBufferStruct) == 8 * MAX_RANKS + 8


def sym_buffer_struct(buf: SymmBuffer) -> SymBufferStruct:
    """Every rank's address of this buffer's first byte. Robust to handles whose buffer_ptrs are the bases of the
    allocations rather than of the tensor: the tensor sits at the same offset in every rank's allocation."""
    delta = buf.buffer.data_ptr() - buf.buffer_ptrs[buf.rank]
    if not 0 <= delta < (1 << 40):
        raise ValueError(f"buf.buffer_ptrs[{buf.rank}] = {buf.buffer_ptrs[buf.rank]:#x} does not lie at or below "
                         f"this rank's buffer {buf.buffer.data_ptr():#x}")
    ptrs = [p + delta for p in buf.buffer_ptrs] + [0] * (MAX_RANKS - len(buf.buffer_ptrs))
    return SymBufferStruct((ctypes.c_uint64 * MAX_RANKS)(*ptrs), buf.rank, buf.num_ranks)


def combine_chunk_bytes(hidden: int) -> int:
    """combine/reduce.cuh kChunkBytes: gcd(2 H, 1024) (as heuristics.smem_plan)."""
    return math.gcd(2 * hidden, 1024)


@dataclass(frozen=True)
class DispatchCombineConfig:
    """One variant of the unit kernel: the buffer's layout, the pool padding BLOCK_M, the pull path."""

    layout: SymmLayout
    block_m: int
    bulk_pull: bool = True  # False: the row is copied with 16 B loads/stores instead of 1D cp.async.bulk

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CANDIDATES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {self.block_m!r}")
        if self.smem_bytes > SMEM_CAPACITY_BYTES:
            raise ValueError(f"hidden={self.layout.hidden}: the unit kernel needs {self.smem_bytes} B of shared "
                             f"memory, more than {SMEM_CAPACITY_BYTES} B (use bulk_pull=False)")

    @property
    def name(self) -> str:
        lay = self.layout
        return (f"megamoe_dispatch_combine_r{lay.num_ranks}_e{lay.num_experts}_t{lay.num_max_tokens_per_rank}"
                f"_k{lay.num_topk}_h{lay.hidden}_i{lay.intermediate}_bm{self.block_m}"
                f"_{'bulk' if self.bulk_pull else 'ldst'}")

    @property
    def smem_regions(self) -> dict[str, tuple[int, int]]:
        """{name: (offset, bytes)}: pull rows, combine chunks, expert counts, receive table, mbarriers."""
        lay = self.layout
        sizes = (
            ("pull", NUM_WARPS * align(lay.hidden, 128) if self.bulk_pull else 0),
            ("combine", NUM_WARPS * NUM_COMBINE_STAGES * combine_chunk_bytes(lay.hidden)),
            ("expert_count", align(lay.num_experts * 4, 16)),
            ("recv_table", align((lay.num_local_experts * lay.num_ranks + 1 + lay.num_local_experts + 1) * 4, 16)),
            ("barriers", NUM_WARPS * (1 + NUM_COMBINE_STAGES) * 8),
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


_KERNEL_TEMPLATE = string.Template(r"""// Generated by megamoe.kernels.dispatch_combine.
// dispatch -> trivial expert -> combine, persistent, cooperative.
// The layout header (megamoe.layout.SymmLayout.to_cpp()) sits in the main file, where constants that this kernel
// does not use would draw "declared but never referenced" (#177).
#pragma nv_diag_suppress 177
${layout_header}
#pragma nv_diag_default 177
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fence.cuh"
#include "common/grid_sync.cuh"
#include "common/mbarrier.cuh"
#include "common/nvlink_barrier.cuh"
#include "combine/clean.cuh"
#include "combine/reduce.cuh"
#include "combine/scatter.cuh"
#include "dispatch/count.cuh"
#include "dispatch/pull.cuh"
#include "dispatch/recv_table.cuh"

namespace megamoe::unit {

constexpr uint32_t kNumThreads = ${num_threads};
constexpr uint32_t kNumWarps = kNumThreads / 32;
constexpr uint32_t kBlockM = ${block_m};
constexpr bool kBulkPull = ${bulk_pull};
constexpr uint32_t kDebugHangAtDispatchBarrier = ${debug_hang_flag};
constexpr uint32_t kSmemPullOffset = ${pull_offset};
constexpr uint32_t kSmemCombineOffset = ${combine_offset};
constexpr uint32_t kSmemExpertCountOffset = ${expert_count_offset};
constexpr uint32_t kSmemRecvTableOffset = ${recv_table_offset};
constexpr uint32_t kSmemBarrierOffset = ${barrier_offset};
static_assert(kNumThreads % 32 == 0 and kNumThreads <= 384, "whole warps, at most 384 threads");
static_assert(not kBulkPull or kSmemPullOffset % 16 == 0, "1D bulk copy destinations 16 B aligned");
static_assert(kSmemCombineOffset % 16 == 0 and kSmemBarrierOffset % 8 == 0, "alignment of the smem regions");
static_assert(combine::kChunkBytes == ${chunk_bytes}, "Python and C++ agree on the combine chunk");
static_assert(dispatch::kPullRowBytes % 16 == 0, "pull rows keep 16 B alignment");

// The trivial expert: out = bf16((fp32(x) * sf) * weight) for every element of the pulled row, written to the
// source rank's combine row (slot, token). Global warp `warp_rank` takes received rows like the pull does.
__device__ __forceinline__ void trivial_expert(const DeviceEnv& env, const SymBuffer& sym,
                                               const dispatch::RecvTable& table, uint32_t warp_rank,
                                               uint32_t num_warps) {
    const uint32_t lane = lane_idx();
    const uint32_t num_rows = table.num_rows();
    for (uint32_t g = warp_rank; g < num_rows; g += num_warps) {
        const dispatch::RowLocation loc = dispatch::locate(table, g);
        const uint32_t pool_block = loc.pool_row / kBlockM;
        const uint32_t num_block_rows = dispatch::num_rows_in_block<kBlockM>(table, loc);

        // Wait for every row of the pool block (as a GEMM consumer does)
        // NOTES: lane 0's ld.acquire.gpu pairs with the pullers' red.release.gpu (pull.cuh: release_row);
        // __syncwarp extends the acquire to the other lanes before their plain loads of the pool.
        if (lane == 0) {
            const uint32_t* arrival = dispatch::l1_arrival_count(sym) + pool_block;
            bounded_wait(
                secondary_env(env), "l1_arrival",
                [&]() { return ptx::ld_acquire<ptx::Scope::kGpu>(arrival) >= num_block_rows; },
                [&]() {
                    return make_longlong3(ptx::ld_relaxed<ptx::Scope::kGpu>(arrival), num_block_rows, pool_block);
                });
        }
        __syncwarp();

        const uint4 meta = *dispatch::pool_src_metadata(sym, loc.pool_row);
        const float weight = *dispatch::pool_topk_weight(sym, loc.pool_row);
        const uint8_t* row = dispatch::pool_row(sym, loc.pool_row);
        __nv_bfloat16* dst = combine::combine_row(sym, meta.x, meta.y, meta.z);
        for (uint32_t c = lane; c < layout::kHidden / 16; c += 32) {
            const uint4 q = reinterpret_cast<const uint4*>(row)[c];
            const float sf = *dispatch::pool_sf(sym, c / 8, loc.pool_row);
            const uint32_t words[4] = {q.x, q.y, q.z, q.w};
            uint32_t packed[8];
#pragma unroll
            for (uint32_t i = 0; i < 8; ++ i) {
                const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
                    static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2))), __NV_E4M3);
                const float2 f = __half22float2(__half2(h));
                const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(f.x, sf), weight),
                                                               __fmul_rn(__fmul_rn(f.y, sf), weight));
                packed[i] = *reinterpret_cast<const uint32_t*>(&b);
            }
            combine::store_combine_chunk(dst, c * 16, make_uint4(packed[0], packed[1], packed[2], packed[3]));
            combine::store_combine_chunk(dst, c * 16 + 8, make_uint4(packed[4], packed[5], packed[6], packed[7]));
        }
        combine::finish_combine_stores();
    }
}

}  // namespace megamoe::unit

extern "C" __global__ void __launch_bounds__(megamoe::unit::kNumThreads, 1)
${name}(const __grid_constant__ megamoe::SymBuffer sym, uint32_t num_tokens, __nv_bfloat16* y,
        int32_t* recv_stats, uint32_t debug_flags, const megamoe::DeviceEnv env) {
    using namespace megamoe;
    using namespace megamoe::unit;
    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t warp = warp_idx(), lane = lane_idx(), thread_idx = threadIdx.x;
    const uint32_t cta_idx = blockIdx.x, num_ctas = gridDim.x;
    const uint32_t warp_rank = cta_idx * kNumWarps + warp, num_warps = num_ctas * kNumWarps;

    auto* expert_count = reinterpret_cast<uint32_t*>(smem + kSmemExpertCountOffset);
    const dispatch::RecvTable table =
        dispatch::make_recv_table(reinterpret_cast<uint32_t*>(smem + kSmemRecvTableOffset));
    auto* barriers = reinterpret_cast<uint64_t*>(smem + kSmemBarrierOffset);
    uint64_t* pull_barrier = barriers + warp;
    combine::ReduceRing ring{smem + kSmemCombineOffset + warp * combine::kSmemBytesPerWarp,
                             barriers + kNumWarps + warp * combine::kNumStages};

    // Init this warp's mbarriers, visible to the async proxy before the first bulk copy
    if (lane == 0) {
        ptx::mbarrier_init(pull_barrier, 1);
        for (uint32_t s = 0; s < combine::kNumStages; ++ s)
            ptx::mbarrier_init(ring.barriers + s, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    const auto sync_cta = []() { __syncthreads(); };
    uint32_t* header = sym.local<uint32_t>(layout::kWorkspaceHeaderOffset);
    const BarrierWords words{header + layout::kGridSyncCounterIdx, header + layout::kNvlBarrierCounterIdx,
                             header + layout::kNvlBarrierSignalIdx};

    // Dispatch: count, reserve slots, write the source indices and counts to the destination ranks
    dispatch::count_and_notify<kNumThreads>(sym, num_tokens, expert_count, cta_idx, num_ctas, thread_idx, sync_cta);
    nvlink_barrier(env, BarrierTags{"gs0_dispatch", "nvl_dispatch", "gs1_dispatch"}, sym, words, cta_idx, num_ctas,
                   thread_idx, sync_cta, true, (debug_flags & kDebugHangAtDispatchBarrier) != 0);

    // Receive table (every CTA), recv stats (CTA 0)
    if (warp == 0)
        dispatch::build_recv_table<kBlockM>(table, sym, lane);
    __syncthreads();
    if (cta_idx == 0)
        dispatch::add_recv_stats<kNumThreads>(table, recv_stats, thread_idx);

    // Pull the received rows into the pool, then run the expert on them
    uint32_t pull_phase = 0;
    dispatch::pull_rows<kBlockM, kBulkPull>(env, sym, table, smem + kSmemPullOffset + warp * dispatch::kPullRowBytes,
                                            pull_barrier, pull_phase, warp_rank, num_warps);
    trivial_expert(env, sym, table, warp_rank, num_warps);

    // Clean the counters once nobody here reads them, then meet the peers: their rows have landed here
    grid_sync(env, "gs_clean", words.grid_counter, cta_idx, num_ctas, thread_idx == 0, sync_cta);
    combine::clean_workspace<kNumThreads>(sym, cta_idx, num_ctas, thread_idx);
    nvlink_barrier(env, BarrierTags{"gs0_combine", "nvl_combine", "gs1_combine"}, sym, words, cta_idx, num_ctas,
                   thread_idx, sync_cta, true);

    // Top-k reduce into y
    combine::reduce_tokens(env, sym, num_tokens, y, ring, warp_rank, num_warps);
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


@functools.lru_cache(maxsize=None)
def _kernel(config: DispatchCombineConfig) -> Any:
    from megamoe.jit import runtime

    return runtime.load(compile_kernel(config), NUM_THREADS)


def config_for(buf: SymmBuffer, block_m: int | None = None, bulk_pull: bool = True) -> DispatchCombineConfig:
    """The unit kernel variant for `buf` (BLOCK_M from the buffer's shared config unless given)."""
    return DispatchCombineConfig(buf.layout, buf.config().block_m if block_m is None else block_m, bulk_pull)


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
        recv_stats: torch.Tensor | None = None, bulk_pull: bool = True, check_inputs: bool = True,
        debug_skip_launch: bool = False, debug_hang: bool = False, timeout_s: float | None = None,
        stream: torch.cuda.Stream | None = None) -> DispatchCombineConfig:
    """Launch the unit kernel for this rank's first `num_tokens` tokens in `buf` (collective over buf.group:
    every rank launches, in the same order, with the same block_m and bulk_pull). y: BF16 [num_tokens, H].
    recv_stats: optional int32 [E_local], += rows received per local expert.
    debug_skip_launch: this rank does not launch (its peers must time out); debug_hang: the dispatch barrier
    waits for an unreachable value (a timeout on one GPU). timeout_s overrides MEGAMOE_TIMEOUT_S."""
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
    config = config_for(buf, block_m, bulk_pull)
    kernel = _kernel(config)
    if debug_skip_launch:
        return config
    env = timeout_records().device_env(rank=buf.rank, timeout_s=timeout_s)
    args = [sym_buffer_struct(buf), runtime.u32(num_tokens), runtime.ptr(y if num_tokens else None),
            runtime.ptr(recv_stats), runtime.u32(DEBUG_HANG_AT_DISPATCH_BARRIER if debug_hang else 0), env]
    kernel.launch(runtime.num_sms(buf.device), args, config.smem_bytes, device=buf.device, stream=stream)
    return config


# ---------------------------------------------------------------------------------------------------------------
# Test support: inputs, exact expectations, views of the results (the tests and the benchmark share them)
# ---------------------------------------------------------------------------------------------------------------

ROUTINGS = ("uniform", "one_expert", "other_rank", "masked")


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs (CPU tensors): x fp8 [T, H], x_sf float32 [T, H/128], topk_idx int64 [T, topk] (global
    expert ids, -1 unused), topk_weights float32 [T, topk]."""

    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def random_inputs(layout: SymmLayout, num_tokens: list[int], routing: str, seed: int) -> list[RankInputs]:
    """Every rank's inputs, identical in every process for one seed. Routings: uniform (distinct random experts),
    one_expert (every token also goes to expert E - 1), other_rank (only experts of rank r + 1), masked (half the
    slots -1, the first tokens with no valid slot)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen = torch.Generator().manual_seed(seed)
    lay, out = layout, []
    for rank, t in enumerate(num_tokens):
        values = torch.randn(t, lay.hidden, generator=gen) * torch.exp2(torch.randint(-6, 6, (t, 1), generator=gen))
        x = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        x_sf = torch.exp(torch.randn(t, lay.hidden // 128, generator=gen))
        experts = torch.rand(t, lay.num_experts, generator=gen).argsort(dim=1)
        if routing == "other_rank":
            dst = (rank + 1) % lay.num_ranks
            local = torch.rand(t, lay.num_local_experts, generator=gen).argsort(dim=1) + dst * lay.num_local_experts
            experts = torch.cat([local, torch.full((t, lay.num_topk), -1)], dim=1)
        idx = experts[:, : lay.num_topk].contiguous()
        if routing == "one_expert":
            hot = lay.num_experts - 1
            missing = ~(idx == hot).any(dim=1)
            slot = torch.randint(0, lay.num_topk, (t,), generator=gen)
            idx[missing, slot[missing]] = hot
        if routing == "masked":
            idx = torch.where(torch.rand(t, lay.num_topk, generator=gen) < 0.5, -1, idx)
            idx[: min(t, 3)] = -1
        weights = torch.rand(t, lay.num_topk, generator=gen) + 0.1
        out.append(RankInputs(x, x_sf, idx.to(torch.int64), weights / weights.sum(dim=1, keepdim=True)))
    return out


def load_inputs(buf: SymmBuffer, inputs: RankInputs) -> int:
    """Copy one rank's inputs into the first rows of its buffer; returns T."""
    t = inputs.x.shape[0]
    for name in ("x", "x_sf", "topk_idx", "topk_weights"):
        getattr(buf, name)[:t].copy_(getattr(inputs, name), non_blocking=True)
    return t


def expected_y(x: torch.Tensor, x_sf: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """y of the unit kernel for one rank's inputs, exactly: out[t, j] = bf16((fp32(x[t]) * sf) * w[t, j]) for each
    valid slot, y[t] = bf16(sum over valid j in slot order of fp32(out[t, j])), zeros without a valid slot."""
    xs = x.float() * x_sf.repeat_interleave(128, dim=1)
    acc = torch.zeros_like(xs)
    for j in range(topk_idx.shape[1]):
        out = (xs * topk_weights[:, j : j + 1]).to(torch.bfloat16).float()
        acc = torch.where((topk_idx[:, j] >= 0)[:, None], acc + out, acc)
    return acc.to(torch.bfloat16)


@dataclass(frozen=True)
class ExpertRows:
    """The rows one local expert received, sorted by (source rank, token, slot) (the reference's order)."""

    src: torch.Tensor          # int64 [n, 3]: (source rank, token, slot)
    x: torch.Tensor            # uint8 [n, H]: the FP8 codes
    x_sf: torch.Tensor         # float32 [n, H/128]
    topk_weight: torch.Tensor  # float32 [n]


def expected_dispatch(inputs: list[RankInputs], layout: SymmLayout, rank: int) -> list[ExpertRows]:
    """What each local expert of `rank` must receive (the reference's dispatch, from the inputs alone)."""
    out = []
    for e in range(rank * layout.num_local_experts, (rank + 1) * layout.num_local_experts):
        picks = [(s, (inp.topk_idx == e).nonzero()) for s, inp in enumerate(inputs)]  # (token, slot) row-major
        src = torch.cat([torch.cat([torch.full((p.shape[0], 1), s), p], dim=1) for s, p in picks]).to(torch.int64)
        out.append(ExpertRows(
            src, torch.cat([inputs[s].x.view(torch.uint8)[p[:, 0]] for s, p in picks]),
            torch.cat([inputs[s].x_sf[p[:, 0]] for s, p in picks]),
            torch.cat([inputs[s].topk_weights[p[:, 0], p[:, 1]] for s, p in picks])))
    return out


def dispatched_rows(buf: SymmBuffer, counts: list[int], block_m: int) -> list[ExpertRows]:
    """The pool read back per local expert (rows at scheduler.pool_offsets, sorted by their metadata), given the
    rows each expert received (e.g. recv_stats of one call)."""
    acts, acts_sf = buf.view("l1_acts").view(torch.uint8), buf.view("l1_acts_sf")
    weights, meta = buf.view("l1_topk_weights"), buf.view("pool_src_metadata").view(torch.int32)
    out = []
    for count, first in zip(counts, scheduler.pool_offsets(counts, block_m)):
        rows = torch.arange(first, first + count, device=buf.device)
        src = meta[rows, :3].to(torch.int64)
        rows = rows[torch.argsort((src[:, 0] * buf.num_max_tokens_per_rank + src[:, 1]) * buf.num_topk + src[:, 2])]
        out.append(ExpertRows(meta[rows, :3].to(torch.int64), acts[rows], acts_sf[:, rows].t(), weights[rows]))
    return out


def compare_dispatch(got: list[ExpertRows], expected: list[ExpertRows]) -> list[str]:
    """Exact comparison per local expert; returns the mismatches as readable strings."""
    errors = []
    for e, (g, x) in enumerate(zip(got, expected)):
        for field in ("src", "x", "x_sf", "topk_weight"):
            a, b = getattr(g, field).cpu(), getattr(x, field).cpu()
            if a.shape != b.shape or not torch.equal(a, b):
                errors.append(f"local expert {e}: {field} differs (got {tuple(a.shape)}, expected {tuple(b.shape)})")
    return errors


def call_errors(buf: SymmBuffer, inputs: list[RankInputs], y: torch.Tensor, recv_stats: torch.Tensor,
                block_m: int) -> list[str]:
    """Everything one call must have produced on this rank (after a poison and a zeroed recv_stats): the pool
    rows exactly, nothing written outside them, the per-expert counts and y, bit for bit."""
    expected = expected_dispatch(inputs, buf.layout, buf.rank)
    counts = [rows.src.shape[0] for rows in expected]
    errors = [] if recv_stats.tolist() == counts else [f"recv counts {recv_stats.tolist()}, expected {counts}"]
    errors += compare_dispatch(dispatched_rows(buf, counts, block_m), expected)
    written = buf.view("pool_src_metadata").view(torch.int32)[:, 0] != -1
    valid = torch.zeros_like(written)
    for count, first in zip(counts, scheduler.pool_offsets(counts, block_m)):
        valid[first : first + count] = True
    if not torch.equal(written, valid):
        errors.append(f"pool metadata written in {int(written.sum())} rows, {int(valid.sum())} received")
    mine = inputs[buf.rank]
    y_expected = expected_y(mine.x, mine.x_sf, mine.topk_idx, mine.topk_weights)
    differ = int((y.view(torch.int16).cpu() != y_expected.view(torch.int16)).sum())
    if differ:
        errors.append(f"y: {differ} of {y.numel()} BF16 values differ")
    return errors


def poison(buf: SymmBuffer, y: torch.Tensor | None = None) -> None:
    """Fill the pool regions (and y) with garbage, so that rows the kernel fails to write are caught."""
    buf.view("l1_acts").view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    buf.view("l1_acts_sf").fill_(float("nan"))
    buf.view("l1_topk_weights").fill_(float("nan"))
    buf.view("pool_src_metadata").view(torch.int32).fill_(-1)
    if y is not None:
        y.fill_(float("nan"))


def workspace_errors(buf: SymmBuffer, num_calls: int) -> list[str]:
    """The state the workspace must be in after `num_calls` calls on a fresh buffer: counters zero, NVLink barrier
    counter 2 calls, each phase signal num_ranks after an odd number of calls and 0 after an even one."""
    errors = [f"{name} not zero after the call" for name in ("expert_send_count", "expert_recv_count",
                                                              "l1_arrival_count", "l1_done_count")
              if bool((buf.view(name).view(torch.int32) != 0).any())]
    header = buf.view("workspace_header").view(torch.int32).cpu().tolist()
    signal = buf.num_ranks if num_calls % 2 else 0
    if header[4] != 2 * num_calls or header[5:7] != [signal, signal] or header[0] & 0x7FFFFFFF:
        errors.append(f"workspace header {header[:7]} after {num_calls} calls (expected grid counter low bits 0, "
                      f"nvl counter {2 * num_calls}, signals {signal})")
    return errors


def bench_round_trip(buf: SymmBuffer, num_tokens: int, *, block_m: int | None = None, bulk_pull: bool = True,
                     num_warmup: int = 10, num_iters: int = 100) -> dict[str, float]:
    """Time dispatch -> trivial expert -> combine (collective: every rank calls it with the same arguments).
    The calls run back to back, each between its own CUDA events, enqueued behind a sleep kernel long enough for
    the host to enqueue them all (megamoe.bench.time_queued_us): GPU time, not Python launch overhead.
    Returns {"median_us", "us_per_call" (mean), "min_us", "max_us", "host_us_per_call", "sleep_us",
    "host_bound" (1.0: the host fell behind anyway), "block_m"}; ready for megamoe.bench to tabulate."""
    from megamoe.bench import time_queued_us

    y = torch.empty(num_tokens, buf.hidden, dtype=torch.bfloat16, device=buf.device)
    config = config_for(buf, block_m, bulk_pull)
    with torch.cuda.device(buf.device):
        stats = time_queued_us(
            lambda: run(buf, num_tokens, y, block_m=config.block_m, bulk_pull=bulk_pull, check_inputs=False),
            warmup=num_warmup, iters=num_iters)
    return dict(stats, us_per_call=stats["mean_us"], block_m=float(config.block_m))


def checked_call(buf: SymmBuffer, inputs: list, block_m: int, bulk: bool = True) -> list[str]:
    """Load this rank's inputs, poison, run one call, check it exactly (recv_stats zeroed: this call's counts).
    Returns the mismatches found (empty when the call is right)."""
    num_tokens = load_inputs(buf, inputs[buf.rank])
    y = torch.empty(num_tokens, buf.hidden, dtype=torch.bfloat16, device=buf.device)
    stats = torch.zeros(buf.layout.num_local_experts, dtype=torch.int32, device=buf.device)
    poison(buf, y)
    run(buf, num_tokens, y, block_m=block_m, recv_stats=stats, bulk_pull=bulk)
    torch.cuda.synchronize()
    return call_errors(buf, inputs, y, stats, block_m)
