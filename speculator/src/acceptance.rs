//! What a drawn child is worth: the chance that recursive rejection sampling accepts it, learned
//! from past verdicts.
//!
//! A sampled dynamic tree ranks its candidate draws by the chance each would be accepted. The
//! draft's own probabilities say little about that: the verifier accepts a first draw x with
//! min(1, p(x)/q(x)), which averages to sum min(p, q) over the draft's distribution q, so a draw
//! from a flat q (each token unlikely) is still often accepted when the LLM is as unsure, and a
//! later draw of the same node faces the residual left by its rejected siblings. So the value of
//! a draw is learned instead, per cell (its place among its siblings, and the probability it was
//! drawn with), as the accepted fraction of the draws of that cell that the verifier tried: those
//! of a node the accepted path reached, up to and including its accepted child.
//!
//! The tree's shape then follows past rounds' verdicts as well as the draft's probabilities and
//! draws; never the verdict on the tree itself (it is drafted before it is sent), so each draw is
//! still a draw from its declared proposal given everything before it, which is all the
//! verifier's induction needs (see [`crate::dynamic::DrawnTokens`]).

/// Draws are told apart by their place among their siblings: first, second, third or later.
const PLACES: usize = 3;

/// Upper edges of the buckets of the probability a token was drawn with (from its node's
/// distribution, renormalised over the tokens not drawn yet when drawing without replacement).
const BUCKET_EDGES: [f32; 8] = [0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85];
const BUCKETS: usize = BUCKET_EDGES.len() + 1;

/// How many tried draws the prior of each cell counts for.
const PRIOR_WEIGHT: f64 = 6.0;

/// One cell of [`DrawAcceptance`]: where a draw sits among its siblings and the probability it
/// was drawn with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DrawCell(u8);

impl DrawCell {
    /// The cell of the `place`-th draw of its node (0 for the first), drawn with probability `q`.
    pub(crate) fn new(place: usize, q: f32) -> Self {
        let bucket = BUCKET_EDGES.iter().take_while(|&&e| q >= e).count();
        DrawCell((place.min(PLACES - 1) * BUCKETS + bucket) as u8)
    }

    fn index(self) -> usize {
        self.0 as usize
    }
}

/// The drawn children of one sent tree: for each node after the root, in order, its parent and
/// cell (the tree's later nodes, added by the lookup, are not listed).
#[derive(Clone, Debug, Default)]
pub(crate) struct SentDraws {
    pub(crate) nodes: Vec<(u32, DrawCell)>,
}

/// The learned chance that the verifier accepts a draw it tries, per [`DrawCell`].
#[derive(Clone, Debug)]
pub struct DrawAcceptance {
    accepted: [f64; PLACES * BUCKETS],
    tried: [f64; PLACES * BUCKETS],
}

/// The prior's acceptance rates, per place (first, second, third or later draw) and bucket:
/// measured with the default pair (SmolLM2-135M verifying the default SSM, T = 0.8, dynamic
/// trees of 32 nodes drawn without replacement, the context lookup on) on 60 training prompts x
/// 64 tokens, 15,000 tried draws; smoothed to rise with the bucket. Draws are accepted far more
/// evenly than their probabilities suggest, and a node's later draws rarely.
const PRIOR_RATES: [[f64; BUCKETS]; PLACES] = [
    [0.20, 0.20, 0.20, 0.23, 0.25, 0.28, 0.40, 0.46, 0.74],
    [0.07, 0.07, 0.08, 0.09, 0.13, 0.15, 0.19, 0.27, 0.50],
    [0.04, 0.04, 0.04, 0.04, 0.06, 0.09, 0.13, 0.21, 0.40],
];

impl Default for DrawAcceptance {
    /// [`PRIOR_RATES`], worth [`PRIOR_WEIGHT`] tried draws per cell: another pair's own rates
    /// take over within a few rounds.
    fn default() -> Self {
        let mut accepted = [0.0; PLACES * BUCKETS];
        let tried = [PRIOR_WEIGHT; PLACES * BUCKETS];
        for (i, rate) in PRIOR_RATES.iter().flatten().enumerate() {
            accepted[i] = PRIOR_WEIGHT * rate;
        }
        DrawAcceptance { accepted, tried }
    }
}

impl DrawAcceptance {
    /// The chance the verifier accepts a draw of `cell` if it tries it.
    pub(crate) fn rate(&self, cell: DrawCell) -> f64 {
        self.accepted[cell.index()] / self.tried[cell.index()]
    }

    /// Learns from the verdict on a sent tree: `accepted_nodes` its accepted path, root to leaf.
    /// The verifier walks a reached node's children in index order (the draws first, in the
    /// order they were made, then the lookup's nodes) until one is accepted, so every draw of a
    /// reached node up to its accepted child was tried.
    pub(crate) fn observe(&mut self, sent: &SentDraws, accepted_nodes: &[u32]) {
        let reached = std::iter::once(0).chain(accepted_nodes.iter().map(|&n| n as usize));
        for (depth, node) in reached.enumerate() {
            let next = accepted_nodes.get(depth).map(|&n| n as usize);
            // Node i + 1 is listed at i; a node's children come after it.
            for (i, &(parent, cell)) in sent.nodes.iter().enumerate().skip(node) {
                if parent as usize != node {
                    continue;
                }
                self.tried[cell.index()] += 1.0;
                if Some(i + 1) == next {
                    self.accepted[cell.index()] += 1.0;
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prior_rises_with_the_draw_probability_and_falls_with_the_place() {
        let a = DrawAcceptance::default();
        let firsts: Vec<f64> = [0.01, 0.1, 0.4, 0.9]
            .iter()
            .map(|&q| a.rate(DrawCell::new(0, q)))
            .collect();
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{firsts:?}");
        assert!(a.rate(DrawCell::new(1, 0.3)) < a.rate(DrawCell::new(0, 0.3)));
        assert_eq!(DrawCell::new(2, 0.3), DrawCell::new(7, 0.3));
    }

    #[test]
    fn a_verdict_counts_the_tried_draws_of_reached_nodes_only() {
        // Root: draws 1 (rejected) and 2 (accepted); node 2: draw 3 (rejected); node 1's
        // child 4 was never tried (nor would be a node 5 the lookup added: it is not listed).
        let first = DrawCell::new(0, 0.5);
        let second = DrawCell::new(1, 0.3);
        let sent = SentDraws {
            nodes: vec![(0, first), (0, second), (2, first), (1, first)],
        };
        let mut a = DrawAcceptance::default();
        let before = a.clone();
        a.observe(&sent, &[2]);
        let (i, j) = (first.index(), second.index());
        assert_eq!(a.tried[i] - before.tried[i], 2.0, "draws 1 and 3");
        assert_eq!(a.accepted[i], before.accepted[i], "neither accepted");
        assert_eq!(a.tried[j] - before.tried[j], 1.0);
        assert_eq!(a.accepted[j] - before.accepted[j], 1.0);
        assert!(a.rate(second) > before.rate(second));
        assert!(a.rate(first) < before.rate(first));
    }
}
