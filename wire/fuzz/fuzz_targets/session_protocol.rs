//! `cargo fuzz run session_protocol` (from `wire/`): a connection's frames and the engine's
//! outcomes, in any order, through the verifier's protocol state (`specinfer_wire::server`): its
//! hello check and one session stream. Never a panic; the hello is admitted exactly when every
//! check passes; and each frame gets the step an independent model of the rules expects, so
//! nothing out of order reaches the engine (opens and resumes only while unbound, rounds only of
//! the bound session, numbered in order, each number answered once).
//!
//! Input: records of `[control byte][u16 LE length][bytes]`. The control byte's low bits are the
//! engine's answer to the step (succeeds or fails, and how many rounds a generation streams); its
//! top bit makes the record a well-formed message built from the bytes instead of a frame body to
//! decode, so that deep states are easy to reach.
#![no_main]

use libfuzzer_sys::fuzz_target;
use specinfer_wire::server::{check_hello, HelloPolicy, SessionStream, StreamStep};
use specinfer_wire::*;

const KEY: &str = "fuzz-key";

fn model() -> ModelFingerprint {
    ModelFingerprint {
        vocab_size: 64,
        bos: Some(1),
        eos: vec![2],
        tokenizer_sha256: [7; 32],
    }
}

struct Records<'a>(&'a [u8]);

impl<'a> Iterator for Records<'a> {
    type Item = (u8, &'a [u8]);
    fn next(&mut self) -> Option<Self::Item> {
        let [control, l0, l1, rest @ ..] = self.0 else {
            return None;
        };
        let len = (u16::from_le_bytes([*l0, *l1]) as usize).min(rest.len());
        let (bytes, tail) = rest.split_at(len);
        self.0 = tail;
        Some((*control, bytes))
    }
}

/// A well-formed message of the kind and fields `bytes` choose (small ids, so they collide).
fn built(bytes: &[u8]) -> Message {
    let b = |i: usize| bytes.get(i).copied().unwrap_or(0);
    let session = (b(1) % 3) as u64;
    match b(0) % 7 {
        0 => Message::ClientHello(ClientHello {
            protocol_version: if b(2) % 8 == 0 { 3 } else { PROTOCOL_VERSION },
            expected_model: if b(3) % 8 == 0 {
                ModelFingerprint {
                    vocab_size: 65,
                    ..model()
                }
            } else {
                model()
            },
            api_key: match b(4) % 4 {
                0 => None,
                1 => Some("other".into()),
                _ => Some(KEY.into()),
            },
        }),
        1 => Message::OpenSession(OpenSession {
            session,
            prompt: vec![3, 4],
            params: SamplingParams::greedy(8),
        }),
        2 => Message::Resume {
            session,
            resume_token: [b(2); 16],
        },
        3 => Message::Verify(Verify {
            session,
            round: (b(2) % 5) as u32,
            tree: TokenTree::chain(&[3, 4]),
        }),
        4 => Message::Generate {
            session,
            drafting: ServerDrafting::Plain,
        },
        5 => Message::Close { session },
        _ => Message::Move { session },
    }
}

/// What the rules say a frame leads to, from the stream's binding alone.
#[derive(Debug, PartialEq)]
enum Expected {
    Open,
    Resume,
    Verify,
    Generate,
    Close,
    Refuse,
}

fn expected(bound: Option<(u64, u32)>, msg: &Message) -> Expected {
    match (msg, bound) {
        (Message::OpenSession(_), None) => Expected::Open,
        (Message::Resume { .. }, None) => Expected::Resume,
        (Message::Verify(v), Some((id, round))) if v.session == id && v.round == round => {
            Expected::Verify
        }
        (Message::Generate { session, .. }, Some((id, _))) if *session == id => Expected::Generate,
        (Message::Close { .. }, _) => Expected::Close,
        _ => Expected::Refuse,
    }
}

fn kind(step: &StreamStep) -> Expected {
    match step {
        StreamStep::Open(_) => Expected::Open,
        StreamStep::Resume { .. } => Expected::Resume,
        StreamStep::Verify(_) => Expected::Verify,
        StreamStep::Generate { .. } => Expected::Generate,
        StreamStep::Close { .. } => Expected::Close,
        StreamStep::Refuse(_) => Expected::Refuse,
    }
}

fn message(control: u8, bytes: &[u8], limits: &Limits) -> Option<Message> {
    if control & 0x80 != 0 {
        Some(built(bytes))
    } else {
        // A frame that does not decode ends the stream, as it does in the service.
        decode_frame(bytes, limits).ok()
    }
}

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let model = model();
    let mut records = Records(data);

    // The connection's first frame.
    let Some((control, bytes)) = records.next() else {
        return;
    };
    let Some(first) = message(control, bytes, &limits) else {
        return;
    };
    let serving = control & 1 == 0;
    let admits_key = |key: Option<&str>| key == Some(KEY);
    let should_admit = matches!(&first, Message::ClientHello(h)
        if h.protocol_version == PROTOCOL_VERSION
            && h.api_key.as_deref() == Some(KEY)
            && h.expected_model == model
            && serving);
    let policy = HelloPolicy {
        model: &model,
        admits_key: &admits_key,
        serving,
    };
    match check_hello(first, &policy) {
        Ok(h) => {
            assert!(should_admit, "admitted {h:?}");
        }
        Err(e) => {
            assert!(!should_admit, "refused a good hello: {e:?}");
            assert!(e.session.is_none());
            return;
        }
    }

    // One session stream.
    let mut stream = SessionStream::<u64>::default();
    let mut bound: Option<(u64, u32)> = None;
    let mut next_engine_id = 100u64;
    for (control, bytes) in records {
        let Some(msg) = message(control, bytes, &limits) else {
            return;
        };
        let want = expected(bound, &msg);
        let step = stream.on_frame(msg);
        assert_eq!(
            kind(&step),
            want,
            "{step:?} with the stream bound to {bound:?}"
        );
        let engine_ok = control & 1 == 0;
        match step {
            StreamStep::Open(OpenSession { session, .. }) | StreamStep::Resume { session, .. } => {
                if engine_ok {
                    stream.bind(session, next_engine_id);
                    bound = Some((session, 0));
                    next_engine_id += 1;
                }
            }
            StreamStep::Verify(v) => {
                let b = stream.bound().expect("a round of an unbound stream");
                assert_eq!((b.client_id, b.next_round), (v.session, v.round));
                assert_eq!(b.id, next_engine_id - 1);
                if engine_ok {
                    assert_eq!(stream.round_done(), v.round);
                    bound = Some((v.session, v.round + 1));
                }
            }
            StreamStep::Generate { .. } => {
                let (session, mut round) = bound.expect("a generation of an unbound stream");
                for _ in 0..(control >> 1) & 7 {
                    assert_eq!(stream.round_done(), round);
                    round += 1;
                }
                bound = Some((session, round));
            }
            StreamStep::Close { .. } => return,
            StreamStep::Refuse(e) => {
                assert_eq!(e.code, ErrorCode::OutOfOrder);
                assert_eq!(e.session, bound.map(|b| b.0));
            }
        }
        assert_eq!(
            stream.bound().map(|b| (b.client_id, b.next_round)),
            bound,
            "the stream's state left the rules"
        );
    }
});
