"""One launch of a GEMM benchmark case, for `ncu` (usage: ncu ... python3 scripts/profile_gemm.py [case index]
[knobs, as scripts/sweep_gemm.py takes them: "band_m=1,prefetch=0"])."""
from __future__ import annotations

import sys
from dataclasses import replace

import torch

from megamoe.bench.gemm import GEMM_CASES
from megamoe.kernels import gemm
from megamoe.testing.gemm import make_problem, run_problem
from sweep_gemm import parse_knobs

case = GEMM_CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 1]
config = gemm.GemmConfig(case.block_m, case.mode, case.n, case.k, case.num_groups)
config = replace(config, **parse_knobs(sys.argv[2] if len(sys.argv) > 2 else ""))
problem = make_problem(config, [case.rows] * case.num_groups, small_int=False)
d = torch.empty(problem.num_pool_rows, case.n, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    run_problem(problem, d)
torch.cuda.synchronize()
