// Compile-time shape of the FP8 grouped GEMM: tile sizes, scale-factor modes, shared-memory carve-up.
#pragma once

#include "common/warp_roles.cuh"

namespace megamoe::gemm {

// How scale factors are promoted into the fp32 accumulator (DESIGN section 4):
// kL1GateUp: A (activations) one SF per 128 K; B tile of 128 interleaved gate/up rows takes two weight SFs,
//            gate for even 8-column chunks, up for odd ones.
// kL2Per64:  A one SF per 64 K (two K = 64 WGMMA batches per 128-K block, promoted separately); B one SF.
enum class ScaleMode : uint32_t { kL1GateUp = 0, kL2Per64 = 1 };

// kClusterN_: CTAs per cluster along N (1 or 2). With 2, the cluster's CTAs compute tiles (m, 2 j) and (m, 2 j + 1)
// of the same A rows, and each TMA-A warp loads half of A's rows, multicast into both CTAs (gemm/producer.cuh).
template <uint32_t BLOCK_M_, uint32_t kNumStages_, ScaleMode kScaleMode_, uint32_t SHAPE_N_, uint32_t SHAPE_K_,
          uint32_t kClusterN_ = 1>
struct GemmTraits {
    static constexpr uint32_t BLOCK_M = BLOCK_M_;
    static constexpr uint32_t BLOCK_N = 128;
    static constexpr uint32_t BLOCK_K = 128;
    static constexpr uint32_t WGMMA_M = 64;
    static constexpr uint32_t WGMMA_K = 32;
    static constexpr uint32_t kNumStages = kNumStages_;
    static constexpr ScaleMode kScaleMode = kScaleMode_;
    static constexpr uint32_t SHAPE_N = SHAPE_N_;
    static constexpr uint32_t SHAPE_K = SHAPE_K_;
    static constexpr uint32_t kClusterN = kClusterN_;

    static_assert(BLOCK_M == 32 or BLOCK_M == 64 or BLOCK_M == 128, "BLOCK_M in {32, 64, 128}");
    static_assert(SHAPE_N % BLOCK_N == 0, "N must be a multiple of BLOCK_N = 128");
    static_assert(SHAPE_K % BLOCK_K == 0, "K must be a multiple of BLOCK_K = 128");
    static_assert(kScaleMode != ScaleMode::kL1GateUp or SHAPE_N % (2 * BLOCK_N) == 0,
                  "L1 mode: N = 2 I with I a multiple of 128");
    static_assert(kNumStages >= 2, "at least double buffering");
    static_assert(kClusterN == 1 or (kClusterN == 2 and BLOCK_M == 128 and SHAPE_N % (2 * BLOCK_N) == 0),
                  "A multicast: clusters of 2 CTAs along N, BLOCK_M 128, an even number of n-blocks");

    // Cooperative mode: two math warpgroups of 64 rows share each B tile.
    static constexpr uint32_t kNumMathWarpgroups = BLOCK_M == 128 ? 2 : 1;
    static constexpr uint32_t kNumMathThreads = kNumMathWarpgroups * 128;
    static constexpr uint32_t kNumMathWarps = kNumMathThreads / 32;
    // A tile of `num_valid_rows` rows whose second math warpgroup holds only padding rows (kSkipPadding of
    // gemm/consumer.cuh and gemm/producer.cuh: that warpgroup does no math)
    MEGAMOE_DEVICE static bool second_warpgroup_idle(uint32_t num_valid_rows) {
        return kNumMathWarpgroups == 2 and num_valid_rows <= WGMMA_M;
    }
    static constexpr uint32_t kNumKBlocks = SHAPE_K / BLOCK_K;
    static constexpr uint32_t kNumNBlocks = SHAPE_N / BLOCK_N;
    static constexpr uint32_t kNumKSteps = BLOCK_K / WGMMA_K;
    static constexpr uint32_t kNumSfaPerKBlock = kScaleMode == ScaleMode::kL2Per64 ? 2 : 1;

    // A stages stay 64 rows tall for BLOCK_M = 32: WGMMA always reads 64 rows (the extra rows are never
    // written by TMA and their results are discarded).
    static constexpr uint32_t kStageRowsA = BLOCK_M < WGMMA_M ? WGMMA_M : BLOCK_M;
    static constexpr uint32_t kStageBytesA = kStageRowsA * BLOCK_K;
    static constexpr uint32_t kStageBytesB = BLOCK_N * BLOCK_K;
    static constexpr uint32_t kStageBytesSfa = align_up<uint32_t>(kNumSfaPerKBlock * BLOCK_M * 4, 128);
    static constexpr uint32_t kTmaBytesA = BLOCK_M * BLOCK_K + kNumSfaPerKBlock * BLOCK_M * 4;
    static constexpr uint32_t kTmaBytesB = kStageBytesB;
    static constexpr uint32_t kMulticastRowsA = BLOCK_M / kClusterN;  // A rows each CTA's TMA-A warp loads
    static_assert(kStageBytesA % 1024 == 0 and kStageBytesB % 1024 == 0, "swizzled stages stay 1024 B aligned");

    // Shared memory: [A stages][B stages][SFA stages][full barriers][empty barriers]
    static constexpr uint32_t kOffsetA = 0;
    static constexpr uint32_t kOffsetB = kOffsetA + kNumStages * kStageBytesA;
    static constexpr uint32_t kOffsetSfa = kOffsetB + kNumStages * kStageBytesB;
    static constexpr uint32_t kOffsetBarriers = kOffsetSfa + kNumStages * kStageBytesSfa;
    static constexpr uint32_t kSmemBytes = kOffsetBarriers + 2 * kNumStages * 8;
    static_assert(kSmemBytes <= kSmemLimit, "shared memory over the SM90 per-block limit");
};

// Pointers into the dynamic shared memory for one set of traits.
template <typename T>
struct GemmSmem {
    uint8_t* base;
    uint32_t base_addr = smem_addr(base);  // shared-window address of base, computed once

    MEGAMOE_DEVICE uint32_t a_addr(uint32_t stage) const { return base_addr + T::kOffsetA + stage * T::kStageBytesA; }
    MEGAMOE_DEVICE uint32_t b_addr(uint32_t stage) const { return base_addr + T::kOffsetB + stage * T::kStageBytesB; }

    MEGAMOE_DEVICE uint8_t* a(uint32_t stage) const { return base + T::kOffsetA + stage * T::kStageBytesA; }
    MEGAMOE_DEVICE uint8_t* b(uint32_t stage) const { return base + T::kOffsetB + stage * T::kStageBytesB; }
    MEGAMOE_DEVICE float* sfa(uint32_t stage) const {
        return reinterpret_cast<float*>(base + T::kOffsetSfa + stage * T::kStageBytesSfa);
    }
    MEGAMOE_DEVICE uint64_t* full_barriers() const { return reinterpret_cast<uint64_t*>(base + T::kOffsetBarriers); }
    MEGAMOE_DEVICE uint64_t* empty_barriers() const { return full_barriers() + T::kNumStages; }
};

}  // namespace megamoe::gemm
