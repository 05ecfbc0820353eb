// Task sequence of the fused kernel (megamoe/scheduler.py models it: `task_sequence`, walked as `iterate_sm` does).
//
// The local experts are cut into waves of consecutive experts: a wave closes after the first expert that brings
// its L1 tile count to at least `min_wave_l1_tiles` (a launch parameter: megamoe/heuristics.py
// min_wave_l1_tiles_for, by default one wave of every expert); the last wave takes what remains. Decided from the
// received counts, so a wave adapts to this call's load (a fixed number of experts per wave from the buffer's
// T_max left most SMs idle at decode: notes/fused.md). For each wave: every L1 tile of the wave's experts
// (expert-major, then m-block, then n-block: pool blocks in pull order, since the pull walks the receive table in
// expert order), then every L2 tile of the wave's experts (per expert M-major: m then n; or N-major: n then m).
// Every CTA reads the same table, so every CTA cuts the same waves.
// The tasks are claimed, not strided: CTA s starts with global index s, then each next index comes from the call's
// claim counter (assembler/fused_roles.cuh: TaskClaims), so a CTA that runs slower takes fewer tiles. Measured on
// the H200 with static striding (s, s + gridDim.x, ...): every CTA had the same tile count, but single SMs ran their
// L2 tiles up to 30% slower (9 against 12 us at T 4096) and the call waited 90-130 us for the last CTA (notes/fused.md).
// The per-expert row counts come from the receive table in shared memory built in this launch (never __ldg of
// counts written in this launch: DESIGN 5c).
//
// NOTES: deadlock freedom. The fused kernel's waits, and why none can close a cycle:
// - the pull (dispatch warps) waits only for its own bulk loads from the peers' inputs: never on the GEMM;
// - an L1 tile's A producer waits for its pool block's arrival count (the pull only);
// - an L2 tile's A producer waits for the L1 tiles of its pool block, which come earlier in the global sequence
//   (all L1 tiles of a wave precede its L2 tiles); each CTA runs its tasks in increasing global index, every
//   index below a claimed one is claimed too (the first gridDim.x by the CTAs' first tasks, the rest handed out in
//   order by the counter) and every CTA is resident (cooperative launch), so by induction on the global index
//   every tile completes: the lowest unfinished one heads its CTA's list and its inputs have lower indices;
// - a math warpgroup publishes its last L1 tile before waiting for any L2 input and sends every L2 signal
//   before its top-k reduce waits for combine rows; the reduce waits only for L2 tiles (of every rank), which
//   wait for nothing the reduce holds;
// - no CTA-wide barrier between the role split and the end of the tile loop; dispatch warps join the final
//   barrier only after their pulls; every CTA (also one without tiles) reaches every grid sync (no early return);
// - the pool is never recycled within a call, so no pull ever waits for an L2 tile to free a row.
#pragma once

#include "common/utils.cuh"

namespace megamoe::assembler {

enum class FusedPhase : uint32_t { kL1 = 0, kL2 = 1 };

struct FusedTask {
    FusedPhase phase;
    uint32_t expert_idx;
    uint32_t m_block_idx;
    uint32_t n_block_idx;
    uint32_t pool_block_idx;  // pool rows [pool_block_idx * BLOCK_M, + BLOCK_M)
    uint32_t num_valid_rows;  // rows of the block that belong to the expert (<= BLOCK_M)
};

// `Counts` maps a local expert to its received rows (the receive table in shared memory).
template <uint32_t BLOCK_M, uint32_t kNumL1NBlocks, uint32_t kNumL2NBlocks, uint32_t kNumExperts, bool kNMajorL2,
          typename Counts>
struct FusedScheduler {
    Counts counts;
    uint32_t min_wave_l1_tiles;      // a wave closes once its L1 tiles reach this
    uint32_t wave_begin = 0;         // first expert of the current wave
    uint32_t wave_end = 0;           // one past its last expert (0: not yet cut)
    FusedPhase phase = FusedPhase::kL1;
    uint32_t expert_idx = 0;         // current expert of the current phase
    uint32_t expert_begin_idx = 0;   // global index of the current expert's first task in this phase
    uint32_t wave_pool_block = 0;    // pool block of the current wave's first expert
    uint32_t expert_pool_block = 0;  // pool block of the current expert's first m-block

    MEGAMOE_DEVICE FusedScheduler(const Counts& counts_, uint32_t min_wave_l1_tiles_)
        : counts(counts_), min_wave_l1_tiles(min_wave_l1_tiles_) {}

    // One past the last expert of the wave that starts at `begin` (at least one expert)
    MEGAMOE_DEVICE uint32_t cut_wave(uint32_t begin) const {
        uint32_t end = begin, num_tiles = 0;
        while (end < kNumExperts and (end == begin or num_tiles < min_wave_l1_tiles))
            num_tiles += ceil_div(counts(end ++), BLOCK_M) * kNumL1NBlocks;
        return end;
    }

    // The task at global index `task_idx`, which is at least the previous call's (the walk only moves forward);
    // false once past the last task.
    MEGAMOE_DEVICE bool seek(uint32_t task_idx, FusedTask& task) {
        while (wave_begin < kNumExperts) {
            if (wave_end == 0)
                wave_end = cut_wave(wave_begin);
            const bool l1 = phase == FusedPhase::kL1;
            const uint32_t num_n = l1 ? kNumL1NBlocks : kNumL2NBlocks;
            // Walk the phase's experts; each owns num_m * num_n consecutive global indices
            for (; expert_idx < wave_end; ++ expert_idx) {
                const uint32_t num_rows = counts(expert_idx);
                const uint32_t num_m = ceil_div(num_rows, BLOCK_M);
                const uint32_t expert_end_idx = expert_begin_idx + num_m * num_n;
                if (task_idx < expert_end_idx) {
                    const uint32_t local_idx = task_idx - expert_begin_idx;
                    const bool n_major = not l1 and kNMajorL2;
                    task.phase = phase;
                    task.expert_idx = expert_idx;
                    task.m_block_idx = n_major ? local_idx % num_m : local_idx / num_n;
                    task.n_block_idx = n_major ? local_idx / num_m : local_idx % num_n;
                    task.pool_block_idx = expert_pool_block + task.m_block_idx;
                    task.num_valid_rows = min(BLOCK_M, num_rows - task.m_block_idx * BLOCK_M);
                    return true;
                }
                expert_begin_idx = expert_end_idx;
                expert_pool_block += num_m;
            }
            // The phase is done: L1 -> the same wave's L2; L2 -> the next wave's L1
            if (l1) {
                phase = FusedPhase::kL2;
                expert_idx = wave_begin;
                expert_pool_block = wave_pool_block;
            } else {
                phase = FusedPhase::kL1;
                wave_pool_block = expert_pool_block;
                wave_begin = wave_end;
                wave_end = 0;
                expert_idx = wave_begin;
            }
        }
        return false;
    }
};

}  // namespace megamoe::assembler
