#!/usr/bin/env bash
# Pack JIT caches (ignored folders of the repository root, e.g. .jit-ab .jit-tests) into .jit-pack/caches.tar.xz,
# without the SASS listings and sources, for scripts/device_batch.sh to unpack on the device machine: the cubins
# compress ~20x (77 MB of caches -> 3.9 MB), so caches that exceed the 64 MiB carry limit together travel in one call.
# Usage: scripts/pack_caches.sh DIR...   (then carry [".jit-pack"])
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 DIR..." >&2; exit 2; }
mkdir -p .jit-pack
tar -cJf .jit-pack/caches.tar.xz --exclude='*.sass' --exclude='*.cu' "$@"
du -h .jit-pack/caches.tar.xz
