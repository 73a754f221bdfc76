//! Tokenizers, built exactly from GGUF metadata or loaded from tokenizer.json.
//!
//! candle's GGUF tokenizer helper adds a prefix space, which changes SmolLM2's ids; here the HF
//! `tokenizers` pipeline is assembled from the GGUF vocabulary and merges with the pre-tokenizer
//! the model was trained with, so the ids match the reference tokenizer.

use std::path::Path;

use sha2::{Digest, Sha256};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::load::Gguf;
use crate::{ModelError, Result};

/// Qwen2's pre-tokenizer split (digits one at a time, no prefix space).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Vec<u32>,
    sha256: [u8; 32],
    default_system: Option<String>,
}

fn tk_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*`, gpt2 BPE).
    pub fn from_gguf(path: &Path) -> Result<Self> {
        Self::from_opened_gguf(&Gguf::open(path)?)
    }

    pub(crate) fn from_opened_gguf(g: &Gguf) -> Result<Self> {
        let model = g.meta_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(g.bad(
                "tokenizer.ggml.model",
                format!("{model:?} is not supported (only gpt2 BPE)"),
            ));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            g.meta(key)?
                .to_vec()
                .map_err(|e| g.bad(key, e))?
                .iter()
                .map(|v| v.to_string().cloned().map_err(|e| g.bad(key, e)))
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                let (a, b) = m.split_once(' ').ok_or_else(|| {
                    g.bad("tokenizer.ggml.merges", format!("merge {m:?} has no space"))
                })?;
                Ok((a.to_owned(), b.to_owned()))
            })
            .collect::<Result<_>>()?;
        let types: Vec<i32> = match g.meta("tokenizer.ggml.token_type") {
            Ok(v) => v
                .to_vec()
                .map_err(|e| g.bad("token_type", e))?
                .iter()
                .map(|t| t.to_i32().unwrap_or(1))
                .collect(),
            Err(_) => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tk_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let pre: PreTokenizerWrapper = match g.meta_str("tokenizer.ggml.pre").unwrap_or("default") {
            "qwen2" => Sequence::new(vec![
                Split::new(
                    SplitPattern::Regex(QWEN2_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(tk_err)?
                .into(),
                ByteLevel::new(false, false, false).into(),
            ])
            .into(),
            _ => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
        };
        inner.with_pre_tokenizer(Some(pre));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) and user-defined (4) tokens are matched whole, never split by BPE.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(specials).map_err(tk_err)?;
        let id = |key: &str| g.meta(key).ok().and_then(|v| v.to_u32().ok());
        let bos = id("tokenizer.ggml.bos_token_id");
        let mut eos: Vec<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        for stop in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(t) = inner.token_to_id(stop) {
                if !eos.contains(&t) {
                    eos.push(t);
                }
            }
        }
        let mut tok = Self::finish(inner, bos, eos)?;
        tok.default_system = g
            .meta_str("tokenizer.chat_template")
            .ok()
            .and_then(default_system_of);
        Ok(tok)
    }

    /// Loads a tokenizer.json (as written by [`Tokenizer::save`] or shipped with a HF model).
    pub fn from_file(path: &Path, bos: Option<u32>, eos: Vec<u32>) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| tk_err(format!("{}: {e}", path.display())))?;
        Self::finish(inner, bos, eos)
    }

    /// A tokenizer.json's contents, with the chat template's default system message (which
    /// tokenizer.json does not carry).
    pub fn from_json(
        json: &str,
        bos: Option<u32>,
        eos: Vec<u32>,
        default_system: Option<String>,
    ) -> Result<Self> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(tk_err)?;
        let mut tok = Self::finish(inner, bos, eos)?;
        tok.default_system = default_system;
        Ok(tok)
    }

    /// The system message the chat template adds to a conversation that has none.
    pub fn default_system(&self) -> Option<&str> {
        self.default_system.as_deref()
    }

    fn finish(inner: tokenizers::Tokenizer, bos: Option<u32>, eos: Vec<u32>) -> Result<Self> {
        let json = inner.to_string(false).map_err(tk_err)?;
        let sha256 = Sha256::digest(json.as_bytes()).into();
        Ok(Tokenizer {
            inner,
            bos,
            eos,
            sha256,
            default_system: None,
        })
    }

    /// The tokenizer.json text (what [`Tokenizer::save`] writes).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(tk_err)
    }

    /// Writes a tokenizer.json that the HF `tokenizers` libraries (Rust, Python, JS) load.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner.save(path, true).map_err(tk_err)
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tk_err)?
            .get_ids()
            .to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(tk_err)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Tokens that end a generation.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Formats a conversation in the model's chat template (ChatML), adding the system message
    /// the template adds when the conversation has none.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> String {
        let mut all = Vec::with_capacity(messages.len() + 1);
        if let (Some(sys), false) = (
            &self.default_system,
            messages.first().is_some_and(|m| m.role == "system"),
        ) {
            all.push(ChatMessage::new("system", sys));
        }
        all.extend_from_slice(messages);
        chat_prompt(&all)
    }

    /// What a peer must match for token ids to mean the same thing on both sides.
    pub fn fingerprint(&self) -> specinfer_wire::ModelFingerprint {
        specinfer_wire::ModelFingerprint {
            vocab_size: self.vocab_size() as u32,
            bos: self.bos,
            eos: self.eos.clone(),
            tokenizer_sha256: self.sha256,
        }
    }

    /// SHA-256 of the tokenizer's JSON form: two sides agree on token ids only if this matches.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }
}

/// The system message a ChatML template inserts when the conversation starts without one
/// (SmolLM2: "You are a helpful AI assistant named SmolLM, ...").
fn default_system_of(template: &str) -> Option<String> {
    let marker = "<|im_start|>system\n";
    let start = template.find("messages[0]['role'] != 'system'")?;
    let rest = &template[start..];
    let body = &rest[rest.find(marker)? + marker.len()..];
    Some(body[..body.find("<|im_end|>")?].to_owned())
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Drops the oldest messages of a chat `history`, a user-assistant exchange at a time, until
/// `fits` accepts it or only the newest message is left (a question too long on its own is the
/// verifier's to refuse). Returns how many were dropped. Every front end that keeps a
/// conversation (the CLI's chat, the desktop app, the browser widget) trims it by this rule.
pub fn forget_oldest_exchanges<E>(
    history: &mut Vec<ChatMessage>,
    fits: impl Fn(&[ChatMessage]) -> std::result::Result<bool, E>,
) -> std::result::Result<usize, E> {
    let mut dropped = 0;
    while history.len() > 1 && !fits(history)? {
        let n = 2.min(history.len() - 1);
        history.drain(..n);
        dropped += n;
    }
    Ok(dropped)
}

/// Prompt tokens a request may use: a verifier opens a session only if the prompt, the
/// answer's `max_new_tokens` and one tree of `max_tree_nodes` fit the model's context.
pub fn prompt_budget(context_tokens: usize, max_new_tokens: u32, max_tree_nodes: u32) -> usize {
    context_tokens.saturating_sub(max_new_tokens as usize + max_tree_nodes as usize)
}

/// ChatML (SmolLM2 and Qwen2.5), ending with the assistant's turn opened for generation.
pub fn chat_prompt(messages: &[ChatMessage]) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    s.push_str("<|im_start|>assistant\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(n: usize) -> Vec<ChatMessage> {
        (0..n)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                ChatMessage::new(role, &format!("message {i}"))
            })
            .collect()
    }

    #[test]
    fn a_long_chat_forgets_its_oldest_exchanges_first() {
        let mut h = history(7);
        let dropped = forget_oldest_exchanges(&mut h, |h| Ok::<_, ()>(h.len() <= 3)).unwrap();
        assert_eq!(dropped, 4);
        let kept: Vec<&str> = h.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(kept, ["message 4", "message 5", "message 6"]);
        assert_eq!(
            h[0].role, "user",
            "the history still starts with a question"
        );
    }

    #[test]
    fn the_newest_question_is_kept_even_when_nothing_fits() {
        let mut h = history(5);
        assert_eq!(
            forget_oldest_exchanges(&mut h, |_| Ok::<_, ()>(false)).unwrap(),
            4
        );
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].content, "message 4");
        let mut fits = history(5);
        assert_eq!(
            forget_oldest_exchanges(&mut fits, |_| Ok::<_, ()>(true)).unwrap(),
            0
        );
        assert_eq!(fits.len(), 5);
    }
}
