"""API argument validation (DESIGN section 7), on CPU: every bad argument raises a clear error before a launch."""
from __future__ import annotations

import gc
import re

import pytest
import torch

import megamoe
from megamoe import quant

E, T_MAX, TOPK, H, I = 4, 16, 2, 256, 128


def _weights(num_local_experts: int = E, hidden: int = H, intermediate: int = I):
    w1, w1_sf = quant.per_block_cast_to_fp8(torch.randn(num_local_experts, 2 * intermediate, hidden))
    w2, w2_sf = quant.per_block_cast_to_fp8(torch.randn(num_local_experts, hidden, intermediate))
    return megamoe.transform_weights((w1, w1_sf), (w2, w2_sf))


@pytest.fixture()
def setup():
    buf = megamoe.get_symm_buffer(None, E, T_MAX, TOPK, H, I, device="cpu")
    x, x_sf = quant.per_token_cast_to_fp8(torch.randn(T_MAX, H))
    buf.x.copy_(x)
    buf.x_sf.copy_(x_sf)
    buf.topk_idx.copy_(quant.random_routing(T_MAX, E, TOPK))
    buf.topk_weights.copy_(torch.rand(T_MAX, TOPK))
    l1, l2 = _weights()
    y = torch.empty(T_MAX, H, dtype=torch.bfloat16)
    return buf, l1, l2, y


def test_valid_arguments_reach_the_kernel_gate(setup) -> None:
    buf, l1, l2, y = setup
    assert megamoe.api.validate_fused_args(y, l1, l2, buf) == T_MAX
    with pytest.raises(RuntimeError, match="SM90 GPU"):
        megamoe.fused(y, l1, l2, buf)
    # DeepGEMM's call: the token count from y, the stats as its fifth positional argument
    with pytest.raises(RuntimeError, match="SM90 GPU"):
        megamoe.fp8_mega_moe(y, l1, l2, buf, None, recipe=(128, 128, 128), activation="swiglu",
                             activation_clamp=None, fast_math=True)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats"):
        megamoe.fp8_mega_moe(y, l1, l2, buf, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="recipe must be"):
        megamoe.fp8_mega_moe(y, l1, l2, buf, recipe=(1, 128, 128))
    with pytest.raises(ValueError, match="activation must be"):
        megamoe.fp8_mega_moe(y, l1, l2, buf, activation="gelu")
    with pytest.raises(ValueError, match="use_fp8_dispatch"):
        megamoe.get_symm_buffer_for_sm90_mega_moe(None, E, T_MAX, TOPK, H, I, use_fp8_dispatch=False)
    assert megamoe.fp8_mega_moe_sm90 is megamoe.fp8_mega_moe
    # the SM90 buffer function rounds the token count up to 128 (DeepGEMM's), the generic one to 384
    assert megamoe.get_symm_buffer_for_sm90_mega_moe(None, E, 100, TOPK, H, I, device="cpu").num_max_tokens_per_rank \
        == 128
    assert megamoe.get_symm_buffer_for_mega_moe(None, E, 100, TOPK, H, I, device="cpu").num_max_tokens_per_rank == 384
    assert megamoe.get_symm_buffer_for_mega_moe(None, E, 385, TOPK, H, I, mma_type="fp8xfp8", device="cpu") \
        .num_max_tokens_per_rank == 768
    with pytest.raises(ValueError, match="num_shared_experts must be 0"):
        megamoe.get_symm_buffer_for_mega_moe(None, E, 100, TOPK, H, I, num_shared_experts=1)
    with pytest.raises(ValueError, match="mma_type"):
        megamoe.get_symm_buffer_for_mega_moe(None, E, 100, TOPK, H, I, mma_type="fp4xfp4")
    for entry in (megamoe.fp8_fp4_mega_moe, megamoe.fp8_fp4_mega_moe_sm90, megamoe.fp4_fp4_mega_moe,
                  megamoe.bf16_mega_moe, megamoe.transform_weights_for_mega_moe_sm90_fp4):
        with pytest.raises(NotImplementedError, match="FP8 x FP8 weights only"):
            entry(y, l1, l2, buf)
    # SGLang's SF helper: the checkpoint's float32 128x128 scales are the layout megamoe needs
    sf = torch.rand(E, 2 * I // 128, H // 128)
    assert torch.equal(megamoe.transform_sf_into_required_layout(sf, mn=2 * I, k=H, recipe=(128, 128), num_groups=E,
                                                                 disable_ue8m0_cast=True), sf)
    with pytest.raises(ValueError, match="UE8M0"):
        megamoe.transform_sf_into_required_layout(sf, mn=2 * I, k=H, num_groups=E)
    with pytest.raises(ValueError, match="sf must be float32"):
        megamoe.transform_sf_into_required_layout(sf, mn=I, k=H, num_groups=E, disable_ue8m0_cast=True)
    with pytest.raises(ValueError, match="UE8M0"):
        megamoe.utils.per_token_cast_to_fp8(torch.randn(4, H), use_ue8m0=True)
    x, x_sf = megamoe.utils.per_token_cast_to_fp8(torch.randn(4, H), use_ue8m0=False, gran_k=128)
    assert x.dtype == torch.float8_e4m3fn and x_sf.shape == (4, H // 128)


def test_buffer_views_alias_the_layout(setup) -> None:
    buf = setup[0]
    layout = buf.layout
    assert buf.buffer.numel() == layout.total_bytes and int(buf.buffer.sum()) != 0  # inputs were copied in
    for name in ("x", "x_sf", "topk_idx", "topk_weights"):
        view = getattr(buf, name)
        region = layout.region(name)
        assert view.data_ptr() - buf.buffer.data_ptr() == region.offset
        assert tuple(view.shape) == region.shape
    assert buf.x.dtype == torch.float8_e4m3fn and buf.topk_idx.dtype == torch.int64
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.view("x")


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(num_experts=0), ValueError, "num_experts must be positive"),
    (dict(num_experts=4.0), TypeError, "num_experts must be an int"),
    (dict(hidden=200), ValueError, "hidden must be a multiple of 128"),
    (dict(intermediate_hidden=192), ValueError, "intermediate_hidden must be a multiple of 128"),
    (dict(num_topk=5), ValueError, "num_topk must be <= num_experts"),
    (dict(num_max_tokens_per_rank=-1), ValueError, "num_max_tokens_per_rank must be positive"),
])
def test_get_symm_buffer_rejects(kwargs, error, pattern) -> None:
    args = dict(num_experts=E, num_max_tokens_per_rank=T_MAX, num_topk=TOPK, hidden=H, intermediate_hidden=I)
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        megamoe.get_symm_buffer(None, device="cpu", **args)
    with pytest.raises(TypeError, match="group must be"):
        megamoe.get_symm_buffer("world", E, T_MAX, TOPK, H, I, device="cpu")


def _bad_fused_cases():
    return [
        ("y dtype", lambda b, l1, l2, y: dict(y=y.float()), TypeError, "y must be torch.bfloat16"),
        ("y shape", lambda b, l1, l2, y: dict(y=y[:, :128]), ValueError, "y must have shape"),
        ("y 1-D", lambda b, l1, l2, y: dict(y=y[0]), ValueError, "y must be 2-D"),
        ("y strided", lambda b, l1, l2, y: dict(y=torch.empty(H, T_MAX, dtype=torch.bfloat16).t()), ValueError,
         "y must be contiguous"),
        ("T > max", lambda b, l1, l2, y: dict(y=torch.empty(T_MAX + 1, H, dtype=torch.bfloat16)), ValueError,
         "num_tokens must be in"),
        ("num_tokens vs y", lambda b, l1, l2, y: dict(num_tokens=3), ValueError, "y must have shape"),
        ("num_tokens type", lambda b, l1, l2, y: dict(num_tokens=3.0), TypeError, "num_tokens must be an int"),
        ("buf type", lambda b, l1, l2, y: dict(buf=object()), TypeError, "buf must be a SymmBuffer"),
        ("w1 dtype", lambda b, l1, l2, y: dict(l1_weights=(l1[0].float(), l1[1])), TypeError, "w1 must be"),
        ("w1_sf shape", lambda b, l1, l2, y: dict(l1_weights=(l1[0], l1[1][:, :1])), ValueError, "w1_sf must have"),
        ("weights tuple", lambda b, l1, l2, y: dict(l2_weights=l2[0]), TypeError, "l2_weights must be"),
        ("E_local mismatch", lambda b, l1, l2, y: dict(zip(("l1_weights", "l2_weights"), _weights(2))),
         ValueError, "E_local, hidden, intermediate"),
        ("stats dtype", lambda b, l1, l2, y: dict(cumulative_local_expert_recv_stats=torch.zeros(E)), TypeError,
         "cumulative_local_expert_recv_stats must be torch.int32"),
        ("stats shape", lambda b, l1, l2, y: dict(cumulative_local_expert_recv_stats=torch.zeros(E + 1,
                                                                                              dtype=torch.int32)),
         ValueError, "cumulative_local_expert_recv_stats must have shape"),
        ("clamp", lambda b, l1, l2, y: dict(activation_clamp=-1.0), ValueError, "activation_clamp must be"),
        ("clamp type", lambda b, l1, l2, y: dict(activation_clamp="7"), TypeError, "activation_clamp must be"),
        ("fast_math", lambda b, l1, l2, y: dict(fast_math=1), TypeError, "fast_math must be a bool"),
        ("expected", lambda b, l1, l2, y: dict(expected_tokens_per_expert=0), ValueError,
         "expected_tokens_per_expert must be"),
    ]


@pytest.mark.parametrize("case", _bad_fused_cases(), ids=lambda c: c[0])
def test_fused_rejects(setup, case) -> None:
    buf, l1, l2, y = setup
    _, make, error, pattern = case
    args = dict(y=y, l1_weights=l1, l2_weights=l2, buf=buf)
    args.update(make(buf, l1, l2, y))
    with pytest.raises(error, match=re.escape(pattern)):
        megamoe.fused(**args)


@pytest.mark.parametrize("value, pattern", [(E, "expert ids in [-1, 4)"), (-2, "expert ids in [-1, 4)")])
def test_fused_rejects_out_of_range_topk_idx(setup, value: int, pattern: str) -> None:
    buf, l1, l2, y = setup
    buf.topk_idx[5, 1] = value
    with pytest.raises(ValueError, match=re.escape(pattern) + r".*\[5, 1\]"):
        megamoe.fused(y, l1, l2, buf)
    # A bad id past num_tokens is not read, so it is not an error
    assert megamoe.api.validate_fused_args(y[:5], l1, l2, buf, num_tokens=5) == 5


def test_fused_rejects_duplicate_experts_and_bad_scales(setup) -> None:
    buf, l1, l2, y = setup
    buf.topk_idx[3] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match="distinct experts"):
        megamoe.fused(y, l1, l2, buf)
    buf.topk_idx[3] = torch.tensor([-1, -1])  # two unused slots are fine
    buf.x_sf[2, 0] = 0.0
    with pytest.raises(ValueError, match="x_sf must be finite and positive"):
        megamoe.fused(y, l1, l2, buf)
    buf.x_sf[2, 0] = 1.0
    buf.topk_weights[0, 0] = float("nan")
    with pytest.raises(ValueError, match="topk_weights must be finite"):
        megamoe.fused(y, l1, l2, buf)


def test_zero_tokens_is_valid(setup) -> None:
    buf, l1, l2, _ = setup
    assert megamoe.api.validate_fused_args(torch.empty(0, H, dtype=torch.bfloat16), l1, l2, buf) == 0


def test_fused_rejects_weights_not_from_transform_weights(setup) -> None:
    """The layout cannot be told from the bytes: weights that skipped transform_weights (natural, or w1 with its rows
    interleaved by the caller as DeepGEMM's layout has them) are refused by name; tensors sharing the transform's
    storage pass, a copy passes once declared with mark_transformed, and a freed transform's address does not."""
    from megamoe import weights

    buf, l1, l2, y = setup
    natural = (quant.per_block_cast_to_fp8(torch.randn(E, 2 * I, H)),
               quant.per_block_cast_to_fp8(torch.randn(E, H, I)))
    with pytest.raises(ValueError, match=re.escape("l1_weights[0] (w1) is not in the fused kernel's layout")):
        megamoe.fused(y, *natural, buf)
    perm = weights.l1_interleave_permutation(I)
    interleaved = ((natural[0][0][:, perm].contiguous(), natural[0][1]), natural[1])
    with pytest.raises(ValueError, match="transform_weights"):
        megamoe.api.validate_fused_args(y, *interleaved, buf)
    # w1 from the transform, w2 not: w2 named
    with pytest.raises(ValueError, match=re.escape("l2_weights[0] (w2)")):
        megamoe.api.validate_fused_args(y, l1, natural[1], buf)
    # what a serving framework does with the transform's tensors: parameters over them, .data, whole views
    params = tuple((torch.nn.Parameter(w, requires_grad=False), sf) for w, sf in (l1, l2))
    assert megamoe.api.validate_fused_args(y, *params, buf) == T_MAX
    assert megamoe.api.validate_fused_args(y, (l1[0].data, l1[1]), (l2[0].view(l2[0].shape), l2[1]), buf) == T_MAX
    # the transform's bytes copied into other tensors: refused until declared
    copies = tuple((w.clone(), sf) for w, sf in (l1, l2))
    assert not weights.is_transformed(*copies)
    with pytest.raises(ValueError, match="mark_transformed"):
        megamoe.api.validate_fused_args(y, *copies, buf)
    weights.mark_transformed(*copies)
    assert weights.is_transformed(*copies)
    assert megamoe.api.validate_fused_args(y, *copies, buf) == T_MAX
    # the record lives as long as the storage: dropped with its last tensor
    key = ("w1", copies[0][0].data_ptr())
    assert key in weights._TRANSFORMED
    del copies, params
    gc.collect()
    assert key not in weights._TRANSFORMED or weights._TRANSFORMED[key][1]() is None
    # and compat's entry point checks the same
    with pytest.raises(ValueError, match="is not in the fused kernel's layout"):
        megamoe.fp8_mega_moe(y, *natural, buf)


def test_check_inputs_switch(setup, monkeypatch) -> None:
    """MEGAMOE_CHECK_INPUTS=0 turns the default routing check off (the call then reaches the kernel gate);
    check_inputs=True still checks."""
    buf, l1, l2, y = setup
    buf.topk_idx[2, 0] = E
    with pytest.raises(ValueError, match="expert ids"):
        megamoe.fused(y, l1, l2, buf)
    monkeypatch.setenv("MEGAMOE_CHECK_INPUTS", "0")
    with pytest.raises(RuntimeError, match="SM90 GPU"):
        megamoe.fused(y, l1, l2, buf)
    with pytest.raises(RuntimeError, match="SM90 GPU"):
        megamoe.fp8_mega_moe(y, l1, l2, buf)
    with pytest.raises(ValueError, match="expert ids"):
        megamoe.fp8_mega_moe(y, l1, l2, buf, check_inputs=True)


def test_prepare_checks_its_arguments_before_any_compile(setup) -> None:
    buf = setup[0]
    with pytest.raises(TypeError, match="buf must be a SymmBuffer"):
        megamoe.prepare(None)
    with pytest.raises(ValueError, match="expected_tokens_per_expert must be"):
        megamoe.prepare(buf, expected_tokens_per_expert=[None, 0.0])
    with pytest.raises(ValueError, match="activation_clamp must be"):
        megamoe.prepare(buf, activation_clamp=-1.0)
    with pytest.raises(RuntimeError, match="megamoe.prepare needs the symmetric buffer on an SM90 GPU"):
        megamoe.prepare(buf)
    with pytest.raises(TypeError, match="expected_tokens_per_expert must be a number"):
        megamoe.prepare(buf, expected_tokens_per_expert="8")
    with pytest.raises(RuntimeError, match="SM90 GPU"):
        megamoe.prepare(buf, expected_tokens_per_expert=1.5)  # one value as it is, or a list
