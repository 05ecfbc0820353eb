// The fused kernel's task queue in shared memory: the TMA-A warp walks the scheduler and pushes each task; the
// TMA-B warp and the math warps pop them in the same order. Only one role of a CTA carries the scheduler's
// state: in the math warpgroups it stayed live across the mainloop and spilled (notes/fused.md).
#pragma once

#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "fused_scheduler.cuh"
#include "gemm/pipeline.cuh"

namespace megamoe::assembler {

// A task as it travels through the queue: {phase << 31 | expert, n block, pool block, valid rows}; the word
// kEndOfTasks in place of the first marks the end of the CTA's list.
constexpr uint32_t kEndOfTasks = 0xffffffffu;

MEGAMOE_DEVICE uint4 pack_task(const FusedTask& task) {
    return make_uint4((static_cast<uint32_t>(task.phase) << 31) | task.expert_idx, task.n_block_idx,
                      task.pool_block_idx, task.num_valid_rows);
}

// The fields the consumers use (m_block_idx stays with the TMA-A warp, which dumps it in debug runs).
struct QueuedTask {
    uint4 words;

    MEGAMOE_DEVICE bool valid() const { return words.x != kEndOfTasks; }
    MEGAMOE_DEVICE FusedPhase phase() const { return static_cast<FusedPhase>(words.x >> 31); }
    MEGAMOE_DEVICE uint32_t expert_idx() const { return words.x & 0x7fffffffu; }
    MEGAMOE_DEVICE uint32_t n_block_idx() const { return words.y; }
    MEGAMOE_DEVICE uint32_t pool_block_idx() const { return words.z; }
    MEGAMOE_DEVICE uint32_t num_valid_rows() const { return words.w; }
};

// kNumSlots tasks in flight, each slot guarded by a full barrier (1 arrival: the pushing lane) and an empty
// barrier (one arrival per popping thread: the TMA-B warp's issuing lane and every math thread).
// NOTES: the push's st.shared precedes its mbarrier.arrive (release, CTA scope); the pop's try_wait acquires, so
// the slot's words are visible to every thread that waited. The pusher reuses a slot only after every popping
// thread arrived on its empty barrier after its own last load of the words (program order, then the arrive's
// release). One arrival per warp after __syncwarp is also ordered, but racecheck did not follow that order and
// reported the slot's next push as a hazard against the math warps' loads; per-thread arrivals gave 0 hazards
// and measured fewer spills in the fused variants.
// Deadlock freedom: the TMA-A warp pushes a task before any wait on its inputs, and a consumer pops task i + 1
// only after it has consumed task i's pipeline stages, which the TMA-A warp issued before pushing task i + 1; with
// kNumSlots >= 2 the push of task i + 2 waits only for pops of task i, which need nothing later.
template <uint32_t kNumSlots>
struct TaskQueue {
    static_assert(kNumSlots >= 2, "a push must not wait for the pop of the task before it");
    static constexpr uint32_t kBytes = kNumSlots * 16 + 2 * kNumSlots * 8;

    uint8_t* base;  // kNumSlots x 16 B tasks, then kNumSlots full and kNumSlots empty barriers

    MEGAMOE_DEVICE uint4* slots() const { return reinterpret_cast<uint4*>(base); }
    MEGAMOE_DEVICE uint64_t* full_barriers() const { return reinterpret_cast<uint64_t*>(base + kNumSlots * 16); }
    MEGAMOE_DEVICE uint64_t* empty_barriers() const { return full_barriers() + kNumSlots; }

    // One thread; fence_mbarrier_init + a CTA barrier must follow before use.
    MEGAMOE_DEVICE void init(uint32_t num_popping_threads) const {
        #pragma unroll
        for (uint32_t i = 0; i < kNumSlots; ++ i) {
            ptx::mbarrier_init(full_barriers() + i, 1);
            ptx::mbarrier_init(empty_barriers() + i, num_popping_threads);
        }
    }

    // The pushing lane: wait for the slot to be free (the flipped parity passes on the first round), write, arrive.
    MEGAMOE_DEVICE void push(const DeviceEnv& env, gemm::PipelineState<kNumSlots>& state, uint4 words) const {
        ptx::mbarrier_wait<false>(env, "task_empty", empty_barriers() + state.stage, state.phase ^ 1);
        volatile uint4* slot = slots() + state.stage;
        slot->x = words.x;
        slot->y = words.y;
        slot->z = words.z;
        slot->w = words.w;
        ptx::mbarrier_arrive_if_at(smem_addr(full_barriers() + state.stage), true);
        state.advance();
    }

    // The next task, by one lane for its warp (the TMA-B warp's issuing lane): wait, copy, free the slot.
    MEGAMOE_DEVICE QueuedTask pop(const DeviceEnv& env, gemm::PipelineState<kNumSlots>& state) const {
        wait_full(env, state.stage, state.phase);
        const QueuedTask task = peek(state.stage);
        release(state.stage);
        state.advance();
        return task;
    }

    // The math warps keep their current and next task in the slots rather than in registers (held across the
    // mainloop they spilled): wait for a slot, read its words on each use, release it once the task is done.
    // (The report inline: a math warpgroup's wait, ReportSite.)
    MEGAMOE_DEVICE void wait_full(const DeviceEnv& env, uint32_t stage, uint32_t phase) const {
        ptx::mbarrier_wait<false, ReportSite::kInline>(env, "task_full", full_barriers() + stage, phase);
    }
    // NOTES: one 16 B load from an address computed from `stage`: four volatile word loads made the compiler keep
    // four loop-carried slot pointers (strength-reduced) across the math warps' mainloop, where they spilled.
    MEGAMOE_DEVICE QueuedTask peek(uint32_t stage) const {
        return QueuedTask{ld_volatile_shared_v4(smem_addr(slots()) + stage * 16)};
    }
    // One arrival per popping thread, after its last read of the slot.
    MEGAMOE_DEVICE void release(uint32_t stage) const {
        ptx::mbarrier_arrive_if_at(smem_addr(empty_barriers() + stage), true);
    }
};

// The top-k weights of each queued L1 task's rows, bulk-copied by the TMA-A warp into its slot's area once the
// task's pool block has arrived, so that the L1 epilogue reads them from shared memory: loaded from global memory
// there, their latency was exposed in every L1 tile (same-call A/B on an H100, cold: T 4096 7-14 us faster, T 1024
// 2-5 us, T 128 unchanged; notes/fused.md). One barrier per slot with one arrival per queued task (an L1 task's
// with the copy's bytes), so that its phase follows the slot's.
// NOTES: the TMA-A warp's ld.acquire of the pool block's arrival count and its fence.proxy.async.global come
// before the copy (the pull fenced the weights' generic stores for the async proxy before its release); the math
// threads read the area only after the slot's barrier phase completed and release the slot after their reads, and
// the TMA-A warp copies into a slot only after pushing a task into it, which waits for that release.
template <uint32_t kNumSlots, uint32_t BLOCK_M>
struct TileWeights {
    static constexpr uint32_t kSlotBytes = BLOCK_M * 4;
    static constexpr uint32_t kBytes = kNumSlots * kSlotBytes + kNumSlots * 8;
    static_assert(kSlotBytes % 16 == 0, "bulk copies move multiples of 16 B");

    uint8_t* base;  // kNumSlots x BLOCK_M floats, then kNumSlots barriers (16 B aligned)

    MEGAMOE_DEVICE float* weights(uint32_t slot) const { return reinterpret_cast<float*>(base + slot * kSlotBytes); }
    MEGAMOE_DEVICE uint64_t* barriers() const { return reinterpret_cast<uint64_t*>(base + kNumSlots * kSlotBytes); }

    // One thread; fence_mbarrier_init + a CTA barrier must follow before use.
    MEGAMOE_DEVICE void init() const {
        #pragma unroll
        for (uint32_t i = 0; i < kNumSlots; ++ i)
            ptx::mbarrier_init(barriers() + i, 1);
    }
    // The TMA-A warp's lane, for the L1 task it pushed into `slot`, once its pool block has arrived: the weights of
    // rows [pool_row, pool_row + BLOCK_M) (16 B aligned: pool_row is a multiple of BLOCK_M).
    MEGAMOE_DEVICE void load(uint32_t slot, const float* src) const {
        ptx::mbarrier_arrive_expect_tx(barriers() + slot, kSlotBytes);
        ptx::bulk_load_1d(weights(slot), src, kSlotBytes, barriers() + slot);
    }
    // The TMA-A warp's lane, for any other task it pushed into `slot` (phase: the slot's). It completes the phase
    // and waits for it itself, which returns at once.
    // NOTES: the wait is for compute-sanitizer's synccheck, which reports an arrival on a barrier whose previous
    // phase completed unwaited ("Missing wait") and stops the kernel there: without it, the next task in the slot
    // arrived on a phase that no math thread waits for (they wait for the weights of L1 tasks only).
    MEGAMOE_DEVICE void skip(const DeviceEnv& env, uint32_t slot, uint32_t phase) const {
        ptx::mbarrier_arrive_if_at(smem_addr(barriers() + slot), true);
        ptx::mbarrier_wait<false>(env, "weights_skip", barriers() + slot, phase);
    }
    // Math threads, for the L1 task in `slot` (phase: the slot's).
    MEGAMOE_DEVICE void wait(const DeviceEnv& env, uint32_t slot, uint32_t phase) const {
        ptx::mbarrier_wait<false, ReportSite::kInline>(env, "tile_weights", barriers() + slot, phase);
    }
};

}  // namespace megamoe::assembler
