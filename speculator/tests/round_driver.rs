//! The round driver against a scripted verifier, no sockets: a toy "LLM" whose next token is a
//! function of the position (a repeating pattern, so the context lookup has something to find),
//! a toy draft that is right except at every third position, and greedy verification done by
//! hand. Whatever the drafting (lookup on or off, pipelined guesses hit or missed, a lost round
//! resumed, a session re-opened), the output must be the scripted LLM's own.

use std::cell::Cell;

use specinfer_model::ModelError;
use specinfer_speculator::{
    ContextLookup, DraftMode, DraftModel, Drafter, Recovery, RoundDriver, Speculator, TreeShape,
};
use specinfer_wire::{
    FinishReason, RoundStats, SamplingParams, TokenTree, Verified, VerifierCosts, VerifyMode,
};

const VOCAB: usize = 64;
const PATTERN: [u32; 7] = [10, 11, 12, 13, 14, 15, 16];
const PROMPT: [u32; 5] = [1, 2, 3, 4, 5];

/// The scripted LLM's next token after a context of `len` tokens.
fn truth(len: usize) -> u32 {
    PATTERN[len % PATTERN.len()]
}

/// What the scripted LLM alone generates after the prompt.
fn expected(max_new: usize) -> Vec<u32> {
    (0..max_new).map(|i| truth(PROMPT.len() + i)).collect()
}

/// Predicts the scripted LLM, wrongly at every `wrong_every`-th position (0: never wrong), with
/// the LLM's token its second choice at half of those.
struct ToyDraft {
    committed_len: usize,
    wrong_every: usize,
    calls: usize,
}

impl ToyDraft {
    fn new(wrong_every: usize) -> Self {
        ToyDraft {
            committed_len: 0,
            wrong_every,
            calls: 0,
        }
    }
}

impl DraftModel for ToyDraft {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        self.committed_len = committed.len();
        Ok(())
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        self.calls += 1;
        let depths = tree.depths();
        Ok((first..tree.len())
            .map(|node| {
                // The context after this node: the committed tokens and the path below the root.
                let len = self.committed_len + depths[node] as usize;
                let (mut best, mut second) = (truth(len), 61);
                if self.wrong_every > 0 && len.is_multiple_of(self.wrong_every) {
                    // Wrong; the LLM's token its second choice half the time.
                    best = 60;
                    second = if len.is_multiple_of(2) {
                        truth(len)
                    } else {
                        61
                    };
                }
                let mut logits = vec![-10.0f32; VOCAB];
                logits[best as usize] = 5.0;
                logits[second as usize] = 1.0;
                logits
            })
            .collect())
    }
}

/// The verifier's side of one session, scripted: greedy verification of whole trees.
struct ScriptedVerifier {
    committed: Vec<u32>,
    left: usize,
    round: u32,
    /// What its verdicts say of its load (node price, node cap).
    load: (u32, u32),
}

impl ScriptedVerifier {
    fn open((prompt, params): (Vec<u32>, SamplingParams)) -> Self {
        ScriptedVerifier {
            committed: prompt,
            left: params.max_new_tokens as usize,
            round: 0,
            load: (0, 0),
        }
    }

    fn verify(&mut self, tree: &TokenTree) -> Verified {
        assert_eq!(
            tree.token(0),
            *self.committed.last().unwrap(),
            "a tree off the root"
        );
        let children = tree.children();
        let (mut node, mut accepted_nodes, mut tokens) = (0usize, Vec::new(), Vec::new());
        while tokens.len() < self.left {
            let t = truth(self.committed.len() + tokens.len());
            tokens.push(t);
            match children[node]
                .iter()
                .find(|&&c| tree.token(c as usize) == t)
            {
                Some(&c) => {
                    accepted_nodes.push(c);
                    node = c as usize;
                }
                None => break,
            }
        }
        accepted_nodes.truncate(tokens.len());
        self.left -= tokens.len();
        self.committed.extend(&tokens);
        self.round += 1;
        Verified {
            session: 1,
            round: self.round - 1,
            accepted_nodes,
            tokens,
            finish: (self.left == 0).then_some(FinishReason::Length),
            stats: RoundStats {
                tree_nodes: tree.len() as u32,
                batch_size: 1,
                queue_us: 0,
                forward_us: 1_000 + 50 * tree.len() as u32,
                node_price_ns: self.load.0,
                node_cap: self.load.1,
            },
            features: None,
        }
    }
}

/// A clock that moves 2 ms each time it is read: rounds look like a network's.
fn scripted_clock() -> impl Fn() -> f64 {
    let t = Cell::new(0.0);
    move || {
        t.set(t.get() + 0.002);
        t.get()
    }
}

fn driver<'a>(draft: ToyDraft, shape: TreeShape, max_new: u32) -> RoundDriver<'a> {
    let drafter = Drafter {
        speculator: Speculator::with_shape(shape, DraftMode::Greedy, 0),
        drafts: vec![Box::new(draft)],
    };
    RoundDriver::new(
        PROMPT.to_vec(),
        SamplingParams::greedy(max_new),
        Some(drafter),
    )
    .unwrap()
}

/// Drives `driver` to the end against a fresh scripted verifier; returns the tokens each round
/// handed out.
fn run(driver: &mut RoundDriver<'_>) -> Vec<u32> {
    run_loaded(driver, (0, 0), 0.0).0
}

/// [`run`] against a verifier whose verdicts carry `load` (node price ns, node cap), each
/// verdict arriving `rtt` seconds late; also returns the size of every tree sent.
fn run_loaded(driver: &mut RoundDriver<'_>, load: (u32, u32), rtt: f64) -> (Vec<u32>, Vec<usize>) {
    let clock = scripted_clock();
    let mut server = ScriptedVerifier::open(driver.open_request());
    server.load = load;
    let (mut streamed, mut sizes) = (Vec::new(), Vec::new());
    while !driver.is_finished() {
        let tree = driver.draft(&clock).unwrap();
        sizes.push(tree.len());
        driver.draft_ahead();
        let out = driver
            .on_verified(&server.verify(&tree), clock() + rtt)
            .unwrap();
        streamed.extend(out.tokens);
    }
    (streamed, sizes)
}

#[test]
fn a_client_told_a_node_cap_never_sends_a_larger_tree() {
    let max_new = 60;
    for cap in [1u32, 3, 5] {
        let mut d = driver(ToyDraft::new(3), TreeShape::Dynamic { budget: 16 }, max_new)
            .with_lookup(Some(ContextLookup::default()))
            .with_pipelining(true);
        let (out, sizes) = run_loaded(&mut d, (0, cap), 0.0);
        assert_eq!(
            out,
            expected(max_new as usize),
            "cap {cap} changed the output"
        );
        // The first tree goes before any verdict said a cap.
        assert!(
            sizes[0] > cap as usize,
            "the uncapped tree is larger: {sizes:?}"
        );
        assert!(
            sizes[1..].iter().all(|&n| n <= cap as usize),
            "cap {cap}: trees of {sizes:?}"
        );
    }
}

#[test]
fn load_aware_trees_shrink_when_the_verifier_prices_nodes_high() {
    let max_new = 120;
    let mean_late_size = |price_ns: u32| {
        let mut d = driver(
            ToyDraft::new(3),
            TreeShape::AdaptiveDynamic { budget: 16 },
            max_new,
        );
        // Behind a 50 ms round trip, where deep trees pay for the user.
        let (out, sizes) = run_loaded(&mut d, (price_ns, 0), 0.05);
        assert_eq!(out, expected(max_new as usize));
        let late = &sizes[sizes.len() / 2..];
        late.iter().sum::<usize>() as f64 / late.len() as f64
    };
    let idle = mean_late_size(0);
    // A node priced at 200 ms, against rounds of about 55 ms: no draft pays.
    let busy = mean_late_size(200_000_000);
    assert!(idle > 2.0, "an idle verifier's trees grow: {idle:.2} nodes");
    assert!(
        busy < 1.5,
        "a busy verifier's trees shrink to the root: {busy:.2} nodes (idle: {idle:.2})"
    );
}

#[test]
fn lookup_on_and_off_both_give_the_llms_output_and_the_lookup_adds_accepted_tokens() {
    let max_new = 60;
    let mut without = driver(ToyDraft::new(3), TreeShape::Expansion(vec![1, 1]), max_new);
    let mut with = driver(ToyDraft::new(3), TreeShape::Expansion(vec![1, 1]), max_new)
        .with_lookup(Some(ContextLookup::default()));
    assert_eq!(run(&mut without), expected(max_new as usize));
    assert_eq!(run(&mut with), expected(max_new as usize));
    assert_eq!(without.generated(), expected(max_new as usize));
    assert_eq!(without.stats().lookup_accepted, 0);
    assert!(
        with.stats().lookup_accepted > 0,
        "the pattern repeats: the lookup's chain must be accepted"
    );
    assert!(
        with.stats().rounds < without.stats().rounds,
        "{} rounds with the lookup, {} without",
        with.stats().rounds,
        without.stats().rounds
    );
    assert_eq!(with.finish(), Some(FinishReason::Length));
}

#[test]
fn the_lookup_alone_drafts_for_a_root_only_driver() {
    let mut d = RoundDriver::new(PROMPT.to_vec(), SamplingParams::greedy(40), None)
        .unwrap()
        .with_lookup(Some(ContextLookup::default()));
    assert_eq!(run(&mut d), expected(40));
    assert!(d.stats().lookup_accepted > 0);
    assert!(d.stats().rounds < 40);
}

#[test]
fn pipelined_guesses_are_used_when_they_hit_and_dropped_when_they_miss() {
    let max_new = 48;
    // A draft that is always right: once the acceptance measured says so (its prior expects
    // one draft in two accepted, so the first guesses stop short), the verdict matches the
    // guess and the tree drafted ahead is sent as is.
    let mut hit = driver(
        ToyDraft::new(0),
        TreeShape::Expansion(vec![1, 1, 1]),
        max_new,
    )
    .with_pipelining(true);
    assert_eq!(run(&mut hit), expected(max_new as usize));
    let s = hit.stats();
    assert!(
        s.pipelined_rounds + 4 >= s.rounds && s.rounds >= 10,
        "{} of {} rounds pipelined",
        s.pipelined_rounds,
        s.rounds
    );
    // A draft wrong at every third position: guesses miss, their trees are dropped, and the
    // output is unchanged.
    let mut miss = driver(
        ToyDraft::new(3),
        TreeShape::Expansion(vec![1, 1, 1]),
        max_new,
    )
    .with_pipelining(true);
    assert_eq!(run(&mut miss), expected(max_new as usize));
    let s = miss.stats();
    assert!(s.pipelined_rounds < s.rounds - 1, "every guess hit: {s:?}");
    assert!(s.pipelined_rounds > 0, "no guess hit: {s:?}");
}

#[test]
fn a_round_whose_answer_was_lost_is_recovered_by_resuming() {
    let max_new = 30;
    let mut d = driver(ToyDraft::new(3), TreeShape::Expansion(vec![1, 2]), max_new)
        .with_lookup(Some(ContextLookup::default()))
        .with_pipelining(true);
    let clock = scripted_clock();
    let mut server = ScriptedVerifier::open(d.open_request());
    let mut streamed = Vec::new();
    for _ in 0..3 {
        let tree = d.draft(&clock).unwrap();
        streamed.extend(
            d.on_verified(&server.verify(&tree), clock())
                .unwrap()
                .tokens,
        );
    }
    // The verifier verifies the fourth tree, but its answer is lost with the connection.
    let tree = d.draft(&clock).unwrap();
    d.draft_ahead();
    let lost = server.verify(&tree);
    d.connection_lost();
    assert!(!d.in_flight());
    assert!(
        d.on_verified(&lost, clock()).is_err(),
        "a verdict for no round in flight"
    );
    // Resumed on a new connection: the session's committed tokens bring the lost round's.
    match d.on_resumed(&server.committed).unwrap() {
        Recovery::Resumed(out) => {
            assert_eq!(out.tokens, lost.tokens);
            streamed.extend(out.tokens);
        }
        Recovery::Reopen => panic!("the verifier's session continues ours"),
    }
    server.round = 0;
    while !d.is_finished() {
        let tree = d.draft(&clock).unwrap();
        streamed.extend(
            d.on_verified(&server.verify(&tree), clock())
                .unwrap()
                .tokens,
        );
    }
    assert_eq!(streamed, expected(max_new as usize));
    assert_eq!(d.generated(), expected(max_new as usize));
}

/// A lost round that ended the answer (here by length) ends it when the session is resumed:
/// the driver does not send another round to a finished session.
#[test]
fn a_lost_round_that_finished_the_answer_finishes_it_on_resume() {
    let max_new = 6;
    let mut d = driver(
        ToyDraft::new(3),
        TreeShape::Expansion(vec![1, 1, 1]),
        max_new,
    );
    let clock = scripted_clock();
    let mut server = ScriptedVerifier::open(d.open_request());
    loop {
        let tree = d.draft(&clock).unwrap();
        let verdict = server.verify(&tree);
        if verdict.finish.is_some() {
            // Its answer is lost with the connection.
            d.connection_lost();
            break;
        }
        d.on_verified(&verdict, clock()).unwrap();
    }
    assert!(!d.is_finished());
    match d.on_resumed(&server.committed).unwrap() {
        Recovery::Resumed(out) => assert!(out.finished, "{out:?}"),
        Recovery::Reopen => panic!("the verifier's session continues ours"),
    }
    assert!(d.is_finished());
    assert_eq!(d.generated(), expected(max_new as usize));
}

#[test]
fn a_session_lost_for_good_is_reopened_with_everything_committed() {
    let max_new = 30u32;
    let mut d = driver(ToyDraft::new(3), TreeShape::Expansion(vec![1, 1]), max_new);
    let clock = scripted_clock();
    let mut server = ScriptedVerifier::open(d.open_request());
    for _ in 0..4 {
        let tree = d.draft(&clock).unwrap();
        d.on_verified(&server.verify(&tree), clock()).unwrap();
    }
    let generated = d.generated().len();
    let _ = d.draft(&clock).unwrap();
    // A verifier that restarted holds some other session under our id.
    assert!(matches!(
        d.on_resumed(&[9, 9, 9]).unwrap(),
        Recovery::Reopen
    ));
    let (prompt, params) = d.open_request();
    assert_eq!(prompt, d.committed());
    assert_eq!(params.max_new_tokens as usize, max_new as usize - generated);
    let mut server = ScriptedVerifier::open((prompt, params));
    while !d.is_finished() {
        let tree = d.draft(&clock).unwrap();
        d.on_verified(&server.verify(&tree), clock()).unwrap();
    }
    assert_eq!(d.generated(), expected(max_new as usize));
}

#[test]
fn the_driver_refuses_rounds_out_of_order() {
    let mut d = driver(ToyDraft::new(3), TreeShape::Expansion(vec![1]), 8);
    let clock = scripted_clock();
    let mut server = ScriptedVerifier::open(d.open_request());
    let tree = d.draft(&clock).unwrap();
    assert!(
        d.draft(&clock).is_err(),
        "a second tree while one is in flight"
    );
    let verdict = server.verify(&tree);
    d.on_verified(&verdict, clock()).unwrap();
    assert!(
        d.on_verified(&verdict, clock()).is_err(),
        "the same verdict twice"
    );
    assert!(RoundDriver::new(Vec::new(), SamplingParams::greedy(4), None).is_err());
}

#[test]
fn a_seeded_sampled_answer_does_not_hand_off_on_the_verifiers_load() {
    // A loaded verifier and a client 14 ms away: the split does not pay, so the hand-off asks
    // for the verifier's own decoding before any tree, unless a seed must reproduce a sampled
    // answer (which decoding draws it must not depend on timings). A greedy answer is the same
    // either way and hands off.
    let loaded = VerifierCosts {
        plain_step_us: 8_000,
        split_round_us: 37_000,
        split_tokens_milli: 1_500,
    };
    let sampled = SamplingParams {
        mode: VerifyMode::Stochastic,
        temperature: 0.8,
        ..SamplingParams::greedy(16)
    };
    let wants_server = |params: SamplingParams, reproducible: bool| {
        let mut d = RoundDriver::new(PROMPT.to_vec(), params, None)
            .unwrap()
            .with_hand_off(true);
        if reproducible {
            d = d.reproducible();
        }
        d.verifier_costs(&loaded, 0.014);
        d.wants_server_decoding()
    };
    assert!(wants_server(sampled.clone(), false));
    assert!(!wants_server(sampled, true));
    assert!(wants_server(SamplingParams::greedy(16), true));
}

/// The toy draft asking for the LLM's features, as a feature-conditioned draft does.
struct FeatureReader(ToyDraft);

impl DraftModel for FeatureReader {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        self.0.sync(committed)
    }
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        self.0.extend(tree, first)
    }
    fn wants_features(&self) -> bool {
        true
    }
}

#[test]
fn a_session_reopened_after_the_hand_off_asks_for_no_features() {
    let drafter = Drafter {
        speculator: Speculator::with_shape(TreeShape::Expansion(vec![1, 1]), DraftMode::Greedy, 0),
        drafts: vec![Box::new(FeatureReader(ToyDraft::new(3)))],
    };
    let mut d =
        RoundDriver::new(PROMPT.to_vec(), SamplingParams::greedy(30), Some(drafter)).unwrap();
    assert!(
        d.open_request().1.return_features,
        "a feature draft's session asks for the LLM's features"
    );
    d.start_server_decoding().unwrap();
    assert!(
        !d.open_request().1.return_features,
        "a session the verifier decodes on its own asked for features nothing reads"
    );
}
