//! When to hand the rest of an answer to the verifier's own decoding.
//!
//! A split round costs its user the round trip, the wait for a place in a forward, the forward
//! over the whole tree and the drafting; it costs the verifier's other users the tree's extra
//! nodes, at the price the verifier puts on a node ([`RoundStats::node_price_ns`]: its marginal
//! forward cost times the sessions sharing the forward). The verifier decoding the session on
//! its own (`Generate` with plain drafting, as a server-only deployment runs) costs one node per
//! token and no round trip: the session is in every forward, one token each, streamed.
//!
//! So per generated token, a split round is worth it only while
//! `(draft + round + (nodes - 1) * price) / tokens` stays under the forward a plain step takes.
//! On a verifier whose forward grows with every node (a CPU, or any engine under load) and with
//! a draft that gets one or two tokens per round, that fails under load and at long round
//! trips; then the answer is finished by the verifier, which an operator sees as a split that
//! never serves fewer users than server-only decoding, and a user as an answer no slower.
//! Both sides are measured from the verdicts alone (moving averages over the rounds after the
//! first, whose prefill and warm-up say nothing about the next round), so the decision follows
//! the verifier's load as it is now. The hand-off is final for the answer: the verifier streams
//! to the end ([`specinfer_wire::Message::Generate`]); the next answer starts split again.
//!
//! [`RoundStats::node_price_ns`]: specinfer_wire::RoundStats::node_price_ns

use specinfer_wire::Verified;

/// The two per-token costs, measured round by round (seconds).
#[derive(Clone, Debug, Default)]
pub struct HandOff {
    /// Verdicts seen, the first included.
    verdicts: usize,
    /// What a split round cost per token it committed, counting what its extra nodes cost the
    /// verifier's other users.
    split_per_token: f64,
    /// The forward of a plain step: the batch's forward without this tree's extra nodes.
    server_per_token: f64,
}

impl HandOff {
    /// Rounds measured (after the first) before the two costs are compared.
    pub const MIN_ROUNDS: usize = 4;
    /// The weight of the newest round in the moving averages.
    const SMOOTHING: f64 = 0.25;

    /// Takes the verdict on a split round: `round_s` from sending the tree to the verdict,
    /// `draft_s` spent drafting it, `tree_nodes` sent.
    pub fn observe(&mut self, v: &Verified, tree_nodes: usize, draft_s: f64, round_s: f64) {
        self.verdicts += 1;
        if self.verdicts == 1 || v.tokens.is_empty() {
            return;
        }
        let extra = tree_nodes.saturating_sub(1) as f64;
        let price = v.stats.node_price_ns as f64 * 1e-9;
        // The verifier's price is its marginal cost per node times the rounds sharing the
        // forward: this one's share is the marginal cost itself.
        let per_node = price / v.stats.batch_size.max(1) as f64;
        let forward = v.stats.forward_us as f64 * 1e-6;
        let split = (draft_s + round_s + extra * price) / v.tokens.len() as f64;
        let server = (forward - extra * per_node).max(forward / (1.0 + extra));
        let measured = self.verdicts - 1;
        let ema = |old: f64, new: f64| {
            if measured == 1 {
                new
            } else {
                (1.0 - Self::SMOOTHING) * old + Self::SMOOTHING * new
            }
        };
        self.split_per_token = ema(self.split_per_token, split);
        self.server_per_token = ema(self.server_per_token, server);
    }

    /// Whether the verifier decoding the rest on its own is cheaper per token than split rounds,
    /// once [`HandOff::MIN_ROUNDS`] rounds have been measured.
    pub fn server_is_cheaper(&self) -> bool {
        self.verdicts > Self::MIN_ROUNDS && self.split_per_token > self.server_per_token
    }

    /// `(split, server)` seconds per token as measured so far.
    pub fn per_token(&self) -> (f64, f64) {
        (self.split_per_token, self.server_per_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specinfer_wire::RoundStats;

    fn verdict(tokens: usize, batch: u32, forward_ms: f64, price_ms: f64) -> Verified {
        Verified {
            session: 1,
            round: 0,
            accepted_nodes: (1..tokens as u32).collect(),
            tokens: vec![7; tokens],
            finish: None,
            stats: RoundStats {
                batch_size: batch,
                forward_us: (forward_ms * 1e3) as u32,
                node_price_ns: (price_ms * 1e6) as u32,
                ..RoundStats::default()
            },
            features: None,
        }
    }

    #[test]
    fn an_idle_verifier_with_a_fixed_cost_per_forward_keeps_the_split() {
        // 12 ms per forward whatever its size, 0.1 ms per node, one session: 2 tokens from a
        // 6-node tree in 13 ms beat a 12 ms plain step per token.
        let mut h = HandOff::default();
        for _ in 0..10 {
            h.observe(&verdict(2, 1, 12.5, 0.1), 6, 0.0005, 0.013);
        }
        assert!(!h.server_is_cheaper(), "{:?}", h.per_token());
    }

    #[test]
    fn a_loaded_verifier_or_a_long_round_trip_hands_off() {
        // Eight sessions share 35 ms forwards, a node costs them 8 x 0.3 ms: 1.4 tokens from
        // 4 nodes, after waiting in the queue, lose to a 34 ms plain step.
        let mut loaded = HandOff::default();
        // A 14 ms round trip around a 16 ms forward, 1.3 tokens a round, idle verifier.
        let mut far = HandOff::default();
        for i in 0..=HandOff::MIN_ROUNDS {
            assert!(
                !loaded.server_is_cheaper() && !far.server_is_cheaper(),
                "round {i}"
            );
            loaded.observe(
                &verdict(if i % 2 == 0 { 1 } else { 2 }, 8, 35.0, 2.4),
                4,
                0.001,
                0.055,
            );
            far.observe(
                &verdict(if i % 3 == 0 { 2 } else { 1 }, 1, 16.0, 0.2),
                3,
                0.001,
                0.031,
            );
        }
        assert!(loaded.server_is_cheaper(), "{:?}", loaded.per_token());
        assert!(far.server_is_cheaper(), "{:?}", far.per_token());
    }
}
