//! Shared fixtures for the integration tests: the real default LLM, a verifier on loopback, and a
//! stand-in drafter.

use std::path::{Path, PathBuf};
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

/// The `specinfer-verifier` binary of this build (`cargo test --workspace` builds it beside
/// the test binaries' folder).
pub fn verifier_exe() -> PathBuf {
    // target/release/deps/TEST-HASH -> target/release/specinfer-verifier
    let exe = std::env::current_exe().expect("the test binary's path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/PROFILE/deps")
        .join("specinfer-verifier");
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --release -p specinfer-verifier`",
        path.display()
    );
    path
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
    start_verifier_drafting(engine, None)
}

/// The default SSM, loaded once per test binary, as a verifier's own draft model.
pub fn default_ssm() -> &'static Llama {
    static SSM: OnceLock<Llama> = OnceLock::new();
    SSM.get_or_init(|| Llama::from_safetensors(&default_ssm_dir()).expect("loading the SSM"))
}

/// [`start_verifier`] with a draft model of the verifier's own (server-side speculation).
pub fn start_verifier_drafting(
    engine: EngineConfig,
    server_draft: Option<&'static Llama>,
) -> (RunningVerifier, RemoteConfig) {
    start_verifier_with(engine, server_draft, &[])
}

/// [`start_verifier`] that also accepts `other_keys` besides [`API_KEY`].
pub fn start_verifier_with(
    engine: EngineConfig,
    server_draft: Option<&'static Llama>,
    other_keys: &[&str],
) -> (RunningVerifier, RemoteConfig) {
    let (model, _) = smollm2();
    let cfg = ServiceConfig {
        api_keys: Some(
            other_keys
                .iter()
                .filter_map(|k| specinfer_verifier::engine::key_id(Some(k)))
                .collect(),
        ),
        server_draft: server_draft.map(|m| m as specinfer_verifier::engine::ServerDraft),
        ..service_config(engine)
    };
    service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap()
}

/// The tests' service configuration for SmolLM2 around `engine`: no key but the one
/// [`service::start_loopback`] adds, no draft model of its own, default connection limits.
pub fn service_config(engine: EngineConfig) -> ServiceConfig {
    let (_, tok) = smollm2();
    ServiceConfig {
        engine,
        api_keys: None,
        model_name: "SmolLM2-135M-Instruct".into(),
        fingerprint: tok.fingerprint(),
        hello_timeout: Duration::from_secs(5),
        connections: Default::default(),
        server_draft: None,
    }
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

pub use specinfer_net::UdpRelay;

/// A raw QUIC connection to `remote` from `bind` (an address of this host, so tests can speak
/// from addresses of their own), before any hello: for tests that speak the protocol frame by
/// frame.
pub async fn raw_connection(
    remote: &RemoteConfig,
    bind: &str,
) -> Result<(quinn::Endpoint, quinn::Connection), String> {
    let mut endpoint = quinn::Endpoint::client(bind.parse().map_err(|e| format!("{bind}: {e}"))?)
        .map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(
        specinfer_net::client_config(&remote.trust).map_err(|e| e.to_string())?,
    );
    let conn = endpoint
        .connect(remote.addr, "localhost")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    Ok((endpoint, conn))
}

/// [`raw_connection`] that has said hello with `api_key` and `fingerprint`, and the verifier's
/// answer.
pub async fn raw_hello(
    remote: &RemoteConfig,
    bind: &str,
    api_key: &str,
    fingerprint: specinfer_wire::ModelFingerprint,
) -> (quinn::Endpoint, quinn::Connection, specinfer_wire::Message) {
    use specinfer_wire::{ClientHello, Limits, Message, PROTOCOL_VERSION};
    let (endpoint, conn) = raw_connection(remote, bind).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = ClientHello {
        protocol_version: PROTOCOL_VERSION,
        expected_model: fingerprint,
        api_key: Some(api_key.into()),
    };
    specinfer_net::write_frame(&mut send, &Message::ClientHello(hello))
        .await
        .unwrap();
    let (reply, _) = specinfer_net::read_frame(&mut recv, &Limits::default())
        .await
        .unwrap()
        .unwrap();
    (endpoint, conn, reply)
}
