//! The feature-conditioned draft's tree logits are those of running each node's path as a
//! chain, each position reading the feature before it: the LLM's for committed positions, the
//! drafter's own prediction for the parent inside the tree.

use specinfer_model::FeatureDrafter;
use specinfer_speculator::{DraftModel, FeatureDraft};
use specinfer_wire::TokenTree;

const VOCAB: usize = 50;
const D: usize = 32;

/// Made-up "LLM features" of positions `0..n`.
fn llm_features(n: usize) -> Vec<f32> {
    (0..n * D)
        .map(|i| ((i * 7919 % 23) as f32 - 11.0) / 5.0)
        .collect()
}

/// Logits and predicted feature of the last of `path` (tree tokens after the committed ones),
/// computed one position at a time on a fresh cache.
fn by_chain(m: &FeatureDrafter, committed: &[u32], known: &[f32], path: &[u32]) -> Vec<f32> {
    // The drafter's own kind of cache (f32), as the draft session's.
    let mut kv = m.new_cache();
    let n = committed.len();
    // Committed positions 1..n-1 (position 0 has no preceding feature), then the root.
    m.append(&mut kv, &committed[1..n - 1], &known[..(n - 2) * D])
        .unwrap();
    let mut prev = known[(n - 2) * D..(n - 1) * D].to_vec();
    let mut tokens = vec![committed[n - 1]];
    tokens.extend(path);
    let mut logits = Vec::new();
    for &t in &tokens {
        let out = m
            .forward(&mut kv, &TokenTree::chain(&[t]), 0, &prev)
            .unwrap();
        logits = out.node(0).to_vec();
        prev = out.feature(0).unwrap().to_vec();
        kv.commit_scratch();
    }
    logits
}

#[test]
fn tree_logits_equal_each_paths_chain() {
    let head: Vec<u32> = (0..VOCAB as u32).filter(|t| t % 3 != 1).collect();
    let m = FeatureDrafter::random(VOCAB, D, &head, 9).unwrap();
    let committed = [4u32, 9, 12, 30, 2, 7];
    let known = llm_features(committed.len() - 1);
    let mut draft = FeatureDraft::new(&m);
    assert!(!draft.ready(&committed), "no features yet");
    draft.take_features(0, &known, D);
    assert!(draft.ready(&committed));
    draft.sync(&committed).unwrap();
    // root 7; children 3, 5; 3's child 6; 5's child 8 (a token outside the head); 6's child 0.
    let tree = TokenTree::new(vec![7, 3, 5, 6, 8, 0], vec![0, 0, 1, 2, 3]).unwrap();
    // Scored in two calls, as a best-first tree grows.
    let mut logits = draft.extend(&tree, 0).unwrap();
    assert_eq!(logits.len(), tree.len());
    let grown = TokenTree::new(vec![7, 3, 5, 6, 8, 0, 11], vec![0, 0, 1, 2, 3, 4]).unwrap();
    logits.extend(draft.extend(&grown, tree.len()).unwrap());
    for (node, node_logits) in logits.iter().enumerate() {
        let mut path = Vec::new();
        let mut n = node;
        while let Some(p) = grown.parent(n) {
            path.push(grown.token(n));
            n = p;
        }
        path.reverse();
        let expected = by_chain(&m, &committed, &known, &path);
        for (t, (a, b)) in node_logits.iter().zip(&expected).enumerate() {
            if head.contains(&(t as u32)) {
                assert!((a - b).abs() < 1e-3, "node {node} token {t}: {a} vs {b}");
            } else {
                assert!(a.is_infinite() && b.is_infinite(), "outside the head: -inf");
            }
        }
    }
    // The next round: two of the tree's tokens were accepted, then a bonus token; the verifier
    // sent the features of the root and the accepted nodes. The draft catches up and drafts on.
    let mut next = committed.to_vec();
    next.extend([3, 6, 40]);
    draft.take_features(committed.len() - 1, &llm_features(3), D);
    assert!(draft.ready(&next));
    draft.sync(&next).unwrap();
    let mut all = known.clone();
    all.extend(llm_features(3));
    let root = draft.extend(&TokenTree::root(40), 0).unwrap().remove(0);
    let expected = by_chain(&m, &next, &all, &[]);
    for (a, b) in root.iter().zip(&expected).filter(|(a, _)| a.is_finite()) {
        assert!((a - b).abs() < 1e-3, "after a round: {a} vs {b}");
    }
}
