#!/usr/bin/env bash
# The CUDA engine's checks on a machine with an NVIDIA GPU (a few minutes): GPU vs CPU logits on
# SmolLM2, greedy speculative == incremental on the GPU, latency vs tree size and batch, decode
# time vs the weights' read time, then the verifier service on cuda:0 over loopback QUIC. Needs
# the NVIDIA driver and NVRTC (the system's, or a PyPI wheel's folder in LD_LIBRARY_PATH).
# It builds the binaries itself (`--build` only builds them), or takes them from
# SPECINFER_GPU_BIN (a folder with gpu_check, specinfer-verifier and specinfer: how
# scripts/gpu-bundle.sh ships them to a machine without Rust).
set -euo pipefail
cd "$(dirname "$0")/.."
# The NVRTC wheel that `cargo test -p specinfer-model --features cuda --test nvrtc` fetches.
cache=${SPECINFER_CACHE:-.cache/specinfer}
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$(cd "$cache" 2>/dev/null && pwd || true)"
if [ -n "${SPECINFER_GPU_BIN:-}" ]; then
  gpu_check=$SPECINFER_GPU_BIN/gpu_check
  verifier=$SPECINFER_GPU_BIN/specinfer-verifier
  client=$SPECINFER_GPU_BIN/specinfer
else
  cargo build --release -p specinfer-model --features cuda --example gpu_check
  cargo build --release -p specinfer-verifier --features cuda --bin specinfer-verifier
  cargo build --release -p specinfer-edge --bin specinfer
  gpu_check=target/release/examples/gpu_check
  verifier=target/release/specinfer-verifier
  client=target/release/specinfer
  [ "${1:-}" != --build ] || exit 0
fi
"$gpu_check"

# The verifier service on the GPU: serve with --device cuda:0 on loopback, generate through it
# (greedy, the default tree) and through the embedded CPU verifier, and compare the answers.
log=$(mktemp)
"$verifier" serve --device cuda:0 --self-signed --insecure-no-auth --listen 127.0.0.1:4433 \
  >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do grep -q "listening on" "$log" && break; sleep 1; done
grep -q "listening on" "$log" || { cat "$log"; echo "the GPU verifier did not start" >&2; exit 1; }
pin=$(sed -n 's/.*fingerprint (pin it on clients): //p' "$log")
prompt="Write a haiku about the sea."
gpu=$("$client" generate --server 127.0.0.1:4433 --pin "$pin" --max-tokens 64 --json \
  --prompt "$prompt")
cpu=$("$client" generate --max-tokens 64 --json --prompt "$prompt")
echo "GPU service: $gpu"
echo "CPU embedded: $cpu"
ids() { sed 's/.*"token_ids":\[\([^]]*\)\].*/\1/'; }
if [ "$(echo "$gpu" | ids)" = "$(echo "$cpu" | ids)" ]; then
  echo "GPU service answer == CPU answer (greedy)"
else
  echo "GPU service answer differs from the CPU answer (greedy; a near-tie between the two engines' logits can do this)"
fi
# Sampled through the GPU service: the default tree's draws verified by the device's walk
# (sample_walk); a walk that fails falls back to the host and says so in the verifier's log.
sampled=$("$client" generate --server 127.0.0.1:4433 --pin "$pin" --max-tokens 64 --json \
  --mode sample --seed 7 --prompt "$prompt")
echo "GPU service, sampled: $sampled"
if grep -q "sampled verification on the device failed" "$log"; then
  grep "sampled verification on the device failed" "$log" | head -3
  echo "the device's sampled verification failed (the host walked instead)" >&2
  exit 1
fi
echo "GPU service sampled with the device's walk"
