#!/usr/bin/env bash
# Builds web/pkg/ (the widget's WebAssembly and its JS glue) from the specinfer-wasm crate.
# Needs a Rust that targets wasm32-unknown-unknown (see ../shared/TOOLCHAIN.md; .ci/run sets one
# up under ~/.cache/specinfer) and wasm-bindgen-cli 0.2.130 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET_DIR=${CARGO_TARGET_DIR:-target}
RUSTC_BOOTSTRAP=1 cargo build --release -p specinfer-wasm --lib --target wasm32-unknown-unknown \
  -Zbuild-std=std,panic_abort
wasm-bindgen --target web --out-dir web/pkg --no-typescript \
  "$TARGET_DIR/wasm32-unknown-unknown/release/specinfer_wasm.wasm"
ls -l web/pkg
