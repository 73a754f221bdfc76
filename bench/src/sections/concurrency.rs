//! Figure 10: per-token latency against tree width and concurrent sessions, every session a
//! QUIC client drafting on this machine, one verifier batching them.

use std::path::Path;

use anyhow::Result;
use serde_json::json;
use specinfer_edge::Client;
use specinfer_speculator::{
    CachedDraft, DraftMode, DraftModel, Drafter, RoundDriver, Speculator, TreeShape,
};
use specinfer_wire::{SamplingParams, VerifyMode};

use crate::common::{params, Ctx, Section};
use crate::plot::plot_lines;
use crate::Network;

pub fn run(ctx: &Ctx, net: &Network, quick: bool, out: &Path) -> Result<Section> {
    let (widths, sessions): (&[usize], &[usize]) = if quick {
        (&[0, 3], &[1, 4])
    } else {
        (&[0, 1, 2, 3, 4, 5], &[1, 2, 4, 8, 16])
    };
    let mut rows = Vec::new();
    for &k in widths {
        for &n in sessions {
            let c = net.rt.block_on(concurrent(ctx, &net.verifier, k, n, 32))?;
            eprintln!(
                "      k={k} sessions={n}: {:.1} ms/token per session",
                c.latency_ms_per_token
            );
            rows.push((k, n, c));
        }
    }
    let series: Vec<(String, Vec<(f64, f64)>)> = widths
        .iter()
        .map(|&k| {
            let name = match k {
                0 => "incremental".to_string(),
                k => format!("<1,1,{k},1,1,1,1,1>"),
            };
            let points = rows
                .iter()
                .filter(|(kk, _, _)| *kk == k)
                .map(|(_, n, c)| (*n as f64, c.latency_ms_per_token))
                .collect();
            (name, points)
        })
        .collect();
    plot_lines(
        &out.join("concurrency.svg"),
        "Per-token latency vs concurrent sessions",
        "concurrent sessions",
        "ms per token (per session)",
        &series
            .iter()
            .map(|(n, p)| (n.as_str(), p.clone()))
            .collect::<Vec<_>>(),
    )?;
    let mut md = "## 4. Per-token latency vs tree width and concurrent sessions (Figure 10)\n\nEvery session is a QUIC client drafting on this machine's cores, all verified by one verifier (embedded, unless --server) with continuous batching; 32 new tokens per session. Tree width 0 is incremental decoding.\n\n| tree width | sessions | ms per token (per session) | verifier forward s per token |\n|---|---|---|---|\n".to_string();
    for (k, n, c) in &rows {
        md += &format!(
            "| {k} | {n} | {:.1} | {:.4} |\n",
            c.latency_ms_per_token, c.verifier_seconds_per_token
        );
    }
    md += "\n![concurrency](concurrency.svg)\n\n";
    Ok(Section {
        key: "concurrency",
        json: json!(rows
            .iter()
            .map(|(k, n, c)| json!({"tree_width": k, "sessions": n, "per_token_latency_ms": c.latency_ms_per_token,
                "verifier_seconds_per_token": c.verifier_seconds_per_token, "tokens": c.tokens}))
            .collect::<Vec<_>>()),
        markdown: md,
    })
}

/// What `sessions` simultaneous generations measured.
struct Concurrent {
    /// Mean over sessions of wall time / tokens.
    latency_ms_per_token: f64,
    /// Verifier forward time summed over sessions, per generated token.
    verifier_seconds_per_token: f64,
    tokens: usize,
}

/// `sessions` clients at once against one verifier, each generating `max_new` tokens with tree
/// `<1,1,k,1,1,1,1,1>` (k = 0: incremental decoding).
async fn concurrent(
    ctx: &Ctx,
    verifier: &specinfer_net::RemoteConfig,
    k: usize,
    sessions: usize,
    max_new: u32,
) -> Result<Concurrent> {
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let remote = verifier.clone();
        let ssm = ctx.ssm.clone();
        let prompt = ctx.prompts[s % ctx.prompts.len()].clone();
        let params = SamplingParams {
            max_new_tokens: max_new,
            ..params(ctx, VerifyMode::Greedy, 0)
        };
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(remote).await?;
            let drafter = (k > 0).then(|| {
                let shape = TreeShape::Expansion(vec![1, 1, k, 1, 1, 1, 1, 1]);
                Drafter {
                    speculator: Speculator::with_shape(shape, DraftMode::Greedy, s as u64),
                    drafts: vec![
                        Box::new(CachedDraft::new(ssm.as_ref())) as Box<dyn DraftModel + Send>
                    ],
                }
            });
            let mut driver = RoundDriver::new(prompt, params, drafter)?;
            let g = client.generate(&mut driver, |_| {}).await?;
            client.shutdown().await;
            anyhow::Ok(g)
        }));
    }
    let (mut latency, mut forward, mut tokens) = (0.0, 0.0, 0);
    for t in tasks {
        let g = t.await??;
        latency += g.wall.as_secs_f64() * 1e3 / g.token_ids.len().max(1) as f64;
        forward += g.stats.verifier_forward_s;
        tokens += g.token_ids.len();
    }
    Ok(Concurrent {
        latency_ms_per_token: latency / sessions as f64,
        verifier_seconds_per_token: forward / tokens.max(1) as f64,
        tokens,
    })
}
