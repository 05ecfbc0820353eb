// The math warpgroup's accumulator as the epilogue sees it: one m64n128 fp32 WGMMA tile per warpgroup
// (common/wgmma.cuh, WGMMA_M64N128K32_E4M3), each thread's share of it as common/acc_fragment.cuh maps it.
#pragma once

#include "common/acc_fragment.cuh"
#include "common/wgmma.cuh"

namespace megamoe::epilogue {

using Accumulator = ptx::WGMMA_M64N128K32_E4M3;
constexpr uint32_t kNumAccum = Accumulator::kNumAccum;
constexpr uint32_t kTileCols = Accumulator::N;
constexpr uint32_t kChunkCols = 8;
constexpr uint32_t kNumChunks = kTileCols / kChunkCols;
static_assert(Accumulator::M == 64 and Accumulator::N == 128 and kNumAccum == 64,
              "the epilogue maps the m64n128 fp32 fragment: 64 values per thread, 16 chunks of 8 columns");

// L1 tiles (DESIGN section 4, transform_weights): chunk 2 g holds gate columns, chunk 2 g + 1 the matching up
// columns; output column 8 g + c of the tile pairs gate column 8 (2 g) + c with up column 8 (2 g + 1) + c.
constexpr uint32_t kNumGateUpPairs = kNumChunks / 2;
constexpr uint32_t kL1OutputCols = kNumGateUpPairs * kChunkCols;
static_assert(kL1OutputCols == 64, "one interleaved 128-column L1 tile yields 64 output columns");

// Index into acc of chunk j, row half h (0: row r, 1: row r + 8), column c in {0, 1} of the thread's pair.
MEGAMOE_HOST_DEVICE constexpr uint32_t acc_index(uint32_t chunk, uint32_t half, uint32_t col) {
    return 4 * chunk + 2 * half + col;
}

// Where an epilogue writes one tile: the pool rows and N block it covers.
struct EpilogueTile {
    uint32_t pool_row;        // first pool row of the tile (a multiple of BLOCK_M)
    uint32_t n_block_idx;     // the GEMM's N block (L1: 128 interleaved columns = 64 output columns)
    uint32_t num_valid_rows;  // rows that belong to the expert; the rest of the BLOCK_M rows are padding
};

}  // namespace megamoe::epilogue
