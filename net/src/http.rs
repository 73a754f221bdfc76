//! What specinfer's HTTP endpoints (the OpenAI endpoint, the browser demo, the verifier's admin
//! endpoint) share: serving an axum router with bounds on every connection, and the Host check
//! against DNS rebinding (a web page whose own name resolves to this machine would otherwise
//! reach an endpoint as same-origin and read what it answers).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A request's headers must arrive within this (slow-loris connections are closed).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more wait in the kernel's backlog.
pub const MAX_CONNECTIONS: usize = 256;

/// Serves `app` on `listener` until the process ends: HTTP/1.1 through hyper, a task per
/// connection, at most [`MAX_CONNECTIONS`] at once, headers within [`HEADER_TIMEOUT`] (which
/// `axum::serve` does not bound). Accept errors (out of descriptors, a connection reset before
/// it was accepted) are logged and retried after a pause, never spun on nor fatal.
pub async fn serve(listener: tokio::net::TcpListener, app: axum::Router) {
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = connections
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        let (socket, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("accepting an HTTP connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let app = app.clone();
        tokio::spawn(async move {
            serve_connection(socket, peer, app).await;
            drop(permit);
        });
    }
}

async fn serve_connection(socket: tokio::net::TcpStream, peer: SocketAddr, app: axum::Router) {
    let service = hyper_util::service::TowerToHyperService::new(app);
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(socket), service);
    if let Err(e) = connection.await {
        tracing::debug!(%peer, "HTTP connection: {e}");
    }
}

/// Whether `host` (a `Host` header: a name or an address, maybe with a port) is served: IP
/// addresses and `localhost` always (no rebinding makes a browser send those for a page of its
/// own), other names only when `allowed` lists them.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    if let Some(v6) = host.strip_prefix('[') {
        return v6
            .split(']')
            .next()
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok());
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => host,
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_addresses_localhost_or_listed_names() {
        let listed = vec!["chat.example".to_string()];
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "[::1]:8080",
            "localhost:8080",
            "LOCALHOST",
            "10.0.0.7:80",
            "chat.example:443",
        ] {
            assert!(host_allowed(ok, &listed), "{ok}");
        }
        for refused in [
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io:8080",
            "[not-an-address]:80",
            "",
        ] {
            assert!(!host_allowed(refused, &listed), "{refused}");
        }
    }
}
