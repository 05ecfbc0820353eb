// The GEMM ring that the L1 and L2 phases of one kernel share (the expert-FFN unit kernel, the fused kernel).
#pragma once

#include "gemm/traits.cuh"

namespace megamoe::assembler {

// A phase's GEMM traits with the shared-memory carve-up both phases use for their one ring: SFA stages sized
// for L2's two per-64 SFs per K block (L1 fills the first BLOCK_M floats), the barriers after them. Same A and B
// stages and barriers in both phases, so a stage may pass from an L1 tile to an L2 tile.
template <typename Base, uint32_t kSfaStageBytes>
struct SharedRingTraits : Base {
    static_assert(Base::kStageBytesSfa <= kSfaStageBytes, "the shared SFA stage must hold this phase's SFs");
    static constexpr uint32_t kStageBytesSfa = kSfaStageBytes;
    static constexpr uint32_t kOffsetBarriers = Base::kOffsetSfa + Base::kNumStages * kStageBytesSfa;
    static constexpr uint32_t kSmemBytes = kOffsetBarriers + 2 * Base::kNumStages * 8;
};

}  // namespace megamoe::assembler
