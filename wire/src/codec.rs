//! Framing: `[u32 LE body length][u16 LE protocol version][bincode 2 message]`.
//!
//! bincode is used only in this module (it is pinned at 2.0.1 and flagged unmaintained; keeping it
//! behind two functions keeps a future swap local).

use bincode::config::{self, Configuration, LittleEndian, Varint};

use crate::{ErrorCode, InvalidMessage, Limits, Message, TreeError, PROTOCOL_VERSION};

/// Bytes of the length prefix.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Hard ceiling for any frame body, whatever the limits say. bincode's decoder refuses to allocate
/// or read beyond it, so a length field inside a frame cannot make us allocate more than this.
const BODY_CEILING: usize = 16 << 20;

type Codec = Configuration<LittleEndian, Varint, bincode::config::Limit<BODY_CEILING>>;

fn codec() -> Codec {
    config::standard().with_limit::<BODY_CEILING>()
}

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("frame of {got} bytes exceeds the limit of {limit}")]
    TooLarge { got: usize, limit: usize },
    #[error("frame is truncated: {got} bytes, need at least {need}")]
    Truncated { got: usize, need: usize },
    #[error("peer speaks protocol version {got}, this side speaks {ours}")]
    UnsupportedVersion { got: u16, ours: u16 },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("invalid message: {0}")]
    Invalid(InvalidMessage),
}

impl From<InvalidMessage> for DecodeError {
    fn from(e: InvalidMessage) -> Self {
        DecodeError::Invalid(e)
    }
}

impl DecodeError {
    /// The code a verifier answers with: a request over one of the [`Limits`] it announced is
    /// `LimitExceeded` (the client may retry with a smaller one), a frame of another protocol
    /// version `UnsupportedVersion`, anything else `BadFrame`.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            DecodeError::TooLarge { .. }
            | DecodeError::Invalid(InvalidMessage::TooLong { .. })
            | DecodeError::Invalid(InvalidMessage::Tree(TreeError::TooManyNodes { .. })) => {
                ErrorCode::LimitExceeded
            }
            DecodeError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            DecodeError::Truncated { .. }
            | DecodeError::Malformed(_)
            | DecodeError::TrailingBytes(_)
            | DecodeError::Invalid(_) => ErrorCode::BadFrame,
        }
    }
}

/// Encodes a whole frame, length prefix included.
pub fn encode_frame(msg: &Message) -> Vec<u8> {
    let mut out = vec![0u8; FRAME_HEADER_BYTES];
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    bincode::serde::encode_into_std_write(msg, &mut out, codec())
        .expect("writing to a Vec cannot fail");
    let body = (out.len() - FRAME_HEADER_BYTES) as u32;
    out[..FRAME_HEADER_BYTES].copy_from_slice(&body.to_le_bytes());
    out
}

/// Reads the length prefix and checks it against the limits before any body byte is read or any
/// buffer allocated.
pub fn frame_len(header: [u8; FRAME_HEADER_BYTES], limits: &Limits) -> Result<usize, DecodeError> {
    let len = u32::from_le_bytes(header) as usize;
    let limit = (limits.max_frame_bytes as usize).min(BODY_CEILING);
    if len > limit {
        return Err(DecodeError::TooLarge { got: len, limit });
    }
    if len < 2 {
        return Err(DecodeError::Truncated { got: len, need: 2 });
    }
    Ok(len)
}

/// Decodes and validates a frame body (everything after the length prefix).
pub fn decode_frame(body: &[u8], limits: &Limits) -> Result<Message, DecodeError> {
    let limit = (limits.max_frame_bytes as usize).min(BODY_CEILING);
    if body.len() > limit {
        return Err(DecodeError::TooLarge {
            got: body.len(),
            limit,
        });
    }
    let [v0, v1, rest @ ..] = body else {
        return Err(DecodeError::Truncated {
            got: body.len(),
            need: 2,
        });
    };
    let version = u16::from_le_bytes([*v0, *v1]);
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            got: version,
            ours: PROTOCOL_VERSION,
        });
    }
    let (msg, used): (Message, usize) = bincode::serde::decode_from_slice(rest, codec())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if used != rest.len() {
        return Err(DecodeError::TrailingBytes(rest.len() - used));
    }
    msg.validate(limits)?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::*;

    fn body(frame: &[u8]) -> &[u8] {
        &frame[FRAME_HEADER_BYTES..]
    }

    #[test]
    fn a_frame_of_another_version_is_refused_cleanly() {
        let next = PROTOCOL_VERSION + 1;
        let mut f = encode_frame(&Message::Close { session: 3 });
        f[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + 2].copy_from_slice(&next.to_le_bytes());
        assert_eq!(
            decode_frame(body(&f), &Limits::default()),
            Err(DecodeError::UnsupportedVersion {
                got: next,
                ours: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn trailing_bytes_and_oversize_are_refused() {
        let mut f = encode_frame(&Message::Close { session: 3 });
        f.push(0);
        assert_eq!(
            decode_frame(body(&f), &Limits::default()),
            Err(DecodeError::TrailingBytes(1))
        );
        let limits = Limits {
            max_frame_bytes: 100,
            ..Limits::default()
        };
        assert!(matches!(
            frame_len(1000u32.to_le_bytes(), &limits),
            Err(DecodeError::TooLarge { .. })
        ));
        assert!(matches!(
            frame_len(u32::MAX.to_le_bytes(), &limits),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn requests_over_a_limit_are_told_apart_from_broken_frames() {
        let limits = Limits::default();
        let over = |msg: &Message| decode_frame(body(&encode_frame(msg)), &limits).unwrap_err();
        let long_prompt = over(&Message::OpenSession(OpenSession {
            session: 1,
            prompt: vec![1; limits.max_prompt_tokens as usize + 1],
            params: SamplingParams::greedy(8),
        }));
        assert_eq!(long_prompt.error_code(), ErrorCode::LimitExceeded);
        let big_tree = over(&Message::Verify(Verify {
            session: 1,
            round: 0,
            tree: TokenTree::chain(&vec![1; limits.max_tree_nodes as usize + 1]),
        }));
        assert_eq!(big_tree.error_code(), ErrorCode::LimitExceeded);
        let too_large = frame_len(u32::MAX.to_le_bytes(), &limits).unwrap_err();
        assert_eq!(too_large.error_code(), ErrorCode::LimitExceeded);
        let mut other = encode_frame(&Message::Close { session: 3 });
        other[FRAME_HEADER_BYTES] = PROTOCOL_VERSION as u8 + 1;
        let other = decode_frame(body(&other), &limits).unwrap_err();
        assert_eq!(other.error_code(), ErrorCode::UnsupportedVersion);
        let mut trailing = encode_frame(&Message::Close { session: 3 });
        trailing.push(0);
        let trailing = decode_frame(body(&trailing), &limits).unwrap_err();
        assert_eq!(trailing.error_code(), ErrorCode::BadFrame);
    }

    #[test]
    fn a_huge_declared_vec_length_does_not_allocate() {
        // OpenSession whose prompt claims 2^40 tokens in a 20-byte frame.
        let mut f = encode_frame(&Message::OpenSession(OpenSession {
            session: 1,
            prompt: vec![1],
            params: SamplingParams::greedy(8),
        }));
        // body: version(2) | variant(1) | session varint(1) | prompt len varint ...
        let pos = FRAME_HEADER_BYTES + 2 + 1 + 1;
        assert_eq!(f[pos], 1);
        let mut forged = f[..pos].to_vec();
        forged.push(253); // varint tag for a u64
        forged.extend_from_slice(&(1u64 << 40).to_le_bytes());
        forged.extend_from_slice(&f[pos + 1..]);
        f = forged;
        assert!(matches!(
            decode_frame(body(&f), &Limits::default()),
            Err(DecodeError::Malformed(_))
        ));
    }

    #[test]
    fn invalid_trees_are_refused_after_framing() {
        // Serialize a tree whose parent index points forward by building it through serde directly.
        #[derive(serde::Serialize)]
        struct RawTree {
            tokens: Vec<u32>,
            parents: Vec<u32>,
            proposals: Option<Proposals>,
        }
        #[derive(serde::Serialize)]
        enum RawMessage {
            _ClientHello,
            _ServerHello,
            _OpenSession,
            _SessionOpened,
            Verify {
                session: u64,
                round: u32,
                tree: RawTree,
            },
        }
        let raw = RawMessage::Verify {
            session: 1,
            round: 0,
            tree: RawTree {
                tokens: vec![1, 2, 3],
                parents: vec![0, 2],
                proposals: None,
            },
        };
        let mut b = PROTOCOL_VERSION.to_le_bytes().to_vec();
        bincode::serde::encode_into_std_write(&raw, &mut b, codec()).unwrap();
        assert_eq!(
            decode_frame(&b, &Limits::default()),
            Err(DecodeError::Invalid(InvalidMessage::Tree(
                TreeError::ParentNotEarlier { node: 2, parent: 2 }
            )))
        );
    }
}
