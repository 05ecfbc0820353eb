#!/usr/bin/env bash
# Run the GPU tiers on the device machine: PYTHONPATH=python, the JIT cache carried from the CPU machine,
# logs under $OUT when set. Usage: scripts/run_gpu_tests.sh [pytest args...] (default: -m "gpu or multigpu")
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The carried cache: .jit-carry (scripts/make_jit_carry.sh) when present, else .jit-cache
if [ -z "${MEGAMOE_JIT_CACHE_DIR:-}" ]; then
  if [ -d "$PWD/.jit-carry" ]; then MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-carry"; else MEGAMOE_JIT_CACHE_DIR="$PWD/.jit-cache"; fi
fi
export MEGAMOE_JIT_CACHE_DIR
# NVLink multicast stays off (DESIGN section 6)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Host C++ built there must use the system compiler (the image's /opt/gcc build segfaulted at iostream use)
export CXX=/usr/bin/g++ CC=/usr/bin/gcc
LOG_DIR="${OUT:-$PWD/.gpu-logs}"
mkdir -p "$LOG_DIR"
count_compiles() { [ -f "$MEGAMOE_JIT_CACHE_DIR/compile.log" ] && wc -l < "$MEGAMOE_JIT_CACHE_DIR/compile.log" || echo 0; }

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)" || true
  nvcc --version | tail -2
} 2>&1 | tee "$LOG_DIR/env.txt"

before=$(count_compiles)
if [ $# -eq 0 ]; then set -- -m "gpu or multigpu"; fi
python3 -m pytest -v -p no:cacheprovider "$@" 2>&1 | tee "$LOG_DIR/pytest.txt"
status=${PIPESTATUS[0]}
after=$(count_compiles)
echo "jit: $((after - before)) nvcc compilations during this run (cache $MEGAMOE_JIT_CACHE_DIR)" | tee -a "$LOG_DIR/pytest.txt"
exit "$status"
