"""The fused kernel under compute-sanitizer (gpu tier): memcheck, racecheck and synccheck each run one small call
(scripts/sanitize_fused.py: E 8, H 1024, I 512, top-6, T 64 on 8 CTAs, fresh inputs, y checked against the
reference) of the default variant (BLOCK_M 128) and of the decode variant (BLOCK_M 32), and must report nothing.
synccheck stops a kernel at its first barrier error, so a protocol slip shows here even where the output is right
(notes/fused.md, "Sanitizers": an unwaited mbarrier phase that no functional test could see)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fused_gpu import _seed, max_y_rel_l2  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NUM_TOKENS = 64  # scripts/sanitize_fused.py's call
# The tools slow every spin-wait down by orders of magnitude: the kernel's timeouts must not fire under them
SANITIZER_TIMEOUT_S = 900
# A run takes 6-25 s on an H100 (racecheck the longest)
RUN_LIMIT_S = 300
CLEAN_SUMMARY = {"memcheck": "ERROR SUMMARY: 0 errors", "synccheck": "ERROR SUMMARY: 0 errors",
                 "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}
# The script's arguments per variant: the buffer's default (BLOCK_M 128), and 8 expected rows per expert (BLOCK_M 32)
VARIANT_ARGS = {"default": [], "decode": ["--expected-tokens-per-expert", "8"]}


@pytest.mark.compile
@pytest.mark.parametrize("variant", list(VARIANT_ARGS))
def test_fused_sanitizer_variants_compile(variant: str) -> None:
    """compile tier: the variants the sanitizer runs launch build (so the carried JIT cache holds them)."""
    command = [sys.executable, str(REPO / "scripts" / "sanitize_fused.py"), "--compile-only", *VARIANT_ARGS[variant]]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANT_ARGS))
@pytest.mark.parametrize("tool", list(CLEAN_SUMMARY))
def test_fused_kernel_sanitizer_clean(tool: str, variant: str) -> None:
    from megamoe.jit.compiler import find_toolkit_tool

    sanitizer = find_toolkit_tool("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found (beside nvcc, CUDA_HOME's bin, or PATH)")
    seed = _seed()
    command = [sanitizer, "--report-api-errors", "no", "--error-exitcode", "9", "--tool", tool, sys.executable,
               str(REPO / "scripts" / "sanitize_fused.py"), "--seed", str(seed),
               "--max-rel-l2", str(max_y_rel_l2(NUM_TOKENS))]
    command += VARIANT_ARGS[variant]
    env = dict(os.environ, MEGAMOE_TIMEOUT_S=str(SANITIZER_TIMEOUT_S))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    output = result.stdout + result.stderr
    tail = "\n".join(output.splitlines()[-40:])
    assert result.returncode == 0, f"{tool} ({variant}, seed {seed}) exit {result.returncode}:\n{tail}"
    assert "sanitize_fused:" in output, f"the call did not complete under {tool} (seed {seed}):\n{tail}"
    assert CLEAN_SUMMARY[tool] in output, f"{tool} ({variant}, seed {seed}) reported:\n{tail}"
