//! Every CUDA kernel compiles through NVRTC, to PTX and to CUBIN, for Ampere (sm_80) and Hopper
//! (sm_90). Needs no
//! GPU: NVRTC comes from the PyPI wheel `nvidia-cuda-nvrtc-cu12`, fetched into the model cache.
//! Run with `cargo test --release -p specinfer-model --features cuda --test nvrtc`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use specinfer_kernels::cuda::{compile_cubin, compile_ptx, nvrtc_version, KERNELS};
use specinfer_kernels::cuda_libs::loaded_library;
use specinfer_model::fetch;

#[test]
fn every_kernel_compiles_to_ptx_and_cubin_for_sm80_and_sm90() {
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
    // The version and the file the process really loaded, as the GPU engine reports them.
    assert_eq!(nvrtc_version().unwrap(), (12, 8));
    let loaded = loaded_library("libnvrtc").expect("NVRTC is in this process's map");
    assert_eq!(
        loaded.canonicalize().unwrap(),
        nvrtc.canonicalize().unwrap()
    );
    // Machine code for the exact architecture: an ELF image naming every kernel.
    for (major, minor) in [(8, 0), (9, 0)] {
        let cubin = compile_cubin(major, minor).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "sm_{major}{minor}: not an ELF image"
        );
        for k in KERNELS {
            assert!(
                cubin.windows(k.len()).any(|w| w == k.as_bytes()),
                "sm_{major}{minor}: kernel {k} missing from the CUBIN"
            );
        }
        eprintln!("sm_{major}{minor}: {} bytes of CUBIN", cubin.len());
    }
    // An architecture NVRTC does not know is an error in words, not a crash.
    let err = compile_cubin(1, 0).unwrap_err();
    assert!(err.contains("sm_10"), "{err}");
}
