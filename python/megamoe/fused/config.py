"""The fused kernel's compile-time config and its shared-memory plan (mirrors assembler/fused_traits.cuh:
FusedTraits; the generated source static_asserts every offset). Chosen only from values every rank shares: the
buffer's layout and an optional `expected_tokens_per_expert` (DESIGN section 5), never the local token count."""
from __future__ import annotations

from dataclasses import dataclass

from megamoe import envs, heuristics
from megamoe.heuristics import MAX_NUM_STAGES, MIN_NUM_STAGES, SMEM_CAPACITY_BYTES
from megamoe.layout import BLOCK_M_CANDIDATES, SymmLayout, align

BLOCK_N = BLOCK_K = 128
NUM_DISPATCH_WARPS = 2  # common/kernel_skeleton.cuh: kNumDispatchWarps
MBARRIER_BYTES = 8
L1_OUTPUT_COLS = 64  # one interleaved 128-column L1 tile yields 64 output columns
# Rows in flight per dispatch warp: 2 leaves the GEMM a stage more than 4 at BLOCK_M 32 and 128 and measured faster
# at every T of bench fused (T 4096: 1393-1446 against 1520-1538 us; notes/fused.md)
DEFAULT_PULL_STAGES = 2
NUM_TASK_SLOTS = 4  # assembler/task_queue.cuh: FusedTraits::kNumTaskSlots
TASK_QUEUE_BYTES = NUM_TASK_SLOTS * 16 + 2 * NUM_TASK_SLOTS * MBARRIER_BYTES
NUM_L2_TASK_SLOTS = NUM_TASK_SLOTS + 4  # FusedTraits::kNumL2TaskSlots: the scatter warp's queue of L2 tasks
L2_TASK_QUEUE_BYTES = NUM_L2_TASK_SLOTS * 16 + 2 * NUM_L2_TASK_SLOTS * MBARRIER_BYTES
# The L1 store thread's pending counters at BLOCK_M 128 (fused_traits.cuh: kL1ReleasesBytes; epilogue/l1_epilogue.cuh:
# L1EpilogueState::kListBytes, a count and 32 pairs)
L1_RELEASES_BYTES = (1 + 32) * 4


def tile_weights_bytes(block_m: int) -> int:
    """assembler/task_queue.cuh TileWeights::kBytes: each task slot's row weights (fp32), then its barrier."""
    return NUM_TASK_SLOTS * (block_m * 4 + MBARRIER_BYTES)


def pull_stage_bytes(hidden: int) -> int:
    """dispatch/pull.cuh kPullStageBytes: the row, then (when H % 512 == 0) its SF row, 128 B aligned."""
    sf = hidden // 128 * 4 if (hidden // 128) % 4 == 0 else 0
    return align(align(hidden, 16) + sf, 128)


def recv_table_words(layout: SymmLayout) -> int:
    """dispatch/recv_table.cuh kRecvTableWords."""
    return layout.num_local_experts * layout.num_ranks + 1 + layout.num_local_experts + 1


@dataclass(frozen=True)
class FusedConfig:
    """One compiled variant of the fused kernel for one buffer layout.

    serial: the debug phase-serial order (the TMA-A warp waits for every pool block before its first tile).
    num_stages 0: as many GEMM stages as fit (at most MAX_NUM_STAGES)."""

    layout: SymmLayout
    block_m: int
    n_major_l2: bool
    clamp: bool = False
    fast_math: bool = True
    serial: bool = False
    pull_stages: int = DEFAULT_PULL_STAGES
    num_stages: int = 0

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CANDIDATES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {self.block_m!r}")
        if not 1 <= self.pull_stages <= 8:
            raise ValueError(f"pull_stages must be in [1, 8], got {self.pull_stages!r}")
        if self.num_stages == 0:
            free = SMEM_CAPACITY_BYTES - self.fixed_bytes - 1024  # at most 1023 B of alignment before staging
            object.__setattr__(self, "num_stages", min(MAX_NUM_STAGES, free // self.stage_bytes))
        if self.num_stages < MIN_NUM_STAGES or self.smem_bytes > SMEM_CAPACITY_BYTES:
            raise ValueError(f"{self.name}: {self.num_stages} GEMM stages need {self.smem_bytes} B of shared memory "
                             f"(limit {SMEM_CAPACITY_BYTES}, at least {MIN_NUM_STAGES} stages)")

    # Shared-memory plan (FusedTraits):
    # [ring][staging][L1 releases][pull][pull barriers][expert count][receive table][misc][task queue]
    # [L2 task queue][tile weights]
    @property
    def stage_bytes(self) -> int:
        """One GEMM stage: A (64 rows at least), B, SFA sized for L2's two per-64 SFs, its two barriers."""
        return (max(self.block_m, 64) * BLOCK_K + BLOCK_N * BLOCK_K + align(2 * self.block_m * 4, 128)
                + 2 * MBARRIER_BYTES)

    @property
    def staging_bytes(self) -> int:
        """L1 double buffer (FP8 tile + SFs) or L2 BF16 rows, whichever is larger."""
        l1 = 2 * align(self.block_m * L1_OUTPUT_COLS + self.block_m * 4, 128)
        return max(l1, self.block_m * BLOCK_N * 2)

    @property
    def fixed_bytes(self) -> int:
        """Everything after the staging area, from its start (alignment padding excluded)."""
        return self.smem_bytes - self.staging_offset

    @property
    def ring_bytes(self) -> int:
        return self.num_stages * self.stage_bytes if self.num_stages else 0

    @property
    def staging_offset(self) -> int:
        return align(self.ring_bytes, 1024)

    @property
    def l1_releases_offset(self) -> int:
        """The L1 store thread's pending counters, right after the staging area."""
        return self.staging_offset + self.staging_bytes

    @property
    def l1_releases_bytes(self) -> int:
        """FusedTraits::kL1ReleasesBytes: the list exists only where the L1 counters are released per run
        (kBatchL1Releases, BLOCK_M 128)."""
        return L1_RELEASES_BYTES if self.block_m == 128 else 0

    @property
    def pull_offset(self) -> int:
        return align(self.l1_releases_offset + self.l1_releases_bytes, 128)

    @property
    def pull_barriers_offset(self) -> int:
        return self.pull_offset + NUM_DISPATCH_WARPS * self.pull_stages * pull_stage_bytes(self.layout.hidden)

    @property
    def expert_count_offset(self) -> int:
        return self.pull_barriers_offset + NUM_DISPATCH_WARPS * self.pull_stages * MBARRIER_BYTES

    @property
    def recv_table_offset(self) -> int:
        return align(self.expert_count_offset + self.layout.num_experts * 4, 16)

    @property
    def misc_offset(self) -> int:
        """16 B: the NVLink barrier ordinal (kept for the kernel's tail), the CTA index, the grid size."""
        return align(self.recv_table_offset + recv_table_words(self.layout) * 4, 16)

    @property
    def task_queue_offset(self) -> int:
        return self.misc_offset + 16

    @property
    def l2_task_queue_offset(self) -> int:
        return self.task_queue_offset + TASK_QUEUE_BYTES

    @property
    def tile_weights_offset(self) -> int:
        return align(self.l2_task_queue_offset + L2_TASK_QUEUE_BYTES, 16)

    @property
    def smem_bytes(self) -> int:
        return self.tile_weights_offset + tile_weights_bytes(self.block_m)

    @property
    def name(self) -> str:
        lay = self.layout
        flags = (f"{'_clamp' if self.clamp else ''}{'_fast' if self.fast_math else ''}"
                 f"{'_serial' if self.serial else ''}")
        return (f"megamoe_fused_r{lay.num_ranks}_e{lay.num_experts}_t{lay.num_max_tokens_per_rank}_k{lay.num_topk}"
                f"_h{lay.hidden}_i{lay.intermediate}_bm{self.block_m}"
                f"_{'n' if self.n_major_l2 else 'm'}_p{self.pull_stages}_s{self.num_stages}{flags}")


def config_for(layout: SymmLayout, *, expected_tokens_per_expert: float | None = None, clamp: bool = False,
               fast_math: bool = True, serial: bool = False, pull_stages: int = DEFAULT_PULL_STAGES) -> FusedConfig:
    """The variant every rank of `layout` picks: BLOCK_M and L2 order from the values all ranks share
    (heuristics), or from `expected_tokens_per_expert` when given (the same on every rank). The waves of experts
    are cut on the device from the received counts (`min_wave_l1_tiles` at launch)."""
    lay = layout
    expected = (heuristics.default_expected_tokens_per_expert(lay.num_ranks, lay.num_experts,
                                                               lay.num_max_tokens_per_rank, lay.num_topk)
                if expected_tokens_per_expert is None else float(expected_tokens_per_expert))
    block_m = heuristics.block_m_for(expected)
    override = envs.n_major_override()
    n_major = expected >= heuristics.N_MAJOR_THRESHOLD if override == -1 else bool(override)
    return FusedConfig(lay, block_m, n_major, clamp=clamp, fast_math=fast_math, serial=serial,
                       pull_stages=pull_stages)
