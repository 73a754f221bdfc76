//! The edge side of specinfer: a draft model proposes, the speculator shapes its proposals into a
//! token tree, a verifier (embedded in-process, or remote) decides.

pub mod draft;
pub mod speculator;

pub use draft::{CandleDraft, DraftModel};
pub use speculator::{DraftMode, Speculator};
