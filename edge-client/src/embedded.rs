//! An in-process verifier on loopback, for the first run without a server: the same QUIC path as
//! a remote verifier, with a fresh self-signed certificate pinned and a random API key.

use std::sync::Arc;
use std::time::Duration;

use specinfer_model::{Llama, Tokenizer};
use specinfer_net::{NetError, RemoteConfig};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::{self, ServiceConfig};
use tokio::sync::oneshot;

pub struct EmbeddedVerifier {
    pub remote: RemoteConfig,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EmbeddedVerifier {
    /// Starts the verifier on its own thread and runtime, so a client blocking on drafting never
    /// stalls it.
    pub fn start(
        model: Arc<Llama>,
        tokenizer: &Tokenizer,
        engine: EngineConfig,
    ) -> Result<Self, NetError> {
        let cfg = ServiceConfig {
            engine,
            api_keys: None,
            model_name: "embedded".into(),
            fingerprint: tokenizer.fingerprint(),
            hello_timeout: Duration::from_secs(10),
            connections: Default::default(),
            server_draft: None,
        };
        let api_key = random_key();
        let (remote_tx, remote_rx) = std::sync::mpsc::channel::<Result<RemoteConfig, NetError>>();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("specinfer-embedded-verifier".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => return drop(remote_tx.send(Err(e.into()))),
                };
                rt.block_on(async move {
                    match service::start_loopback(model, api_key, cfg) {
                        Ok((server, remote)) => {
                            let _ = remote_tx.send(Ok(remote));
                            let _ = stopped.await;
                            server.shutdown().await;
                        }
                        Err(e) => drop(remote_tx.send(Err(e))),
                    }
                });
            })?;
        let remote = remote_rx
            .recv()
            .map_err(|_| NetError::Tls("embedded verifier thread died".into()))??;
        Ok(EmbeddedVerifier {
            remote,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for EmbeddedVerifier {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn random_key() -> String {
    (0..4)
        .map(|_| format!("{:016x}", crate::setup::fresh_seed()))
        .collect()
}
