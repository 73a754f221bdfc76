//! With feature `cuda`, builds the emulated CUDA device: `cuda/specinfer.cu` (the file NVRTC
//! compiles at run time) compiled as C++ for this machine behind `cuda/emulation.h`.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for f in [
        "cuda/specinfer.cu",
        "cuda/emulation.h",
        "cuda/emulated_device.cpp",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("cuda/emulated_device.cpp")
        .include("cuda")
        // IEEE arithmetic as written (no contraction into fused multiply-adds, no fast math):
        // the kernels' own fmaf calls are the only fused operations, as in their contract.
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .warnings(false)
        .opt_level(2)
        .compile("specinfer_emulated_device");
}
