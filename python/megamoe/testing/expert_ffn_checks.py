"""Checks of the expert-FFN unit kernel (megamoe.kernels.expert_ffn) on a problem of megamoe.testing.expert_ffn:
what a correct kernel writes, and how far given outputs are from the reference (DESIGN section 4, checks 0 and 1).
Used by the gpu tier and, on simulated outputs, by the cpu tier."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megamoe.kernels.expert_ffn import FP8_MAX, FP8_NAN_CODE, SF_EPSILON, FfnOutputs, new_outputs
from megamoe.testing.expert_ffn import FfnProblem


def padding_sf() -> Tensor:
    """The SF of an all-zero row: max(0, 1e-10) / 448 as an IEEE fp32 division."""
    return torch.div(torch.tensor(SF_EPSILON, dtype=torch.float32), torch.tensor(FP8_MAX))


def expected_outputs(problem: FfnProblem) -> FfnOutputs:
    """The outputs of a kernel that reproduces the reference exactly: valid rows from the reference, padding rows
    of used pool blocks zero (SF 1e-10 / 448), spare blocks and unwritten rows still poisoned, counters full."""
    cfg, device = problem.config, problem.inputs.l1_acts.device
    outputs = new_outputs(cfg, problem.num_pool_rows, device)
    used = problem.used_rows
    outputs.l2_acts.view(torch.uint8)[:used] = 0
    outputs.l2_acts_sf[:, :used] = padding_sf()
    outputs.l1_done_count[: used // cfg.block_m] = cfg.num_l1_n_blocks
    for e, inter in enumerate(problem.reference.experts):
        rows = problem.rows(e)
        outputs.l2_acts.view(torch.uint8)[rows] = inter.l2_act.view(torch.uint8)
        outputs.l2_acts_sf[:, rows] = inter.l2_act_sf.t()
        outputs.out[rows] = inter.out
        if outputs.l1_acc is not None:
            outputs.l1_acc[rows] = inter.l1_acc
    return outputs


def fp8_ordinal(codes: Tensor) -> Tensor:
    """e4m3 codes -> int32 positions on the number line (+0 and -0 both 0): adjacent values differ by one."""
    c = codes.view(torch.uint8).to(torch.int32)
    return torch.where(c >= 0x80, -(c & 0x7F), c)


def fp8_half_step(s: Tensor) -> Tensor:
    """Half the e4m3 spacing at |s| (2^-9 below 2^-6, else 2^(floor(log2 |s|) - 3)), in float64."""
    _, exponent = torch.frexp(s.double().abs())
    spacing = torch.where(s.double().abs() < 2.0**-6, torch.full_like(s, 2.0**-9, dtype=torch.float64),
                          torch.pow(2.0, (exponent - 4).double()))
    return spacing / 2


def code_beyond(q: Tensor, sf: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    """(beyond, s) float64 [n, I]: s = act / sf, the unrounded value on the scale sf [n, I/64] of the codes q e4m3
    [n, I], and |q - s| less half the e4m3 step at s (> 0: the code lies beyond the rounding of s)."""
    scaled = (act.double().unflatten(1, (-1, 64)) / sf.double().unsqueeze(2)).flatten(1)
    return (q.float().double() - scaled).abs() - fp8_half_step(scaled), scaled


@dataclass
class CodeStats:
    """FP8 activation codes (and their SFs) against an expected requantization of an fp32 activation `act`."""

    steps: list[int] = field(default_factory=lambda: [0, 0, 0])  # codes 0, 1, >= 2 steps away from the expected
    excess: float = 0.0           # max (|q - s| - half e4m3 step at s) / 448 for the unrounded value v on the
                                  # code's own scale, s = v / sf: beyond the rounding of s, in units of the amax
    multi_step_magnitude: float = 0.0  # largest |s| / 448 (units of the group amax) of a code >= 2 steps off
    sf_mismatches: int = 0        # SFs that differ bitwise
    sf_max_rel_err: float = 0.0

    def add(self, q: Tensor, sf: Tensor, act: Tensor, expected_q: Tensor, expected_sf: Tensor) -> None:
        """Accumulate one expert: q e4m3 [n, I], sf f32 [n, I/64], act f32 [n, I] (what the expected codes and SFs
        quantize)."""
        distance = (fp8_ordinal(q) - fp8_ordinal(expected_q)).abs()
        self.steps[0] += int((distance == 0).sum())
        self.steps[1] += int((distance == 1).sum())
        self.steps[2] += int((distance >= 2).sum())
        # The expected value on the code's own scale (the SF stored beside it), so that a code's excess is its own
        # value's error. NOTES: on the expected SF's scale instead, every code of a group would also carry the error
        # of the group's amax, which the SF check bounds on its own: a random-tier case (H 4096, I 2048) whose SF was
        # 1.92e-3 off (within RANDOM_SF_REL_ERR) moved a value near the 416 / 448 midpoint by 0.83 and counted
        # 2.09e-3 amax of excess, with every accumulator within its usual error (scripts/ffn_code_excess.py).
        beyond, scaled = code_beyond(q, sf, act)
        self.excess = max(self.excess, _worst(beyond) / FP8_MAX)
        if bool((distance >= 2).any()):
            self.multi_step_magnitude = max(self.multi_step_magnitude,
                                            _worst(scaled.abs()[distance >= 2]) / FP8_MAX)
        self.sf_mismatches += int((sf.view(torch.int32) != expected_sf.view(torch.int32)).sum())
        self.sf_max_rel_err = max(self.sf_max_rel_err,
                                  _worst((sf.double() - expected_sf.double()).abs() / expected_sf.double()))

    def summary(self) -> str:
        total = sum(self.steps)
        return (f"FP8 codes off by 1 step {self.steps[1]}, by >= 2 {self.steps[2]} of {total} "
                f"({100 * (self.steps[1] + self.steps[2]) / max(1, total):.3f}%; >= 2 steps only at |value| <= "
                f"{self.multi_step_magnitude:.2e} amax), excess beyond rounding {self.excess:.2e} amax; SF "
                f"mismatches {self.sf_mismatches}, max rel err {self.sf_max_rel_err:.2e}")


@dataclass
class FfnReport:
    """Kernel outputs against the reference; each number is the worst case over the experts unless it is a count."""

    errors: list[str]               # layout, padding, poison and counter violations (must be empty)
    l1_acc_mismatches: int | None   # fp32 accumulators that differ bitwise (debug variants)
    codes: CodeStats                # L2 activations and SFs against the reference's
    own_codes: CodeStats | None     # ... against the reference epilogue applied to the kernel's own L1
                                    # accumulators (debug variants): the epilogue alone, without the GEMM's error
    out_mismatches: int             # BF16 outputs != bf16(block_scaled_matmul(own activations and SFs))
    num_outputs: int
    out_excess: float               # max beyond one BF16 step of that recomputation, in units of the expert's RMS
    out_rel_l2: float               # per-slot BF16 output vs the reference's, rel-L2

    @property
    def num_codes(self) -> int:
        return sum(self.codes.steps)

    def summary(self) -> str:
        own = f"; epilogue on own L1 acc: {self.own_codes.summary()}" if self.own_codes is not None else ""
        return (f"L1 acc mismatches {self.l1_acc_mismatches}; vs reference: {self.codes.summary()}{own}; L2 out vs "
                f"own recomputation {self.out_mismatches} of {self.num_outputs} differ "
                f"({100 * self.out_mismatches / max(1, self.num_outputs):.3f}%), excess {self.out_excess:.2e} RMS; "
                f"per-slot rel-L2 vs reference {self.out_rel_l2:.3e}")


def _layout_errors(problem: FfnProblem, outputs: FfnOutputs) -> list[str]:
    cfg, errors = problem.config, []
    used, valid = problem.used_rows, problem.valid_mask()
    padding = ~valid
    padding[used:] = False
    codes = outputs.l2_acts.view(torch.uint8)
    if bool((codes[padding] != 0).any()) or not bool((outputs.l2_acts_sf[:, padding] == padding_sf()).all()):
        errors.append("L2 activations / SF of padding rows in used pool blocks are not exact zeros / 1e-10 / 448")
    if bool((codes[used:] != FP8_NAN_CODE).any()) or not bool(torch.isnan(outputs.l2_acts_sf[:, used:]).all()):
        errors.append("L2 activations / SF of a spare pool block were written")
    valid_codes = codes[valid]
    if bool(((valid_codes & 0x7F) == FP8_NAN_CODE).any()):
        errors.append("L2 activations: a valid row holds NaN codes (unwritten?)")
    if not bool(torch.isfinite(outputs.l2_acts_sf[:, valid]).all()):
        errors.append("L2 activation SF: a valid row is unwritten or non-finite")
    if not bool(torch.isnan(outputs.out[~valid].float()).all()):
        errors.append("out: a padding or spare row was written")
    if not bool(torch.isfinite(outputs.out[valid].float()).all()):
        errors.append("out: a valid row is unwritten or non-finite")
    if outputs.l1_acc is not None and not bool(torch.isnan(outputs.l1_acc[~valid]).all()):
        errors.append("l1_acc: a padding or spare row was written")
    expected = torch.zeros_like(outputs.l1_done_count)
    expected[: used // cfg.block_m] = cfg.num_l1_n_blocks
    if not torch.equal(outputs.l1_done_count, expected):
        errors.append(f"l1_done_count {outputs.l1_done_count.tolist()} != {expected.tolist()}")
    return errors


def _worst(values: Tensor) -> float:
    """Max of a float tensor with NaN counted as +inf (Python's max would drop it)."""
    return torch.nan_to_num(values, nan=math.inf).max().item()


def compare(problem: FfnProblem, outputs: FfnOutputs) -> FfnReport:
    """Measure `outputs` against the problem's reference (see FfnReport)."""
    from megamoe import reference as ref
    from megamoe.quant import requant_per64

    errors = _layout_errors(problem, outputs)
    l1_mismatches = 0 if outputs.l1_acc is not None else None
    codes, own_codes = CodeStats(), (CodeStats() if outputs.l1_acc is not None else None)
    out_mismatches, out_excess, out_rel, num_outputs = 0, 0.0, 0.0, 0
    for e, inter in enumerate(problem.reference.experts):
        rows = problem.rows(e)
        if problem.counts[e] == 0:
            continue
        # L2 activations: codes against the reference's, and against its unrounded scaled value
        q, sf = outputs.l2_acts[rows], outputs.l2_acts_sf[:, rows].t().contiguous()
        codes.add(q, sf, inter.act, inter.l2_act, inter.l2_act_sf)
        if outputs.l1_acc is not None:
            l1_acc = outputs.l1_acc[rows]
            l1_mismatches += int((l1_acc.view(torch.int32) != inter.l1_acc.view(torch.int32)).sum())
            # The reference epilogue on the kernel's own accumulators isolates the epilogue from the GEMM's error
            own_act = ref.swiglu(l1_acc, inter.topk_weight, activation_clamp=problem.activation_clamp,
                                 fast_math=problem.config.fast_math)
            own_q, own_sf = requant_per64(own_act)
            own_codes.add(q, sf, own_act, own_q, own_sf)

        # L2 outputs: against the recomputation from the kernel's own activations, and against the reference
        w2, w2_sf = problem.case.l2_weights[0][e], problem.case.l2_weights[1][e]  # natural (the kernel's are tiled)
        recomputed = ref.block_scaled_matmul(q, sf, w2, ref._l2_scales(w2_sf), 64)
        got = outputs.out[rows]
        out_mismatches += int((got.view(torch.int16) != recomputed.to(torch.bfloat16).view(torch.int16)).sum())
        num_outputs += got.numel()
        rms = recomputed.double().pow(2).mean().sqrt().item()
        over = _worst((got.double() - recomputed.double()).abs() - recomputed.double().abs() * 2.0**-8)
        out_excess = max(out_excess, over / rms if rms > 0 else (0.0 if over <= 0 else math.inf))
        out_rel = max(out_rel, ref.rel_l2(got.float(), inter.out.float()))
    return FfnReport(errors, l1_mismatches, codes, own_codes, out_mismatches, num_outputs, max(out_excess, 0.0),
                     out_rel)
