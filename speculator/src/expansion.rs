//! SpecInfer's expansion trees: level `d` gives every node of level `d - 1` `k_d` children, the
//! draft's best tokens (greedy) or draws from its distribution (sampling, with the proposals
//! the verifier needs to stay lossless).

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{distribution, sample, top_k_sparse};
use specinfer_model::ModelError;
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

use crate::select::top_k_tokens;
use crate::speculator::Drafted;
use crate::{DraftMode, DraftModel};

/// An expansion tree after `committed` (its root is `committed`'s last token).
pub(crate) fn expand_tree(
    model: &mut dyn DraftModel,
    committed: &[u32],
    expansion: &[usize],
    mode: DraftMode,
    rng: &mut ChaCha8Rng,
) -> Result<(TokenTree, Drafted), ModelError> {
    let mut tree = TokenTree::root(*committed.last().expect("committed tokens are never empty"));
    let mut dists: Vec<SparseDist> = Vec::new();
    let mut drawn_from = Vec::new();
    let mut scored = 0;
    let mut forwards = 0;
    for &k in expansion {
        if k == 0 {
            break;
        }
        let logits = model.extend(&tree, scored)?;
        forwards += 1;
        let frontier = scored..tree.len();
        scored = tree.len();
        for (node, l) in frontier.zip(&logits) {
            match mode {
                DraftMode::Greedy => {
                    for t in top_k_tokens(l, k) {
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
                        let i = sample(&weights, rng.random());
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
    if let DraftMode::Sample { draw, .. } = mode {
        tree = tree
            .with_proposals(Proposals {
                mode: draw,
                dists,
                drawn_from,
            })
            .expect("the speculator builds proposals consistent with its tree");
    }
    Ok((
        tree,
        Drafted {
            forwards,
            expected: 0.0,
        },
    ))
}
