//! Building a [`Llama`] from GGUF, from Hugging Face safetensors + config.json, or from random
//! weights (the tiny models unit tests use).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use crate::llama::{Layer, Linear, Weight};
use crate::{Arch, Llama, ModelConfig, ModelError, Result, RopeStyle};

/// An opened GGUF file: header parsed, tensors read on demand.
pub(crate) struct Gguf {
    pub(crate) path: PathBuf,
    pub(crate) content: Content,
    reader: BufReader<File>,
}

impl Gguf {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::Format {
            path: path.to_owned(),
            message: format!("not a readable GGUF file: {e}"),
        })?;
        let expected = content
            .tensor_infos
            .values()
            .map(|t| {
                let elems = t.shape.elem_count();
                content.tensor_data_offset
                    + t.offset
                    + (elems / t.ggml_dtype.block_size() * t.ggml_dtype.type_size()) as u64
            })
            .max()
            .unwrap_or(content.tensor_data_offset);
        if len < expected {
            return Err(ModelError::Truncated {
                path: path.to_owned(),
                expected,
                got: len,
            });
        }
        Ok(Gguf {
            path: path.to_owned(),
            content,
            reader,
        })
    }

    pub(crate) fn meta(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| ModelError::Missing {
                path: self.path.clone(),
                what: format!("metadata {key}"),
            })
    }

    fn meta_u32(&self, key: &str) -> Result<u32> {
        self.meta(key)?.to_u32().map_err(|e| self.bad(key, e))
    }

    fn meta_f32(&self, key: &str) -> Result<f32> {
        self.meta(key)?.to_f32().map_err(|e| self.bad(key, e))
    }

    pub(crate) fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta(key)?
            .to_string()
            .map(String::as_str)
            .map_err(|e| self.bad(key, e))
    }

    pub(crate) fn bad(&self, key: &str, e: impl std::fmt::Display) -> ModelError {
        ModelError::Format {
            path: self.path.clone(),
            message: format!("{key}: {e}"),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        let Some(info) = self.content.tensor_infos.get(name) else {
            return Err(ModelError::Missing {
                path: self.path.clone(),
                what: format!("tensor {name}"),
            });
        };
        use GgmlDType::*;
        if !matches!(
            info.ggml_dtype,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q8_0 | Q4K | Q6K
        ) {
            return Err(ModelError::UnsupportedTensorType {
                path: self.path.clone(),
                name: name.into(),
                dtype: format!("{:?}", info.ggml_dtype),
            });
        }
        Ok(self.content.tensor(&mut self.reader, name, &Device::Cpu)?)
    }
}

impl Llama {
    /// Loads a GGUF v3 model of architecture `llama` or `qwen2`.
    pub fn from_gguf(path: &Path) -> Result<Llama> {
        let mut g = Gguf::open(path)?;
        Self::from_opened_gguf(&mut g)
    }

    pub(crate) fn from_opened_gguf(g: &mut Gguf) -> Result<Llama> {
        let arch_name = g.meta_str("general.architecture")?.to_owned();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            _ => {
                return Err(ModelError::UnsupportedArch {
                    path: g.path.clone(),
                    arch: arch_name,
                })
            }
        };
        let a = &arch_name;
        let d_model = g.meta_u32(&format!("{a}.embedding_length"))? as usize;
        let n_heads = g.meta_u32(&format!("{a}.attention.head_count"))? as usize;
        let n_kv_heads = g
            .meta_u32(&format!("{a}.attention.head_count_kv"))
            .unwrap_or(n_heads as u32) as usize;
        let embed_q = g.qtensor("token_embd.weight")?;
        let vocab_size = embed_q.shape().dims()[0];
        let cfg = ModelConfig {
            arch,
            vocab_size,
            d_model,
            n_layers: g.meta_u32(&format!("{a}.block_count"))? as usize,
            n_heads,
            n_kv_heads,
            head_dim: d_model / n_heads,
            ffn_dim: g.meta_u32(&format!("{a}.feed_forward_length"))? as usize,
            rms_eps: g.meta_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
            rope_theta: g
                .meta_f32(&format!("{a}.rope.freq_base"))
                .unwrap_or(10_000.0),
            rope_style: if arch == Arch::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            max_positions: g.meta_u32(&format!("{a}.context_length")).unwrap_or(2048) as usize,
        };
        let embed = embed_q
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let lm_head = if g.has("output.weight") {
            g.linear("output", false)?
        } else {
            Linear {
                w: Weight::from_qtensor(embed_q)?,
                b: None,
            }
        };
        let bias = arch == Arch::Qwen2;
        let layers = load_layers(g, &GGUF_LAYER, cfg.n_layers, bias)?;
        let final_norm = g.vector("output_norm.weight")?;
        tracing::info!(path = %g.path.display(), ?cfg, "loaded GGUF model");
        Ok(Llama {
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            head_ids: None,
        })
    }

    /// Loads a Hugging Face checkpoint: `config.json` and `model.safetensors` in `dir`
    /// (f32, f16, bf16, or u8 rows with a scale per row as [`quantize_rows_u8`] writes them;
    /// computed in f32).
    pub fn from_safetensors(dir: &Path) -> Result<Llama> {
        let (text, bytes) = read_checkpoint(dir)?;
        Self::from_safetensors_bytes(&text, &bytes, dir)
    }

    /// [`Llama::from_safetensors`] from the two files' contents (a browser fetches them);
    /// `origin` names them in errors.
    pub fn from_safetensors_bytes(
        config_json: &str,
        safetensors: &[u8],
        origin: &Path,
    ) -> Result<Llama> {
        let cfg_path = origin.join("config.json");
        let hf: HfConfig = serde_json::from_str(config_json).map_err(|e| ModelError::Format {
            path: cfg_path.clone(),
            message: e.to_string(),
        })?;
        let arch = match hf.model_type.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            other => {
                return Err(ModelError::UnsupportedArch {
                    path: cfg_path,
                    arch: other.into(),
                })
            }
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: hf.vocab_size,
            d_model: hf.hidden_size,
            n_layers: hf.num_hidden_layers,
            n_heads: hf.num_attention_heads,
            n_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf.hidden_size / hf.num_attention_heads,
            ffn_dim: hf.intermediate_size,
            rms_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_style: RopeStyle::Neox,
            max_positions: hf.max_position_embeddings.unwrap_or(2048),
        };
        let st_path = origin.join("model.safetensors");
        let tensors =
            candle_core::safetensors::load_buffer(safetensors, &Device::Cpu).map_err(|e| {
                ModelError::Format {
                    path: st_path.clone(),
                    message: e.to_string(),
                }
            })?;
        let mut w = Weights {
            path: st_path,
            tensors,
            quantize: None,
        };
        let tie =
            hf.tie_word_embeddings.unwrap_or(false) || !w.tensors.contains_key("lm_head.weight");
        let head_ids = match w.tensors.remove("lm_head.token_ids") {
            Some(t) => {
                let ids = t.to_dtype(DType::U32)?.to_vec1::<u32>()?;
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                    return Err(ModelError::Format {
                        path: w.path.clone(),
                        message: format!("lm_head.token_ids holds {bad}, outside the vocabulary"),
                    });
                }
                Some(ids)
            }
            None => None,
        };
        let mut model = Self::from_named_tensors(cfg, &mut w, tie)?;
        model.head_ids = head_ids;
        Ok(model)
    }

    fn from_named_tensors(cfg: ModelConfig, w: &mut Weights, tie: bool) -> Result<Llama> {
        let bias = cfg.arch == Arch::Qwen2;
        let embed_t = w.take("model.embed_tokens.weight")?;
        let embed = embed_t.flatten_all()?.to_vec1::<f32>()?;
        let lm_head = if tie {
            Linear {
                w: Weight::from_f32(embed_t)?,
                b: None,
            }
        } else {
            w.linear("lm_head", false)?
        };
        let layers = load_layers(w, &HF_LAYER, cfg.n_layers, bias)?;
        let final_norm = w.vector("model.norm.weight")?;
        Ok(Llama {
            cfg,
            embed,
            layers,
            final_norm,
            lm_head,
            head_ids: None,
        })
    }

    /// A model from f32 tensors in Hugging Face naming, its head tied to its embedding.
    pub(crate) fn from_tensor_map(
        cfg: ModelConfig,
        tensors: HashMap<String, Tensor>,
    ) -> Result<Llama> {
        let mut w = Weights {
            path: "<tensors>".into(),
            tensors,
            quantize: None,
        };
        Self::from_named_tensors(cfg, &mut w, true)
    }

    /// A model with random weights in Hugging Face naming, for tests: fast to build, exercises
    /// every code path, and `quantize` makes its projections a GGML quantized type.
    pub fn random(cfg: ModelConfig, seed: u64, quantize: Option<GgmlDType>) -> Result<Llama> {
        let tensors = Self::random_weights(&cfg, seed);
        let mut w = Weights {
            path: "<random>".into(),
            tensors,
            quantize,
        };
        Self::from_named_tensors(cfg, &mut w, false)
    }

    /// The weights [`Llama::random`] uses, by Hugging Face name (f32), e.g. to write a
    /// safetensors checkpoint for loader tests.
    pub fn random_weights(cfg: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        let mut add = |name: String, dims: &[usize], scale: f32, offset: f32| {
            let n: usize = dims.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|_| offset + scale * rng.random_range(-1.0f32..1.0))
                .collect();
            tensors.insert(
                name,
                Tensor::from_vec(data, dims, &Device::Cpu).expect("shape matches data"),
            );
        };
        let (d, kv, f) = (cfg.d_model, cfg.kv_row(), cfg.ffn_dim);
        let lin = (d as f32).sqrt().recip() * 1.5;
        add(
            "model.embed_tokens.weight".into(),
            &[cfg.vocab_size, d],
            1.0,
            0.0,
        );
        add("lm_head.weight".into(), &[cfg.vocab_size, d], lin, 0.0);
        add("model.norm.weight".into(), &[d], 0.1, 1.0);
        for i in 0..cfg.n_layers {
            let p = format!("model.layers.{i}");
            for (n, rows, cols) in [
                ("self_attn.q_proj", cfg.n_heads * cfg.head_dim, d),
                ("self_attn.k_proj", kv, d),
                ("self_attn.v_proj", kv, d),
                ("self_attn.o_proj", d, cfg.n_heads * cfg.head_dim),
                ("mlp.gate_proj", f, d),
                ("mlp.up_proj", f, d),
                ("mlp.down_proj", d, f),
            ] {
                add(
                    format!("{p}.{n}.weight"),
                    &[rows, cols],
                    (cols as f32).sqrt().recip() * 1.5,
                    0.0,
                );
                if cfg.arch == Arch::Qwen2
                    && n.ends_with("_proj")
                    && n.starts_with("self_attn")
                    && n != "self_attn.o_proj"
                {
                    add(format!("{p}.{n}.bias"), &[rows], 0.1, 0.0);
                }
            }
            add(format!("{p}.input_layernorm.weight"), &[d], 0.1, 1.0);
            add(
                format!("{p}.post_attention_layernorm.weight"),
                &[d],
                0.1,
                1.0,
            );
        }
        tensors
    }
}

/// A Hugging Face checkpoint folder's `config.json` and `model.safetensors`.
pub(crate) fn read_checkpoint(dir: &Path) -> Result<(String, Vec<u8>)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| ModelError::Io { path, source })
    };
    let config = String::from_utf8(read("config.json")?).map_err(|e| ModelError::Format {
        path: dir.join("config.json"),
        message: e.to_string(),
    })?;
    Ok((config, read("model.safetensors")?))
}

/// Where a layer's tensors come from; GGUF and Hugging Face checkpoints differ only in names.
trait WeightSource {
    /// A weight matrix `[out, in]`, quantized or not.
    fn matrix(&mut self, name: &str) -> Result<Weight>;
    fn vector(&mut self, name: &str) -> Result<Vec<f32>>;

    /// `name.weight`, plus `name.bias` when `bias`.
    fn linear(&mut self, name: &str, bias: bool) -> Result<Linear> {
        let w = self.matrix(&format!("{name}.weight"))?;
        let b = if bias {
            Some(self.vector(&format!("{name}.bias"))?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }
}

impl WeightSource for Gguf {
    fn matrix(&mut self, name: &str) -> Result<Weight> {
        Weight::from_qtensor(self.qtensor(name)?)
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self
            .qtensor(name)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }
}

impl WeightSource for Weights {
    fn matrix(&mut self, name: &str) -> Result<Weight> {
        let t = self.take(name)?;
        match self.quantize {
            Some(dtype) => Weight::from_qtensor(QTensor::quantize(&t, dtype)?),
            None => Weight::from_f32(t),
        }
    }

    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self.take(name)?.flatten_all()?.to_vec1()?)
    }
}

/// Tensor names of one layer in a checkpoint format: `prefix` + layer index + `.` + name.
/// Norms are vectors (`.weight` included); projections are linears (`.weight`/`.bias` added).
struct LayerNames {
    prefix: &'static str,
    attn_norm: &'static str,
    q: &'static str,
    k: &'static str,
    v: &'static str,
    o: &'static str,
    ffn_norm: &'static str,
    gate: &'static str,
    up: &'static str,
    down: &'static str,
}

const GGUF_LAYER: LayerNames = LayerNames {
    prefix: "blk.",
    attn_norm: "attn_norm.weight",
    q: "attn_q",
    k: "attn_k",
    v: "attn_v",
    o: "attn_output",
    ffn_norm: "ffn_norm.weight",
    gate: "ffn_gate",
    up: "ffn_up",
    down: "ffn_down",
};

const HF_LAYER: LayerNames = LayerNames {
    prefix: "model.layers.",
    attn_norm: "input_layernorm.weight",
    q: "self_attn.q_proj",
    k: "self_attn.k_proj",
    v: "self_attn.v_proj",
    o: "self_attn.o_proj",
    ffn_norm: "post_attention_layernorm.weight",
    gate: "mlp.gate_proj",
    up: "mlp.up_proj",
    down: "mlp.down_proj",
};

/// `bias`: q/k/v carry biases (qwen2).
fn load_layers(
    src: &mut impl WeightSource,
    names: &LayerNames,
    n_layers: usize,
    bias: bool,
) -> Result<Vec<Layer>> {
    (0..n_layers)
        .map(|i| {
            let name = |n: &str| format!("{}{i}.{n}", names.prefix);
            Ok(Layer {
                attn_norm: src.vector(&name(names.attn_norm))?,
                q: src.linear(&name(names.q), bias)?,
                k: src.linear(&name(names.k), bias)?,
                v: src.linear(&name(names.v), bias)?,
                o: src.linear(&name(names.o), false)?,
                ffn_norm: src.vector(&name(names.ffn_norm))?,
                gate: src.linear(&name(names.gate), false)?,
                up: src.linear(&name(names.up), false)?,
                down: src.linear(&name(names.down), false)?,
            })
        })
        .collect()
}

struct Weights {
    path: PathBuf,
    tensors: HashMap<String, Tensor>,
    quantize: Option<GgmlDType>,
}

impl Weights {
    /// `name` in f32; a u8 tensor is 8-bit rows (see [`quantize_rows_u8`]) and is dequantized
    /// with `{name}_scale`.
    fn take(&mut self, name: &str) -> Result<Tensor> {
        let missing = |path: &Path, what: String| ModelError::Missing {
            path: path.to_owned(),
            what,
        };
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| missing(&self.path, format!("tensor {name}")))?;
        if t.dtype() != DType::U8 {
            return Ok(t.to_dtype(DType::F32)?);
        }
        let scale_name = format!("{name}_scale");
        let scale = self.tensors.remove(&scale_name).ok_or_else(|| {
            missing(
                &self.path,
                format!("tensor {scale_name} (u8 {name} needs it)"),
            )
        })?;
        let bad = |message: String| ModelError::Format {
            path: self.path.clone(),
            message,
        };
        let (rows, cols) = t
            .dims2()
            .map_err(|_| bad(format!("u8 tensor {name} is not a matrix")))?;
        let scale = scale
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if scale.len() != rows {
            return Err(bad(format!(
                "{scale_name} has {} values for {rows} rows",
                scale.len()
            )));
        }
        let q = t.flatten_all()?.to_vec1::<u8>()?;
        let data: Vec<f32> = q
            .chunks(cols.max(1))
            .zip(&scale)
            .flat_map(|(row, &s)| row.iter().map(move |&v| (f32::from(v) - 128.0) * s))
            .collect();
        Ok(Tensor::from_vec(data, (rows, cols), &Device::Cpu)?)
    }
}

/// 8-bit rows for a checkpoint: per row, `q = round(x / scale) + 128` with `scale = max|x| / 127`
/// (returned as u8 `[rows, cols]` and f32 `[rows]`, stored as `name` and `{name}_scale`). For
/// an SSM's input embedding, most of its bytes: a quarter of f32 at a relative error of 1/254 of
/// the row's largest value, which a token embedding followed by RMSNorm does not notice.
pub fn quantize_rows_u8(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, cols) = t.dims2()?;
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut q = Vec::with_capacity(v.len());
    let mut scales = Vec::with_capacity(rows);
    for row in v.chunks(cols.max(1)) {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = if max > 0.0 { max / 127.0 } else { 1.0 };
        scales.push(s);
        q.extend(
            row.iter()
                .map(|x| ((x / s).round().clamp(-127.0, 127.0) + 128.0) as u8),
        );
    }
    Ok((
        Tensor::from_vec(q, (rows, cols), &Device::Cpu)?,
        Tensor::from_vec(scales, rows, &Device::Cpu)?,
    ))
}

#[derive(serde::Deserialize)]
struct HfConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    rms_norm_eps: f32,
    rope_theta: Option<f32>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
}
