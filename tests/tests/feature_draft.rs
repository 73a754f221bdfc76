//! The feature-conditioned drafter end to end over loopback QUIC with SmolLM2: the verifier
//! returns the LLM's features with every verdict, the client drafts from them, and greedy
//! output stays token-identical to incremental decoding while more than one token is accepted
//! per LLM pass.

use std::path::PathBuf;

use specinfer_edge::Client;
use specinfer_integration::{chat_ids, start_verifier};
use specinfer_model::FeatureDrafter;
use specinfer_speculator::{DraftMode, Drafter, FeatureDraft, RoundDriver, Speculator, TreeShape};
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::SamplingParams;

fn shipped_drafter() -> FeatureDrafter {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/feature-draft");
    assert!(FeatureDrafter::is_feature_draft(&dir));
    FeatureDrafter::from_safetensors(&dir).expect("loading models/feature-draft")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feature_drafted_greedy_output_over_quic_equals_incremental() {
    let (_server, remote) = start_verifier(EngineConfig::default());
    let drafter = shipped_drafter();
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let (mut tokens, mut rounds) = (0, 0);
    for prompt in [
        "What is the capital of France?",
        "Write a haiku about rain.",
    ] {
        let ids = chat_ids(prompt);
        let params = SamplingParams::greedy(48);
        let mut plain = RoundDriver::new(ids.clone(), params.clone(), None).unwrap();
        let reference = client.generate(&mut plain, |_| {}).await.unwrap();
        let speculative = Drafter {
            speculator: Speculator::for_request(TreeShape::clients_default(), DraftMode::Greedy, 0),
            drafts: vec![Box::new(FeatureDraft::new(&drafter))],
        };
        let mut driver = RoundDriver::new(ids, params, Some(speculative)).unwrap();
        let g = client.generate(&mut driver, |_| {}).await.unwrap();
        assert_eq!(
            g.token_ids, reference.token_ids,
            "the feature drafter changed the answer to {prompt:?}"
        );
        tokens += g.token_ids.len();
        rounds += g.stats.rounds;
    }
    let tau = tokens as f64 / rounds as f64;
    println!("feature drafter over QUIC: {tokens} tokens in {rounds} rounds, tau {tau:.2}");
    assert!(
        tau > 1.5,
        "the drafter's trees were hardly accepted: tau {tau:.2}"
    );
    client.shutdown().await;
}
