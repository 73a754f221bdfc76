//! `specinfer serve-openai`: a local OpenAI-compatible HTTP endpoint (`/v1/models`,
//! `/v1/chat/completions`, `/v1/completions`, streaming as server-sent events), so existing apps
//! use the edge/cloud split unchanged.
//!
//! Deliberately small HTTP/1.1: one request per connection (`Connection: close`), bounded headers
//! and body, requests served one after another (one draft model, one verifier session at a time).

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde_json::{json, Value};
use specinfer_edge::Client;
use specinfer_model::ChatMessage;
use specinfer_speculator::DraftMode;
use specinfer_wire::{SamplingParams, VerifyMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use specinfer_edge::ClientSetup;

const MAX_HEADER: usize = 16 << 10;
const MAX_BODY: usize = 1 << 20;

struct Request {
    method: String,
    path: String,
    body: Vec<u8>,
}

struct HttpError(u16, String);

async fn read_request(sock: &mut TcpStream) -> Result<Request, HttpError> {
    let bad = |m: &str| HttpError(400, m.to_string());
    let mut buf = Vec::with_capacity(4096);
    let header_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEADER {
            return Err(HttpError(431, "request headers too large".into()));
        }
        let mut chunk = [0u8; 4096];
        let n = sock
            .read(&mut chunk)
            .await
            .map_err(|e| bad(&e.to_string()))?;
        if n == 0 {
            return Err(bad("connection closed inside the headers"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..header_end]).map_err(|_| bad("headers are not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (method, path) = (
        first.next().unwrap_or("").to_string(),
        first.next().unwrap_or("").to_string(),
    );
    let headers: Vec<(&str, &str)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim(), v.trim()))
        .collect();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|&(_, v)| v)
    };
    if header("transfer-encoding").is_some() {
        return Err(HttpError(
            411,
            "chunked request bodies are not supported: send the body with a Content-Length".into(),
        ));
    }
    let length = header("content-length")
        .map(|v| v.parse::<usize>().map_err(|_| bad("bad Content-Length")))
        .transpose()?
        .unwrap_or(0);
    if length > MAX_BODY {
        return Err(HttpError(
            413,
            format!("body of {length} bytes, the limit is {MAX_BODY}"),
        ));
    }
    let mut body = buf[header_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = vec![0u8; (length - body.len()).min(64 << 10)];
        let n = sock
            .read(&mut chunk)
            .await
            .map_err(|e| bad(&e.to_string()))?;
        if n == 0 {
            return Err(bad("connection closed inside the body"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(Request { method, path, body })
}

async fn respond(sock: &mut TcpStream, status: u16, body: &Value) {
    let text = body.to_string();
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        _ => "Internal Server Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        text.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(text.as_bytes()).await;
}

fn error_body(message: &str) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error"}})
}

pub async fn serve(
    listener: TcpListener,
    setup: ClientSetup,
    mut client: Client,
    model_name: String,
) -> Result<()> {
    let mut next_id = 0u64;
    loop {
        let (mut sock, _) = listener.accept().await?;
        next_id += 1;
        let req = match read_request(&mut sock).await {
            Ok(r) => r,
            Err(HttpError(code, m)) => {
                respond(&mut sock, code, &error_body(&m)).await;
                continue;
            }
        };
        let result = match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/v1/models") => {
                let created = now();
                respond(
                    &mut sock,
                    200,
                    &json!({"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specinfer"}]}),
                )
                .await;
                Ok(())
            }
            ("POST", "/v1/chat/completions") => {
                complete(
                    &mut sock,
                    &setup,
                    &mut client,
                    &model_name,
                    &req.body,
                    true,
                    next_id,
                )
                .await
            }
            ("POST", "/v1/completions") => {
                complete(
                    &mut sock,
                    &setup,
                    &mut client,
                    &model_name,
                    &req.body,
                    false,
                    next_id,
                )
                .await
            }
            (m, p) => {
                respond(&mut sock, 404, &error_body(&format!("no route {m} {p}"))).await;
                Ok(())
            }
        };
        if let Err(e) = result {
            respond(
                &mut sock,
                500,
                &json!({"error": {"message": e.to_string(), "type": "server_error"}}),
            )
            .await;
        }
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sampling parameters and draft mode of a request: what it leaves out from the server's
/// defaults (OpenAI's unless the operator set others), a fresh seed unless it gives one.
fn request_params(
    setup: &ClientSetup,
    body: &Value,
) -> Result<(SamplingParams, DraftMode), String> {
    let mut params = setup.request_params();
    if let Some(n) = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
    {
        params.max_new_tokens = n
            .as_u64()
            .filter(|&n| n > 0 && n <= 8192)
            .ok_or("max_tokens must be 1..=8192")? as u32;
    }
    if let Some(s) = body.get("seed") {
        params.seed = s.as_u64().ok_or("seed must be a non-negative integer")?;
    }
    let top_p = match body.get("top_p") {
        Some(p) => p
            .as_f64()
            .filter(|&p| p > 0.0 && p <= 1.0)
            .ok_or("top_p must be in (0, 1]")? as f32,
        None => params.top_p,
    };
    let temperature = match body.get("temperature") {
        Some(t) => t
            .as_f64()
            .filter(|&t| (0.0..=2.0).contains(&t))
            .ok_or("temperature must be in [0, 2]")? as f32,
        None => params.temperature,
    };
    if temperature == 0.0 {
        params.mode = VerifyMode::Greedy;
        params.temperature = 0.0;
        params.top_p = 1.0;
        return Ok((params, DraftMode::Greedy));
    }
    params.mode = VerifyMode::Stochastic;
    params.temperature = temperature;
    params.top_p = top_p;
    Ok((params, DraftMode::sampled(temperature, top_p)))
}

async fn complete(
    sock: &mut TcpStream,
    setup: &ClientSetup,
    client: &mut Client,
    model: &str,
    body: &[u8],
    chat: bool,
    n: u64,
) -> Result<()> {
    let body: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            respond(sock, 400, &error_body(&format!("body is not JSON: {e}"))).await;
            return Ok(());
        }
    };
    let messages: Vec<ChatMessage> = if chat {
        let Some(list) = body.get("messages").and_then(Value::as_array) else {
            respond(sock, 400, &error_body("messages must be an array")).await;
            return Ok(());
        };
        let parsed: Option<Vec<ChatMessage>> = list
            .iter()
            .map(|m| {
                Some(ChatMessage::new(
                    m.get("role")?.as_str()?,
                    m.get("content")?.as_str()?,
                ))
            })
            .collect();
        match parsed {
            Some(p) if !p.is_empty() => p,
            _ => {
                respond(
                    sock,
                    400,
                    &error_body("every message needs a string role and content"),
                )
                .await;
                return Ok(());
            }
        }
    } else {
        match body.get("prompt").and_then(Value::as_str) {
            Some(p) => vec![ChatMessage::new("user", p)],
            None => {
                respond(sock, 400, &error_body("prompt must be a string")).await;
                return Ok(());
            }
        }
    };
    let (params, draft_mode) = match request_params(setup, &body) {
        Ok(p) => p,
        Err(m) => {
            respond(sock, 400, &error_body(&m)).await;
            return Ok(());
        }
    };
    let ids = setup.prompt_ids(&messages, !chat)?;
    // Refused here, as OpenAI does, so that apps which trim their history on this code can.
    let budget = setup.prompt_budget(params.max_new_tokens);
    if ids.len() > budget {
        let message = format!(
            "the prompt has {} tokens, more than the {budget} that fit the model's {}-token context \
             with max_tokens {} and room for speculation",
            ids.len(),
            setup.context_tokens,
            params.max_new_tokens
        );
        let error = json!({"error": {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}});
        respond(sock, 400, &error).await;
        return Ok(());
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let id = format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" });
    let created = now();
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    let finish_name = |g: &specinfer_edge::Generation| match g.finish {
        Some(specinfer_wire::FinishReason::Length) => "length",
        _ => "stop",
    };
    if !stream {
        let g = setup
            .run(client, &ids, params, draft_mode, &mut |_| {})
            .await?;
        let text = &g.text;
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_name(&g)})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish_name(&g)})
        };
        let usage = json!({"prompt_tokens": ids.len(), "completion_tokens": g.token_ids.len(), "total_tokens": ids.len() + g.token_ids.len()});
        respond(sock, 200, &json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage})).await;
        return Ok(());
    }
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
    sock.write_all(head.as_bytes()).await?;
    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let event = |delta: Value, finish: Value| -> String {
        let choice = if chat {
            json!({"index": 0, "delta": delta, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish})
        };
        format!(
            "data: {}\n\n",
            json!({"id": id, "object": chunk_object, "created": created, "model": model, "choices": [choice]})
        )
    };
    if chat {
        sock.write_all(event(json!({"role": "assistant", "content": ""}), Value::Null).as_bytes())
            .await?;
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let generation = async move {
        let mut send = |t: &str| {
            let _ = tx.send(t.to_string());
        };
        setup.run(client, &ids, params, draft_mode, &mut send).await
    };
    let mut write_failed = false;
    let writer = async {
        while let Some(text) = rx.recv().await {
            if !write_failed
                && sock
                    .write_all(event(json!({"content": text}), Value::Null).as_bytes())
                    .await
                    .is_err()
            {
                write_failed = true;
            }
        }
    };
    let (result, ()) = tokio::join!(generation, writer);
    match result {
        Ok(g) => {
            sock.write_all(event(json!({}), json!(finish_name(&g))).as_bytes())
                .await?
        }
        // The status line has gone out: the error travels as an event of the stream.
        Err(e) => {
            let error = json!({"error": {"message": format!("{e:#}"), "type": "server_error"}});
            sock.write_all(format!("data: {error}\n\n").as_bytes())
                .await?
        }
    }
    sock.write_all(b"data: [DONE]\n\n").await?;
    Ok(())
}
