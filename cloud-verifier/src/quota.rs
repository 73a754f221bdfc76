//! Per-key token rates: how many tokens each API key may have the LLM run each second.
//!
//! A token here is what the verifier pays for, not what the client keeps: every prompt token
//! prefilled and every tree node verified. Counting accepted tokens instead would let a key send
//! large trees that are mostly rejected, for free. Each key has a bucket that refills at the rate
//! up to a burst; work is placed while the bucket is above zero and charged whole when placed
//! (a tree is never split), so a key may run into debt by one tree and then waits until the debt
//! is repaid. Work that waits is held in the engine's queue, never refused: a client over its
//! rate sees slower rounds, not errors.
//!
//! Sessions of unauthenticated connections have no tenant and no rate, as with the session
//! quota. Buckets exist only for keys that have sent work, and keys are the configured ones.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::engine::KeyId;

/// Token buckets per key. Time comes in as arguments, so the rules are tested without waiting.
#[derive(Debug)]
pub struct KeyRates {
    /// Tokens per second each key may run; 0 means no quota.
    rate: f64,
    /// The most a bucket holds: how far a key that was quiet may run ahead of its rate.
    burst: f64,
    buckets: HashMap<[u8; 32], Bucket>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl KeyRates {
    /// `tokens_per_s` 0 turns the quota off. The burst is one second of the rate, and never less
    /// than `min_burst` (the largest piece of work placed at once), so any tree fits a full bucket.
    pub fn new(tokens_per_s: f64, min_burst: usize) -> Self {
        KeyRates {
            rate: tokens_per_s.max(0.0),
            burst: tokens_per_s.max(min_burst as f64),
            buckets: HashMap::new(),
        }
    }

    /// Whether `key`'s work is held to a rate at all.
    pub fn limits(&self, key: &KeyId) -> bool {
        self.limited(key).is_some()
    }

    fn limited(&self, key: &KeyId) -> Option<[u8; 32]> {
        if self.rate > 0.0 {
            *key
        } else {
            None
        }
    }

    fn level(&self, key: &[u8; 32], now: Instant) -> f64 {
        match self.buckets.get(key) {
            None => self.burst,
            Some(b) => (b.level + now.saturating_duration_since(b.at).as_secs_f64() * self.rate)
                .min(self.burst),
        }
    }

    /// How long `key` must wait before its next work may be placed; `None`: it may go now.
    pub fn wait(&self, key: &KeyId, now: Instant) -> Option<Duration> {
        let key = self.limited(key)?;
        let level = self.level(&key, now);
        (level <= 0.0).then(|| Duration::from_secs_f64((-level + 1.0) / self.rate))
    }

    /// Takes `tokens` from `key`'s bucket (work just placed).
    pub fn charge(&mut self, key: &KeyId, tokens: usize, now: Instant) {
        let Some(key) = self.limited(key) else {
            return;
        };
        let level = self.level(&key, now) - tokens as f64;
        self.buckets.insert(key, Bucket { level, at: now });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: KeyId = Some([7; 32]);

    #[test]
    fn a_key_runs_its_burst_then_waits_for_its_debt_to_refill() {
        let t0 = Instant::now();
        let mut rates = KeyRates::new(100.0, 64);
        assert_eq!(rates.wait(&KEY, t0), None);
        // A full bucket (100) takes a 64-node tree and a second one, going 28 into debt.
        rates.charge(&KEY, 64, t0);
        assert_eq!(rates.wait(&KEY, t0), None);
        rates.charge(&KEY, 64, t0);
        let wait = rates.wait(&KEY, t0).expect("in debt");
        // 28 tokens of debt (and one to get above zero) at 100 tokens/s.
        assert!((wait.as_secs_f64() - 0.29).abs() < 1e-6, "{wait:?}");
        assert_eq!(rates.wait(&KEY, t0 + wait), None);
        // Over a long run a key gets its rate, not more: 10 s of 64-node trees.
        let mut now = t0 + wait;
        let mut placed = 0;
        while now < t0 + Duration::from_secs(10) {
            match rates.wait(&KEY, now) {
                None => {
                    rates.charge(&KEY, 64, now);
                    placed += 64;
                }
                Some(w) => now += w,
            }
        }
        assert!(
            (900..=1164).contains(&placed),
            "{placed} tokens in 10 s at 100/s"
        );
    }

    #[test]
    fn keys_are_held_apart_and_unauthenticated_or_unlimited_work_is_never_held() {
        let t0 = Instant::now();
        let mut rates = KeyRates::new(10.0, 8);
        rates.charge(&KEY, 50, t0);
        assert!(rates.wait(&KEY, t0).is_some());
        assert_eq!(rates.wait(&Some([8; 32]), t0), None);
        rates.charge(&None, 1_000, t0);
        assert_eq!(rates.wait(&None, t0), None);
        let mut off = KeyRates::new(0.0, 8);
        off.charge(&KEY, 1_000_000, t0);
        assert_eq!(off.wait(&KEY, t0), None);
        assert!(rates.limits(&KEY) && !rates.limits(&None) && !off.limits(&KEY));
        // A quiet key's bucket fills to its burst, no further.
        assert!(rates.wait(&KEY, t0 + Duration::from_secs(100)).is_none());
        rates.charge(&KEY, 11, t0 + Duration::from_secs(100));
        assert!(rates.wait(&KEY, t0 + Duration::from_secs(100)).is_some());
    }
}
