//! Capacity, as a fleet operator measures it: the verifier binary in its own process on its own
//! core, open-loop Poisson arrivals of chat sessions from a load generator on the other core,
//! every datagram through a UDP relay that adds the round trip. The same load, the same verifier
//! binary (a fresh process for each mode, started alike) and the same run, three ways:
//!
//! * server-only incremental decoding (the verifier decodes on its own with continuous batching
//!   and streams; what a cloud API runs),
//! * server-side speculation (the verifier drafts with the same SSM itself, on its core),
//! * the split: clients replaying their recorded trees (see [`crate::replay`]), sized load-aware
//!   or whole.
//!
//! Per arrival rate: goodput, time per output token (p50/p99 over sessions), time to first token,
//! verifier CPU-seconds per generated token, nodes per batched forward. The headline is the
//! highest goodput whose p99 time per output token keeps within the SLO.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use specinfer_net::{probe_round_trips, RelayConfig, RemoteConfig, UdpRelay};
use specinfer_wire::{SamplingParams, ServerDrafting};

use crate::common::{Ctx, Section};
use crate::forward_cost::{self, ForwardCost};
use crate::plot::plot_lines;
use crate::replay::{self, Recording, SessionTrace, Sizing};
use crate::verifier_process::{pin_this_process, VerifierProcess};

/// One LLM/SSM pair under load: its models and prompts, the load, and what counts as serving it
/// well.
pub struct Workload<'a> {
    /// Names the pair in the report, and its plots' files (`capacity_<tag>.svg`).
    pub tag: &'static str,
    pub description: String,
    pub ctx: &'a Ctx,
    pub llm: PathBuf,
    /// The SSM, for the verifier's own drafting (server-side speculation).
    pub ssm: PathBuf,
    /// The service-level objective on p99 time per output token.
    pub slo_tpot_s: f64,
    pub max_new: u32,
    /// Sessions per arrival rate.
    pub sessions: usize,
    /// Session arrivals per second, one step each.
    pub rates: Vec<f64>,
    pub modes: Vec<Mode>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mode {
    ServerIncremental,
    ServerSpeculative,
    Split(Sizing),
    /// The split with load-aware trees that hands an answer to the verifier's own decoding
    /// once split rounds cost more per token ([`specinfer_speculator::HandOff`]): the clients'
    /// default.
    SplitHandingOff,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::ServerIncremental => "server-only incremental",
            Mode::ServerSpeculative => "server-side speculation",
            Mode::Split(Sizing::LoadAware) => "split, load-aware trees",
            Mode::Split(Sizing::Whole) => "split, whole dynamic:32 trees",
            Mode::SplitHandingOff => "split, load-aware trees + hand-off",
        }
    }
}

impl Mode {
    /// Server-only decoding, server-side speculation, and the split with load-aware trees,
    /// without and with the hand-off.
    pub const MAIN: [Mode; 4] = [
        Mode::ServerIncremental,
        Mode::ServerSpeculative,
        Mode::Split(Sizing::LoadAware),
        Mode::SplitHandingOff,
    ];
    /// [`Mode::MAIN`] and the split with whole trees, to show what the load-aware sizing buys.
    pub const ALL: [Mode; 5] = [
        Mode::ServerIncremental,
        Mode::ServerSpeculative,
        Mode::Split(Sizing::LoadAware),
        Mode::SplitHandingOff,
        Mode::Split(Sizing::Whole),
    ];
}

/// The round trips every workload is measured at.
const RTTS_MS: [u64; 3] = [0, 14, 50];

/// What one arrival rate measured.
struct Step {
    rate: f64,
    sessions: usize,
    tokens: usize,
    goodput: f64,
    tpot_p50: f64,
    tpot_p99: f64,
    ttft_p50: f64,
    ttft_p99: f64,
    cpu_s_per_token: f64,
    nodes_per_forward: f64,
    tokens_per_round: f64,
    /// Sessions that handed the rest of their answer to the verifier.
    handed_off: usize,
    /// Of those, the sessions that did before their first tree (told by the verifier as they
    /// opened that the split does not pay).
    handed_off_at_once: usize,
    /// The share of the verifier's CPU time spent in its batched forwards (forward,
    /// verification, compaction); the rest is QUIC, sessions and scheduling.
    forward_share: f64,
}

impl Step {
    fn to_json(&self) -> Value {
        json!({"arrival_rate_per_s": self.rate, "sessions": self.sessions, "tokens": self.tokens,
            "goodput_tokens_per_s": self.goodput, "tpot_p50_ms": self.tpot_p50 * 1e3, "tpot_p99_ms": self.tpot_p99 * 1e3,
            "ttft_p50_ms": self.ttft_p50 * 1e3, "ttft_p99_ms": self.ttft_p99 * 1e3,
            "verifier_cpu_s_per_token": self.cpu_s_per_token, "nodes_per_forward": self.nodes_per_forward,
            "tokens_per_round": self.tokens_per_round, "sessions_handed_off": self.handed_off,
            "sessions_handed_off_before_a_tree": self.handed_off_at_once,
            "forward_share_of_verifier_cpu": self.forward_share})
    }
}

/// The best goodput whose p99 time per output token is within `slo` over `steps` (0 when none
/// keeps it).
fn best_within_slo(steps: &[Step], slo: f64) -> f64 {
    steps
        .iter()
        .filter(|s| s.tpot_p99 <= slo)
        .map(|s| s.goodput)
        .fold(0.0, f64::max)
}

/// The `q` quantile of the finite values (NaN when there are none).
fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Measures every workload in turn.
pub fn run(workloads: &[Workload], out: &Path) -> Result<Section> {
    let mut md = "## Capacity (issue #22)\n\n".to_string();
    let mut json = serde_json::Map::new();
    for w in workloads {
        eprintln!("      capacity: {}", w.description);
        let (part, j) = run_workload(w, out)?;
        md += &part;
        json.insert(w.tag.into(), j);
    }
    Ok(Section {
        key: "capacity",
        json: Value::Object(json),
        markdown: md,
    })
}

fn run_workload(w: &Workload, out: &Path) -> Result<(String, Value)> {
    let (ctx, max_new) = (w.ctx, w.max_new);
    let params = SamplingParams {
        stop_ids: ctx.tok.eos().to_vec(),
        ..SamplingParams::greedy(max_new)
    };
    eprintln!(
        "      recording {} prompts' trees (dynamic:32 at every position of the greedy answer)",
        ctx.prompts.len()
    );
    let n_prompts = ctx.prompts.len();
    let recordings = Arc::new(replay::record(
        &ctx.llm,
        &ctx.ssm,
        &ctx.prompts,
        &params,
        32,
        &mut |done| eprintln!("      recorded {done}/{n_prompts}"),
    )?);

    // Read before the process is pinned, which narrows what it reports.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = cores >= 2;
    // The engine's cost curve on the verifier's core, before any verifier runs there.
    let context =
        ctx.prompts.iter().map(Vec::len).sum::<usize>() / n_prompts.max(1) + max_new as usize / 2;
    eprintln!("      timing the engine's batched forwards on core 0 ({context} cached tokens)");
    let curve = forward_cost::measure(&ctx.llm, &ctx.prompts[0], context, 0, 5)?;
    pin_this_process(if pinned { "1" } else { "0" })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(measure(w, pinned.then_some(0), &recordings, &params));
    pin_this_process(&format!("0-{}", cores - 1))?;
    let (relay_rtts, table) = result?;
    report(
        w,
        &table,
        &curve,
        context,
        &relay_rtts,
        pinned,
        n_prompts,
        out,
    )
}

type Table = Vec<(u64, Mode, Vec<Step>)>;

/// Every mode at every round trip, each with a verifier process of its own (on `core`) that
/// starts alike: the verifier keeps closed sessions' K/V for later sessions with the same
/// prompt, and its cost book what its rounds cost, so a verifier shared by the modes measured
/// each after what the one before had left (more cached prompts, or the costs of a heavier
/// load) rather than as a deployment of that mode would run.
async fn measure(
    w: &Workload<'_>,
    core: Option<usize>,
    recordings: &Arc<Vec<Recording>>,
    params: &SamplingParams,
) -> Result<(Vec<(u64, f64, f64)>, Table)> {
    let mut relay_rtts = Vec::new();
    for rtt in RTTS_MS {
        let pings =
            probe_round_trips(RelayConfig::round_trip(Duration::from_millis(rtt)), 20).await?;
        let p50 = percentile(&pings, 0.5);
        let max = pings.iter().copied().fold(0.0, f64::max);
        eprintln!("      relay told {rtt} ms: ping p50 {p50:.2} ms, max {max:.2} ms");
        relay_rtts.push((rtt, p50, max));
    }
    let mut table = Vec::new();
    for rtt in RTTS_MS {
        for &mode in &w.modes {
            let verifier = VerifierProcess::start(core, &w.llm, &w.ssm)?;
            // Every prompt once, untimed and without a round trip: each mode's first sessions
            // find the prompts' K/V cached, as its later ones do.
            let direct = verifier.remote(verifier.addr, w.ctx.tok.fingerprint())?;
            for i in 0..recordings.len() {
                let arrival = Instant::now();
                one_session(
                    &direct,
                    recordings,
                    i,
                    params,
                    Mode::ServerIncremental,
                    arrival,
                )
                .await?;
            }
            let relay = UdpRelay::with_path(
                verifier.addr,
                RelayConfig::round_trip(Duration::from_millis(rtt)),
            )
            .await?;
            let remote = verifier.remote(relay.addr, w.ctx.tok.fingerprint())?;
            // One untimed session of the mode warms its connections (and, for the split, tells
            // the verifier what a split round costs).
            one_session(&remote, recordings, 0, params, mode, Instant::now()).await?;
            let mut steps = Vec::new();
            for (i, &rate) in w.rates.iter().enumerate() {
                let s = step(
                    &verifier, &remote, recordings, params, mode, rate, w.sessions, i as u64,
                )
                .await?;
                eprintln!(
                    "      RTT {rtt} ms, {}, {rate}/s: goodput {:.0} tok/s, TPOT p50 {:.1} p99 {:.1} ms, TTFT p50 {:.0} ms, verifier {:.2} ms CPU/token, {:.1} nodes/forward, {} handed off ({} at once)",
                    mode.name(),
                    s.goodput,
                    s.tpot_p50 * 1e3,
                    s.tpot_p99 * 1e3,
                    s.ttft_p50 * 1e3,
                    s.cpu_s_per_token * 1e3,
                    s.nodes_per_forward,
                    s.handed_off,
                    s.handed_off_at_once
                );
                steps.push(s);
            }
            table.push((rtt, mode, steps));
        }
    }
    Ok((relay_rtts, table))
}

async fn one_session(
    remote: &RemoteConfig,
    recordings: &[Recording],
    i: usize,
    params: &SamplingParams,
    mode: Mode,
    arrival: Instant,
) -> Result<SessionTrace> {
    let rec = &recordings[i % recordings.len()];
    match mode {
        Mode::ServerIncremental => {
            replay::server_generated(remote, rec, params, ServerDrafting::Plain, arrival).await
        }
        Mode::ServerSpeculative => {
            replay::server_generated(remote, rec, params, ServerDrafting::Speculative, arrival)
                .await
        }
        Mode::Split(sizing) => replay::replay(remote, rec, params, sizing, false, arrival).await,
        Mode::SplitHandingOff => {
            replay::replay(remote, rec, params, Sizing::LoadAware, true, arrival).await
        }
    }
}

/// `sessions` sessions arriving as a Poisson process of `rate` per second.
#[allow(clippy::too_many_arguments)]
async fn step(
    verifier: &VerifierProcess,
    remote: &RemoteConfig,
    recordings: &Arc<Vec<Recording>>,
    params: &SamplingParams,
    mode: Mode,
    rate: f64,
    sessions: usize,
    seed: u64,
) -> Result<Step> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    const FORWARD_SECONDS: &str = "specinfer_forward_seconds_sum";
    let (cpu0, batches0, nodes0, forward0) = (
        verifier.cpu_seconds()?,
        verifier.counter("specinfer_batches_total").await?,
        verifier.counter("specinfer_forward_nodes_total").await?,
        verifier.counter(FORWARD_SECONDS).await?,
    );
    let start = Instant::now();
    let mut at = 0.0;
    let mut tasks = Vec::new();
    for i in 0..sessions {
        at += -(1.0 - rng.random::<f64>()).ln() / rate;
        let due = start + Duration::from_secs_f64(at);
        let (remote, recordings, params) = (remote.clone(), recordings.clone(), params.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(due.into()).await;
            let arrival = Instant::now();
            one_session(&remote, &recordings, i, &params, mode, arrival).await
        }));
    }
    let mut traces = Vec::new();
    for t in tasks {
        traces.push(t.await??);
    }
    let wall = start.elapsed().as_secs_f64();
    let cpu = verifier.cpu_seconds()? - cpu0;
    let batches = verifier.counter("specinfer_batches_total").await? - batches0;
    let nodes = verifier.counter("specinfer_forward_nodes_total").await? - nodes0;
    let forward = verifier.counter(FORWARD_SECONDS).await? - forward0;
    let tokens: usize = traces.iter().map(SessionTrace::tokens).sum();
    let rounds: usize = traces.iter().map(|t| t.verdicts.len()).sum();
    let tpot: Vec<f64> = traces.iter().map(SessionTrace::tpot).collect();
    let ttft: Vec<f64> = traces.iter().map(SessionTrace::ttft).collect();
    Ok(Step {
        rate,
        sessions,
        tokens,
        // The first arrival is at `at` of the first session, close to 0: goodput over the
        // whole step, arrivals and drain included.
        goodput: tokens as f64 / wall,
        tpot_p50: percentile(&tpot, 0.5),
        tpot_p99: percentile(&tpot, 0.99),
        ttft_p50: percentile(&ttft, 0.5),
        ttft_p99: percentile(&ttft, 0.99),
        cpu_s_per_token: cpu / tokens.max(1) as f64,
        nodes_per_forward: nodes / batches.max(1.0),
        tokens_per_round: tokens as f64 / rounds.max(1) as f64,
        handed_off: traces
            .iter()
            .filter(|t| t.handed_off_after.is_some())
            .count(),
        handed_off_at_once: traces
            .iter()
            .filter(|t| t.handed_off_after == Some(0))
            .count(),
        forward_share: forward / cpu.max(1e-9),
    })
}

#[allow(clippy::too_many_arguments)]
fn report(
    w: &Workload,
    table: &Table,
    curve: &[ForwardCost],
    context: usize,
    relay_rtts: &[(u64, f64, f64)],
    pinned: bool,
    prompts: usize,
    out: &Path,
) -> Result<(String, Value)> {
    let (sessions, max_new, slo) = (w.sessions, w.max_new, w.slo_tpot_s);
    let find = |rtt: u64, mode: Mode| {
        table
            .iter()
            .find(|(r, m, _)| *r == rtt && *m == mode)
            .map(|(_, _, s)| s.as_slice())
            .unwrap_or(&[])
    };
    let rtts: Vec<u64> = relay_rtts.iter().map(|r| r.0).collect();
    let plot_rtt = if rtts.contains(&14) { 14 } else { rtts[0] };
    let series = |f: fn(&Step) -> f64| -> Vec<(&'static str, Vec<(f64, f64)>)> {
        w.modes
            .iter()
            .map(|&m| {
                (
                    m.name(),
                    find(plot_rtt, m).iter().map(|s| (s.rate, f(s))).collect(),
                )
            })
            .collect()
    };
    plot_lines(
        &out.join(format!("capacity_{}.svg", w.tag)),
        &format!("{}: goodput vs arrival rate, {plot_rtt} ms RTT", w.tag),
        "sessions arriving per second",
        "generated tokens/s (all sessions)",
        &series(|s| s.goodput),
    )?;
    plot_lines(
        &out.join(format!("capacity_{}_latency.svg", w.tag)),
        &format!(
            "{}: p99 time per output token vs arrival rate, {plot_rtt} ms RTT",
            w.tag
        ),
        "sessions arriving per second",
        "p99 ms per output token",
        &series(|s| s.tpot_p99 * 1e3),
    )?;

    let mut md = format!(
        "### {}\n\nThe `specinfer-verifier` binary in its own process{}, a fresh one for every mode at every round trip, \
         its prefix cache warmed with every prompt once before it is measured; the load generator in this one{}; \
         every datagram through a UDP relay adding the round trip (measured with 20 UDP pings through it: {}). \
         Per arrival rate, {sessions} sessions ({prompts} prompts, greedy, at most {max_new} new tokens) arrive as a Poisson process, \
         each on its own QUIC connection. Split sessions replay trees recorded once with the real SSM (dynamic:32 at every position of the LLM's greedy answer) and check every verdict against the recorded answer; \
         the server modes' answers are checked the same way. SLO: p99 time per output token (TPOT, per session, after its first verdict) <= {:.0} ms.\n\n",
        w.description,
        if pinned { " pinned to core 0 (`taskset -c 0`)" } else { " (not pinned: fewer than 2 cores)" },
        if pinned { " pinned to core 1" } else { "" },
        relay_rtts
            .iter()
            .map(|(r, p50, max)| format!("told {r} ms, p50 {p50:.2} ms, max {max:.2} ms"))
            .collect::<Vec<_>>()
            .join("; "),
        slo * 1e3
    );
    md += "Highest goodput within the SLO (tokens/s), and its ratio to server-only incremental:\n\n| RTT ms |";
    for m in &w.modes {
        md += &format!(" {} |", m.name());
    }
    md += "\n|---|";
    md += &"---|".repeat(w.modes.len());
    md += "\n";
    let mut headline = Vec::new();
    for &rtt in &rtts {
        let base = best_within_slo(find(rtt, Mode::ServerIncremental), slo);
        md += &format!("| {rtt} |");
        for &m in &w.modes {
            let g = best_within_slo(find(rtt, m), slo);
            md += &format!(" {g:.0} ({:.2}x) |", g / base.max(1e-9));
            headline.push(json!({"rtt_ms": rtt, "mode": m.name(), "goodput_within_slo": g, "vs_server_incremental": g / base.max(1e-9)}));
        }
        md += "\n";
    }
    let (engine_md, engine_json) = forward_cost::report(curve, slo, context);
    md += "\n";
    md += &engine_md;
    if let Some(peak) = forward_cost::peak(curve) {
        md +=
            "The engine's peak node rate against the server-only goodput measured within the SLO: ";
        md += &rtts
            .iter()
            .map(|&rtt| {
                let base = best_within_slo(find(rtt, Mode::ServerIncremental), slo);
                format!("{:.2}x at {rtt} ms", peak.nodes_per_s() / base.max(1e-9))
            })
            .collect::<Vec<_>>()
            .join(", ");
        md += ".\n";
    }
    md += "\nEvery step:\n\n| RTT ms | mode | arrivals/s | goodput tok/s | TPOT p50 / p99 ms | TTFT p50 / p99 ms | verifier CPU ms/token | forward share of it | nodes per forward | tokens per round | sessions handed off (before their first tree) |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    let mut steps_json = Vec::new();
    for (rtt, mode, steps) in table {
        for s in steps {
            md += &format!(
                "| {rtt} | {} | {} | {:.0} | {:.1} / {:.1} | {:.0} / {:.0} | {:.2} | {:.0}% | {:.1} | {:.2} | {} of {} ({} at once) |\n",
                mode.name(),
                s.rate,
                s.goodput,
                s.tpot_p50 * 1e3,
                s.tpot_p99 * 1e3,
                s.ttft_p50 * 1e3,
                s.ttft_p99 * 1e3,
                s.cpu_s_per_token * 1e3,
                s.forward_share * 100.0,
                s.nodes_per_forward,
                s.tokens_per_round,
                s.handed_off,
                s.sessions,
                s.handed_off_at_once
            );
            let mut j = s.to_json();
            j["rtt_ms"] = json!(rtt);
            j["mode"] = json!(mode.name());
            steps_json.push(j);
        }
    }
    md += &format!(
        "\n![goodput](capacity_{0}.svg)\n\n![latency](capacity_{0}_latency.svg)\n\n",
        w.tag
    );
    let json = json!({"description": w.description, "slo_tpot_ms": slo * 1e3, "pinned": pinned, "sessions_per_step": sessions, "max_new_tokens": max_new,
        "relay_ping_ms": relay_rtts.iter().map(|(r, p50, max)| json!({"told": r, "p50": p50, "max": max})).collect::<Vec<_>>(),
        "within_slo": headline, "engine": engine_json, "steps": steps_json});
    Ok((md, json))
}
