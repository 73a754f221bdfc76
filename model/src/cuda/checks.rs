//! The GPU engine's checks against the CPU engine, shared by `examples/gpu_check.rs` (on an
//! NVIDIA GPU) and the emulated-device tests (every commit): the same checks on either device.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use specinfer_kernels::sampling::argmax;
use specinfer_wire::TokenTree;

use super::device::Device;
use super::{CudaKvCache, CudaLlama, CudaSeqTree, Precision};
use crate::{KvCache, KvPrecision, Llama, Logits, SeqTree, Want};

/// The bound on |GPU logit - CPU logit| for f32 models.
pub const EXACT: f32 = 1e-3;

/// Each engine's K/V pool: room for every sequence these checks run at once (SmolLM2 in bf16:
/// 46k positions).
pub const KV_POOL_BYTES: usize = 1 << 30;

/// Failed asserted checks, listed at the end.
#[derive(Default)]
pub struct Report {
    pub failures: Vec<String>,
}

impl Report {
    pub fn check(&mut self, name: &str, ok: bool, detail: String) {
        println!("{} {name}: {detail}", if ok { "PASS" } else { "FAIL" });
        if !ok {
            self.failures.push(format!("{name}: {detail}"));
        }
    }

    /// Runs one section; an error or a panic in it is a failure, and the run goes on.
    pub fn section(&mut self, title: &str, f: impl FnOnce(&mut Report) -> Result<(), String>) {
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

pub fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

pub fn random_tree(
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

pub fn prefill_gpu(gpu: &CudaLlama, cache: &mut CudaKvCache, ids: &[u32]) -> Vec<f32> {
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
pub fn on_cpu(cpu: &Llama, kv: &mut KvCache, tree: &TokenTree) -> Result<Logits, String> {
    Ok(cpu
        .forward(&mut [SeqTree::new(kv, tree)])
        .map_err(err)?
        .remove(0))
}

/// One tree on the GPU engine, nodes `first..` computed.
pub fn on_gpu(
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

pub fn worst_difference(a: &Logits, b: &Logits, nodes: std::ops::Range<usize>) -> f32 {
    nodes
        .flat_map(|n| a.node(n).iter().zip(b.node(n)).map(|(x, y)| (x - y).abs()))
        .fold(0f32, f32::max)
}

/// GPU against CPU on one model whose CPU path is exact f32, on `dev`.
pub fn exact_checks(
    r: &mut Report,
    name: &str,
    cpu: &Llama,
    seed: u64,
    dev: &Arc<dyn Device>,
) -> Result<(), String> {
    let gpu = CudaLlama::upload_to(cpu, dev.clone(), Precision::F32, KV_POOL_BYTES).map_err(err)?;
    println!("{name}: {}", gpu.runtime());
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bf16 =
        CudaLlama::upload_to(cpu, dev.clone(), Precision::Bf16, KV_POOL_BYTES).map_err(err)?;
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
        let mut kv = KvCache::with_precision(cpu.config(), KvPrecision::F32);
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
        let mut kv = KvCache::with_precision(cpu.config(), KvPrecision::F32);
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
pub fn generate(
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
pub fn draft_tree(ssm: &Llama, committed: &[u32]) -> TokenTree {
    let mut tree = TokenTree::root(*committed.last().unwrap());
    let mut frontier = vec![0usize];
    for &k in &[1usize, 1, 3, 1] {
        let mut kv = KvCache::with_precision(ssm.config(), KvPrecision::F32);
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

/// The device's sampled verification (`sample_walk`) against the property it must keep: over
/// trees whose root children are drawn without replacement from a proposal q unlike the LLM's
/// p, the first token emitted is distributed as p. 1,000 trees, each drawn, forwarded and walked
/// with fresh uniforms; a chi-square statistic over the tokens expected 5 times or more (the rest
/// pooled) must stay within df + 4 sqrt(2 df).
pub fn walk_check(r: &mut Report, gpu: &CudaLlama, prompt: &[u32]) -> Result<(), String> {
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
        let walk = crate::SampleWalk::new(&tree, temperature, top_p, uniforms)
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
    let (chi2, df, bound) = chi_square(&counts, &p);
    r.check(
        "SmolLM2: the device's RRS walk emits first tokens distributed as the LLM's p",
        failures == 0 && chi2 <= bound,
        format!("{failures} walks failed; chi-square {chi2:.1} over {df} degrees of freedom (bound {bound:.1})"),
    );
    Ok(())
}

/// Pearson's statistic of `counts` (draws by token) against the distribution `p`, over the
/// tokens expected 5 times or more (the rest pooled into one cell when it is expected 5 times),
/// its degrees of freedom, and the bound a lossless sampler stays within: df + 4 sqrt(2 df).
pub fn chi_square(counts: &[usize], p: &[f32]) -> (f64, f64, f64) {
    let n = counts.iter().sum::<usize>() as f64;
    let (mut chi2, mut cells) = (0.0, 0usize);
    let (mut rest_seen, mut rest_expected) = (0.0, 0.0);
    for (&seen, &pt) in counts.iter().zip(p) {
        let expected = n * pt as f64;
        if expected >= 5.0 {
            chi2 += (seen as f64 - expected).powi(2) / expected;
            cells += 1;
        } else {
            rest_seen += seen as f64;
            rest_expected += expected;
        }
    }
    if rest_expected >= 5.0 {
        chi2 += (rest_seen - rest_expected).powi(2) / rest_expected;
        cells += 1;
    }
    let df = cells.saturating_sub(1).max(1) as f64;
    (chi2, df, df + 4.0 * (2.0 * df).sqrt())
}
