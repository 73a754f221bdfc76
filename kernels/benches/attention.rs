//! Tree attention over an f16 KV cache, for SmolLM2- and Qwen2.5-1.5B-shaped heads:
//! `cargo bench -p specinfer-kernels --bench attention [-- REPS [CACHED [NODES [LAYERS]]]]`.
//! Reports the time one token's (or one tree's) attention takes over all of a model's layers,
//! each layer with its own cache (so that a long context streams its K/V from memory, as in a
//! real forward), for 1, 8 and 32 nodes (a bushy tree, node i under node i / 2) at 128 and 1,024
//! cached positions, and the multiply-adds per second that makes (scores and weighted values).
//! `LAYERS` 1 keeps one layer's cache hot instead: the arithmetic alone.

use std::time::Instant;

use specinfer_kernels::{tree_attention, AttentionShape, KvRows};

fn main() {
    // `REPS [CACHED [NODES [LAYERS]]]`: repetitions, optionally one context and tree size only
    // (0 for both), and a layer count.
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let reps = args.first().copied().unwrap_or(15);
    let pick = |i: usize, all: Vec<usize>| match args.get(i) {
        Some(&v) if v > 0 => vec![v],
        _ => all,
    };
    let (pasts, nodes) = (pick(1, vec![128, 1024]), pick(2, vec![1, 8, 32]));
    let layers_asked = args.get(3).copied();
    let models = [
        (
            "SmolLM2-135M",
            30,
            AttentionShape {
                n_heads: 9,
                n_kv_heads: 3,
                head_dim: 64,
            },
        ),
        (
            "Qwen2.5-1.5B",
            28,
            AttentionShape {
                n_heads: 12,
                n_kv_heads: 2,
                head_dim: 128,
            },
        ),
    ];
    let value = |i: usize| half::f16::from_f32(((i * 7919) % 977) as f32 * 0.002 - 0.9);
    println!("| heads | layers | cached | nodes | ms per forward (median of {reps}) | GMAC/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, layers, shape) in models {
        for &past in &pasts {
            for &n in &nodes {
                let layers = layers_asked.unwrap_or(layers);
                let caches: Vec<(Vec<half::f16>, Vec<half::f16>)> = (0..layers)
                    .map(|l| {
                        let len = (past + n) * shape.n_kv_heads * shape.head_dim;
                        let k = (0..len).map(|i| value(i + l)).collect();
                        let v = (0..len).map(|i| value(3 * i + l)).collect();
                        (k, v)
                    })
                    .collect();
                let q: Vec<f32> = (0..n * shape.n_heads * shape.head_dim)
                    .map(|i| (i as f32 * 0.37).sin())
                    .collect();
                // Node i sees itself and its ancestors i / 2, i / 4, ... 0.
                let words = n.div_ceil(64);
                let mut bits = vec![0u64; n * words];
                for i in 0..n {
                    let mut j = i;
                    loop {
                        bits[i * words + j / 64] |= 1 << (j % 64);
                        if j == 0 {
                            break;
                        }
                        j /= 2;
                    }
                }
                let mut out = vec![0f32; q.len()];
                let mut times: Vec<f64> = (0..reps + 1)
                    .map(|_| {
                        let start = Instant::now();
                        for (k, v) in &caches {
                            tree_attention(
                                shape,
                                &q,
                                KvRows::F16(k),
                                KvRows::F16(v),
                                past,
                                0,
                                &bits,
                                words,
                                &mut out,
                            );
                        }
                        start.elapsed().as_secs_f64() * 1e3
                    })
                    .skip(1)
                    .collect();
                times.sort_by(f64::total_cmp);
                let ms = times[times.len() / 2];
                // Node i sees the prefix and its depth + 1 tree positions; every head scores
                // and weighs each of them over head_dim values.
                let seen: usize = (0..n).map(|i| past + (i + 1).ilog2() as usize + 1).sum();
                let macs = 2 * seen * shape.n_heads * shape.head_dim * layers;
                println!(
                    "| {name} | {layers} | {past} | {n} | {ms:.3} | {:.1} |",
                    macs as f64 / ms / 1e6
                );
            }
        }
    }
}
