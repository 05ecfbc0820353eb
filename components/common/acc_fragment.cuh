// Where a math warpgroup's thread holds its values of one m64n128 fp32 WGMMA accumulator (common/wgmma.cuh,
// WGMMA_M64N128K32_E4M3), as the GEMM consumer's promotion and both epilogues see it. Thread t of math warpgroup
// g (warp w = t / 32, lane l) holds tile rows r = 64 g + 16 w + l / 4 and r + 8, columns 8 j + 2 (l % 4) + {0, 1}
// for the 16 chunks j of 8 columns: acc[4 j + 0, 1] (row r), acc[4 j + 2, 3] (row r + 8). A row's 128 columns
// live in the 4 lanes of one quad.
#pragma once

#include "common/utils.cuh"

namespace megamoe {

struct AccFragment {
    uint32_t row;        // tile row of acc[4 j + 0, 1]; acc[4 j + 2, 3] is row + 8
    uint32_t quad_lane;  // lane % 4: columns 8 j + 2 quad_lane + {0, 1}

    MEGAMOE_DEVICE static AccFragment of(uint32_t math_wg_idx, uint32_t thread_in_wg) {
        const uint32_t warp_in_wg = thread_in_wg / 32, lane = thread_in_wg % 32;
        return {math_wg_idx * 64 + warp_in_wg * 16 + lane / 4, lane % 4};
    }

    // Tile column of acc[4 j + 0] minus 8 j; acc[4 j + 1] is one to the right
    MEGAMOE_DEVICE uint32_t col() const { return 2 * quad_lane; }

    // First tile row of this thread's warp (16 rows per warp)
    MEGAMOE_DEVICE uint32_t warp_row() const { return row & ~15u; }
};

}  // namespace megamoe
