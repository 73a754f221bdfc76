//! Limits that keep one client from hurting the others, and a verifier whose engine dies
//! saying so instead of pretending to serve.

use std::sync::Arc;

use specinfer_integration::{chat_ids, service_config, smollm2, API_KEY};
use specinfer_model::{Logits, ModelConfig, TreeModel};
use specinfer_net::{Remote, RemoteError};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::{self, ConnectionLimits, ServiceConfig};
use specinfer_wire::{ErrorCode, SamplingParams, TokenTree};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_gets_at_most_its_share_of_connections() {
    let (model, _) = smollm2();
    let cfg = ServiceConfig {
        connections: ConnectionLimits {
            per_address: 2,
            ..Default::default()
        },
        ..service_config(EngineConfig::default())
    };
    let (server, remote) = service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap();
    let first = Remote::connect(&remote).await.unwrap();
    let second = Remote::connect(&remote).await.unwrap();
    let third = Remote::connect(&remote).await;
    assert!(
        matches!(third, Err(RemoteError::Net(_))),
        "a third connection from one address was admitted"
    );
    assert_eq!(
        server
            .metrics()
            .connections_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A connection that ends gives its place back.
    first.shutdown().await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let again = Remote::connect(&remote).await.unwrap();
    again.shutdown().await;
    second.shutdown().await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holds_at_most_its_quota_of_sessions_and_admission_counts_what_sessions_may_grow_to()
{
    let (model, _) = smollm2();
    let cfg = service_config(EngineConfig {
        max_sessions_per_key: 2,
        // Room for two sessions of 64 + 16 tokens and a tree, not three.
        kv_budget_bytes: 3 * per_token_kv(model.config()) * (64 + 256) - 1,
        ..EngineConfig::default()
    });
    let (server, remote) = service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap();
    let conn = Remote::connect(&remote).await.unwrap();
    let prompt: Vec<u32> = chat_ids("Hi").into_iter().cycle().take(64).collect();
    let params = SamplingParams::greedy(16);
    let _a = conn.open(1, prompt.clone(), params.clone()).await.unwrap();
    let _b = conn.open(2, prompt.clone(), params.clone()).await.unwrap();
    match conn.open(3, prompt.clone(), params.clone()).await {
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::Busy));
            assert!(e.to_string().contains("quota"), "{e}");
        }
        Ok(_) => panic!("a third session beyond the key's quota"),
    }
    // With the quota lifted, the KV budget holds: two admitted sessions hold little now (a
    // 64-token prompt), but reserve what they may grow to.
    drop(conn);
    server.shutdown().await;
    let cfg = service_config(EngineConfig {
        max_sessions_per_key: 0,
        kv_budget_bytes: 2 * per_token_kv(model.config()) * (64 + 16 + 256) + 1,
        ..EngineConfig::default()
    });
    let (server, remote) = service::start_loopback(model.clone(), API_KEY.into(), cfg).unwrap();
    let conn = Remote::connect(&remote).await.unwrap();
    let _a = conn.open(1, prompt.clone(), params.clone()).await.unwrap();
    let _b = conn.open(2, prompt.clone(), params.clone()).await.unwrap();
    match conn.open(3, prompt.clone(), params.clone()).await {
        Err(e) => assert!(e.to_string().contains("reserved"), "{e}"),
        Ok(_) => panic!("admitted beyond the KV budget its sessions reserve"),
    }
    server.shutdown().await;
}

fn per_token_kv(cfg: &ModelConfig) -> usize {
    2 * cfg.n_layers * cfg.kv_row() * 4
}

/// SmolLM2, except that a tree of [`PanicOnTree::NODES`] nodes makes its forward panic: a bug
/// on the engine thread.
struct PanicOnTree(Arc<specinfer_model::Llama>);

impl PanicOnTree {
    const NODES: usize = 7;
}

impl TreeModel for PanicOnTree {
    type Cache = <specinfer_model::Llama as TreeModel>::Cache;

    fn config(&self) -> &ModelConfig {
        TreeModel::config(&*self.0)
    }

    fn new_cache(&self) -> specinfer_model::Result<Self::Cache> {
        self.0.new_cache()
    }

    fn committed(cache: &Self::Cache) -> usize {
        <specinfer_model::Llama as TreeModel>::committed(cache)
    }

    fn cache_bytes(cache: &Self::Cache) -> usize {
        <specinfer_model::Llama as TreeModel>::cache_bytes(cache)
    }

    fn forward_trees(
        &self,
        seqs: &mut [(&mut Self::Cache, &TokenTree)],
        logits: &[bool],
    ) -> specinfer_model::Result<Vec<Logits>> {
        assert!(
            seqs.iter().all(|(_, t)| t.len() != Self::NODES),
            "injected engine bug"
        );
        self.0.forward_trees(seqs, logits)
    }

    fn keep_path(&self, cache: &mut Self::Cache, path: &[u32]) -> specinfer_model::Result<()> {
        self.0.keep_path(cache, path)
    }

    fn truncate(&self, cache: &mut Self::Cache, len: usize) {
        self.0.truncate(cache, len)
    }

    fn gives_features(&self) -> bool {
        self.0.gives_features()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_batch_closes_its_sessions_and_the_engine_goes_on() {
    let (model, _) = smollm2();
    let (server, remote) = service::start_loopback(
        Arc::new(PanicOnTree(model.clone())),
        API_KEY.into(),
        service_config(EngineConfig::default()),
    )
    .unwrap();
    let control = server.control();
    let conn = Remote::connect(&remote).await.unwrap();
    let prompt = chat_ids("Hello");
    let root = *prompt.last().unwrap();
    let params = SamplingParams::greedy(16);
    let mut victim = conn.open(1, prompt.clone(), params.clone()).await.unwrap();
    let mut healthy = conn.open(2, prompt.clone(), params.clone()).await.unwrap();
    let before = healthy.verify(TokenTree::root(root)).await.unwrap();

    let deadly = TokenTree::chain(&[root; PanicOnTree::NODES]);
    match victim.verify(deadly).await {
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::Internal), "{e}");
            assert!(e.to_string().contains("session was closed"), "{e}");
        }
        Ok(v) => panic!("the injected panic answered {v:?}"),
    }
    // The session beside it goes on, new sessions open, and the verifier stays healthy.
    let after = healthy
        .verify(TokenTree::root(*before.tokens.last().unwrap()))
        .await
        .unwrap();
    assert_eq!(after.tokens.len(), 1);
    let _third = conn.open(3, prompt.clone(), params).await.unwrap();
    assert!(control.healthy() && !control.engine_stopped());
    let m = server.metrics();
    assert_eq!(
        m.engine_panics.load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(
        m.sessions_active.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    server.shutdown().await;
    // Once the engine thread has ended, the health check and new hellos say so.
    assert!(control.engine_stopped() && !control.healthy());
}
