// L2 epilogue: the promoted fp32 accumulator of one L2 tile -> BF16 (round to nearest even), staged in shared
// memory, in one of two layouts: the rows the combine scatter reads (L2Staging: BLOCK_M rows of 128 BF16, one row
// per (token, slot) destination), or two TMA boxes of 64 columns (L2BoxStaging: the unit kernel's BF16 [P, H]
// output, stored by the TMA for a full tile). Also a copy of the staged rows by threads (partial tiles).
#pragma once

#include <cuda_bf16.h>

#include "common/tma.cuh"
#include "epilogue/fragment.cuh"
#include "epilogue/smem.cuh"

namespace megamoe::epilogue {

// BLOCK_M rows of 256 B. The 16-byte chunk c of row r (columns 8 c .. 8 c + 7) sits at chunk position
// c ^ (r % 8): the 8 rows of an 8x8 stmatrix block then fall into 8 distinct bank groups, and a reader that
// takes the 16 chunks of a row touches 256 contiguous bytes.
template <uint32_t BLOCK_M>
struct L2Staging {
    static constexpr uint32_t kRowBytes = kTileCols * sizeof(__nv_bfloat16);
    static constexpr uint32_t kNumRowChunks = kRowBytes / 16;
    static constexpr uint32_t kBytes = BLOCK_M * kRowBytes;
    static_assert(kRowBytes == 256 and kNumRowChunks == 16, "rows of 128 BF16 = 16 chunks of 16 B");
    static_assert(BLOCK_M == 32 or BLOCK_M == 64 or BLOCK_M == 128, "BLOCK_M in {32, 64, 128}");

    MEGAMOE_HOST_DEVICE static constexpr uint32_t chunk_offset(uint32_t row, uint32_t chunk) {
        return row * kRowBytes + ((chunk ^ (row % 8)) * 16);
    }
};

// Two boxes of BLOCK_M rows x 64 BF16 (128 B), columns 0..63 then 64..127, each in the TMA's 128 B swizzle: the
// 16-byte chunk c % 8 of row r sits at position (c % 8) ^ (r % 8) of the row's 128 B (an 8x8 stmatrix block's 8
// rows again in 8 distinct bank groups). Boxes start 1024 B aligned when the staging does.
template <uint32_t BLOCK_M>
struct L2BoxStaging {
    static constexpr uint32_t kBoxCols = kTileCols / 2;
    static constexpr uint32_t kBoxRowBytes = kBoxCols * sizeof(__nv_bfloat16);
    static constexpr uint32_t kBoxBytes = BLOCK_M * kBoxRowBytes;
    static constexpr uint32_t kBytes = 2 * kBoxBytes;
    static constexpr uint32_t kNumRowChunks = 2 * kBoxRowBytes / 16;
    static_assert(kBoxRowBytes == 128 and kBoxBytes % 1024 == 0, "a box is whole 128 B swizzle atoms");

    MEGAMOE_HOST_DEVICE static constexpr uint32_t chunk_offset(uint32_t row, uint32_t chunk) {
        return (chunk / 8) * kBoxBytes + ptx::swizzle_128b_offset(row, (chunk % 8) * 16);
    }
};

// Stage the thread's accumulator as BF16 in `Staging`'s layout (L2Staging or L2BoxStaging): per pair of chunks
// (j, j + 1) one stmatrix.x4 of the 8x8 blocks (rows 0-7 of the warp, chunk j), (rows 8-15, j), (rows 0-7, j + 1),
// (rows 8-15, j + 1); lane l addresses row 8 ((l / 8) % 2) + l % 8 of the warp's 16, chunk j + l / 16. Call from
// whole warps whose rows lie inside the tile.
template <typename Staging>
MEGAMOE_DEVICE void l2_stage_bf16(const float (&acc)[kNumAccum], const AccFragment& frag, uint8_t* staging) {
    const uint32_t lane = lane_idx();
    const uint32_t row = frag.warp_row() + 8 * ((lane / 8) % 2) + lane % 8;
    const uint32_t chunk_step = lane / 16;
    const uint32_t base = smem_addr(staging);
    #pragma unroll
    for (uint32_t j = 0; j < kNumChunks; j += 2) {
        stmatrix_x4(base + Staging::chunk_offset(row, j + chunk_step),
                    pack_bf16x2(acc[acc_index(j, 0, 0)], acc[acc_index(j, 0, 1)]),
                    pack_bf16x2(acc[acc_index(j, 1, 0)], acc[acc_index(j, 1, 1)]),
                    pack_bf16x2(acc[acc_index(j + 1, 0, 0)], acc[acc_index(j + 1, 0, 1)]),
                    pack_bf16x2(acc[acc_index(j + 1, 1, 0)], acc[acc_index(j + 1, 1, 1)]));
    }
}

// The 16 bytes (8 BF16, columns 8 chunk ..) of staged row `row`.
template <typename Staging>
MEGAMOE_DEVICE uint4 l2_load_staged_chunk(const uint8_t* staging, uint32_t row, uint32_t chunk) {
    return ld_shared_v4(smem_addr(staging) + Staging::chunk_offset(row, chunk));
}

// Copy the first num_valid_rows staged rows to dst (row i at dst + i * dst_row_elems), 16 B per thread and step;
// kNumThreads threads, `thread_idx` among them. Padding rows are never written.
template <typename Staging, uint32_t kNumThreads>
MEGAMOE_DEVICE void l2_copy_staged_rows(const uint8_t* staging, uint32_t num_valid_rows, __nv_bfloat16* dst,
                                        uint32_t dst_row_elems, uint32_t thread_idx) {
    constexpr uint32_t kNumRowChunks = Staging::kNumRowChunks;
    for (uint32_t i = thread_idx; i < num_valid_rows * kNumRowChunks; i += kNumThreads) {
        const uint32_t row = i / kNumRowChunks, chunk = i % kNumRowChunks;
        *reinterpret_cast<uint4*>(dst + static_cast<uint64_t>(row) * dst_row_elems + chunk * kChunkCols) =
            l2_load_staged_chunk<Staging>(staging, row, chunk);
    }
}

}  // namespace megamoe::epilogue
