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
