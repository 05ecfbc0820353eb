// Producer side of the GEMM pipeline: the TMA-A warp (activation tile + its scale factors, MN-major pool)
// and the TMA-B warp (weight tile). One lane of each warp issues; both arrive on the stage's full barrier.
// The K loops stay rolled (`#pragma unroll 1`): with 3-5 K blocks the compiler unrolled them fully and the
// producer warps, at their reduced register budget, spilled 12-52 B (the wait loops' timeout values). The
// catalog's variants (8 K blocks and more) were never unrolled: their SASS is unchanged.
#pragma once

#include "common/tma.cuh"
#include "gemm/pipeline.cuh"
#include "gemm/traits.cuh"

namespace megamoe::gemm {

// Load the K blocks of one A tile: BLOCK_M pool rows starting at `pool_row`, and their SFs
// (rows [kNumSfaPerKBlock * k, +kNumSfaPerKBlock) of the [K / (128 / kNumSfaPerKBlock), P] SF pool).
template <typename T>
MEGAMOE_DEVICE void produce_a_tile(const Pipeline<T::kNumStages>& pipeline, PipelineState<T::kNumStages>& state,
                                   const GemmSmem<T>& smem, const CUtensorMap* tensor_map_a,
                                   const CUtensorMap* tensor_map_sfa, uint32_t pool_row, const DeviceEnv& env) {
    #pragma unroll 1
    for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
        pipeline.producer_acquire(env, state);
        pipeline.producer_commit(state, T::kTmaBytesA);
        ptx::tma_load_2d(smem.a(state.stage), tensor_map_a, pipeline.full_barrier(state),
                         k_block_idx * T::BLOCK_K, pool_row);
        ptx::tma_load_2d(smem.sfa(state.stage), tensor_map_sfa, pipeline.full_barrier(state), pool_row,
                         k_block_idx * T::kNumSfaPerKBlock);
        state.advance();
    }
}

// Load the K blocks of one B tile: rows [b_row, b_row + 128) of the weights viewed as [E * N, K].
template <typename T>
MEGAMOE_DEVICE void produce_b_tile(const Pipeline<T::kNumStages>& pipeline, PipelineState<T::kNumStages>& state,
                                   const GemmSmem<T>& smem, const CUtensorMap* tensor_map_b, uint32_t b_row,
                                   const DeviceEnv& env) {
    #pragma unroll 1
    for (uint32_t k_block_idx = 0; k_block_idx < T::kNumKBlocks; ++ k_block_idx) {
        pipeline.producer_acquire(env, state);
        pipeline.producer_commit(state, T::kTmaBytesB);
        ptx::tma_load_2d(smem.b(state.stage), tensor_map_b, pipeline.full_barrier(state), k_block_idx * T::BLOCK_K,
                         b_row);
        state.advance();
    }
}

}  // namespace megamoe::gemm
