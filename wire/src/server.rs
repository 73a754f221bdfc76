//! The verifier's side of the protocol's order of messages, sans-I/O: what a connection's first
//! frame must be, and which frames a session stream takes in which state. The service feeds it
//! decoded frames and does what it says; a fuzz target (`wire/fuzz`, `session_protocol`) drives it
//! with any sequence of frames and engine outcomes and checks that nothing out of order ever
//! reaches the engine.
//!
//! A session stream starts unbound: it takes `OpenSession` or `Resume` (one of them, once it
//! succeeds), then `Verify` for its own session with the next round number only, or `Generate`;
//! `Close` ends it in any state. Everything else is refused with a typed error and the stream goes
//! on, so a confused client learns why without losing its session.

use crate::{
    ClientHello, ErrorCode, ErrorFrame, Message, ModelFingerprint, OpenSession, ServerDrafting,
    Verify, PROTOCOL_VERSION,
};

/// What a verifier admits on a connection's first frame.
pub struct HelloPolicy<'a> {
    /// The verifier's tokenizer: a client expecting another one is refused.
    pub model: &'a ModelFingerprint,
    /// Whether the presented API key (or none) may connect.
    pub admits_key: &'a dyn Fn(Option<&str>) -> bool,
    /// False once the engine has stopped: the client should go to another verifier.
    pub serving: bool,
}

fn refused(code: ErrorCode, session: Option<u64>, message: impl Into<String>) -> ErrorFrame {
    ErrorFrame {
        code,
        session,
        message: message.into(),
        retry_after_ms: None,
    }
}

/// The hello of a connection's first frame, or why the connection is refused. The checks run in
/// an order that tells a stranger nothing about the model before its key is accepted.
pub fn check_hello(first: Message, policy: &HelloPolicy<'_>) -> Result<ClientHello, ErrorFrame> {
    let Message::ClientHello(h) = first else {
        return Err(refused(
            ErrorCode::BadFrame,
            None,
            "the first frame must be ClientHello",
        ));
    };
    if h.protocol_version != PROTOCOL_VERSION {
        return Err(refused(
            ErrorCode::UnsupportedVersion,
            None,
            format!(
                "client speaks protocol {}, this verifier speaks {PROTOCOL_VERSION}",
                h.protocol_version
            ),
        ));
    }
    if !(policy.admits_key)(h.api_key.as_deref()) {
        return Err(refused(
            ErrorCode::Unauthorized,
            None,
            "missing or unknown API key",
        ));
    }
    if !policy.serving {
        return Err(refused(
            ErrorCode::Internal,
            None,
            "the verifier's engine has stopped; try another verifier",
        ));
    }
    if &h.expected_model != policy.model {
        return Err(refused(
            ErrorCode::ModelMismatch,
            None,
            format!(
                "tokenizer mismatch: the verifier's model is [{}], the client expects [{}]",
                policy.model, h.expected_model
            ),
        ));
    }
    Ok(h)
}

/// The session a stream carries: the client's id for it, the server's handle `Id`, and the round
/// it expects next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundSession<Id> {
    pub client_id: u64,
    pub id: Id,
    pub next_round: u32,
}

/// One session stream's state on the verifier.
#[derive(Debug)]
pub struct SessionStream<Id> {
    bound: Option<BoundSession<Id>>,
}

impl<Id> Default for SessionStream<Id> {
    fn default() -> Self {
        SessionStream { bound: None }
    }
}

/// What the verifier must do with a frame of a session stream.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamStep {
    /// Open the session; on success call [`SessionStream::bind`].
    Open(OpenSession),
    /// Resume a detached session; on success call [`SessionStream::bind`].
    Resume {
        session: u64,
        resume_token: [u8; 16],
    },
    /// Run this round of the bound session: it is that session's and carries the next round
    /// number. After its verdict is sent, call [`SessionStream::round_done`].
    Verify(Verify),
    /// Decode the bound session to its end on the server; each streamed round is a
    /// [`SessionStream::round_done`].
    Generate { drafting: ServerDrafting },
    /// Acknowledge and end the stream (closing the session if one is bound).
    Close { session: u64 },
    /// Answer with this error; the stream and its session go on.
    Refuse(ErrorFrame),
}

impl<Id> SessionStream<Id> {
    pub fn bound(&self) -> Option<&BoundSession<Id>> {
        self.bound.as_ref()
    }

    /// Whose session an error concerns, for the error frame.
    pub fn client_id(&self) -> Option<u64> {
        self.bound.as_ref().map(|b| b.client_id)
    }

    /// What to do with the next frame of this stream.
    pub fn on_frame(&mut self, msg: Message) -> StreamStep {
        let bound_to = |session: u64| self.bound.as_ref().is_some_and(|b| b.client_id == session);
        match msg {
            Message::OpenSession(o) if self.bound.is_none() => StreamStep::Open(o),
            Message::Resume {
                session,
                resume_token,
            } if self.bound.is_none() => StreamStep::Resume {
                session,
                resume_token,
            },
            Message::Verify(v) if bound_to(v.session) => {
                let expected = self.bound.as_ref().map_or(0, |b| b.next_round);
                if v.round == expected {
                    StreamStep::Verify(v)
                } else {
                    StreamStep::Refuse(refused(
                        ErrorCode::OutOfOrder,
                        Some(v.session),
                        format!("expected round {expected}, got {}", v.round),
                    ))
                }
            }
            Message::Generate { session, drafting } if bound_to(session) => {
                StreamStep::Generate { drafting }
            }
            Message::Close { session } => StreamStep::Close { session },
            other => StreamStep::Refuse(refused(
                ErrorCode::OutOfOrder,
                self.client_id(),
                format!(
                    "unexpected {} on a session stream in this state",
                    other.name()
                ),
            )),
        }
    }

    /// The session `client_id` was opened or resumed as the server's `id`.
    ///
    /// # Panics
    /// If the stream is already bound: only [`StreamStep::Open`] and [`StreamStep::Resume`],
    /// which are given only while unbound, lead here.
    pub fn bind(&mut self, client_id: u64, id: Id) {
        assert!(self.bound.is_none(), "a session stream binds once");
        self.bound = Some(BoundSession {
            client_id,
            id,
            next_round: 0,
        });
    }

    /// A round of the bound session was answered: the next one carries the next number. Returns
    /// the answered round's number.
    ///
    /// # Panics
    /// If no session is bound.
    pub fn round_done(&mut self) -> u32 {
        let b = self
            .bound
            .as_mut()
            .expect("rounds belong to a bound session");
        b.next_round += 1;
        b.next_round - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SamplingParams, TokenTree};

    fn verify(session: u64, round: u32) -> Message {
        Message::Verify(Verify {
            session,
            round,
            tree: TokenTree::chain(&[1]),
        })
    }

    #[test]
    fn a_stream_takes_rounds_of_its_own_session_in_order_only() {
        let mut s = SessionStream::<u8>::default();
        assert!(matches!(s.on_frame(verify(1, 0)), StreamStep::Refuse(_)));
        let open = Message::OpenSession(OpenSession {
            session: 1,
            prompt: vec![1],
            params: SamplingParams::greedy(4),
        });
        assert!(matches!(s.on_frame(open.clone()), StreamStep::Open(_)));
        s.bind(1, 9);
        assert!(matches!(s.on_frame(open), StreamStep::Refuse(_)));
        assert!(matches!(s.on_frame(verify(2, 0)), StreamStep::Refuse(_)));
        match s.on_frame(verify(1, 1)) {
            StreamStep::Refuse(e) => {
                assert_eq!(e.code, ErrorCode::OutOfOrder);
                assert_eq!(e.session, Some(1));
                assert!(e.message.contains("expected round 0"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(s.on_frame(verify(1, 0)), StreamStep::Verify(_)));
        assert_eq!(s.round_done(), 0);
        assert!(matches!(s.on_frame(verify(1, 1)), StreamStep::Verify(_)));
        assert_eq!(
            s.on_frame(Message::Close { session: 1 }),
            StreamStep::Close { session: 1 }
        );
    }
}
