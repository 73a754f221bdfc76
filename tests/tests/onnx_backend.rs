//! The ONNX Runtime draft backend against the candle one: the same model, exported to ONNX, must
//! give the same logits through the whole draft life cycle (prefill, a tree grown over several
//! calls, keeping the accepted path, rolling back).

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_integration::{cache_dir, default_ssm_dir};
use specinfer_model::{fetch, Arch, Llama, ModelConfig};
use specinfer_onnx::{init_runtime, OnnxModel};
use specinfer_speculator::{CachedDraft, DraftModel};
use specinfer_wire::TokenTree;

fn runtime() {
    static LOADED: std::sync::Once = std::sync::Once::new();
    LOADED.call_once(|| {
        let lib = fetch::ensure(&fetch::ONNXRUNTIME, &cache_dir()).expect("fetching ONNX Runtime");
        init_runtime(&lib).expect("loading ONNX Runtime");
    });
}

fn export(model: &Llama, name: &str) -> OnnxModel {
    runtime();
    let path: PathBuf =
        std::env::temp_dir().join(format!("specinfer-test-{}-{name}.onnx", std::process::id()));
    model
        .export_onnx(&path, &[("specinfer.tokenizer_sha256", "00")])
        .unwrap();
    let onnx = OnnxModel::load(&path, 1).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(onnx.tokenizer_sha256(), Some("00"));
    onnx
}

/// Largest |candle - onnx| over all logits; both must agree on which tokens are impossible.
fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        for (&p, &q) in x.iter().zip(y) {
            if p == f32::NEG_INFINITY || q == f32::NEG_INFINITY {
                assert_eq!(p, q, "one backend rules a token out, the other does not");
            } else {
                worst = worst.max((p - q).abs());
            }
        }
    }
    worst
}

fn random_tree(rng: &mut ChaCha8Rng, root: u32, nodes: usize, vocab: u32) -> TokenTree {
    let mut t = TokenTree::root(root);
    for i in 1..nodes {
        let parent = rng.random_range(0..i) as u32;
        t.push(parent, rng.random_range(0..vocab));
    }
    t
}

/// Drives both drafts through the same rounds and returns the largest logit difference.
fn compare(candle: &Llama, onnx: &OnnxModel, vocab: u32, prompt_len: usize, seed: u64) -> f32 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut a = CachedDraft::new(candle);
    let mut b = CachedDraft::new(onnx);
    let mut committed: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let mut worst = 0f32;
    for round in 0..4 {
        a.sync(&committed).unwrap();
        b.sync(&committed).unwrap();
        // A tree grown over two calls, as the speculator does level by level.
        let full = random_tree(&mut rng, *committed.last().unwrap(), 6 + 4 * round, vocab);
        let split = full.len() / 2;
        let parents = (1..split).map(|i| full.parent(i).unwrap() as u32).collect();
        let head = TokenTree::new(full.tokens()[..split].to_vec(), parents).unwrap();
        worst = worst.max(max_diff(
            &a.extend(&head, 0).unwrap(),
            &b.extend(&head, 0).unwrap(),
        ));
        worst = worst.max(max_diff(
            &a.extend(&full, split).unwrap(),
            &b.extend(&full, split).unwrap(),
        ));
        // Accept a root-to-node path plus one more token, as a verifier would.
        let leaf = rng.random_range(0..full.len());
        let path = full.path_to(leaf);
        committed.extend(path.iter().skip(1).map(|&n| full.token(n as usize)));
        committed.push(rng.random_range(0..vocab));
        if round == 2 {
            // A rollback: the next sync must recompute from an earlier prefix.
            committed.truncate(prompt_len - 2);
            committed.push(rng.random_range(0..vocab));
        }
    }
    worst
}

#[test]
fn onnx_export_matches_candle_on_tiny_models() {
    for (arch, seed) in [(Arch::Llama, 1), (Arch::Qwen2, 2)] {
        let cfg = ModelConfig::tiny(arch);
        let candle = Llama::random(cfg.clone(), seed, None).unwrap();
        let onnx = export(&candle, &format!("{arch:?}"));
        let worst = compare(&candle, &onnx, cfg.vocab_size as u32, 9, seed);
        eprintln!("{arch:?}: max |logit difference| candle vs ONNX Runtime = {worst:.2e}");
        assert!(worst < 1e-4, "{arch:?}: logits differ by {worst}");
    }
}

#[test]
fn onnx_export_matches_candle_on_default_ssm() {
    let candle = Llama::from_safetensors(&default_ssm_dir()).unwrap();
    let onnx = export(&candle, "ssm");
    let vocab = candle.config().vocab_size as u32;
    let worst = compare(&candle, &onnx, vocab, 40, 7);
    eprintln!("default SSM: max |logit difference| candle vs ONNX Runtime = {worst:.2e}");
    assert!(worst < 2e-3, "logits differ by {worst}");
}
