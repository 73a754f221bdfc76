//! Merge-based speculation: several drafts' trees as one.

use specinfer_wire::{Proposals, SparseDist, TokenTree};

/// SpecInfer's token tree merge (Definition 3.2): one tree holding every root-to-leaf path of
/// each input. Greedy trees share equal prefixes (a path's tokens identify its node). Trees with
/// proposals stay disjoint under the shared root: every sampled child is one draw from its own
/// model's proposal, and folding two draws into one node would change the acceptance odds.
pub fn merge_trees(trees: &[TokenTree]) -> TokenTree {
    let root = trees
        .first()
        .expect("merge needs at least one tree")
        .token(0);
    assert!(
        trees.iter().all(|t| t.token(0) == root),
        "merged trees must share their root"
    );
    let mut merged = TokenTree::root(root);
    let sampled = trees.iter().any(|t| t.proposals().is_some());
    if !sampled {
        let mut index: std::collections::HashMap<(u32, u32), u32> =
            std::collections::HashMap::new();
        for t in trees {
            let mut map = vec![0u32; t.len()];
            for node in 1..t.len() {
                let parent = map[t.parent(node).expect("non-root")];
                let key = (parent, t.token(node));
                map[node] = *index
                    .entry(key)
                    .or_insert_with(|| merged.push(parent, t.token(node)));
            }
        }
        return merged;
    }
    let mut dists = Vec::new();
    let mut drawn_from = Vec::new();
    let mut mode = None;
    for t in trees {
        let p = t
            .proposals()
            .expect("sampled trees are merged only with sampled trees");
        assert!(
            mode.is_none_or(|m| m == p.mode),
            "merged trees must use one draw mode"
        );
        mode = Some(p.mode);
        let mut map = vec![0u32; t.len()];
        for node in 1..t.len() {
            map[node] = merged.push(map[t.parent(node).expect("non-root")], t.token(node));
            drawn_from.push(dists.len() as u32 + p.drawn_from[node - 1]);
        }
        dists.extend(p.dists.iter().map(|d| SparseDist {
            node: map[d.node as usize],
            ..d.clone()
        }));
    }
    merged
        .with_proposals(Proposals {
            mode: mode.expect("at least one tree"),
            dists,
            drawn_from,
        })
        .expect("merging keeps every proposal consistent")
}
