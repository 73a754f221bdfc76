//! ONNX export of a [`Llama`] with the KV cache as explicit inputs and outputs, for ONNX Runtime.
//!
//! The graph scores a batch of tree nodes on top of a cache, exactly like [`Llama::forward`] for
//! one sequence, and leaves the cache to the caller:
//!
//! | name | type | shape | meaning |
//! |---|---|---|---|
//! | `input_ids` | int64 | `[n]` | the nodes' tokens |
//! | `positions` | int64 | `[n]` | committed + depth of each node |
//! | `attn_bias` | float | `[n, past + n]` | 0 where a node may attend (committed positions, its ancestors, itself), -inf elsewhere |
//! | `past_k.{l}`, `past_v.{l}` | float | `[past, kv_heads * head_dim]` | layer `l`'s cache, position-major (as [`KvCache`](crate::KvCache)) |
//! | `logits` | float | `[n, head_rows]` | the head's logits |
//! | `head_token_ids` | int64 | `[head_rows]` | token id of each head row (the whole vocabulary unless the head is restricted) |
//! | `new_k.{l}`, `new_v.{l}` | float | `[n, kv_heads * head_dim]` | the nodes' K (after RoPE) and V, to append to the cache |
//!
//! A feature-conditioned drafter's export ([`crate::FeatureDrafter::export_onnx`]) has two more:
//!
//! | name | type | shape | meaning |
//! |---|---|---|---|
//! | `prev_features` | float | `[n, d]` | input: the feature preceding each node (the LLM's, or the drafter's prediction for its parent) |
//! | `features` | float | `[n, d]` | output: the nodes' predicted features (the head's input) |
//!
//! Metadata: `specinfer.vocab_size`, `specinfer.max_positions`, and whatever the caller adds (the
//! tokenizer's SHA-256, so a client refuses an SSM made for another tokenizer).
//!
//! The file is written with a small protobuf encoder (the ONNX schema needs six message types),
//! so exporting needs neither Python nor a protobuf code generator. Weights are stored as f32.

use std::path::Path;

use crate::llama::Linear;
use crate::{Llama, ModelError, Result, RopeStyle};

/// ONNX opset and IR version the graph is written for (ONNX Runtime 1.14 or newer runs it).
const OPSET: i64 = 17;
const IR_VERSION: i64 = 8;

/// What feeds the first layer of an exported graph.
pub(crate) enum GraphInput<'a> {
    /// The embedding rows of `input_ids` (an SSM, any [`Llama`]).
    Tokens,
    /// A feature-conditioned drafter's: `fc` over `[prev_features ; the token's embedding row]`,
    /// the rows held for the head's tokens only (`token_row`, `u32::MAX` elsewhere: a zero row).
    Features {
        token_row: &'a [u32],
        fc: &'a Linear,
    },
}

impl Llama {
    /// Writes the model as ONNX to `path`; `metadata` is stored as the model's metadata properties.
    pub fn export_onnx(&self, path: &Path, metadata: &[(&str, &str)]) -> Result<()> {
        write_model(self.onnx_graph(GraphInput::Tokens)?, self, path, metadata)
    }
}

/// Writes `graph`, exported from `body`, as an ONNX model file.
pub(crate) fn write_model(
    graph: Pb,
    body: &Llama,
    path: &Path,
    metadata: &[(&str, &str)],
) -> Result<()> {
    let mut model = Pb::default();
    model.int(1, IR_VERSION);
    model.str(2, "specinfer");
    model.str(3, env!("CARGO_PKG_VERSION"));
    let mut opset = Pb::default();
    opset.str(1, "");
    opset.int(2, OPSET);
    model.msg(8, &opset);
    model.msg(7, &graph);
    let vocab = body.cfg.vocab_size.to_string();
    let max_pos = body.cfg.max_positions.to_string();
    let builtin = [
        ("specinfer.vocab_size", vocab.as_str()),
        ("specinfer.max_positions", max_pos.as_str()),
    ];
    for (k, v) in builtin.iter().chain(metadata) {
        let mut entry = Pb::default();
        entry.str(1, k);
        entry.str(2, v);
        model.msg(14, &entry);
    }
    std::fs::write(path, &model.0).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })
}

impl Llama {
    pub(crate) fn onnx_graph(&self, input: GraphInput) -> Result<Pb> {
        let cfg = &self.cfg;
        let (d, hd, half) = (cfg.d_model, cfg.head_dim, cfg.head_dim / 2);
        let (heads, kv_heads) = (cfg.n_heads as i64, cfg.n_kv_heads as i64);
        let group = heads / kv_heads;
        let kv_row = cfg.kv_row() as i64;
        let mut g = Graph::default();
        g.input("input_ids", INT64, &[Dim::N]);
        g.input("positions", INT64, &[Dim::N]);
        g.input("attn_bias", FLOAT, &[Dim::N, Dim::Total]);

        let gather = [("axis", Attr::Int(0))];
        let mut x = match &input {
            GraphInput::Tokens => {
                let embed = g.init_f32("embed", &[cfg.vocab_size as i64, d as i64], &self.embed);
                g.op("Gather", &[&embed, "input_ids"], &gather)
            }
            GraphInput::Features { token_row, fc } => {
                g.input("prev_features", FLOAT, &[Dim::N, Dim::Fixed(d as i64)]);
                let held = (self.embed.len() / d) as i64;
                let rows: Vec<i64> = token_row
                    .iter()
                    .map(|&r| if r == u32::MAX { held } else { r as i64 })
                    .collect();
                let rows = g.init_i64("token_rows", &[rows.len() as i64], &rows);
                let rows = g.op("Gather", &[&rows, "input_ids"], &gather);
                let mut embed = self.embed.clone();
                embed.extend(std::iter::repeat_n(0.0, d));
                let embed = g.init_f32("embed_rows", &[held + 1, d as i64], &embed);
                let e = g.op("Gather", &[&embed, &rows], &gather);
                let cat = g.op("Concat", &["prev_features", &e], &[("axis", Attr::Int(1))]);
                g.linear(&cat, fc, "fc")?
            }
        };

        // RoPE: angle = position * theta^(-2i / head_dim), shared by every layer.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| (cfg.rope_theta as f64).powf(-((2 * i) as f64) / hd as f64) as f32)
            .collect();
        let inv_freq = g.init_f32("inv_freq", &[1, half as i64], &inv_freq);
        let pos = g.op("Cast", &["positions"], &[("to", Attr::Int(FLOAT as i64))]);
        let axis1 = g.init_i64("axis1", &[1], &[1]);
        let pos = g.op("Unsqueeze", &[&pos, &axis1], &[]);
        let angles = g.op("Mul", &[&pos, &inv_freq], &[]);
        // Rotated pairs are (2i, 2i+1) when interleaved, (i, i + half) for NEOX: view a head as
        // [half, 2] or [2, half] and rotate the two slices of the size-2 axis.
        let (pair_shape, pair_axis, cs_shape): (Vec<i64>, i64, Vec<i64>) = match cfg.rope_style {
            RopeStyle::Interleaved => (vec![half as i64, 2], 3, vec![-1, 1, half as i64, 1]),
            RopeStyle::Neox => (vec![2, half as i64], 2, vec![-1, 1, 1, half as i64]),
        };
        let cs_shape = g.init_i64("rope_cs_shape", &[4], &cs_shape);
        let cos = g.op("Cos", &[&angles], &[]);
        let cos = g.op("Reshape", &[&cos, &cs_shape], &[]);
        let sin = g.op("Sin", &[&angles], &[]);
        let sin = g.op("Reshape", &[&sin, &cs_shape], &[]);
        let rope = |g: &mut Graph, t: &str, n_heads: i64| {
            let shape = g.init_i64(
                &format!("rope_shape_{n_heads}"),
                &[4],
                &[-1, n_heads, pair_shape[0], pair_shape[1]],
            );
            let t = g.op("Reshape", &[t, &shape], &[]);
            let parts = g.op_n("Split", &[&t], 2, &[("axis", Attr::Int(pair_axis))]);
            let (a, b) = (&parts[0], &parts[1]);
            let ac = g.op("Mul", &[a, &cos], &[]);
            let bs = g.op("Mul", &[b, &sin], &[]);
            let first = g.op("Sub", &[&ac, &bs], &[]);
            let as_ = g.op("Mul", &[a, &sin], &[]);
            let bc = g.op("Mul", &[b, &cos], &[]);
            let second = g.op("Add", &[&as_, &bc], &[]);
            let joined = g.op(
                "Concat",
                &[&first, &second],
                &[("axis", Attr::Int(pair_axis))],
            );
            let flat = g.init_i64(&format!("flat_{n_heads}"), &[2], &[-1, n_heads * hd as i64]);
            g.op("Reshape", &[&joined, &flat], &[])
        };

        let scale = g.init_f32("attn_scale", &[], &[1.0 / (hd as f32).sqrt()]);
        let kv_split = g.init_i64("kv_split", &[3], &[-1, kv_heads, hd as i64]);
        let q_split = g.init_i64("q_split", &[4], &[-1, kv_heads, group, hd as i64]);
        let out_flat = g.init_i64("out_flat", &[2], &[-1, heads * hd as i64]);
        let eps = g.init_f32("rms_eps", &[], &[cfg.rms_eps]);

        for (l, layer) in self.layers.iter().enumerate() {
            let (pk, pv) = (format!("past_k.{l}"), format!("past_v.{l}"));
            g.input(&pk, FLOAT, &[Dim::Past, Dim::Fixed(kv_row)]);
            g.input(&pv, FLOAT, &[Dim::Past, Dim::Fixed(kv_row)]);
            let h = g.rms_norm(&x, &layer.attn_norm, &eps, &format!("l{l}.attn_norm"))?;
            let q = g.linear(&h, &layer.q, &format!("l{l}.q"))?;
            let k = g.linear(&h, &layer.k, &format!("l{l}.k"))?;
            let v = g.linear(&h, &layer.v, &format!("l{l}.v"))?;
            let q = rope(&mut g, &q, heads);
            let k = rope(&mut g, &k, kv_heads);
            g.output(
                &k,
                &format!("new_k.{l}"),
                FLOAT,
                &[Dim::N, Dim::Fixed(kv_row)],
            );
            g.output(
                &v,
                &format!("new_v.{l}"),
                FLOAT,
                &[Dim::N, Dim::Fixed(kv_row)],
            );

            // The cache, `[past + n, kv_heads * hd]`, as `[kv_heads, 1, ., .]` so that it
            // broadcasts over the query heads sharing each KV head (GQA without copies).
            let per_head = |g: &mut Graph, past: &str, new: &str, perm: Vec<i64>| {
                let all = g.op("Concat", &[past, new], &[("axis", Attr::Int(0))]);
                let all = g.op("Reshape", &[&all, &kv_split], &[]);
                let all = g.op("Transpose", &[&all], &[("perm", Attr::Ints(perm))]);
                g.op("Unsqueeze", &[&all, &axis1], &[])
            };
            let kt = per_head(&mut g, &pk, &k, vec![1, 2, 0]);
            let v_all = per_head(&mut g, &pv, &v, vec![1, 0, 2]);
            // Queries as [kv_heads, group, n, hd]: head h uses KV head h / group.
            let q = g.op("Reshape", &[&q, &q_split], &[]);
            let q = g.op(
                "Transpose",
                &[&q],
                &[("perm", Attr::Ints(vec![1, 2, 0, 3]))],
            );
            let scores = g.op("MatMul", &[&q, &kt], &[]);
            let scores = g.op("Mul", &[&scores, &scale], &[]);
            let scores = g.op("Add", &[&scores, "attn_bias"], &[]);
            let probs = g.op("Softmax", &[&scores], &[("axis", Attr::Int(-1))]);
            let attn = g.op("MatMul", &[&probs, &v_all], &[]);
            let attn = g.op(
                "Transpose",
                &[&attn],
                &[("perm", Attr::Ints(vec![2, 0, 1, 3]))],
            );
            let attn = g.op("Reshape", &[&attn, &out_flat], &[]);
            let o = g.linear(&attn, &layer.o, &format!("l{l}.o"))?;
            x = g.op("Add", &[&x, &o], &[]);

            let h = g.rms_norm(&x, &layer.ffn_norm, &eps, &format!("l{l}.ffn_norm"))?;
            let gate = g.linear(&h, &layer.gate, &format!("l{l}.gate"))?;
            let up = g.linear(&h, &layer.up, &format!("l{l}.up"))?;
            let sig = g.op("Sigmoid", &[&gate], &[]);
            let act = g.op("Mul", &[&gate, &sig], &[]);
            let act = g.op("Mul", &[&act, &up], &[]);
            let down = g.linear(&act, &layer.down, &format!("l{l}.down"))?;
            x = g.op("Add", &[&x, &down], &[]);
        }
        let h = g.rms_norm(&x, &self.final_norm, &eps, "final_norm")?;
        if let GraphInput::Features { .. } = input {
            g.output(&h, "features", FLOAT, &[Dim::N, Dim::Fixed(d as i64)]);
        }
        let logits = g.linear(&h, &self.lm_head, "lm_head")?;
        let rows = self.head_tokens() as i64;
        g.output(&logits, "logits", FLOAT, &[Dim::N, Dim::Fixed(rows)]);
        let ids: Vec<i64> = match &self.head_ids {
            Some(ids) => ids.iter().map(|&t| t as i64).collect(),
            None => (0..rows).collect(),
        };
        let ids = g.init_i64("head_ids", &[rows], &ids);
        g.output(&ids, "head_token_ids", INT64, &[Dim::Fixed(rows)]);
        Ok(g.finish())
    }
}

const FLOAT: i32 = 1;
const INT64: i32 = 7;

/// A protobuf message being encoded (only the wire types ONNX needs: varint and bytes).
#[derive(Default)]
pub(crate) struct Pb(Vec<u8>);

impl Pb {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn int(&mut self, field: u32, v: i64) {
        self.varint((field as u64) << 3);
        self.varint(v as u64);
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.varint(((field as u64) << 3) | 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn str(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    fn msg(&mut self, field: u32, m: &Pb) {
        self.bytes(field, &m.0);
    }
}

enum Attr {
    Int(i64),
    Ints(Vec<i64>),
}

/// A symbolic or fixed dimension of a graph input/output.
#[derive(Clone, Copy)]
enum Dim {
    /// Nodes in this call.
    N,
    /// Cached positions before this call.
    Past,
    /// `past + n`.
    Total,
    Fixed(i64),
}

#[derive(Default)]
struct Graph {
    nodes: Vec<Pb>,
    initializers: Vec<Pb>,
    inputs: Vec<Pb>,
    outputs: Vec<Pb>,
    next: usize,
}

impl Graph {
    fn value_info(name: &str, elem: i32, dims: &[Dim]) -> Pb {
        let mut shape = Pb::default();
        for d in dims {
            let mut dim = Pb::default();
            match d {
                Dim::N => dim.str(2, "n"),
                Dim::Past => dim.str(2, "past"),
                Dim::Total => dim.str(2, "total"),
                Dim::Fixed(v) => dim.int(1, *v),
            }
            shape.msg(1, &dim);
        }
        let mut tensor = Pb::default();
        tensor.int(1, elem as i64);
        tensor.msg(2, &shape);
        let mut ty = Pb::default();
        ty.msg(1, &tensor);
        let mut info = Pb::default();
        info.str(1, name);
        info.msg(2, &ty);
        info
    }

    fn input(&mut self, name: &str, elem: i32, dims: &[Dim]) {
        self.inputs.push(Self::value_info(name, elem, dims));
    }

    /// Exposes `value` as the graph output `name`.
    fn output(&mut self, value: &str, name: &str, elem: i32, dims: &[Dim]) {
        self.node("Identity", &[value], &[name.to_owned()], &[]);
        self.outputs.push(Self::value_info(name, elem, dims));
    }

    fn init(&mut self, name: &str, dims: &[i64], elem: i32, raw: Vec<u8>) -> String {
        let mut t = Pb::default();
        for &d in dims {
            t.int(1, d);
        }
        t.int(2, elem as i64);
        t.str(8, name);
        t.bytes(9, &raw);
        self.initializers.push(t);
        name.to_owned()
    }

    fn init_f32(&mut self, name: &str, dims: &[i64], data: &[f32]) -> String {
        debug_assert_eq!(dims.iter().product::<i64>(), data.len() as i64);
        let raw = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.init(name, dims, FLOAT, raw)
    }

    fn init_i64(&mut self, name: &str, dims: &[i64], data: &[i64]) -> String {
        let raw = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.init(name, dims, INT64, raw)
    }

    fn node(&mut self, op: &str, inputs: &[&str], outputs: &[String], attrs: &[(&str, Attr)]) {
        let mut n = Pb::default();
        for i in inputs {
            n.str(1, i);
        }
        for o in outputs {
            n.str(2, o);
        }
        n.str(3, &format!("{op}_{}", self.next));
        n.str(4, op);
        for (name, attr) in attrs {
            let mut a = Pb::default();
            a.str(1, name);
            match attr {
                Attr::Int(v) => {
                    a.int(20, 2);
                    a.int(3, *v);
                }
                Attr::Ints(vs) => {
                    a.int(20, 7);
                    for v in vs {
                        a.int(8, *v);
                    }
                }
            }
            n.msg(5, &a);
        }
        self.next += 1;
        self.nodes.push(n);
    }

    /// Adds a node with `outputs` fresh outputs and returns their names.
    fn op_n(
        &mut self,
        op: &str,
        inputs: &[&str],
        outputs: usize,
        attrs: &[(&str, Attr)],
    ) -> Vec<String> {
        let names: Vec<String> = (0..outputs)
            .map(|i| format!("{op}_{}.{i}", self.next))
            .collect();
        self.node(op, inputs, &names, attrs);
        names
    }

    fn op(&mut self, op: &str, inputs: &[&str], attrs: &[(&str, Attr)]) -> String {
        self.op_n(op, inputs, 1, attrs).remove(0)
    }

    /// `x W^T (+ b)` with `W^T` stored as an `[in, out]` initializer.
    fn linear(&mut self, x: &str, l: &Linear, name: &str) -> Result<String> {
        let (rows, cols) = l.w.shape();
        let w = l.w.to_f32()?;
        let mut wt = vec![0f32; w.len()];
        for r in 0..rows {
            for c in 0..cols {
                wt[c * rows + r] = w[r * cols + c];
            }
        }
        let wt = self.init_f32(&format!("{name}.weight"), &[cols as i64, rows as i64], &wt);
        let y = self.op("MatMul", &[x, &wt], &[]);
        Ok(match &l.b {
            Some(b) => {
                let b = self.init_f32(&format!("{name}.bias"), &[b.len() as i64], b);
                self.op("Add", &[&y, &b], &[])
            }
            None => y,
        })
    }

    fn rms_norm(&mut self, x: &str, w: &[f32], eps: &str, name: &str) -> Result<String> {
        let w = self.init_f32(&format!("{name}.weight"), &[w.len() as i64], w);
        let sq = self.op("Mul", &[x, x], &[]);
        let ms = self.op(
            "ReduceMean",
            &[&sq],
            &[("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::Int(1))],
        );
        let ms = self.op("Add", &[&ms, eps], &[]);
        let rms = self.op("Sqrt", &[&ms], &[]);
        let y = self.op("Div", &[x, &rms], &[]);
        Ok(self.op("Mul", &[&y, &w], &[]))
    }

    fn finish(self) -> Pb {
        let mut g = Pb::default();
        for n in &self.nodes {
            g.msg(1, n);
        }
        g.str(2, "specinfer_llama");
        for t in &self.initializers {
            g.msg(5, t);
        }
        for i in &self.inputs {
            g.msg(11, i);
        }
        for o in &self.outputs {
            g.msg(12, o);
        }
        g
    }
}
