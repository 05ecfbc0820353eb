// Standalone unit-test kernel of the GEMM component: an m-grouped FP8 GEMM over a pool-like A (each
// expert's rows start at a multiple of BLOCK_M), B [E, N, K] FP8 with 128x128 float SFs, BF16 output for
// the valid rows only. Persistent over all SMs, 384 threads: WG0 = 2 idle (dispatch in the fused kernel)
// + TMA-A + TMA-B warps, WG1/WG2 = math.
#pragma once

#include <cuda_bf16.h>

#include "common/fence.cuh"
#include "common/sync.cuh"
#include "common/warp_roles.cuh"
#include "gemm/consumer.cuh"
#include "gemm/producer.cuh"
#include "gemm/tile_scheduler.cuh"

namespace megamoe::gemm {

// Store the accumulator as BF16, rows below `num_valid_rows` only (padding rows never written).
template <typename T>
MEGAMOE_DEVICE void store_tile_bf16(const float (&acc)[WGMMA::kNumAccum], const Fragment& frag, const Tile& tile,
                                    __nv_bfloat16* d) {
    #pragma unroll
    for (uint32_t half = 0; half < 2; ++ half) {
        const uint32_t row = frag.row + half * 8;
        if (row >= tile.num_valid_rows)
            continue;
        auto* out = d + static_cast<uint64_t>(tile.pool_row + row) * T::SHAPE_N + tile.n_block_idx * T::BLOCK_N + frag.col;
        #pragma unroll
        for (uint32_t j = 0; j < WGMMA::N / 8; ++ j)
            *reinterpret_cast<__nv_bfloat162*>(out + 8 * j) =
                __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
}

// kTrace: CTA 0 records its K blocks' timeline into `trace` (gemm/kblock_trace.cuh). kFeedOnly: no math (the
// producers' rate; the output is not written).
template <typename T, uint32_t kNumExperts, bool kTrace = false, bool kFeedOnly = false>
MEGAMOE_DEVICE void grouped_gemm_impl(const CUtensorMap* tensor_map_a, const CUtensorMap* tensor_map_sfa,
                                      const CUtensorMap* tensor_map_b, const float* w_sf,
                                      const int* num_tokens_per_expert, __nv_bfloat16* d, const DeviceEnv& env,
                                      unsigned long long* trace = nullptr) {
    using Scheduler = GroupedTileScheduler<T::BLOCK_M, T::kNumNBlocks, kNumExperts>;
    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const GemmSmem<T> smem{smem_buffer};
    const Pipeline<T::kNumStages> pipeline{smem.full_barriers(), smem.empty_barriers()};
    const uint32_t warp = warp_idx(), lane = lane_idx();

    // Init the ring, visible to the async proxy before the first TMA
    if (threadIdx.x == 0) {
        MEGAMOE_DEVICE_ASSERT(smem_addr(smem_buffer) % 1024 == 0);
        ptx::prefetch_tensormap(tensor_map_a);
        ptx::prefetch_tensormap(tensor_map_sfa);
        ptx::prefetch_tensormap(tensor_map_b);
        pipeline.init(2, T::kNumMathWarps);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    if (warp < 4) {
        // WG0: the TMA producers (the other two warps are the fused kernel's dispatch warps)
        ptx::setmaxnreg_dec<kNumProducerRegs>();
        if ((warp == kTmaAWarpIdx or warp == kTmaBWarpIdx) and lane == 0) {
            PipelineState<T::kNumStages> state;
            Scheduler scheduler(num_tokens_per_expert);
            Tile tile;
            for (uint32_t tile_idx = blockIdx.x; scheduler.locate(tile_idx, tile); tile_idx += gridDim.x) {
                if (warp == kTmaAWarpIdx)
                    produce_a_tile<T>(pipeline, state, smem, tensor_map_a, tensor_map_sfa, tile.pool_row, env);
                else
                    produce_b_tile<T>(pipeline, state, smem, tensor_map_b,
                                      tile.expert_idx * T::SHAPE_N + tile.n_block_idx * T::BLOCK_N, env);
            }
        }
    } else if (warp / 4 - 1 < T::kNumMathWarpgroups) {
        // Math warpgroups: accumulate each tile, store it
        ptx::setmaxnreg_inc<kNumMathRegs>();
        const uint32_t math_wg_idx = warp / 4 - 1, thread_in_wg = threadIdx.x % 128;
        const Fragment frag = Fragment::of(math_wg_idx, thread_in_wg);
        KBlockTrace<kTrace> tracer{blockIdx.x == 0 and thread_in_wg == 0 and trace != nullptr
                                       ? trace + math_wg_idx * kMaxTracedKBlocks * kNumKBlockEvents : nullptr};
        PipelineState<T::kNumStages> state;
        Scheduler scheduler(num_tokens_per_expert);
        Tile tile;
        for (uint32_t tile_idx = blockIdx.x; scheduler.locate(tile_idx, tile); tile_idx += gridDim.x) {
            float acc[WGMMA::kNumAccum];
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                acc[i] = 0.0f;
            consume_tile<T, kTrace, kFeedOnly>(pipeline, state, smem, WeightScales<T>::of(w_sf, tile.expert_idx, tile.n_block_idx),
                            math_wg_idx, thread_in_wg, acc, env, &tracer);
            if constexpr (not kFeedOnly)
                store_tile_bf16<T>(acc, frag, tile, d);
        }
    } else {
        // WG2 without work (BLOCK_M <= 64): give its registers back
        ptx::setmaxnreg_dec<kNumProducerRegs>();
    }
}

}  // namespace megamoe::gemm
