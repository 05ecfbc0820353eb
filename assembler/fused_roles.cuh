// The warp roles of the fused kernel (fused_kernel.cuh runs them through common/kernel_skeleton.cuh). Each role is
// a function of the one context the kernel builds after its prologue.
#pragma once

#include <cuda_bf16.h>

#include "combine/reduce.cuh"
#include "combine/scatter.cuh"
#include "common/fence.cuh"
#include "common/phase_timer.cuh"
#include "common/sync.cuh"
#include "fused_scheduler.cuh"
#include "fused_traits.cuh"
#include "l2_handoff.cuh"
#include "task_queue.cuh"
#include "gemm/consumer.cuh"
#include "gemm/producer.cuh"

namespace megamoe::assembler {

// Named barriers among the math threads (0 is __syncthreads)
constexpr uint32_t kL1StoreBarrierIdx = 1;      // L1 staging written -> one thread issues the TMA stores
constexpr uint32_t kStagingFreeBarrierIdx = 2;  // the L1 stores' reads of the staging area are done
constexpr uint32_t kL2StagedBarrierIdx = 3;     // L2 tile staged -> the scatter warp (l2_handoff.cuh)
constexpr uint32_t kL2FreeBarrierIdx = 4;       // the scatter warp read the L2 tile -> the math threads

// The receive table's per-expert row counts, as the scheduler reads them: stateless (the table sits at a fixed
// offset of the dynamic shared memory), so the scheduler carries no pointer through the math warps' mainloop.
template <uint32_t kOffsetRecvTable>
struct TableCounts {
    MEGAMOE_DEVICE uint32_t operator()(uint32_t expert) const {
        extern __shared__ __align__(1024) uint8_t smem_buffer[];
        const uint32_t* pair_prefix = reinterpret_cast<const uint32_t*>(smem_buffer + kOffsetRecvTable);
        return pair_prefix[(expert + 1) * layout::kNumRanks] - pair_prefix[expert * layout::kNumRanks];
    }
};

template <typename T>
using FusedSchedulerOf = FusedScheduler<T::BLOCK_M, T::kNumL1NBlocks, T::kNumL2NBlocks, T::kNumExperts,
                                        T::kNMajorL2, TableCounts<T::kOffsetRecvTable>>;

// Everything the roles share, built once after the prologue's shared-memory carve-up.
template <typename T>
struct FusedContext {
    const FusedMaps& maps;
    const SymBuffer& sym;
    const FusedParams& p;
    const DeviceEnv& env;
    uint8_t* smem;
    gemm::GemmSmem<typename T::L1> smem_l1;
    gemm::GemmSmem<typename T::L2> smem_l2;
    gemm::Pipeline<T::kNumStages> pipeline;
    uint64_t* pull_barriers;
    uint32_t* expert_count;
    uint32_t* misc;  // misc region: [0] the dispatch barrier's NVLink ordinal, [1] blockIdx.x, [2] gridDim.x
    dispatch::RecvTable table;
    TableCounts<T::kOffsetRecvTable> counts;
    typename T::Tasks tasks;
    typename T::L2Tasks l2_tasks;
    typename T::RowWeights tile_weights;
    using Handoff = L2Handoff<T::kNumMathThreads, kL2StagedBarrierIdx, kL2FreeBarrierIdx>;

    MEGAMOE_DEVICE FusedContext(const FusedMaps& maps_, const SymBuffer& sym_, const FusedParams& p_,
                                const DeviceEnv& env_, uint8_t* smem_)
        : maps(maps_), sym(sym_), p(p_), env(env_), smem(smem_), smem_l1{smem_}, smem_l2{smem_},
          pipeline{smem_l2.full_barriers(), smem_l2.empty_barriers()},
          pull_barriers(reinterpret_cast<uint64_t*>(smem_ + T::kOffsetPullBarriers)),
          expert_count(reinterpret_cast<uint32_t*>(smem_ + T::kOffsetExpertCount)),
          misc(reinterpret_cast<uint32_t*>(smem_ + T::kOffsetMisc)),
          table(dispatch::make_recv_table(reinterpret_cast<uint32_t*>(smem_ + T::kOffsetRecvTable))),
          counts{}, tasks{smem_ + T::kOffsetTaskQueue}, l2_tasks{smem_ + T::kOffsetL2TaskQueue},
          tile_weights{smem_ + T::kOffsetTileWeights} {}

    // After the head: this CTA's index and the grid size, from shared memory (utils.cuh: ld_volatile_shared)
    MEGAMOE_DEVICE uint32_t cta_idx() const { return ld_volatile_shared(misc + 1); }
    MEGAMOE_DEVICE uint32_t num_ctas() const { return ld_volatile_shared(misc + 2); }

    MEGAMOE_DEVICE uint32_t* pool_counter(uint64_t region_offset, uint32_t pool_block) const {
        return sym.local<uint32_t>(region_offset) + pool_block;
    }
};

// Wait until `counter` reaches `target`, then let the async proxy read what it publishes.
// NOTES: the ld.acquire.gpu pairs with the writers' releases (the pull's red.release.gpu of each row, or at
// BLOCK_M 128 one fence.release.gpu and relaxed adds for several rows, issued after their bulk stores completed
// and their generic stores were fenced for the async proxy; the L1 epilogue's release after
// its TMA stores completed); fence.proxy.async.global after the acquire and before this warp's TMA loads
// (DESIGN 5b, 5c).
MEGAMOE_DEVICE void wait_pool_counter(const DeviceEnv& env, const char* tag, const uint32_t* counter,
                                      uint32_t target, uint32_t pool_block) {
    bounded_wait<false>(
        env, tag, [&]() { return ptx::ld_acquire<ptx::Scope::kGpu>(counter) >= target; },
        [&]() { return make_longlong3(ptx::ld_relaxed<ptx::Scope::kGpu>(counter), target, pool_block); });
    ptx::fence_proxy_async_global();
}

// Phase-serial debug order: wait until every pool block of this call has arrived.
template <typename T>
MEGAMOE_DEVICE void wait_every_pool_block(const FusedContext<T>& ctx, const DeviceEnv& env) {
    for (uint32_t e = 0; e < T::kNumExperts; ++ e) {
        const uint32_t num_rows = ctx.table.expert_count(e), first_block = ctx.table.pool_offset[e] / T::BLOCK_M;
        for (uint32_t m = 0; m * T::BLOCK_M < num_rows; ++ m)
            wait_pool_counter(env, "l1_arrival_all", ctx.pool_counter(layout::kL1ArrivalCountOffset, first_block + m),
                              min(T::BLOCK_M, num_rows - m * T::BLOCK_M), first_block + m);
    }
}

// Debug: record task `position` of this CTA (the scheduler test compares the lists with megamoe/scheduler.py).
MEGAMOE_DEVICE void dump_task(const FusedParams& p, uint32_t cta_idx, uint32_t position, const FusedTask& task) {
    uint32_t* list = p.task_dump + static_cast<uint64_t>(cta_idx) * (1 + 4 * p.task_dump_capacity);
    list[0] = position + 1;
    if (position < p.task_dump_capacity) {
        uint32_t* entry = list + 1 + 4 * position;
        entry[0] = pack_task(task).x;  // phase << 31 | expert, as the queue carries it
        entry[1] = task.m_block_idx;
        entry[2] = task.n_block_idx;
        entry[3] = task.pool_block_idx;
    }
}

// The global task indices of one CTA (fused_scheduler.cuh): its own CTA index first, then each next one from the
// call's claim counter (the workspace header's scheduler word, zeroed by the tail's clean: combine/clean.cuh).
// NOTES: the counter hands out gridDim.x, gridDim.x + 1, ... in order, so every index below a claimed one is
// claimed; relaxed is enough, as nothing is published through it (each task's inputs have their own counters).
// The claim for the next task is issued once the current task's A loads are issued, while the math warps still
// have the ring's stages of it to consume.
struct TaskClaims {
    uint32_t* counter;
    uint32_t num_ctas;

    MEGAMOE_DEVICE uint32_t next() const {
        return num_ctas + ptx::atom_add_relaxed<ptx::Scope::kGpu>(counter, 1u);
    }
};

// TMA-A warp (lane 0 issues): claims tasks and walks the scheduler to them, pushes each task to the queue (before
// any wait on its inputs: task_queue.cuh) and each L2 task to the scatter warp's queue, then loads the activation
// tiles (and an L1 task's row weights) once their pool block is ready.
template <typename T>
MEGAMOE_DEVICE void tma_a_role(const FusedContext<T>& ctx) {
    if (lane_idx() != 0)
        return;
    // (the tiered environments are built at each wait: kept live across the loop, they cost the warp's registers)
    gemm::PipelineState<T::kNumStages> state;
    gemm::PipelineState<T::kNumTaskSlots> queue_state;
    gemm::PipelineState<T::kNumL2TaskSlots> l2_queue_state;
    FusedSchedulerOf<T> scheduler(ctx.counts, ctx.p.min_wave_l1_tiles);
    const TaskClaims claims{ctx.sym.template local<uint32_t>(layout::kWorkspaceHeaderOffset) +
                                layout::kSchedulerCounterIdx, ctx.num_ctas()};
    FusedTask task;
    bool waited_all = false;
    for (uint32_t task_count = 0, task_idx = ctx.cta_idx(); scheduler.seek(task_idx, task);
         ++ task_count, task_idx = claims.next()) {
        const uint32_t slot_idx = queue_state.stage, slot_phase = queue_state.phase;
        ctx.tasks.push(tiered_env(ctx.env, kTierPipeline, kRoleProducer), queue_state, pack_task(task));
        if (task.phase == FusedPhase::kL2) {
            ctx.tile_weights.skip(tiered_env(ctx.env, kTierPipeline, kRoleProducer), slot_idx, slot_phase);
            ctx.l2_tasks.push(tiered_env(ctx.env, kTierPipeline, kRoleProducer), l2_queue_state, pack_task(task));
        }
        const uint32_t pool_row = task.pool_block_idx * T::BLOCK_M;
        if (ctx.p.task_dump != nullptr)
            dump_task(ctx.p, ctx.cta_idx(), task_count, task);
        if (task.phase == FusedPhase::kL1) {
            if (T::kSerial and not waited_all) {
                wait_every_pool_block(ctx, tiered_env(ctx.env, kTierArrival, kRoleProducer));
                waited_all = true;
            }
            wait_pool_counter(tiered_env(ctx.env, kTierArrival, kRoleProducer), "l1_arrival",
                              ctx.pool_counter(layout::kL1ArrivalCountOffset, task.pool_block_idx),
                              task.num_valid_rows, task.pool_block_idx);
            ctx.tile_weights.load(slot_idx, dispatch::pool_topk_weight(ctx.sym, pool_row));
            PhaseTimer{ctx.p.phase_times}.mark(kMarkL1Start, 0);
            gemm::produce_a_tile<typename T::L1>(ctx.pipeline, state, ctx.smem_l1, ctx.maps.l1_a, ctx.maps.l1_sfa,
                                                 pool_row, tiered_env(ctx.env, kTierPipeline, kRoleProducer));
        } else {
            wait_pool_counter(tiered_env(ctx.env, kTierPipeline, kRoleProducer), "l1_done",
                              ctx.pool_counter(layout::kL1DoneCountOffset, task.pool_block_idx), T::kNumL1NBlocks,
                              task.pool_block_idx);
            PhaseTimer{ctx.p.phase_times}.mark(kMarkL2Start, 0);
            gemm::produce_a_tile<typename T::L2>(ctx.pipeline, state, ctx.smem_l2, ctx.maps.l2_a, ctx.maps.l2_sfa,
                                                 pool_row, tiered_env(ctx.env, kTierPipeline, kRoleProducer));
        }
    }
    ctx.tasks.push(tiered_env(ctx.env, kTierPipeline, kRoleProducer), queue_state,
                   make_uint4(kEndOfTasks, 0, 0, 0));
    ctx.l2_tasks.push(tiered_env(ctx.env, kTierPipeline, kRoleProducer), l2_queue_state,
                      make_uint4(kEndOfTasks, 0, 0, 0));
}

// TMA-B warp (lane 0 issues): the weight tiles of each queued task.
template <typename T>
MEGAMOE_DEVICE void tma_b_role(const FusedContext<T>& ctx) {
    if (lane_idx() != 0)
        return;
    gemm::PipelineState<T::kNumStages> state;
    gemm::PipelineState<T::kNumTaskSlots> queue_state;
    for (QueuedTask task = ctx.tasks.pop(tiered_env(ctx.env, kTierPipeline, kRoleProducer), queue_state);
         task.valid(); task = ctx.tasks.pop(tiered_env(ctx.env, kTierPipeline, kRoleProducer), queue_state)) {
        if (task.phase() == FusedPhase::kL1)
            gemm::produce_b_tile<typename T::L1, true>(ctx.pipeline, state, ctx.smem_l1, ctx.maps.w1,
                                                       task.expert_idx() * T::kNumL1NBlocks + task.n_block_idx(),
                                                       tiered_env(ctx.env, kTierPipeline, kRoleProducer),
                                                       task.num_valid_rows());
        else
            gemm::produce_b_tile<typename T::L2, true>(ctx.pipeline, state, ctx.smem_l2, ctx.maps.w2,
                                                       task.expert_idx() * T::kNumL2NBlocks + task.n_block_idx(),
                                                       tiered_env(ctx.env, kTierPipeline, kRoleProducer),
                                                       task.num_valid_rows());
    }
}

// The scatter warp, one staged L2 tile: each valid row's 256 B slice goes to its source rank's combine row. Lane l
// computes the destinations of rows l, l + 32, ... (their metadata loads issued together, one latency per tile);
// each step covers two rows, 16 lanes of 16 B per row, the destination shuffled from the row's lane.
// NOTES: pool_src_metadata was written by the pull in this launch: lane 0 acquires the block's arrival count
// (complete long before: the block's L1 tiles needed it) and __syncwarp extends the order to the other lanes,
// whose ld.relaxed.gpu then see the metadata (never __ldg).
template <typename T>
MEGAMOE_DEVICE void scatter_tile(const FusedContext<T>& ctx, const QueuedTask& task, const uint8_t* staging,
                                 uint32_t lane) {
    constexpr uint32_t kNumRowChunks = T::L2Staging::kNumRowChunks;
    constexpr uint32_t kNumRowGroups = T::BLOCK_M / 32;
    static_assert(kNumRowChunks == 16 and T::BLOCK_M % 32 == 0, "two rows of 16 chunks per warp step");
    const uint32_t pool_row = task.pool_block_idx() * T::BLOCK_M, num_valid_rows = task.num_valid_rows();
    const uint32_t chunk = lane % kNumRowChunks;
    if (lane == 0)
        ptx::ld_acquire<ptx::Scope::kGpu>(ctx.pool_counter(layout::kL1ArrivalCountOffset, task.pool_block_idx()));
    __syncwarp();
    uint4 meta[kNumRowGroups];
    #pragma unroll
    for (uint32_t g = 0; g < kNumRowGroups; ++ g) {
        if (32 * g + lane < num_valid_rows)
            meta[g] = ptx::ld_relaxed_gpu_v4(dispatch::pool_src_metadata(ctx.sym, pool_row + 32 * g + lane));
    }
    #pragma unroll
    for (uint32_t g = 0; g < kNumRowGroups; ++ g) {
        if (32 * g >= num_valid_rows)
            break;
        // (the tile's 128 columns of row 32 g + lane's combine row)
        const uint64_t dst = 32 * g + lane < num_valid_rows
            ? reinterpret_cast<uint64_t>(combine::combine_row(ctx.sym, meta[g].x, meta[g].y, meta[g].z) +
                                         task.n_block_idx() * 128)
            : 0;
        #pragma unroll 4
        for (uint32_t step = 0; step < 16; ++ step) {
            const uint32_t row_in_group = 2 * step + lane / kNumRowChunks, row = 32 * g + row_in_group;
            const uint64_t row_dst = __shfl_sync(0xffffffffu, dst, row_in_group);
            if (row < num_valid_rows)
                combine::store_combine_chunk(reinterpret_cast<__nv_bfloat16*>(row_dst), chunk * epilogue::kChunkCols,
                                             epilogue::l2_load_staged_chunk<typename T::L2Staging>(staging, row, chunk));
        }
    }
}

// The scatter warp, after its tile's combine stores: count the tile for its pool block; the tile that completes
// the block signals each of its rows once.
// NOTES: __syncwarp orders every lane's combine stores before lane 0's acq_rel add (the reduce reads the rows with
// generic loads: no proxy fence); the add that completes the block acquires every earlier tile's release (the
// release sequence of the adds), and __syncwarp orders that before the lanes' red.release.sys signals, which carry
// all the block's rows (cumulativity) to the source rank's ld.acquire.sys in the reduce (combine/reduce.cuh:
// reduce_token_chunks).
template <typename T>
MEGAMOE_DEVICE void count_tile(const FusedContext<T>& ctx, const QueuedTask& task, uint32_t lane) {
    __syncwarp();
    uint32_t done = 0;
    if (lane == 0)
        done = ptx::atom_add_acq_rel<ptx::Scope::kGpu>(
                   ctx.pool_counter(layout::kL2DoneCountOffset, task.pool_block_idx()), 1u) + 1u;
    done = __shfl_sync(0xffffffffu, done, 0);
    if (done == T::kNumL2NBlocks) {
        __syncwarp();
        const uint32_t pool_row = task.pool_block_idx() * T::BLOCK_M;
        for (uint32_t row = lane; row < task.num_valid_rows(); row += 32) {
            const uint4 meta = ptx::ld_relaxed_gpu_v4(dispatch::pool_src_metadata(ctx.sym, pool_row + row));
            ptx::red_add_release<ptx::Scope::kSys>(combine::combine_arrival_count(ctx.sym, meta.x, meta.y), 1u);
        }
    }
}

// The scatter warp (dispatch warp 0 once its pulls are done): every L2 tile of this CTA's task list, in order, as
// the math warpgroups stage it (l2_handoff.cuh). Every lane pops the CTA's L2 tasks from the TMA-A warp's L2 queue.
// NOTES: no deadlock: this warp waits only for the TMA-A warp, which pushes each L2 task before any wait on its
// inputs and never waits for this warp (fused_traits.cuh: kNumL2TaskSlots), and for the math warps of its CTA,
// which stage every L2 tile of the list before any wait of their reduce; the reduce's waits for this warp's
// signals then wait for nothing that waits for them. The pull came first, so no pull waits for an L2 tile either
// (5c).
template <typename T>
MEGAMOE_DEVICE void scatter_role(const FusedContext<T>& ctx) {
    using Handoff = typename FusedContext<T>::Handoff;
    const uint32_t lane = lane_idx();
    const uint8_t* staging = ctx.smem + T::kOffsetStaging;
    gemm::PipelineState<T::kNumL2TaskSlots> l2_queue_state;
    for (QueuedTask task = ctx.l2_tasks.pop(tiered_env(ctx.env, kTierPipeline, kRoleDispatch), l2_queue_state);
         task.valid(); task = ctx.l2_tasks.pop(tiered_env(ctx.env, kTierPipeline, kRoleDispatch), l2_queue_state)) {
        Handoff::wait_staged();
        scatter_tile<T>(ctx, task, staging, lane);
        Handoff::release();
        count_tile<T>(ctx, task, lane);
    }
}

// Dispatch warps: pull this CTA's share of the received rows (global pulling warp cta * 2 + warp); then warp 0
// scatters the L2 tiles.
template <typename T>
MEGAMOE_DEVICE void dispatch_role(const FusedContext<T>& ctx, uint32_t warp) {
    if ((ctx.p.debug_flags & kDebugDelayPull) != 0 and ctx.cta_idx() % 2 == 1) {
        const uint64_t start_ns = globaltimer_ns();
        while (globaltimer_ns() - start_ns < kDebugPullDelayNs)
            __nanosleep(1000);
    }
    dispatch::pull_rows_pipelined<T::BLOCK_M, T::kPullStages, false, T::kPullRowsPerRelease>(
        tiered_env(ctx.env, kTierPeer, kRoleDispatch), ctx.sym, ctx.table,
        ctx.smem + T::kOffsetPull + warp * T::kPullStages * dispatch::kPullStageBytes,
        ctx.pull_barriers + warp * T::kPullStages, ctx.cta_idx() * kNumDispatchWarps + warp,
        ctx.num_ctas() * kNumDispatchWarps);
    PhaseTimer{ctx.p.phase_times}.mark(kMarkPull, lane_idx());
    if (warp == 0) {
        scatter_role<T>(ctx);
        PhaseTimer{ctx.p.phase_times}.mark(kMarkL2Done, lane_idx());
    }
}

// The top-k reduce of this rank's tokens: the 8 warps of both math warpgroups of every CTA.
template <typename T>
MEGAMOE_DEVICE void reduce_tokens(const FusedContext<T>& ctx, uint32_t math_wg_idx) {
    const uint32_t warp_in_math = math_wg_idx * 4 + (threadIdx.x / 32) % 4;
    combine::reduce_token_chunks<T::kReduceVecs, true, false>(
        tiered_env(ctx.env, kTierCombine, kRoleMath), ctx.sym, ctx.p.num_tokens,
        static_cast<__nv_bfloat16*>(ctx.p.y), ctx.cta_idx() * T::kNumReduceWarps + warp_in_math,
        ctx.num_ctas() * T::kNumReduceWarps);
}

// The spare math warpgroup (BLOCK_M <= 64): the reduce only.
template <typename T>
MEGAMOE_DEVICE void reduce_role(const FusedContext<T>& ctx, uint32_t math_wg_idx) {
    reduce_tokens<T>(ctx, math_wg_idx);
}

// Math warpgroups: every tile of this CTA's task list, then the reduce.
template <typename T>
MEGAMOE_DEVICE void math_role(const FusedContext<T>& ctx, uint32_t math_wg_idx, uint32_t thread_in_wg) {
    using L1 = typename T::L1;
    using L2 = typename T::L2;
    constexpr uint32_t kNumMathThreads = T::kNumMathThreads;
    const uint32_t lane = thread_in_wg % 32;
    const uint32_t math_thread_idx = threadIdx.x - kFirstMathThread;
    const bool is_store_thread = math_thread_idx == 0;
    const AccFragment frag = AccFragment::of(math_wg_idx, thread_in_wg);
    uint8_t* staging = ctx.smem + T::kOffsetStaging;
    epilogue::L1EpilogueState l1_state;
    const auto l1_done_counts = [&]() { return ctx.sym.template local<uint32_t>(layout::kL1DoneCountOffset); };
    using Handoff = typename FusedContext<T>::Handoff;
    // Whether the staging area holds an L2 tile the scatter warp may still read (l2_handoff.cuh)
    bool staging_held_by_l2 = false;
    // The GEMM consumer's in-flight wait for the next K block's stage (gemm/consumer.cuh: kPrefetch), at the decode
    // variants (BLOCK_M <= 64). Same-round A/B on the H200 (cold, three seeds): BLOCK_M 32 at T 8 and 128 0.2-1.5 us
    // faster, BLOCK_M 64 at T 192 and 256 1.5-2.5 us faster; BLOCK_M 128 0-6 us faster at T 1024 but 55-67 us slower
    // at T 4096 (warm). No spills with it at BLOCK_M <= 64 (at 128 the scatter warp spilled 32 B: notes/fused.md).
    constexpr bool kPrefetch = T::BLOCK_M <= 64;

    // A task's weight SFs (gemm::WeightScales), loaded before the previous task's epilogue to hide the latency
    const auto load_weight_scales = [&](const QueuedTask& t) {
        return t.phase() == FusedPhase::kL1
            ? gemm::WeightScales::load<L1>(ctx.p.w1_sf, t.expert_idx(), t.n_block_idx(), lane)
            : gemm::WeightScales::load<L2>(ctx.p.w2_sf, t.expert_idx(), t.n_block_idx(), lane);
    };
    // NOTES: the current and the next task stay in their queue slots (task_queue.cuh) and are re-read from shared
    // memory where needed: the slot of the current task is released once its epilogue is done, after the next
    // one's weight SFs were loaded from its slot.
    gemm::PipelineState<T::kNumStages> state;
    gemm::PipelineState<T::kNumTaskSlots> slot;
    const auto wait_slot = [&](const gemm::PipelineState<T::kNumTaskSlots>& s) {
        ctx.tasks.wait_full(tiered_env(ctx.env, kTierPipeline, kRoleMath), s.stage, s.phase);
    };
    const auto current = [&]() { return ctx.tasks.peek(slot.stage); };
    gemm::WeightScales weight_scales{};
    wait_slot(slot);
    if (current().valid())
        weight_scales = load_weight_scales(current());
    const auto next_slot = [&]() {
        gemm::PipelineState<T::kNumTaskSlots> next = slot;
        next.advance();
        return next;
    };
    // Wait for the next task and load its weight SFs (hidden behind this task's epilogue)
    const auto locate_next = [&]() {
        const gemm::PipelineState<T::kNumTaskSlots> next = next_slot();
        wait_slot(next);
        const QueuedTask next_task = ctx.tasks.peek(next.stage);
        if (next_task.valid())
            weight_scales = load_weight_scales(next_task);
    };
    // After locate_next: whether the next task is not an L1 tile (the end of a run of L1 tiles)
    const auto next_is_not_l1 = [&]() {
        const QueuedTask next_task = ctx.tasks.peek(next_slot().stage);
        return not next_task.valid() or next_task.phase() != FusedPhase::kL1;
    };
    for (; current().valid(); slot.advance()) {
        float acc[epilogue::kNumAccum];
        #pragma unroll
        for (uint32_t i = 0; i < epilogue::kNumAccum; ++ i)
            acc[i] = 0.0f;

        if (current().phase() == FusedPhase::kL1) {
            gemm::consume_tile<L1, false, false, kPrefetch, true>(
                ctx.pipeline, state, ctx.smem_l1, weight_scales, math_wg_idx, thread_in_wg, acc,
                tiered_env(ctx.env, kTierPipeline, kRoleMath), nullptr, current().num_valid_rows());
            locate_next();
            // The L1 buffers alias the L2 staging: wait for its reader, the scatter warp (the L1 epilogue's own
            // stores are waited for by their thread before the epilogue's barrier)
            if (staging_held_by_l2)
                Handoff::wait_free();
            staging_held_by_l2 = false;
            const QueuedTask task = current();
            // (built here from kernel constants: held across the mainloop, its pointers cost registers there; the
            // row weights from the task's slot, copied there by the TMA-A warp)
            ctx.tile_weights.wait(tiered_env(ctx.env, kTierPipeline, kRoleMath), slot.stage, slot.phase);
            const epilogue::L1EpilogueArgs l1_args{
                ctx.maps.act_store, ctx.tile_weights.weights(slot.stage),
                ctx.sym.template local<float>(layout::kL2ActsSfOffset),
                l1_done_counts(), layout::kNumPoolTokens, ctx.p.clamp};
            const epilogue::EpilogueTile out_tile{task.pool_block_idx() * T::BLOCK_M, task.n_block_idx(),
                                                  task.num_valid_rows()};
            epilogue::l1_epilogue<T::BLOCK_M, kNumMathThreads, kL1StoreBarrierIdx, T::kClamp, T::kFastMath,
                                  T::kBatchL1Releases ? T::kOffsetL1Releases - T::kOffsetStaging : 0>(
                acc, frag, out_tile, staging, l1_args, is_store_thread, l1_state,
                T::kBatchL1Releases and next_is_not_l1());
        } else {
            // Publish the last L1 tile before waiting for any L2 input (this CTA's L2 producer may need it)
            if (is_store_thread)
                l1_state.publish_pending(l1_done_counts());
            gemm::consume_tile<L2, false, false, kPrefetch, true>(
                ctx.pipeline, state, ctx.smem_l2, weight_scales, math_wg_idx, thread_in_wg, acc,
                tiered_env(ctx.env, kTierPipeline, kRoleMath), nullptr, current().num_valid_rows());
            locate_next();

            // Stage as BF16 rows once every earlier reader of the staging area is done: the scatter warp (the last
            // L2 tile), or the L1 stores, waited for above by the thread that issued them before it reached this
            // barrier. Then hand the tile to the scatter warp.
            if (staging_held_by_l2)
                Handoff::wait_free();
            else
                ptx::named_barrier_sync<kStagingFreeBarrierIdx, kNumMathThreads>();
            if (frag.warp_row() < T::BLOCK_M)
                epilogue::l2_stage_bf16<typename T::L2Staging>(acc, frag, staging);
            Handoff::publish();
            staging_held_by_l2 = true;
        }
        ctx.tasks.release(slot.stage);
    }
    // The last L1 stores complete and are published before any wait of the reduce; the last L2 tile's "free"
    // phase is taken, so that no named barrier is left part-way at exit
    if (is_store_thread)
        l1_state.publish_pending(l1_done_counts());
    if (staging_held_by_l2)
        Handoff::wait_free();
    reduce_tokens<T>(ctx, math_wg_idx);
}

}  // namespace megamoe::assembler
