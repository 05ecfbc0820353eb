"""cpu tier: properties of the reference (megamoe.reference) that the contract of DESIGN section 4 implies: bitwise
invariances (token order, expert labels, ranks), masked slots and empty ranks, receive statistics, the activation
clamp and fast math, and the FP8 recipe's error against the unquantized fp32 MoE."""
from __future__ import annotations

import torch

from megamoe.reference import moe, moe_fp32, random_case, rel_l2

from test_reference import bits, gen, run


# ----------------------------------------------------------------------------------------------------------------
# (b), (c), (g): bitwise invariances
# ----------------------------------------------------------------------------------------------------------------


def test_token_permutation_invariance() -> None:
    case = random_case(48, 256, 256, 8, 3, mask_prob=0.1, generator=gen(1))
    y = run(case)
    perm = torch.randperm(48, generator=gen(2))
    y_perm = moe(case.x[0][perm], case.x_sf[0][perm], case.topk_idx[0][perm], case.topk_weights[0][perm],
                 case.l1_weights[0], case.l2_weights[0])
    assert torch.equal(bits(y_perm), bits(y[perm]))


def test_expert_relabelling_invariance() -> None:
    case = random_case([20, 12], 256, 128, 8, 3, num_ranks=2, mask_prob=0.1, generator=gen(3))
    num_local = 4
    y = run(case)
    new_l1, new_l2, mapping = [], [], torch.arange(8)
    for r in range(2):
        p = torch.randperm(num_local, generator=gen(10 + r))  # new local i holds old local p[i]
        (w1, w1_sf), (w2, w2_sf) = case.l1_weights[r], case.l2_weights[r]
        new_l1.append((w1[p].contiguous(), w1_sf[p].contiguous()))
        new_l2.append((w2[p].contiguous(), w2_sf[p].contiguous()))
        mapping[r * num_local + p] = r * num_local + torch.arange(num_local)
    new_idx = [torch.where(idx >= 0, mapping[idx.clamp_min(0)], -1) for idx in case.topk_idx]
    assert not all(torch.equal(a, b) for a, b in zip(new_idx, case.topk_idx))
    y_new = moe(case.x, case.x_sf, new_idx, case.topk_weights, new_l1, new_l2)
    for a, b in zip(y, y_new):
        assert torch.equal(bits(a), bits(b))


def test_multi_rank_equals_single_rank_on_concatenated_tokens() -> None:
    case = random_case([10, 14], 256, 256, 8, 4, num_ranks=2, mask_prob=0.1, generator=gen(4))
    ys = run(case)
    merged = case.merged()
    assert merged.num_ranks == 1 and merged.l1_weights[0][0].shape[0] == 8
    y_single = run(merged)
    assert torch.equal(bits(torch.cat(ys)), bits(y_single))


# ----------------------------------------------------------------------------------------------------------------
# (d) masked slots and empty ranks; (f) receive statistics
# ----------------------------------------------------------------------------------------------------------------


def test_all_masked_rows_are_zero_and_empty_input() -> None:
    case = random_case(16, 256, 128, 4, 2, generator=gen(5))
    idx = case.topk_idx[0].clone()
    idx[[0, 5, 15]] = -1
    y = moe(case.x[0], case.x_sf[0], idx, case.topk_weights[0], case.l1_weights[0], case.l2_weights[0])
    assert (bits(y[[0, 5, 15]]) == 0).all()  # +0.0 exactly
    assert (y[[1, 2, 3]] != 0).any()
    # A partially masked row equals the sum of its valid slots only (the masked slot's weight is ignored).
    idx2, w2 = idx.clone(), case.topk_weights[0].clone()
    idx2[1, 1], w2[1, 1] = -1, 1e30
    y2 = moe(case.x[0], case.x_sf[0], idx2, w2, case.l1_weights[0], case.l2_weights[0])
    assert torch.isfinite(y2.float()).all() and not torch.equal(bits(y2[1]), bits(y[1]))

    empty = moe(case.x[0][:0], case.x_sf[0][:0], idx[:0], case.topk_weights[0][:0], case.l1_weights[0],
                case.l2_weights[0])
    assert empty.shape == (0, 256) and empty.dtype == torch.bfloat16


def test_rank_with_zero_tokens_still_serves_its_experts() -> None:
    case = random_case([0, 12], 256, 128, 4, 2, num_ranks=2, generator=gen(6))
    stats = [torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    results = run(case, cumulative_local_expert_recv_stats=stats, return_intermediates=True)
    assert results[0].y.shape == (0, 256)
    counts = torch.bincount(case.topk_idx[1].flatten(), minlength=4)
    assert stats[0].tolist() == counts[:2].tolist() and stats[1].tolist() == counts[2:].tolist()
    assert results[0].num_recv_per_expert.tolist() == counts[:2].tolist()
    assert all((ex.src[:, 0] == 1).all() for ex in results[0].experts)


def test_recv_stats_accumulate_across_calls() -> None:
    case = random_case([9, 7], 256, 128, 8, 3, num_ranks=2, mask_prob=0.2, generator=gen(7))
    valid = torch.cat(case.topk_idx).flatten()
    counts = torch.bincount(valid[valid >= 0], minlength=8)
    stats = [torch.full((4,), 5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)]
    run(case, cumulative_local_expert_recv_stats=stats)
    run(case, cumulative_local_expert_recv_stats=stats)
    assert stats[0].dtype == torch.int32
    assert stats[0].tolist() == (5 + 2 * counts[:4]).tolist()
    assert stats[1].tolist() == (2 * counts[4:]).tolist()
    # Single rank: one tensor.
    single = case.merged()
    stat = torch.zeros(8, dtype=torch.int32)
    run(single, cumulative_local_expert_recv_stats=stat)
    run(single, cumulative_local_expert_recv_stats=stat)
    assert stat.tolist() == (2 * counts).tolist()


# ----------------------------------------------------------------------------------------------------------------
# (e) activation clamp and fast math
# ----------------------------------------------------------------------------------------------------------------


def test_activation_clamp_follows_the_formula() -> None:
    clamp = 0.5
    case = random_case(32, 256, 128, 4, 2, generator=gen(8))
    plain = run(case, return_intermediates=True)
    clamped = run(case, activation_clamp=clamp, return_intermediates=True)
    assert not torch.equal(bits(plain.y), bits(clamped.y))
    l1 = torch.cat([ex.l1_acc for ex in clamped.experts]).double()
    act = torch.cat([ex.act for ex in clamped.experts]).double()
    weight = torch.cat([ex.topk_weight for ex in clamped.experts]).double()[:, None]
    gate, up = l1[:, :128], l1[:, 128:]
    assert (gate > clamp).any() and (gate < -clamp).any() and (up.abs() > clamp).any()
    g, u = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    expected = g * torch.sigmoid(g) * u * weight
    assert torch.allclose(act, expected, rtol=2e-6, atol=1e-30)
    # The gate clamp is one-sided (DESIGN: not the seed's symmetric clamp): a symmetric one differs.
    gs = gate.clamp(-clamp, clamp)
    symmetric = gs * torch.sigmoid(gs) * u * weight
    assert not torch.allclose(act, symmetric, rtol=1e-3)
    # The L1 accumulators do not depend on the clamp; a clamp above every value changes nothing.
    assert torch.equal(l1.float(), torch.cat([ex.l1_acc for ex in plain.experts]))
    huge = run(case, activation_clamp=1e30)
    assert torch.equal(bits(huge), bits(plain.y))


def test_fast_math_is_close() -> None:
    case = random_case(32, 256, 256, 4, 2, generator=gen(9))
    exact = run(case, return_intermediates=True)
    fast = run(case, fast_math=True, return_intermediates=True)
    act = torch.cat([ex.act for ex in exact.experts])
    act_fast = torch.cat([ex.act for ex in fast.experts])
    # Same formula with an exp-based sigmoid: measured 3746 of 16384 activations differ, by <= 3.0e-7 relative;
    # none of the FP8 codes flipped and y came out identical.
    assert not torch.equal(act, act_fast)
    assert torch.allclose(act_fast, act, rtol=1e-6, atol=1e-30)
    codes = torch.cat([ex.l2_act for ex in exact.experts]).view(torch.uint8)
    codes_fast = torch.cat([ex.l2_act for ex in fast.experts]).view(torch.uint8)
    assert (codes != codes_fast).float().mean().item() < 0.01
    assert rel_l2(fast.y.float(), exact.y.float()) < 1e-3


# ----------------------------------------------------------------------------------------------------------------
# (h) the FP8 recipe against the unquantized fp32 MoE
# ----------------------------------------------------------------------------------------------------------------


def test_fp8_recipe_error_against_fp32_moe() -> None:
    case = random_case(256, 1024, 512, 16, 4, generator=gen(10))
    y = run(case)
    y_fp32 = moe_fp32(case.x_float[0], case.topk_idx[0], case.topk_weights[0], case.w1_float, case.w2_float)
    assert y_fp32.dtype == torch.float32
    # Measured here: 6.2% rel-L2 (6.23% with this seed; 6.29% with seeds 0, 1, 2). Of it, the FP8 weights alone give
    # 4.6% and the L1->L2 requant alone 2.1%, as DESIGN section 4 measured (4.6%, 2.2%; 5.5% overall on its data,
    # whose activations were distributed differently).
    err = rel_l2(y.float(), y_fp32)
    assert 0.03 < err < 0.09


def test_moe_fp32_clamp_and_masking() -> None:
    case = random_case(8, 128, 128, 4, 2, generator=gen(11))
    idx = case.topk_idx[0].clone()
    idx[0] = -1
    y = moe_fp32(case.x_float[0], idx, case.topk_weights[0], case.w1_float, case.w2_float, activation_clamp=0.1)
    assert (y[0] == 0).all()
    y_plain = moe_fp32(case.x_float[0], idx, case.topk_weights[0], case.w1_float, case.w2_float)
    assert not torch.equal(y, y_plain)
