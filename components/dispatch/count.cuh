// Dispatch, first step (before the dispatch barrier): count this rank's (token, slot) pairs per expert,
// reserve ranges of slots with global atomics, write each pair's source index (token * topk + slot) into the
// destination rank's src_token_topk_idx[local expert][this rank][slot], and add the counts to the destination's
// expert_recv_count[parity][local expert][this rank] (parity: the call's, common/count_buffers.cuh).
#pragma once

#include "common/atomics.cuh"
#include "regions.cuh"

namespace megamoe::dispatch {

// Bits of the workspace header's error_flags word (read by the host after the call)
constexpr uint32_t kErrorRoutingOverflow = 1u;  // a rank sent more than T_max rows to one expert (repeated experts)

// Every thread of every CTA calls this; CTA `cta_idx` takes a contiguous range of tokens. `smem_expert_count`
// holds kNumExperts words. `sync_cta` is a barrier among the kNumThreads callers of the CTA. No barrier at the
// end: the dispatch barrier that must follow begins with one.
// kAssert: a routing that overflows a reserved range traps with a printf (unit kernels); otherwise (kernels that
// issue WGMMA, where a printf serializes the pipeline: DESIGN 5c) the pair is dropped and kErrorRoutingOverflow
// is set in `error_flags`.
template <uint32_t kNumThreads, bool kAssert = true, typename SyncCta>
MEGAMOE_DEVICE void count_and_notify(const SymBuffer& sym, uint32_t parity, uint32_t num_tokens,
                                     uint32_t* smem_expert_count, uint32_t cta_idx, uint32_t num_ctas,
                                     uint32_t thread_idx, const SyncCta& sync_cta, uint32_t* error_flags = nullptr) {
    static_assert(layout::kNumExperts == layout::kNumLocalExperts * layout::kNumRanks, "E = E_local * R");
    constexpr uint32_t kNumTopk = layout::kNumTopk;
    const uint32_t tokens_per_cta = ceil_div(num_tokens, num_ctas);
    const uint32_t pair_begin = min(cta_idx * tokens_per_cta, num_tokens) * kNumTopk;
    const uint32_t pair_end = min((cta_idx + 1) * tokens_per_cta, num_tokens) * kNumTopk;
    const int64_t* routing = topk_idx(sym);

    // Count the CTA's pairs per expert
    for (uint32_t e = thread_idx; e < layout::kNumExperts; e += kNumThreads)
        smem_expert_count[e] = 0;
    sync_cta();
    for (uint32_t p = pair_begin + thread_idx; p < pair_end; p += kNumThreads) {
        const int64_t expert = routing[p];
        if (expert >= 0)
            atomicAdd(smem_expert_count + expert, 1u);
    }
    sync_cta();

    // Reserve a range per expert; tell the destination how many rows it receives from this rank
    for (uint32_t e = thread_idx; e < layout::kNumExperts; e += kNumThreads) {
        const uint32_t count = smem_expert_count[e];
        if (count == 0)
            continue;
        // NOTES: relaxed atomics suffice: the reservation only needs distinct ranges, and the counts reach the
        // destination through the dispatch barrier's release chain (nvlink_barrier.cuh), like the index writes.
        smem_expert_count[e] = ptx::atom_add_relaxed<ptx::Scope::kGpu>(expert_send_count(sym, parity) + e, count);
        const uint32_t dst_rank = e / layout::kNumLocalExperts, local_expert = e % layout::kNumLocalExperts;
        ptx::red_add_relaxed<ptx::Scope::kSys>(
            sym.peer<uint32_t>(expert_recv_count_offset(parity, local_expert, sym.rank_idx), dst_rank), count);
    }
    sync_cta();

    // Write the source indices into the reserved slots of the destination rank
    for (uint32_t p = pair_begin + thread_idx; p < pair_end; p += kNumThreads) {
        const int64_t expert = routing[p];
        if (expert < 0)
            continue;
        const uint32_t slot = atomicAdd(smem_expert_count + expert, 1u);
        // A token's valid experts are distinct, so one rank sends at most T_max rows to an expert
        if constexpr (kAssert) {
            MEGAMOE_DEVICE_ASSERT(slot < layout::kNumMaxTokensPerRank);
        } else if (slot >= layout::kNumMaxTokensPerRank) {
            atomicOr(error_flags, kErrorRoutingOverflow);
            continue;
        }
        const uint32_t dst_rank = static_cast<uint32_t>(expert) / layout::kNumLocalExperts;
        const uint32_t local_expert = static_cast<uint32_t>(expert) % layout::kNumLocalExperts;
        *sym.peer<uint32_t>(src_token_topk_idx_offset(local_expert, sym.rank_idx, slot), dst_rank) = p;
    }
}

}  // namespace megamoe::dispatch
