//! Statistical losslessness of tree verification: whatever the draft proposes, the emitted tokens
//! follow the LLM's distribution. Chi-square tests over many draws with fixed p and q.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specinfer_kernels::sampling::{argmax, normalise, sample};
use specinfer_verifier::verify::{
    verify_greedy, verify_naive_sampling, verify_stochastic, Verdict,
};
use specinfer_wire::{DrawMode, Proposals, SparseDist, TokenTree};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const DRAWS: usize = 100_000;

/// p-value of observed counts against expected probabilities. Cells with expected count < 5 are
/// pooled; any observation in a cell of probability 0 gives p-value 0.
fn chi_square_p(observed: &[u64], expected: &[f64]) -> f64 {
    let n: u64 = observed.iter().sum();
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &e) in observed.iter().zip(expected) {
        let e = e * n as f64;
        if e == 0.0 {
            if o > 0 {
                return 0.0;
            }
            continue;
        }
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
        } else {
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    let dof = (cells - 1) as f64;
    1.0 - ChiSquared::new(dof).unwrap().cdf(stat)
}

const P: [f32; 8] = [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02];

fn sparse(node: u32, q: &[(u32, f32)]) -> SparseDist {
    let total: f32 = q.iter().map(|x| x.1).sum();
    SparseDist {
        node,
        ids: q.iter().map(|x| x.0).collect(),
        probs: q.iter().map(|x| x.1 / total).collect(),
    }
}

/// Draws `k` children from `q`, i.i.d. or without replacement.
fn draw(q: &SparseDist, k: usize, mode: DrawMode, rng: &mut impl Rng) -> Vec<u32> {
    let mut w = q.probs.clone();
    (0..k)
        .map(|_| {
            let i = sample(&w, rng.random());
            if mode == DrawMode::WithoutReplacement {
                w[i] = 0.0;
            }
            q.ids[i]
        })
        .collect()
}

/// A depth-1 tree: root with `k` children drawn from `q`.
fn star(q: &SparseDist, k: usize, mode: DrawMode, rng: &mut impl Rng) -> TokenTree {
    let kids = draw(q, k, mode, rng);
    let mut tokens = vec![0];
    tokens.extend(&kids);
    TokenTree::new(tokens, vec![0; k])
        .unwrap()
        .with_proposals(Proposals {
            mode,
            dists: vec![q.clone()],
            drawn_from: vec![0; k],
        })
        .unwrap()
}

fn cases() -> Vec<(&'static str, SparseDist, usize)> {
    vec![
        (
            "q close to p",
            sparse(
                0,
                &[
                    (0, 0.28),
                    (1, 0.22),
                    (2, 0.15),
                    (3, 0.12),
                    (4, 0.08),
                    (5, 0.08),
                    (6, 0.05),
                    (7, 0.02),
                ],
            ),
            3,
        ),
        (
            "q far from p",
            sparse(0, &[(7, 0.4), (6, 0.3), (5, 0.2), (0, 0.1)]),
            3,
        ),
        (
            "q misses p's mode",
            sparse(0, &[(1, 0.5), (2, 0.3), (3, 0.2)]),
            2,
        ),
        (
            "q peaked: duplicate draws",
            sparse(0, &[(4, 0.9), (6, 0.1)]),
            2,
        ),
    ]
}

fn uniform(_: usize) -> Vec<f32> {
    vec![1.0 / 8.0; 8]
}

fn expected() -> Vec<f64> {
    P.iter().map(|&x| x as f64).collect()
}

/// The LLM's distribution at the root is `P`, at every other node uniform.
fn llm(n: usize) -> Vec<f32> {
    if n == 0 {
        P.to_vec()
    } else {
        uniform(n)
    }
}

/// Runs `verify` on `DRAWS` star trees drawn with `mode` for each case and asserts that the first
/// emitted token follows `P`; returns, per case, how many trees held a duplicate draw.
fn assert_first_token_follows_p(
    method: &str,
    seed: u64,
    mode: DrawMode,
    verify: impl Fn(&TokenTree, &mut ChaCha8Rng) -> Verdict,
) -> Vec<(&'static str, u32)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut duplicates = Vec::new();
    for (name, q, k) in cases() {
        let mut counts = [0u64; 8];
        let mut duplicate_trees = 0;
        for _ in 0..DRAWS {
            let tree = star(&q, k, mode, &mut rng);
            duplicate_trees += (tree.tokens()[1] == tree.tokens()[2]) as u32;
            let v = verify(&tree, &mut rng);
            counts[v.tokens(&tree)[0] as usize] += 1;
        }
        let pv = chi_square_p(&counts, &expected());
        println!("{method}, {name}: p-value {pv:.4}, {duplicate_trees} trees with duplicate draws");
        assert!(
            pv > 1e-3,
            "{method} is not lossless for {name}: p-value {pv}, counts {counts:?}"
        );
        duplicates.push((name, duplicate_trees));
    }
    duplicates
}

#[test]
fn multi_step_speculative_sampling_follows_p() {
    let duplicates = assert_first_token_follows_p("MSS", 1, DrawMode::Iid, |tree, rng| {
        verify_stochastic(tree, llm, rng)
    });
    for (name, duplicate_trees) in duplicates {
        if name.contains("duplicate") {
            assert!(
                duplicate_trees > DRAWS as u32 / 2,
                "the duplicate case must exercise duplicates"
            );
        }
    }
}

#[test]
fn recursive_rejection_sampling_follows_p() {
    assert_first_token_follows_p("RRS", 2, DrawMode::WithoutReplacement, |tree, rng| {
        verify_stochastic(tree, llm, rng)
    });
}

#[test]
fn naive_sampling_follows_p() {
    assert_first_token_follows_p("naive sampling", 3, DrawMode::Iid, |tree, rng| {
        verify_naive_sampling(tree, llm, rng)
    });
}

/// The context lookup's chain (every node drawn from a point mass) beside sampled children: the
/// first token still follows `P`, and after a first token 0 (the chain's first token, also
/// drawable by the sampled children, which have no children of their own) the second follows the
/// LLM's uniform distribution there, whichever branch was accepted.
#[test]
fn a_context_lookup_chain_beside_sampled_children_keeps_p() {
    use specinfer_speculator::ContextLookup;
    let lookup = ContextLookup {
        min_match: 2,
        max_match: 2,
        max_tokens: 2,
    };
    // The root is token 0; "5 0" occurred before, followed by "0 3".
    let context = [5, 0, 0, 3, 1, 5, 0];
    assert_eq!(lookup.continuation(&context), &[0, 3]);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for mode in [DrawMode::Iid, DrawMode::WithoutReplacement] {
        // Where q is close to p the residual leaves the chain almost nothing; where q misses p's
        // mode the chain takes most acceptances: summed over the cases it must be exercised.
        let mut through_chain = 0;
        for (name, q, k) in cases() {
            let (mut first, mut second) = ([0u64; 8], [0u64; 8]);
            let chain_before = through_chain;
            for _ in 0..DRAWS {
                let tree = lookup.extend(star(&q, k, mode, &mut rng), &context, 64, true);
                let v = verify_stochastic(&tree, llm, &mut rng);
                let tokens = v.tokens(&tree);
                first[tokens[0] as usize] += 1;
                if tokens[0] == 0 && tokens.len() > 1 {
                    second[tokens[1] as usize] += 1;
                }
                through_chain += (v.accepted.first() == Some(&(k as u32 + 1))) as u32;
            }
            let p1 = chi_square_p(&first, &expected());
            let p2 = chi_square_p(&second, &[1.0 / 8.0; 8]);
            println!(
                "{mode:?} + lookup, {name}: p-values {p1:.4} (first), {p2:.4} (second), {} through the chain",
                through_chain - chain_before
            );
            assert!(p1 > 1e-3, "{mode:?}, {name}: first token {first:?}");
            assert!(p2 > 1e-3, "{mode:?}, {name}: second token {second:?}");
        }
        assert!(
            through_chain > DRAWS as u32 / 10,
            "{mode:?}: the chain was accepted only {through_chain} times"
        );
    }
}

/// MSS on a depth-1 tree written out independently, with the residual left unnormalised between
/// children: the bug the chi-square test must catch.
fn broken_mss_first_token(tree: &TokenTree, rng: &mut impl Rng) -> u32 {
    let q = &tree.proposals().unwrap().dists[0];
    let mut p = P.to_vec();
    for &x in &tree.tokens()[1..] {
        if rng.random::<f32>() * q.prob(x) < p[x as usize] {
            return x;
        }
        for (&t, &w) in q.ids.iter().zip(&q.probs) {
            p[t as usize] = (p[t as usize] - w).max(0.0);
        }
    }
    sample(&p, rng.random()) as u32
}

#[test]
fn the_chi_square_test_catches_a_missing_residual_normalisation() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    // The residual after one rejection keeps mass on token 0, which later draws can propose.
    let q = sparse(0, &[(0, 0.2), (1, 0.5), (2, 0.3)]);
    let mut counts = [0u64; 8];
    for _ in 0..DRAWS {
        let tree = star(&q, 3, DrawMode::Iid, &mut rng);
        counts[broken_mss_first_token(&tree, &mut rng) as usize] += 1;
    }
    let pv = chi_square_p(&counts, &expected());
    println!("broken MSS: p-value {pv:e}");
    assert!(
        pv < 1e-3,
        "the broken variant passed: the test has no power (p-value {pv})"
    );
}

/// Conditional distributions for a two-token test over a 6-token vocabulary.
fn p2(x1: u32) -> Vec<f32> {
    let mut p: Vec<f32> = (0..6)
        .map(|t| 1.0 + ((t * 7 + x1 * 3) % 6) as f32)
        .collect();
    p[(x1 as usize + 1) % 6] *= 4.0;
    normalise(&mut p);
    p
}

#[test]
fn two_emitted_tokens_follow_the_joint_distribution() {
    let p1: Vec<f32> = vec![0.35, 0.25, 0.15, 0.1, 0.1, 0.05];
    let q0 = sparse(0, &[(0, 0.1), (1, 0.5), (2, 0.2), (5, 0.2)]);
    let q1 =
        |node: u32, x1: u32| sparse(node, &[((x1 + 2) % 6, 0.5), ((x1 + 1) % 6, 0.3), (x1, 0.2)]);
    for mode in [DrawMode::Iid, DrawMode::WithoutReplacement] {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut counts = vec![0u64; 36];
        for _ in 0..DRAWS * 2 {
            let first = draw(&q0, 2, mode, &mut rng);
            let mut tokens = vec![0, first[0], first[1]];
            let mut parents = vec![0, 0];
            let mut dists = vec![q0.clone()];
            let mut drawn_from = vec![0, 0];
            for (i, &x1) in first.iter().enumerate() {
                let node = i as u32 + 1;
                let q = q1(node, x1);
                for x2 in draw(&q, 2, mode, &mut rng) {
                    tokens.push(x2);
                    parents.push(node);
                    drawn_from.push(dists.len() as u32);
                }
                dists.push(q);
            }
            let tree = TokenTree::new(tokens, parents)
                .unwrap()
                .with_proposals(Proposals {
                    mode,
                    dists,
                    drawn_from,
                })
                .unwrap();
            let dist = |n: usize| match tree.depths()[n] {
                0 => p1.clone(),
                1 => p2(tree.token(n)),
                _ => vec![1.0 / 6.0; 6],
            };
            let out = verify_stochastic(&tree, dist, &mut rng).tokens(&tree);
            // A round that emitted one token continues from it: its next token is a fresh draw
            // from p(. | x1), which the single-token tests above show every round produces.
            let second = match out.get(1) {
                Some(&t) => t,
                None => sample(&p2(out[0]), rng.random()) as u32,
            };
            counts[(out[0] * 6 + second) as usize] += 1;
        }
        let joint: Vec<f64> = (0..36)
            .map(|c| p1[c / 6] as f64 * p2(c as u32 / 6)[c % 6] as f64)
            .collect();
        let pv = chi_square_p(&counts, &joint);
        println!("two tokens, {mode:?}: p-value {pv:.4}");
        assert!(
            pv > 1e-3,
            "joint of two tokens is off for {mode:?}: p-value {pv}"
        );
    }
}

/// A deterministic stand-in LLM over 16 tokens whose logits depend on the whole path.
fn toy_logits(path: &[u32]) -> Vec<f32> {
    let mut h: u64 = 1469598103934665603;
    for &t in path {
        h = (h ^ t as u64).wrapping_mul(1099511628211);
    }
    (0..16u64)
        .map(|t| ((h.rotate_left(t as u32 * 4) ^ t.wrapping_mul(0x9E37)) % 1000) as f32)
        .collect()
}

#[test]
fn greedy_emits_exactly_the_argmax_path() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for _ in 0..500 {
        let prefix = vec![rng.random_range(0..16u32)];
        // The greedy continuation of the prefix.
        let mut greedy = prefix.clone();
        for _ in 0..12 {
            let l = toy_logits(&greedy);
            greedy.push(specinfer_kernels::sampling::argmax(&l) as u32);
        }
        // A random tree that contains the first `d` greedy tokens as one path, plus distractors
        // with distinct sibling tokens.
        let d = rng.random_range(0..8usize);
        let mut tree = TokenTree::root(prefix[0]);
        let mut node = 0u32;
        for g in &greedy[1..=d] {
            node = tree.push(node, *g);
        }
        for _ in 0..rng.random_range(0..20) {
            let parent = rng.random_range(0..tree.len()) as u32;
            let t = rng.random_range(0..16u32);
            let siblings = tree.children()[parent as usize].clone();
            if siblings.iter().all(|&s| tree.token(s as usize) != t) {
                tree.push(parent, t);
            }
        }
        let paths: Vec<Vec<u32>> = (0..tree.len())
            .map(|n| {
                tree.path_to(n)
                    .iter()
                    .map(|&i| tree.token(i as usize))
                    .collect()
            })
            .collect();
        let logits: Vec<Vec<f32>> = paths.iter().map(|p| toy_logits(p)).collect();
        let v = verify_greedy(&tree, |n| argmax(&logits[n]) as u32);
        let out = v.tokens(&tree);
        // The longest root path agreeing with the greedy continuation decides the length.
        let deepest = paths
            .iter()
            .filter(|p| greedy.starts_with(p))
            .map(|p| p.len())
            .max()
            .unwrap();
        assert!(deepest > d);
        assert_eq!(out, greedy[1..deepest + 1].to_vec(), "tree {tree:?}");
        assert_eq!(v.accepted.len(), deepest - 1);
    }
}

#[test]
fn mss_accepts_more_than_naive_sampling_on_the_same_trees() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (q, k) = (cases()[0].1.clone(), 3);
    let (mut mss, mut naive) = (0usize, 0usize);
    for _ in 0..DRAWS / 5 {
        let tree = star(&q, k, DrawMode::Iid, &mut rng);
        mss += verify_stochastic(&tree, llm, &mut rng).accepted.len();
        naive += verify_naive_sampling(&tree, llm, &mut rng).accepted.len();
    }
    let ratio = mss as f64 / naive as f64;
    println!(
        "accepted drafts per call: MSS {:.3}, naive {:.3}, ratio {ratio:.2}",
        mss as f64 / (DRAWS / 5) as f64,
        naive as f64 / (DRAWS / 5) as f64
    );
    assert!(
        ratio > 1.2,
        "MSS should accept clearly more than naive sampling; ratio {ratio}"
    );
}

/// End to end: the first two tokens' joint distribution through the real client drawing (the
/// round driver and speculator over a tiny random SSM), the wire (every Verify and Verified
/// encoded and decoded) and the verifier (a session over a tiny random LLM), against the LLM's
/// exact joint, for dynamic and expansion trees, drawn i.i.d. and without replacement, with the
/// context lookup's chain beside them. `tamper` alters each declared proposal before it is
/// sent, which the test must catch.
mod end_to_end {
    use super::chi_square_p;
    use specinfer_kernels::sampling::distribution;
    use specinfer_model::{Arch, FeatureDrafter, KvCache, Llama, ModelConfig, SeqTree};
    use specinfer_speculator::{
        CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, FeatureDraft, RoundDriver,
        Speculator, TreeShape,
    };
    use specinfer_verifier::Session;
    use specinfer_wire::*;

    const VOCAB: usize = 8;
    const TEMPERATURE: f32 = 1.0;
    /// The lookup finds "1 2 3" earlier in the prompt and proposes what followed it.
    const PROMPT: [u32; 7] = [1, 2, 3, 4, 1, 2, 3];

    fn tiny(seed: u64) -> Llama {
        let cfg = ModelConfig {
            vocab_size: VOCAB,
            ..ModelConfig::tiny(Arch::Llama)
        };
        Llama::random(cfg, seed, None).unwrap()
    }

    fn through_the_wire(msg: Message) -> Message {
        let frame = encode_frame(&msg);
        decode_frame(&frame[FRAME_HEADER_BYTES..], &Limits::default()).unwrap()
    }

    /// A proposal declared wrongly: the drawn tokens' probabilities halved.
    fn tampered(tree: TokenTree) -> TokenTree {
        let Some(p) = tree.proposals().cloned() else {
            return tree;
        };
        let dists = p
            .dists
            .iter()
            .map(|d| {
                let mut probs: Vec<f32> = d.probs.iter().map(|&w| w * 0.5).collect();
                probs[0] *= 4.0;
                let total: f32 = probs.iter().sum();
                SparseDist {
                    probs: probs.iter().map(|w| w / total).collect(),
                    ..d.clone()
                }
            })
            .collect();
        tree_with(tree, Proposals { dists, ..p })
    }

    fn parents(tree: &TokenTree) -> Vec<u32> {
        (1..tree.len())
            .map(|n| tree.parent(n).unwrap() as u32)
            .collect()
    }

    fn tree_with(tree: TokenTree, p: Proposals) -> TokenTree {
        TokenTree::new(tree.tokens().to_vec(), parents(&tree))
            .unwrap()
            .with_proposals(p)
            .unwrap()
    }

    /// Whether to hand the rest of the answer to the verifier's own decoding now, from what was
    /// generated so far (asked before every split round).
    type HandOffRule = fn(&[u32]) -> bool;

    /// Counts of (first, second) generated token over `trials` generations, every verdict
    /// carrying `node_cap` (0: none), as a busy verifier's do. Where `hand_off` says so, the
    /// rest is decoded by the verifier on its own, as its engine does after `Generate`. The
    /// verifier applies `repeat_penalty` over the whole context (1: none).
    #[allow(clippy::too_many_arguments)]
    fn sample_pairs<'d>(
        llm: &Llama,
        draft: &dyn Fn() -> Box<dyn DraftModel + Send + 'd>,
        shape: &TreeShape,
        draw: DrawMode,
        trials: usize,
        tamper: bool,
        node_cap: u32,
        hand_off: Option<HandOffRule>,
        repeat_penalty: f32,
    ) -> Vec<u64> {
        let limits = Limits::default();
        let mut counts = vec![0u64; VOCAB * VOCAB];
        for trial in 0..trials as u64 {
            let params = SamplingParams {
                mode: VerifyMode::Stochastic,
                temperature: TEMPERATURE,
                seed: trial,
                repeat_penalty,
                repeat_last_n: 64,
                ..SamplingParams::greedy(2)
            };
            let drafter = Drafter {
                speculator: Speculator::with_shape(
                    shape.clone(),
                    DraftMode::Sample {
                        temperature: TEMPERATURE,
                        top_p: 1.0,
                        top_k: 5,
                        draw,
                    },
                    trial ^ 0xd1ce,
                ),
                drafts: vec![draft()],
            };
            let mut driver = RoundDriver::new(PROMPT.to_vec(), params.clone(), Some(drafter))
                .unwrap()
                .with_lookup(Some(ContextLookup::default()));
            let (prompt, params) = driver.open_request();
            let mut session = Session::open(llm, &prompt, params, &limits).unwrap();
            let mut round = 0;
            // A clock moving a millisecond a reading: the adaptive tree sees costs to weigh.
            let now = std::cell::Cell::new(0.0);
            let clock = || {
                now.set(now.get() + 1e-3);
                now.get()
            };
            while !driver.is_finished() {
                if hand_off.is_some_and(|rule| rule(driver.generated())) {
                    driver.start_server_decoding().unwrap();
                    decode_on_the_verifier(llm, &mut session, &mut driver, round, &clock);
                    break;
                }
                let mut tree = driver.draft(&clock).unwrap();
                if tamper {
                    tree = tampered(tree);
                }
                let Message::Verify(v) = through_the_wire(Message::Verify(Verify {
                    session: 1,
                    round,
                    tree,
                })) else {
                    unreachable!()
                };
                let outcome = session.verify(llm, &limits, &v.tree).unwrap();
                let stats = RoundStats {
                    tree_nodes: v.tree.len() as u32,
                    batch_size: 1,
                    queue_us: 0,
                    forward_us: 500 + 20 * v.tree.len() as u32,
                    node_cap,
                    ..RoundStats::default()
                };
                let Message::Verified(verdict) =
                    through_the_wire(Message::Verified(outcome.into_verified(1, round, stats)))
                else {
                    unreachable!()
                };
                driver.on_verified(&verdict, clock()).unwrap();
                round += 1;
            }
            let out = driver.generated();
            counts[out[0] as usize * VOCAB + out[1] as usize] += 1;
        }
        counts
    }

    /// The verifier decodes the rest of `session` on its own (a driver without drafts, with the
    /// lookup the client asks for, as in its engine), each verdict through the wire to the
    /// client's `driver`.
    fn decode_on_the_verifier(
        llm: &Llama,
        session: &mut Session,
        driver: &mut RoundDriver<'_>,
        mut round: u32,
        clock: &dyn Fn() -> f64,
    ) {
        let limits = Limits::default();
        let mut own = RoundDriver::new(session.tokens().to_vec(), session.params().clone(), None)
            .unwrap()
            .with_lookup(ContextLookup::for_server(driver.server_drafting()));
        while !driver.is_finished() {
            let tree = own.draft(clock).unwrap();
            let outcome = session.verify(llm, &limits, &tree).unwrap();
            let stats = RoundStats {
                tree_nodes: tree.len() as u32,
                batch_size: 1,
                ..RoundStats::default()
            };
            let verdict = outcome.into_verified(1, round, stats);
            own.on_verified(&verdict, clock()).unwrap();
            let Message::Verified(verdict) = through_the_wire(Message::Verified(verdict)) else {
                unreachable!()
            };
            driver.on_verified(&verdict, clock()).unwrap();
            round += 1;
        }
    }

    fn joint(llm: &Llama) -> Vec<f64> {
        joint_penalised(llm, 1.0)
    }

    /// The joint of the next two tokens with every token of their context's logits penalised
    /// as llama.cpp does.
    fn joint_penalised(llm: &Llama, penalty: f32) -> Vec<f64> {
        let next = |seq: &[u32]| {
            let mut kv = KvCache::new(llm.config());
            let tree = TokenTree::chain(seq);
            let out = llm.forward(&mut [SeqTree::new(&mut kv, &tree)]).unwrap();
            let mut row = out[0].node(seq.len() - 1).to_vec();
            specinfer_kernels::sampling::penalise_repeats(&mut row, seq, penalty);
            distribution(&row, TEMPERATURE, 0, 1.0)
        };
        let p1 = next(&PROMPT);
        let mut joint = Vec::with_capacity(VOCAB * VOCAB);
        for (x1, &a) in p1.iter().enumerate() {
            let mut seq = PROMPT.to_vec();
            seq.push(x1 as u32);
            joint.extend(next(&seq).iter().map(|&b| a as f64 * b as f64));
        }
        joint
    }

    /// The verifier's repetition penalty (strong here, 1.5, over the whole context): sampled
    /// trees through the client, the wire and the verifier give the penalised LLM's joint, and
    /// not the plain LLM's (the test's power).
    #[test]
    fn a_repetition_penalty_gives_the_penalised_llms_joint() {
        let (llm, ssm) = (tiny(1), tiny(2));
        let ssm = || Box::new(CachedDraft::new(&ssm)) as Box<dyn DraftModel + Send>;
        let shape = TreeShape::Dynamic { budget: 8 };
        for draw in [DrawMode::Iid, DrawMode::WithoutReplacement] {
            let counts = sample_pairs(&llm, &ssm, &shape, draw, 12_000, false, 0, None, 1.5);
            let pv = chi_square_p(&counts, &joint_penalised(&llm, 1.5));
            println!("penalised {draw:?}: p-value {pv:.4}");
            assert!(pv > 1e-3, "penalised {draw:?}: joint is off, p-value {pv}");
            let plain = chi_square_p(&counts, &joint(&llm));
            assert!(
                plain < 1e-3,
                "the penalty changed nothing (p-value {plain})"
            );
        }
    }

    #[test]
    fn sampled_trees_through_client_wire_and_verifier_keep_the_llms_joint() {
        let (llm, ssm) = (tiny(1), tiny(2));
        let joint = joint(&llm);
        let ssm = || Box::new(CachedDraft::new(&ssm)) as Box<dyn DraftModel + Send>;
        for shape in [
            TreeShape::Dynamic { budget: 8 },
            TreeShape::AdaptiveDynamic { budget: 8 },
            TreeShape::Expansion(vec![2, 2]),
        ] {
            for draw in [DrawMode::Iid, DrawMode::WithoutReplacement] {
                let counts = sample_pairs(&llm, &ssm, &shape, draw, 12_000, false, 0, None, 1.0);
                let pv = chi_square_p(&counts, &joint);
                println!("{shape} {draw:?}: p-value {pv:.4}");
                assert!(pv > 1e-3, "{shape} {draw:?}: joint is off, p-value {pv}");
            }
        }
        // A busy verifier's node cap cuts the trees after the first round to their first nodes.
        for draw in [DrawMode::Iid, DrawMode::WithoutReplacement] {
            let shape = TreeShape::Dynamic { budget: 8 };
            let counts = sample_pairs(&llm, &ssm, &shape, draw, 12_000, false, 3, None, 1.0);
            let pv = chi_square_p(&counts, &joint);
            println!("{shape} {draw:?} capped at 3 nodes: p-value {pv:.4}");
            assert!(
                pv > 1e-3,
                "{shape} {draw:?} capped: joint is off, p-value {pv}"
            );
        }
        // The mutation check: the same trees with their proposals misdeclared.
        let counts = sample_pairs(
            &llm,
            &ssm,
            &TreeShape::Dynamic { budget: 8 },
            DrawMode::WithoutReplacement,
            12_000,
            true,
            0,
            None,
            1.0,
        );
        let pv = chi_square_p(&counts, &joint);
        assert!(
            pv < 1e-3,
            "misdeclared proposals passed: the test has no power (p-value {pv})"
        );
    }

    /// A split answer handed to the verifier's own decoding, before its first tree or after a
    /// first round whose token was even (a decision that follows the tokens drawn, as the
    /// hand-off's measured rates do): every token is still drawn from the LLM's conditional
    /// given those before it, so the joint is the LLM's.
    #[test]
    fn an_answer_handed_to_the_verifier_keeps_the_llms_joint() {
        let (llm, ssm) = (tiny(1), tiny(2));
        let joint = joint(&llm);
        let ssm = || Box::new(CachedDraft::new(&ssm)) as Box<dyn DraftModel + Send>;
        let at_once: HandOffRule = |_| true;
        let after_an_even_token: HandOffRule = |g| g.first().is_some_and(|t| t % 2 == 0);
        for (name, rule) in [
            ("at once", at_once),
            ("after an even token", after_an_even_token),
        ] {
            let shape = TreeShape::Dynamic { budget: 8 };
            let draw = DrawMode::WithoutReplacement;
            let counts = sample_pairs(&llm, &ssm, &shape, draw, 12_000, false, 0, Some(rule), 1.0);
            let pv = chi_square_p(&counts, &joint);
            println!("handed off {name}: p-value {pv:.4}");
            assert!(pv > 1e-3, "handed off {name}: joint is off, p-value {pv}");
        }
    }

    /// The feature-conditioned drafter: the verifier returns the LLM's features with each
    /// verdict (8-bit rows through the wire) and the drafter draws its tree from them; its head
    /// covers six of the eight tokens, so its proposals are exactly 0 on the other two.
    #[test]
    fn feature_drafted_trees_keep_the_llms_joint() {
        let llm = tiny(1);
        let drafter =
            FeatureDrafter::random(VOCAB, llm.config().d_model, &[0, 1, 2, 3, 5, 6], 3).unwrap();
        let joint = joint(&llm);
        let draft = || Box::new(FeatureDraft::new(&drafter)) as Box<dyn DraftModel + Send>;
        for (shape, draw) in [
            (
                TreeShape::Dynamic { budget: 8 },
                DrawMode::WithoutReplacement,
            ),
            (TreeShape::Expansion(vec![2, 2]), DrawMode::Iid),
        ] {
            let counts = sample_pairs(&llm, &draft, &shape, draw, 12_000, false, 0, None, 1.0);
            let pv = chi_square_p(&counts, &joint);
            println!("feature draft, {shape} {draw:?}: p-value {pv:.4}");
            assert!(pv > 1e-3, "{shape} {draw:?}: joint is off, p-value {pv}");
        }
        let counts = sample_pairs(
            &llm,
            &draft,
            &TreeShape::Dynamic { budget: 8 },
            DrawMode::WithoutReplacement,
            12_000,
            true,
            0,
            None,
            1.0,
        );
        let pv = chi_square_p(&counts, &joint);
        assert!(pv < 1e-3, "misdeclared proposals passed (p-value {pv})");
    }
}
