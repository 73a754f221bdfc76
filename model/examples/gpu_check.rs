//! The GPU checks of the CUDA engine, in one run (`scripts/gpu-check.sh` on a machine with an
//! NVIDIA GPU), ordered so that the first minutes on a device answer the most:
//!
//! 1. exact references, asserted: the device's projections equal their CPU emulation
//!    (`specinfer_kernels::projection::warp_linear`) bit for bit, f32 and bf16 weights; GPU logits
//!    against the CPU engine's within 1e-3 on models whose CPU path is exact f32 (tiny random
//!    Llama and Qwen2 models, interleaved and NEOX RoPE, qkv bias; then the default SSM), f32
//!    weights and K/V on the GPU: trees up to 100 nodes, a tree grown in two calls (`first > 0`), a
//!    packed batch of sequences with different committed lengths, compaction (a slot-table
//!    update), device argmaxes against the host's, the K/V pool getting every slot back, and a
//!    forward replayed from a captured CUDA graph against its kernels launched one by one;
//! 2. timings on SmolLM2: verification latency against tree size (1..128 nodes) and batch (1..16
//!    sessions), single-token decode time against the time to read the weights once;
//! 3. SmolLM2 (bf16 weights and K/V on the GPU, the serving default) against the CPU engine (reported:
//!    its CPU path quantizes activations to 8 bits) and greedy speculative against incremental
//!    decoding on the GPU, asserted identical (every kernel sums in a fixed order whatever the
//!    batch), a divergence reported with the logit gap at that token.
//!
//! No check stops the run: each section's failure or panic is recorded, every section runs, and
//! the run fails at the end if an asserted check did.

use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use specinfer_kernels::sampling::argmax;
use specinfer_model::cuda::checks::{
    err, exact_checks, generate, on_cpu, on_gpu, prefill_gpu, random_tree, walk_check,
    worst_difference, Report, KV_POOL_BYTES,
};
use specinfer_model::cuda::device::Device;
use specinfer_model::cuda::{CudaDevice, CudaKvCache, CudaLlama, CudaSeqTree, Precision};
use specinfer_model::{fetch, load_gguf, Arch, KvCache, Llama, ModelConfig};
use specinfer_wire::TokenTree;

fn main() {
    // First of all: may re-execute this program with the CUDA libraries the driver supports.
    match specinfer_kernels::cuda_libs::prepare() {
        Ok(chosen) => println!("CUDA libraries: {chosen}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    let mut r = Report::default();
    let dev: Arc<dyn Device> = match CudaDevice::open(0) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            r.check("opening cuda:0", false, e.to_string());
            finish(r);
        }
    };

    r.section("Exact references: tiny random f32 models (asserted)", |r| {
        for (arch, seed) in [(Arch::Llama, 1), (Arch::Qwen2, 2)] {
            let cpu = Llama::random(ModelConfig::tiny(arch), seed, None).map_err(err)?;
            exact_checks(r, &format!("{arch:?}"), &cpu, seed, &dev)?;
        }
        Ok(())
    });
    r.section("Exact references: the default SSM, f32 (asserted)", |r| {
        let ssm = Llama::from_safetensors(std::path::Path::new("models/ssm"))
            .map_err(|e| format!("models/ssm (run from the repository root): {e}"))?;
        exact_checks(r, "default SSM", &ssm, 3, &dev)
    });

    let cache_dir = fetch::cache_dir();
    let smollm2 = fetch::ensure(&fetch::SMOLLM2_135M, &cache_dir)
        .map_err(err)
        .and_then(|p| load_gguf(&p).map_err(err));
    let (cpu, tok) = match smollm2 {
        Ok(m) => m,
        Err(e) => {
            r.check("SmolLM2", false, format!("cannot load it: {e}"));
            finish(r);
        }
    };
    let t = Instant::now();
    let gpu = match CudaLlama::upload_to(&cpu, dev.clone(), Precision::Bf16, KV_POOL_BYTES) {
        Ok(g) => g,
        Err(e) => {
            r.check("SmolLM2 on the GPU", false, e.to_string());
            finish(r);
        }
    };
    println!(
        "\nuploaded SmolLM2-135M in {:.2} s ({})",
        t.elapsed().as_secs_f64(),
        gpu.runtime()
    );
    let prompt = tok
        .encode(&tok.chat_prompt(&[specinfer_model::ChatMessage::new(
            "user",
            "Explain what a hash map is.",
        )]))
        .unwrap();
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);

    r.section(
        &format!(
            "Verification latency vs tree size (SmolLM2, 1 session, {} cached tokens)",
            prompt.len()
        ),
        |_| {
            let mut base = gpu.new_cache().map_err(err)?;
            prefill_gpu(&gpu, &mut base, &prompt[..prompt.len() - 1]);
            for nodes in [1usize, 2, 4, 8, 16, 32, 64, 128] {
                let tree = random_tree(&mut rng, *prompt.last().unwrap(), nodes, vocab);
                let ms = time(&gpu, &mut || {
                    gpu.forward(&mut [CudaSeqTree {
                        cache: &mut base,
                        tree: &tree,
                        first: 0,
                    }])
                    .unwrap();
                });
                println!("{nodes:>4} nodes: {ms:.2} ms");
            }
            Ok(())
        },
    );
    r.section(
        "Verification latency vs batch (SmolLM2, 16-node trees per session)",
        |_| {
            let mut caches: Vec<CudaKvCache> = (0..16)
                .map(|_| {
                    let mut c = gpu.new_cache().unwrap();
                    prefill_gpu(&gpu, &mut c, &prompt[..prompt.len() - 1]);
                    c
                })
                .collect();
            let trees: Vec<TokenTree> = (0..16)
                .map(|_| random_tree(&mut rng, *prompt.last().unwrap(), 16, vocab))
                .collect();
            for batch in [1usize, 2, 4, 8, 16] {
                let ms = time(&gpu, &mut || {
                    let mut seqs: Vec<CudaSeqTree> = caches
                        .iter_mut()
                        .zip(&trees)
                        .take(batch)
                        .map(|(cache, tree)| CudaSeqTree {
                            cache,
                            tree,
                            first: 0,
                        })
                        .collect();
                    gpu.forward(&mut seqs).unwrap();
                });
                println!(
                    "{batch:>3} sessions: {ms:.2} ms per round ({:.2} ms per session)",
                    ms / batch as f64
                );
            }
            Ok(())
        },
    );
    r.section("Decode time vs weight-read time (SmolLM2)", |_| {
        let mut base = gpu.new_cache().map_err(err)?;
        prefill_gpu(&gpu, &mut base, &prompt[..prompt.len() - 1]);
        let decode = time(&gpu, &mut || {
            let tree = TokenTree::root(*prompt.last().unwrap());
            gpu.forward(&mut [CudaSeqTree { cache: &mut base, tree: &tree, first: 0 }]).unwrap();
        });
        let weight_bytes = gpu.weight_bytes();
        let bandwidth = gpu.measure_bandwidth().map_err(err)?;
        println!(
            "single-token decode {decode:.2} ms; reading the {:.0} MB of f32 weights once at the measured {:.0} GB/s takes {:.3} ms ({:.1}x)",
            weight_bytes as f64 / 1e6,
            bandwidth / 1e9,
            weight_bytes as f64 / bandwidth * 1e3,
            decode / (weight_bytes as f64 / bandwidth * 1e3)
        );
        Ok(())
    });
    r.section(
        &format!(
            "SmolLM2: GPU vs CPU logits (reported; trees on a {}-token prompt)",
            prompt.len()
        ),
        |_| {
            for nodes in [1usize, 9, 24, 64] {
                let tree = random_tree(&mut rng, *prompt.last().unwrap(), nodes, vocab);
                let mut kv = KvCache::new(cpu.config());
                cpu.prefill(&mut kv, &prompt[..prompt.len() - 1])
                    .map_err(err)?;
                let a = on_cpu(&cpu, &mut kv, &tree)?;
                let mut gc = gpu.new_cache().map_err(err)?;
                prefill_gpu(&gpu, &mut gc, &prompt[..prompt.len() - 1]);
                let b = on_gpu(&gpu, &mut gc, &tree, 0)?;
                let same = (0..nodes)
                    .filter(|&n| argmax(a.node(n)) == argmax(b.node(n)))
                    .count();
                println!(
                "{nodes:>3} nodes: max |logit difference| {:.2e}, argmax agrees on {same}/{nodes}",
                worst_difference(&a, &b, 0..nodes)
            );
            }
            Ok(())
        },
    );
    r.section(
        "SmolLM2: sampled verification on the device keeps the LLM's distribution (asserted)",
        |r| walk_check(r, &gpu, &prompt),
    );
    r.section("SmolLM2: greedy speculative vs incremental on the GPU", |r| {
        let ssm = Llama::from_safetensors(std::path::Path::new("models/ssm")).map_err(err)?;
        let (inc, inc_gaps, inc_rounds) = generate(&gpu, &prompt, 64, None)?;
        let (spec, spec_gaps, rounds) = generate(&gpu, &prompt, 64, Some(&ssm))?;
        println!("incremental {inc_rounds} rounds, speculative {rounds} rounds");
        match inc.iter().zip(&spec).position(|(a, b)| a != b) {
            None => r.check("greedy speculative == incremental", true, format!("{} tokens identical", inc.len())),
            Some(i) => {
                // The kernels are batch invariant, so any divergence is a bug; the gap says
                // whether it sits at a near-tie (a summation order differing somewhere) or not.
                let detail = format!(
                    "first divergence at token {i}: incremental {} (top-2 gap {:.2e}), speculative {} (gap {:.2e})",
                    inc[i], inc_gaps[i], spec[i], spec_gaps[i]
                );
                r.check("greedy speculative == incremental", false, detail);
            }
        }
        Ok(())
    });
    finish(r);
}

/// Milliseconds per call of `f`, over 20 calls after a warm-up, each waited for on the device:
/// launches return before the work is done, so a clock read without waiting times queueing.
fn time(gpu: &CudaLlama, f: &mut dyn FnMut()) -> f64 {
    f();
    gpu.synchronize().expect("the device finishes its work");
    let t = Instant::now();
    for _ in 0..20 {
        f();
    }
    gpu.synchronize().expect("the device finishes its work");
    t.elapsed().as_secs_f64() / 20.0 * 1e3
}

fn finish(r: Report) -> ! {
    if r.failures.is_empty() {
        println!("\nall asserted checks passed");
        std::process::exit(0);
    }
    println!("\n{} asserted check(s) FAILED:", r.failures.len());
    for f in &r.failures {
        println!("- {f}");
    }
    std::process::exit(1);
}
