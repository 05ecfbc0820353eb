"""The fused kernel never hangs silently (gpu tier, each case in a subprocess: the trap poisons the CUDA context):
a dispatch barrier that cannot complete, and a virtual peer rank that never launches, each end in a trap whose
host-mapped records name the NVLink barrier ('nvl_dispatch', role common) after the configured timeout, and no
role behind it (pull, producers, math) reports first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 0.5

_PRELUDE = """
import torch
from megamoe import reference, weights
from megamoe.fused.launch import prepare, run
from megamoe.jit.diagnostics import timeout_records
"""

# One rank, the dispatch barrier told to wait for a value it never reaches (DEBUG_HANG_AT_DISPATCH_BARRIER)
_HANG_CHILD = _PRELUDE + """
from megamoe.buffer import allocate
from megamoe.layout import SymmLayout
rc = reference.random_case(64, 1024, 512, 8, 6, generator=torch.Generator().manual_seed(0), device="cuda")
buf = allocate(None, SymmLayout.create(1, 8, 128, 6, 1024, 512), torch.device("cuda"))
l1, l2 = weights.transform_weights(rc.l1_weights[0], rc.l2_weights[0])
for name, value in (("x", rc.x[0]), ("x_sf", rc.x_sf[0]), ("topk_idx", rc.topk_idx[0]),
                    ("topk_weights", rc.topk_weights[0])):
    getattr(buf, name)[:64].copy_(value)
y = torch.empty(64, 1024, dtype=torch.bfloat16, device="cuda")
try:
    run(y, l1, l2, buf, 64, debug_hang=True)
    torch.cuda.synchronize()
except Exception as exc:
    print("LAUNCH FAILED:", type(exc).__name__, str(exc).splitlines()[0])
for report in timeout_records().reports():
    print("REPORT:", report)
"""

# Two virtual ranks; rank 1 never launches
_ABSENT_PEER_CHILD = _PRELUDE + """
from megamoe.testing.virtual_ranks import grid_per_rank, virtual_rank_buffers
rc = reference.random_case([64, 64], 2048, 1024, 16, 6, num_ranks=2, generator=torch.Generator().manual_seed(0),
                           device="cuda")
bufs = virtual_rank_buffers(2, 16, 128, 6, 2048, 1024)
l1, l2 = weights.transform_weights(rc.l1_weights[0], rc.l2_weights[0])
for name, value in (("x", rc.x[0]), ("x_sf", rc.x_sf[0]), ("topk_idx", rc.topk_idx[0]),
                    ("topk_weights", rc.topk_weights[0])):
    getattr(bufs[0], name)[:64].copy_(value)
y = torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda")
prepare(bufs[0])
try:
    run(y, l1, l2, bufs[0], 64, num_sms=grid_per_rank(2))
    torch.cuda.synchronize()
except Exception as exc:
    print("LAUNCH FAILED:", type(exc).__name__, str(exc).splitlines()[0])
for report in timeout_records().reports():
    print("REPORT:", report)
"""


def _run_child(source: str) -> tuple[str, list[str]]:
    env = dict(os.environ, MEGAMOE_TIMEOUT_S=str(TIMEOUT_S),
               PYTHONPATH=f"{REPO / 'python'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    return out, [line for line in proc.stdout.splitlines() if line.startswith("REPORT:")]


def _check_barrier_reports(out: str, reports: list[str]) -> None:
    assert "LAUNCH FAILED" in out, out
    barrier = [r for r in reports if "timed out at 'nvl_dispatch'" in r]
    assert barrier, out
    assert all("rank 0" in r and "(common)" in r for r in barrier), out
    # Only the barrier and the grid syncs around it may have timed out: no role after the split reports
    assert all("'nvl_dispatch'" in r or "'gs0_dispatch'" in r for r in reports), out
    waited = [float(r.split("after ")[1].split(" ms")[0]) for r in barrier]
    assert all(1000 * TIMEOUT_S <= w < 10_000 * TIMEOUT_S for w in waited), waited  # measured with %globaltimer


@pytest.mark.gpu
def test_dispatch_barrier_hang_reports_and_traps() -> None:
    out, reports = _run_child(_HANG_CHILD)
    _check_barrier_reports(out, reports)
    print("\n".join(reports[:4]))


@pytest.mark.gpu
def test_absent_virtual_peer_reports_and_traps() -> None:
    out, reports = _run_child(_ABSENT_PEER_CHILD)
    _check_barrier_reports(out, reports)
    print("\n".join(reports[:4]))
