"""cpu tier: the reference's helpers (megamoe.reference.rel_l2, block_scaled_matmul) and `moe`'s argument
validation (DESIGN section 7: errors name the argument)."""
from __future__ import annotations

import math

import pytest
import torch

from megamoe import reference
from megamoe.quant import BLOCK, random_routing
from megamoe.reference import moe, random_case, rel_l2

from test_reference import bits, gen




def test_rel_l2() -> None:
    b = torch.tensor([3.0, 4.0])
    assert rel_l2(b, b) == 0.0
    assert rel_l2(torch.tensor([3.0, 4.5]), b) == pytest.approx(0.1)
    assert rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_l2(torch.ones(2), torch.zeros(2)) == math.inf
    with pytest.raises(ValueError, match="same shape"):
        rel_l2(torch.ones(2), torch.ones(3))


def test_block_scaled_matmul_order_independent_of_batch() -> None:
    case = random_case(64, 256, 128, 1, 1, generator=gen(13))
    x, x_sf = case.x[0], case.x_sf[0]
    w1, w1_sf = case.l1_weights[0]
    b_sf = w1_sf[0].repeat_interleave(BLOCK, 0)
    full = reference.block_scaled_matmul(x, x_sf, w1[0], b_sf, BLOCK)
    one = reference.block_scaled_matmul(x[5:6], x_sf[5:6], w1[0], b_sf, BLOCK)
    assert torch.equal(bits(full[5:6]), bits(one))


def test_moe_validation() -> None:
    case = random_case([4, 4], 256, 128, 4, 2, num_ranks=2, generator=gen(14))
    x, x_sf, idx, w = case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0]
    merged = case.merged()
    l1, l2 = merged.l1_weights[0], merged.l2_weights[0]
    x_all, sf_all, idx_all, w_all = merged.x[0], merged.x_sf[0], merged.topk_idx[0], merged.topk_weights[0]
    with pytest.raises(TypeError, match="x must be torch.float8_e4m3fn"):
        moe(x_all.float(), sf_all, idx_all, w_all, l1, l2)
    with pytest.raises(ValueError, match=r"x_sf must have shape \(8, 2\)"):
        moe(x_all, sf_all[:, :1], idx_all, w_all, l1, l2)
    with pytest.raises(TypeError, match="topk_idx must be torch.int64"):
        moe(x_all, sf_all, idx_all.int(), w_all, l1, l2)
    with pytest.raises(ValueError, match=r"topk_idx values must be in \[-1, 4\)"):
        moe(x_all, sf_all, idx_all + 4, w_all, l1, l2)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        moe(x_all, sf_all, idx_all, w_all[:, :1], l1, l2)
    with pytest.raises(ValueError, match="activation_clamp"):
        moe(x_all, sf_all, idx_all, w_all, l1, l2, activation_clamp=-1.0)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats must have shape"):
        moe(x_all, sf_all, idx_all, w_all, l1, l2, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="cumulative_local_expert_recv_stats must be torch.int32"):
        moe(x_all, sf_all, idx_all, w_all, l1, l2, cumulative_local_expert_recv_stats=torch.zeros(4))
    # Multi-rank: lists of one length, same sizes on every rank, expert ids over all ranks' experts.
    with pytest.raises(TypeError, match="x_sf must be a list of 2 entries"):
        moe(case.x, case.x_sf[:1], case.topk_idx, case.topk_weights, case.l1_weights, case.l2_weights)
    with pytest.raises(ValueError, match=r"topk_idx\[1\] values must be in \[-1, 4\)"):
        moe(case.x, case.x_sf, [idx, idx + 2], case.topk_weights, case.l1_weights, case.l2_weights)
    bad_l1 = [case.l1_weights[0], tuple(t[:1] for t in case.l1_weights[1])]
    bad_l2 = [case.l2_weights[0], tuple(t[:1] for t in case.l2_weights[1])]
    with pytest.raises(ValueError, match=r"l1_weights\[1\].*E_local=2"):
        moe(case.x, case.x_sf, case.topk_idx, case.topk_weights, bad_l1, bad_l2)
    with pytest.raises(TypeError, match="x must be a Tensor"):
        moe(None, x_sf, idx, w, l1, l2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must have topk = 2 like rank 0"):
        moe(case.x, case.x_sf, [idx, random_routing(4, 4, 3)], [w, torch.ones(4, 3)], case.l1_weights,
            case.l2_weights)
