//! `specinfer-train run`: the whole pipeline from nothing, resumable: ShareGPT prompts, teacher
//! answers from the LLM, distillation of a small Llama with a restricted head, export
//! (safetensors + config + tokenizer.json), evaluation on held-out prompts.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use specinfer_model::{fetch, load_gguf, Llama};
use specinfer_train::{data, eval, feature, feature_pipeline, ssm, teacher, train};

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
    /// Adaptive boosting (SpecInfer Section 3): train the next SSM of an ensemble on the
    /// training prompts the earlier SSMs cover worst, from the teacher answers `run` made.
    Boost(BoostArgs),
    /// Table 1 for SSMs alone and merged: top-k alignment (greedy and stochastic) and tau.
    Eval(EvalArgs),
    /// Tokens per LLM pass (tau) of an SSM or a feature-conditioned drafter on held-out
    /// ShareGPT prompts, greedy and sampling, for each tree shape given: what a tree or drafter
    /// change is judged by.
    Tau(TauArgs),
    /// Train (or only evaluate) the feature-conditioned drafter: EAGLE's one layer over the
    /// LLM's own features, which the verifier returns with its verdicts.
    FeatureDraft(feature_pipeline::Args),
}

#[derive(clap::Args)]
struct TauArgs {
    /// The drafter's folder: an SSM, or a feature-conditioned drafter (its config.json says
    /// which; the in-process verifier then returns the LLM's features with every verdict).
    #[arg(long, default_value = "models/ssm")]
    ssm: PathBuf,
    /// Held-out prompts (the same ones `run` holds out).
    #[arg(long, default_value_t = 60)]
    prompts: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 64)]
    max_new: u32,
    /// Sampling temperature of the sampled rows.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Tree shapes (as the CLI's --tree takes them); repeat for several.
    #[arg(long, default_values_t = ["adaptive:dynamic:32".to_string(), "dynamic:32".to_string(), "1,1,3,1,1,1,1,1".to_string()])]
    tree: Vec<String>,
    /// Add the context lookup's chain (as the clients do by default).
    #[arg(long)]
    lookup: bool,
}

/// The SSM's shape and its training schedule.
#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// Optimiser steps (batches of `batch` sequences).
    #[arg(long, default_value_t = 2500)]
    steps: usize,
    /// Sequences per optimiser step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per training sequence (the end of prompt + answer).
    #[arg(long, default_value_t = 192)]
    seq_len: usize,
    /// Peak learning rate (after 50 warmup steps, cosine-decayed to a tenth at --steps; a
    /// resumed run continues the schedule where its checkpoint stopped).
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Hidden width.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Transformer layers. Resuming with more grows a checkpoint: its layers come first, and
    /// the new ones start as identities (the grown model computes what the checkpoint did).
    #[arg(long, default_value_t = 5)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Width of the feed-forward layer.
    #[arg(long, default_value_t = 384)]
    ffn: usize,
    /// Tokens the SSM's head covers (the most frequent in the teacher's answers). Resuming with
    /// a larger value grows a checkpoint's head (its rows kept, new tokens after them).
    #[arg(long, default_value_t = 4096)]
    head_tokens: usize,
    /// Seed of the initialisation and of the batch order.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(clap::Args)]
struct BoostArgs {
    /// The SSMs already in the ensemble (folders), in order.
    #[arg(long, required = true)]
    earlier: Vec<PathBuf>,
    /// Where the new SSM goes.
    #[arg(long)]
    out: PathBuf,
    /// The work folder of `run` (teacher answers); default: the cache's train folder.
    #[arg(long)]
    work: Option<PathBuf>,
    /// Train on every prompt instead of the uncovered ones (an independently trained SSM, the
    /// baseline boosting is compared against; give it another --seed).
    #[arg(long)]
    independent: bool,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// Drafter folders: SSMs, evaluated alone and merged, or a feature-conditioned drafter,
    /// evaluated alone (its top-k at the first tree level, reading the LLM's features 8-bit).
    #[arg(long, required = true)]
    ssm: Vec<PathBuf>,
    /// The work folder of `run` (held-out teacher answers).
    #[arg(long)]
    work: Option<PathBuf>,
    /// Label of the merged row.
    #[arg(long, default_value = "merged")]
    label: String,
    /// Markdown and JSON file stem to append the rows to.
    #[arg(long)]
    out: PathBuf,
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
    /// Training prompts answered by the teacher: ShareGPT's first turns (about 12,000 usable),
    /// then its later turns (about 34,000 more), asked on their own.
    #[arg(long, default_value_t = 8000)]
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
    /// Have the teacher answer the first N training prompts once more, sampling at a
    /// temperature drawn per prompt from 0.7..1.0 (teacher_train_sampled.jsonl), and train on
    /// those answers too: the continuations users meet in sample mode, and more data once the
    /// prompts run out.
    #[arg(long, default_value_t = 0)]
    sampled_answers: usize,
    #[command(flatten)]
    model: ModelArgs,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Run(a) => run(a),
        Command::Boost(b) => boost(b),
        Command::Eval(e) => eval_ensemble(e),
        Command::Tau(t) => tau_table(t),
        Command::FeatureDraft(a) => {
            let (llm, tok) = load_llm(&None)?;
            feature_pipeline::run(a, &llm, &tok, fetch::SMOLLM2_135M.file_name)
        }
    }
}

/// Prints a Markdown table of greedy and sampled tau per tree shape.
fn tau_table(a: TauArgs) -> Result<()> {
    let (llm, tok) = load_llm(&None)?;
    let drafter = eval::DrafterFolder::load(&a.ssm)?;
    let drafts = || vec![drafter.draft()];
    let prompts: Vec<Vec<u32>> = data::prompts(&fetch::cache_dir(), 1000)?
        .into_iter()
        .filter(|p| data::held_out(p))
        .take(a.prompts)
        .map(|p| tok.encode(&tok.chat_prompt(&[specinfer_model::ChatMessage::new("user", &p)])))
        .collect::<std::result::Result<_, _>>()?;
    let prompts: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let lookup = a.lookup.then(specinfer_speculator::ContextLookup::default);
    println!(
        "| tree | greedy tau | sampled tau (T = {}) |\n|---|---|---|",
        a.temperature
    );
    for tree in &a.tree {
        let shape: specinfer_speculator::TreeShape = tree.parse().map_err(anyhow::Error::msg)?;
        let t0 = std::time::Instant::now();
        let greedy =
            eval::tau_decoding_with(&llm, &drafts, &prompts, a.max_new, &shape, lookup, None)?;
        let sampled = eval::tau_decoding_with(
            &llm,
            &drafts,
            &prompts,
            a.max_new,
            &shape,
            lookup,
            Some(a.temperature),
        )?;
        println!("| {tree} | {greedy:.2} | {sampled:.2} |");
        eprintln!("  ({tree}: {:.0} s)", t0.elapsed().as_secs_f64());
    }
    Ok(())
}

fn default_work(work: &Option<PathBuf>) -> PathBuf {
    work.clone()
        .unwrap_or_else(|| fetch::cache_dir().join("train"))
}

fn load_llm(llm: &Option<PathBuf>) -> Result<(Llama, specinfer_model::Tokenizer)> {
    let path = match llm {
        Some(p) => p.clone(),
        None => fetch::ensure_with(&fetch::SMOLLM2_135M, &fetch::cache_dir(), &mut |e| {
            eprintln!("{}: {e}", env!("CARGO_BIN_NAME"))
        })?,
    };
    Ok(load_gguf(&path)?)
}

/// Temperature of the stochastic alignment rates (the CLI's default sampling temperature).
const EVAL_TEMPERATURE: f32 = 0.8;

fn run(a: RunArgs) -> Result<()> {
    let work = default_work(&a.work);
    std::fs::create_dir_all(&work)?;
    let t0 = Instant::now();
    let (llm, tok) = load_llm(&a.llm)?;

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
    let sampled_file = work.join("teacher_train_sampled.jsonl");
    let answer = |prompts: &[String], decoding, file: &Path| {
        teacher::generate(
            &llm,
            &tok,
            prompts,
            a.max_new,
            a.teacher_batch,
            decoding,
            file,
        )
    };
    answer(&heldout, teacher::Decoding::Greedy, &heldout_file)?;
    answer(&train_prompts, teacher::Decoding::Greedy, &train_file)?;
    let mut train_ex = teacher::read_examples(&train_file)?;
    if a.sampled_answers > 0 {
        let n = a.sampled_answers.min(train_prompts.len());
        let decoding = teacher::Decoding::Sampled { seed: a.model.seed };
        answer(&train_prompts[..n], decoding, &sampled_file)?;
        train_ex.extend(teacher::read_examples(&sampled_file)?.into_iter().take(n));
    }
    let heldout_ex = teacher::read_examples(&heldout_file)?;

    eprintln!("[3/5] distillation; [4/5] export to {}", a.out.display());
    let (curve, onnx_diff) = distil(&llm, &tok, &train_ex, &heldout_ex, &a.model, &work, &a.out)?;

    eprintln!("[5/5] evaluation on {} held-out prompts", heldout_ex.len());
    let exported = Llama::from_safetensors(&a.out)?;
    let mut report = eval::Report::default();
    eval::alignment(
        &llm,
        &[&exported],
        &heldout_ex,
        EVAL_TEMPERATURE,
        &mut report,
    )?;
    eval::tau(
        &llm,
        &eval::ssm_drafts(&[&exported]),
        &heldout_ex,
        64,
        &mut report,
    )?;
    let per_token = ssm_compute(&exported) as f64 / ssm_compute(&llm) as f64;
    let json = serde_json::json!({
        "report": report,
        "loss_curve_every_25_steps": curve,
        "ssm_over_llm_compute_per_token": per_token,
        "onnx_vs_candle_max_logit_difference": onnx_diff,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "minutes": t0.elapsed().as_secs_f64() / 60.0,
    });
    std::fs::write(
        a.out.join("eval.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    let loss = match (curve.first(), curve.last()) {
        (Some(first), Some(last)) => {
            format!("Loss (mean of each 25 steps): first {first:.3}, last {last:.3}. ")
        }
        _ => String::new(),
    };
    let teacher = match &a.llm {
        Some(p) => p.file_stem().map_or_else(
            || p.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        ),
        None => "SmolLM2-135M-Instruct".into(),
    };
    let md = format!(
        "# SSM evaluation\n\nHeld-out ShareGPT prompts: {} ({} answer positions), teacher {teacher} (greedy answers).\n\n\
         | k | 1 | 2 | 3 | 4 | 5 |\n|---|---|---|---|---|---|\n| LLM token in SSM top-k (greedy) | {} |\n| LLM token (sampled, T = {}) in SSM top-k | {} |\n\n\
         Greedy speculation on {} held-out prompts x 64 tokens, tokens per LLM pass (tau): the clients' default greedy tree at its whole budget ({}) {:.2}, {:.2} with the context lookup's chain added to every tree (as the clients do by default); the paper's tree <1,1,3,1,1,1,1,1> {:.2}, {:.2} with the lookup.\n\n\
         SSM compute per token: {:.4} of the LLM's. {loss}ONNX export vs candle: max logit difference {:.1e}. Pipeline time: {:.1} min.\n",
        report.examples,
        report.positions,
        percent_row(&report.top_k_greedy),
        EVAL_TEMPERATURE,
        percent_row(&report.top_k_stochastic),
        report.tau_prompts,
        report.default_tree,
        report.tau_default_tree,
        report.tau_default_tree_with_lookup,
        report.tau_paper_tree,
        report.tau_paper_tree_with_lookup,
        per_token,
        onnx_diff,
        t0.elapsed().as_secs_f64() / 60.0
    );
    std::fs::write(a.out.join("EVAL.md"), &md)?;
    println!("{md}");
    Ok(())
}

fn percent_row(v: &[f64; 5]) -> String {
    v.iter()
        .map(|x| format!("{:.1}%", x * 100.0))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Trains an SSM on `examples` (resumable from the checkpoint in `work`), exports it to `out`
/// (safetensors + config) and checks its ONNX export against the candle forward on a held-out
/// answer. Returns the loss curve and the largest ONNX-vs-candle logit difference.
#[allow(clippy::too_many_arguments)]
fn distil(
    llm: &Llama,
    tok: &specinfer_model::Tokenizer,
    examples: &[teacher::Example],
    heldout: &[teacher::Example],
    m: &ModelArgs,
    work: &std::path::Path,
    out: &std::path::Path,
) -> Result<(Vec<f32>, f32)> {
    let head = train::head_tokens(examples, m.head_tokens, tok.eos());
    let cfg = ssm::SsmConfig {
        vocab_size: llm.config().vocab_size,
        d_model: m.d_model,
        n_layers: m.layers,
        n_heads: m.heads,
        ffn_dim: m.ffn,
        rope_theta: 10_000.0,
        rms_eps: 1e-5,
        max_positions: 2048,
    };
    let mut model = ssm::Ssm::init(
        cfg,
        head,
        llm.token_embeddings(),
        llm.config().d_model,
        m.seed,
    )?;
    std::fs::create_dir_all(work)?;
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
    let head: std::collections::HashSet<u32> = model.head_ids.iter().copied().collect();
    let covered = examples
        .iter()
        .flat_map(|e| &e.answer)
        .filter(|t| head.contains(t))
        .count() as f64
        / examples
            .iter()
            .map(|e| e.answer.len())
            .sum::<usize>()
            .max(1) as f64;
    eprintln!(
        "      {} examples ({} with the teacher's top-{}); head of {} tokens covers {:.1}% of the teacher's answer tokens",
        examples.len(),
        examples.iter().filter(|e| !e.top.is_empty()).count(),
        teacher::TOP_KEPT,
        head.len(),
        covered * 100.0
    );
    let tc = train::TrainConfig {
        steps: m.steps,
        batch: m.batch,
        seq_len: m.seq_len,
        lr: m.lr,
        warmup: 50,
        seed: m.seed,
        checkpoint_every: 100,
    };
    let new_points = train::train(&mut model, examples, &tc, &checkpoint, start)?;
    // The loss curve of earlier (interrupted) runs lives beside the checkpoint.
    let curve_file = work.join("loss_curve.json");
    let mut curve: Vec<f32> = std::fs::read_to_string(&curve_file)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    curve.truncate(start / 25);
    curve.extend(new_points);
    std::fs::write(&curve_file, serde_json::to_string(&curve)?)?;

    model.export(out, &tok.sha256())?;
    let exported = Llama::from_safetensors(out)?;
    let onnx_diff = check_onnx(&exported, heldout, &work.join("model.onnx"))?;
    Ok((curve, onnx_diff))
}

/// Exports `ssm` to ONNX and runs it in ONNX Runtime on a held-out prompt and answer: the
/// largest logit difference to the candle forward.
fn check_onnx(ssm: &Llama, heldout: &[teacher::Example], path: &std::path::Path) -> Result<f32> {
    use specinfer_onnx::OnnxModel;
    use specinfer_speculator::TreeScorer;
    use specinfer_wire::TokenTree;
    ssm.export_onnx(path, &[])?;
    let onnx = OnnxModel::load(path, 1)?;
    let e = heldout.first().context("no held-out example")?;
    let mut seq = e.prompt.clone();
    seq.extend(&e.answer);
    let tree = TokenTree::chain(&seq);
    let a = ssm.score(&mut ssm.new_cache(), &tree, 0)?;
    let b = onnx.score(&mut onnx.new_cache(), &tree, 0)?;
    let mut worst = 0f32;
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        if x.is_finite() || y.is_finite() {
            worst = worst.max((x - y).abs());
        }
    }
    eprintln!(
        "      ONNX export {} agrees with candle to {worst:.1e}",
        path.display()
    );
    Ok(worst)
}

fn boost(b: BoostArgs) -> Result<()> {
    let work = default_work(&b.work);
    let (llm, tok) = load_llm(&None)?;
    let train_file = work.join("teacher_train.jsonl");
    let examples = teacher::read_examples(&train_file).with_context(|| {
        format!(
            "{}: run `specinfer-train run` first (it writes the teacher answers)",
            train_file.display()
        )
    })?;
    let heldout = teacher::read_examples(&work.join("teacher_heldout.jsonl"))?;
    let earlier: Vec<Llama> = b
        .earlier
        .iter()
        .map(|p| Llama::from_safetensors(p).with_context(|| format!("loading {}", p.display())))
        .collect::<Result<_>>()?;
    let earlier: Vec<&Llama> = earlier.iter().collect();
    let chosen: Vec<teacher::Example> = if b.independent {
        examples
    } else {
        eprintln!(
            "[1/2] coverage of {} training prompts by the earlier SSMs",
            examples.len()
        );
        let mut scored = Vec::with_capacity(examples.len());
        for (i, e) in examples.into_iter().enumerate() {
            // Top-3: what the paper tree's widest level proposes; the first 32 answer tokens.
            scored.push((eval::coverage(&earlier, &e, 32, 3)?, e));
            if (i + 1) % 200 == 0 {
                eprintln!("      {}/{}", i + 1, scored.capacity());
            }
        }
        scored.sort_by(|a, b| a.0.total_cmp(&b.0));
        // The worse-covered half: what the ensemble still misses.
        let half = scored.len() / 2;
        eprintln!(
            "      coverage (top-3 over the first 32 answer tokens): median {:.1}%; training on the {} prompts below it",
            scored[half].0 * 100.0,
            half
        );
        scored.into_iter().take(half).map(|(_, e)| e).collect()
    };
    eprintln!("[2/2] distillation into {}", b.out.display());
    let name = b
        .out
        .file_name()
        .map_or("boost".into(), |n| n.to_string_lossy().into_owned());
    let (curve, onnx_diff) = distil(
        &llm,
        &tok,
        &chosen,
        &heldout,
        &b.model,
        &work.join(name),
        &b.out,
    )?;
    let json = serde_json::json!({
        "trained_on_prompts": chosen.len(),
        "boosted_after": b.earlier.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "independent": b.independent,
        "loss_curve_every_25_steps": curve,
        "onnx_vs_candle_max_logit_difference": onnx_diff,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    std::fs::write(
        b.out.join("train.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    Ok(())
}

fn eval_ensemble(e: EvalArgs) -> Result<()> {
    let work = default_work(&e.work);
    let (llm, _) = load_llm(&None)?;
    let heldout = teacher::read_examples(&work.join("teacher_heldout.jsonl"))?;
    let folders: Vec<eval::DrafterFolder> = e
        .ssm
        .iter()
        .map(|p| eval::DrafterFolder::load(p))
        .collect::<Result<_>>()?;
    let mut ssms: Vec<&Llama> = Vec::new();
    let mut rows = Vec::new();
    let mut md = String::new();
    let mut row = |name: String, report: eval::Report| {
        md += &format!(
            "| {name} | {} | {} | {:.2} |\n",
            percent_row(&report.top_k_greedy),
            percent_row(&report.top_k_stochastic),
            report.tau_paper_tree
        );
        rows.push(serde_json::json!({"ssms": name, "report": report}));
    };
    for (path, folder) in e.ssm.iter().zip(&folders) {
        let name = path.display().to_string();
        eprintln!("evaluating {name}");
        let mut report = eval::Report::default();
        match folder {
            eval::DrafterFolder::Ssm(m) => {
                eval::alignment(&llm, &[m], &heldout, EVAL_TEMPERATURE, &mut report)?;
                ssms.push(m);
            }
            // Its first tree level reads the LLM's feature of the position before, 8-bit as the
            // wire carries it; it is never merged (the clients refuse that too).
            eval::DrafterFolder::Feature(f) => {
                let (greedy, stochastic, positions) = feature::alignment(
                    &llm,
                    f,
                    &heldout,
                    EVAL_TEMPERATURE,
                    feature::FeaturePrecision::Int8,
                )?;
                report.examples = heldout.len();
                report.positions = positions;
                report.temperature = EVAL_TEMPERATURE;
                report.top_k_greedy = greedy;
                report.top_k_stochastic = stochastic;
            }
        }
        eval::tau(&llm, &|| vec![folder.draft()], &heldout, 64, &mut report)?;
        row(name, report);
    }
    if ssms.len() > 1 {
        eprintln!("evaluating {}", e.label);
        let mut report = eval::Report::default();
        eval::alignment(&llm, &ssms, &heldout, EVAL_TEMPERATURE, &mut report)?;
        eval::tau(&llm, &eval::ssm_drafts(&ssms), &heldout, 64, &mut report)?;
        row(e.label.clone(), report);
    }
    let md_path = e.out.with_extension("md");
    let mut all = std::fs::read_to_string(&md_path).unwrap_or_else(|_| {
        format!(
            "# SSM ensembles on {} held-out prompts\n\nTop-k: the LLM's next token within any member's top-k, greedy (teacher's token) | stochastic (probability of a T = {EVAL_TEMPERATURE} sample). tau: greedy, paper tree, trees merged across members, {} prompts x 64 tokens.\n\n\
             | SSMs | greedy top-1 | top-2 | top-3 | top-4 | top-5 | stochastic top-1 | top-2 | top-3 | top-4 | top-5 | tau |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            heldout.len(),
            heldout.len()
        )
    });
    all += &md;
    std::fs::write(&md_path, &all)?;
    let json_path = e.out.with_extension("json");
    let mut prev: Vec<serde_json::Value> = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default();
    prev.extend(rows);
    std::fs::write(&json_path, serde_json::to_string_pretty(&prev)?)?;
    println!("{all}");
    Ok(())
}

/// Multiply-adds per token of the projections and the head (what dominates decoding).
fn ssm_compute(m: &Llama) -> usize {
    let c = m.config();
    let attn = c.d_model * (c.n_heads * c.head_dim) * 2 + c.d_model * c.kv_row() * 2;
    let mlp = 3 * c.d_model * c.ffn_dim;
    c.n_layers * (attn + mlp) + c.d_model * m.head_tokens()
}
