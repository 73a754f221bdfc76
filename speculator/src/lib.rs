//! The platform-neutral half of the edge client: a draft model proposes, the speculator shapes
//! its proposals into a token tree. No I/O, no async, no ONNX Runtime: the native client
//! (`specinfer-edge`) and the browser build (`specinfer-wasm`) both use it as is.

pub mod draft;
pub mod lookup;
pub mod speculator;

pub use draft::{CachedDraft, DraftModel, TreeScorer};
pub use lookup::{AdaptiveLookup, ContextLookup};
pub use speculator::{
    merge_trees, DepthController, DraftMode, DraftedPart, RoundObservation, Speculator, TreeShape,
    PLAIN_EXPLORE,
};
