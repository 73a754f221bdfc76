//! A Llama-family transformer (llama, qwen2) on candle-core, built for tree-based speculative
//! inference: one forward pass computes logits for every node of a token tree (or of several
//! sequences' trees, packed), with positions `committed + depth` and attention limited to each
//! node's ancestors; the KV cache keeps the accepted path by moving its entries, not recomputing.

mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod feature;
#[cfg(feature = "fetch")]
pub mod fetch;
mod kv;
pub mod kv_slots;
mod llama;
mod load;
mod logits;
mod onnx;
mod tokenizer;
mod tree_model;

pub use config::{Arch, ModelConfig, RopeStyle};
pub use feature::{FeatureDrafter, FEATURE_DRAFT_KIND};
pub use kv::{KvCache, KvPrecision};
pub use llama::{Llama, SeqTree, WeightCost};
pub use load::quantize_rows_u8;
pub use logits::{DeviceRows, Logits, SampleWalk, WalkOutcome, Want};
pub use specinfer_kernels::KvRows;
pub use tokenizer::{chat_prompt, forget_oldest_exchanges, prompt_budget, ChatMessage, Tokenizer};
pub use tree_model::TreeModel;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: architecture {arch:?} is not supported (supported: llama, qwen2)")]
    UnsupportedArch { path: PathBuf, arch: String },
    #[error("{path}: tensor {name} has type {dtype}, which is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)")]
    UnsupportedTensorType {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: missing {what}")]
    Missing { path: PathBuf, what: String },
    #[error("{path}: file is truncated: {got} bytes, the header describes {expected}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        got: u64,
    },
    #[error("{path}: sha256 is {got}, expected {expected}; delete the file to fetch it again")]
    Sha256Mismatch {
        path: PathBuf,
        expected: String,
        got: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("fetching {what}: {message}")]
    Fetch { what: String, message: String },
    #[error("sequence would reach {needed} positions, the model's context is {limit}")]
    ContextFull { needed: usize, limit: usize },
    #[error(
        "K/V pool full: {needed} positions needed, {free} of {capacity} free (the verifier's \
         KV budget sizes the pool; its admission should keep sessions within it)"
    )]
    KvPoolFull {
        needed: usize,
        free: usize,
        capacity: usize,
    },
    #[error("{backend}: {message}")]
    Runtime {
        backend: &'static str,
        message: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// Loads a GGUF model and the tokenizer stored in its metadata, reading the header once.
pub fn load_gguf(path: &std::path::Path) -> Result<(Llama, Tokenizer)> {
    let mut g = load::Gguf::open(path)?;
    let tokenizer = Tokenizer::from_opened_gguf(&g)?;
    let model = Llama::from_opened_gguf(&mut g)?;
    Ok((model, tokenizer))
}

/// A GGUF's tokenizer and its model's context length (positions), without loading the weights:
/// what a client of a remote verifier needs of the LLM.
pub fn gguf_tokenizer_and_context(path: &std::path::Path) -> Result<(Tokenizer, usize)> {
    let g = load::Gguf::open(path)?;
    let arch = g.meta_str("general.architecture")?;
    let context = g
        .meta(&format!("{arch}.context_length"))
        .ok()
        .and_then(|v| v.to_u32().ok())
        .unwrap_or(2048) as usize;
    Ok((Tokenizer::from_opened_gguf(&g)?, context))
}
