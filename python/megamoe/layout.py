"""The symmetric buffer layout: one byte map, identical on every rank, fixed at buffer creation.

Every rank allocates one buffer of `SymmLayout.total_bytes` and carves it into the regions below. Peers address
each other's regions with the same offsets (DESIGN section 6), so the layout must be computed only from values all
ranks share (the six numbers given to `get_symm_buffer`) and never from a per-call choice such as BLOCK_M or the
local token count (DESIGN section 5). It is sized for the worst case of any routing and any candidate BLOCK_M.

`SymmLayout.to_cpp()` renders the same map as a C++ header; it is the single source of truth the device code
includes, so the Python views and the kernel's pointer arithmetic cannot drift apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    import torch

MAX_RANKS = 8  # kMaxRanks: one NVLink domain of up to 8 GPUs
MAX_BLOCK_M = 128  # kMaxBlockM
MIN_BLOCK_M = 32
BLOCK_M_CANDIDATES = (32, 64, 128)
REGION_ALIGNMENT = 1024  # every region starts 1024 B aligned (TMA, 128 B swizzle, and simply tidy)
SF_BLOCK_K = 128  # x / L1 activations: one float scale per 128 columns
L2_SF_BLOCK_K = 64  # L1 output (= L2 input): one float scale per 64 columns (DESIGN section 4)
POOL_SRC_METADATA_FIELDS = ("src_rank_idx", "src_token_idx", "src_topk_slot_idx", "pad")

# The workspace header: 32 u32 words (128 B). (name, first word, number of words).
WORKSPACE_HEADER_WORDS = 32
WORKSPACE_HEADER_BYTES = WORKSPACE_HEADER_WORDS * 4
WORKSPACE_HEADER_FIELDS: tuple[tuple[str, int, int], ...] = (
    ("grid_sync_counter", 0, 4),  # grid-wide sync counters (u32)
    ("nvl_barrier_counter", 4, 1),  # NVLink barrier arrival counter (u32)
    ("nvl_barrier_signal", 5, 2),  # NVLink barrier phase signals, one per phase (int32)
    ("error_flags", 7, 1),  # bits the device sets for bad input it skipped (dispatch/count.cuh), never cleared
    ("scheduler_counter", 8, WORKSPACE_HEADER_WORDS - 8),  # spare scheduler counters (u32)
)

DTYPE_BYTES: dict[str, int] = {
    "uint32": 4,
    "int32": 4,
    "int64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
}

# Buffers of the send and receive counts: one per call parity (common/count_buffers.cuh)
COUNT_PARITIES = 2

# Region names in buffer order, grouped. The workspace group is one contiguous span, zeroed once at allocation
# (buffer.allocate); between calls there is no host memset: the kernel cleans its own counters (DESIGN 5c).
WORKSPACE_REGIONS = (
    "workspace_header",
    "expert_send_count",
    "expert_recv_count",
    "src_token_topk_idx",
    "l1_arrival_count",
    "l1_done_count",
    "l2_done_count",
    "combine_arrival_count",
    "pool_src_metadata",
)
INPUT_REGIONS = ("x", "x_sf", "topk_idx", "topk_weights")
POOL_REGIONS = ("l1_acts", "l1_acts_sf", "l1_topk_weights", "l2_acts", "l2_acts_sf")
COMBINE_REGIONS = ("combine",)

_UINT32_LIMIT = 2**32


def align(value: int, alignment: int) -> int:
    """Round `value` up to a multiple of `alignment`."""
    return (value + alignment - 1) // alignment * alignment


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    return value


def validate_moe_shape(
    num_ranks: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
) -> None:
    """Raise ValueError/TypeError naming the argument unless the shape is one the kernel supports."""
    for name, value in (
        ("num_ranks", num_ranks),
        ("num_experts", num_experts),
        ("num_max_tokens_per_rank", num_max_tokens_per_rank),
        ("num_topk", num_topk),
        ("hidden", hidden),
        ("intermediate", intermediate),
    ):
        _check_int(name, value)
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks must be in [1, {MAX_RANKS}] (kMaxRanks), got {num_ranks}")
    if hidden % 128 != 0:
        raise ValueError(f"hidden must be a multiple of 128, got {hidden}")
    if intermediate % 128 != 0:
        raise ValueError(f"intermediate must be a multiple of 128, got {intermediate}")
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts must be a multiple of num_ranks, got num_experts={num_experts}, num_ranks={num_ranks}"
        )
    if num_topk > num_experts:
        raise ValueError(f"num_topk must be <= num_experts ({num_experts}), got {num_topk}")


@dataclass(frozen=True)
class Region:
    """One region of the symmetric buffer: `num_bytes` bytes at byte `offset` from the buffer base."""

    name: str
    offset: int
    num_bytes: int
    dtype: str
    shape: tuple[int, ...]
    group: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.num_bytes

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This region of a flat uint8 buffer as a typed tensor of `shape` (no copy)."""
        import torch

        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} of shape {tuple(buffer.shape)}")
        if buffer.numel() < self.end:
            raise ValueError(
                f"buffer must hold at least {self.end} bytes for region {self.name!r}, got {buffer.numel()}"
            )
        return buffer[self.offset : self.end].view(getattr(torch, self.dtype)).view(self.shape)


def _cpp_name(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _human_bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{num_bytes} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class SymmLayout:
    """Byte map of the symmetric buffer. Build with `SymmLayout.create(...)`; every derived size is worst case.

    Derived numbers (E_local = num_experts / num_ranks, R = num_ranks, T_max = num_max_tokens_per_rank):
      num_max_recv_tokens = R * T_max * min(topk, E_local)   (a token's valid experts are distinct, so it sends at
                                                               most min(topk, E_local) rows to any one rank)
      num_pool_tokens     = (ceil(num_max_recv_tokens / 128) + E_local) * 128   (worst routing + per-expert padding
                                                                                 to the largest BLOCK_M)
      num_max_pool_blocks = ceil(num_max_recv_tokens / 32) + E_local   (most pool blocks of any candidate BLOCK_M)
    """

    num_ranks: int
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate: int
    regions: tuple[Region, ...] = field(init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        num_ranks: int,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate: int,
    ) -> SymmLayout:
        return cls(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate)

    def __post_init__(self) -> None:
        validate_moe_shape(
            self.num_ranks,
            self.num_experts,
            self.num_max_tokens_per_rank,
            self.num_topk,
            self.hidden,
            self.intermediate,
        )
        for name, value in self.cpp_constants().items():
            if value >= _UINT32_LIMIT:
                raise ValueError(f"shape too large: {name} = {value} does not fit in 32 bits")
        if self.num_max_tokens_per_rank * self.num_topk >= _UINT32_LIMIT:
            raise ValueError(
                f"num_max_tokens_per_rank * num_topk must fit in 32 bits (src_token_topk_idx), "
                f"got {self.num_max_tokens_per_rank} * {self.num_topk}"
            )
        object.__setattr__(self, "regions", self._build_regions())

    # Derived numbers

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def num_max_recv_tokens(self) -> int:
        return self.num_ranks * self.num_max_tokens_per_rank * min(self.num_topk, self.num_local_experts)

    @property
    def num_pool_tokens(self) -> int:
        return (ceil_div(self.num_max_recv_tokens, MAX_BLOCK_M) + self.num_local_experts) * MAX_BLOCK_M

    @property
    def num_max_pool_blocks(self) -> int:
        return ceil_div(self.num_max_recv_tokens, MIN_BLOCK_M) + self.num_local_experts

    @property
    def total_bytes(self) -> int:
        return self.regions[-1].end

    @property
    def workspace_begin(self) -> int:
        return self.region(WORKSPACE_REGIONS[0]).offset

    @property
    def workspace_end(self) -> int:
        return self.region(WORKSPACE_REGIONS[-1]).end

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the workspace span [workspace_begin, workspace_end) (zeroed once, at allocation)."""
        return self.workspace_end - self.workspace_begin

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise ValueError(f"name must be one of {[r.name for r in self.regions]}, got {name!r}")

    # Construction

    def _region_specs(self) -> list[tuple[str, str, str, tuple[int, ...]]]:
        e, e_local, r = self.num_experts, self.num_local_experts, self.num_ranks
        t, k, h, i = self.num_max_tokens_per_rank, self.num_topk, self.hidden, self.intermediate
        p, b = self.num_pool_tokens, self.num_max_pool_blocks
        return [
            # Workspace, zeroed once at allocation. Each call zeroes the local counters it uses at its start and the
            # other parity's send / receive counts in its head (combine/clean.cuh), so every call starts clean without
            # a host memset and without a barrier at the end of the previous call; grid-sync and NVLink barrier
            # words reset themselves, src_token_topk_idx and pool_src_metadata are rewritten for every row.
            ("workspace", "workspace_header", "uint32", (WORKSPACE_HEADER_WORDS,)),
            # Send and receive counts, double-buffered by call parity (the NVLink barrier ordinal's low bit at the
            # call's start, common/count_buffers.cuh)
            ("workspace", "expert_send_count", "uint32", (COUNT_PARITIES, e)),
            ("workspace", "expert_recv_count", "uint32", (COUNT_PARITIES, e_local, r)),
            ("workspace", "src_token_topk_idx", "uint32", (e_local, r, t)),
            ("workspace", "l1_arrival_count", "uint32", (b,)),
            ("workspace", "l1_done_count", "uint32", (b,)),
            # Finished L2 tiles per pool block (the tile that completes a block signals its rows to the sources)
            ("workspace", "l2_done_count", "uint32", (b,)),
            # Combine rows landed here per token (every rank's scatter adds one per row it writes)
            ("workspace", "combine_arrival_count", "uint32", (t,)),
            ("workspace", "pool_src_metadata", "uint32", (p, len(POOL_SRC_METADATA_FIELDS))),
            # Inputs: written by this rank, pulled by peers.
            ("input", "x", "float8_e4m3fn", (t, h)),
            ("input", "x_sf", "float32", (t, h // SF_BLOCK_K)),
            ("input", "topk_idx", "int64", (t, k)),
            ("input", "topk_weights", "float32", (t, k)),
            # Local pools: received tokens grouped by local expert, each expert padded to BLOCK_M.
            ("pool", "l1_acts", "float8_e4m3fn", (p, h)),
            ("pool", "l1_acts_sf", "float32", (h // SF_BLOCK_K, p)),
            ("pool", "l1_topk_weights", "float32", (p,)),
            ("pool", "l2_acts", "float8_e4m3fn", (p, i)),
            ("pool", "l2_acts_sf", "float32", (i // L2_SF_BLOCK_K, p)),
            # Combine: peers write L2 output rows at (slot, token).
            ("combine", "combine", "bfloat16", (k, t, h)),
        ]

    def _build_regions(self) -> tuple[Region, ...]:
        regions: list[Region] = []
        offset = 0
        for group, name, dtype, shape in self._region_specs():
            offset = align(offset, REGION_ALIGNMENT)
            num_bytes = math.prod(shape) * DTYPE_BYTES[dtype]
            regions.append(Region(name, offset, num_bytes, dtype, shape, group))
            offset += num_bytes
        return tuple(regions)

    # Reports and code generation

    def cpp_constants(self) -> dict[str, int]:
        """The derived integer constants of the generated header (all uint32)."""
        return {
            "kNumRanks": self.num_ranks,
            "kNumExperts": self.num_experts,
            "kNumLocalExperts": self.num_local_experts,
            "kNumMaxTokensPerRank": self.num_max_tokens_per_rank,
            "kNumTopk": self.num_topk,
            "kHidden": self.hidden,
            "kIntermediate": self.intermediate,
            "kNumPoolTokens": self.num_pool_tokens,
            "kNumMaxPoolBlocks": self.num_max_pool_blocks,
            "kNumMaxRecvTokens": self.num_max_recv_tokens,
        }

    def to_cpp(self, namespace: str = "megamoe::layout") -> str:
        """A C++17 header with every offset, size and derived constant (the device code's source of truth)."""
        lines = [
            "// Generated by megamoe.layout.SymmLayout.to_cpp(); do not edit.",
            f"// {self!r}",
            "// Offsets are bytes from the symmetric buffer base. Products such as pool_token * kHidden need 64 bits.",
            "#pragma once",
            "",
            "#include <cstdint>",
            "",
            f"namespace {namespace} {{",
            "",
        ]
        for name, value in self.cpp_constants().items():
            lines.append(f"constexpr uint32_t {name} = {value}u;")
        lines += [
            "",
            f"constexpr uint32_t kMaxRanks = {MAX_RANKS}u;",
            f"constexpr uint32_t kMaxBlockM = {MAX_BLOCK_M}u;",
            f"constexpr uint32_t kMinBlockM = {MIN_BLOCK_M}u;",
            f"constexpr uint32_t kRegionAlignment = {REGION_ALIGNMENT}u;",
            f"constexpr uint32_t kNumPoolSrcMetadataFields = {len(POOL_SRC_METADATA_FIELDS)}u;  "
            f"// {', '.join(POOL_SRC_METADATA_FIELDS)}",
            "",
            "// Workspace header words (u32 index into the workspace_header region).",
            f"constexpr uint32_t kWorkspaceHeaderWords = {WORKSPACE_HEADER_WORDS}u;",
        ]
        for name, first_word, num_words in WORKSPACE_HEADER_FIELDS:
            cpp = _cpp_name(name)
            lines.append(f"constexpr uint32_t k{cpp}Idx = {first_word}u;")
            lines.append(f"constexpr uint32_t kNum{cpp}s = {num_words}u;")
        lines.append("")
        for region in self.regions:
            cpp = _cpp_name(region.name)
            shape = " x ".join(str(d) for d in region.shape)
            lines.append(f"// {region.name}: {region.dtype} [{shape}] ({region.group})")
            lines.append(f"constexpr uint64_t k{cpp}Offset = {region.offset}ull;")
            lines.append(f"constexpr uint64_t k{cpp}Bytes = {region.num_bytes}ull;")
        lines += [
            "",
            f"constexpr uint64_t kWorkspaceBegin = {self.workspace_begin}ull;",
            f"constexpr uint64_t kWorkspaceEnd = {self.workspace_end}ull;",
            f"constexpr uint64_t kWorkspaceBytes = {self.workspace_bytes}ull;",
            f"constexpr uint64_t kTotalBytes = {self.total_bytes}ull;",
            "",
        ]
        previous_end = "0ull"
        for region in self.regions:
            cpp = _cpp_name(region.name)
            lines.append(
                f'static_assert(k{cpp}Offset % kRegionAlignment == 0, "{region.name} must be 1024 B aligned");'
            )
            if previous_end != "0ull":
                lines.append(
                    f'static_assert(k{cpp}Offset >= {previous_end}, "{region.name} overlaps its predecessor");'
                )
            previous_end = f"k{cpp}Offset + k{cpp}Bytes"
        lines += [
            f'static_assert(kTotalBytes == {previous_end}, "total must end at the last region");',
            'static_assert(kNumPoolTokens % kMaxBlockM == 0, "pool tokens are a multiple of the largest BLOCK_M");',
            "",
            f"}}  // namespace {namespace}",
            "",
        ]
        return "\n".join(lines)

    def to_table(self) -> Table:
        table = Table(
            title=(
                f"Symmetric buffer: R={self.num_ranks} E={self.num_experts} (E_local={self.num_local_experts}) "
                f"T_max={self.num_max_tokens_per_rank} topk={self.num_topk} H={self.hidden} I={self.intermediate}"
            ),
            caption=(
                f"pool tokens {self.num_pool_tokens}, max pool blocks {self.num_max_pool_blocks}, "
                f"max recv tokens {self.num_max_recv_tokens}; workspace {_human_bytes(self.workspace_bytes)}, "
                f"total {_human_bytes(self.total_bytes)}"
            ),
        )
        table.add_column("region")
        table.add_column("group")
        table.add_column("dtype")
        table.add_column("shape", justify="right")
        table.add_column("offset (B)", justify="right")
        table.add_column("size (B)", justify="right")
        table.add_column("size", justify="right")
        for region in self.regions:
            table.add_row(
                region.name,
                region.group,
                region.dtype,
                " x ".join(str(d) for d in region.shape),
                str(region.offset),
                str(region.num_bytes),
                _human_bytes(region.num_bytes),
            )
        return table
