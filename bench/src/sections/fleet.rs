//! The verifier fleet as an operator sees it: three `specinfer-verifier` processes on loopback
//! sharing one certificate, and clients that know all three (greedy, the default SSM and tree).
//!
//! - **Failover**: a verifier killed with SIGKILL while clients generate; for each session it
//!   held, the time from the kill to that session's next token (found dead by the QUIC idle
//!   timeout, a short resume attempt, then re-opened elsewhere with its committed tokens).
//! - **Rolling restart**: generated tokens/s while the three are drained and restarted one after
//!   another (`specinfer-verifier drain`, as a preStop hook runs it), against steady state.
//! - **Prefix reuse**: time to first token of a 10-turn chat's last turn, on a verifier that
//!   keeps ended sessions' K/V and on one that does not.
//!
//! All processes share the machine's cores (three verifiers and the clients on two cores is
//! what this machine has): the ratios, not the absolute times, are the point.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use specinfer_edge::Client;
use specinfer_model::{ChatMessage, Llama};
use specinfer_net::{RemoteConfig, ServerIdentity, VerifierAddrs};
use specinfer_speculator::{
    CachedDraft, DraftMode, DraftModel, Drafter, RoundDriver, Speculator, TreeShape,
};
use specinfer_wire::SamplingParams;

use crate::common::{Ctx, Section};
use crate::verifier_process::{VerifierOptions, VerifierProcess};

/// The clients' QUIC idle timeout: how soon a dead verifier is noticed.
const IDLE: Duration = Duration::from_secs(3);
/// A session whose next token came later than this after a kill was held up by it (rounds
/// come every 0.1-0.3 s here otherwise).
const HELD_UP_S: f64 = 1.0;

/// The chat the prefix-reuse measurement holds (one user message per turn).
const TURNS: [&str; 10] = [
    "What is the capital of France?",
    "And of Italy?",
    "Which of the two is older?",
    "Name a famous museum in each.",
    "What can I eat there?",
    "How do I travel between them?",
    "How long does the train take?",
    "What should I pack?",
    "Any tips for the weather?",
    "Summarize our plan in one sentence.",
];

struct Fleet {
    verifiers: Vec<VerifierProcess>,
    addrs: Vec<SocketAddr>,
    /// The verifiers' certificate and key, private to this fleet (two fleets alive at once must not
    /// share or delete each other's files).
    dir: tempfile::TempDir,
    llm: PathBuf,
}

impl Fleet {
    fn start(llm: &Path, n: usize, extra: &[&str]) -> Result<Fleet> {
        let dir = tempfile::tempdir()?;
        let (cert, key) = ServerIdentity::self_signed_pem(&["localhost"])?;
        std::fs::write(dir.path().join("cert.pem"), cert)?;
        std::fs::write(dir.path().join("key.pem"), key)?;
        let mut fleet = Fleet {
            verifiers: Vec::new(),
            addrs: Vec::new(),
            dir,
            llm: llm.to_path_buf(),
        };
        for _ in 0..n {
            let v = fleet.spawn("127.0.0.1:0".parse()?, extra)?;
            fleet.addrs.push(v.addr);
            fleet.verifiers.push(v);
        }
        Ok(fleet)
    }

    fn spawn(&self, listen: SocketAddr, extra: &[&str]) -> Result<VerifierProcess> {
        let (cert, key) = (
            self.dir.path().join("cert.pem"),
            self.dir.path().join("key.pem"),
        );
        VerifierProcess::start_with(&VerifierOptions {
            core: None,
            llm: &self.llm,
            ssm: None,
            listen,
            identity: Some((&cert, &key)),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// A new process for verifier `i`, on its old address.
    fn restart(&mut self, i: usize) -> Result<()> {
        self.verifiers[i] = self.spawn(self.addrs[i], &[])?;
        Ok(())
    }

    fn client_config(&self, ctx: &Ctx) -> Result<(RemoteConfig, VerifierAddrs)> {
        let cfg = self.verifiers[0].remote(self.addrs[0], ctx.tok.fingerprint())?;
        let list: Vec<String> = self.addrs.iter().map(|a| a.to_string()).collect();
        Ok((
            RemoteConfig {
                idle_timeout: IDLE,
                ..cfg
            },
            VerifierAddrs::parse(&list.join(","))?,
        ))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // The processes stop before their files go (the folder is removed after this).
        self.verifiers.clear();
    }
}

/// A greedy generation of `prompt` drafted by `ssm` with the clients' default tree.
fn driver(
    stop_ids: &[u32],
    ssm: &'static Llama,
    prompt: &[u32],
    max_new: u32,
) -> RoundDriver<'static> {
    let params = SamplingParams {
        stop_ids: stop_ids.to_vec(),
        ..SamplingParams::greedy(max_new)
    };
    let drafter = Drafter {
        speculator: Speculator::for_request(TreeShape::clients_default(), DraftMode::Greedy, 0),
        drafts: vec![Box::new(CachedDraft::new(ssm)) as Box<dyn DraftModel + Send>],
    };
    RoundDriver::new(prompt.to_vec(), params, Some(drafter)).expect("a valid request")
}

/// Each client's rounds: when each came, and how many tokens it brought.
type RoundLog = Arc<Mutex<Vec<Vec<(Instant, usize)>>>>;

/// Clients generating over and over; every round's time and tokens.
struct Load {
    rounds: RoundLog,
    errors: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(
        rt: &tokio::runtime::Runtime,
        ctx: &Ctx,
        ssm: &'static Llama,
        fleet: &Fleet,
        clients: usize,
    ) -> Result<Load> {
        let (cfg, addrs) = fleet.client_config(ctx)?;
        let load = Load {
            rounds: Arc::new(Mutex::new(vec![Vec::new(); clients])),
            errors: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            tasks: Vec::new(),
        };
        let mut tasks = Vec::new();
        for c in 0..clients {
            let prompts: Vec<Vec<u32>> = ctx.prompts.clone();
            let max_new = ctx.max_new;
            let stop_ids = ctx.tok.eos().to_vec();
            let (cfg, addrs) = (cfg.clone(), addrs.clone());
            let (rounds, errors, stop) =
                (load.rounds.clone(), load.errors.clone(), load.stop.clone());
            tasks.push(rt.spawn(async move {
                let mut client = match Client::connect_fleet(cfg, addrs).await {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("  client {c}: {e}");
                        errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                };
                let mut n = c;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = &prompts[n % prompts.len()];
                    n += 1;
                    let mut driver = driver(&stop_ids, ssm, prompt, max_new);
                    let result = client
                        .generate(&mut driver, |out| {
                            rounds.lock().unwrap()[c].push((Instant::now(), out.tokens.len()))
                        })
                        .await;
                    if let Err(e) = result {
                        eprintln!("  client {c}: {e}");
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                client.shutdown().await;
            }));
        }
        Ok(Load { tasks, ..load })
    }

    /// Tokens generated in [from, to).
    fn tokens_between(&self, from: Instant, to: Instant) -> usize {
        self.rounds
            .lock()
            .unwrap()
            .iter()
            .flatten()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, n)| n)
            .sum()
    }

    fn finish(self, rt: &tokio::runtime::Runtime) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = rt.block_on(t);
        }
        self.errors.load(Ordering::Relaxed)
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn run(ctx: &Ctx, llm: &Path, ssm_dir: &Path, quick: bool) -> Result<Section> {
    let ssm: &'static Llama = Box::leak(Box::new(
        Llama::from_safetensors(ssm_dir).context("loading the SSM")?,
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let clients = if quick { 6 } else { 12 };
    let kills = if quick { 3 } else { 8 };
    let steady_s = if quick { 10.0 } else { 30.0 };

    // Failover after SIGKILL.
    let mut fleet = Fleet::start(llm, 3, &[])?;
    let load = Load::start(&rt, ctx, ssm, &fleet, clients)?;
    std::thread::sleep(Duration::from_secs(3));
    let (mut victims, mut bystanders) = (Vec::new(), Vec::new());
    for k in 0..kills {
        let i = k % 3;
        let killed = Instant::now();
        fleet.verifiers[i].kill()?;
        // Every session on it recovers within the idle timeout, a resume attempt and a
        // re-open; then the verifier comes back.
        std::thread::sleep(IDLE * 3);
        fleet.restart(i)?;
        std::thread::sleep(Duration::from_secs(2));
        let rounds = load.rounds.lock().unwrap().clone();
        let (mut hit, mut missed) = (Vec::new(), Vec::new());
        for rs in &rounds {
            let Some(next) = rs.iter().find(|(t, _)| *t > killed) else {
                continue;
            };
            let delay = next.0.duration_since(killed).as_secs_f64();
            // Its generation at the kill: the first to end after it.
            // A session's rounds come well within a second of each other here; one whose next
            // token came later was held up by the kill (it was on the killed verifier, or
            // opening a session there).
            if delay > HELD_UP_S {
                hit.push(delay);
            } else {
                missed.push(delay);
            }
        }
        eprintln!(
            "  kill {} (verifier {i}): next token after {hit:.2?} s on sessions held up, {missed:.2?} s on the others",
            k + 1
        );
        victims.extend(hit);
        bystanders.extend(missed);
    }
    let failover_errors = load.finish(&rt);
    drop(fleet);
    victims.sort_by(f64::total_cmp);
    bystanders.sort_by(f64::total_cmp);

    // Goodput: steady state, then during a rolling restart.
    let mut fleet = Fleet::start(llm, 3, &[])?;
    let load = Load::start(&rt, ctx, ssm, &fleet, clients)?;
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(steady_s));
    let t1 = Instant::now();
    let exe = VerifierProcess::exe()?;
    for i in 0..3 {
        let admin = fleet.verifiers[i].admin().to_string();
        let out = std::process::Command::new(&exe)
            .args(["drain", "--admin", &admin, "--timeout-s", "60"])
            .output()?;
        if !out.status.success() {
            bail!("drain: {}", String::from_utf8_lossy(&out.stderr));
        }
        if !fleet.verifiers[i].wait_exit(Duration::from_secs(30))? {
            bail!("verifier {i} did not exit after draining");
        }
        fleet.restart(i)?;
    }
    let t2 = Instant::now();
    let steady = load.tokens_between(t0, t1) as f64 / (t1 - t0).as_secs_f64();
    let rolling = load.tokens_between(t1, t2) as f64 / (t2 - t1).as_secs_f64();
    let rolling_errors = load.finish(&rt);
    drop(fleet);

    // Prefix reuse: the last turn of a 10-turn chat, with and without the prefix cache.
    let mut ttft = Vec::new();
    for extra in [&[][..], &["--prefix-cache-mib", "0"][..]] {
        let fleet = Fleet::start(llm, 1, extra)?;
        let (cfg, addrs) = fleet.client_config(ctx)?;
        let (last_ttft, prompt_len) = rt.block_on(async {
            let mut client = Client::connect_fleet(cfg, addrs).await?;
            let mut messages = Vec::new();
            let (mut last, mut len) = (Duration::ZERO, 0);
            for turn in TURNS {
                messages.push(ChatMessage::new("user", turn));
                let prompt = ctx.tok.encode(&ctx.tok.chat_prompt(&messages))?;
                len = prompt.len();
                let g = client
                    .generate(&mut driver(ctx.tok.eos(), ssm, &prompt, 32), |_| {})
                    .await?;
                messages.push(ChatMessage::new("assistant", &g.text));
                last = g.ttft;
            }
            client.shutdown().await;
            anyhow::Ok((last, len))
        })?;
        ttft.push((last_ttft.as_secs_f64(), prompt_len));
    }
    let ((with_cache, prompt_len), (without_cache, _)) = (ttft[0], ttft[1]);

    let json = json!({
        "clients": clients,
        "idle_timeout_s": IDLE.as_secs_f64(),
        "failover": {
            "kills": kills,
            "sessions_held_up": victims.len(),
            "held_up_threshold_s": HELD_UP_S,
            "death_to_next_token_s": {"p50": percentile(&victims, 0.5), "p99": percentile(&victims, 0.99), "max": victims.last()},
            "other_sessions_next_token_s": {"p50": percentile(&bystanders, 0.5)},
            "errors": failover_errors,
        },
        "rolling_restart": {
            "steady_tokens_per_s": steady,
            "rolling_tokens_per_s": rolling,
            "ratio": rolling / steady,
            "seconds": (t2 - t1).as_secs_f64(),
            "errors": rolling_errors,
        },
        "prefix_reuse": {
            "turns": TURNS.len(),
            "last_prompt_tokens": prompt_len,
            "ttft_with_cache_s": with_cache,
            "ttft_without_cache_s": without_cache,
        },
    });
    let markdown = format!(
        "## Verifier fleet\n\n\
Three verifier processes on loopback sharing one certificate, {clients} clients knowing all three \
(greedy, default SSM and tree, client idle timeout {idle:.0} s), all on the machine's shared cores.\n\n\
| measurement | value |\n|---|---|\n\
| sessions held up by {kills} SIGKILLs (next token over {held:.0} s after the kill) | {rec} |\n\
| death to a held-up session's next token, p50 / p99 | {f50:.2} / {f99:.2} s |\n\
| next token of the other sessions, p50 | {b50:.2} s |\n\
| errors seen by clients (failover) | {fe} |\n\
| goodput, steady state | {steady:.1} tokens/s |\n\
| goodput during a rolling restart of all three ({roll_s:.1} s) | {rolling:.1} tokens/s ({ratio:.2}x) |\n\
| errors seen by clients (rolling restart) | {re} |\n\
| last turn of a 10-turn chat ({prompt_len} prompt tokens), time to first token with / without prefix reuse | {with_cache:.3} / {without_cache:.3} s ({speed:.1}x) |\n\n",
        idle = IDLE.as_secs_f64(),
        rec = victims.len(),
        held = HELD_UP_S,
        f50 = percentile(&victims, 0.5),
        f99 = percentile(&victims, 0.99),
        b50 = percentile(&bystanders, 0.5),
        fe = failover_errors,
        roll_s = (t2 - t1).as_secs_f64(),
        ratio = rolling / steady,
        re = rolling_errors,
        speed = without_cache / with_cache,
    );
    Ok(Section {
        key: "fleet",
        json,
        markdown,
    })
}
