//! The ONNX Runtime draft backend against the candle one: the same model, exported to ONNX, must
//! give the same logits through the whole draft life cycle (prefill, a tree grown over several
//! calls, keeping the accepted path, rolling back), for SSMs and for the feature-conditioned
//! drafter (whose deeper tree levels read its own predicted features).

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_integration::{cache_dir, default_ssm_dir};
use specinfer_model::{fetch, Arch, FeatureDrafter, Llama, ModelConfig};
use specinfer_onnx::{init_runtime, OnnxFeatureModel, OnnxModel};
use specinfer_speculator::{CachedDraft, DraftModel, FeatureDraft};
use specinfer_wire::TokenTree;

fn runtime() {
    static LOADED: std::sync::Once = std::sync::Once::new();
    LOADED.call_once(|| {
        let lib = fetch::ensure(&fetch::ONNXRUNTIME, &cache_dir()).expect("fetching ONNX Runtime");
        init_runtime(&lib).expect("loading ONNX Runtime");
    });
}

/// A private folder for an export named `name` (removed when dropped), and the file's path in it.
fn export_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    runtime();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{name}.onnx"));
    (dir, path)
}

fn export(model: &Llama, name: &str) -> OnnxModel {
    let (_dir, path) = export_path(name);
    model
        .export_onnx(&path, &[("specinfer.tokenizer_sha256", "00")])
        .unwrap();
    let onnx = OnnxModel::load(&path, 1).unwrap();
    assert!(
        OnnxFeatureModel::load(&path, 1).is_err(),
        "an SSM's export loaded as a feature drafter's"
    );
    assert_eq!(onnx.tokenizer_sha256(), Some("00"));
    onnx
}

fn export_feature(model: &FeatureDrafter, name: &str) -> OnnxFeatureModel {
    let (_dir, path) = export_path(name);
    model
        .export_onnx(&path, &[("specinfer.tokenizer_sha256", "00")])
        .unwrap();
    let onnx = OnnxFeatureModel::load(&path, 1).unwrap();
    assert!(
        OnnxModel::load(&path, 1).is_err(),
        "a feature drafter's export loaded as an SSM's"
    );
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
    let mut a = CachedDraft::new(candle);
    let mut b = CachedDraft::new(onnx);
    compare_drafts(&mut a, &mut b, None, vocab, prompt_len, seed)
}

/// [`compare`] for feature-conditioned drafts: each verdict gives both the same features
/// (random rows of width `dim`, as the LLM's would be) of the positions committed since.
fn compare_feature(
    candle: &FeatureDrafter,
    onnx: &OnnxFeatureModel,
    vocab: u32,
    prompt_len: usize,
    seed: u64,
) -> f32 {
    let mut a = FeatureDraft::new(candle);
    let mut b = FeatureDraft::new(onnx);
    let dim = candle.feature_dim();
    compare_drafts(&mut a, &mut b, Some(dim), vocab, prompt_len, seed)
}

fn compare_drafts(
    a: &mut dyn DraftModel,
    b: &mut dyn DraftModel,
    feature_dim: Option<usize>,
    vocab: u32,
    prompt_len: usize,
    seed: u64,
) -> f32 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut committed: Vec<u32> = (0..prompt_len)
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let mut worst = 0f32;
    // Positions whose features the drafts were given.
    let mut featured = 0;
    for round in 0..4 {
        if let Some(d) = feature_dim {
            // A verdict's features: every committed position but the last (the bonus token).
            let from = featured.min(committed.len() - 1);
            let rows: Vec<f32> = (0..(committed.len() - 1 - from) * d)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect();
            a.take_features(from, &rows, d);
            b.take_features(from, &rows, d);
            featured = committed.len() - 1;
            assert!(a.ready(&committed) && b.ready(&committed));
        }
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
            featured = featured.min(committed.len() - 1);
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

#[test]
fn onnx_export_matches_candle_for_feature_drafters() {
    let vocab = ModelConfig::tiny(Arch::Llama).vocab_size;
    let head: Vec<u32> = (0..vocab as u32).step_by(3).collect();
    let tiny = FeatureDrafter::random(vocab, 32, &head, 5).unwrap();
    let onnx = export_feature(&tiny, "feature-tiny");
    let worst = compare_feature(&tiny, &onnx, vocab as u32, 9, 5);
    eprintln!("tiny feature drafter: max |logit difference| candle vs ONNX Runtime = {worst:.2e}");
    assert!(
        worst < 1e-4,
        "tiny feature drafter: logits differ by {worst}"
    );

    let dir = default_ssm_dir().join("../feature-draft");
    let shipped = FeatureDrafter::from_safetensors(&dir).unwrap();
    let onnx = export_feature(&shipped, "feature-draft");
    let worst = compare_feature(&shipped, &onnx, shipped.config().vocab_size as u32, 40, 7);
    eprintln!("models/feature-draft: max |logit difference| candle vs ONNX Runtime = {worst:.2e}");
    assert!(
        worst < 2e-3,
        "models/feature-draft: logits differ by {worst}"
    );
}
