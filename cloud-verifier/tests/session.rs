//! Sessions in one batch fail or succeed on their own.

use specinfer_model::{Arch, Llama, ModelConfig, ModelError};
use specinfer_verifier::{verify_batch, Session, SessionError};
use specinfer_wire::{Limits, SamplingParams, TokenTree, VerifyMode};

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

/// A sampled session re-opened elsewhere with its committed tokens (failover) continues with the
/// draws the first one would have made: each round's randomness is a function of the seed and
/// the committed length, not of how many rounds this process has run.
#[test]
fn a_reopened_sampled_session_continues_the_same_stream() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 1, None).unwrap();
    let limits = Limits::default();
    let params = |max_new: u32| SamplingParams {
        mode: VerifyMode::Stochastic,
        temperature: 1.0,
        seed: 42,
        ..SamplingParams::greedy(max_new)
    };
    let run = |s: &mut Session, rounds: usize| {
        for _ in 0..rounds {
            let root = TokenTree::root(s.root());
            s.verify(&model, &limits, &root).unwrap();
        }
    };
    let prompt = [5u32, 6, 7];
    let mut whole = Session::open(&model, &prompt, params(24), &limits).unwrap();
    run(&mut whole, 24);
    let mut first = Session::open(&model, &prompt, params(24), &limits).unwrap();
    run(&mut first, 10);
    let mut reopened = Session::open(&model, first.tokens(), params(14), &limits).unwrap();
    run(&mut reopened, 14);
    assert_eq!(reopened.tokens(), whole.tokens());
    // And the stream is not one sample repeated: other seeds give other answers.
    let mut other = Session::open(
        &model,
        &prompt,
        SamplingParams {
            seed: 43,
            ..params(24)
        },
        &limits,
    )
    .unwrap();
    run(&mut other, 24);
    assert_ne!(other.tokens(), whole.tokens());
}

/// A session that asks for features gets, with each verdict, the LLM's feature of every
/// position it ran and kept (the first verdict also the prompt's), consecutive from where the
/// last verdict stopped, equal (within the 8-bit step) to the LLM's own along the committed
/// tokens: a drafter on the edge reads exactly what the LLM computed.
#[test]
fn verdicts_carry_the_llms_features_of_the_committed_positions() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 1, None).unwrap();
    let limits = Limits::default();
    let params = SamplingParams {
        return_features: true,
        ..SamplingParams::greedy(12)
    };
    let prompt = [3u32, 14, 15, 92, 65];
    let mut session = Session::open(&model, &prompt, params, &limits).unwrap();
    let mut next_position = 0;
    let mut rows = Vec::new();
    for _ in 0..4 {
        // A chain guessed from nothing: mostly rejected, sometimes a token accepted.
        let tree = TokenTree::chain(&[session.root(), 7, 8]);
        let out = session.verify(&model, &limits, &tree).unwrap();
        let f = out.features.expect("the session asked for features");
        assert_eq!(f.first_position as usize, next_position);
        f.validate(1024).unwrap();
        next_position += f.rows();
        rows.extend(
            f.dequantize()
                .chunks(f.dim as usize)
                .zip(f.scales.clone())
                .map(|(r, s)| (r.to_vec(), s)),
        );
    }
    // Every committed position but the last (the next root, not yet run).
    assert_eq!(next_position, session.tokens().len() - 1);
    let committed = &session.tokens()[..next_position];
    let mut kv = specinfer_model::KvCache::new(model.config());
    let chain = TokenTree::chain(committed);
    let reference = model
        .forward(&mut [specinfer_model::SeqTree::new(&mut kv, &chain)])
        .unwrap()
        .remove(0);
    for (p, (row, scale)) in rows.iter().enumerate() {
        let exact = reference.feature(p).unwrap();
        for (a, b) in row.iter().zip(exact) {
            assert!(
                (a - b).abs() <= scale * 0.5 + 1e-4,
                "position {p}: {a} vs {b}"
            );
        }
    }
    // A session that did not ask gets none.
    let mut plain = Session::open(&model, &prompt, SamplingParams::greedy(4), &limits).unwrap();
    let tree = TokenTree::root(plain.root());
    assert!(plain
        .verify(&model, &limits, &tree)
        .unwrap()
        .features
        .is_none());
}

/// Greedy decoding with a repetition penalty: each node's argmax is taken over its row
/// penalised by its own context (committed tokens, then its path in the tree), so trees give
/// exactly what one token per round gives, and the penalty changes the answer.
#[test]
fn a_penalised_greedy_tree_equals_penalised_incremental_decoding() {
    let model = Llama::random(ModelConfig::tiny(Arch::Llama), 3, None).unwrap();
    let limits = Limits::default();
    let params = |penalty| SamplingParams {
        repeat_penalty: penalty,
        repeat_last_n: 16,
        ..SamplingParams::greedy(40)
    };
    let prompt = [5, 6, 7, 5, 6];
    let run = |penalty: f32, tree_of: &dyn Fn(&Session) -> TokenTree| {
        let mut s = Session::open(&model, &prompt, params(penalty), &limits).unwrap();
        let mut rounds = 0;
        while s.finish().is_none() {
            let tree = tree_of(&s);
            s.verify(&model, &limits, &tree).unwrap();
            rounds += 1;
        }
        (s.generated().to_vec(), rounds)
    };
    let (incremental, _) = run(1.3, &|s| TokenTree::root(s.root()));
    // Trees whose every level holds the incremental answer's next token beside a wrong one.
    let answer = incremental.clone();
    let (speculative, rounds) = run(1.3, &|s| {
        let done = s.generated().len();
        let mut tree = TokenTree::root(s.root());
        let mut parent = 0;
        for &t in answer.iter().skip(done).take(4) {
            tree.push(parent, (t + 1) % 101);
            parent = tree.push(parent, t);
        }
        tree
    });
    assert_eq!(speculative, incremental);
    assert!(
        rounds < 40,
        "{rounds} rounds: the trees were never accepted"
    );
    let (plain, _) = run(1.0, &|s| TokenTree::root(s.root()));
    assert_ne!(plain, incremental, "the penalty changed nothing");
}
