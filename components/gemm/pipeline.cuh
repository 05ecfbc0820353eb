// The shared-memory ring between the TMA producer warps and the math warpgroups: kNumStages stages,
// each guarded by a full barrier (TMA bytes landed) and an empty barrier (all math warps done reading).
#pragma once

#include "common/cluster.cuh"
#include "common/mbarrier.cuh"

namespace megamoe::gemm {

// Position in the ring. The phase flips each time the stage index wraps: the one place for that arithmetic,
// used by producers and consumers alike.
template <uint32_t kNumStages>
struct PipelineState {
    uint32_t stage = 0;
    uint32_t phase = 0;

    MEGAMOE_DEVICE void advance() {
        if (++ stage == kNumStages) {
            stage = 0;
            phase ^= 1;
        }
    }

    // advance() kNum times
    template <uint32_t kNum>
    MEGAMOE_DEVICE void advance_by() {
        const uint32_t total = stage + kNum;
        stage = total % kNumStages;
        phase ^= (total / kNumStages) & 1;
    }
};

// kClusterSize = 2: each stage's A is multicast by both CTAs of the cluster, so a stage is free only once the math
// warps of both are done with it: every math warp arrives on the empty barriers of both CTAs.
template <uint32_t kNumStages, uint32_t kClusterSize = 1>
struct Pipeline {
    static_assert(kClusterSize == 1 or kClusterSize == 2, "a CTA alone or a pair");
    uint64_t* full_barriers;   // [kNumStages], 2 arrivals (TMA-A and TMA-B warps) + transaction bytes
    uint64_t* empty_barriers;  // [kNumStages], one arrival per math warp (of each CTA in the cluster)
    // Shared-window addresses of the barriers, computed once (a generic-to-shared conversion reads SR_CgaCtaId)
    uint32_t full_addr = smem_addr(full_barriers);
    uint32_t empty_addr = smem_addr(empty_barriers);
    uint32_t cta_rank = kClusterSize == 1 ? 0 : ptx::cluster_cta_rank();

    // One thread initializes; fence_mbarrier_init + a CTA barrier (in a cluster: a cluster barrier) must follow
    // before use.
    MEGAMOE_DEVICE void init(uint32_t num_producers, uint32_t num_consumer_warps) const {
        #pragma unroll
        for (uint32_t i = 0; i < kNumStages; ++ i) {
            ptx::mbarrier_init(full_barriers + i, num_producers);
            ptx::mbarrier_init(empty_barriers + i, num_consumer_warps * kClusterSize);
        }
    }

    // NOTES: both waits report a timeout through the host-mapped record only (kPrint = false): a printf
    // call anywhere in a loop of this kernel makes ptxas serialize the math warpgroups' WGMMAs (C7510). The
    // consumer's report stays inline (ReportSite::kInline): out of line, it spilled in the math region.

    // Producer acquire: wait until the math warps released this stage's previous use.
    // NOTES: waiting with the flipped parity returns at once on the first pass through the ring, when the
    // barrier's phase 0 is still pending (the "previous" phase counts as complete).
    MEGAMOE_DEVICE void producer_acquire(const DeviceEnv& env, const PipelineState<kNumStages>& state) const {
        ptx::mbarrier_wait<false>(env, "gemm_empty", empty_barriers + state.stage, state.phase ^ 1);
    }

    // Producer commit: arrive on the full barrier expecting the bytes this producer's TMA loads will deliver.
    MEGAMOE_DEVICE void producer_commit(const PipelineState<kNumStages>& state, uint32_t num_bytes) const {
        ptx::mbarrier_arrive_expect_tx(full_barriers + state.stage, num_bytes);
    }

    MEGAMOE_DEVICE uint64_t* full_barrier(const PipelineState<kNumStages>& state) const {
        return full_barriers + state.stage;
    }

    // Consumer wait: until both producers' bytes for this stage have landed.
    MEGAMOE_DEVICE void consumer_wait(const DeviceEnv& env, const PipelineState<kNumStages>& state) const {
        ptx::mbarrier_wait<false, ReportSite::kInline>(env, "gemm_full", full_barriers + state.stage, state.phase);
    }

    // Consumer wait that may run while a WGMMA group is in flight (ptx::mbarrier_wait_inline_at): returns 0, or
    // the ns waited past the timeout; the caller reports it with report_full_timeout after its WGMMA wait.
    MEGAMOE_DEVICE uint64_t consumer_wait_inline(const DeviceEnv& env, const PipelineState<kNumStages>& state) const {
        return ptx::mbarrier_wait_inline_at(full_addr + state.stage * 8, state.phase, env.timeout_ns);
    }

    MEGAMOE_DEVICE void report_full_timeout(const DeviceEnv& env, const PipelineState<kNumStages>& state,
                                            uint64_t waited_ns) const {
        if (waited_ns != 0)
            megamoe_report_timeout<false, ReportSite::kInline>(env, "gemm_full", waited_ns, state.phase,
                                                               static_cast<int64_t>(full_barriers[state.stage]),
                                                               state.stage);
    }

    // Consumer release: one arrival per math warp, after that warp's wgmma reads of the stage completed.
    MEGAMOE_DEVICE void consumer_release(const PipelineState<kNumStages>& state, uint32_t lane) const {
        // (in a cluster: this CTA's barrier through its own window, the peer's through the cluster window)
        const uint32_t bar_addr = empty_addr + state.stage * 8;
        ptx::mbarrier_arrive_if_at(bar_addr, lane == 0);
        if constexpr (kClusterSize == 2)
            ptx::mbarrier_arrive_cluster_if(ptx::map_to_cta(bar_addr, cta_rank ^ 1), lane == 0);
    }

    // Producer, after producer_acquire: arrive for the `num_warps` math warps that skip this stage (a warpgroup whose
    // rows are all padding: gemm/consumer.cuh, kSkipPadding), so that the stage's empty phase completes with the
    // other warps' releases.
    MEGAMOE_DEVICE void producer_release_for_idle(const PipelineState<kNumStages>& state, uint32_t num_warps) const {
        static_assert(kClusterSize == 1, "a CTA alone");
        ptx::mbarrier_arrive_count_at(empty_addr + state.stage * 8, num_warps);
    }
};

}  // namespace megamoe::gemm
