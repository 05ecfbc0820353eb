// The dispatch/combine unit kernel: dispatch -> trivial expert (out = x * sf * weight) -> combine, persistent and
// cooperative (megamoe.kernels.dispatch_combine generates its traits and the entry point). Its head and, with the
// lean sync, its tail are the fused kernel's (dispatch_phases.cuh); the pull and reduce are the components'.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "common/fence.cuh"
#include "common/grid_sync.cuh"
#include "common/mbarrier.cuh"
#include "common/nvlink_barrier.cuh"
#include "common/phase_timer.cuh"
#include "combine/clean.cuh"
#include "combine/reduce.cuh"
#include "combine/scatter.cuh"
#include "dispatch/count.cuh"
#include "dispatch/pull.cuh"
#include "dispatch/recv_table.cuh"
#include "dispatch_phases.cuh"

namespace megamoe::unit {

// One variant's compile-time knobs (megamoe/kernels/dispatch_combine.py: DispatchCombineConfig) and its shared-memory
// plan (DispatchCombineConfig.smem_regions)
template <uint32_t kNumThreads_, uint32_t kBlockM_, bool kBulkPull_, bool kPipelinedPull_, uint32_t kPullStages_,
          uint32_t kPullWarps_, bool kCoalescedCombineStore_, bool kBulkReduce_, uint32_t kReduceVecs_,
          bool kLeanSync_, bool kTablePrefetch_, bool kReduceOverlap_, uint32_t kDebugHangAtDispatchBarrier_,
          uint32_t kSmemPullOffset_, uint32_t kSmemCombineOffset_, uint32_t kSmemExpertCountOffset_,
          uint32_t kSmemRecvTableOffset_, uint32_t kSmemBarrierOffset_>
struct DispatchCombineTraits {
    static constexpr uint32_t kNumThreads = kNumThreads_;
    static constexpr uint32_t kNumWarps = kNumThreads / 32;
    static constexpr uint32_t kBlockM = kBlockM_;
    static constexpr bool kBulkPull = kBulkPull_;
    static constexpr bool kPipelinedPull = kPipelinedPull_;
    static constexpr uint32_t kPullStages = kPullStages_;
    static constexpr uint32_t kPullWarps = kPullWarps_;
    static constexpr bool kCoalescedCombineStore = kCoalescedCombineStore_;
    static constexpr bool kBulkReduce = kBulkReduce_;
    static constexpr uint32_t kReduceVecs = kReduceVecs_;
    static constexpr bool kLeanSync = kLeanSync_;
    static constexpr bool kTablePrefetch = kTablePrefetch_;
    static constexpr bool kReduceOverlap = kReduceOverlap_;
    static constexpr uint32_t kDebugHangAtDispatchBarrier = kDebugHangAtDispatchBarrier_;
    static constexpr uint32_t kSmemPullOffset = kSmemPullOffset_;
    static constexpr uint32_t kSmemCombineOffset = kSmemCombineOffset_;
    static constexpr uint32_t kSmemExpertCountOffset = kSmemExpertCountOffset_;
    static constexpr uint32_t kSmemRecvTableOffset = kSmemRecvTableOffset_;
    static constexpr uint32_t kSmemBarrierOffset = kSmemBarrierOffset_;
    // Pull barriers first: kPullWarps x kPullStages (pipelined) or one per warp; then the combine rings' (kBulkReduce)
    static constexpr uint32_t kNumPullBarriers = kPipelinedPull ? kPullWarps * kPullStages : kNumWarps;

    static_assert(kNumThreads % 32 == 0 and kNumThreads <= 384, "whole warps, at most 384 threads");
    static_assert(kPullWarps >= 1 and kPullWarps <= kNumWarps, "pulling warps");
    static_assert(not kPipelinedPull or kBulkPull, "the pipelined pull is a bulk pull");
    static_assert(not kBulkPull or kSmemPullOffset % 16 == 0, "1D bulk copy destinations 16 B aligned");
    static_assert(kSmemCombineOffset % 16 == 0 and kSmemBarrierOffset % 8 == 0, "alignment of the smem regions");
    static_assert(dispatch::kPullRowBytes % 16 == 0, "pull rows keep 16 B alignment");
};

// Wait for every row of the pool block holding `loc` (as a GEMM consumer does)
template <typename T>
MEGAMOE_DEVICE void wait_pool_block(const DeviceEnv& env, const SymBuffer& sym, const dispatch::RecvTable& table,
                                    const dispatch::RowLocation& loc, uint32_t lane) {
    const uint32_t pool_block = loc.pool_row / T::kBlockM;
    const uint32_t num_block_rows = dispatch::num_rows_in_block<T::kBlockM>(table, loc);
    // NOTES: lane 0's ld.acquire.gpu pairs with the pullers' releases (pull.cuh: release_row / release_pipelined_row /
    // release_pipelined_rows); __syncwarp extends the acquire to the other lanes before their plain loads of the pool.
    if (lane == 0) {
        const uint32_t* arrival = dispatch::l1_arrival_count(sym) + pool_block;
        bounded_wait(
            secondary_env(env), "l1_arrival",
            [&]() { return ptx::ld_acquire<ptx::Scope::kGpu>(arrival) >= num_block_rows; },
            [&]() { return make_longlong3(ptx::ld_relaxed<ptx::Scope::kGpu>(arrival), num_block_rows, pool_block); });
    }
    __syncwarp();
}

// out = bf16((fp32(fp8) * sf) * weight), 8 codes (two u32 words) -> 8 BF16 (four u32 words)
MEGAMOE_DEVICE void dequant_8(const uint32_t (&words)[2], float sf, float weight, uint32_t (&packed)[4]) {
#pragma unroll
    for (uint32_t i = 0; i < 4; ++ i) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2))), __NV_E4M3);
        const float2 f = __half22float2(__half2(h));
        const __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(f.x, sf), weight),
                                                       __fmul_rn(__fmul_rn(f.y, sf), weight));
        packed[i] = *reinterpret_cast<const uint32_t*>(&b);
    }
}

// The trivial expert: out = bf16((fp32(x) * sf) * weight) for every element of the pulled row, written to the
// source rank's combine row (slot, token). Global warp `warp_rank` takes received rows like the pull does.
// Split stores (legacy): lane l converts 16 codes per step, two 16 B stores at bytes 32 c and 32 c + 16 (each
// store instruction half-fills 32 sectors). Coalesced: lane l converts the 8 codes at 256 it + 8 l and stores
// bytes [512 it + 16 l, +16) (each instruction fills 4 whole 128 B lines); kExpertBatch steps' loads are issued
// before their stores.
constexpr uint32_t kExpertBatch = 8;
template <typename T>
MEGAMOE_DEVICE void trivial_expert(const DeviceEnv& env, const SymBuffer& sym, const dispatch::RecvTable& table,
                                   uint32_t warp_rank, uint32_t num_warps) {
    const uint32_t lane = lane_idx();
    const uint32_t num_rows = table.num_rows();
    for (uint32_t g = warp_rank; g < num_rows; g += num_warps) {
        const dispatch::RowLocation loc = dispatch::locate(table, g);
        wait_pool_block<T>(env, sym, table, loc, lane);

        const uint4 meta = *dispatch::pool_src_metadata(sym, loc.pool_row);
        const float weight = *dispatch::pool_topk_weight(sym, loc.pool_row);
        const uint8_t* row = dispatch::pool_row(sym, loc.pool_row);
        __nv_bfloat16* dst = combine::combine_row(sym, meta.x, meta.y, meta.z);
        if constexpr (T::kCoalescedCombineStore) {
            constexpr uint32_t kSteps = (layout::kHidden + 255) / 256;
#pragma unroll 1
            for (uint32_t base = 0; base < kSteps; base += kExpertBatch) {
                uint2 q[kExpertBatch];
                float sf[kExpertBatch];
#pragma unroll
                for (uint32_t j = 0; j < kExpertBatch; ++ j) {
                    const uint32_t col = (base + j) * 256 + lane * 8;
                    q[j] = make_uint2(0u, 0u);
                    sf[j] = 0.0f;
                    if (base + j < kSteps and col < layout::kHidden) {
                        q[j] = *reinterpret_cast<const uint2*>(row + col);
                        sf[j] = *dispatch::pool_sf(sym, col / 128, loc.pool_row);
                    }
                }
#pragma unroll
                for (uint32_t j = 0; j < kExpertBatch; ++ j) {
                    const uint32_t col = (base + j) * 256 + lane * 8;
                    if (base + j < kSteps and col < layout::kHidden) {
                        const uint32_t words[2] = {q[j].x, q[j].y};
                        uint32_t packed[4];
                        dequant_8(words, sf[j], weight, packed);
                        combine::store_combine_chunk(dst, col, make_uint4(packed[0], packed[1], packed[2], packed[3]));
                    }
                }
            }
        } else {
            for (uint32_t c = lane; c < layout::kHidden / 16; c += 32) {
                const uint4 q = reinterpret_cast<const uint4*>(row)[c];
                const float sf = *dispatch::pool_sf(sym, c / 8, loc.pool_row);
                const uint32_t lo[2] = {q.x, q.y}, hi[2] = {q.z, q.w};
                uint32_t a[4], b[4];
                dequant_8(lo, sf, weight, a);
                dequant_8(hi, sf, weight, b);
                combine::store_combine_chunk(dst, c * 16, make_uint4(a[0], a[1], a[2], a[3]));
                combine::store_combine_chunk(dst, c * 16 + 8, make_uint4(b[0], b[1], b[2], b[3]));
            }
        }
        combine::finish_combine_stores();
        if constexpr (T::kReduceOverlap)
            combine::signal_combine_row(sym, meta.x, meta.y, lane);
    }
}

// The kernel body (every thread of every CTA). PHASES (dispatch_combine.py) are marked in this order; the timer is
// off unless the launch passes a buffer.
template <typename T>
MEGAMOE_DEVICE void dispatch_combine_impl(const SymBuffer& sym, uint32_t num_tokens, __nv_bfloat16* y,
                                          int32_t* recv_stats, uint32_t debug_flags, const DeviceEnv& env,
                                          unsigned long long* phase_times) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t warp = warp_idx(), lane = lane_idx(), thread_idx = threadIdx.x;
    const uint32_t cta_idx = blockIdx.x, num_ctas = gridDim.x;
    const uint32_t warp_rank = cta_idx * T::kNumWarps + warp, num_warps = num_ctas * T::kNumWarps;
    const bool is_pull_warp = warp < T::kPullWarps;
    const PhaseTimer timer{phase_times};
    timer.mark(0, lane);
    combine::clean_at_start<T::kNumThreads>(sym, cta_idx, num_ctas, thread_idx);
    const uint32_t pull_warp_rank = cta_idx * T::kPullWarps + warp, num_pull_warps = num_ctas * T::kPullWarps;

    auto* expert_count = reinterpret_cast<uint32_t*>(smem + T::kSmemExpertCountOffset);
    const dispatch::RecvTable table =
        dispatch::make_recv_table(reinterpret_cast<uint32_t*>(smem + T::kSmemRecvTableOffset));
    auto* barriers = reinterpret_cast<uint64_t*>(smem + T::kSmemBarrierOffset);
    // Pipelined: this warp's kPullStages barriers and stages (pulling warps only); legacy: one barrier and row
    uint64_t* pull_barriers = barriers + (T::kPipelinedPull ? warp * T::kPullStages : warp);
    combine::ReduceRing ring{smem + T::kSmemCombineOffset + warp * combine::kSmemBytesPerWarp,
                             barriers + T::kNumPullBarriers + warp * combine::kNumStages};

    // Init this warp's mbarriers, visible to the async proxy before the first bulk copy
    if (lane == 0) {
        if constexpr (T::kPipelinedPull) {
            if (is_pull_warp)
                for (uint32_t s = 0; s < T::kPullStages; ++ s)
                    ptx::mbarrier_init(pull_barriers + s, 1);
        } else {
            ptx::mbarrier_init(pull_barriers, 1);
        }
        if constexpr (T::kBulkReduce)
            for (uint32_t s = 0; s < combine::kNumStages; ++ s)
                ptx::mbarrier_init(ring.barriers + s, 1);
        ptx::fence_mbarrier_init();
    }

    const auto sync_cta = []() { __syncthreads(); };
    const BarrierWords words = assembler::barrier_words(sym);
    // NOTES: every thread reads the NVLink barrier counter here, before its CTA's first grid-sync arrival; CTA 0
    // moves it only after that grid sync (both barriers: nvlink_barrier, nvlink_barrier_polled), and earlier
    // calls' moves are ordered by the kernel boundary. Its low bit is the call's count parity
    // (common/count_buffers.cuh).
    const uint32_t nvl_ordinal = *words.nvl_counter;
    const uint32_t parity = nvl_ordinal & 1u;
    __syncthreads();

    // Dispatch: count, reserve slots, notify; the dispatch barrier; the receive table and recv stats
    const assembler::HeadArgs head{num_tokens, expert_count, table, recv_stats, nullptr,
                                   (debug_flags & T::kDebugHangAtDispatchBarrier) != 0};
    assembler::dispatch_head<T::kNumThreads, T::kBlockM, true, T::kTablePrefetch, T::kLeanSync>(
        env, sym, head, [&]() { return nvl_ordinal; }, parity, cta_idx, num_ctas, thread_idx,
        [&](uint32_t i) { timer.mark(i, lane); });

    // Pull the received rows into the pool, then run the expert on them
    if (is_pull_warp) {
        if constexpr (T::kPipelinedPull) {
            dispatch::pull_rows_pipelined<T::kBlockM, T::kPullStages>(
                env, sym, table, smem + T::kSmemPullOffset + warp * T::kPullStages * dispatch::kPullStageBytes,
                pull_barriers, pull_warp_rank, num_pull_warps);
        } else {
            uint32_t pull_phase = 0;
            dispatch::pull_rows<T::kBlockM, T::kBulkPull>(env, sym, table,
                                                          smem + T::kSmemPullOffset + warp * dispatch::kPullRowBytes,
                                                          pull_barriers, pull_phase, pull_warp_rank, num_pull_warps);
        }
        timer.mark(4, lane);
    }
    trivial_expert<T>(env, sym, table, warp_rank, num_warps);
    timer.mark(5, lane);

    if constexpr (T::kReduceOverlap) {
        // Reduce as soon as this warp's scatter is done, token by token as their rows land; then the barrier that
        // cleans the counters and lets the peers past this call
        combine::reduce_token_chunks<T::kReduceVecs, true>(env, sym, num_tokens, y, warp_rank, num_warps);
        timer.mark(6, lane);
        assembler::combine_tail<T::kNumThreads, true>(env, sym, nvl_ordinal + 1u, parity, cta_idx, num_ctas,
                                                        thread_idx);
    } else {
        if constexpr (T::kLeanSync) {
            // One grid sync: CTA 0 zeroes the receive counts before it signals, every CTA the local counters while
            // it waits (combine/clean.cuh: clean_recv_counts, clean_local_counters)
            assembler::combine_tail<T::kNumThreads, true>(env, sym, nvl_ordinal + 1u, parity, cta_idx, num_ctas,
                                                          thread_idx);
        } else {
            // Clean the counters once nobody here reads them, then meet the peers: their rows have landed here
            grid_sync(env, "gs_clean", words.grid_counter, cta_idx, num_ctas, thread_idx == 0, sync_cta);
            combine::clean_workspace<T::kNumThreads>(sym, parity, cta_idx, num_ctas, thread_idx);
            nvlink_barrier(env, BarrierTags{"gs0_combine", "nvl_combine", "gs1_combine"}, sym, words, cta_idx,
                           num_ctas, thread_idx, sync_cta, true);
        }
        timer.mark(6, lane);

        // Top-k reduce into y
        if constexpr (T::kBulkReduce)
            combine::reduce_tokens(env, sym, num_tokens, y, ring, warp_rank, num_warps);
        else
            combine::reduce_token_chunks<T::kReduceVecs>(env, sym, num_tokens, y, warp_rank, num_warps);
    }
    timer.mark(7, lane);
}

}  // namespace megamoe::unit
