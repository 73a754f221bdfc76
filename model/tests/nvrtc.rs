//! Every CUDA kernel compiles to PTX through NVRTC for Ampere (sm_80) and Hopper (sm_90). Needs no
//! GPU: NVRTC comes from the PyPI wheel `nvidia-cuda-nvrtc-cu12`, fetched into the model cache.
//! Run with `cargo test --release -p specinfer-model --features cuda --test nvrtc`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use specinfer_kernels::cuda::{compile_ptx, KERNELS};
use specinfer_model::fetch;

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90() {
    let cache = std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/specinfer"));
    fetch::ensure(&fetch::NVRTC_BUILTINS, &cache).unwrap();
    let nvrtc = fetch::ensure(&fetch::NVRTC, &cache).unwrap();
    // Loaded by path here, cudarc's later dlopen by name finds it; it opens its builtins from
    // its own folder.
    let lib = unsafe { libloading::Library::new(&nvrtc) }.expect("loading the fetched NVRTC");
    std::mem::forget(lib);
    for arch in ["sm_80", "sm_90"] {
        let ptx = compile_ptx(arch).unwrap_or_else(|e| panic!("{e}"));
        let src = ptx.to_src();
        assert!(
            src.contains(&format!(".target {arch}")),
            "{arch}: wrong target"
        );
        for k in KERNELS {
            assert!(
                src.contains(&format!(".entry {k}(")),
                "{arch}: kernel {k} missing from the PTX"
            );
        }
        eprintln!(
            "{arch}: {} kernels, {} bytes of PTX",
            KERNELS.len(),
            src.len()
        );
    }
}
