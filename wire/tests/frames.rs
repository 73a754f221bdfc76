//! Encoding round trips for random trees and messages, and the decoder under random and mutated
//! bytes: it may refuse a frame, it must never panic.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use rand::{Rng, SeedableRng};
use specinfer_wire::*;

fn limits() -> Limits {
    Limits::default()
}

/// Random well-formed trees, with proposals half of the time.
fn tree_strategy() -> impl Strategy<Value = TokenTree> {
    (1usize..80, any::<u64>(), any::<bool>(), any::<bool>()).prop_map(|(n, seed, with_q, iid)| {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut tokens = vec![rng.random_range(0..50_000u32)];
        let mut parents = Vec::new();
        for i in 1..n {
            parents.push(rng.random_range(0..i as u32));
            tokens.push(0);
        }
        if !with_q {
            tokens
                .iter_mut()
                .for_each(|t| *t = rng.random_range(0..50_000));
            return TokenTree::new(tokens, parents).unwrap();
        }
        // One proposal per expanded node; children take distinct tokens from its support.
        let mut dists: Vec<SparseDist> = Vec::new();
        let mut drawn_from = Vec::new();
        for i in 1..n {
            let parent = parents[i - 1];
            let d = match dists.iter().position(|d| d.node == parent) {
                Some(d) => d,
                None => {
                    let k = 64;
                    let ids: Vec<u32> = (0..k).map(|j| parent * 64 + j).collect();
                    let mut probs: Vec<f32> =
                        (0..k).map(|_| rng.random_range(0.01..1.0f32)).collect();
                    let s: f32 = probs.iter().sum();
                    probs.iter_mut().for_each(|p| *p /= s);
                    dists.push(SparseDist {
                        node: parent,
                        ids,
                        probs,
                    });
                    dists.len() - 1
                }
            };
            let siblings_before = parents[..i - 1].iter().filter(|&&p| p == parent).count() as u32;
            tokens[i] = parent * 64 + siblings_before;
            drawn_from.push(d as u32);
        }
        let mode = if iid {
            DrawMode::Iid
        } else {
            DrawMode::WithoutReplacement
        };
        TokenTree::new(tokens, parents)
            .unwrap()
            .with_proposals(Proposals {
                mode,
                dists,
                drawn_from,
            })
            .unwrap()
    })
}

fn params_strategy() -> impl Strategy<Value = SamplingParams> {
    (
        (0.05f32..3.0, 0.1f32..=1.0, 0u32..100, any::<u64>()),
        1u32..4000,
        prop::collection::vec(0u32..50_000, 0..8),
        (0.5f32..=10.0, 0u32..=MAX_REPEAT_LAST_N),
    )
        .prop_map(
            |((temperature, top_p, top_k, seed), max_new_tokens, stop_ids, (penalty, last_n))| {
                SamplingParams {
                    mode: VerifyMode::Stochastic,
                    temperature,
                    top_p,
                    top_k,
                    seed,
                    max_new_tokens,
                    stop_ids,
                    return_features: false,
                    repeat_penalty: penalty,
                    repeat_last_n: last_n,
                }
            },
        )
}

fn message_strategy() -> impl Strategy<Value = Message> {
    let fp = (1u32..200_000, any::<[u8; 32]>()).prop_map(|(vocab_size, tokenizer_sha256)| {
        ModelFingerprint {
            vocab_size,
            bos: Some(1),
            eos: vec![2],
            tokenizer_sha256,
        }
    });
    prop_oneof![
        (fp.clone(), prop::option::of("[a-z0-9]{0,64}")).prop_map(|(expected_model, api_key)| {
            Message::ClientHello(ClientHello {
                protocol_version: PROTOCOL_VERSION,
                expected_model,
                api_key,
            })
        }),
        (fp, "[ -~]{0,100}", any::<(u32, u32, u64, bool)>()).prop_map(
            |(model, model_name, (sessions, queued_rounds, kv_free_bytes, draining))| {
                Message::ServerHello(ServerHello {
                    protocol_version: PROTOCOL_VERSION,
                    model_name,
                    model,
                    limits: Limits::default(),
                    load: ServerLoad {
                        sessions,
                        max_sessions: 64,
                        queued_rounds,
                        kv_free_bytes,
                        batch_nodes: 12,
                        draining,
                    },
                })
            }
        ),
        any::<u64>().prop_map(|session| Message::Move { session }),
        (
            any::<u64>(),
            prop::collection::vec(0u32..50_000, 1..500),
            params_strategy()
        )
            .prop_map(
                |(session, prompt, params)| Message::OpenSession(OpenSession {
                    session,
                    prompt,
                    params
                })
            ),
        (any::<u64>(), any::<[u8; 16]>(), any::<[u32; 3]>()).prop_map(
            |(session, resume_token, [plain, round, tokens])| {
                Message::SessionOpened(SessionOpened {
                    session,
                    resume_token,
                    costs: VerifierCosts {
                        plain_step_us: plain,
                        split_round_us: round,
                        split_tokens_milli: tokens,
                    },
                })
            }
        ),
        (any::<u64>(), any::<u32>(), tree_strategy()).prop_map(|(session, round, tree)| {
            Message::Verify(Verify {
                session,
                round,
                tree,
            })
        }),
        (
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(0u32..256, 0..32),
            prop::collection::vec(any::<u32>(), 1..33)
        )
            .prop_map(
                |(session, round, accepted_nodes, tokens)| Message::Verified(Verified {
                    session,
                    round,
                    accepted_nodes,
                    tokens,
                    finish: Some(FinishReason::Stop),
                    stats: RoundStats {
                        tree_nodes: 9,
                        batch_size: 2,
                        queue_us: 10,
                        forward_us: 1000,
                        ..RoundStats::default()
                    },
                    features: None,
                })
            ),
        ("[ -~]{0,200}", prop::option::of(any::<u64>())).prop_map(|(message, session)| {
            Message::Error(ErrorFrame {
                code: ErrorCode::Busy,
                session,
                message,
                retry_after_ms: Some(50),
            })
        }),
        any::<u64>().prop_map(|session| Message::Close { session }),
        (any::<u64>(), any::<[u8; 16]>()).prop_map(|(session, resume_token)| Message::Resume {
            session,
            resume_token
        }),
        (any::<u64>(), prop::collection::vec(any::<u32>(), 0..300))
            .prop_map(|(session, committed)| Message::Resumed { session, committed }),
        (any::<u64>(), 0u32..=limits().max_tree_nodes, 0u8..3).prop_map(
            |(session, max_tokens, kind)| Message::Generate {
                session,
                drafting: match kind {
                    0 => ServerDrafting::Plain,
                    1 => ServerDrafting::Speculative,
                    _ => ServerDrafting::Lookup { max_tokens },
                },
            }
        ),
    ]
}

#[test]
fn a_lookup_chain_longer_than_a_tree_may_be_is_refused() {
    let asking = |max_tokens| {
        encode_frame(&Message::Generate {
            session: 1,
            drafting: ServerDrafting::Lookup { max_tokens },
        })
    };
    let limit = limits().max_tree_nodes;
    let ok = asking(limit);
    assert!(decode_frame(&ok[FRAME_HEADER_BYTES..], &limits()).is_ok());
    let over = asking(limit + 1);
    assert!(matches!(
        decode_frame(&over[FRAME_HEADER_BYTES..], &limits()),
        Err(DecodeError::Invalid(InvalidMessage::TooLong { .. }))
    ));
}

/// A repetition penalty outside (0, 10], or a window past MAX_REPEAT_LAST_N tokens, is a bad
/// parameter, refused when the frame is decoded.
#[test]
fn a_repetition_penalty_out_of_range_is_refused() {
    let open = |repeat_penalty, repeat_last_n| {
        encode_frame(&Message::OpenSession(OpenSession {
            session: 1,
            prompt: vec![1, 2, 3],
            params: SamplingParams {
                repeat_penalty,
                repeat_last_n,
                ..SamplingParams::greedy(8)
            },
        }))
    };
    let decoded = |frame: Vec<u8>| decode_frame(&frame[FRAME_HEADER_BYTES..], &limits());
    assert!(decoded(open(1.1, 64)).is_ok());
    assert!(decoded(open(10.0, MAX_REPEAT_LAST_N)).is_ok());
    for (penalty, last_n) in [
        (0.0, 64),
        (-1.0, 64),
        (10.5, 64),
        (f32::NAN, 64),
        (f32::INFINITY, 64),
        (1.1, MAX_REPEAT_LAST_N + 1),
    ] {
        assert!(
            matches!(
                decoded(open(penalty, last_n)),
                Err(DecodeError::Invalid(InvalidMessage::BadParam(_)))
            ),
            "penalty {penalty}, last {last_n} accepted"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn every_message_round_trips(msg in message_strategy()) {
        let frame = encode_frame(&msg);
        let len = frame_len(frame[..4].try_into().unwrap(), &limits()).unwrap();
        prop_assert_eq!(len, frame.len() - FRAME_HEADER_BYTES);
        let back = decode_frame(&frame[FRAME_HEADER_BYTES..], &limits()).unwrap();
        prop_assert_eq!(back, msg);
    }

    #[test]
    fn truncated_frames_are_refused(msg in message_strategy(), cut in any::<prop::sample::Index>()) {
        let frame = encode_frame(&msg);
        let body = &frame[FRAME_HEADER_BYTES..];
        let cut = cut.index(body.len());
        prop_assert!(decode_frame(&body[..cut], &limits()).is_err());
    }
}

/// Thousands of random and mutated frames through the decoder: no panic, and whatever decodes
/// passes validation (decode validates) and re-encodes to a frame that decodes to the same value.
#[test]
fn random_and_mutated_frames_never_panic() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let seeds: Vec<Vec<u8>> = (0..64)
        .map(|_| encode_frame(&message_strategy().new_tree(&mut runner).unwrap().current()))
        .collect();
    let mut decoded = 0;
    for i in 0..5000 {
        let mut body = if i % 5 == 0 {
            let n = rng.random_range(0..300);
            let mut b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            if n >= 2 && rng.random_bool(0.8) {
                b[..2].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            }
            b
        } else {
            seeds[rng.random_range(0..seeds.len())][FRAME_HEADER_BYTES..].to_vec()
        };
        for _ in 0..rng.random_range(1..6) {
            if body.is_empty() {
                break;
            }
            let at = rng.random_range(0..body.len());
            match rng.random_range(0..4) {
                0 => body[at] ^= 1 << rng.random_range(0..8),
                1 => body[at] = [0, 0xff, 0x7f, 0x80, 251, 252, 253][rng.random_range(0..7)],
                2 => body.truncate(at),
                _ => body.insert(at, rng.random()),
            }
        }
        if let Ok(msg) = decode_frame(&body, &limits()) {
            decoded += 1;
            let again = encode_frame(&msg);
            assert_eq!(
                decode_frame(&again[FRAME_HEADER_BYTES..], &limits()).unwrap(),
                msg
            );
        }
    }
    // Some mutations are harmless (a flipped bit in a token id); the decoder must accept those.
    assert!(
        decoded > 0,
        "no mutated frame decoded: the generator is broken"
    );
}
