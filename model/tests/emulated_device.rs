//! The GPU engine on the emulated CUDA device: `kernels/cuda/specinfer.cu`, the file NVRTC
//! compiles for a real GPU, built as C++ for the host with each CUDA thread a fiber
//! (`specinfer_model::cuda::EmulatedDevice`), against the CPU engine on tiny random models.
//! Runs on every commit (`cargo test -p specinfer-model --features cuda --test emulated_device`);
//! what the emulation cannot show (driver, NVRTC, real concurrency, timing) is left to
//! `scripts/gpu-check.sh` on a lent GPU.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use specinfer_model::cuda::checks::{exact_checks, Report};
use specinfer_model::cuda::device::Device;
use specinfer_model::cuda::EmulatedDevice;
use specinfer_model::{Arch, Llama, ModelConfig};

fn emulated() -> Arc<dyn Device> {
    EmulatedDevice::new().shared()
}

/// Every check `gpu_check` asserts on tiny models (trees of 1, 9, 64 and 100 nodes, compaction,
/// a tree grown over two forwards, a packed batch whose caches grow past 256 positions, graphs
/// against direct launches, device argmaxes, the LM head bit for bit, the K/V pool's slots), on
/// Llama (interleaved RoPE) and Qwen2 (NEOX RoPE, qkv bias) models.
#[test]
fn the_gpu_checks_pass_on_the_emulated_device() {
    let mut r = Report::default();
    for (arch, seed) in [(Arch::Llama, 1), (Arch::Qwen2, 2)] {
        let cpu = Llama::random(ModelConfig::tiny(arch), seed, None).unwrap();
        let name = format!("{arch:?}");
        r.section(&name.clone(), |r| {
            exact_checks(r, &name, &cpu, seed, &emulated())
        });
    }
    assert!(r.failures.is_empty(), "failed: {:#?}", r.failures);
}
