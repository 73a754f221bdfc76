//! Compute kernels shared by the verifier's engine, the native SSM and training.
//!
//! Plain slices in, plain slices out, no tensor framework: the layouts are the ones a CUDA path
//! would use. Work is spread over rayon's global pool (the one pool of the process); a browser
//! build will need that behind a feature, as wasm32 has no threads by default.

mod attention;
pub mod quant;
pub mod sampling;

pub use attention::{tree_attention, AttentionShape};
pub use quant::{F32Matrix, QuantFormat, QuantMatrix};
