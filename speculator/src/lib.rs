//! The platform-neutral half of the edge client: a draft model proposes, the speculator shapes
//! its proposals into a token tree. No I/O, no async, no ONNX Runtime: the native client
//! (`specinfer-edge`) and the browser build (`specinfer-wasm`) both use it as is.

mod acceptance;
pub mod controller;
pub mod draft;
mod dynamic;
mod expansion;
pub mod feature;
pub mod handoff;
pub mod lookup;
pub mod merge;
pub mod round;
mod select;
pub mod shape;
pub mod speculator;

pub use controller::{
    AffineFit, Calibration, DepthController, DraftedPart, RoundObservation, PLAIN_EXPLORE,
};
pub use draft::{CachedDraft, DraftModel, TreeScorer};
pub use dynamic::GrowthCosts;
pub use feature::{FeatureDraft, FeatureScorer};
pub use handoff::HandOff;
pub use lookup::{AdaptiveLookup, ContextLookup};
pub use merge::merge_trees;
pub use round::{
    Clock, Drafter, GenerationStats, Recovery, RoundDriver, RoundError, RoundOutput, TextStream,
};
pub use shape::{DraftMode, TreeShape};
pub use speculator::Speculator;
