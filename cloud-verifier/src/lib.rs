//! The cloud verifier: runs the LLM over drafted token trees and decides which tokens it keeps.
//!
//! Layers, from pure to I/O: [`verify`] (verification algorithms), [`session`] (one sequence's
//! state, batched verification), [`engine`] (the thread that owns the model and batches rounds of
//! many sessions; [`prefix`] keeps ended sessions' K/V for reuse), [`service`] (QUIC, auth,
//! drain), [`admin`] (metrics and probes over HTTP); frames and TLS come from `specinfer-net`.

pub mod admin;
pub mod costs;
pub mod engine;
pub mod metrics;
pub mod prefix;
pub mod quota;
pub mod service;
pub mod session;
pub mod verify;
pub mod web;

pub use session::{verify_batch, RoundOutcome, Session, SessionError};
