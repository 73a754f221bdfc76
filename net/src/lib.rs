//! specinfer's network layer, shared by the verifier and every native client: frames over
//! streams (QUIC, or WebTransport for browsers) in [`frames`], TLS (certificate pinning, CA
//! roots, self-signed identities) in [`tls`], and the client's connection to a verifier in
//! [`client`], the verifiers it may choose from in [`addrs`]; a UDP relay that adds a wide-area path's delay, jitter and loss in [`relay`]
//! (benchmarks and fault tests). The protocol itself (messages, validation) is `specinfer-wire`'s, sans-I/O.

pub mod addrs;
pub mod client;
pub mod frames;
pub mod http;
pub mod relay;
pub mod tls;

pub use addrs::{AddrsError, VerifierAddrs};
pub use client::{Remote, RemoteConfig, RemoteError, RemoteSession};
pub use frames::{read_frame, read_frame_within, write_frame, FRAME_DEADLINE};
pub use http::host_allowed;
pub use relay::{probe_round_trips, RelayConfig, UdpRelay};
pub use tls::{cert_fingerprint, client_config, ServerIdentity, Trust};

use specinfer_wire::DecodeError;

/// ALPN of protocol version 1.
pub const ALPN: &[u8] = b"specinfer/1";

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("bad frame from peer: {0}")]
    Decode(DecodeError),
    #[error("connection failed: {0}")]
    Connection(quinn::ConnectionError),
    #[error("connect failed: {0}")]
    Connect(quinn::ConnectError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("timed out waiting for the peer")]
    Timeout,
    #[error("WebTransport: {0}")]
    WebTransport(String),
}

impl From<DecodeError> for NetError {
    fn from(e: DecodeError) -> Self {
        NetError::Decode(e)
    }
}

impl From<quinn::ConnectionError> for NetError {
    fn from(e: quinn::ConnectionError) -> Self {
        NetError::Connection(e)
    }
}

impl From<quinn::ConnectError> for NetError {
    fn from(e: quinn::ConnectError) -> Self {
        NetError::Connect(e)
    }
}
