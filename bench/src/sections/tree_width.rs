//! Table 2 and Figure 7: tokens per LLM pass against the width of the paper's tree, a dynamic
//! tree, and incremental decoding, with an in-process verifier.

use std::path::Path;

use anyhow::Result;
use serde_json::json;
use specinfer_speculator::TreeShape;
use specinfer_wire::{DrawMode, VerifyMode};

use crate::common::{run_local, Ctx, Section};
use crate::plot::plot_lines;

pub fn run(ctx: &Ctx, out: &Path) -> Result<Section> {
    let greedy = |shape| run_local(ctx, shape, VerifyMode::Greedy, DrawMode::Iid);
    let incremental = greedy(None)?;
    let mut widths = Vec::new();
    for k in 1..=5usize {
        let shape = TreeShape::Expansion(vec![1, 1, k, 1, 1, 1, 1, 1]);
        widths.push((format!("<1,1,{k},1,1,1,1,1>"), k, greedy(Some(shape))?));
    }
    let dynamic = greedy(Some(TreeShape::Dynamic { budget: 16 }))?;
    plot_lines(
        &out.join("tree_width.svg"),
        "Tokens per LLM pass vs tree width <1,1,k,1,1,1,1,1>",
        "k",
        "tokens per round",
        &[(
            "greedy",
            widths
                .iter()
                .map(|(_, k, r)| (*k as f64, r.tau()))
                .collect(),
        )],
    )?;
    let mut md = "## 2 and 7. Tree width, dynamic trees, incremental (greedy, in-process verifier)\n\n| configuration | tokens per round | tokens/s | vs incremental |\n|---|---|---|---|\n".to_string();
    md += &format!(
        "| incremental | {:.2} | {:.1} | 1.00 |\n",
        incremental.tau(),
        incremental.tokens_per_s()
    );
    for (name, _, r) in &widths {
        md += &format!(
            "| {name} | {:.2} | {:.1} | {:.2} |\n",
            r.tau(),
            r.tokens_per_s(),
            r.tokens_per_s() / incremental.tokens_per_s()
        );
    }
    md += &format!(
        "| dynamic:16 | {:.2} | {:.1} | {:.2} |\n\n![tree width](tree_width.svg)\n\n",
        dynamic.tau(),
        dynamic.tokens_per_s(),
        dynamic.tokens_per_s() / incremental.tokens_per_s()
    );
    Ok(Section {
        key: "tree_width",
        json: json!({
            "incremental": incremental.to_json(),
            "widths": widths.iter().map(|(n, _, r)| json!({"tree": n, "run": r.to_json()})).collect::<Vec<_>>(),
            "dynamic_16": dynamic.to_json(),
        }),
        markdown: md,
    })
}
