//! Sessions in one batch fail or succeed on their own.

use specinfer_model::{Arch, Llama, ModelConfig, ModelError};
use specinfer_verifier::{verify_batch, Session, SessionError};
use specinfer_wire::{Limits, SamplingParams, TokenTree};

#[test]
fn a_session_at_the_end_of_its_context_does_not_fail_the_batch() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 1, None).unwrap();
    let limits = Limits {
        max_prompt_tokens: 1024,
        ..Limits::default()
    };
    let max = model.config().max_positions;
    let long: Vec<u32> = (0..max as u32 - 1).map(|i| i % 100).collect();
    let mut full = Session::open(&model, &long, SamplingParams::greedy(64), &limits).unwrap();
    let mut fine = Session::open(&model, &[5, 6, 7], SamplingParams::greedy(64), &limits).unwrap();
    // Three levels deep: the long session would need positions past the context.
    let deep = |root: u32| TokenTree::chain(&[root, 1, 2, 3]);
    let (t_full, t_fine) = (deep(full.root()), deep(fine.root()));
    let results = verify_batch(
        &model,
        &limits,
        &mut [(&mut full, &t_full), (&mut fine, &t_fine)],
    );
    assert!(
        matches!(
            results[0],
            Err(SessionError::Model(ModelError::ContextFull { .. }))
        ),
        "{:?}",
        results[0].as_ref().err()
    );
    let ok = results[1]
        .as_ref()
        .expect("the other session's round must succeed");
    assert!(!ok.tokens.is_empty());
    assert_eq!(fine.generated(), &ok.tokens[..]);
}
