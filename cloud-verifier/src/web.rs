//! The browser demo's web server: the page, the `<specinfer-chat>` widget, its WebAssembly, the
//! SSM and tokenizer files, and `/config.json` telling the page where the WebTransport endpoint
//! is and which certificate hash to trust. HTTP/1.1 GET on loopback-style deployments
//! (`http://127.0.0.1` and `http://localhost` are secure contexts, so WebTransport works there),
//! served by `specinfer_net::http::serve` (axum on hyper, bounded connections and timeouts).
//!
//! Only the files registered here are served; nothing maps a URL to the file system. A Host that
//! is neither an IP address, `localhost` nor an allowed name is refused: `/config.json` may carry
//! an API key, which a page of another site must not read by rebinding its name to this address.
//! There are no test hooks here: the end-to-end test adds its own routes to [`router`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use specinfer_model::Tokenizer;

/// How long a request may take to be answered.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The files the demo serves, by URL path; shared by the server and whoever replaces one
/// (`/config.json` when the certificate is renewed).
#[derive(Clone, Default)]
pub struct WebFiles {
    files: Arc<RwLock<HashMap<String, (&'static str, Bytes)>>>,
}

impl WebFiles {
    /// Adds (or replaces) the file at `path`.
    pub fn add(&self, path: &str, content_type: &'static str, body: Vec<u8>) {
        self.files
            .write()
            .expect("never poisoned: no code panics holding it")
            .insert(path.to_owned(), (content_type, Bytes::from(body)));
    }

    /// The file at `path`, and its content type.
    pub fn get(&self, path: &str) -> Option<(&'static str, Bytes)> {
        let files = self.files.read().expect("never poisoned");
        files.get(path).cloned()
    }

    /// Adds a file read from disk, with the content type its extension implies.
    pub fn add_file(&self, path: &str, file: &std::path::Path) -> std::io::Result<()> {
        let ty = match file.extension().and_then(|e| e.to_str()) {
            Some("html") => "text/html; charset=utf-8",
            Some("js") => "text/javascript; charset=utf-8",
            Some("wasm") => "application/wasm",
            Some("json") => "application/json",
            _ => "application/octet-stream",
        };
        let body = std::fs::read(file)?;
        self.add(path, ty, body);
        Ok(())
    }
}

/// Where the page finds the verifier.
#[derive(Clone, Debug)]
pub struct DemoEndpoint {
    /// UDP port of the WebTransport endpoint, on the host the page came from.
    pub webtransport_port: u16,
    /// SHA-256 (hex) of its certificate, for `serverCertificateHashes`.
    pub certificate_sha256: String,
    /// Handed to the page; only for demos on a trusted network.
    pub api_key: Option<String>,
}

/// The demo's files: the page and widget from `web_dir`, the WebAssembly from `web_dir/pkg`
/// (built by `web/build.sh`), the SSM from `ssm_dir`, the LLM's tokenizer and chat settings
/// (with its context of `context_tokens`, to which the widget trims a conversation), and
/// `/config.json`.
pub fn demo_files(
    web_dir: &Path,
    ssm_dir: &Path,
    tokenizer: &Tokenizer,
    context_tokens: usize,
    endpoint: &DemoEndpoint,
) -> Result<WebFiles, String> {
    let files = WebFiles::default();
    let pkg = web_dir.join("pkg");
    for (url, file) in [
        ("/index.html", web_dir.join("index.html")),
        ("/specinfer-chat.js", web_dir.join("specinfer-chat.js")),
        ("/pkg/specinfer_wasm.js", pkg.join("specinfer_wasm.js")),
        (
            "/pkg/specinfer_wasm_bg.wasm",
            pkg.join("specinfer_wasm_bg.wasm"),
        ),
        ("/pkg/vendor.js", pkg.join("vendor.js")),
        ("/ssm/config.json", ssm_dir.join("config.json")),
        ("/ssm/model.safetensors", ssm_dir.join("model.safetensors")),
    ] {
        files.add_file(url, &file).map_err(|e| {
            let hint = if file.starts_with(&pkg) {
                " (build the WebAssembly first: web/build.sh)"
            } else {
                ""
            };
            format!("{}: {e}{hint}", file.display())
        })?;
    }
    files.add(
        "/tokenizer.json",
        "application/json",
        tokenizer.to_json().map_err(|e| e.to_string())?.into_bytes(),
    );
    files.add(
        "/chat.json",
        "application/json",
        serde_json::json!({
            "bos": tokenizer.bos(),
            "eos": tokenizer.eos(),
            "system": tokenizer.default_system(),
            "context_tokens": context_tokens,
        })
        .to_string()
        .into_bytes(),
    );
    set_endpoint(&files, endpoint);
    Ok(files)
}

/// Points the page at `endpoint`: `/config.json` (again, when the certificate is renewed; pages
/// loaded from then on trust the new one).
pub fn set_endpoint(files: &WebFiles, endpoint: &DemoEndpoint) {
    let config = serde_json::json!({
        "webtransport_port": endpoint.webtransport_port,
        "certificate_sha256": endpoint.certificate_sha256,
        "api_key": endpoint.api_key,
    });
    files.add(
        "/config.json",
        "application/json",
        config.to_string().into_bytes(),
    );
}

/// How often the browsers' certificate is replaced: well within the 13 days it lives, so that a
/// page loaded just before a renewal still connects for days.
pub const CERTIFICATE_RENEWAL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Replaces the WebTransport certificate every `every` and points `/config.json` at the new one
/// (the port and API key in `endpoint` stay); runs until the process ends.
pub async fn renew_certificates(
    webtransport: crate::service::WebTransportIdentity,
    files: WebFiles,
    mut endpoint: DemoEndpoint,
    names: Vec<String>,
    every: Duration,
) {
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        let renewed =
            specinfer_net::ServerIdentity::self_signed_for_browsers(&names).and_then(|identity| {
                webtransport.renew(&identity)?;
                Ok(identity.fingerprint())
            });
        match renewed {
            Ok(fingerprint) => {
                tracing::info!(certificate_sha256 = %fingerprint, "browser certificate renewed");
                endpoint.certificate_sha256 = fingerprint;
                set_endpoint(&files, &endpoint);
                wait = every;
            }
            // The old certificate still has days to live: try again in an hour.
            Err(e) => {
                tracing::error!("renewing the browser certificate: {e}");
                wait = Duration::from_secs(3600).min(every);
            }
        }
    }
}

/// The demo's routes: `files` by GET, behind the Host check (`allowed_hosts`: names served
/// besides IP addresses and `localhost`).
pub fn router(files: WebFiles, allowed_hosts: Vec<String>) -> Router {
    Router::new().fallback(serve_file).with_state(files).layer(
        axum::middleware::from_fn_with_state(Arc::new(allowed_hosts), check_host),
    )
}

/// Serves [`router`]`(files, allowed_hosts)` on `listener`; returns only when the process ends.
pub async fn serve_web(
    listener: tokio::net::TcpListener,
    files: WebFiles,
    allowed_hosts: Vec<String>,
) {
    specinfer_net::http::serve(listener, router(files, allowed_hosts)).await
}

async fn check_host(
    State(allowed): State<Arc<Vec<String>>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !specinfer_net::host_allowed(host, &allowed) {
        let message = format!(
            "Host {host:?} is not served here (start the verifier with --web-allowed-host to serve it)\n"
        );
        return (StatusCode::FORBIDDEN, message).into_response();
    }
    match tokio::time::timeout(REQUEST_TIMEOUT, next.run(request)).await {
        Ok(response) => response,
        Err(_) => StatusCode::REQUEST_TIMEOUT.into_response(),
    }
}

async fn serve_file(
    State(files): State<WebFiles>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Response {
    if method != axum::http::Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, "GET only\n").into_response();
    }
    let path = match uri.path() {
        "/" => "/index.html",
        p => p,
    };
    match files.get(path) {
        Some((content_type, body)) => (
            [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, "no-store"),
            ],
            body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "not found\n").into_response(),
    }
}
