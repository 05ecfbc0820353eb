"""gpu tier: the common layer's smoke kernel (TMA load -> mbarrier -> transform -> TMA store), exact; and the
device timeout diagnostic (run in a subprocess: the trap poisons the CUDA context)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("swizzle", [True, False])
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 96), (33, 4), (1, 36)])
def test_smoke_kernel_exact(shape: tuple[int, int], swizzle: bool) -> None:
    from megamoe.kernels import smoke

    config = smoke.SmokeConfig(32, 32 if swizzle else 64, swizzle)
    for _ in range(3):  # fresh inputs each time, output poisoned before each run
        x = torch.randint(-1000, 1000, shape, device="cuda").float()
        out = torch.full_like(x, float("nan"))
        smoke.run(x, out, config)
        torch.cuda.synchronize()
        expected = smoke.expected(x)
        mismatches = (out != expected).sum().item()
        assert mismatches == 0, f"{mismatches} of {out.numel()} elements differ (shape {shape}, {config})"


def test_smoke_kernel_fewer_blocks_than_tiles() -> None:
    from megamoe.kernels import smoke

    x = torch.randint(-100, 100, (2048, 256), device="cuda").float()
    out = torch.full_like(x, float("nan"))
    smoke.run(x, out, num_blocks=3)  # each CTA loops over many tiles: the mbarrier phase must flip right
    torch.cuda.synchronize()
    assert torch.equal(out, smoke.expected(x))


_HANG_CHILD = """
import sys, torch
from megamoe.kernels import smoke
from megamoe.jit.diagnostics import timeout_records
x = torch.randn(256, 64, device="cuda")
out = torch.empty_like(x)
try:
    smoke.run(x, out, smoke.SmokeConfig(32, 32, True), num_blocks=4, debug_hang=True)
    torch.cuda.synchronize()
except Exception as exc:
    print("LAUNCH FAILED:", type(exc).__name__, str(exc).splitlines()[0])
for report in timeout_records().reports():
    print("REPORT:", report)
"""


def test_timeout_reports_and_traps() -> None:
    env = dict(os.environ, MEGAMOE_TIMEOUT_S="0.5", PYTHONPATH=f"{REPO / 'python'}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _HANG_CHILD], capture_output=True, text=True, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert "LAUNCH FAILED" in out, out
    reports = [line for line in proc.stdout.splitlines() if line.startswith("REPORT:")]
    assert reports, out
    assert all("timed out at 'smoke_full'" in r and "rank 0" in r for r in reports), out
    waited = [float(r.split("after ")[1].split(" ms")[0]) for r in reports]
    assert all(500 <= w < 5000 for w in waited), waited  # MEGAMOE_TIMEOUT_S=0.5 measured with %globaltimer
    assert "megamoe timeout: rank 0 sm" in out, out  # the device printf got through as well
