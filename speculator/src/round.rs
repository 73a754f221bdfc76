//! One generation's draft -> verify -> commit rounds as a sans-I/O state machine, the way
//! `quinn-proto` sits under `quinn`: [`RoundDriver`] owns the committed tokens, the drafting
//! (draft models, the context lookup, tree shapes and their controllers, the pipelined guess),
//! what each verdict does, the streamed text, and what to send to resume or re-open a session.
//! It never touches a socket or a clock: the caller moves the trees and verdicts, and gives it
//! the time (seconds on any monotonic scale) where it measures.
//!
//! Every front end drives this one loop: the native client over QUIC, the browser client over
//! WebTransport, the benchmarks and the SSM evaluation against an in-process verifier session.
//!
//! ```text
//! let (prompt, params) = driver.open_request();     // OpenSession
//! while !driver.is_finished() {
//!     let tree = driver.draft(&clock)?;              // Verify
//!     driver.draft_ahead();                          // optional, while the tree is verified
//!     let out = driver.on_verified(&verdict, clock())?;
//! }
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use specinfer_model::{ModelError, Tokenizer};
use specinfer_wire::{
    FinishReason, Limits, SamplingParams, ServerDrafting, TokenTree, Verified, VerifierCosts,
    VerifyMode,
};

use crate::{AdaptiveLookup, ContextLookup, DraftModel, DraftedPart, HandOff, Speculator};

#[derive(Debug, thiserror::Error)]
pub enum RoundError {
    #[error("draft model: {0}")]
    Draft(#[from] ModelError),
    /// The caller or the verifier broke the round protocol (a verdict with no round in flight,
    /// a round started while one is in flight or after the answer finished).
    #[error("round protocol: {0}")]
    Protocol(String),
}

/// Seconds on a monotonic scale whose origin does not matter (`Instant` natively,
/// `performance.now()` in a browser, a scripted counter in tests).
pub type Clock<'c> = &'c dyn Fn() -> f64;

/// What drafts each round's tree: a speculator and its draft models (several: their trees are
/// merged). Without one, every tree is the root alone (plain decoding, plus the lookup's chain
/// when it is on).
pub struct Drafter<'a> {
    pub speculator: Speculator,
    pub drafts: Vec<Box<dyn DraftModel + Send + 'a>>,
}

/// What one verdict (or a resume that recovered a lost one) brought.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundOutput {
    /// Tokens newly committed.
    pub tokens: Vec<u32>,
    /// Text newly decodable (end-of-turn tokens left out, an incomplete UTF-8 character held
    /// back until it completes); empty without a tokenizer.
    pub text: String,
    pub finished: bool,
}

/// Counts over one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub rounds: usize,
    /// Tokens committed by each round (tokens per LLM pass).
    pub accepted_per_round: Vec<usize>,
    /// Rounds whose tree was drafted ahead, while the previous round was being verified.
    pub pipelined_rounds: usize,
    /// Accepted tokens that only the context lookup's chain proposed.
    pub lookup_accepted: usize,
    /// Tree nodes sent, the root of each tree included.
    pub tree_nodes: usize,
    /// Seconds spent drafting trees (a draft's catch-up on committed tokens left out: it is
    /// not a cost of the tree's size).
    pub draft_s: f64,
    /// The verifier's forward seconds, summed over rounds (from the verdicts' stats).
    pub verifier_forward_s: f64,
    /// Rounds the verifier decoded on its own after the answer was handed to it
    /// ([`RoundDriver::with_hand_off`]); counted in `rounds` too.
    pub server_rounds: usize,
}

/// How the context lookup's chain is cut.
enum Lookup {
    /// To the length measured costs make pay (the clients).
    Adaptive(AdaptiveLookup),
    /// Never (measurements of tokens per pass).
    Uncut(ContextLookup),
}

/// The round in flight: what the controllers learn from when its verdict comes.
struct InFlight {
    drafted: DraftedPart,
    tree_nodes: usize,
    draft_s: f64,
    sent_at: f64,
    /// The tree itself, kept only for drafting ahead.
    tree: Option<TokenTree>,
}

/// What a resumed session's committed tokens mean for the generation.
#[derive(Debug)]
pub enum Recovery {
    /// The verifier still holds the session: carry on with it (its tokens of a round whose
    /// answer was lost, if any, are here).
    Resumed(RoundOutput),
    /// The verifier's session does not continue ours: open a new one with
    /// [`RoundDriver::open_request`].
    Reopen,
}

/// The sans-I/O state of one generation (see the module doc).
pub struct RoundDriver<'a> {
    committed: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    drafter: Option<Drafter<'a>>,
    lookup: Option<Lookup>,
    pipelining: bool,
    max_tree_nodes: usize,
    /// The node cap of the verifier's last verdict (it is busy), if any.
    node_cap: Option<usize>,
    /// A tree drafted ahead, and the committed tokens it assumed.
    ahead: Option<(Vec<u32>, TokenTree)>,
    in_flight: Option<InFlight>,
    finish: Option<FinishReason>,
    text: Option<TextStream>,
    stats: GenerationStats,
    /// Set by someone else (a Stop button) to end the generation after the round in flight.
    stop: Option<Arc<AtomicBool>>,
    /// Measures whether the verifier's own decoding would serve the rest cheaper (on when
    /// [`RoundDriver::with_hand_off`] asked for it).
    hand_off: Option<HandOff>,
    /// The verifier decodes the rest on its own: verdicts come without trees.
    server_decodes: bool,
}

impl<'a> RoundDriver<'a> {
    /// A generation after `prompt` (token ids, not empty: its last token roots the first tree).
    pub fn new(
        prompt: Vec<u32>,
        params: SamplingParams,
        drafter: Option<Drafter<'a>>,
    ) -> Result<Self, RoundError> {
        if prompt.is_empty() {
            return Err(RoundError::Protocol("an empty prompt".into()));
        }
        Ok(RoundDriver {
            prompt_len: prompt.len(),
            committed: prompt,
            params,
            drafter,
            lookup: None,
            pipelining: false,
            max_tree_nodes: Limits::default().max_tree_nodes as usize,
            node_cap: None,
            ahead: None,
            in_flight: None,
            finish: None,
            text: None,
            stats: GenerationStats::default(),
            stop: None,
            hand_off: None,
            server_decodes: false,
        })
    }

    /// Adds the context lookup's chain (see [`ContextLookup`]) to every tree, whatever drafts
    /// it (root-only trees included: then the lookup is the only draft), cut to the length that
    /// measured acceptance and costs make pay ([`AdaptiveLookup`]).
    pub fn with_lookup(mut self, lookup: Option<ContextLookup>) -> Self {
        self.lookup = lookup.map(|l| Lookup::Adaptive(AdaptiveLookup::new(l)));
        self
    }

    /// The context lookup's chain at its whole length, never cut: what tokens-per-pass
    /// measurements use beside uncut tree shapes, so that they do not depend on timings.
    pub fn with_uncut_lookup(mut self, lookup: Option<ContextLookup>) -> Self {
        self.lookup = lookup.map(Lookup::Uncut);
        self
    }

    /// While a tree is verified, [`RoundDriver::draft_ahead`] drafts the next one from its most
    /// likely outcome (see [`Speculator::draft_ahead`]); kept when the guess was right. Pays
    /// when the round trip is long next to drafting; with a single draft model only.
    pub fn with_pipelining(mut self, on: bool) -> Self {
        self.pipelining = on;
        self
    }

    /// Decodes the committed tokens into streamed text ([`RoundOutput::text`]).
    pub fn with_text(mut self, tokenizer: Arc<Tokenizer>) -> Self {
        self.text = Some(TextStream::new(tokenizer));
        self
    }

    /// The verifier's limits (from its hello): trees are kept within its node limit.
    pub fn set_limits(&mut self, limits: &Limits) {
        self.max_tree_nodes = limits.max_tree_nodes as usize;
    }

    /// The prompt and parameters of a session to open: at the start, the prompt; after a lost
    /// session, everything committed so far with the tokens still to generate.
    pub fn open_request(&self) -> (Vec<u32>, SamplingParams) {
        let left = self
            .params
            .max_new_tokens
            .saturating_sub(self.generated().len() as u32)
            .max(1);
        // Once the verifier decodes on its own, nothing drafts from features any more.
        let return_features = !self.server_decodes
            && self
                .drafter
                .as_ref()
                .is_some_and(|d| d.drafts.iter().any(|m| m.wants_features()));
        let params = SamplingParams {
            max_new_tokens: left,
            return_features,
            ..self.params.clone()
        };
        (self.committed.clone(), params)
    }

    /// Hands the rest of the answer to the verifier's own decoding once split rounds cost more
    /// per token than its plain steps (see [`HandOff`]): the caller then asks for it
    /// (`Generate` with plain drafting) when [`RoundDriver::wants_server_decoding`] says so.
    pub fn with_hand_off(mut self, on: bool) -> Self {
        self.hand_off = on.then(HandOff::default);
        self
    }

    /// A sampled answer that its seed must reproduce (a request that named one): the choices
    /// that follow measured timings are left out, the hand-off and the lookup's cut (its chain
    /// goes whole), so that with a fixed tree shape the seed alone decides what is drawn, on an
    /// idle verifier as on a loaded one. Adaptive shapes still follow timings, and so does a
    /// busy verifier's node cap. A greedy answer is the same whatever they choose: it keeps them.
    pub fn reproducible(mut self) -> Self {
        if self.params.mode == VerifyMode::Stochastic {
            self.hand_off = None;
            if let Some(Lookup::Adaptive(lookup)) = &self.lookup {
                self.lookup = Some(Lookup::Uncut(lookup.config()));
            }
        }
        self
    }

    /// What the verifier said a token costs on it as the session opened, and the round trip to
    /// it: with the hand-off on, they stand for the first rounds' measurements, so a split
    /// that does not pay hands off before its first tree ([`HandOff::start_from`]).
    pub fn verifier_costs(&mut self, costs: &VerifierCosts, rtt_s: f64) {
        if let Some(h) = &mut self.hand_off {
            h.start_from(costs, rtt_s);
        }
    }

    /// Whether the caller should now ask the verifier to decode the rest on its own, and call
    /// [`RoundDriver::start_server_decoding`].
    pub fn wants_server_decoding(&self) -> bool {
        !self.server_decodes
            && self.finish.is_none()
            && self.in_flight.is_none()
            && self
                .hand_off
                .as_ref()
                .is_some_and(HandOff::server_is_cheaper)
    }

    /// The verifier decodes the rest: from now on every verdict is a streamed round of its own,
    /// with no tree in flight. Final for this answer.
    pub fn start_server_decoding(&mut self) -> Result<(), RoundError> {
        if self.in_flight.is_some() {
            return Err(RoundError::Protocol(
                "the verifier cannot take over while a round is in flight".into(),
            ));
        }
        self.server_decodes = true;
        self.ahead = None;
        if let Some(h) = &self.hand_off {
            let (split, server) = h.per_token();
            tracing::info!(
                generated = self.generated().len(),
                split_ms_per_token = split * 1e3,
                server_ms_per_token = server * 1e3,
                "the verifier decodes the rest of the answer on its own"
            );
        }
        Ok(())
    }

    /// What the verifier drafts once it decodes the rest on its own: the context lookup's chain
    /// where this driver runs one (it costs no model, and dropping it would throw away what it
    /// gives: an answer that quotes its question or repeats itself), else nothing.
    pub fn server_drafting(&self) -> ServerDrafting {
        match &self.lookup {
            Some(Lookup::Adaptive(l)) => ServerDrafting::Lookup {
                max_tokens: l.config().max_tokens as u32,
            },
            Some(Lookup::Uncut(l)) => ServerDrafting::Lookup {
                max_tokens: l.max_tokens as u32,
            },
            None => ServerDrafting::Plain,
        }
    }

    /// Whether the verifier decodes the rest on its own ([`RoundDriver::start_server_decoding`]).
    pub fn server_decodes(&self) -> bool {
        self.server_decodes
    }

    /// The generation ends, without a [`FinishReason`], once `stop` is set: the round in flight
    /// (if any) is still taken, so what is committed stays what the verifier committed.
    pub fn with_stop(mut self, stop: Arc<AtomicBool>) -> Self {
        self.stop = Some(stop);
        self
    }

    /// Whether the generation has ended: the verifier finished it, or it was stopped.
    pub fn is_finished(&self) -> bool {
        self.finish.is_some() || self.is_stopped()
    }

    /// Whether it was stopped (see [`RoundDriver::with_stop`]).
    pub fn is_stopped(&self) -> bool {
        self.stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed))
    }

    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Whether a tree was sent and its verdict not yet taken.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Prompt and generated tokens.
    pub fn committed(&self) -> &[u32] {
        &self.committed
    }

    pub fn generated(&self) -> &[u32] {
        &self.committed[self.prompt_len..]
    }

    pub fn stats(&self) -> &GenerationStats {
        &self.stats
    }

    /// The whole text generated so far (empty without a tokenizer).
    pub fn text(&self) -> Result<String, ModelError> {
        match &self.text {
            Some(t) => t.whole(),
            None => Ok(String::new()),
        }
    }

    /// Gives the drafter back (a chat keeps its speculator's measurements from one answer to
    /// the next, and its draft caches).
    pub fn into_drafter(self) -> Option<Drafter<'a>> {
        self.drafter
    }

    /// The next round's tree, to send now; `clock` times the drafting.
    pub fn draft(&mut self, clock: Clock<'_>) -> Result<TokenTree, RoundError> {
        if self.finish.is_some() || self.in_flight.is_some() {
            return Err(RoundError::Protocol(
                "no round to start: the answer is finished or a round is in flight".into(),
            ));
        }
        let mut started = clock();
        let root = *self.committed.last().expect("never empty");
        let tree = match (self.ahead.take(), &mut self.drafter) {
            (Some((guess, tree)), _) if guess == self.committed => {
                self.stats.pipelined_rounds += 1;
                tree
            }
            (_, None) => TokenTree::root(root),
            (_, Some(d))
                if !d.speculator.drafts_next()
                    || !d.drafts.iter().all(|m| m.ready(&self.committed)) =>
            {
                TokenTree::root(root)
            }
            (_, Some(d)) if d.drafts.len() == 1 => {
                // Catching the draft up on the committed tokens (the whole prompt, in the first
                // round) is not part of the per-level cost the adaptive depth weighs.
                d.drafts[0].sync(&self.committed)?;
                started = clock();
                d.speculator.draft(&mut d.drafts[0], &self.committed)?
            }
            (_, Some(d)) => d.speculator.draft_merged(&mut d.drafts, &self.committed)?,
        };
        // A busy verifier's cap binds the whole tree; the draft's likeliest nodes come first
        // (BFS from the root, best-first within dynamic trees), so they are what stays.
        let max_nodes = self
            .node_cap
            .map_or(self.max_tree_nodes, |cap| cap.min(self.max_tree_nodes));
        let mut tree = tree;
        tree.truncate(max_nodes);
        // The draft model's part of the tree (its nodes come first) is what the adaptive shapes
        // learn from; the lookup's nodes only add to the verify cost.
        let drafted = DraftedPart::of(&tree);
        let sampled = self.params.mode == VerifyMode::Stochastic;
        let tree = match &mut self.lookup {
            Some(Lookup::Adaptive(lookup)) => {
                lookup.extend(tree, &self.committed, max_nodes, sampled)
            }
            Some(Lookup::Uncut(lookup)) => lookup.extend(tree, &self.committed, max_nodes, sampled),
            None => tree,
        };
        let sent_at = clock();
        self.stats.draft_s += sent_at - started;
        self.stats.tree_nodes += tree.len();
        self.in_flight = Some(InFlight {
            drafted,
            tree_nodes: tree.len(),
            draft_s: sent_at - started,
            sent_at,
            tree: self.pipelining.then(|| tree.clone()),
        });
        Ok(tree)
    }

    /// With pipelining on, drafts the tree that would follow the one in flight under its most
    /// likely outcome; the next [`RoundDriver::draft`] uses it if the verdict matched the guess.
    /// Call after sending, while the verifier works. A failed guess (say, the draft's context
    /// is full) only loses the head start.
    pub fn draft_ahead(&mut self) {
        let (
            Some(InFlight {
                tree: Some(tree), ..
            }),
            Some(d),
        ) = (&self.in_flight, &mut self.drafter)
        else {
            return;
        };
        // A feature-conditioned draft has no LLM features of a guessed outcome.
        if d.drafts.len() == 1 && d.speculator.drafts_next() && !d.drafts[0].wants_features() {
            self.ahead = d
                .speculator
                .draft_ahead(&mut d.drafts[0], &self.committed, tree)
                .ok();
        }
    }

    /// Takes the verdict on the tree in flight, received at `now`.
    pub fn on_verified(&mut self, v: &Verified, now: f64) -> Result<RoundOutput, RoundError> {
        if v.tokens.is_empty() && v.finish.is_none() {
            return Err(RoundError::Protocol(
                "a verdict that commits no token and does not finish".into(),
            ));
        }
        if self.server_decodes {
            // Nodes of the verifier's own trees: the lookup's chain is the only draft it is
            // asked for ([`RoundDriver::server_drafting`]).
            if v.accepted_nodes.len() > v.tokens.len() {
                return Err(RoundError::Protocol(
                    "a round the verifier decoded on its own accepted more nodes than it committed tokens".into(),
                ));
            }
            self.stats.lookup_accepted += v.accepted_nodes.len();
            self.stats.server_rounds += 1;
            self.stats.tree_nodes += v.stats.tree_nodes as usize;
            return self.count_and_commit(v);
        }
        let Some(sent) = self.in_flight.take() else {
            return Err(RoundError::Protocol(
                "a verdict with no round in flight".into(),
            ));
        };
        let round_s = (now - sent.sent_at).max(0.0);
        let forward_s = v.stats.forward_us as f64 * 1e-6;
        let queue_s = v.stats.queue_us as f64 * 1e-6;
        let observed = sent.drafted.observation(
            sent.tree_nodes,
            &v.accepted_nodes,
            sent.draft_s,
            round_s,
            queue_s,
            forward_s,
        );
        self.stats.lookup_accepted += v.accepted_nodes.len().saturating_sub(observed.accepted);
        tracing::debug!(
            model_depth = observed.tree_depth,
            tree_nodes = sent.tree_nodes,
            model_accepted = observed.accepted,
            accepted = v.accepted_nodes.len(),
            draft_ms = sent.draft_s * 1e3,
            round_ms = round_s * 1e3,
            forward_ms = forward_s * 1e3,
            "round"
        );
        // Load-aware trees: the verifier's price of a node and, when it is busy, its cap.
        let node_price = v.stats.node_price_ns as f64 * 1e-9;
        self.node_cap = (v.stats.node_cap > 0).then_some(v.stats.node_cap as usize);
        let looked_up = match &mut self.lookup {
            Some(Lookup::Adaptive(lookup)) => {
                lookup.set_node_price(node_price);
                Some(lookup.observe(&v.tokens, sent.tree_nodes, round_s, queue_s, forward_s))
            }
            _ => None,
        };
        if let Some(h) = &mut self.hand_off {
            h.observe(v, sent.tree_nodes, sent.draft_s, round_s);
            // The verifier runs the same lookup once it decodes on its own.
            if let Some(tokens) = looked_up {
                h.observe_lookup(tokens);
            }
        }
        if let Some(d) = &mut self.drafter {
            d.speculator.set_node_price(node_price);
            d.speculator.observe(observed, &v.accepted_nodes);
            if let Some(f) = &v.features {
                let rows = f.dequantize();
                for m in &mut d.drafts {
                    m.take_features(f.first_position as usize, &rows, f.dim as usize);
                }
            }
        }
        self.count_and_commit(v)
    }

    /// Counts a verdict's round (split or the verifier's own) and commits its tokens.
    fn count_and_commit(&mut self, v: &Verified) -> Result<RoundOutput, RoundError> {
        self.stats.rounds += 1;
        self.stats.accepted_per_round.push(v.tokens.len());
        self.stats.verifier_forward_s += v.stats.forward_us as f64 * 1e-6;
        self.finish = v.finish;
        self.commit(&v.tokens)
    }

    /// The connection carrying the session broke: the round in flight (if any) is lost, and so
    /// is a tree drafted ahead of it. Then resume ([`RoundDriver::on_resumed`]) or re-open.
    pub fn connection_lost(&mut self) {
        self.in_flight = None;
        self.ahead = None;
    }

    /// The verifier's committed tokens for a resumed session: if they continue ours (a lost
    /// round's tokens included), take them; else the session must be re-opened.
    pub fn on_resumed(&mut self, server_committed: &[u32]) -> Result<Recovery, RoundError> {
        self.connection_lost();
        if !server_committed.starts_with(&self.committed) {
            return Ok(Recovery::Reopen);
        }
        let missed = server_committed[self.committed.len()..].to_vec();
        // The lost round may have ended the answer, as its verdict would have said: a stop
        // token among the generated ones (the verifier commits nothing after it), or the
        // length asked for.
        let generated = &server_committed[self.prompt_len..];
        self.finish = if generated.iter().any(|t| self.params.stop_ids.contains(t)) {
            Some(FinishReason::Stop)
        } else if generated.len() >= self.params.max_new_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok(Recovery::Resumed(self.commit(&missed)?))
    }

    fn commit(&mut self, tokens: &[u32]) -> Result<RoundOutput, RoundError> {
        self.committed.extend_from_slice(tokens);
        let finished = self.finish.is_some();
        let text = match &mut self.text {
            Some(t) => t.push(tokens, finished)?,
            None => String::new(),
        };
        Ok(RoundOutput {
            tokens: tokens.to_vec(),
            text,
            finished,
        })
    }
}

/// Generated tokens turned into text as they come: end-of-turn tokens left out, a character
/// whose bytes are split over rounds held back until it is whole.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    visible: Vec<u32>,
    shown_bytes: usize,
}

impl TextStream {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        TextStream {
            tokenizer,
            visible: Vec::new(),
            shown_bytes: 0,
        }
    }

    /// The text `tokens` add; at the end (`finished`) whatever is left, complete or not.
    pub fn push(&mut self, tokens: &[u32], finished: bool) -> Result<String, ModelError> {
        let eos = self.tokenizer.eos();
        self.visible
            .extend(tokens.iter().copied().filter(|t| !eos.contains(t)));
        let text = self.tokenizer.decode(&self.visible)?;
        if text.ends_with('\u{FFFD}') && !finished {
            return Ok(String::new());
        }
        let new = text.get(self.shown_bytes..).unwrap_or("").to_string();
        self.shown_bytes = text.len();
        Ok(new)
    }

    /// Everything decoded so far.
    pub fn whole(&self) -> Result<String, ModelError> {
        self.tokenizer.decode(&self.visible)
    }
}
