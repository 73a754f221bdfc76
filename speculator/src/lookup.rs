//! Drafting by copying from the context (prompt lookup): when the last few tokens already
//! occurred earlier in the conversation, what followed them then is a likely continuation now.
//! Answers quote their question, code repeats identifiers, and small LLMs repeat themselves: all
//! cases a small draft model predicts badly and a lookup predicts for free (no model, no cache,
//! microseconds per round), so its chain rides along with the draft model's tree.

use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

use crate::{DepthController, RoundObservation};

/// Proposes the continuation of the latest earlier occurrence of the context's last tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextLookup {
    /// The longest suffix of the context looked up; the longest one found wins, since a longer
    /// match predicts its continuation better.
    pub max_match: usize,
    /// The shortest suffix looked up: a single token recurs too often to predict anything.
    pub min_match: usize,
    /// Tokens copied after the match: the chain's length.
    pub max_tokens: usize,
}

impl Default for ContextLookup {
    /// Matches of 2 to 4 tokens, 6 tokens copied: measured on held-out ShareGPT answers of
    /// SmolLM2 (see `models/ssm/EVAL.md`).
    fn default() -> Self {
        ContextLookup {
            max_match: 4,
            min_match: 2,
            max_tokens: 6,
        }
    }
}

impl ContextLookup {
    /// The lookup a verifier runs for a session it decodes on its own, as `drafting` asks (the
    /// client's own lookup, so that a hand-off keeps what it gives); `None` for other drafting.
    pub fn for_server(drafting: specinfer_wire::ServerDrafting) -> Option<ContextLookup> {
        match drafting {
            specinfer_wire::ServerDrafting::Lookup { max_tokens } => Some(ContextLookup {
                max_tokens: max_tokens as usize,
                ..ContextLookup::default()
            }),
            _ => None,
        }
    }

    /// The tokens that followed the latest earlier occurrence of the longest suffix of `context`
    /// between `min_match` and `max_match` tokens long; empty when no such suffix recurs.
    pub fn continuation<'c>(&self, context: &'c [u32]) -> &'c [u32] {
        let len = context.len();
        for n in (self.min_match.max(1)..=self.max_match).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest first: a conversation's recent text predicts its next tokens best.
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
                let from = start + n;
                return &context[from..(from + self.max_tokens).min(len)];
            }
        }
        &[]
    }

    /// `tree` (rooted at `context`'s last token) with the lookup's chain added after its nodes,
    /// which keep their indices: node `i < tree.len()` of the result is node `i` of `tree`, so a
    /// caller can tell which accepted nodes the draft model proposed.
    ///
    /// For greedy verification the chain shares the prefix the tree already holds. For sampling
    /// verification (`sampled`, or a tree that carries proposals) it is a separate branch of the
    /// root whose every node is drawn from a point mass: the LLM accepts it with its own
    /// probability of that token, so the output keeps the LLM's distribution. The result has at
    /// most `max_nodes` nodes (the verifier's tree limit); the chain is cut to fit.
    pub fn extend(
        &self,
        tree: TokenTree,
        context: &[u32],
        max_nodes: usize,
        sampled: bool,
    ) -> TokenTree {
        debug_assert_eq!(context.last().copied(), Some(tree.token(0)));
        add_chain(tree, self.continuation(context), max_nodes, sampled)
    }
}

/// [`ContextLookup::extend`] for a given chain.
fn add_chain(mut tree: TokenTree, chain: &[u32], max_nodes: usize, sampled: bool) -> TokenTree {
    let room = max_nodes.saturating_sub(tree.len());
    let proposals = tree.proposals().cloned().or_else(|| {
        // A root-only tree drafted for sampling: one draw per proposal, so either mode.
        sampled.then(|| Proposals {
            mode: DrawMode::Iid,
            dists: Vec::new(),
            drawn_from: Vec::new(),
        })
    });
    let Some(mut proposals) = proposals else {
        let children = tree.children();
        let mut node = 0u32;
        let mut rest = chain;
        while let Some((&t, tail)) = rest.split_first() {
            match children[node as usize]
                .iter()
                .find(|&&c| tree.token(c as usize) == t)
            {
                Some(&c) => {
                    node = c;
                    rest = tail;
                }
                None => break,
            }
        }
        // Shared tokens take no room: only the chain's new part is cut to fit.
        for &t in &rest[..rest.len().min(room)] {
            node = tree.push(node, t);
        }
        return tree;
    };
    let chain = &chain[..chain.len().min(room)];
    if chain.is_empty() {
        return tree;
    }
    let mut node = 0u32;
    for &t in chain {
        proposals.dists.push(SparseDist {
            node,
            ids: vec![t],
            probs: vec![1.0],
        });
        node = tree.push(node, t);
        proposals.drawn_from.push(proposals.dists.len() as u32 - 1);
    }
    tree.with_proposals(proposals)
        .expect("a point-mass chain keeps the tree's proposals consistent")
}

/// A [`ContextLookup`] whose chain is cut to the length that pays, learned per generation by
/// the same cost model as the adaptive tree depth ([`DepthController`]): how often the LLM keeps
/// the copied token at each chain depth, and what each verified node costs. Next to a fast
/// verifier (one machine) short chains win, behind a round trip long ones do; a length of 0
/// (no chain) is chosen when even one copied token does not pay, with a chain tried again now
/// and then. The acceptance counts a chain token however it was accepted, through the chain's
/// node or a draft model's equal one, so with a draft model beside it the lookup's worth is
/// somewhat overrated.
pub struct AdaptiveLookup {
    lookup: ContextLookup,
    depth: DepthController,
    /// The chain the last tree carried (`None`: the context held no match, nothing to learn).
    sent: Option<Vec<u32>>,
}

impl AdaptiveLookup {
    pub fn new(lookup: ContextLookup) -> Self {
        AdaptiveLookup {
            lookup,
            depth: DepthController::new(lookup.max_tokens),
            sent: None,
        }
    }

    /// The lookup it cuts.
    pub fn config(&self) -> ContextLookup {
        self.lookup
    }

    /// [`ContextLookup::extend`] with the chain cut to the measured length.
    pub fn extend(
        &mut self,
        tree: TokenTree,
        context: &[u32],
        max_nodes: usize,
        sampled: bool,
    ) -> TokenTree {
        debug_assert_eq!(context.last().copied(), Some(tree.token(0)));
        let full = self.lookup.continuation(context);
        let chain = &full[..full.len().min(self.depth.best_depth())];
        self.sent = (!full.is_empty()).then(|| chain.to_vec());
        add_chain(tree, chain, max_nodes, sampled)
    }

    /// The verifier's price of a tree node, in seconds (see
    /// [`DepthController::set_node_price`]).
    pub fn set_node_price(&mut self, seconds: f64) {
        self.depth.set_node_price(seconds);
    }

    /// What came of the tree [`AdaptiveLookup::extend`] returned last: the tokens the round
    /// committed (accepted drafts, then the LLM's own), and the round's measured costs
    /// (`tree_nodes` and the times as in [`RoundObservation`]). Returns how many of the
    /// committed tokens the chain held (0 when the context had no match).
    pub fn observe(
        &mut self,
        committed: &[u32],
        tree_nodes: usize,
        round_s: f64,
        queue_s: f64,
        forward_s: f64,
    ) -> usize {
        let Some(chain) = self.sent.take() else {
            return 0;
        };
        // Past an accepted prefix of the chain the LLM emitted its own token, which differs
        // from the chain's next one (else that node would have been accepted).
        let accepted = chain
            .iter()
            .zip(committed)
            .take_while(|(a, b)| a == b)
            .count();
        // Copying costs no draft forwards.
        self.depth.observe(
            RoundObservation {
                tree_depth: chain.len(),
                tree_nodes,
                drafted_nodes: chain.len() + 1,
                accepted,
                draft_s: 0.0,
                round_s,
                queue_s,
                forward_s,
            },
            0,
        );
        accepted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(max_tokens: usize) -> ContextLookup {
        ContextLookup {
            max_tokens,
            ..ContextLookup::default()
        }
    }

    #[test]
    fn the_longest_recurring_suffix_wins_and_its_latest_occurrence() {
        // "5 6" recurs twice (followed by 7 then by 9); "4 5 6" once (followed by 7 8).
        let ctx = [4, 5, 6, 7, 8, 1, 5, 6, 9, 2, 4, 5, 6];
        assert_eq!(lookup(6).continuation(&ctx), &[7, 8, 1, 5, 6, 9]);
        let ctx = [5, 6, 7, 1, 5, 6, 9, 2, 3, 5, 6];
        assert_eq!(lookup(2).continuation(&ctx), &[9, 2]);
        // A continuation stops at the context's end.
        assert_eq!(lookup(6).continuation(&[3, 1, 2, 1, 2]), &[1, 2]);
        // Nothing recurs, or only single tokens do.
        assert!(lookup(6).continuation(&[1, 2, 3, 4, 1]).is_empty());
        assert!(lookup(6).continuation(&[1]).is_empty());
        assert!(lookup(6).continuation(&[]).is_empty());
    }

    #[test]
    fn a_greedy_tree_keeps_its_nodes_and_shares_the_chain_prefix() {
        let mut tree = TokenTree::root(6);
        let a = tree.push(0, 7);
        tree.push(a, 3);
        tree.push(0, 9);
        let ctx = [5, 6, 7, 8, 2, 5, 6];
        let out = lookup(3).extend(tree.clone(), &ctx, 64, false);
        assert_eq!(&out.tokens()[..tree.len()], tree.tokens());
        // 7 is shared, 8 and 2 are new under it.
        assert_eq!(out.len(), tree.len() + 2);
        assert_eq!(out.path_to(out.len() - 1), vec![0, a, 4, 5]);
        assert_eq!(out.token(5), 2);
    }

    #[test]
    fn a_sampled_tree_gets_a_point_mass_branch_that_validates() {
        use specinfer_wire::Limits;
        let tree = TokenTree::new(vec![6, 7], vec![0])
            .unwrap()
            .with_proposals(Proposals {
                mode: DrawMode::WithoutReplacement,
                dists: vec![SparseDist {
                    node: 0,
                    ids: vec![7, 8],
                    probs: vec![0.5, 0.5],
                }],
                drawn_from: vec![0],
            })
            .unwrap();
        let out = lookup(2).extend(tree.clone(), &[1, 6, 7, 8, 2, 1, 6], 64, false);
        // The chain 7 8 is not folded into the sampled child 7.
        assert_eq!(out.tokens(), &[6, 7, 7, 8]);
        assert_eq!(out.parent(2), Some(0));
        assert_eq!(out.parent(3), Some(2));
        let p = out.proposals().unwrap();
        assert_eq!(p.drawn_from, vec![0, 1, 2]);
        assert_eq!(p.dists[2].probs, vec![1.0]);
        out.validate(100, &Limits::default()).unwrap();
        // The tree limit cuts the chain.
        assert_eq!(
            lookup(2)
                .extend(tree.clone(), &[1, 6, 7, 8, 2, 1, 6], 3, false)
                .len(),
            3
        );
        assert_eq!(
            lookup(2)
                .extend(tree, &[1, 6, 7, 8, 2, 1, 6], 1, false)
                .len(),
            2
        );
        // A root-only tree drafted for sampling gets proposals too (the verifier refuses a
        // sampled tree without them); for greedy verification it stays a plain chain.
        let out = lookup(2).extend(TokenTree::root(6), &[1, 6, 7, 8, 2, 1, 6], 64, true);
        assert_eq!(out.tokens(), &[6, 7, 8]);
        out.validate(100, &Limits::default()).unwrap();
        assert_eq!(out.proposals().unwrap().drawn_from, vec![0, 1]);
        let out = lookup(2).extend(TokenTree::root(6), &[1, 6, 7, 8, 2, 1, 6], 64, false);
        assert!(out.proposals().is_none());
    }

    #[test]
    fn the_adaptive_chain_shrinks_when_copies_are_rejected_and_stays_when_kept() {
        // "1 2" recurs, followed by 3 4 5 6 7 8.
        let ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2];
        let round = |adaptive: &mut AdaptiveLookup, kept: &[u32]| {
            let tree = adaptive.extend(TokenTree::root(2), &ctx, 64, false);
            let chain = tree.len() - 1;
            // Verification costs 1 ms per node on top of 4 ms, no round trip.
            let forward = 0.004 + 0.001 * tree.len() as f64;
            adaptive.observe(kept, tree.len(), forward, 0.0, forward);
            chain
        };
        // The LLM never keeps a copied token: the chain goes, but is tried now and then.
        let mut never = AdaptiveLookup::new(ContextLookup::default());
        let lengths: Vec<usize> = (0..64).map(|_| round(&mut never, &[0])).collect();
        assert_eq!(lengths[0], 6, "a fresh lookup starts with the whole chain");
        let tail = &lengths[32..];
        assert!(
            tail.iter().filter(|&&n| n == 0).count() >= tail.len() - 3,
            "{lengths:?}"
        );
        assert!(
            tail.iter().any(|&n| n > 0),
            "the chain is never retried: {lengths:?}"
        );
        // The LLM keeps every copied token: the whole chain stays.
        let mut always = AdaptiveLookup::new(ContextLookup::default());
        let lengths: Vec<usize> = (0..64)
            .map(|_| round(&mut always, &[3, 4, 5, 6, 7, 8, 0]))
            .collect();
        assert!(lengths[32..].iter().all(|&n| n == 6), "{lengths:?}");
        // A context without a match teaches nothing.
        let mut idle = AdaptiveLookup::new(ContextLookup::default());
        let tree = idle.extend(TokenTree::root(5), &[1, 2, 3, 4, 5], 64, false);
        assert_eq!(tree.len(), 1);
        idle.observe(&[0], 1, 0.005, 0.0, 0.005);
        assert_eq!(idle.depth.best_depth(), 6);
    }
}
