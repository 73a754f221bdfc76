//! The GPU engine on the emulated CUDA device: `kernels/cuda/specinfer.cu`, the file NVRTC
//! compiles for a real GPU, built as C++ for the host with each CUDA thread a fiber
//! (`specinfer_model::cuda::EmulatedDevice`), against the CPU engine on tiny random models.
//! Runs on every commit (`cargo test -p specinfer-model --features cuda --test emulated_device`);
//! what the emulation cannot show (driver, NVRTC, real concurrency, timing) is left to
//! `scripts/gpu-check.sh` on a lent GPU.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use specinfer_model::cuda::checks::{
    exact_checks, on_cpu, on_gpu, prefill_gpu, worst_difference, Report,
};
use specinfer_model::cuda::device::Device;
use specinfer_model::cuda::{CudaKvCache, CudaLlama, CudaSeqTree, EmulatedDevice, Precision};
use specinfer_model::{Arch, Llama, Logits, ModelConfig, SampleWalk};
use specinfer_wire::TokenTree;

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

fn prefilled(gpu: &CudaLlama, prompt: &[u32]) -> CudaKvCache {
    let mut cache = gpu.new_cache().unwrap();
    prefill_gpu(gpu, &mut cache, prompt);
    cache
}

fn logits_of(gpu: &CudaLlama, cache: &mut CudaKvCache, tree: &TokenTree) -> Logits {
    on_gpu(gpu, cache, tree, 0).unwrap()
}

/// The CPU engine's logits of `tree` after `prompt`.
fn on_the_cpu(cpu: &Llama, prompt: &[u32], tree: &TokenTree) -> Logits {
    let mut kv =
        specinfer_model::KvCache::with_precision(cpu.config(), specinfer_model::KvPrecision::F32);
    cpu.prefill(&mut kv, prompt).unwrap();
    on_cpu(cpu, &mut kv, tree).unwrap()
}

/// Whether nodes `0..n` of `a` and `b` are the same bits.
fn same(a: &Logits, b: &Logits, n: usize) -> bool {
    (0..n).all(|i| a.node(i) == b.node(i))
}

/// A panic in the middle of a forward's graph capture (an assertion in the launch code) must
/// not leave the device capturing: the next forward works and gives the right logits.
#[test]
fn a_panic_during_a_graph_capture_leaves_the_engine_usable() {
    let cpu = Llama::random(ModelConfig::tiny(Arch::Llama), 11, None).unwrap();
    let device = EmulatedDevice::new();
    let gpu = CudaLlama::upload_to(&cpu, device.shared(), Precision::F32, 16 << 20).unwrap();
    let mut cache = prefilled(&gpu, &[1, 2, 3, 4]);
    // A new shape's first forward (6 rows: the bucket of 8) captures its layers: the fault
    // lands inside the capture.
    let tree = TokenTree::chain(&[5, 6, 7, 8, 9, 10]);
    device.panic_at_launch(device.issued() + 5);
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        gpu.forward(&mut [CudaSeqTree {
            cache: &mut cache,
            tree: &tree,
            first: 0,
        }])
    }));
    assert!(failed.is_err(), "the injected fault did not fire");
    let mut cache = prefilled(&gpu, &[1, 2, 3, 4]);
    let got = logits_of(&gpu, &mut cache, &tree);
    let want = on_the_cpu(&cpu, &[1, 2, 3, 4], &tree);
    let worst = worst_difference(&got, &want, 0..tree.len());
    assert!(worst < 1e-3, "max |difference| from the CPU engine {worst}");
}

/// The device walk reads row i for node i: logits of a forward that started past the root
/// (`first > 0`) are refused with an error, not walked over the wrong rows.
#[test]
fn a_device_walk_over_logits_not_from_the_root_is_an_error() {
    use specinfer_wire::{DrawMode, Proposals, SparseDist};
    let cpu = Llama::random(ModelConfig::tiny(Arch::Qwen2), 12, None).unwrap();
    let gpu = CudaLlama::upload_to(&cpu, emulated(), Precision::F32, 16 << 20).unwrap();
    let mut cache = prefilled(&gpu, &[1, 2, 3]);
    let mut tree = TokenTree::root(4);
    for t in [5, 6, 7] {
        tree.push(0, t);
    }
    let tree = tree
        .with_proposals(Proposals {
            mode: DrawMode::WithoutReplacement,
            dists: vec![SparseDist {
                node: 0,
                ids: vec![5, 6, 7, 8],
                probs: vec![0.25; 4],
            }],
            drawn_from: vec![0; 3],
        })
        .unwrap();
    let mut head = tree.clone();
    head.truncate(2);
    gpu.forward(&mut [CudaSeqTree {
        cache: &mut cache,
        tree: &head,
        first: 0,
    }])
    .unwrap();
    let rest = gpu
        .forward(&mut [CudaSeqTree {
            cache: &mut cache,
            tree: &tree,
            first: 2,
        }])
        .unwrap()
        .remove(0);
    let walk = SampleWalk::new(&tree, 0.8, 1.0, vec![0.5; 4]).unwrap();
    match rest.walk_on_device(&walk) {
        Some(Err(e)) => assert!(e.to_string().contains("start at the root"), "{e}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A head wider than the attention kernel holds (256) is refused at upload, not overflowed.
#[test]
fn a_head_dim_over_256_is_refused_at_upload() {
    let cfg = ModelConfig {
        d_model: 288,
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 288,
        ..ModelConfig::tiny(Arch::Llama)
    };
    let cpu = Llama::random(cfg, 13, None).unwrap();
    let err = CudaLlama::upload_to(&cpu, emulated(), Precision::F32, 16 << 20)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("head_dim 288"), "{err}");
}

/// Forwards of 1 to 20 nodes replay graphs captured per power-of-two bucket (six of them, rows
/// past a batch's are padding), and every one gives the bits of kernels launched one by one.
#[test]
fn graphs_are_kept_per_shape_bucket_and_padding_changes_nothing() {
    let cpu = Llama::random(ModelConfig::tiny(Arch::Qwen2), 14, None).unwrap();
    let gpu = CudaLlama::upload_to(&cpu, emulated(), Precision::F32, 16 << 20).unwrap();
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    // Twice over: the first pass grows the workspace (which drops the graphs over the old
    // buffers), the second replays graphs captured over the final one.
    for nodes in (1..=20u32).chain(1..=20) {
        let mut tree = TokenTree::root(6);
        for i in 1..nodes {
            tree.push((i - 1) / 2, (7 * i) % 101);
        }
        gpu.set_graphs(true);
        let mut cache = prefilled(&gpu, &prompt);
        let replayed = logits_of(&gpu, &mut cache, &tree);
        gpu.set_graphs(false);
        let mut cache = prefilled(&gpu, &prompt);
        let direct = logits_of(&gpu, &mut cache, &tree);
        assert!(
            same(&replayed, &direct, tree.len()),
            "{nodes} nodes: a replayed graph differs"
        );
    }
    // Buckets 1, 2, 4, 8, 16 and 32 rows (the prompt's 8-row prefill shares the 8 bucket).
    assert_eq!(gpu.graphs_cached(), 6);
    // At most two kept: the least recently used bucket makes room, and a shape whose graph was
    // dropped is captured again, with the same bits.
    gpu.set_graph_limit(2);
    let mut reference = None;
    for nodes in [3u32, 1, 20, 3] {
        let tree = TokenTree::chain(&(0..nodes).map(|i| (5 * i + 2) % 101).collect::<Vec<_>>());
        let mut cache = prefilled(&gpu, &prompt);
        let logits = logits_of(&gpu, &mut cache, &tree);
        assert!(
            gpu.graphs_cached() <= 2,
            "{} graphs kept",
            gpu.graphs_cached()
        );
        if nodes == 3 {
            match &reference {
                None => reference = Some(logits),
                Some(first) => assert!(
                    same(first, &logits, tree.len()),
                    "a recaptured graph differs"
                ),
            }
        }
    }
}

/// Attention is split over blocks of absolute positions (256 for this model): a path's logits
/// in one tree forward (a sibling beside every node of it, so a node's slot is not its
/// position) equal, bit for bit, those of decoding it one token at a time, across the boundary
/// at position 256, and stay within the f32 tolerance of the CPU engine's.
#[test]
fn attention_splits_keep_trees_and_incremental_decoding_identical() {
    use rand::{Rng, SeedableRng};
    let cpu = Llama::random(ModelConfig::tiny(Arch::Llama), 15, None).unwrap();
    let gpu = CudaLlama::upload_to(&cpu, emulated(), Precision::F32, 16 << 20).unwrap();
    assert_eq!(specinfer_model::cuda::attention_split(512), (2, 256));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
    let ids: Vec<u32> = (0..262).map(|_| rng.random_range(0..101)).collect();
    let mut cache = prefilled(&gpu, &ids[..250]);
    // The path ids[250..] at nodes 0, 2, 4, ...; node 2k + 1 a sibling of node 2k + 2.
    let mut tree = TokenTree::root(ids[250]);
    let mut path = vec![0usize];
    for &t in &ids[251..] {
        let parent = *path.last().unwrap() as u32;
        tree.push(parent, (t + 1) % 101);
        path.push(tree.push(parent, t) as usize);
    }
    let at_once = logits_of(&gpu, &mut cache, &tree);
    let mut cache = prefilled(&gpu, &ids[..250]);
    for (i, &t) in ids[250..].iter().enumerate() {
        let one = logits_of(&gpu, &mut cache, &TokenTree::root(t));
        assert!(
            one.node(0) == at_once.node(path[i]),
            "position {}: tree and incremental differ",
            250 + i
        );
        gpu.compact(&mut cache, &[0]).unwrap();
    }
    let want = on_the_cpu(&cpu, &ids[..250], &tree);
    let worst = worst_difference(&at_once, &want, 0..tree.len());
    assert!(worst < 1e-3, "max |difference| from the CPU engine {worst}");
}

/// The emulated device refuses launches a driver would (block and grid outside the limits, too
/// much shared memory, arguments that do not match the kernel's signature), and a warp shuffle
/// some lanes never reach (a block of 48 threads: its second warp has 16) is the launch's error,
/// not a hang.
#[test]
fn the_emulated_device_checks_launches_and_reports_a_partial_warp() {
    use specinfer_model::cuda::device::{Arg, DeviceBuf, Kernel, Launch};
    let dev = emulated();
    let (rows, out, inp) = (2usize, 4usize, 64usize);
    let x = DeviceBuf::from_host(&dev, &vec![0.5f32; rows * inp]).unwrap();
    let w = DeviceBuf::from_host(&dev, &vec![0.25f32; out * inp]).unwrap();
    let y = DeviceBuf::<f32>::zeros(&dev, rows * out).unwrap();
    let args = [
        y.arg(),
        x.arg(),
        w.arg(),
        Arg::Ptr(0),
        Arg::I32(rows as i32),
        Arg::I32(out as i32),
        Arg::I32(inp as i32),
    ];
    let launch = |block: u32, grid: u32, shared: u32, args: &[Arg]| {
        let shape = Launch {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_bytes: shared,
        };
        // SAFETY: the buffers hold what linear_f32 reads and writes for these sizes.
        unsafe { dev.launch(Kernel::LinearF32, shape, args) }
            .err()
            .map(|e| e.to_string())
    };
    assert_eq!(launch(128, 1, 0, &args), None);
    assert_eq!(y.to_host().unwrap(), vec![8.0; rows * out]);
    let refused = [
        (launch(2048, 1, 0, &args), "invalid block"),
        (launch(128, 0, 0, &args), "invalid grid"),
        (launch(128, 1, 64 << 10, &args), "dynamic shared memory"),
        (launch(128, 1, 0, &args[..6]), "takes 7 arguments"),
        (
            launch(128, 1, 0, &[&[Arg::I32(0)], &args[1..]].concat()),
            "argument 0 is 8 bytes",
        ),
        (launch(48, 1, 0, &args), "reached by 16 of its 32 lanes"),
    ];
    for (err, want) in refused {
        let err = err.unwrap_or_else(|| panic!("a launch that should fail ({want}) ran"));
        assert!(err.contains(want), "{err:?} does not say {want:?}");
    }
}
