#!/usr/bin/env bash
# Builds web/pkg/: the widget's WebAssembly and its JS glue (from the specinfer-wasm crate), and
# vendor.js, the answer renderer (web/render.js with marked, DOMPurify and highlight.js, pinned
# by web/package-lock.json, bundled by esbuild).
# Needs a Rust that targets wasm32-unknown-unknown (see ../shared/TOOLCHAIN.md; .ci/run sets one
# up under ~/.cache/specinfer), wasm-bindgen-cli 0.2.130 on PATH, and npm.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET_DIR=${CARGO_TARGET_DIR:-target}
RUSTC_BOOTSTRAP=1 cargo build --release -p specinfer-wasm --lib --target wasm32-unknown-unknown \
  -Zbuild-std=std,panic_abort
wasm-bindgen --target web --out-dir web/pkg --no-typescript \
  "$TARGET_DIR/wasm32-unknown-unknown/release/specinfer_wasm.wasm"
# Exactly the locked versions (npm ci checks their integrity hashes); no install scripts run.
(cd web && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error &&
  node_modules/.bin/esbuild render.js --bundle --format=esm --minify --legal-comments=eof \
    --outfile=pkg/vendor.js --log-level=warning)
ls -l web/pkg
