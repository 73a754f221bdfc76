//! Teacher data: the LLM answers the prompts (greedy, or sampled, in its chat template), many
//! sequences per forward pass through the same engine the verifier uses.

use std::io::{BufRead, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use rand::{Rng, SeedableRng};
use specinfer_kernels::sampling::{argmax, distribution, sample};
use specinfer_model::{ChatMessage, KvCache, Llama, SeqTree, Tokenizer};
use specinfer_wire::TokenTree;

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug)]
pub struct Example {
    pub prompt: Vec<u32>,
    pub answer: Vec<u32>,
    /// Per answer token, the teacher's most likely tokens there with their probabilities (at
    /// temperature 1): soft targets for distillation. Empty in answers made before they were kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<Vec<(u32, f32)>>,
}

/// How many of the teacher's most likely tokens each answer position keeps.
pub const TOP_KEPT: usize = 8;

/// The `k` most likely tokens of softmax(`logits`) with their probabilities, most likely first.
pub fn top_probabilities(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if k < ids.len() {
        ids.select_nth_unstable_by(k, by_logit);
        ids.truncate(k);
    }
    ids.sort_by(by_logit);
    ids.into_iter()
        .map(|t| {
            (
                t,
                (((logits[t as usize] - max) as f64).exp() / total) as f32,
            )
        })
        .collect()
}

pub fn read_examples(path: &Path) -> Result<Vec<Example>> {
    let f = std::fs::File::open(path)?;
    std::io::BufReader::new(f)
        .lines()
        .map(|l| Ok(serde_json::from_str(&l?)?))
        .collect()
}

/// Cuts an answer file back to its last whole line (a run killed while writing leaves half a
/// line, which would otherwise stop every resumption at parsing it) and returns how many whole
/// lines, one answer each, it holds.
fn drop_partial_last_line(path: &Path) -> Result<usize> {
    let bytes = std::fs::read(path)?;
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if keep < bytes.len() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)?
            .set_len(keep as u64)?;
        eprintln!(
            "teacher: dropped a partly written answer at the end of {}",
            path.display()
        );
    }
    Ok(bytes[..keep].iter().filter(|&&b| b == b'\n').count())
}

/// How the teacher picks each answer token.
#[derive(Clone, Copy, Debug)]
pub enum Decoding {
    Greedy,
    /// Sampled at a temperature drawn per prompt from [`SAMPLED_TEMPERATURES`]: the answers
    /// the SSM meets when users sample, and more than one answer per prompt. Every draw comes
    /// from (`seed`, prompt index), so a resumed run continues the same answers.
    Sampled {
        seed: u64,
    },
}

/// The range sampled answers draw their temperature from.
pub const SAMPLED_TEMPERATURES: std::ops::Range<f32> = 0.7..1.0;

/// Appends the teacher's answers for `prompts` to `out` (JSONL), skipping the prompts already
/// answered there: an interrupted run resumes where it stopped.
pub fn generate(
    llm: &Llama,
    tok: &Tokenizer,
    prompts: &[String],
    max_new: usize,
    batch: usize,
    decoding: Decoding,
    out: &Path,
) -> Result<()> {
    let done = if out.exists() {
        drop_partial_last_line(out)?
    } else {
        0
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)?;
    let start = Instant::now();
    let mut tokens = 0usize;
    let todo = &prompts[done.min(prompts.len())..];
    for (b, chunk) in todo.chunks(batch).enumerate() {
        let mut seqs: Vec<(Vec<u32>, KvCache, Example, bool)> = Vec::new();
        // Per prompt of a sampled run: its RNG and temperature.
        let mut draws: Vec<(rand_chacha::ChaCha8Rng, f32)> = match decoding {
            Decoding::Greedy => Vec::new(),
            Decoding::Sampled { seed } => (0..chunk.len())
                .map(|j| {
                    let index = (done + b * batch + j) as u64;
                    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                        seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    );
                    let t = rng.random_range(SAMPLED_TEMPERATURES);
                    (rng, t)
                })
                .collect(),
        };
        for p in chunk {
            let ids = tok.encode(&tok.chat_prompt(&[ChatMessage::new("user", p)]))?;
            let mut cache = KvCache::new(llm.config());
            llm.prefill(&mut cache, &ids[..ids.len() - 1])?;
            let answer = Example {
                prompt: Vec::new(),
                answer: Vec::new(),
                top: Vec::new(),
            };
            seqs.push((ids, cache, answer, false));
        }
        for _ in 0..max_new {
            let active: Vec<usize> = (0..seqs.len()).filter(|&i| !seqs[i].3).collect();
            if active.is_empty() {
                break;
            }
            let trees: Vec<TokenTree> = active
                .iter()
                .map(|&i| {
                    TokenTree::root(
                        *seqs[i]
                            .2
                            .answer
                            .last()
                            .unwrap_or(seqs[i].0.last().expect("prompt")),
                    )
                })
                .collect();
            let mut caches: Vec<&mut KvCache> = Vec::new();
            for (i, s) in seqs.iter_mut().enumerate() {
                if active.contains(&i) {
                    caches.push(&mut s.1);
                }
            }
            let mut batch_in: Vec<SeqTree> = caches
                .into_iter()
                .zip(&trees)
                .map(|(c, t)| SeqTree::new(c, t))
                .collect();
            let logits = llm.forward(&mut batch_in)?;
            drop(batch_in);
            for (&i, l) in active.iter().zip(&logits) {
                let s = &mut seqs[i];
                s.1.compact(&[0]);
                let t = match decoding {
                    Decoding::Greedy => argmax(l.node(0)) as u32,
                    Decoding::Sampled { .. } => {
                        let (rng, temperature) = &mut draws[i];
                        let p = distribution(l.node(0), *temperature, 0, 1.0);
                        sample(&p, rng.random()) as u32
                    }
                };
                s.2.answer.push(t);
                s.2.top.push(top_probabilities(l.node(0), TOP_KEPT));
                tokens += 1;
                if tok.eos().contains(&t) || s.2.answer.len() >= max_new {
                    s.3 = true;
                }
            }
        }
        for (ids, _, mut example, _) in seqs {
            example.prompt = ids;
            writeln!(file, "{}", serde_json::to_string(&example)?)?;
        }
        let n = done + (b + 1) * batch;
        let rate = tokens as f64 / start.elapsed().as_secs_f64();
        let left = prompts.len().saturating_sub(n) as f64
            / (((b + 1) * batch) as f64 / start.elapsed().as_secs_f64());
        eprint!(
            "\rteacher: {}/{} prompts, {rate:.0} tokens/s, ETA {:.0} s   ",
            n.min(prompts.len()),
            prompts.len(),
            left
        );
    }
    eprintln!();
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_partly_written_last_answer_is_dropped_and_whole_ones_kept() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let path = file.path();
        for (written, kept) in [
            ("{\"a\":1}\n{\"a\":2}\n{\"a\"", "{\"a\":1}\n{\"a\":2}\n"),
            ("{\"a\":1}\n", "{\"a\":1}\n"),
            ("{\"a", ""),
            ("", ""),
        ] {
            std::fs::write(path, written).unwrap();
            super::drop_partial_last_line(path).unwrap();
            assert_eq!(std::fs::read_to_string(path).unwrap(), kept);
        }
    }
}
