//! Compute kernels shared by the verifier's engine, the native SSM and training.
//!
//! Plain slices in, plain slices out: the same layouts are used by the CUDA path, and nothing here
//! depends on a tensor framework, so it also builds for wasm32.

mod attention;
pub mod quant;
pub mod sampling;

pub use attention::{tree_attention, AttentionShape};
pub use quant::{QuantFormat, QuantMatrix};
