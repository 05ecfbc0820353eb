"""Kernel config selection: the BLOCK_M bucket, the wave rule, L2 order.

The config is chosen only from values every rank shares (the symmetric buffer's shape, or an explicit
`expected_tokens_per_expert`), never from the local token count: a rank with T = 0 still receives its peers'
tokens and must run the same kernel variant (DESIGN section 5).

What uses it today: BLOCK_M (SymmBuffer.config(): the dispatch/combine unit kernel's pool padding by default, the
`megamoe bench comm` launches; the expert FFN bench's bucket; `megamoe demo`); the wave rule (`min_wave_l1_tiles`)
and the L2 order are the fused kernel's and the scheduler model's parameters (megamoe.scheduler). Waves are cut on
the device from the received counts (assembler/fused_scheduler.cuh), so only their fill target comes from here.
Each kernel plans its own shared memory with its config (kernels/gemm.py GemmConfig, kernels/expert_ffn.py
ExpertFfnConfig, kernels/dispatch_combine.py DispatchCombineConfig, fused/config.py FusedConfig).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from megamoe import envs
from megamoe.layout import BLOCK_M_CANDIDATES, validate_moe_shape

SMEM_CAPACITY_BYTES = 232448  # SM90 maximum dynamic shared memory per block (227 KB); kSmemLimit on device
NUM_THREADS = 384  # threads of every fused-layout kernel: kNumThreads of components/common/warp_roles.cuh
MAX_NUM_STAGES = 8  # a GEMM ring's stages (GemmConfig, ExpertFfnConfig): as many as fit, at most 8
MIN_NUM_STAGES = 3  # ... and at least 3 (DESIGN section 8)
BLOCK_N = 128
BLOCK_K = 128
# expected tokens per expert <= 24 -> BLOCK_M 32. Measured on the H200 (fused kernel, flash shape, top-k of randn
# routing, cold, BLOCK_M 32 / 64 in the same rounds): 0.98 at 12 and 16 rows per expert, 0.995 at 24 (the largest
# experts then take a second m-block), 1.12-1.17 at 32 and 1.31-1.39 at 40-60 (notes/fused.md)
BUCKET_BLOCK_M_32 = 24.0
BUCKET_BLOCK_M_64 = 64.5  # <= 64.5 -> BLOCK_M 64, else 128
N_MAJOR_THRESHOLD = 256.0  # expected tokens per expert >= 256 -> N-major L2 order
DEFAULT_NUM_SMS = 132  # H200
# A wave of experts closes once its L1 tiles reach WAVE_FILL x the grid (fused_scheduler.cuh: cut_wave); 0: one
# wave of every expert. One rank of the DSV4-Flash shape measured one wave fastest at every T (fills 1, 2, 4 and
# one wave: notes/fused.md); waves may pay off where the pull is slow (several GPUs at prefill), not measured yet.
WAVE_FILL = 0
ONE_WAVE = 2**32 - 1  # min_wave_l1_tiles that no wave reaches


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """The launch choices for one shape: BLOCK_M, the wave rule and the L2 order (the fused kernel's; the unit
    kernels take BLOCK_M from it). `cooperative` and `num_math_warpgroups` follow from block_m."""

    block_m: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    cooperative: bool = field(init=False)
    num_math_warpgroups: int = field(init=False)
    min_wave_l1_tiles: int
    n_major_l2: bool
    expected_tokens_per_expert: float
    num_sms: int

    def __post_init__(self) -> None:
        if self.block_m not in BLOCK_M_CANDIDATES:
            raise ValueError(f"block_m must be one of {BLOCK_M_CANDIDATES}, got {self.block_m}")
        if self.block_n != BLOCK_N or self.block_k != BLOCK_K:
            raise ValueError(f"block_n and block_k must be {BLOCK_N}, got {self.block_n} and {self.block_k}")
        object.__setattr__(self, "cooperative", self.block_m == 128)
        object.__setattr__(self, "num_math_warpgroups", 2 if self.cooperative else 1)


def default_expected_tokens_per_expert(
    num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int
) -> float:
    """Tokens per expert if every rank sends its maximum and routing is uniform (identical on all ranks)."""
    return num_max_tokens_per_rank * num_ranks * num_topk / num_experts


def block_m_for(expected: float) -> int:
    """The BLOCK_M bucket: <= 24 -> 32, <= 64.5 -> 64, else 128."""
    if expected <= BUCKET_BLOCK_M_32:
        return 32
    if expected <= BUCKET_BLOCK_M_64:
        return 64
    return 128


def min_wave_l1_tiles_for(num_sms: int, fill: int = WAVE_FILL) -> int:
    """The L1 tiles at which a wave of experts closes: fill x the grid (every CTA has `fill` L1 tiles per wave);
    fill 0: one wave (ONE_WAVE)."""
    return ONE_WAVE if fill == 0 else fill * num_sms


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
    n_major_override = envs.n_major_override()
    n_major_l2 = expected >= N_MAJOR_THRESHOLD if n_major_override == -1 else bool(n_major_override)
    config = MoeConfig(
        block_m=block_m,
        min_wave_l1_tiles=min_wave_l1_tiles_for(num_sms),
        n_major_l2=n_major_l2,
        expected_tokens_per_expert=expected,
        num_sms=num_sms,
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
    return [
        ("expected tok/expert", f"{config.expected_tokens_per_expert:.2f}"),
        ("BLOCK_M", str(config.block_m)),
        ("coop", "yes" if config.cooperative else "no"),
        ("math WGs", str(config.num_math_warpgroups)),
        ("wave L1 tiles >=", "one wave" if config.min_wave_l1_tiles == ONE_WAVE else str(config.min_wave_l1_tiles)),
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
    return table
