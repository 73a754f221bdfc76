#!/usr/bin/env bash
# The device machine's half of scripts/gpu-bundle.sh. `stage` keeps what this call carried in
# /tmp; `check` keeps it too, then reassembles SmolLM2, unpacks the binaries, points cudarc at
# the machine's CUDA libraries and runs scripts/gpu-check.sh on them.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=/tmp/specinfer-gpu
mkdir -p "$stage"
for f in .gpu-bundle/*; do [ -f "$f" ] && cp "$f" "$stage/"; done
ls -l "$stage"
[ "${1:-}" = stage ] && exit 0
[ "${1:-}" = check ] || { echo "usage: $0 stage|check" >&2; exit 2; }
for f in model.0 model.1 bin.tar.xz; do
  [ -f "$stage/$f" ] || { echo "$f has not arrived: run 'stage' and 'check' back to back" >&2; exit 1; }
done
export SPECINFER_CACHE=$stage/cache
mkdir -p "$SPECINFER_CACHE"
cat "$stage/model.0" "$stage/model.1" >"$SPECINFER_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
tar -C "$stage" -xJf "$stage/bin.tar.xz"
# The binaries choose NVRTC themselves: the newest the driver supports, from the CUDA
# toolkits, the loader's path and PyPI wheels (specinfer_kernels::cuda_libs; they say which).
# The driver: where the container runtime puts it, if not on the loader's default path.
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/nvidia/lib64"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
SPECINFER_GPU_BIN=$stage/bin scripts/gpu-check.sh
