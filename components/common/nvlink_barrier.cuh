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
