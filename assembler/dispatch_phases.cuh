// The communication phases every kernel of the project runs the same way, on every thread of every CTA: the head
// (the next parity's counts zeroed, count + reserve + notify, the dispatch NVLink barrier, the receive table, recv
// stats) and, in the dispatch/combine unit kernel only, the tail (the combine NVLink barrier with the workspace
// clean). The fused kernel (fused_kernel.cuh) and the unit kernel (dispatch_combine_kernel.cuh) both run the head;
// they differ only in the timeout policy and environment they pass (kPrint: no printf reachable beside WGMMA,
// DESIGN 5c) and in the profiling marks.
#pragma once

#include "combine/clean.cuh"
#include "common/nvlink_barrier.cuh"
#include "dispatch/count.cuh"
#include "dispatch/recv_table.cuh"

namespace megamoe::assembler {

// The NVLink barrier words of this rank's workspace header.
MEGAMOE_DEVICE BarrierWords barrier_words(const SymBuffer& sym) {
    uint32_t* header = sym.local<uint32_t>(layout::kWorkspaceHeaderOffset);
    return BarrierWords{header + layout::kGridSyncCounterIdx, header + layout::kNvlBarrierCounterIdx,
                        header + layout::kNvlBarrierSignalIdx};
}

// Where the head phases leave their results, and how they report
struct HeadArgs {
    uint32_t num_tokens;
    uint32_t* expert_count;   // shared memory, E words
    dispatch::RecvTable table;
    int32_t* recv_stats;      // may be nullptr
    uint32_t* error_flags;    // nullptr: the count asserts (printf) instead of flagging (kPrint kernels)
    bool debug_hang;          // the dispatch barrier waits for a value it never reaches
};

// Head, every thread (kPrint: timeouts printf and the count asserts; else records only and error flags): the
// next parity's counts zeroed; count, reserve, notify; the dispatch barrier; the receive table (every CTA;
// kTablePrefetch: the counts read by every thread first) and recv stats (CTA 0). `mark(i)` after phase i (1:
// notify, 2: barrier, 3: table), for profiling. `nvl_ordinal`: the NVLink barrier counter each thread read before
// its CTA's first grid-sync arrival (nvlink_barrier_polled). `parity`: its low bit, the call's count buffers
// (common/count_buffers.cuh).
// kPolledBarrier = false: the first version's NVLink barrier (nvlink_barrier, three grid syncs), kept for the unit
// kernel's legacy knobs.
template <uint32_t kNumThreads, uint32_t kBlockM, bool kPrint, bool kTablePrefetch = true, bool kPolledBarrier = true,
          typename NvlOrdinal, typename Mark>
MEGAMOE_DEVICE void dispatch_head(const DeviceEnv& env, const SymBuffer& sym, const HeadArgs& args,
                                  const NvlOrdinal& nvl_ordinal, uint32_t parity, uint32_t cta_idx,
                                  uint32_t num_ctas, uint32_t thread_idx, const Mark& mark) {
    const auto sync_cta = []() { __syncthreads(); };
    combine::clean_next_parity<kNumThreads>(sym, parity, cta_idx, num_ctas, thread_idx);
    dispatch::count_and_notify<kNumThreads, kPrint>(sym, parity, args.num_tokens, args.expert_count, cta_idx,
                                                    num_ctas, thread_idx, sync_cta, args.error_flags);
    mark(1);
    if constexpr (kPolledBarrier) {
        nvlink_barrier_polled<kPrint>(env, BarrierTags{"gs0_dispatch", "nvl_dispatch", ""}, sym, barrier_words(sym),
                                      nvl_ordinal(), cta_idx, num_ctas, thread_idx, sync_cta, []() {}, []() {},
                                      args.debug_hang);
    } else {
        static_assert(kPrint, "the first version's barrier reports with printf");
        nvlink_barrier(env, BarrierTags{"gs0_dispatch", "nvl_dispatch", "gs1_dispatch"}, sym, barrier_words(sym),
                       cta_idx, num_ctas, thread_idx, sync_cta, true, args.debug_hang);
    }
    mark(2);
    if constexpr (kTablePrefetch) {
        dispatch::prefetch_recv_counts<kNumThreads>(args.table, sym, parity, thread_idx);
        __syncthreads();
    }
    if (thread_idx < 32)
        dispatch::build_recv_table<kBlockM, kTablePrefetch>(args.table, sym, parity, thread_idx);
    __syncthreads();
    if (cta_idx == 0)
        dispatch::add_recv_stats<kNumThreads>(args.table, args.recv_stats, thread_idx);
    mark(3);
}

// The unit kernel's tail, every thread: every rank's rows have been reduced where they belong; clean this call's
// counters and meet the peers (the clean folded into the combine barrier: combine/clean.cuh). `nvl_ordinal`: the
// head's + 1; `parity`: the head's. (The fused kernel has no tail: the next call cleans, combine/clean.cuh.)
template <uint32_t kNumThreads, bool kPrint>
MEGAMOE_DEVICE void combine_tail(const DeviceEnv& env, const SymBuffer& sym, uint32_t nvl_ordinal, uint32_t parity,
                                 uint32_t cta_idx, uint32_t num_ctas, uint32_t thread_idx) {
    nvlink_barrier_polled<kPrint>(
        env, BarrierTags{"gs0_combine", "nvl_combine", ""}, sym, barrier_words(sym), nvl_ordinal, cta_idx,
        num_ctas, thread_idx, []() { __syncthreads(); },
        [&]() { combine::clean_recv_counts<kNumThreads>(sym, parity, thread_idx); },
        [&]() { combine::clean_local_counters<kNumThreads>(sym, parity, cta_idx, num_ctas, thread_idx); });
}

}  // namespace megamoe::assembler
