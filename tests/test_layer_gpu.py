"""gpu tier: megamoe.layer.MoELayer on one H200, and its input fill kernel (megamoe.kernels.input_cast).

Fresh random inputs per test, the buffer's input regions poisoned before each fill, y poisoned by the layer's own
allocation (torch.empty, checked finite); y against reference.moe on the same FP8 inputs (within the fused tests'
max_y_rel_l2) and against the unquantized MoE of the same weights (the recipe's error, reported, bounded as in
tests/test_checkpoint.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megamoe import quant, reference  # noqa: E402
from megamoe.testing.layer import PREFIX, routed_hidden_states, synthetic_experts  # noqa: E402
from test_fused_gpu import max_y_rel_l2  # noqa: E402

RECIPE_MAX_REL_L2 = 5e-2  # tests/test_checkpoint.py: the FP8 recipe against the unquantized MoE, measured 4.1-4.3e-2
SHAPE = dict(num_experts=8, num_topk=6, hidden=1024, intermediate=512, max_tokens_per_rank=128)


def _poison_inputs(buf) -> None:
    buf.x.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    buf.x_sf.fill_(float("nan"))
    buf.topk_idx.fill_(-7)
    buf.topk_weights.fill_(float("nan"))


def _layer(seed: int):
    from megamoe.layer import MoELayer

    layer = MoELayer(**SHAPE, device="cuda")
    tensors = synthetic_experts(SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"], seed)
    layer.load_weights(tensors, prefix=PREFIX)
    return layer, tensors


def _natural(tensors) -> tuple:
    from megamoe import checkpoint

    return checkpoint.load_deepseek_experts(tensors, PREFIX, range(SHAPE["num_experts"]), SHAPE["hidden"],
                                            SHAPE["intermediate"], device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 77, 128])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("hidden,num_topk", [(1024, 6), (7168, 8)])
def test_input_cast_is_bit_exact(num_tokens: int, idx_dtype: torch.dtype, hidden: int, num_topk: int) -> None:
    """The fill kernel's codes and SFs equal quant.per_token_cast_to_fp8 bit for bit (an all-zero group and a
    group of large values included), the ids arrive as int64, the weights unchanged."""
    from megamoe.buffer import allocate
    from megamoe.kernels import input_cast
    from megamoe.layout import SymmLayout

    buf = allocate(None, SymmLayout.create(1, 32, 128, num_topk, hidden, 2048 if hidden == 7168 else 512),
                   torch.device("cuda"))
    hidden_states, idx, weights = routed_hidden_states(num_tokens, hidden, 32, num_topk, num_tokens, mask_every=5)
    hidden_states[0, 128:256] = 0
    hidden_states[-1, :128] *= 1e4
    hidden_states, idx, weights = hidden_states.cuda(), idx.to(idx_dtype).cuda(), weights.cuda()
    _poison_inputs(buf)
    assert input_cast.run(buf, hidden_states, idx, weights) == num_tokens
    torch.cuda.synchronize()
    x, x_sf = quant.per_token_cast_to_fp8(hidden_states)
    assert torch.equal(buf.x[:num_tokens].view(torch.uint8), x.view(torch.uint8))
    assert torch.equal(buf.x_sf[:num_tokens], x_sf)
    assert torch.equal(buf.topk_idx[:num_tokens], idx.long())
    assert torch.equal(buf.topk_weights[:num_tokens], weights)
    # Rows past T are not written
    assert bool((buf.topk_idx[num_tokens:] == -7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_matches_reference(seed: int) -> None:
    """Weights from a DeepSeek-format checkpoint mapping, forward with int32 and int64 ids and masked slots, T
    changing between calls (0 included); recv stats summed over the calls."""
    layer, tensors = _layer(seed)
    (w1, w1_sf), (w2, w2_sf) = _natural(tensors)
    expected_stats = torch.zeros(SHAPE["num_experts"], dtype=torch.int32)
    for call, (num_tokens, idx_dtype) in enumerate(((100, torch.int64), (0, torch.int32), (128, torch.int32),
                                                    (7, torch.int64))):
        hidden_states, idx, weights = routed_hidden_states(num_tokens, SHAPE["hidden"], SHAPE["num_experts"],
                                                           SHAPE["num_topk"], 1000 * seed + call, mask_every=3)
        _poison_inputs(layer.buffer)
        y = layer(hidden_states.cuda(), idx.to(idx_dtype).cuda(), weights.cuda())
        torch.cuda.synchronize()
        assert y.shape == (num_tokens, SHAPE["hidden"]) and y.dtype == torch.bfloat16
        expected_stats += torch.bincount(idx[idx >= 0].flatten(), minlength=SHAPE["num_experts"]).int()
        if num_tokens == 0:
            continue
        assert bool(torch.isfinite(y).all())
        x, x_sf = quant.per_token_cast_to_fp8(hidden_states)
        y_ref = reference.moe(x, x_sf, idx, weights, (w1.cpu(), w1_sf.cpu()), (w2.cpu(), w2_sf.cpu()),
                              fast_math=True)
        err = reference.rel_l2(y.float().cpu(), y_ref.float())
        y_fp32 = reference.moe_fp32(hidden_states.float(), idx, weights, quant.dequant_per_block(w1, w1_sf).cpu(),
                                    quant.dequant_per_block(w2, w2_sf).cpu())
        recipe = reference.rel_l2(y.float().cpu(), y_fp32)
        print(f"seed {seed} call {call} T {num_tokens}: y rel-L2 {err:.3e} vs reference, {recipe:.3e} vs the "
              f"unquantized MoE")
        assert err <= max_y_rel_l2(num_tokens) and recipe <= RECIPE_MAX_REL_L2
    assert torch.equal(layer.recv_stats.cpu(), expected_stats)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens_hint", [8, 64])
def test_layer_num_tokens_hint(num_tokens_hint: int) -> None:
    """A serving bucket's hint picks the config for its load (BLOCK_M 32 / 64 here instead of the buffer
    maximum's 128) and gives the same bits as the default config on the same inputs."""
    from megamoe import heuristics
    from megamoe.fused import config_for

    layer, _ = _layer(7)
    lay = layer.buffer.layout
    default_bm = config_for(lay).block_m
    hinted_bm = config_for(lay, expected_tokens_per_expert=heuristics.default_expected_tokens_per_expert(
        1, SHAPE["num_experts"], num_tokens_hint, SHAPE["num_topk"])).block_m
    assert hinted_bm < default_bm, (hinted_bm, default_bm)
    inputs = [t.cuda() for t in routed_hidden_states(num_tokens_hint, SHAPE["hidden"], SHAPE["num_experts"],
                                                     SHAPE["num_topk"], 70 + num_tokens_hint, mask_every=3)]
    _poison_inputs(layer.buffer)
    y_default = layer(*inputs)
    _poison_inputs(layer.buffer)
    y_hinted = layer(*inputs, num_tokens_hint=num_tokens_hint)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(y_default).all())
    assert torch.equal(y_hinted.view(torch.int16), y_default.view(torch.int16)), \
        f"BLOCK_M {hinted_bm} (hint {num_tokens_hint}) differs from BLOCK_M {default_bm}"


@pytest.mark.gpu
def test_layer_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """One capture at a fixed T = 64 (padded slots -1) with that bucket as the hint, as a serving framework
    captures its decode graphs, replayed with new hidden states and routing each time. `prepare` is all the
    capture needs before it (no eager call), and nothing compiles after it."""
    from megamoe.jit import compiler

    layer, tensors = _layer(5)
    (w1, w1_sf), (w2, w2_sf) = _natural(tensors)
    num_tokens = 64
    static = [t.cuda() for t in routed_hidden_states(num_tokens, SHAPE["hidden"], SHAPE["num_experts"],
                                                     SHAPE["num_topk"], 0)]
    layer.prepare([num_tokens])

    def no_build(name: str, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{name} was compiled or looked up after prepare")

    monkeypatch.setattr(compiler, "build", no_build)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(*static, num_tokens_hint=num_tokens)
    for replay in range(5):
        new = routed_hidden_states(num_tokens, SHAPE["hidden"], SHAPE["num_experts"], SHAPE["num_topk"],
                                   10 + replay, mask_every=2)
        new[1][num_tokens - 8:] = -1  # padded tokens: no expert
        for dst, src in zip(static, new):
            dst.copy_(src)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        x, x_sf = quant.per_token_cast_to_fp8(new[0])
        y_ref = reference.moe(x, x_sf, new[1], new[2], (w1.cpu(), w1_sf.cpu()), (w2.cpu(), w2_sf.cpu()),
                              fast_math=True)
        err = reference.rel_l2(y.float().cpu(), y_ref.float())
        assert err <= max_y_rel_l2(num_tokens), f"replay {replay}: y rel-L2 {err:.3e}"
        assert bool((y[num_tokens - 8:] == 0).all()), "a token with no expert must come out as zeros"


@pytest.mark.gpu
def test_layer_named_errors() -> None:
    from megamoe.layer import MoELayer

    layer = MoELayer(**SHAPE, device="cuda")
    hidden_states, idx, weights = (t.cuda() for t in routed_hidden_states(8, SHAPE["hidden"], SHAPE["num_experts"],
                                                                          SHAPE["num_topk"], 0))
    with pytest.raises(RuntimeError, match="no weights"):
        layer(hidden_states, idx, weights)
    layer.load_weights(synthetic_experts(SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"], 0), PREFIX)
    too_many = routed_hidden_states(129, SHAPE["hidden"], SHAPE["num_experts"], SHAPE["num_topk"], 0)
    with pytest.raises(ValueError, match="more than the buffer's maximum"):
        layer(*(t.cuda() for t in too_many))
    with pytest.raises(ValueError, match="hidden_states must be BF16"):
        layer(hidden_states.float(), idx, weights)
    with pytest.raises(ValueError, match="topk_idx must be int32 or int64"):
        layer(hidden_states, idx.short(), weights)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        layer(hidden_states, idx, weights.half())
    with pytest.raises(ValueError, match="must be on"):
        layer(hidden_states.cpu(), idx, weights)
    for bad in (0, 129):
        with pytest.raises(ValueError, match="num_tokens_hint must be in"):
            layer(hidden_states, idx, weights, num_tokens_hint=bad)
    with pytest.raises(TypeError, match="num_tokens_hint must be an int"):
        layer(hidden_states, idx, weights, num_tokens_hint=8.0)
    with pytest.raises(KeyError, match="checkpoint has no tensor"):
        layer.load_weights({}, PREFIX)
