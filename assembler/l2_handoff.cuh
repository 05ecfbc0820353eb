// The hand-off of each staged L2 tile from the math warpgroups to the scatter warp (a dispatch warp whose pulls
// are done): the math threads stage the tile's BF16 rows and go on to their next tile; the scatter warp sends the
// rows to their source ranks' combine rows, counts the tile for its pool block and, when the tile completes the
// block, signals the block's rows (fused_roles.cuh: scatter_role). Off the math warps: the metadata loads, the
// combine stores, the gpu-scope count and the row signals (DESIGN 5c: "off the math warps' critical path").
#pragma once

#include "common/sync.cuh"

namespace megamoe::assembler {

// One staging area, one L2 tile in flight, two named barriers over the math threads and the scatter warp, which
// learns the CTA's L2 tasks from the TMA-A warp's L2 queue (fused_roles.cuh: scatter_role), so nothing but the rows
// passes between the two sides:
//   "staged"  per L2 tile: the math threads arrive after their staging writes, the scatter warp syncs;
//   "free"    per L2 tile: the scatter warp arrives after its last read of the rows, the math threads sync before
//             they next write the staging area (the next tile's epilogue, L1 or L2, or at the end of the list).
// The L1 tiles do not involve the scatter warp, which is still pulling while the first L1 tiles run.
// NOTES: named barriers, not mbarriers: the math threads' side is one bar.arrive or bar.sync, with no parity to
// carry and no timeout path in the math region (an mbarrier wait there took the fused variants from 64-76 B to
// 284-332 B of spills). A bar.arrive or bar.sync completes with the prior memory accesses of its threads performed
// relative to every participant (PTX ISA, barrier): the math threads' stmatrix writes are visible to the scatter
// warp after "staged", and the scatter warp's loads of the rows are performed before the math threads pass "free"
// and overwrite them (WAR). Each side waits for the other's phase before arriving again (the math threads sync
// "free" of tile n before they arrive "staged" for tile n + 1; the scatter warp arrives "free" for tile n + 1 only
// after "staged" of tile n + 1), so no phase of either barrier collects arrivals of two tiles. Neither side's
// bar.sync needs a timeout: both reach their barriers by walking the same list, between waits that time out on
// their own (the pull, the GEMM pipeline).
template <uint32_t kNumMathThreads, uint32_t kStagedBarrierIdx, uint32_t kFreeBarrierIdx>
struct L2Handoff {
    static constexpr uint32_t kNumParticipants = kNumMathThreads + 32;

    // Every math thread after its staging writes of an L2 tile.
    MEGAMOE_DEVICE static void publish() { ptx::named_barrier_arrive<kStagedBarrierIdx, kNumParticipants>(); }

    // Every math thread, before writing the staging area after publishing a tile: the scatter warp has read it.
    MEGAMOE_DEVICE static void wait_free() { ptx::named_barrier_sync<kFreeBarrierIdx, kNumParticipants>(); }

    // The scatter warp: the next L2 tile of the list is staged.
    MEGAMOE_DEVICE static void wait_staged() { ptx::named_barrier_sync<kStagedBarrierIdx, kNumParticipants>(); }

    // The scatter warp, every lane, after its last read of the staging area.
    MEGAMOE_DEVICE static void release() {
        __syncwarp();
        ptx::named_barrier_arrive<kFreeBarrierIdx, kNumParticipants>();
    }
};

}  // namespace megamoe::assembler
