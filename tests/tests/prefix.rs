//! Prefix reuse end to end: a chat's second turn starts from the K/V the verifier kept of the
//! first and prefills only what is new, another conversation reuses only the system prompt they
//! share (a copy: the chat's K/V stay for its own prompts, so its first question asked again
//! reuses all of its prompt), and every answer is token for token what a verifier without the
//! prefix cache gives. A feature-conditioned drafter's sessions reuse prefixes too, and send the
//! LLM's features of the positions they did not prefill from what the earlier session kept.

use specinfer_edge::Client;
use specinfer_integration::{chat_ids, smollm2, start_verifier};
use specinfer_model::ChatMessage;
use specinfer_net::RemoteConfig;
use specinfer_speculator::RoundDriver;
use specinfer_verifier::engine::EngineConfig;
use specinfer_wire::{FeatureRows, SamplingParams, ServerDrafting, TokenTree};

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

/// A session that asks for features, on a connection to `remote`: root-only rounds, or after
/// the first the verifier decoding the rest on its own (`hand_off`, as a client does once the
/// split stops paying). The committed tokens at the end (prompt and answer), and the first
/// verdict's features.
async fn feature_session(
    remote: &RemoteConfig,
    prompt: &[u32],
    max_new: u32,
    hand_off: bool,
) -> (Vec<u32>, FeatureRows) {
    let params = SamplingParams {
        return_features: true,
        ..SamplingParams::greedy(max_new)
    };
    let conn = specinfer_net::Remote::connect(remote).await.unwrap();
    let mut s = conn.open(1, prompt.to_vec(), params).await.unwrap();
    let mut committed = prompt.to_vec();
    let mut first = None;
    loop {
        let v = if first.is_some() && hand_off {
            s.verdict().await.unwrap()
        } else {
            let root = *committed.last().unwrap();
            s.verify(TokenTree::chain(&[root])).await.unwrap()
        };
        committed.extend(&v.tokens);
        if v.finish.is_some() {
            break;
        }
        if first.is_none() {
            first = Some(
                v.features
                    .expect("a feature session's verdict without features"),
            );
            if hand_off {
                s.generate(ServerDrafting::Plain).await.unwrap();
            }
        }
    }
    s.close().await.unwrap();
    conn.shutdown().await;
    (committed, first.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feature_session_reuses_a_prefix_and_sends_the_features_the_first_kept() {
    let (cached, remote) = start_verifier(EngineConfig::default());
    let (plain, plain_remote) = start_verifier(EngineConfig {
        prefix_cache_bytes: 0,
        ..EngineConfig::default()
    });
    let (_, tok) = smollm2();
    let first_turn = chat_ids("What is the capital of France?");
    // The first turn hands off after its first round: its entry still keeps the features.
    let (committed, _) = feature_session(&remote, &first_turn, 16, true).await;
    // The next turn's prompt extends everything the first committed.
    let mut next_turn = committed.clone();
    next_turn.extend(tok.encode("\nAnd of Italy?").unwrap());
    let (_, reused_rows) = feature_session(&remote, &next_turn, 4, false).await;
    let (_, fresh_rows) = feature_session(&plain_remote, &next_turn, 4, false).await;
    let m = cached.metrics();
    let reused = m
        .prefix_tokens_reused
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    assert_eq!(m.prefix_hits.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(reused, committed.len() - 1, "the first turn's K/V, whole");
    // The same positions (the whole prompt and the first root: the prompt is shorter than
    // what a drafter reads), each row the LLM's feature of its position within 8-bit rounding
    // and the float noise of prefilled against decoded positions.
    assert_eq!(
        (
            reused_rows.first_position,
            reused_rows.dim,
            reused_rows.scales.len()
        ),
        (
            fresh_rows.first_position,
            fresh_rows.dim,
            fresh_rows.scales.len()
        )
    );
    assert_eq!(fresh_rows.scales.len(), next_turn.len());
    let (got, want) = (reused_rows.dequantize(), fresh_rows.dequantize());
    let dim = fresh_rows.dim as usize;
    // The largest difference between two rows relative to the second's largest value.
    let relative = |a: &[f32], b: &[f32]| {
        let max = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / max
    };
    let rows: Vec<(&[f32], &[f32])> = got.chunks(dim).zip(want.chunks(dim)).collect();
    let worst = rows
        .iter()
        .map(|(a, b)| relative(a, b))
        .fold(0f32, f32::max);
    println!("largest relative difference of a reused row: {worst:.4}");
    assert!(
        worst <= 0.05,
        "a reused row differs by {worst} of its scale"
    );
    // A row one position off would not pass: neighbours differ by far more.
    let neighbours = rows
        .windows(2)
        .map(|w| relative(w[0].0, w[1].1))
        .fold(f32::INFINITY, f32::min);
    assert!(
        neighbours > 0.05,
        "neighbouring rows differ by only {neighbours}"
    );
    cached.shutdown().await;
    plain.shutdown().await;
}
