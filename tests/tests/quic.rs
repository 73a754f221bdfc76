//! End to end over loopback QUIC with SmolLM2: lossless greedy output for every tree shape,
//! reproducible seeded sampling, continuous batching of concurrent sessions, and faults that
//! must not disturb a healthy session.

use std::time::Duration;

use specinfer_edge::{Client, Generation};
use specinfer_integration::{
    chat_ids, default_ssm, raw_hello, smollm2, start_verifier, start_verifier_drafting,
    start_verifier_with, NoisyDraft, UdpRelay, API_KEY,
};
use specinfer_net::RemoteConfig;
use specinfer_net::{client_config, read_frame, write_frame};
use specinfer_speculator::{ContextLookup, DraftMode, Drafter, RoundDriver, Speculator};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::RunningVerifier;
use specinfer_wire::*;

async fn generate(
    remote: &RemoteConfig,
    prompt: &[u32],
    params: SamplingParams,
    tree: Option<(Vec<usize>, DraftMode, u64)>,
) -> Generation {
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let g = generate_on(&mut client, prompt, params, tree, None).await;
    client.shutdown().await;
    g
}

/// A fresh verifier, the chat prompt of `question`, greedy parameters, and the incremental
/// answer the verifier gives it directly: what a client through a relay must reproduce.
async fn greedy_reference(
    question: &str,
    max_new: u32,
) -> (
    RunningVerifier,
    RemoteConfig,
    Vec<u32>,
    SamplingParams,
    Vec<u32>,
) {
    let (server, direct) = start_verifier(EngineConfig::default());
    let ids = chat_ids(question);
    let params = SamplingParams::greedy(max_new);
    let reference = generate(&direct, &ids, params.clone(), None)
        .await
        .token_ids;
    (server, direct, ids, params, reference)
}

/// One generation on `client`: incremental, or with trees of `expansion` from a noisy SmolLM2;
/// with `lookup`'s chain added to every tree.
async fn generate_on(
    client: &mut Client,
    prompt: &[u32],
    params: SamplingParams,
    tree: Option<(Vec<usize>, DraftMode, u64)>,
    lookup: Option<ContextLookup>,
) -> Generation {
    let (llm, _) = smollm2();
    let drafter = tree.map(|(expansion, mode, seed)| Drafter {
        speculator: Speculator::new(expansion, mode, seed),
        drafts: vec![Box::new(NoisyDraft::new(llm, seed, 2.0))],
    });
    let mut driver = RoundDriver::new(prompt.to_vec(), params, drafter)
        .unwrap()
        .with_lookup(lookup);
    client.generate(&mut driver, |_| {}).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_over_quic_equals_incremental_for_every_tree_shape() {
    let (server, remote) = start_verifier(EngineConfig::default());
    for prompt in [
        "What is the capital of France?",
        "Write a haiku about rain.",
    ] {
        let ids = chat_ids(prompt);
        let params = SamplingParams::greedy(40);
        let reference = generate(&remote, &ids, params.clone(), None).await;
        assert_eq!(reference.token_ids.len(), 40);
        assert_eq!(
            reference.stats.rounds, 40,
            "incremental decoding emits one token per round"
        );
        for expansion in [
            vec![1, 1, 1, 1],
            vec![2, 2, 1],
            vec![1, 1, 3, 1, 1, 1, 1, 1],
        ] {
            let g = generate(
                &remote,
                &ids,
                params.clone(),
                Some((expansion.clone(), DraftMode::Greedy, 3)),
            )
            .await;
            assert_eq!(
                g.token_ids, reference.token_ids,
                "tree {expansion:?} changed the output of {prompt:?}"
            );
            assert!(
                g.stats.rounds < 40,
                "tree {expansion:?} never accepted a draft"
            );
            println!(
                "{prompt:?} tree {expansion:?}: {} rounds, tau {:.2}, {} B up, {} B down",
                g.stats.rounds,
                40.0 / g.stats.rounds as f64,
                g.bytes_up,
                g.bytes_down
            );
        }
    }
    server.shutdown().await;
}

/// The tokens and round count of a session the verifier generates on its own.
async fn server_generated(
    remote: &RemoteConfig,
    prompt: &[u32],
    params: SamplingParams,
    drafting: ServerDrafting,
) -> Result<(Vec<u32>, usize), specinfer_net::RemoteError> {
    let conn = specinfer_net::Remote::connect(remote).await?;
    let mut s = conn.open(1, prompt.to_vec(), params).await?;
    s.generate(drafting).await?;
    let (mut tokens, mut rounds) = (Vec::new(), 0);
    loop {
        let v = s.verdict().await?;
        assert!(v.stats.tree_nodes >= 1);
        // Nothing drafts from features once the verifier decodes on its own.
        assert!(v.features.is_none(), "a streamed verdict carried features");
        tokens.extend(&v.tokens);
        rounds += 1;
        if v.finish.is_some() {
            break;
        }
    }
    s.close().await?;
    conn.shutdown().await;
    Ok((tokens, rounds))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_verifier_generating_on_its_own_gives_the_client_driven_answer() {
    let (server, remote) = start_verifier_drafting(EngineConfig::default(), Some(default_ssm()));
    let ids = chat_ids("Name three colours of the rainbow.");
    let params = SamplingParams::greedy(48);
    let reference = generate(&remote, &ids, params.clone(), None).await;
    let (plain, plain_rounds) =
        server_generated(&remote, &ids, params.clone(), ServerDrafting::Plain)
            .await
            .unwrap();
    assert_eq!(plain, reference.token_ids, "server-side plain decoding");
    assert_eq!(plain_rounds, 48, "plain decoding is one token per round");
    // A session opened for a feature drafter that hands off: the same answer, and no features
    // (not even the prompt's, still pending) in the streamed verdicts.
    let with_features = SamplingParams {
        return_features: true,
        ..params.clone()
    };
    let (handed_off, _) = server_generated(&remote, &ids, with_features, ServerDrafting::Plain)
        .await
        .unwrap();
    assert_eq!(
        handed_off, reference.token_ids,
        "after a feature session's hand-off"
    );
    let (spec, spec_rounds) =
        server_generated(&remote, &ids, params.clone(), ServerDrafting::Speculative)
            .await
            .unwrap();
    assert_eq!(spec, reference.token_ids, "server-side speculation");
    assert!(
        spec_rounds < 48,
        "server-side speculation never accepted a draft"
    );
    // The lookup's chain alone, what a client that handed off asks for: the same answer, in
    // fewer rounds where the answer copies its prompt.
    let (looked_up, _) = server_generated(
        &remote,
        &ids,
        params.clone(),
        ServerDrafting::Lookup { max_tokens: 6 },
    )
    .await
    .unwrap();
    assert_eq!(looked_up, reference.token_ids, "server-side lookup");
    let copying =
        chat_ids("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.");
    let copied = generate(&remote, &copying, params.clone(), None).await;
    let (looked_up, lookup_rounds) = server_generated(
        &remote,
        &copying,
        params.clone(),
        ServerDrafting::Lookup { max_tokens: 6 },
    )
    .await
    .unwrap();
    assert_eq!(looked_up, copied.token_ids, "server-side lookup, copying");
    assert!(
        lookup_rounds < copied.token_ids.len(),
        "the lookup's chain was never accepted: {lookup_rounds} rounds"
    );
    // Sampled, seeded: plain decoding draws each token from the seed and the position, so it
    // is reproducible. Speculative sampling keeps the distribution but not the sample: the
    // adaptive tree follows the engine's measured costs (the load), and another tree consumes
    // the draws differently; it must still finish its answer.
    let sampled = SamplingParams {
        mode: VerifyMode::Stochastic,
        temperature: 0.8,
        seed: 7,
        ..params
    };
    let a = server_generated(&remote, &ids, sampled.clone(), ServerDrafting::Plain)
        .await
        .unwrap();
    let b = server_generated(&remote, &ids, sampled.clone(), ServerDrafting::Plain)
        .await
        .unwrap();
    assert_eq!(a, b, "seeded server-side sampling is reproducible");
    let (drafted, _) = server_generated(&remote, &ids, sampled, ServerDrafting::Speculative)
        .await
        .unwrap();
    assert_eq!(
        drafted.len(),
        48,
        "sampled server-side speculation ends its answer"
    );
    server.shutdown().await;

    // A verifier without a draft model of its own says so.
    let (server, remote) = start_verifier(EngineConfig::default());
    match server_generated(
        &remote,
        &ids,
        SamplingParams::greedy(8),
        ServerDrafting::Speculative,
    )
    .await
    {
        Err(specinfer_net::RemoteError::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::Unsupported);
            assert!(e.message.contains("--ssm"), "{}", e.message);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_over_quic_is_reproducible() {
    let (server, remote) = start_verifier(EngineConfig::default());
    let ids = chat_ids("Tell me a short story about a fox.");
    let params = |seed| SamplingParams {
        mode: VerifyMode::Stochastic,
        temperature: 0.9,
        top_p: 0.95,
        top_k: 0,
        seed,
        max_new_tokens: 32,
        stop_ids: Vec::new(),
        return_features: false,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
    };
    let mode = DraftMode::Sample {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 8,
        draw: DrawMode::Iid,
    };
    let a = generate(&remote, &ids, params(7), Some((vec![2, 2, 1], mode, 11))).await;
    let b = generate(&remote, &ids, params(7), Some((vec![2, 2, 1], mode, 11))).await;
    let c = generate(&remote, &ids, params(8), Some((vec![2, 2, 1], mode, 12))).await;
    assert_eq!(a.token_ids, b.token_ids, "same seeds, different output");
    assert_ne!(
        a.token_ids, c.token_ids,
        "different seeds gave the same 32 sampled tokens"
    );
    println!("sampled: tau {:.2}", 32.0 / a.stats.rounds as f64);
    server.shutdown().await;
}

/// The client's context lookup over QUIC: alone (root-only trees) and beside a draft tree, greedy
/// output stays the LLM's own, and sampled sessions accept its point-mass chains (a sampled tree
/// without proposals would be refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_lookup_keeps_greedy_output_and_is_accepted_when_sampling() {
    let (server, remote) = start_verifier(EngineConfig::default());
    let ids = chat_ids("Repeat the sentence 'The cat sat on the mat.' five times.");
    let greedy = SamplingParams::greedy(48);
    let reference = generate(&remote, &ids, greedy.clone(), None).await;
    let sampled = SamplingParams {
        mode: VerifyMode::Stochastic,
        temperature: 0.5,
        top_p: 1.0,
        top_k: 0,
        seed: 5,
        max_new_tokens: 48,
        stop_ids: Vec::new(),
        return_features: false,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
    };
    let sample_draft = DraftMode::Sample {
        temperature: 0.5,
        top_p: 1.0,
        top_k: 8,
        draw: DrawMode::Iid,
    };
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let lookup = Some(ContextLookup::default());
    for (params, mode) in [(greedy, DraftMode::Greedy), (sampled, sample_draft)] {
        let alone = generate_on(&mut client, &ids, params.clone(), None, lookup).await;
        let tree = Some((vec![1, 2, 1], mode, 9));
        let with_tree = generate_on(&mut client, &ids, params.clone(), tree, lookup).await;
        for (what, g) in [("lookup alone", &alone), ("lookup and tree", &with_tree)] {
            println!(
                "{:?} {what}: {} rounds, {} tokens from the lookup",
                params.mode, g.stats.rounds, g.stats.lookup_accepted
            );
            assert_eq!(g.token_ids.len(), 48);
            if params.mode == VerifyMode::Greedy {
                assert_eq!(
                    g.token_ids, reference.token_ids,
                    "{what} changed the output"
                );
            }
        }
        assert!(
            alone.stats.lookup_accepted > 0 && alone.stats.rounds < 48,
            "{:?}: the lookup alone never got a token accepted on an answer that repeats a sentence",
            params.mode
        );
    }
    client.shutdown().await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_sessions_each_equal_their_solo_run() {
    let (server, remote) = start_verifier(EngineConfig::default());
    let prompts = [
        "Name a fruit.",
        "Name a colour.",
        "Say hello.",
        "Count to three.",
        "Name a planet.",
        "Name a river.",
        "What is 2+2?",
        "Name a metal.",
        "Name a bird.",
        "Say goodbye.",
        "Name a tree.",
        "Name a city.",
        "Name a sport.",
        "Name a tool.",
        "Name a dance.",
        "Name a gem.",
    ];
    let params = |i: usize| {
        if i.is_multiple_of(2) {
            SamplingParams::greedy(12)
        } else {
            SamplingParams {
                mode: VerifyMode::Stochastic,
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: i as u64,
                max_new_tokens: 12,
                stop_ids: Vec::new(),
                return_features: false,
                repeat_penalty: 1.0,
                repeat_last_n: 0,
            }
        }
    };
    let mut solo = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        solo.push(
            generate(&remote, &chat_ids(p), params(i), None)
                .await
                .token_ids,
        );
    }
    let batches_before = server.metrics().batch_size.count_above(1.0);
    let tasks: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let remote = remote.clone();
            let ids = chat_ids(p);
            tokio::spawn(async move { generate(&remote, &ids, params(i), None).await.token_ids })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(
            t.await.unwrap(),
            solo[i],
            "session {i} differs when batched with others"
        );
    }
    let shared = server.metrics().batch_size.count_above(1.0) - batches_before;
    println!("{shared} forwards carried more than one session");
    assert!(
        shared > 0,
        "concurrent sessions were never batched together"
    );
    server.shutdown().await;
}

/// A raw connection that has said hello with the given key and fingerprint.
async fn raw_connect(
    remote: &RemoteConfig,
    api_key: &str,
    fingerprint: ModelFingerprint,
) -> (quinn::Endpoint, quinn::Connection, Message) {
    raw_hello(remote, "127.0.0.1:0", api_key, fingerprint).await
}

async fn exchange(conn: &quinn::Connection, bytes: &[u8]) -> Message {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(bytes).await.unwrap();
    let (reply, _) = tokio::time::timeout(
        Duration::from_secs(30),
        read_frame(&mut recv, &Limits::default()),
    )
    .await
    .expect("the verifier must answer, not stall")
    .unwrap()
    .expect("an error frame, not silence");
    reply
}

fn code(m: &Message) -> ErrorCode {
    match m {
        Message::Error(e) => e.code,
        other => panic!("expected an error frame, got {other:?}"),
    }
}

fn open_frame(session: u64, prompt: Vec<u32>) -> Vec<u8> {
    encode_frame(&Message::OpenSession(OpenSession {
        session,
        prompt,
        params: SamplingParams::greedy(8),
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_get_typed_errors_while_a_healthy_session_goes_on() {
    let engine = EngineConfig {
        max_sessions: 4,
        detach_grace: Duration::from_secs(1),
        ..EngineConfig::default()
    };
    let (server, remote) = start_verifier(engine);
    let (_, tok) = smollm2();
    let healthy_ids = chat_ids("Name three animals.");
    let reference = generate(&remote, &healthy_ids, SamplingParams::greedy(48), None)
        .await
        .token_ids;
    let healthy = {
        let remote = remote.clone();
        let ids = healthy_ids.clone();
        tokio::spawn(async move {
            generate(&remote, &ids, SamplingParams::greedy(48), None)
                .await
                .token_ids
        })
    };

    let (_ep, conn, hello) = raw_connect(&remote, API_KEY, tok.fingerprint()).await;
    assert!(matches!(hello, Message::ServerHello(_)), "{hello:?}");
    // The native protocol offers no unidirectional streams and no datagrams to buffer on.
    assert!(conn.max_datagram_size().is_none(), "datagrams are off");
    let uni = tokio::time::timeout(Duration::from_millis(300), conn.open_uni()).await;
    assert!(uni.is_err(), "a unidirectional stream was granted");

    // Before any hello, a frame announcing 1 MiB: refused from its length prefix alone (a
    // connection that has not authenticated gets a hello's worth of buffer, not 4 MiB).
    {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(client_config(&remote.trust).unwrap());
        let stranger = endpoint
            .connect(remote.addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        let mut first = (1u32 << 20).to_le_bytes().to_vec();
        first.extend([0u8; 64]);
        let reply = exchange(&stranger, &first).await;
        assert_eq!(code(&reply), ErrorCode::LimitExceeded, "{reply:?}");
    }

    // Random bytes after the version, in a frame of plausible size.
    let mut junk = 42u32.to_le_bytes().to_vec();
    junk.extend(PROTOCOL_VERSION.to_le_bytes());
    junk.extend((0..40u8).map(|i| i.wrapping_mul(97).wrapping_add(13)));
    assert_eq!(code(&exchange(&conn, &junk).await), ErrorCode::BadFrame);
    // A length prefix far over the limit: refused before any allocation.
    assert_eq!(
        code(&exchange(&conn, &u32::MAX.to_le_bytes()).await),
        ErrorCode::LimitExceeded
    );
    // A tree over the node limit.
    let big = TokenTree::chain(&vec![5u32; 300]);
    let frame = encode_frame(&Message::Verify(Verify {
        session: 1,
        round: 0,
        tree: big,
    }));
    let reply = exchange(&conn, &frame).await;
    assert_eq!(code(&reply), ErrorCode::LimitExceeded);
    assert!(format!("{reply:?}").contains("limit is 256"), "{reply:?}");
    // A proposal that does not sum to 1 (built past the constructor's checks).
    let tree: TokenTree = serde_json::from_value(serde_json::json!({
        "tokens": [3, 4], "parents": [0],
        "proposals": {"mode": "Iid", "dists": [{"node": 0, "ids": [4, 5], "probs": [0.5, 0.9]}], "drawn_from": [0]}
    }))
    .unwrap();
    let frame = encode_frame(&Message::Verify(Verify {
        session: 1,
        round: 0,
        tree,
    }));
    let reply = exchange(&conn, &frame).await;
    assert_eq!(code(&reply), ErrorCode::BadFrame);
    assert!(format!("{reply:?}").contains("sum"), "{reply:?}");
    // A token id outside the vocabulary, on an open session.
    {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&open_frame(9, vec![1, 2, 3])).await.unwrap();
        let (opened, _) = read_frame(&mut recv, &Limits::default())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(opened, Message::SessionOpened(_)), "{opened:?}");
        let tree = TokenTree::new(vec![3, 60_000], vec![0]).unwrap();
        write_frame(
            &mut send,
            &Message::Verify(Verify {
                session: 9,
                round: 0,
                tree,
            }),
        )
        .await
        .unwrap();
        let (reply, _) = read_frame(&mut recv, &Limits::default())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(code(&reply), ErrorCode::BadFrame);
        assert!(format!("{reply:?}").contains("vocabulary"), "{reply:?}");
    }
    // Wrong API key, mismatched tokenizer.
    let (_e1, _c1, refused) = raw_connect(&remote, "not-a-key", tok.fingerprint()).await;
    assert_eq!(code(&refused), ErrorCode::Unauthorized);
    let mut other = tok.fingerprint();
    other.tokenizer_sha256[0] ^= 1;
    let (_e2, _c2, refused) = raw_connect(&remote, API_KEY, other).await;
    assert_eq!(code(&refused), ErrorCode::ModelMismatch);
    assert!(
        format!("{refused:?}").contains("verifier's model is"),
        "{refused:?}"
    );

    // A client that vanishes mid-round: its sessions are released after the grace period.
    {
        let (_ep, conn2, _) = raw_connect(&remote, API_KEY, tok.fingerprint()).await;
        let (mut send, mut recv) = conn2.open_bi().await.unwrap();
        send.write_all(&open_frame(1, vec![1, 2, 3])).await.unwrap();
        let (opened, _) = read_frame(&mut recv, &Limits::default())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(opened, Message::SessionOpened(_)), "{opened:?}");
        let tree = TokenTree::new(vec![3, 4, 5], vec![0, 1]).unwrap();
        send.write_all(&encode_frame(&Message::Verify(Verify {
            session: 1,
            round: 0,
            tree,
        })))
        .await
        .unwrap();
        conn2.close(0u32.into(), b"vanish");
    }
    // More sessions than allowed (4, one of them the healthy session): the extra one is told to retry.
    let mut held = Vec::new();
    let mut busy = None;
    for s in 0..5u64 {
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&open_frame(100 + s, vec![1, 2, 3]))
            .await
            .unwrap();
        let (reply, _) = read_frame(&mut recv, &Limits::default())
            .await
            .unwrap()
            .unwrap();
        match reply {
            Message::SessionOpened(_) => held.push((send, recv)),
            Message::Error(e) => {
                busy = Some(e);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let busy = busy.expect("the session limit was never reached");
    assert_eq!(busy.code, ErrorCode::Busy);
    assert!(busy.retry_after_ms.is_some());

    drop(held);
    assert_eq!(
        healthy.await.unwrap(),
        reference,
        "the healthy session's output changed"
    );
    conn.close(0u32.into(), b"done");
    let metrics = server.metrics().clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metrics
        .sessions_active
        .load(std::sync::atomic::Ordering::Relaxed)
        > 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sessions of vanished clients were never released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(metrics.errors(ErrorCode::BadFrame) >= 3);
    assert!(metrics.errors(ErrorCode::LimitExceeded) >= 2);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_survives_a_dropped_connection_and_resumes() {
    let (server, remote) = start_verifier(EngineConfig::default());
    let ids = chat_ids("Name two oceans.");
    let reference = generate(&remote, &ids, SamplingParams::greedy(12), None)
        .await
        .token_ids;

    let first = specinfer_net::Remote::connect(&remote).await.unwrap();
    let mut s = first
        .open(5, ids.clone(), SamplingParams::greedy(12))
        .await
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..4 {
        let root = *out.last().unwrap_or(ids.last().unwrap());
        out.extend(s.verify(TokenTree::root(root)).await.unwrap().tokens);
    }
    let token = s.resume_token();
    drop(s);
    drop(first); // the connection goes away without a Close

    let second = specinfer_net::Remote::connect(&remote).await.unwrap();
    // The verifier notices the lost connection asynchronously; until then the session is still
    // attached and cannot be taken over.
    let mut tries = 0;
    let (mut s, committed) = loop {
        match second.resume(5, token).await {
            Ok(r) => break r,
            Err(e) if e.code() == Some(ErrorCode::UnknownSession) && tries < 50 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("resume failed: {e}"),
        }
    };
    assert_eq!(committed[..ids.len()], ids[..]);
    assert_eq!(
        committed[ids.len()..],
        out[..],
        "the verifier kept exactly the committed tokens"
    );
    loop {
        let v = s
            .verify(TokenTree::root(*out.last().unwrap()))
            .await
            .unwrap();
        out.extend(v.tokens);
        if v.finish.is_some() {
            break;
        }
    }
    assert_eq!(out, reference, "resuming changed the output");
    // A wrong token resumes nothing.
    let err = second
        .resume(6, [7; 16])
        .await
        .err()
        .expect("an unknown token must be refused");
    assert_eq!(err.code(), Some(ErrorCode::UnknownSession));
    s.close().await.unwrap();
    second.shutdown().await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_key_that_opened_a_session_can_resume_it() {
    let (server, remote) = start_verifier_with(EngineConfig::default(), None, &["another-key"]);
    let ids = chat_ids("Name two oceans.");
    let owner = specinfer_net::Remote::connect(&remote).await.unwrap();
    let mut s = owner
        .open(5, ids.clone(), SamplingParams::greedy(12))
        .await
        .unwrap();
    s.verify(TokenTree::root(*ids.last().unwrap()))
        .await
        .unwrap();
    let token = s.resume_token();
    drop(s);
    drop(owner);
    // Time for the verifier to see the connection go and detach the session.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let other = RemoteConfig {
        api_key: Some("another-key".into()),
        ..remote.clone()
    };
    let thief = specinfer_net::Remote::connect(&other).await.unwrap();
    let err = thief
        .resume(5, token)
        .await
        .err()
        .expect("another key must not take the session over");
    assert_eq!(err.code(), Some(ErrorCode::UnknownSession));
    thief.shutdown().await;
    // The session was there to take: its own key resumes it at once.
    let again = specinfer_net::Remote::connect(&remote).await.unwrap();
    let (s, committed) = again.resume(5, token).await.unwrap();
    assert_eq!(committed[..ids.len()], ids[..]);
    s.close().await.unwrap();
    again.shutdown().await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_reconnects_after_its_network_dies_without_losing_text() {
    let (server, direct, ids, params, reference) =
        greedy_reference("Name three rivers in Europe.", 40).await;
    let (llm, _) = smollm2();

    let relay = UdpRelay::start(direct.addr).await.unwrap();
    let remote = RemoteConfig {
        addr: relay.addr,
        // Short, so the dead path is noticed within the test's patience.
        idle_timeout: Duration::from_millis(800),
        ..direct.clone()
    };
    let mut client = Client::connect(remote).await.unwrap();
    let drafter = Drafter {
        speculator: Speculator::new(vec![1, 2, 1], DraftMode::Greedy, 3),
        drafts: vec![Box::new(NoisyDraft::new(llm, 3, 2.0))],
    };
    let mut driver = RoundDriver::new(ids.clone(), params, Some(drafter))
        .unwrap()
        .with_pipelining(true);
    let mut streamed = Vec::new();
    let mut cut = false;
    let g = client
        .generate(&mut driver, |out| {
            streamed.extend_from_slice(&out.tokens);
            // After the second round the network goes away mid-generation.
            if streamed.len() >= 2 && !cut {
                relay.cut_existing();
                cut = true;
            }
        })
        .await
        .unwrap();
    assert_eq!(g.reconnects, 1, "the cut must have been noticed, once");
    assert_eq!(g.token_ids, reference, "reconnecting changed the output");
    assert_eq!(
        streamed, reference,
        "text was lost or repeated in the stream"
    );
    assert!(g.stats.pipelined_rounds > 0, "no round was drafted ahead");
    client.shutdown().await;
    server.shutdown().await;
}

/// A split that costs more per token than the verifier's own decoding (here a 120 ms round trip
/// through a real UDP relay around ~10 ms forwards) hands the rest of the answer to the
/// verifier: the output stays the incremental one, the last rounds are the verifier's streamed
/// steps, and far fewer round trips are paid than without the hand-off. A later session is
/// told as it opens what the split costs, and sends no tree at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_that_does_not_pay_hands_the_answer_to_the_verifier_losslessly() {
    let (server, direct, ids, params, reference) =
        greedy_reference("Describe a lighthouse at night.", 48).await;
    let (llm, _) = smollm2();
    let relay = specinfer_net::UdpRelay::with_path(
        direct.addr,
        specinfer_net::RelayConfig::round_trip(Duration::from_millis(120)),
    )
    .await
    .unwrap();
    let remote = RemoteConfig {
        addr: relay.addr,
        ..direct.clone()
    };
    let mut client = Client::connect(remote).await.unwrap();
    let run = |hand_off: bool| {
        let drafter = Drafter {
            speculator: Speculator::new(vec![1, 1], DraftMode::Greedy, 5),
            drafts: vec![Box::new(NoisyDraft::new(llm, 5, 2.0))],
        };
        RoundDriver::new(ids.clone(), params.clone(), Some(drafter))
            .unwrap()
            .with_hand_off(hand_off)
    };
    let mut streamed = Vec::new();
    let mut handing_off = run(true);
    let g = client
        .generate(&mut handing_off, |out| {
            streamed.extend_from_slice(&out.tokens)
        })
        .await
        .unwrap();
    assert_eq!(g.token_ids, reference, "the hand-off changed the output");
    assert_eq!(
        streamed, reference,
        "text was lost or repeated in the stream"
    );
    assert!(
        g.stats.server_rounds > 0,
        "the verifier never took over: {:?}",
        g.stats
    );
    let split_rounds = g.stats.rounds - g.stats.server_rounds;
    let mut kept = run(false);
    let all_split = client.generate(&mut kept, |_| {}).await.unwrap();
    assert_eq!(all_split.token_ids, reference);
    assert_eq!(all_split.stats.server_rounds, 0);
    assert!(
        split_rounds < all_split.stats.rounds,
        "{split_rounds} split rounds with the hand-off, {} without",
        all_split.stats.rounds
    );
    // The verifier now knows what its split rounds cost and tells the next session as it
    // opens: that answer hands off before sending a single tree.
    let (mut told, mut streamed) = (run(true), Vec::new());
    let g = client
        .generate(&mut told, |out| streamed.extend_from_slice(&out.tokens))
        .await
        .unwrap();
    assert_eq!((&g.token_ids, &streamed), (&reference, &reference));
    assert_eq!(
        g.stats.server_rounds, g.stats.rounds,
        "trees were sent although the verifier said the split does not pay: {:?}",
        g.stats
    );
    client.shutdown().await;
    server.shutdown().await;
}
