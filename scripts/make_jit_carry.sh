#!/usr/bin/env bash
# Fill the JIT cache with every kernel variant (megamoe jit warm, the comm bench's and the dispatch tests'
# variants), then copy the entries this warm-up used (a cache hit marks its build.json) without the SASS listings
# and sources into .jit-carry/ — small enough to carry to the device machine (64 MiB limit on what travels).
# Usage: scripts/make_jit_carry.sh [a command that compiles more, run before the copy]   (then carry [".jit-carry"])
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-cache"
mkdir -p .jit-cache
stamp=$(mktemp)
python3 -m megamoe.cli jit warm > /dev/null
python3 -m megamoe.cli bench comm --compile-only > /dev/null
python3 -m megamoe.cli bench fused_multi --compile-only > /dev/null
# The dispatch/combine tests' own variants (their compile tier lists every variant the gpu and multigpu tiers launch)
python3 -m pytest -q -m compile -p no:cacheprovider tests/test_dispatch_combine.py tests/test_fused_gpu.py tests/test_fused_e2e_gpu.py tests/test_virtual_ranks_gpu.py tests/test_serving_compat_gpu.py tests/test_fused_multigpu.py tests/test_fused_sanitizers_gpu.py > /dev/null
if [ $# -gt 0 ]; then "$@" > /dev/null; fi
rm -rf .jit-carry
python3 - "$stamp" <<'PY'
import os, shutil, sys
from pathlib import Path

since = os.path.getmtime(sys.argv[1])
src, dst = Path(".jit-cache"), Path(".jit-carry")
dst.mkdir()
for meta in src.glob("*/*/build.json"):
    if meta.stat().st_mtime >= since:
        shutil.copytree(meta.parent, dst / meta.parent.relative_to(src),
                        ignore=shutil.ignore_patterns("*.sass", "*.cu"))
if (src / "compile.log").exists():
    shutil.copy(src / "compile.log", dst / "compile.log")
PY
rm -f "$stamp"
du -sh .jit-carry
