//! `specinfer serve-openai`: a local OpenAI-compatible HTTP endpoint (`/v1/models`,
//! `/v1/chat/completions`, `/v1/completions`, streaming as server-sent events), so existing apps
//! use the edge/cloud split unchanged.
//!
//! HTTP is axum's on hyper's (parsing, keep-alive, chunked bodies, malformed requests), each
//! connection a task of its own. What a web page must not be able to do is refused before any
//! handler runs, since the endpoint spends its user's API key and shows their answers:
//! - a `Host` that is neither an IP address, `localhost` nor an `--allowed-host` (DNS
//!   rebinding: a page whose name resolves to 127.0.0.1 would otherwise read the answers);
//! - an `Origin` that is not an `--allowed-origin` (a page's cross-site request); allowed ones
//!   get CORS headers and their preflights answered;
//! - a POST whose body is not `application/json` (the "simple" requests a page may send
//!   anywhere without a preflight are form or text bodies).
//!
//! Connections are served by `specinfer_net::http::serve` (bounded in number, headers within
//! 10 s); a body must arrive within [`BODY_TIMEOUT`]. Generations run one after another on
//! the [`Generator`]'s thread; a client that disconnects stops its generation (streamed or not)
//! after the round in flight, or before it starts if it was still queued.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use specinfer_model::ChatMessage;
use specinfer_net::host_allowed;
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::generator::{invalid_request, Busy, Generator, Job, Reply};

/// Largest request body.
const MAX_BODY: usize = 1 << 20;
/// A request's body must arrive within this.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Who may call the endpoint, beyond local apps.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// Host names (without port) accepted besides IP addresses and `localhost`.
    pub hosts: Vec<String>,
    /// Web origins (`scheme://host[:port]`) whose pages may call the endpoint.
    pub origins: Vec<String>,
}

struct Endpoint {
    generator: Generator,
    model: String,
    next_id: std::sync::atomic::AtomicU64,
}

/// Serves the endpoint on `listener`; returns only when the process ends.
pub async fn serve(listener: TcpListener, generator: Generator, model: String, access: Access) {
    let endpoint = Arc::new(Endpoint {
        generator,
        model,
        next_id: Default::default(),
    });
    let app = router(endpoint).layer(axum::middleware::from_fn_with_state(
        Arc::new(access),
        check_caller,
    ));
    specinfer_net::http::serve(listener, app).await
}

fn router(endpoint: Arc<Endpoint>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<Endpoint>>, b: Body| complete(s, b, true)),
        )
        .route(
            "/v1/completions",
            post(|s: State<Arc<Endpoint>>, b: Body| complete(s, b, false)),
        )
        .fallback(|method: Method, uri: axum::http::Uri| async move {
            error(
                StatusCode::NOT_FOUND,
                invalid_request(&format!("no route {method} {}", uri.path())),
            )
        })
        .with_state(endpoint)
}

fn error(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

/// The Host, Origin and Content-Type checks (see the module doc), and CORS for allowed origins.
async fn check_caller(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    let refuse = |status: StatusCode, message: String| error(status, invalid_request(&message));
    let headers = request.headers();
    match headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
        Some(host) if host_allowed(host, &access.hosts) => {}
        Some(host) => {
            return refuse(
                StatusCode::FORBIDDEN,
                format!("Host {host:?} is not served here (start serve-openai with --allowed-host to serve it)"),
            )
        }
        None => return refuse(StatusCode::BAD_REQUEST, "a request needs a Host header".into()),
    }
    let origin = headers.get(header::ORIGIN).cloned();
    if let Some(o) = &origin {
        if !access.origins.iter().any(|a| o.as_bytes() == a.as_bytes()) {
            return refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "Origin {:?} may not call this endpoint (start serve-openai with --allowed-origin to allow it)",
                    String::from_utf8_lossy(o.as_bytes())
                ),
            );
        }
    }
    if request.method() == Method::OPTIONS && origin.is_some() {
        let mut preflight = StatusCode::NO_CONTENT.into_response();
        allow_origin(preflight.headers_mut(), origin);
        let h = preflight.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        return preflight;
    }
    if request.method() == Method::POST && !is_json(headers) {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be JSON, sent with Content-Type: application/json".into(),
        );
    }
    let mut response = next.run(request).await;
    allow_origin(response.headers_mut(), origin);
    response
}

fn allow_origin(headers: &mut HeaderMap, origin: Option<HeaderValue>) {
    if let Some(o) = origin {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        headers.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(e): State<Arc<Endpoint>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": e.model, "object": "model", "created": now(), "owned_by": "specinfer"}]}),
    )
}

/// Sets the stop flag when dropped before [`StopOnDrop::finished`]: the client has gone
/// (hyper drops the response, or the handler, when its connection closes).
struct StopOnDrop {
    flag: Arc<AtomicBool>,
    finished: bool,
}

impl StopOnDrop {
    fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            self.flag.store(true, Ordering::Relaxed);
        }
    }
}

/// The messages of a chat request, or the prompt of a completion request.
fn messages(body: &Value, chat: bool) -> Result<Vec<ChatMessage>, &'static str> {
    if !chat {
        let prompt = body.get("prompt").and_then(Value::as_str);
        return Ok(vec![ChatMessage::new(
            "user",
            prompt.ok_or("prompt must be a string")?,
        )]);
    }
    let list = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be an array")?;
    let parsed: Option<Vec<ChatMessage>> = list
        .iter()
        .map(|m| {
            Some(ChatMessage::new(
                m.get("role")?.as_str()?,
                m.get("content")?.as_str()?,
            ))
        })
        .collect();
    parsed
        .filter(|p| !p.is_empty())
        .ok_or("every message needs a string role and content")
}

async fn complete(State(e): State<Arc<Endpoint>>, body: Body, chat: bool) -> Response {
    let bad = |m: &str| error(StatusCode::BAD_REQUEST, invalid_request(m));
    let bytes: Bytes =
        match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, MAX_BODY)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => {
                return error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    invalid_request(&format!(
                        "the body is over the limit of {MAX_BODY} bytes, or broken"
                    )),
                )
            }
            Err(_) => {
                return error(
                    StatusCode::REQUEST_TIMEOUT,
                    invalid_request("the body did not arrive in time"),
                )
            }
        };
    let body: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(err) => return bad(&format!("body is not JSON: {err}")),
    };
    let messages = match messages(&body, chat) {
        Ok(m) => m,
        Err(m) => return bad(m),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let (replies, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let stop = StopOnDrop {
        flag: Arc::new(AtomicBool::new(false)),
        finished: false,
    };
    let job = Job {
        chat,
        messages,
        body,
        stop: stop.flag.clone(),
        replies,
    };
    if let Err(Busy) = e.generator.submit(job) {
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"error": {"message": "too many requests are waiting: retry shortly", "type": "server_error"}}),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return r;
    }
    let prompt_tokens = match rx.recv().await {
        Some(Reply::Started { prompt_tokens }) => prompt_tokens,
        Some(Reply::Refused(status, body)) => {
            stop.finished();
            return error(status, body);
        }
        _ => return server_error("the generator stopped"),
    };
    let n = e.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let shape = Shape {
        id: format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" }),
        created: now(),
        model: e.model.clone(),
        chat,
    };
    if stream {
        return streamed(shape, rx, stop);
    }
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Reply::Text(t)) => text.push_str(&t),
            Some(Reply::Finished {
                finish_reason,
                completion_tokens,
            }) => {
                stop.finished();
                let choice = if chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": finish_reason})
                };
                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                let object = if chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                return Json(json!({"id": shape.id, "object": object, "created": shape.created, "model": shape.model, "choices": [choice], "usage": usage})).into_response();
            }
            Some(Reply::Failed(m)) => return server_error(&m),
            _ => return server_error("the generator stopped"),
        }
    }
}

fn server_error(message: &str) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        json!({"error": {"message": message, "type": "server_error"}}),
    )
}

/// What every chunk of a response repeats.
struct Shape {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl Shape {
    /// One server-sent event carrying `delta` (and the finish reason on the last).
    fn event(&self, delta: Value, finish: Value) -> Bytes {
        let (object, choice) = if self.chat {
            (
                "chat.completion.chunk",
                json!({"index": 0, "delta": delta, "finish_reason": finish}),
            )
        } else {
            (
                "text_completion",
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish}),
            )
        };
        let chunk = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        Bytes::from(format!("data: {chunk}\n\n"))
    }
}

/// The answer as server-sent events, each piece of text as it is verified; the stream owns
/// `stop`, so a client that leaves stops the generation.
fn streamed(shape: Shape, rx: UnboundedReceiver<Reply>, stop: StopOnDrop) -> Response {
    enum Step {
        Start,
        Body,
        Done,
    }
    let events = futures_util::stream::unfold(
        (Step::Start, rx, Some(stop), shape),
        |(step, mut rx, mut stop, shape)| async move {
            let bytes = match step {
                Step::Done => return None,
                Step::Start if shape.chat => {
                    let role =
                        shape.event(json!({"role": "assistant", "content": ""}), Value::Null);
                    return Some((
                        Ok::<_, std::convert::Infallible>(role),
                        (Step::Body, rx, stop, shape),
                    ));
                }
                Step::Start | Step::Body => match rx.recv().await {
                    Some(Reply::Text(t)) => {
                        let chunk = shape.event(json!({"content": t}), Value::Null);
                        return Some((Ok(chunk), (Step::Body, rx, stop, shape)));
                    }
                    Some(Reply::Finished { finish_reason, .. }) => {
                        if let Some(s) = stop.take() {
                            s.finished();
                        }
                        let mut b = shape.event(json!({}), json!(finish_reason)).to_vec();
                        b.extend_from_slice(b"data: [DONE]\n\n");
                        b
                    }
                    // The status line has gone out: an error travels as an event of the stream.
                    Some(Reply::Failed(m)) => {
                        let error = json!({"error": {"message": m, "type": "server_error"}});
                        format!("data: {error}\n\ndata: [DONE]\n\n").into_bytes()
                    }
                    _ => b"data: [DONE]\n\n".to_vec(),
                },
            };
            Some((Ok(Bytes::from(bytes)), (Step::Done, rx, stop, shape)))
        },
    );
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_recognised_with_parameters_and_in_any_case() {
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        for (v, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            assert_eq!(is_json(&h), ok, "{v}");
        }
    }
}
