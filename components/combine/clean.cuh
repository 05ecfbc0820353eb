// Workspace cleanup: zero this call's counters so the next call starts clean. Grid sync and NVLink barrier words
// are never zeroed (they reset themselves); src_token_topk_idx and pool_src_metadata are rewritten for every
// received row and read only where valid.
// Offsets come from the generated layout header (namespace megamoe::layout), included before this header.
#pragma once

#include "common/sym_buffer.cuh"

namespace megamoe::combine {

MEGAMOE_DEVICE void zero_words(uint32_t* words, uint32_t num_words, uint32_t thread_rank, uint32_t num_threads) {
    for (uint32_t i = thread_rank; i < num_words; i += num_threads)
        words[i] = 0u;
}

// The clean split in two for nvlink_barrier_polled (clean_workspace below is both halves after its own grid sync) (no grid sync of its own):
// clean_recv_counts: CTA 0's threads, in the combine barrier's before_signal, i.e. after its prologue grid sync.
// NOTES: every CTA read expert_recv_count (build_recv_table / prefetch_recv_counts) before it arrived at that
// grid sync, whose acquire orders those reads before these zero stores; the signals that follow publish the zeros
// (release cumulativity through the CTA barrier) before any peer can pass the barrier and red.add its next call's
// counts. This rank's own next call adds after the kernel boundary.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_recv_counts(const SymBuffer& sym, uint32_t thread_idx) {
    zero_words(sym.local<uint32_t>(layout::kExpertRecvCountOffset), layout::kNumLocalExperts * layout::kNumRanks,
               thread_idx, kNumThreads);
}

// clean_local_counters: every thread of every CTA, after the same prologue grid sync (while_waiting).
// NOTES: expert_send_count was last touched by count_and_notify, l1_arrival_count / l1_done_count by the pull's
// red.release and the expert's acquire loads, all before each CTA's arrival at that grid sync: its acquire
// orders them before these stores (coherence: a red before the zero cannot land after it). Nothing reads them
// again in this kernel; the next call runs after the kernel boundary. combine_arrival_count: every row of this
// call was counted before its reducing warp passed its wait, and every CTA's reduce (with the overlapped reduce,
// the barrier comes after it) ended before its arrival; the peers' next rows come after this barrier and
// the next call's dispatch barrier. The scheduler word (the fused kernel's task claims): every CTA's last claim came
// before its arrival too.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_local_counters(const SymBuffer& sym, uint32_t cta_idx, uint32_t num_ctas,
                                         uint32_t thread_idx) {
    const uint32_t thread_rank = cta_idx * kNumThreads + thread_idx, num_threads = num_ctas * kNumThreads;
    if (thread_rank == 0)
        sym.local<uint32_t>(layout::kWorkspaceHeaderOffset)[layout::kSchedulerCounterIdx] = 0u;
    zero_words(sym.local<uint32_t>(layout::kExpertSendCountOffset), layout::kNumExperts, thread_rank, num_threads);
    zero_words(sym.local<uint32_t>(layout::kL1ArrivalCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kL1DoneCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kL2DoneCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kCombineArrivalCountOffset), layout::kNumMaxTokensPerRank, thread_rank,
               num_threads);
}

// Every thread of every CTA calls this.
// NOTES: when. After a grid sync that follows the last local reader of every counter (the pull reads
// expert_recv_count, the consumers of pool blocks read l1_arrival_count / l1_done_count), and before the
// NVLink barrier that lets the peers past this call: a peer's next red.add to expert_recv_count comes after
// that barrier's acquire, which by the barrier's release chain (its prologue arrives with .sys) is after these
// zero stores. expert_send_count and the pool-block counters are local: kernel order covers the next call.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_workspace(const SymBuffer& sym, uint32_t cta_idx, uint32_t num_ctas, uint32_t thread_idx) {
    const uint32_t thread_rank = cta_idx * kNumThreads + thread_idx, num_threads = num_ctas * kNumThreads;
    zero_words(sym.local<uint32_t>(layout::kExpertRecvCountOffset), layout::kNumLocalExperts * layout::kNumRanks,
               thread_rank, num_threads);
    clean_local_counters<kNumThreads>(sym, cta_idx, num_ctas, thread_idx);
}

}  // namespace megamoe::combine
