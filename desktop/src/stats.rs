//! What speculation did for one answer: the live panel's figures, kept with the answer.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use specinfer_edge::Generation;

/// Deepest tree level the acceptance chart shows.
pub const CHART_DEPTH: usize = 8;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AnswerStats {
    pub tokens: usize,
    /// Rounds: LLM passes, one tree each.
    pub rounds: usize,
    /// Tokens each round committed (its accepted draft tokens and the LLM's own next token).
    pub tokens_per_round: Vec<usize>,
    pub wall_s: f64,
    /// Until the first round's answer (the prompt's prefill with it).
    pub first_round_s: f64,
    /// The verifier's forward passes, summed (known at the end).
    pub verifier_forward_s: f64,
    pub bytes_up: usize,
    pub bytes_down: usize,
}

impl AnswerStats {
    pub fn from_generation(g: &Generation) -> AnswerStats {
        AnswerStats {
            tokens: g.token_ids.len(),
            rounds: g.stats.rounds,
            tokens_per_round: g.stats.accepted_per_round.clone(),
            wall_s: g.wall.as_secs_f64(),
            first_round_s: g.ttft.as_secs_f64(),
            verifier_forward_s: g.stats.verifier_forward_s,
            bytes_up: g.bytes_up,
            bytes_down: g.bytes_down,
        }
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall_s.max(1e-9)
    }

    /// Tokens per second after the first round: the decoding rate, without the prompt's
    /// prefill (which speculation does not change) weighing on short answers.
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        let first = *self.tokens_per_round.first()?;
        let seconds = self.wall_s - self.first_round_s;
        (self.rounds > 1 && seconds > 0.0).then(|| (self.tokens - first) as f64 / seconds)
    }

    /// Mean tokens per LLM pass.
    pub fn tokens_per_pass(&self) -> f64 {
        self.tokens as f64 / self.rounds.max(1) as f64
    }

    pub fn round_ms(&self) -> f64 {
        self.wall_s * 1e3 / self.rounds.max(1) as f64
    }

    pub fn bytes_per_round(&self) -> (f64, f64) {
        let r = self.rounds.max(1) as f64;
        (self.bytes_up as f64 / r, self.bytes_down as f64 / r)
    }

    /// For each tree depth d = 1, 2, ... (up to [`CHART_DEPTH`]): the share of rounds that
    /// accepted a drafted token at depth d, i.e. committed more than d tokens.
    pub fn acceptance_by_depth(&self) -> Vec<f64> {
        let rounds = self.tokens_per_round.len();
        if rounds == 0 {
            return Vec::new();
        }
        let deepest = self.tokens_per_round.iter().max().map_or(0, |n| n - 1);
        (1..=deepest.min(CHART_DEPTH))
            .map(|d| {
                let reached = self.tokens_per_round.iter().filter(|&&n| n > d).count();
                reached as f64 / rounds as f64
            })
            .collect()
    }

    /// Speculation's speed-up over plain decoding, at `plain` decoding tokens per second
    /// measured on the same verifier.
    pub fn speed_up(&self, plain: Option<f64>) -> Option<f64> {
        Some(self.decode_tokens_per_s()? / plain.filter(|p| *p > 0.0)?)
    }
}

/// The figures of an answer in progress, as its rounds come in.
pub struct LiveStats {
    start: Instant,
    stats: AnswerStats,
}

impl Default for LiveStats {
    fn default() -> Self {
        LiveStats {
            start: Instant::now(),
            stats: AnswerStats::default(),
        }
    }
}

impl LiveStats {
    /// A round committed `tokens` tokens.
    pub fn on_round(&mut self, tokens: usize) {
        let s = &mut self.stats;
        s.wall_s = self.start.elapsed().as_secs_f64();
        if s.rounds == 0 {
            s.first_round_s = s.wall_s;
        }
        s.rounds += 1;
        s.tokens += tokens;
        s.tokens_per_round.push(tokens);
    }

    pub fn snapshot(&self) -> AnswerStats {
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(tokens_per_round: &[usize], wall_s: f64, first_round_s: f64) -> AnswerStats {
        AnswerStats {
            tokens: tokens_per_round.iter().sum(),
            rounds: tokens_per_round.len(),
            tokens_per_round: tokens_per_round.to_vec(),
            wall_s,
            first_round_s,
            ..AnswerStats::default()
        }
    }

    #[test]
    fn acceptance_by_depth_counts_rounds_that_reached_each_level() {
        // Rounds committing 1, 2, 4 and 3 tokens accepted 0, 1, 3 and 2 drafted ones.
        let s = stats(&[1, 2, 4, 3], 1.0, 0.1);
        assert_eq!(s.acceptance_by_depth(), vec![0.75, 0.5, 0.25]);
        assert_eq!(s.tokens_per_pass(), 2.5);
        assert!(stats(&[], 0.0, 0.0).acceptance_by_depth().is_empty());
        assert!(stats(&[1, 1], 1.0, 0.5).acceptance_by_depth().is_empty());
    }

    #[test]
    fn speed_up_compares_decoding_rates_without_the_first_round() {
        // 10 tokens: 1 in the first round (0.5 s), 9 in the next 0.5 s: 18 tokens/s.
        let spec = stats(&[1, 3, 3, 3], 1.0, 0.5);
        assert_eq!(spec.decode_tokens_per_s(), Some(18.0));
        assert_eq!(spec.speed_up(Some(6.0)), Some(3.0));
        assert_eq!(spec.speed_up(None), None);
        assert_eq!(stats(&[4], 1.0, 1.0).speed_up(Some(6.0)), None);
    }
}
