//! Attacks on a verifier over loopback QUIC, one after another, each beside a healthy session:
//! every attacker is refused or capped, and the healthy session keeps its output and its time
//! per round within 2x of its time alone, measured just before in the same run (a ratio, so it
//! holds on any machine that runs both the same way).
//!
//! The attacks are those of the verifier's security review: a connection flood from one address,
//! bytes on streams before any hello, a huge first frame, connections that never finish a frame
//! (before and after the hello), a key opening every session it can, a key flooding the engine
//! with the largest trees, malformed and oversized frames, guessed and stolen resume tokens, a
//! session asking for more KV than exists, and failing requests meant to keep a session alive.
//! Each is bounded in count and time. This file holds one test, so no other test of this binary
//! shares the machine with its timings.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use specinfer_integration::{chat_ids, raw_connection, service_config, smollm2, API_KEY};
use specinfer_net::{read_frame, write_frame, Remote, RemoteConfig, RemoteError, FRAME_DEADLINE};
use specinfer_verifier::engine::{key_id, EngineConfig};
use specinfer_verifier::metrics::Metrics;
use specinfer_verifier::service::{self, ConnectionLimits, RunningVerifier, ServiceConfig};
use specinfer_wire::*;

const ATTACKER_KEY: &str = "attacker";
/// The attacker's own source address (all of 127/8 is loopback), so per-address caps fall on
/// it and not on the healthy client at 127.0.0.1.
const ATTACKER_BIND: &str = "127.0.0.2:0";
const PER_ADDRESS: usize = 8;
/// Open connections beyond which new ones must first prove their address (a QUIC Retry).
const RETRY_ABOVE: usize = 8;
const SESSIONS_PER_KEY: usize = 4;
/// Tokens a key may have the LLM run each second.
const KEY_RATE: f64 = 128.0;
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
const HEALTHY_TOKENS: u32 = 128;
/// The largest tree the flood sends.
const FLOOD_TREE: usize = 64;

fn start() -> (RunningVerifier, RemoteConfig) {
    let (model, _) = smollm2();
    let cfg = ServiceConfig {
        api_keys: key_id(Some(ATTACKER_KEY)).map(|k| [k].into_iter().collect()),
        hello_timeout: HELLO_TIMEOUT,
        connections: ConnectionLimits {
            per_address: PER_ADDRESS,
            retry_above: RETRY_ABOVE,
            ..Default::default()
        },
        ..service_config(EngineConfig {
            max_sessions_per_key: SESSIONS_PER_KEY,
            key_tokens_per_s: KEY_RATE,
            idle_timeout: IDLE_TIMEOUT,
            ..EngineConfig::default()
        })
    };
    service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap()
}

/// One healthy answer: plain greedy decoding, a round per token, on its own connection.
struct Healthy {
    tokens: Vec<u32>,
    per_round: Duration,
}

async fn healthy_answer(remote: &RemoteConfig, session: u64) -> Healthy {
    let conn = Remote::connect(remote).await.unwrap();
    let prompt = chat_ids("Name three animals.");
    let mut s = conn
        .open(
            session,
            prompt.clone(),
            SamplingParams::greedy(HEALTHY_TOKENS),
        )
        .await
        .unwrap();
    let mut root = *prompt.last().unwrap();
    let (mut tokens, mut rounds) = (Vec::new(), 0u32);
    let started = Instant::now();
    loop {
        let v = s.verify(TokenTree::chain(&[root])).await.unwrap();
        rounds += 1;
        tokens.extend(&v.tokens);
        root = *v.tokens.last().unwrap();
        if v.finish.is_some() {
            break;
        }
    }
    let per_round = started.elapsed() / rounds;
    s.close().await.unwrap();
    conn.shutdown().await;
    Healthy { tokens, per_round }
}

/// A raw QUIC connection from the attacker's address, before any hello.
async fn raw(remote: &RemoteConfig) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    raw_connection(remote, ATTACKER_BIND).await
}

/// A raw connection that has said hello with the attacker's key.
async fn raw_hello(remote: &RemoteConfig) -> (quinn::Endpoint, quinn::Connection) {
    let (endpoint, conn, reply) = specinfer_integration::raw_hello(
        remote,
        ATTACKER_BIND,
        ATTACKER_KEY,
        remote.expected_model.clone(),
    )
    .await;
    assert!(matches!(reply, Message::ServerHello(_)), "{reply:?}");
    (endpoint, conn)
}

/// Sends `bytes` on a fresh stream and returns the one frame that comes back.
async fn exchange(conn: &quinn::Connection, bytes: &[u8]) -> Option<Message> {
    let (mut send, mut recv) = conn.open_bi().await.ok()?;
    send.write_all(bytes).await.ok()?;
    let got = tokio::time::timeout(
        Duration::from_secs(10),
        read_frame(&mut recv, &Limits::default()),
    )
    .await
    .expect("the verifier must answer, not stall");
    got.ok().flatten().map(|(m, _)| m)
}

fn code(m: &Option<Message>) -> Option<ErrorCode> {
    match m {
        Some(Message::Error(e)) => Some(e.code),
        _ => None,
    }
}

fn attacker(remote: &RemoteConfig) -> RemoteConfig {
    RemoteConfig {
        api_key: Some(ATTACKER_KEY.into()),
        ..remote.clone()
    }
}

/// Waits until the healthy measurement is over.
async fn until(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type Attack = fn(RemoteConfig, Arc<AtomicBool>, Arc<Metrics>) -> tokio::task::JoinHandle<String>;

/// The attacks, each returning what shows it was refused or capped (after asserting it).
fn attacks() -> Vec<(&'static str, Attack)> {
    vec![
        ("connection flood from one address", |remote, stop, _| {
            tokio::spawn(async move {
                let mut held = Vec::new();
                let mut refused = 0;
                for _ in 0..64 {
                    match raw(&remote).await {
                        Ok(c) => held.push(c),
                        Err(_) => refused += 1,
                    }
                }
                assert!(held.len() <= PER_ADDRESS, "{} admitted", held.len());
                assert!(refused >= 64 - PER_ADDRESS);
                until(&stop).await;
                for (_, c) in &held {
                    c.close(0u32.into(), b"");
                }
                format!(
                    "{} of 64 connections admitted, {refused} refused",
                    held.len()
                )
            })
        }),
        (
            "a connection flood from many addresses",
            |remote, stop, metrics| {
                tokio::spawn(async move {
                    // Eight addresses of their own, each within its per-address share: past the
                    // first few open connections every new one must answer a Retry first, so a
                    // spoofed address cannot hold a connection at all.
                    let before = metrics.connections_retried.load(Ordering::Relaxed);
                    let mut held = Vec::new();
                    for host in 3..11u8 {
                        for _ in 0..PER_ADDRESS {
                            let bind = format!("127.0.0.{host}:0");
                            if let Ok(c) = raw_connection(&remote, &bind).await {
                                held.push(c);
                            }
                        }
                    }
                    let retried = metrics.connections_retried.load(Ordering::Relaxed) - before;
                    assert!(
                        retried as usize >= held.len() - RETRY_ABOVE,
                        "{retried} Retries for {} connections",
                        held.len()
                    );
                    until(&stop).await;
                    for (_, c) in &held {
                        c.close(0u32.into(), b"");
                    }
                    format!(
                    "{} connections from 8 addresses, {retried} of them made to answer a Retry first",
                    held.len()
                )
                })
            },
        ),
        (
            "bytes on many streams before the hello",
            |remote, stop, _| {
                tokio::spawn(async move {
                    let (_ep, conn) = raw(&remote).await.unwrap();
                    let opened = Instant::now();
                    let chunk = vec![0u8; 64 << 10];
                    let mut written = 0usize;
                    let mut streams = Vec::new();
                    for _ in 0..16 {
                        // Streams beyond what the verifier grants before a hello never open.
                        match tokio::time::timeout(Duration::from_millis(200), conn.open_bi()).await
                        {
                            Ok(Ok(s)) => streams.push(s),
                            _ => break,
                        }
                    }
                    // Each stream is offered 2 MiB; flow control takes what the verifier buffers.
                    'fill: for (send, _) in &mut streams {
                        for _ in 0..32 {
                            match tokio::time::timeout(
                                Duration::from_millis(50),
                                send.write(&chunk),
                            )
                            .await
                            {
                                Ok(Ok(n)) => written += n,
                                _ => continue 'fill,
                            }
                        }
                    }
                    assert!(
                        written <= 9 << 20,
                        "{written} bytes buffered before a hello"
                    );
                    let closed = tokio::time::timeout(HELLO_TIMEOUT * 3, conn.closed()).await;
                    assert!(closed.is_ok(), "a connection without a hello stayed open");
                    until(&stop).await;
                    format!(
                        "{:.1} MiB of 32 MiB taken before the hello, closed after {:.1} s",
                        written as f64 / (1 << 20) as f64,
                        opened.elapsed().as_secs_f64()
                    )
                })
            },
        ),
        ("a 4 MiB first frame, again and again", |remote, stop, _| {
            tokio::spawn(async move {
                let mut refused = 0;
                for _ in 0..6 {
                    let (_ep, conn) = raw(&remote).await.unwrap();
                    let mut first = (4u32 << 20).to_le_bytes().to_vec();
                    first.extend([0u8; 256]);
                    let reply = exchange(&conn, &first).await;
                    assert_eq!(code(&reply), Some(ErrorCode::LimitExceeded), "{reply:?}");
                    refused += 1;
                    conn.close(0u32.into(), b"");
                }
                until(&stop).await;
                format!("{refused} of 6 refused from their length prefix")
            })
        }),
        (
            "frames that never finish, before and after the hello",
            |remote, stop, _| {
                tokio::spawn(async move {
                    let started = Instant::now();
                    // Before: a hello announced and never sent whole.
                    let (_ep, before) = raw(&remote).await.unwrap();
                    let (mut send, _recv) = before.open_bi().await.unwrap();
                    send.write_all(&200u32.to_le_bytes()).await.unwrap();
                    send.write_all(&[1; 10]).await.unwrap();
                    // After: a session stream whose frame stops after its first bytes.
                    let (_ep2, after) = raw_hello(&remote).await;
                    let (mut send2, mut recv2) = after.open_bi().await.unwrap();
                    send2.write_all(&100u32.to_le_bytes()).await.unwrap();
                    send2.write_all(&[1; 10]).await.unwrap();
                    let cut = tokio::time::timeout(HELLO_TIMEOUT * 3, before.closed()).await;
                    assert!(cut.is_ok(), "a connection with half a hello stayed open");
                    let before_s = started.elapsed().as_secs_f64();
                    let bound = FRAME_DEADLINE + Duration::from_secs(3);
                    let mut sink = [0u8; 64];
                    let ended = tokio::time::timeout(bound, recv2.read(&mut sink)).await;
                    assert!(ended.is_ok(), "a half-sent frame held its stream open");
                    until(&stop).await;
                    format!(
                        "half a hello cut after {before_s:.1} s, half a frame after {:.1} s",
                        started.elapsed().as_secs_f64()
                    )
                })
            },
        ),
        ("one key opening every session it can", |remote, stop, _| {
            tokio::spawn(async move {
                let conn = Remote::connect(&attacker(&remote)).await.unwrap();
                let prompt = chat_ids("Hi");
                let mut opened = Vec::new();
                let mut refusals = 0;
                for id in 1..=12 {
                    match conn
                        .open(id, prompt.clone(), SamplingParams::greedy(16))
                        .await
                    {
                        Ok(s) => opened.push(s),
                        Err(e) => {
                            assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");
                            assert!(e.to_string().contains("quota"), "{e}");
                            refusals += 1;
                        }
                    }
                }
                assert_eq!(opened.len(), SESSIONS_PER_KEY);
                until(&stop).await;
                let count = opened.len();
                for s in opened {
                    s.close().await.unwrap();
                }
                format!("{count} sessions opened, {refusals} refused by the key's quota")
            })
        }),
        (
            "one key flooding the engine with the largest trees",
            |remote, stop, _| {
                tokio::spawn(async move {
                    let conn = Remote::connect(&attacker(&remote)).await.unwrap();
                    let prompt = chat_ids("Write a long story.");
                    let started = Instant::now();
                    let mut flood = Vec::new();
                    for id in 1..=SESSIONS_PER_KEY as u64 {
                        let mut s = conn
                            .open(id, prompt.clone(), SamplingParams::greedy(4096))
                            .await
                            .unwrap();
                        let stop = stop.clone();
                        let mut root = *prompt.last().unwrap();
                        flood.push(tokio::spawn(async move {
                            let mut nodes = 0;
                            while !stop.load(Ordering::Relaxed) {
                                match s.verify(TokenTree::chain(&[root; FLOOD_TREE])).await {
                                    Ok(v) if v.finish.is_none() => {
                                        nodes += FLOOD_TREE;
                                        root = *v.tokens.last().unwrap();
                                    }
                                    _ => break,
                                }
                            }
                            let _ = s.close().await;
                            nodes
                        }));
                    }
                    // Tree nodes only: prompt tokens are charged too (fewer where a cached prefix
                    // spares their prefill), which only leaves the trees less of the quota.
                    let mut nodes = 0;
                    for f in flood {
                        nodes += f.await.unwrap();
                    }
                    let secs = started.elapsed().as_secs_f64();
                    // Its rate, plus the bucket it started with (a second of the rate, at least
                    // one largest tree), plus the one tree a key may run into debt by; 5% for the
                    // clocks (this one starts before the first charge and stops after the last).
                    let allowed = (KEY_RATE * secs + 256.0 + FLOOD_TREE as f64) * 1.05;
                    assert!(
                        nodes as f64 <= allowed,
                        "{nodes} tokens in {secs:.1} s at a rate of {KEY_RATE}/s"
                    );
                    format!(
                        "{nodes} tokens run for it in {secs:.1} s, its quota allowing {:.0} \
                     ({KEY_RATE:.0}/s and a {:.0}-token bucket)",
                        allowed / 1.05,
                        256.0 + FLOOD_TREE as f64
                    )
                })
            },
        ),
        ("malformed and oversized frames", |remote, stop, _| {
            tokio::spawn(async move {
                let (_ep, conn) = raw_hello(&remote).await;
                let too_many_proposals: TokenTree = serde_json::from_value(serde_json::json!({
                    "tokens": [3, 4], "parents": [0],
                    "proposals": {"mode": "Iid",
                        "dists": (0..64).map(|_| serde_json::json!(
                            {"node": 0, "ids": [4, 5], "probs": [0.5, 0.5]})).collect::<Vec<_>>(),
                        "drawn_from": [0]}
                }))
                .unwrap();
                let frames: Vec<Vec<u8>> = vec![
                    u32::MAX.to_le_bytes().to_vec(),
                    {
                        let mut junk = 42u32.to_le_bytes().to_vec();
                        junk.extend(PROTOCOL_VERSION.to_le_bytes());
                        junk.extend((0..40u8).map(|i| i.wrapping_mul(97)));
                        junk
                    },
                    encode_frame(&Message::Verify(Verify {
                        session: 1,
                        round: 0,
                        tree: TokenTree::chain(&[5u32; 300]),
                    })),
                    encode_frame(&Message::Verify(Verify {
                        session: 1,
                        round: 0,
                        tree: too_many_proposals,
                    })),
                ];
                let mut refused = 0;
                while !stop.load(Ordering::Relaxed) || refused < frames.len() {
                    let frame = &frames[refused % frames.len()];
                    let reply = exchange(&conn, frame).await;
                    let c = code(&reply);
                    assert!(
                        matches!(c, Some(ErrorCode::BadFrame | ErrorCode::LimitExceeded)),
                        "{reply:?}"
                    );
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                format!("{refused} bad frames, each answered with a typed error")
            })
        }),
        ("guessed and stolen resume tokens", |remote, stop, _| {
            tokio::spawn(async move {
                // A victim of the healthy key loses its connection: its session waits, detached.
                let victim = Remote::connect(&remote).await.unwrap();
                let s = victim
                    .open(77, chat_ids("Tell me a secret."), SamplingParams::greedy(8))
                    .await
                    .unwrap();
                let stolen = s.resume_token();
                drop(s);
                victim.shutdown().await;
                let conn = Remote::connect(&attacker(&remote)).await.unwrap();
                let mut refused = 0;
                let mut guess = [0u8; 16];
                for i in 0..200u32 {
                    guess[..4].copy_from_slice(&i.to_le_bytes());
                    let token = if i % 50 == 0 { stolen } else { guess };
                    match conn.resume(77, token).await {
                        Err(e) => {
                            assert_eq!(e.code(), Some(ErrorCode::UnknownSession), "{e}");
                            refused += 1;
                        }
                        Ok(_) => panic!("the attacker resumed another key's session"),
                    }
                }
                // The owner still can.
                let owner = Remote::connect(&remote).await.unwrap();
                owner.resume(77, stolen).await.unwrap();
                until(&stop).await;
                format!(
                    "{refused} of 200 resumes refused (4 with the stolen token); the owner resumed"
                )
            })
        }),
        (
            "a session asking for more KV than exists",
            |remote, stop, _| {
                tokio::spawn(async move {
                    let conn = Remote::connect(&attacker(&remote)).await.unwrap();
                    let mut refused = 0;
                    // The longest answer the protocol allows after a long prompt: more KV than
                    // one session may hold (512 MiB), refused at admission before any prefill.
                    let prompt: Vec<u32> = (0..4000u32).map(|i| 100 + i % 1000).collect();
                    for id in 1..=20 {
                        let params = SamplingParams::greedy(Limits::default().max_new_tokens);
                        match conn.open(id, prompt.clone(), params).await {
                            Err(RemoteError::Refused(e)) => {
                                assert!(
                                    matches!(e.code, ErrorCode::LimitExceeded | ErrorCode::Busy),
                                    "{e:?}"
                                );
                                refused += 1;
                            }
                            other => {
                                panic!("a session that cannot fit was admitted: {:?}", other.err())
                            }
                        }
                    }
                    until(&stop).await;
                    format!("{refused} of 20 refused at admission")
                })
            },
        ),
        (
            "failing requests meant to keep a session alive",
            |remote, stop, _| {
                tokio::spawn(async move {
                    let (_ep, conn) = raw_hello(&remote).await;
                    let (mut send, mut recv) = conn.open_bi().await.unwrap();
                    let open = Message::OpenSession(OpenSession {
                        session: 5,
                        prompt: chat_ids("Hi"),
                        params: SamplingParams::greedy(16),
                    });
                    write_frame(&mut send, &open).await.unwrap();
                    let limits = Limits::default();
                    let (opened, _) = read_frame(&mut recv, &limits).await.unwrap().unwrap();
                    assert!(matches!(opened, Message::SessionOpened(_)), "{opened:?}");
                    // Rounds out of order, every 100 ms, for twice the idle timeout.
                    let started = Instant::now();
                    let mut failed = 0;
                    while started.elapsed() < IDLE_TIMEOUT * 2 {
                        let wrong = Message::Verify(Verify {
                            session: 5,
                            round: 9,
                            tree: TokenTree::chain(&[3]),
                        });
                        write_frame(&mut send, &wrong).await.unwrap();
                        let (reply, _) = read_frame(&mut recv, &limits).await.unwrap().unwrap();
                        assert_eq!(code(&Some(reply)), Some(ErrorCode::OutOfOrder));
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                    let right = Message::Verify(Verify {
                        session: 5,
                        round: 0,
                        tree: TokenTree::chain(&[3]),
                    });
                    write_frame(&mut send, &right).await.unwrap();
                    let (reply, _) = read_frame(&mut recv, &limits).await.unwrap().unwrap();
                    assert_eq!(
                        code(&Some(reply.clone())),
                        Some(ErrorCode::UnknownSession),
                        "failing requests kept the session: {reply:?}"
                    );
                    until(&stop).await;
                    format!("{failed} failing rounds; the session still expired when idle")
                })
            },
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attack_is_capped_and_a_healthy_session_beside_it_keeps_its_output_and_latency() {
    let (server, remote) = start();
    let reference = healthy_answer(&remote, 1000).await;
    let mut report = Vec::new();
    for (i, (name, attack)) in attacks().into_iter().enumerate() {
        // A shared VM has slow spells of seconds that fall on one measurement and not the
        // other: an attack whose healthy round is more than twice as slow is measured once
        // more, alone and beside a fresh run of it, and must stay within 2x on one of the two.
        // An attack that does slow the healthy session fails both.
        let mut ratios = Vec::new();
        for attempt in 0..2u64 {
            let seed = 10 * i as u64 + attempt;
            let alone = healthy_answer(&remote, 2000 + seed).await;
            let stop = Arc::new(AtomicBool::new(false));
            let attack = attack(remote.clone(), stop.clone(), server.metrics().clone());
            // Give the attack time to be in force before the healthy session starts.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let beside = healthy_answer(&remote, 3000 + seed).await;
            stop.store(true, Ordering::Relaxed);
            let evidence = tokio::time::timeout(Duration::from_secs(30), attack)
                .await
                .unwrap_or_else(|_| panic!("{name}: the attack did not end"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                beside.tokens, reference.tokens,
                "{name}: the healthy answer changed"
            );
            let ratio = beside.per_round.as_secs_f64() / alone.per_round.as_secs_f64();
            println!(
                "{name}: {evidence}; healthy {:.1} ms a round beside it, {:.1} ms alone",
                beside.per_round.as_secs_f64() * 1e3,
                alone.per_round.as_secs_f64() * 1e3
            );
            report.push(format!(
                "{name}: {evidence}; healthy round {:.1} ms beside it, {:.1} ms alone ({ratio:.2}x)",
                beside.per_round.as_secs_f64() * 1e3,
                alone.per_round.as_secs_f64() * 1e3
            ));
            ratios.push(ratio);
            if ratio <= 2.0 {
                break;
            }
        }
        assert!(
            ratios.iter().any(|&r| r <= 2.0),
            "{name}: healthy latency {ratios:.2?}x: {report:#?}"
        );
    }
    println!("\n{}", report.join("\n"));
    server.shutdown().await;
}
