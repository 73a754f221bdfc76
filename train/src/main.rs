//! `specinfer-train run`: the whole pipeline from nothing, resumable: ShareGPT prompts, teacher
//! answers from the LLM, distillation of a small Llama with a restricted head, export
//! (safetensors + config + tokenizer.json), evaluation on held-out prompts.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use specinfer_model::{fetch, load_gguf, Llama};
use specinfer_train::{data, eval, ssm, teacher, train};

#[derive(Parser)]
#[command(
    name = "specinfer-train",
    version,
    about = "Distil a small speculative model (SSM) from the LLM."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run (or resume) the whole pipeline.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Where the finished SSM goes.
    #[arg(long, default_value = "models/ssm")]
    out: PathBuf,
    /// Intermediate files and checkpoints (resumable).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Teacher LLM GGUF; default: SmolLM2-135M-Instruct.
    #[arg(long)]
    llm: Option<PathBuf>,
    /// Training prompts answered by the teacher.
    #[arg(long, default_value_t = 2000)]
    prompts: usize,
    /// Held-out prompts for evaluation.
    #[arg(long, default_value_t = 60)]
    heldout: usize,
    /// Tokens per teacher answer.
    #[arg(long, default_value_t = 96)]
    max_new: usize,
    /// Prompts the teacher answers per batched forward.
    #[arg(long, default_value_t = 32)]
    teacher_batch: usize,
    /// Optimiser steps (batches of `batch` sequences).
    #[arg(long, default_value_t = 1500)]
    steps: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 192)]
    seq_len: usize,
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 384)]
    ffn: usize,
    /// Tokens the SSM's head covers (the most frequent in the teacher's answers).
    #[arg(long, default_value_t = 4096)]
    head_tokens: usize,
}

fn main() -> Result<()> {
    let Command::Run(a) = Cli::parse().command;
    let work = a
        .work
        .clone()
        .unwrap_or_else(|| fetch::cache_dir().join("train"));
    std::fs::create_dir_all(&work)?;
    let t0 = Instant::now();
    let llm_path = match &a.llm {
        Some(p) => p.clone(),
        None => fetch::ensure(&fetch::SMOLLM2_135M, &fetch::cache_dir())?,
    };
    let (llm, tok) = load_gguf(&llm_path)?;

    eprintln!("[1/5] prompts");
    let all = data::prompts(&fetch::cache_dir(), 1000)?;
    let train_prompts: Vec<String> = all
        .iter()
        .filter(|p| !data::held_out(p))
        .take(a.prompts)
        .cloned()
        .collect();
    let heldout: Vec<String> = all
        .iter()
        .filter(|p| data::held_out(p))
        .take(a.heldout)
        .cloned()
        .collect();
    eprintln!(
        "      {} conversations read; {} training and {} held-out prompts",
        all.len(),
        train_prompts.len(),
        heldout.len()
    );

    eprintln!("[2/5] teacher answers");
    let train_file = work.join("teacher_train.jsonl");
    let heldout_file = work.join("teacher_heldout.jsonl");
    teacher::generate(
        &llm,
        &tok,
        &heldout,
        a.max_new,
        a.teacher_batch,
        &heldout_file,
    )?;
    teacher::generate(
        &llm,
        &tok,
        &train_prompts,
        a.max_new,
        a.teacher_batch,
        &train_file,
    )?;
    let train_ex = teacher::read_examples(&train_file)?;
    let heldout_ex = teacher::read_examples(&heldout_file)?;

    eprintln!("[3/5] distillation");
    let head = train::head_tokens(&train_ex, a.head_tokens, tok.eos());
    let covered = train_ex
        .iter()
        .flat_map(|e| &e.answer)
        .filter(|t| head.contains(t))
        .count() as f64
        / train_ex
            .iter()
            .map(|e| e.answer.len())
            .sum::<usize>()
            .max(1) as f64;
    eprintln!(
        "      head of {} tokens covers {:.1}% of the teacher's answer tokens",
        head.len(),
        covered * 100.0
    );
    let cfg = ssm::SsmConfig {
        vocab_size: llm.config().vocab_size,
        d_model: a.d_model,
        n_layers: a.layers,
        n_heads: a.heads,
        ffn_dim: a.ffn,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
        max_positions: 2048,
    };
    let mut model = ssm::Ssm::init(cfg, head, llm.token_embeddings(), llm.config().d_model, 1)?;
    let checkpoint = work.join("ssm_checkpoint.safetensors");
    let start = match std::fs::read_to_string(checkpoint.with_extension("step")) {
        Ok(s) if checkpoint.exists() => {
            model.load_checkpoint(&checkpoint)?;
            let step: usize = s.trim().parse().context("checkpoint step file")?;
            eprintln!("      resuming from step {step}");
            step
        }
        _ => 0,
    };
    let tc = train::TrainConfig {
        steps: a.steps,
        batch: a.batch,
        seq_len: a.seq_len,
        lr: a.lr,
        warmup: 50,
        seed: 7,
        checkpoint_every: 100,
    };
    let new_points = train::train(&mut model, &train_ex, &tc, &checkpoint, start)?;
    // The loss curve of earlier (interrupted) runs lives beside the checkpoint.
    let curve_file = work.join("loss_curve.json");
    let mut curve: Vec<f32> = std::fs::read_to_string(&curve_file)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    curve.truncate(start / 25);
    curve.extend(new_points);
    std::fs::write(&curve_file, serde_json::to_string(&curve)?)?;

    eprintln!("[4/5] export to {}", a.out.display());
    model.export(&a.out, &tok.sha256())?;

    eprintln!("[5/5] evaluation on {} held-out prompts", heldout_ex.len());
    let exported = Llama::from_safetensors(&a.out)?;
    let mut report = eval::Report::default();
    eval::alignment(&exported, &heldout_ex, &mut report)?;
    let tau_prompts: Vec<Vec<u32>> = heldout_ex
        .iter()
        .take(10)
        .map(|e| e.prompt.clone())
        .collect();
    eval::tau(&llm, &exported, &tau_prompts, 64, &mut report)?;
    let per_token = ssm_compute(&exported) as f64 / ssm_compute(&llm) as f64;
    let json = serde_json::json!({
        "report": report,
        "loss_curve_every_25_steps": curve,
        "ssm_over_llm_compute_per_token": per_token,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "minutes": t0.elapsed().as_secs_f64() / 60.0,
    });
    std::fs::write(
        a.out.join("eval.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    let md = format!(
        "# SSM evaluation\n\nHeld-out ShareGPT prompts: {} ({} answer positions), teacher SmolLM2-135M-Instruct (greedy).\n\n\
         | k | 1 | 2 | 3 | 4 | 5 |\n|---|---|---|---|---|---|\n| LLM token in SSM top-k (greedy) | {} |\n\n\
         Greedy speculation with the paper's tree <1,1,3,1,1,1,1,1> on {} held-out prompts x 64 tokens: tau = {:.2} tokens per LLM pass.\n\n\
         SSM compute per token: {:.4} of the LLM's. Loss (mean of each 25 steps): first {:.3}, last {:.3}. Pipeline time: {:.1} min.\n",
        report.examples,
        report.positions,
        report.top_k_greedy.iter().map(|x| format!("{:.1}%", x * 100.0)).collect::<Vec<_>>().join(" | "),
        report.tau_prompts,
        report.tau_paper_tree,
        per_token,
        curve.first().copied().unwrap_or(f32::NAN),
        curve.last().copied().unwrap_or(f32::NAN),
        t0.elapsed().as_secs_f64() / 60.0
    );
    std::fs::write(a.out.join("EVAL.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// Multiply-adds per token of the projections and the head (what dominates decoding).
fn ssm_compute(m: &Llama) -> usize {
    let c = m.config();
    let attn = c.d_model * (c.n_heads * c.head_dim) * 2 + c.d_model * c.kv_row() * 2;
    let mlp = 3 * c.d_model * c.ffn_dim;
    c.n_layers * (attn + mlp) + c.d_model * m.head_tokens()
}
