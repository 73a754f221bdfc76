//! Tree verification: which drafted tokens the LLM keeps, and the one token it adds itself.
//!
//! Pure functions over a [`TokenTree`] and the LLM's per-node distributions, with a caller-supplied
//! RNG. Each walks from the root, accepting at most one child per level, and always ends with a
//! token the LLM produced (the bonus token after a fully accepted path, or the correction after a
//! rejection), so every call makes progress.
//!
//! Losslessness:
//! * [`verify_greedy`] emits exactly the LLM's argmax path.
//! * [`verify_stochastic`] with i.i.d. children is SpecInfer's multi-step speculative sampling;
//!   with children drawn without replacement it is recursive rejection sampling. Each step is a
//!   speculative-sampling step from the current residual, so the emitted token at every depth is
//!   distributed exactly as the LLM's distribution there. The tree must carry every draw, duplicate
//!   draws included: dropping duplicates changes the acceptance probabilities.
//! * [`verify_naive_sampling`] samples from the LLM and keeps a child only when it matches; lossless,
//!   but accepts less (for ablation).

use rand::Rng;
use specinfer_kernels::sampling::{normalise, sample};
use specinfer_wire::{DrawMode, TokenTree};

/// The outcome of verifying one tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Accepted tree nodes, root-to-leaf, without the root.
    pub accepted: Vec<u32>,
    /// The token the LLM produced after the accepted path.
    pub next_token: u32,
    /// Per depth (index 0 is depth 1): drafted children tried and accepted (0 or 1) / rejected.
    pub accepted_at_depth: Vec<u32>,
    pub rejected_at_depth: Vec<u32>,
}

impl Verdict {
    /// Tokens to append to the sequence: the accepted drafts, then the LLM's own token.
    pub fn tokens(&self, tree: &TokenTree) -> Vec<u32> {
        let mut t: Vec<u32> = self
            .accepted
            .iter()
            .map(|&n| tree.token(n as usize))
            .collect();
        t.push(self.next_token);
        t
    }

    /// The verdict of a walk the device made ([`specinfer_model::SampleWalk`]), its statistics
    /// recorded as the host's walk records them (a depth only where a child was tried).
    pub fn from_walk(walk: specinfer_model::WalkOutcome) -> Verdict {
        let mut v = empty_verdict();
        for (d, &rejected) in walk.rejected_at_depth.iter().enumerate() {
            let accepted = u32::from(d < walk.accepted.len());
            if accepted + rejected > 0 {
                v.record(d + 1, accepted, rejected);
            }
        }
        v.accepted = walk.accepted;
        v.next_token = walk.next_token;
        v
    }

    fn record(&mut self, depth: usize, accepted: u32, rejected: u32) {
        if self.accepted_at_depth.len() < depth {
            self.accepted_at_depth.resize(depth, 0);
            self.rejected_at_depth.resize(depth, 0);
        }
        self.accepted_at_depth[depth - 1] += accepted;
        self.rejected_at_depth[depth - 1] += rejected;
    }
}

fn empty_verdict() -> Verdict {
    Verdict {
        accepted: Vec::new(),
        next_token: 0,
        accepted_at_depth: Vec::new(),
        rejected_at_depth: Vec::new(),
    }
}

/// SpecInfer VerifyGreedy. `best(node)` is the LLM's most likely token at `node` (the first of
/// equal maxima), all greedy verification needs of its logits.
pub fn verify_greedy(tree: &TokenTree, best: impl Fn(usize) -> u32) -> Verdict {
    let children = tree.children();
    let mut v = empty_verdict();
    let mut node = 0usize;
    let mut depth = 0;
    loop {
        let best = best(node);
        depth += 1;
        let kids = &children[node];
        match kids.iter().find(|&&c| tree.token(c as usize) == best) {
            Some(&c) => {
                v.record(depth, 1, kids.len() as u32 - 1);
                v.accepted.push(c);
                node = c as usize;
            }
            None => {
                v.record(depth, 0, kids.len() as u32);
                v.next_token = best;
                return v;
            }
        }
    }
}

/// Samples `x ~ p(node)`; continues into a child whose token is `x`, else emits `x`.
/// `dist(node)` is the LLM's distribution at `node` after temperature / top-k / top-p.
pub fn verify_naive_sampling(
    tree: &TokenTree,
    mut dist: impl FnMut(usize) -> Vec<f32>,
    rng: &mut impl Rng,
) -> Verdict {
    let children = tree.children();
    let mut v = empty_verdict();
    let mut node = 0usize;
    let mut depth = 0;
    loop {
        let x = sample(&dist(node), rng.random::<f64>()) as u32;
        depth += 1;
        let kids = &children[node];
        match kids.iter().find(|&&c| tree.token(c as usize) == x) {
            Some(&c) => {
                v.record(depth, 1, 0);
                v.accepted.push(c);
                node = c as usize;
            }
            None => {
                v.record(depth, 0, kids.len() as u32);
                v.next_token = x;
                return v;
            }
        }
    }
}

/// Multi-step speculative sampling (i.i.d. children) or recursive rejection sampling (children
/// drawn without replacement), chosen by the tree's [`DrawMode`]. The tree must carry proposals;
/// a tree without them (or a childless root) degenerates to plain sampling.
pub fn verify_stochastic(
    tree: &TokenTree,
    mut dist: impl FnMut(usize) -> Vec<f32>,
    rng: &mut impl Rng,
) -> Verdict {
    let children = tree.children();
    let proposals = tree.proposals();
    let mut v = empty_verdict();
    let mut node = 0usize;
    let mut depth = 0;
    'walk: loop {
        let mut p = dist(node);
        depth += 1;
        let kids = &children[node];
        if let Some(props) = proposals.filter(|_| !kids.is_empty()) {
            // Tokens already drawn from each proposal at this node (for draws without replacement).
            let mut drawn: Vec<(u32, Vec<u32>)> = Vec::new();
            for &c in kids {
                let d = props.drawn_from[c as usize - 1];
                let q = &props.dists[d as usize];
                let x = tree.token(c as usize);
                let mut q_dense: Vec<(u32, f32)> =
                    q.ids.iter().copied().zip(q.probs.iter().copied()).collect();
                if props.mode == DrawMode::WithoutReplacement {
                    let seen = match drawn.iter().position(|(k, _)| *k == d) {
                        Some(i) => &mut drawn[i].1,
                        None => {
                            drawn.push((d, Vec::new()));
                            &mut drawn.last_mut().expect("just pushed").1
                        }
                    };
                    q_dense.retain(|(t, _)| !seen.contains(t));
                    seen.push(x);
                    let total: f32 = q_dense.iter().map(|(_, w)| w).sum();
                    q_dense.iter_mut().for_each(|(_, w)| *w /= total);
                }
                let qx = q_dense
                    .iter()
                    .find(|(t, _)| *t == x)
                    .map_or(0.0, |(_, w)| *w);
                let px = p[x as usize];
                // Accept with min(1, p(x)/q(x)); qx > 0 because x was drawn from q.
                if qx > 0.0 && rng.random::<f64>() * (qx as f64) < px as f64 {
                    v.record(depth, 1, 0);
                    v.accepted.push(c);
                    node = c as usize;
                    continue 'walk;
                }
                v.record(depth, 0, 1);
                // Residual: p <- norm(max(0, p - q)).
                let before = p.clone();
                for &(t, w) in &q_dense {
                    let e = &mut p[t as usize];
                    *e = (*e - w).max(0.0);
                }
                if !normalise(&mut p) {
                    // Only reachable through rounding when p == q (then rejection has probability 0).
                    p = before;
                }
            }
        }
        v.next_token = sample(&p, rng.random::<f64>()) as u32;
        return v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_walk_records_its_depths_as_the_host_walk_does() {
        // Two accepted nodes after one rejection at depth 1; three children rejected at depth 3.
        let v = Verdict::from_walk(specinfer_model::WalkOutcome {
            accepted: vec![2, 5],
            next_token: 9,
            rejected_at_depth: vec![1, 0, 3],
        });
        assert_eq!((v.accepted, v.next_token), (vec![2, 5], 9));
        assert_eq!(v.accepted_at_depth, vec![1, 1, 0]);
        assert_eq!(v.rejected_at_depth, vec![1, 0, 3]);
        // A leaf reached: its depth tried no child, so the host records nothing there.
        let leaf = Verdict::from_walk(specinfer_model::WalkOutcome {
            accepted: vec![1],
            next_token: 4,
            rejected_at_depth: vec![0, 0],
        });
        assert_eq!(leaf.accepted_at_depth, vec![1]);
        assert_eq!(leaf.rejected_at_depth, vec![0]);
    }
}
