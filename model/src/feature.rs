//! A feature-conditioned drafter (EAGLE's design): it drafts from the LLM's own features instead
//! of from tokens alone. At position `p` its input is a projection of the feature of position
//! `p - 1` (the LLM's, sent by the verifier, for committed positions; its own prediction inside
//! a tree) next to the embedding of token `p`; one Llama decoder layer turns that into a
//! predicted feature of position `p`, and the LLM's own LM head, restricted to the most
//! frequent tokens, scores the next token from it. The LLM's features already hold what its
//! head needs, so one layer predicts the next token far better than a standalone small model.
//!
//! Stored as a Hugging Face folder: `config.json` (a one-layer llama with
//! `"specinfer_draft": "feature"`) and `model.safetensors` (the layer, `fc.weight`/`fc.bias`
//! `[d, 2d]`, the final norm, and the LLM's embedding rows of the head's tokens, which also serve
//! as the head: SmolLM2 ties its embeddings).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use specinfer_wire::TokenTree;

use crate::llama::{Linear, Weight};
use crate::{KvCache, Llama, Logits, ModelConfig, ModelError, Result, SeqTree};

/// The kind a `config.json` names in `specinfer_draft` for a feature-conditioned drafter.
pub const FEATURE_DRAFT_KIND: &str = "feature";

pub struct FeatureDrafter {
    /// `[d, 2d]` with bias: `[previous feature ; token embedding]` to the layer's input.
    fc: Linear,
    /// Row of each vocabulary token in the body's embedding (`u32::MAX`: not in the head; such
    /// a token enters as a zero embedding, its feature still carrying the context).
    token_row: Vec<u32>,
    /// One decoder layer, the final norm and the restricted head; its `embed` holds the head
    /// tokens' rows only, looked up through `token_row`.
    body: Llama,
}

impl FeatureDrafter {
    /// Whether `dir`'s `config.json` describes a feature-conditioned drafter (not an SSM).
    pub fn is_feature_draft(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("config.json"))
            .is_ok_and(|t| Self::describes_feature_draft(&t))
    }

    /// Whether a `config.json`'s text describes a feature-conditioned drafter (a browser has the
    /// text, not a folder).
    pub fn describes_feature_draft(config_json: &str) -> bool {
        serde_json::from_str::<serde_json::Value>(config_json)
            .is_ok_and(|v| v["specinfer_draft"] == FEATURE_DRAFT_KIND)
    }

    pub fn from_safetensors(dir: &Path) -> Result<Self> {
        let (config, weights) = crate::load::read_checkpoint(dir)?;
        Self::from_safetensors_bytes(&config, &weights, dir)
    }

    /// [`FeatureDrafter::from_safetensors`] from the two files' contents.
    pub fn from_safetensors_bytes(
        config_json: &str,
        safetensors: &[u8],
        origin: &Path,
    ) -> Result<Self> {
        let body = Llama::from_safetensors_bytes(config_json, safetensors, origin)?;
        let st_path = origin.join("model.safetensors");
        let bad = |message: String| ModelError::Format {
            path: st_path.clone(),
            message,
        };
        if body.cfg.n_layers != 1 {
            return Err(bad(format!(
                "a feature drafter has one layer, this one {}",
                body.cfg.n_layers
            )));
        }
        let Some(head_ids) = body.head_ids.clone() else {
            return Err(bad("a feature drafter needs lm_head.token_ids".into()));
        };
        let tensors = candle_core::safetensors::load_buffer(safetensors, &Device::Cpu)
            .map_err(|e| bad(e.to_string()))?;
        let take = |name: &str| -> Result<Tensor> {
            Ok(tensors
                .get(name)
                .ok_or_else(|| ModelError::Missing {
                    path: st_path.clone(),
                    what: format!("tensor {name}"),
                })?
                .to_dtype(DType::F32)?)
        };
        let d = body.cfg.d_model;
        let fc_w = take("fc.weight")?;
        if fc_w.dims() != [d, 2 * d] {
            return Err(bad(format!(
                "fc.weight is {:?}, expected [{d}, {}]",
                fc_w.dims(),
                2 * d
            )));
        }
        let fc_b = take("fc.bias")?.flatten_all()?.to_vec1::<f32>()?;
        if fc_b.len() != d {
            return Err(bad(format!(
                "fc.bias has {} values, expected {d}",
                fc_b.len()
            )));
        }
        Self::assemble(body, &head_ids, fc_w, fc_b)
    }

    fn assemble(body: Llama, head_ids: &[u32], fc_w: Tensor, fc_b: Vec<f32>) -> Result<Self> {
        if body.embed.len() != head_ids.len() * body.cfg.d_model {
            return Err(ModelError::Format {
                path: "<feature drafter>".into(),
                message: format!(
                    "the embedding must hold the {} head tokens' rows",
                    head_ids.len()
                ),
            });
        }
        let mut token_row = vec![u32::MAX; body.cfg.vocab_size];
        for (row, &t) in head_ids.iter().enumerate() {
            token_row[t as usize] = row as u32;
        }
        Ok(FeatureDrafter {
            fc: Linear {
                w: Weight::from_f32(fc_w)?,
                b: Some(fc_b),
            },
            token_row,
            body,
        })
    }

    /// A drafter with random weights over `vocab` tokens of width `d` (a multiple of 4), its
    /// head covering `head_ids` (for tests: the LLM it pairs with must have width `d`).
    pub fn random(vocab: usize, d: usize, head_ids: &[u32], seed: u64) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        let tiny = ModelConfig::tiny(crate::Arch::Llama);
        // The head tokens' embedding rows come out of `random_weights` as a vocabulary of
        // `head_ids.len()`; the body itself spans the whole vocabulary.
        let rows_cfg = ModelConfig {
            vocab_size: head_ids.len(),
            d_model: d,
            head_dim: d / tiny.n_heads,
            n_layers: 1,
            rope_style: crate::RopeStyle::Neox,
            ..tiny
        };
        let mut tensors = Llama::random_weights(&rows_cfg, seed);
        tensors.remove("lm_head.weight");
        let mut body = Llama::from_tensor_map(
            ModelConfig {
                vocab_size: vocab,
                ..rows_cfg
            },
            tensors,
        )?;
        body.head_ids = Some(head_ids.to_vec());
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xfc);
        let scale = (2.0 * d as f32).sqrt().recip() * 1.5;
        let fc: Vec<f32> = (0..2 * d * d)
            .map(|_| scale * rng.random_range(-1.0f32..1.0))
            .collect();
        let fc_w = Tensor::from_vec(fc, (d, 2 * d), &Device::Cpu)?;
        Self::assemble(body, head_ids, fc_w, vec![0.0; d])
    }

    /// The body's shape: width, heads, context.
    pub fn config(&self) -> &ModelConfig {
        &self.body.cfg
    }

    /// Tokens its head covers (every other token has probability exactly 0).
    pub fn head_tokens(&self) -> usize {
        self.body.head_tokens()
    }

    /// Width of the features it reads and predicts (the LLM's).
    pub fn feature_dim(&self) -> usize {
        self.body.cfg.d_model
    }

    /// f32, as every drafter's (see `TreeScorer::new_cache` for `Llama`): the same numbers as
    /// its ONNX export's.
    pub fn new_cache(&self) -> KvCache {
        KvCache::with_precision(&self.body.cfg, crate::KvPrecision::F32)
    }

    /// The layer's input rows for tokens whose preceding features are `prev` (`[n, d]`).
    fn inputs(&self, tokens: impl Iterator<Item = u32>, prev: &[f32]) -> Result<Vec<f32>> {
        let d = self.feature_dim();
        let mut cat = Vec::with_capacity(prev.len() * 2);
        for (t, f) in tokens.zip(prev.chunks(d)) {
            cat.extend_from_slice(f);
            match self.token_row.get(t as usize) {
                Some(&row) if row != u32::MAX => {
                    let row = row as usize;
                    cat.extend_from_slice(&self.body.embed[row * d..(row + 1) * d]);
                }
                _ => cat.extend(std::iter::repeat_n(0.0, d)),
            }
        }
        if cat.len() != prev.len() * 2 {
            return Err(ModelError::Format {
                path: "<input>".into(),
                message: format!(
                    "{} preceding-feature floats do not match the tokens",
                    prev.len()
                ),
            });
        }
        let rows = cat.len() / (2 * d);
        self.fc.forward(&cat, rows)
    }

    /// Logits (whole vocabulary, exactly 0 probability outside the head) and predicted features
    /// of nodes `first..` of `tree`, whose preceding features are `prev` (`[nodes, d]`: the
    /// LLM's for the root, the drafter's own prediction of the parent below it). Afterwards the
    /// cache's scratch region holds nodes `0..tree.len()`.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
        prev: &[f32],
    ) -> Result<Logits> {
        let inputs = self.inputs((first..tree.len()).map(|i| tree.token(i)), prev)?;
        self.body
            .forward_rows(SeqTree { cache, tree, first }, &inputs, true)
    }

    /// Writes the drafter as ONNX to `path` (an SSM's graph with the `prev_features` input and
    /// the `features` output; see the ONNX module); `metadata` as in [`Llama::export_onnx`].
    pub fn export_onnx(&self, path: &Path, metadata: &[(&str, &str)]) -> Result<()> {
        let graph = self.body.onnx_graph(crate::onnx::GraphInput::Features {
            token_row: &self.token_row,
            fc: &self.fc,
        })?;
        crate::onnx::write_model(graph, &self.body, path, metadata)
    }

    /// Runs committed `tokens` (preceding features `prev`) on top of the cache and commits them.
    pub fn append(&self, cache: &mut KvCache, tokens: &[u32], prev: &[f32]) -> Result<()> {
        let tree = TokenTree::chain(tokens);
        let inputs = self.inputs(tokens.iter().copied(), prev)?;
        self.body
            .forward_rows(SeqTree::new(cache, &tree), &inputs, false)?;
        cache.commit_scratch();
        Ok(())
    }
}
