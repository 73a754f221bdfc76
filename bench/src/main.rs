//! `specinfer-bench`: measures specinfer the way the SpecInfer paper did and the way an edge/cloud
//! deployment and its operator need, and writes JSON + Markdown + SVG plots under
//! `bench/results/`.
//!
//! Every ratio is measured within one run. Each section is a module with one entry point; `main`
//! loads the models and prompts once and runs the sections asked for, in order.

mod common;
mod forward_cost;
mod plot;
mod replay;
mod sections;
mod verifier_process;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use serde_json::{json, Value};
use specinfer_edge::EmbeddedVerifier;
use specinfer_model::{fetch, load_gguf, Llama};
use specinfer_train::{data, teacher};
use specinfer_verifier::engine::EngineConfig;

use crate::common::{jsonl_prompts, probe_netem, Ctx, Section};

#[derive(Parser)]
#[command(
    name = "specinfer-bench",
    version,
    about = "Reproduce the SpecInfer paper's measurements on specinfer, and measure a verifier's capacity as an operator does, with plots."
)]
struct Args {
    /// Small prompt counts and lengths: finishes in a few minutes per section.
    #[arg(long)]
    quick: bool,
    /// The sections to run, in order (comma-separated). The report is `report.md` for the
    /// default set, else named after the sections (`capacity.md`).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = SectionName::DEFAULT)]
    sections: Vec<SectionName>,
    /// The SSM (a folder from specinfer-train).
    #[arg(long, default_value = "models/ssm")]
    ssm: PathBuf,
    /// The feature-conditioned drafter the feature-draft section compares with the SSM.
    #[arg(long, default_value = "models/feature-draft")]
    feature_draft: PathBuf,
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
    /// Internal: time our forward on this GGUF and print the curve as JSON (the engine
    /// section's child process, whose kernels pick their x86 path from its environment).
    #[arg(long, hide = true)]
    engine_curve: Option<PathBuf>,
    #[arg(long, hide = true, value_delimiter = ',', default_values_t = [128])]
    engine_contexts: Vec<usize>,
    #[arg(long, hide = true, default_value_t = 5)]
    engine_reps: usize,
    /// Internal: decode greedily on this GGUF as llama-bench's tg32 does and print tokens/s
    /// (the engine section's alternating decode runs).
    #[arg(long, hide = true)]
    engine_decode: Option<PathBuf>,
    /// The catalogue LLMs the local section measures (comma-separated names, as `specinfer
    /// --model` takes them); default: all.
    #[arg(long, value_delimiter = ',')]
    local_models: Vec<String>,
    /// The LLM/SSM pairs the capacity section loads (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [CapacityPair::Smollm2, CapacityPair::Qwen])]
    capacity_pairs: Vec<CapacityPair>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CapacityPair {
    /// SmolLM2-135M-Instruct with the default SSM on held-out ShareGPT chat prompts.
    Smollm2,
    /// Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct drafting, on HumanEval.
    Qwen,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SectionName {
    /// Table 1: SSM/LLM top-k alignment.
    Alignment,
    /// Table 2 / Figure 7: tokens per pass against tree width.
    TreeWidth,
    /// Table 3: MSS, RRS and naive sampling.
    Sampling,
    /// Figure 11: tree-based against sequence-based decoding.
    TreeVsSequence,
    /// A client's tokens/s against the round-trip time.
    Rtt,
    /// Figure 10: latency against tree width and concurrent sessions.
    Concurrency,
    /// The Qwen2.5-Coder pair on HumanEval.
    Qwen,
    /// The verifier's capacity: server-only, server-side speculation and the split under
    /// Poisson load, pinned processes, a delaying relay.
    Capacity,
    /// The verifier fleet: failover time after a SIGKILL, goodput during a rolling restart,
    /// time to first token with prefix reuse (three verifier processes on loopback).
    Fleet,
    /// A soak: 16 clients against one verifier for 30 minutes (3 with --quick), answers cut
    /// off at random; the verifier's memory and KV over time, every answer against its solo run.
    Soak,
    /// The feature-conditioned drafter beside the SSM: top-k, tokens per pass (greedy and
    /// sampled, with and without the lookup), and over QUIC against a pinned verifier process
    /// tokens/s, drafting time per node and bytes per round each way.
    FeatureDraft,
    /// The CPU engine beside llama.cpp in the same run: decode and tree forwards (1 to 64
    /// nodes) of every shipped GGUF on the best x86 path and on AVX2, llama-bench on the same
    /// files and threads, and the machine's read bandwidth and int8 peak with the limits they
    /// set (`engine.md`; builds llama.cpp once, about 8 minutes).
    Engine,
    /// Speculation on the user's own machine: `specinfer generate` with its embedded verifier
    /// for every catalogue LLM with its default drafter, on code and chat prompts, plain, the
    /// lookup, the default and fixed arrangements, greedy and sampled, beside llama.cpp's plain
    /// and speculative decoding on the same files and cores (`local.md`; builds llama.cpp once).
    Local,
}

impl SectionName {
    const DEFAULT: [SectionName; 8] = [
        SectionName::Alignment,
        SectionName::TreeWidth,
        SectionName::Sampling,
        SectionName::TreeVsSequence,
        SectionName::Rtt,
        SectionName::Concurrency,
        SectionName::Qwen,
        SectionName::Capacity,
    ];

    fn file_stem(self) -> String {
        self.to_possible_value()
            .map_or("section".into(), |v| v.get_name().to_string())
    }
}

/// What the network sections talk to: a runtime and a verifier (remote, or embedded here).
pub struct Network {
    pub rt: tokio::runtime::Runtime,
    pub verifier: specinfer_net::RemoteConfig,
    _embedded: Option<EmbeddedVerifier>,
}

impl Network {
    fn new(args: &Args, ctx: &Ctx) -> Result<Self> {
        // Two workers: QUIC keeps moving while a pipelined draft runs on the other.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (verifier, embedded) = match &args.server {
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
                let e =
                    EmbeddedVerifier::start(ctx.llm.clone(), &ctx.tok, EngineConfig::default())?;
                (e.remote.clone(), Some(e))
            }
        };
        Ok(Network {
            rt,
            verifier,
            _embedded: embedded,
        })
    }
}

/// The capacity section over the pairs asked for.
fn capacity(args: &Args, smollm2: &Ctx, smollm2_path: &std::path::Path) -> Result<Section> {
    use sections::capacity::{Mode, Workload};
    let quick = args.quick;
    let qwen = if args.capacity_pairs.contains(&CapacityPair::Qwen) {
        let (n, max_new) = if quick { (4, 48) } else { (8, 96) };
        Some(sections::qwen::context(n, max_new)?)
    } else {
        None
    };
    let mut workloads = Vec::new();
    for pair in &args.capacity_pairs {
        workloads.push(match (pair, &qwen) {
            (CapacityPair::Smollm2, _) => Workload {
            tag: "smollm2",
            description:
                "SmolLM2-135M-Instruct (Q4_1) with the default SSM, held-out ShareGPT chat prompts"
                    .into(),
            ctx: smollm2,
            llm: smollm2_path.to_path_buf(),
            ssm: args.ssm.clone(),
            // Plain decoding on one core takes about 5-8 ms a token: 50 ms reads as a fast stream.
            slo_tpot_s: 0.050,
            max_new: if quick { 64 } else { 128 },
            sessions: if quick { 12 } else { 32 },
            rates: if quick {
                vec![1.0, 2.0, 4.0, 8.0, 12.0]
            } else {
                vec![0.5, 1.0, 2.0, 4.0, 8.0, 12.0]
            },
            modes: Mode::ALL.to_vec(),
        },
            (CapacityPair::Qwen, Some((ctx, llm, ssm))) => Workload {
            tag: "qwen",
            description: "Qwen2.5-Coder-1.5B-Instruct verified, Qwen2.5-Coder-0.5B-Instruct drafting (Q4_K_M), HumanEval prompts".into(),
            ctx,
            llm: llm.clone(),
            ssm: ssm.clone(),
            // Plain decoding on one core takes about 100 ms a token: 250 ms is a steady stream
            // of words.
            slo_tpot_s: 0.250,
            max_new: ctx.max_new,
            sessions: if quick { 6 } else { 12 },
            rates: if quick {
                vec![0.1, 0.2, 0.4]
            } else {
                vec![0.05, 0.1, 0.2, 0.4]
            },
            modes: Mode::MAIN.to_vec(),
        },
            (CapacityPair::Qwen, None) => unreachable!("loaded above when asked for"),
        });
    }
    sections::capacity::run(&workloads, &args.out)
}

/// What most sections share: SmolLM2, the SSM, the held-out prompts and their teacher answers.
struct Loaded {
    ctx: Ctx,
    examples: Vec<teacher::Example>,
    set_name: String,
    llm_path: PathBuf,
}

fn load_shared(args: &Args) -> Result<Loaded> {
    // Fixed 8-level trees with a weak SSM run at a fraction of incremental speed, so even the
    // full profile keeps the prompt set small enough to finish in about 20 minutes on 2 cores.
    let (n_prompts, max_new) = if args.quick { (6, 48) } else { (16, 80) };
    let llm_path = fetch::ensure(&fetch::SMOLLM2_135M, &fetch::cache_dir())?;
    let (llm, tok) = load_gguf(&llm_path)?;
    let ssm = Llama::from_safetensors(&args.ssm)
        .with_context(|| format!("loading SSM {}", args.ssm.display()))?;

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
    teacher::generate(
        &llm,
        &tok,
        &heldout,
        max_new as usize,
        16,
        teacher::Decoding::Greedy,
        &teacher_file,
    )?;
    let examples = teacher::read_examples(&teacher_file)?;
    let ctx = Ctx {
        prompts: examples.iter().map(|e| e.prompt.clone()).collect(),
        llm: std::sync::Arc::new(llm),
        tok,
        ssm: std::sync::Arc::new(ssm),
        max_new,
    };
    Ok(Loaded {
        ctx,
        examples,
        set_name,
        llm_path,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(gguf) = &args.engine_curve {
        return sections::engine::child(gguf, &args.engine_contexts, args.engine_reps);
    }
    if let Some(gguf) = &args.engine_decode {
        return sections::engine::decode_child(gguf);
    }
    let t0 = Instant::now();
    std::fs::create_dir_all(&args.out)?;
    let mut network: Option<Network> = None;
    let mut loaded: Option<Loaded> = None;
    let mut done: Vec<Section> = Vec::new();
    for &name in &args.sections {
        eprintln!("[{}]", name.file_stem());
        if name == SectionName::Engine {
            done.push(sections::engine::run(args.quick, &args.out)?);
            continue;
        }
        if name == SectionName::Local {
            done.push(sections::local::run(args.quick, &args.local_models)?);
            continue;
        }
        if loaded.is_none() {
            loaded = Some(load_shared(&args)?);
        }
        let Loaded {
            ctx,
            examples,
            set_name,
            llm_path,
        } = loaded.as_ref().expect("loaded above");
        if matches!(name, SectionName::Rtt | SectionName::Concurrency) && network.is_none() {
            network = Some(Network::new(&args, ctx)?);
        }
        let net = || network.as_ref().context("the network sections' verifier");
        let section = match name {
            SectionName::Alignment => sections::alignment::run(ctx, examples, set_name)?,
            SectionName::TreeWidth => sections::tree_width::run(ctx, &args.out)?,
            SectionName::Sampling => sections::stochastic::run(ctx)?,
            SectionName::TreeVsSequence => sections::tree_vs_sequence::run(ctx)?,
            SectionName::Rtt => sections::rtt::run(ctx, net()?, args.quick, &args.out)?,
            SectionName::Concurrency => {
                sections::concurrency::run(ctx, net()?, args.quick, &args.out)?
            }
            SectionName::Qwen => sections::qwen::run(args.quick)?,
            SectionName::Capacity => capacity(&args, ctx, llm_path)?,
            SectionName::Fleet => sections::fleet::run(ctx, llm_path, &args.ssm, args.quick)?,
            SectionName::Soak => sections::soak::run(ctx, llm_path, args.quick)?,
            SectionName::FeatureDraft => {
                sections::feature_draft::run(ctx, examples, &args.feature_draft, llm_path)?
            }
            SectionName::Engine | SectionName::Local => unreachable!("run above"),
        };
        done.push(section);
    }

    let machine = json!({
        "cpu": std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())),
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "os": std::env::consts::OS,
        "specinfer": env!("CARGO_PKG_VERSION"),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "network": match probe_netem() {
            Ok(()) => "round trips: a delay added by the client per round (RTT, concurrency sections) or a UDP relay between processes (capacity); netem works here but the harness does not use it".to_string(),
            Err(why) => format!("round trips: a delay added by the client per round (RTT, concurrency sections) or a UDP relay between processes (capacity); netem unavailable: {why}"),
        },
        "minutes": t0.elapsed().as_secs_f64() / 60.0,
    });
    let stem = if args.sections == SectionName::DEFAULT {
        "report".to_string()
    } else {
        args.sections
            .iter()
            .map(|s| s.file_stem())
            .collect::<Vec<_>>()
            .join("+")
    };
    let mut report = serde_json::Map::new();
    report.insert("machine".into(), machine.clone());
    for s in &done {
        report.insert(s.key.into(), s.json.clone());
    }
    std::fs::write(
        args.out.join(format!("{stem}.json")),
        serde_json::to_string_pretty(&Value::Object(report))?,
    )?;
    let mut md = format!(
        "# specinfer benchmark\n\nMachine: {} ({} cores). Command: `{}`. Network: {}. Took {:.1} min.\n\n",
        machine["cpu"].as_str().unwrap_or("?"),
        machine["cores"],
        machine["command"].as_str().unwrap_or(""),
        machine["network"].as_str().unwrap_or(""),
        machine["minutes"].as_f64().unwrap_or(0.0)
    );
    for s in &done {
        md += &s.markdown;
    }
    std::fs::write(args.out.join(format!("{stem}.md")), &md)?;
    println!("{md}");
    Ok(())
}
