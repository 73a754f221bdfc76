//! When to hand the rest of an answer to the verifier's own decoding.
//!
//! A split round costs its user the round trip, the wait for a place in a forward, the forward
//! over the whole tree and the drafting; it costs the verifier's other users the tree's extra
//! nodes, at the price the verifier puts on a node ([`RoundStats::node_price_ns`]: its marginal
//! forward cost times the sessions sharing the forward) less this session's own share, which
//! its round already paid (alone in a forward, extra nodes cost nobody else anything, and an
//! idle verifier's split is judged by its user's time alone). The verifier decoding the session on
//! its own (`Generate` with plain drafting, as a server-only deployment runs) costs one node per
//! token and no round trip: the session is in every forward, one token each, streamed.
//!
//! So per generated token, a split round is worth it only while
//! `(draft + round + (nodes - 1) * others' price) / tokens` stays under the forward a plain step
//! takes.
//! On a verifier whose forward grows with every node (a CPU, or any engine under load) and with
//! a draft that gets one or two tokens per round, that fails under load and at long round
//! trips; then the answer is finished by the verifier, which an operator sees as a split that
//! never serves fewer users than server-only decoding, and a user as an answer no slower.
//! Both sides are measured from the verdicts alone (moving averages over the rounds after the
//! first, whose warm-up says nothing about the next round), so the decision follows the
//! verifier's load as it is now. Before the first round they start from what the verifier
//! said when the session opened ([`VerifierCosts`]: its plain step and its recent split rounds,
//! every session's) with this client's round trip, so a split that does not pay sends no tree
//! at all; the client's drafting is left out of that start, which only ever favours the split,
//! and its own rounds then correct it. The hand-off is final for the answer: the verifier streams
//! to the end ([`specinfer_wire::Message::Generate`]); the next answer decides again from what
//! its session is told.
//!
//! [`RoundStats::node_price_ns`]: specinfer_wire::RoundStats::node_price_ns

use specinfer_wire::{Verified, VerifierCosts};

/// The two per-token costs, measured round by round (seconds).
#[derive(Clone, Debug, Default)]
pub struct HandOff {
    /// Verdicts seen, the first included.
    verdicts: usize,
    /// Rounds the averages stand for: those measured, or [`HandOff::MIN_ROUNDS`] for costs the
    /// verifier gave ([`HandOff::start_from`]).
    measured: usize,
    /// What a split round cost per token it committed, counting what its extra nodes cost the
    /// verifier's other users.
    split_per_token: f64,
    /// The forward of a plain step: the batch's forward without this tree's extra nodes.
    server_per_token: f64,
    /// Tokens per round the context lookup's chain held (moving average), which the
    /// verifier's own rounds keep after the hand-off ([`specinfer_wire::ServerDrafting::Lookup`]):
    /// its plain step then commits `1 + lookup_per_round` tokens. Zero without a lookup.
    lookup_per_round: f64,
}

impl HandOff {
    /// Rounds measured (after the first) before the two costs are compared.
    pub const MIN_ROUNDS: usize = 4;
    /// The weight of the newest round in the moving averages.
    const SMOOTHING: f64 = 0.25;

    /// Starts the averages from the verifier's costs for a client `rtt_s` away, as if
    /// [`HandOff::MIN_ROUNDS`] rounds had measured them, unless rounds were measured already
    /// (a session re-opened after a lost connection keeps what its rounds said). Costs the
    /// verifier could not give leave it as it was.
    pub fn start_from(&mut self, costs: &VerifierCosts, rtt_s: f64) {
        if self.measured > 0 {
            return;
        }
        if let Some((split, plain)) = costs.per_token(rtt_s) {
            self.split_per_token = split;
            self.server_per_token = plain;
            self.measured = Self::MIN_ROUNDS;
        }
    }

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
        // forward: this one's share is the marginal cost itself, already in `round_s`; the
        // rest is what the other rounds waited for this tree's extra nodes.
        let per_node = price / v.stats.batch_size.max(1) as f64;
        let forward = v.stats.forward_us as f64 * 1e-6;
        let split = (draft_s + round_s + extra * (price - per_node)) / v.tokens.len() as f64;
        let server = (forward - extra * per_node).max(forward / (1.0 + extra));
        self.measured += 1;
        let first = self.measured == 1;
        let ema = |old: f64, new: f64| {
            if first {
                new
            } else {
                (1.0 - Self::SMOOTHING) * old + Self::SMOOTHING * new
            }
        };
        self.split_per_token = ema(self.split_per_token, split);
        self.server_per_token = ema(self.server_per_token, server);
    }

    /// Takes how many of a split round's committed tokens the context lookup's chain held
    /// (after [`HandOff::observe`] on the same round): what the verifier's own rounds, which
    /// run the same lookup, would have committed beyond their plain step. Counted however the
    /// tokens were accepted, so a drafter that agrees with the chain leaves its worth intact.
    pub fn observe_lookup(&mut self, tokens: usize) {
        let new = tokens as f64;
        self.lookup_per_round = if self.verdicts <= 1 {
            new
        } else {
            (1.0 - Self::SMOOTHING) * self.lookup_per_round + Self::SMOOTHING * new
        };
    }

    /// Whether the verifier decoding the rest on its own is cheaper per token than split rounds,
    /// once [`HandOff::MIN_ROUNDS`] rounds have been measured (or the verifier's costs stand
    /// for them).
    pub fn server_is_cheaper(&self) -> bool {
        let (split, server) = self.per_token();
        self.measured >= Self::MIN_ROUNDS && split > server
    }

    /// `(split, server)` seconds per token as measured so far, the server's with the lookup's
    /// tokens its rounds would keep.
    pub fn per_token(&self) -> (f64, f64) {
        (
            self.split_per_token,
            self.server_per_token / (1.0 + self.lookup_per_round),
        )
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
        // Alone in its forwards, a session's extra nodes cost nobody else: at 1 ms a node its
        // 6-node trees make 12.5 ms forwards of a 7.5 ms plain step, and 2 tokens in 13 ms
        // still beat it.
        let mut alone = HandOff::default();
        for _ in 0..10 {
            alone.observe(&verdict(2, 1, 12.5, 1.0), 6, 0.0005, 0.013);
        }
        let (split, server) = alone.per_token();
        assert!(
            (server - 0.0075).abs() < 1e-4 && split < server,
            "{split} {server}"
        );
    }

    #[test]
    fn the_lookups_tokens_count_for_the_verifiers_own_rounds() {
        // Alone on a verifier whose forward barely grows with nodes (7.5 ms plain step, 0.1 ms
        // a node): 3 tokens from a 6-node tree in 13 ms plus 6 ms of drafting, 6.3 ms a
        // token, beat a plain step...
        let split = |h: &mut HandOff, looked_up: usize| {
            for _ in 0..8 {
                h.observe(&verdict(3, 1, 8.0, 0.1), 6, 0.006, 0.013);
                h.observe_lookup(looked_up);
            }
        };
        let mut drafter_alone = HandOff::default();
        split(&mut drafter_alone, 0);
        assert!(
            !drafter_alone.server_is_cheaper(),
            "{:?}",
            drafter_alone.per_token()
        );
        // ...but not the verifier's own rounds when the lookup's chain held two of the three
        // tokens: they commit 3 tokens a step without drafting, 2.5 ms a token.
        let mut copying = HandOff::default();
        split(&mut copying, 2);
        let (split_s, server_s) = copying.per_token();
        assert!(copying.server_is_cheaper(), "{split_s} {server_s}");
        assert!((server_s - 0.0075 / 3.0).abs() < 1e-4, "{server_s}");
    }

    #[test]
    fn the_verifiers_costs_decide_before_the_first_round_and_rounds_correct_them() {
        // A loaded verifier: 37 ms per split round for 1.5 tokens, 8 ms plain steps; a client
        // 14 ms away hands off before any tree.
        let costs = |plain_us, split_round_us, split_tokens_milli| VerifierCosts {
            plain_step_us: plain_us,
            split_round_us,
            split_tokens_milli,
        };
        let loaded = costs(8_000, 37_000, 1_500);
        let mut far = HandOff::default();
        far.start_from(&loaded, 0.014);
        assert!(far.server_is_cheaper(), "{:?}", far.per_token());
        // A verifier that has seen no split round says nothing of it: measure first.
        let mut unknown = HandOff::default();
        unknown.start_from(&costs(8_000, 0, 0), 0.014);
        assert!(!unknown.server_is_cheaper());
        // An idle verifier next door keeps the split, until this client's own rounds say
        // otherwise; a re-opened session keeps what they said.
        let idle = costs(12_000, 13_000, 2_500);
        let mut near = HandOff::default();
        near.start_from(&idle, 0.0005);
        assert!(!near.server_is_cheaper(), "{:?}", near.per_token());
        for _ in 0..4 {
            near.observe(&verdict(1, 1, 16.0, 0.2), 3, 0.001, 0.060);
        }
        assert!(near.server_is_cheaper(), "{:?}", near.per_token());
        near.start_from(&idle, 0.0005);
        assert!(near.server_is_cheaper(), "{:?}", near.per_token());
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
