//! The cloud verifier: runs the LLM over drafted token trees and decides which tokens it keeps.

pub mod session;
pub mod verify;

pub use session::{verify_batch, RoundOutcome, Session, SessionError};
