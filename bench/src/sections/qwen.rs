//! The heavier pair: Qwen2.5-Coder-1.5B-Instruct verified with Qwen2.5-Coder-0.5B-Instruct as
//! SSM on HumanEval prompts; incremental vs the paper's tree, greedy, in-process verifier.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use specinfer_model::{fetch, load_gguf, ChatMessage, Llama, Tokenizer};
use specinfer_speculator::{Speculator, TreeShape};
use specinfer_wire::{DrawMode, VerifyMode};

use crate::common::{humaneval_prompts, run_local, Ctx, Section};

/// The pair's models and `n_prompts` HumanEval prompts as chat requests, `max_new` tokens each;
/// also the LLM's and the SSM's GGUF files.
pub fn context(n_prompts: usize, max_new: u32) -> Result<(Ctx, PathBuf, PathBuf)> {
    let cache = fetch::cache_dir();
    let llm_path = fetch::ensure(&fetch::QWEN25_CODER_15B, &cache)?;
    let ssm_path = fetch::ensure(&fetch::QWEN25_CODER_05B, &cache)?;
    let (llm, tok) = load_gguf(&llm_path)?;
    let (ssm, _) = load_gguf(&ssm_path)?;
    let prompts = humaneval_prompts(n_prompts)?
        .iter()
        .map(|p| chat_ids(&tok, p))
        .collect::<Result<Vec<_>>>()?;
    let ctx = Ctx {
        llm: Arc::new(llm),
        tok,
        ssm: Arc::new(ssm) as Arc<Llama>,
        prompts,
        max_new,
    };
    Ok((ctx, llm_path, ssm_path))
}

fn chat_ids(tok: &Tokenizer, problem: &str) -> Result<Vec<u32>> {
    let msg = format!("Complete this Python function.\n```python\n{problem}```");
    Ok(tok.encode(&tok.chat_prompt(&[ChatMessage::new("user", &msg)]))?)
}

pub fn run(quick: bool) -> Result<Section> {
    let (n_prompts, max_new) = if quick { (1, 32) } else { (4, 64) };
    let (ctx, _, _) = context(n_prompts, max_new)?;
    let greedy = |shape| run_local(&ctx, shape, VerifyMode::Greedy, DrawMode::Iid);
    let inc = greedy(None)?;
    let spec = greedy(Some(TreeShape::Expansion(
        Speculator::PAPER_EXPANSION.to_vec(),
    )))?;
    let md = format!(
        "## 8. Qwen2.5-Coder-1.5B-Instruct verified with Qwen2.5-Coder-0.5B-Instruct (HumanEval, greedy, in-process)\n\n\
         | configuration | tokens per round | tokens/s | vs incremental |\n|---|---|---|---|\n\
         | incremental | {:.2} | {:.2} | 1.00 |\n| <1,1,3,1,1,1,1,1> | {:.2} | {:.2} | {:.2} |\n\n",
        inc.tau(),
        inc.tokens_per_s(),
        spec.tau(),
        spec.tokens_per_s(),
        spec.tokens_per_s() / inc.tokens_per_s()
    );
    Ok(Section {
        key: "qwen_humaneval",
        json: json!({"prompts": n_prompts, "max_new_tokens": max_new, "incremental": inc.to_json(), "paper_tree": spec.to_json()}),
        markdown: md,
    })
}
