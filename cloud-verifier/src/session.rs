//! A verifier session, sans-I/O: the committed tokens, their KV cache, the sampling parameters and
//! the session's own RNG. The QUIC service and the in-process (embedded) verifier both drive it,
//! on any [`TreeModel`] (the CPU engine by default, a GPU's with the `cuda` feature).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{argmax, distribution, penalise_repeats};
use specinfer_model::{Llama, ModelError, SampleWalk, TreeModel, Want};
use specinfer_wire::{
    FeatureRows, FinishReason, Limits, RoundStats, SamplingParams, TokenTree, TreeError, Verified,
    VerifyMode, PROMPT_FEATURE_ROWS,
};

use crate::verify::{verify_greedy, verify_naive_sampling, verify_stochastic, Verdict};

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(
        "the tree's root is token {got}, but the session's last committed token is {expected}"
    )]
    WrongRoot { got: u32, expected: u32 },
    #[error("invalid tree: {0}")]
    Tree(TreeError),
    #[error("stochastic verification needs the draft's proposal distributions in the tree")]
    MissingProposals,
    #[error("the session has finished ({0:?})")]
    Finished(FinishReason),
    #[error("model: {0}")]
    Model(ModelError),
    #[error("the prompt is still being prefilled")]
    Prefilling,
    #[error("this verifier's engine does not give the LLM's features (the CPU engine does; the GPU engine does not yet): open the session without return_features")]
    FeaturesUnsupported,
}

impl From<TreeError> for SessionError {
    fn from(e: TreeError) -> Self {
        SessionError::Tree(e)
    }
}

impl From<ModelError> for SessionError {
    fn from(e: ModelError) -> Self {
        SessionError::Model(e)
    }
}

/// What one verification round produced.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundOutcome {
    /// Accepted tree nodes (without the root), root-to-leaf.
    pub accepted_nodes: Vec<u32>,
    /// Tokens appended to the sequence this round: the accepted drafts and the LLM's own token,
    /// cut at a stop token or the length limit.
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub accepted_at_depth: Vec<u32>,
    pub rejected_at_depth: Vec<u32>,
    /// The features gathered since the last verdict, when the session asked for them.
    pub features: Option<FeatureRows>,
}

impl RoundOutcome {
    /// The wire's answer to round `round` of `session` (accepted nodes cut where a stop cut the
    /// tokens).
    pub fn into_verified(self, session: u64, round: u32, stats: RoundStats) -> Verified {
        let accepted = self.accepted_nodes.len().min(self.tokens.len());
        let mut accepted_nodes = self.accepted_nodes;
        accepted_nodes.truncate(accepted);
        Verified {
            session,
            round,
            accepted_nodes,
            tokens: self.tokens,
            finish: self.finish,
            stats,
            features: self.features,
        }
    }
}

pub struct Session<M: TreeModel = Llama> {
    params: SamplingParams,
    cache: M::Cache,
    /// Prompt and everything generated; the last token is the next tree's root and has no K/V yet.
    tokens: Vec<u32>,
    prompt_len: usize,
    finish: Option<FinishReason>,
    /// When the session asked for features: those not yet sent, and the last ones sent.
    features: Option<SessionFeatures>,
}

/// The LLM's features a session gathers: the rows not yet sent (from `unsent` on), and before
/// them at least the last [`PROMPT_FEATURE_ROWS`] sent, which a later session reusing this
/// one's K/V as its prompt's prefix sends in place of prefilling.
struct SessionFeatures {
    held: PrefixFeatures,
    unsent: usize,
    /// Gathered for the prefix cache, no longer sent (the verifier decodes the rest itself).
    muted: bool,
}

impl SessionFeatures {
    /// Starting at position `reused` (the first to prefill), after `cached`'s rows of the
    /// positions before it, if any.
    fn new(dim: usize, reused: usize, cached: Option<PrefixFeatures>) -> Self {
        let held = cached
            .filter(|c| c.dim == dim)
            .map(|mut c| {
                c.truncate(reused);
                c
            })
            .filter(|c| c.end() == reused)
            .unwrap_or_else(|| PrefixFeatures::empty(dim, reused));
        let mut f = SessionFeatures {
            unsent: held.first,
            held,
            muted: false,
        };
        f.keep_last(PROMPT_FEATURE_ROWS);
        f
    }

    /// Appends the features of `nodes` of a forward's output, the positions that follow the
    /// ones held.
    fn push(&mut self, logits: &specinfer_model::Logits, nodes: impl Iterator<Item = usize>) {
        for n in nodes {
            if let Some(f) = logits.feature(n) {
                self.held.rows.extend_from_slice(f);
            }
        }
    }

    /// Keeps only the last `rows` positions (a long prompt's features beyond what a drafter
    /// reads are never sent).
    fn keep_last(&mut self, rows: usize) {
        self.held.keep_last(rows);
        self.unsent = self.unsent.max(self.held.first);
    }

    /// The rows not yet sent, as the wire carries them; none once muted.
    fn take(&mut self) -> Option<FeatureRows> {
        let h = &self.held;
        let rows = (!self.muted).then(|| {
            let from = (self.unsent - h.first) * h.dim;
            FeatureRows::quantize(self.unsent as u32, h.dim, &h.rows[from..])
        });
        self.unsent = h.end();
        // Trimmed once twice the kept rows are held, not every round: each trim moves them all.
        if h.rows.len() >= 2 * PROMPT_FEATURE_ROWS * h.dim {
            self.keep_last(PROMPT_FEATURE_ROWS);
        }
        rows
    }
}

/// The LLM's features of consecutive positions `first..` (f32, `dim` wide): what a session
/// holds, and what a prefix-cache entry keeps beside its K/V.
pub struct PrefixFeatures {
    first: usize,
    dim: usize,
    rows: Vec<f32>,
}

impl PrefixFeatures {
    fn empty(dim: usize, first: usize) -> Self {
        PrefixFeatures {
            first,
            dim,
            rows: Vec::new(),
        }
    }

    fn end(&self) -> usize {
        self.first + self.rows.len() / self.dim.max(1)
    }

    /// How many floats hold the positions before `len`.
    fn floats_before(&self, len: usize) -> usize {
        (len.clamp(self.first, self.end()) - self.first) * self.dim
    }

    /// Drops the positions from `len` on.
    fn truncate(&mut self, len: usize) {
        self.rows.truncate(self.floats_before(len));
    }

    /// Keeps only the last `rows` positions.
    fn keep_last(&mut self, rows: usize) {
        let held = self.rows.len() / self.dim.max(1);
        if held > rows {
            self.rows.drain(..(held - rows) * self.dim);
            self.first += held - rows;
        }
    }

    /// Those of the positions before `len`.
    pub fn before(&self, len: usize) -> PrefixFeatures {
        PrefixFeatures {
            first: self.first,
            dim: self.dim,
            rows: self.rows[..self.floats_before(len)].to_vec(),
        }
    }

    /// Whether a session over a prompt of `prompt_len` tokens finds here every feature it
    /// sends that it does not prefill: those of the prompt's last [`PROMPT_FEATURE_ROWS`]
    /// positions before its first round's root, as a session that prefilled it all sends.
    pub fn serve(&self, prompt_len: usize) -> bool {
        self.first <= prompt_len.saturating_sub(1 + PROMPT_FEATURE_ROWS)
    }

    pub fn bytes(&self) -> usize {
        self.rows.len() * std::mem::size_of::<f32>()
    }
}

impl<M: TreeModel> Session<M> {
    /// A session whose prompt (all but its last token, the first round's root) is still to be
    /// prefilled, in chunks, by [`run_batch`] with [`Work::Prefill`]: a long prompt then shares
    /// forward passes with other sessions' rounds instead of stalling them.
    pub fn new(
        model: &M,
        prompt: &[u32],
        params: SamplingParams,
        limits: &Limits,
    ) -> Result<Self, SessionError> {
        Self::with_cache(model, prompt, params, limits, model.new_cache()?, 0, None)
    }

    /// [`Session::new`] over a cache whose first `reused` committed positions hold the K/V of
    /// `prompt`'s first `reused` tokens (a prefix reused from an earlier session, which may
    /// hold more after them): the cache is cut to those (at most all but the prompt's last
    /// token), and only the rest of the prompt is prefilled. A session that asks for features
    /// sends `features` (those the prefix's entry kept) for the reused positions; without
    /// them, none.
    pub fn with_cache(
        model: &M,
        prompt: &[u32],
        params: SamplingParams,
        limits: &Limits,
        mut cache: M::Cache,
        reused: usize,
        features: Option<PrefixFeatures>,
    ) -> Result<Self, SessionError> {
        TokenTree::chain(prompt).validate(
            model.config().vocab_size as u32,
            &Limits {
                max_tree_nodes: limits.max_prompt_tokens,
                ..*limits
            },
        )?;
        if params.return_features && !model.gives_features() {
            return Err(SessionError::FeaturesUnsupported);
        }
        let reused = reused
            .min(M::committed(&cache))
            .min(prompt.len().saturating_sub(1));
        model.truncate(&mut cache, reused);
        let features = params
            .return_features
            .then(|| SessionFeatures::new(model.config().d_model, reused, features));
        Ok(Session {
            params,
            cache,
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            finish: None,
            features,
        })
    }

    /// A session with its whole prompt prefilled at once (for use outside the batching engine).
    pub fn open(
        model: &M,
        prompt: &[u32],
        params: SamplingParams,
        limits: &Limits,
    ) -> Result<Self, SessionError> {
        let mut s = Self::new(model, prompt, params, limits)?;
        let n = s.prefill_pending();
        if n > 0 {
            run_batch(
                model,
                limits,
                &mut [(&mut s, Work::Prefill { max_tokens: n })],
            )
            .remove(0)?;
        }
        Ok(s)
    }

    /// Prompt tokens not yet in the KV cache.
    pub fn prefill_pending(&self) -> usize {
        self.tokens.len() - 1 - M::committed(&self.cache)
    }

    /// The token the next tree must have as its root.
    pub fn root(&self) -> u32 {
        *self.tokens.last().expect("a session always has a token")
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Stops sending the LLM's features with verdicts: once the verifier decodes the session
    /// on its own (`Generate`, after which no tree comes), no drafter reads them, and each would
    /// cost a row (580 bytes for SmolLM2) per token downstream. Pending rows are never sent.
    /// They are still gathered, so that the session's prefix-cache entry serves a later
    /// feature session (the conversation's next turn).
    pub fn stop_sending_features(&mut self) {
        if let Some(f) = &mut self.features {
            f.muted = true;
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Gives up the session's cache with the tokens whose K/V it holds, and the features it
    /// holds of them when it gathered features, for reuse by a later session that starts with
    /// them.
    pub fn into_prefix(self) -> (Vec<u32>, M::Cache, Option<PrefixFeatures>) {
        let mut tokens = self.tokens;
        tokens.truncate(M::committed(&self.cache));
        let features = self.features.map(|f| {
            let mut held = f.held;
            held.truncate(tokens.len());
            held.keep_last(PROMPT_FEATURE_ROWS);
            held
        });
        (tokens, self.cache, features)
    }

    pub fn kv_bytes(&self) -> usize {
        M::cache_bytes(&self.cache)
    }

    fn check(&self, model: &M, tree: &TokenTree, limits: &Limits) -> Result<(), SessionError> {
        if let Some(f) = self.finish {
            return Err(SessionError::Finished(f));
        }
        if self.prefill_pending() > 0 {
            return Err(SessionError::Prefilling);
        }
        tree.validate(model.config().vocab_size as u32, limits)?;
        // Checked here, per session, so one sequence at the end of its context never fails the
        // batched forward of the others.
        let needed =
            M::committed(&self.cache) + tree.depths().into_iter().max().unwrap_or(0) as usize + 1;
        if needed > model.config().max_positions {
            return Err(SessionError::Model(ModelError::ContextFull {
                needed,
                limit: model.config().max_positions,
            }));
        }
        if tree.token(0) != self.root() {
            return Err(SessionError::WrongRoot {
                got: tree.token(0),
                expected: self.root(),
            });
        }
        if self.params.mode == VerifyMode::Stochastic
            && tree.len() > 1
            && tree.proposals().is_none()
        {
            return Err(SessionError::MissingProposals);
        }
        Ok(())
    }

    /// Applies a verdict: commits the accepted path's K/V, appends the tokens, applies stop and
    /// length limits.
    fn commit(
        &mut self,
        model: &M,
        tree: &TokenTree,
        logits: &specinfer_model::Logits,
        verdict: Verdict,
    ) -> Result<RoundOutcome, SessionError> {
        let mut tokens = verdict.tokens(tree);
        let mut finish = None;
        if let Some(i) = tokens.iter().position(|t| self.params.stop_ids.contains(t)) {
            tokens.truncate(i + 1);
            finish = Some(FinishReason::Stop);
        }
        let room = self.params.max_new_tokens as usize - self.generated().len();
        if tokens.len() >= room {
            tokens.truncate(room);
            finish = finish.or(Some(FinishReason::Length));
        }
        let mut path = vec![0u32];
        path.extend(&verdict.accepted);
        model.keep_path(&mut self.cache, &path)?;
        self.tokens.extend(&tokens);
        self.finish = finish;
        let features = self.features.as_mut().and_then(|f| {
            f.push(logits, path.iter().map(|&n| n as usize));
            f.take()
        });
        Ok(RoundOutcome {
            accepted_nodes: verdict.accepted,
            tokens,
            finish,
            accepted_at_depth: verdict.accepted_at_depth,
            rejected_at_depth: verdict.rejected_at_depth,
            features,
        })
    }

    fn decide(&mut self, tree: &TokenTree, logits: &specinfer_model::Logits) -> Verdict {
        let p = &self.params;
        // Each round's uniforms come from the seed and the committed length, not from a stream
        // the session carries: rounds start at distinct lengths, so their streams are
        // independent, and a session re-opened elsewhere with its committed tokens (failover)
        // draws exactly what the first verifier would have, never reusing a uniform.
        let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
        rng.set_stream(self.tokens.len() as u64);
        // Node n's row, with the repetition penalty over its context's latest tokens (the
        // committed ones, then its path in the tree) where the session asked for one.
        let row = |n: usize| -> std::borrow::Cow<'_, [f32]> {
            if !p.penalises_repeats() {
                return std::borrow::Cow::Borrowed(logits.node(n));
            }
            let path = tree.path_to(n);
            let last_n = p.repeat_last_n as usize;
            let committed = &self.tokens[self.tokens.len().saturating_sub(last_n)..];
            let mut recent: Vec<u32> = committed.to_vec();
            recent.extend(path[1..].iter().map(|&i| tree.token(i as usize)));
            let recent = &recent[recent.len().saturating_sub(last_n)..];
            let mut l = logits.node(n).to_vec();
            penalise_repeats(&mut l, recent, p.repeat_penalty);
            std::borrow::Cow::Owned(l)
        };
        let dist = |n: usize| distribution(&row(n), p.temperature, p.top_k as usize, p.top_p);
        match p.mode {
            VerifyMode::Greedy if p.penalises_repeats() => {
                verify_greedy(tree, |n| argmax(&row(n)) as u32)
            }
            VerifyMode::Greedy => verify_greedy(tree, |n| logits.argmax(n)),
            VerifyMode::Stochastic => match self.walk_on_device(tree, logits, &rng) {
                Some(verdict) => verdict,
                None => verify_stochastic(tree, dist, &mut rng),
            },
            VerifyMode::Naive => verify_naive_sampling(tree, dist, &mut rng),
        }
    }

    /// The stochastic verdict from the device that holds the logits (the GPU engine), with the
    /// uniforms `rng` would give the host's walk, in its order; `None` where the rows are on the
    /// host, the device cannot walk them, or top-k or a repetition penalty applies (the device's
    /// distribution is temperature and top-p only): the host then walks.
    fn walk_on_device(
        &self,
        tree: &TokenTree,
        logits: &specinfer_model::Logits,
        rng: &ChaCha8Rng,
    ) -> Option<Verdict> {
        let p = &self.params;
        if p.top_k > 0 || p.penalises_repeats() || !logits.is_on_device() {
            return None;
        }
        let mut rng = rng.clone();
        let uniforms = (0..tree.len()).map(|_| rng.random::<f64>()).collect();
        let walk = SampleWalk::new(tree, p.temperature, p.top_p, uniforms)?;
        match logits.walk_on_device(&walk)? {
            Ok(out) => Some(Verdict::from_walk(out)),
            Err(e) => {
                tracing::warn!(error = %e, "sampled verification on the device failed; on the host");
                None
            }
        }
    }
}

/// What a session contributes to a batched forward.
pub enum Work<'t> {
    /// A verification round over this tree.
    Verify(&'t TokenTree),
    /// The next chunk (at most `max_tokens`) of the prompt's prefill.
    Prefill { max_tokens: usize },
}

/// What a session's share of a batched forward produced.
#[derive(Debug)]
pub enum Done {
    Round(RoundOutcome),
    /// Prompt tokens still to prefill after this chunk.
    Prefilled {
        pending: usize,
    },
}

/// Runs several sessions' work (verification trees and prefill chunks) in ONE batched forward.
/// A session whose work is refused gets its error; the others go on.
pub fn run_batch<M: TreeModel>(
    model: &M,
    limits: &Limits,
    work: &mut [(&mut Session<M>, Work)],
) -> Vec<Result<Done, SessionError>> {
    // Prefill chunks become chain trees; verification trees are used as given.
    let chains: Vec<Option<TokenTree>> = work
        .iter()
        .map(|(s, w)| match w {
            Work::Prefill { max_tokens } if s.prefill_pending() > 0 => {
                let start = M::committed(&s.cache);
                let end = start + s.prefill_pending().min((*max_tokens).max(1));
                Some(TokenTree::chain(&s.tokens[start..end]))
            }
            _ => None,
        })
        .collect();
    let mut results: Vec<Option<Result<Done, SessionError>>> = work
        .iter()
        .zip(&chains)
        .map(|((s, w), chain)| match (w, chain) {
            (Work::Verify(tree), _) => s.check(model, tree, limits).err().map(Err),
            (Work::Prefill { .. }, None) => Some(Ok(Done::Prefilled { pending: 0 })),
            (Work::Prefill { .. }, Some(_)) => None,
        })
        .collect();
    let runnable: Vec<bool> = results.iter().map(Option::is_none).collect();
    if runnable.iter().any(|&r| r) {
        let trees: Vec<&TokenTree> = work
            .iter()
            .zip(&chains)
            .zip(&runnable)
            .filter(|(_, &r)| r)
            .map(|((w, chain), _)| match (&w.1, chain) {
                (Work::Verify(t), _) => *t,
                (_, Some(c)) => c,
                _ => unreachable!("only runnable work reaches the forward"),
            })
            .collect();
        // Prefill chunks need only their K/V (the first round computes the root's logits), greedy
        // rounds only each node's argmax.
        let wants: Vec<Want> = work
            .iter()
            .zip(&runnable)
            .filter(|(_, &r)| r)
            .map(|((s, w), _)| match w {
                Work::Prefill { .. } => Want::KvOnly,
                // A penalised greedy round takes its argmax over penalised rows, on the host.
                Work::Verify(_)
                    if s.params.mode == VerifyMode::Greedy && !s.params.penalises_repeats() =>
                {
                    Want::Argmax
                }
                Work::Verify(_) => Want::Logits,
            })
            .collect();
        let mut batch: Vec<(&mut M::Cache, &TokenTree)> = work
            .iter_mut()
            .zip(&runnable)
            .filter(|(_, &r)| r)
            .zip(&trees)
            .map(|(((s, _), _), tree)| (&mut s.cache, *tree))
            .collect();
        let forward = model.forward_trees(&mut batch, &wants);
        drop(batch);
        let chosen = work
            .iter_mut()
            .zip(results.iter_mut())
            .zip(&runnable)
            .filter(|(_, &r)| r)
            .map(|(x, _)| x);
        match forward {
            Ok(logits) => {
                for ((((s, w), result), l), tree) in chosen.zip(&logits).zip(&trees) {
                    *result = Some(match w {
                        Work::Verify(_) => {
                            let verdict = s.decide(tree, l);
                            s.commit(model, tree, l, verdict).map(Done::Round)
                        }
                        Work::Prefill { .. } => {
                            if let Some(f) = &mut s.features {
                                f.push(l, 0..tree.len());
                                f.keep_last(PROMPT_FEATURE_ROWS);
                            }
                            let all: Vec<u32> = (0..tree.len() as u32).collect();
                            model
                                .keep_path(&mut s.cache, &all)
                                .map(|()| Done::Prefilled {
                                    pending: s.prefill_pending(),
                                })
                                .map_err(SessionError::Model)
                        }
                    });
                }
            }
            Err(e) => {
                let message = e.to_string();
                for (_, result) in chosen {
                    let e = ModelError::Format {
                        path: "<batch>".into(),
                        message: message.clone(),
                    };
                    *result = Some(Err(SessionError::Model(e)));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every entry decided"))
        .collect()
}

/// Verifies several sessions' trees in ONE batched forward (see [`run_batch`]).
pub fn verify_batch<M: TreeModel>(
    model: &M,
    limits: &Limits,
    work: &mut [(&mut Session<M>, &TokenTree)],
) -> Vec<Result<RoundOutcome, SessionError>> {
    let mut w: Vec<(&mut Session<M>, Work)> = work
        .iter_mut()
        .map(|(s, t)| (&mut **s, Work::Verify(t)))
        .collect();
    run_batch(model, limits, &mut w)
        .into_iter()
        .map(|r| match r? {
            Done::Round(o) => Ok(o),
            Done::Prefilled { .. } => unreachable!("verification work yields rounds"),
        })
        .collect()
}

impl<M: TreeModel> Session<M> {
    /// One round for this session alone.
    pub fn verify(
        &mut self,
        model: &M,
        limits: &Limits,
        tree: &TokenTree,
    ) -> Result<RoundOutcome, SessionError> {
        verify_batch(model, limits, &mut [(self, tree)]).remove(0)
    }
}
