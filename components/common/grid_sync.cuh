// Grid-wide barrier among the persistent CTAs of a cooperative launch (all co-resident, one per SM).
#pragma once

#include "atomics.cuh"
#include "timeout.cuh"

namespace megamoe {

// Top bit of the counter: flips once per completed grid sync, the low bits return to where they were.
constexpr uint32_t kGridSyncFlipBit = 0x80000000u;
// Waits that only follow another wait (a grid sync behind a CTA that waits for a peer, a consumer behind a
// producer that waits) allow this many timeouts, so the wait that is the root cause reports first.
constexpr uint64_t kSecondaryTimeoutFactor = 2;

// The environment of a secondary wait: the same records, a longer timeout.
MEGAMOE_DEVICE DeviceEnv secondary_env(const DeviceEnv& env) {
    return DeviceEnv{env.timeout_ns * kSecondaryTimeoutFactor, env.timeout_records, env.rank, env.role};
}

// Every participating thread of every CTA calls this. `sync_cta()` is a barrier among the CTA's participating
// threads (`__syncthreads` or a named barrier); `is_leader` holds for exactly one of them.
// CTA 0 adds kGridSyncFlipBit - (num_ctas - 1), every other CTA adds 1: the sum of all arrivals is
// kGridSyncFlipBit, so the top bit flips exactly when the last CTA arrives, and the counter needs no reset
// (a CTA already in the next sync cannot flip it again before every CTA has arrived there too).
// kArriveScope = kSys when the sync publishes writes that a peer GPU reads after a later .sys release.
// kPrint: a timeout also printfs (false in kernels that issue WGMMA: the record only, DESIGN 5c).
template <ptx::Scope kArriveScope = ptx::Scope::kGpu, bool kPrint = true, typename SyncCta>
MEGAMOE_DEVICE void grid_sync(const DeviceEnv& env, const char* tag, uint32_t* counter, uint32_t cta_idx,
                              uint32_t num_ctas, bool is_leader, const SyncCta& sync_cta) {
    // NOTES: the CTA barrier orders every participating thread's prior writes before the leader's release
    // (bar.sync is a CTA-scope fence for its participants); the release then makes them visible, by
    // cumulativity, to every CTA whose leader acquires the flipped counter. The closing CTA barrier extends
    // that acquire to the leader's CTA-mates.
    sync_cta();
    if (is_leader) {
        const uint32_t arrival = cta_idx == 0 ? kGridSyncFlipBit - (num_ctas - 1) : 1u;
        const uint32_t old_value = ptx::atom_add_release<kArriveScope>(counter, arrival);
        bounded_wait<kPrint>(
            secondary_env(env), tag,
            [&]() { return ((ptx::ld_acquire<ptx::Scope::kGpu>(counter) ^ old_value) & kGridSyncFlipBit) != 0; },
            [&]() {
                return make_longlong3(ptx::ld_relaxed<ptx::Scope::kGpu>(counter), old_value, num_ctas);
            });
    }
    sync_cta();
}

}  // namespace megamoe
