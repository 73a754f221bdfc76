//! Speculative generation against a verifier: draft a tree, send it, keep what comes back, and
//! survive a lost connection without losing text (resume the session, or re-open it with the
//! tokens committed so far).

use std::time::{Duration, Instant};

use specinfer_model::ModelError;
use specinfer_wire::{ErrorCode, ErrorFrame, FinishReason, SamplingParams, TokenTree, VerifyMode};

use crate::remote::{Remote, RemoteConfig, RemoteError, RemoteSession};
use crate::{AdaptiveLookup, ContextLookup, DraftModel, DraftedPart, Speculator};

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("draft model: {0}")]
    Draft(ModelError),
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
    pub rounds: usize,
    /// Tokens emitted by each round (tau per round).
    pub accepted_per_round: Vec<usize>,
    pub finish: Option<FinishReason>,
    pub wall: Duration,
    /// Time from the request to the first round's answer.
    pub ttft: Duration,
    pub bytes_up: usize,
    pub bytes_down: usize,
    /// Verifier-side forward time summed over rounds.
    pub verifier_forward: Duration,
    pub reconnects: usize,
    /// Rounds whose tree was drafted ahead, while the previous round was being verified.
    pub pipelined_rounds: usize,
    /// Accepted tokens that only the context lookup's chain proposed.
    pub lookup_accepted: usize,
}

/// How each round's tree is made.
pub enum Drafting<'a> {
    /// Root-only trees: plain incremental decoding through the same path (the baseline).
    None,
    /// Trees drafted by one model, or by several and merged.
    Tree {
        speculator: &'a mut Speculator,
        drafts: Vec<&'a mut (dyn DraftModel + Send)>,
    },
}

/// A verifier connection that reconnects on demand.
pub struct Client {
    cfg: RemoteConfig,
    remote: Option<Remote>,
    next_session: u64,
    added_rtt: Duration,
    pipelining: bool,
    lookup: Option<ContextLookup>,
}

impl Client {
    pub async fn connect(cfg: RemoteConfig) -> Result<Client, ClientError> {
        let remote = Remote::connect(&cfg).await?;
        Ok(Client {
            cfg,
            remote: Some(remote),
            next_session: 1,
            added_rtt: Duration::ZERO,
            pipelining: false,
            lookup: None,
        })
    }

    /// While a tree is being verified, draft the next one from its most likely outcome (see
    /// [`Speculator::draft_ahead`]); used when the guess was right, dropped when not. Pays when
    /// the round trip is long next to drafting and the edge has a core to spare; with a single
    /// draft model only.
    pub fn set_pipelining(&mut self, on: bool) {
        self.pipelining = on;
    }

    /// Adds the context lookup's chain (see [`ContextLookup`]) to every round's tree, whatever
    /// drafts it (root-only trees included: then the lookup is the only draft), cut to the
    /// length that measured acceptance and costs make pay ([`AdaptiveLookup`]); `max_tokens`
    /// is the longest chain.
    pub fn set_context_lookup(&mut self, lookup: Option<ContextLookup>) {
        self.lookup = lookup;
    }

    /// Adds `rtt` of waiting to every round, on top of the verifier's forward: an in-process
    /// stand-in for a slower network, so the edge/cloud trade-off can be measured on one machine
    /// (benchmarks only).
    pub fn emulate_round_trip(&mut self, rtt: Duration) {
        self.added_rtt = rtt;
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

    /// Generates after `prompt` (token ids), calling `on_tokens` with each round's new tokens.
    pub async fn generate(
        &mut self,
        prompt: &[u32],
        params: SamplingParams,
        mut drafting: Drafting<'_>,
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, ClientError> {
        let start = Instant::now();
        let id = self.next_session;
        self.next_session += 1;
        let mut g = Generation::default();
        let mut committed = prompt.to_vec();
        let mut session = self
            .remote()
            .await?
            .open(id, committed.clone(), params.clone())
            .await?;
        // A tree drafted ahead, and the committed tokens it assumed.
        let mut ahead: Option<(Vec<u32>, TokenTree)> = None;
        let mut lookup = self.lookup.map(AdaptiveLookup::new);
        loop {
            let mut drafted = Instant::now();
            let tree = match (ahead.take(), &mut drafting) {
                (Some((guess, tree)), _) if guess == committed => {
                    g.pipelined_rounds += 1;
                    tree
                }
                (_, Drafting::None) => TokenTree::root(*committed.last().expect("never empty")),
                (_, Drafting::Tree { speculator, .. }) if !speculator.drafts_next() => {
                    TokenTree::root(*committed.last().expect("never empty"))
                }
                (_, Drafting::Tree { speculator, drafts }) if drafts.len() == 1 => {
                    // Catching the draft up on the committed tokens (the whole prompt, in the
                    // first round) is not part of the per-level cost the adaptive depth weighs.
                    drafts[0].sync(&committed)?;
                    drafted = Instant::now();
                    speculator.draft(&mut *drafts[0], &committed)?
                }
                (_, Drafting::Tree { speculator, drafts }) => {
                    speculator.draft_merged(drafts, &committed)?
                }
            };
            // The draft model's part of the tree (its nodes come first in the sent tree) is what
            // the adaptive depth learns from; the lookup's nodes only add to the verify cost.
            let drafted_part = DraftedPart::of(&tree);
            let tree = match &mut lookup {
                Some(lookup) => lookup.extend(
                    tree,
                    &committed,
                    session.limits().max_tree_nodes as usize,
                    params.mode == VerifyMode::Stochastic,
                ),
                None => tree,
            };
            let draft_s = drafted.elapsed().as_secs_f64();
            let tree_nodes = tree.len();
            let sent = Instant::now();
            let in_flight = self.pipelining.then(|| tree.clone());
            let verdict = match session.send_tree(tree).await {
                Ok(()) => {
                    if let (Some(t), Drafting::Tree { speculator, drafts }) =
                        (&in_flight, &mut drafting)
                    {
                        if drafts.len() == 1 && speculator.drafts_next() {
                            // A failed guess (say, the context is full) only loses the head start.
                            ahead = speculator.draft_ahead(&mut *drafts[0], &committed, t).ok();
                        }
                    }
                    let verdict = session.verdict().await;
                    if let Ok(v) = &verdict {
                        // The answer would arrive a round trip after the request plus the
                        // verifier's work (drafting ahead overlaps both, as over a network).
                        let served = Duration::from_micros(v.stats.forward_us as u64);
                        tokio::time::sleep_until((sent + self.added_rtt + served).into()).await;
                    }
                    verdict
                }
                Err(e) => Err(e),
            };
            match verdict {
                Ok(v) => {
                    let round_s = sent.elapsed().as_secs_f64();
                    let forward_s = v.stats.forward_us as f64 * 1e-6;
                    let observed = drafted_part.observation(
                        tree_nodes,
                        &v.accepted_nodes,
                        draft_s,
                        round_s,
                        forward_s,
                    );
                    g.lookup_accepted += v.accepted_nodes.len() - observed.accepted;
                    tracing::debug!(
                        model_depth = observed.tree_depth,
                        tree_nodes,
                        model_accepted = observed.accepted,
                        accepted = v.accepted_nodes.len(),
                        draft_ms = draft_s * 1e3,
                        round_ms = round_s * 1e3,
                        forward_ms = forward_s * 1e3,
                        "round"
                    );
                    if let Some(lookup) = &mut lookup {
                        lookup.observe(&v.tokens, tree_nodes, round_s, forward_s);
                    }
                    if let Drafting::Tree { speculator, .. } = &mut drafting {
                        speculator.observe(observed);
                    }
                    if g.rounds == 0 {
                        g.ttft = start.elapsed();
                    }
                    g.rounds += 1;
                    g.accepted_per_round.push(v.tokens.len());
                    g.verifier_forward += Duration::from_micros(v.stats.forward_us as u64);
                    committed.extend(&v.tokens);
                    g.token_ids.extend(&v.tokens);
                    on_tokens(&v.tokens);
                    if v.finish.is_some() {
                        g.finish = v.finish;
                        break;
                    }
                }
                Err(e) if e.is_connection_loss() && g.reconnects < 3 => {
                    tracing::warn!("lost the verifier ({e}); reconnecting");
                    g.reconnects += 1;
                    g.bytes_up += session.bytes_up;
                    g.bytes_down += session.bytes_down;
                    self.remote = None;
                    let token = session.resume_token();
                    session = self
                        .recover(
                            id,
                            token,
                            &mut committed,
                            &mut g,
                            prompt.len(),
                            &params,
                            &mut on_tokens,
                        )
                        .await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        g.bytes_up += session.bytes_up;
        g.bytes_down += session.bytes_down;
        let _ = session.close().await;
        g.wall = start.elapsed();
        Ok(g)
    }

    /// After a lost connection: resume the session if the verifier still holds it (taking any
    /// tokens of a round whose answer was lost), else open a new one with everything committed.
    #[allow(clippy::too_many_arguments)]
    async fn recover(
        &mut self,
        id: u64,
        resume_token: [u8; 16],
        committed: &mut Vec<u32>,
        g: &mut Generation,
        prompt_len: usize,
        params: &SamplingParams,
        on_tokens: &mut impl FnMut(&[u32]),
    ) -> Result<RemoteSession, ClientError> {
        let remote = self.remote().await?;
        match remote.resume(id, resume_token).await {
            Ok((s, server)) if server.starts_with(committed) => {
                let missed = &server[committed.len()..];
                if !missed.is_empty() {
                    g.token_ids.extend(missed);
                    on_tokens(missed);
                    committed.extend_from_slice(missed);
                }
                Ok(s)
            }
            // Gone (grace period over, or the verifier restarted): re-open with all we have. A
            // sampled session then continues with a fresh RNG stream (still exact sampling).
            Ok(_)
            | Err(RemoteError::Refused(ErrorFrame {
                code: ErrorCode::UnknownSession,
                ..
            })) => {
                let left = params
                    .max_new_tokens
                    .saturating_sub((committed.len() - prompt_len) as u32)
                    .max(1);
                let params = SamplingParams {
                    max_new_tokens: left,
                    ..params.clone()
                };
                Ok(remote.open(id, committed.clone(), params).await?)
            }
            Err(e) => Err(e.into()),
        }
    }
}
