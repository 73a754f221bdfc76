//! The speculator: one tree per round from a draft model, in the shape asked for, adapted to
//! what past rounds measured. The shapes themselves live in [`crate::shape`], their growth in
//! [`crate::expansion`] and [`crate::dynamic`], the controllers in [`crate::controller`].

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specinfer_model::ModelError;
use specinfer_wire::TokenTree;

use crate::acceptance::{DrawAcceptance, SentDraws};
use crate::controller::{Calibration, DraftAttempts};
use crate::dynamic::{dynamic_tree, DrawnTokens, Growth, LikeliestTokens};
use crate::expansion::expand_tree;
use crate::{merge_trees, DepthController, DraftMode, DraftModel, RoundObservation, TreeShape};

pub struct Speculator {
    pub shape: TreeShape,
    pub mode: DraftMode,
    /// Each tree's draws come from this seed and the committed length it is drafted at (see
    /// [`Speculator::draws_at`]), never from a stream carried across rounds.
    seed: u64,
    depth: DepthController,
    /// The last tree [`Speculator::draft`] built for sending, until its round is observed.
    drafted: Option<Drafted>,
    /// Dynamic trees: how far the draft's path probabilities can be trusted.
    calibration: Calibration,
    /// Adaptive dynamic trees: what trying to draft has been worth.
    attempts: DraftAttempts,
    /// Sampled dynamic trees: how often each kind of draw has been accepted...
    acceptance: DrawAcceptance,
    /// ...and the draws of the last tree drafted for sending, until its round is observed.
    draws: Option<SentDraws>,
}

/// What went into a drafted tree, for learning from its round.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Drafted {
    pub(crate) forwards: usize,
    /// Sum over the drafted nodes of the draft's probability of the path to them: the accepted
    /// length greedy verification would average if the draft were calibrated.
    pub(crate) expected: f64,
}

impl Speculator {
    pub const PAPER_EXPANSION: [usize; 8] = [1, 1, 3, 1, 1, 1, 1, 1];

    /// An expansion-tree speculator (see [`TreeShape::Expansion`]).
    pub fn new(expansion: Vec<usize>, mode: DraftMode, seed: u64) -> Self {
        Self::with_shape(TreeShape::Expansion(expansion), mode, seed)
    }

    /// The speculator of a request whose verifier samples with `request_seed`: its draws come
    /// from another stream (the seed salted), independent of the verifier's acceptance tests,
    /// which lossless sampling needs, and as reproducible as they are.
    pub fn for_request(shape: TreeShape, mode: DraftMode, request_seed: u64) -> Self {
        Self::with_shape(shape, mode, request_seed ^ 0x5eed_d4af_7000_0000)
    }

    pub fn with_shape(shape: TreeShape, mode: DraftMode, seed: u64) -> Self {
        let max_depth = match &shape {
            TreeShape::Adaptive(e) | TreeShape::Expansion(e) => e.len(),
            TreeShape::Dynamic { .. } | TreeShape::AdaptiveDynamic { .. } => 0,
        };
        Speculator {
            shape,
            mode,
            seed,
            depth: DepthController::new(max_depth),
            drafted: None,
            calibration: Calibration::default(),
            attempts: DraftAttempts::default(),
            acceptance: DrawAcceptance::default(),
            draws: None,
        }
    }

    /// Feeds what the round of the last drafted tree measured to the adaptive controllers. A
    /// round whose tree did not come from [`Speculator::draft`] (a root sent without drafting,
    /// or a tree drafted ahead) counts as costing no draft forwards. `accepted_nodes` is the
    /// verdict's accepted path (root to leaf).
    pub fn observe(&mut self, round: RoundObservation, accepted_nodes: &[u32]) {
        let drafted = self.drafted.take().unwrap_or_default();
        if let Some(mut draws) = self.draws.take() {
            // Nodes past the drafted part sent (a busy verifier's cap cut them) were not tried.
            draws.nodes.truncate(round.drafted_nodes.saturating_sub(1));
            self.acceptance.observe(&draws, accepted_nodes);
        }
        let forwards = match self.shape {
            TreeShape::Dynamic { .. } | TreeShape::AdaptiveDynamic { .. } => {
                if round.tree_depth > 0 {
                    self.calibration.observe(round.accepted, drafted.expected);
                }
                if drafted.forwards > 0 {
                    self.attempts
                        .observe_drafted(round.accepted + 1, round.draft_s + round.round_s);
                } else {
                    self.attempts.observe_plain();
                }
                drafted.forwards
            }
            _ => round.tree_depth,
        };
        self.depth.observe(round, forwards);
    }

    /// The verifier's price of a tree node, in seconds (see
    /// [`DepthController::set_node_price`]): adaptive trees weigh every node at least at it.
    pub fn set_node_price(&mut self, seconds: f64) {
        self.depth.set_node_price(seconds);
    }

    /// The depth the next adaptive tree will have.
    pub fn adaptive_depth(&self) -> usize {
        self.depth.best_depth()
    }

    /// Whether the next tree will hold drafted nodes. When it will be the root alone (the
    /// adaptive depth chose plain decoding), [`Speculator::draft`] does not run the draft model
    /// at all, not even to catch up on the committed tokens: that would cost one draft forward
    /// per round for nothing, and the next drafted round catches up on them in one batch.
    pub fn drafts_next(&self) -> bool {
        match &self.shape {
            TreeShape::Expansion(e) => e.first().is_some_and(|&k| k > 0),
            TreeShape::Adaptive(e) => {
                self.depth.best_depth() > 0 && e.first().is_some_and(|&k| k > 0)
            }
            TreeShape::Dynamic { budget } => *budget > 0,
            TreeShape::AdaptiveDynamic { budget } => {
                // A draft forward is paid before the draft's confidence says whether any node
                // is worth verifying, so whether to try at all is learned from the rounds that
                // tried: their tokens per second against plain decoding's.
                *budget > 0 && self.attempts.worth_trying(self.depth.plain_seconds())
            }
        }
    }

    /// The random stream of the tree drafted after `committed_len` tokens. A function of the
    /// seed and that length only, so the tree drafted at a position is the same whether it was
    /// drafted ahead or not, and after a failover (the session re-opened elsewhere with its
    /// committed tokens) as in an uninterrupted run: a seeded sampled session with a fixed tree
    /// shape is reproducible through both. Positions differ between rounds, so their streams
    /// are independent.
    fn draws_at(&self, committed_len: usize) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(committed_len as u64);
        rng
    }

    /// Drafts the next tree after `committed` (its root is `committed`'s last token).
    pub fn draft(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
    ) -> Result<TokenTree, ModelError> {
        let mut rng = self.draws_at(committed.len());
        self.draft_with(model, committed, &mut rng)
    }

    fn draft_with(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
        rng: &mut ChaCha8Rng,
    ) -> Result<TokenTree, ModelError> {
        self.draws = None;
        if !self.drafts_next() {
            return Ok(TokenTree::root(
                *committed.last().expect("committed tokens are never empty"),
            ));
        }
        model.sync(committed)?;
        let (tree, drafted) = match self.shape.clone() {
            TreeShape::Expansion(expansion) => {
                expand_tree(model, committed, &expansion, self.mode, rng)?
            }
            TreeShape::Adaptive(expansion) => {
                let depth = self.depth.best_depth();
                expand_tree(model, committed, &expansion[..depth], self.mode, rng)?
            }
            TreeShape::Dynamic { budget } => {
                self.dynamic(model, committed, budget, Growth::ToBudget, rng)?
            }
            TreeShape::AdaptiveDynamic { budget } => {
                let growth = match self.depth.growth_costs(self.calibration.factor()) {
                    Some(costs) => Growth::WhilePaying(costs),
                    None => Growth::FirstWave,
                };
                self.dynamic(model, committed, budget, growth, rng)?
            }
        };
        self.drafted = Some(drafted);
        Ok(tree)
    }

    /// A dynamic tree of the speculator's mode: the draft's likeliest tokens, or draws.
    fn dynamic(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
        budget: usize,
        growth: Growth,
        rng: &mut ChaCha8Rng,
    ) -> Result<(TokenTree, Drafted), ModelError> {
        match self.mode {
            DraftMode::Greedy => dynamic_tree(
                model,
                committed,
                budget,
                growth,
                &mut LikeliestTokens::default(),
            ),
            DraftMode::Sample {
                temperature,
                top_p,
                top_k,
                draw,
            } => {
                let mut frontier =
                    DrawnTokens::new(temperature, top_p, top_k, draw, rng, &self.acceptance);
                let (tree, drafted) =
                    dynamic_tree(model, committed, budget, growth, &mut frontier)?;
                let (tree, draws) = frontier.attach(tree);
                self.draws = Some(draws);
                Ok((tree, drafted))
            }
        }
    }

    /// Pipelining: drafts the tree that would follow `in_flight` (just sent, rooted at
    /// `committed`'s last token) under its most likely outcome: the verifier accepts the draft's
    /// best path (every node's first child) to the depth the measured acceptance makes likeliest,
    /// then emits its own token there, guessed as the draft's best token that is not one of that
    /// node's children (those would have been accepted). Returns the committed tokens this guess
    /// assumes, and the tree; on a miss the caller drops both, and the next sync rolls the draft
    /// back to what was accepted.
    pub fn draft_ahead(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
        in_flight: &TokenTree,
    ) -> Result<(Vec<u32>, TokenTree), ModelError> {
        let children = in_flight.children();
        let tree_depth = in_flight.depths().into_iter().max().unwrap_or(0) as usize;
        let stop = self.depth.likeliest_accepted(tree_depth);
        let mut guess = committed.to_vec();
        let mut node = 0;
        for _ in 0..stop {
            let Some(&child) = children[node].first() else {
                break;
            };
            node = child as usize;
            guess.push(in_flight.token(node));
        }
        model.sync(&guess)?;
        let last = *guess.last().expect("committed tokens are never empty");
        let logits = model.extend(&TokenTree::root(last), 0)?;
        let rejected: Vec<u32> = children[node]
            .iter()
            .map(|&c| in_flight.token(c as usize))
            .collect();
        let bonus = logits[0]
            .iter()
            .enumerate()
            .filter(|(t, _)| !rejected.contains(&(*t as u32)))
            .fold((0usize, f32::NEG_INFINITY), |best, (t, &l)| {
                if l > best.1 {
                    (t, l)
                } else {
                    best
                }
            })
            .0;
        guess.push(bonus as u32);
        // The round observed next is the one of the tree already sent.
        let sent = (self.drafted.take(), self.draws.take());
        let tree = self.draft(model, &guess);
        (self.drafted, self.draws) = sent;
        Ok((guess, tree?))
    }

    /// Drafts with every model and merges their trees (SpecInfer's merge-based speculation).
    pub fn draft_merged<M: DraftModel>(
        &mut self,
        models: &mut [M],
        committed: &[u32],
    ) -> Result<TokenTree, ModelError> {
        // One stream for all the models, so their draws are independent of each other.
        let mut rng = self.draws_at(committed.len());
        let mut trees = Vec::with_capacity(models.len());
        for m in models.iter_mut() {
            trees.push(self.draft_with(m, committed, &mut rng)?);
        }
        // Merging renumbers the nodes: the draws are not learned from.
        self.draws = None;
        Ok(merge_trees(&trees))
    }
}
