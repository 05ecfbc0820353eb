// Task sequence of the expert-FFN unit kernel: every L1 tile (expert-major, then bands of kBandM m-blocks, n-block-
// major inside a band: gemm/tile_scheduler.cuh), then every L2 tile in the same order; CTA s takes tasks s,
// s + num_ctas, ... Every role walks it on its own.
// No deadlock (as megamoe/scheduler.py argues for the fused wave schedule): an L2 tile waits only for the L1
// tiles of its pool block, all earlier in the sequence; each CTA runs its tasks in increasing order and every
// CTA is resident (cooperative launch), so by induction on the task index every task completes.
#pragma once

#include "gemm/tile_scheduler.cuh"

namespace megamoe::assembler {

enum class Phase : uint32_t { kL1 = 0, kL2 = 1 };

struct FfnTask {
    Phase phase;
    gemm::Tile tile;
};

template <uint32_t BLOCK_M, uint32_t kNumL1NBlocks, uint32_t kNumL2NBlocks, uint32_t kNumExperts, uint32_t kBandM = 1>
struct ExpertFfnScheduler {
    gemm::GroupedTileScheduler<BLOCK_M, kNumL1NBlocks, kNumExperts, kBandM> l1;
    gemm::GroupedTileScheduler<BLOCK_M, kNumL2NBlocks, kNumExperts, kBandM> l2;
    bool in_l2 = false;
    uint32_t num_l1_tiles = 0;

    MEGAMOE_DEVICE explicit ExpertFfnScheduler(const int* num_tokens_per_expert)
        : l1(num_tokens_per_expert), l2(num_tokens_per_expert) {}

    // Locate task `task_idx` (non-decreasing across calls); false once past the last L2 tile.
    MEGAMOE_DEVICE bool locate(uint32_t task_idx, FfnTask& task) {
        if (not in_l2) {
            if (l1.locate(task_idx, task.tile)) {
                task.phase = Phase::kL1;
                return true;
            }
            // Past the last L1 tile: the L1 walker has counted them all (it is never called again)
            in_l2 = true;
            num_l1_tiles = l1.expert_first_tile;
        }
        task.phase = Phase::kL2;
        return l2.locate(task_idx - num_l1_tiles, task.tile);
    }
};

}  // namespace megamoe::assembler
