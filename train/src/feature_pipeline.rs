//! `specinfer-train feature-draft`: the feature-conditioned drafter from nothing, resumable:
//! teacher answers (shared with the SSM's pipeline), the LLM's features over them, training,
//! export, and its evaluation beside the SSM's.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use specinfer_model::{fetch, ChatMessage, FeatureDrafter, Llama, Tokenizer};
use specinfer_speculator::{ContextLookup, DraftModel, FeatureDraft, TreeShape};

use crate::feature::{self, DrafterShape, FeaturePrecision, FeatureTrainConfig, TrainableDrafter};
use crate::{data, eval, teacher, train};

#[derive(clap::Args)]
pub struct Args {
    /// Where the finished drafter goes.
    #[arg(long, default_value = "models/feature-draft")]
    pub out: PathBuf,
    /// Intermediate files (teacher answers, features); default: the cache's train folder,
    /// where `specinfer-train run` keeps its teacher answers too.
    #[arg(long)]
    pub work: Option<PathBuf>,
    /// Training prompts the teacher answers (greedy).
    #[arg(long, default_value_t = 4000)]
    pub prompts: usize,
    /// Held-out prompts for evaluation.
    #[arg(long, default_value_t = 60)]
    pub heldout: usize,
    /// Tokens per teacher answer.
    #[arg(long, default_value_t = 96)]
    pub max_new: usize,
    /// Training prompts whose answer as ShareGPT recorded it is also trained on: the LLM's
    /// features over text it did not write cost a forward per token, about a tenth of the
    /// teacher's decoding, and widen what the drafter has seen. 0 trains on teacher answers only.
    #[arg(long, default_value_t = 8_000)]
    pub recorded_answers: usize,
    /// Tokens kept of each recorded answer (its beginning).
    #[arg(long, default_value_t = 96)]
    pub recorded_answer_tokens: usize,
    /// Positions per training window.
    #[arg(long, default_value_t = 96)]
    pub seq_len: usize,
    /// Optimiser steps.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Windows per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Peak learning rate (warmup 50 steps, cosine decay).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Width of the layer's feed-forward part.
    #[arg(long, default_value_t = 1024)]
    pub ffn: usize,
    /// Tokens the head covers (the most frequent in the teacher's answers).
    #[arg(long, default_value_t = 8192)]
    pub head_tokens: usize,
    /// Noise on the input features while training, relative to their RMS.
    #[arg(long, default_value_t = 0.1)]
    pub input_noise: f32,
    /// Held-out prompts the tokens-per-pass measurement decodes (64 tokens each).
    #[arg(long, default_value_t = 30)]
    pub tau_prompts: usize,
    /// Passes per training step: 1 reads only the LLM's features; 2 also trains on reading its
    /// own predictions, as tree nodes below the root do.
    #[arg(long, default_value_t = 2)]
    pub passes: usize,
    /// Start from this exported drafter's weights instead of from scratch.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Only evaluate the drafter already in --out.
    #[arg(long)]
    pub eval_only: bool,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// Temperature of the sampled rows (the terminal chat's default).
const SAMPLED_T: f32 = 0.8;

pub fn run(a: Args, llm: &Llama, tok: &Tokenizer, llm_name: &str) -> Result<()> {
    let work = a
        .work
        .clone()
        .unwrap_or_else(|| fetch::cache_dir().join("train"));
    std::fs::create_dir_all(&work)?;
    let t0 = Instant::now();
    eprintln!("[1/5] prompts and teacher answers");
    let all = data::prompts(&fetch::cache_dir(), 1000)?;
    let pick = |held: bool, n: usize| -> Vec<String> {
        all.iter()
            .filter(|p| data::held_out(p) == held)
            .take(n)
            .cloned()
            .collect()
    };
    let heldout_file = work.join("teacher_heldout.jsonl");
    let train_file = work.join("teacher_train.jsonl");
    let answer = |prompts: &[String], file: &Path| {
        teacher::generate(
            llm,
            tok,
            prompts,
            a.max_new,
            32,
            teacher::Decoding::Greedy,
            file,
        )
    };
    answer(&pick(true, a.heldout), &heldout_file)?;
    let heldout = teacher::read_examples(&heldout_file)?;
    if !a.eval_only {
        answer(&pick(false, a.prompts), &train_file)?;
        let mut examples = teacher::read_examples(&train_file)?;
        examples.truncate(a.prompts);
        eprintln!("[2/5] the LLM's features over {} answers", examples.len());
        let mut set = feature::record(
            llm,
            &examples,
            a.seq_len + 32,
            &feature::file_sha256(&train_file)?,
            &work.join("features.safetensors"),
        )?;
        if a.recorded_answers > 0 {
            let recorded = recorded_examples(tok, a.recorded_answers, a.recorded_answer_tokens)?;
            eprintln!(
                "      and over {} answers as ShareGPT recorded them",
                recorded.len()
            );
            let more = feature::record(
                llm,
                &recorded,
                a.recorded_answer_tokens + 32,
                &feature::examples_sha256(&recorded)?,
                &work.join("features_recorded_answers.safetensors"),
            )?;
            set.examples.extend(more.examples);
        }
        eprintln!("[3/5] training");
        let head = train::head_tokens(&examples, a.head_tokens, tok.eos());
        let shape = DrafterShape {
            n_heads: llm.config().n_heads,
            ffn_dim: a.ffn,
            rope_theta: 10_000.0,
            rms_eps: llm.config().rms_eps,
            max_positions: 2048,
        };
        let mut drafter = TrainableDrafter::init(llm, head, shape, a.seed)?;
        if let Some(init) = &a.init {
            drafter.load_exported(init)?;
        }
        let cfg = FeatureTrainConfig {
            steps: a.steps,
            batch: a.batch,
            seq_len: a.seq_len,
            lr: a.lr,
            warmup: 50,
            seed: a.seed,
            regression_weight: 1.0,
            input_noise: a.input_noise,
            passes: a.passes,
        };
        let curve = feature::train(&drafter, &set, &cfg)?;
        std::fs::write(
            work.join("feature_loss_curve.json"),
            serde_json::to_string(&curve)?,
        )?;
        eprintln!("[4/5] export to {}", a.out.display());
        drafter.export(&a.out, llm_name, &tok.sha256())?;
    }
    eprintln!("[5/5] evaluation on {} held-out prompts", heldout.len());
    let drafter = FeatureDrafter::from_safetensors(&a.out)
        .with_context(|| format!("loading {}", a.out.display()))?;
    evaluate(llm, &drafter, &heldout, &a, t0)
}

/// The first `n` training prompts that ShareGPT answered, as examples: the chat prompt the
/// teacher reads and the first `max_tokens` tokens of the recorded answer (its end of turn when
/// the whole answer fits).
fn recorded_examples(
    tok: &Tokenizer,
    n: usize,
    max_tokens: usize,
) -> Result<Vec<teacher::Example>> {
    data::recorded_answers(&fetch::cache_dir(), 1000)?
        .into_iter()
        .take(n)
        .map(|(prompt, answer)| {
            let mut answer = tok.encode(&answer)?;
            if answer.len() < max_tokens {
                answer.extend(tok.eos().first());
            }
            answer.truncate(max_tokens);
            Ok(teacher::Example {
                prompt: tok.encode(&tok.chat_prompt(&[ChatMessage::new("user", &prompt)]))?,
                answer,
                top: Vec::new(),
            })
        })
        .collect()
}

fn evaluate(
    llm: &Llama,
    drafter: &FeatureDrafter,
    heldout: &[teacher::Example],
    a: &Args,
    t0: Instant,
) -> Result<()> {
    let mut rows = Vec::new();
    let mut json = serde_json::Map::new();
    for precision in [
        FeaturePrecision::F32,
        FeaturePrecision::F16,
        FeaturePrecision::Int8,
    ] {
        let (greedy, sampled, positions) =
            feature::alignment(llm, drafter, heldout, SAMPLED_T, precision)?;
        rows.push(format!(
            "| {precision:?} | {} | {} |",
            pct(&greedy),
            pct(&sampled)
        ));
        json.insert(
            format!("{precision:?}"),
            serde_json::json!({"top_k_greedy": greedy, "top_k_sampled": sampled, "positions": positions}),
        );
    }
    let prompts: Vec<&[u32]> = heldout
        .iter()
        .take(a.tau_prompts)
        .map(|e| e.prompt.as_slice())
        .collect();
    let drafts = || vec![Box::new(FeatureDraft::new(drafter)) as Box<dyn DraftModel + Send>];
    let shape = TreeShape::clients_default().uncut();
    let mut tau = serde_json::Map::new();
    let mut tau_rows = Vec::new();
    for lookup in [None, Some(ContextLookup::default())] {
        let mut row = Vec::new();
        for temperature in [None, Some(SAMPLED_T)] {
            let t =
                eval::tau_decoding_with(llm, &drafts, &prompts, 64, &shape, lookup, temperature)?;
            let key = format!(
                "{}{}",
                if temperature.is_some() {
                    "sampled"
                } else {
                    "greedy"
                },
                if lookup.is_some() { "_with_lookup" } else { "" }
            );
            tau.insert(key, t.into());
            row.push(format!("{t:.2}"));
        }
        tau_rows.push(format!(
            "| {shape}{} | {} |",
            if lookup.is_some() { " + lookup" } else { "" },
            row.join(" | ")
        ));
    }
    let per_token = drafter_macs(drafter) as f64 / llm_macs(llm) as f64;
    let d = drafter.feature_dim();
    json.insert("tau".into(), tau.into());
    json.insert(
        "drafter_over_llm_compute_per_token".into(),
        per_token.into(),
    );
    json.insert("feature_bytes_per_row".into(), (d + 4).into());
    json.insert("minutes".into(), (t0.elapsed().as_secs_f64() / 60.0).into());
    json.insert(
        "command".into(),
        std::env::args().collect::<Vec<_>>().join(" ").into(),
    );
    std::fs::write(
        a.out.join("eval.json"),
        serde_json::to_string_pretty(&serde_json::Value::Object(json))?,
    )?;
    let md = format!(
        "# Feature-conditioned drafter: evaluation\n\n\
         Held-out ShareGPT prompts: {} with the teacher's (SmolLM2-135M-Instruct) greedy answers.\n\n\
         Top-k agreement at the first tree level (the drafter reads the LLM's feature of the previous position, at the precision of each row): greedy, is the LLM's token in the drafter's top-k; sampled, the LLM's probability mass at T = {SAMPLED_T} inside it.\n\n\
         | features | greedy top-1..5 | sampled top-1..5 |\n|---|---|---|\n{}\n\n\
         Tokens per LLM pass (tau), {} held-out prompts x 64 tokens, the clients' default tree at its whole budget, through the round driver and an in-process verifier session that returns features (8-bit rows, as on the wire):\n\n\
         | tree | greedy | sampled (T = {SAMPLED_T}) |\n|---|---|---|\n{}\n\n\
         Drafting compute per token: {per_token:.4} of the LLM's (multiply-adds). Features on the wire: {} bytes per row (8-bit values and an f32 scale).\n",
        heldout.len(),
        rows.join("\n"),
        prompts.len(),
        tau_rows.join("\n"),
        d + 4,
    );
    std::fs::write(a.out.join("EVAL.md"), &md)?;
    println!("{md}");
    Ok(())
}

fn pct(v: &[f64; 5]) -> String {
    v.iter()
        .map(|x| format!("{:.1}%", x * 100.0))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Multiply-adds per token of one Llama layer's projections.
fn layer_macs(c: &specinfer_model::ModelConfig) -> usize {
    c.d_model * (c.n_heads * c.head_dim) * 2
        + c.d_model * c.kv_row() * 2
        + 3 * c.d_model * c.ffn_dim
}

fn llm_macs(m: &Llama) -> usize {
    let c = m.config();
    c.n_layers * layer_macs(c) + m.head_tokens() * c.d_model
}

/// `fc`, the layer and the restricted head.
fn drafter_macs(f: &FeatureDrafter) -> usize {
    let c = f.config();
    2 * c.d_model * c.d_model + layer_macs(c) + f.head_tokens() * c.d_model
}
