"""Symmetric buffer layout: alignment, order, exact sizes, generated C++ header, worst-case pool capacity."""
from __future__ import annotations

import itertools
import math
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe.layout import (
    BLOCK_M_CANDIDATES,
    DTYPE_BYTES,
    REGION_ALIGNMENT,
    WORKSPACE_HEADER_FIELDS,
    WORKSPACE_HEADER_WORDS,
    WORKSPACE_REGIONS,
    SymmLayout,
    align,
    ceil_div,
)

# Seed section 20.2: (name, experts, hidden, intermediate, topk, token counts); ranks 1, 2, 4, 8.
TEST_MATRIX = (
    ("smoke", 8, 4096, 2048, 6, (1, 2, 3, 4)),
    ("decode", 48, 7168, 2048, 6, (16, 64, 128)),
    ("prefill", 48, 7168, 3072, 6, (256, 1024, 8192)),
    ("dsv4_flash", 256, 4096, 2048, 6, (16, 256, 8192)),
    ("dsv4_pro", 384, 7168, 3072, 6, (16, 256, 8192)),
    ("mimo", 256, 4096, 2048, 8, (16, 256, 8192)),
)
RANKS = (1, 2, 4, 8)
MATRIX_CASES = [
    (name, ranks, experts, tokens, topk, hidden, inter)
    for name, experts, hidden, inter, topk, token_counts in TEST_MATRIX
    for ranks in RANKS
    for tokens in token_counts
]
MATRIX_IDS = [f"{c[0]}-r{c[1]}-t{c[3]}" for c in MATRIX_CASES]


def _layout(case: tuple) -> SymmLayout:
    _, ranks, experts, tokens, topk, hidden, inter = case
    return SymmLayout.create(ranks, experts, tokens, topk, hidden, inter)


def _expected_shapes(layout: SymmLayout) -> dict[str, tuple[str, tuple[int, ...]]]:
    e, el, r, t = layout.num_experts, layout.num_local_experts, layout.num_ranks, layout.num_max_tokens_per_rank
    k, h, i = layout.num_topk, layout.hidden, layout.intermediate
    p, b = layout.num_pool_tokens, layout.num_max_pool_blocks
    return {
        "workspace_header": ("uint32", (32,)),
        "expert_send_count": ("uint32", (2, e)),
        "expert_recv_count": ("uint32", (2, el, r)),
        "src_token_topk_idx": ("uint32", (el, r, t)),
        "l1_arrival_count": ("uint32", (b,)),
        "l1_done_count": ("uint32", (b,)),
        "l2_done_count": ("uint32", (b,)),
        "combine_arrival_count": ("uint32", (t,)),
        "pool_src_metadata": ("uint32", (p, 4)),
        "x": ("float8_e4m3fn", (t, h)),
        "x_sf": ("float32", (t, h // 128)),
        "topk_idx": ("int64", (t, k)),
        "topk_weights": ("float32", (t, k)),
        "l1_acts": ("float8_e4m3fn", (p, h)),
        "l1_acts_sf": ("float32", (h // 128, p)),
        "l1_topk_weights": ("float32", (p,)),
        "l2_acts": ("float8_e4m3fn", (p, i)),
        "l2_acts_sf": ("float32", (i // 64, p)),
        "combine": ("bfloat16", (k, t, h)),
    }


@pytest.mark.parametrize("case", MATRIX_CASES, ids=MATRIX_IDS)
def test_regions_aligned_ordered_exact(case: tuple) -> None:
    layout = _layout(case)
    _, ranks, experts, tokens, topk, hidden, inter = case
    e_local = experts // ranks
    recv = ranks * tokens * min(topk, e_local)
    assert layout.num_local_experts == e_local
    assert layout.num_max_recv_tokens == recv
    assert layout.num_pool_tokens == (ceil_div(recv, 128) + e_local) * 128
    assert layout.num_max_pool_blocks == ceil_div(recv, 32) + e_local
    assert layout.num_pool_tokens % 128 == 0

    expected = _expected_shapes(layout)
    assert [r.name for r in layout.regions] == list(expected)
    previous_end = 0
    for region in layout.regions:
        dtype, shape = expected[region.name]
        assert (region.dtype, region.shape) == (dtype, shape), region.name
        assert region.num_bytes == math.prod(shape) * DTYPE_BYTES[dtype], region.name
        assert region.offset % REGION_ALIGNMENT == 0, region.name
        assert region.offset >= previous_end, f"{region.name} overlaps its predecessor"
        # No gap beyond the alignment padding.
        assert region.offset == align(previous_end, REGION_ALIGNMENT), region.name
        assert layout.region(region.name) is region
        previous_end = region.end
    assert layout.total_bytes == layout.regions[-1].end
    assert layout.workspace_begin == 0
    assert layout.workspace_end == layout.region(WORKSPACE_REGIONS[-1]).end
    assert layout.workspace_bytes == layout.workspace_end
    assert all(r.group == "workspace" for r in layout.regions if r.offset < layout.workspace_end)
    assert all(r.group != "workspace" for r in layout.regions if r.offset >= layout.workspace_end)


def test_large_shape_needs_64_bit_and_header_fields() -> None:
    layout = SymmLayout.create(8, 384, 8192, 6, 7168, 3072)
    assert layout.total_bytes > 2**32  # GB-scale: offsets must be 64-bit
    assert layout.region("combine").offset > 2**32
    words = [w for _, first, count in WORKSPACE_HEADER_FIELDS for w in range(first, first + count)]
    assert words == list(range(WORKSPACE_HEADER_WORDS))
    assert layout.region("workspace_header").num_bytes == 128


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(hidden=4000), "hidden"),
        (dict(intermediate=2000), "intermediate"),
        (dict(num_experts=7), "num_experts"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(num_ranks=16, num_experts=16), "num_ranks"),
        (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank"),
        (dict(num_topk=9), "num_topk"),
        (dict(num_topk=0), "num_topk"),
    ],
)
def test_validation_names_argument(kwargs: dict, argument: str) -> None:
    args = dict(num_ranks=2, num_experts=8, num_max_tokens_per_rank=4, num_topk=6, hidden=4096, intermediate=2048)
    args.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        SymmLayout.create(**args)


def test_validation_types() -> None:
    with pytest.raises(TypeError, match="hidden"):
        SymmLayout.create(2, 8, 4, 6, 4096.0, 2048)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        SymmLayout.create(2, 8, 4, 6, 4096, 2048).region("nope")


def test_region_view() -> None:
    torch = pytest.importorskip("torch")
    layout = SymmLayout.create(2, 8, 4, 6, 256, 128)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    x_sf = layout.region("x_sf").view(buffer)
    assert x_sf.dtype == torch.float32 and tuple(x_sf.shape) == (4, 2)
    x_sf.fill_(1.0)
    assert int(buffer[layout.region("x_sf").offset : layout.region("x_sf").end].count_nonzero()) > 0
    assert layout.region("combine").view(buffer).dtype == torch.bfloat16


def test_to_cpp_and_table() -> None:
    layout = SymmLayout.create(8, 384, 8192, 6, 7168, 3072)
    header = layout.to_cpp()
    assert header.count("#pragma once") == 1 and "#include <cstdint>" in header
    assert "namespace megamoe::layout {" in header
    for region in layout.regions:
        cpp = "".join(p[:1].upper() + p[1:] for p in region.name.split("_"))
        assert f"constexpr uint64_t k{cpp}Offset = {region.offset}ull;" in header
        assert f"constexpr uint64_t k{cpp}Bytes = {region.num_bytes}ull;" in header
        assert f"static_assert(k{cpp}Offset % kRegionAlignment == 0" in header
    for name, value in layout.cpp_constants().items():
        assert f"constexpr uint32_t {name} = {value}u;" in header
    for name in ("kNumRanks", "kNumExperts", "kNumLocalExperts", "kNumMaxTokensPerRank", "kNumTopk", "kHidden",
                 "kIntermediate", "kNumPoolTokens", "kNumMaxPoolBlocks", "kNumMaxRecvTokens"):
        assert f"constexpr uint32_t {name} =" in header
    assert "namespace foo::bar {" in layout.to_cpp(namespace="foo::bar")
    table = layout.to_table()
    assert table.row_count == len(layout.regions)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_cpp_header_compiles(tmp_path: Path) -> None:
    layouts = [SymmLayout.create(8, 384, 8192, 6, 7168, 3072), SymmLayout.create(1, 8, 1, 6, 4096, 2048)]
    includes = []
    for idx, layout in enumerate(layouts):
        path = tmp_path / f"layout_{idx}.cuh"
        path.write_text(layout.to_cpp(namespace=f"megamoe::layout{idx}"))
        includes.append(f'#include "{path.name}"')
    source = tmp_path / "check.cpp"
    source.write_text(
        "\n".join(includes)
        + "\nstatic_assert(megamoe::layout0::kTotalBytes > (1ull << 32), \"64-bit sizes\");\nint main() { return 0; }\n"
    )
    result = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", str(source)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def _pool_fits(layout: SymmLayout, counts: list[int]) -> None:
    total = layout.num_ranks * layout.num_max_tokens_per_rank
    assert len(counts) == layout.num_local_experts
    assert all(0 <= c <= total for c in counts)  # each token sends at most one row per expert
    assert sum(counts) <= layout.num_max_recv_tokens
    for block_m in BLOCK_M_CANDIDATES:
        assert sum(align(c, block_m) for c in counts) <= layout.num_pool_tokens, (block_m, counts)
        assert sum(ceil_div(c, block_m) for c in counts) <= layout.num_max_pool_blocks, (block_m, counts)


def _adversarial_counts(layout: SymmLayout) -> dict[str, list[int]]:
    e_local = layout.num_local_experts
    total = layout.num_ranks * layout.num_max_tokens_per_rank  # tokens in the whole group
    k = min(layout.num_topk, e_local)
    recv = total * k
    uniform = [recv // e_local + (1 if idx < recv % e_local else 0) for idx in range(e_local)]
    # As much padding as possible: every expert one token past a multiple of 128, rest to the first experts.
    padding = [0] * e_local
    budget = recv
    for idx in range(e_local):
        take = min(1, budget)
        padding[idx] += take
        budget -= take
    for idx in range(e_local):
        room = total - padding[idx]
        take = min(room, budget) // 128 * 128
        padding[idx] += take
        budget -= take
    return {
        "one_expert": [total] + [0] * (e_local - 1),
        "all_local_experts": [total] * k + [0] * (e_local - k),
        "uniform": uniform,
        "max_padding": padding,
        "single_token_each": [1] * e_local if recv >= e_local else [1] * recv + [0] * (e_local - recv),
    }


@pytest.mark.parametrize("case", MATRIX_CASES, ids=MATRIX_IDS)
def test_worst_case_pool_fits(case: tuple) -> None:
    layout = _layout(case)
    for name, counts in _adversarial_counts(layout).items():
        _pool_fits(layout, counts)


def test_pool_fits_exhaustive_small() -> None:
    # Every count vector the constraints allow (a superset of what routings produce).
    for ranks, tokens, topk, e_local in itertools.product((1, 2), (1, 2, 3), (1, 2, 3), (1, 2, 3)):
        if topk > e_local * ranks:
            continue
        layout = SymmLayout.create(ranks, e_local * ranks, tokens, topk, 128, 128)
        total = ranks * tokens
        for counts in itertools.product(range(total + 1), repeat=e_local):
            if sum(counts) <= layout.num_max_recv_tokens:
                _pool_fits(layout, list(counts))


def test_pool_fits_real_routings() -> None:
    torch = pytest.importorskip("torch")
    rng = random.Random(0)
    for _ in range(20):
        ranks = rng.choice((1, 2, 4, 8))
        e_local = rng.choice((1, 2, 3, 6))
        experts = ranks * e_local
        topk = rng.randint(1, min(8, experts))
        tokens = rng.randint(1, 300)
        layout = SymmLayout.create(ranks, experts, tokens, topk, 128, 128)
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        for rank_idx in range(ranks):
            # Every source rank routes all tokens: distinct experts per token, some slots dropped (-1).
            scores = torch.rand(ranks * tokens, experts, generator=gen)
            if rng.random() < 0.5:  # bias everything towards this rank's experts
                scores[:, rank_idx * e_local : (rank_idx + 1) * e_local] += 1.0
            topk_idx = scores.topk(topk, dim=1).indices
            topk_idx[torch.rand(topk_idx.shape, generator=gen) < 0.1] = -1
            local = topk_idx[(topk_idx >= rank_idx * e_local) & (topk_idx < (rank_idx + 1) * e_local)]
            counts = torch.bincount(local - rank_idx * e_local, minlength=e_local).tolist()
            _pool_fits(layout, counts)
