"""Kernel config selection: BLOCK_M band, pipeline stages from the shared-memory plan, wave size, L2 order.

The config is chosen only from values every rank shares (the symmetric buffer's shape, or an explicit
`expected_tokens_per_expert`), never from the local token count: a rank with T = 0 still receives its peers'
tokens and must run the same kernel variant (DESIGN section 5).

Shared-memory plan (offsets from the 1024 B aligned dynamic shared-memory base, in this order):

  a_stages       num_stages x max(block_m, 64) x 128 B     WGMMA reads 64 rows: BLOCK_M = 32 keeps 64-row A stages
  b_stages       num_stages x 128 x 128 B                  weights
  cd             max(L1: 2 x block_m x 64 B, L2: block_m x 128 x 2 B), 1024 aligned
                 (L1 FP8 output double-buffered, L2 BF16 staging: a union, never live at the same time)
  dispatch_pull  align(2 dispatch warps x hidden B, 1024)  one token row per dispatch warp
  sfa_stages     num_stages x align(2 x block_m x 4 B, 128) L2 needs two per-64 SF per 128-K block
  combine        combine warps x 2 stages x chunk B        chunk = gcd(2 x hidden, 1024) B (<= 512 BF16)
  expert_count   align(num_experts x 4 B, 128)             dispatch's per-expert counting
  misc           1024 B                                    top-k weights and other scratch
  barriers       1024 B + num_stages x 2 x 8 B             fixed mbarriers (dispatch, combine) + full/empty ring

A and B stages come first, so each stays 1024 B aligned (128 B swizzle); every later size keeps the next start
aligned as it needs (1024 for TMA-swizzled tiles, 128 for SF stages, 16 for 1D bulk copies, 8 for mbarriers).
num_stages = min(8, floor((232448 - fixed) / per_stage)), at least 3.

Combine chunk choice: each combine warp reduces one token at a time, chunk by chunk, with a 2-stage ring of 1D
bulk loads (one per valid top-k slot) and accumulates in fp32 registers: 1 KB = 512 BF16 = 16 floats per lane. The
result is stored straight from registers to y (no store buffer). The buffers are kept separate from the pipeline
(no aliasing). 1 KB chunks cost 16 KB at 8 combine warps; 2 KB chunks would cost a GEMM stage at BLOCK_M = 128.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from megamoe import envs
from megamoe.layout import BLOCK_M_CANDIDATES, align, validate_moe_shape

SMEM_CAPACITY_BYTES = 232448  # SM90 maximum dynamic shared memory per block (227 KB); kSmemLimit on device
NUM_THREADS = 384  # threads of every fused-layout kernel: kNumThreads of components/common/warp_roles.cuh
MAX_NUM_STAGES = 8
MIN_NUM_STAGES = 3
BLOCK_N = 128
BLOCK_K = 128
WGMMA_M = 64  # WGMMA always reads 64 rows of A
NUM_DISPATCH_WARPS = 2
NUM_WARPS_PER_WARPGROUP = 4
NUM_COMBINE_STAGES = 2
MAX_COMBINE_CHUNK_BYTES = 1024
MISC_SCRATCH_BYTES = 1024
FIXED_BARRIER_BYTES = 1024
MBARRIER_BYTES = 8
L1_OUTPUT_COLUMNS = BLOCK_N // 2  # one 128-column interleaved L1 N-block yields 64 output columns
BAND_BLOCK_M_32 = 16.5  # expected tokens per expert <= 16.5 -> BLOCK_M 32
BAND_BLOCK_M_64 = 64.5  # <= 64.5 -> BLOCK_M 64, else 128
N_MAJOR_THRESHOLD = 256.0  # expected tokens per expert >= 256 -> N-major L2 order
DEFAULT_NUM_SMS = 132  # H200


@dataclass(frozen=True)
class SmemRegion:
    name: str
    offset: int
    num_bytes: int

    @property
    def end(self) -> int:
        return self.offset + self.num_bytes


@dataclass(frozen=True)
class SmemPlan:
    """The kernel's dynamic shared memory: ordered regions; total = fixed_bytes + num_stages * stage_bytes."""

    regions: tuple[SmemRegion, ...]
    num_stages: int
    stage_bytes: int
    fixed_bytes: int
    combine_chunk_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.regions[-1].end

    def region(self, name: str) -> SmemRegion:
        for region in self.regions:
            if region.name == name:
                return region
        raise ValueError(f"name must be one of {[r.name for r in self.regions]}, got {name!r}")


def smem_plan(block_m: int, hidden: int, num_experts: int) -> SmemPlan:
    """Shared-memory plan for one BLOCK_M; raise ValueError if fewer than 3 stages fit in 232448 B."""
    if block_m not in BLOCK_M_CANDIDATES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {block_m}")
    num_math_warpgroups = 2 if block_m == 128 else 1
    num_combine_warps = num_math_warpgroups * NUM_WARPS_PER_WARPGROUP
    combine_chunk_bytes = math.gcd(2 * hidden, MAX_COMBINE_CHUNK_BYTES)

    a_stage = max(block_m, WGMMA_M) * BLOCK_K
    b_stage = BLOCK_N * BLOCK_K
    sfa_stage = align(2 * block_m * 4, 128)
    barrier_stage = 2 * MBARRIER_BYTES
    stage_bytes = a_stage + b_stage + sfa_stage + barrier_stage

    cd = align(max(2 * block_m * L1_OUTPUT_COLUMNS, block_m * BLOCK_N * 2), 1024)
    dispatch_pull = align(NUM_DISPATCH_WARPS * hidden, 1024)
    combine = num_combine_warps * NUM_COMBINE_STAGES * combine_chunk_bytes
    expert_count = align(num_experts * 4, 128)
    fixed_bytes = cd + dispatch_pull + combine + expert_count + MISC_SCRATCH_BYTES + FIXED_BARRIER_BYTES

    num_stages = min(MAX_NUM_STAGES, (SMEM_CAPACITY_BYTES - fixed_bytes) // stage_bytes)
    if num_stages < MIN_NUM_STAGES:
        raise ValueError(
            f"hidden={hidden}, num_experts={num_experts}, block_m={block_m}: only {num_stages} pipeline stages fit "
            f"in {SMEM_CAPACITY_BYTES} B of shared memory (fixed {fixed_bytes} B, {stage_bytes} B per stage); "
            f"need >= {MIN_NUM_STAGES}"
        )

    sizes = (
        ("a_stages", num_stages * a_stage, 1024),
        ("b_stages", num_stages * b_stage, 1024),
        ("cd", cd, 1024),
        ("dispatch_pull", dispatch_pull, 1024),
        ("sfa_stages", num_stages * sfa_stage, 128),
        ("combine", combine, 128),
        ("expert_count", expert_count, 128),
        ("misc", MISC_SCRATCH_BYTES, 128),
        ("barriers", FIXED_BARRIER_BYTES + num_stages * barrier_stage, 8),
    )
    regions: list[SmemRegion] = []
    offset = 0
    for name, num_bytes, alignment in sizes:
        if offset % alignment != 0:
            raise AssertionError(f"smem region {name} at {offset} is not {alignment} B aligned")
        regions.append(SmemRegion(name, offset, num_bytes))
        offset += num_bytes
    plan = SmemPlan(tuple(regions), num_stages, stage_bytes, fixed_bytes, combine_chunk_bytes)
    if plan.total_bytes != fixed_bytes + num_stages * stage_bytes or plan.total_bytes > SMEM_CAPACITY_BYTES:
        raise AssertionError(f"smem plan inconsistent: {plan}")
    return plan


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """One kernel variant. `cooperative` and `num_math_warpgroups` follow from block_m."""

    block_m: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    cooperative: bool = field(init=False)
    num_math_warpgroups: int = field(init=False)
    num_stages: int
    smem_bytes: int
    num_experts_per_wave: int
    n_major_l2: bool
    expected_tokens_per_expert: float
    num_sms: int
    smem_plan: SmemPlan = field(repr=False)

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CANDIDATES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {self.block_m}")
        if self.block_n != BLOCK_N or self.block_k != BLOCK_K:
            raise ValueError(f"block_n and block_k must be {BLOCK_N}, got {self.block_n} and {self.block_k}")
        object.__setattr__(self, "cooperative", self.block_m == 128)
        object.__setattr__(self, "num_math_warpgroups", 2 if self.cooperative else 1)

    def to_cpp(self, namespace: str = "megamoe::config") -> str:
        """The config as C++ constants (template arguments and shared-memory offsets)."""
        lines = [
            "// Generated by megamoe.heuristics.MoeConfig.to_cpp(); do not edit.",
            "#pragma once",
            "",
            "#include <cstdint>",
            "",
            f"namespace {namespace} {{",
            "",
            f"constexpr uint32_t kBlockM = {self.block_m}u;",
            f"constexpr uint32_t kBlockN = {self.block_n}u;",
            f"constexpr uint32_t kBlockK = {self.block_k}u;",
            f"constexpr bool kCooperative = {'true' if self.cooperative else 'false'};",
            f"constexpr uint32_t kNumMathWarpgroups = {self.num_math_warpgroups}u;",
            f"constexpr uint32_t kNumStages = {self.num_stages}u;",
            f"constexpr uint32_t kNumExpertsPerWave = {self.num_experts_per_wave}u;",
            f"constexpr bool kNMajorL2 = {'true' if self.n_major_l2 else 'false'};",
            f"constexpr uint32_t kNumSms = {self.num_sms}u;",
            f"constexpr uint32_t kSmemBytes = {self.smem_bytes}u;",
            f"constexpr uint32_t kCombineChunkBytes = {self.smem_plan.combine_chunk_bytes}u;",
            "",
        ]
        for region in self.smem_plan.regions:
            cpp = "".join(part.capitalize() for part in region.name.split("_"))
            lines.append(f"constexpr uint32_t kSmem{cpp}Offset = {region.offset}u;")
            lines.append(f"constexpr uint32_t kSmem{cpp}Bytes = {region.num_bytes}u;")
        lines += [
            "",
            'static_assert(kSmemBytes <= 232448u, "SM90 dynamic shared memory limit");',
            'static_assert(kSmemAStagesOffset % 1024 == 0 && kSmemBStagesOffset % 1024 == 0, "128B swizzle");',
            "",
            f"}}  // namespace {namespace}",
            "",
        ]
        return "\n".join(lines)


def default_expected_tokens_per_expert(
    num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int
) -> float:
    """Tokens per expert if every rank sends its maximum and routing is uniform (identical on all ranks)."""
    return num_max_tokens_per_rank * num_ranks * num_topk / num_experts


def block_m_for(expected: float) -> int:
    """The BLOCK_M band: <= 16.5 -> 32, <= 64.5 -> 64, else 128."""
    if expected <= BAND_BLOCK_M_32:
        return 32
    if expected <= BAND_BLOCK_M_64:
        return 64
    return 128


def num_experts_per_wave_for(
    num_local_experts: int, expected: float, block_m: int, intermediate: int, num_sms: int
) -> int:
    """Smallest divisor d of E_local with d * ceil(expected / block_m) * (2I / 128) >= num_sms, else E_local."""
    num_l1_blocks_per_expert = math.ceil(expected / block_m) * (2 * intermediate // BLOCK_N)
    for d in range(1, num_local_experts + 1):
        if num_local_experts % d == 0 and d * num_l1_blocks_per_expert >= num_sms:
            return d
    return num_local_experts


_printed_configs: set[tuple[object, ...]] = set()


def select_config(
    num_ranks: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    expected_tokens_per_expert: float | None = None,
) -> MoeConfig:
    """Choose the kernel config from values all ranks share (never the local token count)."""
    validate_moe_shape(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)
    if isinstance(num_sms, bool) or not isinstance(num_sms, int):
        raise TypeError(f"num_sms must be an int, got {type(num_sms).__name__} ({num_sms!r})")
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    if expected_tokens_per_expert is None:
        expected = default_expected_tokens_per_expert(num_ranks, num_experts, num_max_tokens_per_rank, num_topk)
    else:
        if isinstance(expected_tokens_per_expert, bool) or not isinstance(expected_tokens_per_expert, (int, float)):
            raise TypeError(
                f"expected_tokens_per_expert must be a number, got {type(expected_tokens_per_expert).__name__}"
            )
        if not (math.isfinite(expected_tokens_per_expert) and expected_tokens_per_expert >= 0):
            raise ValueError(f"expected_tokens_per_expert must be finite and >= 0, got {expected_tokens_per_expert}")
        expected = float(expected_tokens_per_expert)

    block_m = block_m_for(expected)
    plan = smem_plan(block_m, hidden, num_experts)
    n_major_override = envs.n_major_override()
    n_major_l2 = expected >= N_MAJOR_THRESHOLD if n_major_override == -1 else bool(n_major_override)
    config = MoeConfig(
        block_m=block_m,
        num_stages=plan.num_stages,
        smem_bytes=plan.total_bytes,
        num_experts_per_wave=num_experts_per_wave_for(
            num_experts // num_ranks, expected, block_m, intermediate, num_sms
        ),
        n_major_l2=n_major_l2,
        expected_tokens_per_expert=expected,
        num_sms=num_sms,
        smem_plan=plan,
    )
    if envs.print_configs():
        shape = (num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)
        key = (shape, config)
        if key not in _printed_configs:
            _printed_configs.add(key)
            label = "R={} E={} T_max={} topk={} H={} I={}".format(*shape)
            Console(stderr=True).print(config_detail_table(config, title=f"megamoe config: {label}"))
    return config


def _config_columns(config: MoeConfig) -> list[tuple[str, str]]:
    plan = config.smem_plan
    return [
        ("expected tok/expert", f"{config.expected_tokens_per_expert:.2f}"),
        ("BLOCK_M", str(config.block_m)),
        ("coop", "yes" if config.cooperative else "no"),
        ("math WGs", str(config.num_math_warpgroups)),
        ("stages", str(config.num_stages)),
        ("stage (B)", str(plan.stage_bytes)),
        ("fixed (B)", str(plan.fixed_bytes)),
        ("SMEM (B)", str(config.smem_bytes)),
        ("experts/wave", str(config.num_experts_per_wave)),
        ("L2 order", "N-major" if config.n_major_l2 else "M-major"),
        ("SMs", str(config.num_sms)),
    ]


def config_table(
    configs: Sequence[MoeConfig] | Mapping[str, MoeConfig], *, title: str = "megamoe configs"
) -> Table:
    """One row per config; pass a mapping to label the rows (e.g. by shape)."""
    items = list(configs.items()) if isinstance(configs, Mapping) else [(str(i), c) for i, c in enumerate(configs)]
    table = Table(title=title)
    table.add_column("case")
    for header, _ in _config_columns(items[0][1]) if items else []:
        table.add_column(header, justify="left" if header in ("coop", "L2 order") else "right")
    for label, config in items:
        table.add_row(label, *(value for _, value in _config_columns(config)))
    return table


def config_detail_table(config: MoeConfig, *, title: str = "megamoe config") -> Table:
    """One config as a two-column (field, value) table: fits a narrow log."""
    table = Table(title=title)
    table.add_column("field")
    table.add_column("value", justify="right")
    for header, value in _config_columns(config):
        table.add_row(header, value)
    table.add_row("combine chunk (B)", str(config.smem_plan.combine_chunk_bytes))
    return table


def smem_table(config: MoeConfig) -> Table:
    """The shared-memory plan of one config, region by region."""
    plan = config.smem_plan
    table = Table(
        title=f"SMEM plan: BLOCK_M={config.block_m}, {plan.num_stages} stages",
        caption=(
            f"{plan.total_bytes} B of {SMEM_CAPACITY_BYTES} B = fixed {plan.fixed_bytes} B + "
            f"{plan.num_stages} x {plan.stage_bytes} B per stage"
        ),
    )
    table.add_column("region")
    table.add_column("offset (B)", justify="right")
    table.add_column("size (B)", justify="right")
    for region in plan.regions:
        table.add_row(region.name, str(region.offset), str(region.num_bytes))
    return table
