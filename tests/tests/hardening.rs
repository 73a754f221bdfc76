//! Limits that keep one client from hurting the others, and a verifier whose engine dies
//! saying so instead of pretending to serve.

use std::sync::Arc;

use specinfer_integration::{chat_ids, service_config, smollm2, API_KEY};
use specinfer_model::{Logits, ModelConfig, TreeModel, Want};
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
    2 * cfg.n_layers * cfg.kv_row() * specinfer_model::KvPrecision::default().bytes()
}

/// The LLM with a hook that sees the tree sizes of every forward on the engine thread, and may
/// panic there as an engine bug would.
struct Hooked {
    llm: Arc<specinfer_model::Llama>,
    on_forward: ForwardHook,
}

/// Called with the tree sizes of each forward.
type ForwardHook = Box<dyn Fn(&[usize]) + Send + Sync>;

impl TreeModel for Hooked {
    type Cache = <specinfer_model::Llama as TreeModel>::Cache;

    fn config(&self) -> &ModelConfig {
        TreeModel::config(&*self.llm)
    }

    fn new_cache(&self) -> specinfer_model::Result<Self::Cache> {
        self.llm.new_cache()
    }

    fn committed(cache: &Self::Cache) -> usize {
        <specinfer_model::Llama as TreeModel>::committed(cache)
    }

    fn cache_bytes(cache: &Self::Cache) -> usize {
        <specinfer_model::Llama as TreeModel>::cache_bytes(cache)
    }

    fn kv_position_bytes(&self) -> usize {
        self.llm.kv_position_bytes()
    }

    fn forward_trees(
        &self,
        seqs: &mut [(&mut Self::Cache, &TokenTree)],
        wants: &[Want],
    ) -> specinfer_model::Result<Vec<Logits>> {
        let sizes: Vec<usize> = seqs.iter().map(|(_, t)| t.len()).collect();
        (self.on_forward)(&sizes);
        self.llm.forward_trees(seqs, wants)
    }

    fn keep_path(&self, cache: &mut Self::Cache, path: &[u32]) -> specinfer_model::Result<()> {
        self.llm.keep_path(cache, path)
    }

    fn truncate(&self, cache: &mut Self::Cache, len: usize) {
        self.llm.truncate(cache, len)
    }

    fn gives_features(&self) -> bool {
        self.llm.gives_features()
    }
}

/// Trees of this size make the hooked model panic.
const DEADLY_NODES: usize = 7;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_batch_closes_its_sessions_and_the_engine_goes_on() {
    let (model, _) = smollm2();
    let deadly_size =
        Box::new(|sizes: &[usize]| assert!(!sizes.contains(&DEADLY_NODES), "injected engine bug"));
    let (server, remote) = service::start_loopback(
        Arc::new(Hooked {
            llm: model.clone(),
            on_forward: deadly_size,
        }),
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

    let deadly = TokenTree::chain(&[root; DEADLY_NODES]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_many_sessions_gets_no_more_of_the_forwards_than_a_key_with_one() {
    // One tree per forward (64 nodes hold one tree of 47 or 48, not two), so the order in
    // which the engine takes waiting rounds is the whole story.
    const ATTACK: usize = 48;
    const HEALTHY: usize = 47;
    let (model, _) = smollm2();
    let batches = Arc::new(std::sync::Mutex::new(Vec::<Vec<usize>>::new()));
    let seen = batches.clone();
    let hooked = Hooked {
        llm: model.clone(),
        on_forward: Box::new(move |sizes| seen.lock().unwrap().push(sizes.to_vec())),
    };
    let cfg = ServiceConfig {
        api_keys: specinfer_verifier::engine::key_id(Some("healthy"))
            .map(|k| [k].into_iter().collect()),
        ..service_config(EngineConfig {
            batch_node_budget: 64,
            ..EngineConfig::default()
        })
    };
    let (server, remote) = service::start_loopback(Arc::new(hooked), API_KEY.into(), cfg).unwrap();
    let prompt = chat_ids("Hello");
    let params = SamplingParams::greedy(256);
    let attacker = Remote::connect(&remote).await.unwrap();
    let healthy_key = specinfer_net::RemoteConfig {
        api_key: Some("healthy".into()),
        ..remote.clone()
    };
    let healthy = Remote::connect(&healthy_key).await.unwrap();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Six sessions of one key keep a full tree each in the queue.
    let mut flood = Vec::new();
    for id in 1..=6 {
        let mut session = attacker
            .open(id, prompt.clone(), params.clone())
            .await
            .unwrap();
        let (done, mut root) = (done.clone(), *prompt.last().unwrap());
        flood.push(tokio::spawn(async move {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                match session.verify(TokenTree::chain(&[root; ATTACK])).await {
                    Ok(v) if v.finish.is_none() => root = *v.tokens.last().unwrap(),
                    _ => break,
                }
            }
        }));
    }
    let mut session = healthy.open(100, prompt.clone(), params).await.unwrap();
    let mut root = *prompt.last().unwrap();
    for _ in 0..12 {
        let v = session
            .verify(TokenTree::chain(&[root; HEALTHY]))
            .await
            .unwrap();
        root = *v.tokens.last().unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for f in flood {
        let _ = f.await;
    }
    // Between two of the healthy key's forwards, at most two of the attacker's: the one
    // running when its round arrived, and at most one more taken before it. First come, first
    // served would make it wait behind all six.
    let order: Vec<bool> = batches
        .lock()
        .unwrap()
        .iter()
        .filter(|b| b.iter().any(|&n| n == ATTACK || n == HEALTHY))
        .map(|b| b.contains(&HEALTHY))
        .collect();
    let first = order.iter().position(|&h| h).unwrap();
    let last = order.iter().rposition(|&h| h).unwrap();
    let longest_wait = order[first..=last]
        .split(|&h| h)
        .map(<[bool]>::len)
        .max()
        .unwrap();
    assert_eq!(order.iter().filter(|&&h| h).count(), 12);
    assert!(
        longest_wait <= 2,
        "the healthy key waited {longest_wait} forwards: {order:?}"
    );
    server.shutdown().await;
}
