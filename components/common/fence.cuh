// Memory fences, including the proxy fences of DESIGN section 5b.
#pragma once

#include "utils.cuh"

namespace megamoe::ptx {

// Ordinary st.shared / stmatrix writes -> a later TMA store (async proxy) reading that shared memory.
// Each writing thread fences, then the writers meet at a barrier, then one thread issues the TMA store.
MEGAMOE_DEVICE void fence_proxy_async_shared_cta() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Ordinary global stores <-> TMA (async proxy) accesses of the same global memory: after the writer's
// stores and before its release, and on the reader's side after its acquire and before issuing the TMA.
MEGAMOE_DEVICE void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

MEGAMOE_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

MEGAMOE_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Release only (PTX ISA 8.6, sm_90): with a later relaxed write, a release pattern. SASS (nvcc 13.0): MEMBAR.ALL.GPU
// without the L1 invalidation (CCTL.IVALL) that fence.acq_rel.gpu adds for its acquire half.
MEGAMOE_DEVICE void fence_release_gpu() { asm volatile("fence.release.gpu;" ::: "memory"); }

// Makes mbarrier.init visible to the async proxy (TMA completes on the barrier) before first use.
MEGAMOE_DEVICE void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

}  // namespace megamoe::ptx
