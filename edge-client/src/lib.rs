//! The edge side of specinfer: a draft model proposes, the speculator shapes its proposals into a
//! token tree, a verifier (remote over QUIC, or embedded in-process on loopback) decides.

pub mod client;
pub mod embedded;
pub mod onnx;
pub mod remote;

pub use client::{Client, ClientError, Drafting, Generation};
pub use embedded::EmbeddedVerifier;
pub use onnx::OnnxModel;
pub use remote::{Remote, RemoteConfig, RemoteError, RemoteSession};
pub use specinfer_speculator::{draft, speculator};
pub use specinfer_speculator::{
    merge_trees, DepthController, DraftMode, DraftedPart, RoundObservation, Speculator, TreeShape,
};
pub use specinfer_speculator::{
    AdaptiveLookup, CachedDraft, ContextLookup, DraftModel, TreeScorer,
};
