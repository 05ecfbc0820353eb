"""cpu tier: the reference (megamoe.reference) implements the numerical contract of DESIGN section 4, checked
against independent computations: a deliberately naive float64 loop formulation, and exact integer arithmetic on
small-integer inputs. Its properties (invariances, masking, statistics, clamp, fast math, the recipe's error):
test_reference_properties.py; its helpers and argument validation: test_reference_api.py."""
from __future__ import annotations

import math

import torch

from megamoe.quant import BLOCK, REQUANT_GROUP
from megamoe.reference import MoeCase, moe, random_case, rel_l2

FP8 = torch.float8_e4m3fn
U = 2.0**-24  # fp32 unit roundoff


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(case: MoeCase, **kwargs):
    """moe() on a case: multi-rank when the case has several ranks, else single-rank."""
    if case.num_ranks == 1:
        return moe(case.x[0], case.x_sf[0], case.topk_idx[0], case.topk_weights[0], case.l1_weights[0],
                   case.l2_weights[0], **kwargs)
    return moe(case.x, case.x_sf, case.topk_idx, case.topk_weights, case.l1_weights, case.l2_weights, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so that equality is bitwise (signed zeros, NaN codes)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


# ----------------------------------------------------------------------------------------------------------------
# (a) a tiny multi-rank case against a deliberately naive float64 loop formulation
# ----------------------------------------------------------------------------------------------------------------


def naive_l1(x: torch.Tensor, x_sf: torch.Tensor, w1: torch.Tensor, w1_sf: torch.Tensor) -> tuple[list, list]:
    """h[n] = sum_b dot(x[b], w1[n, b]) * x_sf[b] * w1_sf[n // 128, b] in float64, with sum_b |term| per n."""
    h = [0.0] * w1.shape[0]
    mag = [0.0] * w1.shape[0]
    for b in range(x.shape[0] // BLOCK):
        ks = slice(b * BLOCK, (b + 1) * BLOCK)
        dots = (w1[:, ks].double() @ x[ks].double()).tolist()  # exact: FP8 products summed in float64
        for n in range(w1.shape[0]):
            term = dots[n] * float(x_sf[b]) * float(w1_sf[n // BLOCK, b])
            h[n] += term
            mag[n] += abs(term)
    return h, mag


def naive_swiglu(h: list[float], weight: float, clamp: float | None) -> list[float]:
    inter = len(h) // 2
    out = []
    for i in range(inter):
        gate, up = h[i], h[inter + i]
        if clamp is not None:
            gate, up = min(gate, clamp), max(-clamp, min(up, clamp))
        out.append(gate / (1.0 + math.exp(-gate)) * up * weight)
    return out


def naive_requant(v: list[float]) -> tuple[list[float], list[float]]:
    """Per 64 columns, with every fp32 operation emulated as float64 then one rounding (innocuous for +-*/)."""
    q, sfs = [], []
    for g in range(len(v) // REQUANT_GROUP):
        group = v[g * REQUANT_GROUP:(g + 1) * REQUANT_GROUP]
        a = max(max(abs(x) for x in group), f32(1e-10))
        sfs.append(f32(a / 448.0))
        inv = f32(448.0 / a)
        scaled = [max(-448.0, min(448.0, f32(x * inv))) for x in group]
        q.extend(torch.tensor(scaled, dtype=torch.float32).to(FP8).float().tolist())
    return q, sfs


def naive_l2(q: list[float], sf: list[float], w2: torch.Tensor, w2_sf: torch.Tensor) -> tuple[list, list]:
    """o[n] = sum over 64-K halves g of dot(q[g], w2[n, g]) * sf[g] * w2_sf[n // 128, g // 2], float64."""
    o = [0.0] * w2.shape[0]
    mag = [0.0] * w2.shape[0]
    qt = torch.tensor(q, dtype=torch.float64)
    for g in range(len(sf)):
        ks = slice(g * REQUANT_GROUP, (g + 1) * REQUANT_GROUP)
        dots = (w2[:, ks].double() @ qt[ks]).tolist()
        for n in range(w2.shape[0]):
            term = dots[n] * sf[g] * float(w2_sf[n // BLOCK, g // 2])
            o[n] += term
            mag[n] += abs(term)
    return o, mag


def test_tiny_case_matches_naive_loops() -> None:
    hidden, inter, num_experts, topk = 256, 128, 4, 2
    case = random_case([3, 4], hidden, inter, num_experts, topk, num_ranks=2, generator=gen(0))
    num_local = num_experts // 2
    case.topk_idx[0][1, 0] = -1  # an unused slot before a used one
    case.topk_idx[1][2] = -1     # a token with no valid slot
    results = run(case, return_intermediates=True)
    assert len(results) == 2

    # Routing: which (src_rank, token, slot) each local expert receives, in canonical order.
    expected_src: dict[tuple[int, int], list[list[int]]] = {(r, le): [] for r in range(2) for le in range(num_local)}
    for s in range(2):
        for t, row in enumerate(case.topk_idx[s].tolist()):
            for j, e in enumerate(row):
                if e >= 0:
                    expected_src[(e // num_local, e % num_local)].append([s, t, j])
    slot_out: dict[tuple[int, int, int], torch.Tensor] = {}
    full_naive_out: dict[tuple[int, int, int], list[float]] = {}
    num_l1 = num_out = num_out_exact = 0
    for r in range(2):
        (w1, w1_sf), (w2, w2_sf) = case.l1_weights[r], case.l2_weights[r]
        assert results[r].num_recv_per_expert.tolist() == [len(expected_src[(r, le)]) for le in range(num_local)]
        for le, ex in enumerate(results[r].experts):
            assert ex.src.tolist() == expected_src[(r, le)]
            for row, (s, t, j) in enumerate(ex.src.tolist()):
                assert torch.equal(bits(ex.x[row]), bits(case.x[s][t]))
                assert torch.equal(ex.x_sf[row], case.x_sf[s][t])
                weight = float(case.topk_weights[s][t, j])
                assert float(ex.topk_weight[row]) == weight
                # L1: the reference rounds each exact block dot to fp32, multiplies by the scale product and
                # accumulates in fp32: at most 3 roundings per block term and one per addition, so
                # |ref - exact| <= (num_blocks + 3) * u * sum_b |term_b|.
                h, mag = naive_l1(case.x[s][t], case.x_sf[s][t], w1[le], w1_sf[le])
                tol = (hidden // BLOCK + 3) * U * torch.tensor(mag, dtype=torch.float64)
                diff = (ex.l1_acc[row].double() - torch.tensor(h, dtype=torch.float64)).abs()
                assert (diff <= tol).all()
                num_l1 += len(h)
                # Activation from the reference's own l1_acc (so the exact stages below can be checked exactly):
                # fp32 sigmoid and three fp32 products are within a few ulps: rtol 2e-6.
                v = naive_swiglu(ex.l1_acc[row].double().tolist(), weight, None)
                assert torch.allclose(ex.act[row].double(), torch.tensor(v, dtype=torch.float64), rtol=2e-6,
                                      atol=1e-30)
                # Requant from the reference's own act: exact (same IEEE fp32 operations).
                q, sf = naive_requant(ex.act[row].double().tolist())
                assert ex.l2_act[row].float().tolist() == q
                assert ex.l2_act_sf[row].tolist() == sf
                # L2 from the reference's own l2_act: fp32 error as for L1, then one bf16 rounding (8 significant
                # bits: at most 2^-8 relative).
                o, mag2 = naive_l2(q, sf, w2[le], w2_sf[le])
                o64 = torch.tensor(o, dtype=torch.float64)
                tol2 = 2.0**-8 * o64.abs() * (1 + 1e-6) + (inter // REQUANT_GROUP + 3) * U * torch.tensor(mag2)
                assert ((ex.out[row].double() - o64).abs() <= tol2).all()
                num_out += len(o)
                num_out_exact += int((ex.out[row] == o64.to(torch.bfloat16)).sum())
                slot_out[(s, t, j)] = ex.out[row]
                # Fully independent chain (naive activation and requant from the naive h), for the end check.
                qn, sfn = naive_requant(naive_swiglu(h, weight, None))
                full_naive_out[(s, t, j)] = naive_l2(qn, sfn, w2[le], w2_sf[le])[0]
    assert num_l1 == 2 * inter * sum(len(v) for v in expected_src.values())
    # Measured: all 2816 L2 outputs are the correctly rounded bf16 of the exact value.
    assert num_out_exact >= 0.99 * num_out

    # Combine: y[t] = bf16(sum over valid slots in order of fp32(out)). With topk = 2 the fp32 sum of two bf16
    # values is exact (unless their exponents differ by more than 16), so the float64 sum rounds the same way.
    for s in range(2):
        y = results[s].y
        assert y.dtype == torch.bfloat16 and y.shape == (case.x[s].shape[0], hidden)
        y_full = torch.zeros(y.shape, dtype=torch.float64)
        for t, row in enumerate(case.topk_idx[s].tolist()):
            acc = torch.zeros(hidden, dtype=torch.float64)
            for j, e in enumerate(row):
                if e >= 0:
                    acc += slot_out[(s, t, j)].double()
                    y_full[t] += torch.tensor(full_naive_out[(s, t, j)], dtype=torch.float64)
            assert torch.equal(bits(y[t]), bits(acc.to(torch.bfloat16)))
        # End to end against the fully naive chain: only bf16 rounding and rare FP8 code flips differ
        # (measured rel-L2 2.3e-3 for rank 0, 2.6e-3 for rank 1).
        assert rel_l2(y.double(), y_full) < 1e-2


# ----------------------------------------------------------------------------------------------------------------
# (i) bit-exact small-integer case (DESIGN section 4, check 0)
# ----------------------------------------------------------------------------------------------------------------


def test_small_int_l1_is_exact() -> None:
    hidden, inter = 1024, 256
    case = random_case([16, 8], hidden, inter, 4, 2, num_ranks=2, small_int=True, generator=gen(12))
    results = run(case, return_intermediates=True)
    num_local, checked = 2, 0
    for r in range(2):
        w1, w1_sf = case.l1_weights[r]
        # Distinct gate and up scales exist, so choosing the wrong one would show.
        assert not torch.equal(w1_sf[:, :inter // BLOCK], w1_sf[:, inter // BLOCK:])
        for le, ex in enumerate(results[r].experts):
            if ex.src.shape[0] == 0:
                continue
            x_int = ex.x.float().to(torch.int64).view(-1, hidden // BLOCK, BLOCK)
            w_int = w1[le].float().to(torch.int64).view(2 * inter, hidden // BLOCK, BLOCK)
            partial = torch.einsum("mbk,nbk->bmn", x_int, w_int)  # exact integers
            assert partial.abs().max() <= 2048
            scale = ex.x_sf.t()[:, :, None].double() * w1_sf[le].repeat_interleave(BLOCK, 0).t()[:, None, :].double()
            exact = (partial.double() * scale).sum(0)  # float64: exact for these magnitudes
            assert torch.equal(ex.l1_acc.double(), exact)
            checked += ex.src.shape[0]
    assert checked == sum(int((idx >= 0).sum()) for idx in case.topk_idx)
