//! The cached draft model over a conversation longer than its context.

use specinfer_model::{Arch, Llama, ModelConfig};
use specinfer_speculator::{CachedDraft, DraftModel};
use specinfer_wire::TokenTree;

#[test]
fn a_conversation_longer_than_the_draft_context_is_drafted_from_its_latest_tokens() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 3, None).unwrap();
    let limit = model.config().max_positions;
    let mut draft = CachedDraft::new(&model);
    let mut committed: Vec<u32> = (0..100u32).map(|i| i * 7 % 101).collect();
    let mut starts = vec![0];
    while committed.len() < 3 * limit {
        draft.sync(&committed).unwrap();
        let root = *committed.last().unwrap();
        let tree = TokenTree::chain(&[root, 5, 6, 9]);
        let got = draft.extend(&tree, 0).unwrap();
        let start = draft.window_start();
        if start != *starts.last().unwrap() {
            starts.push(start);
        }
        // The tree fits behind what the draft reads ...
        assert!(committed.len() - start + tree.len() <= limit);
        // ... and its logits are the model's over exactly those tokens (every 20th round: a
        // fresh draft prefills them in one go).
        if committed.len() % 20 < 3 {
            let mut fresh = CachedDraft::new(&model);
            fresh.sync(&committed[start..]).unwrap();
            assert_eq!(fresh.window_start(), 0);
            let want = fresh.extend(&tree, 0).unwrap();
            for (a, b) in got.iter().zip(&want) {
                let worst = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst < 1e-4,
                    "{} committed, window from {start}: {worst}",
                    committed.len()
                );
            }
        }
        // The verifier accepts two drafted tokens and adds one of its own.
        committed.extend([5, 6, (committed.len() % 101) as u32]);
    }
    // The window moved a few times, by half its length, not every round.
    assert!(starts.len() >= 4, "window starts {starts:?}");
    assert!(
        starts.len() <= 3 * limit / (limit / 4) + 1,
        "window starts {starts:?}"
    );
}
