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

/// The device's verification distribution (`softmax_top_p`, the `distribution_row` the sampled
/// walk uses) equals the host's `specinfer_kernels::sampling::distribution` bit for bit, so
/// that both decide alike for the same uniforms: rows with ties, -inf (a restricted head's
/// outside tokens) and a dominant token, several temperatures and top-p values.
#[test]
fn the_device_distribution_equals_the_hosts_bit_for_bit() {
    use rand::{Rng, SeedableRng};
    use specinfer_model::cuda::device::{Arg, DeviceBuf, Kernel, Launch};
    let dev = emulated();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    let (rows, vocab) = (6usize, 3000usize);
    let mut checked = 0;
    for (temperature, top_p) in [
        (1.0f32, 1.0f32),
        (0.8, 0.95),
        (0.3, 0.5),
        (1.7, 0.9),
        (0.6, 0.999),
    ] {
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| match (i / vocab, rng.random_range(0..10)) {
                (0, _) if i % vocab == 17 => 30.0,
                (_, 0) => f32::NEG_INFINITY,
                (_, 1) => 1.25,
                _ => rng.random_range(-6.0f32..6.0),
            })
            .collect();
        let device_logits = DeviceBuf::from_host(&dev, &logits).unwrap();
        let probs = DeviceBuf::<f32>::zeros(&dev, rows * vocab).unwrap();
        // SAFETY: rows x vocab floats in and out; 256 floats of shared memory for 256 threads.
        unsafe {
            dev.launch(
                Kernel::SoftmaxTopP,
                Launch {
                    grid: (rows as u32, 1, 1),
                    block: (256, 1, 1),
                    shared_bytes: 256 * 4,
                },
                &[
                    probs.arg(),
                    device_logits.arg(),
                    Arg::I32(vocab as i32),
                    Arg::F32(temperature),
                    Arg::F32(top_p),
                ],
            )
        }
        .unwrap();
        let device = probs.to_host().unwrap();
        for r in 0..rows {
            let host = specinfer_kernels::sampling::distribution(
                &logits[r * vocab..(r + 1) * vocab],
                temperature,
                0,
                top_p,
            );
            let got = &device[r * vocab..(r + 1) * vocab];
            let differ = host
                .iter()
                .zip(got)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "T {temperature}, top-p {top_p}, row {r}: {differ} of {vocab} differ"
            );
            checked += 1;
        }
    }
    println!("{checked} rows of {vocab} identical");
}
