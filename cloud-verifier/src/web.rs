//! The browser demo's web server: the page, the `<specinfer-chat>` widget, its WebAssembly, the
//! SSM and tokenizer files, and `/config.json` telling the page where the WebTransport endpoint
//! is and which certificate hash to trust. Plain HTTP/1.1 GET on loopback-style deployments
//! (`http://127.0.0.1` and `http://localhost` are secure contexts, so WebTransport works there).
//!
//! Only the files registered here are served; nothing maps a URL to the file system.
//!
//! `POST /report` (a page reporting a finished answer, used by the end-to-end test) is answered
//! and handed to whoever holds the receiving end; `GET /hold` stays open until the next report,
//! which keeps a headless browser's virtual clock from running out while the answer is generated.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use specinfer_model::Tokenizer;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// The files the demo serves, by URL path.
#[derive(Clone, Default)]
pub struct WebFiles {
    files: HashMap<String, (&'static str, Arc<Vec<u8>>)>,
}

impl WebFiles {
    pub fn add(&mut self, path: &str, content_type: &'static str, body: Vec<u8>) {
        self.files
            .insert(path.to_owned(), (content_type, Arc::new(body)));
    }

    /// Adds a file read from disk, with the content type its extension implies.
    pub fn add_file(&mut self, path: &str, file: &std::path::Path) -> std::io::Result<()> {
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
pub struct DemoEndpoint {
    /// UDP port of the WebTransport endpoint, on the host the page came from.
    pub webtransport_port: u16,
    /// SHA-256 (hex) of its certificate, for `serverCertificateHashes`.
    pub certificate_sha256: String,
    /// Handed to the page; only for demos on a trusted network.
    pub api_key: Option<String>,
}

/// The demo's files: the page and widget from `web_dir`, the WebAssembly from `web_dir/pkg`
/// (built by `web/build.sh`), the SSM from `ssm_dir`, the LLM's tokenizer and chat settings,
/// and `/config.json`.
pub fn demo_files(
    web_dir: &Path,
    ssm_dir: &Path,
    tokenizer: &Tokenizer,
    endpoint: &DemoEndpoint,
) -> Result<WebFiles, String> {
    let mut files = WebFiles::default();
    let pkg = web_dir.join("pkg");
    for (url, file) in [
        ("/index.html", web_dir.join("index.html")),
        ("/specinfer-chat.js", web_dir.join("specinfer-chat.js")),
        ("/pkg/specinfer_wasm.js", pkg.join("specinfer_wasm.js")),
        (
            "/pkg/specinfer_wasm_bg.wasm",
            pkg.join("specinfer_wasm_bg.wasm"),
        ),
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
    let json = |v: serde_json::Value| v.to_string().into_bytes();
    files.add(
        "/tokenizer.json",
        "application/json",
        tokenizer.to_json().map_err(|e| e.to_string())?.into_bytes(),
    );
    files.add(
        "/chat.json",
        "application/json",
        json(serde_json::json!({
            "bos": tokenizer.bos(),
            "eos": tokenizer.eos(),
            "system": tokenizer.default_system(),
        })),
    );
    files.add(
        "/config.json",
        "application/json",
        json(serde_json::json!({
            "webtransport_port": endpoint.webtransport_port,
            "certificate_sha256": endpoint.certificate_sha256,
            "api_key": endpoint.api_key,
        })),
    );
    Ok(files)
}

/// Largest request (headers and body) the server reads.
const MAX_REQUEST: usize = 64 << 10;

/// Serves `files` on `listener`; reports POSTed to `/report` go to `reports`.
pub async fn serve_web(
    listener: tokio::net::TcpListener,
    files: WebFiles,
    reports: mpsc::UnboundedSender<String>,
) {
    let files = Arc::new(files);
    // Counts reports; a hold waits for the count to change.
    let (reported_tx, reported_rx) = watch::channel(0u64);
    let reported_tx = Arc::new(reported_tx);
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let (files, reports) = (files.clone(), reports.clone());
        let (reported_tx, mut reported_rx) = (reported_tx.clone(), reported_rx.clone());
        tokio::spawn(async move {
            let Some((head, body)) = read_request(&mut sock).await else {
                return;
            };
            let line = head.lines().next().unwrap_or("");
            let mut parts = line.split(' ');
            let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let path = target.split('?').next().unwrap_or("");
            let (status, ty, content): (&str, &str, Arc<Vec<u8>>) = match (method, path) {
                ("POST", "/report") => {
                    let _ = reports.send(String::from_utf8_lossy(&body).into_owned());
                    reported_tx.send_modify(|n| *n += 1);
                    ("200 OK", "text/plain", Arc::new(b"ok\n".to_vec()))
                }
                ("GET", "/hold") => {
                    reported_rx.borrow_and_update();
                    let _ =
                        tokio::time::timeout(Duration::from_secs(600), reported_rx.changed()).await;
                    ("200 OK", "text/plain", Arc::new(b"done\n".to_vec()))
                }
                ("GET", p) => match files.files.get(if p == "/" { "/index.html" } else { p }) {
                    Some((ty, body)) => ("200 OK", *ty, body.clone()),
                    None => (
                        "404 Not Found",
                        "text/plain",
                        Arc::new(b"not found\n".to_vec()),
                    ),
                },
                _ => (
                    "405 Method Not Allowed",
                    "text/plain",
                    Arc::new(b"GET only\n".to_vec()),
                ),
            };
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ty}\r\ncontent-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n",
                content.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(&content).await;
        });
    }
}

/// Reads a request's head and (for a POST) its body, within [`MAX_REQUEST`] and 10 seconds.
async fn read_request(sock: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let read = async {
        let mut chunk = [0u8; 4096];
        loop {
            let n = sock.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > MAX_REQUEST {
                return None;
            }
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                let length: usize = head
                    .lines()
                    .filter_map(|l| l.split_once(':'))
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                if length > MAX_REQUEST {
                    return None;
                }
                while buf.len() < end + 4 + length {
                    let n = sock.read(&mut chunk).await.ok()?;
                    if n == 0 {
                        return None;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                return Some((head, buf[end + 4..end + 4 + length].to_vec()));
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()
        .flatten()
}
