// Workspace cleanup: zero the counters so that every call starts clean, without a host memset (DESIGN 5c). Grid
// sync and NVLink barrier words are never zeroed (they reset themselves); src_token_topk_idx and pool_src_metadata
// are rewritten for every received row and read only where valid.
//
// Two places clean:
//   every call: at its start, the local counters it uses after its dispatch barrier (clean_at_start), and in its
//     head, before that barrier, the other parity's send and receive counts, which the next call uses
//     (clean_next_parity; common/count_buffers.cuh). This is all the fused kernel needs: it ends without a barrier,
//     leaving this call's counters as they are.
//   the combine barrier of the dispatch/combine unit kernel (clean_recv_counts, clean_local_counters), which also
//     zeroes this call's own counters, so the workspace is all zero between its calls.
// Offsets come from the generated layout header (namespace megamoe::layout), included before this header.
#pragma once

#include "common/count_buffers.cuh"
#include "common/sym_buffer.cuh"

namespace megamoe::combine {

MEGAMOE_DEVICE void zero_words(uint32_t* words, uint32_t num_words, uint32_t thread_rank, uint32_t num_threads) {
    for (uint32_t i = thread_rank; i < num_words; i += num_threads)
        words[i] = 0u;
}

// The counters local to this rank that a call uses after its dispatch barrier: the task-claim word, the pool
// blocks' counters, the tokens' combine arrivals.
MEGAMOE_DEVICE void zero_pool_and_arrival_counters(const SymBuffer& sym, uint32_t thread_rank, uint32_t num_threads) {
    if (thread_rank == 0)
        sym.local<uint32_t>(layout::kWorkspaceHeaderOffset)[layout::kSchedulerCounterIdx] = 0u;
    zero_words(sym.local<uint32_t>(layout::kL1ArrivalCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kL1DoneCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kL2DoneCountOffset), layout::kNumMaxPoolBlocks, thread_rank,
               num_threads);
    zero_words(sym.local<uint32_t>(layout::kCombineArrivalCountOffset), layout::kNumMaxTokensPerRank, thread_rank,
               num_threads);
}

// Every thread of every CTA, first thing in the kernel (the earlier these stores issue, the less the dispatch
// barrier's release waits for them).
// NOTES: the last writers of these counters are the previous call's: this rank's own threads (kernel order) and
// the peers' combine signals, every one of which this rank's reduce waited for before that call ended, so each
// of those adds is coherence-ordered before these stores. This call's first accesses come after its dispatch
// barrier: this rank's CTAs past the prologue grid sync's acquire, the peers' combine signals after the
// cross-rank chain that begins with that grid sync's .sys release.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_at_start(const SymBuffer& sym, uint32_t cta_idx, uint32_t num_ctas, uint32_t thread_idx) {
    zero_pool_and_arrival_counters(sym, cta_idx * kNumThreads + thread_idx, num_ctas * kNumThreads);
}

// Every thread of every CTA, in the head, before the dispatch barrier. `parity`: this call's.
// NOTES: expert_send_count[!parity] is local (kernel order). expert_recv_count[!parity] was last added to by the
// peers' notifies of an earlier call, each before that call's dispatch barrier, which this rank passed in that
// call before it read the counts; the peers' next notifies into it (the next call's) come after they pass this
// call's dispatch barrier, whose chain (this thread's stores -> CTA barrier -> the prologue's atom.release.sys ->
// CTA 0's signals) orders these stores first. A peer cannot run further ahead: passing the next call's barrier
// needs this rank's signal for it.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_next_parity(const SymBuffer& sym, uint32_t parity, uint32_t cta_idx, uint32_t num_ctas,
                                      uint32_t thread_idx) {
    const uint32_t thread_rank = cta_idx * kNumThreads + thread_idx, num_threads = num_ctas * kNumThreads;
    zero_words(expert_send_count(sym, parity ^ 1u), kNumSendCounts, thread_rank, num_threads);
    zero_words(expert_recv_count(sym, parity ^ 1u), kNumRecvPairs, thread_rank, num_threads);
}

// The unit kernel's combine barrier (nvlink_barrier_polled; no grid sync of its own), in two halves:
// clean_recv_counts: CTA 0's threads, in the barrier's before_signal, i.e. after its prologue grid sync.
// NOTES: every CTA read expert_recv_count[parity] (build_recv_table / prefetch_recv_counts) before it arrived at
// that grid sync, whose acquire orders those reads before these zero stores; the signals that follow publish the
// zeros (release cumulativity through the CTA barrier) before any peer can pass the barrier and notify again.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_recv_counts(const SymBuffer& sym, uint32_t parity, uint32_t thread_idx) {
    zero_words(expert_recv_count(sym, parity), kNumRecvPairs, thread_idx, kNumThreads);
}

// clean_local_counters: every thread of every CTA, after the same prologue grid sync (while_waiting).
// NOTES: expert_send_count was last touched by count_and_notify, l1_arrival_count / l1_done_count by the pull's
// releases (red.release, or relaxed adds after a fence.release) and the expert's acquire loads, all before each CTA's
// arrival at that grid sync: its acquire orders them before these stores (coherence: a red before the zero cannot land
// after it). Nothing reads them again in this kernel; the next call runs after the kernel boundary.
// combine_arrival_count: every row of this call was counted before its reducing warp passed its wait, and every CTA's
// reduce (with the overlapped reduce, the barrier comes after it) ended before its arrival; the peers' next rows come
// after this barrier and the next call's dispatch barrier.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_local_counters(const SymBuffer& sym, uint32_t parity, uint32_t cta_idx, uint32_t num_ctas,
                                         uint32_t thread_idx) {
    const uint32_t thread_rank = cta_idx * kNumThreads + thread_idx, num_threads = num_ctas * kNumThreads;
    zero_words(expert_send_count(sym, parity), kNumSendCounts, thread_rank, num_threads);
    zero_pool_and_arrival_counters(sym, thread_rank, num_threads);
}

// Both halves, for the unit kernel's first-version barrier: every thread of every CTA, after a grid sync that
// follows the last local reader of every counter, and before the NVLink barrier that lets the peers past this
// call (a peer's next notify comes after that barrier's acquire, which by its release chain is after these
// stores).
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void clean_workspace(const SymBuffer& sym, uint32_t parity, uint32_t cta_idx, uint32_t num_ctas,
                                    uint32_t thread_idx) {
    const uint32_t thread_rank = cta_idx * kNumThreads + thread_idx, num_threads = num_ctas * kNumThreads;
    zero_words(expert_recv_count(sym, parity), kNumRecvPairs, thread_rank, num_threads);
    clean_local_counters<kNumThreads>(sym, parity, cta_idx, num_ctas, thread_idx);
}

}  // namespace megamoe::combine
