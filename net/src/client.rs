//! The QUIC client side of the protocol: hello, then one stream per session.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::{client_config, read_frame, write_frame, NetError, Trust};
use specinfer_wire::{
    ClientHello, ErrorCode, ErrorFrame, Limits, Message, ModelFingerprint, OpenSession,
    SamplingParams, ServerDrafting, ServerHello, TokenTree, Verified, VerifierCosts, Verify,
    PROTOCOL_VERSION,
};

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("verifier refused ({:?}): {}", .0.code, .0.message)]
    Refused(ErrorFrame),
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The verifier is draining and closed the session instead of running its round
    /// ([`Message::Move`]): re-open it on another verifier with the committed tokens.
    #[error("the verifier is draining and moved the session")]
    Moved,
}

impl RemoteError {
    /// Whether reconnecting could help (the connection broke), as opposed to a refusal.
    pub fn is_connection_loss(&self) -> bool {
        matches!(self, RemoteError::Net(_))
    }

    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            RemoteError::Refused(e) => Some(e.code),
            _ => None,
        }
    }
}

/// Where and how to reach a verifier.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub addr: SocketAddr,
    /// Name the certificate must carry (ignored when pinning).
    pub server_name: String,
    pub trust: Trust,
    pub api_key: Option<String>,
    pub expected_model: ModelFingerprint,
    /// A connection that hears nothing for this long is dead (keep-alives go out at a third of
    /// it): the client then reconnects and resumes instead of hanging on a lost verifier.
    pub idle_timeout: Duration,
}

impl RemoteConfig {
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
}

/// A connection to a verifier that has accepted our hello.
pub struct Remote {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    pub server: ServerHello,
    limits: Limits,
}

impl Remote {
    pub async fn connect(cfg: &RemoteConfig) -> Result<Remote, RemoteError> {
        let bind: SocketAddr = if cfg.addr.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        }
        .parse()
        .expect("literal");
        let mut endpoint = quinn::Endpoint::client(bind).map_err(NetError::from)?;
        let mut client = client_config(&cfg.trust)?;
        let mut transport = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(cfg.idle_timeout)
            .map_err(|_| RemoteError::Protocol("idle timeout out of range".into()))?;
        transport.max_idle_timeout(Some(idle));
        transport.keep_alive_interval(Some(cfg.idle_timeout / 3));
        client.transport_config(Arc::new(transport));
        endpoint.set_default_client_config(client);
        let conn = endpoint
            .connect(cfg.addr, &cfg.server_name)
            .map_err(NetError::from)?
            .await
            .map_err(NetError::from)?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(NetError::from)?;
        let hello = Message::ClientHello(ClientHello {
            protocol_version: PROTOCOL_VERSION,
            expected_model: cfg.expected_model.clone(),
            api_key: cfg.api_key.clone(),
        });
        write_frame(&mut send, &hello).await?;
        // Until the server tells us its limits, accept what any server may send.
        let limits = Limits::default();
        match read_frame(&mut recv, &limits).await? {
            Some((Message::ServerHello(server), _)) => Ok(Remote {
                limits: server.limits,
                endpoint,
                conn,
                server,
            }),
            Some((Message::Error(e), _)) => Err(RemoteError::Refused(e)),
            Some((other, _)) => Err(RemoteError::Protocol(format!(
                "expected ServerHello, got {other:?}"
            ))),
            None => Err(RemoteError::Protocol(
                "verifier closed the hello stream".into(),
            )),
        }
    }

    /// The verifier's address.
    pub fn addr(&self) -> SocketAddr {
        self.conn.remote_address()
    }

    /// Closes the connection and waits (briefly) until the verifier has been told.
    pub async fn shutdown(self) {
        self.conn.close(0u32.into(), b"client done");
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), self.endpoint.wait_idle())
            .await;
    }

    /// A session on a new stream, before its first message.
    async fn session_stream(
        &self,
        session: u64,
        resume_token: [u8; 16],
    ) -> Result<RemoteSession, RemoteError> {
        let (send, recv) = self.conn.open_bi().await.map_err(NetError::from)?;
        Ok(RemoteSession {
            send,
            recv,
            session,
            round: 0,
            resume_token,
            limits: self.limits,
            costs: VerifierCosts::default(),
            rtt: self.conn.rtt(),
            bytes_up: 0,
            bytes_down: 0,
        })
    }

    /// Opens a session; `prompt`'s last token roots the first tree.
    pub async fn open(
        &self,
        session: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RemoteSession, RemoteError> {
        let mut s = self.session_stream(session, [0; 16]).await?;
        match s
            .call(Message::OpenSession(OpenSession {
                session,
                prompt,
                params,
            }))
            .await?
        {
            Message::SessionOpened(o) if o.session == session => {
                s.resume_token = o.resume_token;
                s.costs = o.costs;
                s.rtt = self.conn.rtt();
                Ok(s)
            }
            other => Err(unexpected("SessionOpened", other)),
        }
    }

    /// Re-attaches a session that lost its connection; returns it and its committed tokens.
    pub async fn resume(
        &self,
        session: u64,
        resume_token: [u8; 16],
    ) -> Result<(RemoteSession, Vec<u32>), RemoteError> {
        let mut s = self.session_stream(session, resume_token).await?;
        match s
            .call(Message::Resume {
                session,
                resume_token,
            })
            .await?
        {
            Message::Resumed {
                session: id,
                committed,
            } if id == session => Ok((s, committed)),
            other => Err(unexpected("Resumed", other)),
        }
    }
}

fn unexpected(wanted: &str, got: Message) -> RemoteError {
    match got {
        Message::Error(e) => RemoteError::Refused(e),
        other => RemoteError::Protocol(format!("expected {wanted}, got {other:?}")),
    }
}

/// One session on its own stream.
pub struct RemoteSession {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    session: u64,
    round: u32,
    resume_token: [u8; 16],
    limits: Limits,
    /// What a token costs on the verifier, as it said when the session opened.
    costs: VerifierCosts,
    /// The connection's smoothed round trip when the session opened.
    rtt: Duration,
    pub bytes_up: usize,
    pub bytes_down: usize,
}

impl RemoteSession {
    async fn call(&mut self, msg: Message) -> Result<Message, RemoteError> {
        self.bytes_up += write_frame(&mut self.send, &msg).await?;
        self.receive().await
    }

    async fn receive(&mut self) -> Result<Message, RemoteError> {
        match read_frame(&mut self.recv, &self.limits).await? {
            Some((reply, n)) => {
                self.bytes_down += n;
                Ok(reply)
            }
            None => Err(RemoteError::Protocol(
                "verifier closed the session stream".into(),
            )),
        }
    }

    pub fn resume_token(&self) -> [u8; 16] {
        self.resume_token
    }

    /// The verifier's limits (from its hello): what a tree sent on this session may hold.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// What a token costs on the verifier (from its answer to the open, or to a re-open).
    pub fn costs(&self) -> &VerifierCosts {
        &self.costs
    }

    /// The connection's smoothed round trip as the session opened (QUIC's own estimate).
    pub fn rtt(&self) -> Duration {
        self.rtt
    }

    /// Sends one tree and waits for the verdict.
    pub async fn verify(&mut self, tree: TokenTree) -> Result<Verified, RemoteError> {
        self.send_tree(tree).await?;
        self.verdict().await
    }

    /// Sends one tree without waiting, so the caller can work while it is verified; the
    /// answer comes from [`RemoteSession::verdict`].
    pub async fn send_tree(&mut self, tree: TokenTree) -> Result<(), RemoteError> {
        let msg = Message::Verify(Verify {
            session: self.session,
            round: self.round,
            tree,
        });
        self.bytes_up += write_frame(&mut self.send, &msg).await?;
        Ok(())
    }

    /// Asks the verifier to decode the session to its end on its own (server-only generation);
    /// each of its rounds then comes from [`RemoteSession::verdict`], until one finishes.
    pub async fn generate(&mut self, drafting: ServerDrafting) -> Result<(), RemoteError> {
        let msg = Message::Generate {
            session: self.session,
            drafting,
        };
        self.bytes_up += write_frame(&mut self.send, &msg).await?;
        Ok(())
    }

    /// Waits for the verdict on the tree last sent.
    pub async fn verdict(&mut self) -> Result<Verified, RemoteError> {
        let round = self.round;
        match self.receive().await? {
            Message::Verified(v) if v.session == self.session && v.round == round => {
                self.round += 1;
                Ok(v)
            }
            Message::Move { session } if session == self.session => Err(RemoteError::Moved),
            other => Err(unexpected("Verified", other)),
        }
    }

    /// Ends the session and waits for the verifier's acknowledgement: its memory is freed at
    /// once, and a process that exits right after leaves nothing waiting out a grace period.
    pub async fn close(mut self) -> Result<(), RemoteError> {
        let session = self.session;
        let reply = self.call(Message::Close { session }).await?;
        let _ = self.send.finish();
        match reply {
            Message::Close { session: s } if s == session => Ok(()),
            other => Err(unexpected("Close", other)),
        }
    }
}
