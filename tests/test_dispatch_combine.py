"""Dispatch and combine components (components/dispatch, components/combine) through their unit-test kernel
(megamoe.kernels.dispatch_combine): dispatch -> trivial expert (dequant x weight, BF16) -> combine.

cpu: generated source, shared-memory plan, input generators, and the host expectations against the reference.
compile: every variant the gpu and multigpu tiers launch (and a large one) compiles clean (DESIGN section 3).
gpu (one rank): pool rows, SF, weights, metadata, counts and y exact for every routing, BLOCK_M and token count;
200 back-to-back calls; a barrier that never completes reports a timeout and traps (in a subprocess).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megamoe.jit import checks  # noqa: E402
from megamoe.kernels import dispatch_combine as dc  # noqa: E402
from megamoe.testing import dispatch_combine as dcc  # noqa: E402
from megamoe.layout import SymmLayout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (ranks, experts, T_max, topk, hidden, intermediate)
MAIN = (1, 8, 256, 4, 512, 128)
WIDE = (1, 8, 64, 4, 7168, 128)  # 56 SF per row: more than one per lane; 7 KB rows
NARROW = (1, 8, 64, 2, 128, 128)  # 256 B combine chunks
# Kept in sync with tests/test_dispatch_combine_multigpu.py (compiled here so the GPU run finds them cached)
MULTI = (2, 8, 256, 4, 512, 128)
LEGACY, FUSED = "legacy", "fused_pull"  # knob presets besides the default (dispatch_combine.py)
KNOBS = {None: {}, LEGACY: dc.LEGACY_KNOBS, FUSED: dc.FUSED_PULL_KNOBS}
# The knob sets the multigpu tier launches besides the default: the legacy kernel and the fused kernel's pull
MULTI_PRESETS = ((64, True, LEGACY), (64, True, FUSED))
VARIANT_CASES = [(MAIN, 64, False, None), (WIDE, 64, True, None), (NARROW, 32, True, None),
                 (MAIN, 64, True, LEGACY), (MAIN, 64, True, FUSED), (WIDE, 64, True, LEGACY),
                 (WIDE, 64, True, FUSED), (NARROW, 32, True, FUSED)]
COMPILE_CASES = (
    [(MAIN, bm, True, None) for bm in (32, 64, 128)] + VARIANT_CASES
    + [(MULTI, bm, True, None) for bm in (32, 64, 128)] + [(MULTI, 64, False, None)]
    + [(MULTI, bm, bulk, preset) for bm, bulk, preset in MULTI_PRESETS]
    + [((8, 384, 8192, 8, 7168, 3072), 128, True, None), ((8, 384, 8192, 8, 7168, 3072), 128, True, LEGACY),
       ((4, 48, 64, 6, 256, 128), 32, True, None)]
)


def _config(shape: tuple, block_m: int, bulk: bool, preset: str | None = None) -> dc.DispatchCombineConfig:
    return dc.DispatchCombineConfig(SymmLayout.create(*shape), block_m, bulk, **KNOBS[preset])


# ---------------------------------------------------------------------------------------------------------------
# cpu
# ---------------------------------------------------------------------------------------------------------------


def test_source_and_smem_plan() -> None:
    config = _config(MULTI, 64, True)
    src = dc.source(config)
    assert config.name in src and "constexpr uint32_t kNumRanks = 2u;" in src and "#pragma once" not in src
    assert "kBlockM = 64;" in src and "kBulkPull = true;" in src
    regions = config.smem_regions
    assert all(offset % 128 == 0 for offset, _ in regions.values())
    # default: 2 stages per warp of (512 B row + 16 B SF row, 128 B aligned); no combine ring (ldg reduce)
    assert dc.pull_stage_bytes(512) == 640 and dc.pull_stage_bytes(128) == 128 and dc.pull_stage_bytes(7168) == 7424
    assert regions["pull"][1] == dc.NUM_WARPS * 2 * 640 and regions["combine"][1] == 0
    assert regions["barriers"][1] == dc.NUM_WARPS * 2 * 8 and config.smem_bytes <= 232448
    assert "kLeanSync = true;" in src and "kPipelinedPull = true;" in src and "kBulkReduce = false;" in src
    # the legacy knobs: the first version's plan and name
    legacy = _config(MULTI, 64, True, LEGACY)
    assert legacy.is_legacy and legacy.knob_tag == "" and legacy.name.endswith("_bm64_bulk")
    assert legacy.smem_regions["pull"][1] == dc.NUM_WARPS * 512
    assert legacy.smem_regions["barriers"][1] == dc.NUM_WARPS * (1 + dc.NUM_COMBINE_STAGES) * 8
    legacy_src = dc.source(legacy)
    assert "kLeanSync = false;" in legacy_src and "kBulkReduce = true;" in legacy_src
    assert "kPipelinedPull = false;" in legacy_src and "kCoalescedCombineStore = false;" in legacy_src
    fused = _config(MULTI, 64, True, FUSED)
    assert fused.smem_regions["pull"][1] == 2 * 4 * 640 and "_p2x4_" in fused.name
    assert len({_config(MULTI, 64, True, p).name for p in KNOBS}) == 3
    assert _config(MULTI, 64, False).smem_regions["pull"][1] == 0
    with pytest.raises(ValueError, match="shared memory"):
        dc.DispatchCombineConfig(SymmLayout.create(*WIDE), 64, True, pull_stages=4)
    for bad in ({"pull_stages": 0}, {"pull_warps": 13}, {"combine_store": "x"}, {"reduce": "x"},
                {"reduce_vecs": 5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dc.DispatchCombineConfig(SymmLayout.create(*MULTI), 64, True, **bad)
    assert dc.combine_chunk_bytes(128) == 256 and dc.combine_chunk_bytes(7168) == 1024
    with pytest.raises(ValueError, match="block_m"):
        _config(MULTI, 48, True)
    assert dc.SymBufferStruct.local_ptr.offset == 64
    assert dc.SymBufferStruct.rank_idx.offset == 72 and dc.SymBufferStruct.num_ranks.offset == 76


@pytest.mark.parametrize("routing", dcc.ROUTINGS)
def test_random_inputs(routing: str) -> None:
    layout = SymmLayout.create(*MULTI)
    inputs = dcc.random_inputs(layout, [40, 7], routing, seed=5)
    again = dcc.random_inputs(layout, [40, 7], routing, seed=5)
    for rank, (a, b) in enumerate(zip(inputs, again)):
        assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.x.view(torch.uint8), b.x.view(torch.uint8))
        idx = a.topk_idx
        ordered = idx.sort(dim=1).values
        assert not bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()), "distinct experts"
        assert bool(((idx >= -1) & (idx < layout.num_experts)).all())
        assert bool(torch.isfinite(a.x.float()).all()) and bool((a.x_sf > 0).all())
        if routing == "other_rank":
            valid = idx[idx >= 0]
            assert bool((valid // layout.num_local_experts == (rank + 1) % 2).all())
        if routing == "one_expert":
            assert bool((idx == layout.num_experts - 1).any(dim=1).all())
        if routing == "masked":
            assert bool((idx[:3] == -1).all())


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("routing", dcc.ROUTINGS)
def test_expected_dispatch_is_the_reference(num_ranks: int, routing: str) -> None:
    """The host expectation the gpu tiers use equals reference.moe's intermediates (its dispatched rows)."""
    from megamoe import reference

    layout = SymmLayout.create(num_ranks, 8, 64, 4, 256, 128)
    inputs = dcc.random_inputs(layout, [64, 0][:num_ranks] if num_ranks == 2 else [50], routing, seed=11)
    el, h, i = layout.num_local_experts, layout.hidden, layout.intermediate
    zeros = torch.zeros(el, 2 * i, h).to(torch.float8_e4m3fn), torch.ones(el, 2 * i // 128, h // 128)
    zeros2 = torch.zeros(el, h, i).to(torch.float8_e4m3fn), torch.ones(el, h // 128, i // 128)
    results = reference.moe([a.x for a in inputs], [a.x_sf for a in inputs], [a.topk_idx for a in inputs],
                            [a.topk_weights for a in inputs], [zeros] * num_ranks, [zeros2] * num_ranks,
                            return_intermediates=True)
    for rank, result in enumerate(results):
        ref = [dcc.ExpertRows(e.src, e.x.view(torch.uint8), e.x_sf, e.topk_weight) for e in result.experts]
        expected = dcc.expected_dispatch(inputs, layout, rank)
        assert dcc.compare_dispatch(expected, ref) == []
        assert [r.src.shape[0] for r in expected] == result.num_recv_per_expert.tolist()


def test_expected_y() -> None:
    layout = SymmLayout.create(*NARROW)
    (a,) = dcc.random_inputs(layout, [20], "uniform", seed=2)
    idx = a.topk_idx.clone()
    idx[0] = -1
    idx[1, 1:] = -1
    y = dcc.expected_y(a.x, a.x_sf, idx, a.topk_weights)
    assert y.dtype == torch.bfloat16 and y.shape == (20, 128)
    assert bool((y[0] == 0).all()), "a token without a valid slot is zero"
    single = ((a.x[1].float() * a.x_sf[1].repeat_interleave(128)) * a.topk_weights[1, 0]).to(torch.bfloat16)
    single = (single.float() + 0.0).to(torch.bfloat16)  # the fp32 sum starts at +0: a -0 product gives +0
    assert torch.equal(y[1].view(torch.int16), single.view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("shape,block_m,bulk,preset", COMPILE_CASES,
                         ids=[f"r{s[0]}-e{s[1]}-h{s[4]}-bm{bm}-{'bulk' if b else 'ldst'}-{p or 'default'}"
                              for s, bm, b, p in COMPILE_CASES])
def test_kernel_compiles_clean(shape: tuple, block_m: int, bulk: bool, preset: str | None) -> None:
    config = _config(shape, block_m, bulk, preset)
    result = dc.compile_kernel(config)
    assert checks.violations(result) == [], result.ptxas_log
    assert result.entry.stack_frame_bytes == 0 and result.entry.spill_store_bytes == 0
    sass = result.sass or ""
    # The protocol's instructions are there: bulk copies (pull row, or the legacy reduce's combine loads),
    # peer-scoped atomics, proxy fences
    assert ("UBLKCP" in sass) == (bulk or config.reduce == "bulk")
    assert "STRONG.SYS" in sass and "FENCE.VIEW.ASYNC" in sass
    assert ("UBLKCP.G.S" in sass) == bulk, "the pull's bulk store exists exactly in the bulk variant"


# ---------------------------------------------------------------------------------------------------------------
# gpu (one rank)
# ---------------------------------------------------------------------------------------------------------------


def _buffer(shape: tuple):
    import megamoe

    _, experts, t_max, topk, hidden, inter = shape
    return megamoe.get_symm_buffer(None, experts, t_max, topk, hidden, inter)




@pytest.mark.gpu
@pytest.mark.parametrize("tokens", ["random", "max", "zero"])
@pytest.mark.parametrize("routing", [r for r in dcc.ROUTINGS if r != "other_rank"])
@pytest.mark.parametrize("block_m", [32, 64, 128])
def test_single_rank_exact(block_m: int, routing: str, tokens: str) -> None:
    buf = _buffer(MAIN)
    rng = random.Random(f"{block_m}-{routing}-{tokens}")
    num_calls = 3
    for call in range(num_calls):  # fresh inputs every call, outputs poisoned before each
        t = {"random": rng.randint(1, MAIN[2]), "max": MAIN[2], "zero": 0}[tokens]
        inputs = dcc.random_inputs(buf.layout, [t], routing, seed=rng.randrange(1 << 30))
        errors = dcc.checked_call(buf, inputs, block_m)
        assert errors == [], f"call {call} (T={t}): {errors}"
    assert dcc.workspace_errors(buf, num_calls) == []


@pytest.mark.gpu
@pytest.mark.parametrize("shape,block_m,bulk,preset", VARIANT_CASES,
                         ids=["ldst-pull", "hidden7168", "hidden128", "legacy", "fused-pull", "hidden7168-legacy",
                              "hidden7168-fused-pull", "hidden128-fused-pull"])
def test_single_rank_variants(shape: tuple, block_m: int, bulk: bool, preset: str | None) -> None:
    buf = _buffer(shape)
    for call, routing in enumerate(["uniform", "masked", "one_expert"]):
        inputs = dcc.random_inputs(buf.layout, [shape[2] - call], routing, seed=100 + call)
        assert dcc.checked_call(buf, inputs, block_m, bulk, KNOBS[preset]) == [], routing
    assert dcc.workspace_errors(buf, 3) == []


@pytest.mark.gpu
def test_legacy_and_default_alternate() -> None:
    """Calls alternating between the legacy and the default kernel on one buffer (the bench does this): both
    keep the workspace (counters, NVLink barrier words) in the same state."""
    buf = _buffer(MAIN)
    for call in range(6):
        inputs = dcc.random_inputs(buf.layout, [MAIN[2] - 7 * call], dcc.ROUTINGS[call % 4], seed=300 + call)
        preset = (LEGACY, None, FUSED)[call % 3]
        assert dcc.checked_call(buf, inputs, 64, True, KNOBS[preset]) == [], (call, preset)
    assert dcc.workspace_errors(buf, 6) == []


@pytest.mark.gpu
def test_pool_matches_reference_moe() -> None:
    """The pool against reference.moe's own intermediates (not only the host helper)."""
    from megamoe import reference

    buf = _buffer(MAIN)
    gen = torch.Generator().manual_seed(7)
    case = reference.random_case(200, 512, 128, 8, 4, mask_prob=0.2, small_int=True, generator=gen)
    inputs = [dcc.RankInputs(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0])]
    assert dcc.checked_call(buf, inputs, 32) == []
    result = reference.moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                           case.l2_weights[0], return_intermediates=True)
    ref = [dcc.ExpertRows(e.src, e.x.view(torch.uint8), e.x_sf, e.topk_weight) for e in result.experts]
    counts = result.num_recv_per_expert.tolist()
    assert dcc.compare_dispatch(dcc.dispatched_rows(buf, counts, 32), ref) == []


@pytest.mark.gpu
def test_back_to_back_calls() -> None:
    """200 calls with changing inputs, token counts and BLOCK_M, no host synchronization in between."""
    buf = _buffer(MAIN)
    rng = random.Random(1234)
    num_calls = 200
    calls = []
    for call in range(num_calls):
        t = rng.choice([0, MAIN[2], rng.randint(1, MAIN[2])])
        inputs = dcc.random_inputs(buf.layout, [t], dcc.ROUTINGS[call % 4], seed=call)
        calls.append((inputs, rng.choice([32, 64, 128])))
    stats = torch.zeros(buf.layout.num_local_experts, dtype=torch.int32, device=buf.device)
    ys = dcc.queued_calls(buf, calls, stats)
    torch.cuda.synchronize()
    total = torch.zeros(buf.layout.num_local_experts, dtype=torch.int64)
    for call, ((inputs, _), y) in enumerate(zip(calls, ys)):
        a = inputs[0]
        expected = dcc.expected_y(a.x, a.x_sf, a.topk_idx, a.topk_weights)
        assert torch.equal(y.view(torch.int16).cpu(), expected.view(torch.int16)), f"call {call}: y differs"
        total += torch.tensor([r.src.shape[0] for r in dcc.expected_dispatch(inputs, buf.layout, 0)])
    assert stats.cpu().tolist() == total.tolist(), "cumulative recv stats"
    last_inputs, last_block_m = calls[-1]
    expected = dcc.expected_dispatch(last_inputs, buf.layout, 0)
    got = dcc.dispatched_rows(buf, [r.src.shape[0] for r in expected], last_block_m)
    assert dcc.compare_dispatch(got, expected) == []
    assert dcc.workspace_errors(buf, num_calls) == []


_HANG_CHILD = """
import torch, megamoe
from megamoe.kernels import dispatch_combine as dc
from megamoe.testing import dispatch_combine as dcc
from megamoe.jit.diagnostics import timeout_records
buf = megamoe.get_symm_buffer(None, 8, 256, 4, 512, 128)
t = dcc.load_inputs(buf, dcc.random_inputs(buf.layout, [64], "uniform", 0)[0])
y = torch.empty(t, 512, dtype=torch.bfloat16, device="cuda")
try:
    dc.run(buf, t, y, block_m=64, debug_hang=True)
    torch.cuda.synchronize()
except Exception as exc:
    print("LAUNCH FAILED:", type(exc).__name__, str(exc).splitlines()[0])
for report in timeout_records().reports():
    print("REPORT:", report)
"""


@pytest.mark.gpu
def test_barrier_timeout_reports_and_traps() -> None:
    env = dict(os.environ, MEGAMOE_TIMEOUT_S="0.5", PYTHONPATH=f"{REPO / 'python'}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _HANG_CHILD], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert "LAUNCH FAILED" in out, out
    reports = [line for line in proc.stdout.splitlines() if line.startswith("REPORT:")]
    assert any("timed out at 'nvl_dispatch'" in r and "rank 0" in r for r in reports), out
    waited = [float(r.split("after ")[1].split(" ms")[0]) for r in reports if "nvl_dispatch" in r]
    assert all(500 <= w < 5000 for w in waited), waited
    assert "megamoe timeout: rank 0 sm" in out, out
