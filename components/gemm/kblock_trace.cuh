// Profiling aid: SM clock readings at the steps of each K block of one CTA's math warpgroups, to see how the two
// warpgroups' WGMMA groups and promotions interleave. Compiled out unless enabled.
#pragma once

#include "common/utils.cuh"

namespace megamoe::gemm {

// Events of a K block, in order: its stage is ready, its first WGMMA is issued, its last WGMMA group completed
// (the block's promotion then runs while the next block's WGMMAs do: gemm/consumer.cuh)
enum class KBlockEvent : uint32_t { kStageReady = 0, kIssue = 1, kDone = 2 };
constexpr uint32_t kNumKBlockEvents = 3;
constexpr uint32_t kMaxTracedKBlocks = 512;

// buffer: [math warpgroup][kMaxTracedKBlocks][kNumKBlockEvents] u64 clock64() readings; set for one thread per
// math warpgroup of CTA 0 (nullptr elsewhere). NOTES: no mark sits between a WGMMA commit and its wait (its
// branch would make ptxas serialize the pipeline).
template <bool kEnabled>
struct KBlockTrace {
    unsigned long long* buffer;
    uint32_t num_blocks = 0;

    MEGAMOE_DEVICE void mark(KBlockEvent event) const {
        if constexpr (kEnabled) {
            if (buffer != nullptr and num_blocks < kMaxTracedKBlocks)
                buffer[num_blocks * kNumKBlockEvents + static_cast<uint32_t>(event)] = clock64();
        }
    }

    MEGAMOE_DEVICE void next() {
        if constexpr (kEnabled)
            ++ num_blocks;
    }
};

}  // namespace megamoe::gemm
