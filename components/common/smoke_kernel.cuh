// Smoke kernel of the common layer: a persistent loop over the tiles of a 2D fp32 tensor that
// TMA-loads a tile through an mbarrier, transforms it in shared memory, and TMA-stores it back.
// out[r, c] = 2 * in[r, c] + r - c (position-dependent, so a wrong swizzle address fails the test).
#pragma once

#include "fence.cuh"
#include "mbarrier.cuh"
#include "sync.cuh"
#include "tma.cuh"

namespace megamoe::smoke {

template <uint32_t kNumThreads, uint32_t BLOCK_ROWS, uint32_t BLOCK_COLS, bool kSwizzle128B>
MEGAMOE_DEVICE void smoke_kernel_impl(const CUtensorMap* tensor_map_in, const CUtensorMap* tensor_map_out,
                                      uint32_t num_rows, uint32_t num_cols, uint32_t debug_hang,
                                      const DeviceEnv& env) {
    static_assert(kNumThreads % 32 == 0, "whole warps");
    static_assert(not kSwizzle128B or BLOCK_COLS * sizeof(float) == 128, "128 B swizzle: rows of 128 B");
    static_assert(BLOCK_COLS * sizeof(float) % 16 == 0, "TMA box inner extent is a multiple of 16 B");
    constexpr uint32_t kTileBytes = BLOCK_ROWS * BLOCK_COLS * sizeof(float);
    static_assert(kTileBytes % 1024 == 0, "tile keeps the next region 1024 B aligned");

    extern __shared__ __align__(1024) uint8_t smem[];
    auto* tile = reinterpret_cast<float*>(smem);
    auto* full_barrier = reinterpret_cast<uint64_t*>(smem + kTileBytes);

    // Init the barrier and make it visible to the async proxy before the first TMA
    if (threadIdx.x == 0) {
        MEGAMOE_DEVICE_ASSERT(smem_addr(smem) % 1024 == 0);
        ptx::prefetch_tensormap(tensor_map_in);
        ptx::prefetch_tensormap(tensor_map_out);
        ptx::mbarrier_init(full_barrier, 1);
        ptx::fence_mbarrier_init();
    }
    __syncthreads();

    const uint32_t num_row_blocks = ceil_div(num_rows, BLOCK_ROWS);
    const uint32_t num_col_blocks = ceil_div(num_cols, BLOCK_COLS);
    uint32_t phase = 0;
    for (uint32_t tile_idx = blockIdx.x; tile_idx < num_row_blocks * num_col_blocks; tile_idx += gridDim.x) {
        const uint32_t row_base = (tile_idx / num_col_blocks) * BLOCK_ROWS;
        const uint32_t col_base = (tile_idx % num_col_blocks) * BLOCK_COLS;

        // Issue the TMA load (the debug switch expects 16 B more than arrive, so the wait must time out)
        if (threadIdx.x == 0) {
            ptx::mbarrier_arrive_expect_tx(full_barrier, kTileBytes + (debug_hang ? 16 : 0));
            ptx::tma_load_2d(tile, tensor_map_in, full_barrier, col_base, row_base);
        }

        // Wait for the tile, transform it in place
        ptx::mbarrier_wait(env, "smoke_full", full_barrier, phase);
        phase ^= 1;
        for (uint32_t i = threadIdx.x; i < BLOCK_ROWS * BLOCK_COLS; i += kNumThreads) {
            const uint32_t row = i / BLOCK_COLS, col = i % BLOCK_COLS;
            const uint32_t offset = kSwizzle128B ? ptx::swizzle_128b_offset(row, col * sizeof(float)) / sizeof(float)
                                                 : i;
            const float position = static_cast<float>(row_base + row) - static_cast<float>(col_base + col);
            tile[offset] = 2.0f * tile[offset] + position;
        }

        // NOTES: generic-proxy st.shared -> TMA store reading shared memory: each writer fences to the
        // async proxy, the writers meet at a barrier, then one thread issues the store (DESIGN 5b).
        ptx::fence_proxy_async_shared_cta();
        ptx::named_barrier_sync<1, kNumThreads>();
        if (threadIdx.x == 0) {
            ptx::tma_store_2d(tensor_map_out, tile, col_base, row_base);
            ptx::bulk_commit_group();
            // The tile is reloaded next iteration: the store must have finished reading it
            ptx::bulk_wait_group_read<0>();
        }
        ptx::named_barrier_sync<1, kNumThreads>();
    }

    // The writes must be complete before the kernel's completion is what the host relies on
    if (threadIdx.x == 0)
        ptx::bulk_wait_group<0>();
}

}  // namespace megamoe::smoke
