//! Fused tree attention: every new node attends to the whole committed prefix plus its own
//! ancestors among the new nodes, read straight from the KV cache with the ancestor bitsets. No
//! N x N mask is materialised and no K/V is copied.
//!
//! The committed prefix is what costs (hundreds to thousands of positions against a handful of
//! tree nodes), and every node and every query head of a GQA group sees all of it: so each K and
//! V row of the prefix is read once per call and used for all of them, instead of once per
//! (node, head). Over a short prefix the call's three parallel sections (scores, softmax,
//! weighted sums) cost more in waits for the team than in arithmetic; there one section of
//! tasks that each take some of a kv head's rows whole reads the prefix a few times instead
//! ([`Sections`]). Softmax is two-pass (scores of a row kept, one max, one sum): a tree's score
//! rows are small, and a row's result then depends on nothing but the row.
//!
//! The cache may hold f32 or f16 values ([`KvRows`]). f16 halves the bytes every decoded token
//! reads from a long context (and the memory a session holds); each value is converted to f32 as
//! it is loaded (exact), so attention over an f16 cache gives the bits of f32 attention over the
//! stored values. A decoding step's few rows convert the cache's rows in registers; a tree's many
//! rows read a block's rows widened once into a buffer.

use crate::lanes::{self, dispatch, Arith, CacheValue, SyncPtr};
use crate::{profile, team};

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

/// The most rows (of nodes and query heads) that read a block's f16 K or V rows from the cache
/// in place, each converting them as it loads them. Past this (trees), the block's rows are
/// widened once into a buffer that every row then reads. Both give the same bits; converting in
/// place saves a decoding step's rows the store and reload of their few uses each.
const IN_PLACE_ROWS: usize = 16;

/// `count` rows of `len` values of `cache`, the first at element `first` and each `stride` after
/// the one before, widened to f32 into `buf` one after another (asking for the rows a few ahead
/// of the widening).
#[inline(always)]
fn widen_rows<'b, A: Arith, E: CacheValue>(
    cache: &[E],
    first: usize,
    stride: usize,
    count: usize,
    len: usize,
    buf: &'b mut Vec<f32>,
) -> &'b [f32] {
    // About 2 KB ahead, at least 8 rows: a V task's rows are one cache line each.
    let ahead_rows = (AHEAD_BYTES / (std::mem::size_of::<E>() * len).max(1)).max(8);
    // Grown once per thread, not zeroed per block: every value is written below.
    if buf.len() < count * len {
        buf.resize(count * len, 0.0);
    }
    for r in 0..count {
        let ahead = cache
            .as_ptr()
            .wrapping_add(first + (r + ahead_rows) * stride);
        prefetch_lines::<A, E>(ahead, len);
        A::widen(
            &cache[first + r * stride..][..len],
            &mut buf[r * len..][..len],
        );
    }
    &buf[..count * len]
}

/// How far ahead, in bytes of cache rows, widening asks for the rows it will widen.
const AHEAD_BYTES: usize = 2048;

std::thread_local! {
    /// Each thread's buffer for widened f16 rows, kept between tasks and calls: a task's rows
    /// are a few KB, and allocating (and zeroing) them afresh for every task of every layer
    /// measured about a tenth of attention's time.
    static WIDENED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    /// Each thread's weighted-sum accumulators, kept the same way.
    static ACCUMULATORS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
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
    let started = profile::start();
    // The same call whatever the cache's value type.
    macro_rules! on {
        ($k:expr, $v:expr) => {
            attend(
                None,
                shape,
                q,
                $k,
                $v,
                past,
                first,
                ancestors,
                words_per_node,
                out,
            )
        };
    }
    match (k, v) {
        (KvRows::F32(k), KvRows::F32(v)) => on!(k, v),
        (KvRows::F16(k), KvRows::F16(v)) => on!(k, v),
        _ => panic!("K and V caches of different value types"),
    }
    profile::attention_done(started);
}

/// How a call's work is cut into the compute team's sections. Either way every (node, head) row
/// goes through the same operations in the same order, so the choice never changes a bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sections {
    /// Three: prefix scores in tasks of (kv head, positions), each row's softmax, weighted sums
    /// in tasks of (kv head, dimensions). Each K and V row of the prefix is read once per call,
    /// however many nodes and heads use it: long prefixes.
    Three,
    /// One, of tasks that each take some of a kv head's rows (nodes times the group's heads)
    /// whole: their scores, softmax and weighted sums, `splits` tasks per kv head, each reading
    /// the head's whole prefix. Short prefixes, where two more waits for the team cost more
    /// than reading the prefix again.
    One { splits: usize },
}

/// The longest prefix [`Sections::One`] takes. Measured against [`Sections::Three`] in one
/// process, blocks of 4 calls over every layer alternating (2 threads, AMD EPYC Zen 4, f16
/// cache, a bushy tree): at 128 cached positions one section took 0.69-0.87 of the time for
/// trees of 8 and 32 nodes (SmolLM2-135M's heads and Qwen2.5-Coder-1.5B's), 0.78-0.97 for one
/// node; at 256, 0.74-1.00 for trees and 0.88-1.03 for one node; at 512, 1.00-1.11; at 1,024,
/// up to 1.36x.
const ONE_SECTION_PAST: usize = 256;

/// A kv head's rows per task, at least, in [`Sections::One`]: a decoding step's few rows (3 or
/// 6, one node's heads of a group) in one task each took 0.78-0.97 of the time of Three, split
/// in two 0.92-1.15; a tree's rows (24 or 48 for 8 nodes) in two tasks per head 0.69-0.87.
const ONE_SECTION_MIN_ROWS: usize = 8;

impl Sections {
    /// The cut for `rows` rows per kv head over a prefix of `past` positions on `threads`
    /// threads: one section where the prefix is short, with enough tasks for every thread to
    /// take two.
    fn choose(past: usize, rows: usize, n_kv_heads: usize, threads: usize) -> Sections {
        if past > ONE_SECTION_PAST {
            return Sections::Three;
        }
        let splits = (2 * threads)
            .div_ceil(n_kv_heads)
            .min(rows / ONE_SECTION_MIN_ROWS)
            .max(1);
        Sections::One { splits }
    }
}

/// [`tree_attention`] on a cache of `E` values (read in place: see [`CacheValue`]), in
/// `sections` (chosen here when `None`: see [`Sections::choose`]).
#[allow(clippy::too_many_arguments)]
fn attend<E: CacheValue>(
    sections: Option<Sections>,
    shape: AttentionShape,
    q: &[f32],
    k: &[E],
    v: &[E],
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
    let a = Attention {
        shape,
        q,
        k,
        v,
        past,
        n,
        group: n_heads / n_kv_heads,
        scale: 1.0 / (head_dim as f32).sqrt(),
        visible: &s.visible,
        visible_at: &s.visible_at,
        offsets: &s.offsets,
    };
    let scores_ptr = SyncPtr(s.scores.as_mut_ptr());
    let inv_ptr = SyncPtr(s.inv_sums.as_mut_ptr());
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let w = Weights {
        scores: &scores_ptr,
        inv_sums: &inv_ptr,
        out: &out_ptr,
    };
    // The weighted sums go `D` dimensions at a time, the widest that divides the head.
    macro_rules! by_chunk {
        ($done:lifetime, $run:ident; $($d:literal)*) => {
            $(if head_dim.is_multiple_of($d) {
                $run!($d);
                break $done;
            })*
        };
    }
    let rows = n * a.group;
    let sections = sections
        .unwrap_or_else(|| Sections::choose(past, rows, n_kv_heads, rayon::current_num_threads()));
    match sections {
        Sections::One { splits } => {
            let splits = splits.clamp(1, rows.max(1));
            macro_rules! whole_rows {
                ($d:literal) => {
                    // Kv heads innermost: each thread's span of tasks covers the heads alike.
                    team::for_each(n_kv_heads * splits, |t| {
                        let (kh, part) = (t % n_kv_heads, t / n_kv_heads);
                        let task_rows = part * rows / splits..(part + 1) * rows / splits;
                        dispatch!(<E: CacheValue> head_rows::<A, E, $d>(
                            a: &Attention<E> = &a,
                            kh: usize = kh,
                            rows: std::ops::Range<usize> = task_rows,
                            w: &Weights = &w,
                        ));
                    })
                };
            }
            'one: {
                by_chunk!('one, whole_rows; 32 16 8 4 2 1);
            }
        }
        Sections::Three => {
            // 1. Prefix scores, in tasks of (kv head, positions): a K row is read once for every
            //    node and every query head of its group.
            let chunks = past.div_ceil(POSITIONS);
            team::for_each(n_kv_heads * chunks, |t| {
                // Positions outermost: each thread's span of tasks is one run of positions, so
                // that it streams a contiguous part of the cache.
                let (kh, c) = (t % n_kv_heads, t / n_kv_heads);
                let positions = c * POSITIONS..((c + 1) * POSITIONS).min(past);
                dispatch!(<E: CacheValue> prefix_scores::<A, E>(
                    a: &Attention<E> = &a,
                    kh: usize = kh,
                    rows: std::ops::Range<usize> = 0..rows,
                    positions: std::ops::Range<usize> = positions,
                    scores: &SyncPtr = &scores_ptr,
                ));
            });

            // 2. Each row's tree scores and softmax weights, a task a row.
            team::for_each(n * n_heads, |r| {
                dispatch!(<E: CacheValue> softmax_row::<A, E>(
                    a: &Attention<E> = &a,
                    r: usize = r,
                    w: &Weights = &w,
                ));
            });

            // 3. Weighted sums of V, in tasks of (kv head, head dimensions): a V row is read once
            //    for every node and head, and each output keeps its accumulators in registers.
            macro_rules! values {
                ($d:literal) => {{
                    let chunks = head_dim / $d;
                    team::for_each(n_kv_heads * chunks, |t| {
                        let (kh, d0) = (t / chunks, (t % chunks) * $d);
                        dispatch!(<E: CacheValue> weighted_values::<A, E, $d>(
                            a: &Attention<E> = &a,
                            kh: usize = kh,
                            task_rows: std::ops::Range<usize> = 0..rows,
                            d0: usize = d0,
                            w: &Weights = &w,
                        ));
                    });
                }};
            }
            'values: {
                by_chunk!('values, values; 32 16 8 4 2 1);
            }
        }
    }
    SCRATCH.set(scratch);
}

/// The inputs of one call, shared by its tasks.
struct Attention<'a, E> {
    shape: AttentionShape,
    q: &'a [f32],
    k: &'a [E],
    v: &'a [E],
    past: usize,
    n: usize,
    group: usize,
    scale: f32,
    visible: &'a [usize],
    visible_at: &'a [usize],
    offsets: &'a [usize],
}

impl<E> Attention<'_, E> {
    /// The tree positions (absolute) node `i` sees: its ancestors and itself, by depth.
    fn visible(&self, i: usize) -> &[usize] {
        &self.visible[self.visible_at[i]..self.visible_at[i + 1]]
    }

    /// Kv head `kh`'s row `j` (of `n * group`): node `j / group`'s query head `kh * group + j %
    /// group`, as a row of the score rows (node-major).
    fn row_of(&self, kh: usize, j: usize) -> usize {
        (j / self.group) * self.shape.n_heads + kh * self.group + j % self.group
    }

    fn query(&self, i: usize, h: usize) -> &[f32] {
        let hd = self.shape.head_dim;
        &self.q[(i * self.shape.n_heads + h) * hd..][..hd]
    }

    /// Where kv head `kh`'s dimension `d0` of position `pos` lies in the K and V caches.
    fn at(&self, pos: usize, kh: usize, d0: usize) -> usize {
        (pos * self.shape.n_kv_heads + kh) * self.shape.head_dim + d0
    }
}

impl<E: CacheValue> Attention<'_, E> {
    /// Whether a kv head's tasks widen a block's rows once instead of reading the cache in
    /// place: f16 rows read by more than [`IN_PLACE_ROWS`] rows (the nodes times the group's
    /// heads).
    fn widens(&self) -> bool {
        E::HALF && self.n * self.group > IN_PLACE_ROWS
    }
}

/// Where a call's tasks find the score rows (softmax weights once normalised by `inv_sums`) and
/// write their output. Raw: in one section a task writes its rows' scores while others write
/// theirs.
struct Weights<'a> {
    scores: &'a SyncPtr,
    inv_sums: &'a SyncPtr,
    out: &'a SyncPtr,
}

impl Weights<'_> {
    /// Row `r`'s weights. The caller has written them (an earlier section, or its own task).
    fn row<'w, E>(&'w self, a: &Attention<E>, r: usize) -> &'w [f32] {
        // SAFETY: row r's entries lie inside the scores buffer, and only the task that wrote
        // them (or none, after their section) touches them now.
        unsafe {
            std::slice::from_raw_parts(
                self.scores.0.add(a.offsets[r]),
                a.offsets[r + 1] - a.offsets[r],
            )
        }
    }

    /// One over the sum of row `r`'s weights (written as the row's weights were).
    fn inv_sum(&self, r: usize) -> f32 {
        // SAFETY: as in `row`.
        unsafe { *self.inv_sums.0.add(r) }
    }
}

/// Positions scored per pass over a query's vector: eight independent chains in flight.
const SCORE_BLOCK: usize = 8;

/// How far ahead (in positions) a task's first query asks for the K rows it will read.
const PREFETCH_AHEAD: usize = 16;

/// Asks for the cache lines of `len` values at `p`. A plain counted loop: `step_by`'s iterator
/// measured several per cent of attention's time here.
#[inline(always)]
fn prefetch_lines<A: Arith, E>(p: *const E, len: usize) {
    let (p, bytes) = (p as *const u8, len * std::mem::size_of::<E>());
    let mut line = 0;
    while line < bytes {
        A::prefetch(p.wrapping_add(line));
        line += 64;
    }
}

/// Prefix scores of every node and query head of kv head `kh` at `positions`: from the cache in
/// place, or (f16, many rows) from the positions' rows widened once.
#[inline(always)]
fn prefix_scores<A: Arith, E: CacheValue>(
    a: &Attention<E>,
    kh: usize,
    rows: std::ops::Range<usize>,
    positions: std::ops::Range<usize>,
    scores: &SyncPtr,
) {
    let hd = a.shape.head_dim;
    let (first, stride) = (a.at(positions.start, kh, 0), a.shape.n_kv_heads * hd);
    if a.widens() {
        let mut buf = WIDENED.take();
        let k = widen_rows::<A, E>(a.k, first, stride, positions.len(), hd, &mut buf);
        // Widened rows were asked for as they were widened, and are in cache now.
        score_rows::<A, E, f32>(a, kh, rows, positions, (k, 0, hd), false, scores);
        WIDENED.set(buf);
    } else {
        score_rows::<A, E, E>(a, kh, rows, positions, (a.k, first, stride), true, scores);
    }
}

/// [`prefix_scores`] from the K rows `(k, k0, stride)`: `positions`' `i`th row at
/// `k[k0 + i * stride..]`. The first query streams the rows from memory (asked for ahead where
/// `ask_ahead`); the others find them in L1.
#[inline(always)]
fn score_rows<A: Arith, E, T: CacheValue>(
    a: &Attention<E>,
    kh: usize,
    rows: std::ops::Range<usize>,
    positions: std::ops::Range<usize>,
    (k, k0, stride): (&[T], usize, usize),
    ask_ahead: bool,
    scores: &SyncPtr,
) {
    let hd = a.shape.head_dim;
    let k_at = |pos: usize| k0 + (pos - positions.start) * stride;
    let k_row = |pos: usize| &k[k_at(pos)..][..hd];
    let k_ahead = |pos: usize| {
        if ask_ahead {
            prefetch_lines::<A, T>(k.as_ptr().wrapping_add(k_at(pos)), hd)
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
        for j in rows.clone() {
            let r = a.row_of(kh, j);
            let q = a.query(r / a.shape.n_heads, r % a.shape.n_heads);
            let row = a.offsets[r];
            // SAFETY: prefix entries `pos..pos + len` of row r are inside the buffer, and only
            // the task of (kv head kh, these rows and positions) writes them.
            let dst = unsafe { scores.slice_mut(row + pos, len) };
            // A block and single positions give the same bits (see `Arith::dots`).
            if len == SCORE_BLOCK {
                A::scaled_dots8(q, k, k_at(pos), stride, a.scale, dst);
            } else {
                for (p, d) in dst.iter_mut().enumerate() {
                    *d = A::dots(q, [k_row(pos + p)])[0] * a.scale;
                }
            }
        }
        pos += len;
    }
}

/// Prefix positions per task of a call's first step (and per widened block of K rows).
const POSITIONS: usize = 64;

/// Kv head `kh`'s rows `rows` (of `n * group`) whole, in one task: their prefix scores, their
/// tree scores and softmax weights, and their weighted sums of V.
#[inline(always)]
fn head_rows<A: Arith, E: CacheValue, const D: usize>(
    a: &Attention<E>,
    kh: usize,
    rows: std::ops::Range<usize>,
    w: &Weights,
) {
    for start in (0..a.past).step_by(POSITIONS) {
        let positions = start..(start + POSITIONS).min(a.past);
        prefix_scores::<A, E>(a, kh, rows.clone(), positions, w.scores);
    }
    for j in rows.clone() {
        softmax_row::<A, E>(a, a.row_of(kh, j), w);
    }
    for d0 in (0..a.shape.head_dim).step_by(D) {
        weighted_values::<A, E, D>(a, kh, rows.clone(), d0, w);
    }
}

/// Fills in row `r`'s tree scores, turns the row into unnormalised weights and stores one over
/// their sum. Only the task that owns row `r` (its prefix scores already written) calls it.
#[inline(always)]
fn softmax_row<A: Arith, E: CacheValue>(a: &Attention<E>, r: usize, w: &Weights) {
    // SAFETY: row r's scores and sum lie inside their buffers, and only this task touches them.
    let (row, inv) = unsafe {
        (
            w.scores
                .slice_mut(a.offsets[r], a.offsets[r + 1] - a.offsets[r]),
            &mut w.inv_sums.slice_mut(r, 1)[0],
        )
    };
    let (i, h) = (r / a.shape.n_heads, r % a.shape.n_heads);
    let (q, kh, hd) = (a.query(i, h), h / a.group, a.shape.head_dim);
    for (t, &pos) in a.visible(i).iter().enumerate() {
        // The same code as the prefix's scores: a position scores the same bits whether it is
        // committed or an ancestor in the tree.
        row[a.past + t] = A::dots(q, [&a.k[a.at(pos, kh, 0)..][..hd]])[0] * a.scale;
    }
    let max = lanes::max(row);
    // A node always sees itself: the sum is at least 1.
    *inv = 1.0 / A::exp_shifted_sum(row, max);
}

/// Weighted V sums for dimensions `d0..d0 + D` of kv head `kh`, for every node and head of the
/// group. The prefix goes in blocks of positions, each block's V rows (a few KB) used by every
/// node and head while they are in L1; then each node's tree positions.
#[inline(always)]
fn weighted_values<A: Arith, E: CacheValue, const D: usize>(
    a: &Attention<E>,
    kh: usize,
    task_rows: std::ops::Range<usize>,
    d0: usize,
    w: &Weights,
) {
    const BLOCK: usize = 64;
    let rows = task_rows.len();
    let row_of = |j: usize| a.row_of(kh, task_rows.start + j);
    let weights_of = |j: usize| {
        let r = row_of(j);
        w.row(a, r)
    };
    let at = |t: usize| a.at(t, kh, d0);
    let ask = |ts: std::ops::Range<usize>| {
        for t in ts {
            prefetch_lines::<A, E>(a.v.as_ptr().wrapping_add(at(t)), D);
        }
    };
    let mut buf = ACCUMULATORS.take();
    buf.clear();
    buf.resize(rows * 2 * D, 0.0);
    let acc = buf.as_chunks_mut::<D>().0.as_chunks_mut::<2>().0;
    if a.widens() {
        let mut widened = WIDENED.take();
        let stride = a.shape.n_kv_heads * a.shape.head_dim;
        for start in (0..a.past).step_by(BLOCK) {
            let block = start..(start + BLOCK).min(a.past);
            let v = widen_rows::<A, E>(a.v, at(start), stride, block.len(), D, &mut widened);
            accumulate_rows::<A, f32, D>(acc, &weights_of, v, |t| (t - start) * D, block);
        }
        WIDENED.set(widened);
    } else {
        ask(0..BLOCK.min(a.past));
        for start in (0..a.past).step_by(BLOCK) {
            let block = start..(start + BLOCK).min(a.past);
            // The next block's V rows asked for while every row uses this one.
            ask(block.end..(block.end + BLOCK).min(a.past));
            accumulate_rows::<A, E, D>(acc, &weights_of, a.v, at, block);
        }
    }
    for (j, acc) in acc.iter_mut().enumerate() {
        let r = row_of(j);
        let seen = a.visible(r / a.shape.n_heads);
        A::accumulate(
            std::array::from_mut(acc),
            a.v,
            |t| at(seen[t - a.past]),
            a.past..a.past + seen.len(),
            [weights_of(j)],
        );
        let o = r * a.shape.head_dim + d0;
        for (d, (even, odd)) in acc[0].iter().zip(&acc[1]).enumerate() {
            // SAFETY: dimensions d0..d0 + D of row r are inside `out`, and only the task of
            // (kv head kh, these dimensions) writes them.
            unsafe { *w.out.0.add(o + d) = (even + odd) * w.inv_sum(r) };
        }
    }
    ACCUMULATORS.set(buf);
}

/// Every row's `acc[j] += weights_of(j)[t] * v[at(t)..][..D]` for `t` in `ts` (see
/// [`Arith::accumulate`]), the rows in runs of up to four: each V row is loaded once per run.
#[inline(always)]
fn accumulate_rows<'w, A: Arith, T: CacheValue, const D: usize>(
    acc: &mut [[[f32; D]; 2]],
    weights_of: &impl Fn(usize) -> &'w [f32],
    v: &[T],
    at: impl Fn(usize) -> usize + Copy,
    ts: std::ops::Range<usize>,
) {
    let mut j = 0;
    while j < acc.len() {
        let run = &mut acc[j..];
        j += match run.len() {
            1 => accumulate_run::<A, T, D, 1>(run, j, weights_of, v, at, ts.clone()),
            2 => accumulate_run::<A, T, D, 2>(run, j, weights_of, v, at, ts.clone()),
            3 => accumulate_run::<A, T, D, 3>(run, j, weights_of, v, at, ts.clone()),
            _ => accumulate_run::<A, T, D, 4>(run, j, weights_of, v, at, ts.clone()),
        };
    }
}

/// [`Arith::accumulate`] for the `R` rows from row `first` on (`acc` starts at that row);
/// returns `R`.
#[inline(always)]
fn accumulate_run<'w, A: Arith, T: CacheValue, const D: usize, const R: usize>(
    acc: &mut [[[f32; D]; 2]],
    first: usize,
    weights_of: &impl Fn(usize) -> &'w [f32],
    v: &[T],
    at: impl Fn(usize) -> usize,
    ts: std::ops::Range<usize>,
) -> usize {
    let acc: &mut [[[f32; D]; 2]; R] = (&mut acc[..R]).try_into().expect("R rows");
    A::accumulate(
        acc,
        v,
        at,
        ts,
        std::array::from_fn(|k| weights_of(first + k)),
    );
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

    /// One section and three give the same bits, however the rows are split: every row goes
    /// through the same operations in the same order. Prefixes shorter and longer than a block,
    /// trees extended from earlier nodes (`first`), f32 and f16 caches, grouped heads.
    #[test]
    fn one_section_gives_the_bits_of_three() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        let cases = [
            // (nodes, past, first, heads, kv heads, head_dim)
            (1usize, 0usize, 0usize, 6usize, 2usize, 12usize),
            (1, 130, 0, 9, 3, 64),
            (8, 128, 0, 12, 2, 128),
            (5, 70, 2, 6, 2, 32),
            (33, 9, 0, 6, 3, 16),
            (3, 300, 1, 4, 4, 8),
        ];
        for &(n, past, first, n_heads, n_kv_heads, head_dim) in &cases {
            let shape = AttentionShape {
                n_heads,
                n_kv_heads,
                head_dim,
            };
            // A random tree of first + n nodes; the queries are its last n.
            let total = first + n;
            let wpn = total.div_ceil(64);
            let mut all = vec![0u64; total * wpn];
            for i in 0..total {
                if i > 0 {
                    let p = rng.random_range(0..i);
                    for w in 0..wpn {
                        all[i * wpn + w] = all[p * wpn + w];
                    }
                }
                all[i * wpn + i / 64] |= 1 << (i % 64);
            }
            let bits = &all[first * wpn..];
            let mut r = |len| {
                (0..len)
                    .map(|_| half::f16::from_f32(rng.random_range(-2.0f32..2.0)))
                    .collect::<Vec<_>>()
            };
            let q: Vec<f32> = r(n * n_heads * head_dim)
                .iter()
                .map(|h| h.to_f32())
                .collect();
            let kv_len = (past + total) * n_kv_heads * head_dim;
            let (k16, v16) = (r(kv_len), r(kv_len));
            let widen = |h: &[half::f16]| h.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let (k32, v32) = (widen(&k16), widen(&v16));
            let run_f32 = |sections| {
                let mut out = vec![0f32; q.len()];
                attend(
                    sections, shape, &q, &k32, &v32, past, first, bits, wpn, &mut out,
                );
                out
            };
            let run_f16 = |sections| {
                let mut out = vec![0f32; q.len()];
                attend(
                    sections, shape, &q, &k16, &v16, past, first, bits, wpn, &mut out,
                );
                out
            };
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            let three = run_f32(Some(Sections::Three));
            assert!(same(&three, &run_f16(Some(Sections::Three))));
            for splits in [1, 2, 3, 7, 1000] {
                let one = Some(Sections::One { splits });
                assert!(
                    same(&three, &run_f32(one)) && same(&three, &run_f16(one)),
                    "n={n} past={past} first={first} splits={splits}: one section differs"
                );
            }
            // The choice made for the call's own shape, too.
            assert!(same(&three, &run_f32(None)));
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
