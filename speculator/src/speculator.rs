//! Building token trees from a draft model. Platform-neutral: no I/O, no async, so the browser
//! build reuses it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{distribution, sample, top_k_sparse};
use specinfer_model::ModelError;
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

use crate::DraftModel;

/// How children are chosen at each expanded node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftMode {
    /// The `k` most likely tokens (greedy verification needs nothing else).
    Greedy,
    /// `k` children drawn from the draft's distribution (after temperature / top-p) truncated to
    /// its `top_k` tokens; the proposal travels with the tree for lossless verification.
    Sample {
        temperature: f32,
        top_p: f32,
        top_k: usize,
        draw: DrawMode,
    },
}

/// The shape of the trees a speculator grows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TreeShape {
    /// SpecInfer's expansion trees: level `d` gives every node of level `d - 1` `k_d` children.
    /// `<1,1,3,1,1,1,1,1>` is the paper's default.
    Expansion(Vec<usize>),
    /// Beyond the paper: grow, wave by wave, the candidates with the highest path probability
    /// under the draft model until `budget` nodes (root excluded) are placed. Greedy mode only.
    Dynamic { budget: usize },
    /// An expansion tree cut to the depth that maximises measured tokens per second: deeper trees
    /// pay off only while the draft keeps being accepted there and verifying stays cheap next to
    /// the round trip. See [`DepthController`].
    Adaptive(Vec<usize>),
    /// A dynamic tree that stops growing, short of `budget`, at the first node whose expected
    /// acceptance (the draft's path probability, scaled by how well those predicted past rounds)
    /// does not pay for its verification (and, for a wave's first node, the draft forward that
    /// scored its parent) at the rate the tree reached so far. Whether to draft at all is learned
    /// from the rounds that tried, with drafting tried again now and then, as for
    /// [`TreeShape::Adaptive`]. Greedy mode only.
    AdaptiveDynamic { budget: usize },
}

impl TreeShape {
    /// The clients' tree in greedy mode: best-first growth by the draft's path probabilities
    /// puts the same nodes where they are likelier accepted than the paper's fixed expansion
    /// (held-out tau 2.24 vs 1.62 at 32 nodes vs 20), and the adaptive cut spends nodes only
    /// where the measured costs pay for them.
    pub fn default_greedy() -> TreeShape {
        TreeShape::AdaptiveDynamic { budget: 32 }
    }

    /// The clients' tree when sampling: the paper's expansion, whose children are drawn from the
    /// draft (dynamic trees cannot be), cut to the depth that pays.
    pub fn default_sampled() -> TreeShape {
        TreeShape::Adaptive(Speculator::PAPER_EXPANSION.to_vec())
    }

    /// The tree without its adaptive cut: what it grows to while every node pays.
    pub fn uncut(&self) -> TreeShape {
        match self {
            TreeShape::Adaptive(e) => TreeShape::Expansion(e.clone()),
            TreeShape::AdaptiveDynamic { budget } => TreeShape::Dynamic { budget: *budget },
            other => other.clone(),
        }
    }

    /// Dynamic trees pick their tokens by the draft's probabilities, not by drawing from them, so
    /// they carry no proposals for speculative sampling.
    pub fn is_greedy_only(&self) -> bool {
        matches!(
            self,
            TreeShape::Dynamic { .. } | TreeShape::AdaptiveDynamic { .. }
        )
    }
}

/// The form [`TreeShape`]'s `FromStr` reads.
impl std::fmt::Display for TreeShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let expansion = |e: &[usize]| {
            e.iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            TreeShape::Expansion(e) => write!(f, "{}", expansion(e)),
            TreeShape::Dynamic { budget } => write!(f, "dynamic:{budget}"),
            TreeShape::Adaptive(e) => write!(f, "adaptive:{}", expansion(e)),
            TreeShape::AdaptiveDynamic { budget } => write!(f, "adaptive:dynamic:{budget}"),
        }
    }
}

impl std::str::FromStr for TreeShape {
    type Err = String;

    /// `1,1,3,1`, `dynamic:N`, `adaptive:1,1,3,1` (the expansion cut to a measured depth) or
    /// `adaptive:dynamic:N` (the dynamic tree grown while it pays).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("adaptive:") {
            return match rest.parse::<TreeShape>()? {
                TreeShape::Expansion(e) => Ok(TreeShape::Adaptive(e)),
                TreeShape::Dynamic { budget } => Ok(TreeShape::AdaptiveDynamic { budget }),
                _ => Err(format!(
                    "{s:?}: adaptive: takes an expansion (adaptive:1,1,3) or a dynamic tree (adaptive:dynamic:32)"
                )),
            };
        }
        if let Some(n) = s.strip_prefix("dynamic:") {
            let budget = n
                .parse()
                .map_err(|_| format!("{s:?}: dynamic:N needs a node count"))?;
            return Ok(TreeShape::Dynamic { budget });
        }
        s.split(',')
            .map(|k| {
                k.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{s:?}: expected numbers like 1,1,3,1 or dynamic:N"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(TreeShape::Expansion)
    }
}

pub struct Speculator {
    pub shape: TreeShape,
    pub mode: DraftMode,
    rng: ChaCha8Rng,
    depth: DepthController,
    /// The last tree [`Speculator::draft`] built for sending, until its round is observed.
    drafted: Option<Drafted>,
    /// Decayed sums over dynamic trees' rounds of the draft nodes accepted and of the
    /// acceptance their path probabilities predicted.
    calibration: [f64; 2],
    /// Decayed sums over the rounds an adaptive dynamic tree was drafted for (whether or not it
    /// grew past the root) of the tokens they gave and the seconds they took, drafting included:
    /// what trying to draft is worth, next to plain decoding; and their decayed count.
    attempts: [f64; 3],
    /// Rounds since the last one drafted for.
    since_attempt: usize,
}

/// The (decayed) number of drafted rounds an adaptive dynamic tree needs to have seen before it
/// may judge drafting not worth trying: one unlucky round must not switch drafting off.
const MIN_ATTEMPTS: f64 = 4.0;

/// What went into a drafted tree, for learning from its round.
#[derive(Clone, Copy, Debug, Default)]
struct Drafted {
    forwards: usize,
    /// Sum over the drafted nodes of the draft's probability of the path to them: the accepted
    /// length greedy verification would average if the draft were calibrated.
    expected: f64,
}

impl Speculator {
    pub const PAPER_EXPANSION: [usize; 8] = [1, 1, 3, 1, 1, 1, 1, 1];

    /// An expansion-tree speculator (see [`TreeShape::Expansion`]).
    pub fn new(expansion: Vec<usize>, mode: DraftMode, seed: u64) -> Self {
        Self::with_shape(TreeShape::Expansion(expansion), mode, seed)
    }

    pub fn with_shape(shape: TreeShape, mode: DraftMode, seed: u64) -> Self {
        let max_depth = match &shape {
            TreeShape::Adaptive(e) | TreeShape::Expansion(e) => e.len(),
            TreeShape::Dynamic { .. } | TreeShape::AdaptiveDynamic { .. } => 0,
        };
        Speculator {
            shape,
            mode,
            rng: ChaCha8Rng::seed_from_u64(seed),
            depth: DepthController::new(max_depth),
            drafted: None,
            calibration: [0.0; 2],
            attempts: [0.0; 3],
            since_attempt: 0,
        }
    }

    /// Feeds what the round of the last drafted tree measured to the adaptive controllers. A
    /// round whose tree did not come from [`Speculator::draft`] (a root sent without drafting,
    /// or a tree drafted ahead) counts as costing no draft forwards.
    pub fn observe(&mut self, round: RoundObservation) {
        let drafted = self.drafted.take().unwrap_or_default();
        let forwards = match self.shape {
            TreeShape::Dynamic { .. } | TreeShape::AdaptiveDynamic { .. } => {
                if round.tree_depth > 0 {
                    let [accepted, expected] = &mut self.calibration;
                    *accepted = 0.95 * *accepted + round.accepted as f64;
                    *expected = 0.95 * *expected + drafted.expected;
                }
                if drafted.forwards > 0 {
                    let [tokens, seconds, count] = &mut self.attempts;
                    *tokens = 0.9 * *tokens + (round.accepted + 1) as f64;
                    *seconds = 0.9 * *seconds + round.draft_s + round.round_s;
                    *count = 0.9 * *count + 1.0;
                    self.since_attempt = 0;
                } else {
                    self.since_attempt += 1;
                }
                drafted.forwards
            }
            _ => round.tree_depth,
        };
        self.depth.observe(round, forwards);
    }

    /// How many accepted tokens one unit of the draft's path probability has been worth (1 for
    /// a calibrated draft; a prior of one round worth 1 keeps it finite and moving).
    fn calibration(&self) -> f64 {
        let [accepted, expected] = self.calibration;
        (accepted + 1.0) / (expected + 1.0)
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
                let [tokens, seconds, count] = self.attempts;
                *budget > 0
                    && (count < MIN_ATTEMPTS
                        || tokens / seconds >= 1.0 / self.depth.plain_seconds()
                        || self.since_attempt + 1 >= PLAIN_EXPLORE)
            }
        }
    }

    /// Drafts the next tree after `committed` (its root is `committed`'s last token).
    pub fn draft(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
    ) -> Result<TokenTree, ModelError> {
        if !self.drafts_next() {
            return Ok(TokenTree::root(
                *committed.last().expect("committed tokens are never empty"),
            ));
        }
        model.sync(committed)?;
        let (tree, drafted) = match self.shape.clone() {
            TreeShape::Expansion(expansion) => self.expand(model, committed, &expansion)?,
            TreeShape::Adaptive(expansion) => {
                let depth = self.depth.best_depth();
                self.expand(model, committed, &expansion[..depth])?
            }
            TreeShape::Dynamic { budget } => {
                self.dynamic(model, committed, budget, Growth::ToBudget)?
            }
            TreeShape::AdaptiveDynamic { budget } => {
                let growth = match self.depth.growth_costs(self.calibration()) {
                    Some(costs) => Growth::WhilePaying(costs),
                    None => Growth::FirstWave,
                };
                self.dynamic(model, committed, budget, growth)?
            }
        };
        self.drafted = Some(drafted);
        Ok(tree)
    }

    fn dynamic(
        &self,
        model: &mut dyn DraftModel,
        committed: &[u32],
        budget: usize,
        growth: Growth,
    ) -> Result<(TokenTree, Drafted), ModelError> {
        assert_eq!(
            self.mode,
            DraftMode::Greedy,
            "dynamic trees are built in greedy mode only"
        );
        dynamic_tree(model, committed, budget, growth)
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
        let sent = self.drafted.take();
        let tree = self.draft(model, &guess);
        self.drafted = sent;
        Ok((guess, tree?))
    }

    /// Drafts with every model and merges their trees (SpecInfer's merge-based speculation).
    pub fn draft_merged(
        &mut self,
        models: &mut [&mut (dyn DraftModel + Send)],
        committed: &[u32],
    ) -> Result<TokenTree, ModelError> {
        let mut trees = Vec::with_capacity(models.len());
        for m in models.iter_mut() {
            trees.push(self.draft(&mut **m, committed)?);
        }
        Ok(merge_trees(&trees))
    }

    fn expand(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
        expansion: &[usize],
    ) -> Result<(TokenTree, Drafted), ModelError> {
        let mut tree =
            TokenTree::root(*committed.last().expect("committed tokens are never empty"));
        let mut dists: Vec<SparseDist> = Vec::new();
        let mut drawn_from = Vec::new();
        let mut scored = 0;
        let mut forwards = 0;
        for &k in expansion {
            if k == 0 {
                break;
            }
            let logits = model.extend(&tree, scored)?;
            forwards += 1;
            let frontier = scored..tree.len();
            scored = tree.len();
            for (node, l) in frontier.zip(&logits) {
                match self.mode {
                    DraftMode::Greedy => {
                        for t in top_k_tokens(l, k) {
                            tree.push(node as u32, t);
                        }
                    }
                    DraftMode::Sample {
                        temperature,
                        top_p,
                        top_k,
                        draw,
                    } => {
                        let q = distribution(l, temperature, 0, top_p);
                        let (ids, probs) = top_k_sparse(&q, top_k);
                        let mut weights = probs.clone();
                        let d = dists.len() as u32;
                        for _ in 0..k {
                            if weights.iter().all(|&w| w <= 0.0) {
                                break;
                            }
                            let i = sample(&weights, self.rng.random());
                            if draw == DrawMode::WithoutReplacement {
                                weights[i] = 0.0;
                            }
                            tree.push(node as u32, ids[i]);
                            drawn_from.push(d);
                        }
                        dists.push(SparseDist {
                            node: node as u32,
                            ids,
                            probs,
                        });
                    }
                }
            }
        }
        if let DraftMode::Sample { draw, .. } = self.mode {
            tree = tree
                .with_proposals(Proposals {
                    mode: draw,
                    dists,
                    drawn_from,
                })
                .expect("the speculator builds proposals consistent with its tree");
        }
        Ok((
            tree,
            Drafted {
                forwards,
                expected: 0.0,
            },
        ))
    }
}

/// The `k` highest logits' token ids, best first (ties to the lower id). One pass keeping the
/// best `k` so far: almost every logit loses to the current k-th at one comparison, where
/// selecting over a copy of the whole (49,152-token) vocabulary took a draft about a tenth of a
/// millisecond per scored node.
fn top_k_tokens(l: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(l.len());
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    // `a` ranks before `b`: a higher logit, or an equal one at a lower id.
    let before = |a: u32, b: u32| {
        l[a as usize]
            .total_cmp(&l[b as usize])
            .then(b.cmp(&a))
            .is_gt()
    };
    // The k-th best logit so far: anything below it loses at one float comparison.
    let mut floor = f32::NEG_INFINITY;
    for (t, &x) in l.iter().enumerate() {
        let t = t as u32;
        if best.len() == k && (x < floor || !before(t, best[k - 1])) {
            continue;
        }
        let at = best
            .iter()
            .position(|&b| before(t, b))
            .unwrap_or(best.len());
        best.insert(at, t);
        best.truncate(k);
        if best.len() == k {
            floor = l[best[k - 1] as usize];
        }
    }
    best
}

/// `ln(sum(exp(l)))`, skipping the `-inf` logits of tokens outside a restricted draft head.
fn log_sum_exp(l: &[f32]) -> f64 {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = l
        .iter()
        .filter(|&&x| x != f32::NEG_INFINITY)
        .map(|&x| (x - max).exp())
        .sum();
    max as f64 + (sum as f64).ln()
}

/// Best-first tree growth: candidates (a scored node's likely next tokens) are ranked by the
/// draft's log-probability of the whole path; each wave adds the best few and scores them in one
/// draft forward, as far as `growth` lets it.
fn dynamic_tree(
    model: &mut dyn DraftModel,
    committed: &[u32],
    budget: usize,
    growth: Growth,
) -> Result<(TokenTree, Drafted), ModelError> {
    const CHILDREN_PER_NODE: usize = 8;
    let mut tree = TokenTree::root(*committed.last().expect("committed tokens are never empty"));
    let mut drafted = Drafted::default();
    let mut path_logp = vec![0f64];
    // (path log-prob, parent, token)
    let mut candidates: Vec<(f64, u32, u32)> = Vec::new();
    let wave = budget.div_ceil(6).max(1);
    let mut scored = 0;
    while tree.len() <= budget {
        let logits = model.extend(&tree, scored)?;
        drafted.forwards += 1;
        for (node, l) in (scored..tree.len()).zip(&logits) {
            let lse = log_sum_exp(l);
            for t in top_k_tokens(l, CHILDREN_PER_NODE.min(budget)) {
                candidates.push((path_logp[node] + l[t as usize] as f64 - lse, node as u32, t));
            }
        }
        scored = tree.len();
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
        for i in 0..wave.min(budget + 1 - tree.len()) {
            let Some(&(logp, parent, token)) = candidates.last() else {
                break;
            };
            if !growth.places(&tree, drafted, logp.exp(), i == 0) {
                break;
            }
            candidates.pop();
            tree.push(parent, token);
            path_logp.push(logp);
            drafted.expected += logp.exp();
        }
        if tree.len() == scored {
            break;
        }
        // No candidate the next forward could add (the new nodes' children, no likelier than
        // their parents, or one already waiting) would pay for that forward: skip it.
        let bound = path_logp[scored..]
            .iter()
            .chain(candidates.last().map(|c| &c.0))
            .fold(f64::NEG_INFINITY, |a, &b| a.max(b))
            .exp();
        let after_next = Drafted {
            forwards: drafted.forwards + 1,
            ..drafted
        };
        if !growth.places(&tree, after_next, bound, true) {
            break;
        }
    }
    Ok((tree, drafted))
}

/// How far a dynamic tree grows.
#[derive(Clone, Copy, Debug)]
enum Growth {
    /// To its budget ([`TreeShape::Dynamic`]).
    ToBudget,
    /// The first wave only: an adaptive tree before any round was measured, placing some nodes
    /// to learn what drafting buys and costs.
    FirstWave,
    /// While each node pays at the measured costs ([`TreeShape::AdaptiveDynamic`]).
    WhilePaying(GrowthCosts),
}

impl Growth {
    /// Whether a node with path probability `p` goes into `tree`, built with `so_far`'s forwards
    /// (a wave's first node: scored by the last of them).
    fn places(&self, tree: &TokenTree, so_far: Drafted, p: f64, first_of_wave: bool) -> bool {
        match self {
            Growth::ToBudget => true,
            Growth::FirstWave => so_far.forwards == 1,
            Growth::WhilePaying(c) => c.pays(tree, so_far, p, first_of_wave),
        }
    }
}

/// The measured costs a growing dynamic tree weighs each node against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GrowthCosts {
    /// Seconds of a round besides the verifier's forward (round trip, queueing).
    fixed: f64,
    per_forward: f64,
    /// Verifier forward seconds for a tree of n nodes: `intercept + slope * n`.
    intercept: f64,
    slope: f64,
    /// Accepted tokens per unit of path probability.
    calibration: f64,
}

impl GrowthCosts {
    /// Whether adding a node with path probability `p` to `tree` (built with `so_far`'s
    /// forwards) raises the round's expected tokens per second. Each draft forward is charged
    /// to the first node of the wave it scored the parents of, so the first node must also pay
    /// for the root's forward: a draft that cannot is switched off.
    fn pays(&self, tree: &TokenTree, so_far: Drafted, p: f64, first_of_wave: bool) -> bool {
        let charged_forwards = so_far.forwards - usize::from(first_of_wave);
        let tokens = 1.0 + self.calibration * so_far.expected;
        let seconds = self.fixed
            + self.intercept
            + self.slope * tree.len() as f64
            + self.per_forward * charged_forwards as f64;
        let cost = self.slope + if first_of_wave { self.per_forward } else { 0.0 };
        self.calibration * p * seconds > tokens * cost
    }
}

/// SpecInfer's token tree merge (Definition 3.2): one tree holding every root-to-leaf path of
/// each input. Greedy trees share equal prefixes (a path's tokens identify its node). Trees with
/// proposals stay disjoint under the shared root: every sampled child is one draw from its own
/// model's proposal, and folding two draws into one node would change the acceptance odds.
pub fn merge_trees(trees: &[TokenTree]) -> TokenTree {
    let root = trees
        .first()
        .expect("merge needs at least one tree")
        .token(0);
    assert!(
        trees.iter().all(|t| t.token(0) == root),
        "merged trees must share their root"
    );
    let mut merged = TokenTree::root(root);
    let sampled = trees.iter().any(|t| t.proposals().is_some());
    if !sampled {
        let mut index: std::collections::HashMap<(u32, u32), u32> =
            std::collections::HashMap::new();
        for t in trees {
            let mut map = vec![0u32; t.len()];
            for node in 1..t.len() {
                let parent = map[t.parent(node).expect("non-root")];
                let key = (parent, t.token(node));
                map[node] = *index
                    .entry(key)
                    .or_insert_with(|| merged.push(parent, t.token(node)));
            }
        }
        return merged;
    }
    let mut dists = Vec::new();
    let mut drawn_from = Vec::new();
    let mut mode = None;
    for t in trees {
        let p = t
            .proposals()
            .expect("sampled trees are merged only with sampled trees");
        assert!(
            mode.is_none_or(|m| m == p.mode),
            "merged trees must use one draw mode"
        );
        mode = Some(p.mode);
        let mut map = vec![0u32; t.len()];
        for node in 1..t.len() {
            map[node] = merged.push(map[t.parent(node).expect("non-root")], t.token(node));
            drawn_from.push(dists.len() as u32 + p.drawn_from[node - 1]);
        }
        dists.extend(p.dists.iter().map(|d| SparseDist {
            node: map[d.node as usize],
            ..d.clone()
        }));
    }
    merged
        .with_proposals(Proposals {
            mode: mode.expect("at least one tree"),
            dists,
            drawn_from,
        })
        .expect("merging keeps every proposal consistent")
}

/// The draft model's part of a tree about to be sent: its nodes come first, so the indices of
/// the nodes a verdict accepted tell which of them the draft proposed (a lookup's chain, added
/// after, only adds to the verify cost). The adaptive controllers learn from this part alone.
#[derive(Clone, Copy, Debug)]
pub struct DraftedPart {
    pub nodes: usize,
    pub depth: usize,
}

impl DraftedPart {
    pub fn of(tree: &TokenTree) -> Self {
        DraftedPart {
            nodes: tree.len(),
            depth: tree.depths().into_iter().max().unwrap_or(0) as usize,
        }
    }

    /// The round as the controllers take it: `tree_nodes` sent in all, the verdict's
    /// `accepted_nodes` (root-to-leaf; those the draft model proposed count as its accepted),
    /// and the times as in [`RoundObservation`].
    pub fn observation(
        &self,
        tree_nodes: usize,
        accepted_nodes: &[u32],
        draft_s: f64,
        round_s: f64,
        forward_s: f64,
    ) -> RoundObservation {
        RoundObservation {
            tree_depth: self.depth,
            tree_nodes,
            accepted: accepted_nodes
                .iter()
                .take_while(|&&n| (n as usize) < self.nodes)
                .count(),
            draft_s,
            round_s,
            forward_s,
        }
    }
}

/// What the client measured in one round.
#[derive(Clone, Copy, Debug)]
pub struct RoundObservation {
    /// Depth of the tree sent (0 for a root-only tree).
    pub tree_depth: usize,
    pub tree_nodes: usize,
    /// Drafted tokens the verifier accepted (the accepted path's length).
    pub accepted: usize,
    /// Seconds spent drafting the tree.
    pub draft_s: f64,
    /// Seconds from sending the tree to having the answer (network + queue + forward).
    pub round_s: f64,
    /// Seconds the verifier spent in its forward pass (from the round's stats).
    pub forward_s: f64,
}

/// Chooses the tree depth m that maximises expected tokens per second,
/// `E[tokens | m] / E[seconds | m]`, from what past rounds measured:
/// * acceptance: the chance a drafted token at depth d is accepted given depth d-1 was, counted
///   per depth (with a prior of 1 success in 2, and a depth never tried assumed as good as the
///   one above it, so the controller keeps exploring);
/// * cost: drafting time per level and the fixed part of a round (round trip, queueing) as
///   moving averages; verification time as an affine function of the tree's node count, fitted
///   by decayed least squares (a forward over N nodes costs far less than N forwards, so a
///   per-node cost would flatter shallow trees).
///
/// Depth 0 (the root alone: plain decoding) is a candidate too, so a draft that loses to plain
/// decoding is switched off; after [`PLAIN_EXPLORE`] - 1 rounds at depth 0 one round speculates
/// again to keep the acceptance statistics current.
pub struct DepthController {
    max_depth: usize,
    reached: Vec<f64>,
    accepted: Vec<f64>,
    /// Seconds per draft model forward (one per level of an expansion tree).
    draft_per_forward: f64,
    /// Decayed sums for the fit of forward seconds against tree nodes: weight, x, y, xx, xy.
    fit: [f64; 5],
    fixed: f64,
    rounds: usize,
    /// Rounds at depth 0 since the last one that speculated.
    plain_streak: usize,
}

/// At depth 0, one round in this many speculates (see [`DepthController`]).
pub const PLAIN_EXPLORE: usize = 16;

impl DepthController {
    pub fn new(max_depth: usize) -> Self {
        DepthController {
            max_depth,
            reached: vec![0.0; max_depth + 1],
            accepted: vec![0.0; max_depth + 1],
            draft_per_forward: 0.0,
            fit: [0.0; 5],
            fixed: 0.0,
            rounds: 0,
            plain_streak: 0,
        }
    }

    /// Expected forward seconds for a tree of `nodes` nodes: the affine fit, or (while every
    /// observed tree had one size) proportional to the node count.
    fn verify_seconds(&self, nodes: usize) -> f64 {
        let (intercept, slope) = self.verify_fit();
        intercept + slope * nodes as f64
    }

    /// `(intercept, slope)` of [`DepthController::verify_seconds`].
    fn verify_fit(&self) -> (f64, f64) {
        let [w, sx, sy, sxx, sxy] = self.fit;
        if w <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (sx / w, sy / w);
        let var = sxx / w - mx * mx;
        if var > 1e-6 * mx * mx.max(1.0) {
            let slope = ((sxy / w - mx * my) / var).max(0.0);
            ((my - slope * mx).max(0.0), slope)
        } else {
            (0.0, my / mx.max(1.0))
        }
    }

    /// The costs a growing dynamic tree weighs, with `calibration` accepted tokens per unit of
    /// path probability; `None` before any round was measured.
    pub(crate) fn growth_costs(&self, calibration: f64) -> Option<GrowthCosts> {
        let (intercept, slope) = self.verify_fit();
        (self.rounds > 0).then_some(GrowthCosts {
            fixed: self.fixed,
            per_forward: self.draft_per_forward,
            intercept,
            slope,
            calibration,
        })
    }

    /// Expected seconds of a plain decoding round (the root alone).
    pub fn plain_seconds(&self) -> f64 {
        (self.fixed + self.verify_seconds(1)).max(1e-9)
    }

    /// Learns from one round whose tree cost `draft_forwards` draft model forwards (an expansion
    /// tree: its depth).
    pub fn observe(&mut self, o: RoundObservation, draft_forwards: usize) {
        for d in 1..=o.tree_depth.min(self.max_depth) {
            // Depth d was tried only if every depth above it was accepted.
            if o.accepted + 1 >= d {
                self.reached[d] += 1.0;
                self.accepted[d] += (o.accepted >= d) as u8 as f64;
            }
        }
        let ema = |old: f64, new: f64, n: usize| if n == 0 { new } else { 0.8 * old + 0.2 * new };
        if draft_forwards > 0 {
            self.draft_per_forward = ema(
                self.draft_per_forward,
                o.draft_s / draft_forwards as f64,
                self.rounds,
            );
        }
        let (x, y) = (o.tree_nodes.max(1) as f64, o.forward_s);
        for (sum, v) in self.fit.iter_mut().zip([1.0, x, y, x * x, x * y]) {
            *sum = 0.95 * *sum + v;
        }
        self.plain_streak = if o.tree_depth == 0 {
            self.plain_streak + 1
        } else {
            0
        };
        self.fixed = ema(self.fixed, (o.round_s - o.forward_s).max(0.0), self.rounds);
        self.rounds += 1;
    }

    /// Acceptance chance at depth d given d-1 was accepted.
    fn acceptance(&self, d: usize) -> f64 {
        if self.reached[d] == 0.0 && d > 1 {
            return self.acceptance(d - 1);
        }
        (self.accepted[d] + 1.0) / (self.reached[d] + 2.0)
    }

    /// The number of tree levels a round most likely accepts, for a tree `depth` levels deep:
    /// the `d` maximising P(levels 1..=d accepted, level d+1 not), from the measured acceptance.
    pub fn likeliest_accepted(&self, depth: usize) -> usize {
        if self.max_depth == 0 {
            // No per-depth statistics (dynamic trees): guess the root's level only.
            return 0;
        }
        let (mut best, mut best_p) = (0, 0.0);
        let mut chain = 1.0;
        for d in 0..=depth {
            // Levels deeper than those measured share the deepest measured rate.
            let next = if d < depth {
                self.acceptance((d + 1).min(self.max_depth))
            } else {
                0.0
            };
            let p = chain * (1.0 - next);
            if p > best_p {
                best = d;
                best_p = p;
            }
            chain *= next;
        }
        best
    }

    pub fn best_depth(&self) -> usize {
        if self.max_depth == 0 || self.rounds == 0 {
            return self.max_depth;
        }
        let plain_rate = 1.0 / self.plain_seconds();
        let (mut best, mut best_rate) = (1, 0.0);
        let (mut expected, mut chain) = (1.0, 1.0);
        for m in 1..=self.max_depth {
            chain *= self.acceptance(m);
            expected += chain;
            // Nodes grow at least linearly with depth; a chain is the cheapest tree of depth m.
            let seconds =
                self.fixed + self.draft_per_forward * m as f64 + self.verify_seconds(m + 1);
            let rate = expected / seconds.max(1e-9);
            if rate > best_rate {
                best = m;
                best_rate = rate;
            }
        }
        let explore = self.plain_streak + 1 >= PLAIN_EXPLORE;
        if plain_rate > best_rate && !explore {
            0
        } else {
            best
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn top_k_tokens_are_the_first_k_of_a_full_sort(
            l in proptest::collection::vec(prop_oneof![Just(f32::NEG_INFINITY), Just(0.5f32), -4f32..4.0], 1..300),
            k in 1usize..12,
        ) {
            let mut order: Vec<u32> = (0..l.len() as u32).collect();
            order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
            order.truncate(k);
            prop_assert_eq!(top_k_tokens(&l, k), order);
        }
    }

    #[test]
    fn log_sum_exp_skips_tokens_outside_the_head() {
        let l = [0.0f32, f32::NEG_INFINITY, 2f32.ln(), f32::NEG_INFINITY];
        assert!((log_sum_exp(&l) - 3f64.ln()).abs() < 1e-6);
    }
}
