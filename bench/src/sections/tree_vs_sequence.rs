//! Figure 11: one forward over the paper's tree against one forward per root-to-leaf path.

use std::time::Instant;

use anyhow::Result;
use serde_json::json;
use specinfer_model::{KvCache, SeqTree};
use specinfer_speculator::{CachedDraft, DraftMode, Speculator};
use specinfer_wire::TokenTree;

use crate::common::{Ctx, Section};

pub fn run(ctx: &Ctx) -> Result<Section> {
    let (tree_ms, seq_ms, paths) = measure(ctx)?;
    Ok(Section {
        key: "tree_vs_sequence",
        json: json!({"tree_ms": tree_ms, "sequence_ms": seq_ms, "paths": paths, "speedup": seq_ms / tree_ms}),
        markdown: format!(
            "## 5. Tree-based vs sequence-based decoding (paper tree, {paths} root-to-leaf paths)\n\nOne tree forward: {tree_ms:.1} ms; one forward per path: {seq_ms:.1} ms; speed-up {:.2}x.\n\n",
            seq_ms / tree_ms
        ),
    })
}

/// One forward over the paper's tree vs one forward per root-to-leaf path (each path as its own
/// sequence on a copy of the prompt's cache), averaged over the prompts.
fn measure(ctx: &Ctx) -> Result<(f64, f64, usize)> {
    let (mut tree_s, mut seq_s, mut paths) = (0.0, 0.0, 0);
    for ids in &ctx.prompts {
        let mut spec = Speculator::new(Speculator::PAPER_EXPANSION.to_vec(), DraftMode::Greedy, 0);
        let mut draft = CachedDraft::new(ctx.ssm.as_ref());
        let tree = spec.draft(&mut draft, ids)?;
        let mut base = KvCache::new(ctx.llm.config());
        ctx.llm.prefill(&mut base, &ids[..ids.len() - 1])?;
        let mut kv = base.clone();
        let t = Instant::now();
        ctx.llm.forward(&mut [SeqTree::new(&mut kv, &tree)])?;
        tree_s += t.elapsed().as_secs_f64();
        let children = tree.children();
        let leaves: Vec<usize> = (0..tree.len())
            .filter(|&n| children[n].is_empty())
            .collect();
        paths = leaves.len();
        let t = Instant::now();
        for leaf in leaves {
            let tokens: Vec<u32> = tree
                .path_to(leaf)
                .iter()
                .map(|&n| tree.token(n as usize))
                .collect();
            let mut kv = base.clone();
            ctx.llm
                .forward(&mut [SeqTree::new(&mut kv, &TokenTree::chain(&tokens))])?;
        }
        seq_s += t.elapsed().as_secs_f64();
    }
    let n = ctx.prompts.len() as f64;
    Ok((tree_s / n * 1e3, seq_s / n * 1e3, paths))
}
