//! What one forward gives back for one tree: its nodes' logits (on the host, or left on a GPU and
//! copied row by row only when read), or only each node's argmax, and its nodes' features.

use std::sync::OnceLock;

use specinfer_kernels::sampling::argmax;
use specinfer_wire::{DrawMode, TokenTree};

use crate::Result;

/// What a sequence wants of a batched forward besides its K/V (see
/// [`crate::TreeModel::forward_trees`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Only the K/V (a prompt prefill chunk): an engine may skip the LM head for it.
    KvOnly,
    /// Each node's most likely token (greedy verification): a GPU engine reduces the rows on
    /// the device and copies one id per node instead of a row of the vocabulary.
    Argmax,
    /// Each node's logits over the vocabulary (sampled verification).
    Logits,
}

impl Want {
    /// Whether the LM head runs for the sequence.
    pub fn head(self) -> bool {
        self != Want::KvOnly
    }
}

/// Logits rows left in a device's memory after a forward, copied to the host one row at a time.
pub trait DeviceRows: Send + Sync {
    /// Row `i` over the whole vocabulary (tokens outside a restricted head at -inf).
    fn row(&self, i: usize) -> Result<Vec<f32>>;

    /// Sampled verification of the rows' tree on the device ([`SampleWalk`]); `None` where the
    /// device cannot (the host then walks the rows it copies).
    fn walk(&self, _walk: &SampleWalk) -> Option<Result<WalkOutcome>> {
        None
    }
}

/// Everything sampled verification (multi-step speculative sampling, or recursive rejection
/// sampling for draws without replacement) needs besides the LLM's rows, flattened for a device:
/// the tree's children in draw order, the proposals it was drawn from, the distribution's
/// temperature and top-p, and the uniforms the walk consumes, drawn by the host from the
/// session's RNG in the order the host's walk would use them (one per child tried, then one for
/// the emitted token), so that both walks decide alike.
#[derive(Clone, Debug)]
pub struct SampleWalk {
    /// Node i's children are `kids[kid_start[i]..kid_start[i + 1]]`, in draw order.
    pub kid_start: Vec<i32>,
    pub kids: Vec<i32>,
    pub token: Vec<i32>,
    /// The proposal each node was drawn from (0 for the root, which was not).
    pub drawn_from: Vec<i32>,
    /// Proposal d's support: `q_ids` / `q_probs` at `q_start[d]..q_start[d + 1]`.
    pub q_start: Vec<i32>,
    pub q_ids: Vec<i32>,
    pub q_probs: Vec<f32>,
    pub without_replacement: bool,
    pub temperature: f32,
    pub top_p: f32,
    /// One per node: at most a tree's non-root nodes are tried, plus the emitted token's draw.
    pub uniforms: Vec<f64>,
}

impl SampleWalk {
    /// The walk over `tree`, which must carry proposals, with `uniforms` (at least one per node).
    pub fn new(tree: &TokenTree, temperature: f32, top_p: f32, uniforms: Vec<f64>) -> Option<Self> {
        let props = tree.proposals()?;
        let children = tree.children();
        let mut kid_start = vec![0i32];
        let mut kids = Vec::with_capacity(tree.len());
        for c in &children {
            kids.extend(c.iter().map(|&k| k as i32));
            kid_start.push(kids.len() as i32);
        }
        let mut q_start = vec![0i32];
        let (mut q_ids, mut q_probs) = (Vec::new(), Vec::new());
        for q in &props.dists {
            q_ids.extend(q.ids.iter().map(|&t| t as i32));
            q_probs.extend(&q.probs);
            q_start.push(q_ids.len() as i32);
        }
        let drawn_from = std::iter::once(0)
            .chain(props.drawn_from.iter().map(|&d| d as i32))
            .collect();
        assert!(uniforms.len() >= tree.len(), "one uniform per node");
        Some(SampleWalk {
            kid_start,
            kids,
            token: (0..tree.len()).map(|i| tree.token(i) as i32).collect(),
            drawn_from,
            q_start,
            q_ids,
            q_probs,
            without_replacement: props.mode == DrawMode::WithoutReplacement,
            temperature,
            top_p,
            uniforms,
        })
    }
}

/// A device's sampled verification: the accepted nodes (root to leaf), the token emitted after
/// them, and the children rejected at each depth from 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalkOutcome {
    pub accepted: Vec<u32>,
    pub next_token: u32,
    pub rejected_at_depth: Vec<u32>,
}

enum Rows {
    /// `[nodes, vocab]` on the host.
    Host(Vec<f32>),
    /// Each node's argmax only.
    Argmax(Vec<u32>),
    /// On a device; a row is copied the first time it is read. Sampled verification reads the
    /// rows along the path it walks, a few of a tree's nodes.
    Device {
        source: Box<dyn DeviceRows>,
        fetched: Vec<OnceLock<Vec<f32>>>,
    },
}

/// Logits for every computed node of one tree (`first..`), and (from engines that give them)
/// each node's feature: the final hidden state after the last norm, the LM head's input,
/// `[nodes, d_model]`. A feature-conditioned drafter predicts the next token from the LLM's
/// features, so a verifier can send them back with the tokens it emits.
pub struct Logits {
    rows: Rows,
    vocab: usize,
    /// `[nodes, feature_dim]`; empty when the engine gave none.
    features: Vec<f32>,
    feature_dim: usize,
}

impl std::fmt::Debug for Logits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.rows {
            Rows::Host(_) => "host",
            Rows::Argmax(_) => "argmax",
            Rows::Device { .. } => "device",
        };
        f.debug_struct("Logits")
            .field("nodes", &self.nodes())
            .field("vocab", &self.vocab)
            .field("rows", &kind)
            .field("feature_dim", &self.feature_dim)
            .finish()
    }
}

impl Logits {
    /// Logits of `data.len() / vocab` nodes, row after row, without features.
    pub fn from_rows(data: Vec<f32>, vocab: usize) -> Self {
        Logits {
            rows: Rows::Host(data),
            vocab,
            features: Vec::new(),
            feature_dim: 0,
        }
    }

    /// Only each node's most likely token ([`Want::Argmax`]); [`Logits::node`] is not available.
    pub fn from_argmax(ids: Vec<u32>, vocab: usize) -> Self {
        Logits {
            rows: Rows::Argmax(ids),
            ..Logits::from_rows(Vec::new(), vocab)
        }
    }

    /// `nodes` rows left on a device, copied when read.
    pub fn on_device(source: Box<dyn DeviceRows>, nodes: usize, vocab: usize) -> Self {
        Logits {
            rows: Rows::Device {
                source,
                fetched: (0..nodes).map(|_| OnceLock::new()).collect(),
            },
            ..Logits::from_rows(Vec::new(), vocab)
        }
    }

    /// The same, with every node's feature (`[nodes, dim]`).
    pub fn with_features(mut self, features: Vec<f32>, dim: usize) -> Self {
        self.features = features;
        self.feature_dim = dim;
        self
    }

    /// Replaces the rows by `[nodes, vocab]` host rows.
    pub(crate) fn set_rows(&mut self, data: Vec<f32>) {
        self.rows = Rows::Host(data);
    }

    /// Node `i`'s feature (`d_model` floats); `None` when the engine gave none.
    pub fn feature(&self, i: usize) -> Option<&[f32]> {
        let d = self.feature_dim;
        self.features.get(i * d..(i + 1) * d).filter(|_| d > 0)
    }

    /// Node `i`'s logits over the vocabulary. Panics for a forward that kept only argmaxes, or
    /// when the device cannot copy the row (the engine's batch then fails, as on any device
    /// error inside a forward).
    pub fn node(&self, i: usize) -> &[f32] {
        match &self.rows {
            Rows::Host(data) => &data[i * self.vocab..(i + 1) * self.vocab],
            Rows::Argmax(_) => panic!("this forward kept only each node's argmax (Want::Argmax)"),
            Rows::Device { source, fetched } => fetched[i].get_or_init(|| {
                source
                    .row(i)
                    .unwrap_or_else(|e| panic!("copying logits row {i} from the device: {e}"))
            }),
        }
    }

    /// Whether the rows are left on a device (which may walk them: [`Logits::walk_on_device`]).
    pub fn is_on_device(&self) -> bool {
        matches!(self.rows, Rows::Device { .. })
    }

    /// Sampled verification on the device that holds the rows, where it can; `None` for rows on
    /// the host (or a device that cannot).
    pub fn walk_on_device(&self, walk: &SampleWalk) -> Option<Result<WalkOutcome>> {
        match &self.rows {
            Rows::Device { source, .. } => source.walk(walk),
            _ => None,
        }
    }

    /// Node `i`'s most likely token (the first of equal maxima, in token order).
    pub fn argmax(&self, i: usize) -> u32 {
        match &self.rows {
            Rows::Argmax(ids) => ids[i],
            _ => argmax(self.node(i)) as u32,
        }
    }

    pub fn nodes(&self) -> usize {
        match &self.rows {
            Rows::Host(data) => data.len() / self.vocab,
            Rows::Argmax(ids) => ids.len(),
            Rows::Device { fetched, .. } => fetched.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Rows `[0, i, 1]`, counting the copies.
    struct Counted(AtomicUsize);

    impl DeviceRows for Arc<Counted> {
        fn row(&self, i: usize) -> Result<Vec<f32>> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(vec![0.0, i as f32, 1.0])
        }
    }

    #[test]
    fn device_rows_are_copied_once_and_only_when_read() {
        let source = Arc::new(Counted(AtomicUsize::new(0)));
        let l = Logits::on_device(Box::new(source.clone()), 4, 3);
        assert_eq!(l.nodes(), 4);
        assert_eq!(source.0.load(Ordering::Relaxed), 0);
        assert_eq!(l.node(3), &[0.0, 3.0, 1.0]);
        assert_eq!(l.argmax(3), 1);
        assert_eq!(l.argmax(0), 2, "the first of equal maxima");
        assert_eq!(source.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_sample_walk_lists_children_in_draw_order_and_the_proposals_they_came_from() {
        use specinfer_wire::{Proposals, SparseDist};
        // Root 5 with children 7 and 9 (from proposal 0), 9 with child 4 (from proposal 1).
        let tree = TokenTree::new(vec![5, 7, 9, 4], vec![0, 0, 2])
            .unwrap()
            .with_proposals(Proposals {
                mode: DrawMode::WithoutReplacement,
                dists: vec![
                    SparseDist {
                        node: 0,
                        ids: vec![7, 9, 3],
                        probs: vec![0.5, 0.3, 0.2],
                    },
                    SparseDist {
                        node: 2,
                        ids: vec![4],
                        probs: vec![1.0],
                    },
                ],
                drawn_from: vec![0, 0, 1],
            })
            .unwrap();
        let w = SampleWalk::new(&tree, 0.8, 0.9, vec![0.5; 4]).unwrap();
        assert_eq!(w.kid_start, vec![0, 2, 2, 3, 3]);
        assert_eq!(w.kids, vec![1, 2, 3]);
        assert_eq!(w.token, vec![5, 7, 9, 4]);
        assert_eq!(w.drawn_from, vec![0, 0, 0, 1]);
        assert_eq!((w.q_start, w.q_ids), (vec![0, 3, 4], vec![7, 9, 3, 4]));
        assert!(w.without_replacement);
        assert!(SampleWalk::new(&TokenTree::chain(&[1, 2]), 0.8, 1.0, vec![0.5; 2]).is_none());
    }

    #[test]
    fn argmax_only_logits_answer_argmax_and_count_nodes() {
        let l = Logits::from_argmax(vec![7, 3], 10);
        assert_eq!((l.nodes(), l.argmax(0), l.argmax(1)), (2, 7, 3));
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.node(0).len())).is_err()
        );
        let h = Logits::from_rows(vec![0.0, 2.0, 2.0, 1.0, 0.0, 0.0], 3);
        assert_eq!((h.nodes(), h.argmax(0), h.argmax(1)), (2, 1, 0));
    }
}
