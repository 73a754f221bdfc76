//! Compute kernels shared by the verifier's engine, the native SSM and training.
//!
//! Plain slices in, plain slices out, no tensor framework: the layouts are the ones the CUDA
//! kernels (feature `cuda`) use. A call's work is spread over as many threads as rayon's current
//! pool has: the caller and the compute team's helpers (`team`), or rayon's workers where the team
//! is led by another caller; in WebAssembly without threads it runs on the calling thread.

mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_libs;
mod lanes;
pub mod profile;
pub mod projection;
pub mod quant;
pub mod sampling;
mod team;
mod weight_buffer;

pub use attention::{tree_attention, AttentionShape, KvRows};
pub use lanes::{add_rms_norm, rms_norm, swiglu};
pub use quant::{matmul_many, read_ahead, F32Matrix, QuantFormat, QuantMatrix};
