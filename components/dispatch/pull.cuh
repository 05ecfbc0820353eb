// Dispatch, second step (after the dispatch barrier): each warp pulls received rows from their source ranks into
// the local pool: the FP8 row, its SF transposed into the MN-major SF pool, its top-k weight, and the source
// metadata; then it releases the row's pool block (l1_arrival_count += 1).
#pragma once

#include "common/atomics.cuh"
#include "common/fence.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "recv_table.cuh"

namespace megamoe::dispatch {

static_assert(layout::kHidden % 16 == 0, "1D bulk copies: size a multiple of 16 B");
static_assert(layout::kHidden < (1u << 20), "one row per mbarrier transaction (tx-count limit 2^20 - 1)");
static_assert(layout::kXOffset % 16 == 0 and layout::kL1ActsOffset % 16 == 0, "rows 16 B aligned");

// Shared memory per pulling warp: one row (kBulkPull only).
constexpr uint32_t kPullRowBytes = align_up(layout::kHidden, 128u);

// Publish a pulled row: everything written for it is visible before its block's arrival count moves.
template <bool kBulkPull>
MEGAMOE_DEVICE void release_row(const SymBuffer& sym, uint32_t pool_block, uint32_t lane) {
    // NOTES: `bulk_wait_group 0` (not `.read`) completes the row's bulk store: its writes are performed.
    // fence.proxy.async.global in every lane orders the lane's generic stores (SF, weight, metadata, or the row
    // itself without kBulkPull) with async-proxy accesses (the GEMM's TMA loads of the pool, DESIGN 5b);
    // __syncwarp orders all lanes' writes before lane 0's red.release.gpu, which by cumulativity publishes
    // them to any thread on this GPU that acquires the count.
    if (kBulkPull and lane == 0)
        ptx::bulk_wait_group<0>();
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0)
        ptx::red_add_release<ptx::Scope::kGpu>(l1_arrival_count(sym) + pool_block, 1u);
}

// Called by every lane of a warp, after the dispatch barrier and build_recv_table. Global warp `warp_rank` of
// `num_warps` takes received rows warp_rank, warp_rank + num_warps, ... kBulkPull: the row travels
// peer x -> shared memory (1D cp.async.bulk, completes on `pull_barrier`, whose phase `pull_phase` tracks) ->
// pool (1D bulk store); otherwise 16 B loads and stores by the lanes. The release of each row is deferred until
// the next row's load is in flight, so that the store's completion overlaps the next pull.
template <uint32_t kBlockM, bool kBulkPull>
MEGAMOE_DEVICE void pull_rows(const DeviceEnv& env, const SymBuffer& sym, const RecvTable& table,
                              uint8_t* smem_row, uint64_t* pull_barrier, uint32_t& pull_phase, uint32_t warp_rank,
                              uint32_t num_warps) {
    constexpr uint32_t kNumTopk = layout::kNumTopk;
    const uint32_t lane = lane_idx();
    const uint32_t num_rows = table.num_rows();

    // NOTES: the source ranks' x rows are generic-proxy stores (their earlier kernels), published to this rank by
    // the dispatch barrier this warp is past; the issuing lane fences to the async proxy after that acquire and
    // before its first bulk load (DESIGN 5b; kernel order covers only the source's own GPU).
    if constexpr (kBulkPull)
        ptx::fence_proxy_async_global();

    bool has_pending = false;
    uint32_t pending_block = 0;
    for (uint32_t g = warp_rank; g < num_rows; g += num_warps) {
        const RowLocation loc = locate(table, g);
        // NOTES: written by the source rank (plain peer stores) before its dispatch-barrier release; this
        // thread is past the barrier's acquire chain, so a plain load sees it.
        const uint32_t token_topk =
            *sym.local<const uint32_t>(src_token_topk_idx_offset(loc.local_expert, loc.src_rank, loc.src_slot));
        const uint32_t token = token_topk / kNumTopk, slot = token_topk % kNumTopk;
        const uint8_t* src_row = sym.peer<const uint8_t>(x_row_offset(token), loc.src_rank);
        uint8_t* dst_row = pool_row(sym, loc.pool_row);

        // Start the row (the source's input rows: fenced to the async proxy above)
        if constexpr (kBulkPull) {
            if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(pull_barrier, layout::kHidden);
                ptx::bulk_load_1d(smem_row, src_row, layout::kHidden, pull_barrier);
            }
        } else {
            for (uint32_t c = lane; c < layout::kHidden / 16; c += 32)
                reinterpret_cast<uint4*>(dst_row)[c] = __ldcg(reinterpret_cast<const uint4*>(src_row) + c);
        }

        // SF (transposed into the MN-major pool), top-k weight, source metadata
        for (uint32_t k = lane; k < kNumSfPerRow; k += 32)
            *pool_sf(sym, k, loc.pool_row) = __ldcg(sym.peer<const float>(x_sf_offset(token, k), loc.src_rank));
        if (lane == 0) {
            *pool_topk_weight(sym, loc.pool_row) =
                __ldcg(sym.peer<const float>(topk_weight_offset(token, slot), loc.src_rank));
            *pool_src_metadata(sym, loc.pool_row) = make_uint4(loc.src_rank, token, slot, 0u);
        }

        // Release the previous row while this one is in flight
        if (has_pending)
            release_row<kBulkPull>(sym, pending_block, lane);

        // Land the row in the pool
        if constexpr (kBulkPull) {
            if (lane == 0) {
                ptx::mbarrier_wait(env, "dispatch_pull", pull_barrier, pull_phase);
                ptx::bulk_store_1d(dst_row, smem_row, layout::kHidden);
                ptx::bulk_commit_group();
                // The next row may overwrite the shared-memory row once the store has read it
                ptx::bulk_wait_group_read<0>();
            }
            pull_phase ^= 1u;
            __syncwarp();
        }
        has_pending = true;
        pending_block = loc.pool_row / kBlockM;
    }
    if (has_pending)
        release_row<kBulkPull>(sym, pending_block, lane);
}

// ---------------------------------------------------------------------------------------------------------------
// Pipelined pull: kStages rows in flight per warp (a ring of kStages shared-memory stages, one mbarrier each).
// ---------------------------------------------------------------------------------------------------------------

// The SF row travels with the row as a second 1D bulk load when it is a multiple of 16 B (H % 512 == 0; x_sf
// rows then start 16 B aligned too); otherwise the lanes copy it with plain loads when the row is issued.
constexpr bool kPullSfBulk = kNumSfPerRow % 4 == 0;
constexpr uint32_t kPullSfBytes = kNumSfPerRow * sizeof(float);
constexpr uint32_t kPullStageSfOffset = align_up(layout::kHidden, 16u);
constexpr uint32_t kPullStageBytes = align_up(kPullStageSfOffset + (kPullSfBulk ? kPullSfBytes : 0u), 128u);
constexpr uint32_t kPullTxBytes = layout::kHidden + (kPullSfBulk ? kPullSfBytes : 0u);
static_assert(kPullTxBytes < (1u << 20), "one row per mbarrier transaction (tx-count limit 2^20 - 1)");
static_assert(not kPullSfBulk or layout::kXSfOffset % 16 == 0, "x_sf rows 16 B aligned for the bulk load");

// Publish pulled row(s): lane 0 waits until at most kPendingStores bulk-store groups are pending (the row's own
// store, committed before those, is complete), then the same chain as release_row.
template <int kPendingStores>
MEGAMOE_DEVICE void release_pipelined_row(const SymBuffer& sym, uint32_t pool_block, uint32_t lane) {
    // NOTES: cp.async.bulk.wait_group N (not `.read`) completes every bulk-store group but the N most recent, so
    // the released row's store has performed its writes. fence.proxy.async.global in every lane orders the lane's
    // generic stores (SF, weight, metadata) with the GEMM's async-proxy reads of the pool (DESIGN 5b); __syncwarp
    // orders every lane's writes before lane 0's red.release.gpu, which publishes them by cumulativity.
    if (lane == 0)
        ptx::bulk_wait_group<kPendingStores>();
    ptx::fence_proxy_async_global();
    __syncwarp();
    if (lane == 0)
        ptx::red_add_release<ptx::Scope::kGpu>(l1_arrival_count(sym) + pool_block, 1u);
}

// Publish `num_rows` pulled rows with one fence: lane j < num_rows holds the pool block of the j-th (`pool_block`).
// Same chain as release_pipelined_row, with the release split into one fence.release.gpu for the warp and relaxed
// increments by the lanes that hold a block.
template <int kPendingStores>
MEGAMOE_DEVICE void release_pipelined_rows(const SymBuffer& sym, uint32_t pool_block, uint32_t num_rows,
                                           uint32_t lane) {
    // NOTES: as release_pipelined_row: wait_group N completes the stores of every row but the N most recent groups'
    // (all rows held here were committed before those). After __syncwarp each lane's fence.release.gpu (one
    // MEMBAR for the warp) orders, by cumulativity, every lane's writes and lane 0's observed store completions
    // before that lane's relaxed increment: the fence-based release pattern of the PTX memory model.
    if (lane == 0)
        ptx::bulk_wait_group<kPendingStores>();
    ptx::fence_proxy_async_global();
    __syncwarp();
    ptx::fence_release_gpu();
    if (lane < num_rows)
        ptx::red_add_relaxed<ptx::Scope::kGpu>(l1_arrival_count(sym) + pool_block, 1u);
}

// Called by every lane of a warp, after the dispatch barrier and build_recv_table. Global pulling warp `warp_rank`
// of `num_warps` takes received rows warp_rank + i * num_warps. Row i goes peer x -> stage i % kStages (1D bulk
// load of the row and of its SF row, on that stage's mbarrier) -> pool (1D bulk store); up to kStages loads are in
// flight while the oldest row lands. Lane s (s < kStages) keeps the top-k weight and the pool row of the row in
// stage s in registers (no dynamically indexed register arrays: no local memory). kPrint: a timeout also printfs
// (false in kernels that issue WGMMA). kRowsPerRelease > 1: after each warp's first kEagerReleases rows (the first
// pool blocks, which the first L1 tiles wait for, released row by row), one fence publishes kRowsPerRelease rows.
template <uint32_t kBlockM, uint32_t kStages, bool kPrint = true, uint32_t kRowsPerRelease = 1,
          uint32_t kEagerReleases = 4>
MEGAMOE_DEVICE void pull_rows_pipelined(const DeviceEnv& env, const SymBuffer& sym, const RecvTable& table,
                                        uint8_t* smem_stages, uint64_t* stage_barriers, uint32_t warp_rank,
                                        uint32_t num_warps) {
    static_assert(kStages >= 1 and kStages <= 8, "1..8 rows in flight per warp");
    static_assert(kRowsPerRelease >= 1 and kRowsPerRelease <= 32, "the held pool blocks live one per lane");
    constexpr uint32_t kNumTopk = layout::kNumTopk;
    const uint32_t lane = lane_idx();
    const uint32_t num_rows = table.num_rows();
    const uint32_t num_mine = warp_rank < num_rows ? (num_rows - warp_rank + num_warps - 1) / num_warps : 0u;

    float stage_weight = 0.0f;    // lane s: the weight of the row in stage s
    uint32_t stage_pool_row = 0;  // lane s: the pool row of the row in stage s

    // NOTES: the source ranks' x and SF rows are generic-proxy stores (their earlier kernels), published to this
    // rank by the dispatch barrier this warp is past; the issuing lane fences to the async proxy after that
    // acquire and before its first bulk load (DESIGN 5b; kernel order covers only the source's own GPU).
    ptx::fence_proxy_async_global();

    // Start row i into its stage: bulk loads of the row (and SF row), metadata now, weight into lane s's register
    const auto issue = [&](uint32_t i) {
        const uint32_t stage = i % kStages;
        const RowLocation loc = locate(table, warp_rank + i * num_warps);
        // NOTES: written by the source rank (plain peer stores) before its dispatch-barrier release; this thread
        // is past the barrier's acquire chain, so a plain load sees it.
        const uint32_t token_topk =
            *sym.local<const uint32_t>(src_token_topk_idx_offset(loc.local_expert, loc.src_rank, loc.src_slot));
        const uint32_t token = token_topk / kNumTopk, slot = token_topk % kNumTopk;
        uint8_t* stage_smem = smem_stages + stage * kPullStageBytes;
        // The source's input rows: fenced to the async proxy above
        if (lane == 0) {
            ptx::mbarrier_arrive_expect_tx(stage_barriers + stage, kPullTxBytes);
            ptx::bulk_load_1d(stage_smem, sym.peer<const uint8_t>(x_row_offset(token), loc.src_rank),
                              layout::kHidden, stage_barriers + stage);
            if constexpr (kPullSfBulk)
                ptx::bulk_load_1d(stage_smem + kPullStageSfOffset,
                                  sym.peer<const float>(x_sf_offset(token, 0), loc.src_rank), kPullSfBytes,
                                  stage_barriers + stage);
            *pool_src_metadata(sym, loc.pool_row) = make_uint4(loc.src_rank, token, slot, 0u);
        }
        if constexpr (not kPullSfBulk) {
            for (uint32_t k = lane; k < kNumSfPerRow; k += 32)
                *pool_sf(sym, k, loc.pool_row) = __ldcg(sym.peer<const float>(x_sf_offset(token, k), loc.src_rank));
        }
        // The load is consumed only when the row lands (its latency overlaps the bulk loads)
        if (lane == stage) {
            stage_weight = __ldcg(sym.peer<const float>(topk_weight_offset(token, slot), loc.src_rank));
            stage_pool_row = loc.pool_row;
        }
    };

    const uint32_t num_prologue = min(num_mine, kStages);
    for (uint32_t i = 0; i < num_prologue; ++ i)
        issue(i);

    uint32_t prev_block = 0;
    uint32_t held_block = 0;  // lane j < num_held: the pool block of the j-th stored row not yet released
    uint32_t num_held = 0;
    for (uint32_t i = 0; i < num_mine; ++ i) {
        const uint32_t stage = i % kStages;
        const uint32_t row = __shfl_sync(0xffffffffu, stage_pool_row, stage);
        uint8_t* stage_smem = smem_stages + stage * kPullStageBytes;

        // Every lane observes the stage's phase (it reads the SF from the stage), then lane 0 lands the row
        ptx::mbarrier_wait<kPrint>(env, "dispatch_pull", stage_barriers + stage, (i / kStages) & 1u);
        if (lane == 0) {
            ptx::bulk_store_1d(pool_row(sym, row), stage_smem, layout::kHidden);
            ptx::bulk_commit_group();
        }
        if constexpr (kPullSfBulk) {
            const float* sf = reinterpret_cast<const float*>(stage_smem + kPullStageSfOffset);
            for (uint32_t k = lane; k < kNumSfPerRow; k += 32)
                *pool_sf(sym, k, row) = sf[k];
        }
        if (lane == stage)
            *pool_topk_weight(sym, row) = stage_weight;

        // Release the previous row (its store: every group but this row's is complete), or hold it until
        // kRowsPerRelease rows share one fence
        if constexpr (kRowsPerRelease == 1) {
            if (i > 0)
                release_pipelined_row<1>(sym, prev_block, lane);
        } else if (i > 0) {
            if (lane == num_held)
                held_block = prev_block;
            if (++ num_held == kRowsPerRelease or i <= kEagerReleases) {
                release_pipelined_rows<1>(sym, held_block, num_held, lane);
                num_held = 0;
            }
        }
        prev_block = row / kBlockM;

        // Refill the stage: the store has read it (lane 0) and every lane has read its SF (__syncwarp)
        if (i + kStages < num_mine) {
            if (lane == 0)
                ptx::bulk_wait_group_read<0>();
            __syncwarp();
            issue(i + kStages);
        }
    }
    if (num_mine > 0) {
        if constexpr (kRowsPerRelease == 1) {
            release_pipelined_row<0>(sym, prev_block, lane);
        } else {
            if (lane == num_held)
                held_block = prev_block;
            release_pipelined_rows<0>(sym, held_block, num_held + 1, lane);
        }
    }
}

}  // namespace megamoe::dispatch
