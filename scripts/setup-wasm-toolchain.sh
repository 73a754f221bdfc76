#!/usr/bin/env bash
# Makes the pinned Rust (rust-toolchain.toml, 1.95.0) build for wasm32-unknown-unknown where
# `rustup target add` cannot download anything: Debian's source-only rust-src 1.95.0 package
# (trixie-backports, fetched with a private apt configuration, no system change) is placed in a
# hard-linked copy of the toolchain's sysroot, where `cargo -Zbuild-std` looks for it.
# Also installs wasm-bindgen-cli 0.2.130 (the version the specinfer-wasm crate pins).
# Usage: scripts/setup-wasm-toolchain.sh PREFIX; then `source PREFIX/env.sh`.
set -euo pipefail
PREFIX=$(mkdir -p "${1:?usage: $0 PREFIX}" && cd "$1" && pwd)
RUST_SRC=${RUST_SRC_VERSION:-1.95.0+dfsg1-2~bpo13+1}
cd "$(dirname "$0")/.."
want=$(rustc -V | awk '{print $2}')
if [ ! -e "$PREFIX/toolchain/lib/rustlib/src/rust/library/std" ]; then
  echo "specinfer: fetching Debian rust-src $RUST_SRC for wasm32 builds" >&2
  mirror=${DEBIAN_MIRROR:-$(grep -rhoE '^URIs: *[^ ]+/debian$' /etc/apt/sources.list.d/ 2>/dev/null | head -1 | awk '{print $2}')}
  [ -n "$mirror" ] || mirror=$(grep -hoE '^deb [^ ]+/debian ' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')
  [ -n "$mirror" ] || { echo "no Debian archive in the apt configuration; set DEBIAN_MIRROR" >&2; exit 1; }
  apt_dir="$PREFIX/apt"
  mkdir -p "$apt_dir"/{lists/partial,cache/archives/partial} "$PREFIX/debs"
  : > "$apt_dir/status"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie-backports main" > "$apt_dir/sources.list"
  opts=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
        -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache" -o Dir::State::status="$apt_dir/status"
        -o Debug::NoLocking=1 -o Acquire::Languages=none)
  apt-get "${opts[@]}" update -qq
  (cd "$PREFIX/debs" && apt-get "${opts[@]}" download "rust-src=$RUST_SRC" 2>/dev/null)
  rm -rf "$PREFIX/rust-src" && mkdir -p "$PREFIX/rust-src"
  dpkg -x "$PREFIX"/debs/rust-src_*.deb "$PREFIX/rust-src"
  src=$(echo "$PREFIX"/rust-src/usr/src/rustc-*)
  [ "${src##*/rustc-}" = "$want" ] || { echo "rust-src ${src##*/rustc-} does not match rustc $want" >&2; exit 1; }
  sysroot=$(rustc --print sysroot)
  rm -rf "$PREFIX/toolchain"
  cp -al "$sysroot" "$PREFIX/toolchain" 2>/dev/null || cp -a "$sysroot" "$PREFIX/toolchain"
  mkdir -p "$PREFIX/toolchain/lib/rustlib/src"
  ln -sfn "$src" "$PREFIX/toolchain/lib/rustlib/src/rust"
fi
if ! "$PREFIX/bin/wasm-bindgen" --version 2>/dev/null | grep -q 0.2.130; then
  echo "specinfer: building wasm-bindgen-cli 0.2.130 (about 12 minutes on 2 cores, once)" >&2
  cargo install -q wasm-bindgen-cli --version =0.2.130 --root "$PREFIX" \
    --target-dir "$PREFIX/wasm-bindgen-build"
fi
cat > "$PREFIX/env.sh" <<EOT
export PATH="$PREFIX/toolchain/bin:$PREFIX/bin:\$PATH"
export RUSTC_BOOTSTRAP=1
EOT
echo "specinfer: wasm toolchain ready; source $PREFIX/env.sh" >&2
