//! What the verifier's engine can do on one core, measured beside the capacity runs: the cost of
//! one batched forward over `sequences` sessions of `nodes_each` nodes, and the two figures it
//! bounds. Server-only decoding runs forwards of one node per session, so within a time-per-token
//! SLO it can batch only as many sessions as keep one forward under the SLO. A split, however
//! good its drafter, can commit at most one token per node it sends, so no split can produce
//! more tokens per second than the engine's peak rate of nodes per second. The ratio of the two
//! is the most any drafter can gain this verifier; where it is below a goal, only a cheaper node
//! (a memory-bound verifier: a GPU) can reach that goal, not a better tree or drafter.

use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use specinfer_model::{KvCache, Llama, SeqTree};
use specinfer_wire::TokenTree;

use crate::verifier_process::pin_this_process;

/// One measured forward shape.
pub struct ForwardCost {
    pub sequences: usize,
    pub nodes_each: usize,
    /// Median seconds of the forward.
    pub seconds: f64,
}

impl ForwardCost {
    pub fn nodes(&self) -> usize {
        self.sequences * self.nodes_each
    }
    pub fn nodes_per_s(&self) -> f64 {
        self.nodes() as f64 / self.seconds
    }
}

/// The shapes measured: server-only's forwards (one node per session) and tree forwards of
/// 8-node trees, up to 128 nodes (the capacity section's loads batch up to about 150).
const SHAPES: [(usize, usize); 13] = [
    (1, 1),
    (2, 1),
    (4, 1),
    (8, 1),
    (16, 1),
    (32, 1),
    (64, 1),
    (128, 1),
    (1, 8),
    (2, 8),
    (4, 8),
    (8, 8),
    (16, 8),
];

/// Times each shape's forward (median of `reps`) with this process pinned to `core` and one
/// kernel thread, as the verifier process runs there; every session holds `context` cached
/// tokens of `prompt` (repeated to length). Leaves the process pinned to `core`.
pub fn measure(
    llm: &Llama,
    prompt: &[u32],
    context: usize,
    core: usize,
    reps: usize,
) -> Result<Vec<ForwardCost>> {
    pin_this_process(&core.to_string())?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .context("building a one-thread kernel pool")?;
    pool.install(|| {
        let tokens: Vec<u32> = prompt.iter().copied().cycle().take(context).collect();
        let mut first = KvCache::new(llm.config());
        llm.prefill(&mut first, &tokens)?;
        let max_sequences = SHAPES.iter().map(|s| s.0).max().unwrap_or(1);
        let mut caches = vec![first; max_sequences];
        let mut out = Vec::new();
        for (sequences, nodes_each) in SHAPES {
            let tree = bushy_tree(&tokens, nodes_each);
            out.push(ForwardCost {
                sequences,
                nodes_each,
                seconds: median_forward_seconds(llm, &mut caches[..sequences], &tree, reps)?,
            });
        }
        Ok(out)
    })
}

/// A bushy tree of `nodes` (node i under node i / 2), as a speculation tree is, of `tokens`.
pub fn bushy_tree(tokens: &[u32], nodes: usize) -> TokenTree {
    let mut tree = TokenTree::root(tokens[0]);
    for i in 1..nodes as u32 {
        tree.push(i / 2, tokens[i as usize % tokens.len()]);
    }
    tree
}

/// The median time of `reps` forwards of `tree` over each of `caches` in one batch (the tree
/// goes to each cache's scratch region; the caches' committed tokens stay as they are).
pub fn median_forward_seconds(
    llm: &Llama,
    caches: &mut [KvCache],
    tree: &TokenTree,
    reps: usize,
) -> Result<f64> {
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let mut seqs: Vec<SeqTree> = caches.iter_mut().map(|c| SeqTree::new(c, tree)).collect();
        let t = Instant::now();
        llm.forward(&mut seqs)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Server-only's best: the most tokens per second of forwards of one node per session whose
/// time keeps within `slo` (each session then gets a token per forward); the shape reaching it.
pub fn server_only_bound(curve: &[ForwardCost], slo: f64) -> Option<&ForwardCost> {
    curve
        .iter()
        .filter(|c| c.nodes_each == 1 && c.seconds <= slo)
        .max_by(|a, b| a.nodes_per_s().total_cmp(&b.nodes_per_s()))
}

/// The engine's peak node rate over every shape: what a split whose every node were accepted
/// could produce at most, round trips and the SLO aside.
pub fn peak(curve: &[ForwardCost]) -> Option<&ForwardCost> {
    curve
        .iter()
        .max_by(|a, b| a.nodes_per_s().total_cmp(&b.nodes_per_s()))
}

/// The measurement as a Markdown paragraph and table, and as JSON.
pub fn report(curve: &[ForwardCost], slo: f64, context: usize) -> (String, Value) {
    let mut md = format!(
        "What one core of this verifier can do at all: the engine's batched forward (the same `Llama::forward` the \
         verifier runs, in the bench process pinned to core 0 with one kernel thread, before the load; every session \
         {context} cached tokens; median of the runs). Verification, sampling, K/V compaction and QUIC come on top.\n\n\
         | sessions x nodes | nodes | forward ms | nodes/s |\n|---|---|---|---|\n"
    );
    for c in curve {
        md += &format!(
            "| {} x {} | {} | {:.1} | {:.0} |\n",
            c.sequences,
            c.nodes_each,
            c.nodes(),
            c.seconds * 1e3,
            c.nodes_per_s()
        );
    }
    let server = server_only_bound(curve, slo);
    let peak = peak(curve);
    // Both bounds and the gain between them, where server-only has one.
    let gain = server
        .zip(peak)
        .map(|(s, p)| (s, p, p.nodes_per_s() / s.nodes_per_s()));
    md += "\n";
    match gain {
        Some((s, p, r)) => {
            md += &format!(
                "Within the SLO ({:.0} ms per token) server-only forwards can batch {} sessions ({:.1} ms a forward): at most \
                 {:.0} tokens/s. A split can commit at most one token per node, so even if every node were accepted its \
                 goodput could not pass the engine's peak node rate, {:.0} nodes/s ({} x {} nodes): **at most {r:.2}x \
                 server-only's bound, for any drafter and tree**, before round trips and the SLO's own limit on rounds.\n\n",
                slo * 1e3,
                s.sequences,
                s.seconds * 1e3,
                s.nodes_per_s(),
                p.nodes_per_s(),
                p.sequences,
                p.nodes_each
            )
        }
        None => md += &format!(
            "No server-only forward kept within the SLO ({:.0} ms): even one session's step is slower.\n\n",
            slo * 1e3
        ),
    }
    let json = json!({
        "context_tokens": context,
        "forwards": curve.iter().map(|c| json!({"sequences": c.sequences, "nodes_each": c.nodes_each,
            "forward_ms": c.seconds * 1e3, "nodes_per_s": c.nodes_per_s()})).collect::<Vec<_>>(),
        "server_only_tokens_per_s_bound": server.map(ForwardCost::nodes_per_s),
        "peak_nodes_per_s": peak.map(ForwardCost::nodes_per_s),
        "split_gain_bound": gain.map(|(_, _, r)| r),
    });
    (md, json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(sequences: usize, nodes_each: usize, ms: f64) -> ForwardCost {
        ForwardCost {
            sequences,
            nodes_each,
            seconds: ms / 1e3,
        }
    }

    #[test]
    fn server_only_is_bounded_by_the_slo_and_the_split_by_the_peak_node_rate() {
        // 10 ms fixed, 1 ms a node: 4 sessions fit a 15 ms SLO (266 tokens/s), the peak is 64
        // nodes in 74 ms (865 nodes/s).
        let curve: Vec<ForwardCost> = [(1, 1), (4, 1), (8, 1), (64, 1), (8, 8)]
            .iter()
            .map(|&(s, n)| cost(s, n, 10.0 + (s * n) as f64))
            .collect();
        let server = server_only_bound(&curve, 0.015).unwrap();
        assert_eq!((server.sequences, server.nodes_each), (4, 1));
        let peak = peak(&curve).unwrap();
        assert_eq!(peak.nodes(), 64);
        let (_, json) = report(&curve, 0.015, 128);
        let ratio = json["split_gain_bound"].as_f64().unwrap();
        assert!((ratio - (64.0 / 0.074) / (4.0 / 0.014)).abs() < 1e-9);
        // No forward within a 5 ms SLO: no bound is claimed.
        assert!(server_only_bound(&curve, 0.005).is_none());
        assert!(report(&curve, 0.005, 128).1["split_gain_bound"].is_null());
    }
}
