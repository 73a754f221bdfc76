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
    "rms_norm",
    "rope",
    "linear_f32",
    "linear_bf16",
    "swiglu",
    "add_into",
    "gather_rows",
    "store_kv_f32",
    "store_kv_bf16",
    "tree_attention_f32",
    "tree_attention_bf16",
    "attention_combine",
    "argmax_rows",
    "softmax_top_p",
    "sample_walk",
];

/// Whether NVRTC can be loaded in this process.
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

const NVRTC_MISSING: &str = "NVRTC cannot be loaded (cudarc opens libnvrtc.so or libnvrtc.so.12): \
     on a GPU machine `specinfer_kernels::cuda_libs::prepare` links the NVRTC the driver supports \
     (.so.12 or .so.13, the CUDA toolkit's or the PyPI wheel nvidia-cuda-nvrtc-cu12/-cu13's)";

/// The version of the NVRTC this process loaded.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    if !nvrtc_available() {
        return Err(NVRTC_MISSING.into());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC's documented query, with valid out pointers.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {status:?}"));
    }
    Ok((major, minor))
}

/// Compiles [`SOURCE`] to PTX for a GPU architecture such as `"sm_80"` or `"sm_90"`. Exact
/// arithmetic (no fast math), so GPU logits stay close to the CPU engine's.
pub fn compile_ptx(arch: &'static str) -> Result<Ptx, String> {
    if !nvrtc_available() {
        return Err(NVRTC_MISSING.into());
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

/// Compiles [`SOURCE`] to CUBIN (machine code) for exactly the architecture `sm_XY`, with the
/// same exact arithmetic as [`compile_ptx`]. A driver loads a CUBIN made by any NVRTC of its own
/// major version (CUDA's minor-version compatibility), where PTX from an NVRTC newer than the
/// driver is refused; load it with `Ptx::from_binary`.
pub fn compile_cubin(major: i32, minor: i32) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    if !nvrtc_available() {
        return Err(NVRTC_MISSING.into());
    }
    let arch = format!("sm_{major}{minor}");
    let src = std::ffi::CString::new(SOURCE).expect("the kernel source has no NUL");
    let prog = result::create_program(&src, Some(c"specinfer.cu"))
        .map_err(|e| format!("NVRTC ({arch}): {e}"))?;
    let options = [
        format!("--gpu-architecture={arch}"),
        "--ftz=false".into(),
        "--prec-sqrt=true".into(),
        "--prec-div=true".into(),
        "--fmad=true".into(),
    ];
    // SAFETY: `prog` is alive until destroyed below; the buffer has the size NVRTC reported.
    let compiled = unsafe {
        match result::compile_program(prog, &options) {
            Ok(()) => {
                let mut size = 0usize;
                let status = sys::nvrtcGetCUBINSize(prog, &mut size);
                if status != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(format!("NVRTC ({arch}) gave no CUBIN: {status:?}"))
                } else {
                    let mut cubin = vec![0u8; size];
                    let status = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(cubin)
                    } else {
                        Err(format!("NVRTC ({arch}): nvrtcGetCUBIN {status:?}"))
                    }
                }
            }
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(format!("NVRTC ({arch}): {e}: {log}"))
            }
        }
    };
    // SAFETY: created above and not destroyed before.
    let _ = unsafe { result::destroy_program(prog) };
    compiled
}

/// The emulated device's launcher: [`SOURCE`] compiled as C++ for this machine (see
/// `kernels/cuda/emulated_device.cpp`), each CUDA thread a fiber.
pub mod emulated {
    use std::ffi::{c_char, c_int, c_void, CString};

    extern "C" {
        fn specinfer_emulated_launch(
            name: *const c_char,
            grid: *const u32,
            block: *const u32,
            shared: u32,
            params: *mut *mut c_void,
            sizes: *const usize,
            count: usize,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
    }

    /// Runs kernel `name` over `grid` x `block` threads with `shared` bytes of dynamic shared
    /// memory, as `cuLaunchKernel` would: `params[i]` points to argument i's value, of
    /// `sizes[i]` bytes (checked against the kernel's signature). Returns when every block has
    /// finished; a barrier or shuffle some threads never reach, or a launch outside the
    /// device's limits, is an `Err` naming it.
    ///
    /// # Safety
    /// The arguments must be what the kernel reads and writes: every pointer argument a host
    /// address holding what the kernel touches through it, for the whole launch.
    pub unsafe fn launch(
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        params: &mut [*mut c_void],
        sizes: &[usize],
    ) -> Result<(), String> {
        assert_eq!(params.len(), sizes.len(), "one size per parameter");
        let name = CString::new(name).map_err(|_| "a kernel name with a NUL".to_string())?;
        let (grid, block) = ([grid.0, grid.1, grid.2], [block.0, block.1, block.2]);
        let mut err = vec![0u8; 512];
        // SAFETY: every pointer is valid for the call (err for err.len() bytes); the caller
        // vouches for the kernel's arguments.
        let rc = unsafe {
            specinfer_emulated_launch(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared,
                params.as_mut_ptr(),
                sizes.as_ptr(),
                params.len(),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(String::from_utf8_lossy(&err[..end]).into_owned())
    }
}
