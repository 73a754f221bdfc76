//! Tree construction: merging keeps every path of every input (SpecInfer Definition 3.2), and
//! dynamic trees spend exactly their node budget on the most probable paths.
#![cfg(not(target_arch = "wasm32"))]

use proptest::prelude::*;
use specinfer_model::ModelError;
use specinfer_speculator::{merge_trees, DraftMode, DraftModel, Speculator, TreeShape};
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};

fn paths(t: &TokenTree) -> Vec<Vec<u32>> {
    (0..t.len())
        .map(|n| t.path_to(n).iter().map(|&i| t.token(i as usize)).collect())
        .collect()
}

fn tree_from(parents: &[usize], tokens: &[u32]) -> TokenTree {
    let mut t = TokenTree::root(7);
    for (i, (&p, &tok)) in parents.iter().zip(tokens).enumerate() {
        t.push((p % (i + 1)) as u32, tok);
    }
    t
}

proptest! {
    #[test]
    fn a_merged_tree_holds_every_path_of_each_input(
        a in (prop::collection::vec(0usize..100, 0..30), prop::collection::vec(0u32..4, 30)),
        b in (prop::collection::vec(0usize..100, 0..30), prop::collection::vec(0u32..4, 30)),
        c in (prop::collection::vec(0usize..100, 0..30), prop::collection::vec(0u32..4, 30)),
    ) {
        let trees: Vec<TokenTree> = [a, b, c].iter().map(|(p, t)| tree_from(p, t)).collect();
        let merged = merge_trees(&trees);
        let got = paths(&merged);
        for t in &trees {
            for p in paths(t) {
                prop_assert!(got.contains(&p), "path {:?} lost", p);
            }
        }
        // Nothing else: every merged path comes from some input, and equal paths share a node.
        let all: Vec<Vec<u32>> = trees.iter().flat_map(paths).collect();
        for p in &got {
            prop_assert!(all.contains(p));
        }
        let mut unique = got.clone();
        unique.sort();
        unique.dedup();
        prop_assert_eq!(unique.len(), got.len(), "a path appears twice in the merged greedy tree");
    }
}

#[test]
fn merging_sampled_trees_keeps_each_draw_and_its_proposal() {
    let q = |node, ids: Vec<u32>| SparseDist {
        node,
        probs: vec![1.0 / ids.len() as f32; ids.len()],
        ids,
    };
    let a = TokenTree::new(vec![7, 1, 2], vec![0, 1])
        .unwrap()
        .with_proposals(Proposals {
            mode: DrawMode::Iid,
            dists: vec![q(0, vec![1, 3]), q(1, vec![2])],
            drawn_from: vec![0, 1],
        })
        .unwrap();
    let b = TokenTree::new(vec![7, 1], vec![0])
        .unwrap()
        .with_proposals(Proposals {
            mode: DrawMode::Iid,
            dists: vec![q(0, vec![1, 4])],
            drawn_from: vec![0],
        })
        .unwrap();
    let m = merge_trees(&[a, b]);
    assert_eq!(m.len(), 4, "the two draws of token 1 stay two nodes");
    let p = m.proposals().unwrap();
    assert_eq!(p.dists.len(), 3);
    assert_eq!(
        p.dists[p.drawn_from[2] as usize].ids,
        vec![1, 4],
        "b's child keeps b's proposal"
    );
    assert_eq!(
        p.dists[1].node, 1,
        "a's second-level proposal follows its node"
    );
}

/// A deterministic toy draft model over 50 tokens: logits depend on the whole path.
struct Toy;

impl DraftModel for Toy {
    fn sync(&mut self, _: &[u32]) -> Result<(), ModelError> {
        Ok(())
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        Ok((first..tree.len())
            .map(|n| {
                let h = tree.path_to(n).iter().fold(17u64, |h, &i| {
                    h.wrapping_mul(31)
                        .wrapping_add(tree.token(i as usize) as u64)
                });
                (0..50u64)
                    .map(|t| ((h ^ t.wrapping_mul(0x9E3779B97F4A7C15)) % 997) as f32 / 100.0)
                    .collect()
            })
            .collect())
    }
}

#[test]
fn dynamic_trees_spend_their_budget_on_the_likeliest_paths() {
    for budget in [1usize, 5, 16, 40] {
        let mut s = Speculator::with_shape(TreeShape::Dynamic { budget }, DraftMode::Greedy, 0);
        let t = s.draft(&mut Toy, &[1, 2, 3]).unwrap();
        assert_eq!(t.len(), budget + 1, "budget {budget}");
        assert_eq!(t.token(0), 3);
        // The first child is the draft's argmax at the root.
        let root_logits = Toy.extend(&TokenTree::root(3), 0).unwrap().remove(0);
        assert_eq!(
            t.token(1),
            specinfer_kernels::sampling::argmax(&root_logits) as u32
        );
        for n in 1..t.len() {
            assert!(t.parent(n).unwrap() < n);
        }
    }
    assert_eq!(
        "dynamic:12".parse::<TreeShape>().unwrap(),
        TreeShape::Dynamic { budget: 12 }
    );
    assert_eq!(
        "1,1,3".parse::<TreeShape>().unwrap(),
        TreeShape::Expansion(vec![1, 1, 3])
    );
    assert!("1,x".parse::<TreeShape>().is_err());
}

/// A round at `depth` with a draft right up to depth `good`, under a linear cost model.
fn round(
    depth: usize,
    good: usize,
    fixed: f64,
    per_node: f64,
    per_level: f64,
) -> specinfer_speculator::RoundObservation {
    specinfer_speculator::RoundObservation {
        tree_depth: depth,
        tree_nodes: depth + 1,
        accepted: good.min(depth),
        draft_s: per_level * depth as f64,
        round_s: fixed + per_node * (depth + 1) as f64,
        forward_s: per_node * (depth + 1) as f64,
    }
}

/// Rounds where the draft is right up to depth `good` and wrong after it.
fn feed(
    c: &mut specinfer_speculator::DepthController,
    good: usize,
    fixed: f64,
    per_node: f64,
    per_level: f64,
) {
    for _ in 0..200 {
        let depth = c.best_depth();
        c.observe(round(depth, good, fixed, per_node, per_level));
    }
}

#[test]
fn the_adaptive_depth_follows_acceptance_and_costs() {
    use specinfer_speculator::DepthController;
    // The draft is good for 3 tokens, then never: deeper trees only cost.
    let mut c = DepthController::new(8);
    feed(&mut c, 3, 0.01, 0.001, 0.001);
    assert!(
        (3..=4).contains(&c.best_depth()),
        "depth {}",
        c.best_depth()
    );
    // Always right and a slow network: use the whole depth.
    let mut c = DepthController::new(8);
    feed(&mut c, 8, 0.05, 0.001, 0.001);
    assert_eq!(c.best_depth(), 8);
    // Never right: plain decoding (the root alone), with one exploring round in
    // PLAIN_EXPLORE.
    let mut c = DepthController::new(8);
    feed(&mut c, 0, 0.0, 0.05, 0.01);
    let depths: Vec<usize> = (0..specinfer_speculator::PLAIN_EXPLORE)
        .map(|_| {
            let d = c.best_depth();
            c.observe(round(d, 0, 0.0, 0.05, 0.01));
            d
        })
        .collect();
    assert_eq!(
        depths.iter().filter(|&&d| d == 0).count(),
        depths.len() - 1,
        "{depths:?}"
    );
    assert_eq!(*depths.iter().max().unwrap(), 1, "{depths:?}");
    // Verification nearly free per extra node (a forward over a tree costs about one token's)
    // and a draft right half the time: speculating pays although each tree costs more than a
    // plain step.
    let mut c = DepthController::new(8);
    for i in 0..400 {
        let depth = c.best_depth();
        let accepted = if i % 2 == 0 { depth.min(2) } else { 0 };
        c.observe(specinfer_speculator::RoundObservation {
            tree_depth: depth,
            tree_nodes: depth + 1,
            accepted,
            draft_s: 0.0005 * depth as f64,
            round_s: 0.004 + 0.0003 * depth as f64,
            forward_s: 0.004 + 0.0003 * depth as f64,
        });
    }
    assert!(c.best_depth() >= 1, "depth {}", c.best_depth());
    assert_eq!(
        "adaptive:1,1,3".parse::<TreeShape>().unwrap(),
        TreeShape::Adaptive(vec![1, 1, 3])
    );
}

/// Counts what the speculator asks of its draft model.
#[derive(Default)]
struct Counting {
    calls: usize,
}

impl DraftModel for Counting {
    fn sync(&mut self, _: &[u32]) -> Result<(), ModelError> {
        self.calls += 1;
        Ok(())
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        self.calls += 1;
        Toy.extend(tree, first)
    }
}

#[test]
fn plain_decoding_rounds_leave_the_draft_model_alone() {
    let mut s = Speculator::with_shape(TreeShape::Adaptive(vec![1; 8]), DraftMode::Greedy, 0);
    let mut model = Counting::default();
    assert!(s.drafts_next(), "a fresh adaptive speculator drafts");
    assert_eq!(s.draft(&mut model, &[1, 2, 3]).unwrap().len(), 9);
    // A draft never right on a slow verifier: the controller turns drafting off.
    for _ in 0..40 {
        let depth = s.adaptive_depth();
        s.observe(round(depth, 0, 0.0, 0.05, 0.01));
    }
    let (mut plain, mut calls_in_plain) = (0, 0);
    for _ in 0..specinfer_speculator::PLAIN_EXPLORE {
        let before = model.calls;
        let drafting = s.drafts_next();
        let tree = s.draft(&mut model, &[1, 2, 3]).unwrap();
        assert_eq!(drafting, tree.len() > 1);
        if !drafting {
            plain += 1;
            calls_in_plain += model.calls - before;
        }
        s.observe(round(tree.len() - 1, 0, 0.0, 0.05, 0.01));
    }
    assert!(
        plain >= specinfer_speculator::PLAIN_EXPLORE - 1,
        "{plain} plain rounds"
    );
    assert_eq!(calls_in_plain, 0, "plain rounds ran the draft model");
    // A fixed expansion always drafts.
    let fixed = Speculator::new(vec![1, 1], DraftMode::Greedy, 0);
    assert!(fixed.drafts_next());
}
