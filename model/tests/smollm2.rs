//! The engine on the real default LLM, SmolLM2-135M-Instruct Q4_1 (fetched once into the cache).

use std::path::PathBuf;
use std::sync::OnceLock;

use rand::{Rng, SeedableRng};
use specinfer_model::{fetch, load_gguf, ChatMessage, KvCache, Llama, SeqTree, Tokenizer};
use specinfer_wire::TokenTree;

fn smollm2() -> &'static (Llama, Tokenizer) {
    static MODEL: OnceLock<(Llama, Tokenizer)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let cache = std::env::var_os("SPECINFER_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/specinfer")
            });
        let path = fetch::ensure(&fetch::SMOLLM2_135M, &cache).expect("fetching SmolLM2");
        load_gguf(&path).expect("loading SmolLM2")
    })
}

#[test]
fn tokenizer_matches_the_gguf_reference() {
    let (_, tok) = smollm2();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.encode("Hello").unwrap(), vec![19556]);
    assert_eq!(tok.bos(), Some(1));
    assert!(tok.eos().contains(&2), "<|im_end|> (2) must end generation");
    // Digits are split one by one; no prefix space is added at the start.
    assert_eq!(tok.encode("2024").unwrap().len(), 4);
    assert_eq!(tok.encode(" Hello").unwrap().len(), 1);
    assert_ne!(tok.encode(" Hello").unwrap(), vec![19556]);

    let prompt = tok.chat_prompt(&[ChatMessage::new("user", "What is 12+30?")]);
    assert!(prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    let ids = tok.encode(&prompt).unwrap();
    // Special tokens are single ids: <|im_start|> = 1, <|im_end|> = 2.
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&t| t == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&t| t == 2).count(), 2);
    assert_eq!(tok.decode(&ids).unwrap(), prompt);

    for text in [
        "Ça coûte 3€ — naïve café, façade; Ångström",
        "東京タワーは高い。中文测试，한국어",
        "emoji 🚀🎉👩‍👩‍👧 and ZWJ",
        "fn main() {\n\tprintln!(\"{}\", 1_000);\n}\r\n  two  spaces\n\n\nend",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "round trip of {text:?}");
    }
}

#[test]
fn exported_tokenizer_json_loads_and_agrees() {
    let (_, tok) = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    tok.save(&path).unwrap();
    let back = Tokenizer::from_file(&path, tok.bos(), tok.eos().to_vec()).unwrap();
    let text = "<|im_start|>user\nCount 1 2 3, café 東京 🚀<|im_end|>\n";
    assert_eq!(back.encode(text).unwrap(), tok.encode(text).unwrap());
    assert_eq!(back.sha256(), tok.sha256());
}

/// Every node's logits from one tree forward equal those of decoding its path token by token.
#[test]
fn tree_forward_equals_incremental_decoding_on_smollm2() {
    let (model, tok) = smollm2();
    let prompt = tok
        .encode(&tok.chat_prompt(&[ChatMessage::new("user", "Name three colours.")]))
        .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut worst = 0f32;
    for (n, bushy) in [(1usize, false), (9, false), (24, true), (64, true)] {
        let mut tree = TokenTree::root(*prompt.last().unwrap());
        for i in 1..n as u32 {
            let parent = if bushy { rng.random_range(0..i) } else { i - 1 };
            tree.push(parent, rng.random_range(0..49152));
        }
        let mut cache = KvCache::new(model.config());
        model
            .prefill(&mut cache, &prompt[..prompt.len() - 1])
            .unwrap();
        let base = cache.committed();
        let logits = model
            .forward(&mut [SeqTree::new(&mut cache, &tree)])
            .unwrap()
            .remove(0);
        // Check a sample of nodes (all of them for the small trees) against their paths.
        let nodes: Vec<usize> = if n <= 9 {
            (0..n).collect()
        } else {
            (0..6).map(|_| rng.random_range(0..n)).collect()
        };
        for node in nodes {
            cache.rollback(base);
            let path: Vec<u32> = tree
                .path_to(node)
                .iter()
                .map(|&i| tree.token(i as usize))
                .collect();
            if path.len() > 1 {
                model.prefill(&mut cache, &path[..path.len() - 1]).unwrap();
            }
            let last = TokenTree::root(*path.last().unwrap());
            let want = model
                .forward(&mut [SeqTree::new(&mut cache, &last)])
                .unwrap()
                .remove(0);
            let d = logits
                .node(node)
                .iter()
                .zip(want.node(0))
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // The kernels are batch invariant (quantized matmul row by row with exact integer
            // block dots, attention per node in a fixed order): not close, identical.
            assert_eq!(d, 0.0, "tree of {n}, node {node}: max abs diff {d}");
            worst = worst.max(d);
        }
    }
    println!("SmolLM2 tree vs incremental: max abs logit diff {worst:e}");
}

/// A node's logits are bit-identical alone, inside trees of several sizes, and inside batches of
/// several sequences: the property that keeps greedy speculation from ever flipping a near-tie.
#[test]
fn batch_invariance_on_smollm2() {
    let (model, tok) = smollm2();
    let prompts: Vec<Vec<u32>> = [
        "Hi!",
        "Tell me about the moon.",
        "Sort [3, 1, 2] in Python.",
    ]
    .iter()
    .map(|p| {
        tok.encode(&tok.chat_prompt(&[ChatMessage::new("user", p)]))
            .unwrap()
    })
    .collect();
    // The probe: node logits of the first sequence's root and its first child.
    let probe = |extra_children: usize, batch: usize| -> (Vec<f32>, Vec<f32>) {
        let mut caches: Vec<KvCache> = prompts[..batch]
            .iter()
            .map(|p| {
                let mut c = KvCache::new(model.config());
                model.prefill(&mut c, &p[..p.len() - 1]).unwrap();
                c
            })
            .collect();
        let trees: Vec<TokenTree> = prompts[..batch]
            .iter()
            .map(|p| {
                let mut t = TokenTree::root(*p.last().unwrap());
                t.push(0, 504);
                for k in 0..extra_children as u32 {
                    t.push(k % 2, 1000 + k);
                }
                t
            })
            .collect();
        let mut seqs: Vec<SeqTree> = caches
            .iter_mut()
            .zip(&trees)
            .map(|(c, t)| SeqTree::new(c, t))
            .collect();
        let out = model.forward(&mut seqs).unwrap();
        (out[0].node(0).to_vec(), out[0].node(1).to_vec())
    };
    let alone = probe(0, 1);
    for (extra, batch) in [(3, 1), (16, 1), (0, 2), (7, 3), (30, 3)] {
        let got = probe(extra, batch);
        assert!(
            got.0 == alone.0 && got.1 == alone.1,
            "{extra} more nodes, batch of {batch}: logits changed"
        );
    }
}
