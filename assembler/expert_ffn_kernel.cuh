// Unit-test kernel of the epilogue component, composed with the gemm component: the local expert FFN of one
// rank over a pool (experts back to back, each padded to a multiple of BLOCK_M):
//   L1 grouped GEMM (gate/up interleaved weights) + L1 epilogue -> L2 activations [P, I] e4m3 + SF [I/64][P]
//   L2 grouped GEMM (per-64 activation SF) + L2 epilogue -> BF16 [P, H], valid rows only.
// One persistent cooperative launch, L1 tiles then L2 tiles (expert_ffn_scheduler.cuh): the L2 TMA-A producer
// waits for its pool block's L1 completion counter, so the L1 -> L2 publication runs as in the fused kernel.
// 384 threads: WG0 = 2 idle warps (dispatch in the fused kernel) + TMA-A + TMA-B warps; WG1, WG2 = math.
#pragma once

#include <cuda_bf16.h>

#include "common/fence.cuh"
#include "common/sync.cuh"
#include "common/kernel_skeleton.cuh"
#include "epilogue/l1_epilogue.cuh"
#include "epilogue/l2_epilogue.cuh"
#include "expert_ffn_scheduler.cuh"
#include "gemm/consumer.cuh"
#include "gemm/producer.cuh"
#include "shared_ring.cuh"

namespace megamoe::assembler {

// Named barriers among the math threads (0 is __syncthreads)
constexpr uint32_t kL1StoreBarrierIdx = 1;      // L1 staging written -> one thread issues the TMA stores
constexpr uint32_t kStagingFreeBarrierIdx = 2;  // every reader of the shared staging area is done with it
constexpr uint32_t kL2StagedBarrierIdx = 3;     // L2 staging written -> TMA stores issued, or rows copied out

// kBandM: m-blocks per band of the tile order (gemm/tile_scheduler.cuh); kPrefetch: the next stage awaited while
// a block's last WGMMA group runs (gemm/consumer.cuh).
template <uint32_t BLOCK_M_, uint32_t kNumStages_, uint32_t kHidden_, uint32_t kIntermediate_, uint32_t kNumExperts_,
          bool kClamp_, bool kFastMath_, bool kDebugL1Acc_, uint32_t kBandM_ = 1, bool kPrefetch_ = true>
struct ExpertFfnTraits {
    static constexpr uint32_t BLOCK_M = BLOCK_M_;
    static constexpr uint32_t kNumStages = kNumStages_;
    static constexpr uint32_t kHidden = kHidden_;
    static constexpr uint32_t kIntermediate = kIntermediate_;
    static constexpr uint32_t kNumExperts = kNumExperts_;
    static constexpr bool kClamp = kClamp_;
    static constexpr bool kFastMath = kFastMath_;
    static constexpr bool kDebugL1Acc = kDebugL1Acc_;
    static constexpr uint32_t kBandM = kBandM_;
    static constexpr bool kPrefetch = kPrefetch_;

    using L1Base = gemm::GemmTraits<BLOCK_M, kNumStages, gemm::ScaleMode::kL1GateUp, 2 * kIntermediate, kHidden>;
    using L2Base = gemm::GemmTraits<BLOCK_M, kNumStages, gemm::ScaleMode::kL2Per64, kHidden, kIntermediate>;
    using L1 = SharedRingTraits<L1Base, L2Base::kStageBytesSfa>;
    using L2 = SharedRingTraits<L2Base, L2Base::kStageBytesSfa>;
    static_assert(L1::kOffsetB == L2::kOffsetB and L1::kOffsetSfa == L2::kOffsetSfa and
                  L1::kOffsetBarriers == L2::kOffsetBarriers, "one ring for both phases");
    static_assert(L1::kNumMathThreads == L2::kNumMathThreads, "the same math warpgroups in both phases");

    static constexpr uint32_t kNumMathThreads = L1::kNumMathThreads;
    static constexpr uint32_t kNumL1NBlocks = L1::kNumNBlocks;  // 2 I / 128: an L2 pool block's L1 dependencies
    static constexpr uint32_t kNumL2NBlocks = L2::kNumNBlocks;
    static_assert(kNumL1NBlocks * epilogue::kL1OutputCols == kIntermediate, "each L1 tile yields 64 of I columns");
    static_assert(kNumExperts >= 1, "at least one expert");

    // Shared memory: [ring: A stages, B stages, SFA stages, barriers][staging: L1 double buffer | L2 boxes]. A full
    // L2 tile leaves by two TMA stores of its boxes (against rows copied out by the threads: +3-4% at prefill on an
    // H100, notes/gemm.md); a partial one is copied out by the threads from the same boxes.
    using L1Staging = epilogue::L1Staging<BLOCK_M>;
    using L2Staging = epilogue::L2BoxStaging<BLOCK_M>;
    static constexpr uint32_t kOffsetStaging = align_up<uint32_t>(L2::kSmemBytes, 1024);
    static constexpr uint32_t kStagingBytes =
        L1Staging::kBytes > L2Staging::kBytes ? L1Staging::kBytes : L2Staging::kBytes;
    static constexpr uint32_t kSmemBytes = kOffsetStaging + kStagingBytes;
    static_assert(kSmemBytes <= kSmemLimit, "shared memory over the SM90 per-block limit");
};

// Global memory besides the tensor maps.
struct ExpertFfnParams {
    const float* w1_sf;                // [E, 2I/128, H/128]
    const float* w2_sf;                // [E, H/128, I/128]
    const int* num_tokens_per_expert;  // [E]
    const float* topk_weights;         // [P]
    float* act_sf;                     // [I/64][P]
    uint32_t* l1_done_count;           // [P / BLOCK_M], zero at launch
    __nv_bfloat16* out;                // [P, H]
    float* l1_acc;                     // [P, 2I] fp32, natural column order (debug builds only)
    uint32_t num_pool_rows;            // P
    float clamp;
};

struct ExpertFfnMaps {
    const CUtensorMap* l1_a;       // pool [P, H] e4m3, box {128, BLOCK_M}, 128 B swizzle
    const CUtensorMap* l1_sfa;     // [H/128][P] f32, box {BLOCK_M, 1}
    const uint8_t* w1;             // [E, 2I, H] e4m3 in the tile layout (gemm/producer.cuh: produce_b_tile)
    const CUtensorMap* l2_a;       // L2 activations [P, I] e4m3, box {128, BLOCK_M}, 128 B swizzle
    const CUtensorMap* l2_sfa;     // [I/64][P] f32, box {BLOCK_M, 2}
    const uint8_t* w2;             // [E, H, I] e4m3 in the tile layout
    const CUtensorMap* act_store;  // L2 activations [P, I] e4m3, box {64, BLOCK_M}, no swizzle
    const CUtensorMap* out_store;  // output [P, H] bf16, box {64, BLOCK_M}, 128 B swizzle
};

// L2 producer: wait until every L1 N block of the pool block is published, then let the async proxy read it.
// NOTES: the ld.acquire.gpu pairs with the L1 epilogue's red.release.gpu, issued after its TMA stores of the
// activations and SFs completed (epilogue/l1_epilogue.cuh); fence.proxy.async.global after the acquire and
// before the TMA loads (DESIGN 5b). No printf here: a call anywhere in the kernel's loops makes ptxas serialize
// the math warpgroups' WGMMAs (the record in host-mapped memory still reports the timeout).
template <typename T>
MEGAMOE_DEVICE void wait_l1_done(const uint32_t* done_counts, uint32_t pool_block, const DeviceEnv& env) {
    const uint32_t* counter = done_counts + pool_block;
    bounded_wait<false>(
        env, "l1_done", [&]() { return ptx::ld_acquire<ptx::Scope::kGpu>(counter) >= T::kNumL1NBlocks; },
        [&]() { return make_longlong3(ptx::ld_relaxed<ptx::Scope::kGpu>(counter), T::kNumL1NBlocks, pool_block); });
    ptx::fence_proxy_async_global();
}

template <typename T>
MEGAMOE_DEVICE void expert_ffn_impl(const ExpertFfnMaps& maps, const ExpertFfnParams& p, const DeviceEnv& env) {
    using L1 = typename T::L1;
    using L2 = typename T::L2;
    using Scheduler = ExpertFfnScheduler<T::BLOCK_M, T::kNumL1NBlocks, T::kNumL2NBlocks, T::kNumExperts, T::kBandM>;
    constexpr uint32_t kNumMathThreads = T::kNumMathThreads;
    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const gemm::GemmSmem<L1> smem_l1{smem_buffer};
    const gemm::GemmSmem<L2> smem_l2{smem_buffer};
    const gemm::Pipeline<T::kNumStages> pipeline{smem_l2.full_barriers(), smem_l2.empty_barriers()};
    const uint32_t lane = lane_idx();

    // Init the ring, visible to the async proxy before the first TMA
    if (threadIdx.x == 0) {
        MEGAMOE_DEVICE_ASSERT(smem_addr(smem_buffer) % 1024 == 0);
        ptx::prefetch_tensormap(maps.l1_a);
        ptx::prefetch_tensormap(maps.l1_sfa);
        ptx::prefetch_tensormap(maps.l2_a);
        ptx::prefetch_tensormap(maps.l2_sfa);
        ptx::prefetch_tensormap(maps.act_store);
        ptx::prefetch_tensormap(maps.out_store);
        pipeline.init(2, L1::kNumMathWarps);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    // The TMA producers (lane 0 of each TMA warp issues; the dispatch warps of the fused kernel idle here)
    const auto produce = [&](bool is_tma_a) {
        if (lane != 0)
            return;
        gemm::PipelineState<T::kNumStages> state;
        Scheduler scheduler(p.num_tokens_per_expert);
        FfnTask task;
        for (uint32_t task_idx = blockIdx.x; scheduler.locate(task_idx, task); task_idx += gridDim.x) {
            const gemm::Tile& tile = task.tile;
            if (is_tma_a) {
                if (task.phase == Phase::kL1) {
                    gemm::produce_a_tile<L1>(pipeline, state, smem_l1, maps.l1_a, maps.l1_sfa, tile.pool_row, env);
                } else {
                    wait_l1_done<T>(p.l1_done_count, tile.pool_row / T::BLOCK_M, env);
                    gemm::produce_a_tile<L2>(pipeline, state, smem_l2, maps.l2_a, maps.l2_sfa, tile.pool_row, env);
                }
            } else if (task.phase == Phase::kL1) {
                gemm::produce_b_tile<L1, true>(pipeline, state, smem_l1, maps.w1,
                                               tile.expert_idx * L1::kNumNBlocks + tile.n_block_idx, env,
                                               tile.num_valid_rows);
            } else {
                gemm::produce_b_tile<L2, true>(pipeline, state, smem_l2, maps.w2,
                                               tile.expert_idx * L2::kNumNBlocks + tile.n_block_idx, env,
                                               tile.num_valid_rows);
            }
        }
    };
    // Math warpgroups: accumulate each tile, run its epilogue
    const auto math = [&](uint32_t math_wg_idx, uint32_t thread_in_wg) {
        const uint32_t math_thread_idx = threadIdx.x - kFirstMathThread;
        const bool is_store_thread = math_thread_idx == 0;
        const AccFragment frag = AccFragment::of(math_wg_idx, thread_in_wg);
        uint8_t* staging = smem_buffer + T::kOffsetStaging;
        const epilogue::L1EpilogueArgs l1_args{maps.act_store, p.topk_weights, p.act_sf, p.l1_done_count,
                                               p.num_pool_rows, p.clamp};
        epilogue::L1EpilogueState l1_state;
        bool staging_held_by_l2 = false;

        // A task's weight SFs (gemm::WeightScales), loaded before the previous task's epilogue to hide the latency
        const auto load_weight_scales = [&](const FfnTask& t) {
            return t.phase == Phase::kL1
                ? gemm::WeightScales::load<L1>(p.w1_sf, t.tile.expert_idx, t.tile.n_block_idx, lane)
                : gemm::WeightScales::load<L2>(p.w2_sf, t.tile.expert_idx, t.tile.n_block_idx, lane);
        };
        gemm::PipelineState<T::kNumStages> state;
        Scheduler scheduler(p.num_tokens_per_expert);
        FfnTask task, next_task;
        uint32_t task_idx = blockIdx.x;
        bool has_task = scheduler.locate(task_idx, task);
        gemm::WeightScales weight_scales{};
        if (has_task)
            weight_scales = load_weight_scales(task);
        const auto locate_next = [&](FfnTask& next) {
            task_idx += gridDim.x;
            const bool found = scheduler.locate(task_idx, next);
            if (found)
                weight_scales = load_weight_scales(next);
            return found;
        };
        for (; has_task; task = next_task) {
            const gemm::Tile tile = task.tile;
            const epilogue::EpilogueTile out_tile{tile.pool_row, tile.n_block_idx, tile.num_valid_rows};
            float acc[epilogue::kNumAccum];
            #pragma unroll
            for (uint32_t i = 0; i < epilogue::kNumAccum; ++ i)
                acc[i] = 0.0f;

            if (task.phase == Phase::kL1) {
                // The rows' top-k weights into L1 while the mainloop runs: the epilogue's load then hits it (the
                // call's weights, written before this launch; the fused kernel copies its own into shared memory).
                // Same call on an H100, six rounds each: 32 x 768 rows median 1210 -> 1128 us, 32 x 1536 2470 ->
                // 2455 us (notes/fused.md)
                prefetch_global_l1(p.topk_weights + tile.pool_row + frag.row);
                prefetch_global_l1(p.topk_weights + tile.pool_row + frag.row + 8);
                gemm::consume_tile<L1, false, false, T::kPrefetch, true>(
                    pipeline, state, smem_l1, weight_scales, math_wg_idx, thread_in_wg, acc, env, nullptr,
                    tile.num_valid_rows);
                has_task = locate_next(next_task);
                if constexpr (T::kDebugL1Acc)
                    epilogue::store_l1_acc_natural<T::kIntermediate>(acc, frag, out_tile, p.l1_acc);
                // The L1 buffers alias the L2 staging: wait for its readers (the threads' copies, the TMA stores)
                if (staging_held_by_l2) {
                    if (is_store_thread)
                        ptx::bulk_wait_group_read<0>();
                    ptx::named_barrier_sync<kStagingFreeBarrierIdx, kNumMathThreads>();
                }
                staging_held_by_l2 = false;
                epilogue::L1EpilogueArgs tile_args = l1_args;  // (the tile's row weights)
                tile_args.topk_weights += out_tile.pool_row;
                epilogue::l1_epilogue<T::BLOCK_M, kNumMathThreads, kL1StoreBarrierIdx, T::kClamp, T::kFastMath>(
                    acc, frag, out_tile, staging, tile_args, is_store_thread, l1_state);
            } else {
                // Publish the last L1 tile before waiting for any L2 input (this CTA's L2 producer may need it)
                if (is_store_thread)
                    l1_state.publish_pending(l1_args.done_counts);
                gemm::consume_tile<L2, false, false, T::kPrefetch, true>(
                    pipeline, state, smem_l2, weight_scales, math_wg_idx, thread_in_wg, acc, env, nullptr,
                    tile.num_valid_rows);
                has_task = locate_next(next_task);

                // Stage as BF16 once every earlier reader of the staging area is done (the L1 stores were waited
                // for above, the previous L2 tile's TMA stores here, by the thread that issued them, before it
                // reached this barrier)
                if (is_store_thread)
                    ptx::bulk_wait_group_read<0>();
                ptx::named_barrier_sync<kStagingFreeBarrierIdx, kNumMathThreads>();
                if (frag.warp_row() < T::BLOCK_M)
                    epilogue::l2_stage_bf16<typename T::L2Staging>(acc, frag, staging);
                const bool is_full = tile.num_valid_rows == T::BLOCK_M;
                if (is_full) {
                    // A full tile leaves as two TMA stores (the math warps go on to their next tile meanwhile)
                    ptx::fence_proxy_async_shared_cta();
                    ptx::named_barrier_sync<kL2StagedBarrierIdx, kNumMathThreads>();
                    if (is_store_thread) {
                        const int32_t col = tile.n_block_idx * L2::BLOCK_N, row = tile.pool_row;
                        ptx::tma_store_2d(maps.out_store, staging, col, row);
                        ptx::tma_store_2d(maps.out_store, staging + T::L2Staging::kBoxBytes,
                                          col + T::L2Staging::kBoxCols, row);
                        ptx::bulk_commit_group();
                    }
                } else {
                    // The threads copy the valid rows (a partial tile's padding rows stay unwritten)
                    ptx::named_barrier_sync<kL2StagedBarrierIdx, kNumMathThreads>();
                    epilogue::l2_copy_staged_rows<typename T::L2Staging, kNumMathThreads>(
                        staging, tile.num_valid_rows,
                        p.out + static_cast<uint64_t>(tile.pool_row) * T::kHidden + tile.n_block_idx * L2::BLOCK_N,
                        T::kHidden, math_thread_idx);
                }
                staging_held_by_l2 = true;
            }
        }
        // The last L1 stores complete and are published, and the L2 stores have read the staging, before the
        // kernel ends
        if (is_store_thread)
            l1_state.publish_pending(l1_args.done_counts);
        if (is_store_thread and staging_held_by_l2)
            ptx::bulk_wait_group_read<0>();
    };
    run_warp_roles<L1::kNumMathWarpgroups, SpareWarpgroup::kReleaseRegisters>(
        NoRole{}, [&]() { produce(true); }, [&]() { produce(false); }, math, NoRole{});
}

}  // namespace megamoe::assembler
