// The send and receive counts of the workspace, which dispatch counts into and combine's clean zeroes:
// double-buffered by call parity, the low bit of the NVLink barrier ordinal at the call's start (the same on every
// rank: every rank has passed the same barriers). A call counts into buffer `parity` and zeroes the other one in its
// head for the next call (combine/clean.cuh: clean_next_parity), so no call needs a barrier at its end before a
// peer's next notify. Offsets come from the generated layout header (namespace megamoe::layout), included before
// this header.
#pragma once

#include "sym_buffer.cuh"

namespace megamoe {

constexpr uint32_t kNumCountParities = 2;
constexpr uint32_t kNumSendCounts = layout::kNumExperts;                          // [E] per parity
constexpr uint32_t kNumRecvPairs = layout::kNumLocalExperts * layout::kNumRanks;  // (local expert, source rank)
static_assert(layout::kExpertSendCountBytes == kNumCountParities * kNumSendCounts * sizeof(uint32_t),
              "expert_send_count is [2][E]");
static_assert(layout::kExpertRecvCountBytes == kNumCountParities * kNumRecvPairs * sizeof(uint32_t),
              "expert_recv_count is [2][E_local][R]");

MEGAMOE_DEVICE uint32_t* expert_send_count(const SymBuffer& sym, uint32_t parity) {  // [E]
    return sym.local<uint32_t>(layout::kExpertSendCountOffset) + parity * kNumSendCounts;
}
MEGAMOE_DEVICE uint32_t* expert_recv_count(const SymBuffer& sym, uint32_t parity) {  // [E_local][R]
    return sym.local<uint32_t>(layout::kExpertRecvCountOffset) + parity * kNumRecvPairs;
}

// Byte offset of the receive count a source rank adds to in the destination rank's workspace
MEGAMOE_DEVICE uint64_t expert_recv_count_offset(uint32_t parity, uint32_t local_expert, uint32_t src_rank) {
    return layout::kExpertRecvCountOffset + ((parity * layout::kNumLocalExperts + local_expert) * layout::kNumRanks +
                                             src_rank) * sizeof(uint32_t);
}

}  // namespace megamoe
