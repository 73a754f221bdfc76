//! The engine thread: owns the LLM and every session, and runs continuous (iteration-level)
//! batching. Verify requests that arrive while a forward is running wait in a FIFO queue; each
//! iteration takes from its front, one round per session, until the node budget is spent, and
//! runs them through ONE batched forward. Sessions join and leave between iterations.
//!
//! The network side talks to it through a bounded channel and gets answers on oneshot channels;
//! a full channel or session table is answered with "busy", never queued without bound.
//!
//! A session may also ask the engine to decode it to its end on its own ([`EngineHandle::generate`]):
//! server-only generation as a cloud API runs it, plain or speculating with the verifier's own
//! draft model. Its rounds join the same FIFO and batches as the clients' trees, and stream out.
//!
//! Every round's stats carry the price of a tree node (the fitted marginal forward cost per node
//! times the sessions sharing the forward) and, when rounds wait for a place in a forward, a node
//! cap, so load-aware clients shrink their trees under load and grow them with idle capacity.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use specinfer_model::TreeModel;
use specinfer_speculator::{
    AffineFit, CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, RoundDriver, Speculator,
    TreeScorer, TreeShape,
};
use specinfer_wire::{
    ErrorCode, Limits, RoundStats, SamplingParams, ServerDrafting, TokenTree, VerifierCosts,
    VerifyMode,
};
use tokio::sync::{mpsc, oneshot};

use crate::costs::CostBook;
use crate::metrics::Metrics;
use crate::prefix::PrefixCache;
use crate::quota::KeyRates;
use crate::session::{run_batch, Done, PrefixFeatures, Work};
use crate::{RoundOutcome, Session, SessionError};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub limits: Limits,
    pub max_sessions: usize,
    /// KV cache bytes all sessions together may hold.
    pub kv_budget_bytes: usize,
    /// KV cache bytes one session may hold.
    pub session_kv_bytes: usize,
    /// Tree nodes one batched forward may carry (at least one whole tree always goes).
    pub batch_node_budget: usize,
    /// A session with no request for this long is closed.
    pub idle_timeout: Duration,
    /// A session whose stream vanished without `Close` is kept this long.
    pub detach_grace: Duration,
    /// Requests the engine queue holds before answering "busy".
    pub queue_depth: usize,
    /// KV cache bytes kept of sessions that ended, for later sessions that start with the
    /// same tokens (a chat's next turn, a shared system prompt); part of `kv_budget_bytes`,
    /// evicted first when sessions need the room. 0 turns prefix reuse off.
    pub prefix_cache_bytes: usize,
    /// Sessions one API key may hold at once (0: no quota), so one client cannot take every
    /// session of the verifier. Sessions of unauthenticated connections have no quota.
    pub max_sessions_per_key: usize,
    /// Tokens one API key may have the LLM run each second, prompt tokens and tree nodes
    /// (0: no quota; see [`crate::quota`]). Work over the rate waits in the queue.
    pub key_tokens_per_s: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            limits: Limits::default(),
            max_sessions: 64,
            kv_budget_bytes: 4 << 30,
            session_kv_bytes: 512 << 20,
            batch_node_budget: 512,
            idle_timeout: Duration::from_secs(300),
            detach_grace: Duration::from_secs(30),
            queue_depth: 1024,
            prefix_cache_bytes: 512 << 20,
            max_sessions_per_key: 32,
            key_tokens_per_s: 0.0,
        }
    }
}

/// An error for one request, as sent to the peer.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineError {
    pub code: ErrorCode,
    pub message: String,
    pub retry_after_ms: Option<u32>,
}

impl EngineError {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        EngineError {
            code,
            message: message.into(),
            retry_after_ms: None,
        }
    }

    fn draining() -> Self {
        EngineError::new(
            ErrorCode::Draining,
            "this verifier is draining: open the session on another one",
        )
    }

    /// The engine has ended (a drained verifier exiting): the client takes the session to
    /// another verifier, as it does from a draining one.
    fn gone() -> Self {
        EngineError::new(
            ErrorCode::Draining,
            "this verifier is shutting down: open the session on another one",
        )
    }

    fn busy(message: impl Into<String>) -> Self {
        EngineError {
            code: ErrorCode::Busy,
            message: message.into(),
            retry_after_ms: Some(500),
        }
    }
}

pub type SessionId = u64;

pub struct Opened {
    pub id: SessionId,
    pub resume_token: [u8; 16],
    /// What a token costs on this verifier now, for the client's choice of the split.
    pub costs: VerifierCosts,
}

pub struct Round {
    pub outcome: RoundOutcome,
    pub stats: RoundStats,
}

/// The draft model a verifier drafts with itself for sessions that ask it to (co-located,
/// server-side speculation). It lives as long as the process.
pub type ServerDraft = &'static dyn TreeScorer;

/// The rounds of a session the engine decodes on its own, as they complete. Unbounded, but
/// bounded in fact: a session's rounds each commit at least one of its `max_new_tokens`.
pub type RoundStream = mpsc::UnboundedReceiver<Result<Round, EngineError>>;

enum Request {
    Open {
        prompt: Vec<u32>,
        params: SamplingParams,
        owner: KeyId,
        reply: oneshot::Sender<Result<Opened, EngineError>>,
    },
    Resume {
        token: [u8; 16],
        owner: KeyId,
        reply: oneshot::Sender<Result<(SessionId, Vec<u32>), EngineError>>,
    },
    Verify {
        id: SessionId,
        tree: TokenTree,
        enqueued: Instant,
        reply: oneshot::Sender<Result<Round, EngineError>>,
    },
    Generate {
        id: SessionId,
        drafting: ServerDrafting,
        rounds: mpsc::UnboundedSender<Result<Round, EngineError>>,
    },
    Detach {
        id: SessionId,
    },
    Close {
        id: SessionId,
    },
    Drain,
    Shutdown,
}

/// The network side's handle on the engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Request>,
    /// Where `Detach` and `Close` go when the queue is full: never dropped (a dropped notice
    /// kept a session's KV until its idle timeout), and bounded in fact, one per session.
    notices: std::sync::mpsc::Sender<Request>,
}

impl EngineHandle {
    fn send(&self, r: Request) -> Result<(), EngineError> {
        self.tx.try_send(r).map_err(|e| match e {
            TrySendError::Full(_) => EngineError::busy("verifier queue is full"),
            TrySendError::Disconnected(_) => EngineError::gone(),
        })
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, EngineError>>) -> Request,
    ) -> Result<T, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        rx.await.unwrap_or_else(|_| Err(EngineError::gone()))
    }

    /// Opens a session for a connection whose key is `owner`.
    pub async fn open(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        owner: KeyId,
    ) -> Result<Opened, EngineError> {
        self.ask(|reply| Request::Open {
            prompt,
            params,
            owner,
            reply,
        })
        .await
    }

    /// Re-attaches a detached session opened with the same key; returns its id and committed
    /// tokens.
    pub async fn resume(
        &self,
        token: [u8; 16],
        owner: KeyId,
    ) -> Result<(SessionId, Vec<u32>), EngineError> {
        self.ask(|reply| Request::Resume {
            token,
            owner,
            reply,
        })
        .await
    }

    pub async fn verify(&self, id: SessionId, tree: TokenTree) -> Result<Round, EngineError> {
        self.ask(|reply| Request::Verify {
            id,
            tree,
            enqueued: Instant::now(),
            reply,
        })
        .await
    }

    /// Decodes the open session to its end on the engine's own, streaming each round; the
    /// stream's first item is the error when the session cannot be driven. Dropping the stream
    /// stops the decoding at the next round.
    pub fn generate(
        &self,
        id: SessionId,
        drafting: ServerDrafting,
    ) -> Result<RoundStream, EngineError> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.send(Request::Generate {
            id,
            drafting,
            rounds: tx,
        })?;
        Ok(rx)
    }

    /// The session's stream vanished: keep it for the grace period.
    pub fn detach(&self, id: SessionId) {
        self.notify(Request::Detach { id });
    }

    pub fn close(&self, id: SessionId) {
        self.notify(Request::Close { id });
    }

    fn notify(&self, r: Request) {
        if let Err(TrySendError::Full(r)) = self.tx.try_send(r) {
            let _ = self.notices.send(r);
        }
    }

    /// Starts draining: from now on the engine opens and resumes no session, and answers each
    /// session's next round with [`ErrorCode::Draining`], closing it (the client moves it to
    /// another verifier); rounds already queued and sessions it generates on its own finish.
    /// Detached sessions are dropped at once: their clients re-open elsewhere.
    pub fn drain(&self) {
        self.notify(Request::Drain);
    }

    /// Finishes queued rounds, then stops the engine thread.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Request::Shutdown);
    }
}

struct Entry<M: TreeModel> {
    session: Session<M>,
    resume_token: [u8; 16],
    /// The key of the connection that opened it.
    owner: KeyId,
    /// The KV bytes it may grow to (prompt, max_new_tokens and a tree), reserved when it was
    /// admitted: admission counts what sessions will hold, not what they hold now.
    reserved: usize,
    last_used: Instant,
    detached_at: Option<Instant>,
    /// While the prompt is being prefilled: who waits for the session, and since when.
    opening: Option<(oneshot::Sender<Result<Opened, EngineError>>, Instant)>,
    /// When the engine decodes the session on its own.
    driving: Option<Driving>,
}

/// A closed session's K/V kept for reuse, with the features it kept when it gathered them
/// (a feature-conditioned drafter's session reuses only an entry that has them).
struct CachedPrefix<C> {
    cache: C,
    features: Option<PrefixFeatures>,
}

/// A session the engine decodes on its own: the same round driver the clients run drafts its
/// trees (root-only ones for plain decoding).
struct Driving {
    driver: RoundDriver<'static>,
    rounds: mpsc::UnboundedSender<Result<Round, EngineError>>,
    /// Whether its next round is in the queue.
    queued: bool,
}

/// The fewest shared tokens worth reusing a cached prefix for (fewer cost about as little to
/// prefill as to look up).
const MIN_PREFIX_TOKENS: usize = 16;

/// Prompt tokens the oldest opening session prefills per iteration even when verification
/// rounds fill the node budget, so a prefill always progresses.
const MIN_PREFILL_CHUNK: usize = 32;

/// Work an iteration held back because its key ran over its token rate.
#[derive(Default)]
struct Held {
    ids: Vec<SessionId>,
    /// When the first of them may go.
    shortest: Option<Duration>,
}

impl Held {
    fn push(&mut self, id: SessionId, wait: Duration) {
        self.ids.push(id);
        self.shortest = Some(self.shortest.map_or(wait, |s| s.min(wait)));
    }
}

/// One session's share of an iteration.
enum Job {
    Verify(PendingVerify),
    Prefill(usize),
}

struct PendingVerify {
    id: SessionId,
    tree: TokenTree,
    enqueued: Instant,
    reply: Reply,
}

/// Where a round's answer goes.
enum Reply {
    /// To the client that sent the tree.
    Caller(oneshot::Sender<Result<Round, EngineError>>),
    /// To the session's own driver, then out on its round stream.
    Driven,
}

/// Starts the engine thread. It ends after `shutdown`, or when every handle is dropped.
pub fn spawn<M: TreeModel + 'static>(
    model: Arc<M>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    server_draft: Option<ServerDraft>,
) -> (EngineHandle, std::thread::JoinHandle<()>) {
    let (tx, rx) = sync_channel(cfg.queue_depth);
    let (notices, notices_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("specinfer-engine".into())
        .spawn(move || {
            let _alive = EngineAlive(metrics.clone());
            Engine {
                model,
                metrics,
                sessions: HashMap::new(),
                pending: VecDeque::new(),
                served: HashMap::new(),
                next_id: 1,
                server_draft,
                forward_cost: AffineFit::default(),
                costs: CostBook::default(),
                epoch: Instant::now(),
                draining: false,
                prefixes: PrefixCache::new(cfg.prefix_cache_bytes),
                rates: KeyRates::new(
                    cfg.key_tokens_per_s,
                    (cfg.limits.max_tree_nodes as usize).max(MIN_PREFILL_CHUNK),
                ),
                held_for: None,
                cfg,
            }
            .run(rx, notices_rx)
        })
        .expect("spawning the engine thread");
    (EngineHandle { tx, notices }, thread)
}

/// Marks the engine dead in the metrics when its thread ends, by return or by panic, so the
/// health check tells an orchestrator to restart the process.
struct EngineAlive(Arc<Metrics>);

impl Drop for EngineAlive {
    fn drop(&mut self) {
        self.0.engine_alive.store(false, Ordering::Relaxed);
    }
}

/// Who opened a session: the SHA-256 of the API key its connection presented (`None`: no key).
/// A session can only be resumed by a connection with the same key.
pub type KeyId = Option<[u8; 32]>;

/// The [`KeyId`] of a connection that presented `api_key`.
pub fn key_id(api_key: Option<&str>) -> KeyId {
    use sha2::{Digest, Sha256};
    api_key.map(|k| Sha256::digest(k.as_bytes()).into())
}

/// A resume token: 128 bits from the operating system's random source.
fn fresh_resume_token() -> Result<[u8; 16], EngineError> {
    let mut token = [0u8; 16];
    getrandom::fill(&mut token).map_err(|e| {
        EngineError::new(
            ErrorCode::Internal,
            format!("the OS gave no random bytes: {e}"),
        )
    })?;
    Ok(token)
}

/// Equality whose time does not depend on where the inputs differ, for secrets.
fn constant_time_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

struct Engine<M: TreeModel> {
    model: Arc<M>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    sessions: HashMap<SessionId, Entry<M>>,
    pending: VecDeque<PendingVerify>,
    /// Tree nodes each key has had verified since the queue was last empty (fair queuing).
    served: HashMap<KeyId, usize>,
    next_id: SessionId,
    server_draft: Option<ServerDraft>,
    /// Forward seconds against nodes per forward: what one more node costs.
    forward_cost: AffineFit,
    /// What a token costs now, split and plain, as opening sessions are told.
    costs: CostBook,
    /// The origin of the drivers' clock.
    epoch: Instant,
    /// See [`EngineHandle::drain`].
    draining: bool,
    /// Closed sessions' K/V, for sessions that start with the same tokens.
    prefixes: PrefixCache<CachedPrefix<M::Cache>>,
    /// Each key's token rate.
    rates: KeyRates,
    /// Set by an iteration that placed nothing because every waiting key was over its rate:
    /// how long until the first of them may go again (the loop sleeps that long, not spins).
    held_for: Option<Duration>,
}

impl<M: TreeModel> Engine<M> {
    fn run(mut self, rx: Receiver<Request>, notices: Receiver<Request>) {
        let mut stopping = false;
        loop {
            let idle = self.pending.is_empty() && !self.prefilling() && !self.driving();
            if idle && stopping {
                break;
            }
            let wait = if idle {
                Some(Duration::from_secs(1))
            } else {
                self.held_for.take()
            };
            if let Some(wait) = wait {
                match rx.recv_timeout(wait) {
                    Ok(r) => stopping |= self.handle(r),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            // Everything that arrived meanwhile joins this iteration.
            while let Ok(r) = notices.try_recv().or_else(|_| rx.try_recv()) {
                stopping |= self.handle(r);
            }
            self.iteration();
            self.evict();
            self.metrics
                .publish_load(self.pending.len(), self.kv_bytes(), self.epoch);
        }
        tracing::info!(sessions = self.sessions.len(), "engine stopped");
        self.metrics.sessions_active.store(0, Ordering::Relaxed);
    }

    /// Returns true on shutdown.
    fn handle(&mut self, r: Request) -> bool {
        match r {
            Request::Open { reply, .. } if self.draining => {
                let _ = reply.send(Err(EngineError::draining()));
            }
            Request::Open {
                prompt,
                params,
                owner,
                reply,
            } => match self.open(prompt, params, owner) {
                // Answered when the prompt's prefill completes (see `iteration`).
                Ok(id) => {
                    let e = self.sessions.get_mut(&id).expect("just opened");
                    e.opening = Some((reply, Instant::now()));
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Request::Resume {
                token,
                owner,
                reply,
            } => {
                let found = self.sessions.iter_mut().find(|(_, e)| {
                    constant_time_eq(&e.resume_token, &token)
                        && e.owner == owner
                        && e.detached_at.is_some()
                });
                let _ = reply.send(match found {
                    Some((&id, _)) if self.draining => {
                        self.remove(id, "resumed while draining");
                        Err(EngineError::draining())
                    }
                    Some((&id, e)) => {
                        e.detached_at = None;
                        e.last_used = Instant::now();
                        Ok((id, e.session.tokens().to_vec()))
                    }
                    None => Err(EngineError::new(
                        ErrorCode::UnknownSession,
                        "no detached session has this resume token",
                    )),
                });
            }
            Request::Verify {
                id,
                tree,
                enqueued,
                reply,
            } => {
                if self.sessions.get(&id).is_some_and(|e| e.driving.is_some()) {
                    let _ = reply.send(Err(EngineError::new(
                        ErrorCode::OutOfOrder,
                        format!("session {id} is being generated by the verifier"),
                    )));
                } else if self.draining && self.sessions.contains_key(&id) {
                    self.remove(id, "moved: draining");
                    let _ = reply.send(Err(EngineError::draining()));
                } else if self.sessions.contains_key(&id) {
                    self.pending.push_back(PendingVerify {
                        id,
                        tree,
                        enqueued,
                        reply: Reply::Caller(reply),
                    });
                } else {
                    let _ = reply.send(Err(EngineError::new(
                        ErrorCode::UnknownSession,
                        format!("session {id} is not open"),
                    )));
                }
            }
            Request::Generate {
                id,
                drafting,
                rounds,
            } => {
                if let Err(e) = self.start_driving(id, drafting, rounds.clone()) {
                    let _ = rounds.send(Err(e));
                }
            }
            Request::Detach { id } => {
                if let Some(e) = self.sessions.get_mut(&id) {
                    e.detached_at = Some(Instant::now());
                }
            }
            Request::Close { id } => self.close(id),
            Request::Drain => {
                self.draining = true;
                let detached: Vec<SessionId> = self
                    .sessions
                    .iter()
                    .filter(|(_, e)| e.detached_at.is_some())
                    .map(|(&id, _)| id)
                    .collect();
                for id in detached {
                    self.remove(id, "detached while draining");
                }
                tracing::info!(sessions = self.sessions.len(), "draining");
            }
            Request::Shutdown => return true,
        }
        false
    }

    fn kv_bytes(&self) -> usize {
        self.sessions.values().map(|e| e.session.kv_bytes()).sum()
    }

    fn reserved_bytes(&self) -> usize {
        self.sessions.values().map(|e| e.reserved).sum()
    }

    fn prefilling(&self) -> bool {
        self.sessions.values().any(|e| e.opening.is_some())
    }

    fn driving(&self) -> bool {
        self.sessions.values().any(|e| e.driving.is_some())
    }

    fn start_driving(
        &mut self,
        id: SessionId,
        drafting: ServerDrafting,
        rounds: mpsc::UnboundedSender<Result<Round, EngineError>>,
    ) -> Result<(), EngineError> {
        let in_flight = self.pending.iter().any(|p| p.id == id);
        let e = self.sessions.get_mut(&id).ok_or_else(|| {
            EngineError::new(
                ErrorCode::UnknownSession,
                format!("session {id} is not open"),
            )
        })?;
        let busy = if e.opening.is_some() {
            Some("the session's prompt is still being prefilled")
        } else if e.driving.is_some() {
            Some("the verifier is already generating the session")
        } else if in_flight {
            Some("the session has a round in flight")
        } else {
            None
        };
        if let Some(why) = busy {
            return Err(EngineError::new(ErrorCode::OutOfOrder, why));
        }
        e.session.stop_sending_features();
        let params = e.session.params().clone();
        let lookup = ContextLookup::for_server(drafting);
        let drafter = match drafting {
            ServerDrafting::Plain | ServerDrafting::Lookup { .. } => None,
            ServerDrafting::Speculative => {
                let ssm = self.server_draft.ok_or_else(|| {
                    EngineError::new(
                        ErrorCode::Unsupported,
                        "this verifier has no draft model of its own (start it with --ssm)",
                    )
                })?;
                let mode = match params.mode {
                    VerifyMode::Greedy => DraftMode::Greedy,
                    _ => DraftMode::sampled(params.temperature, params.top_p),
                };
                Some(Drafter {
                    speculator: Speculator::for_request(
                        TreeShape::clients_default(),
                        mode,
                        params.seed,
                    ),
                    drafts: vec![Box::new(CachedDraft::new(ssm)) as Box<dyn DraftModel + Send>],
                })
            }
        };
        let mut driver = RoundDriver::new(e.session.tokens().to_vec(), params, drafter)
            .map_err(|err| EngineError::new(ErrorCode::Internal, err.to_string()))?
            .with_lookup(lookup);
        driver.set_limits(&self.cfg.limits);
        e.driving = Some(Driving {
            driver,
            rounds,
            queued: false,
        });
        Ok(())
    }

    /// Drafts the next round of every session the engine decodes on its own that has none
    /// queued (on this thread: co-located drafting costs the verifier's time, as it should).
    fn queue_driven_rounds(&mut self) {
        let epoch = self.epoch;
        let clock = move || epoch.elapsed().as_secs_f64();
        for (&id, e) in self.sessions.iter_mut() {
            let Some(d) = &mut e.driving else { continue };
            if d.queued {
                continue;
            }
            match d.driver.draft(&clock) {
                Ok(tree) => {
                    d.queued = true;
                    self.pending.push_back(PendingVerify {
                        id,
                        tree,
                        enqueued: Instant::now(),
                        reply: Reply::Driven,
                    });
                }
                Err(err) => {
                    let _ = d
                        .rounds
                        .send(Err(EngineError::new(ErrorCode::Internal, err.to_string())));
                    e.driving = None;
                }
            }
        }
    }

    /// Hands a driven session's round to its driver and out on its stream; stops driving at
    /// the end, on an error, or when nobody reads the stream any more.
    fn driven_round(&self, e: &mut Entry<M>, result: Result<Round, EngineError>) {
        let Some(d) = &mut e.driving else { return };
        d.queued = false;
        let go_on = match &result {
            Ok(r) => {
                let v = r.outcome.clone().into_verified(0, 0, r.stats.clone());
                match d.driver.on_verified(&v, self.epoch.elapsed().as_secs_f64()) {
                    Ok(_) => !d.driver.is_finished(),
                    Err(err) => {
                        tracing::warn!(%err, "a driven session's round");
                        false
                    }
                }
            }
            Err(_) => false,
        };
        let delivered = d.rounds.send(result).is_ok();
        if !go_on || !delivered {
            e.driving = None;
        }
    }

    fn open(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        owner: KeyId,
    ) -> Result<SessionId, EngineError> {
        if self.sessions.len() >= self.cfg.max_sessions {
            return Err(EngineError::busy(format!(
                "all {} sessions are in use",
                self.cfg.max_sessions
            )));
        }
        let quota = self.cfg.max_sessions_per_key;
        // Without authentication there is no tenant to hold to a quota.
        if quota > 0
            && owner.is_some()
            && self.sessions.values().filter(|e| e.owner == owner).count() >= quota
        {
            return Err(EngineError::busy(format!(
                "this API key holds {quota} sessions, its quota on this verifier"
            )));
        }
        let cfg = self.model.config();
        let per_token = self.model.kv_position_bytes();
        let need = (prompt.len()
            + params.max_new_tokens as usize
            + self.cfg.limits.max_tree_nodes as usize)
            * per_token;
        if need > self.cfg.session_kv_bytes {
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "prompt + max_new_tokens need {need} KV bytes, a session may hold {}",
                    self.cfg.session_kv_bytes
                ),
            ));
        }
        if prompt.len() + params.max_new_tokens as usize + self.cfg.limits.max_tree_nodes as usize
            > cfg.max_positions
        {
            return Err(EngineError::new(
                ErrorCode::LimitExceeded,
                format!(
                    "prompt + max_new_tokens exceed the model's context of {}",
                    cfg.max_positions
                ),
            ));
        }
        // Reuse the longest cached prefix of the prompt (all but its last token, the first
        // round's root); for a session that wants features, one whose entry kept the features
        // it will send.
        let model = &self.model;
        let hit = self.prefixes.take_longest(
            &prompt[..prompt.len() - 1],
            MIN_PREFIX_TOKENS,
            |p| {
                !params.return_features
                    || p.features.as_ref().is_some_and(|f| f.serve(prompt.len()))
            },
            |p, len| {
                model.copy_prefix(&p.cache, len).map(|cache| CachedPrefix {
                    cache,
                    features: p.features.as_ref().map(|f| f.before(len)),
                })
            },
        );
        // Cached prefixes give way to sessions.
        while self.reserved_bytes() + self.prefixes.bytes() + need > self.cfg.kv_budget_bytes
            && self.prefixes.evict_oldest()
        {}
        self.publish_prefixes();
        if self.reserved_bytes() + need > self.cfg.kv_budget_bytes {
            return Err(EngineError::busy(
                "the verifier's KV memory is reserved by the sessions it holds",
            ));
        }
        let session = match hit {
            Some(hit) => {
                self.metrics.prefix_hits.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .prefix_tokens_reused
                    .fetch_add(hit.tokens as u64, Ordering::Relaxed);
                Session::with_cache(
                    &*self.model,
                    &prompt,
                    params,
                    &self.cfg.limits,
                    hit.cache.cache,
                    hit.tokens,
                    hit.cache.features,
                )
            }
            None => Session::new(&*self.model, &prompt, params, &self.cfg.limits),
        }
        .map_err(|e| {
            let code = match e {
                SessionError::FeaturesUnsupported => ErrorCode::Unsupported,
                _ => ErrorCode::BadFrame,
            };
            EngineError::new(code, e.to_string())
        })?;
        let id = self.next_id;
        self.next_id += 1;
        let resume_token = fresh_resume_token()?;
        self.sessions.insert(
            id,
            Entry {
                session,
                resume_token,
                owner,
                reserved: need,
                last_used: Instant::now(),
                detached_at: None,
                opening: None,
                driving: None,
            },
        );
        self.metrics.sessions_opened.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .sessions_active
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        tracing::debug!(id, prompt = prompt.len(), "session opened");
        Ok(id)
    }

    /// Ends a session its client closed, keeping its K/V as a prefix for later sessions.
    fn close(&mut self, id: SessionId) {
        let Some(e) = self.take(id, "closed") else {
            return;
        };
        if e.opening.is_none() && !self.draining {
            let kv_bytes = e.session.kv_bytes();
            let (tokens, cache, features) = e.session.into_prefix();
            let bytes = kv_bytes + features.as_ref().map_or(0, PrefixFeatures::bytes);
            self.prefixes.insert(
                tokens,
                CachedPrefix { cache, features },
                bytes,
                MIN_PREFIX_TOKENS,
            );
            self.publish_prefixes();
        }
    }

    fn publish_prefixes(&self) {
        self.metrics
            .prefix_cache_bytes
            .store(self.prefixes.bytes() as u64, Ordering::Relaxed);
    }

    fn remove(&mut self, id: SessionId, why: &str) {
        self.take(id, why);
    }

    /// Takes a session out of the table (and the active-sessions gauge).
    fn take(&mut self, id: SessionId, why: &str) -> Option<Entry<M>> {
        let mut e = self.sessions.remove(&id)?;
        tracing::debug!(id, why, "session removed");
        // Whoever waits for its prefill hears why, rather than that the verifier stopped.
        if let Some((reply, _)) = e.opening.take() {
            let _ = reply.send(Err(EngineError::new(
                ErrorCode::Internal,
                format!("the session was closed before its prompt was prefilled: {why}"),
            )));
        }
        self.metrics
            .sessions_active
            .store(self.sessions.len() as u64, Ordering::Relaxed);
        Some(e)
    }

    /// One continuous-batching iteration: verification rounds first (FIFO, one per session,
    /// under the node budget), then prompt prefill chunks with what the budget leaves, all in ONE
    /// batched forward.
    fn iteration(&mut self) {
        self.queue_driven_rounds();
        let mut jobs: Vec<(SessionId, Job)> = Vec::new();
        let mut nodes = 0;
        let mut deferred = VecDeque::new();
        let mut waiting = std::mem::take(&mut self.pending);
        let now = Instant::now();
        // Work of keys over their token rate waits; the shortest such wait, and who waits.
        let mut held = Held::default();
        // A rate-limited key's oldest waiting prefill: its rounds enqueued later let it have
        // the key's tokens first, or a key's busy sessions would starve its new ones.
        let mut oldest_prefill: HashMap<KeyId, Instant> = HashMap::new();
        for e in self.sessions.values() {
            if let (Some((_, since)), true) = (&e.opening, self.rates.limits(&e.owner)) {
                oldest_prefill
                    .entry(e.owner)
                    .and_modify(|t| *t = (*t).min(*since))
                    .or_insert(*since);
            }
        }
        while let Some(p) = self.next_fairly(&mut waiting) {
            let fits = jobs.is_empty() || nodes + p.tree.len() <= self.cfg.batch_node_budget;
            // One round per session per forward: a second tree needs the first one's outcome.
            if !fits || jobs.iter().any(|(id, _)| *id == p.id) {
                deferred.push_back(p);
                continue;
            }
            if !self.sessions.contains_key(&p.id) {
                if let Reply::Caller(reply) = p.reply {
                    let _ = reply.send(Err(EngineError::new(
                        ErrorCode::UnknownSession,
                        "session closed",
                    )));
                }
                continue;
            }
            let owner = self
                .sessions
                .get(&p.id)
                .map(|e| e.owner)
                .unwrap_or_default();
            let wait = self.rates.wait(&owner, now).or_else(|| {
                oldest_prefill
                    .get(&owner)
                    .is_some_and(|&since| since < p.enqueued)
                    .then_some(Duration::ZERO)
            });
            if let Some(wait) = wait {
                held.push(p.id, wait);
                deferred.push_back(p);
                continue;
            }
            self.rates.charge(&owner, p.tree.len(), now);
            nodes += p.tree.len();
            *self.served.entry(owner).or_default() += p.tree.len();
            jobs.push((p.id, Job::Verify(p)));
        }
        // Busy: rounds wait for a place. Trees are capped at an equal share of a forward.
        let node_cap = if deferred.is_empty() {
            0
        } else {
            let waiting: std::collections::HashSet<SessionId> = jobs
                .iter()
                .map(|(id, _)| *id)
                .chain(deferred.iter().map(|p| p.id))
                .filter(|id| !held.ids.contains(id))
                .collect();
            (self.cfg.batch_node_budget / waiting.len().max(1)).max(1) as u32
        };
        // Deferred requests keep their order; the next iteration picks among them fairly again.
        self.pending = deferred;
        if self.pending.is_empty() {
            // Idle: the next busy period starts even (a key that was busy before has no debt).
            self.served.clear();
        }
        let mut opening: Vec<(SessionId, usize, KeyId)> = self
            .sessions
            .iter()
            .filter(|(id, e)| e.opening.is_some() && !jobs.iter().any(|(j, _)| j == *id))
            .map(|(&id, e)| (id, e.session.prefill_pending(), e.owner))
            .collect();
        opening.sort_unstable();
        let mut left = self.cfg.batch_node_budget.saturating_sub(nodes);
        for (id, pending, owner) in opening {
            if let Some(wait) = self.rates.wait(&owner, now) {
                held.push(id, wait);
                continue;
            }
            let take = pending.min(left.max(MIN_PREFILL_CHUNK));
            self.rates.charge(&owner, take, now);
            jobs.push((id, Job::Prefill(take)));
            left = left.saturating_sub(take);
            if left == 0 {
                break;
            }
        }
        self.metrics
            .rate_held
            .store(held.ids.len() as u64, Ordering::Relaxed);
        if jobs.is_empty() {
            self.held_for = held.shortest;
            return;
        }

        let started = Instant::now();
        // Sessions leave the table for the forward so each can be borrowed mutably.
        let mut entries: Vec<Entry<M>> = jobs
            .iter()
            .map(|(id, _)| self.sessions.remove(id).expect("checked above"))
            .collect();
        // A panic in the forward (a bug) fails this batch's sessions, not the engine: the
        // other sessions and every later batch go on.
        let batch = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut work: Vec<(&mut Session<M>, Work)> = entries
                .iter_mut()
                .zip(&jobs)
                .map(|(e, (_, job))| {
                    let w = match job {
                        Job::Verify(p) => Work::Verify(&p.tree),
                        Job::Prefill(n) => Work::Prefill { max_tokens: *n },
                    };
                    (&mut e.session, w)
                })
                .collect();
            run_batch(&*self.model, &self.cfg.limits, &mut work)
        }));
        let results = match batch {
            Ok(results) => results,
            Err(_) => {
                self.fail_batch(jobs, entries);
                return;
            }
        };
        // A GPU's forward may still be running (prefill chunks and sampled rounds read nothing
        // back): the cost fit must time the work, not its launches.
        if let Err(e) = self.model.synchronize() {
            tracing::warn!(error = %e, "waiting for the device after a batch");
        }
        let forward = started.elapsed();
        let rounds = jobs
            .iter()
            .filter(|(_, j)| matches!(j, Job::Verify(_)))
            .count() as u32;
        let forward_nodes: usize = jobs
            .iter()
            .map(|(_, j)| match j {
                Job::Verify(p) => p.tree.len(),
                Job::Prefill(n) => *n,
            })
            .sum();
        self.forward_cost
            .observe(forward_nodes as f64, forward.as_secs_f64());
        self.metrics
            .forward_nodes
            .fetch_add(forward_nodes as u64, Ordering::Relaxed);
        self.metrics
            .last_batch_nodes
            .store(forward_nodes as u64, Ordering::Relaxed);
        let (_, per_node) = self.forward_cost.line();
        let node_price_ns = (per_node * rounds as f64 * 1e9).min(u32::MAX as f64) as u32;
        self.costs.forward(
            forward.as_secs_f64(),
            forward_nodes,
            rounds as usize,
            per_node,
        );
        self.metrics.batch_size.observe(jobs.len() as f64);
        self.metrics.forward_seconds.observe(forward.as_secs_f64());
        self.metrics.batches.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        for (((id, job), mut e), result) in jobs.into_iter().zip(entries).zip(results) {
            e.last_used = now;
            match job {
                Job::Verify(p) => {
                    let queue = started.duration_since(p.enqueued);
                    self.metrics.queue_seconds.observe(queue.as_secs_f64());
                    let reply = match result {
                        Ok(Done::Round(outcome)) => {
                            self.metrics.record_round(&outcome);
                            if matches!(p.reply, Reply::Caller(_)) {
                                self.costs.split_round(
                                    outcome.tokens.len(),
                                    p.tree.len(),
                                    queue.as_secs_f64(),
                                    forward.as_secs_f64(),
                                    per_node * rounds.saturating_sub(1) as f64,
                                    now,
                                );
                            }
                            let stats = RoundStats {
                                tree_nodes: p.tree.len() as u32,
                                batch_size: rounds,
                                queue_us: queue.as_micros().min(u32::MAX as u128) as u32,
                                forward_us: forward.as_micros().min(u32::MAX as u128) as u32,
                                node_price_ns,
                                node_cap,
                            };
                            Ok(Round { outcome, stats })
                        }
                        Ok(Done::Prefilled { .. }) => {
                            unreachable!("verification work yields rounds")
                        }
                        Err(e) => {
                            let code = match e {
                                SessionError::Finished(_) | SessionError::Prefilling => {
                                    ErrorCode::OutOfOrder
                                }
                                SessionError::Model(_) => ErrorCode::Internal,
                                _ => ErrorCode::BadFrame,
                            };
                            Err(EngineError::new(code, e.to_string()))
                        }
                    };
                    match p.reply {
                        Reply::Caller(tx) => {
                            let _ = tx.send(reply);
                        }
                        Reply::Driven => self.driven_round(&mut e, reply),
                    }
                    self.sessions.insert(id, e);
                }
                Job::Prefill(_) => match result {
                    Ok(Done::Prefilled { pending: 0 }) => {
                        if let Some((reply, since)) = e.opening.take() {
                            self.metrics
                                .prefill_seconds
                                .observe(since.elapsed().as_secs_f64());
                            let _ = reply.send(Ok(Opened {
                                id,
                                resume_token: e.resume_token,
                                costs: self.costs.now(now),
                            }));
                        }
                        self.sessions.insert(id, e);
                    }
                    Ok(_) => {
                        self.sessions.insert(id, e);
                    }
                    Err(err) => {
                        if let Some((reply, _)) = e.opening.take() {
                            let _ = reply
                                .send(Err(EngineError::new(ErrorCode::Internal, err.to_string())));
                        }
                        self.metrics
                            .sessions_active
                            .store(self.sessions.len() as u64, Ordering::Relaxed);
                    }
                },
            }
        }
    }

    /// The next waiting round to place: the oldest of the key least served in this busy period
    /// (tree nodes verified), so that a key with many sessions gets no more of the forwards
    /// than a key with one (fair queuing between keys; FIFO within a key).
    fn next_fairly(&self, waiting: &mut VecDeque<PendingVerify>) -> Option<PendingVerify> {
        let served = |p: &PendingVerify| {
            self.sessions
                .get(&p.id)
                .and_then(|e| self.served.get(&e.owner))
                .copied()
                .unwrap_or(0)
        };
        let next = (0..waiting.len()).min_by_key(|&i| (served(&waiting[i]), i))?;
        waiting.remove(next)
    }

    /// After a panic in a batch's forward: its sessions (whose caches may be half-written)
    /// are closed, each waiting client told so.
    fn fail_batch(&mut self, jobs: Vec<(SessionId, Job)>, entries: Vec<Entry<M>>) {
        self.metrics.engine_panics.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            sessions = jobs.len(),
            "a batched forward panicked (a bug): its sessions are closed, the engine goes on"
        );
        let failed = || {
            EngineError::new(
                ErrorCode::Internal,
                "the verifier failed on this round (a bug, logged); the session was closed",
            )
        };
        for ((_, job), mut e) in jobs.into_iter().zip(entries) {
            match job {
                Job::Verify(p) => match p.reply {
                    Reply::Caller(tx) => {
                        let _ = tx.send(Err(failed()));
                    }
                    Reply::Driven => self.driven_round(&mut e, Err(failed())),
                },
                Job::Prefill(_) => {
                    if let Some((reply, _)) = e.opening.take() {
                        let _ = reply.send(Err(failed()));
                    }
                }
            }
        }
        self.metrics
            .sessions_active
            .store(self.sessions.len() as u64, Ordering::Relaxed);
    }

    fn evict(&mut self) {
        let now = Instant::now();
        // A session whose work waits in the engine (a queued round, a prompt being prefilled,
        // work held to its key's rate) is not idle, however long it waits.
        let expired: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(id, e)| {
                (now.duration_since(e.last_used) > self.cfg.idle_timeout
                    && e.opening.is_none()
                    && !self.pending.iter().any(|p| p.id == **id))
                    || e.detached_at
                        .is_some_and(|t| now.duration_since(t) > self.cfg.detach_grace)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            self.remove(id, "idle or detached past the grace period");
        }
    }
}
