//! The Qwen coder pair end to end over loopback QUIC: the verifier runs
//! Qwen2.5-Coder-1.5B-Instruct, the client drafts with the SSM shipped for it
//! (`models/ssm-qwen2.5-coder-1.5b`, a Llama of 1/700 the LLM's compute whose head covers the
//! 8,192 tokens the LLM's answers use most, distilled from that model's own answers). Greedy
//! output must equal the verifier's incremental decoding token for token while drafts are
//! accepted, and sampled first tokens, drawn through the client's trees of SSM draws, must
//! follow the LLM's own distribution.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use specinfer_edge::Client;
use specinfer_integration::{cache_dir, service_config, API_KEY};
use specinfer_kernels::sampling::distribution;
use specinfer_model::{fetch, load_gguf, ChatMessage, KvCache, Llama, SeqTree, Tokenizer};
use specinfer_net::RemoteConfig;
use specinfer_speculator::{CachedDraft, DraftMode, Drafter, RoundDriver, Speculator, TreeShape};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::{self, RunningVerifier, ServiceConfig};
use specinfer_wire::{SamplingParams, TokenTree, VerifyMode};
use statrs::distribution::{ChiSquared, ContinuousCDF};

/// The LLM and its tokenizer, and the shipped SSM, loaded once per test binary.
fn models() -> &'static (Arc<Llama>, Tokenizer, Llama) {
    static MODELS: OnceLock<(Arc<Llama>, Tokenizer, Llama)> = OnceLock::new();
    MODELS.get_or_init(|| {
        let path = fetch::ensure(&fetch::QWEN25_CODER_15B, &cache_dir()).expect("fetching Qwen");
        let (llm, tok) = load_gguf(&path).expect("loading Qwen");
        let ssm = Llama::from_safetensors(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/ssm-qwen2.5-coder-1.5b"),
        )
        .expect("loading the shipped Qwen SSM");
        assert_eq!(
            ssm.config().vocab_size,
            llm.config().vocab_size,
            "the SSM speaks the LLM's tokens"
        );
        (Arc::new(llm), tok, ssm)
    })
}

fn start_qwen_verifier() -> (RunningVerifier, RemoteConfig) {
    let (llm, tok, _) = models();
    let cfg = ServiceConfig {
        model_name: "Qwen2.5-Coder-1.5B-Instruct".into(),
        fingerprint: tok.fingerprint(),
        ..service_config(EngineConfig::default())
    };
    service::start_loopback(llm.clone(), API_KEY.into(), cfg).expect("a verifier")
}

/// A client drafter over the shipped SSM.
fn ssm_drafter(shape: &str, mode: DraftMode, seed: u64) -> Drafter<'static> {
    let (_, _, ssm) = models();
    let shape: TreeShape = shape.parse().unwrap();
    Drafter {
        speculator: Speculator::with_shape(shape, mode, seed),
        drafts: vec![Box::new(CachedDraft::new(ssm))],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_qwen_coder_ssm_drafts_and_greedy_output_equals_incremental_decoding() {
    let (_, tok, _) = models();
    let (server, remote) = start_qwen_verifier();
    let max_new = 40;
    for question in [
        "Write a Python function that returns the n-th Fibonacci number.",
        "What does a hash map do? Answer in two sentences.",
    ] {
        let prompt = tok
            .encode(&tok.chat_prompt(&[ChatMessage::new("user", question)]))
            .unwrap();
        let params = SamplingParams::greedy(max_new);
        let mut client = Client::connect(remote.clone()).await.unwrap();
        let mut plain = RoundDriver::new(prompt.clone(), params.clone(), None).unwrap();
        let reference = client.generate(&mut plain, |_| {}).await.unwrap();
        let drafter = ssm_drafter("dynamic:16", DraftMode::Greedy, 1);
        let mut split = RoundDriver::new(prompt, params, Some(drafter)).unwrap();
        let g = client.generate(&mut split, |_| {}).await.unwrap();
        client.shutdown().await;
        assert_eq!(reference.token_ids.len(), max_new as usize);
        assert_eq!(
            g.token_ids, reference.token_ids,
            "the SSM's trees changed the greedy answer to {question:?}"
        );
        assert!(
            g.stats.rounds < reference.stats.rounds,
            "the verifier accepted none of the SSM's drafts for {question:?}"
        );
        println!(
            "{question:?}: {} rounds for {max_new} tokens (tau {:.2})",
            g.stats.rounds,
            max_new as f64 / g.stats.rounds as f64
        );
    }
    server.shutdown().await;
}

/// Sampled sessions of one token each, through the client's speculator drawing trees from the
/// SSM (without replacement, as the clients sample), the wire and the verifier's recursive
/// rejection sampling: the first token's counts against the LLM's distribution at T = 1. The
/// SSM proposes only its head's tokens and truncates its draws to 16 of them, so the residuals
/// carry most of the LLM's tail: a wrong residual or proposal would show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_first_tokens_through_the_qwen_ssm_follow_the_llm() {
    const TRIALS: u64 = 480;
    let (llm, tok, _) = models();
    let prompt = tok.encode("def is_prime(n):\n    ").unwrap();
    let p = {
        let mut kv = KvCache::new(llm.config());
        let out = llm
            .forward(&mut [SeqTree::new(&mut kv, &TokenTree::chain(&prompt))])
            .unwrap();
        distribution(out[0].node(prompt.len() - 1), 1.0, 0, 1.0)
    };
    // Cells: each token expected at least 5 times on its own, the rest pooled.
    let mut cells: Vec<u32> = (0..p.len() as u32)
        .filter(|&t| p[t as usize] as f64 * TRIALS as f64 >= 5.0)
        .collect();
    cells.sort_by(|a, b| p[*b as usize].total_cmp(&p[*a as usize]));
    assert!(
        cells.len() >= 3,
        "the prompt's next token must spread over several likely tokens"
    );
    let (server, remote) = start_qwen_verifier();
    let mut client = Client::connect(remote).await.unwrap();
    let mut observed = vec![0u64; cells.len() + 1];
    let mut drafted = 0;
    for trial in 0..TRIALS {
        let params = SamplingParams {
            mode: VerifyMode::Stochastic,
            temperature: 1.0,
            top_p: 1.0,
            seed: trial,
            ..SamplingParams::greedy(1)
        };
        let drafter = ssm_drafter("dynamic:8", DraftMode::sampled(1.0, 1.0), trial ^ 0x9e37);
        let mut driver = RoundDriver::new(prompt.clone(), params, Some(drafter)).unwrap();
        let g = client.generate(&mut driver, |_| {}).await.unwrap();
        let token = g.token_ids[0];
        drafted += usize::from(g.stats.tree_nodes > 1);
        let cell = cells.iter().position(|&c| c == token);
        observed[cell.unwrap_or(cells.len())] += 1;
    }
    client.shutdown().await;
    server.shutdown().await;
    let expected: Vec<f64> = cells
        .iter()
        .map(|&c| p[c as usize] as f64)
        .chain([1.0 - cells.iter().map(|&c| p[c as usize] as f64).sum::<f64>()])
        .map(|q| q * TRIALS as f64)
        .collect();
    let stat: f64 = observed
        .iter()
        .zip(&expected)
        .filter(|(_, &e)| e > 0.0)
        .map(|(&o, &e)| (o as f64 - e).powi(2) / e)
        .sum();
    let dof = expected.iter().filter(|&&e| e > 0.0).count() - 1;
    let p_value = 1.0 - ChiSquared::new(dof as f64).unwrap().cdf(stat);
    println!(
        "first tokens over {TRIALS} sessions: observed {observed:?}, expected {expected:.1?}, p-value {p_value:.3} ({drafted} sessions sent a tree)"
    );
    assert!(
        drafted > TRIALS as usize / 2,
        "few sessions drafted a tree: {drafted}"
    );
    assert!(
        p_value > 1e-3,
        "sampled first tokens do not follow the LLM: observed {observed:?}, expected {expected:.1?}"
    );
}
