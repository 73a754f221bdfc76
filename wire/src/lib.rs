//! The protocol spoken between an edge speculator and a cloud verifier.
//!
//! Everything here is sans-I/O: values, their encoding, and the checks an untrusted frame must pass
//! before anything else looks at it. It builds for `wasm32-unknown-unknown` so the browser client
//! speaks exactly the same bytes as the native one.

mod codec;
mod features;
mod hex;
mod message;
pub mod server;
mod tree;

pub use codec::{decode_frame, encode_frame, frame_len, DecodeError, FRAME_HEADER_BYTES};
pub use features::{FeatureRows, MAX_FEATURE_DIM, PROMPT_FEATURE_ROWS};
pub use hex::parse_sha256_hex;
pub use message::*;
pub use tree::{AncestorBits, DrawMode, Proposals, SparseDist, TokenTree, TreeError};

/// Version of the frame format and message set. A peer only accepts frames carrying exactly its own
/// version, so a v1 peer rejects a v2 frame with [`DecodeError::UnsupportedVersion`] instead of
/// misreading it.
pub const PROTOCOL_VERSION: u16 = 7;

/// The largest top-K a sparse proposal distribution may carry.
pub const MAX_PROPOSAL_K: usize = 64;

/// Bounds applied to every untrusted frame. The defaults are what a verifier serving a ~100k vocab
/// model would accept; a server may tighten them and announces them in its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    pub max_frame_bytes: u32,
    pub max_tree_nodes: u32,
    pub max_prompt_tokens: u32,
    pub max_new_tokens: u32,
    pub max_stop_ids: u32,
    pub max_api_key_bytes: u32,
    pub max_message_bytes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 4 << 20,
            max_tree_nodes: 256,
            max_prompt_tokens: 8192,
            max_new_tokens: 8192,
            max_stop_ids: 16,
            max_api_key_bytes: 256,
            max_message_bytes: 4096,
        }
    }
}
