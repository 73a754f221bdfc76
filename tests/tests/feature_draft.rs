//! The feature-conditioned drafter end to end over loopback QUIC with SmolLM2: the verifier
//! returns the LLM's features with every verdict, the client drafts from them (in candle and
//! through ONNX Runtime), and greedy output stays token-identical to incremental decoding while
//! more than one token is accepted per LLM pass.

use std::path::PathBuf;

use specinfer_edge::Client;
use specinfer_integration::{cache_dir, chat_ids, default_ssm, smollm2, start_verifier};
use specinfer_model::{fetch, FeatureDrafter};
use specinfer_onnx::OnnxFeatureModel;
use specinfer_speculator::{
    CachedDraft, DraftMode, DraftModel, Drafter, FeatureDraft, RoundDriver, Speculator, TreeShape,
};
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
    let lib = fetch::ensure(&fetch::ONNXRUNTIME, &cache_dir()).expect("fetching ONNX Runtime");
    specinfer_onnx::init_runtime(&lib).expect("loading ONNX Runtime");
    let export_dir = tempfile::tempdir().unwrap();
    let onnx_file = export_dir.path().join("feature-draft.onnx");
    drafter.export_onnx(&onnx_file, &[]).unwrap();
    let onnx = OnnxFeatureModel::load(&onnx_file, 1).unwrap();
    drop(export_dir);
    let mut client = Client::connect(remote.clone()).await.unwrap();
    // Per drafter (the feature drafter in candle and in ONNX Runtime, the default SSM): tokens,
    // rounds, tree nodes, drafting seconds, bytes up, bytes down; printed side by side, what a
    // round costs each way.
    let mut costs = [[0f64; 6]; 3];
    let (_, tok) = smollm2();
    for prompt in [
        "Explain how a bicycle works.",
        "Give me three tips for learning a new language.",
    ] {
        let ids = chat_ids(prompt);
        let params = SamplingParams {
            stop_ids: tok.eos().to_vec(),
            ..SamplingParams::greedy(64)
        };
        let mut plain = RoundDriver::new(ids.clone(), params.clone(), None).unwrap();
        let reference = client.generate(&mut plain, |_| {}).await.unwrap();
        let drafts: [Box<dyn DraftModel + Send + '_>; 3] = [
            Box::new(FeatureDraft::new(&drafter)),
            Box::new(FeatureDraft::new(&onnx)),
            Box::new(CachedDraft::new(default_ssm())),
        ];
        for (draft, c) in drafts.into_iter().zip(&mut costs) {
            // The default tree at its whole budget: its adaptive cut would follow this
            // machine's load (on loopback it may find that drafting does not pay at all).
            let speculative = Drafter {
                speculator: Speculator::for_request(
                    TreeShape::clients_default().uncut(),
                    DraftMode::Greedy,
                    0,
                ),
                drafts: vec![draft],
            };
            let mut driver =
                RoundDriver::new(ids.clone(), params.clone(), Some(speculative)).unwrap();
            let g = client.generate(&mut driver, |_| {}).await.unwrap();
            assert_eq!(
                g.token_ids, reference.token_ids,
                "a drafter changed the answer to {prompt:?}"
            );
            let s = &g.stats;
            for (x, v) in c.iter_mut().zip([
                g.token_ids.len() as f64,
                s.rounds as f64,
                s.tree_nodes as f64,
                s.draft_s,
                g.bytes_up as f64,
                g.bytes_down as f64,
            ]) {
                *x += v;
            }
        }
    }
    for (name, c) in [
        "feature drafter",
        "feature drafter (ONNX Runtime)",
        "default SSM",
    ]
    .iter()
    .zip(costs)
    {
        println!(
            "{name}: tau {:.2}, {:.1} nodes per round, {:.0} us drafting per node, {:.0} B up and {:.0} B down per round",
            c[0] / c[1],
            c[2] / c[1],
            c[3] / c[2] * 1e6,
            c[4] / c[1],
            c[5] / c[1]
        );
    }
    let tau = costs[0][0] / costs[0][1];
    assert!(
        tau > 1.5,
        "the feature drafter's trees were hardly accepted: tau {tau:.2}"
    );
    // The same model on either backend drafts the same trees (within float noise of ties).
    let onnx_tau = costs[1][0] / costs[1][1];
    assert!(
        (onnx_tau - tau).abs() < 0.1,
        "ONNX Runtime's drafts differ: tau {onnx_tau:.2} against {tau:.2}"
    );
    client.shutdown().await;
}
