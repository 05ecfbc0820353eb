// The receive table: built in shared memory by every CTA after the dispatch barrier, from this rank's
// expert_recv_count[parity][E_local][R] (the call's parity, common/count_buffers.cuh). It maps a packed receive
// index g (rows ordered by local expert, then source rank, then reserved slot) to the source of the row and to its
// pool row.
#pragma once

#include "common/atomics.cuh"
#include "regions.cuh"

namespace megamoe::dispatch {

// Shared memory of the table: kNumRecvPairs + 1 + kNumLocalExperts + 1 words.
constexpr uint32_t kRecvTableWords = kNumRecvPairs + 1 + layout::kNumLocalExperts + 1;

struct RecvTable {
    // pair_prefix[k]: rows of the pairs before pair k = (local expert k / R, source rank k % R);
    // pair_prefix[kNumRecvPairs]: rows received in total
    uint32_t* pair_prefix;
    // pool_offset[e]: first pool row of local expert e (scheduler.pool_offsets: experts back to back, each
    // padded to BLOCK_M); pool_offset[E_local]: pool rows used
    uint32_t* pool_offset;

    MEGAMOE_DEVICE uint32_t num_rows() const { return pair_prefix[kNumRecvPairs]; }
    MEGAMOE_DEVICE uint32_t expert_begin(uint32_t e) const { return pair_prefix[e * layout::kNumRanks]; }
    MEGAMOE_DEVICE uint32_t expert_count(uint32_t e) const {
        return pair_prefix[(e + 1) * layout::kNumRanks] - pair_prefix[e * layout::kNumRanks];
    }
};

MEGAMOE_DEVICE RecvTable make_recv_table(uint32_t* smem_words) {
    return RecvTable{smem_words, smem_words + kNumRecvPairs + 1};
}

// Inclusive prefix sum over the warp.
MEGAMOE_DEVICE uint32_t warp_inclusive_scan(uint32_t value, uint32_t lane) {
#pragma unroll
    for (uint32_t delta = 1; delta < 32; delta <<= 1) {
        const uint32_t other = __shfl_up_sync(0xffffffffu, value, delta);
        if (lane >= delta)
            value += other;
    }
    return value;
}

// Optional first step, by every thread of the CTA: copy the counts into pair_prefix (the scan then runs in place),
// one L2 round trip for all of them instead of one per 32 pairs in the scanning warp. The caller's CTA barrier
// publishes them to the scanning warp.
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void prefetch_recv_counts(const RecvTable& table, const SymBuffer& sym, uint32_t parity,
                                         uint32_t thread_idx) {
    // NOTES: same ordering as in build_recv_table: this thread is past the dispatch barrier's acquire (its CTA
    // leader's acquire, extended by the CTA barrier), so relaxed loads see the peers' totals.
    const uint32_t* recv_count = expert_recv_count(sym, parity);
    for (uint32_t k = thread_idx; k < kNumRecvPairs; k += kNumThreads)
        table.pair_prefix[k] = ptx::ld_relaxed<ptx::Scope::kGpu>(recv_count + k);
}

// One warp builds the table; the caller's CTA barrier publishes it to the other warps. kPrefetched: the counts
// are already in pair_prefix (prefetch_recv_counts, then a CTA barrier).
template <uint32_t kBlockM, bool kPrefetched = false>
MEGAMOE_DEVICE void build_recv_table(const RecvTable& table, const SymBuffer& sym, uint32_t parity, uint32_t lane) {
    static_assert(kBlockM == 32 or kBlockM == 64 or kBlockM == 128, "BLOCK_M candidates (layout.BLOCK_M_CANDIDATES)");
    static_assert(kBlockM <= layout::kMaxBlockM, "the pool is sized for BLOCK_M <= kMaxBlockM");
    const uint32_t* recv_count = expert_recv_count(sym, parity);

    // Prefix over the (expert, source) pairs
    // NOTES: the counts were added by the peers with red.relaxed.sys before their dispatch-barrier release;
    // the barrier's acquire chain ends in this CTA's grid-sync epilogue, so relaxed loads see the totals.
    uint32_t carry = 0;
    for (uint32_t base = 0; base < kNumRecvPairs; base += 32) {
        const uint32_t k = base + lane;
        uint32_t count = 0;
        if (k < kNumRecvPairs)
            count = kPrefetched ? table.pair_prefix[k] : ptx::ld_relaxed<ptx::Scope::kGpu>(recv_count + k);
        // A routing that repeats an expert in a token can count more than the T_max reserved slots of a pair
        // (count.cuh drops those pairs and flags it): never pull past the pair's slots
        count = min(count, layout::kNumMaxTokensPerRank);
        const uint32_t inclusive = warp_inclusive_scan(count, lane);
        if (k < kNumRecvPairs)
            table.pair_prefix[k] = carry + inclusive - count;
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0)
        table.pair_prefix[kNumRecvPairs] = carry;
    __syncwarp();

    // Pool offsets: experts padded to BLOCK_M
    carry = 0;
    for (uint32_t base = 0; base < layout::kNumLocalExperts; base += 32) {
        const uint32_t e = base + lane;
        const uint32_t padded = e < layout::kNumLocalExperts ? align_up(table.expert_count(e), kBlockM) : 0u;
        const uint32_t inclusive = warp_inclusive_scan(padded, lane);
        if (e < layout::kNumLocalExperts)
            table.pool_offset[e] = carry + inclusive - padded;
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0)
        table.pool_offset[layout::kNumLocalExperts] = carry;
    __syncwarp();
}

// Where received row g (g < num_rows()) comes from and goes to.
struct RowLocation {
    uint32_t local_expert;
    uint32_t src_rank;
    uint32_t src_slot;       // index into src_token_topk_idx[local_expert][src_rank]
    uint32_t row_in_expert;  // rank of the row within its expert (any order of the reservations)
    uint32_t pool_row;
};

MEGAMOE_DEVICE RowLocation locate(const RecvTable& table, uint32_t g) {
    // The last pair whose prefix is <= g (it is non-empty: the next prefix exceeds g)
    uint32_t lo = 0, hi = kNumRecvPairs;
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (table.pair_prefix[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    const uint32_t e = lo / layout::kNumRanks;
    const uint32_t row_in_expert = g - table.expert_begin(e);
    return RowLocation{e, lo % layout::kNumRanks, g - table.pair_prefix[lo], row_in_expert,
                       table.pool_offset[e] + row_in_expert};
}

// Rows of the pool block holding `loc` (BLOCK_M, or fewer in the expert's last block): the value its
// l1_arrival_count reaches once every row of the block has been pulled.
template <uint32_t kBlockM>
MEGAMOE_DEVICE uint32_t num_rows_in_block(const RecvTable& table, const RowLocation& loc) {
    const uint32_t block_begin = loc.row_in_expert / kBlockM * kBlockM;
    return min(kBlockM, table.expert_count(loc.local_expert) - block_begin);
}

// cumulative_local_expert_recv_stats[e] += rows received by local expert e (one CTA calls this; may be null).
template <uint32_t kNumThreads>
MEGAMOE_DEVICE void add_recv_stats(const RecvTable& table, int32_t* recv_stats, uint32_t thread_idx) {
    if (recv_stats == nullptr)
        return;
    for (uint32_t e = thread_idx; e < layout::kNumLocalExperts; e += kNumThreads)
        recv_stats[e] += static_cast<int32_t>(table.expert_count(e));
}

}  // namespace megamoe::dispatch
