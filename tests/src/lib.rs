//! Shared fixtures for the integration tests: the real default LLM, a verifier on loopback, and a
//! stand-in drafter.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use specinfer_model::{fetch, load_gguf, ChatMessage, Llama, ModelError, Tokenizer};
use specinfer_net::RemoteConfig;
use specinfer_speculator::{CachedDraft, DraftModel};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::{self, RunningVerifier, ServiceConfig};
use specinfer_wire::TokenTree;

pub const API_KEY: &str = "test-key";

/// The model cache: `$SPECINFER_CACHE`, else the repository's `.cache/specinfer`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/specinfer"))
}

/// The SSM committed under `models/ssm`.
pub fn default_ssm_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/ssm")
}

/// SmolLM2-135M-Instruct, fetched once into the cache and loaded once per test binary.
pub fn smollm2() -> &'static (Arc<Llama>, Tokenizer) {
    static MODEL: OnceLock<(Arc<Llama>, Tokenizer)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = fetch::ensure(&fetch::SMOLLM2_135M, &cache_dir()).expect("fetching SmolLM2");
        let (m, t) = load_gguf(&path).expect("loading SmolLM2");
        (Arc::new(m), t)
    })
}

pub fn chat_ids(prompt: &str) -> Vec<u32> {
    let (_, tok) = smollm2();
    tok.encode(&tok.chat_prompt(&[ChatMessage::new("user", prompt)]))
        .unwrap()
}

/// A verifier on 127.0.0.1 with a fresh pinned certificate; returns it and a client config.
pub fn start_verifier(engine: EngineConfig) -> (RunningVerifier, RemoteConfig) {
    let (model, tok) = smollm2();
    let cfg = ServiceConfig {
        engine,
        api_keys: None,
        model_name: "SmolLM2-135M-Instruct".into(),
        fingerprint: tok.fingerprint(),
        hello_timeout: Duration::from_secs(5),
    };
    service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap()
}

/// The LLM itself with seeded noise on its logits: it proposes the LLM's own top-k, often in the
/// wrong order, so rounds accept through later siblings and reject at every depth.
pub struct NoisyDraft<'m> {
    inner: CachedDraft<'m>,
    rng: rand_chacha::ChaCha8Rng,
    noise: f32,
}

impl<'m> NoisyDraft<'m> {
    pub fn new(model: &'m Llama, seed: u64, noise: f32) -> Self {
        NoisyDraft {
            inner: CachedDraft::new(model),
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            noise,
        }
    }
}

impl DraftModel for NoisyDraft<'_> {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        self.inner.sync(committed)
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut l = self.inner.extend(tree, first)?;
        for row in &mut l {
            row.iter_mut()
                .for_each(|x| *x += self.rng.random_range(0.0..self.noise));
        }
        Ok(l)
    }
}

/// A UDP relay in front of a verifier whose existing flows can be cut (their datagrams dropped
/// both ways), as when a laptop's network dies; flows that start later go through. A client
/// then sees its connection time out and must reconnect from a new socket.
pub struct UdpRelay {
    pub addr: std::net::SocketAddr,
    flows: Arc<std::sync::Mutex<Vec<Arc<RelayFlow>>>>,
    task: tokio::task::JoinHandle<()>,
}

struct RelayFlow {
    client: std::net::SocketAddr,
    upstream: tokio::net::UdpSocket,
    dead: std::sync::atomic::AtomicBool,
}

impl UdpRelay {
    /// Starts relaying to `server` (must run inside a tokio runtime).
    pub async fn start(server: std::net::SocketAddr) -> std::io::Result<UdpRelay> {
        use std::sync::atomic::Ordering;
        let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await?);
        let addr = front.local_addr()?;
        let flows: Arc<std::sync::Mutex<Vec<Arc<RelayFlow>>>> = Default::default();
        let task_flows = flows.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                let known = task_flows
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|f| f.client == from)
                    .cloned();
                let flow = match known {
                    Some(f) => f,
                    None => {
                        let Ok(upstream) = tokio::net::UdpSocket::bind("127.0.0.1:0").await else {
                            continue;
                        };
                        if upstream.connect(server).await.is_err() {
                            continue;
                        }
                        let flow = Arc::new(RelayFlow {
                            client: from,
                            upstream,
                            dead: false.into(),
                        });
                        task_flows.lock().unwrap().push(flow.clone());
                        let (back, front) = (flow.clone(), front.clone());
                        tokio::spawn(async move {
                            let mut buf = vec![0u8; 65536];
                            while let Ok(n) = back.upstream.recv(&mut buf).await {
                                if !back.dead.load(Ordering::Relaxed) {
                                    let _ = front.send_to(&buf[..n], back.client).await;
                                }
                            }
                        });
                        flow
                    }
                };
                if !flow.dead.load(Ordering::Relaxed) {
                    let _ = flow.upstream.send(&buf[..n]).await;
                }
            }
        });
        Ok(UdpRelay { addr, flows, task })
    }

    /// Drops every datagram of the flows that exist now, from now on.
    pub fn cut_existing(&self) {
        for f in self.flows.lock().unwrap().iter() {
            f.dead.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
