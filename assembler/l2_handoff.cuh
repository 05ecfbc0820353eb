// The hand-off of each staged L2 tile from the math warpgroups to the scatter warp (a dispatch warp whose pulls
// are done): the math threads stage the tile's BF16 rows and go on to their next tile; the scatter warp sends the
// rows to their source ranks' combine rows, counts the tile for its pool block and, when the tile completes the
// block, signals the block's rows (fused_roles.cuh: scatter_role). Off the math warps: the metadata loads, the
// combine stores, the gpu-scope count and the row signals (DESIGN 5c: "off the math warps' critical path").
#pragma once

#include "common/sync.cuh"

namespace megamoe::assembler {

// One staging area, one tile in flight: a 16 B mailbox (the staged tile's task) and two named barriers over the
// math threads and the scatter warp: "staged" (the math threads arrive after their staging writes, the scatter
// warp syncs) and "free" (the scatter warp arrives after its last read of the staging area, the math threads sync
// before they write it again).
// NOTES: named barriers, not mbarriers: the math threads' side is one bar.arrive or bar.sync, with no parity to
// carry and no timeout path in the math region (an mbarrier wait there, with its parity, took the fused variants
// from 64-76 B to 284-332 B of spills). A bar.arrive or bar.sync completes with the prior memory accesses of its
// threads performed relative to every participant (PTX ISA, barrier): math thread 0's mailbox store and every
// math thread's stmatrix are visible to the scatter warp after its bar.sync, and the scatter warp's loads of the
// staging area are performed before any math thread passes the "free" barrier and overwrites it (WAR). Each side
// waits for the other's phase before arriving again (the math threads sync "free" of tile n before they arrive
// "staged" for tile n + 1), so no phase of either barrier collects arrivals of two tiles. The scatter warp's
// bar.sync needs no timeout: the math threads arrive at it for every tile and once more with the end marker, or
// trap on one of their own bounded waits.
template <uint32_t kNumMathThreads, uint32_t kStagedBarrierIdx, uint32_t kFreeBarrierIdx>
struct L2Handoff {
    static constexpr uint32_t kBytes = 16;
    static constexpr uint32_t kNumParticipants = kNumMathThreads + 32;

    uint8_t* mailbox;

    // Every math thread after its staging writes (thread 0 first writes the task; kEndOfTasks ends the scatter).
    MEGAMOE_DEVICE void publish(bool is_first_thread, const uint4& task) const {
        if (is_first_thread) {
            volatile uint4* box = reinterpret_cast<volatile uint4*>(mailbox);
            box->x = task.x;
            box->y = task.y;
            box->z = task.z;
            box->w = task.w;
        }
        ptx::named_barrier_arrive<kStagedBarrierIdx, kNumParticipants>();
    }

    // Every math thread, before writing the staging area after publishing a tile: the scatter warp has read it.
    MEGAMOE_DEVICE void wait_free() const { ptx::named_barrier_sync<kFreeBarrierIdx, kNumParticipants>(); }

    // The scatter warp: the next published tile's task words.
    MEGAMOE_DEVICE uint4 take() const {
        ptx::named_barrier_sync<kStagedBarrierIdx, kNumParticipants>();
        return ld_volatile_shared_v4(smem_addr(mailbox));
    }

    // The scatter warp, after its last read of the staging area.
    MEGAMOE_DEVICE void release() const { ptx::named_barrier_arrive<kFreeBarrierIdx, kNumParticipants>(); }
};

}  // namespace megamoe::assembler
