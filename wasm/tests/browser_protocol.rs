//! The browser client's protocol logic, natively: with the default SSM drafting and SmolLM2
//! verifying in-process, its greedy answer equals incremental decoding token for token, its
//! streamed text equals the decoded answer, and bad frames are refused.

use std::path::PathBuf;

use specinfer_model::{fetch, load_gguf};
use specinfer_verifier::Session;
use specinfer_wasm::BrowserClient;
use specinfer_wire::*;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn body(frame: &[u8]) -> &[u8] {
    &frame[FRAME_HEADER_BYTES..]
}

fn decode(frame: &[u8]) -> Message {
    decode_frame(body(frame), &Limits::default()).unwrap()
}

#[test]
fn browser_client_answers_exactly_like_the_llm_alone() {
    let cache = std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/specinfer"));
    let (llm, tok) = load_gguf(&fetch::ensure(&fetch::SMOLLM2_135M, &cache).unwrap()).unwrap();
    let tok_file = std::env::temp_dir().join(format!("specinfer-wasm-{}.json", std::process::id()));
    tok.save(&tok_file).unwrap();
    let tokenizer_json = std::fs::read_to_string(&tok_file).unwrap();
    std::fs::remove_file(&tok_file).unwrap();
    let chat_json =
        serde_json::json!({"bos": tok.bos(), "eos": tok.eos(), "system": tok.default_system()})
            .to_string();
    let ssm = repo().join("models/ssm");
    let mut client = BrowserClient::new(
        &std::fs::read_to_string(ssm.join("config.json")).unwrap(),
        &std::fs::read(ssm.join("model.safetensors")).unwrap(),
        &tokenizer_json,
        &chat_json,
        "1,1,3,1",
    )
    .unwrap();

    match decode(&client.hello(Some("key".into()))) {
        Message::ClientHello(h) => assert_eq!(h.expected_model, tok.fingerprint()),
        other => panic!("expected a hello, got {other:?}"),
    }
    let limits = Limits::default();
    let (prompt, params) = match decode(&client.open("Name two oceans.", 40).unwrap()) {
        Message::OpenSession(o) => (o.prompt, o.params),
        other => panic!("expected OpenSession, got {other:?}"),
    };
    let mut reference = Session::open(&llm, &prompt, params.clone(), &limits).unwrap();
    while reference.finish().is_none() {
        let root = TokenTree::root(reference.root());
        reference.verify(&llm, &limits, &root).unwrap();
    }
    let expected = reference.tokens()[prompt.len()..].to_vec();

    let mut session = Session::open(&llm, &prompt, params, &limits).unwrap();
    let opened = encode_frame(&Message::SessionOpened(SessionOpened {
        session: 1,
        resume_token: [0; 16],
    }));
    assert!(client.on_frame(body(&opened)).unwrap().contains("opened"));
    let (mut text, mut rounds) = (String::new(), 0u32);
    loop {
        let verify = match decode(&client.next_round().unwrap()) {
            Message::Verify(v) => v,
            other => panic!("expected Verify, got {other:?}"),
        };
        assert!(
            client.next_round().is_err(),
            "a second round while one is in flight"
        );
        let out = session.verify(&llm, &limits, &verify.tree).unwrap();
        let reply = encode_frame(&Message::Verified(Verified {
            session: verify.session,
            round: verify.round,
            accepted_nodes: out.accepted_nodes,
            tokens: out.tokens,
            finish: out.finish,
            stats: RoundStats {
                tree_nodes: verify.tree.len() as u32,
                batch_size: 1,
                queue_us: 0,
                forward_us: 0,
            },
        }));
        // The same answer again (a replayed or misrouted frame) is refused.
        let event: serde_json::Value =
            serde_json::from_str(&client.on_frame(body(&reply)).unwrap()).unwrap();
        assert!(client.on_frame(body(&reply)).is_err());
        rounds += 1;
        text += event["text"].as_str().unwrap();
        if event["finished"].as_bool().unwrap() {
            break;
        }
    }
    assert_eq!(
        client.token_ids(),
        expected,
        "speculation changed the answer"
    );
    let visible: Vec<u32> = expected
        .iter()
        .copied()
        .filter(|t| !tok.eos().contains(t))
        .collect();
    assert_eq!(
        text,
        tok.decode(&visible).unwrap(),
        "streamed text differs from the answer"
    );
    let stats: serde_json::Value = serde_json::from_str(&client.stats()).unwrap();
    assert_eq!(stats["rounds"], rounds);
    assert_eq!(stats["tokens"], expected.len());
    // A header announcing more than the limits allow is refused before any allocation.
    assert!(client.frame_len(&u32::MAX.to_le_bytes()).is_err());
    assert!(client.frame_len(&[1, 2]).is_err());
}
