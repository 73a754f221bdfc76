#!/usr/bin/env bash
# The CUDA engine's checks on a machine with an NVIDIA GPU (a few minutes): GPU vs CPU logits on
# SmolLM2, greedy speculative == incremental on the GPU, latency vs tree size and batch, decode
# time vs the weights' read time. Needs the NVIDIA driver and NVRTC: the system's, or the PyPI
# wheel's libnvrtc.so.12 fetched by `cargo test -p specinfer-model --features cuda --test nvrtc`
# into the model cache (give its folder in LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${SPECINFER_CACHE:-.cache/specinfer}
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$(cd "$cache" 2>/dev/null && pwd || true)"
cargo run --release -p specinfer-model --features cuda --example gpu_check
