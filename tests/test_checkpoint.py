"""cpu tier: routed-expert weights in DeepSeek V3's checkpoint format (megamoe.checkpoint), written to a sharded
safetensors checkpoint, read back through `SafetensorsFiles` and `load_deepseek_experts` for one rank's experts,
and the MoE of those weights through the reference (the contract the kernel is tested against) next to the
unquantized MoE of the same weights (the recipe's error, reported)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megamoe import checkpoint, quant, reference  # noqa: E402
from megamoe.testing.layer import PREFIX, routed_hidden_states, synthetic_experts  # noqa: E402
# The FP8 recipe against the unquantized MoE of the same (already FP8) weights, BF16 hidden states: measured
# rel-L2 4.14e-2 .. 4.34e-2 over seeds 0-7 at this shape (the per-128 activation cast and the per-64 requant, each
# about 3 mantissa bits); the bound is the largest measured + 15%.
RECIPE_MAX_REL_L2 = 5e-2


def write_sharded(tensors: dict[str, torch.Tensor], directory, num_shards: int) -> list:
    names = sorted(tensors)
    paths = []
    for s in range(num_shards):
        path = directory / f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        safetensors_torch.save_file({n: tensors[n] for n in names[s::num_shards]}, str(path))
        paths.append(path)
    return paths


@pytest.mark.parametrize("seed", [0, 1])
def test_load_one_ranks_experts_and_run_the_reference(tmp_path, seed: int) -> None:
    num_experts, hidden, intermediate, num_topk, num_ranks, rank = 8, 512, 256, 2, 2, 1
    tensors = synthetic_experts(num_experts, hidden, intermediate, seed)
    files = checkpoint.SafetensorsFiles(write_sharded(tensors, tmp_path, 3))
    assert len(files) == 6 * num_experts
    e_local = num_experts // num_ranks
    local = list(range(rank * e_local, (rank + 1) * e_local))
    (w1, w1_sf), (w2, w2_sf) = checkpoint.load_deepseek_experts(files, PREFIX, local, hidden, intermediate)
    # The natural layout: gate rows then up rows, the scales beside them, down as is
    for j, e in enumerate(local):
        i = intermediate
        assert torch.equal(w1[j, :i].view(torch.uint8), tensors[f"{PREFIX}{e}.gate_proj.weight"].view(torch.uint8))
        assert torch.equal(w1[j, i:].view(torch.uint8), tensors[f"{PREFIX}{e}.up_proj.weight"].view(torch.uint8))
        assert torch.equal(w1_sf[j, :i // 128], tensors[f"{PREFIX}{e}.gate_proj.weight_scale_inv"])
        assert torch.equal(w1_sf[j, i // 128:], tensors[f"{PREFIX}{e}.up_proj.weight_scale_inv"])
        assert torch.equal(w2[j].view(torch.uint8), tensors[f"{PREFIX}{e}.down_proj.weight"].view(torch.uint8))
        assert torch.equal(w2_sf[j], tensors[f"{PREFIX}{e}.down_proj.weight_scale_inv"])

    # DeepSeek's weight_dequant convention: w = w_fp8 * weight_scale_inv[n // 128, k // 128]
    gate = tensors[f"{PREFIX}{local[0]}.gate_proj.weight"]
    gate_s = tensors[f"{PREFIX}{local[0]}.gate_proj.weight_scale_inv"]
    dequant = gate.float() * gate_s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(quant.dequant_per_block(w1[0, :intermediate], w1_sf[0, :intermediate // 128]), dequant)

    # This rank's tokens routed to its own experts (local ids), BF16 hidden states cast per 128 as the layer does
    hidden_states, idx, weights = routed_hidden_states(40, hidden, e_local, num_topk, 100 + seed, mask_every=7)
    x, x_sf = quant.per_token_cast_to_fp8(hidden_states)
    y = reference.moe(x, x_sf, idx, weights, (w1, w1_sf), (w2, w2_sf), fast_math=True)
    y_fp32 = reference.moe_fp32(hidden_states.float(), idx, weights, quant.dequant_per_block(w1, w1_sf),
                                quant.dequant_per_block(w2, w2_sf))
    err = reference.rel_l2(y.float(), y_fp32)
    print(f"seed {seed}: FP8 recipe vs the unquantized MoE of the same weights: rel-L2 {err:.3e}")
    assert 0 < err < RECIPE_MAX_REL_L2


def test_named_errors() -> None:
    tensors = synthetic_experts(2, 256, 128, 0)
    with pytest.raises(KeyError, match="gate_proj.weight"):
        checkpoint.load_deepseek_experts(tensors, PREFIX, [0, 2], 256, 128)
    bad = dict(tensors)
    bad[f"{PREFIX}1.up_proj.weight"] = bad[f"{PREFIX}1.up_proj.weight"].float()
    with pytest.raises(TypeError, match="up_proj.weight must be torch.float8_e4m3fn"):
        checkpoint.load_deepseek_experts(bad, PREFIX, [0, 1], 256, 128)
    bad = dict(tensors)
    bad[f"{PREFIX}0.down_proj.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match="down_proj.weight_scale_inv must have shape"):
        checkpoint.load_deepseek_experts(bad, PREFIX, [0, 1], 256, 128)
    with pytest.raises(ValueError, match="multiples of 128"):
        checkpoint.load_deepseek_experts(tensors, PREFIX, [0], 200, 128)
    assert checkpoint.expert_tensor_names(PREFIX, 5)[0] == f"{PREFIX}5.gate_proj.weight"
