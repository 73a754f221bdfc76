//! Dynamic trees: best-first growth by the draft's path probabilities, to a node budget or
//! while each node pays at the measured costs; their children the draft's likeliest tokens
//! (greedy) or draws from its distribution (sampling).

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{distribution, sample, top_k_sparse};
use specinfer_model::ModelError;
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

use crate::acceptance::{DrawAcceptance, DrawCell, SentDraws};
use crate::select::{log_sum_exp, top_k_tokens};
use crate::speculator::Drafted;
use crate::DraftModel;

/// A node gets at most this many children: past the eighth, a draft's next token is rarely
/// worth a node.
const CHILDREN_PER_NODE: usize = 8;

/// Best-first tree growth: candidates (a scored node's possible children) are ranked by their
/// value (what each would add to the expected accepted length, see [`Frontier::place`]); each
/// wave adds the best few and scores them in one draft forward, as far as `growth` lets it. `frontier` says what the candidates are: the
/// draft's likeliest tokens (greedy verification), or draws from its distribution (speculative
/// sampling).
pub(crate) fn dynamic_tree(
    model: &mut dyn DraftModel,
    committed: &[u32],
    budget: usize,
    growth: Growth,
    frontier: &mut dyn Frontier,
) -> Result<(TokenTree, Drafted), ModelError> {
    let mut tree = TokenTree::root(*committed.last().expect("committed tokens are never empty"));
    let mut drafted = Drafted::default();
    let mut values = vec![1f64];
    let wave = budget.div_ceil(6).max(1);
    let mut scored = 0;
    while tree.len() <= budget {
        let logits = model.extend(&tree, scored)?;
        drafted.forwards += 1;
        for (node, l) in (scored..tree.len()).zip(&logits) {
            frontier.score(node as u32, l, values[node], budget);
        }
        scored = tree.len();
        for i in 0..wave.min(budget + 1 - tree.len()) {
            let Some(value) = frontier.best() else {
                break;
            };
            if !growth.places(&tree, drafted, value, i == 0) {
                break;
            }
            let p = frontier.place(&mut tree);
            values.push(p);
            drafted.expected += p;
        }
        if tree.len() == scored {
            break;
        }
        // No candidate the next forward could add (the new nodes' children, no likelier than
        // their parents, or one already waiting) would pay for that forward: skip it.
        let bound = values[scored..]
            .iter()
            .copied()
            .chain(frontier.best())
            .fold(0f64, f64::max);
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

/// The candidate children of a growing dynamic tree.
pub(crate) trait Frontier {
    /// Adds the candidates of `node`, just scored by the draft (`logits`), whose value (see
    /// [`Frontier::place`]) is `value`.
    fn score(&mut self, node: u32, logits: &[f32], value: f64, budget: usize);
    /// The expected value of the child [`Frontier::place`] would add next.
    fn best(&mut self) -> Option<f64>;
    /// Adds that child to `tree`; returns its value: what it adds to the round's expected
    /// accepted length (the draft's probability of its path, or the chance the verifier
    /// accepts it), never more than its parent's.
    fn place(&mut self, tree: &mut TokenTree) -> f64;
}

/// Greedy verification: a node's candidates are the draft's likeliest tokens, ranked by the
/// path probability through them.
pub(crate) struct LikeliestTokens {
    /// (path log-probability, parent, token), sorted ascending when `sorted`.
    candidates: Vec<(f64, u32, u32)>,
    sorted: bool,
    /// Each placed node's path log-probability (kept in logs: the ranking compares them).
    path_logp: Vec<f64>,
}

impl Default for LikeliestTokens {
    fn default() -> Self {
        LikeliestTokens {
            candidates: Vec::new(),
            sorted: true,
            path_logp: vec![0.0],
        }
    }
}

impl Frontier for LikeliestTokens {
    fn score(&mut self, node: u32, l: &[f32], _path_p: f64, budget: usize) {
        let lse = log_sum_exp(l);
        let parent_logp = self.path_logp[node as usize];
        for t in top_k_tokens(l, CHILDREN_PER_NODE.min(budget)) {
            self.candidates
                .push((parent_logp + l[t as usize] as f64 - lse, node, t));
        }
        self.sorted = false;
    }

    fn best(&mut self) -> Option<f64> {
        if !self.sorted {
            // Best last; ties to the lower parent, then the lower token.
            self.candidates
                .sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
            self.sorted = true;
        }
        self.candidates.last().map(|c| c.0.exp())
    }

    fn place(&mut self, tree: &mut TokenTree) -> f64 {
        self.best();
        let (logp, parent, token) = self.candidates.pop().expect("placed after best()");
        tree.push(parent, token);
        self.path_logp.push(logp);
        logp.exp()
    }
}

/// Speculative sampling: a node's candidates are draws from the draft's distribution (after
/// temperature and top-p, truncated to its `top_k` likeliest tokens), made one at a time, i.i.d.
/// or without replacement; every draw is kept and declared with its proposal. The next draw is
/// made where it is likeliest to be accepted, as [`DrawAcceptance`] has learned from earlier
/// rounds: ranking draws by the draft's path probability instead gave held-out tau 1.92 where
/// this gives 2.01 (60 prompts x 64 tokens, T = 0.8, 32 nodes, context lookup on).
///
/// Why the LLM's distribution survives: the verifier walks a node's children in draw order and
/// accepts child j with min(1, r_j(x_j)/q_j(x_j)), where r_j is the residual target after the
/// earlier children were rejected and q_j the distribution x_j was drawn from; the token it
/// emits at that node is then distributed as r_j, whatever happens after a rejection, so as r_1
/// = p by induction. That induction needs each x_j to be a draw from q_j given everything before
/// it; it does not need the number of draws, or which nodes are expanded, to be fixed: here they
/// follow the draft's probabilities, the draws already made (a draw is decided before it is
/// made and never dropped after) and earlier rounds' verdicts, and never the LLM's verdict on
/// this tree, whose randomness is the verifier's own.
/// Below an accepted child the same holds for its subtree, whatever its shape.
pub(crate) struct DrawnTokens<'r> {
    temperature: f32,
    top_p: f32,
    top_k: usize,
    draw: DrawMode,
    rng: &'r mut ChaCha8Rng,
    acceptance: &'r DrawAcceptance,
    open: Vec<OpenNode>,
    dists: Vec<SparseDist>,
    drawn_from: Vec<u32>,
    /// Each placed node's parent and cell, for learning from the verdict.
    draws: SentDraws,
}

/// A scored node that may get more children.
struct OpenNode {
    node: u32,
    /// Index of its proposal in `dists`.
    dist: usize,
    /// The chance the verifier reaches this node and tries its next draw: that it accepts the
    /// node, and rejects the children drawn so far.
    reached: f64,
    /// Its proposal's tokens not drawn yet.
    undrawn: Vec<bool>,
    children: usize,
    /// The value of its next draw ([`DrawnTokens::next_value`]), kept until it draws.
    next: f64,
}

impl<'r> DrawnTokens<'r> {
    pub(crate) fn new(
        temperature: f32,
        top_p: f32,
        top_k: usize,
        draw: DrawMode,
        rng: &'r mut ChaCha8Rng,
        acceptance: &'r DrawAcceptance,
    ) -> Self {
        DrawnTokens {
            temperature,
            top_p,
            top_k,
            draw,
            rng,
            acceptance,
            open: Vec::new(),
            dists: Vec::new(),
            drawn_from: Vec::new(),
            draws: SentDraws::default(),
        }
    }

    /// The weights `o`'s next draw is made with: its proposal, without the tokens drawn already
    /// when drawing without replacement (unnormalised).
    fn next_weights(&self, o: &OpenNode) -> Vec<f32> {
        let probs = &self.dists[o.dist].probs;
        match self.draw {
            DrawMode::WithoutReplacement => probs
                .iter()
                .zip(&o.undrawn)
                .map(|(&w, &u)| if u { w } else { 0.0 })
                .collect(),
            DrawMode::Iid => probs.clone(),
        }
    }

    /// The chance that `o`'s next draw is accepted: that the verifier tries it, times the
    /// learned acceptance of the cell the drawn token falls in, averaged over the draw. A
    /// repeated token (drawing i.i.d.) adds nothing.
    fn next_value(&self, o: &OpenNode) -> f64 {
        let weights = self.next_weights(o);
        let mass: f32 = weights.iter().sum();
        if mass <= 0.0 {
            return 0.0;
        }
        let expected: f64 = weights
            .iter()
            .zip(&o.undrawn)
            .filter(|&(&w, &u)| u && w > 0.0)
            .map(|(&w, _)| {
                let q = w / mass;
                f64::from(q) * self.acceptance.rate(DrawCell::new(o.children, q))
            })
            .sum();
        o.reached * expected
    }

    /// The best open node's index in `open`, with its next draw's value (ties to the lower
    /// node).
    fn best_open(&self) -> Option<(usize, f64)> {
        self.open
            .iter()
            .enumerate()
            .map(|(i, o)| (i, o.next))
            .filter(|&(_, v)| v > 0.0)
            .fold(None, |best: Option<(usize, f64)>, (i, v)| match best {
                Some((_, bv)) if bv >= v => best,
                _ => Some((i, v)),
            })
    }

    /// `tree` with its proposals: the distributions children were drawn from (those of nodes
    /// that got none are left out); and what was drawn where, to learn from its verdict.
    pub(crate) fn attach(self, tree: TokenTree) -> (TokenTree, SentDraws) {
        let mut used: Vec<Option<u32>> = vec![None; self.dists.len()];
        let mut dists = Vec::new();
        for &d in &self.drawn_from {
            if used[d as usize].is_none() {
                used[d as usize] = Some(dists.len() as u32);
                dists.push(self.dists[d as usize].clone());
            }
        }
        let drawn_from = self
            .drawn_from
            .iter()
            .map(|&d| used[d as usize].expect("every draw's proposal is kept"))
            .collect();
        let tree = tree
            .with_proposals(Proposals {
                mode: self.draw,
                dists,
                drawn_from,
            })
            .expect("a sampled dynamic tree declares every draw's proposal");
        (tree, self.draws)
    }
}

impl Frontier for DrawnTokens<'_> {
    fn score(&mut self, node: u32, l: &[f32], reached: f64, _budget: usize) {
        let q = distribution(l, self.temperature, 0, self.top_p);
        let (ids, probs) = top_k_sparse(&q, self.top_k);
        let undrawn = vec![true; ids.len()];
        let mut open = OpenNode {
            node,
            dist: self.dists.len(),
            reached,
            undrawn,
            children: 0,
            next: 0.0,
        };
        self.dists.push(SparseDist { node, ids, probs });
        open.next = self.next_value(&open);
        self.open.push(open);
    }

    fn best(&mut self) -> Option<f64> {
        self.best_open().map(|(_, v)| v)
    }

    fn place(&mut self, tree: &mut TokenTree) -> f64 {
        let (i, _) = self.best_open().expect("placed after best()");
        let weights = self.next_weights(&self.open[i]);
        let k = sample(&weights, self.rng.random());
        let q = weights[k] / weights.iter().sum::<f32>();
        let o = &mut self.open[i];
        let cell = DrawCell::new(o.children, q);
        let rate = self.acceptance.rate(cell);
        let token = self.dists[o.dist].ids[k];
        tree.push(o.node, token);
        self.draws.nodes.push((o.node, cell));
        self.drawn_from.push(o.dist as u32);
        let accepted = o.reached * rate;
        o.undrawn[k] = false;
        o.children += 1;
        o.reached *= 1.0 - rate;
        if o.children >= CHILDREN_PER_NODE {
            self.open.swap_remove(i);
        } else {
            self.open[i].next = self.next_value(&self.open[i]);
        }
        accepted
    }
}

/// How far a dynamic tree grows.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Growth {
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
pub struct GrowthCosts {
    /// Seconds of a round besides the verifier's forward (round trip, queueing).
    pub fixed: f64,
    /// Seconds of one draft forward.
    pub per_forward: f64,
    /// Verifier forward seconds for a tree of n nodes: `intercept + slope * n` (the slope at
    /// least the verifier's price of a node).
    pub intercept: f64,
    pub slope: f64,
    /// Accepted tokens per unit of path probability.
    pub calibration: f64,
}

impl GrowthCosts {
    /// How many nodes of a tree already drafted (path probabilities `path_p` of its non-root
    /// nodes, best first, as a dynamic tree places them) a tree grown while paying would send,
    /// the root included: what a client that replays recorded trees sends at these costs. Its
    /// drafting is already paid, so no draft forward is charged.
    pub fn paying_prefix(&self, path_p: &[f64]) -> usize {
        let costs = GrowthCosts {
            per_forward: 0.0,
            ..*self
        };
        let mut expected = 0.0;
        for (i, &p) in path_p.iter().enumerate() {
            let so_far = Drafted {
                forwards: 1,
                expected,
            };
            if !costs.pays_at(i + 1, so_far, p, false) {
                return i + 1;
            }
            expected += p;
        }
        path_p.len() + 1
    }

    /// Whether adding a node with path probability `p` to `tree` (built with `so_far`'s
    /// forwards) raises the round's expected tokens per second. Each draft forward is charged
    /// to the first node of the wave it scored the parents of, so the first node must also pay
    /// for the root's forward: a draft that cannot is switched off.
    fn pays(&self, tree: &TokenTree, so_far: Drafted, p: f64, first_of_wave: bool) -> bool {
        self.pays_at(tree.len(), so_far, p, first_of_wave)
    }

    /// [`GrowthCosts::pays`] for a tree of `nodes` nodes.
    fn pays_at(&self, nodes: usize, so_far: Drafted, p: f64, first_of_wave: bool) -> bool {
        let charged_forwards = so_far.forwards - usize::from(first_of_wave);
        let tokens = 1.0 + self.calibration * so_far.expected;
        let seconds = self.fixed
            + self.intercept
            + self.slope * nodes as f64
            + self.per_forward * charged_forwards as f64;
        let cost = self.slope + if first_of_wave { self.per_forward } else { 0.0 };
        self.calibration * p * seconds > tokens * cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(fixed: f64, slope: f64) -> GrowthCosts {
        GrowthCosts {
            fixed,
            per_forward: 0.0,
            intercept: 0.001,
            slope,
            calibration: 1.0,
        }
    }

    #[test]
    fn the_paying_prefix_shrinks_as_nodes_get_dearer() {
        let path_p = [0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05];
        // Behind a 50 ms round trip, nearly free nodes all pay.
        assert_eq!(costs(0.05, 1e-6).paying_prefix(&path_p), 8);
        // A node priced at ten rounds never pays: the root alone.
        assert_eq!(costs(0.05, 0.5).paying_prefix(&path_p), 1);
        let sizes: Vec<usize> = [1e-6, 1e-3, 5e-3, 2e-2, 1e-1]
            .iter()
            .map(|&slope| costs(0.05, slope).paying_prefix(&path_p))
            .collect();
        assert!(
            sizes.windows(2).all(|w| w[0] >= w[1]),
            "dearer nodes never grow the tree: {sizes:?}"
        );
        assert!(sizes[0] > sizes[4], "{sizes:?}");
        assert_eq!(costs(0.05, 1.0).paying_prefix(&[]), 1, "the root alone");
    }
}
