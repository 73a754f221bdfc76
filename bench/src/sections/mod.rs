//! The report's sections, one module each with one entry point.

pub mod alignment;
pub mod capacity;
pub mod concurrency;
pub mod engine;
pub mod feature_draft;
pub mod fleet;
pub mod local;
pub mod qwen;
pub mod rtt;
pub mod soak;
pub mod stochastic;
pub mod tree_vs_sequence;
pub mod tree_width;
