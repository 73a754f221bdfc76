//! Prefix reuse end to end: a chat's second turn starts from the K/V the verifier kept of the
//! first, prefills only what is new, and answers token for token as a verifier without the
//! prefix cache does.

use specinfer_edge::Client;
use specinfer_integration::{smollm2, start_verifier};
use specinfer_model::ChatMessage;
use specinfer_net::RemoteConfig;
use specinfer_speculator::RoundDriver;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::SamplingParams;

/// A two-turn chat on one connection: each turn's answer and the second turn's prompt length.
async fn two_turns(remote: &RemoteConfig) -> (Vec<u32>, Vec<u32>, usize) {
    let (_, tok) = smollm2();
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let mut messages = vec![ChatMessage::new("user", "What is the capital of France?")];
    let mut answers = Vec::new();
    let mut prompt_len = 0;
    for next in ["And of Italy?", ""] {
        let prompt = tok.encode(&tok.chat_prompt(&messages)).unwrap();
        prompt_len = prompt.len();
        let params = SamplingParams {
            stop_ids: tok.eos().to_vec(),
            ..SamplingParams::greedy(24)
        };
        let mut driver = RoundDriver::new(prompt, params, None).unwrap();
        let g = client.generate(&mut driver, |_| {}).await.unwrap();
        messages.push(ChatMessage::new(
            "assistant",
            &tok.decode(&g.token_ids).unwrap(),
        ));
        messages.push(ChatMessage::new("user", next));
        answers.push(g.token_ids);
    }
    client.shutdown().await;
    (answers.remove(0), answers.remove(0), prompt_len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chats_next_turn_reuses_the_last_turns_kv_and_answers_the_same() {
    let (cached, remote) = start_verifier(EngineConfig::default());
    let (first, second, second_prompt) = two_turns(&remote).await;
    let m = cached.metrics();
    let hits = m.prefix_hits.load(std::sync::atomic::Ordering::Relaxed);
    let reused = m
        .prefix_tokens_reused
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert_eq!(hits, 1, "the second turn started from the first's K/V");
    assert!(
        reused > second_prompt / 2 && reused < second_prompt,
        "{reused} of {second_prompt} prompt tokens reused"
    );
    cached.shutdown().await;

    let (plain, remote) = start_verifier(EngineConfig {
        prefix_cache_bytes: 0,
        ..EngineConfig::default()
    });
    let (first_plain, second_plain, _) = two_turns(&remote).await;
    assert_eq!(
        plain
            .metrics()
            .prefix_hits
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    plain.shutdown().await;
    assert_eq!(first, first_plain);
    assert_eq!(second, second_plain, "reused K/V changed the answer");
}
