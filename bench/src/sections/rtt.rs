//! Edge/cloud: a client's tokens per second against the round-trip time, for the tree shapes a
//! client may use, with the delay added by the client per round (in process).

use std::path::Path;

use anyhow::Result;
use serde_json::json;
use specinfer_speculator::{Speculator, TreeShape};

use crate::common::{run_remote, Ctx, Run, Section};
use crate::plot::plot_lines;
use crate::Network;

/// One round-trip time: adaptive speculation without and with pipelining, with the context
/// lookup's chain added, the lookup alone, and incremental.
struct RttRow {
    rtt: u64,
    spec: Run,
    piped: Run,
    spec_lookup: Run,
    /// The CLI's greedy default: the default tree plus the lookup.
    default_lookup: Run,
    lookup_alone: Run,
    inc: Run,
}

pub fn run(ctx: &Ctx, net: &Network, quick: bool, out: &Path) -> Result<Section> {
    let rtts: &[u64] = if quick {
        &[0, 20, 100]
    } else {
        &[0, 5, 20, 50, 100]
    };
    let adaptive = TreeShape::Adaptive(Speculator::PAPER_EXPANSION.to_vec());
    let default_tree = TreeShape::clients_default();
    // Long round trips make this the slowest section: at most 6 prompts.
    let rtt_prompts = 6;
    let mut rows = Vec::new();
    for &rtt in rtts {
        let run = |shape: Option<TreeShape>, pipelined, lookup| {
            net.rt.block_on(run_remote(
                ctx,
                rtt_prompts,
                &net.verifier,
                shape,
                pipelined,
                lookup,
                rtt,
            ))
        };
        rows.push(RttRow {
            rtt,
            spec: run(Some(adaptive.clone()), false, false)?,
            piped: run(Some(adaptive.clone()), true, false)?,
            spec_lookup: run(Some(adaptive.clone()), false, true)?,
            default_lookup: run(Some(default_tree.clone()), false, true)?,
            lookup_alone: run(None, false, true)?,
            inc: run(None, false, false)?,
        });
    }
    let series = |f: fn(&RttRow) -> &Run| -> Vec<(f64, f64)> {
        rows.iter()
            .map(|r| (r.rtt as f64, f(r).tokens_per_s()))
            .collect()
    };
    plot_lines(
        &out.join("rtt.svg"),
        "Client tokens/s vs round-trip time",
        "round-trip time (ms)",
        "tokens/s",
        &[
            (
                "default tree (adaptive dynamic) + lookup",
                series(|r| &r.default_lookup),
            ),
            ("speculative (adaptive paper tree)", series(|r| &r.spec)),
            ("speculative, pipelined", series(|r| &r.piped)),
            ("speculative + context lookup", series(|r| &r.spec_lookup)),
            ("context lookup alone", series(|r| &r.lookup_alone)),
            ("incremental", series(|r| &r.inc)),
        ],
    )?;
    let mut md = format!("## 6. Edge/cloud: round-trip time\n\nThe round trip is added by the client on top of each round's verification; client and verifier share this machine's cores (no taskset), and the incremental baseline pays the round trip on every token, which a server-only deployment streaming its own decoding would not (the capacity section measures that properly). \"speculative\": the paper's tree cut to the depth that pays (`{}`); \"+ lookup\": the context lookup's chain added to every tree; \"default tree + lookup\": what `specinfer` runs in greedy mode (`{}`, a dynamic tree grown while its nodes pay, plus the chain); \"lookup alone\": root-only trees plus the chain. Tokens/s (tokens per round).\n\n| RTT ms | default tree + lookup | speculative | pipelined (hit rate) | speculative + lookup | lookup alone | incremental | speculative verifier s/token | incremental verifier s/token |\n|---|---|---|---|---|---|---|---|---|\n", adaptive, default_tree);
    for r in &rows {
        md += &format!(
            "| {} | {:.1} ({:.2}) | {:.1} ({:.2}) | {:.1} ({:.0}%) | {:.1} ({:.2}) | {:.1} ({:.2}) | {:.1} | {:.4} | {:.4} |\n",
            r.rtt,
            r.default_lookup.tokens_per_s(),
            r.default_lookup.tau(),
            r.spec.tokens_per_s(),
            r.spec.tau(),
            r.piped.tokens_per_s(),
            100.0 * r.piped.pipelined_rounds as f64 / r.piped.rounds.max(1) as f64,
            r.spec_lookup.tokens_per_s(),
            r.spec_lookup.tau(),
            r.lookup_alone.tokens_per_s(),
            r.lookup_alone.tau(),
            r.inc.tokens_per_s(),
            r.spec.verifier_seconds / r.spec.tokens.max(1) as f64,
            r.inc.verifier_seconds / r.inc.tokens.max(1) as f64
        );
    }
    md += "\n![rtt](rtt.svg)\n\n";
    Ok(Section {
        key: "rtt",
        json: json!(rows.iter().map(|r| json!({"rtt_ms": r.rtt, "speculative": r.spec.to_json(), "speculative_pipelined": r.piped.to_json(),
            "speculative_with_lookup": r.spec_lookup.to_json(), "default_tree_with_lookup": r.default_lookup.to_json(), "lookup_alone": r.lookup_alone.to_json(), "incremental": r.inc.to_json()})).collect::<Vec<_>>()),
        markdown: md,
    })
}
