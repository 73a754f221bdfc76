//! The QUIC service. A connection's first bidirectional stream carries the hello (version, API key,
//! model fingerprint); every later bidirectional stream carries one session (open or resume,
//! verify rounds, close). A bad frame closes its stream and session only; the connection and
//! every other session go on.
//!
//! Browsers speak the same protocol over WebTransport (HTTP/3 on QUIC, through
//! `web-transport-quinn`, which sits on the same quinn and rustls): a WebTransport session is
//! handled exactly like a native connection, its bidirectional streams like QUIC streams.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::future::Future;

use specinfer_model::TreeModel;
use specinfer_wire::server::{check_hello, HelloPolicy, SessionStream, StreamStep};
use specinfer_wire::{
    ClientHello, ErrorCode, ErrorFrame, Limits, Message, ModelFingerprint, ServerHello, ServerLoad,
    SessionOpened, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::engine::{self, EngineConfig, EngineError, EngineHandle, SessionId};
use crate::metrics::Metrics;
use specinfer_net::{read_frame, write_frame, NetError, RemoteConfig, ServerIdentity, Trust};

#[derive(Clone)]
pub struct ServiceConfig {
    pub engine: EngineConfig,
    /// SHA-256 digests of the accepted API keys ([`engine::key_id`]): the verifier never needs
    /// the keys themselves, so its configuration does not hold them. `None` serves without
    /// authentication (only with an explicit opt-in on the command line).
    pub api_keys: Option<HashSet<[u8; 32]>>,
    pub model_name: String,
    pub fingerprint: ModelFingerprint,
    /// How long a new connection may take to say hello.
    pub hello_timeout: Duration,
    /// Bounds on connections before anyone has authenticated.
    pub connections: ConnectionLimits,
    /// The verifier's own draft model, for sessions that ask it to generate speculatively
    /// (`Generate` with `ServerDrafting::Speculative`); without one they are refused.
    pub server_draft: Option<engine::ServerDraft>,
}

/// How many connections the verifier holds, before authentication: a peer cannot exhaust it
/// by opening connections, nor make it keep state for spoofed addresses.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections from one IP address at once.
    pub per_address: usize,
    /// Connections at once, over all addresses.
    pub total: usize,
    /// Above this many connections, a new one must first prove it can receive at its address
    /// (a QUIC Retry, one more round trip), so a flood of spoofed handshakes costs no state.
    pub retry_above: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            per_address: 64,
            total: 4096,
            retry_above: 256,
        }
    }
}

/// One admitted connection's place in the counts, given back when it ends.
struct ConnectionSlot {
    ctx: Arc<Ctx>,
    ip: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self.ctx.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total -= 1;
        if let Some(n) = open.by_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.by_address.remove(&self.ip);
            }
        }
    }
}

/// Connections open now, by source address.
#[derive(Default)]
struct OpenConnections {
    total: usize,
    by_address: HashMap<IpAddr, usize>,
}

/// Admits `incoming` within the connection limits, or answers it (a Retry, or a refusal).
fn admit(ctx: &Arc<Ctx>, incoming: quinn::Incoming) -> Option<(quinn::Incoming, ConnectionSlot)> {
    let limits = ctx.cfg.connections;
    let ip = incoming.remote_address().ip();
    let mut open = ctx.open.lock().unwrap_or_else(|e| e.into_inner());
    if open.total >= limits.retry_above && !incoming.remote_address_validated() {
        drop(open);
        if incoming.may_retry() {
            ctx.metrics
                .connections_retried
                .fetch_add(1, Ordering::Relaxed);
            let _ = incoming.retry();
        } else {
            incoming.refuse();
        }
        return None;
    }
    let from_ip = open.by_address.get(&ip).copied().unwrap_or(0);
    if open.total >= limits.total || from_ip >= limits.per_address {
        drop(open);
        ctx.metrics
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%ip, from_ip, "connection refused: over the connection limits");
        incoming.refuse();
        return None;
    }
    open.total += 1;
    *open.by_address.entry(ip).or_default() += 1;
    drop(open);
    Some((
        incoming,
        ConnectionSlot {
            ctx: ctx.clone(),
            ip,
        },
    ))
}

/// Failed authentications, logged with the address but at most once a second (with how many
/// went unlogged), so a key-guessing client cannot flood the log.
struct AuthFailures {
    last_logged: Option<Instant>,
    unlogged: u64,
}

impl AuthFailures {
    const EVERY: Duration = Duration::from_secs(1);

    fn record(&mut self, from: SocketAddr) {
        let now = Instant::now();
        if self
            .last_logged
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            self.unlogged += 1;
            return;
        }
        tracing::warn!(
            %from,
            unlogged_since_last = self.unlogged,
            "a connection presented a missing or unknown API key"
        );
        self.last_logged = Some(now);
        self.unlogged = 0;
    }
}

struct Ctx {
    cfg: ServiceConfig,
    auth_failures: std::sync::Mutex<AuthFailures>,
    /// Connections open now (see [`ConnectionLimits`]).
    open: std::sync::Mutex<OpenConnections>,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    /// When the engine started: the origin of its heartbeat.
    started: Instant,
}

/// What the service needs from a client connection: a native QUIC connection, or a browser's
/// WebTransport session.
trait ClientConn: Send + Sync + 'static {
    type Send: AsyncWrite + Unpin + Send + 'static;
    type Recv: AsyncRead + Unpin + Send + 'static;
    fn accept_bi(&self) -> impl Future<Output = Result<(Self::Send, Self::Recv), NetError>> + Send;
    fn closed(&self) -> impl Future<Output = ()> + Send;
    fn close(&self, reason: &'static [u8]);
    fn remote_address(&self) -> SocketAddr;
}

impl ClientConn for quinn::Connection {
    type Send = quinn::SendStream;
    type Recv = quinn::RecvStream;

    async fn accept_bi(&self) -> Result<(Self::Send, Self::Recv), NetError> {
        Ok(quinn::Connection::accept_bi(self).await?)
    }

    async fn closed(&self) {
        let _ = quinn::Connection::closed(self).await;
    }

    fn close(&self, reason: &'static [u8]) {
        quinn::Connection::close(self, 1u32.into(), reason);
    }

    fn remote_address(&self) -> SocketAddr {
        quinn::Connection::remote_address(self)
    }
}

impl ClientConn for web_transport_quinn::Session {
    type Send = web_transport_quinn::SendStream;
    type Recv = web_transport_quinn::RecvStream;

    async fn accept_bi(&self) -> Result<(Self::Send, Self::Recv), NetError> {
        web_transport_quinn::Session::accept_bi(self)
            .await
            .map_err(|e| NetError::WebTransport(e.to_string()))
    }

    async fn closed(&self) {
        let _ = web_transport_quinn::Session::closed(self).await;
    }

    fn close(&self, reason: &'static [u8]) {
        web_transport_quinn::Session::close(self, 1, reason);
    }

    fn remote_address(&self) -> SocketAddr {
        // A session is its QUIC connection underneath.
        quinn::Connection::remote_address(self)
    }
}

/// Drain, health and readiness of a running verifier, for the admin endpoint and the signal
/// handler.
#[derive(Clone)]
pub struct VerifierControl {
    ctx: Arc<Ctx>,
}

/// An engine whose loop has not gone round for this long is unhealthy.
const ENGINE_STALL: Duration = Duration::from_secs(30);

impl VerifierControl {
    /// Starts draining (idempotent): the verifier reports itself unready and draining in its
    /// hello, opens and resumes no session, and moves each live session at its next round; see
    /// [`EngineHandle::drain`].
    pub fn drain(&self) {
        if self.ctx.metrics.draining.swap(1, Ordering::Relaxed) == 0 {
            tracing::info!("drain requested");
            self.ctx.engine.drain();
        }
    }

    pub fn draining(&self) -> bool {
        self.ctx.metrics.draining.load(Ordering::Relaxed) != 0
    }

    /// The engine thread runs and goes round: false after a panic or a hung forward, when the
    /// process should be restarted.
    pub fn healthy(&self) -> bool {
        self.ctx
            .metrics
            .engine_healthy(self.ctx.started, ENGINE_STALL)
    }

    /// The engine thread has ended (a panic, or after shutdown): nothing is served any more.
    pub fn engine_stopped(&self) -> bool {
        !self.ctx.metrics.engine_alive.load(Ordering::Relaxed)
    }

    /// Healthy and not draining: new sessions are welcome.
    pub fn ready(&self) -> bool {
        self.healthy() && !self.draining()
    }

    /// Sessions it holds (attached, or detached within their grace period).
    pub fn sessions(&self) -> u64 {
        self.ctx.metrics.sessions_active.load(Ordering::Relaxed)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.ctx.metrics
    }
}

/// A verifier serving on a QUIC endpoint (and, optionally, a WebTransport one).
/// The WebTransport endpoint's certificate, renewable while it runs: a certificate a browser
/// trusts by its hash lives at most 14 days, and the verifier runs longer.
#[derive(Clone)]
pub struct WebTransportIdentity {
    endpoint: quinn::Endpoint,
}

impl WebTransportIdentity {
    /// Handshakes from now on present `identity`; sessions already open keep going.
    pub fn renew(&self, identity: &ServerIdentity) -> Result<(), NetError> {
        self.endpoint
            .set_server_config(Some(webtransport_config(identity)?));
        Ok(())
    }
}

fn webtransport_config(identity: &ServerIdentity) -> Result<quinn::ServerConfig, NetError> {
    identity.quinn_config_with_alpn(web_transport_quinn::ALPN.as_bytes())
}

pub struct RunningVerifier {
    endpoint: quinn::Endpoint,
    ctx: Arc<Ctx>,
    engine_thread: Option<std::thread::JoinHandle<()>>,
    accept: tokio::task::JoinHandle<()>,
    web: Option<(quinn::Endpoint, tokio::task::JoinHandle<()>)>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApiKeysError {
    #[error("line {0}: sha256: must be followed by 64 hex digits")]
    BadDigest(usize),
    #[error("no API key in it")]
    Empty,
}

/// An API key file's digests: one key per line, as `sha256:` and 64 hex digits (the file then
/// does not hold the key) or plain (hashed here); `#` starts a comment line. Also returns how
/// many keys were plain, which an operator should be told to hash.
pub fn parse_api_keys(text: &str) -> Result<(HashSet<[u8; 32]>, usize), ApiKeysError> {
    let (mut keys, mut plain) = (HashSet::new(), 0);
    for (n, line) in text.lines().map(str::trim).enumerate() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let digest = match line.strip_prefix("sha256:") {
            Some(hex) => {
                specinfer_wire::parse_sha256_hex(hex).ok_or(ApiKeysError::BadDigest(n + 1))?
            }
            None => {
                plain += 1;
                engine::key_id(Some(line)).expect("a key has a digest")
            }
        };
        keys.insert(digest);
    }
    if keys.is_empty() {
        return Err(ApiKeysError::Empty);
    }
    Ok((keys, plain))
}

/// A verifier on 127.0.0.1 (a free port) with a fresh self-signed certificate, and the client
/// configuration that reaches it: pinned to that certificate, with `api_key`, which the verifier
/// accepts besides any keys `cfg` lists. What a first run's embedded verifier and the end-to-end
/// tests start.
pub fn start_loopback<M: TreeModel + 'static>(
    model: Arc<M>,
    api_key: String,
    cfg: ServiceConfig,
) -> Result<(RunningVerifier, RemoteConfig), NetError> {
    let identity = ServerIdentity::self_signed(&["localhost"])?;
    let mut keys = cfg.api_keys.clone().unwrap_or_default();
    keys.extend(engine::key_id(Some(&api_key)));
    let cfg = ServiceConfig {
        api_keys: Some(keys),
        ..cfg
    };
    let remote = RemoteConfig {
        addr: "127.0.0.1:0".parse().expect("literal"),
        server_name: "localhost".into(),
        trust: Trust::pinned_hex(&identity.fingerprint())?,
        api_key: Some(api_key),
        expected_model: cfg.fingerprint.clone(),
        idle_timeout: RemoteConfig::DEFAULT_IDLE_TIMEOUT,
    };
    let server = start(model, &identity, remote.addr, cfg)?;
    let remote = RemoteConfig {
        addr: server.local_addr(),
        ..remote
    };
    Ok((server, remote))
}

/// Starts the engine thread and the QUIC endpoint. Must be called inside a tokio runtime.
pub fn start<M: TreeModel + 'static>(
    model: Arc<M>,
    identity: &ServerIdentity,
    listen: SocketAddr,
    cfg: ServiceConfig,
) -> Result<RunningVerifier, NetError> {
    let endpoint = quinn::Endpoint::server(identity.quinn_config()?, listen)?;
    let metrics = Arc::new(Metrics::default());
    let started = Instant::now();
    let (engine, engine_thread) =
        engine::spawn(model, cfg.engine.clone(), metrics.clone(), cfg.server_draft);
    if cfg.api_keys.is_none() {
        tracing::warn!("serving WITHOUT authentication (--insecure-no-auth): anyone who can reach this port may use it");
    }
    let ctx = Arc::new(Ctx {
        cfg,
        engine,
        metrics,
        started,
        open: Default::default(),
        auth_failures: std::sync::Mutex::new(AuthFailures {
            last_logged: None,
            unlogged: 0,
        }),
    });
    let accept = tokio::spawn(accept_loop(endpoint.clone(), ctx.clone()));
    tracing::info!(addr = %endpoint.local_addr()?, fingerprint = identity.fingerprint(), "verifier listening");
    Ok(RunningVerifier {
        endpoint,
        ctx,
        engine_thread: Some(engine_thread),
        accept,
        web: None,
    })
}

impl RunningVerifier {
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .expect("a bound endpoint has an address")
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.ctx.metrics
    }

    /// What an operator (or an orchestrator's probes) controls and watches while it serves.
    pub fn control(&self) -> VerifierControl {
        VerifierControl {
            ctx: self.ctx.clone(),
        }
    }

    /// Also serves browsers: WebTransport on `listen` with `identity` (for development, one from
    /// [`ServerIdentity::self_signed_for_browsers`], which a page trusts by its hash). Returns the
    /// bound address.
    pub fn serve_webtransport(
        &mut self,
        identity: &ServerIdentity,
        listen: SocketAddr,
    ) -> Result<SocketAddr, NetError> {
        let endpoint = quinn::Endpoint::server(webtransport_config(identity)?, listen)?;
        let addr = endpoint.local_addr()?;
        let ctx = self.ctx.clone();
        let accept_endpoint = endpoint.clone();
        let task = tokio::spawn(async move {
            while let Some(incoming) = accept_endpoint.accept().await {
                let ctx = ctx.clone();
                let Some((incoming, slot)) = admit(&ctx, incoming) else {
                    continue;
                };
                tokio::spawn(async move {
                    let _slot = slot;
                    let session = async {
                        let conn = incoming.await?;
                        web_transport_quinn::Request::accept(conn)
                            .await
                            .map_err(|e| NetError::WebTransport(e.to_string()))?
                            .ok()
                            .await
                            .map_err(|e| NetError::WebTransport(e.to_string()))
                    };
                    // The QUIC and HTTP/3 handshakes and the CONNECT request get the time a
                    // native connection gets to say hello: a peer that stalls them holds nothing
                    // for longer.
                    let session = tokio::time::timeout(ctx.cfg.hello_timeout, session)
                        .await
                        .unwrap_or(Err(NetError::Timeout));
                    match session {
                        Ok(session) => {
                            ctx.metrics.connections.fetch_add(1, Ordering::Relaxed);
                            if let Err(e) = connection(session, &ctx).await {
                                tracing::debug!("WebTransport session ended: {e}");
                            }
                        }
                        Err(e) => tracing::debug!("WebTransport handshake failed: {e}"),
                    }
                });
            }
        });
        tracing::info!(%addr, certificate_sha256 = identity.fingerprint(), "WebTransport listening");
        self.web = Some((endpoint, task));
        Ok(addr)
    }

    /// A handle that renews the browsers' certificate of the WebTransport endpoint, if one is
    /// served.
    pub fn webtransport_identity(&self) -> Option<WebTransportIdentity> {
        self.web.as_ref().map(|(endpoint, _)| WebTransportIdentity {
            endpoint: endpoint.clone(),
        })
    }

    /// Stops accepting connections, lets queued rounds finish, then closes every connection.
    pub async fn shutdown(mut self) {
        self.endpoint.set_server_config(None);
        self.accept.abort();
        if let Some((web, task)) = &self.web {
            web.set_server_config(None);
            task.abort();
        }
        self.ctx.engine.shutdown();
        if let Some(t) = self.engine_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        self.endpoint.close(0u32.into(), b"verifier shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(5), self.endpoint.wait_idle()).await;
        if let Some((web, _)) = &self.web {
            web.close(0u32.into(), b"verifier shutting down");
            let _ = tokio::time::timeout(Duration::from_secs(2), web.wait_idle()).await;
        }
        tracing::info!("verifier stopped");
    }
}

async fn accept_loop(endpoint: quinn::Endpoint, ctx: Arc<Ctx>) {
    while let Some(incoming) = endpoint.accept().await {
        let Some((incoming, slot)) = admit(&ctx, incoming) else {
            continue;
        };
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let _slot = slot;
            match incoming.await {
                Ok(conn) => {
                    ctx.metrics.connections.fetch_add(1, Ordering::Relaxed);
                    let remote = conn.remote_address();
                    if let Err(e) = connection(conn, &ctx).await {
                        tracing::debug!(%remote, "connection ended: {e}");
                    }
                }
                Err(e) => tracing::debug!("handshake failed: {e}"),
            }
        });
    }
}

fn error(code: ErrorCode, session: Option<u64>, message: impl Into<String>) -> ErrorFrame {
    ErrorFrame {
        code,
        session,
        message: message.into(),
        retry_after_ms: None,
    }
}

fn engine_error(e: EngineError, session: u64) -> Message {
    Message::Error(ErrorFrame {
        code: e.code,
        session: Some(session),
        message: e.message,
        retry_after_ms: e.retry_after_ms,
    })
}

impl Ctx {
    /// The load a hello reports.
    fn load(&self) -> ServerLoad {
        let m = &self.metrics;
        let cfg = &self.cfg.engine;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        ServerLoad {
            sessions: get(&m.sessions_active).min(u32::MAX as u64) as u32,
            max_sessions: cfg.max_sessions.min(u32::MAX as usize) as u32,
            queued_rounds: get(&m.queued_rounds).min(u32::MAX as u64) as u32,
            kv_free_bytes: (cfg.kv_budget_bytes as u64).saturating_sub(get(&m.kv_bytes)),
            batch_nodes: get(&m.last_batch_nodes).min(u32::MAX as u64) as u32,
            draining: get(&m.draining) != 0,
        }
    }

    async fn send<W: AsyncWrite + Unpin>(
        &self,
        send: &mut W,
        msg: &Message,
    ) -> Result<(), NetError> {
        if let Message::Error(e) = msg {
            self.metrics.error(e.code);
        }
        let n = write_frame(send, msg).await?;
        self.metrics
            .bytes_out
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(())
    }

    async fn recv<R: AsyncRead + Unpin>(&self, recv: &mut R) -> Result<Option<Message>, NetError> {
        self.recv_within(recv, &self.cfg.engine.limits).await
    }

    /// The connection's first frame, held to [`HELLO_FRAME_BYTES`]: a client that has not
    /// authenticated never makes the verifier buffer or decode more than a hello.
    async fn recv_hello<R: AsyncRead + Unpin>(
        &self,
        recv: &mut R,
    ) -> Result<Option<Message>, NetError> {
        let limits = Limits {
            max_frame_bytes: HELLO_FRAME_BYTES.min(self.cfg.engine.limits.max_frame_bytes),
            ..self.cfg.engine.limits
        };
        self.recv_within(recv, &limits).await
    }

    async fn recv_within<R: AsyncRead + Unpin>(
        &self,
        recv: &mut R,
        limits: &Limits,
    ) -> Result<Option<Message>, NetError> {
        let got = read_frame(recv, limits).await?;
        Ok(got.map(|(m, n)| {
            self.metrics.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
            m
        }))
    }

    /// The hello of a connection's first frame, or the error that refuses the connection.
    fn check_hello(&self, first: Message) -> Result<ClientHello, ErrorFrame> {
        let admits_key = |key: Option<&str>| match &self.cfg.api_keys {
            None => true,
            Some(keys) => engine::key_id(key).is_some_and(|d| keys.contains(&d)),
        };
        check_hello(
            first,
            &HelloPolicy {
                model: &self.cfg.fingerprint,
                admits_key: &admits_key,
                serving: self.metrics.engine_alive.load(Ordering::Relaxed),
            },
        )
    }
}

/// The largest first frame of a connection (a hello is a few hundred bytes).
pub const HELLO_FRAME_BYTES: u32 = 16 << 10;

async fn connection<C: ClientConn>(conn: C, ctx: &Arc<Ctx>) -> Result<(), NetError> {
    let (mut send, mut recv) = tokio::time::timeout(ctx.cfg.hello_timeout, conn.accept_bi())
        .await
        .map_err(|_| NetError::Timeout)??;
    let hello = tokio::time::timeout(ctx.cfg.hello_timeout, ctx.recv_hello(&mut recv))
        .await
        .map_err(|_| NetError::Timeout)?;
    // Sessions are bound to the key that opened them: only it may resume them.
    let checked = match hello {
        Ok(Some(first)) => ctx.check_hello(first),
        Ok(None) => Err(error(
            ErrorCode::BadFrame,
            None,
            "stream ended before ClientHello",
        )),
        Err(NetError::Decode(e)) => Err(error(e.error_code(), None, e.to_string())),
        Err(e) => return Err(e),
    };
    let owner = match checked {
        Ok(h) => engine::key_id(h.api_key.as_deref()),
        Err(refusal) => {
            if refusal.code == ErrorCode::Unauthorized {
                ctx.auth_failures
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .record(conn.remote_address());
            }
            ctx.send(&mut send, &Message::Error(refusal)).await?;
            let _ = send.shutdown().await;
            // Give the client a moment to read the reason before the connection goes.
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await;
            conn.close(b"refused");
            return Ok(());
        }
    };
    let hello = Message::ServerHello(ServerHello {
        protocol_version: PROTOCOL_VERSION,
        model_name: ctx.cfg.model_name.clone(),
        model: ctx.cfg.fingerprint.clone(),
        limits: ctx.cfg.engine.limits,
        load: ctx.load(),
    });
    ctx.send(&mut send, &hello).await?;
    loop {
        let (send, recv) = conn.accept_bi().await?;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            session_stream(send, recv, &ctx, owner).await;
        });
    }
}

/// Serves one session stream: the order of its frames is [`SessionStream`]'s (sans-I/O, fuzzed
/// in `wire/fuzz`); this carries out each step against the engine.
async fn session_stream<W, R>(mut send: W, mut recv: R, ctx: &Ctx, owner: engine::KeyId)
where
    W: AsyncWrite + Unpin,
    R: AsyncRead + Unpin,
{
    let mut stream = SessionStream::<SessionId>::default();
    let closed_cleanly = loop {
        let msg = match ctx.recv(&mut recv).await {
            Ok(Some(m)) => m,
            Ok(None) => break false,
            Err(NetError::Decode(e)) => {
                let _ = ctx
                    .send(
                        &mut send,
                        &Message::Error(error(e.error_code(), stream.client_id(), e.to_string())),
                    )
                    .await;
                let _ = send.shutdown().await;
                if let Some(b) = stream.bound() {
                    ctx.engine.close(b.id);
                }
                return;
            }
            Err(_) => break false,
        };
        let reply = match stream.on_frame(msg) {
            StreamStep::Open(o) => match ctx.engine.open(o.prompt, o.params, owner).await {
                Ok(opened) => {
                    stream.bind(o.session, opened.id);
                    Message::SessionOpened(SessionOpened {
                        session: o.session,
                        resume_token: opened.resume_token,
                        costs: opened.costs,
                    })
                }
                Err(e) => engine_error(e, o.session),
            },
            StreamStep::Resume {
                session,
                resume_token,
            } => match ctx.engine.resume(resume_token, owner).await {
                Ok((id, committed)) => {
                    stream.bind(session, id);
                    Message::Resumed { session, committed }
                }
                Err(e) => engine_error(e, session),
            },
            StreamStep::Verify(v) => {
                let id = stream.bound().expect("verify steps are bound").id;
                match ctx.engine.verify(id, v.tree).await {
                    Ok(r) => {
                        stream.round_done();
                        Message::Verified(r.outcome.into_verified(v.session, v.round, r.stats))
                    }
                    Err(e) if e.code == ErrorCode::Draining => {
                        // The engine has closed the session; the client takes it elsewhere.
                        ctx.metrics.sessions_moved.fetch_add(1, Ordering::Relaxed);
                        let _ = ctx
                            .send(&mut send, &Message::Move { session: v.session })
                            .await;
                        let _ = send.shutdown().await;
                        return;
                    }
                    Err(e) => {
                        let fatal = e.code == ErrorCode::BadFrame;
                        let reply = engine_error(e, v.session);
                        if fatal {
                            // A tree the model refused: the session ends, the stream with it.
                            let _ = ctx.send(&mut send, &reply).await;
                            let _ = send.shutdown().await;
                            ctx.engine.close(id);
                            return;
                        }
                        reply
                    }
                }
            }
            StreamStep::Generate { drafting } => {
                match stream_generation(&mut send, ctx, &mut stream, drafting).await {
                    Ok(()) => continue,
                    Err(_) => break false,
                }
            }
            StreamStep::Close { session } => {
                // Acknowledged, so the client knows the memory is freed before it goes.
                let _ = ctx.send(&mut send, &Message::Close { session }).await;
                break true;
            }
            StreamStep::Refuse(e) => Message::Error(e),
        };
        if ctx.send(&mut send, &reply).await.is_err() {
            break false;
        }
    };
    let bound = stream.bound().map(|b| b.id);
    tracing::debug!(closed_cleanly, session = bound, "session stream ended");
    if let Some(id) = bound {
        if closed_cleanly {
            ctx.engine.close(id);
        } else {
            ctx.engine.detach(id);
        }
    }
    let _ = send.shutdown().await;
}

/// Streams the rounds of a session the engine decodes on its own, one `Verified` each, until it
/// finishes or fails. The client's frames are not read meanwhile: a client that wants to stop
/// closes the stream, the next round's send fails, and dropping the round stream stops the
/// engine's decoding. Errs only when the stream is gone.
async fn stream_generation<W: AsyncWrite + Unpin>(
    send: &mut W,
    ctx: &Ctx,
    stream: &mut SessionStream<SessionId>,
    drafting: specinfer_wire::ServerDrafting,
) -> Result<(), NetError> {
    let b = stream.bound().expect("generate steps are bound");
    let (client_id, id) = (b.client_id, b.id);
    let mut rounds = match ctx.engine.generate(id, drafting) {
        Ok(rounds) => rounds,
        Err(e) => return ctx.send(send, &engine_error(e, client_id)).await,
    };
    while let Some(round) = rounds.recv().await {
        let msg = match round {
            Ok(r) => {
                let number = stream.round_done();
                Message::Verified(r.outcome.into_verified(client_id, number, r.stats))
            }
            Err(e) => engine_error(e, client_id),
        };
        ctx.send(send, &msg).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_authentications_are_logged_at_most_once_a_second() {
        let mut f = AuthFailures {
            last_logged: None,
            unlogged: 0,
        };
        let from: SocketAddr = "192.0.2.1:5000".parse().unwrap();
        f.record(from);
        let first = f.last_logged.expect("the first is logged");
        f.record(from);
        f.record(from);
        assert_eq!((f.last_logged, f.unlogged), (Some(first), 2));
        // A second later the next one is logged, with the count of those that were not.
        f.last_logged = Some(first - AuthFailures::EVERY);
        f.record(from);
        assert_eq!(f.unlogged, 0);
        assert!(f.last_logged.unwrap() > first);
    }

    #[test]
    fn api_key_files_hold_digests_or_plain_keys_and_both_admit_the_key() {
        let digest = engine::key_id(Some("k-123")).unwrap();
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        let (keys, plain) =
            parse_api_keys(&format!("# operators\nsha256:{hex}\n\nplain-key\n")).unwrap();
        assert_eq!(plain, 1);
        assert!(keys.contains(&digest));
        assert!(keys.contains(&engine::key_id(Some("plain-key")).unwrap()));
        assert!(!keys.contains(&engine::key_id(Some("k-124")).unwrap()));
        assert_eq!(
            parse_api_keys("sha256:abc"),
            Err(ApiKeysError::BadDigest(1))
        );
        assert_eq!(parse_api_keys("# nothing\n"), Err(ApiKeysError::Empty));
    }
}
