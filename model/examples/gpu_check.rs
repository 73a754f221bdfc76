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

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use specinfer_kernels::sampling::argmax;
use specinfer_model::cuda::{CudaKvCache, CudaLlama, CudaSeqTree, Precision};
use specinfer_model::{fetch, load_gguf, Arch, KvCache, Llama, Logits, ModelConfig, SeqTree, Want};
use specinfer_wire::TokenTree;

/// The bound on |GPU logit - CPU logit| for f32 models.
const EXACT: f32 = 1e-3;

/// Each engine's K/V pool: room for every sequence these checks run at once (SmolLM2 in bf16:
/// 46k positions).
const KV_POOL_BYTES: usize = 1 << 30;

/// Failed asserted checks, listed at the end.
#[derive(Default)]
struct Report {
    failures: Vec<String>,
}

impl Report {
    fn check(&mut self, name: &str, ok: bool, detail: String) {
        println!("{} {name}: {detail}", if ok { "PASS" } else { "FAIL" });
        if !ok {
            self.failures.push(format!("{name}: {detail}"));
        }
    }

    /// Runs one section; an error or a panic in it is a failure, and the run goes on.
    fn section(&mut self, title: &str, f: impl FnOnce(&mut Report) -> Result<(), String>) {
        println!("\n## {title}");
        let started = Instant::now();
        match std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut *self))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.check(title, false, format!("error: {e}")),
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.check(title, false, format!("panicked: {msg}"));
            }
        }
        println!("({:.1} s)", started.elapsed().as_secs_f64());
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn random_tree(
    rng: &mut rand_chacha::ChaCha8Rng,
    root: u32,
    nodes: usize,
    vocab: u32,
) -> TokenTree {
    let mut t = TokenTree::root(root);
    for i in 1..nodes {
        t.push(rng.random_range(0..i) as u32, rng.random_range(0..vocab));
    }
    t
}

fn prefill_gpu(gpu: &CudaLlama, cache: &mut CudaKvCache, ids: &[u32]) -> Vec<f32> {
    let tree = TokenTree::chain(ids);
    let out = gpu
        .forward(&mut [CudaSeqTree {
            cache,
            tree: &tree,
            first: 0,
        }])
        .unwrap();
    gpu.compact(cache, &(0..ids.len() as u32).collect::<Vec<_>>())
        .unwrap();
    out[0].node(ids.len() - 1).to_vec()
}

/// One tree on the CPU engine.
fn on_cpu(cpu: &Llama, kv: &mut KvCache, tree: &TokenTree) -> Result<Logits, String> {
    Ok(cpu
        .forward(&mut [SeqTree::new(kv, tree)])
        .map_err(err)?
        .remove(0))
}

/// One tree on the GPU engine, nodes `first..` computed.
fn on_gpu(
    gpu: &CudaLlama,
    cache: &mut CudaKvCache,
    tree: &TokenTree,
    first: usize,
) -> Result<Logits, String> {
    Ok(gpu
        .forward(&mut [CudaSeqTree { cache, tree, first }])
        .map_err(err)?
        .remove(0))
}

fn worst_difference(a: &Logits, b: &Logits, nodes: std::ops::Range<usize>) -> f32 {
    nodes
        .flat_map(|n| a.node(n).iter().zip(b.node(n)).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max)
}

/// GPU against CPU on one model whose CPU path is exact f32.
fn exact_checks(r: &mut Report, name: &str, cpu: &Llama, seed: u64) -> Result<(), String> {
    let gpu = CudaLlama::upload(cpu, 0, Precision::F32, KV_POOL_BYTES).map_err(err)?;
    println!("{name}: {}", gpu.runtime());
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bf16 = CudaLlama::upload(cpu, 0, Precision::Bf16, KV_POOL_BYTES).map_err(err)?;
    for (format, g) in [("f32", &gpu), ("bf16", &bf16)] {
        let rows = 11;
        let x: Vec<f32> = (0..rows * cpu.config().d_model)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (device, host) = g.check_lm_head_projection(&x, rows).map_err(err)?;
        let differ = device
            .iter()
            .zip(&host)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        r.check(
            &format!("{name}: {format} projection == its CPU emulation bit for bit"),
            differ == 0,
            format!("{differ} of {} outputs differ", host.len()),
        );
    }
    drop(bf16);
    let prompt: Vec<u32> = (0..37).map(|_| rng.random_range(0..vocab)).collect();
    let cpu_prefilled = || -> Result<KvCache, String> {
        let mut kv = KvCache::new(cpu.config());
        cpu.prefill(&mut kv, &prompt).map_err(err)?;
        Ok(kv)
    };
    let gpu_prefilled = || -> Result<CudaKvCache, String> {
        let mut c = gpu.new_cache().map_err(err)?;
        prefill_gpu(&gpu, &mut c, &prompt);
        Ok(c)
    };
    let root = *prompt.last().unwrap();
    for nodes in [1usize, 9, 64, 100] {
        let tree = random_tree(&mut rng, root, nodes, vocab);
        let mut kv = cpu_prefilled()?;
        let a = on_cpu(cpu, &mut kv, &tree)?;
        let mut gc = gpu_prefilled()?;
        let b = on_gpu(&gpu, &mut gc, &tree, 0)?;
        let worst = worst_difference(&a, &b, 0..nodes);
        r.check(
            &format!("{name}: a {nodes}-node tree"),
            worst <= EXACT,
            format!("max |difference| {worst:.2e}"),
        );
        // Compaction keeps a root-to-leaf path; the next tree then reads it from the cache.
        let path = tree.path_to(nodes - 1);
        kv.compact(&path);
        gpu.compact(&mut gc, &path).map_err(err)?;
        let next = random_tree(&mut rng, tree.token(nodes - 1), 8, vocab);
        let a = on_cpu(cpu, &mut kv, &next)?;
        let b = on_gpu(&gpu, &mut gc, &next, 0)?;
        let worst = worst_difference(&a, &b, 0..8);
        r.check(
            &format!("{name}: after keeping a {}-node path", path.len()),
            worst <= EXACT,
            format!("max |difference| {worst:.2e}"),
        );
    }
    // A tree grown in two forwards: the second computes nodes 40.. over the first's scratch.
    let tree = random_tree(&mut rng, root, 72, vocab);
    let mut kv = cpu_prefilled()?;
    let a = on_cpu(cpu, &mut kv, &tree)?;
    let mut gc = gpu_prefilled()?;
    let mut head = tree.clone();
    head.truncate(40);
    gpu.forward(&mut [CudaSeqTree {
        cache: &mut gc,
        tree: &head,
        first: 0,
    }])
    .map_err(err)?;
    let b = on_gpu(&gpu, &mut gc, &tree, 40)?;
    let worst = (40..72)
        .flat_map(|n| {
            a.node(n)
                .iter()
                .zip(b.node(n - 40))
                .map(|(x, y)| (x - y).abs())
        })
        .fold(0f32, f32::max);
    r.check(
        &format!("{name}: a tree grown in two forwards (first = 40)"),
        worst <= EXACT,
        format!("max |difference| {worst:.2e}"),
    );
    // One packed forward of sequences with different committed lengths and tree sizes; two
    // outgrow a slot table's first 256 entries (one in its prefill, one in this forward: its
    // device table grows).
    let shapes = [
        (5usize, 7usize),
        (17, 30),
        (40, 64),
        (1, 1),
        (300, 9),
        (230, 60),
    ];
    let mut cpu_caches = Vec::new();
    let mut gpu_caches = Vec::new();
    let mut trees = Vec::new();
    for &(len, nodes) in &shapes {
        let ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..vocab)).collect();
        let mut kv = KvCache::new(cpu.config());
        cpu.prefill(&mut kv, &ids).map_err(err)?;
        cpu_caches.push(kv);
        let mut c = gpu.new_cache().map_err(err)?;
        prefill_gpu(&gpu, &mut c, &ids);
        gpu_caches.push(c);
        trees.push(random_tree(&mut rng, ids[len - 1], nodes, vocab));
    }
    let a: Vec<Logits> = cpu_caches
        .iter_mut()
        .zip(&trees)
        .map(|(kv, t)| {
            cpu.forward(&mut [SeqTree::new(kv, t)])
                .map(|mut l| l.remove(0))
        })
        .collect::<Result<_, _>>()
        .map_err(err)?;
    let mut seqs: Vec<CudaSeqTree> = gpu_caches
        .iter_mut()
        .zip(&trees)
        .map(|(cache, tree)| CudaSeqTree {
            cache,
            tree,
            first: 0,
        })
        .collect();
    let b = gpu.forward(&mut seqs).map_err(err)?;
    let worst = a
        .iter()
        .zip(&b)
        .zip(&shapes)
        .map(|((x, y), &(_, nodes))| worst_difference(x, y, 0..nodes))
        .fold(0f32, f32::max);
    r.check(
        &format!(
            "{name}: one packed forward of {} sequences (committed 1..300)",
            shapes.len()
        ),
        worst <= EXACT,
        format!("max |difference| {worst:.2e}"),
    );
    // The same forward with every kernel launched one by one: the same bits as the captured
    // CUDA graph's (`b`, this shape's first forward, was captured; `c` below replays it).
    gpu.set_graphs(false);
    let direct = gpu.forward(&mut seqs).map_err(err)?;
    gpu.set_graphs(true);
    let same = b
        .iter()
        .zip(&direct)
        .zip(&shapes)
        .all(|((g, k), &(_, nodes))| (0..nodes).all(|i| g.node(i) == k.node(i)));
    r.check(
        &format!("{name}: a CUDA graph's forward == kernels launched one by one, bit for bit"),
        same,
        String::new(),
    );
    // The same forward again (it rewrites the same scratch rows) with logits for a third of the
    // sequences, argmaxes for another, nothing for the rest: the logits are the same bits (the
    // head's rows are gathered, and a projection does not depend on its batch), the argmaxes
    // (reduced on the device) the host's of the full rows, the others empty. `b`'s rows are
    // still on the device, so this forward's head writes a fresh buffer and `b` stays readable.
    let wants: Vec<Want> = (0..shapes.len())
        .map(|i| [Want::Logits, Want::KvOnly, Want::Argmax][i % 3])
        .collect();
    let c = gpu.forward_wanting(&mut seqs, &wants).map_err(err)?;
    let same = b
        .iter()
        .zip(&c)
        .zip(&wants)
        .all(|((full, got), want)| match want {
            Want::Logits => {
                full.nodes() == got.nodes()
                    && (0..full.nodes()).all(|i| full.node(i) == got.node(i))
            }
            Want::Argmax => {
                full.nodes() == got.nodes()
                    && (0..full.nodes()).all(|i| full.argmax(i) == got.argmax(i))
            }
            Want::KvOnly => got.nodes() == 0,
        });
    r.check(
        &format!("{name}: logits, device argmaxes or nothing per sequence, the same answers"),
        same,
        format!("wants: {wants:?}"),
    );
    // Every slot of the K/V pool comes back when the caches are dropped.
    drop(seqs);
    let held: usize = gpu_caches.iter().chain([&gc]).map(|c| c.bytes()).sum();
    let (capacity, free) = gpu.kv_slots();
    let in_use = capacity - free;
    drop((gpu_caches, gc));
    let (_, after) = gpu.kv_slots();
    r.check(
        &format!("{name}: the K/V pool counts what the caches hold, and gets it all back"),
        in_use * gpu.kv_position_bytes() == held && after == capacity,
        format!("{in_use} slots in use ({held} bytes held), {after} of {capacity} free after"),
    );
    Ok(())
}

/// Greedy generation on the GPU: trees from `draft` (None: root only), accepted by argmax. Also
/// gives, for each emitted token, the gap between the top two logits where it was chosen.
fn generate(
    gpu: &CudaLlama,
    prompt: &[u32],
    max_new: usize,
    draft: Option<&Llama>,
) -> Result<(Vec<u32>, Vec<f32>, usize), String> {
    let mut cache = gpu.new_cache().map_err(err)?;
    prefill_gpu(gpu, &mut cache, &prompt[..prompt.len() - 1]);
    let mut committed = prompt.to_vec();
    let mut gaps = Vec::new();
    let mut rounds = 0;
    while committed.len() - prompt.len() < max_new {
        let root = *committed.last().unwrap();
        let tree = match draft {
            None => TokenTree::root(root),
            Some(ssm) => draft_tree(ssm, &committed),
        };
        let logits = gpu
            .forward(&mut [CudaSeqTree {
                cache: &mut cache,
                tree: &tree,
                first: 0,
            }])
            .map_err(err)?;
        let children = tree.children();
        let mut node = 0usize;
        let mut path = vec![0u32];
        loop {
            let l = logits[0].node(node);
            let want = argmax(l) as u32;
            let second = l
                .iter()
                .enumerate()
                .filter(|&(i, _)| i as u32 != want)
                .map(|(_, &x)| x)
                .fold(f32::NEG_INFINITY, f32::max);
            gaps.push(l[want as usize] - second);
            committed.push(want);
            match children[node]
                .iter()
                .find(|&&c| tree.token(c as usize) == want)
            {
                Some(&c) => {
                    node = c as usize;
                    path.push(c);
                }
                None => {
                    gpu.compact(&mut cache, &path).map_err(err)?;
                    break;
                }
            }
        }
        rounds += 1;
    }
    committed.truncate(prompt.len() + max_new);
    gaps.truncate(max_new);
    Ok((committed[prompt.len()..].to_vec(), gaps, rounds))
}

/// The tree <1,1,3,1> of the draft model's greedy top-k, on the CPU (recomputed from scratch
/// each level: this is a check, not a fast path).
fn draft_tree(ssm: &Llama, committed: &[u32]) -> TokenTree {
    let mut tree = TokenTree::root(*committed.last().unwrap());
    let mut frontier = vec![0usize];
    for &k in &[1usize, 1, 3, 1] {
        let mut kv = KvCache::new(ssm.config());
        ssm.prefill(&mut kv, &committed[..committed.len() - 1])
            .unwrap();
        let out = ssm
            .forward(&mut [SeqTree::new(&mut kv, &tree)])
            .unwrap()
            .remove(0);
        let mut next = Vec::new();
        for &n in &frontier {
            let l = out.node(n);
            let mut order: Vec<u32> = (0..l.len() as u32).collect();
            order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));
            for &t in order.iter().take(k) {
                next.push(tree.push(n as u32, t) as usize);
            }
        }
        frontier = next;
    }
    tree
}

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

    r.section("Exact references: tiny random f32 models (asserted)", |r| {
        for (arch, seed) in [(Arch::Llama, 1), (Arch::Qwen2, 2)] {
            let cpu = Llama::random(ModelConfig::tiny(arch), seed, None).map_err(err)?;
            exact_checks(r, &format!("{arch:?}"), &cpu, seed)?;
        }
        Ok(())
    });
    r.section("Exact references: the default SSM, f32 (asserted)", |r| {
        let ssm = Llama::from_safetensors(std::path::Path::new("models/ssm"))
            .map_err(|e| format!("models/ssm (run from the repository root): {e}"))?;
        exact_checks(r, "default SSM", &ssm, 3)
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
    let gpu = match CudaLlama::upload(&cpu, 0, Precision::Bf16, KV_POOL_BYTES) {
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
                let ms = time(&mut || {
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
                let ms = time(&mut || {
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
        let decode = time(&mut || {
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

/// The device's sampled verification (`sample_walk`) against the property it must keep: over
/// trees whose root children are drawn without replacement from a proposal q unlike the LLM's
/// p, the first token emitted is distributed as p. 1,000 trees, each drawn, forwarded and walked
/// with fresh uniforms; a chi-square statistic over the tokens expected 5 times or more (the rest
/// pooled) must stay within df + 4 sqrt(2 df).
fn walk_check(r: &mut Report, gpu: &CudaLlama, prompt: &[u32]) -> Result<(), String> {
    use specinfer_wire::{DrawMode, Proposals, SparseDist};
    const TRIALS: usize = 1000;
    let (temperature, top_p) = (0.8f32, 1.0f32);
    let mut cache = gpu.new_cache().map_err(err)?;
    prefill_gpu(gpu, &mut cache, &prompt[..prompt.len() - 1]);
    let root = *prompt.last().unwrap();
    let mut forward = |tree: &TokenTree| -> Result<Logits, String> {
        let mut out = gpu
            .forward(&mut [CudaSeqTree {
                cache: &mut cache,
                tree,
                first: 0,
            }])
            .map_err(err)?;
        Ok(out.remove(0))
    };
    let p = specinfer_kernels::sampling::distribution(
        forward(&TokenTree::root(root))?.node(0),
        temperature,
        0,
        top_p,
    );
    // q: uniform over p's 8 likeliest tokens, so that rejections and residuals decide often.
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    let q_ids: Vec<u32> = order[..8].iter().map(|&t| t as u32).collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut counts = vec![0usize; p.len()];
    let mut failures = 0;
    for _ in 0..TRIALS {
        let mut pool = q_ids.clone();
        let mut tree = TokenTree::root(root);
        for _ in 0..3 {
            let x = pool.swap_remove(rng.random_range(0..pool.len()));
            tree.push(0, x);
        }
        let tree = tree
            .with_proposals(Proposals {
                mode: DrawMode::WithoutReplacement,
                dists: vec![SparseDist {
                    node: 0,
                    ids: q_ids.clone(),
                    probs: vec![1.0 / 8.0; 8],
                }],
                drawn_from: vec![0; 3],
            })
            .map_err(err)?;
        let logits = forward(&tree)?;
        let uniforms = (0..tree.len()).map(|_| rng.random::<f64>()).collect();
        let walk = specinfer_model::SampleWalk::new(&tree, temperature, top_p, uniforms)
            .expect("the tree carries proposals");
        match logits.walk_on_device(&walk) {
            Some(Ok(out)) => {
                let first = match out.accepted.first() {
                    Some(&c) => tree.token(c as usize),
                    None => out.next_token,
                };
                counts[first as usize] += 1;
            }
            _ => failures += 1,
        }
    }
    let n = (TRIALS - failures) as f64;
    let (mut chi2, mut df) = (0.0, 0usize);
    let (mut rest_seen, mut rest_expected) = (0.0, 0.0);
    for (t, &pt) in p.iter().enumerate() {
        let expected = n * pt as f64;
        if expected >= 5.0 {
            chi2 += (counts[t] as f64 - expected).powi(2) / expected;
            df += 1;
        } else {
            rest_seen += counts[t] as f64;
            rest_expected += expected;
        }
    }
    if rest_expected >= 5.0 {
        chi2 += (rest_seen - rest_expected).powi(2) / rest_expected;
        df += 1;
    }
    let df = df.saturating_sub(1).max(1) as f64;
    let bound = df + 4.0 * (2.0 * df).sqrt();
    r.check(
        "SmolLM2: the device's RRS walk emits first tokens distributed as the LLM's p",
        failures == 0 && chi2 <= bound,
        format!("{failures} walks failed; chi-square {chi2:.1} over {df} degrees of freedom (bound {bound:.1})"),
    );
    Ok(())
}

fn time(f: &mut dyn FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..20 {
        f();
    }
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
