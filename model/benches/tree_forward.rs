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
    let (model, tok) = load_gguf(&path).expect("loading SmolLM2");
    report_reference_error(&path, &model, &tok);
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

/// The numeric contract's cost: logits of our kernels (8-bit activations) against candle with
/// every weight dequantized to f32 (f32 activations), on a real prompt.
fn report_reference_error(
    path: &std::path::Path,
    model: &specinfer_model::Llama,
    tok: &specinfer_model::Tokenizer,
) {
    let prompt = tok.encode("<|im_start|>user\nExplain why the sky is blue in two sentences.<|im_end|>\n<|im_start|>assistant\n").unwrap();
    let logits = move |m: &specinfer_model::Llama, prompt: &[u32]| {
        let mut kv = KvCache::new(m.config());
        let tree = TokenTree::chain(prompt);
        m.forward(&mut [SeqTree::new(&mut kv, &tree)])
            .unwrap()
            .remove(0)
    };
    let ours = logits(model, &prompt);
    // candle reads these when its first matmul weight is built, once per thread: use a fresh one.
    std::env::set_var("SPECINFER_MATMUL", "candle");
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let path = path.to_owned();
    let p = prompt.clone();
    let reference = std::thread::spawn(move || logits(&load_gguf(&path).unwrap().0, &p))
        .join()
        .unwrap();
    std::env::remove_var("SPECINFER_MATMUL");
    std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
    let (mut err, mut range, mut argmax_same) = (0f32, 0f32, 0);
    for i in 0..prompt.len() {
        let (a, b) = (ours.node(i), reference.node(i));
        err = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(err, f32::max);
        range = b.iter().map(|x| x.abs()).fold(range, f32::max);
        let am = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .unwrap()
                .0
        };
        argmax_same += (am(a) == am(b)) as usize;
    }
    println!(
        "max |logit - f32 reference| over {} positions: {err:.3} (logits span +-{range:.1}); same argmax at {argmax_same}/{} positions",
        prompt.len(),
        prompt.len()
    );
}
