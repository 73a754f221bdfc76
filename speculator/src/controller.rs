//! The adaptive controllers: what a round measured, and the tree depth (or chain length) that
//! maximises tokens per second given it.

use specinfer_wire::TokenTree;

use crate::dynamic::GrowthCosts;

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
        queue_s: f64,
        forward_s: f64,
    ) -> RoundObservation {
        RoundObservation {
            tree_depth: self.depth,
            tree_nodes,
            drafted_nodes: self.nodes,
            accepted: accepted_nodes
                .iter()
                .take_while(|&&n| (n as usize) < self.nodes)
                .count(),
            draft_s,
            round_s,
            queue_s,
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
    /// Nodes of the tree the draft model proposed, the root included (they come first).
    pub drafted_nodes: usize,
    /// Drafted tokens the verifier accepted (the accepted path's length).
    pub accepted: usize,
    /// Seconds spent drafting the tree.
    pub draft_s: f64,
    /// Seconds from sending the tree to having the answer (network + queue + forward).
    pub round_s: f64,
    /// Seconds the tree waited at the verifier for a place in a forward (from the round's
    /// stats).
    pub queue_s: f64,
    /// Seconds the verifier spent in its forward pass (from the round's stats).
    pub forward_s: f64,
}

/// Chooses the tree depth m that maximises expected tokens per second,
/// `E[tokens | m] / E[seconds | m]`, from what past rounds measured:
/// * acceptance: the chance a drafted token at depth d is accepted given depth d-1 was, counted
///   per depth (with a prior of 1 success in 2, and a depth never tried assumed as good as the
///   one above it, so the controller keeps exploring);
/// * cost: drafting time per level and the fixed part of a round (round trip, client work) as
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
    /// Forward seconds against tree nodes.
    verify_cost: AffineFit,
    fixed: f64,
    rounds: usize,
    /// Rounds at depth 0 since the last one that speculated.
    plain_streak: usize,
    /// The verifier's price of a tree node (seconds; see [`DepthController::set_node_price`]).
    node_price: f64,
}

/// At depth 0, one round in this many speculates (see [`DepthController`]).
pub const PLAIN_EXPLORE: usize = 16;

impl DepthController {
    /// The weight of the newest round in the moving averages of drafting and fixed costs.
    const SMOOTHING: f64 = 0.2;

    pub fn new(max_depth: usize) -> Self {
        DepthController {
            max_depth,
            reached: vec![0.0; max_depth + 1],
            accepted: vec![0.0; max_depth + 1],
            draft_per_forward: 0.0,
            verify_cost: AffineFit::default(),
            fixed: 0.0,
            rounds: 0,
            plain_streak: 0,
            node_price: 0.0,
        }
    }

    /// What one more tree node costs the verifier's users now, as the verifier last said
    /// (seconds): the cost per node weighed is never below it. A verifier under load prices
    /// nodes at its marginal forward cost times the sessions sharing its forwards, so trees
    /// shrink towards the root alone; idle, it prices them at its marginal cost and they grow
    /// while they pay.
    pub fn set_node_price(&mut self, seconds: f64) {
        self.node_price = seconds.max(0.0);
    }

    /// Expected forward seconds for a tree of `nodes` nodes: the affine fit, or (while every
    /// observed tree had one size) proportional to the node count.
    fn verify_seconds(&self, nodes: usize) -> f64 {
        let (intercept, slope) = self.verify_fit();
        intercept + slope * nodes as f64
    }

    /// `(intercept, slope)` of [`DepthController::verify_seconds`].
    fn verify_fit(&self) -> (f64, f64) {
        let (intercept, slope) = self.verify_cost.line();
        (intercept, slope.max(self.node_price))
    }

    /// The costs a growing dynamic tree weighs, with `calibration` accepted tokens per unit of
    /// path probability; `None` before any round was measured.
    pub fn growth_costs(&self, calibration: f64) -> Option<GrowthCosts> {
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
        let ema = |old: f64, new: f64, n: usize| {
            if n == 0 {
                new
            } else {
                (1.0 - Self::SMOOTHING) * old + Self::SMOOTHING * new
            }
        };
        if draft_forwards > 0 {
            self.draft_per_forward = ema(
                self.draft_per_forward,
                o.draft_s / draft_forwards as f64,
                self.rounds,
            );
        }
        self.verify_cost
            .observe(o.tree_nodes.max(1) as f64, o.forward_s);
        self.plain_streak = if o.tree_depth == 0 {
            self.plain_streak + 1
        } else {
            0
        };
        // The verifier's queueing is left out: it is other sessions' work, which a larger tree
        // does not save. Counted, it made trees grow exactly when the verifier had no room (the
        // queue grows, each token looks worth more, trees grow, the queue grows).
        self.fixed = ema(
            self.fixed,
            (o.round_s - o.forward_s - o.queue_s).max(0.0),
            self.rounds,
        );
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

/// A line fitted by least squares to points whose weights decay with age: tracks a cost that
/// drifts (a verifier getting busier) without forgetting the tree sizes seen long ago.
#[derive(Clone, Copy, Debug, Default)]
pub struct AffineFit {
    weight: f64,
    sum_x: f64,
    sum_y: f64,
    sum_xx: f64,
    sum_xy: f64,
}

impl AffineFit {
    /// Each round's weight decays by this per round (halved in about 14 rounds).
    const DECAY: f64 = 0.95;

    pub fn observe(&mut self, x: f64, y: f64) {
        let d = Self::DECAY;
        self.weight = d * self.weight + 1.0;
        self.sum_x = d * self.sum_x + x;
        self.sum_y = d * self.sum_y + y;
        self.sum_xx = d * self.sum_xx + x * x;
        self.sum_xy = d * self.sum_xy + x * y;
    }

    /// `(intercept, slope)`, neither negative; while every point had one x (one tree size), a
    /// line through the origin.
    pub fn line(&self) -> (f64, f64) {
        let w = self.weight;
        if w <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (self.sum_x / w, self.sum_y / w);
        let var = self.sum_xx / w - mx * mx;
        if var > 1e-6 * mx * mx.max(1.0) {
            let slope = ((self.sum_xy / w - mx * my) / var).max(0.0);
            ((my - slope * mx).max(0.0), slope)
        } else {
            (0.0, my / mx.max(1.0))
        }
    }
}

/// How many accepted tokens one unit of a dynamic tree's path probability has been worth:
/// decayed sums over its rounds of the draft nodes accepted and of the acceptance their path
/// probabilities predicted.
#[derive(Clone, Copy, Debug, Default)]
pub struct Calibration {
    accepted: f64,
    predicted: f64,
}

impl Calibration {
    const DECAY: f64 = 0.95;

    pub fn observe(&mut self, accepted: usize, predicted: f64) {
        self.accepted = Self::DECAY * self.accepted + accepted as f64;
        self.predicted = Self::DECAY * self.predicted + predicted;
    }

    /// 1 for a calibrated draft; a prior of one round worth 1 keeps it finite and moving.
    pub fn factor(&self) -> f64 {
        (self.accepted + 1.0) / (self.predicted + 1.0)
    }
}

/// What trying to draft has been worth to an adaptive dynamic tree, next to plain decoding:
/// decayed sums over the rounds it drafted for (whether or not the tree grew past the root) of
/// the tokens they gave and the seconds they took, drafting included, and their decayed count.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DraftAttempts {
    tokens: f64,
    seconds: f64,
    count: f64,
    /// Rounds since the last one drafted for.
    since_last: usize,
}

impl DraftAttempts {
    const DECAY: f64 = 0.9;
    /// The (decayed) number of drafted rounds needed before drafting may be judged not worth
    /// trying: one unlucky round must not switch drafting off.
    const MIN_COUNT: f64 = 4.0;

    pub(crate) fn observe_drafted(&mut self, tokens: usize, seconds: f64) {
        self.tokens = Self::DECAY * self.tokens + tokens as f64;
        self.seconds = Self::DECAY * self.seconds + seconds;
        self.count = Self::DECAY * self.count + 1.0;
        self.since_last = 0;
    }

    pub(crate) fn observe_plain(&mut self) {
        self.since_last += 1;
    }

    /// Whether the next round should draft: a draft forward is paid before the draft's
    /// confidence says whether any node is worth verifying, so this is learned from the rounds
    /// that tried (their tokens per second against plain decoding's), with a try now and then.
    pub(crate) fn worth_trying(&self, plain_seconds: f64) -> bool {
        self.count < Self::MIN_COUNT
            || self.tokens / self.seconds >= 1.0 / plain_seconds
            || self.since_last + 1 >= PLAIN_EXPLORE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller after rounds of a 4-node tree: a 2 ms round trip, a 10 ms forward, and
    /// `queue_s` spent waiting at the verifier for a place in a forward.
    fn measured(queue_s: f64) -> DepthController {
        let mut c = DepthController::new(0);
        for _ in 0..20 {
            c.observe(
                RoundObservation {
                    tree_depth: 2,
                    tree_nodes: 4,
                    drafted_nodes: 4,
                    accepted: 1,
                    draft_s: 0.0,
                    round_s: 0.002 + queue_s + 0.010,
                    queue_s,
                    forward_s: 0.010,
                },
                0,
            );
        }
        c
    }

    #[test]
    fn waiting_in_a_busy_verifiers_queue_does_not_make_nodes_worth_more() {
        let path_p = [0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05];
        let idle = measured(0.0).growth_costs(1.0).unwrap();
        let busy = measured(0.050).growth_costs(1.0).unwrap();
        assert!((idle.fixed - 0.002).abs() < 1e-9, "{}", idle.fixed);
        assert!((busy.fixed - 0.002).abs() < 1e-9, "{}", busy.fixed);
        assert_eq!(idle.paying_prefix(&path_p), 2);
        assert_eq!(busy.paying_prefix(&path_p), 2);
    }
}
