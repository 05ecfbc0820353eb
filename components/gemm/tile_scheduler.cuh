// Grouped tile scheduler of the standalone GEMM: tiles (expert, m-block, n-block), expert-major, then
// M-major, each expert's rows starting at a multiple of BLOCK_M in the pool (as scheduler.pool_offsets);
// CTA s takes tiles s, s + num_ctas, ... Every role walks the same sequence on its own.
#pragma once

#include "common/utils.cuh"

namespace megamoe::gemm {

struct Tile {
    uint32_t expert_idx;
    uint32_t m_block_idx;
    uint32_t n_block_idx;
    uint32_t pool_row;     // first pool row of the tile
    uint32_t num_valid_rows;  // rows of the tile that belong to the expert (<= BLOCK_M)
};

template <uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kNumExperts>
struct GroupedTileScheduler {
    const int* num_tokens_per_expert;
    uint32_t expert_idx = 0;
    uint32_t expert_first_tile = 0;
    uint32_t expert_pool_row = 0;
    uint32_t expert_num_tokens = 0;

    MEGAMOE_DEVICE explicit GroupedTileScheduler(const int* counts) : num_tokens_per_expert(counts) {
        expert_num_tokens = __ldg(counts);
    }

    // Locate global tile `tile_idx` (non-decreasing across calls); false once past the last tile.
    MEGAMOE_DEVICE bool locate(uint32_t tile_idx, Tile& tile) {
        while (true) {
            const uint32_t num_m_blocks = ceil_div(expert_num_tokens, BLOCK_M);
            if (tile_idx < expert_first_tile + num_m_blocks * kNumNBlocks)
                break;
            expert_first_tile += num_m_blocks * kNumNBlocks;
            expert_pool_row += num_m_blocks * BLOCK_M;
            if (++ expert_idx == kNumExperts)
                return false;
            expert_num_tokens = __ldg(num_tokens_per_expert + expert_idx);
        }
        const uint32_t local_idx = tile_idx - expert_first_tile;
        tile.expert_idx = expert_idx;
        tile.m_block_idx = local_idx / kNumNBlocks;
        tile.n_block_idx = local_idx % kNumNBlocks;
        tile.pool_row = expert_pool_row + tile.m_block_idx * BLOCK_M;
        tile.num_valid_rows = min(BLOCK_M, expert_num_tokens - tile.m_block_idx * BLOCK_M);
        return true;
    }
};

}  // namespace megamoe::gemm
