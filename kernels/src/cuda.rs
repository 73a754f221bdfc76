//! The CUDA kernels' source and their run-time compilation through NVRTC (feature `cuda`).
//!
//! cudarc loads NVRTC (and, for running, the driver) dynamically, so a build with this feature
//! needs no CUDA installation; only compiling or running the kernels does. cudarc panics when a
//! library is missing, so callers check [`nvrtc_available`] first.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

/// The cudarc this crate was built with, for the GPU engine built on these kernels.
pub use cudarc;

/// All of specinfer's kernels (see `kernels/cuda/specinfer.cu` for layouts and contracts).
pub const SOURCE: &str = include_str!("../cuda/specinfer.cu");

/// The entry points [`SOURCE`] defines.
pub const KERNELS: &[&str] = &[
    "embed_rows",
    "rms_norm",
    "rope",
    "silu_mul",
    "add_bias",
    "add_into",
    "gather_rows",
    "tree_attention",
    "softmax_top_p",
];

/// Whether NVRTC can be loaded in this process.
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] to PTX for a GPU architecture such as `"sm_80"` or `"sm_90"`. Exact
/// arithmetic (no fast math), so GPU logits stay close to the CPU engine's.
pub fn compile_ptx(arch: &'static str) -> Result<Ptx, String> {
    if !nvrtc_available() {
        return Err("NVRTC (libnvrtc.so.12) cannot be loaded: install the CUDA toolkit's NVRTC or the PyPI wheel nvidia-cuda-nvrtc-cu12".into());
    }
    compile_ptx_with_opts(
        SOURCE,
        CompileOptions {
            arch: Some(arch),
            use_fast_math: Some(false),
            name: Some("specinfer.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|e| format!("NVRTC ({arch}): {e}"))
}
