//! `cargo fuzz run validated_messages` (from `wire/`): whatever a peer's frame decodes to, once
//! it passes the checks the verifier and the client make (`Message::validate`, and for trees
//! `TokenTree::validate` against a small vocabulary), every accessor the rest of specinfer then
//! calls on it must work without a panic: tree depths, children, paths, the ancestor mask,
//! proposal probabilities, feature rows.
#![no_main]

use libfuzzer_sys::fuzz_target;
use specinfer_wire::{decode_frame, AncestorBits, Limits, Message, PROMPT_FEATURE_ROWS};

/// A vocabulary small enough that fuzzed token ids often fall outside it.
const VOCAB: u32 = 50_000;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let Ok(msg) = decode_frame(data, &limits) else {
        return;
    };
    if msg.validate(&limits).is_err() {
        return;
    }
    match msg {
        Message::Verify(v) => {
            if v.tree.validate(VOCAB, &limits).is_err() {
                return;
            }
            let depths = v.tree.depths();
            let children = v.tree.children();
            assert_eq!(depths.len(), v.tree.len());
            assert_eq!(children.len(), v.tree.len());
            let mask = AncestorBits::new(&v.tree);
            for node in 0..v.tree.len() {
                let path = v.tree.path_to(node);
                assert_eq!(path.len() as u32, depths[node] + 1);
                // A node sees itself and its ancestors, no other node.
                for other in 0..v.tree.len() {
                    let ancestor = path.contains(&(other as u32));
                    assert_eq!(mask.sees(node, other), ancestor);
                }
                for &c in &children[node] {
                    assert_eq!(v.tree.parent(c as usize), Some(node));
                }
            }
            if let Some(p) = v.tree.proposals() {
                let _ = format!("{p:?}");
            }
        }
        Message::Verified(v) => {
            if let Some(f) = v.features {
                if f.validate(limits.max_tree_nodes as usize + PROMPT_FEATURE_ROWS)
                    .is_ok()
                {
                    assert_eq!(f.dequantize().len(), f.rows() * f.dim as usize);
                }
            }
        }
        _ => {}
    }
});
