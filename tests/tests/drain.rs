//! Draining one verifier, as a rolling restart does, watched from both sides: its admin
//! endpoint (readiness, health, metrics, the drain call) and the protocol (the load in the
//! hello, new sessions refused with `Draining`, a live session told to `Move` at its next round).

use specinfer_integration::{chat_ids, start_verifier};
use specinfer_net::{Remote, RemoteError};
use specinfer_verifier::admin;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::{ErrorCode, SamplingParams, TokenTree};

/// `curl` on the admin endpoint: the status code and the body.
async fn http(method: &str, url: &str) -> (u16, String) {
    let out = tokio::process::Command::new("curl")
        .args(["-s", "-X", method, "-w", "\n%{http_code}", url])
        .output()
        .await
        .expect("curl");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_string())
}

fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_verifier_turns_unready_refuses_new_sessions_and_moves_live_ones() {
    let (server, remote) = start_verifier(EngineConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(admin::serve(listener, server.control()));

    let prompt = chat_ids("What is the capital of France?");
    let root = TokenTree::root(*prompt.last().unwrap());
    let conn = Remote::connect(&remote).await.unwrap();
    assert!(!conn.server.load.draining);
    assert_eq!(conn.server.load.max_sessions, 64);
    let mut live = conn
        .open(1, prompt.clone(), SamplingParams::greedy(16))
        .await
        .unwrap();
    let first = live.verify(root.clone()).await.unwrap();
    assert_eq!(first.tokens.len(), 1);
    // A second connection's hello counts the open session.
    let watcher = Remote::connect(&remote).await.unwrap();
    assert_eq!(watcher.server.load.sessions, 1);

    assert_eq!(
        http("GET", &format!("{base}/readyz")).await,
        (200, "ready\n".into())
    );
    assert_eq!(http("GET", &format!("{base}/healthz")).await.0, 200);
    assert_eq!(
        http("POST", &format!("{base}/drain")).await,
        (202, "draining; sessions=1\n".into())
    );
    // Idempotent; a GET is not a drain call.
    assert_eq!(http("POST", &format!("{base}/drain")).await.0, 202);
    assert_eq!(http("GET", &format!("{base}/drain")).await.0, 405);

    // The live session's next round is not run: it is told to move, and closed here.
    let next = TokenTree::root(*first.tokens.last().unwrap());
    assert!(matches!(live.verify(next).await, Err(RemoteError::Moved)));
    // New sessions and new connections learn it too.
    match conn
        .open(2, prompt.clone(), SamplingParams::greedy(16))
        .await
    {
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::Draining), "{e}"),
        Ok(_) => panic!("a draining verifier opened a session"),
    }
    let late = Remote::connect(&remote).await.unwrap();
    assert!(late.server.load.draining);

    assert_eq!(
        http("GET", &format!("{base}/readyz")).await,
        (503, "draining\n".into())
    );
    assert_eq!(http("GET", &format!("{base}/healthz")).await.0, 200);
    let (_, metrics) = http("GET", &format!("{base}/metrics")).await;
    assert_eq!(gauge(&metrics, "specinfer_draining"), 1.0);
    assert_eq!(gauge(&metrics, "specinfer_sessions_moved_total"), 1.0);
    assert_eq!(gauge(&metrics, "specinfer_sessions_active"), 0.0);
    let control = server.control();
    assert!(control.draining() && control.healthy());
    // Once the engine thread has ended the health check says so (an orchestrator restarts it).
    server.shutdown().await;
    assert!(!control.healthy());
    assert_eq!(http("GET", &format!("{base}/healthz")).await.0, 503);
}
