//! Fused tree attention: every new node attends to the whole committed prefix plus its own
//! ancestors among the new nodes, read straight from the KV cache with the ancestor bitsets. No
//! N x N mask is materialised and no K/V is copied.
//!
//! The committed prefix is what costs (hundreds to thousands of positions against a handful of
//! tree nodes), and every node and every query head of a GQA group sees all of it: so each K and
//! V row of the prefix is read once per call and used for all of them, instead of once per
//! (node, head). Softmax is two-pass (scores of a row kept, one max, one sum): a tree's score rows
//! are small, and a row's result then depends on nothing but the row.
//!
//! The cache may hold f32 or f16 values ([`KvRows`]). f16 halves the bytes every decoded token
//! reads from a long context (and the memory a session holds); each row is widened to f32 as it is
//! read (exact), so attention over an f16 cache gives the bits of f32 attention over the stored
//! values.

use crate::lanes::{self, dispatch, Arith, SyncPtr};
use crate::team;

/// Head layout of one attention call (grouped-query attention when `n_kv_heads < n_heads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// A sequence's K or V cache of one layer, position-major `[positions, n_kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

impl KvRows<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(c) => c.len(),
            KvRows::F16(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (exact), for comparisons.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            KvRows::F32(c) => c.to_vec(),
            KvRows::F16(c) => c.iter().map(|h| h.to_f32()).collect(),
        }
    }
}

/// `count` rows of `len` values of `cache`, the first at element `first` and each `stride` after
/// the one before, as f32: `(values, offset of the first row, stride)`. An f32 cache is read in
/// place; an f16 one is widened into `buf` (asking for the rows a few ahead of the widening).
#[inline(always)]
fn rows_f32<'a, A: Arith>(
    cache: KvRows<'a>,
    first: usize,
    stride: usize,
    count: usize,
    len: usize,
    buf: &'a mut Vec<f32>,
) -> (&'a [f32], usize, usize) {
    match cache {
        KvRows::F32(c) => (c, first, stride),
        KvRows::F16(c) => {
            // About 2 KB ahead, at least 8 rows: a V task's rows are one cache line each.
            let ahead_rows = (AHEAD_BYTES / (2 * len).max(1)).max(8);
            // Grown once per task, not zeroed per chunk: every value is written below.
            if buf.len() < count * len {
                buf.resize(count * len, 0.0);
            }
            for r in 0..count {
                let ahead = c.as_ptr().wrapping_add(first + (r + ahead_rows) * stride);
                // `len` halves span the bytes of `len / 2` floats.
                prefetch_lines::<A>(ahead as *const f32, len.div_ceil(2));
                A::widen(&c[first + r * stride..][..len], &mut buf[r * len..][..len]);
            }
            (&buf[..count * len], 0, len)
        }
    }
}

/// How far ahead, in bytes of f16 rows, widening asks for the rows it will widen.
const AHEAD_BYTES: usize = 2048;

std::thread_local! {
    /// Each thread's buffer for widened f16 rows, kept between tasks and calls: a task's rows
    /// are a few KB, and allocating (and zeroing) them afresh for every task of every layer
    /// measured about a tenth of attention's time.
    static WIDENED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `cache[range]` as f32: borrowed from an f32 cache, widened from an f16 one into `buf`.
fn region_f32<'a>(
    cache: KvRows<'a>,
    range: std::ops::Range<usize>,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    #[inline(always)]
    fn widen<A: Arith>(src: &[half::f16], dst: &mut [f32]) {
        A::widen(src, dst)
    }
    match cache {
        KvRows::F32(c) => &c[range],
        KvRows::F16(c) => {
            // Every element is overwritten: only a change of length writes anything here.
            buf.resize(range.len(), 0.0);
            dispatch!(widen::<A>(src: &[half::f16] = &c[range], dst: &mut [f32] = buf));
            buf
        }
    }
}

/// A call's bookkeeping, kept per thread from call to call: a forward makes a call per layer and
/// each allocated about eight small buffers on the calling thread while the team's helpers
/// waited (about a microsecond per layer of SmolLM2's decoding). Every element a call reads it
/// has written.
#[derive(Default)]
struct Scratch {
    /// Every node's visible tree positions, one node after another (see [`Attention::visible`]).
    visible: Vec<usize>,
    /// Where each node's start in `visible` (and one past the last).
    visible_at: Vec<usize>,
    offsets: Vec<usize>,
    scores: Vec<f32>,
    inv_sums: Vec<f32>,
    tree_k: Vec<f32>,
    tree_v: Vec<f32>,
}

std::thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
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
/// index, i.e. by depth) with the same operations whatever the tree or batch around it. A node
/// therefore gets bit-identical output whether it is decoded alone after its path was committed
/// or inside a tree: the property that makes speculative output equal incremental output exactly.
#[allow(clippy::too_many_arguments)]
pub fn tree_attention(
    shape: AttentionShape,
    q: &[f32],
    k: KvRows<'_>,
    v: KvRows<'_>,
    past: usize,
    first: usize,
    ancestors: &[u64],
    words_per_node: usize,
    out: &mut [f32],
) {
    // Taken for the call's duration: a call started on this thread meanwhile (a thread waiting
    // in rayon's fallback running another caller's forward) finds an empty one.
    let mut scratch = SCRATCH.take();
    let s = &mut scratch;
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
    // The tree positions each node sees (the committed prefix is seen by all).
    s.visible.clear();
    s.visible_at.clear();
    s.visible_at.push(0);
    for i in 0..n {
        let bits = &ancestors[i * words_per_node..(i + 1) * words_per_node];
        s.visible.extend(
            (0..=first + i)
                .filter(|&j| bits[j / 64] >> (j % 64) & 1 == 1)
                .map(|j| past + j),
        );
        s.visible_at.push(s.visible.len());
    }
    // Score rows, one per (node, head): the prefix's scores, then the node's tree positions'.
    s.offsets.clear();
    s.offsets.push(0);
    for i in 0..n {
        let len = past + s.visible_at[i + 1] - s.visible_at[i];
        for _ in 0..n_heads {
            s.offsets.push(s.offsets.last().unwrap() + len);
        }
    }
    // Every score is written below (step 1 the prefix's, step 2 the tree's), every sum too.
    s.scores.resize(*s.offsets.last().unwrap(), 0.0);
    s.inv_sums.resize(n * n_heads, 0.0);
    // The tree's own rows (a few positions, or a whole prompt) widened once, not per query.
    let tree = past * kv_row..(past + first + n) * kv_row;
    let a = Attention {
        shape,
        q,
        k,
        v,
        tree_k: region_f32(k, tree.clone(), &mut s.tree_k),
        tree_v: region_f32(v, tree, &mut s.tree_v),
        past,
        n,
        group: n_heads / n_kv_heads,
        scale: 1.0 / (head_dim as f32).sqrt(),
        visible: &s.visible,
        visible_at: &s.visible_at,
        offsets: &s.offsets,
    };
    let scores = &mut s.scores;

    // 1. Prefix scores, in tasks of (kv head, positions): a K row is read once for every node
    //    and every query head of its group.
    const POSITIONS: usize = 64;
    let chunks = past.div_ceil(POSITIONS);
    let scores_ptr = SyncPtr(scores.as_mut_ptr());
    team::for_each(n_kv_heads * chunks, |t| {
        // Positions outermost: each thread's span of tasks is one run of positions, so that it
        // streams a contiguous part of the cache.
        let (kh, c) = (t % n_kv_heads, t / n_kv_heads);
        let positions = c * POSITIONS..((c + 1) * POSITIONS).min(past);
        dispatch!(prefix_scores::<A>(
            a: &Attention = &a,
            kh: usize = kh,
            positions: std::ops::Range<usize> = positions,
            scores: &SyncPtr = &scores_ptr,
        ));
    });

    // 2. Each row's tree scores and softmax weights.
    let inv_sums = &mut s.inv_sums;
    let inv_ptr = &SyncPtr(inv_sums.as_mut_ptr());
    let scores_at = &scores_ptr;
    team::for_each(n * n_heads, |r| {
        // SAFETY: row `r` owns scores `offsets[r]..offsets[r + 1]` and `inv_sums[r]`; each task
        // is one row.
        let (row, inv) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    scores_at.0.add(a.offsets[r]),
                    a.offsets[r + 1] - a.offsets[r],
                ),
                &mut *inv_ptr.0.add(r),
            )
        };
        *inv = dispatch!(softmax_row::<A>(a: &Attention = &a, r: usize = r, row: &mut [f32] = row) -> f32);
    });

    // 3. Weighted sums of V, in tasks of (kv head, head dimensions): a V row is read once for
    //    every node and head, and each output keeps its accumulators in registers.
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let w = Weights {
        scores,
        inv_sums,
        out: &out_ptr,
    };
    macro_rules! by_chunk {
        ($done:lifetime; $($d:literal)*) => {
            $(if head_dim.is_multiple_of($d) {
                let chunks = head_dim / $d;
                team::for_each(n_kv_heads * chunks, |t| {
                    let (kh, d0) = (t / chunks, (t % chunks) * $d);
                    dispatch!(weighted_values::<A, $d>(
                        a: &Attention = &a,
                        kh: usize = kh,
                        d0: usize = d0,
                        w: &Weights = &w,
                    ));
                });
                break $done;
            })*
        };
    }
    'values: {
        by_chunk!('values; 32 16 8 4 2 1);
    }
    SCRATCH.set(scratch);
}

/// The inputs of one call, shared by its tasks.
struct Attention<'a> {
    shape: AttentionShape,
    q: &'a [f32],
    k: KvRows<'a>,
    v: KvRows<'a>,
    /// K and V of the tree's positions (`past..`), as f32, `[tree position, kv head, dim]`.
    tree_k: &'a [f32],
    tree_v: &'a [f32],
    past: usize,
    n: usize,
    group: usize,
    scale: f32,
    visible: &'a [usize],
    visible_at: &'a [usize],
    offsets: &'a [usize],
}

impl Attention<'_> {
    /// The tree positions (absolute) node `i` sees: its ancestors and itself, by depth.
    fn visible(&self, i: usize) -> &[usize] {
        &self.visible[self.visible_at[i]..self.visible_at[i + 1]]
    }

    fn query(&self, i: usize, h: usize) -> &[f32] {
        let hd = self.shape.head_dim;
        &self.q[(i * self.shape.n_heads + h) * hd..][..hd]
    }

    /// Where kv head `kh`'s dimension `d0` of tree position `pos` (absolute) lies in `tree_k`
    /// and `tree_v`.
    fn tree_at(&self, pos: usize, kh: usize, d0: usize) -> usize {
        ((pos - self.past) * self.shape.n_kv_heads + kh) * self.shape.head_dim + d0
    }
}

struct Weights<'a> {
    scores: &'a [f32],
    inv_sums: &'a [f32],
    out: &'a SyncPtr,
}

/// Positions scored per pass over a query's vector: eight independent chains in flight.
const SCORE_BLOCK: usize = 8;

/// How far ahead (in positions) a task's first query asks for the K rows it will read.
const PREFETCH_AHEAD: usize = 16;

/// Asks for the cache lines of `len` floats at `p`. A plain counted loop: `step_by`'s iterator
/// measured several per cent of attention's time here.
#[inline(always)]
fn prefetch_lines<A: Arith>(p: *const f32, len: usize) {
    let mut line = 0;
    while line < len {
        A::prefetch(p.wrapping_add(line));
        line += 16;
    }
}

/// Prefix scores of every node and query head of kv head `kh` at `positions`. The first query
/// streams the K rows from memory (asked for ahead); the others find them in L1.
#[inline(always)]
fn prefix_scores<A: Arith>(
    a: &Attention,
    kh: usize,
    positions: std::ops::Range<usize>,
    scores: &SyncPtr,
) {
    let hd = a.shape.head_dim;
    // The chunk's K rows of kv head kh: in the cache (f32), or widened into `buf` (f16).
    let mut buf = WIDENED.take();
    let (k, k0, stride) = rows_f32::<A>(
        a.k,
        (positions.start * a.shape.n_kv_heads + kh) * hd,
        a.shape.n_kv_heads * hd,
        positions.len(),
        hd,
        &mut buf,
    );
    let k_at = |pos: usize| k0 + (pos - positions.start) * stride;
    let k_row = |pos: usize| &k[k_at(pos)..][..hd];
    // Rows read in place stream from memory: ask for them ahead of each block of eight (widened
    // rows were asked for as they were widened, and are in cache now).
    let in_place = matches!(a.k, KvRows::F32(_));
    let k_ahead = |pos: usize| {
        if in_place {
            prefetch_lines::<A>(k.as_ptr().wrapping_add(k_at(pos)), hd)
        }
    };
    for pos in positions.start..positions.start + PREFETCH_AHEAD {
        k_ahead(pos);
    }
    // Eight positions at a time (a few KB of K, in L1) for every node and head, then the next
    // eight: row by row over the whole chunk instead, the chunk's K rows (32 KB for 64
    // positions of 128 floats) were read from L2 for each row, at about half the FMA rate.
    let mut pos = positions.start;
    while pos < positions.end {
        let len = (positions.end - pos).min(SCORE_BLOCK);
        for p in pos + PREFETCH_AHEAD..pos + PREFETCH_AHEAD + len {
            k_ahead(p);
        }
        for i in 0..a.n {
            for h in kh * a.group..(kh + 1) * a.group {
                let q = a.query(i, h);
                let row = a.offsets[i * a.shape.n_heads + h];
                // SAFETY: prefix entries `pos..pos + len` of row (i, h) are inside the buffer,
                // and only the task of (kv head kh, these positions) writes them.
                let dst = unsafe { std::slice::from_raw_parts_mut(scores.0.add(row + pos), len) };
                // A block and single positions give the same bits (see `Arith::dots`).
                if len == SCORE_BLOCK {
                    A::scaled_dots8(q, k, k_at(pos), stride, a.scale, dst);
                } else {
                    for (p, d) in dst.iter_mut().enumerate() {
                        *d = A::dots(q, [k_row(pos + p)])[0] * a.scale;
                    }
                }
            }
        }
        pos += len;
    }
    WIDENED.set(buf);
}

/// Fills in the row's tree scores, turns the row into unnormalised weights and returns one over
/// their sum.
#[inline(always)]
fn softmax_row<A: Arith>(a: &Attention, r: usize, row: &mut [f32]) -> f32 {
    let (i, h) = (r / a.shape.n_heads, r % a.shape.n_heads);
    let (q, kh, hd) = (a.query(i, h), h / a.group, a.shape.head_dim);
    for (t, &pos) in a.visible(i).iter().enumerate() {
        // The same code as the prefix's scores: a position scores the same bits whether it is
        // committed or an ancestor in the tree.
        row[a.past + t] = A::dots(q, [&a.tree_k[a.tree_at(pos, kh, 0)..][..hd]])[0] * a.scale;
    }
    let max = lanes::max(row);
    // A node always sees itself: the sum is at least 1.
    1.0 / A::exp_shifted_sum(row, max)
}

/// Weighted V sums for dimensions `d0..d0 + D` of kv head `kh`, for every node and head of the
/// group. The prefix goes in blocks of positions, each block's V rows (a few KB) used by every
/// node and head while they are in L1; then each node's tree positions.
#[inline(always)]
fn weighted_values<A: Arith, const D: usize>(a: &Attention, kh: usize, d0: usize, w: &Weights) {
    const BLOCK: usize = 64;
    let hd = a.shape.head_dim;
    let nkv = a.shape.n_kv_heads;
    let rows: Vec<usize> = (0..a.n)
        .flat_map(|i| (kh * a.group..(kh + 1) * a.group).map(move |h| i * a.shape.n_heads + h))
        .collect();
    let mut acc = vec![[[0f32; D]; 2]; rows.len()];
    let weights = |r: usize| &w.scores[a.offsets[r]..a.offsets[r + 1]];
    let row_weights: Vec<&[f32]> = rows.iter().map(|&r| weights(r)).collect();
    let prefix = |t: usize| (t * nkv + kh) * hd + d0;
    let mut buf = WIDENED.take();
    for start in (0..a.past).step_by(BLOCK) {
        let block = start..(start + BLOCK).min(a.past);
        // The block's V rows: in the cache (f32; the next block's asked for while every row
        // uses this one), or widened into `buf` (f16, asked for as they are widened).
        if let KvRows::F32(v) = a.v {
            for t in start + BLOCK..(start + 2 * BLOCK).min(a.past) {
                prefetch_lines::<A>(v.as_ptr().wrapping_add(prefix(t)), D);
            }
        }
        let (v, v0, stride) = rows_f32::<A>(a.v, prefix(start), nkv * hd, block.len(), D, &mut buf);
        let at = |t: usize| v0 + (t - start) * stride;
        // Rows in runs, each V row loaded once per run.
        let mut i = 0;
        while i < rows.len() {
            let (acc, ws) = (&mut acc[i..], &row_weights[i..]);
            i += match rows.len() - i {
                1 => accumulate_run::<A, D, 1>(acc, ws, v, at, block.clone()),
                2 => accumulate_run::<A, D, 2>(acc, ws, v, at, block.clone()),
                3 => accumulate_run::<A, D, 3>(acc, ws, v, at, block.clone()),
                _ => accumulate_run::<A, D, 4>(acc, ws, v, at, block.clone()),
            };
        }
    }
    for ((acc, &r), &ws) in acc.iter_mut().zip(&rows).zip(&row_weights) {
        let seen = a.visible(r / a.shape.n_heads);
        let tree = |t: usize| a.tree_at(seen[t - a.past], kh, d0);
        A::accumulate(
            std::array::from_mut(acc),
            a.tree_v,
            tree,
            a.past..a.past + seen.len(),
            [ws],
        );
        let o = r * hd + d0;
        for (d, (even, odd)) in acc[0].iter().zip(&acc[1]).enumerate() {
            // SAFETY: dimensions d0..d0 + D of row r are inside `out`, and only the task of
            // (kv head kh, these dimensions) writes them.
            unsafe { *w.out.0.add(o + d) = (even + odd) * w.inv_sums[r] };
        }
    }
    WIDENED.set(buf);
}

/// [`Arith::accumulate`] for the first `R` rows of `acc` and `weights`; returns `R`.
#[inline(always)]
fn accumulate_run<A: Arith, const D: usize, const R: usize>(
    acc: &mut [[[f32; D]; 2]],
    weights: &[&[f32]],
    v: &[f32],
    at: impl Fn(usize) -> usize,
    ts: std::ops::Range<usize>,
) -> usize {
    let acc: &mut [[[f32; D]; 2]; R] = (&mut acc[..R]).try_into().expect("R rows");
    let mut w: [&[f32]; R] = [&[]; R];
    w.copy_from_slice(&weights[..R]);
    A::accumulate(acc, v, at, ts, w);
    R
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
            tree_attention(
                shape,
                &q,
                KvRows::F32(&k),
                KvRows::F32(&v),
                past,
                0,
                &bits,
                wpn,
                &mut out,
            );
            let want = reference(shape, &q, &k, &v, past, &sees);
            let err = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "n={n} past={past}: max abs err {err}");
        }
    }

    /// An f16 cache gives exactly the bits of an f32 cache holding the same (rounded) values, on
    /// every path this CPU has: widening is exact and the arithmetic is the same. Shapes with
    /// and without a prefix longer than a block, and head sizes of every register width.
    #[test]
    fn an_f16_cache_gives_the_bits_of_f32_over_its_values() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for &(n, past, head_dim) in &[
            (1usize, 150usize, 64usize),
            (5, 70, 128),
            (3, 9, 12),
            (70, 0, 32),
        ] {
            let shape = AttentionShape {
                n_heads: 6,
                n_kv_heads: 2,
                head_dim,
            };
            // A chain: node i sees nodes 0..=i.
            let wpn = n.div_ceil(64);
            let mut bits = vec![0u64; n * wpn];
            for i in 0..n {
                for j in 0..=i {
                    bits[i * wpn + j / 64] |= 1 << (j % 64);
                }
            }
            let mut r = |len| {
                (0..len)
                    .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)))
                    .collect::<Vec<_>>()
            };
            let q: Vec<f32> = r(n * 6 * head_dim).iter().map(|h| h.to_f32()).collect();
            let (k16, v16) = (r((past + n) * 2 * head_dim), r((past + n) * 2 * head_dim));
            let widen = |h: &[half::f16]| h.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let (k32, v32) = (widen(&k16), widen(&v16));
            let run = |k, v| {
                let mut out = vec![0f32; q.len()];
                tree_attention(shape, &q, k, v, past, 0, &bits, wpn, &mut out);
                out
            };
            let halves = run(KvRows::F16(&k16), KvRows::F16(&v16));
            let floats = run(KvRows::F32(&k32), KvRows::F32(&v32));
            assert!(
                halves
                    .iter()
                    .zip(&floats)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "n={n} past={past} head_dim={head_dim}: f16 and f32 caches differ"
            );
        }
    }
}
