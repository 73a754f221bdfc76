//! The transformer and its tree-masked forward pass.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use specinfer_kernels::{
    add_rms_norm, matmul_many, read_ahead, rms_norm, swiglu, tree_attention, AttentionShape,
    F32Matrix, QuantFormat, QuantMatrix,
};
use specinfer_wire::TokenTree;

use crate::{KvCache, Logits, ModelConfig, ModelError, Result, RopeStyle};

/// A weight matrix `[out, in]`: our small-batch kernel for the block formats it handles
/// (weights read once per forward whatever the node count, batch invariant), candle for the rest.
pub(crate) enum Weight {
    Quant(QuantMatrix),
    F32(F32Matrix),
    Candle(QMatMul),
}

impl Weight {
    /// The matrix as f32 `[out, in]`, whatever it is stored as.
    pub(crate) fn to_f32(&self) -> Result<Vec<f32>> {
        Ok(match self {
            Weight::Quant(m) => (0..m.rows()).flat_map(|r| m.dequantize_row(r)).collect(),
            Weight::F32(m) => m.weights().to_vec(),
            Weight::Candle(QMatMul::QTensor(t)) => t
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
            }
        })
    }

    /// Bytes of the weights as held for the kernels (what one token's forward reads).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Weight::Quant(m) => m.bytes(),
            Weight::F32(m) => 4 * m.rows() * m.cols(),
            Weight::Candle(QMatMul::QTensor(t)) => t.storage_size_in_bytes(),
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }

    /// `(out, in)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        match self {
            Weight::Quant(m) => (m.rows(), m.cols()),
            Weight::F32(m) => (m.rows(), m.cols()),
            Weight::Candle(QMatMul::QTensor(t)) => t.shape().dims2().expect("a matrix"),
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.dims2().expect("a matrix")
            }
        }
    }

    /// Chooses the kernel for a GGML tensor. `SPECINFER_MATMUL=candle` forces candle's kernels
    /// (for before/after measurements).
    /// An unquantized `[out, in]` weight (from safetensors): our kernel, unless candle is forced.
    pub(crate) fn from_f32(t: Tensor) -> Result<Weight> {
        let candle_forced = std::env::var("SPECINFER_MATMUL").is_ok_and(|v| v == "candle");
        match t.dims() {
            &[rows, cols] if !candle_forced => Ok(Weight::F32(F32Matrix::new(
                rows,
                cols,
                t.flatten_all()?.to_vec1()?,
            ))),
            _ => Ok(Weight::Candle(QMatMul::Tensor(t))),
        }
    }

    pub(crate) fn from_qtensor(t: QTensor) -> Result<Weight> {
        let format = match t.dtype() {
            GgmlDType::Q4_0 => Some(QuantFormat::Q4_0),
            GgmlDType::Q4_1 => Some(QuantFormat::Q4_1),
            GgmlDType::Q8_0 => Some(QuantFormat::Q8_0),
            GgmlDType::Q4K => Some(QuantFormat::Q4_K),
            GgmlDType::Q5_0 => Some(QuantFormat::Q5_0),
            GgmlDType::Q6K => Some(QuantFormat::Q6_K),
            _ => None,
        };
        let candle_forced = std::env::var("SPECINFER_MATMUL").is_ok_and(|v| v == "candle");
        match (format, t.shape().dims()) {
            (Some(f), &[rows, cols]) if !candle_forced => {
                let m = QuantMatrix::from_ggml(f, rows, cols, &t.data()?).map_err(|e| {
                    ModelError::Format {
                        path: "<weights>".into(),
                        message: e.to_string(),
                    }
                })?;
                Ok(Weight::Quant(m))
            }
            _ => Ok(Weight::Candle(QMatMul::from_qtensor(t)?)),
        }
    }
}

/// A projection `y = x W^T (+ b)`.
pub(crate) struct Linear {
    pub(crate) w: Weight,
    pub(crate) b: Option<Vec<f32>>,
}

impl Linear {
    /// `x` is `[rows, in]` row-major; returns `[rows, out]`.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut y = vec![0f32; rows * self.w.shape().0];
        self.forward_into(x, rows, &mut y)?;
        Ok(y)
    }

    /// [`Linear::forward`] into `y` (`[rows, out]`), every element of which it writes.
    pub(crate) fn forward_into(&self, x: &[f32], rows: usize, y: &mut [f32]) -> Result<()> {
        match &self.w {
            Weight::Quant(m) => m.matmul(x, rows, y),
            Weight::F32(m) => m.matmul(x, rows, y),
            Weight::Candle(w) => {
                let xt = Tensor::from_slice(x, (rows, x.len() / rows), &Device::Cpu)?;
                y.copy_from_slice(&w.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        self.add_bias(y);
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.b {
            for row in y.chunks_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
    }
}

/// Projections of one input by several linears (a layer's query/key/value, or gate/up): when
/// all are quantized (in any GGML formats: Q4_K_M files mix Q4_K and Q6_K), one parallel
/// section covers them. Writes every element of `outs` (`[rows, out]` each).
fn forward_many<const K: usize>(
    ls: [&Linear; K],
    x: &[f32],
    rows: usize,
    mut outs: [&mut [f32]; K],
) -> Result<()> {
    let same_width = |ms: &[&QuantMatrix; K]| ms.iter().all(|m| m.cols() == ms[0].cols());
    let Some(ms) = all_quantized(ls).filter(same_width) else {
        for (o, l) in outs.iter_mut().zip(ls) {
            l.forward_into(x, rows, o)?;
        }
        return Ok(());
    };
    matmul_many(&ms, x, rows, &mut outs);
    for (o, l) in outs.iter_mut().zip(ls) {
        l.add_bias(o);
    }
    Ok(())
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

pub struct Llama {
    pub(crate) cfg: ModelConfig,
    /// `[vocab, d_model]`, dequantized once: a lookup per token is then a copy.
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) lm_head: Linear,
    /// When the head covers only some tokens (a draft model's restricted support): the token id
    /// of each head row. Every other token gets logit -inf, i.e. probability exactly 0.
    pub(crate) head_ids: Option<Vec<u32>>,
}

/// See [`Llama::per_token_weights`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightCost {
    pub bytes: usize,
    pub macs: usize,
}

/// One sequence's share of a batched forward: its cache and the tree to run on top of it.
pub struct SeqTree<'a> {
    pub cache: &'a mut KvCache,
    pub tree: &'a TokenTree,
    /// Nodes `0..first` are already in the cache's scratch region from an earlier forward of
    /// this (growing) tree; only `first..` are computed. 0 for a fresh tree.
    pub first: usize,
}

impl<'a> SeqTree<'a> {
    pub fn new(cache: &'a mut KvCache, tree: &'a TokenTree) -> Self {
        SeqTree {
            cache,
            tree,
            first: 0,
        }
    }
}

impl Llama {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Rows of the output head: the vocabulary, or a draft model's restricted support.
    pub fn head_tokens(&self) -> usize {
        self.head_ids.as_ref().map_or(self.cfg.vocab_size, Vec::len)
    }

    /// What one node's forward costs at least, whatever the engine: the projection and head
    /// weights it reads (bytes as held here; the embedding lookup reads one row) and the
    /// multiply-adds they take. Their floor on this machine is bytes / memory bandwidth, and
    /// extra tree nodes cost only multiply-adds until those outlast the read.
    pub fn per_token_weights(&self) -> WeightCost {
        let mut cost = WeightCost { bytes: 0, macs: 0 };
        for l in self.per_token_linears() {
            let (rows, cols) = l.w.shape();
            cost.bytes += l.w.bytes();
            cost.macs += rows * cols;
        }
        cost
    }

    /// Seconds the projections and the head of a forward of `rows` nodes take with their weights
    /// already in cache: each multiplied `reps` times in a row, the fastest counted, summed. The
    /// products' arithmetic alone, for reports beside a forward's time (whose products also wait
    /// for memory and for each other's threads); the activations are a fixed pattern, which no
    /// kernel's instruction count depends on.
    pub fn products_seconds_hot(&self, rows: usize, reps: usize) -> Result<f64> {
        let mut total = 0.0;
        for l in self.per_token_linears() {
            let (out, inputs) = l.w.shape();
            let x: Vec<f32> = (0..rows * inputs)
                .map(|i| (i % 29) as f32 / 14.0 - 1.0)
                .collect();
            let mut y = vec![0f32; rows * out];
            let mut best = f64::MAX;
            for _ in 0..reps.max(1) {
                let t = std::time::Instant::now();
                l.forward_into(&x, rows, &mut y)?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            total += best;
        }
        Ok(total)
    }

    /// Every projection a token's forward multiplies by, in order, and the head.
    fn per_token_linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
            .chain([&self.lm_head])
    }

    /// The bytes [`Llama::per_token_weights`] counts, buffer by buffer in the order a forward
    /// reads them: reading just these is the floor under a token's forward on this memory.
    /// Weights held by candle's kernels (none in the shipped models) are left out.
    pub fn per_token_buffers(&self) -> Vec<&[u8]> {
        let mut out = Vec::new();
        for l in self.per_token_linears() {
            match &l.w {
                Weight::Quant(m) => out.extend(m.streams().into_iter().filter(|b| !b.is_empty())),
                Weight::F32(m) => {
                    let w = m.weights();
                    // SAFETY: any f32 is four initialised bytes, and u8 needs no alignment.
                    out.push(unsafe {
                        std::slice::from_raw_parts(w.as_ptr().cast::<u8>(), 4 * w.len())
                    });
                }
                Weight::Candle(_) => {}
            }
        }
        out
    }

    /// The final norm's weights (a feature-conditioned drafter starts from them).
    pub fn final_norm_weights(&self) -> &[f32] {
        &self.final_norm
    }

    /// The token embedding table, `[vocab, d_model]` (to initialise draft models from).
    pub fn token_embeddings(&self) -> &[f32] {
        &self.embed
    }

    /// Runs every sequence's tree in ONE pass: projections and MLPs over all nodes of all trees
    /// packed together (no padding), attention per sequence over its own cache. Afterwards each
    /// cache holds its tree in the scratch region, ready for [`KvCache::compact`].
    pub fn forward(&self, seqs: &mut [SeqTree<'_>]) -> Result<Vec<Logits>> {
        // The kernels' parallel sections run on the compute team, led from this thread. Not
        // inside rayon's pool: there a second rayon worker spins idle beside the team's helper,
        // three busy threads on a 2-core host (1.90 cores doing work instead of 1.99).
        let all = vec![true; seqs.len()];
        self.run_forward(seqs, &all, None)
    }

    /// [`Llama::forward`] computing logits only for the sequences whose `logits` entry is true;
    /// the others get empty logits (a prompt prefill chunk batched with verification trees needs
    /// only its K/V, and the head is a fifth of SmolLM2's per-token work).
    pub fn forward_selected(
        &self,
        seqs: &mut [SeqTree<'_>],
        logits: &[bool],
    ) -> Result<Vec<Logits>> {
        assert_eq!(seqs.len(), logits.len(), "one logits flag per sequence");
        self.run_forward(seqs, logits, None)
    }

    /// Runs `tokens` as a chain on top of the cache and commits them, computing no logits: a
    /// draft model catching up on committed tokens needs only their K/V, and its head (with the
    /// restricted head, a row of the whole vocabulary per token) would cost more than its layers.
    pub fn append(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<()> {
        let tree = TokenTree::chain(tokens);
        self.run_forward(&mut [SeqTree::new(cache, &tree)], &[false], None)?;
        cache.commit_scratch();
        Ok(())
    }

    /// [`Llama::forward`] of one sequence whose nodes `first..` enter the first layer as the
    /// given rows (`[nodes, d_model]`) instead of their tokens' embeddings: a feature-conditioned
    /// drafter feeds the layers a projection of the previous token's feature and this token's
    /// embedding. The tree's tokens still set positions and the mask.
    /// Without `logits`, only features (the head is skipped).
    pub fn forward_rows(&self, seq: SeqTree<'_>, inputs: &[f32], logits: bool) -> Result<Logits> {
        let nodes = seq.tree.len() - seq.first;
        if inputs.len() != nodes * self.cfg.d_model {
            return Err(ModelError::Format {
                path: "<input>".into(),
                message: format!(
                    "{} input floats for {nodes} nodes of width {}",
                    inputs.len(),
                    self.cfg.d_model
                ),
            });
        }
        let mut seqs = [seq];
        Ok(self
            .run_forward(&mut seqs, &[logits], Some(inputs))?
            .remove(0))
    }

    /// The forward of [`Llama::forward_selected`]: the head runs only on the rows of sequences
    /// whose `want` entry is true; `inputs`, when given, replaces the embeddings of all rows.
    fn run_forward(
        &self,
        seqs: &mut [SeqTree<'_>],
        want: &[bool],
        inputs: Option<&[f32]>,
    ) -> Result<Vec<Logits>> {
        let cfg = &self.cfg;
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let shape = AttentionShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: hd,
        };
        let q_row = cfg.n_heads * hd;
        let kv_row = cfg.kv_row();

        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut ancestors = Vec::with_capacity(seqs.len());
        for s in seqs.iter_mut() {
            let depths = s.tree.depths();
            let needed = s.cache.committed() + *depths.iter().max().unwrap_or(&0) as usize + 1;
            if needed > cfg.max_positions {
                return Err(ModelError::ContextFull {
                    needed,
                    limit: cfg.max_positions,
                });
            }
            assert!(
                s.first <= s.cache.scratch() && s.first < s.tree.len(),
                "first must be the first node not yet in the cache"
            );
            for (node, &depth) in depths.iter().enumerate().skip(s.first) {
                let token = s.tree.token(node) as usize;
                if token >= cfg.vocab_size {
                    return Err(ModelError::Format {
                        path: "<input>".into(),
                        message: format!(
                            "token {token} outside the vocabulary of {}",
                            cfg.vocab_size
                        ),
                    });
                }
                tokens.push(token);
                positions.push(s.cache.committed() + depth as usize);
            }
            ancestors.push(s.tree.ancestors());
            s.cache.begin_tree(s.first, s.tree.len() - s.first);
        }
        let rows = tokens.len();
        let (cos, sin) = rope_tables(cfg, &positions);

        let mut x = match inputs {
            Some(rows) => rows.to_vec(),
            None => {
                let mut x = Vec::with_capacity(rows * d);
                for &t in &tokens {
                    x.extend_from_slice(&self.embed[t * d..(t + 1) * d]);
                }
                x
            }
        };
        let mut a = Activations::new(rows, d, q_row, kv_row, cfg.ffn_dim);
        for (li, layer) in self.layers.iter().enumerate() {
            // From the second layer on, `a.h` holds the layer before's MLP output, which joins
            // the residual stream as the norm reads it.
            if li == 0 {
                rms_norm(&x, &layer.attn_norm, cfg.rms_eps, &mut a.h);
            } else {
                add_rms_norm(&mut x, &mut a.h, &layer.attn_norm, cfg.rms_eps);
            }
            // Each product names the one after it: the team's helpers read their shares of it
            // ahead while they wait (attention, and the serial work between sections).
            read_ahead_of([&layer.o]);
            forward_many(
                [&layer.q, &layer.k, &layer.v],
                &a.h,
                rows,
                [&mut a.q, &mut a.k, &mut a.v],
            )?;
            apply_rope(cfg.rope_style, &mut a.q, hd, &cos, &sin);
            apply_rope(cfg.rope_style, &mut a.k, hd, &cos, &sin);
            let mut start = 0;
            for (s, anc) in seqs.iter_mut().zip(&ancestors) {
                let n = s.tree.len() - s.first;
                let wpn = anc.words_per_node();
                s.cache.append(
                    li,
                    &a.k[start * kv_row..(start + n) * kv_row],
                    &a.v[start * kv_row..(start + n) * kv_row],
                );
                let (kc, vc) = s.cache.layer(li);
                tree_attention(
                    shape,
                    &a.q[start * q_row..(start + n) * q_row],
                    kc,
                    vc,
                    s.cache.committed(),
                    s.first,
                    &anc.words()[s.first * wpn..],
                    wpn,
                    &mut a.attn[start * q_row..(start + n) * q_row],
                );
                start += n;
            }
            read_ahead_of([&layer.gate, &layer.up]);
            layer.o.forward_into(&a.attn, rows, &mut a.h)?;
            add_rms_norm(&mut x, &mut a.h, &layer.ffn_norm, cfg.rms_eps);
            read_ahead_of([&layer.down]);
            forward_many(
                [&layer.gate, &layer.up],
                &a.h,
                rows,
                [&mut a.gate, &mut a.up],
            )?;
            swiglu(&mut a.gate, &a.up, rows);
            match self.layers.get(li + 1) {
                Some(next) => read_ahead_of([&next.q, &next.k, &next.v]),
                None => read_ahead_of([&self.lm_head]),
            }
            layer.down.forward_into(&a.gate, rows, &mut a.h)?;
        }
        let vocab = cfg.vocab_size;
        let counts: Vec<usize> = seqs.iter().map(|s| s.tree.len() - s.first).collect();
        let wanted_rows: usize = counts
            .iter()
            .zip(want)
            .filter(|(_, &w)| w)
            .map(|(n, _)| n)
            .sum();
        // Every node's feature (the head's input); cheap next to the head itself. The last
        // layer's MLP output joins the residual stream as the final norm reads it.
        let mut h = std::mem::take(&mut a.h);
        if self.layers.is_empty() {
            rms_norm(&x, &self.final_norm, cfg.rms_eps, &mut h);
        } else {
            add_rms_norm(&mut x, &mut h, &self.final_norm, cfg.rms_eps);
        }
        let mut start = 0;
        let mut out: Vec<Logits> = counts
            .iter()
            .map(|&n| {
                let features = h[start * d..(start + n) * d].to_vec();
                start += n;
                Logits::from_rows(Vec::new(), vocab).with_features(features, d)
            })
            .collect();
        if wanted_rows == 0 {
            return Ok(out);
        }
        // The head's input: every row, or (some sequences want no logits) the wanted rows.
        let h = if wanted_rows == rows {
            h
        } else {
            let mut start = 0;
            let mut kept = Vec::with_capacity(wanted_rows * d);
            for (&n, &w) in counts.iter().zip(want) {
                if w {
                    kept.extend_from_slice(&h[start * d..(start + n) * d]);
                }
                start += n;
            }
            kept
        };
        let mut logits = self.lm_head.forward(&h, wanted_rows)?;
        if let Some(ids) = &self.head_ids {
            let mut full = vec![f32::NEG_INFINITY; wanted_rows * cfg.vocab_size];
            for (r, row) in logits.chunks(ids.len()).enumerate() {
                for (&t, &l) in ids.iter().zip(row) {
                    full[r * cfg.vocab_size + t as usize] = l;
                }
            }
            logits = full;
        }

        // Each wanted sequence's rows, split off from the end; the first wanted one takes what
        // is left whole (`split_off(0)` would copy it: a vocabulary row per node).
        for ((o, &n), &w) in out.iter_mut().zip(&counts).zip(want).rev() {
            if w {
                let at = logits.len() - n * vocab;
                let rows = if at == 0 {
                    std::mem::take(&mut logits)
                } else {
                    logits.split_off(at)
                };
                o.set_rows(rows);
            }
        }
        Ok(out)
    }

    /// Runs `tokens` as a chain on top of the cache and commits all of them: prompt prefill.
    /// Returns the logits of the last token.
    pub fn prefill(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
        let tree = TokenTree::chain(tokens);
        let logits = self.forward(&mut [SeqTree::new(cache, &tree)])?.remove(0);
        cache.commit_scratch();
        Ok(logits.node(tokens.len() - 1).to_vec())
    }
}

/// [`read_ahead`] of the linears' weights, where all are quantized (the kernel's own layout).
fn read_ahead_of<const N: usize>(ls: [&Linear; N]) {
    if let Some(ms) = all_quantized(ls) {
        read_ahead(&ms);
    }
}

/// The linears' matrices in our kernel's layout, where all of them are quantized.
fn all_quantized<const N: usize>(ls: [&Linear; N]) -> Option<[&QuantMatrix; N]> {
    let ms = ls.map(|l| match &l.w {
        Weight::Quant(m) => Some(m),
        _ => None,
    });
    if ms.iter().any(Option::is_none) {
        return None;
    }
    Some(ms.map(|m| m.expect("checked above")))
}

/// A forward's intermediate rows, allocated once and overwritten whole by every layer's steps:
/// a buffer per step and layer would be allocated and zeroed afresh (about 0.7 MB a layer for
/// Qwen2.5-Coder-1.5B's 8-node tree), on the calling thread while the team waits.
struct Activations {
    /// A norm's output, then the attention output's and the MLP's projections (`[rows, d]`).
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl Activations {
    fn new(rows: usize, d: usize, q_row: usize, kv_row: usize, ffn: usize) -> Self {
        let zeros = |width: usize| vec![0f32; rows * width];
        Activations {
            h: zeros(d),
            q: zeros(q_row),
            k: zeros(kv_row),
            v: zeros(kv_row),
            attn: zeros(q_row),
            gate: zeros(ffn),
            up: zeros(ffn),
        }
    }
}

/// cos/sin of `position * theta^(-2i/head_dim)` for every row, `[rows, head_dim / 2]`.
fn rope_tables(cfg: &ModelConfig, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let half = cfg.head_dim / 2;
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    let freqs: Vec<f64> = (0..half)
        .map(|i| (cfg.rope_theta as f64).powf(-((2 * i) as f64) / cfg.head_dim as f64))
        .collect();
    for &p in positions {
        for &freq in &freqs {
            let a = p as f64 * freq;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates every head of every row in place. `x` is `[rows, heads, head_dim]`.
fn apply_rope(style: RopeStyle, x: &mut [f32], hd: usize, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    let rows = cos.len() / half;
    let row_len = x.len() / rows;
    for (r, row) in x.chunks_mut(row_len).enumerate() {
        let (c, s) = (
            &cos[r * half..(r + 1) * half],
            &sin[r * half..(r + 1) * half],
        );
        let rotate = |x0: &mut f32, x1: &mut f32, c: f32, s: f32| {
            let (a, b) = (*x0, *x1);
            *x0 = a * c - b * s;
            *x1 = a * s + b * c;
        };
        for head in row.chunks_mut(hd) {
            // One loop per style, so that the halves' loop vectorises.
            match style {
                RopeStyle::Neox => {
                    let (lo, hi) = head.split_at_mut(half);
                    for i in 0..half {
                        rotate(&mut lo[i], &mut hi[i], c[i], s[i]);
                    }
                }
                RopeStyle::Interleaved => {
                    for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                        let (x0, x1) = pair.split_at_mut(1);
                        rotate(&mut x0[0], &mut x1[0], c[i], s[i]);
                    }
                }
            }
        }
    }
}
