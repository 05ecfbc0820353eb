#!/usr/bin/env bash
# Run a batch of steps on the device machine in one call: each step with its own time limit and log, the logs packed
# into one archive, $OUT/batch.tgz (a call returns only a few files from $OUT), also when the call's own limit cuts
# the batch short (the archive is rewritten after every step). The summary (step, exit status, seconds) and each
# log's last lines go to stdout, which the call returns.
# Usage (on the device machine, from the repository root; the JIT cache compiled here and carried):
#   scripts/device_batch.sh "tests|200|scripts/run_gpu_tests.sh -m gpu -q tests/test_gemm_gpu.py" \
#                           "sweep|150|python3 scripts/sweep_gemm.py --cases 1 6 --knobs '' cluster_n=2"
# A step is "NAME|SECONDS|COMMAND" (COMMAND runs under bash -c); a NAME ending in "@h200" runs only where nvidia-smi
# names an H200 (benchmarks whose targets assume one: a call for the nvidia-h200 kind often gets an H100), and is
# listed as skipped elsewhere. Environment: PYTHONPATH=python, the system host
# compiler, NVLink multicast off (DESIGN section 6), MEGAMOE_JIT_CACHE_DIR defaulting to .jit-run.
# Caches too large to carry as they are (64 MiB in all) travel packed: scripts/pack_caches.sh here writes
# .jit-pack/caches.tar.xz (cubins compress ~20x), carry [".jit-pack"], and this script unpacks it first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MEGAMOE_JIT_CACHE_DIR="${MEGAMOE_JIT_CACHE_DIR:-$PWD/.jit-run}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CXX=/usr/bin/g++ CC=/usr/bin/gcc
out_dir="${OUT:-$PWD/.gpu-logs}"
mkdir -p "$out_dir"
logs=$(mktemp -d)
if [ -f .jit-pack/caches.tar.xz ]; then
    python3 -c "import tarfile; tarfile.open('.jit-pack/caches.tar.xz').extractall(filter='data')" || exit 1
fi
pack() { tar czf "$out_dir/batch.tgz" -C "$logs" .; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; } > "$logs/env.txt" 2>&1
cat "$logs/env.txt"
start=$(date +%s)
on_h200=0
grep -q H200 "$logs/env.txt" && on_h200=1
for step in "$@"; do
    name="${step%%|*}"
    rest="${step#*|}"
    seconds="${rest%%|*}"
    command="${rest#*|}"
    if [[ "$name" == *@h200 && $on_h200 == 0 ]]; then
        echo "$name skipped: not an H200" | tee -a "$logs/summary.txt" | tee "$logs/$name.txt"
        pack
        continue
    fi
    step_start=$(date +%s)
    timeout "$seconds" bash -c "$command" > "$logs/$name.txt" 2>&1
    status=$?
    now=$(date +%s)
    echo "$name rc=$status $(( now - step_start ))s (at $(( now - start ))s)" | tee -a "$logs/summary.txt"
    pack
done
for step in "$@"; do
    name="${step%%|*}"
    echo "== $name (last lines)"
    tail -n 15 "$logs/$name.txt"
done
