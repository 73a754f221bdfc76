//! Building token trees from a draft model. Platform-neutral: no I/O, no async, so the browser
//! build reuses it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{distribution, sample, top_k_sparse};
use specinfer_model::ModelError;
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

use crate::DraftModel;

/// How children are chosen at each expanded node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftMode {
    /// The `k` most likely tokens (greedy verification needs nothing else).
    Greedy,
    /// `k` children drawn from the draft's distribution (after temperature / top-p) truncated to
    /// its `top_k` tokens; the proposal travels with the tree for lossless verification.
    Sample {
        temperature: f32,
        top_p: f32,
        top_k: usize,
        draw: DrawMode,
    },
}

/// Expansion-based trees (SpecInfer): level `d` gives every node of level `d - 1` `expansion[d]`
/// children. `<1,1,3,1,1,1,1,1>` is the paper's default.
pub struct Speculator {
    pub expansion: Vec<usize>,
    pub mode: DraftMode,
    rng: ChaCha8Rng,
}

impl Speculator {
    pub const PAPER_EXPANSION: [usize; 8] = [1, 1, 3, 1, 1, 1, 1, 1];

    pub fn new(expansion: Vec<usize>, mode: DraftMode, seed: u64) -> Self {
        Speculator {
            expansion,
            mode,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Drafts the next tree after `committed` (its root is `committed`'s last token).
    pub fn draft(
        &mut self,
        model: &mut dyn DraftModel,
        committed: &[u32],
    ) -> Result<TokenTree, ModelError> {
        model.sync(committed)?;
        let mut tree =
            TokenTree::root(*committed.last().expect("committed tokens are never empty"));
        let mut dists: Vec<SparseDist> = Vec::new();
        let mut drawn_from = Vec::new();
        let mut scored = 0;
        for &k in &self.expansion {
            if k == 0 {
                break;
            }
            let logits = model.extend(&tree, scored)?;
            let frontier = scored..tree.len();
            scored = tree.len();
            for (node, l) in frontier.zip(&logits) {
                match self.mode {
                    DraftMode::Greedy => {
                        let mut order: Vec<u32> = (0..l.len() as u32).collect();
                        let k = k.min(order.len());
                        order.select_nth_unstable_by(k - 1, |&a, &b| {
                            l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b))
                        });
                        order.truncate(k);
                        order.sort_by(|&a, &b| {
                            l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b))
                        });
                        for t in order {
                            tree.push(node as u32, t);
                        }
                    }
                    DraftMode::Sample {
                        temperature,
                        top_p,
                        top_k,
                        draw,
                    } => {
                        let q = distribution(l, temperature, 0, top_p);
                        let (ids, probs) = top_k_sparse(&q, top_k);
                        let mut weights = probs.clone();
                        let d = dists.len() as u32;
                        for _ in 0..k {
                            if weights.iter().all(|&w| w <= 0.0) {
                                break;
                            }
                            let i = sample(&weights, self.rng.random());
                            if draw == DrawMode::WithoutReplacement {
                                weights[i] = 0.0;
                            }
                            tree.push(node as u32, ids[i]);
                            drawn_from.push(d);
                        }
                        dists.push(SparseDist {
                            node: node as u32,
                            ids,
                            probs,
                        });
                    }
                }
            }
        }
        if let DraftMode::Sample { draw, .. } = self.mode {
            tree = tree
                .with_proposals(Proposals {
                    mode: draw,
                    dists,
                    drawn_from,
                })
                .expect("the speculator builds proposals consistent with its tree");
        }
        Ok(tree)
    }
}
