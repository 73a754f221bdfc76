//! Prefix reuse: the committed K/V of sessions that ended, kept under a byte budget and
//! looked up by token ids, so that a chat's next turn (its prompt is the last turn's prompt and
//! answer, and more) or another request with the same system prompt prefills only what is new.
//!
//! An entry is one sequence's cache, moved in when its session closes. A session whose prompt
//! extends an entry's whole sequence (a chat's next turn) moves it out; one that shares only part
//! of it (another request under the same system prompt, or the same prompt again, whose cached
//! answer it will not repeat) gets a copy of the shared positions where the engine can copy, and
//! the entry stays for the prompts it holds in full. Moving it out there lost those: requests
//! cycling over a few prompts under one system prompt each took the previous one's entry and
//! prefilled almost all of their own. Least recently stored or copied entries go first when the
//! budget, or the engine's KV budget, needs room.

use std::collections::VecDeque;

/// Cached prefixes of type `C` (a model's per-sequence cache).
pub struct PrefixCache<C> {
    /// Least recently stored or copied first.
    entries: VecDeque<Entry<C>>,
    bytes: usize,
    budget: usize,
}

struct Entry<C> {
    tokens: Vec<u32>,
    cache: C,
    bytes: usize,
}

/// A reused prefix: the cache and how many of the prompt's positions it holds.
pub struct Hit<C> {
    pub cache: C,
    pub tokens: usize,
}

impl<C> PrefixCache<C> {
    /// Holds at most `budget` bytes (0: keeps nothing).
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            entries: VecDeque::new(),
            bytes: 0,
            budget,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps `cache`, which holds the K/V of `tokens`, evicting the oldest entries to fit; a
    /// cache larger than the whole budget, or of fewer than `min_tokens` tokens, is dropped.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: C, bytes: usize, min_tokens: usize) {
        if bytes > self.budget || tokens.len() < min_tokens {
            return;
        }
        // A longer or equal sequence with the same start makes an older entry useless.
        self.remove_where(|e| tokens.starts_with(&e.tokens));
        while self.bytes + bytes > self.budget {
            self.evict_oldest();
        }
        self.bytes += bytes;
        self.entries.push_back(Entry {
            tokens,
            cache,
            bytes,
        });
    }

    /// The K/V of the longest prefix `prompt` shares with a `usable` entry, if it has at least
    /// `min_tokens` tokens: the entry itself, taken out, when `prompt` extends its whole
    /// sequence or `copy` (the shared positions of an entry's cache) gives nothing; else that
    /// copy, the entry staying. The caller truncates the cache to [`Hit::tokens`].
    pub fn take_longest(
        &mut self,
        prompt: &[u32],
        min_tokens: usize,
        usable: impl Fn(&C) -> bool,
        copy: impl FnOnce(&C, usize) -> Option<C>,
    ) -> Option<Hit<C>> {
        let (best, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| usable(&e.cache))
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt)))
            .max_by_key(|&(i, shared)| (shared, i))?;
        if shared < min_tokens.max(1) {
            return None;
        }
        let e = self.entries.remove(best).expect("an index from the scan");
        if shared < e.tokens.len() {
            if let Some(cache) = copy(&e.cache, shared) {
                // Just used: the last to go when room is needed.
                self.entries.push_back(e);
                return Some(Hit {
                    cache,
                    tokens: shared,
                });
            }
        }
        self.bytes -= e.bytes;
        Some(Hit {
            cache: e.cache,
            tokens: shared,
        })
    }

    /// Drops the oldest entry; false when there is none.
    pub fn evict_oldest(&mut self) -> bool {
        match self.entries.pop_front() {
            Some(e) => {
                self.bytes -= e.bytes;
                true
            }
            None => false,
        }
    }

    fn remove_where(&mut self, mut drop: impl FnMut(&Entry<C>) -> bool) {
        let mut freed = 0;
        self.entries.retain(|e| {
            let gone = drop(e);
            if gone {
                freed += e.bytes;
            }
            !gone
        });
        self.bytes -= freed;
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine that cannot copy a cache.
    fn no_copy(_: &&str, _: usize) -> Option<&'static str> {
        None
    }

    #[test]
    fn a_partly_shared_entry_is_copied_and_stays_for_its_own_prompt() {
        let mut c = PrefixCache::new(1000);
        // One prompt's sequence (system prompt 1, 2, then 3, 4) and another's (1, 2, then 9).
        c.insert(vec![1, 2, 3, 4], "a", 40, 1);
        c.insert(vec![1, 2, 9], "b", 30, 1);
        let copied = |e: &&str, _: usize| Some(if *e == "a" { "copy of a" } else { "copy of b" });
        // Another request under the system prompt: a copy of the two shared positions.
        let hit = c.take_longest(&[1, 2, 5, 5], 1, |_| true, copied).unwrap();
        assert_eq!((hit.cache, hit.tokens), ("copy of b", 2));
        assert_eq!((c.len(), c.bytes()), (2, 70));
        // The first prompt again still finds its own entry whole; its answer differs from the
        // cached one after position 3, so it is copied too.
        let hit = c.take_longest(&[1, 2, 3, 7], 1, |_| true, copied).unwrap();
        assert_eq!((hit.cache, hit.tokens), ("copy of a", 3));
        // A next turn extending a whole sequence moves the entry out.
        let hit = c
            .take_longest(&[1, 2, 3, 4, 8], 1, |_| true, copied)
            .unwrap();
        assert_eq!((hit.cache, hit.tokens), ("a", 4));
        assert_eq!((c.len(), c.bytes()), (1, 30));
        // Where the engine cannot copy, a partly shared entry is moved out as before.
        let hit = c.take_longest(&[1, 2, 5], 1, |_| true, no_copy).unwrap();
        assert_eq!((hit.cache, hit.tokens), ("b", 2));
        assert!(c.is_empty());
    }

    #[test]
    fn the_longest_shared_prefix_is_taken_out_and_the_budget_holds() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2, 3, 4], "a", 40, 1);
        c.insert(vec![1, 2, 9], "b", 40, 1);
        assert_eq!((c.len(), c.bytes()), (2, 80));
        // Shares 3 tokens with "a", 2 with "b".
        let hit = c
            .take_longest(&[1, 2, 3, 7, 7], 1, |_| true, no_copy)
            .unwrap();
        assert_eq!((hit.cache, hit.tokens), ("a", 3));
        assert_eq!((c.len(), c.bytes()), (1, 40));
        // Below the minimum shared length: nothing.
        assert!(c
            .take_longest(&[1, 2, 9, 9], 4, |_| true, no_copy)
            .is_none());
        assert!(c.take_longest(&[5], 1, |_| true, no_copy).is_none());
        // Room is made by evicting the oldest; an entry over the whole budget is not kept.
        c.insert(vec![5, 6], "c", 40, 1);
        c.insert(vec![7, 8], "d", 40, 1);
        assert_eq!((c.len(), c.bytes()), (2, 80));
        assert!(
            c.take_longest(&[1, 2, 9], 1, |_| true, no_copy).is_none(),
            "b was the oldest"
        );
        c.insert(vec![1], "huge", 101, 1);
        assert_eq!(c.len(), 2);
        // Too short to be worth keeping.
        c.insert(vec![3], "short", 1, 2);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn an_entry_the_caller_cannot_use_is_passed_over_for_a_shorter_one() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3, 4], "without features", 40, 1);
        c.insert(vec![1, 2, 9], "with features", 30, 1);
        let usable = |e: &&str| *e == "with features";
        let hit = c
            .take_longest(&[1, 2, 3, 4, 5], 1, usable, no_copy)
            .unwrap();
        assert_eq!((hit.cache, hit.tokens), ("with features", 2));
        assert!(c
            .take_longest(&[1, 2, 3, 4, 5], 1, usable, no_copy)
            .is_none());
        let hit = c
            .take_longest(&[1, 2, 3, 4, 5], 1, |_| true, no_copy)
            .unwrap();
        assert_eq!((hit.cache, hit.tokens), ("without features", 4));
    }

    #[test]
    fn a_longer_turn_of_the_same_conversation_replaces_the_shorter() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3], "turn 1", 30, 1);
        c.insert(vec![1, 2, 3, 4, 5], "turn 2", 50, 1);
        assert_eq!((c.len(), c.bytes()), (1, 50));
        assert!(c.evict_oldest());
        assert!(!c.evict_oldest());
        assert_eq!(c.bytes(), 0);
    }
}
