// Typed addresses of the symmetric-buffer regions dispatch reads and writes. Offsets come from the generated
// layout header (megamoe.layout.SymmLayout.to_cpp(), namespace megamoe::layout), which the kernel source
// includes before this header: it is the single source of truth for the byte map.
#pragma once

#include "common/sym_buffer.cuh"

namespace megamoe::dispatch {

static_assert(layout::kNumRanks >= 1 and layout::kNumRanks <= kMaxRanks, "1..kMaxRanks ranks");
static_assert(layout::kMaxRanks == kMaxRanks, "layout and SymBuffer agree on kMaxRanks");
static_assert(layout::kHidden % 128 == 0, "hidden is a multiple of 128 (one float SF per 128 columns)");
static_assert(layout::kNumPoolSrcMetadataFields == 4, "pool_src_metadata rows are one uint4");

constexpr uint32_t kNumSfPerRow = layout::kHidden / 128;
constexpr uint32_t kNumRecvPairs = layout::kNumLocalExperts * layout::kNumRanks;  // (local expert, source rank)

// Workspace: this rank's counters. The send and receive counts are double-buffered by call parity, the low bit
// of the NVLink barrier ordinal at the call's start (the same on every rank: every rank has passed the same
// barriers). A call counts into buffer `parity` and zeroes the other one in its head for the next call
// (combine/clean.cuh: clean_next_parity), so no call needs a barrier at its end before a peer's next notify.
constexpr uint32_t kNumCountParities = 2;
static_assert(layout::kExpertSendCountBytes == kNumCountParities * layout::kNumExperts * sizeof(uint32_t),
              "expert_send_count is [2][E]");
static_assert(layout::kExpertRecvCountBytes == kNumCountParities * kNumRecvPairs * sizeof(uint32_t),
              "expert_recv_count is [2][E_local][R]");

MEGAMOE_DEVICE uint32_t* expert_send_count(const SymBuffer& sym, uint32_t parity) {  // [E]
    return sym.local<uint32_t>(layout::kExpertSendCountOffset) + parity * layout::kNumExperts;
}
MEGAMOE_DEVICE uint32_t* expert_recv_count(const SymBuffer& sym, uint32_t parity) {  // [E_local][R]
    return sym.local<uint32_t>(layout::kExpertRecvCountOffset) + parity * kNumRecvPairs;
}
MEGAMOE_DEVICE uint32_t* l1_arrival_count(const SymBuffer& sym) {  // [max pool blocks]
    return sym.local<uint32_t>(layout::kL1ArrivalCountOffset);
}

// Byte offsets of entries that a source rank writes into the destination rank's workspace
MEGAMOE_DEVICE uint64_t expert_recv_count_offset(uint32_t parity, uint32_t local_expert, uint32_t src_rank) {
    return layout::kExpertRecvCountOffset +
           ((parity * layout::kNumLocalExperts + local_expert) * layout::kNumRanks + src_rank) * sizeof(uint32_t);
}
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
