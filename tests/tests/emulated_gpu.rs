//! The GPU engine behind the verifier service, on the emulated CUDA device
//! (`specinfer_model::cuda::EmulatedDevice`: `kernels/cuda/specinfer.cu` built for the host, a
//! fiber per CUDA thread): whole generations through the real client, QUIC and the service,
//! against the same service on the CPU engine, and the device's sampled walk against the host's.
//! Run by `scripts/test` (`--features cuda`); a tiny random Qwen2 model (NEOX RoPE, qkv bias)
//! keeps the emulation fast.
#![cfg(feature = "cuda")]

use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use specinfer_edge::{Client, Generation};
use specinfer_integration::{NoisyDraft, API_KEY};
use specinfer_model::cuda::checks::{on_gpu, prefill_gpu};
use specinfer_model::cuda::{CudaLlama, EmulatedDevice, Precision};
use specinfer_model::{Arch, Llama, ModelConfig, SampleWalk};
use specinfer_speculator::{DraftMode, Drafter, RoundDriver, Speculator, TreeShape};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::service::{self, ServiceConfig};
use specinfer_verifier::verify::{verify_stochastic, Verdict};
use specinfer_wire::{
    DrawMode, ModelFingerprint, Proposals, SamplingParams, SparseDist, TokenTree,
};

/// The tiny model: the same weights on every call (seeded).
fn tiny_model() -> Llama {
    Llama::random(ModelConfig::tiny(Arch::Qwen2), 7, None).unwrap()
}

fn tiny() -> &'static Llama {
    static MODEL: std::sync::OnceLock<Llama> = std::sync::OnceLock::new();
    MODEL.get_or_init(tiny_model)
}

fn on_emulated_gpu(model: &Llama) -> CudaLlama {
    CudaLlama::upload_to(
        model,
        EmulatedDevice::new().shared(),
        Precision::F32,
        64 << 20,
    )
    .unwrap()
}

fn service_config() -> ServiceConfig {
    ServiceConfig {
        engine: EngineConfig::default(),
        api_keys: None,
        model_name: "tiny-qwen2".into(),
        fingerprint: ModelFingerprint {
            vocab_size: 101,
            bos: None,
            eos: Vec::new(),
            tokenizer_sha256: [7; 32],
        },
        hello_timeout: Duration::from_secs(5),
        connections: Default::default(),
        server_draft: None,
    }
}

/// One generation through a verifier at `remote`, trees drafted (when `tree` is given) by the
/// LLM with seeded noise on its logits, so that rounds accept and reject at every depth.
async fn generate(
    remote: &specinfer_net::RemoteConfig,
    prompt: &[u32],
    params: SamplingParams,
    tree: Option<(Vec<usize>, DraftMode, u64)>,
) -> Generation {
    let drafter = tree.map(|(expansion, mode, seed)| Drafter {
        speculator: Speculator::new(expansion, mode, seed),
        drafts: vec![Box::new(NoisyDraft::new(tiny(), seed, 1.5))],
    });
    let mut driver = RoundDriver::new(prompt.to_vec(), params, drafter)
        .unwrap()
        .with_hand_off(false);
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let g = client.generate(&mut driver, |_| {}).await.unwrap();
    client.shutdown().await;
    g
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_generation_through_the_service_on_the_emulated_gpu_equals_the_cpu_engines() {
    let (cpu, cpu_remote) =
        service::start_loopback(Arc::new(tiny_model()), API_KEY.into(), service_config()).unwrap();
    let device = EmulatedDevice::new();
    let model = CudaLlama::upload_to(tiny(), device.shared(), Precision::F32, 64 << 20).unwrap();
    let (gpu, gpu_remote) =
        service::start_loopback(Arc::new(model), API_KEY.into(), service_config()).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for case in 0..2u64 {
        let prompt: Vec<u32> = (0..20 + 7 * case)
            .map(|_| rng.random_range(0..101))
            .collect();
        let params = SamplingParams::greedy(48);
        let reference = generate(&cpu_remote, &prompt, params.clone(), None).await;
        assert_eq!(reference.token_ids.len(), 48);
        let waits_before = device.synchronizations();
        let plain = generate(&gpu_remote, &prompt, params.clone(), None).await;
        assert_eq!(
            plain.token_ids, reference.token_ids,
            "plain decoding, prompt {case}"
        );
        let tree = Some((vec![2, 2, 1, 1], DraftMode::Greedy, case));
        let spec = generate(&gpu_remote, &prompt, params.clone(), tree).await;
        assert_eq!(
            spec.token_ids, reference.token_ids,
            "speculative decoding, prompt {case}"
        );
        assert!(
            spec.stats.rounds < 48,
            "the trees never had a node accepted ({} rounds)",
            spec.stats.rounds
        );
        println!(
            "prompt {case}: 48 tokens identical; speculative on the emulated GPU in {} rounds",
            spec.stats.rounds
        );
        // The verifier's cost fit times each batch: it must wait for the device first (a
        // GPU's forward returns at launch), at least once per round.
        let (waits, rounds) = (
            device.synchronizations() - waits_before,
            plain.stats.rounds + spec.stats.rounds,
        );
        assert!(
            waits >= rounds,
            "{waits} waits for the device over {rounds} rounds"
        );
    }
    cpu.shutdown().await;
    gpu.shutdown().await;
}

/// A tree whose root has `k` children drawn from a proposal over 8 tokens, the `favoured`
/// ones (the LLM's likeliest, so that acceptances and residuals with mass left happen) and
/// random others, with or without replacement, and one child of the first of them drawn
/// likewise: two depths of rejections and residuals.
fn sampled_tree(
    rng: &mut impl Rng,
    root: u32,
    favoured: &[u32],
    k: usize,
    mode: DrawMode,
    vocab: u32,
) -> TokenTree {
    let mut support: Vec<u32> = favoured.to_vec();
    while support.len() < 8 {
        let t = rng.random_range(0..vocab);
        if !support.contains(&t) {
            support.push(t);
        }
    }
    let raw: Vec<f32> = (0..8).map(|_| rng.random_range(0.05f32..1.0)).collect();
    let total: f32 = raw.iter().sum();
    let probs: Vec<f32> = raw.iter().map(|w| w / total).collect();
    let draw = |rng: &mut dyn rand::RngCore, taken: &mut Vec<u32>| -> u32 {
        loop {
            let u: f32 = rng.random();
            let mut acc = 0.0;
            let mut pick = support[7];
            for (t, p) in support.iter().zip(&probs) {
                acc += p;
                if u < acc {
                    pick = *t;
                    break;
                }
            }
            if mode == DrawMode::Iid || !taken.contains(&pick) {
                taken.push(pick);
                return pick;
            }
        }
    };
    let mut tree = TokenTree::root(root);
    let mut taken = Vec::new();
    for _ in 0..k {
        tree.push(0, draw(rng, &mut taken));
    }
    let mut deeper = Vec::new();
    tree.push(1, draw(rng, &mut deeper));
    let dist = |node| SparseDist {
        node,
        ids: support.clone(),
        probs: probs.clone(),
    };
    let mut drawn_from = vec![0u32; k];
    drawn_from.push(1);
    tree.with_proposals(Proposals {
        mode,
        dists: vec![dist(0), dist(1)],
        drawn_from,
    })
    .unwrap()
}

/// The device's sampled verification (`sample_walk`) decides exactly as the host's
/// `verify_stochastic` on the same logits and uniforms: i.i.d. and without-replacement draws,
/// temperatures and top-p values, 40 trees each, eight walks of each.
#[test]
fn the_device_walk_decides_exactly_as_the_host_walk() {
    let model = tiny();
    let gpu = on_emulated_gpu(model);
    let vocab = model.config().vocab_size as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let prompt: Vec<u32> = (0..12).map(|_| rng.random_range(0..vocab)).collect();
    let mut cache = gpu.new_cache().unwrap();
    prefill_gpu(&gpu, &mut cache, &prompt[..11]);
    // The LLM's four likeliest tokens after the prompt: every proposal holds them.
    let root_logits = on_gpu(&gpu, &mut cache, &TokenTree::root(prompt[11]), 0)
        .unwrap()
        .node(0)
        .to_vec();
    let mut favoured: Vec<u32> = (0..vocab).collect();
    favoured.sort_by(|&a, &b| root_logits[b as usize].total_cmp(&root_logits[a as usize]));
    favoured.truncate(4);
    let (mut differ, mut walks, mut accepted_later) = (0, 0, 0);
    for mode in [DrawMode::Iid, DrawMode::WithoutReplacement] {
        for (temperature, top_p) in [(1.0f32, 1.0f32), (0.7, 0.9), (0.3, 0.5)] {
            for _ in 0..40 {
                let tree = sampled_tree(&mut rng, prompt[11], &favoured, 3, mode, vocab);
                let logits = on_gpu(&gpu, &mut cache, &tree, 0).unwrap();
                // Eight walks of each tree, each with its own uniforms: decisions are many
                // per forward.
                for _ in 0..8 {
                    let seed: u64 = rng.random();
                    let stream = || {
                        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
                        r.set_stream(9);
                        r
                    };
                    let mut uniforms_rng = stream();
                    let uniforms = (0..tree.len())
                        .map(|_| uniforms_rng.random::<f64>())
                        .collect();
                    let walk = SampleWalk::new(&tree, temperature, top_p, uniforms).unwrap();
                    let device = Verdict::from_walk(logits.walk_on_device(&walk).unwrap().unwrap());
                    let dist = |n: usize| {
                        specinfer_kernels::sampling::distribution(
                            logits.node(n),
                            temperature,
                            0,
                            top_p,
                        )
                    };
                    let host = verify_stochastic(&tree, dist, &mut stream());
                    walks += 1;
                    // A child after the first accepted: its q' is the proposal less the earlier
                    // draws, renormalised, which the walks must agree on.
                    accepted_later += host.accepted.first().is_some_and(|&c| c > 1) as usize;
                    if (
                        &device.accepted,
                        device.next_token,
                        &device.rejected_at_depth,
                    ) != (&host.accepted, host.next_token, &host.rejected_at_depth)
                    {
                        differ += 1;
                        if differ <= 3 {
                            eprintln!(
                                "{mode:?} T {temperature} top-p {top_p}: device {:?} / {} / {:?}, host {:?} / {} / {:?}",
                                device.accepted, device.next_token, device.rejected_at_depth,
                                host.accepted, host.next_token, host.rejected_at_depth
                            );
                        }
                    }
                }
            }
        }
    }
    assert_eq!(
        differ, 0,
        "{differ} of {walks} walks decided otherwise on the device"
    );
    assert!(
        accepted_later >= walks / 20,
        "only {accepted_later} walks accepted a later child"
    );
    println!("{walks} walks identical, {accepted_later} accepted a child after the first");
}

/// Sampled generation through the service on the emulated GPU: the first token of 400
/// sessions, each a tree of three root children drawn without replacement by a noisy drafter
/// and verified by the device's walk (recursive rejection sampling), follows the LLM's
/// distribution (chi-square within df + 4 sqrt(2 df)).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_first_tokens_through_the_device_walk_follow_the_llms_distribution() {
    const SESSIONS: usize = 400;
    let (temperature, top_p) = (0.7f32, 0.95f32);
    let device = EmulatedDevice::new();
    let model = CudaLlama::upload_to(tiny(), device.shared(), Precision::F32, 64 << 20).unwrap();
    let (server, remote) =
        service::start_loopback(Arc::new(model), API_KEY.into(), service_config()).unwrap();
    let prompt: Vec<u32> = vec![12, 40, 7, 99, 3, 64, 20, 5];
    let mut kv = specinfer_model::KvCache::with_precision(
        tiny().config(),
        specinfer_model::KvPrecision::F32,
    );
    tiny().prefill(&mut kv, &prompt[..7]).unwrap();
    let root = tiny()
        .forward(&mut [specinfer_model::SeqTree::new(
            &mut kv,
            &TokenTree::root(prompt[7]),
        )])
        .unwrap()
        .remove(0);
    let p = specinfer_kernels::sampling::distribution(root.node(0), temperature, 0, top_p);
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let mut counts = vec![0usize; p.len()];
    for seed in 0..SESSIONS as u64 {
        let params = SamplingParams {
            mode: specinfer_wire::VerifyMode::Stochastic,
            temperature,
            top_p,
            top_k: 0,
            seed,
            max_new_tokens: 1,
            stop_ids: Vec::new(),
            return_features: false,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        };
        // The client's draws from a stream of their own (the request's seed salted, as every
        // front end does): drawn with the verifier's uniforms, acceptance would be biased.
        let drafter = Drafter {
            speculator: Speculator::for_request(
                TreeShape::Expansion(vec![3]),
                DraftMode::Sample {
                    temperature: 1.0,
                    top_p: 1.0,
                    top_k: 8,
                    draw: DrawMode::WithoutReplacement,
                },
                seed,
            ),
            drafts: vec![Box::new(NoisyDraft::new(tiny(), seed, 1.5))],
        };
        let mut driver = RoundDriver::new(prompt.clone(), params, Some(drafter))
            .unwrap()
            .with_hand_off(false);
        let g = client.generate(&mut driver, |_| {}).await.unwrap();
        counts[g.token_ids[0] as usize] += 1;
    }
    client.shutdown().await;
    server.shutdown().await;
    let walks = device.launched(specinfer_model::cuda::device::Kernel::SampleWalk);
    assert!(
        walks >= SESSIONS,
        "{walks} device walks for {SESSIONS} sampled rounds"
    );
    let (chi2, df, bound) = specinfer_model::cuda::checks::chi_square(&counts, &p);
    println!("{walks} device walks; chi-square {chi2:.1} over {df} degrees of freedom (bound {bound:.1})");
    assert!(
        chi2 <= bound,
        "chi-square {chi2:.1} over {df} degrees of freedom (bound {bound:.1})"
    );
}
