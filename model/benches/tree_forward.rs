//! Forward latency of a tree of N nodes on top of C cached tokens, SmolLM2-135M Q4_1:
//! `cargo bench -p specinfer-model --bench tree_forward`. Reports the median of several runs and
//! the ratio cost(N) / cost(1), all in one run so the ratios share the machine's state.

use std::path::PathBuf;
use std::time::Instant;

use specinfer_model::{fetch, load_gguf, KvCache, SeqTree};
use specinfer_wire::TokenTree;

fn main() {
    let cache = std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/specinfer"));
    let path = fetch::ensure(&fetch::SMOLLM2_135M, &cache).expect("fetching SmolLM2");
    let (model, _) = load_gguf(&path).expect("loading SmolLM2");
    let reps: usize = std::env::var("BENCH_REPS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(7);
    println!("SmolLM2-135M-Instruct Q4_1, tree = chain-ish tree of N nodes, median of {reps} runs");
    println!("| cached | N | ms | cost(N)/cost(1) |");
    println!("|---:|---:|---:|---:|");
    for cached in [128usize, 1024] {
        let prompt: Vec<u32> = (0..cached as u32)
            .map(|i| 100 + (i * 7919) % 40000)
            .collect();
        let mut kv = KvCache::new(model.config());
        model.prefill(&mut kv, &prompt).unwrap();
        let mut base = 0.0;
        for n in [1usize, 2, 4, 8, 16, 32, 64] {
            // A bushy tree: node i hangs off node i / 2 (depth log2 N), like a wide speculation tree.
            let mut tree = TokenTree::root(17);
            for i in 1..n as u32 {
                tree.push(i / 2, 200 + i);
            }
            let mut times: Vec<f64> = (0..reps)
                .map(|_| {
                    let t = Instant::now();
                    model.forward(&mut [SeqTree::new(&mut kv, &tree)]).unwrap();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let ms = times[reps / 2];
            if n == 1 {
                base = ms;
            }
            println!("| {cached} | {n} | {ms:.1} | {:.2} |", ms / base);
        }
    }
}
