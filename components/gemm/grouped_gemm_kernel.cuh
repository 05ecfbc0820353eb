// Standalone unit-test kernel of the GEMM component: an m-grouped FP8 GEMM over a pool-like A (each
// expert's rows start at a multiple of BLOCK_M), B [E, N, K] FP8 with 128x128 float SFs, BF16 output for
// the valid rows only. Persistent over all SMs (or clusters of T::kClusterN CTAs sharing A), 384 threads:
// WG0 = 2 idle (dispatch in the fused kernel) + TMA-A + TMA-B warps, WG1/WG2 = math.
#pragma once

#include <cuda_bf16.h>

#include "common/fence.cuh"
#include "common/sync.cuh"
#include "common/kernel_skeleton.cuh"
#include "common/tma.cuh"
#include "gemm/consumer.cuh"
#include "gemm/producer.cuh"
#include "gemm/tile_scheduler.cuh"

namespace megamoe::gemm {

// The output tile leaves through shared memory in two passes of 64 columns (a thread's fragment holds 2-column
// pairs of 2 rows: stored directly, each warp store touches 8 rows with 16 bytes each and the LSU queue throttles;
// measured with ncu: 6.7% of all warp samples on those stores). The whole tile is staged, one buffer per pass (half
// a tile staged, one more ring stage, lost: notes/gemm.md). Row r of a pass is 128 bytes, 8 chunks of 8 columns;
// chunk c sits at slot c ^ (r % 8): a warp's fragment writes (8 rows x 4 lanes of one chunk) fall into 32 distinct
// banks, and a pass is a box of the output in the TMA's 128 B swizzle (buffers 1024 B aligned).
template <typename T>
struct OutputStaging {
    static constexpr uint32_t kNumPasses = 2;
    static constexpr uint32_t kNumRows = T::BLOCK_M;
    static constexpr uint32_t kPassCols = T::BLOCK_N / kNumPasses;
    static constexpr uint32_t kNumChunks = kPassCols / 8;  // per row and pass
    static constexpr uint32_t kRowBytes = kPassCols * 2;
    static constexpr uint32_t kBufferBytes = T::BLOCK_M * kRowBytes;
    static constexpr uint32_t kBytes = kNumPasses * kBufferBytes;
    static constexpr uint32_t kOffset = align_up<uint32_t>(T::kSmemBytes, 1024);
    static constexpr uint32_t kKernelSmemBytes = kOffset + kBytes;  // the standalone kernel's whole carve-up
    static_assert(kNumChunks == 8 and T::BLOCK_N == WGMMA::N, "64-column passes over one 128-column WGMMA tile");
    static_assert(kRowBytes == 128 and kBufferBytes % 1024 == 0, "a pass is whole 128 B swizzle atoms");
    static_assert(kKernelSmemBytes <= kSmemLimit, "ring + output staging over the SM90 per-block limit");

    MEGAMOE_DEVICE static uint32_t slot_offset(uint32_t row, uint32_t chunk) {
        return ptx::swizzle_128b_offset(row, chunk * 16);
    }
};

// Named barriers of the standalone kernel's math threads (0 is __syncthreads): math warpgroup g uses
// kStagingFreeBarrierIdx + 2 g and kStagedBarrierIdx + 2 g
constexpr uint32_t kStagingFreeBarrierIdx = 1;  // the warpgroup's staging rows were copied out
constexpr uint32_t kStagedBarrierIdx = 2;       // the warpgroup's rows are staged

// Each math warpgroup stores its own rows of the tile: its own barriers and TMA stores, so that no barrier joins
// the warpgroups between tiles (one warpgroup's epilogue can run while the other's WGMMAs keep the tensor cores
// busy; they stay at most a ring's depth apart). Against both warpgroups storing the tile together (two barriers
// across them per tile), on an H100: L1 mode +1-6%, L2 mode within 2% (notes/gemm.md).
template <typename T>
struct StoreGroups {
    static constexpr uint32_t kNumGroups = T::kNumMathWarpgroups;
    static constexpr uint32_t kNumThreads = 128;
    static constexpr uint32_t kNumRows = T::BLOCK_M / kNumGroups;  // rows of a group (its TMA store box)
    static_assert(kNumRows * kNumGroups == T::BLOCK_M and kNumRows <= T::WGMMA_M, "a group holds one warpgroup's rows");
    static_assert(kNumRows * 128 % 1024 == 0, "a group's rows start on a 128 B swizzle atom");
    static_assert(kStagedBarrierIdx + 2 * (kNumGroups - 1) < 16, "named barriers 1..15");
};

// Stage pass `kPass` of this warpgroup's accumulator rows (below BLOCK_M: with BLOCK_M = 32 the WGMMA rows
// 32..63 are discarded).
template <typename Staging, uint32_t kPass>
MEGAMOE_DEVICE void stage_pass_bf16(const float (&acc)[WGMMA::kNumAccum], const AccFragment& frag, uint8_t* buffer) {
    #pragma unroll
    for (uint32_t half = 0; half < 2; ++ half) {
        const uint32_t row = frag.row + half * 8;
        if (row >= Staging::kNumRows)
            continue;
        #pragma unroll
        for (uint32_t c = 0; c < Staging::kNumChunks; ++ c) {
            const uint32_t j = kPass * Staging::kNumChunks + c;
            const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
            *reinterpret_cast<__nv_bfloat162*>(buffer + Staging::slot_offset(row, c) + frag.col() * 2) = pair;
        }
    }
}

// Copy the staged rows [first_row, first_row + Groups::kNumRows) below `tile.num_valid_rows` out, 16 bytes per
// thread and step (padding rows never written).
template <typename T, typename Staging, typename Groups, uint32_t kPass>
MEGAMOE_DEVICE void copy_staged_pass(const uint8_t* buffer, const Tile& tile, __nv_bfloat16* d, uint32_t first_row,
                                     uint32_t thread_in_group) {
    __nv_bfloat16* tile_out = d + static_cast<uint64_t>(tile.pool_row) * T::SHAPE_N + tile.n_block_idx * T::BLOCK_N +
                              kPass * Staging::kPassCols;
    const uint32_t end_row = min(tile.num_valid_rows, first_row + Groups::kNumRows);
    const uint32_t num_chunks = end_row > first_row ? (end_row - first_row) * Staging::kNumChunks : 0;
    for (uint32_t i = thread_in_group; i < num_chunks; i += Groups::kNumThreads) {
        const uint32_t row = first_row + i / Staging::kNumChunks, chunk = i % Staging::kNumChunks;
        const int4 value = *reinterpret_cast<const int4*>(buffer + Staging::slot_offset(row, chunk));
        *reinterpret_cast<int4*>(tile_out + static_cast<uint64_t>(row) * T::SHAPE_N + chunk * 8) = value;
    }
}

// The whole tile, by each math warpgroup (StoreGroups) for its rows: a full tile leaves as one TMA store per pass
// and warpgroup, issued by the warpgroup's first thread, so the math warps go on to the next tile while the stores run
// (against the threads' copy: +4-12% at prefill on an H100, notes/gemm.md); a partial tile's valid rows are copied
// out by the threads (its padding rows must stay unwritten, which a box store cannot do).
// NOTES: a group's rows of the staging are rewritten only after the stores that read them have finished reading
// (the group's store thread waits for its bulk group's reads, then the group's staging-free barrier); each writer's
// fence.proxy.async orders its st.shared before the TMA store's reads, the group's staged barrier makes them all
// precede the issue. Groups touch disjoint rows of the staging, so they never wait for each other. Each store
// thread waits for its bulk groups' reads before the kernel exits (after the warp roles: in the math role it
// spilled).
template <typename T, typename Staging, typename Groups>
MEGAMOE_DEVICE void store_tile_bf16(const float (&acc)[WGMMA::kNumAccum], const AccFragment& frag, const Tile& tile,
                                    uint8_t* staging, __nv_bfloat16* d, const CUtensorMap* tensor_map_d,
                                    uint32_t math_thread_idx) {
    const uint32_t group_idx = math_thread_idx / Groups::kNumThreads;
    const uint32_t thread_in_group = math_thread_idx % Groups::kNumThreads;
    const uint32_t first_row = group_idx * Groups::kNumRows;
    const bool is_store_thread = thread_in_group == 0;
    const bool is_full = tile.num_valid_rows == T::BLOCK_M;
    uint8_t* buffer_1 = staging + Staging::kBufferBytes;
    if (is_store_thread)
        ptx::bulk_wait_group_read<0>();
    ptx::named_barrier_sync<Groups::kNumThreads>(kStagingFreeBarrierIdx + 2 * group_idx);
    stage_pass_bf16<Staging, 0>(acc, frag, staging);
    stage_pass_bf16<Staging, 1>(acc, frag, buffer_1);
    ptx::fence_proxy_async_shared_cta();
    ptx::named_barrier_sync<Groups::kNumThreads>(kStagedBarrierIdx + 2 * group_idx);
    if (is_full) {
        if (is_store_thread) {
            const int32_t col = tile.n_block_idx * T::BLOCK_N;
            const uint32_t offset = first_row * Staging::kRowBytes;
            ptx::tma_store_2d(tensor_map_d, staging + offset, col, tile.pool_row + first_row);
            ptx::tma_store_2d(tensor_map_d, buffer_1 + offset, col + Staging::kPassCols, tile.pool_row + first_row);
            ptx::bulk_commit_group();
        }
    } else {
        copy_staged_pass<T, Staging, Groups, 0>(staging, tile, d, first_row, thread_in_group);
        copy_staged_pass<T, Staging, Groups, 1>(buffer_1, tile, d, first_row, thread_in_group);
    }
}

// kBandM: m-blocks per band of the tile order (gemm/tile_scheduler.cuh). kPrefetch: the next stage awaited while a
// block's last WGMMA group runs (gemm/consumer.cuh). kTrace: CTA 0 records its K blocks' timeline into `trace`
// (gemm/kblock_trace.cuh). kFeedOnly: no math (the producers' rate; the output is not written).
template <typename T, uint32_t kNumExperts, uint32_t kBandM, bool kPrefetch, bool kTrace = false,
          bool kFeedOnly = false>
MEGAMOE_DEVICE void grouped_gemm_impl(const CUtensorMap* tensor_map_a, const CUtensorMap* tensor_map_sfa,
                                      const CUtensorMap* tensor_map_d, const uint8_t* b_tiles, const float* w_sf,
                                      const int* num_tokens_per_expert, __nv_bfloat16* d, const DeviceEnv& env,
                                      unsigned long long* trace = nullptr) {
    using Staging = OutputStaging<T>;
    using Groups = StoreGroups<T>;
    // Tiles are handed out per cluster: a cluster's CTAs take the same (expert, m-block) and n-blocks
    // kClusterN j + rank, so that they share A (gemm/producer.cuh)
    using Scheduler = GroupedTileScheduler<T::BLOCK_M, T::kNumNBlocks / T::kClusterN, kNumExperts, kBandM>;
    extern __shared__ __align__(1024) uint8_t smem_buffer[];
    const GemmSmem<T> smem{smem_buffer};
    const Pipeline<T::kNumStages, T::kClusterN> pipeline{smem.full_barriers(), smem.empty_barriers()};
    const uint32_t lane = lane_idx();
    const uint32_t cta_rank = pipeline.cta_rank;
    const uint32_t first_task_idx = blockIdx.x / T::kClusterN, num_clusters = gridDim.x / T::kClusterN;
    const auto locate = [&](Scheduler& scheduler, uint32_t task_idx, Tile& tile) {
        const bool found = scheduler.locate(task_idx, tile);
        tile.n_block_idx = tile.n_block_idx * T::kClusterN + cta_rank;
        return found;
    };

    // Init the ring, visible to the async proxy (and, in a cluster, to the peer's multicasts and arrivals) before
    // the first TMA
    if (threadIdx.x == 0) {
        MEGAMOE_DEVICE_ASSERT(smem_addr(smem_buffer) % 1024 == 0);
        ptx::prefetch_tensormap(tensor_map_a);
        ptx::prefetch_tensormap(tensor_map_sfa);
        ptx::prefetch_tensormap(tensor_map_d);
        pipeline.init(2, T::kNumMathWarps);
        ptx::fence_mbarrier_init();
    }
    if constexpr (T::kClusterN == 1)
        __syncthreads();
    else
        ptx::cluster_sync();

    // The TMA producers (lane 0 of each TMA warp issues; the dispatch warps of the fused kernel idle here)
    const auto produce = [&](bool is_tma_a) {
        if (lane != 0)
            return;
        PipelineState<T::kNumStages> state;
        Scheduler scheduler(num_tokens_per_expert);
        Tile tile;
        for (uint32_t task_idx = first_task_idx; locate(scheduler, task_idx, tile); task_idx += num_clusters) {
            if (is_tma_a)
                produce_a_tile<T>(pipeline, state, smem, tensor_map_a, tensor_map_sfa, tile.pool_row, env,
                                  cta_rank);
            else
                produce_b_tile<T>(pipeline, state, smem, b_tiles, tile.expert_idx * T::kNumNBlocks + tile.n_block_idx,
                                  env);
        }
    };
    // Math warpgroups: accumulate each tile, store it
    const auto math = [&](uint32_t math_wg_idx, uint32_t thread_in_wg) {
        const AccFragment frag = AccFragment::of(math_wg_idx, thread_in_wg);
        uint8_t* staging = smem_buffer + Staging::kOffset;
        const uint32_t math_thread_idx = threadIdx.x - kFirstMathThread;
        KBlockTrace<kTrace> tracer{blockIdx.x == 0 and thread_in_wg == 0 and trace != nullptr
                                       ? trace + math_wg_idx * kMaxTracedKBlocks * kNumKBlockEvents : nullptr};
        PipelineState<T::kNumStages> state;
        Scheduler scheduler(num_tokens_per_expert);
        // The next tile's weight SFs are loaded before this tile's epilogue, which hides their latency
        Tile tile, next_tile;
        uint32_t task_idx = first_task_idx;
        bool has_tile = locate(scheduler, task_idx, tile);
        WeightScales weight_scales{};
        if (has_tile)
            weight_scales = WeightScales::load<T>(w_sf, tile.expert_idx, tile.n_block_idx, lane);
        while (has_tile) {
            float acc[WGMMA::kNumAccum];
            #pragma unroll
            for (uint32_t i = 0; i < WGMMA::kNumAccum; ++ i)
                acc[i] = 0.0f;
            consume_tile<T, kTrace, kFeedOnly, kPrefetch>(
                pipeline, state, smem, weight_scales, math_wg_idx, thread_in_wg, acc, env, &tracer);
            task_idx += num_clusters;
            const bool has_next = locate(scheduler, task_idx, next_tile);
            if (has_next)
                weight_scales = WeightScales::load<T>(w_sf, next_tile.expert_idx, next_tile.n_block_idx, lane);
            if constexpr (not kFeedOnly)
                store_tile_bf16<T, Staging, Groups>(acc, frag, tile, staging, d, tensor_map_d, math_thread_idx);
            tile = next_tile;
            has_tile = has_next;
        }
    };
    run_warp_roles<T::kNumMathWarpgroups, SpareWarpgroup::kReleaseRegisters>(
        NoRole{}, [&]() { produce(true); }, [&]() { produce(false); }, math, NoRole{});
    // The staging must outlive the TMA stores that read it (each math warpgroup's first thread issued its own)
    const uint32_t math_thread_idx = threadIdx.x - kFirstMathThread;
    if (threadIdx.x >= kFirstMathThread and math_thread_idx < T::kNumMathThreads and
        math_thread_idx % Groups::kNumThreads == 0)
        ptx::bulk_wait_group_read<0>();
    // NOTES: in a cluster, no CTA exits while its peer may still multicast into its stages or arrive on its
    // barriers (both walk the same tasks, so both are done once both got here)
    if constexpr (T::kClusterN > 1)
        ptx::cluster_sync();
}

}  // namespace megamoe::gemm
