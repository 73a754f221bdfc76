//! Table 1: how often the LLM's token is among the SSM's top k.

use anyhow::Result;
use serde_json::json;
use specinfer_train::{eval, teacher};

use crate::common::{Ctx, Section};

pub fn run(ctx: &Ctx, examples: &[teacher::Example], prompt_set: &str) -> Result<Section> {
    let mut align = eval::Report::default();
    eval::alignment(&ctx.llm, &[ctx.ssm.as_ref()], examples, 0.8, &mut align)?;
    let mut md = format!(
        "## 1. SSM/LLM alignment (prompts: {prompt_set})\n\n| k | 1 | 2 | 3 | 4 | 5 |\n|---|---|---|---|---|---|\n| LLM's greedy token in SSM top-k |"
    );
    for v in align.top_k_greedy {
        md += &format!(" {:.1}% |", v * 100.0);
    }
    md += "\n| LLM's sampled token (T = 0.8) in SSM top-k (expected) |";
    for v in align.top_k_stochastic {
        md += &format!(" {:.1}% |", v * 100.0);
    }
    md += "\n\n";
    Ok(Section {
        key: "alignment",
        json: json!({"top_k_greedy": align.top_k_greedy, "top_k_stochastic_t08": align.top_k_stochastic, "prompt_set": prompt_set}),
        markdown: md,
    })
}
