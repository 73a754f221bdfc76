//! Distilling small speculative models from the LLM: data, teacher answers, the trainable SSM,
//! training, export and evaluation. `specinfer-train run` drives it all.

pub mod data;
pub mod eval;
pub mod feature;
pub mod feature_pipeline;
pub mod ssm;
pub mod teacher;
pub mod train;
