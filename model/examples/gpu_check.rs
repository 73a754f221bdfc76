//! The GPU checks of the CUDA engine, in one run (`scripts/gpu-check.sh` on a machine with an
//! NVIDIA GPU): GPU logits against the CPU engine's for trees and paths on SmolLM2; greedy
//! speculative decoding on the GPU against incremental decoding on the GPU; verification latency
//! against tree size (1..128 nodes) and batch (1..16 sessions); single-token decode time against
//! the time to read the weights once at the measured memory bandwidth.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use specinfer_kernels::sampling::argmax;
use specinfer_model::cuda::{CudaKvCache, CudaLlama, CudaSeqTree};
use specinfer_model::{fetch, load_gguf, KvCache, Llama, SeqTree};
use specinfer_wire::TokenTree;

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

/// Greedy generation on the GPU: trees from `draft` (None: root only), accepted by argmax.
fn generate(
    gpu: &CudaLlama,
    prompt: &[u32],
    max_new: usize,
    draft: Option<&Llama>,
) -> (Vec<u32>, usize) {
    let mut cache = gpu.new_cache().unwrap();
    prefill_gpu(gpu, &mut cache, &prompt[..prompt.len() - 1]);
    let mut committed = prompt.to_vec();
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
            .unwrap();
        let children = tree.children();
        let mut node = 0usize;
        let mut path = vec![0u32];
        loop {
            let want = argmax(logits[0].node(node)) as u32;
            match children[node]
                .iter()
                .find(|&&c| tree.token(c as usize) == want)
            {
                Some(&c) => {
                    node = c as usize;
                    path.push(c);
                    committed.push(want);
                }
                None => {
                    gpu.compact(&mut cache, &path).unwrap();
                    committed.push(want);
                    break;
                }
            }
        }
        rounds += 1;
    }
    committed.truncate(prompt.len() + max_new);
    (committed[prompt.len()..].to_vec(), rounds)
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
    let cache_dir = fetch::cache_dir();
    let (cpu, tok) = load_gguf(&fetch::ensure(&fetch::SMOLLM2_135M, &cache_dir).unwrap()).unwrap();
    let t = Instant::now();
    let gpu = CudaLlama::upload(&cpu, 0).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "uploaded SmolLM2-135M in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let prompt = tok
        .encode(&tok.chat_prompt(&[specinfer_model::ChatMessage::new(
            "user",
            "Explain what a hash map is.",
        )]))
        .unwrap();
    let vocab = cpu.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);

    println!(
        "\n## GPU vs CPU logits (trees on a {}-token prompt)",
        prompt.len()
    );
    for nodes in [1usize, 9, 24, 64] {
        let tree = random_tree(&mut rng, *prompt.last().unwrap(), nodes, vocab);
        let mut kv = KvCache::new(cpu.config());
        cpu.prefill(&mut kv, &prompt[..prompt.len() - 1]).unwrap();
        let a = cpu
            .forward(&mut [SeqTree::new(&mut kv, &tree)])
            .unwrap()
            .remove(0);
        let mut gc = gpu.new_cache().unwrap();
        prefill_gpu(&gpu, &mut gc, &prompt[..prompt.len() - 1]);
        let b = gpu
            .forward(&mut [CudaSeqTree {
                cache: &mut gc,
                tree: &tree,
                first: 0,
            }])
            .unwrap()
            .remove(0);
        let (mut worst, mut same) = (0f32, 0);
        for n in 0..nodes {
            let (x, y) = (a.node(n), b.node(n));
            worst = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(worst, f32::max);
            same += (argmax(x) == argmax(y)) as usize;
        }
        println!(
            "{nodes:>3} nodes: max |logit difference| {worst:.2e}, argmax agrees on {same}/{nodes}"
        );
    }

    println!("\n## Greedy speculative vs incremental on the GPU");
    let ssm = Llama::from_safetensors(std::path::Path::new("models/ssm")).ok();
    let (inc, inc_rounds) = generate(&gpu, &prompt, 64, None);
    match &ssm {
        Some(ssm) => {
            let (spec, rounds) = generate(&gpu, &prompt, 64, Some(ssm));
            println!(
                "incremental {inc_rounds} rounds, speculative {rounds} rounds; outputs {}",
                if spec == inc { "IDENTICAL" } else { "DIFFER" }
            );
            assert_eq!(
                spec, inc,
                "speculative output differs from incremental on the GPU"
            );
        }
        None => println!("models/ssm not found: run from the repository root"),
    }

    println!(
        "\n## Verification latency vs tree size (1 session, {} cached tokens)",
        prompt.len()
    );
    let time = |f: &mut dyn FnMut()| {
        f();
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        t.elapsed().as_secs_f64() / 20.0 * 1e3
    };
    let mut base = gpu.new_cache().unwrap();
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
    println!("\n## Verification latency vs batch (16-node trees per session)");
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
    let decode = time(&mut || {
        let tree = TokenTree::root(*prompt.last().unwrap());
        gpu.forward(&mut [CudaSeqTree {
            cache: &mut base,
            tree: &tree,
            first: 0,
        }])
        .unwrap();
    });
    let weight_bytes = gpu.weight_bytes();
    let bandwidth = gpu.measure_bandwidth().unwrap();
    println!(
        "\nsingle-token decode {decode:.2} ms; reading the {:.0} MB of f32 weights once at the measured {:.0} GB/s takes {:.3} ms ({:.1}x)",
        weight_bytes as f64 / 1e6,
        bandwidth / 1e9,
        weight_bytes as f64 / bandwidth * 1e3,
        decode / (weight_bytes as f64 / bandwidth * 1e3)
    );
}
