//! Training the feature-conditioned drafter ([`specinfer_model::FeatureDrafter`], EAGLE's
//! design) from the LLM's own features over the teacher's answers.
//!
//! Position `p` sees the LLM's feature of position `p - 1` and the embedding of token `p`; it
//! is trained to predict the LLM's feature of position `p` (squared error) and, through the
//! LLM's frozen head restricted to the drafter's tokens, the LLM's next-token distribution there
//! (cross-entropy against the LLM's own distribution over those tokens, not only its token). The
//! input features get a little noise, as EAGLE does: inside a tree the drafter reads its own,
//! imperfect, predictions.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};
use specinfer_model::{KvCache, Llama, SeqTree, FEATURE_DRAFT_KIND};
use specinfer_wire::TokenTree;

use crate::ssm::{decoder_layer, linear, normal, rms_norm, Causal, ExportedShape};
use crate::teacher::Example;
use crate::train::{scheduled_lr, step_rng};

/// The LLM's features along the teacher's examples (prompt tail + answer).
pub struct FeatureSet {
    pub dim: usize,
    /// Per example: its tokens, where its answer starts among them, and its features
    /// (`[tokens, dim]`).
    pub examples: Vec<(Vec<u32>, usize, Vec<f32>)>,
}

/// SHA-256 of a file (the teacher answers a feature set was recorded from).
pub fn file_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// SHA-256 of examples made here rather than read from a file (the recorded answers).
pub fn examples_sha256(examples: &[Example]) -> Result<String> {
    let mut h = Sha256::new();
    for e in examples {
        h.update(serde_json::to_vec(e)?);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Records the LLM's features of every example (its last `max_len` tokens), or loads them from
/// `cache` when it was recorded from the same examples (`source_sha256`: of the teacher's answer
/// file, or [`examples_sha256`] of examples made in memory).
pub fn record(
    llm: &Llama,
    examples: &[Example],
    max_len: usize,
    source_sha256: &str,
    cache: &Path,
) -> Result<FeatureSet> {
    let dim = llm.config().d_model;
    let meta_path = cache.with_extension("json");
    let meta = serde_json::json!({"source_sha256": source_sha256, "max_len": max_len, "examples": examples.len(), "dim": dim});
    if cache.exists()
        && std::fs::read_to_string(&meta_path)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .is_some_and(|m| m == meta)
    {
        eprintln!(
            "      features recorded earlier from the same examples: {}",
            cache.display()
        );
        return load(cache, dim);
    }
    let t0 = Instant::now();
    let mut out = Vec::with_capacity(examples.len());
    let mut recorded = 0usize;
    for (i, chunk) in examples.chunks(8).enumerate() {
        let seqs: Vec<(Vec<u32>, usize)> = chunk
            .iter()
            .map(|e| {
                let mut s = e.prompt.clone();
                s.extend(&e.answer);
                let cut = s.len().saturating_sub(max_len);
                (s[cut..].to_vec(), e.prompt.len().saturating_sub(cut))
            })
            .collect();
        let trees: Vec<TokenTree> = seqs.iter().map(|(s, _)| TokenTree::chain(s)).collect();
        let mut caches: Vec<KvCache> = seqs.iter().map(|_| KvCache::new(llm.config())).collect();
        let mut batch: Vec<SeqTree> = caches
            .iter_mut()
            .zip(&trees)
            .map(|(c, t)| SeqTree::new(c, t))
            .collect();
        let no_logits = vec![false; batch.len()];
        let outs = llm.forward_selected(&mut batch, &no_logits)?;
        for ((tokens, answer_from), o) in seqs.into_iter().zip(outs) {
            let features: Vec<f32> = (0..tokens.len())
                .flat_map(|p| {
                    o.feature(p)
                        .expect("the CPU engine gives features")
                        .to_vec()
                })
                .collect();
            recorded += tokens.len();
            out.push((tokens, answer_from, features));
        }
        if i % 25 == 0 {
            eprint!(
                "\r      features: {}/{} examples, {:.0} tokens/s   ",
                out.len(),
                examples.len(),
                recorded as f64 / t0.elapsed().as_secs_f64()
            );
        }
    }
    eprintln!();
    let set = FeatureSet { dim, examples: out };
    save(&set, cache)?;
    std::fs::write(&meta_path, serde_json::to_string(&meta)?)?;
    Ok(set)
}

/// Features in f16 (half the bytes; the drafter's inputs get noise far larger than f16's step).
fn save(set: &FeatureSet, path: &Path) -> Result<()> {
    let dev = Device::Cpu;
    let mut tokens: Vec<u32> = Vec::new();
    let mut bounds = vec![0u32];
    let mut answer_from = Vec::new();
    let mut features: Vec<f32> = Vec::new();
    for (t, a, f) in &set.examples {
        tokens.extend(t);
        bounds.push(tokens.len() as u32);
        answer_from.push(*a as u32);
        features.extend(f);
    }
    let n = tokens.len();
    let t: HashMap<String, Tensor> = [
        ("tokens", Tensor::from_vec(tokens, n, &dev)?),
        ("bounds", Tensor::new(bounds.as_slice(), &dev)?),
        ("answer_from", Tensor::new(answer_from.as_slice(), &dev)?),
        (
            "features",
            Tensor::from_vec(features, (n, set.dim), &dev)?.to_dtype(DType::F16)?,
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    candle_core::safetensors::save(&t, path)?;
    Ok(())
}

fn load(path: &Path, dim: usize) -> Result<FeatureSet> {
    let t = candle_core::safetensors::load(path, &Device::Cpu)?;
    let get = |k: &str| {
        t.get(k)
            .with_context(|| format!("{}: no {k}", path.display()))
    };
    let tokens = get("tokens")?.to_vec1::<u32>()?;
    let bounds = get("bounds")?.to_vec1::<u32>()?;
    let answer_from = get("answer_from")?.to_vec1::<u32>()?;
    let features = get("features")?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let examples = bounds
        .windows(2)
        .zip(answer_from)
        .map(|(w, a)| {
            let (s, e) = (w[0] as usize, w[1] as usize);
            (
                tokens[s..e].to_vec(),
                a as usize,
                features[s * dim..e * dim].to_vec(),
            )
        })
        .collect();
    Ok(FeatureSet { dim, examples })
}

/// The drafter's shape.
#[derive(Clone, Debug)]
pub struct DrafterShape {
    pub n_heads: usize,
    pub ffn_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub max_positions: usize,
}

/// The trainable drafter: `fc`, one decoder layer and a final norm; the LLM's embedding rows
/// of the head's tokens stay frozen (they are its input embedding and its head).
pub struct TrainableDrafter {
    pub shape: DrafterShape,
    pub dim: usize,
    pub vocab_size: usize,
    pub head_ids: Vec<u32>,
    /// `[head + 1, d]`: the head tokens' LLM embeddings and a zero row for every other token.
    embed_in: Tensor,
    /// `[head, d]`: the LLM's head rows of the head's tokens.
    head: Tensor,
    vars: Vec<(String, Var)>,
}

const LAYER: &str = "model.layers.0.";

impl TrainableDrafter {
    /// A fresh drafter for `llm`: the residual outputs small, the final norm the LLM's, and `fc`
    /// such that the layer first passes the previous feature on.
    pub fn init(llm: &Llama, head_ids: Vec<u32>, shape: DrafterShape, seed: u64) -> Result<Self> {
        let cfg = llm.config();
        let d = cfg.d_model;
        let dev = Device::Cpu;
        let emb = llm.token_embeddings();
        let rows: Vec<f32> = head_ids
            .iter()
            .flat_map(|&t| emb[t as usize * d..(t as usize + 1) * d].iter().copied())
            .collect();
        let head = Tensor::from_vec(rows, (head_ids.len(), d), &dev)?;
        let embed_in = Tensor::cat(&[&head, &Tensor::zeros((1, d), DType::F32, &dev)?], 0)?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut normal = |n: usize, std: f32| normal(&mut rng, n, std);
        let mut vars = Vec::new();
        let mut add = |name: String, data: Vec<f32>, dims: &[usize]| -> Result<()> {
            vars.push((
                name,
                Var::from_tensor(&Tensor::from_vec(data, dims, &dev)?)?,
            ));
            Ok(())
        };
        // On the feature half, the inverse of the final norm's weights: with the residual
        // outputs near zero the drafter starts out predicting the previous position's feature.
        let norm = llm.final_norm_weights();
        let mut fc = normal(d * 2 * d, 0.01);
        for i in 0..d {
            let w = norm[i];
            fc[i * 2 * d + i] += 1.0 / if w.abs() < 0.1 { 0.1f32.copysign(w) } else { w };
        }
        add("fc.weight".into(), fc, &[d, 2 * d])?;
        add("fc.bias".into(), vec![0.0; d], &[d])?;
        let f = shape.ffn_dim;
        let std = 0.02;
        add(format!("{LAYER}input_layernorm.weight"), vec![1.0; d], &[d])?;
        add(
            format!("{LAYER}post_attention_layernorm.weight"),
            vec![1.0; d],
            &[d],
        )?;
        for n in ["q_proj", "k_proj", "v_proj"] {
            add(
                format!("{LAYER}self_attn.{n}.weight"),
                normal(d * d, std),
                &[d, d],
            )?;
        }
        add(
            format!("{LAYER}self_attn.o_proj.weight"),
            normal(d * d, std / 4.0),
            &[d, d],
        )?;
        add(
            format!("{LAYER}mlp.gate_proj.weight"),
            normal(f * d, std),
            &[f, d],
        )?;
        add(
            format!("{LAYER}mlp.up_proj.weight"),
            normal(f * d, std),
            &[f, d],
        )?;
        add(
            format!("{LAYER}mlp.down_proj.weight"),
            normal(d * f, std / 4.0),
            &[d, f],
        )?;
        add(
            "model.norm.weight".into(),
            llm.final_norm_weights().to_vec(),
            &[d],
        )?;
        Ok(TrainableDrafter {
            shape,
            dim: d,
            vocab_size: cfg.vocab_size,
            head_ids,
            embed_in,
            head,
            vars,
        })
    }

    /// Starts from the trained weights of an exported drafter (to train it further).
    pub fn load_exported(&mut self, dir: &Path) -> Result<()> {
        let t = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
        for (name, v) in &self.vars {
            let saved = t
                .get(name)
                .with_context(|| format!("{}: no {name}", dir.display()))?;
            v.set(&saved.to_dtype(DType::F32)?)?;
        }
        Ok(())
    }

    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|(_, v)| v.clone()).collect()
    }

    fn get(&self, name: &str) -> Tensor {
        self.vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor().clone())
            .unwrap_or_else(|| panic!("no var {name}"))
    }

    /// Predicted features `[b, l, d]` from the preceding features `prev` (`[b, l, d]`) and the
    /// tokens' rows in `embed_in` (`[b, l]`, u32).
    fn forward(&self, prev: &Tensor, rows: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, d) = prev.dims3()?;
        let e = self
            .embed_in
            .index_select(&rows.flatten_all()?, 0)?
            .reshape((b, l, d))?;
        let x = linear(
            &Tensor::cat(&[prev, &e], 2)?,
            &self.get("fc.weight").contiguous()?,
        )?
        .broadcast_add(&self.get("fc.bias"))?;
        let causal = Causal::new(
            l,
            d / self.shape.n_heads,
            self.shape.rope_theta,
            prev.device(),
        )?;
        let get = |n: &str| self.get(&format!("{LAYER}{n}"));
        let x = decoder_layer(&x, &get, self.shape.n_heads, self.shape.rms_eps, &causal)?;
        rms_norm(&x, &self.get("model.norm.weight"), self.shape.rms_eps)
    }

    /// Logits over the head's tokens of features `[n, d]`.
    fn head_logits(&self, features: &Tensor) -> candle_core::Result<Tensor> {
        features.matmul(&self.head.t()?)
    }

    /// Writes the folder [`specinfer_model::FeatureDrafter::from_safetensors`] loads: the
    /// trained weights in f16, the head tokens' embedding rows in 8 bits with a scale per row
    /// (they are also the head: tied, as in SmolLM2), `config.json` naming the LLM.
    pub fn export(&self, dir: &Path, llm_name: &str, tokenizer_sha256: &[u8; 32]) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for (name, v) in &self.vars {
            tensors.insert(name.clone(), v.as_tensor().to_dtype(DType::F16)?);
        }
        let (q, scale) = specinfer_model::quantize_rows_u8(&self.head)?;
        tensors.insert("model.embed_tokens.weight_scale".into(), scale);
        tensors.insert("model.embed_tokens.weight".into(), q);
        tensors.insert(
            "lm_head.token_ids".into(),
            Tensor::new(self.head_ids.as_slice(), &Device::Cpu)?,
        );
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        let s = &self.shape;
        ExportedShape {
            vocab_size: self.vocab_size,
            d_model: self.dim,
            ffn_dim: s.ffn_dim,
            n_layers: 1,
            n_heads: s.n_heads,
            rms_eps: s.rms_eps,
            rope_theta: s.rope_theta,
            max_positions: s.max_positions,
            tied: true,
            head_tokens: self.head_ids.len(),
            tokenizer_sha256,
        }
        .write(
            dir,
            serde_json::json!({
                "specinfer_draft": FEATURE_DRAFT_KIND,
                "specinfer_feature_llm": llm_name,
            }),
        )?;
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct FeatureTrainConfig {
    pub steps: usize,
    pub batch: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub warmup: usize,
    pub seed: u64,
    /// Weight of the feature regression against the token cross-entropy.
    pub regression_weight: f64,
    /// Std of the Gaussian noise on input features, relative to their RMS.
    pub input_noise: f32,
    /// Passes per step: the first reads the LLM's features; each further pass reads the
    /// previous pass's predictions, shifted one position, as a tree node deeper than the root
    /// reads its parent's predicted feature ("training-time test"), and adds its loss.
    pub passes: usize,
}

/// One batch: windows of `seq_len` positions (from position 1: position 0 has no preceding
/// feature), padded at the end; `mask` selects positions whose next token is an answer token.
struct Batch {
    prev: Tensor,
    rows: Tensor,
    target: Tensor,
    picked: Tensor,
}

fn make_batch(
    set: &FeatureSet,
    picks: &[usize],
    seq_len: usize,
    head_row: &HashMap<u32, u32>,
    zero_row: u32,
    rng: &mut impl Rng,
) -> Result<Option<Batch>> {
    let d = set.dim;
    let l = seq_len;
    let (mut prev, mut rows, mut target, mut picked) = (
        vec![0f32; picks.len() * l * d],
        vec![zero_row; picks.len() * l],
        vec![0f32; picks.len() * l * d],
        Vec::new(),
    );
    for (b, &i) in picks.iter().enumerate() {
        let (tokens, answer_from, f) = &set.examples[i];
        let n = tokens.len();
        if n < 3 {
            continue;
        }
        // Positions start..start + l (each >= 1), drawn so the window holds answer positions.
        let last_start = n.saturating_sub(l).max(1);
        let first_start = answer_from.saturating_sub(l / 2).clamp(1, last_start);
        let start = rng.random_range(first_start..=last_start);
        for j in 0..l.min(n - start) {
            let p = start + j;
            let at = (b * l + j) * d;
            prev[at..at + d].copy_from_slice(&f[(p - 1) * d..p * d]);
            target[at..at + d].copy_from_slice(&f[p * d..(p + 1) * d]);
            rows[b * l + j] = *head_row.get(&tokens[p]).unwrap_or(&zero_row);
            // Trained where the next token is an answer token.
            if p + 1 >= *answer_from && p + 1 < n {
                picked.push((b * l + j) as u32);
            }
        }
    }
    if picked.is_empty() {
        return Ok(None);
    }
    let dev = Device::Cpu;
    let bl = picks.len();
    Ok(Some(Batch {
        prev: Tensor::from_vec(prev, (bl, l, d), &dev)?,
        rows: Tensor::from_vec(rows, (bl, l), &dev)?,
        target: Tensor::from_vec(target, (bl * l, d), &dev)?,
        picked: Tensor::new(picked.as_slice(), &dev)?,
    }))
}

/// Trains `drafter` on `set`; returns the mean loss of each logged window.
pub fn train(
    drafter: &TrainableDrafter,
    set: &FeatureSet,
    cfg: &FeatureTrainConfig,
) -> Result<Vec<f32>> {
    let head_row: HashMap<u32, u32> = drafter
        .head_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| (t, i as u32))
        .collect();
    let zero_row = drafter.head_ids.len() as u32;
    let rms = {
        let (s, n) = set
            .examples
            .iter()
            .take(64)
            .flat_map(|(_, _, f)| f)
            .fold((0f64, 0usize), |(s, n), x| (s + (*x as f64).powi(2), n + 1));
        (s / n.max(1) as f64).sqrt() as f32
    };
    let noise_std = (cfg.input_noise * rms) as f64;
    let mut opt = AdamW::new(
        drafter.vars(),
        ParamsAdamW {
            lr: cfg.lr,
            weight_decay: 0.0,
            ..ParamsAdamW::default()
        },
    )?;
    let t0 = Instant::now();
    let (mut window, mut curve) = (Vec::new(), Vec::new());
    let d = set.dim;
    for step in 0..cfg.steps {
        let lr = scheduled_lr(cfg.lr, cfg.warmup, step, cfg.steps, 0.05);
        opt.set_learning_rate(lr);
        let mut rng = step_rng(cfg.seed, step);
        let picks: Vec<usize> = (0..cfg.batch)
            .map(|_| rng.random_range(0..set.examples.len()))
            .collect();
        let Some(b) = make_batch(set, &picks, cfg.seq_len, &head_row, zero_row, &mut rng)? else {
            continue;
        };
        let prev = if noise_std > 0.0 {
            (&b.prev + b.prev.randn_like(0.0, noise_std)?)?
        } else {
            b.prev.clone()
        };
        let target = b.target.index_select(&b.picked, 0)?;
        let teacher = candle_nn::ops::softmax_last_dim(&drafter.head_logits(&target)?)?;
        let (mut input, mut loss, mut first_ce, mut regression) = (prev, None, None, None);
        for _ in 0..cfg.passes.max(1) {
            let out = drafter.forward(&input, &b.rows)?;
            let pred = out.reshape(((), d))?.index_select(&b.picked, 0)?;
            let mse = (&pred - &target)?.sqr()?.mean_all()?;
            let log_q = candle_nn::ops::log_softmax(&drafter.head_logits(&pred)?, D::Minus1)?;
            let ce = (&teacher * log_q)?.sum(D::Minus1)?.mean_all()?.neg()?;
            let pass = (mse.affine(cfg.regression_weight, 0.0)? + &ce)?;
            loss = Some(match loss {
                None => pass,
                Some(l) => (l + pass)?,
            });
            first_ce.get_or_insert(ce);
            regression.get_or_insert(mse);
            // Position j of the next pass reads this pass's prediction for position j - 1.
            let l = out.dim(1)?;
            input = Tensor::cat(&[&input.narrow(1, 0, 1)?, &out.narrow(1, 0, l - 1)?], 1)?;
        }
        let (loss, ce, regression) = (
            loss.expect("at least one pass"),
            first_ce.expect("at least one pass"),
            regression.expect("at least one pass"),
        );
        opt.backward_step(&loss)?;
        window.push(ce.to_scalar::<f32>()?);
        if (step + 1) % 25 == 0 || step + 1 == cfg.steps {
            let mean = window.iter().sum::<f32>() / window.len() as f32;
            curve.push(mean);
            window.clear();
            let eta =
                t0.elapsed().as_secs_f64() / (step + 1) as f64 * (cfg.steps - step - 1) as f64;
            eprintln!(
                "train: step {}/{} cross-entropy {mean:.3} (feature mse {:.4}) lr {lr:.2e} ETA {eta:.0} s",
                step + 1,
                cfg.steps,
                regression.to_scalar::<f32>()?
            );
        }
    }
    Ok(curve)
}

/// How the features reach the drafter, to measure what the wire's compression costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum FeaturePrecision {
    F32,
    F16,
    /// 8-bit rows with a scale each, as [`specinfer_wire::FeatureRows`] sends them.
    Int8,
}

impl FeaturePrecision {
    fn apply(self, rows: Vec<f32>, dim: usize) -> Result<Vec<f32>> {
        Ok(match self {
            FeaturePrecision::F32 => rows,
            FeaturePrecision::F16 => {
                let n = rows.len();
                Tensor::from_vec(rows, n, &Device::Cpu)?
                    .to_dtype(DType::F16)?
                    .to_dtype(DType::F32)?
                    .to_vec1()?
            }
            FeaturePrecision::Int8 => {
                specinfer_wire::FeatureRows::quantize(0, dim, &rows).dequantize()
            }
        })
    }
}

/// Top-k agreement (k = 1..=5) of the drafter with the LLM along the teacher's greedy answers,
/// each position reading the LLM's feature of the position before it at `precision` (the
/// drafter's first level in a tree): greedy (is the LLM's token in the drafter's top-k?) and
/// stochastic (the LLM's probability mass at `temperature` inside the drafter's top-k).
pub fn alignment(
    llm: &Llama,
    drafter: &specinfer_model::FeatureDrafter,
    examples: &[Example],
    temperature: f32,
    precision: FeaturePrecision,
) -> Result<([f64; 5], [f64; 5], usize)> {
    let d = llm.config().d_model;
    let (mut greedy, mut stochastic, mut positions) = ([0f64; 5], [0f64; 5], 0usize);
    for e in examples {
        let mut seq = e.prompt.clone();
        seq.extend(&e.answer);
        seq.truncate(
            llm.config()
                .max_positions
                .min(drafter.config().max_positions),
        );
        let n = seq.len();
        if n < 3 {
            continue;
        }
        let mut kv = KvCache::new(llm.config());
        let chain = TokenTree::chain(&seq[..n - 1]);
        let teacher = llm.forward(&mut [SeqTree::new(&mut kv, &chain)])?.remove(0);
        let h: Vec<f32> = (0..n - 1)
            .flat_map(|p| teacher.feature(p).expect("features").to_vec())
            .collect();
        // The drafter over positions 1..n-1, position p reading the LLM's feature of p - 1.
        let prev = precision.apply(h[..(n - 2) * d].to_vec(), d)?;
        let mut dkv = drafter.new_cache();
        let out = drafter.forward(&mut dkv, &TokenTree::chain(&seq[1..n - 1]), 0, &prev)?;
        for p in e.prompt.len().max(2) - 1..n - 1 {
            let top = crate::eval::top5(out.node(p - 1));
            let q = specinfer_kernels::sampling::distribution(teacher.node(p), temperature, 0, 1.0);
            for k in 0..5 {
                let proposed = &top[..=k];
                greedy[k] += proposed.contains(&seq[p + 1]) as u8 as f64;
                stochastic[k] += proposed
                    .iter()
                    .filter(|&&t| t != u32::MAX)
                    .map(|&t| q[t as usize] as f64)
                    .sum::<f64>();
            }
            positions += 1;
        }
    }
    let norm = |v: [f64; 5]| v.map(|x| x / positions.max(1) as f64);
    Ok((norm(greedy), norm(stochastic), positions))
}
