//! The small speculative model as candle tensors with autograd: a Llama (RoPE pairing `i` with
//! `i + d/2`, no GQA) whose output head covers only the tokens the teacher actually uses. A
//! restricted head keeps sampling verification lossless (the draft's proposal is simply 0 outside
//! its support) and keeps the model small.
//!
//! Exported in Hugging Face naming plus `lm_head.token_ids`, which `specinfer-model` loads for
//! inference (the training forward here and the inference forward there are two jobs: this one
//! needs gradients, that one tree masks and KV caches).

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SsmConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub ffn_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub max_positions: usize,
}

/// The head's token ids in exports and checkpoints.
const HEAD_IDS: &str = "lm_head.token_ids";
/// The output head over the restricted support.
const HEAD: &str = "lm_head.weight";

/// The input embedding: exported as 8-bit rows (at f16 it would be four fifths of the file).
const EMBED: &str = "model.embed_tokens.weight";

pub struct Ssm {
    pub cfg: SsmConfig,
    /// Token ids of the head's rows.
    pub head_ids: Vec<u32>,
    vars: Vec<(String, Var)>,
}

pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps as f64)?.sqrt()?)?
        .broadcast_mul(w)
}

/// `n` draws from a normal distribution of standard deviation `std` (Box-Muller).
pub(crate) fn normal(rng: &mut impl rand::Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u1, u2): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random());
            std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
        })
        .collect()
}

/// The shape of an exported Llama-family draft model, as `config.json` records it.
pub(crate) struct ExportedShape<'a> {
    pub vocab_size: usize,
    pub d_model: usize,
    pub ffn_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub max_positions: usize,
    /// The head is the embedding's rows.
    pub tied: bool,
    pub head_tokens: usize,
    pub tokenizer_sha256: &'a [u8; 32],
}

impl ExportedShape<'_> {
    /// Writes `config.json` in Hugging Face naming (no GQA), with specinfer's keys (the
    /// restricted head's size, the SHA-256 of the tokenizer its ids belong to) and `extra`'s.
    pub(crate) fn write(&self, dir: &Path, extra: serde_json::Value) -> Result<()> {
        let mut config = serde_json::json!({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.ffn_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tied,
            "specinfer_head_tokens": self.head_tokens,
            "specinfer_tokenizer_sha256": self.tokenizer_sha256.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        });
        if let (Some(c), serde_json::Value::Object(extra)) = (config.as_object_mut(), extra) {
            c.extend(extra);
        }
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(&config)?,
        )?;
        Ok(())
    }
}

/// `x @ w^T` for a 3-d `x`.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (b, l, d) = x.dims3()?;
    x.reshape((b * l, d))?.matmul(&w.t()?)?.reshape((b, l, ()))
}

/// What every layer of a causal forward over `l` positions shares: RoPE tables (`[l, hd]`,
/// dimension `i` paired with `i + hd / 2`) and the causal mask.
pub(crate) struct Causal {
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
}

impl Causal {
    pub(crate) fn new(l: usize, hd: usize, theta: f32, dev: &Device) -> candle_core::Result<Self> {
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| theta.powf(-(2.0 * i as f32) / hd as f32))
            .collect();
        let ang: Vec<f32> = (0..l)
            .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        let ang = Tensor::from_vec(ang, (l, hd / 2), dev)?;
        let ang = Tensor::cat(&[&ang, &ang], 1)?;
        let mask: Vec<f32> = (0..l)
            .flat_map(|i| (0..l).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        Ok(Causal {
            cos: ang.cos()?,
            sin: ang.sin()?,
            mask: Tensor::from_vec(mask, (l, l), dev)?,
        })
    }

    fn rope(&self, t: &Tensor) -> candle_core::Result<Tensor> {
        let hd = t.dim(D::Minus1)?;
        let x1 = t.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = t.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        t.broadcast_mul(&self.cos)?
            .add(&rotated.broadcast_mul(&self.sin)?)
    }
}

/// One Llama decoder layer (no GQA) over `x` (`[batch, len, d]`), its weights by Hugging Face
/// name within the layer (`self_attn.q_proj.weight`, ...).
pub(crate) fn decoder_layer(
    x: &Tensor,
    get: &dyn Fn(&str) -> Tensor,
    n_heads: usize,
    rms_eps: f32,
    causal: &Causal,
) -> candle_core::Result<Tensor> {
    let (b, l, d) = x.dims3()?;
    let hd = d / n_heads;
    let hn = rms_norm(x, &get("input_layernorm.weight"), rms_eps)?;
    let split = |w: &str| -> candle_core::Result<Tensor> {
        linear(&hn, &get(&format!("self_attn.{w}.weight")))?
            .reshape((b, l, n_heads, hd))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (
        causal.rope(&split("q_proj")?)?,
        causal.rope(&split("k_proj")?)?,
        split("v_proj")?,
    );
    let att =
        (q.matmul(&k.t()?.contiguous()?)? / (hd as f64).sqrt())?.broadcast_add(&causal.mask)?;
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, l, d))?;
    let x = (x + linear(&o, &get("self_attn.o_proj.weight"))?)?;
    let hn = rms_norm(&x, &get("post_attention_layernorm.weight"), rms_eps)?;
    let g = linear(&hn, &get("mlp.gate_proj.weight"))?;
    let u = linear(&hn, &get("mlp.up_proj.weight"))?;
    let act = (candle_nn::ops::silu(&g)? * u)?;
    x + linear(&act, &get("mlp.down_proj.weight"))?
}

impl Ssm {
    /// A fresh model: token embeddings from the teacher's, projected down by a fixed random
    /// map (keeps the teacher's similarity structure), everything else small random.
    pub fn init(
        cfg: SsmConfig,
        head_ids: Vec<u32>,
        teacher_embed: &[f32],
        teacher_d: usize,
        seed: u64,
    ) -> Result<Self> {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let dev = Device::Cpu;
        let d = cfg.d_model;
        let mut normal = |n: usize, std: f32| normal(&mut rng, n, std);
        let proj = normal(teacher_d * d, 1.0 / (teacher_d as f32).sqrt());
        let mut embed = vec![0f32; cfg.vocab_size * d];
        for t in 0..cfg.vocab_size {
            let src = &teacher_embed[t * teacher_d..(t + 1) * teacher_d];
            for j in 0..d {
                embed[t * d + j] = (0..teacher_d)
                    .map(|k| src[k] * proj[k * d + j])
                    .sum::<f32>();
            }
        }
        // Scale to unit RMS per row on average, as the RMSNorm downstream expects.
        let rms = (embed.iter().map(|x| x * x).sum::<f32>() / embed.len() as f32).sqrt();
        embed.iter_mut().for_each(|x| *x /= rms);
        let mut vars = Vec::new();
        let mut add = |name: String, data: Vec<f32>, shape: &[usize]| -> Result<()> {
            vars.push((
                name,
                Var::from_tensor(&Tensor::from_vec(data, shape, &dev)?)?,
            ));
            Ok(())
        };
        add(EMBED.into(), embed, &[cfg.vocab_size, d])?;
        let std = 0.02;
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}");
            add(format!("{p}.input_layernorm.weight"), vec![1.0; d], &[d])?;
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![1.0; d],
                &[d],
            )?;
            for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                add(
                    format!("{p}.self_attn.{n}.weight"),
                    normal(d * d, std),
                    &[d, d],
                )?;
            }
            add(
                format!("{p}.mlp.gate_proj.weight"),
                normal(cfg.ffn_dim * d, std),
                &[cfg.ffn_dim, d],
            )?;
            add(
                format!("{p}.mlp.up_proj.weight"),
                normal(cfg.ffn_dim * d, std),
                &[cfg.ffn_dim, d],
            )?;
            add(
                format!("{p}.mlp.down_proj.weight"),
                normal(d * cfg.ffn_dim, std / (2.0 * cfg.n_layers as f32).sqrt()),
                &[d, cfg.ffn_dim],
            )?;
        }
        add("model.norm.weight".into(), vec![1.0; d], &[d])?;
        add(
            HEAD.into(),
            normal(head_ids.len() * d, std),
            &[head_ids.len(), d],
        )?;
        Ok(Ssm {
            cfg,
            head_ids,
            vars,
        })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.vars.iter().map(|(_, v)| v.clone()).collect()
    }

    fn var(&self, name: &str) -> &Var {
        self.vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no var {name}"))
    }

    fn get(&self, name: &str) -> &Tensor {
        self.var(name).as_tensor()
    }

    /// Logits over the head's tokens for `ids` (`[batch, len]`, u32): `[batch, len, head]`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let cfg = &self.cfg;
        let (b, l) = ids.dims2()?;
        let d = cfg.d_model;
        let mut x = self
            .get(EMBED)
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, l, d))?;
        let causal = Causal::new(l, d / cfg.n_heads, cfg.rope_theta, ids.device())?;
        for i in 0..cfg.n_layers {
            let get = |n: &str| self.get(&format!("model.layers.{i}.{n}")).clone();
            x = decoder_layer(&x, &get, cfg.n_heads, cfg.rms_eps, &causal)?;
        }
        let x = rms_norm(&x, self.get("model.norm.weight"), cfg.rms_eps)?;
        linear(&x, self.get(HEAD))
    }

    /// Writes `model.safetensors` (f16 weights, the input embedding in 8-bit rows,
    /// `lm_head.token_ids`) and `config.json`, which
    /// records the SHA-256 of the tokenizer the token ids belong to (so the folder needs no
    /// tokenizer.json of its own to be checked against an LLM).
    pub fn export(&self, dir: &Path, tokenizer_sha256: &[u8; 32]) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for (name, v) in &self.vars {
            if name == EMBED {
                let (q, scale) = specinfer_model::quantize_rows_u8(v.as_tensor())?;
                tensors.insert(format!("{name}_scale"), scale);
                tensors.insert(name.clone(), q);
            } else {
                tensors.insert(name.clone(), v.as_tensor().to_dtype(DType::F16)?);
            }
        }
        tensors.insert(
            HEAD_IDS.into(),
            Tensor::new(self.head_ids.as_slice(), &Device::Cpu)?,
        );
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
        let c = &self.cfg;
        ExportedShape {
            vocab_size: c.vocab_size,
            d_model: c.d_model,
            ffn_dim: c.ffn_dim,
            n_layers: c.n_layers,
            n_heads: c.n_heads,
            rms_eps: c.rms_eps,
            rope_theta: c.rope_theta,
            max_positions: c.max_positions,
            tied: false,
            head_tokens: self.head_ids.len(),
            tokenizer_sha256,
        }
        .write(dir, serde_json::json!({}))?;
        Ok(())
    }

    /// Saves / restores the training state (f32 weights and the head's token ids) for
    /// resumption. The head is restored too: with more teacher data the most frequent tokens
    /// change, and the head's rows must keep meaning the tokens they were trained on.
    pub fn save_checkpoint(&self, path: &Path) -> Result<()> {
        let mut t: HashMap<String, Tensor> = self
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        t.insert(
            HEAD_IDS.into(),
            Tensor::new(self.head_ids.as_slice(), &Device::Cpu)?,
        );
        candle_core::safetensors::save(&t, path)?;
        Ok(())
    }

    ///
    /// A run may ask for a larger head than the checkpoint's: the saved rows keep their tokens,
    /// and the run's most frequent tokens not among them follow, each row starting as the mean
    /// of the saved rows (a logit typical of the trained tokens, neither favoured nor ruled out).
    ///
    /// A run may also ask for more layers: the saved layers come first and each new one starts
    /// with its two residual outputs (`o_proj`, `down_proj`) at zero, so the grown model computes
    /// exactly what the checkpoint did and training only adds to it (a deeper model without
    /// relearning what the shallow one knew).
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<()> {
        let t = candle_core::safetensors::load(path, &Device::Cpu)?;
        let saved_layers = (0..)
            .take_while(|i| t.contains_key(&format!("model.layers.{i}.input_layernorm.weight")))
            .count();
        anyhow::ensure!(
            saved_layers <= self.cfg.n_layers,
            "checkpoint has {saved_layers} layers, this run {} (a model can grow on resume, not shrink)",
            self.cfg.n_layers
        );
        for i in saved_layers..self.cfg.n_layers {
            for w in ["self_attn.o_proj", "mlp.down_proj"] {
                let v = self.var(&format!("model.layers.{i}.{w}.weight"));
                v.set(&v.zeros_like()?)?;
            }
        }
        if let Some(ids) = t.get(HEAD_IDS) {
            let mut ids = ids.to_vec1::<u32>()?;
            let size = self.head_ids.len();
            anyhow::ensure!(
                ids.len() <= size,
                "checkpoint head has {} tokens, this run {} (a head can grow on resume, not shrink)",
                ids.len(),
                size
            );
            let saved: std::collections::HashSet<u32> = ids.iter().copied().collect();
            let new: Vec<u32> = self
                .head_ids
                .iter()
                .copied()
                .filter(|t| !saved.contains(t))
                .take(size - ids.len())
                .collect();
            ids.extend(new);
            self.head_ids = ids;
        }
        for (n, v) in &self.vars {
            let Some(saved) = t.get(n) else { continue };
            let (rows, want) = (saved.dim(0)?, v.dim(0)?);
            if n == HEAD && rows < want {
                let mean = saved.mean_keepdim(0)?;
                let grown = Tensor::cat(&[saved, &mean.repeat((want - rows, 1))?], 0)?;
                v.set(&grown)?;
            } else {
                v.set(saved)?;
            }
        }
        Ok(())
    }
}
