//! Load on a verifier over loopback QUIC: N clients x M rounds of incremental decoding
//! (`cargo bench -p specinfer-integration --bench load`). Reports rounds/s, p50/p99 round latency
//! seen by clients, and the batch sizes the engine formed, for N = 1, 4, 16.

use std::time::{Duration, Instant};

use specinfer_integration::{chat_ids, start_verifier};
use specinfer_net::Remote;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::{SamplingParams, TokenTree};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

fn main() {
    let rounds: usize = std::env::var("LOAD_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (server, remote) = start_verifier(EngineConfig::default());
        println!("SmolLM2-135M-Instruct Q4_1, root-only trees, {rounds} rounds per client, loopback QUIC");
        println!("| clients | rounds/s | p50 ms | p99 ms | mean batch | max batch seen |");
        println!("|---:|---:|---:|---:|---:|---:|");
        for clients in [1usize, 4, 16] {
            // Sessions are opened (and prefilled) before the clock starts.
            let mut sessions = Vec::new();
            let mut conns = Vec::new();
            for c in 0..clients {
                let r = Remote::connect(&remote).await.unwrap();
                let ids = chat_ids(&format!("Tell me fact number {c} about the sea."));
                let s = r.open(1, ids.clone(), SamplingParams::greedy(rounds as u32 + 1)).await.unwrap();
                sessions.push((s, *ids.last().unwrap()));
                conns.push(r);
            }
            let (before_n, before_mean) = server.metrics().batch_size.count_mean();
            let start = Instant::now();
            let tasks: Vec<_> = sessions
                .into_iter()
                .map(|(mut s, mut root)| {
                    tokio::spawn(async move {
                        let mut lat = Vec::with_capacity(rounds);
                        for _ in 0..rounds {
                            let t = Instant::now();
                            let v = s.verify(TokenTree::root(root)).await.unwrap();
                            lat.push(t.elapsed());
                            root = *v.tokens.last().unwrap();
                        }
                        s.close().await.unwrap();
                        lat
                    })
                })
                .collect();
            let mut lat = Vec::new();
            for t in tasks {
                lat.extend(t.await.unwrap());
            }
            let wall = start.elapsed().as_secs_f64();
            lat.sort();
            let (after_n, after_mean) = server.metrics().batch_size.count_mean();
            let batches = after_n - before_n;
            let mean_batch = (after_mean * after_n as f64 - before_mean * before_n as f64) / batches as f64;
            println!(
                "| {clients} | {:.1} | {:.1} | {:.1} | {mean_batch:.2} | {} |",
                lat.len() as f64 / wall,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                if server.metrics().batch_size.count_above(8.0) > 0 { ">8" } else if server.metrics().batch_size.count_above(1.0) > 0 { ">1" } else { "1" }
            );
            for r in conns {
                r.shutdown().await;
            }
        }
        server.shutdown().await;
    });
}
