//! Counters and histograms, rendered in the Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use specinfer_wire::ErrorCode;

use crate::RoundOutcome;

/// A cumulative histogram with fixed upper bounds.
pub struct Histogram {
    bounds: &'static [f64],
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    pub const fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            state: Mutex::new((Vec::new(), 0.0, 0)),
        }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().expect("metrics lock");
        if s.0.is_empty() {
            s.0 = vec![0; self.bounds.len()];
        }
        for (i, &b) in self.bounds.iter().enumerate() {
            if v <= b {
                s.0[i] += 1;
            }
        }
        s.1 += v;
        s.2 += 1;
    }

    /// Observations so far and their mean.
    pub fn count_mean(&self) -> (u64, f64) {
        let s = self.state.lock().expect("metrics lock");
        (s.2, if s.2 == 0 { 0.0 } else { s.1 / s.2 as f64 })
    }

    /// Observations above `v`, which must be one of the bucket bounds.
    pub fn count_above(&self, v: f64) -> u64 {
        let s = self.state.lock().expect("metrics lock");
        let at_or_below = self
            .bounds
            .iter()
            .position(|&b| b >= v)
            .and_then(|i| s.0.get(i).copied())
            .unwrap_or(0);
        s.2 - at_or_below
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().expect("metrics lock");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in self.bounds.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                s.0.get(i).copied().unwrap_or(0)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            s.2, s.1, s.2
        );
    }
}

const SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
const COUNTS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];
const MAX_DEPTH: usize = 32;
const ERROR_CODES: [ErrorCode; 12] = [
    ErrorCode::BadFrame,
    ErrorCode::UnsupportedVersion,
    ErrorCode::Unauthorized,
    ErrorCode::ModelMismatch,
    ErrorCode::UnknownSession,
    ErrorCode::SessionExists,
    ErrorCode::Busy,
    ErrorCode::LimitExceeded,
    ErrorCode::OutOfOrder,
    ErrorCode::Unsupported,
    ErrorCode::Internal,
    ErrorCode::Draining,
];

pub struct Metrics {
    pub connections: AtomicU64,
    /// Connections refused before their handshake: over the per-address or total limit.
    pub connections_refused: AtomicU64,
    /// Connections asked to prove their address (a QUIC Retry) because many were open.
    pub connections_retried: AtomicU64,
    pub sessions_active: AtomicU64,
    pub sessions_opened: AtomicU64,
    pub rounds: AtomicU64,
    pub tokens: AtomicU64,
    pub batches: AtomicU64,
    /// Tree nodes and prompt tokens over all batched forwards (per forward: divide by batches).
    pub forward_nodes: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Verification rounds waiting for a forward (a gauge; what an autoscaler should watch).
    pub queued_rounds: AtomicU64,
    /// Rounds and prefills held back because their API key ran over its token rate (a gauge).
    pub rate_held: AtomicU64,
    /// KV cache bytes the sessions hold (a gauge).
    pub kv_bytes: AtomicU64,
    /// Tree nodes and prompt tokens of the last batched forward (a gauge).
    pub last_batch_nodes: AtomicU64,
    /// 1 while the verifier drains (not ready; opens no session).
    pub draining: AtomicU64,
    /// Sessions told to move to another verifier while draining.
    pub sessions_moved: AtomicU64,
    /// KV bytes held by cached prefixes of ended sessions (a gauge).
    pub prefix_cache_bytes: AtomicU64,
    /// Sessions that started from a cached prefix.
    pub prefix_hits: AtomicU64,
    /// Prompt tokens not prefilled thanks to cached prefixes.
    pub prefix_tokens_reused: AtomicU64,
    /// Batched forwards that panicked (their sessions were closed; the engine went on).
    pub engine_panics: AtomicU64,
    /// Whether the engine thread runs (false once it ended, by return or panic).
    pub engine_alive: AtomicBool,
    /// When the engine loop last went round, in milliseconds since the engine started: a loop
    /// that stops going round (a hung forward) is seen by the health check.
    pub engine_heartbeat_ms: AtomicU64,
    /// Tokens emitted per round (tau).
    pub tau: Histogram,
    pub batch_size: Histogram,
    pub forward_seconds: Histogram,
    pub queue_seconds: Histogram,
    pub prefill_seconds: Histogram,
    accepted_at_depth: [AtomicU64; MAX_DEPTH],
    tried_at_depth: [AtomicU64; MAX_DEPTH],
    errors: [AtomicU64; ERROR_CODES.len()],
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            connections: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            connections_retried: AtomicU64::new(0),
            sessions_active: AtomicU64::new(0),
            sessions_opened: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            forward_nodes: AtomicU64::new(0),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            queued_rounds: AtomicU64::new(0),
            rate_held: AtomicU64::new(0),
            kv_bytes: AtomicU64::new(0),
            last_batch_nodes: AtomicU64::new(0),
            draining: AtomicU64::new(0),
            sessions_moved: AtomicU64::new(0),
            prefix_cache_bytes: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_tokens_reused: AtomicU64::new(0),
            engine_panics: AtomicU64::new(0),
            engine_alive: AtomicBool::new(true),
            engine_heartbeat_ms: AtomicU64::new(0),
            tau: Histogram::new(COUNTS),
            batch_size: Histogram::new(COUNTS),
            forward_seconds: Histogram::new(SECONDS),
            queue_seconds: Histogram::new(SECONDS),
            prefill_seconds: Histogram::new(SECONDS),
            accepted_at_depth: std::array::from_fn(|_| AtomicU64::new(0)),
            tried_at_depth: std::array::from_fn(|_| AtomicU64::new(0)),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Metrics {
    pub fn record_round(&self, o: &RoundOutcome) {
        self.rounds.fetch_add(1, Ordering::Relaxed);
        self.tokens
            .fetch_add(o.tokens.len() as u64, Ordering::Relaxed);
        self.tau.observe(o.tokens.len() as f64);
        for (d, (&a, &r)) in o
            .accepted_at_depth
            .iter()
            .zip(&o.rejected_at_depth)
            .enumerate()
            .take(MAX_DEPTH)
        {
            self.accepted_at_depth[d].fetch_add(a as u64, Ordering::Relaxed);
            self.tried_at_depth[d].fetch_add((a + r) as u64, Ordering::Relaxed);
        }
    }

    /// The engine's load after an iteration, and its heartbeat.
    pub fn publish_load(&self, queued_rounds: usize, kv_bytes: usize, epoch: Instant) {
        self.queued_rounds
            .store(queued_rounds as u64, Ordering::Relaxed);
        self.kv_bytes.store(kv_bytes as u64, Ordering::Relaxed);
        self.engine_heartbeat_ms
            .store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// The engine thread runs and its loop went round within `within` (`started` is when the
    /// engine started, the origin of its heartbeat).
    pub fn engine_healthy(&self, started: Instant, within: Duration) -> bool {
        let beat = Duration::from_millis(self.engine_heartbeat_ms.load(Ordering::Relaxed));
        self.engine_alive.load(Ordering::Relaxed) && started.elapsed().saturating_sub(beat) < within
    }

    pub fn error(&self, code: ErrorCode) {
        let i = ERROR_CODES
            .iter()
            .position(|&c| c == code)
            .expect("every code is listed");
        self.errors[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn errors(&self, code: ErrorCode) -> u64 {
        let i = ERROR_CODES
            .iter()
            .position(|&c| c == code)
            .expect("every code is listed");
        self.errors[i].load(Ordering::Relaxed)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            &mut out,
            "specinfer_connections_total",
            "counter",
            "QUIC connections accepted.",
            &self.connections,
        );
        counter(
            &mut out,
            "specinfer_connections_refused_total",
            "counter",
            "Connections refused before their handshake (over the per-address or total limit).",
            &self.connections_refused,
        );
        counter(
            &mut out,
            "specinfer_connections_retried_total",
            "counter",
            "Connections asked to prove their address with a QUIC Retry (many were open).",
            &self.connections_retried,
        );
        counter(
            &mut out,
            "specinfer_sessions_active",
            "gauge",
            "Sessions holding a KV cache.",
            &self.sessions_active,
        );
        counter(
            &mut out,
            "specinfer_sessions_opened_total",
            "counter",
            "Sessions opened.",
            &self.sessions_opened,
        );
        counter(
            &mut out,
            "specinfer_rounds_total",
            "counter",
            "Verification rounds.",
            &self.rounds,
        );
        counter(
            &mut out,
            "specinfer_tokens_total",
            "counter",
            "Tokens emitted by verification.",
            &self.tokens,
        );
        counter(
            &mut out,
            "specinfer_batches_total",
            "counter",
            "Batched forward passes.",
            &self.batches,
        );
        counter(
            &mut out,
            "specinfer_forward_nodes_total",
            "counter",
            "Tree nodes and prompt tokens over all batched forward passes.",
            &self.forward_nodes,
        );
        counter(
            &mut out,
            "specinfer_queued_rounds",
            "gauge",
            "Verification rounds waiting for a forward.",
            &self.queued_rounds,
        );
        counter(
            &mut out,
            "specinfer_rate_held",
            "gauge",
            "Rounds and prefills held back because their API key ran over its token rate.",
            &self.rate_held,
        );
        counter(
            &mut out,
            "specinfer_kv_bytes",
            "gauge",
            "KV cache bytes the sessions hold.",
            &self.kv_bytes,
        );
        counter(
            &mut out,
            "specinfer_last_batch_nodes",
            "gauge",
            "Tree nodes and prompt tokens of the last batched forward.",
            &self.last_batch_nodes,
        );
        counter(
            &mut out,
            "specinfer_draining",
            "gauge",
            "1 while the verifier drains (opens no session, moves live ones).",
            &self.draining,
        );
        counter(
            &mut out,
            "specinfer_sessions_moved_total",
            "counter",
            "Sessions told to move to another verifier while draining.",
            &self.sessions_moved,
        );
        counter(
            &mut out,
            "specinfer_engine_panics_total",
            "counter",
            "Batched forwards that panicked (a bug; their sessions were closed, the engine went on).",
            &self.engine_panics,
        );
        counter(
            &mut out,
            "specinfer_prefix_cache_bytes",
            "gauge",
            "KV bytes held by cached prefixes of ended sessions.",
            &self.prefix_cache_bytes,
        );
        counter(
            &mut out,
            "specinfer_prefix_hits_total",
            "counter",
            "Sessions that started from a cached prefix.",
            &self.prefix_hits,
        );
        counter(
            &mut out,
            "specinfer_prefix_tokens_reused_total",
            "counter",
            "Prompt tokens not prefilled thanks to cached prefixes.",
            &self.prefix_tokens_reused,
        );
        counter(
            &mut out,
            "specinfer_bytes_in_total",
            "counter",
            "Frame bytes received.",
            &self.bytes_in,
        );
        counter(
            &mut out,
            "specinfer_bytes_out_total",
            "counter",
            "Frame bytes sent.",
            &self.bytes_out,
        );
        self.tau.render(
            &mut out,
            "specinfer_round_tokens",
            "Tokens emitted per round (tau).",
        );
        self.batch_size.render(
            &mut out,
            "specinfer_batch_size",
            "Sessions per batched forward.",
        );
        self.forward_seconds.render(
            &mut out,
            "specinfer_forward_seconds",
            "Batched forward + verification latency.",
        );
        self.queue_seconds.render(
            &mut out,
            "specinfer_queue_seconds",
            "Time a round waited for its batch.",
        );
        self.prefill_seconds.render(
            &mut out,
            "specinfer_prefill_seconds",
            "Prompt prefill latency.",
        );
        let _ = writeln!(out, "# HELP specinfer_depth_accepted_total Drafted tokens accepted, by tree depth.\n# TYPE specinfer_depth_accepted_total counter");
        for (d, a) in self.accepted_at_depth.iter().enumerate() {
            let a = a.load(Ordering::Relaxed);
            if a > 0 || self.tried_at_depth[d].load(Ordering::Relaxed) > 0 {
                let _ = writeln!(
                    out,
                    "specinfer_depth_accepted_total{{depth=\"{}\"}} {a}",
                    d + 1
                );
            }
        }
        let _ = writeln!(out, "# HELP specinfer_depth_tried_total Drafted tokens tried, by tree depth.\n# TYPE specinfer_depth_tried_total counter");
        for (d, t) in self.tried_at_depth.iter().enumerate() {
            let t = t.load(Ordering::Relaxed);
            if t > 0 {
                let _ = writeln!(
                    out,
                    "specinfer_depth_tried_total{{depth=\"{}\"}} {t}",
                    d + 1
                );
            }
        }
        let _ = writeln!(out, "# HELP specinfer_errors_total Error frames sent, by code.\n# TYPE specinfer_errors_total counter");
        for (code, n) in ERROR_CODES.iter().zip(&self.errors) {
            let _ = writeln!(
                out,
                "specinfer_errors_total{{code=\"{code:?}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        out
    }
}
