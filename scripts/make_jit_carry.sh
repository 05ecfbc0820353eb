#!/usr/bin/env bash
# Fill the JIT cache with every kernel variant (megamoe jit warm + the comm bench's variants), then copy it
# without the SASS listings and sources into .jit-carry/ — small enough to carry to the device machine
# (64 MiB limit on what travels). Usage: scripts/make_jit_carry.sh   (then carry [".jit-carry"])
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-cache"
python3 -m megamoe.cli jit warm > /dev/null
python3 -m megamoe.cli bench comm --compile-only > /dev/null
rm -rf .jit-carry
python3 -c "import shutil; shutil.copytree('.jit-cache', '.jit-carry', ignore=shutil.ignore_patterns('*.sass', '*.cu'))"
du -sh .jit-carry
