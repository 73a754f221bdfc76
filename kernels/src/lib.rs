//! Compute kernels shared by the verifier's engine, the native SSM and training.
//!
//! Plain slices in, plain slices out, no tensor framework: the layouts are the ones the CUDA
//! kernels (feature `cuda`) use. Work is spread over rayon's global pool (the one pool of the
//! process); in WebAssembly without threads rayon runs it on the calling thread.

mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_libs;
mod lanes;
pub mod projection;
pub mod quant;
pub mod sampling;

pub use attention::{tree_attention, AttentionShape, KvRows};
pub use lanes::{rms_norm, swiglu};
pub use quant::{matmul_many, F32Matrix, QuantFormat, QuantMatrix};
