//! The speculator core compiled to WebAssembly and run in Node (wasm-bindgen-test): drafting a
//! tiny random model builds exactly the expansion tree, with every node's children the draft
//! model's own best tokens there, and merging keeps every path. Run with
//! `cargo test -p specinfer-speculator --target wasm32-unknown-unknown -Zbuild-std=std,panic_abort`
//! and `wasm-bindgen-test-runner` as the target's runner (`scripts/test` does).
#![cfg(target_arch = "wasm32")]

use specinfer_model::{Arch, Llama, ModelConfig};
use specinfer_speculator::{merge_trees, CachedDraft, DraftMode, DraftModel, Speculator};
use specinfer_wire::TokenTree;
use wasm_bindgen_test::wasm_bindgen_test;

#[wasm_bindgen_test]
fn drafting_in_wasm_builds_the_expansion_tree_from_the_models_best_tokens() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 3, None).unwrap();
    let committed = [5u32, 17, 42, 9];
    let mut draft = CachedDraft::new(&model);
    let mut speculator = Speculator::new(vec![2, 1, 2], DraftMode::Greedy, 0);
    let tree = speculator.draft(&mut draft, &committed).unwrap();
    assert_eq!(tree.len(), 1 + 2 + 2 + 4, "<2,1,2> has 1 + 2 + 2 + 4 nodes");
    // Every inner node's children are the model's top tokens after that node's path.
    let children = tree.children();
    for (node, kids) in children.iter().enumerate().filter(|(_, k)| !k.is_empty()) {
        let mut seq = committed[..committed.len() - 1].to_vec();
        seq.extend(tree.path_to(node).iter().map(|&n| tree.token(n as usize)));
        let mut fresh = CachedDraft::new(&model);
        fresh.sync(&seq).unwrap();
        let logits = fresh
            .extend(&TokenTree::root(*seq.last().unwrap()), 0)
            .unwrap();
        let mut order: Vec<u32> = (0..logits[0].len() as u32).collect();
        order.sort_by(|&a, &b| logits[0][b as usize].total_cmp(&logits[0][a as usize]));
        let got: Vec<u32> = kids.iter().map(|&c| tree.token(c as usize)).collect();
        assert_eq!(got, order[..got.len()].to_vec(), "children of node {node}");
    }
}

#[wasm_bindgen_test]
fn merging_in_wasm_keeps_every_path() {
    let a = TokenTree::new(vec![1, 2, 3, 4], vec![0, 1, 1]).unwrap();
    let b = TokenTree::new(vec![1, 2, 5], vec![0, 1]).unwrap();
    let merged = merge_trees(&[a, b]);
    let paths: Vec<Vec<u32>> = (0..merged.len())
        .map(|n| {
            merged
                .path_to(n)
                .iter()
                .map(|&i| merged.token(i as usize))
                .collect()
        })
        .collect();
    for want in [vec![1, 2, 3], vec![1, 2, 4], vec![1, 2, 5]] {
        assert!(paths.contains(&want), "{want:?} lost");
    }
    assert_eq!(merged.len(), 5, "the shared prefix 1,2 is one path");
}
