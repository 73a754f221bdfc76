//! Dynamic trees: best-first growth by the draft's path probabilities, to a node budget or
//! while each node pays at the measured costs.

use specinfer_model::ModelError;
use specinfer_wire::TokenTree;

use crate::select::{log_sum_exp, top_k_tokens};
use crate::speculator::Drafted;
use crate::DraftModel;

/// Best-first tree growth: candidates (a scored node's likely next tokens) are ranked by the
/// draft's log-probability of the whole path; each wave adds the best few and scores them in one
/// draft forward, as far as `growth` lets it.
pub(crate) fn dynamic_tree(
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
pub(crate) struct GrowthCosts {
    /// Seconds of a round besides the verifier's forward (round trip, queueing).
    pub(crate) fixed: f64,
    pub(crate) per_forward: f64,
    /// Verifier forward seconds for a tree of n nodes: `intercept + slope * n`.
    pub(crate) intercept: f64,
    pub(crate) slope: f64,
    /// Accepted tokens per unit of path probability.
    pub(crate) calibration: f64,
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
