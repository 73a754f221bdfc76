//! Tree forward == incremental decoding of every node's path, on tiny random models (llama and
//! qwen2, f32 and quantized), for single trees and packed batches.

use candle_core::quantized::GgmlDType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_model::{Arch, KvCache, Llama, ModelConfig, SeqTree};
use specinfer_wire::TokenTree;

/// Chains, stars, deep and bushy trees of 1..=64 nodes.
fn random_tree(rng: &mut ChaCha8Rng, vocab: u32) -> TokenTree {
    let n = rng.random_range(1..=64usize);
    let shape = rng.random_range(0..4);
    let mut tree = TokenTree::root(rng.random_range(0..vocab));
    for i in 1..n as u32 {
        let parent = match shape {
            0 => i - 1,                                 // chain
            1 => 0,                                     // star
            2 => i - 1 - rng.random_range(0..i.min(2)), // deep, occasional forks
            _ => rng.random_range(0..i),                // bushy
        };
        tree.push(parent, rng.random_range(0..vocab));
    }
    tree
}

/// Logits of every node by decoding its path one token at a time after `prompt`: depth-first, with
/// rollback, so each node costs one single-token forward.
fn incremental_logits(model: &Llama, prompt: &[u32], tree: &TokenTree) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(model.config());
    model.prefill(&mut cache, prompt).unwrap();
    let children = tree.children();
    let mut out = vec![Vec::new(); tree.len()];
    let mut stack = vec![0usize];
    let base = cache.committed();
    while let Some(node) = stack.pop() {
        // Rebuild the cache to hold exactly the path above `node`.
        let path = tree.path_to(node);
        cache.rollback(base);
        for &p in &path[..path.len() - 1] {
            let t = TokenTree::root(tree.token(p as usize));
            model.forward(&mut [SeqTree::new(&mut cache, &t)]).unwrap();
            cache.compact(&[0]);
        }
        let t = TokenTree::root(tree.token(node));
        let l = model.forward(&mut [SeqTree::new(&mut cache, &t)]).unwrap();
        out[node] = l[0].node(0).to_vec();
        stack.extend(children[node].iter().map(|&c| c as usize));
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits are O(1..10) here; float reassociation between a 1-row and an n-row matmul moves them by
/// ~1e-6 relative; 1e-3 absolute is far below any change a wrong mask or position would cause
/// (those move logits by O(1)).
const TOL: f32 = 1e-3;

fn check_model(model: &Llama, seed: u64, trees: usize) -> f32 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config().vocab_size as u32;
    let mut worst = 0f32;
    for _ in 0..trees {
        let prompt: Vec<u32> = (0..rng.random_range(1..20))
            .map(|_| rng.random_range(0..vocab))
            .collect();
        let tree = random_tree(&mut rng, vocab);
        let mut cache = KvCache::new(model.config());
        model.prefill(&mut cache, &prompt).unwrap();
        let got = model
            .forward(&mut [SeqTree::new(&mut cache, &tree)])
            .unwrap()
            .remove(0);
        let want = incremental_logits(model, &prompt, &tree);
        for (i, w) in want.iter().enumerate() {
            let d = max_diff(got.node(i), w);
            assert!(d < TOL, "node {i} of {tree:?}: max abs diff {d}");
            worst = worst.max(d);
        }
    }
    worst
}

#[test]
fn tree_logits_equal_incremental_logits_llama_f32() {
    let m = Llama::random(ModelConfig::tiny(Arch::Llama), 1, None).unwrap();
    let worst = check_model(&m, 10, 24);
    println!("llama f32: max abs diff {worst:e}");
}

#[test]
fn tree_logits_equal_incremental_logits_qwen2_quantized() {
    for dtype in [
        GgmlDType::Q8_0,
        GgmlDType::Q4_1,
        GgmlDType::Q4_0,
        GgmlDType::Q5_0,
    ] {
        let m = Llama::random(ModelConfig::tiny(Arch::Qwen2), 2, Some(dtype)).unwrap();
        let worst = check_model(&m, 11, 8);
        println!("qwen2 {dtype:?}: max abs diff {worst:e}");
    }
}

/// One forward's batch: each cache with its sequence's tree.
fn batch<'a>(caches: &'a mut [KvCache], seqs: &'a [(Vec<u32>, TokenTree)]) -> Vec<SeqTree<'a>> {
    caches
        .iter_mut()
        .zip(seqs)
        .map(|(cache, (_, tree))| SeqTree::new(cache, tree))
        .collect()
}

#[test]
fn a_packed_batch_equals_each_sequence_alone() {
    let m = Llama::random(ModelConfig::tiny(Arch::Llama), 3, Some(GgmlDType::Q8_0)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let vocab = m.config().vocab_size as u32;
    let seqs: Vec<(Vec<u32>, TokenTree)> = (0..5)
        .map(|_| {
            let prompt = (0..rng.random_range(1..30))
                .map(|_| rng.random_range(0..vocab))
                .collect();
            (prompt, random_tree(&mut rng, vocab))
        })
        .collect();
    let prefilled = || -> Vec<KvCache> {
        seqs.iter()
            .map(|(p, _)| {
                let mut c = KvCache::new(m.config());
                m.prefill(&mut c, p).unwrap();
                c
            })
            .collect()
    };
    let mut caches = prefilled();
    let batched = m.forward(&mut batch(&mut caches, &seqs)).unwrap();
    let mut worst = 0f32;
    for ((prompt, tree), got) in seqs.iter().zip(&batched) {
        let mut c = KvCache::new(m.config());
        m.prefill(&mut c, prompt).unwrap();
        let alone = m
            .forward(&mut [SeqTree::new(&mut c, tree)])
            .unwrap()
            .remove(0);
        for i in 0..tree.len() {
            let d = max_diff(got.node(i), alone.node(i));
            assert!(d < TOL, "node {i}: {d}");
            worst = worst.max(d);
        }
    }
    println!("batch of 5 vs alone: max abs diff {worst:e}");

    // Logits for some sequences only (prefill chunks batched with trees): the others get none,
    // and every cache ends up holding the same K/V as with all logits computed.
    let want = [true, false, true, false, false];
    let mut selected_caches = prefilled();
    let selected = m
        .forward_selected(&mut batch(&mut selected_caches, &seqs), &want)
        .unwrap();
    for (i, (((_, tree), got), &w)) in seqs.iter().zip(&selected).zip(&want).enumerate() {
        if w {
            for n in 0..tree.len() {
                assert!(
                    max_diff(got.node(n), batched[i].node(n)) < TOL,
                    "seq {i} node {n}"
                );
            }
        } else {
            assert_eq!(got.nodes(), 0, "seq {i} wanted no logits");
        }
    }
    for (a, b) in caches.iter().zip(&selected_caches) {
        for layer in 0..m.config().n_layers {
            let ((ka, va), (kb, vb)) = (a.layer(layer), b.layer(layer));
            let (ka, va, kb, vb) = (
                ka.to_f32_vec(),
                va.to_f32_vec(),
                kb.to_f32_vec(),
                vb.to_f32_vec(),
            );
            assert_eq!((ka.len(), va.len()), (kb.len(), vb.len()));
            assert!(
                max_diff(&ka, &kb) < TOL && max_diff(&va, &vb) < TOL,
                "layer {layer} K/V"
            );
        }
    }
}

#[test]
fn compaction_keeps_the_accepted_path_without_recompute() {
    let m = Llama::random(ModelConfig::tiny(Arch::Llama), 4, None).unwrap();
    let prompt = [5u32, 17, 42, 8];
    // Tree: 0 -> {1, 2}; 1 -> 3; 2 -> 4 -> 5.
    let tree = TokenTree::new(vec![9, 11, 12, 13, 14, 15], vec![0, 0, 1, 2, 4]).unwrap();
    let mut c = KvCache::new(m.config());
    m.prefill(&mut c, &prompt).unwrap();
    m.forward(&mut [SeqTree::new(&mut c, &tree)]).unwrap();
    assert_eq!(c.scratch(), 6);
    c.compact(&[0, 2, 4]);
    assert_eq!(c.committed(), prompt.len() + 3);
    // The next token after the compacted path must see exactly prompt + [9, 12, 14].
    let next = TokenTree::root(99);
    let got = m
        .forward(&mut [SeqTree::new(&mut c, &next)])
        .unwrap()
        .remove(0);
    let mut fresh = KvCache::new(m.config());
    m.prefill(&mut fresh, &[5, 17, 42, 8, 9, 12, 14]).unwrap();
    let want = m
        .forward(&mut [SeqTree::new(&mut fresh, &next)])
        .unwrap()
        .remove(0);
    let d = max_diff(got.node(0), want.node(0));
    assert!(d < TOL, "after compaction: {d}");
    // And a wrong path gives different logits (the test can fail).
    let mut wrong = KvCache::new(m.config());
    m.prefill(&mut wrong, &[5, 17, 42, 8, 9, 11, 13]).unwrap();
    let other = m
        .forward(&mut [SeqTree::new(&mut wrong, &next)])
        .unwrap()
        .remove(0);
    assert!(max_diff(other.node(0), want.node(0)) > 100.0 * TOL);
}

#[test]
fn extending_a_tree_level_by_level_equals_one_forward() {
    let m = Llama::random(ModelConfig::tiny(Arch::Qwen2), 5, Some(GgmlDType::Q8_0)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let prompt = [3u32, 1, 4, 1, 5];
    let mut whole = KvCache::new(m.config());
    let mut grown = KvCache::new(m.config());
    m.prefill(&mut whole, &prompt).unwrap();
    m.prefill(&mut grown, &prompt).unwrap();
    let mut tree = TokenTree::root(9);
    let mut logits = m
        .forward(&mut [SeqTree::new(&mut grown, &tree)])
        .unwrap()
        .remove(0)
        .node(0)
        .to_vec();
    let mut all = vec![logits.clone()];
    for _ in 0..4 {
        let first = tree.len();
        for _ in 0..rng.random_range(1..4) {
            let parent = rng.random_range(0..first) as u32;
            tree.push(parent, rng.random_range(0..101));
        }
        let out = m
            .forward(&mut [SeqTree {
                cache: &mut grown,
                tree: &tree,
                first,
            }])
            .unwrap()
            .remove(0);
        for i in 0..out.nodes() {
            all.push(out.node(i).to_vec());
        }
        logits = out.node(0).to_vec();
    }
    assert!(!logits.is_empty());
    let once = m
        .forward(&mut [SeqTree::new(&mut whole, &tree)])
        .unwrap()
        .remove(0);
    for (i, l) in all.iter().enumerate() {
        assert_eq!(
            once.node(i),
            &l[..],
            "node {i} differs between grown and one-shot forward"
        );
    }
}

/// The default f16 cache holds half the bytes of an f32 one, and its logits stay close to the
/// f32 cache's (f16 keeps 11 significant bits of each K/V value); with f32 nothing is rounded.
#[test]
fn an_f16_cache_holds_half_the_bytes_of_f32_and_nearly_its_logits() {
    use specinfer_model::KvPrecision;
    let m = Llama::random(ModelConfig::tiny(Arch::Llama), 8, None).unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 100).collect();
    let tree = {
        let mut t = TokenTree::root(7);
        for i in 1..9u32 {
            t.push(i / 2, (i * 13) % 100);
        }
        t
    };
    let logits = |precision| {
        let mut cache = KvCache::with_precision(m.config(), precision);
        m.prefill(&mut cache, &prompt).unwrap();
        let out = m.forward(&mut [SeqTree::new(&mut cache, &tree)]).unwrap();
        (out, cache.bytes(), cache.precision())
    };
    let (halves, half_bytes, p16) = logits(KvPrecision::default());
    let (floats, float_bytes, p32) = logits(KvPrecision::F32);
    assert_eq!((p16, p32), (KvPrecision::F16, KvPrecision::F32));
    assert_eq!(2 * half_bytes, float_bytes);
    let worst = (0..tree.len())
        .map(|n| max_diff(halves[0].node(n), floats[0].node(n)))
        .fold(0.0, f32::max);
    assert!(worst > 0.0, "f16 rounding moved nothing: is the cache f16?");
    assert!(worst < 0.05, "f16 cache moved logits by {worst}");
}
