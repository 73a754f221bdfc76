//! The edge side of specinfer: a draft model proposes, the speculator shapes its proposals into a
//! token tree, a verifier (remote over QUIC, or embedded in-process on loopback) decides.

pub mod client;
pub mod draft;
pub mod embedded;
pub mod onnx;
pub mod remote;
pub mod speculator;

pub use client::{Client, ClientError, Drafting, Generation};
pub use draft::{CachedDraft, DraftModel, TreeScorer};
pub use embedded::EmbeddedVerifier;
pub use onnx::OnnxModel;
pub use remote::{Remote, RemoteConfig, RemoteError, RemoteSession};
pub use speculator::{
    merge_trees, DepthController, DraftMode, RoundObservation, Speculator, TreeShape,
};
