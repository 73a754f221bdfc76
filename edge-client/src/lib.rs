//! The edge side of specinfer: a draft model proposes, the round driver (`specinfer-speculator`)
//! shapes its proposals into token trees, a verifier (remote over QUIC, or embedded in-process
//! on loopback) decides. This crate is the I/O around the driver: the QUIC client loop with
//! reconnection, the embedded verifier, and the `specinfer` CLI.

pub mod client;
#[cfg(feature = "embedded-verifier")]
pub mod embedded;
pub mod setup;

pub use client::{Client, ClientError, EmulatedRoundTrip, Generation};
#[cfg(feature = "embedded-verifier")]
pub use embedded::EmbeddedVerifier;
pub use setup::{
    catalogue_model, CatalogueModel, ClientOptions, ClientSetup, Decoding, DraftBackend,
    DraftSource, LlmChoice, SetupError, SetupEvent, VerifierChoice, CATALOGUE, REPEAT_LAST_N,
};

/// Logs of the edge's front ends (the CLI, the desktop app) on stderr: warnings and errors
/// unless `SPECINFER_LOG` says otherwise (an `EnvFilter`, such as `info` or
/// `specinfer_edge=debug`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SPECINFER_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
