// Grouped tile scheduler of the standalone GEMM: tiles (expert, m-block, n-block), expert-major; within an
// expert, bands of kBandM m-blocks, and within a band n-block-major (the band's m-blocks the fastest index). Each
// expert's rows start at a multiple of BLOCK_M in the pool (as scheduler.pool_offsets); CTA s takes tiles
// s, s + num_ctas, ... Every role walks the same sequence on its own.
// NOTES: why bands: the CTAs of one wave (132 consecutive tiles) share the A rows and B columns they read through
// L2. M-major (kBandM = 1) spreads a wave over all n-blocks of ~4 m-blocks, so every wave re-reads the expert's
// whole B (29 MiB at N 4096, K 7168: more than the L2 keeps) from HBM; a band of 16 m-blocks keeps its A rows in
// L2 while the wave sweeps ~8 n-blocks at a time, so B is read once per band.
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

template <uint32_t BLOCK_M, uint32_t kNumNBlocks, uint32_t kNumExperts, uint32_t kBandM = 1>
struct GroupedTileScheduler {
    static_assert(kBandM >= 1, "a band holds at least one m-block");

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
        // Band of m-blocks (the last one may be short), then n-block-major inside it
        const uint32_t local_idx = tile_idx - expert_first_tile;
        const uint32_t band_idx = local_idx / (kBandM * kNumNBlocks);
        const uint32_t band_first_m = band_idx * kBandM;
        const uint32_t band_num_m = min(kBandM, ceil_div(expert_num_tokens, BLOCK_M) - band_first_m);
        const uint32_t in_band = local_idx - band_idx * kBandM * kNumNBlocks;
        tile.expert_idx = expert_idx;
        tile.m_block_idx = band_first_m + in_band % band_num_m;
        tile.n_block_idx = in_band / band_num_m;
        tile.pool_row = expert_pool_row + tile.m_block_idx * BLOCK_M;
        tile.num_valid_rows = min(BLOCK_M, expert_num_tokens - tile.m_block_idx * BLOCK_M);
        return true;
    }
};

}  // namespace megamoe::gemm
