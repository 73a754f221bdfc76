//! What a generated token costs on this verifier now, split and plain, as every session that
//! opens is told ([`VerifierCosts`]): a client then knows before its first round whether
//! sending trees pays, instead of learning it from rounds that cost the verifier's other users
//! their extra nodes. Kept from every session's rounds, so the first rounds of one answer
//! inform the start of the next.

use std::time::{Duration, Instant};

use specinfer_wire::VerifierCosts;

/// Moving averages of the verifier's recent forwards and client-drafted rounds.
#[derive(Debug, Default)]
pub struct CostBook {
    /// Seconds of forward a session's plain step costs (per batch).
    plain_step_s: Option<f64>,
    /// Seconds a client-drafted round cost at the verifier, its extra nodes priced.
    split_round_s: Option<f64>,
    /// Tokens those rounds committed.
    split_tokens: Option<f64>,
    last_split: Option<Instant>,
}

impl CostBook {
    /// Split rounds older than this say nothing about the verifier's load now; then sessions
    /// are told nothing of the split, so one of them measures it again even while every other
    /// hands its answer to the verifier.
    pub const SPLIT_FRESH_FOR: Duration = Duration::from_secs(10);
    /// The weight of the newest observation in the moving averages.
    const SMOOTHING: f64 = 0.1;

    fn ema(old: &mut Option<f64>, new: f64) {
        *old = Some(match *old {
            Some(o) => (1.0 - Self::SMOOTHING) * o + Self::SMOOTHING * new,
            None => new,
        });
    }

    /// Takes a batched forward of `forward_s` seconds over `nodes` nodes (trees and prompt
    /// chunks) holding `rounds` verification rounds, with the fitted marginal cost per node:
    /// had every round been one node and no prompt shared it, the forward would have cost
    /// `forward_s - (nodes - rounds) * per_node_s`, which is what a plain step costs each of
    /// its sessions.
    pub fn forward(&mut self, forward_s: f64, nodes: usize, rounds: usize, per_node_s: f64) {
        if rounds == 0 || nodes == 0 {
            return;
        }
        let extra = nodes.saturating_sub(rounds) as f64;
        let plain =
            (forward_s - extra * per_node_s.max(0.0)).max(forward_s * rounds as f64 / nodes as f64);
        Self::ema(&mut self.plain_step_s, plain);
    }

    /// Takes a client-drafted round of `tree_nodes` that committed `tokens`: it waited
    /// `queue_s`, its forward took `forward_s`, and each extra node cost the forward's other
    /// rounds `others_per_node_s` (the marginal cost per node times their number; as in
    /// [`specinfer_speculator::HandOff`]).
    pub fn split_round(
        &mut self,
        tokens: usize,
        tree_nodes: usize,
        queue_s: f64,
        forward_s: f64,
        others_per_node_s: f64,
        now: Instant,
    ) {
        if tree_nodes < 2 || tokens == 0 {
            return;
        }
        let extra = (tree_nodes - 1) as f64;
        Self::ema(
            &mut self.split_round_s,
            queue_s + forward_s + extra * others_per_node_s,
        );
        Self::ema(&mut self.split_tokens, tokens as f64);
        self.last_split = Some(now);
    }

    /// What a session opening `now` is told.
    pub fn now(&self, now: Instant) -> VerifierCosts {
        let fresh = self
            .last_split
            .is_some_and(|t| now.saturating_duration_since(t) < Self::SPLIT_FRESH_FOR);
        // A field, `per_unit` to one, 0 when unknown (or, for the split's, stale).
        let field = |v: Option<f64>, per_unit: f64, told: bool| {
            v.filter(|_| told)
                .map_or(0, |v| (v * per_unit).clamp(0.0, u32::MAX as f64) as u32)
        };
        VerifierCosts {
            plain_step_us: field(self.plain_step_s, 1e6, true),
            split_round_us: field(self.split_round_s, 1e6, fresh),
            split_tokens_milli: field(self.split_tokens, 1e3, fresh),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loaded_verifier_tells_a_distant_client_that_the_split_does_not_pay() {
        let mut book = CostBook::default();
        let t0 = Instant::now();
        assert_eq!(book.now(t0).per_token(0.0), None, "nothing measured yet");
        // Eight rounds of 4-node trees share 20 ms forwards at 0.5 ms per node; each commits
        // 1.5 tokens after 5 ms in the queue.
        for i in 0..40 {
            book.forward(0.020, 32, 8, 0.0005);
            book.split_round(1 + i % 2, 4, 0.005, 0.020, 7.0 * 0.0005, t0);
        }
        let costs = book.now(t0 + Duration::from_secs(1));
        let (split, plain) = costs.per_token(0.014).expect("both measured");
        // A plain step: 20 ms less 24 extra nodes at 0.5 ms.
        assert!((plain - 0.008).abs() < 1e-4, "{plain}");
        // (14 + 5 + 20 + 3 x 3.5 ms) / 1.5 tokens = 33 ms.
        assert!((split - 0.033).abs() < 2e-3, "{split}");
        assert!(split > plain);
        // An idle verifier whose forward is mostly fixed: 3 tokens from 6 nodes in 12.5 ms
        // beat a 12 ms plain step for a client next door; alone in the forward, its extra
        // nodes cost nobody else.
        let mut idle = CostBook::default();
        for _ in 0..40 {
            idle.forward(0.0125, 6, 1, 0.0001);
            idle.split_round(3, 6, 0.0, 0.0125, 0.0, t0);
        }
        let (split, plain) = idle.now(t0).per_token(0.0005).unwrap();
        assert!(split < plain, "{split} {plain}");
    }

    #[test]
    fn split_rounds_age_out_and_plain_trees_are_not_split_rounds() {
        let mut book = CostBook::default();
        let t0 = Instant::now();
        book.forward(0.010, 1, 1, 0.001);
        book.split_round(1, 1, 0.0, 0.010, 0.001, t0);
        let told = book.now(t0);
        assert_eq!((told.plain_step_us, told.split_round_us), (10_000, 0));
        book.split_round(2, 3, 0.0, 0.010, 0.001, t0);
        assert_eq!(book.now(t0).split_tokens_milli, 2000);
        let later = book.now(t0 + CostBook::SPLIT_FRESH_FOR);
        assert_eq!(
            (
                later.split_round_us,
                later.split_tokens_milli,
                later.plain_step_us
            ),
            (0, 0, 10_000)
        );
    }
}
