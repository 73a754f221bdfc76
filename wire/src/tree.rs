//! Token trees: the unit of speculation that crosses the wire.

use serde::{Deserialize, Serialize};

use crate::{Limits, MAX_PROPOSAL_K};

/// How the children that share one proposal distribution were drawn from it. Verification must
/// know: i.i.d. draws are verified with SpecInfer's multi-step speculative sampling, draws without
/// replacement with recursive rejection sampling (the proposal is renormalised without the tokens
/// already drawn). Using the wrong one breaks losslessness.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DrawMode {
    Iid,
    WithoutReplacement,
}

/// A draft model's next-token distribution at one tree node, truncated to its top-K and
/// renormalised. Children drawn from it can only be tokens in `ids`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SparseDist {
    /// The expanded node whose children were drawn from this distribution.
    pub node: u32,
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl SparseDist {
    /// Probability of `token` (0 outside the support).
    pub fn prob(&self, token: u32) -> f32 {
        self.ids
            .iter()
            .position(|&t| t == token)
            .map_or(0.0, |i| self.probs[i])
    }
}

/// What sampling verification needs beyond the tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Proposals {
    pub mode: DrawMode,
    pub dists: Vec<SparseDist>,
    /// For every non-root node `i`, `drawn_from[i - 1]` indexes the distribution in `dists` that
    /// node was drawn from. A merged tree has children of one node drawn from several SSMs'
    /// distributions; siblings appear in draw order.
    pub drawn_from: Vec<u32>,
}

/// A tree of speculated tokens in BFS order (parents before children).
///
/// Node 0 is the root: the last committed token, whose K/V the verifier has not computed yet. Its
/// LLM distribution decides the first new token. Siblings may repeat a token: in sampling mode
/// every child is one draw, and duplicate draws matter to the acceptance probabilities.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenTree {
    tokens: Vec<u32>,
    /// `parents[i - 1]` is the parent of node `i`.
    parents: Vec<u32>,
    proposals: Option<Proposals>,
}

/// Why a tree was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TreeError {
    #[error("tree is empty: it needs at least the root")]
    Empty,
    #[error("tree has {got} nodes, the limit is {limit}")]
    TooManyNodes { got: usize, limit: usize },
    #[error("tree has {tokens} tokens but {parents} parent indices (expected tokens - 1)")]
    ParentCount { tokens: usize, parents: usize },
    #[error("node {node} names parent {parent}, which is not an earlier node")]
    ParentNotEarlier { node: usize, parent: u32 },
    #[error("node {node} has token {token}, outside the vocabulary of {vocab}")]
    TokenOutOfVocab { node: usize, token: u32, vocab: u32 },
    #[error("proposal table has {got} entries, expected one per non-root node ({expected})")]
    DrawnFromCount { got: usize, expected: usize },
    #[error("{got} proposal distributions for {drawn} drawn nodes: each is a distribution some node was drawn from")]
    TooManyProposals { got: usize, drawn: usize },
    #[error("node {node} says it was drawn from proposal {dist}, which does not exist")]
    NoSuchProposal { node: usize, dist: u32 },
    #[error(
        "node {node} was drawn from a proposal of node {dist_node}, but its parent is {parent}"
    )]
    ProposalOfOtherNode {
        node: usize,
        dist_node: u32,
        parent: u32,
    },
    #[error("node {node} (token {token}) is not in the support of the proposal it was drawn from")]
    DrawnOutsideSupport { node: usize, token: u32 },
    #[error("proposal {dist}: {reason}")]
    BadProposal { dist: usize, reason: String },
    #[error("proposal {dist} belongs to node {node}, which does not exist")]
    ProposalNodeMissing { dist: usize, node: u32 },
    #[error("node {node} repeats token {token}, drawn without replacement from the same proposal as a sibling")]
    RepeatedDraw { node: usize, token: u32 },
}

impl TokenTree {
    /// A tree with only the root: one step of plain incremental decoding.
    pub fn root(token: u32) -> Self {
        TokenTree {
            tokens: vec![token],
            parents: Vec::new(),
            proposals: None,
        }
    }

    /// A single path `tokens[0] -> tokens[1] -> ...` (also how a prompt is prefilled).
    pub fn chain(tokens: &[u32]) -> Self {
        assert!(!tokens.is_empty(), "a chain needs at least its root");
        TokenTree {
            tokens: tokens.to_vec(),
            parents: (0..tokens.len() as u32 - 1).collect(),
            proposals: None,
        }
    }

    /// Builds a tree from tokens and parent indices (`parents[i - 1]` for node `i`) and checks its
    /// shape. Proposals, if any, are attached with [`TokenTree::with_proposals`].
    pub fn new(tokens: Vec<u32>, parents: Vec<u32>) -> Result<Self, TreeError> {
        let tree = TokenTree {
            tokens,
            parents,
            proposals: None,
        };
        tree.check_shape(usize::MAX)?;
        Ok(tree)
    }

    /// Attaches the proposals sampling verification needs and checks them against the tree.
    pub fn with_proposals(mut self, proposals: Proposals) -> Result<Self, TreeError> {
        self.proposals = Some(proposals);
        self.check_proposals()?;
        Ok(self)
    }

    /// Adds a child of `parent` and returns its index. BFS order is the caller's job when it
    /// matters (the wire only needs parents before children, which this keeps).
    pub fn push(&mut self, parent: u32, token: u32) -> u32 {
        assert!(
            (parent as usize) < self.tokens.len(),
            "parent must be an existing node"
        );
        self.tokens.push(token);
        self.parents.push(parent);
        self.tokens.len() as u32 - 1
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Keeps the first `nodes` nodes (at least the root). Parents come before children, so what
    /// is kept is a tree; a sampled tree keeps the proposals of the draws it keeps, so each node
    /// keeps a prefix of its children's draw sequence and stays exactly verifiable (how many
    /// draws a node gets may follow anything but the LLM). How a client honours a verifier's
    /// node cap.
    pub fn truncate(&mut self, nodes: usize) {
        let nodes = nodes.max(1);
        if nodes >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(nodes);
        self.parents.truncate(nodes - 1);
        if let Some(p) = &mut self.proposals {
            p.drawn_from.truncate(nodes - 1);
            let mut kept: Vec<Option<u32>> = vec![None; p.dists.len()];
            let mut dists = Vec::new();
            for d in &mut p.drawn_from {
                let slot = &mut kept[*d as usize];
                let new = *slot.get_or_insert_with(|| {
                    dists.push(p.dists[*d as usize].clone());
                    dists.len() as u32 - 1
                });
                *d = new;
            }
            p.dists = dists;
        }
    }

    /// Never true for a validated tree; present because `len` is.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn token(&self, node: usize) -> u32 {
        self.tokens[node]
    }

    /// Parent of `node`, `None` for the root.
    pub fn parent(&self, node: usize) -> Option<usize> {
        (node > 0).then(|| self.parents[node - 1] as usize)
    }

    pub fn proposals(&self) -> Option<&Proposals> {
        self.proposals.as_ref()
    }

    /// Depth of every node; the root has depth 0. Positions in the sequence are
    /// `committed_len + depth`.
    pub fn depths(&self) -> Vec<u32> {
        let mut d = vec![0u32; self.tokens.len()];
        for i in 1..self.tokens.len() {
            d[i] = d[self.parents[i - 1] as usize] + 1;
        }
        d
    }

    /// Children of every node, in node order (which is draw order for sampled children).
    pub fn children(&self) -> Vec<Vec<u32>> {
        let mut c = vec![Vec::new(); self.tokens.len()];
        for i in 1..self.tokens.len() {
            c[self.parents[i - 1] as usize].push(i as u32);
        }
        c
    }

    /// Nodes from the root to `node`, inclusive.
    pub fn path_to(&self, node: usize) -> Vec<u32> {
        let mut path = vec![node as u32];
        let mut n = node;
        while let Some(p) = self.parent(n) {
            path.push(p as u32);
            n = p;
        }
        path.reverse();
        path
    }

    pub fn ancestors(&self) -> AncestorBits {
        AncestorBits::new(self)
    }

    /// Checks everything an untrusted tree must satisfy before a model sees it.
    pub fn validate(&self, vocab_size: u32, limits: &Limits) -> Result<(), TreeError> {
        self.check_shape(limits.max_tree_nodes as usize)?;
        for (node, &token) in self.tokens.iter().enumerate() {
            if token >= vocab_size {
                return Err(TreeError::TokenOutOfVocab {
                    node,
                    token,
                    vocab: vocab_size,
                });
            }
        }
        if let Some(p) = &self.proposals {
            for (dist, d) in p.dists.iter().enumerate() {
                if let Some(&token) = d.ids.iter().find(|&&t| t >= vocab_size) {
                    return Err(TreeError::BadProposal {
                        dist,
                        reason: format!("token {token} outside the vocabulary of {vocab_size}"),
                    });
                }
            }
        }
        self.check_proposals()
    }

    fn check_shape(&self, max_nodes: usize) -> Result<(), TreeError> {
        if self.tokens.is_empty() {
            return Err(TreeError::Empty);
        }
        if self.tokens.len() > max_nodes {
            return Err(TreeError::TooManyNodes {
                got: self.tokens.len(),
                limit: max_nodes,
            });
        }
        if self.parents.len() != self.tokens.len() - 1 {
            return Err(TreeError::ParentCount {
                tokens: self.tokens.len(),
                parents: self.parents.len(),
            });
        }
        for (i, &parent) in self.parents.iter().enumerate() {
            let node = i + 1;
            if parent as usize >= node {
                return Err(TreeError::ParentNotEarlier { node, parent });
            }
        }
        Ok(())
    }

    fn check_proposals(&self) -> Result<(), TreeError> {
        let Some(p) = &self.proposals else {
            return Ok(());
        };
        let expected = self.tokens.len() - 1;
        if p.drawn_from.len() != expected {
            return Err(TreeError::DrawnFromCount {
                got: p.drawn_from.len(),
                expected,
            });
        }
        // Bounds the work a frame can ask for: a distribution no node was drawn from is never
        // read, and without this bound a 4 MiB frame could carry half a million of them.
        if p.dists.len() > expected {
            return Err(TreeError::TooManyProposals {
                got: p.dists.len(),
                drawn: expected,
            });
        }
        for (dist, d) in p.dists.iter().enumerate() {
            if d.node as usize >= self.tokens.len() {
                return Err(TreeError::ProposalNodeMissing { dist, node: d.node });
            }
            check_sparse_dist(d).map_err(|reason| TreeError::BadProposal { dist, reason })?;
        }
        for (i, &dist) in p.drawn_from.iter().enumerate() {
            let node = i + 1;
            let d = p
                .dists
                .get(dist as usize)
                .ok_or(TreeError::NoSuchProposal { node, dist })?;
            let parent = self.parents[i];
            if d.node != parent {
                return Err(TreeError::ProposalOfOtherNode {
                    node,
                    dist_node: d.node,
                    parent,
                });
            }
            if !d.ids.contains(&self.tokens[node]) {
                return Err(TreeError::DrawnOutsideSupport {
                    node,
                    token: self.tokens[node],
                });
            }
            if p.mode == DrawMode::WithoutReplacement {
                let repeated = (1..node).any(|sib| {
                    self.parents[sib - 1] == parent
                        && p.drawn_from[sib - 1] == dist
                        && self.tokens[sib] == self.tokens[node]
                });
                if repeated {
                    return Err(TreeError::RepeatedDraw {
                        node,
                        token: self.tokens[node],
                    });
                }
            }
        }
        Ok(())
    }
}

fn check_sparse_dist(d: &SparseDist) -> Result<(), String> {
    if d.ids.is_empty() || d.ids.len() > MAX_PROPOSAL_K {
        return Err(format!(
            "support of {} tokens, must be 1..={MAX_PROPOSAL_K}",
            d.ids.len()
        ));
    }
    if d.ids.len() != d.probs.len() {
        return Err(format!(
            "{} ids but {} probabilities",
            d.ids.len(),
            d.probs.len()
        ));
    }
    let mut sum = 0.0f64;
    for &q in &d.probs {
        if !(q.is_finite() && q > 0.0 && q <= 1.0) {
            return Err(format!("probability {q} is not in (0, 1]"));
        }
        sum += q as f64;
    }
    if (sum - 1.0).abs() > 1e-3 {
        return Err(format!("probabilities sum to {sum}, not 1"));
    }
    for (i, t) in d.ids.iter().enumerate() {
        if d.ids[..i].contains(t) {
            return Err(format!("token {t} appears twice in the support"));
        }
    }
    Ok(())
}

/// For every node, the set of nodes it may attend to inside the tree: its ancestors and itself.
/// Stored as `words_per_node` u64 words per node so trees of any size work; this is exactly what
/// the attention kernels consume (CPU and GPU), and no N x N float mask is ever built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AncestorBits {
    words_per_node: usize,
    words: Vec<u64>,
}

impl AncestorBits {
    pub fn new(tree: &TokenTree) -> Self {
        let n = tree.len();
        let wpn = n.div_ceil(64).max(1);
        let mut words = vec![0u64; n * wpn];
        for i in 0..n {
            if let Some(p) = tree.parent(i) {
                let (dst, src) = words.split_at_mut(i * wpn);
                dst[p * wpn..(p + 1) * wpn]
                    .iter()
                    .zip(src[..wpn].iter_mut())
                    .for_each(|(s, d)| *d = *s);
            }
            words[i * wpn + i / 64] |= 1u64 << (i % 64);
        }
        AncestorBits {
            words_per_node: wpn,
            words,
        }
    }

    /// Whether `node` may attend to `other` (an ancestor or itself).
    pub fn sees(&self, node: usize, other: usize) -> bool {
        self.words[node * self.words_per_node + other / 64] >> (other % 64) & 1 == 1
    }

    pub fn words_per_node(&self) -> usize {
        self.words_per_node
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_sampled_tree_keeps_only_its_nodes_proposals_and_stays_valid() {
        // Root with two drawn children (from dist 0), and a grandchild under node 2 (dist 1).
        let mut t = TokenTree::root(5);
        t.push(0, 6);
        t.push(0, 7);
        t.push(2, 8);
        let dist = |node, ids: Vec<u32>| SparseDist {
            node,
            probs: vec![1.0 / ids.len() as f32; ids.len()],
            ids,
        };
        let t = t
            .with_proposals(Proposals {
                mode: DrawMode::WithoutReplacement,
                dists: vec![dist(0, vec![6, 7]), dist(2, vec![8, 9])],
                drawn_from: vec![0, 0, 1],
            })
            .unwrap();
        let mut three = t.clone();
        three.truncate(3);
        assert_eq!(three.tokens(), &[5, 6, 7]);
        let p = three.proposals().unwrap();
        assert_eq!(p.dists.len(), 1, "the grandchild's proposal goes with it");
        assert_eq!(p.drawn_from, vec![0, 0]);
        three.validate(100, &Limits::default()).unwrap();
        let mut root = t.clone();
        root.truncate(0);
        assert_eq!(root.len(), 1, "the root always stays");
        root.validate(100, &Limits::default()).unwrap();
        let mut all = t.clone();
        all.truncate(10);
        assert_eq!(all, t);
    }

    #[test]
    fn ancestors_of_a_branching_tree_beyond_64_nodes() {
        // A chain of 70 nodes with a side branch at node 65: bitsets must cross word boundaries.
        let mut t = TokenTree::chain(&(0..70).collect::<Vec<_>>());
        let side = t.push(65, 7);
        let a = t.ancestors();
        assert_eq!(a.words_per_node(), 2);
        for j in 0..=65 {
            assert!(a.sees(side as usize, j), "side branch must see {j}");
        }
        for j in 66..70 {
            assert!(!a.sees(side as usize, j), "side branch must not see {j}");
            assert!(!a.sees(j - 1, j), "node {} must not see later {j}", j - 1);
        }
        assert!(a.sees(69, 0) && a.sees(69, 64) && a.sees(69, 69));
        assert_eq!(t.depths()[side as usize], 66);
        assert_eq!(t.path_to(side as usize).len(), 67);
    }

    #[test]
    fn shape_errors_are_typed() {
        assert_eq!(TokenTree::new(vec![], vec![]), Err(TreeError::Empty));
        assert_eq!(
            TokenTree::new(vec![1, 2], vec![1]),
            Err(TreeError::ParentNotEarlier { node: 1, parent: 1 })
        );
        assert!(matches!(
            TokenTree::new(vec![1, 2], vec![]),
            Err(TreeError::ParentCount { .. })
        ));
        let t = TokenTree::chain(&[1, 5]);
        let l = Limits::default();
        assert_eq!(
            t.validate(5, &l),
            Err(TreeError::TokenOutOfVocab {
                node: 1,
                token: 5,
                vocab: 5
            })
        );
        assert!(t.validate(6, &l).is_ok());
    }

    #[test]
    fn proposals_are_checked_against_the_tree() {
        let t = TokenTree::new(vec![1, 2, 3], vec![0, 0]).unwrap();
        let dist = |node, ids: Vec<u32>, probs: Vec<f32>| SparseDist { node, ids, probs };
        let ok = Proposals {
            mode: DrawMode::Iid,
            dists: vec![dist(0, vec![2, 3], vec![0.5, 0.5])],
            drawn_from: vec![0, 0],
        };
        assert!(t.clone().with_proposals(ok.clone()).is_ok());

        let mut outside = ok.clone();
        outside.dists[0] = dist(0, vec![2, 4], vec![0.5, 0.5]);
        assert!(matches!(
            t.clone().with_proposals(outside),
            Err(TreeError::DrawnOutsideSupport { node: 2, token: 3 })
        ));
        let mut unnormalised = ok.clone();
        unnormalised.dists[0].probs = vec![0.5, 0.6];
        assert!(matches!(
            t.clone().with_proposals(unnormalised),
            Err(TreeError::BadProposal { .. })
        ));
        let mut nan = ok.clone();
        nan.dists[0].probs = vec![f32::NAN, 1.0];
        assert!(matches!(
            t.clone().with_proposals(nan),
            Err(TreeError::BadProposal { .. })
        ));
        let mut wrong_node = ok.clone();
        wrong_node.dists[0].node = 1;
        assert!(matches!(
            t.clone().with_proposals(wrong_node),
            Err(TreeError::ProposalOfOtherNode { .. })
        ));
        let mut unread = ok.clone();
        unread
            .dists
            .extend([dist(1, vec![2], vec![1.0]), dist(2, vec![2], vec![1.0])]);
        assert!(matches!(
            t.clone().with_proposals(unread),
            Err(TreeError::TooManyProposals { got: 3, drawn: 2 })
        ));
        let mut few = ok;
        few.drawn_from = vec![0];
        assert!(matches!(
            t.with_proposals(few),
            Err(TreeError::DrawnFromCount { .. })
        ));
    }
}
