#!/usr/bin/env bash
# `megamoe bench comm` on the device machine: one process per visible GPU (>= 2), PYTHONPATH=python, the JIT cache
# carried from the CPU machine (fill it there with: megamoe bench comm --compile-only), table and JSON under $OUT
# when set. Usage: scripts/bench_comm.sh [megamoe bench comm args...] (e.g. --tokens 128 --iters 100)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${MEGAMOE_JIT_CACHE_DIR:-}" ]; then  # the carried cache (scripts/make_jit_carry.sh) when present
  if [ -d "$PWD/.jit-carry" ]; then MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-carry"; else MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-cache"; fi
fi
export MEGAMOE_JIT_CACHE_DIR
# NVLink multicast stays off (DESIGN section 6); the bench sets these in every rank as well
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG_DIR="${OUT:-$PWD/.gpu-logs}"
mkdir -p "$LOG_DIR"
count_compiles() { [ -f "$MEGAMOE_JIT_CACHE_DIR/compile.log" ] && wc -l < "$MEGAMOE_JIT_CACHE_DIR/compile.log" || echo 0; }

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
  nvidia-smi topo -m || true
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$LOG_DIR/bench-comm-env.txt"

before=$(count_compiles)
COLUMNS="${COLUMNS:-240}" python3 -m megamoe.cli bench comm --json "$LOG_DIR/megamoe-bench-comm.json" "$@" 2>&1 \
  | tee "$LOG_DIR/bench-comm.txt"
status=${PIPESTATUS[0]}
after=$(count_compiles)
echo "jit: $((after - before)) nvcc compilations during this run (cache $MEGAMOE_JIT_CACHE_DIR)" | tee -a "$LOG_DIR/bench-comm.txt"
exit "$status"
