// Thread-block clusters (SM90): the CTA's rank, a cluster-wide barrier, a peer CTA's shared-memory addresses, and
// the two cross-CTA operations a shared operand needs: a TMA load multicast into every CTA of the cluster, and an
// arrive on a peer's mbarrier. (TMA multicast inside one cluster: not NVLink multicast.)
#pragma once

#include <cuda.h>

#include "utils.cuh"

namespace megamoe::ptx {

MEGAMOE_DEVICE uint32_t cluster_cta_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    return rank;
}

// Every non-exited thread of every CTA in the cluster: shared-memory writes before it (mbarrier inits included)
// are visible to the whole cluster after it.
MEGAMOE_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// The shared::cluster address of the same shared-memory location in CTA `cta_rank` of the cluster.
MEGAMOE_DEVICE uint32_t map_to_cta(uint32_t smem_addr, uint32_t cta_rank) {
    uint32_t mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(smem_addr), "r"(cta_rank));
    return mapped;
}

// Arrive on the mbarrier at a shared::cluster address (this CTA's or a peer's) where `pred` holds: predicated,
// not a branch (it runs in the consumer's WGMMA region). NOTES: the default semantics (release at CTA scope) order
// this warp's completed WGMMA reads of the stage before the peer's next TMA write into it; `.release.cluster`
// measured ~1100 SM clocks per K block in the consumer (notes/gemm.md, B multicast experiment).
MEGAMOE_DEVICE void mbarrier_arrive_cluster_if(uint32_t cluster_bar_addr, bool pred) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %1, 0;\n"
        "@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n"
        "}\n" ::"r"(cluster_bar_addr), "r"(static_cast<uint32_t>(pred))
        : "memory");
}

// Load the box at (c0, c1) into the same shared-memory offset of every CTA in `cta_mask`; each destination's
// mbarrier at `bar`'s offset receives the transaction bytes.
MEGAMOE_DEVICE void tma_load_2d_multicast(void* smem_dst, const CUtensorMap* desc, uint64_t* bar, int32_t c0,
                                          int32_t c1, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;"
        ::"r"(smem_addr(smem_dst)), "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_addr(bar)), "r"(c0), "r"(c1),
        "h"(cta_mask)
        : "memory");
}

}  // namespace megamoe::ptx
