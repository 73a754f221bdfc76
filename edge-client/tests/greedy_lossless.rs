//! Greedy speculative generation is token-identical to incremental greedy generation on SmolLM2.
//!
//! The stand-in drafter is the LLM itself with seeded noise on its logits: it proposes the LLM's
//! own top-k, but often in the wrong order, so rounds accept through later siblings, reject at
//! every depth, and exercise KV compaction of non-trivial paths.

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use specinfer_edge::{CandleDraft, DraftMode, DraftModel, Speculator};
use specinfer_model::{fetch, load_gguf, ChatMessage, ModelError};
use specinfer_verifier::Session;
use specinfer_wire::{Limits, SamplingParams, TokenTree};

struct Noisy<'m> {
    inner: CandleDraft<'m>,
    rng: rand_chacha::ChaCha8Rng,
}

impl DraftModel for Noisy<'_> {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        self.inner.sync(committed)
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut l = self.inner.extend(tree, first)?;
        for row in &mut l {
            row.iter_mut()
                .for_each(|x| *x += self.rng.random_range(0.0..2.5f32));
        }
        Ok(l)
    }
}

#[test]
fn speculative_greedy_equals_incremental_greedy_on_smollm2() {
    let cache = std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/specinfer"));
    let path = fetch::ensure(&fetch::SMOLLM2_135M, &cache).unwrap();
    let (llm, tok) = load_gguf(&path).unwrap();
    let limits = Limits::default();
    let prompts = [
        "What is the capital of France?",
        "Write a Python function that reverses a string.",
        "List three uses of copper.",
        "Explain photosynthesis to a child.",
        "Translate 'good morning' into Spanish and German.",
    ];
    let (mut rounds, mut tokens, mut accepted_later_sibling) = (0usize, 0usize, 0usize);
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = tok
            .encode(&tok.chat_prompt(&[ChatMessage::new("user", prompt)]))
            .unwrap();
        // No stop tokens: always 64 tokens, so every prompt compares the full length.
        let params = SamplingParams::greedy(64);

        let mut inc = Session::open(&llm, &ids, params.clone(), &limits).unwrap();
        while inc.finish().is_none() {
            inc.verify(&llm, &limits, &TokenTree::root(inc.root()))
                .unwrap();
        }

        let mut spec = Session::open(&llm, &ids, params, &limits).unwrap();
        let mut speculator = Speculator::new(vec![2, 2, 1, 1], DraftMode::Greedy, i as u64);
        let mut draft = Noisy {
            inner: CandleDraft::new(&llm),
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(i as u64),
        };
        while spec.finish().is_none() {
            let tree = speculator.draft(&mut draft, spec.tokens()).unwrap();
            let out = spec.verify(&llm, &limits, &tree).unwrap();
            let children = tree.children();
            accepted_later_sibling += out
                .accepted_nodes
                .iter()
                .filter(|&&n| children[tree.parent(n as usize).unwrap()][0] != n)
                .count();
            rounds += 1;
        }
        assert_eq!(spec.generated().len(), 64);
        assert_eq!(
            spec.generated(),
            inc.generated(),
            "prompt {prompt:?}: speculative output differs"
        );
        tokens += 64;
    }
    println!("{tokens} tokens in {rounds} rounds (tau {:.2}); {accepted_later_sibling} acceptances through a non-first sibling", tokens as f64 / rounds as f64);
    assert!(rounds < tokens, "speculation never accepted a draft");
    assert!(
        accepted_later_sibling > 0,
        "the test did not exercise non-trivial paths"
    );
}
