//! Tree construction: merging keeps every path of every input (SpecInfer Definition 3.2), and
//! dynamic trees spend exactly their node budget on the most probable paths.
#![cfg(not(target_arch = "wasm32"))]

use proptest::prelude::*;
use specinfer_model::ModelError;
use specinfer_speculator::{
    merge_trees, DraftMode, DraftModel, DraftedPart, Speculator, TreeShape,
};
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
        drafted_nodes: depth + 1,
        accepted: good.min(depth),
        draft_s: per_level * depth as f64,
        round_s: fixed + per_node * (depth + 1) as f64,
        queue_s: 0.0,
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
        c.observe(round(depth, good, fixed, per_node, per_level), depth);
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
            c.observe(round(d, 0, 0.0, 0.05, 0.01), d);
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
        c.observe(
            specinfer_speculator::RoundObservation {
                tree_depth: depth,
                tree_nodes: depth + 1,
                drafted_nodes: depth + 1,
                accepted,
                draft_s: 0.0005 * depth as f64,
                round_s: 0.004 + 0.0003 * depth as f64,
                queue_s: 0.0,
                forward_s: 0.004 + 0.0003 * depth as f64,
            },
            depth,
        );
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
    for shape in [
        TreeShape::Adaptive(vec![1; 8]),
        TreeShape::AdaptiveDynamic { budget: 8 },
    ] {
        plain_rounds_do_not_draft(shape);
    }
}

fn plain_rounds_do_not_draft(shape: TreeShape) {
    let mut s = Speculator::with_shape(shape.clone(), DraftMode::Greedy, 0);
    let mut model = Counting::default();
    assert!(s.drafts_next(), "a fresh adaptive speculator drafts");
    // A draft never right on a slow verifier (a node costs 50 ms, a draft forward 10): the
    // controller turns drafting off.
    let round_of = |s: &mut Speculator, model: &mut Counting| {
        let before = model.calls;
        let drafting = s.drafts_next();
        let tree = s.draft(model, &[1, 2, 3]).unwrap();
        let depth = tree.depths().into_iter().max().unwrap_or(0) as usize;
        let draft_s = if drafting {
            0.01 * (depth + 1) as f64
        } else {
            0.0
        };
        let forward_s = 0.05 * tree.len() as f64;
        s.observe(
            DraftedPart::of(&tree).observation(tree.len(), &[], draft_s, forward_s, 0.0, forward_s),
            &[],
        );
        (drafting, tree.len(), model.calls - before)
    };
    let (first, _, _) = round_of(&mut s, &mut model);
    assert!(first, "{shape}: the first round drafts");
    for _ in 0..40 {
        round_of(&mut s, &mut model);
    }
    let (mut plain, mut calls_in_plain) = (0, 0);
    for _ in 0..specinfer_speculator::PLAIN_EXPLORE {
        let (drafting, nodes, calls) = round_of(&mut s, &mut model);
        if !drafting {
            assert_eq!(nodes, 1, "{shape}: a plain round sent drafted nodes");
            plain += 1;
            calls_in_plain += calls;
        }
    }
    assert!(
        plain >= specinfer_speculator::PLAIN_EXPLORE - 1,
        "{shape}: {plain} plain rounds"
    );
    assert_eq!(
        calls_in_plain, 0,
        "{shape}: plain rounds ran the draft model"
    );
}

#[test]
fn a_fixed_expansion_always_drafts() {
    let fixed = Speculator::new(vec![1, 1], DraftMode::Greedy, 0);
    assert!(fixed.drafts_next());
}

/// The nodes a verifier accepts when the draft's best path is right for `good` levels.
fn best_path(tree: &TokenTree, good: usize) -> Vec<u32> {
    let children = tree.children();
    let mut path = Vec::new();
    let mut node = 0;
    while path.len() < good {
        let Some(&c) = children[node].first() else {
            break;
        };
        path.push(c);
        node = c as usize;
    }
    path
}

/// Mean drafted nodes per round of an adaptive dynamic tree over rounds where the draft's best
/// path is right for `good` levels, a round costs `fixed` plus `per_node` per verified node,
/// and a draft forward `per_forward`.
fn adaptive_dynamic_nodes(good: usize, fixed: f64, per_node: f64, per_forward: f64) -> f64 {
    let mut s = Speculator::with_shape(
        TreeShape::AdaptiveDynamic { budget: 32 },
        DraftMode::Greedy,
        0,
    );
    let mut nodes = 0;
    let rounds = 200;
    for r in 0..rounds {
        let context = [1, 2, 3 + r as u32 % 40];
        let drafting = s.drafts_next();
        let tree = s.draft(&mut Toy, &context).unwrap();
        let depth = tree.depths().into_iter().max().unwrap_or(0) as usize;
        nodes += tree.len() - 1;
        let forward = per_node * tree.len() as f64;
        let draft = if drafting {
            per_forward * (depth + 1) as f64
        } else {
            0.0
        };
        let accepted = best_path(&tree, good);
        s.observe(
            DraftedPart::of(&tree).observation(
                tree.len(),
                &accepted,
                draft,
                fixed + forward,
                0.0,
                forward,
            ),
            &accepted,
        );
    }
    nodes as f64 / rounds as f64
}

#[test]
fn adaptive_dynamic_trees_grow_while_their_nodes_pay() {
    // A long round trip and cheap verification: a draft right for 3 levels gets big trees.
    let far = adaptive_dynamic_nodes(3, 0.05, 0.0002, 0.0005);
    assert!(
        far >= 6.0,
        "{far} nodes per round behind a 50 ms round trip"
    );
    // Each verified node as dear as a whole round trip: far fewer nodes.
    let near = adaptive_dynamic_nodes(3, 0.001, 0.002, 0.0005);
    assert!(near < far / 2.0, "{near} vs {far} nodes per round");
    // A draft never right on a slow verifier: (almost) plain decoding.
    let useless = adaptive_dynamic_nodes(0, 0.0, 0.005, 0.002);
    assert!(
        useless < 1.0,
        "{useless} nodes per round from a useless draft"
    );
    println!("nodes per round: far {far:.1}, near {near:.1}, useless draft {useless:.2}");
}

#[test]
fn tree_shapes_print_as_they_parse() {
    for s in [
        "1,1,3,1",
        "dynamic:12",
        "adaptive:1,1,3",
        "adaptive:dynamic:32",
    ] {
        assert_eq!(s.parse::<TreeShape>().unwrap().to_string(), s);
    }
    assert_eq!(
        "adaptive:dynamic:32".parse::<TreeShape>().unwrap(),
        TreeShape::AdaptiveDynamic { budget: 32 }
    );
    assert_eq!(
        TreeShape::clients_default().uncut(),
        TreeShape::Dynamic { budget: 32 }
    );
}

/// Depth and root children of the sampled dynamic tree `s` drafts after `context`.
fn depth_and_width(s: &mut Speculator, context: &[u32]) -> (u32, usize) {
    let t = s.draft(&mut Toy, context).unwrap();
    let depth = t.depths().into_iter().max().unwrap_or(0);
    (depth, t.children()[0].len())
}

#[test]
fn sampled_dynamic_trees_learn_which_draws_the_verifier_accepts() {
    let shape = TreeShape::Dynamic { budget: 16 };
    let mode = DraftMode::sampled(1.0, 1.0);
    let context = [1, 2, 3];
    let (fresh_depth, fresh_width) = depth_and_width(
        &mut Speculator::with_shape(shape.clone(), mode, 7),
        &context,
    );
    // Verdicts that accept every node's first draw, to the leaf, and nothing else.
    let mut s = Speculator::with_shape(shape, mode, 7);
    for i in 0..60u32 {
        let tree = s.draft(&mut Toy, &[1, 2, 4 + i % 30]).unwrap();
        let accepted = best_path(&tree, usize::MAX);
        s.observe(
            DraftedPart::of(&tree).observation(tree.len(), &accepted, 0.001, 0.01, 0.0, 0.005),
            &accepted,
        );
    }
    let (depth, width) = depth_and_width(&mut s, &context);
    assert!(
        depth > fresh_depth && width < fresh_width,
        "first draws always accepted: depth {fresh_depth} -> {depth}, root children {fresh_width} -> {width}"
    );
}
