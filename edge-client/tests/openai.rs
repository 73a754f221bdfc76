//! The OpenAI-compatible endpoint answers as an ordinary client expects: `curl` talks to a real
//! `specinfer serve-openai` process (embedded verifier, SmolLM2), and the streamed chat
//! completion, parsed as server-sent events, carries exactly the non-streamed answer. What a web
//! page must not do is refused (a foreign Host or Origin, a body that is not JSON), and a client
//! that leaves mid-stream stops its generation.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// POSTs `body` as JSON.
fn post(url: &str, body: &str) -> (u16, String) {
    curl(&["-H", "content-type: application/json", "-d", body, url])
}

fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-sS", "-N", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl must be installed (.ci/run installs it)");
    let text = String::from_utf8(out.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_string())
}

#[test]
fn chat_completions_stream_as_server_sent_events() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    // The server binds a port the system picks and says which: a port picked here and freed
    // before the server binds it could be taken by another test in between.
    let log_file = tempfile::Builder::new()
        .prefix("serve-openai-")
        .suffix(".log")
        .tempfile_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let log = log_file.path().to_path_buf();
    let _server = Server(
        Command::new(env!("CARGO_BIN_EXE_specinfer"))
            .args([
                "serve-openai",
                "--ssm",
                "self",
                "--tree",
                "2,1",
                "--listen",
                "127.0.0.1:0",
                "--allowed-origin",
                "http://app.example",
            ])
            .current_dir(&root)
            .env("SPECINFER_LOG", "specinfer=info")
            .stdout(Stdio::null())
            .stderr(log_file.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let start = Instant::now();
    let addr = loop {
        let said = std::fs::read_to_string(&log).unwrap();
        if let Some(at) = said.split("OpenAI-compatible API on http://").nth(1) {
            break at.split('/').next().unwrap().to_string();
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "serve-openai did not come up: {said}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let url = |p: &str| format!("http://{addr}{p}");

    let (code, models) = curl(&[&url("/v1/models")]);
    assert_eq!(code, 200);
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["object"], "model");

    let request = r#"{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Name three colours."}],"max_tokens":24,"temperature":0}"#;
    let (code, whole) = post(&url("/v1/chat/completions"), request);
    assert_eq!(code, 200, "{whole}");
    let whole: serde_json::Value = serde_json::from_str(&whole).unwrap();
    let answer = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!answer.is_empty());
    let used = whole["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        (1..=24).contains(&used),
        "completion_tokens {used} outside 1..=24"
    );

    let streamed_request =
        request.replace("\"temperature\":0", "\"temperature\":0,\"stream\":true");
    let (code, sse) = post(&url("/v1/chat/completions"), &streamed_request);
    assert_eq!(code, 200);
    let events: Vec<&str> = sse.split("\n\n").filter(|e| !e.trim().is_empty()).collect();
    assert_eq!(
        events.last().unwrap().trim(),
        "data: [DONE]",
        "the stream must end with [DONE]"
    );
    let mut text = String::new();
    let mut finishes = 0;
    for e in &events[..events.len() - 1] {
        let json = e
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data line: {e:?}"));
        let chunk: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(chunk["object"], "chat.completion.chunk");
        let choice = &chunk["choices"][0];
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        finishes += !choice["finish_reason"].is_null() as usize;
    }
    assert_eq!(finishes, 1, "exactly one chunk carries the finish reason");
    assert_eq!(
        text, answer,
        "greedy streaming and non-streaming answers differ"
    );

    // Fields a request leaves out take OpenAI's defaults: temperature 1 (sampled), and a fresh
    // seed each time, so the same unseeded question gets another answer; a seed reproduces one.
    let content = |body: &str| {
        let (code, reply) = post(&url("/v1/chat/completions"), body);
        assert_eq!(code, 200, "{reply}");
        let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
        reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let unseeded = request.replace(",\"temperature\":0", "");
    let answers: Vec<String> = (0..3).map(|_| content(&unseeded)).collect();
    assert!(
        answers.iter().any(|a| a != &answers[0]),
        "three unseeded sampled answers were all the same: {answers:?}"
    );
    let seeded = unseeded.replace("\"max_tokens\":24", "\"max_tokens\":24,\"seed\":7");
    assert_eq!(
        content(&seeded),
        content(&seeded),
        "a seed must reproduce its sample"
    );

    let (code, err) = post(&url("/v1/chat/completions"), "{not json");
    assert_eq!(code, 400);
    assert!(err.contains("invalid_request_error"));
    let (code, _) = post(
        &url("/v1/chat/completions"),
        r#"{"messages":[],"max_tokens":3}"#,
    );
    assert_eq!(code, 400);
    // A chunked body (what some clients send for streamed uploads) is read like any other.
    let (code, chunked) = curl(&[
        "-H",
        "content-type: application/json",
        "-H",
        "Transfer-Encoding: chunked",
        "-d",
        request,
        &url("/v1/chat/completions"),
    ]);
    assert_eq!(code, 200, "{chunked}");
    let chunked: serde_json::Value = serde_json::from_str(&chunked).unwrap();
    assert_eq!(chunked["choices"][0]["message"]["content"], answer.as_str());
    // A conversation longer than the context: refused with OpenAI's code, before any stream.
    let long = request.replace("Name three colours.", &"colour ".repeat(9000));
    for body in [
        long.clone(),
        long.replace("\"temperature\":0", "\"stream\":true"),
    ] {
        let (code, err) = post(&url("/v1/chat/completions"), &body);
        assert_eq!(code, 400, "{err}");
        let err: serde_json::Value = serde_json::from_str(&err).unwrap();
        assert_eq!(err["error"]["code"], "context_length_exceeded", "{err}");
    }

    // What a web page may send anywhere without asking (a form or text body), a foreign Origin
    // and a Host that only a rebound DNS name would carry: refused before anything runs.
    let chat = url("/v1/chat/completions");
    let (code, err) = curl(&["-d", request, &chat]);
    assert_eq!(code, 415, "a form-encoded body: {err}");
    let (code, _) = curl(&["-H", "content-type: text/plain", "-d", request, &chat]);
    assert_eq!(code, 415, "a text body");
    let json = ["-H", "content-type: application/json", "-d", request];
    let (code, err) = curl(&[&json[..], &["-H", "Origin: http://evil.example", &chat]].concat());
    assert_eq!(code, 403, "{err}");
    let (code, err) = curl(&[&json[..], &["-H", "Host: evil.example", &chat]].concat());
    assert_eq!(code, 403, "{err}");
    assert!(err.contains("--allowed-host"), "{err}");
    // An allowed origin is answered, with CORS headers, and so is its preflight.
    let (code, headers) = curl(
        &[
            &json[..],
            &[
                "-H",
                "Origin: http://app.example",
                "-D",
                "-",
                "-o",
                "/dev/null",
                &chat,
            ],
        ]
        .concat(),
    );
    assert_eq!(code, 200);
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("access-control-allow-origin: http://app.example"),
        "{headers}"
    );
    let (code, _) = curl(&[
        "-X",
        "OPTIONS",
        "-H",
        "Origin: http://app.example",
        "-H",
        "Access-Control-Request-Method: POST",
        &chat,
    ]);
    assert_eq!(code, 204);

    // A streaming client that leaves after the first text stops its generation.
    let long = r#"{"prompt":"Count from 1 to 2000, separated by commas: 1, 2, 3,","max_tokens":4000,"temperature":0,"stream":true}"#;
    {
        use std::io::{Read, Write};
        let mut socket = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            socket,
            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{long}",
            long.len()
        )
        .unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("\"text\":\"") {
            let n = socket.read(&mut buf).unwrap();
            assert!(n > 0, "the stream ended before any text");
            seen.extend_from_slice(&buf[..n]);
        }
    }
    let start = Instant::now();
    loop {
        let said = std::fs::read_to_string(&log).unwrap();
        if said.contains("the client left: its generation stopped") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the generation went on without its client: {said}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // And the endpoint serves the next request.
    let (code, _) = post(&url("/v1/chat/completions"), request);
    assert_eq!(code, 200);
}
