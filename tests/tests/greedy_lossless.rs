//! Greedy speculative generation is token-identical to incremental greedy generation on SmolLM2.
//!
//! The stand-in drafter is the LLM itself with seeded noise on its logits: it proposes the LLM's
//! own top-k, but often in the wrong order, so rounds accept through later siblings, reject at
//! every depth, and exercise KV compaction of non-trivial paths. Each prompt runs once more with
//! the context lookup's chain added to every tree.

use specinfer_integration::{smollm2, NoisyDraft};
use specinfer_model::{ChatMessage, Llama};
use specinfer_speculator::{ContextLookup, DraftMode, Speculator};
use specinfer_verifier::Session;
use specinfer_wire::{Limits, SamplingParams, TokenTree};

#[test]
fn speculative_greedy_equals_incremental_greedy_on_smollm2() {
    let (llm, tok) = smollm2();
    let llm: &Llama = llm;
    let limits = Limits::default();
    let prompts = [
        "What is the capital of France?",
        "Write a Python function that reverses a string.",
        "List three uses of copper.",
        "Explain photosynthesis to a child.",
        "Translate 'good morning' into Spanish and German.",
    ];
    let (mut rounds, mut tokens, mut accepted_later_sibling) = (0usize, 0usize, 0usize);
    let mut accepted_from_lookup = 0usize;
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = tok
            .encode(&tok.chat_prompt(&[ChatMessage::new("user", prompt)]))
            .unwrap();
        // No stop tokens: always 64 tokens, so every prompt compares the full length.
        let params = SamplingParams::greedy(64);

        let mut inc = Session::open(llm, &ids, params.clone(), &limits).unwrap();
        while inc.finish().is_none() {
            inc.verify(llm, &limits, &TokenTree::root(inc.root()))
                .unwrap();
        }

        // With and without the context lookup's chain after the draft's nodes.
        for lookup in [None, Some(ContextLookup::default())] {
            let mut spec = Session::open(llm, &ids, params.clone(), &limits).unwrap();
            let mut speculator = Speculator::new(vec![2, 2, 1, 1], DraftMode::Greedy, i as u64);
            let mut draft = NoisyDraft::new(llm, i as u64, 2.5);
            while spec.finish().is_none() {
                let drafted = speculator.draft(&mut draft, spec.tokens()).unwrap();
                let model_nodes = drafted.len();
                let tree = match &lookup {
                    Some(l) => l.extend(drafted, spec.tokens(), 256, false),
                    None => drafted,
                };
                let out = spec.verify(llm, &limits, &tree).unwrap();
                let children = tree.children();
                accepted_later_sibling += out
                    .accepted_nodes
                    .iter()
                    .filter(|&&n| children[tree.parent(n as usize).unwrap()][0] != n)
                    .count();
                accepted_from_lookup += out
                    .accepted_nodes
                    .iter()
                    .filter(|&&n| n as usize >= model_nodes)
                    .count();
                rounds += 1;
            }
            assert_eq!(spec.generated().len(), 64);
            assert_eq!(
                spec.generated(),
                inc.generated(),
                "prompt {prompt:?} (lookup {lookup:?}): speculative output differs"
            );
        }
        tokens += 2 * 64;
    }
    println!("{tokens} tokens in {rounds} rounds (tau {:.2}); {accepted_later_sibling} acceptances through a non-first sibling, {accepted_from_lookup} of lookup nodes", tokens as f64 / rounds as f64);
    assert!(rounds < tokens, "speculation never accepted a draft");
    assert!(
        accepted_later_sibling > 0,
        "the test did not exercise non-trivial paths"
    );
    assert!(
        accepted_from_lookup > 0,
        "no lookup node was ever accepted: the lookup path went untested"
    );
}
