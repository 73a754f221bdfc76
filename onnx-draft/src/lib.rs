//! Draft models through ONNX Runtime: an ONNX export of a `specinfer-model` transformer (see
//! `Llama::export_onnx` for the graph's inputs and outputs) with the KV cache kept here, so the
//! same [`CachedDraft`](specinfer_speculator::CachedDraft) bookkeeping (rollback, keeping the accepted path)
//! serves both backends.
//!
//! ONNX Runtime is loaded at run time (`ort`'s `load-dynamic`): from `ORT_DYLIB_PATH` when set,
//! else the library of the PyPI `onnxruntime` wheel, fetched into the model cache and checked by
//! SHA-256. No ONNX Runtime is needed to build.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::environment::Environment;
use ort::session::{Session, SessionInputValue};
use ort::value::{PrimitiveTensorElementType, TensorRef};
use specinfer_model::fetch::{self, FetchEvent};
use specinfer_model::{KvCache, KvRows, ModelError};
use specinfer_wire::TokenTree;

use specinfer_speculator::{FeatureScorer, TreeScorer};

fn ort_err(message: impl std::fmt::Display) -> ModelError {
    ModelError::Runtime {
        backend: "onnxruntime",
        message: message.to_string(),
    }
}

/// The ONNX Runtime library to load: `ORT_DYLIB_PATH`, else the wheel's, fetched if needed
/// (telling `progress`).
pub fn runtime_library(progress: &mut dyn FnMut(&FetchEvent)) -> Result<PathBuf, ModelError> {
    match std::env::var_os("ORT_DYLIB_PATH") {
        Some(p) => Ok(PathBuf::from(p)),
        None => fetch::ensure_with(&fetch::ONNXRUNTIME, &fetch::cache_dir(), progress),
    }
}

/// One process-wide environment: ONNX Runtime can be loaded only once per process.
static ENV: OnceLock<Result<Environment, String>> = OnceLock::new();

fn load_runtime(lib: &Path) -> Result<Environment, String> {
    let builder = ort::init_from(lib)
        .map_err(|e| format!("loading ONNX Runtime from {}: {e}", lib.display()))?;
    builder
        .with_name("specinfer")
        .build()
        .map_err(|e| e.to_string())
}

/// Loads ONNX Runtime from `lib` now, instead of from [`runtime_library`] at the first
/// [`OnnxModel::load`]. The first load in a process wins.
pub fn init_runtime(lib: &Path) -> Result<(), ModelError> {
    ENV.get_or_init(|| load_runtime(lib))
        .as_ref()
        .map(|_| ())
        .map_err(ort_err)
}

fn environment() -> Result<&'static Environment, ModelError> {
    ENV.get_or_init(|| {
        let lib = runtime_library(&mut |e| tracing::info!("{e}")).map_err(|e| e.to_string())?;
        load_runtime(&lib)
    })
    .as_ref()
    .map_err(ort_err)
}

/// An ONNX draft model (an SSM's export) in an ONNX Runtime session.
pub struct OnnxModel {
    /// `Session::run` needs `&mut`; drafts run one at a time per model anyway.
    session: Mutex<Session>,
    layers: usize,
    kv_row: usize,
    vocab: usize,
    max_positions: usize,
    /// Token id of each logit row (all tokens, or the SSM's restricted head).
    head_ids: Vec<u32>,
    tokenizer_sha256: Option<String>,
    /// Width of the `prev_features` input and `features` output of a feature-conditioned
    /// drafter's export; `None` for an SSM's.
    feature_dim: Option<usize>,
}

/// A feature-conditioned drafter's ONNX export ([`specinfer_model::FeatureDrafter::export_onnx`])
/// in an ONNX Runtime session.
pub struct OnnxFeatureModel(OnnxModel);

impl OnnxModel {
    /// Loads an SSM's export from `path` into a session with `threads` intra-op threads (0: ONNX
    /// Runtime's default).
    pub fn load(path: &Path, threads: usize) -> Result<OnnxModel, ModelError> {
        let model = Self::open(path, threads)?;
        if model.feature_dim.is_some() {
            return Err(ort_err(format!(
                "{} is a feature-conditioned drafter's export: it drafts from the LLM's features, not as an SSM",
                path.display()
            )));
        }
        Ok(model)
    }

    fn open(path: &Path, threads: usize) -> Result<OnnxModel, ModelError> {
        let env = environment()?;
        let at = |e: ort::Error| ort_err(format!("{}: {e}", path.display()));
        let mut builder = Session::builder(env).map_err(at)?;
        if threads > 0 {
            builder = builder
                .with_intra_threads(threads)
                .map_err(|e| at(e.into()))?;
        }
        let session = builder.commit_from_file(path).map_err(at)?;
        let meta_usize = |key: &str| -> Result<usize, ModelError> {
            let meta = session.metadata().map_err(at)?;
            meta.custom(key)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| {
                    ort_err(format!(
                        "{}: no metadata {key}; not a specinfer export",
                        path.display()
                    ))
                })
        };
        let vocab = meta_usize("specinfer.vocab_size")?;
        let max_positions = meta_usize("specinfer.max_positions")?;
        let tokenizer_sha256 = session
            .metadata()
            .map_err(at)?
            .custom("specinfer.tokenizer_sha256");
        let layers = session
            .inputs()
            .iter()
            .filter(|i| i.name().starts_with("past_k."))
            .count();
        // The fixed last dimension of input `name`: None when there is no such input,
        // Some(None) when its width is not fixed.
        let width = |name: &str| {
            session.inputs().iter().find(|i| i.name() == name).map(|i| {
                i.dtype()
                    .tensor_shape()
                    .and_then(|s| s.last().copied())
                    .filter(|&d| d > 0)
                    .map(|d| d as usize)
            })
        };
        let no_width = |name: &str| {
            ort_err(format!(
                "{}: no {name} input of fixed width",
                path.display()
            ))
        };
        let kv_row = width("past_k.0")
            .flatten()
            .ok_or_else(|| no_width("past_k.0"))?;
        let feature_dim = width("prev_features")
            .map(|w| w.ok_or_else(|| no_width("prev_features")))
            .transpose()?;
        let mut model = OnnxModel {
            session: Mutex::new(session),
            layers,
            kv_row,
            vocab,
            max_positions,
            head_ids: Vec::new(),
            tokenizer_sha256,
            feature_dim,
        };
        // One token on an empty cache: checks the graph runs and learns the head's token ids.
        let mut cache = model.new_cache();
        let zeros = feature_dim.map(|d| vec![0f32; d]);
        model.head_ids = model
            .run(&mut cache, &TokenTree::root(0), 0, zeros.as_deref())?
            .1;
        if let Some(bad) = model.head_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ort_err(format!(
                "{}: head token {bad} outside the vocabulary",
                path.display()
            )));
        }
        Ok(model)
    }

    /// The SHA-256 (hex) of the tokenizer the model was trained with, if the export recorded it.
    pub fn tokenizer_sha256(&self) -> Option<&str> {
        self.tokenizer_sha256.as_deref()
    }

    /// Runs nodes `first..` of `tree` (preceded by the features `prev`, `[n, d]`, in a feature
    /// drafter's export); returns their head-row logits, the head's token ids and, in a feature
    /// drafter's export, the nodes' predicted features.
    #[allow(clippy::type_complexity)]
    fn run(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
        prev: Option<&[f32]>,
    ) -> Result<(Vec<f32>, Vec<u32>, Option<Vec<f32>>), ModelError> {
        let n = tree.len() - first;
        match (self.feature_dim, prev) {
            (Some(d), Some(p)) if p.len() == n * d => {}
            (None, None) => {}
            (Some(d), _) => {
                return Err(ort_err(format!(
                    "a feature drafter's graph needs the preceding feature of each of the {n} nodes ({d} floats each)"
                )))
            }
            (None, Some(_)) => return Err(ort_err("this graph takes no features")),
        }
        let committed = cache.committed();
        let depths = tree.depths();
        let needed = committed + *depths.iter().max().unwrap_or(&0) as usize + 1;
        if needed > self.max_positions {
            return Err(ModelError::ContextFull {
                needed,
                limit: self.max_positions,
            });
        }
        if let Some(&t) = tree.tokens().iter().find(|&&t| t as usize >= self.vocab) {
            return Err(ort_err(format!(
                "token {t} outside the vocabulary of {}",
                self.vocab
            )));
        }
        cache.begin_tree(first, n);
        let past = committed + first;
        let total = past + n;
        let ids: Vec<i64> = tree.tokens()[first..].iter().map(|&t| t as i64).collect();
        let positions: Vec<i64> = depths[first..]
            .iter()
            .map(|&d| (committed + d as usize) as i64)
            .collect();
        let anc = tree.ancestors();
        let mut bias = vec![f32::NEG_INFINITY; n * total];
        for (i, row) in bias.chunks_mut(total).enumerate() {
            row[..committed].fill(0.0);
            for other in 0..=first + i {
                if anc.sees(first + i, other) {
                    row[committed + other] = 0.0;
                }
            }
        }
        let mut inputs = vec![
            input("input_ids".into(), vec![n], &ids)?,
            input("positions".into(), vec![n], &positions)?,
            input("attn_bias".into(), vec![n, total], &bias)?,
        ];
        if let (Some(d), Some(p)) = (self.feature_dim, prev) {
            inputs.push(input("prev_features".into(), vec![n, d], p)?);
        }
        for l in 0..self.layers {
            // Caches of this drafter are made by `new_cache`, in f32 as ONNX Runtime takes them.
            let (KvRows::F32(k), KvRows::F32(v)) = cache.layer(l) else {
                return Err(ort_err(
                    "an ONNX drafter needs an f32 K/V cache (KvCache::with_shape)",
                ));
            };
            inputs.push(input(format!("past_k.{l}"), vec![past, self.kv_row], k)?);
            inputs.push(input(format!("past_v.{l}"), vec![past, self.kv_row], v)?);
        }
        let mut session = self.session.lock().expect("an ONNX Runtime call panicked");
        let out = session.run(inputs).map_err(ort_err)?;
        let f32_out = |name: &str| -> Result<Vec<f32>, ModelError> {
            let (_, data) = out[name].try_extract_tensor::<f32>().map_err(ort_err)?;
            Ok(data.to_vec())
        };
        let logits = f32_out("logits")?;
        let (_, head) = out["head_token_ids"]
            .try_extract_tensor::<i64>()
            .map_err(ort_err)?;
        let head: Vec<u32> = head.iter().map(|&t| t as u32).collect();
        let features = match self.feature_dim {
            Some(d) => {
                let f = f32_out("features")?;
                if f.len() != n * d {
                    return Err(ort_err("features have the wrong size"));
                }
                Some(f)
            }
            None => None,
        };
        let mut new_kv = Vec::with_capacity(self.layers);
        for l in 0..self.layers {
            new_kv.push((
                f32_out(&format!("new_k.{l}"))?,
                f32_out(&format!("new_v.{l}"))?,
            ));
        }
        drop(out);
        drop(session);
        for (l, (k, v)) in new_kv.iter().enumerate() {
            if k.len() != n * self.kv_row || v.len() != n * self.kv_row {
                return Err(ort_err(format!("new_k.{l}/new_v.{l} have the wrong size")));
            }
            cache.append(l, k, v);
        }
        if logits.len() != n * head.len() {
            return Err(ort_err("logits do not match head_token_ids"));
        }
        Ok((logits, head, features))
    }

    /// Head-row logits spread over the whole vocabulary (`-inf` outside the head).
    fn full_rows(&self, logits: &[f32]) -> Vec<Vec<f32>> {
        logits
            .chunks(self.head_ids.len())
            .map(|row| {
                let mut full = vec![f32::NEG_INFINITY; self.vocab];
                for (&t, &l) in self.head_ids.iter().zip(row) {
                    full[t as usize] = l;
                }
                full
            })
            .collect()
    }
}

impl OnnxFeatureModel {
    /// Loads a feature-conditioned drafter's export from `path` (see [`OnnxModel::load`]).
    pub fn load(path: &Path, threads: usize) -> Result<OnnxFeatureModel, ModelError> {
        let model = OnnxModel::open(path, threads)?;
        if model.feature_dim.is_none() {
            return Err(ort_err(format!(
                "{} is an SSM's export, not a feature-conditioned drafter's",
                path.display()
            )));
        }
        Ok(OnnxFeatureModel(model))
    }

    /// The SHA-256 (hex) of the tokenizer the drafter was trained with, if the export recorded it.
    pub fn tokenizer_sha256(&self) -> Option<&str> {
        self.0.tokenizer_sha256()
    }
}

/// A named input borrowing `data` (no copy).
fn input<'v, T: PrimitiveTensorElementType + std::fmt::Debug + Clone + 'static>(
    name: String,
    shape: Vec<usize>,
    data: &'v [T],
) -> Result<(Cow<'static, str>, SessionInputValue<'v>), ModelError> {
    let t = TensorRef::from_array_view((shape, data)).map_err(ort_err)?;
    Ok((Cow::Owned(name), SessionInputValue::from(t)))
}

impl TreeScorer for OnnxModel {
    fn new_cache(&self) -> KvCache {
        KvCache::with_shape(self.layers, self.kv_row)
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn score(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let (logits, _, _) = self.run(cache, tree, first, None)?;
        Ok(self.full_rows(&logits))
    }

    fn append(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<(), ModelError> {
        // The logits (head rows only) are dropped before being spread over the vocabulary.
        self.run(cache, &TokenTree::chain(tokens), 0, None)?;
        cache.commit_scratch();
        Ok(())
    }
}

impl FeatureScorer for OnnxFeatureModel {
    fn new_cache(&self) -> KvCache {
        self.0.new_cache()
    }

    fn max_positions(&self) -> usize {
        self.0.max_positions
    }

    fn feature_dim(&self) -> usize {
        self.0.feature_dim.expect("checked at load")
    }

    fn score_features(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
        prev: &[f32],
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>), ModelError> {
        let (logits, _, features) = self.0.run(cache, tree, first, Some(prev))?;
        Ok((
            self.0.full_rows(&logits),
            features.expect("a feature drafter's graph gives features"),
        ))
    }

    fn append_committed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        prev: &[f32],
    ) -> Result<(), ModelError> {
        self.0
            .run(cache, &TokenTree::chain(tokens), 0, Some(prev))?;
        cache.commit_scratch();
        Ok(())
    }
}
