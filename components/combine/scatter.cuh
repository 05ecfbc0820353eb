// Combine, first step: an expert's BF16 output row goes to the combine buffer of the rank that sent the token,
// at (top-k slot, token), through the SymBuffer mapping (a peer store over NVLink, or a local one).
// Offsets come from the generated layout header (namespace megamoe::layout), included before this header.
#pragma once

#include <cuda_bf16.h>

#include "common/atomics.cuh"
#include "common/fence.cuh"
#include "common/sym_buffer.cuh"

namespace megamoe::combine {

static_assert(layout::kHidden % 128 == 0, "combine rows are a multiple of 256 B");
static_assert(layout::kCombineOffset % 16 == 0, "combine rows 16 B aligned (vector stores, 1D bulk loads)");

// Byte offset of row (slot, token) in any rank's combine buffer [topk][T_max][H].
MEGAMOE_DEVICE uint64_t combine_row_offset(uint32_t slot, uint32_t token) {
    return layout::kCombineOffset +
           (static_cast<uint64_t>(slot) * layout::kNumMaxTokensPerRank + token) * layout::kHidden *
               sizeof(__nv_bfloat16);
}

// The source rank's combine row for (token, slot), as mapped in this process.
MEGAMOE_DEVICE __nv_bfloat16* combine_row(const SymBuffer& sym, uint32_t src_rank, uint32_t token, uint32_t slot) {
    return sym.peer<__nv_bfloat16>(combine_row_offset(slot, token), src_rank);
}

// 16 B (8 BF16) at element `col` (a multiple of 8) of a combine row.
MEGAMOE_DEVICE void store_combine_chunk(__nv_bfloat16* row, uint32_t col, const uint4& value) {
    *reinterpret_cast<uint4*>(row + col) = value;
}

// After a thread's last combine store, before the barrier that publishes the rows to their ranks.
// NOTES: generic-proxy stores that the destination reads with 1D bulk loads (async proxy) need
// fence.proxy.async.global on the writer's side, before its release (DESIGN 5b); the reader fences again after
// its acquire (reduce.cuh).
MEGAMOE_DEVICE void finish_combine_stores() { ptx::fence_proxy_async_global(); }

// The source rank's count of combine rows landed for `token`.
MEGAMOE_DEVICE uint32_t* combine_arrival_count(const SymBuffer& sym, uint32_t src_rank, uint32_t token) {
    return sym.peer<uint32_t>(layout::kCombineArrivalCountOffset + token * sizeof(uint32_t), src_rank);
}

// After the whole warp stored one combine row: count it at the source rank (reduce_token_chunks waits for a
// token's count to reach its number of valid slots).
// NOTES: __syncwarp orders the other lanes' row stores before lane 0's red.release.sys, whose release is
// cumulative over what lane 0 observed; the reducing warp's ld.acquire.sys of the count pairs with it.
MEGAMOE_DEVICE void signal_combine_row(const SymBuffer& sym, uint32_t src_rank, uint32_t token, uint32_t lane) {
    __syncwarp();
    if (lane == 0)
        ptx::red_add_release<ptx::Scope::kSys>(combine_arrival_count(sym, src_rank, token), 1u);
}

}  // namespace megamoe::combine
