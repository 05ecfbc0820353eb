// Compile-time shape and shared-memory plan of the fused kernel (mirrored by megamoe/fused/config.py: FusedConfig,
// which the generated source checks with static_asserts). The model's shape comes from the layout header
// (namespace megamoe::layout), included before this file.
#pragma once

#include <cuda.h>

#include "common/kernel_skeleton.cuh"
#include "dispatch/pull.cuh"
#include "dispatch/recv_table.cuh"
#include "epilogue/l1_epilogue.cuh"
#include "epilogue/l2_epilogue.cuh"
#include "gemm/traits.cuh"
#include "shared_ring.cuh"
#include "task_queue.cuh"

namespace megamoe::assembler {

// kSerial (debug, phase-serial): the TMA-A warp waits until every pool block has arrived before its first tile.
template <uint32_t BLOCK_M_, uint32_t kNumStages_, uint32_t kPullStages_, bool kNMajorL2_, bool kClamp_,
          bool kFastMath_, bool kSerial_>
struct FusedTraits {
    static constexpr uint32_t BLOCK_M = BLOCK_M_;
    static constexpr uint32_t kNumStages = kNumStages_;
    static constexpr uint32_t kPullStages = kPullStages_;
    static constexpr bool kNMajorL2 = kNMajorL2_;
    static constexpr bool kClamp = kClamp_;
    static constexpr bool kFastMath = kFastMath_;
    static constexpr bool kSerial = kSerial_;
    static constexpr uint32_t kHidden = layout::kHidden;
    static constexpr uint32_t kIntermediate = layout::kIntermediate;
    static constexpr uint32_t kNumExperts = layout::kNumLocalExperts;  // the GEMM groups: this rank's experts
    // combine/reduce.cuh: 16 B vectors per lane and slot. 4 at BLOCK_M 128 (12 KB in flight per warp at top-6, the
    // reduce after the last L2 tile): same-call A/B on an H100, T 4096 cold 4-7 us faster in every round and seed, T
    // 1024 unchanged
    static constexpr uint32_t kReduceVecs = BLOCK_M == 128 ? 4 : 2;

    using L1Base = gemm::GemmTraits<BLOCK_M, kNumStages, gemm::ScaleMode::kL1GateUp, 2 * kIntermediate, kHidden>;
    using L2Base = gemm::GemmTraits<BLOCK_M, kNumStages, gemm::ScaleMode::kL2Per64, kHidden, kIntermediate>;
    using L1 = SharedRingTraits<L1Base, L2Base::kStageBytesSfa>;
    using L2 = SharedRingTraits<L2Base, L2Base::kStageBytesSfa>;
    static_assert(L1::kOffsetB == L2::kOffsetB and L1::kOffsetSfa == L2::kOffsetSfa and
                  L1::kOffsetBarriers == L2::kOffsetBarriers, "one ring for both phases");

    static constexpr uint32_t kNumMathWarpgroups = L1::kNumMathWarpgroups;
    static constexpr uint32_t kNumMathThreads = L1::kNumMathThreads;
    static constexpr uint32_t kNumMathWarps = L1::kNumMathWarps;
    static constexpr uint32_t kNumReduceWarps = 8;  // both math warpgroups reduce (a spare one keeps its registers)
    static constexpr uint32_t kNumL1NBlocks = L1::kNumNBlocks;  // 2 I / 128: an L2 pool block's L1 dependencies
    static constexpr uint32_t kNumL2NBlocks = L2::kNumNBlocks;  // H / 128: an L2 pool block's tiles
    static_assert(kNumL1NBlocks * epilogue::kL1OutputCols == kIntermediate, "each L1 tile yields 64 of I columns");
    static_assert(BLOCK_M <= layout::kMaxBlockM and layout::kNumPoolTokens % 4 == 0, "pool sized for BLOCK_M");
    static_assert(layout::kNumPoolTokens / BLOCK_M < 0xffffu, "L1EpilogueState holds pool blocks in 16 bits");

    // Shared memory, in this order (offsets from the 1024 B aligned base):
    //   ring         A, B, SFA stages and the ring's barriers (SharedRingTraits)
    //   staging      L1 double buffer | L2 BF16 rows (a union: never live at the same time), 1024 aligned
    //   pull         kNumDispatchWarps x kPullStages stages of dispatch/pull.cuh (row + SF row), 128 aligned
    //   pull_bars    one mbarrier per pull stage
    //   expert_count E words: count_and_notify's per-expert counts (before the role split only)
    //   recv_table   dispatch/recv_table.cuh
    //   misc         16 B: the NVLink barrier ordinal read at kernel start (for the tail: nothing computed before
    //                the role split stays live in registers across it), the CTA index and the grid size
    //   task_queue   task_queue.cuh: kNumTaskSlots tasks from the TMA-A warp to the TMA-B and math warps
    //   l2_queue     kNumL2TaskSlots of the CTA's claimed L2 tasks from the TMA-A warp to the scatter warp
    //   tile_weights task_queue.cuh: the top-k weights of each task slot's rows, 16 aligned
    using L1Staging = epilogue::L1Staging<BLOCK_M>;
    using L2Staging = epilogue::L2Staging<BLOCK_M>;
    static constexpr uint32_t kOffsetStaging = align_up<uint32_t>(L2::kSmemBytes, 1024);
    static constexpr uint32_t kStagingBytes =
        L1Staging::kBytes > L2Staging::kBytes ? L1Staging::kBytes : L2Staging::kBytes;
    // The L1 store thread's pending counters (epilogue/l1_epilogue.cuh: L1EpilogueState's batched form), right
    // after the staging area (the epilogue addresses it from the staging pointer), at BLOCK_M 128 only. Same-call
    // A/B on an H100 (cold, seeds 0 / 1 / 2): T 4096 7-13 us faster, T 1024 within 1-2 us; at the decode configs
    // (BLOCK_M 32) T 8 and 128 2.5-4 us slower, the L2 tiles starting later (notes/fused.md).
    static constexpr bool kBatchL1Releases = BLOCK_M == 128;
    // The pull's rows published kPullRowsPerRelease per fence at BLOCK_M 128 (each MEMBAR.GPU drains what the SM
    // has in flight, also for the math warps: notes/fused.md, "The release's fence, split"). Same-call A/B on an
    // H100 (cold, seeds 0 / 1 / 2) against one fence per row: 4 rows T 4096 0-10 us, T 1024 1-2 us faster; 8 rows
    // no better at T 4096 (notes/fused.md, "The pull's rows published several per fence").
    static constexpr uint32_t kPullRowsPerRelease = BLOCK_M == 128 ? 4 : 1;
    static constexpr uint32_t kOffsetL1Releases = kOffsetStaging + kStagingBytes;
    static constexpr uint32_t kL1ReleasesBytes = kBatchL1Releases ? epilogue::L1EpilogueState::kListBytes : 0;
    static constexpr uint32_t kOffsetPull = align_up<uint32_t>(kOffsetL1Releases + kL1ReleasesBytes, 128);
    static constexpr uint32_t kPullBytes = kNumDispatchWarps * kPullStages * dispatch::kPullStageBytes;
    static constexpr uint32_t kOffsetPullBarriers = kOffsetPull + kPullBytes;
    static constexpr uint32_t kOffsetExpertCount = kOffsetPullBarriers + kNumDispatchWarps * kPullStages * 8;
    static constexpr uint32_t kOffsetRecvTable =
        align_up<uint32_t>(kOffsetExpertCount + layout::kNumExperts * 4, 16);
    static constexpr uint32_t kOffsetMisc = align_up<uint32_t>(kOffsetRecvTable + dispatch::kRecvTableWords * 4, 16);
    static constexpr uint32_t kNumTaskSlots = 4;
    using Tasks = TaskQueue<kNumTaskSlots>;
    static constexpr uint32_t kOffsetTaskQueue = kOffsetMisc + 16;
    // The scatter warp learns its CTA's L2 tasks from the TMA-A warp, which claims them (fused_scheduler.cuh). It
    // is at most one L2 task behind the math warps (l2_handoff.cuh), which are at most kNumTaskSlots behind the
    // TMA-A warp, so at most kNumTaskSlots + 2 L2 tasks wait in this queue: with 4 slots more than the task queue,
    // a push never waits for the scatter warp (it still waits, bounded, if that argument were wrong).
    static constexpr uint32_t kNumL2TaskSlots = kNumTaskSlots + 4;
    using L2Tasks = TaskQueue<kNumL2TaskSlots>;
    static constexpr uint32_t kOffsetL2TaskQueue = kOffsetTaskQueue + Tasks::kBytes;
    using RowWeights = TileWeights<kNumTaskSlots, BLOCK_M>;
    static constexpr uint32_t kOffsetTileWeights = align_up<uint32_t>(kOffsetL2TaskQueue + L2Tasks::kBytes, 16);
    static constexpr uint32_t kSmemBytes = kOffsetTileWeights + RowWeights::kBytes;
    static_assert(kSmemBytes <= kSmemLimit, "shared memory over the SM90 per-block limit");
    static_assert(kPullStages >= 1 and kPullStages <= 8, "1..8 rows in flight per dispatch warp");
};

// Global memory besides the symmetric buffer and the tensor maps (one struct: the launch passes it by value).
struct FusedParams {
    const float* w1_sf;   // [E_local, 2I/128, H/128]
    const float* w2_sf;   // [E_local, H/128, I/128]
    void* y;              // BF16 [T, H]
    int32_t* recv_stats;  // [E_local] or nullptr: += rows received per local expert
    uint32_t num_tokens;  // T of this rank
    uint32_t debug_flags; // kDebugHangAtDispatchBarrier | kDebugDelayPull
    float clamp;          // activation clamp (read only when compiled with it)
    uint32_t task_dump_capacity;  // tasks per CTA that task_dump holds
    uint32_t* task_dump;  // debug, or nullptr: per CTA [1 + capacity x 4] u32, the TMA-A warp's task list
                          // (count, then (phase << 31 | expert, m block, n block, pool block) per task)
    uint32_t min_wave_l1_tiles;  // fused_scheduler.cuh: a wave of experts closes once its L1 tiles reach this
    uint32_t reserved;
    unsigned long long* phase_times;  // profiling, or nullptr: common/phase_timer.cuh, the FusedPhaseMark phases
};

// The phases the fused kernel marks when handed a phase_times buffer (megamoe/fused/launch.py: PHASES), each the
// earliest and the latest mark over the CTAs' marking warps: kernel start and head done (warp 0); pulls done (each
// dispatch warp: the latest is the last pool block's arrival); every L1 tile's and every L2 tile's A load issued,
// once its input is ready (the TMA-A warp: the earliest L1 mark is the first L1 tile's start, the latest L2 mark the
// last L2 tile's start); L2 tiles sent and signalled (each CTA's scatter warp); tiles and reduce done (the first
// math warp, after its role); kernel end (warp 0).
enum FusedPhaseMark : uint32_t {
    kMarkStart = 0, kMarkHead, kMarkPull, kMarkL1Start, kMarkL2Start, kMarkL2Done, kMarkReduce, kMarkEnd,
    kNumPhaseMarks
};

constexpr uint32_t kDebugHangAtDispatchBarrier = 1u;  // the dispatch barrier waits for an unreachable value
// Stress (debug): the dispatch warps of every odd CTA start their pulls kDebugPullDelayNs late, so that half the pool
// blocks arrive long after the GEMM started on the others (the tiles wait on arrival counts mid-call)
constexpr uint32_t kDebugDelayPull = 2u;
constexpr uint64_t kDebugPullDelayNs = 200000;

// The tensor maps (each a __grid_constant__ kernel parameter; pointers to them here) and the weights, which the
// TMA-B warp loads with non-tensor bulk copies (gemm/producer.cuh: produce_b_tile).
struct FusedMaps {
    const CUtensorMap* l1_a;       // pool [P, H] e4m3, box {128, BLOCK_M}, 128 B swizzle
    const CUtensorMap* l1_sfa;     // [H/128][P] f32, box {BLOCK_M, 1}
    const uint8_t* w1;             // [E_local, 2I, H] e4m3 in the tile layout (megamoe/weights.py: tile_weights)
    const CUtensorMap* l2_a;       // L2 activations [P, I] e4m3, box {128, BLOCK_M}, 128 B swizzle
    const CUtensorMap* l2_sfa;     // [I/64][P] f32, box {BLOCK_M, 2}
    const uint8_t* w2;             // [E_local, H, I] e4m3 in the tile layout
    const CUtensorMap* act_store;  // L2 activations [P, I] e4m3, box {64, BLOCK_M}, no swizzle
};

}  // namespace megamoe::assembler
