//! Speculative generation against a verifier: draft a tree, send it, keep what comes back, and
//! survive a lost connection without losing text (resume the session, or re-open it with the
//! tokens committed so far).

use std::time::{Duration, Instant};

use specinfer_model::ModelError;
use specinfer_speculator::{GenerationStats, Recovery, RoundDriver, RoundError, RoundOutput};
use specinfer_wire::{ErrorCode, ErrorFrame, FinishReason, Verified};

use specinfer_net::{Remote, RemoteConfig, RemoteError, RemoteSession};

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
    pub reconnects: usize,
}

/// A verifier connection that reconnects on demand.
pub struct Client {
    cfg: RemoteConfig,
    remote: Option<Remote>,
    next_session: u64,
    round_trip: EmulatedRoundTrip,
}

impl Client {
    pub async fn connect(cfg: RemoteConfig) -> Result<Client, ClientError> {
        let remote = Remote::connect(&cfg).await?;
        Ok(Client {
            cfg,
            remote: Some(remote),
            next_session: 1,
            round_trip: EmulatedRoundTrip::default(),
        })
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

    async fn remote(&mut self) -> Result<&Remote, ClientError> {
        if self.remote.is_none() {
            self.remote = Some(Remote::connect(&self.cfg).await?);
        }
        Ok(self.remote.as_ref().expect("just connected"))
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
        while !driver.is_finished() {
            let tree = driver.draft(&clock)?;
            let sent = Instant::now();
            let verdict = match session.send_tree(tree).await {
                Ok(()) => {
                    driver.draft_ahead();
                    let verdict = session.verdict().await;
                    if let Ok(v) = &verdict {
                        self.round_trip.deliver(sent, v).await;
                    }
                    verdict
                }
                Err(e) => Err(e),
            };
            match verdict {
                Ok(v) => {
                    let out = driver.on_verified(&v, clock())?;
                    if driver.stats().rounds == 1 {
                        g.ttft = start.elapsed();
                    }
                    on_round(&out);
                }
                Err(e) if e.is_connection_loss() && g.reconnects < 3 => {
                    tracing::warn!("lost the verifier ({e}); reconnecting");
                    g.reconnects += 1;
                    g.bytes_up += session.bytes_up;
                    g.bytes_down += session.bytes_down;
                    driver.connection_lost();
                    self.remote = None;
                    let token = session.resume_token();
                    session = self.recover(id, token, driver, &mut on_round).await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
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

    /// Opens `driver`'s session (at the start, or again with everything committed).
    async fn open(
        &mut self,
        id: u64,
        driver: &mut RoundDriver<'_>,
    ) -> Result<RemoteSession, ClientError> {
        let (prompt, params) = driver.open_request();
        let session = self.remote().await?.open(id, prompt, params).await?;
        driver.set_limits(session.limits());
        Ok(session)
    }

    /// After a lost connection: resume the session if the verifier still holds it (taking any
    /// tokens of a round whose answer was lost), else open a new one with everything committed.
    async fn recover(
        &mut self,
        id: u64,
        resume_token: [u8; 16],
        driver: &mut RoundDriver<'_>,
        on_round: &mut impl FnMut(&RoundOutput),
    ) -> Result<RemoteSession, ClientError> {
        match self.remote().await?.resume(id, resume_token).await {
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
            // Gone (grace period over, or the verifier restarted).
            Err(RemoteError::Refused(ErrorFrame {
                code: ErrorCode::UnknownSession,
                ..
            })) => self.open(id, driver).await,
            Err(e) => Err(e.into()),
        }
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
