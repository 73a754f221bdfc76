//! Fused tree attention: every new node attends to the whole committed prefix plus its own
//! ancestors among the new nodes, read straight from the KV cache with the ancestor bitsets. No
//! N x N mask is materialised and no K/V is copied.

use rayon::prelude::*;

use crate::quant::dot8 as dot;

/// Head layout of one attention call (grouped-query attention when `n_kv_heads < n_heads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// Attention for `n` new nodes of one sequence.
///
/// * `q`: `[n, n_heads, head_dim]`, already rotated.
/// * `k`, `v`: the sequence's cache, position-major `[past + n, n_kv_heads, head_dim]`: `past`
///   committed positions followed by the new nodes in tree order.
/// * `first`: tree index of the first query node. Tree nodes `0..first` are already in the cache
///   behind the committed positions (drafting extends a tree level by level); queries are tree
///   nodes `first..first + n`.
/// * `ancestors`: `words_per_node` u64 words per query node; bit `j` says the node sees tree node
///   `j` (its ancestors and itself).
/// * `out`: `[n, n_heads, head_dim]`.
///
/// Every (node, head) visits its visible positions in the same order (prefix, then ancestors by
/// index, i.e. by depth) whatever the tree or batch around it, with a two-pass softmax. A node therefore
/// gets bit-identical output whether it is decoded alone after its path was committed or inside a
/// tree: the property that makes speculative output equal incremental output exactly.
#[allow(clippy::too_many_arguments)]
pub fn tree_attention(
    shape: AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    past: usize,
    first: usize,
    ancestors: &[u64],
    words_per_node: usize,
    out: &mut [f32],
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let row = n_heads * head_dim;
    let kv_row = n_kv_heads * head_dim;
    let n = q.len() / row;
    assert_eq!(q.len(), n * row, "q is not [n, heads, head_dim]");
    assert_eq!(out.len(), q.len());
    assert!(
        k.len() >= (past + first + n) * kv_row && v.len() >= (past + first + n) * kv_row,
        "cache too short"
    );
    assert!(
        ancestors.len() >= n * words_per_node,
        "ancestor bitsets too short"
    );
    assert_eq!(
        n_heads % n_kv_heads,
        0,
        "heads must be a multiple of kv heads"
    );
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    // The tree positions each node sees (the committed prefix is seen by all).
    let tree_visible: Vec<Vec<usize>> = (0..n)
        .map(|i| {
            let bits = &ancestors[i * words_per_node..(i + 1) * words_per_node];
            (0..=first + i)
                .filter(|&j| bits[j / 64] >> (j % 64) & 1 == 1)
                .map(|j| past + j)
                .collect()
        })
        .collect();
    // One task per (node, head): enough parallelism for a single decoded token too.
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each_init(Vec::new, |scores, (task, o)| {
            let (i, h) = (task / n_heads, task % n_heads);
            let kvh = h / group;
            let qh = &q[i * row + h * head_dim..i * row + (h + 1) * head_dim];
            let positions = || (0..past).chain(tree_visible[i].iter().copied());
            scores.clear();
            scores.extend(positions().map(|pos| {
                let off = pos * kv_row + kvh * head_dim;
                dot(qh, &k[off..off + head_dim]) * scale
            }));
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut denom = 0f32;
            o.iter_mut().for_each(|x| *x = 0.0);
            for (pos, s) in positions().zip(scores.iter()) {
                let w = (s - max).exp();
                denom += w;
                let off = pos * kv_row + kvh * head_dim;
                o.iter_mut()
                    .zip(&v[off..off + head_dim])
                    .for_each(|(a, &x)| *a += w * x);
            }
            let inv = 1.0 / denom;
            o.iter_mut().for_each(|x| *x *= inv);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Textbook attention with an explicit mask, in f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        shape: AttentionShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        past: usize,
        sees: &dyn Fn(usize, usize) -> bool,
    ) -> Vec<f32> {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let n = q.len() / (n_heads * head_dim);
        let mut out = vec![0f32; q.len()];
        for i in 0..n {
            for h in 0..n_heads {
                let kvh = h / (n_heads / n_kv_heads);
                let qh = &q[(i * n_heads + h) * head_dim..][..head_dim];
                let pos: Vec<usize> = (0..past)
                    .chain((0..n).filter(|&j| sees(i, j)).map(|j| past + j))
                    .collect();
                let scores: Vec<f64> = pos
                    .iter()
                    .map(|&p| {
                        let kk = &k[(p * n_kv_heads + kvh) * head_dim..][..head_dim];
                        qh.iter()
                            .zip(kk)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (head_dim as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for d in 0..head_dim {
                    let val: f64 = pos
                        .iter()
                        .zip(&scores)
                        .map(|(&p, s)| {
                            (s - m).exp() / z * v[(p * n_kv_heads + kvh) * head_dim + d] as f64
                        })
                        .sum();
                    out[(i * n_heads + h) * head_dim + d] = val as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_masked_reference_on_random_trees() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(n, past) in &[(1usize, 0usize), (1, 5), (3, 2), (17, 9), (70, 3)] {
            let shape = AttentionShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: 12,
            };
            let parents: Vec<usize> = (1..n).map(|i| rng.random_range(0..i)).collect();
            let wpn = n.div_ceil(64);
            let mut bits = vec![0u64; n * wpn];
            for i in 0..n {
                if i > 0 {
                    let p = parents[i - 1];
                    for w in 0..wpn {
                        bits[i * wpn + w] = bits[p * wpn + w];
                    }
                }
                bits[i * wpn + i / 64] |= 1 << (i % 64);
            }
            let sees = |i: usize, j: usize| bits[i * wpn + j / 64] >> (j % 64) & 1 == 1;
            let mut r = |len| {
                (0..len)
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect::<Vec<_>>()
            };
            let q = r(n * 6 * 12);
            let k = r((past + n) * 2 * 12);
            let v = r((past + n) * 2 * 12);
            let mut out = vec![0f32; q.len()];
            tree_attention(shape, &q, &k, &v, past, 0, &bits, wpn, &mut out);
            let want = reference(shape, &q, &k, &v, past, &sees);
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "n={n} past={past}: max abs err {err}");
        }
    }
}
