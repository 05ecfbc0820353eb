// Producer side of the GEMM pipeline: the TMA-A warp (activation tile + its scale factors, MN-major pool)
// and the TMA-B warp (weight tile). One lane of each warp issues; both arrive on the stage's full barrier.
// The K loops stay rolled (`#pragma unroll 1`): with 3-5 K blocks the compiler unrolled them fully and the
// producer warps, at their reduced register budget, spilled 12-52 B (the wait loops' timeout values). The
// catalog's variants (8 K blocks and more) were never unrolled: their SASS is unchanged.
#pragma once

#include "common/cluster.cuh"
#include "common/tma.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/traits.cuh"

namespace megamoe::gemm {

// Load the K blocks of one A tile: BLOCK_M pool rows starting at `pool_row`, and their SFs
// (rows [kNumSfaPerKBlock * k, +kNumSfaPerKBlock) of the [K / (128 / kNumSfaPerKBlock), P] SF pool).
// kClusterN = 2: `tensor_map_a`'s box is kMulticastRowsA rows; CTA rank r loads rows [r * kMulticastRowsA, +...)
// of the tile into both CTAs of the cluster (same stage offset, each CTA's full barrier receives the bytes), so the
// full barrier still expects the whole tile. The SFs (1-2 KB) each CTA loads for itself.
// NOTES: the peer's half may land (complete_tx) on this CTA's full barrier before this warp's expect_tx: the phase
// cannot complete early, since this warp's arrival is still pending. The peer writes a stage only after its own
// empty barrier completed, which counts this CTA's math warps too (Pipeline::consumer_release).
template <typename T>
MEGAMOE_DEVICE void produce_a_tile(const Pipeline<T::kNumStages, T::kClusterN>& pipeline,
                                   PipelineState<T::kNumStages>& state, const GemmSmem<T>& smem,
                                   const CUtensorMap* tensor_map_a, const CUtensorMap* tensor_map_sfa,
                                   uint32_t pool_row, const DeviceEnv& env, uint32_t cta_rank = 0) {
    #pragma unroll 1
    for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
        pipeline.producer_acquire(env, state);
        pipeline.producer_commit(state, T::kTmaBytesA);
        if constexpr (T::kClusterN == 1) {
            ptx::tma_load_2d(smem.a(state.stage), tensor_map_a, pipeline.full_barrier(state),
                             k_block_idx * T::BLOCK_K, pool_row);
        } else {
            const uint32_t first_row = cta_rank * T::kMulticastRowsA;
            ptx::tma_load_2d_multicast(smem.a(state.stage) + first_row * T::BLOCK_K, tensor_map_a,
                                       pipeline.full_barrier(state), k_block_idx * T::BLOCK_K, pool_row + first_row,
                                       (1u << T::kClusterN) - 1);
        }
        ptx::tma_load_2d(smem.sfa(state.stage), tensor_map_sfa, pipeline.full_barrier(state), pool_row,
                         k_block_idx * T::kNumSfaPerKBlock);
        state.advance();
    }
}

// Load the K blocks of one B tile from weights stored in the tile layout (megamoe/weights.py: tile_weights): tile
// `tile_idx` = expert * kNumNBlocks + n block is kNumKBlocks consecutive 16 KB blocks, each the 128 rows x 128 B
// of one K block already in the 128 B swizzle that the consumer's descriptors expect, so one non-tensor bulk copy
// per stage moves it. Measured on the H200 (probe, 805 MB streamed by 132 CTAs, nothing else): 2D tensor boxes of
// the row-major weights 4.15-4.31 TB/s, these copies 4.44-4.46 (at 2-16 stages, 8-64 KB each), the 16 B load
// floor 4.44 (notes/gemm.md).
// kSkipPadding (with num_valid_rows): where the tile's second math warpgroup holds only padding rows, it skips the
// tile (gemm/consumer.cuh) and this warp arrives on each stage's empty barrier for its warps.
template <typename T, bool kSkipPadding = false>
MEGAMOE_DEVICE void produce_b_tile(const Pipeline<T::kNumStages, T::kClusterN>& pipeline,
                                   PipelineState<T::kNumStages>& state, const GemmSmem<T>& smem,
                                   const uint8_t* b_tiles, uint32_t tile_idx, const DeviceEnv& env,
                                   uint32_t num_valid_rows = T::BLOCK_M) {
    static_assert(T::kTmaBytesB == T::BLOCK_N * T::BLOCK_K, "one stage of B is one whole 128 x 128 B block");
    const uint8_t* tile = b_tiles + static_cast<uint64_t>(tile_idx) * T::kNumKBlocks * T::kTmaBytesB;
    const bool release_for_idle = kSkipPadding and T::second_warpgroup_idle(num_valid_rows);
    #pragma unroll 1
    for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
        pipeline.producer_acquire(env, state);
        if constexpr (kSkipPadding) {
            if (release_for_idle)
                pipeline.producer_release_for_idle(state, T::kNumMathWarps / T::kNumMathWarpgroups);
        }
        pipeline.producer_commit(state, T::kTmaBytesB);
        ptx::bulk_load_1d(smem.b(state.stage), tile + k_block_idx * T::kTmaBytesB, T::kTmaBytesB,
                          pipeline.full_barrier(state));
        state.advance();
    }
}

}  // namespace megamoe::gemm
