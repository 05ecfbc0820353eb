// Typed addresses of the symmetric-buffer regions dispatch reads and writes. Offsets come from the generated
// layout header (megamoe.layout.SymmLayout.to_cpp(), namespace megamoe::layout), which the kernel source
// includes before this header: it is the single source of truth for the byte map.
#pragma once

#include "common/count_buffers.cuh"
#include "common/sym_buffer.cuh"

namespace megamoe::dispatch {

static_assert(layout::kNumRanks >= 1 and layout::kNumRanks <= kMaxRanks, "1..kMaxRanks ranks");
static_assert(layout::kMaxRanks == kMaxRanks, "layout and SymBuffer agree on kMaxRanks");
static_assert(layout::kHidden % 128 == 0, "hidden is a multiple of 128 (one float SF per 128 columns)");
static_assert(layout::kNumPoolSrcMetadataFields == 4, "pool_src_metadata rows are one uint4");

constexpr uint32_t kNumSfPerRow = layout::kHidden / 128;

// Workspace: this rank's pool-block arrival counters (the send and receive counts: common/count_buffers.cuh)
MEGAMOE_DEVICE uint32_t* l1_arrival_count(const SymBuffer& sym) {  // [max pool blocks]
    return sym.local<uint32_t>(layout::kL1ArrivalCountOffset);
}

// Byte offsets of entries that a source rank writes into the destination rank's workspace
MEGAMOE_DEVICE uint64_t src_token_topk_idx_offset(uint32_t local_expert, uint32_t src_rank, uint32_t slot) {
    const uint64_t idx = (static_cast<uint64_t>(local_expert) * layout::kNumRanks + src_rank) *
                         layout::kNumMaxTokensPerRank + slot;
    return layout::kSrcTokenTopkIdxOffset + idx * sizeof(uint32_t);
}

// Inputs (this rank's, or a source rank's through `peer`)
MEGAMOE_DEVICE const int64_t* topk_idx(const SymBuffer& sym) {
    return sym.local<const int64_t>(layout::kTopkIdxOffset);
}
MEGAMOE_DEVICE uint64_t x_row_offset(uint32_t token) {
    return layout::kXOffset + static_cast<uint64_t>(token) * layout::kHidden;
}
MEGAMOE_DEVICE uint64_t x_sf_offset(uint32_t token, uint32_t k) {
    return layout::kXSfOffset + (static_cast<uint64_t>(token) * kNumSfPerRow + k) * sizeof(float);
}
MEGAMOE_DEVICE uint64_t topk_weight_offset(uint32_t token, uint32_t slot) {
    return layout::kTopkWeightsOffset + (static_cast<uint64_t>(token) * layout::kNumTopk + slot) * sizeof(float);
}

// Pool (this rank's): rows grouped by local expert, each expert padded to BLOCK_M
MEGAMOE_DEVICE uint8_t* pool_row(const SymBuffer& sym, uint32_t row) {
    return sym.local<uint8_t>(layout::kL1ActsOffset + static_cast<uint64_t>(row) * layout::kHidden);
}
MEGAMOE_DEVICE float* pool_sf(const SymBuffer& sym, uint32_t k, uint32_t row) {  // MN-major [H/128][P]
    return sym.local<float>(layout::kL1ActsSfOffset +
                            (static_cast<uint64_t>(k) * layout::kNumPoolTokens + row) * sizeof(float));
}
MEGAMOE_DEVICE float* pool_topk_weight(const SymBuffer& sym, uint32_t row) {
    return sym.local<float>(layout::kL1TopkWeightsOffset + static_cast<uint64_t>(row) * sizeof(float));
}
MEGAMOE_DEVICE uint4* pool_src_metadata(const SymBuffer& sym, uint32_t row) {  // (rank, token, slot, 0)
    return sym.local<uint4>(layout::kPoolSrcMetadataOffset + static_cast<uint64_t>(row) * sizeof(uint4));
}

}  // namespace megamoe::dispatch
