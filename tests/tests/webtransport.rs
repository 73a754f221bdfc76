//! Browsers' transport, without a browser: a WebTransport client (web-transport-quinn, trusting
//! the development certificate by its hash as a page does with `serverCertificateHashes`) speaks
//! the native protocol over a WebTransport session and gets the same answer as a QUIC client.

use specinfer_edge::Client;
use specinfer_integration::{chat_ids, start_verifier, API_KEY};
use specinfer_net::{read_frame, write_frame, ServerIdentity};
use specinfer_speculator::RoundDriver;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webtransport_session_gets_the_same_answer_as_quic() {
    let (mut server, remote) = start_verifier(EngineConfig::default());
    let identity = ServerIdentity::self_signed_for_browsers(&["localhost"]).unwrap();
    let addr = server
        .serve_webtransport(&identity, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let ids = chat_ids("Name a planet.");
    let params = SamplingParams::greedy(16);

    let mut quic = Client::connect(remote.clone()).await.unwrap();
    let mut driver = RoundDriver::new(ids.clone(), params.clone(), None).unwrap();
    let reference = quic.generate(&mut driver, |_| {}).await.unwrap().token_ids;
    quic.shutdown().await;

    let hash = specinfer_wire::parse_sha256_hex(&identity.fingerprint()).unwrap();
    let client = web_transport_quinn::ClientBuilder::new()
        .with_server_certificate_hashes(vec![hash.to_vec()])
        .unwrap();
    let url = url::Url::parse(&format!("https://localhost:{}/", addr.port())).unwrap();
    let session = client.connect(url).await.unwrap();
    let limits = Limits::default();
    let (mut send, mut recv) = session.open_bi().await.unwrap();
    let hello = Message::ClientHello(ClientHello {
        protocol_version: PROTOCOL_VERSION,
        expected_model: remote.expected_model.clone(),
        api_key: Some(API_KEY.into()),
    });
    write_frame(&mut send, &hello).await.unwrap();
    let (reply, _) = read_frame(&mut recv, &limits).await.unwrap().unwrap();
    assert!(matches!(reply, Message::ServerHello(_)), "{reply:?}");

    let (mut send, mut recv) = session.open_bi().await.unwrap();
    let open = Message::OpenSession(OpenSession {
        session: 1,
        prompt: ids.clone(),
        params,
    });
    write_frame(&mut send, &open).await.unwrap();
    let (opened, _) = read_frame(&mut recv, &limits).await.unwrap().unwrap();
    assert!(matches!(opened, Message::SessionOpened(_)), "{opened:?}");
    let mut out: Vec<u32> = Vec::new();
    for round in 0.. {
        let root = *out.last().unwrap_or(ids.last().unwrap());
        let verify = Message::Verify(Verify {
            session: 1,
            round,
            tree: TokenTree::root(root),
        });
        write_frame(&mut send, &verify).await.unwrap();
        match read_frame(&mut recv, &limits).await.unwrap().unwrap().0 {
            Message::Verified(v) => {
                out.extend(&v.tokens);
                if v.finish.is_some() {
                    break;
                }
            }
            other => panic!("expected Verified, got {other:?}"),
        }
    }
    assert_eq!(out, reference, "WebTransport and QUIC answers differ");
    // A garbage frame gets a typed error on its stream, like over QUIC.
    let (mut send, mut recv) = session.open_bi().await.unwrap();
    let [v0, v1] = PROTOCOL_VERSION.to_le_bytes();
    send.write_all(&[5, 0, 0, 0, v0, v1, 9, 9, 9])
        .await
        .unwrap();
    match read_frame(&mut recv, &limits).await.unwrap().unwrap().0 {
        Message::Error(e) => assert_eq!(e.code, ErrorCode::BadFrame),
        other => panic!("expected an error, got {other:?}"),
    }
    session.close(0, b"done");
    server.shutdown().await;
}

/// Says hello over a WebTransport session to `port`, trusting the certificate `hash`.
async fn hello_over_webtransport(
    port: u16,
    hash: [u8; 32],
    remote: &specinfer_net::RemoteConfig,
) -> Result<Message, String> {
    let client = web_transport_quinn::ClientBuilder::new()
        .with_server_certificate_hashes(vec![hash.to_vec()])
        .map_err(|e| e.to_string())?;
    let url = url::Url::parse(&format!("https://localhost:{port}/")).unwrap();
    let session = client.connect(url).await.map_err(|e| e.to_string())?;
    let (mut send, mut recv) = session.open_bi().await.map_err(|e| e.to_string())?;
    let hello = Message::ClientHello(ClientHello {
        protocol_version: PROTOCOL_VERSION,
        expected_model: remote.expected_model.clone(),
        api_key: Some(API_KEY.into()),
    });
    write_frame(&mut send, &hello)
        .await
        .map_err(|e| e.to_string())?;
    let reply = read_frame(&mut recv, &Limits::default()).await;
    session.close(0, b"done");
    Ok(reply.map_err(|e| e.to_string())?.ok_or("no reply")?.0)
}

/// A raw HTTP/1.1 GET of `path` from the demo server at `addr`, naming `host`.
async fn http_get(addr: std::net::SocketAddr, host: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut reply = String::new();
    socket.read_to_string(&mut reply).await.unwrap();
    reply
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_browser_certificate_is_renewed_and_the_demo_tells_pages_only_on_its_own_host() {
    use specinfer_verifier::web;
    let (mut server, remote) = start_verifier(EngineConfig::default());
    let first = ServerIdentity::self_signed_for_browsers(&["localhost"]).unwrap();
    let port = server
        .serve_webtransport(&first, "127.0.0.1:0".parse().unwrap())
        .unwrap()
        .port();
    let endpoint = web::DemoEndpoint {
        webtransport_port: port,
        certificate_sha256: first.fingerprint(),
        api_key: Some(API_KEY.into()),
    };
    let files = web::WebFiles::default();
    web::set_endpoint(&files, &endpoint);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let demo = listener.local_addr().unwrap();
    tokio::spawn(web::serve_web(listener, files.clone(), Vec::new()));

    // The page's configuration (with its API key) goes to pages of this host only: a name
    // rebound to this address is refused.
    let own = http_get(demo, &demo.to_string(), "/config.json").await;
    assert!(own.starts_with("HTTP/1.1 200"), "{own}");
    assert!(own.contains(&first.fingerprint()), "{own}");
    let rebound = http_get(demo, "evil.example:80", "/config.json").await;
    assert!(rebound.starts_with("HTTP/1.1 403"), "{rebound}");
    assert!(!rebound.contains(API_KEY), "{rebound}");
    // No test hook is served.
    let hold = http_get(demo, "localhost", "/hold").await;
    assert!(hold.starts_with("HTTP/1.1 404"), "{hold}");

    // Renewed every 300 ms here (every 7 days in the binary): the page is told the new hash,
    // new sessions get the new certificate, and the old one is trusted no longer.
    let first_hash = specinfer_wire::parse_sha256_hex(&first.fingerprint()).unwrap();
    assert!(matches!(
        hello_over_webtransport(port, first_hash, &remote).await,
        Ok(Message::ServerHello(_))
    ));
    tokio::spawn(web::renew_certificates(
        server.webtransport_identity().unwrap(),
        files.clone(),
        endpoint,
        vec!["localhost".into()],
        std::time::Duration::from_millis(300),
    ));
    let renewed = loop {
        let (_, config) = files.get("/config.json").unwrap();
        let config: serde_json::Value = serde_json::from_slice(&config).unwrap();
        let hash = config["certificate_sha256"].as_str().unwrap().to_string();
        if hash != first.fingerprint() {
            assert_eq!(
                config["api_key"], API_KEY,
                "the rest of the configuration stays"
            );
            break specinfer_wire::parse_sha256_hex(&hash).unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    // Renewals go on every 300 ms: a hash read now may be replaced before the handshake, so
    // a few tries are allowed; the old hash is refused every time.
    let mut current = renewed;
    let mut connected = false;
    for _ in 0..5 {
        if let Ok(Message::ServerHello(_)) = hello_over_webtransport(port, current, &remote).await {
            connected = true;
            break;
        }
        let (_, config) = files.get("/config.json").unwrap();
        let config: serde_json::Value = serde_json::from_slice(&config).unwrap();
        current = specinfer_wire::parse_sha256_hex(config["certificate_sha256"].as_str().unwrap())
            .unwrap();
    }
    assert!(
        connected,
        "a page trusting the renewed certificate connects"
    );
    assert!(
        hello_over_webtransport(port, first_hash, &remote)
            .await
            .is_err(),
        "the first certificate is no longer presented"
    );
    server.shutdown().await;
}
