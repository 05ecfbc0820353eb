// The fused MoE kernel: one persistent cooperative launch per rank (DESIGN sections 1, 5, 5b, 5c).
//
//   head (every thread)   count + reserve + notify, NVLink barrier "dispatch", receive table, recv stats
//   roles (kernel_skeleton.cuh, no CTA-wide barrier until their ends)
//     dispatch warps      pull the received rows into the pool (row, SF, weight, metadata; arrival counts)
//     TMA-A warp          per task: wait for the pool block (L1: its arrival count; L2: its L1 completions)
//     TMA-B warp          per task: the weight tiles
//     math warpgroups     L1 tiles + L1 epilogue (publish), L2 tiles + L2 epilogue (BF16 rows staged for the
//                         scatter warp), then the top-k reduce of this rank's tokens (a spare warpgroup reduces
//                         only)
//     dispatch warp 0     after its pulls, the scatter warp (l2_handoff.cuh): each L2 tile's 256 B slices to the
//                         source ranks' combine rows, the pool block's tile count, the completing tile's signals
//   no tail               the next call cleans (combine/clean.cuh: clean_at_start, clean_next_parity); a CTA
//                         ends after its reduce
//
// NOTES: why the call needs no barrier at its end. y is complete once this rank's reduce has counted every row's
// arrival, and every row was pulled from this rank's inputs (x, SF, weights, source indices) before its combine row
// came back, so the caller may rewrite them. What a barrier would order is the next call: a fast peer's notify
// (into the other parity's receive counts, zeroed in this call's head) and its combine rows (after the next
// dispatch barrier, which this rank joins only after it has zeroed the local counters).
//
// Task order and the deadlock-freedom argument: fused_scheduler.cuh. Every wait reports through the host-mapped
// record of its (SM, role) and traps, never printf (a call reachable here makes ptxas serialize the WGMMAs).
#pragma once

#include "combine/reduce.cuh"
#include "common/phase_timer.cuh"
#include "dispatch_phases.cuh"
#include "fused_roles.cuh"

namespace megamoe::assembler {

// Head, every thread: init the ring and pull barriers; the next parity's counts zeroed; count, reserve, notify;
// the dispatch barrier; the receive table (every CTA) and recv stats (CTA 0).
template <typename T>
MEGAMOE_DEVICE void fused_head(const FusedContext<T>& ctx) {
    constexpr uint32_t kNumThreads = megamoe::kNumThreads;
    const uint32_t thread_idx = threadIdx.x, cta_idx = blockIdx.x, num_ctas = gridDim.x;
    const SymBuffer& sym = ctx.sym;

    // Init the ring and the pull stages' barriers, visible to the async proxy before the first TMA
    if (thread_idx == 0) {
        ptx::prefetch_tensormap(ctx.maps.l1_a);
        ptx::prefetch_tensormap(ctx.maps.l1_sfa);
        ptx::prefetch_tensormap(ctx.maps.l2_a);
        ptx::prefetch_tensormap(ctx.maps.l2_sfa);
        ptx::prefetch_tensormap(ctx.maps.act_store);
        ctx.pipeline.init(2, T::kNumMathWarps);
        ctx.tasks.init(T::kNumMathThreads + 1);  // every math thread and the TMA-B warp's lane pop
        ctx.l2_tasks.init(32);                   // every lane of the scatter warp pops
        ctx.tile_weights.init();
        if constexpr (T::kBatchL1Releases)
            epilogue::L1EpilogueState::init_list(smem_addr(ctx.smem + T::kOffsetL1Releases));
        for (uint32_t i = 0; i < kNumDispatchWarps * T::kPullStages; ++ i)
            ptx::mbarrier_init(ctx.pull_barriers + i, 1);
        ptx::fence_mbarrier_init();
    }
    // NOTES: every thread reads the NVLink barrier counter before its CTA's first grid-sync arrival; CTA 0 moves
    // it only after that grid sync (nvlink_barrier_polled), and earlier calls' moves are ordered by the kernel
    // boundary. Thread 0 keeps it in shared memory for the call's parity (published by the CTA barrier below);
    // the head's barrier reads it again after the count, just before that grid sync (dispatch_head's getter):
    // held in a register through the count, it spilled 4 B at BLOCK_M 128, and read from shared memory there,
    // ptxas allocated the math region differently and spilled 216 B (notes/fused.md, "Spills: the report out of
    // line").
    if (thread_idx == 0) {
        ctx.misc[0] = *barrier_words(sym).nvl_counter;
        ctx.misc[1] = cta_idx;
        ctx.misc[2] = num_ctas;
    }
    __syncthreads();

    const HeadArgs head{ctx.p.num_tokens, ctx.expert_count, ctx.table, ctx.p.recv_stats,
                        sym.local<uint32_t>(layout::kWorkspaceHeaderOffset) + layout::kErrorFlagsIdx,
                        (ctx.p.debug_flags & kDebugHangAtDispatchBarrier) != 0};
    dispatch_head<kNumThreads, T::BLOCK_M, false>(tiered_env(ctx.env, kTierPeer, kRoleCommon), sym, head,
                                                  [&]() { return *barrier_words(sym).nvl_counter; },
                                                  ctx.misc[0] & 1u, cta_idx, num_ctas, thread_idx,
                                                  [](uint32_t) {});
}

// NOTES: each phase builds its own context from kernel constants (parameters, the shared-memory base): a
// context built before the role split and used after it would keep its registers live through the 40-register
// producer roles, which then spill.
// WG0's registers after the split: the 40 of DESIGN 5 left the TMA-A warp (scheduler walk, pool-block waits)
// spilling 148 B; 56 is what the register file leaves beside two 224-register math warpgroups (128 x 56 +
// 256 x 224 = 64512).
constexpr uint32_t kFusedWg0Regs = 56;

template <typename T>
MEGAMOE_DEVICE void fused_impl(const FusedMaps& maps, const SymBuffer& sym, const FusedParams& p,
                               const DeviceEnv& env) {
    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const bool is_warp_0 = threadIdx.x < 32;
    if (is_warp_0)
        PhaseTimer{p.phase_times}.mark(kMarkStart, lane_idx());
    combine::clean_at_start<megamoe::kNumThreads>(sym, blockIdx.x, gridDim.x, threadIdx.x);
    fused_head<T>(FusedContext<T>(maps, sym, p, env, smem_buffer));
    if (is_warp_0)
        PhaseTimer{p.phase_times}.mark(kMarkHead, lane_idx());
    run_warp_roles<T::kNumMathWarpgroups, SpareWarpgroup::kKeepRegisters, kFusedWg0Regs>(
        [&](uint32_t warp) { dispatch_role<T>(FusedContext<T>(maps, sym, p, env, smem_buffer), warp); },
        [&]() { tma_a_role<T>(FusedContext<T>(maps, sym, p, env, smem_buffer)); },
        [&]() { tma_b_role<T>(FusedContext<T>(maps, sym, p, env, smem_buffer)); },
        [&](uint32_t math_wg_idx, uint32_t thread_in_wg) {
            math_role<T>(FusedContext<T>(maps, sym, p, env, smem_buffer), math_wg_idx, thread_in_wg);
        },
        [&](uint32_t math_wg_idx, uint32_t) {
            reduce_role<T>(FusedContext<T>(maps, sym, p, env, smem_buffer), math_wg_idx);
        });
    // (marked here, after the roles: a mark inside the math role, even after its tile loop, made ptxas spill in it)
    if (warp_idx() == kFirstMathThread / 32)
        PhaseTimer{p.phase_times}.mark(kMarkReduce, lane_idx());
    // The CTA's end: every role done (the only CTA barrier after the role split; marks only)
    if (p.phase_times != nullptr) {
        __syncthreads();
        if (threadIdx.x < 32)
            PhaseTimer{p.phase_times}.mark(kMarkEnd, lane_idx());
    }
}

}  // namespace megamoe::assembler
