//! Prefix reuse end to end: a chat's second turn starts from the K/V the verifier kept of the
//! first and prefills only what is new, another conversation reuses only the system prompt they
//! share (a copy: the chat's K/V stay for its own prompts, so its first question asked again
//! reuses all of its prompt), and every answer is token for token what a verifier without the
//! prefix cache gives.

use specinfer_edge::Client;
use specinfer_integration::{chat_ids, smollm2, start_verifier};
use specinfer_model::ChatMessage;
use specinfer_net::RemoteConfig;
use specinfer_speculator::RoundDriver;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::SamplingParams;

/// On one connection: a two-turn chat, then a new conversation with another question. Each
/// answer, and each prompt's length.
/// Greedy answers of at most 24 tokens.
fn greedy() -> SamplingParams {
    let (_, tok) = smollm2();
    SamplingParams {
        stop_ids: tok.eos().to_vec(),
        ..SamplingParams::greedy(24)
    }
}

async fn conversations(remote: &RemoteConfig) -> Vec<(Vec<u32>, usize)> {
    let (_, tok) = smollm2();
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let chat = vec![ChatMessage::new("user", "What is the capital of France?")];
    let other = vec![ChatMessage::new("user", "Write a haiku about rain.")];
    let mut out = Vec::new();
    for (mut messages, next) in [(chat, Some("And of Italy?")), (other, None)] {
        loop {
            let prompt = tok.encode(&tok.chat_prompt(&messages)).unwrap();
            let len = prompt.len();
            let mut driver = RoundDriver::new(prompt, greedy(), None).unwrap();
            let g = client.generate(&mut driver, |_| {}).await.unwrap();
            out.push((g.token_ids.clone(), len));
            match (messages.len(), next) {
                (1, Some(question)) => {
                    messages.push(ChatMessage::new(
                        "assistant",
                        &tok.decode(&g.token_ids).unwrap(),
                    ));
                    messages.push(ChatMessage::new("user", question));
                }
                _ => break,
            }
        }
    }
    client.shutdown().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_prefixes_prefill_only_what_is_new_and_change_no_answer() {
    let (cached, remote) = start_verifier(EngineConfig::default());
    let answers = conversations(&remote).await;
    let m = cached.metrics();
    let hits = m.prefix_hits.load(std::sync::atomic::Ordering::Relaxed);
    let reused = m
        .prefix_tokens_reused
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    // The second turn starts from the first's K/V; the other conversation from the system
    // prompt the template puts in front of every conversation.
    assert_eq!(hits, 2);
    let (second, other) = (answers[1].1, answers[2].1);
    assert!(
        reused > second / 2 + 16 && reused < second + other,
        "{reused} prompt tokens reused over prompts of {second} and {other}"
    );

    // The first question again: the chat's K/V, which the other conversation only copied its
    // system prompt from, hold all of its prompt but the last token (the first round's root).
    let prompt = chat_ids("What is the capital of France?");
    let len = prompt.len();
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let mut driver = RoundDriver::new(prompt, greedy(), None).unwrap();
    let again = client.generate(&mut driver, |_| {}).await.unwrap();
    client.shutdown().await;
    let reused_again = m
        .prefix_tokens_reused
        .load(std::sync::atomic::Ordering::Relaxed) as usize
        - reused;
    assert_eq!(reused_again, len - 1, "of a prompt of {len}");
    assert_eq!(again.token_ids, answers[0].0, "the same question, greedy");
    cached.shutdown().await;

    let (plain, remote) = start_verifier(EngineConfig {
        prefix_cache_bytes: 0,
        ..EngineConfig::default()
    });
    let expected = conversations(&remote).await;
    let hits = plain
        .metrics()
        .prefix_hits
        .load(std::sync::atomic::Ordering::Relaxed);
    plain.shutdown().await;
    assert_eq!(hits, 0);
    for (i, ((got, _), (want, _))) in answers.iter().zip(&expected).enumerate() {
        assert!(want.len() > 4);
        assert_eq!(got, want, "answer {i} changed by a reused prefix");
    }
}
