#!/usr/bin/env bash
# Packs scripts/gpu-check.sh for a lent device machine (the workplace's H200): it has the NVIDIA
# driver and CUDA 13 but no Rust and no network, and one call carries at most 64 MiB together
# with the working tree. So the binaries are built here (cudarc loads CUDA at run time: building
# needs no CUDA), stripped and compressed, and SmolLM2 (94 MiB) travels in two parts, one per
# call, kept in /tmp between two calls made back to back (a machine stays warm 30 s):
#   1. run `scripts/gpu-device.sh stage`  carrying .gpu-bundle/model.0
#   2. run `scripts/gpu-device.sh check`  carrying .gpu-bundle/model.1 and .gpu-bundle/bin.tar.xz
# (add `2>&1 | tee $OUT/gpu-check.log` to the second for the whole log). .gpu-bundle is ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${SPECINFER_CACHE:-.cache/specinfer}/SmolLM2-135M-Instruct.Q4_1.gguf
scripts/gpu-check.sh --build
[ -f "$model" ] || ./target/release/specinfer generate --max-tokens 1 --prompt "Hi" >/dev/null
out=.gpu-bundle
rm -rf "$out"
mkdir -p "$out/bin"
strip -o "$out/bin/gpu_check" target/release/examples/gpu_check
strip -o "$out/bin/specinfer-verifier" target/release/specinfer-verifier
strip -o "$out/bin/specinfer" target/release/specinfer
tar -C "$out" -cJf "$out/bin.tar.xz" bin
rm -r "$out/bin"
# The first half as large as the first call allows (1 MiB spare), the rest with the binaries.
limit=$((64 << 20))
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
split -b $((limit - tree - (1 << 20))) -d -a 1 "$model" "$out/model."
[ ! -e "$out/model.2" ] || { echo "SmolLM2 does not fit in two calls" >&2; exit 1; }
first=$((tree + $(stat -c %s "$out/model.0")))
second=$((tree + $(stat -c %s "$out/model.1") + $(stat -c %s "$out/bin.tar.xz")))
echo "call 1 carries $((first >> 20)) MiB, call 2 $((second >> 20)) MiB (limit $((limit >> 20)) MiB, the working tree included)"
[ "$first" -le "$limit" ] && [ "$second" -le "$limit" ] || { echo "over the limit" >&2; exit 1; }
