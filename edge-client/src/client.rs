//! Speculative generation against a verifier: draft a tree, send it, keep what comes back, and
//! survive a lost connection without losing text (resume the session, or re-open it with the
//! tokens committed so far).
//!
//! A client may know several verifiers (a fleet). It places each connection by the power of two
//! choices: two verifiers at random among those not recently found dead, draining or busy, and
//! of those the less loaded by what their hellos report. A session whose verifier dies, is cut
//! off or drains continues on another one with its committed tokens, so nothing is lost: a
//! greedy answer is the same token for token, and a seeded sampled one too (with a fixed tree
//! shape), since the verifier's and the drafter's randomness are functions of the seed and the
//! committed length, whichever verifier continues the session.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use specinfer_model::ModelError;
use specinfer_speculator::{GenerationStats, Recovery, RoundDriver, RoundError, RoundOutput};
use specinfer_wire::{ErrorCode, ErrorFrame, FinishReason, Verified};

use specinfer_net::{AddrsError, Remote, RemoteConfig, RemoteError, RemoteSession, VerifierAddrs};

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("draft model: {0}")]
    Draft(ModelError),
    #[error(transparent)]
    Round(#[from] RoundError),
    #[error(transparent)]
    Addrs(#[from] AddrsError),
}

impl From<ModelError> for ClientError {
    fn from(e: ModelError) -> Self {
        ClientError::Draft(e)
    }
}

/// What one generation did.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    /// The generated text (end-of-turn tokens left out; empty when the driver had no
    /// tokenizer).
    pub text: String,
    pub finish: Option<FinishReason>,
    /// The driver's counts: rounds, tokens per round, verifier forward time, pipelined rounds,
    /// tokens only the lookup proposed.
    pub stats: GenerationStats,
    pub wall: Duration,
    /// Time from the request to the first round's answer.
    pub ttft: Duration,
    pub bytes_up: usize,
    pub bytes_down: usize,
    /// Recoveries: reconnections, and moves off draining verifiers.
    pub reconnects: usize,
    /// The verifiers that served the session, in order (more than one after a failover).
    pub served_by: Vec<SocketAddr>,
}

/// Recoveries (reconnections and moves) one generation survives.
const MAX_RECOVERIES: usize = 8;
/// Verifiers tried for one session's opening when they answer busy or draining.
const MAX_PLACEMENTS: usize = 6;
/// How long a verifier that did not answer is left out of placement. Short: a dead candidate
/// drawn beside a live one costs no wait (see `less_loaded_of`), and a verifier
/// restarted in its place should get sessions again soon.
const DEAD_FOR: Duration = Duration::from_secs(5);
/// How long a draining verifier is left out of placement: a draining one says so in its hello
/// anyway, and its replacement (a restart takes seconds) should not stand idle while the rest
/// of the fleet carries its sessions.
const DRAINING_FOR: Duration = Duration::from_secs(3);
/// How long a client tries to resume a session on the verifier that lost it before it re-opens
/// the session elsewhere: a quarter of the idle timeout, within these bounds. The verifier has
/// already been silent for a whole idle timeout, so a resume that takes longer than a few round
/// trips is not coming; a short wait still catches a client whose own network changed.
const RESUME_WAIT: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(1));

/// A verifier connection that reconnects on demand, to one verifier or to the least loaded of
/// a fleet.
pub struct Client {
    /// How to reach a verifier; `addr` is the current one's.
    cfg: RemoteConfig,
    verifiers: VerifierAddrs,
    /// Verifiers left out of placement until then: found dead, draining or busy.
    avoid: HashMap<SocketAddr, Instant>,
    /// How many addresses the verifiers resolved to when last placed.
    known: usize,
    remote: Option<Remote>,
    next_session: u64,
    round_trip: EmulatedRoundTrip,
}

impl Client {
    /// A client of the one verifier at `cfg.addr`.
    pub async fn connect(cfg: RemoteConfig) -> Result<Client, ClientError> {
        let verifiers = VerifierAddrs::one(cfg.addr);
        Self::connect_fleet(cfg, verifiers).await
    }

    /// A client of a fleet: each connection goes to the less loaded of two verifiers drawn from
    /// `verifiers` (resolved again at every placement); `cfg` says how to reach any of them.
    pub async fn connect_fleet(
        cfg: RemoteConfig,
        verifiers: VerifierAddrs,
    ) -> Result<Client, ClientError> {
        let mut client = Client {
            cfg,
            verifiers,
            avoid: HashMap::new(),
            known: 0,
            remote: None,
            next_session: 1,
            round_trip: EmulatedRoundTrip::default(),
        };
        client.place().await?;
        Ok(client)
    }

    /// The verifier this client's sessions go to now.
    pub fn verifier(&self) -> SocketAddr {
        self.cfg.addr
    }

    /// Adds `rtt` of waiting to every round, on top of the verifier's forward: an in-process
    /// stand-in for a slower network, so the edge/cloud trade-off can be measured on one machine
    /// (benchmarks and tests only; see [`EmulatedRoundTrip`]).
    pub fn emulate_round_trip(&mut self, rtt: Duration) {
        self.round_trip = EmulatedRoundTrip { rtt };
    }

    /// Closes the connection and waits until the verifier has been told.
    pub async fn shutdown(self) {
        if let Some(r) = self.remote {
            r.shutdown().await;
        }
    }

    /// Leaves the current verifier out of placement for `how_long` and drops the connection.
    fn leave(&mut self, how_long: Duration) {
        self.avoid.insert(self.cfg.addr, Instant::now() + how_long);
        if let Some(r) = self.remote.take() {
            tokio::spawn(r.shutdown());
        }
    }

    /// Connects to a verifier by the power of two choices (see the module doc). Verifiers
    /// recently found dead, draining or busy are left out while others remain.
    async fn place(&mut self) -> Result<(), ClientError> {
        let all = self.verifiers.resolve().await?;
        self.known = all.len();
        let now = Instant::now();
        self.avoid.retain(|_, until| *until > now);
        let mut candidates: Vec<SocketAddr> = all
            .iter()
            .copied()
            .filter(|a| !self.avoid.contains_key(a))
            .collect();
        if candidates.is_empty() {
            candidates = all;
        }
        shuffle(&mut candidates, crate::setup::fresh_seed());
        let mut refusal = None;
        let mut other = None;
        for pair in candidates.chunks(2) {
            match self.less_loaded_of(pair).await {
                Ok(remote) => {
                    self.cfg.addr = remote.addr();
                    tracing::debug!(verifier = %self.cfg.addr, load = ?remote.server.load, "placed");
                    self.remote = Some(remote);
                    return Ok(());
                }
                Err(e @ RemoteError::Refused(_)) => refusal = Some(e),
                Err(e) => other = Some(e),
            }
        }
        // A refusal says more than a timeout (a wrong key, another model).
        Err(refusal
            .or(other)
            .expect("a resolved list is never empty")
            .into())
    }

    /// Says hello to the verifiers of `pair` at once and keeps the less loaded; once one has
    /// answered, the other gets as long again to answer, so a dead one costs no timeout.
    async fn less_loaded_of(&mut self, pair: &[SocketAddr]) -> Result<Remote, RemoteError> {
        let mut hellos = tokio::task::JoinSet::new();
        let started = Instant::now();
        for &addr in pair {
            let cfg = RemoteConfig {
                addr,
                ..self.cfg.clone()
            };
            hellos.spawn(async move {
                let hello = tokio::time::timeout(cfg.idle_timeout, Remote::connect(&cfg)).await;
                (
                    addr,
                    hello.unwrap_or(Err(specinfer_net::NetError::Timeout.into())),
                )
            });
        }
        let mut answered: Vec<Remote> = Vec::new();
        let mut error = None;
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            let next = match deadline {
                Some(d) => match tokio::time::timeout_at(d, hellos.join_next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
                None => hellos.join_next().await,
            };
            let Some(Ok((addr, hello))) = next else {
                break;
            };
            match hello {
                Ok(remote) if remote.server.load.draining => {
                    self.avoid.insert(addr, Instant::now() + DRAINING_FOR);
                    tokio::spawn(remote.shutdown());
                    error = Some(RemoteError::Refused(specinfer_wire::ErrorFrame {
                        code: ErrorCode::Draining,
                        session: None,
                        message: format!("the verifier at {addr} is draining"),
                        retry_after_ms: None,
                    }));
                }
                Ok(remote) => {
                    let first = started.elapsed().max(Duration::from_millis(20));
                    deadline.get_or_insert(tokio::time::Instant::now() + first);
                    answered.push(remote);
                }
                Err(e) => {
                    tracing::debug!(verifier = %addr, "no hello: {e}");
                    if e.is_connection_loss() {
                        self.avoid.insert(addr, Instant::now() + DEAD_FOR);
                    }
                    error = Some(e);
                }
            }
        }
        answered.sort_by(|a, b| a.server.load.score().total_cmp(&b.server.load.score()));
        let mut answered = answered.into_iter();
        match answered.next() {
            Some(best) => {
                for r in answered {
                    tokio::spawn(r.shutdown());
                }
                Ok(best)
            }
            None => Err(error.unwrap_or(RemoteError::Net(specinfer_net::NetError::Timeout))),
        }
    }

    /// Runs `driver`'s generation on a new session, calling `on_round` with what each round
    /// (or a recovery) committed. A lost connection is survived up to three times: the session
    /// is resumed if the verifier still holds it, else re-opened with everything committed.
    pub async fn generate(
        &mut self,
        driver: &mut RoundDriver<'_>,
        mut on_round: impl FnMut(&RoundOutput),
    ) -> Result<Generation, ClientError> {
        let start = Instant::now();
        let clock = move || start.elapsed().as_secs_f64();
        let id = self.next_session;
        self.next_session += 1;
        let mut g = Generation::default();
        let mut session = self.open(id, driver).await?;
        let mut served_by = vec![self.cfg.addr];
        // Whether this session's verifier was asked to decode the rest on its own.
        let mut generating = false;
        while !driver.is_finished() {
            if driver.wants_server_decoding() {
                driver.start_server_decoding()?;
            }
            let verdict = if driver.server_decodes() {
                // Streamed rounds: no tree goes up, so no round trip per verdict.
                let asked = if generating {
                    Ok(())
                } else {
                    session.generate(driver.server_drafting()).await
                };
                match asked {
                    Ok(()) => {
                        generating = true;
                        session.verdict().await
                    }
                    Err(e) => Err(e),
                }
            } else {
                let tree = driver.draft(&clock)?;
                let sent = Instant::now();
                match session.send_tree(tree).await {
                    Ok(()) => {
                        driver.draft_ahead();
                        let verdict = session.verdict().await;
                        if let Ok(v) = &verdict {
                            self.round_trip.deliver(sent, v).await;
                        }
                        verdict
                    }
                    Err(e) => Err(e),
                }
            };
            if verdict.is_err() {
                // A new or resumed session is asked again.
                generating = false;
            }
            match verdict {
                Ok(v) => {
                    let out = driver.on_verified(&v, clock())?;
                    if driver.stats().rounds == 1 {
                        g.ttft = start.elapsed();
                    }
                    on_round(&out);
                }
                Err(RemoteError::Moved) if g.reconnects < MAX_RECOVERIES => {
                    tracing::info!(verifier = %self.cfg.addr, "the verifier is draining; moving the session");
                    g.reconnects += 1;
                    g.bytes_up += session.bytes_up;
                    g.bytes_down += session.bytes_down;
                    driver.connection_lost();
                    self.leave(DRAINING_FOR);
                    session = self.open(id, driver).await?;
                }
                Err(e) if e.is_connection_loss() && g.reconnects < MAX_RECOVERIES => {
                    tracing::warn!(verifier = %self.cfg.addr, "lost the verifier ({e}); reconnecting");
                    g.reconnects += 1;
                    g.bytes_up += session.bytes_up;
                    g.bytes_down += session.bytes_down;
                    driver.connection_lost();
                    if let Some(r) = self.remote.take() {
                        tokio::spawn(r.shutdown());
                    }
                    let token = session.resume_token();
                    session = self.recover(id, token, driver, &mut on_round).await?;
                }
                Err(e) => return Err(e.into()),
            }
            if served_by.last() != Some(&self.cfg.addr) {
                served_by.push(self.cfg.addr);
            }
        }
        g.served_by = served_by;
        g.bytes_up += session.bytes_up;
        g.bytes_down += session.bytes_down;
        let _ = session.close().await;
        g.wall = start.elapsed();
        g.token_ids = driver.generated().to_vec();
        g.text = driver.text()?;
        g.finish = driver.finish();
        g.stats = driver.stats().clone();
        Ok(g)
    }

    /// Opens `driver`'s session (at the start, or again with everything committed) on the
    /// current verifier, or on another one when it is gone, busy or draining.
    async fn open(
        &mut self,
        id: u64,
        driver: &mut RoundDriver<'_>,
    ) -> Result<RemoteSession, ClientError> {
        let mut tries = 0;
        loop {
            if self.remote.is_none() {
                self.place().await?;
            }
            let remote = self.remote.as_ref().expect("just placed");
            let (prompt, params) = driver.open_request();
            let error = match remote.open(id, prompt, params).await {
                Ok(session) => {
                    driver.set_limits(session.limits());
                    driver.verifier_costs(session.costs(), session.rtt().as_secs_f64());
                    return Ok(session);
                }
                Err(e) => e,
            };
            tries += 1;
            // Elsewhere, if there is an elsewhere.
            let away = match &error {
                RemoteError::Refused(ErrorFrame {
                    code: ErrorCode::Busy,
                    retry_after_ms,
                    ..
                }) if self.known > 1 => {
                    Duration::from_millis(retry_after_ms.unwrap_or(1000).into())
                }
                RemoteError::Refused(ErrorFrame {
                    code: ErrorCode::Draining,
                    ..
                }) => DRAINING_FOR,
                e if e.is_connection_loss() => DEAD_FOR,
                _ => return Err(error.into()),
            };
            if tries >= MAX_PLACEMENTS {
                return Err(error.into());
            }
            tracing::info!(verifier = %self.cfg.addr, "{error}; opening the session on another verifier");
            self.leave(away);
        }
    }

    /// After a lost connection: resume the session if its verifier answers again soon and still
    /// holds it (taking any tokens of a round whose answer was lost), else open it again with
    /// everything committed, there or on another verifier.
    async fn recover(
        &mut self,
        id: u64,
        resume_token: [u8; 16],
        driver: &mut RoundDriver<'_>,
        on_round: &mut impl FnMut(&RoundOutput),
    ) -> Result<RemoteSession, ClientError> {
        let wait = (self.cfg.idle_timeout / 4).clamp(RESUME_WAIT.0, RESUME_WAIT.1);
        let remote = match tokio::time::timeout(wait, Remote::connect(&self.cfg)).await {
            Ok(Ok(remote)) => remote,
            Ok(Err(e)) if !e.is_connection_loss() => return Err(e.into()),
            _ => {
                tracing::info!(verifier = %self.cfg.addr, "the verifier does not answer; re-opening the session on another");
                self.leave(DEAD_FOR);
                return self.open(id, driver).await;
            }
        };
        let resumed = remote.resume(id, resume_token).await;
        self.remote = Some(remote);
        match resumed {
            Ok((session, server)) => match driver.on_resumed(&server)? {
                Recovery::Resumed(out) => {
                    if !out.tokens.is_empty() {
                        on_round(&out);
                    }
                    Ok(session)
                }
                // The verifier's session went elsewhere: re-open with all we have. A sampled
                // session continues the same stream: a round's randomness is a function of the
                // seed and the committed length.
                Recovery::Reopen => self.open(id, driver).await,
            },
            // Gone (grace period over, or the verifier restarted), or draining: `open` goes
            // elsewhere when it must.
            Err(RemoteError::Refused(ErrorFrame {
                code: ErrorCode::UnknownSession | ErrorCode::Draining,
                ..
            })) => self.open(id, driver).await,
            Err(e) if e.is_connection_loss() => {
                self.leave(DEAD_FOR);
                self.open(id, driver).await
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Fisher-Yates with a splitmix64 stream: placement needs a fair order, not a secret one.
fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..items.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// An in-process stand-in for a slower network (benchmarks and tests): each verdict is handed
/// over a round trip after its request plus the verifier's work, as it would arrive over a
/// link with that round trip (drafting ahead overlaps both, as over a network).
#[derive(Clone, Copy, Debug, Default)]
pub struct EmulatedRoundTrip {
    pub rtt: Duration,
}

impl EmulatedRoundTrip {
    async fn deliver(&self, sent: Instant, verdict: &Verified) {
        if self.rtt > Duration::ZERO {
            let served = Duration::from_micros(verdict.stats.forward_us as u64);
            tokio::time::sleep_until((sent + self.rtt + served).into()).await;
        }
    }
}
