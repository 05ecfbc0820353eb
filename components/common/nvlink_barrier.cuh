// Cross-rank barrier over NVLink: grid sync, then CTA 0 signals every rank's phase word and waits for all ranks'
// signals in its own, then (optionally) a second grid sync that hands the peers' writes to every CTA.
//
// State in the workspace header (layout.WORKSPACE_HEADER_FIELDS), never reset between calls:
//   nvl_counter    barriers completed by this rank; status = counter % 4 picks phase = status & 1 and the sign
//                  status >> 1 of this barrier
//   nvl_signals[2] one word per phase. Sign 0: every rank adds +1, done at num_ranks; sign 1: every rank adds -1,
//                  done at 0. So each word returns to 0 every 4 barriers, and two consecutive barriers use
//                  different words: a rank can be at most one barrier ahead of any other (passing barrier b + 1
//                  needs everyone's signal for it, sent only after passing b), so no word is shared by a
//                  barrier still being waited for and the next one signalled.
#pragma once

#include "grid_sync.cuh"
#include "sym_buffer.cuh"

namespace megamoe {

// Local pointers into this rank's workspace header.
struct BarrierWords {
    uint32_t* grid_counter;
    uint32_t* nvl_counter;
    uint32_t* nvl_signals;  // two words: phase 0, phase 1
};

// Names in the timeout record (<= 15 characters each).
struct BarrierTags {
    const char* prologue;    // the first grid sync
    const char* cross_rank;  // CTA 0 waiting for the peers' signals
    const char* epilogue;    // the second grid sync
};

// Every participating thread of every CTA calls this; `thread_idx` is the index among the CTA's participating
// threads (thread 0 leads; threads [0, num_ranks) of CTA 0 send the signals), `sync_cta` their CTA barrier.
// Without the epilogue only CTA 0's thread 0 waits for the peers (enough at the very end of a kernel).
// debug_never_done: the wait targets an unreachable value (tests the timeout diagnostic on one GPU).
template <typename SyncCta>
MEGAMOE_DEVICE void nvlink_barrier(const DeviceEnv& env, const BarrierTags& tags, const SymBuffer& sym,
                                   const BarrierWords& words, uint32_t cta_idx, uint32_t num_ctas,
                                   uint32_t thread_idx, const SyncCta& sync_cta, bool sync_epilogue,
                                   bool debug_never_done = false) {
    // NOTES: the prologue arrives with a .sys release. Every thread's earlier writes, peer-mapped stores and
    // red included, are ordered before its CTA leader's release.sys by the CTA barrier; CTA 0's thread 0
    // acquires the flipped counter; CTA 0's signalling threads follow it through the CTA barrier, so their
    // red.release.sys carries all of those writes (release cumulativity) to the peer whose ld.acquire.sys
    // observes the signal. Each link of that chain is morally strong at a scope that includes both ends.
    grid_sync<ptx::Scope::kSys>(env, tags.prologue, words.grid_counter, cta_idx, num_ctas, thread_idx == 0,
                                sync_cta);

    if (cta_idx == 0) {
        // Plain read: the counter is written only by this CTA's thread 0, at the end of the previous barrier,
        // followed by at least one CTA barrier (or a kernel boundary) before this read.
        const uint32_t status = *words.nvl_counter & 3u;
        const uint32_t phase = status & 1u;
        const bool negative = (status >> 1) != 0;
        uint32_t* signal = words.nvl_signals + phase;

        // Signal every rank (this one included)
        if (thread_idx < sym.num_ranks)
            ptx::red_add_release<ptx::Scope::kSys>(sym.map(signal, thread_idx), negative ? 0xffffffffu : 1u);
        // Every thread has read the status before thread 0 advances the counter
        sync_cta();

        // Wait for every rank's signal
        if (thread_idx == 0) {
            const uint32_t target = (negative ? 0u : sym.num_ranks) + (debug_never_done ? 0x40000000u : 0u);
            bounded_wait(
                env, tags.cross_rank, [&]() { return ptx::ld_acquire<ptx::Scope::kSys>(signal) == target; },
                [&]() {
                    return make_longlong3(static_cast<int32_t>(ptx::ld_relaxed<ptx::Scope::kSys>(signal)),
                                          static_cast<int32_t>(target), *words.nvl_counter);
                });
            *words.nvl_counter += 1u;
        }
    }

    // NOTES: CTA 0's thread 0 acquired the peers' writes at .sys scope; its gpu-scope release in this grid
    // sync passes them on to every CTA (cumulativity again).
    if (sync_epilogue)
        grid_sync<ptx::Scope::kGpu>(env, tags.epilogue, words.grid_counter, cta_idx, num_ctas, thread_idx == 0,
                                    sync_cta);
}

}  // namespace megamoe

namespace megamoe {

// The same cross-rank barrier with one grid sync instead of two: after the prologue grid sync, CTA 0 signals
// every rank, and every CTA's thread 0 waits for the signals itself (no epilogue grid sync).
//
// `ordinal` is this barrier's number: nvl_counter as read by every thread at kernel start (before its CTA's first
// arrival at a grid sync) plus the barriers this kernel has passed. Only CTA 0's thread 0 writes nvl_counter
// (ordinal + 1, after its wait), and only after the prologue grid sync, i.e. after every CTA has arrived there and
// so has read the counter: no CTA reads it while it moves. A CTA cannot miss its signal word's target: the word is
// next changed by a peer's signal for barrier ordinal + 2, sent after that peer passed ordinal + 1, which needs this
// rank's signal for ordinal + 1, sent after every CTA here arrived at that prologue, i.e. after this wait.
//
// before_signal(): run by CTA 0's threads after the prologue and before the signals, which publish its writes to
// the peers (the combine barrier zeroes expert_recv_count there). while_waiting(): run by every thread after the
// prologue, before its CTA's wait (work off the critical path, e.g. clearing local counters).
// kPrint: timeouts also printf (false in kernels that issue WGMMA).
template <bool kPrint = true, typename SyncCta, typename BeforeSignal, typename WhileWaiting>
MEGAMOE_DEVICE void nvlink_barrier_polled(const DeviceEnv& env, const BarrierTags& tags, const SymBuffer& sym,
                                          const BarrierWords& words, uint32_t ordinal, uint32_t cta_idx,
                                          uint32_t num_ctas, uint32_t thread_idx, const SyncCta& sync_cta,
                                          const BeforeSignal& before_signal, const WhileWaiting& while_waiting,
                                          bool debug_never_done = false) {
    // NOTES: the prologue's release chain is nvlink_barrier's: every thread's writes (peer stores and red
    // included) -> CTA barrier -> leader's atom.release.sys -> CTA 0's acquire -> CTA 0's CTA barrier -> its
    // signalling threads' red.release.sys (cumulativity) -> a peer thread's ld.acquire.sys that reads the target.
    // before_signal's writes by CTA 0's threads join the chain through the CTA barrier before the signals.
    grid_sync<ptx::Scope::kSys, kPrint>(env, tags.prologue, words.grid_counter, cta_idx, num_ctas, thread_idx == 0,
                                        sync_cta);

    const uint32_t status = ordinal & 3u;
    const uint32_t phase = status & 1u;
    const bool negative = (status >> 1) != 0;
    uint32_t* signal = words.nvl_signals + phase;

    if (cta_idx == 0) {
        before_signal();
        sync_cta();
        if (thread_idx < sym.num_ranks)
            ptx::red_add_release<ptx::Scope::kSys>(sym.map(signal, thread_idx), negative ? 0xffffffffu : 1u);
    }
    while_waiting();

    // NOTES: every CTA's thread 0 acquires the signal word at .sys scope. It reads the sum of every rank's
    // red.release.sys (this rank's own included): each rank's release heads a release sequence that the later
    // atomic adds continue, so the acquire synchronizes with all of them and sees every write they publish (the
    // peers' combine rows or counts, and this rank's other CTAs' writes, through CTA 0's signal). The closing CTA
    // barrier extends the acquire to the CTA's other threads.
    if (thread_idx == 0) {
        const uint32_t target = (negative ? 0u : sym.num_ranks) + (debug_never_done ? 0x40000000u : 0u);
        bounded_wait<kPrint>(
            env, tags.cross_rank, [&]() { return ptx::ld_acquire<ptx::Scope::kSys>(signal) == target; },
            [&]() {
                return make_longlong3(static_cast<int32_t>(ptx::ld_relaxed<ptx::Scope::kSys>(signal)),
                                      static_cast<int32_t>(target), ordinal);
            });
        if (cta_idx == 0)
            *words.nvl_counter = ordinal + 1u;
    }
    sync_cta();
}

}  // namespace megamoe
