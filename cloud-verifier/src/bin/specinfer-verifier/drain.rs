//! Draining: on the serving side, the signal handling that turns SIGTERM into a drain and the
//! drain into an exit; on the operator's side, `specinfer-verifier drain`, which asks a running
//! verifier to drain over its admin endpoint and waits for it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use specinfer_verifier::service::VerifierControl;

/// Serves until asked to stop: Ctrl-C stops at once; SIGTERM or `POST /drain` drains, and the
/// drain ends when the last session has left, after `deadline`, or at a second signal. Errs
/// when the engine thread has died (a panic): the process should exit and be restarted by
/// whatever supervises it, its clients moving to other verifiers meanwhile.
pub async fn until_stopped(control: &VerifierControl, deadline: Duration) -> Result<()> {
    let mut term = terminate_signal();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => return Ok(()),
        _ = term.recv() => control.drain(),
        _ = until(|| control.draining()) => {}
        _ = until(|| control.engine_stopped()) => {
            bail!("the engine thread stopped (see the log above); exiting so that the verifier is restarted")
        }
    }
    let started = Instant::now();
    tracing::info!(
        sessions = control.sessions(),
        deadline_s = deadline.as_secs(),
        "draining: moving live sessions to other verifiers"
    );
    tokio::select! {
        _ = until(|| control.sessions() == 0) => tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "drained: no session left"
        ),
        _ = tokio::time::sleep(deadline) => tracing::warn!(
            sessions = control.sessions(),
            "drain deadline reached with sessions left"
        ),
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

/// Resolves once `condition` holds (checked every 100 ms): the verifier's state is in atomics
/// that other tasks and the engine thread change.
async fn until(condition: impl Fn() -> bool) {
    while !condition() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn terminate_signal() -> tokio::signal::unix::Signal {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler")
}

/// `specinfer-verifier drain`: asks for the drain, then asks again each second (the call is
/// idempotent and answers how many sessions are left) until none is, the verifier has exited
/// (it does once none is), or `timeout` passed.
pub fn run(admin: SocketAddr, timeout: Duration) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let started = Instant::now();
        let mut asked = false;
        loop {
            let body = match post(admin, "/drain").await {
                Ok(body) => body,
                // It exits once the last session has left.
                Err(_) if asked => {
                    println!("drained: the verifier has exited");
                    return Ok(());
                }
                Err(e) => return Err(e.context(format!("asking the verifier at {admin} to drain"))),
            };
            asked = true;
            let left: u64 = body
                .trim()
                .rsplit("sessions=")
                .next()
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("unexpected answer from {admin}: {body:?}"))?;
            println!("draining: {left} session(s) left");
            if left == 0 || started.elapsed() >= timeout {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// One HTTP/1.1 POST without a body; the answer's body, or an error on a non-2xx status.
async fn post(addr: SocketAddr, path: &str) -> Result<String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let request = hyper::Request::post(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        let body = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            bail!("{status}: {body}");
        }
        Ok(body)
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .context("no answer within 10 s")?
}
