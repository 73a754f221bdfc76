//! The operator's HTTP endpoint, on its own (private) address: Prometheus metrics, the health
//! and readiness probes an orchestrator polls, and the drain call a rolling restart makes.
//!
//! | route | answer |
//! |---|---|
//! | `GET /metrics` | the Prometheus text format |
//! | `GET /healthz` | 200 while the engine thread runs and goes round, else 503 (restart me) |
//! | `GET /readyz` | 200 while healthy and not draining, else 503 (send no new sessions) |
//! | `POST /drain` | 202, starts draining (idempotent); the body says how many sessions are left |
//!
//! Served with axum (on hyper, through `specinfer_net::http::serve`: bounded connections,
//! header timeouts) rather than by hand: request parsing, keep-alive and malformed-request
//! handling are a well-kept library's job. The endpoint has no
//! authentication: bind it to loopback or a cluster-internal address, never the public one.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;

use crate::service::VerifierControl;

/// How long a request may take to arrive and be answered.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The admin routes over `control`.
pub fn router(control: VerifierControl) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/drain", post(drain))
        .with_state(control)
}

/// Serves [`router`] on `listener`; returns only when the process ends.
pub async fn serve(listener: tokio::net::TcpListener, control: VerifierControl) {
    let app = router(control).layer(axum::middleware::from_fn(
        |req: axum::extract::Request, next: axum::middleware::Next| async move {
            match tokio::time::timeout(REQUEST_TIMEOUT, next.run(req)).await {
                Ok(response) => response,
                Err(_) => StatusCode::REQUEST_TIMEOUT.into_response(),
            }
        },
    ));
    specinfer_net::http::serve(listener, app).await
}

async fn metrics(State(c): State<VerifierControl>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        c.metrics().render(),
    )
}

async fn healthz(State(c): State<VerifierControl>) -> (StatusCode, &'static str) {
    if c.healthy() {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine thread stopped or hangs\n",
        )
    }
}

async fn readyz(State(c): State<VerifierControl>) -> (StatusCode, &'static str) {
    if c.ready() {
        (StatusCode::OK, "ready\n")
    } else if c.draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "unhealthy\n")
    }
}

async fn drain(State(c): State<VerifierControl>) -> (StatusCode, String) {
    c.drain();
    (
        StatusCode::ACCEPTED,
        format!("draining; sessions={}\n", c.sessions()),
    )
}
