//! specinfer in the browser: the SSM drafts token trees locally (the same speculator core and
//! model code as the native client, compiled to `wasm32-unknown-unknown`), the verifier decides.
//!
//! Sans-I/O: [`BrowserClient`] turns user actions into protocol frames and frames into text.
//! JavaScript only moves bytes over a WebTransport stream (reading a frame = 4 length bytes,
//! [`BrowserClient::frame_len`], then the body), so everything that decides anything is here and
//! is tested natively as well as in Node.

use std::path::Path;

use serde::Deserialize;
use specinfer_model::{ChatMessage, Llama, Tokenizer};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, DraftedPart, Speculator, TreeShape,
};
use specinfer_wire::{
    decode_frame, encode_frame, frame_len, ClientHello, FinishReason, Limits, Message, OpenSession,
    SamplingParams, TokenTree, Verify, FRAME_HEADER_BYTES, PROTOCOL_VERSION,
};
use wasm_bindgen::prelude::*;

/// Variants that wrap another error say it in their message and do not also give it as their
/// `source`, so a printed chain of causes says it once.
#[derive(Debug, thiserror::Error)]
pub enum BrowserError {
    #[error("model: {0}")]
    Model(specinfer_model::ModelError),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("verifier: {0}")]
    Verifier(String),
    #[error("chat settings: {0}")]
    Settings(String),
}

impl From<specinfer_model::ModelError> for BrowserError {
    fn from(e: specinfer_model::ModelError) -> Self {
        BrowserError::Model(e)
    }
}

impl From<BrowserError> for JsValue {
    fn from(e: BrowserError) -> JsValue {
        JsError::new(&e.to_string()).into()
    }
}

/// What the chat template needs beyond tokenizer.json (served beside it as `chat.json`).
#[derive(Deserialize)]
struct ChatSettings {
    bos: Option<u32>,
    eos: Vec<u32>,
    system: Option<String>,
}

/// One browser chat: an SSM, its draft state, and the protocol state of one session.
#[wasm_bindgen]
pub struct BrowserClient {
    tokenizer: Tokenizer,
    speculator: Speculator,
    draft: CachedDraft<'static>,
    limits: Limits,
    session: u64,
    round: u32,
    committed: Vec<u32>,
    prompt_len: usize,
    in_flight: bool,
    finished: bool,
    /// Characters of the answer already handed out.
    shown_chars: usize,
    rounds: u32,
    draft_ms: f64,
    /// Tree nodes sent in this answer (the SSM's and the context lookup's).
    drafted_nodes: usize,
    /// The round in flight, for the adaptive tree to learn from.
    sent: Option<SentRound>,
}

struct SentRound {
    at_ms: f64,
    draft_s: f64,
    drafted: DraftedPart,
    tree_nodes: usize,
}

/// Milliseconds since some fixed origin (for draft timing only).
fn now_ms() -> f64 {
    #[cfg(target_arch = "wasm32")]
    {
        js_sys_now()
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::time::{SystemTime, UNIX_EPOCH};
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    }
}

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen]
extern "C" {
    #[wasm_bindgen(js_namespace = Date, js_name = now)]
    fn js_sys_now() -> f64;
}

#[wasm_bindgen]
impl BrowserClient {
    /// `ssm_config` and `ssm_weights`: the SSM folder's config.json and model.safetensors;
    /// `tokenizer_json` and `chat_json`: the LLM's tokenizer and chat settings; `tree`: a tree
    /// shape as the CLI takes it (e.g. "adaptive:dynamic:32", the CLI's greedy default), cut to
    /// what the rounds' measured times make pay.
    #[wasm_bindgen(constructor)]
    pub fn new(
        ssm_config: &str,
        ssm_weights: &[u8],
        tokenizer_json: &str,
        chat_json: &str,
        tree: &str,
    ) -> Result<BrowserClient, BrowserError> {
        let settings: ChatSettings =
            serde_json::from_str(chat_json).map_err(|e| BrowserError::Settings(e.to_string()))?;
        let tokenizer =
            Tokenizer::from_json(tokenizer_json, settings.bos, settings.eos, settings.system)?;
        let ssm = Llama::from_safetensors_bytes(ssm_config, ssm_weights, Path::new("ssm"))?;
        let shape: TreeShape = tree.parse().map_err(BrowserError::Settings)?;
        // The page holds one model for its lifetime: leaking it gives the draft a 'static borrow.
        let ssm: &'static Llama = Box::leak(Box::new(ssm));
        Ok(BrowserClient {
            tokenizer,
            speculator: Speculator::with_shape(shape, DraftMode::Greedy, 0),
            draft: CachedDraft::new(ssm),
            limits: Limits::default(),
            session: 0,
            round: 0,
            committed: Vec::new(),
            prompt_len: 0,
            in_flight: false,
            finished: true,
            shown_chars: 0,
            rounds: 0,
            draft_ms: 0.0,
            drafted_nodes: 0,
            sent: None,
        })
    }

    /// The first frame on a new connection.
    pub fn hello(&self, api_key: Option<String>) -> Vec<u8> {
        encode_frame(&Message::ClientHello(ClientHello {
            protocol_version: PROTOCOL_VERSION,
            expected_model: self.tokenizer.fingerprint(),
            api_key,
        }))
    }

    /// Starts a new answer to `user_message` (greedy: token-identical to the LLM alone).
    pub fn open(&mut self, user_message: &str, max_tokens: u32) -> Result<Vec<u8>, BrowserError> {
        let text = self
            .tokenizer
            .chat_prompt(&[ChatMessage::new("user", user_message)]);
        let prompt = self.tokenizer.encode(&text)?;
        if prompt.is_empty() {
            return Err(BrowserError::Protocol("empty prompt".into()));
        }
        self.session += 1;
        self.round = 0;
        self.prompt_len = prompt.len();
        self.committed = prompt.clone();
        self.in_flight = false;
        self.finished = false;
        self.shown_chars = 0;
        self.rounds = 0;
        self.draft_ms = 0.0;
        self.drafted_nodes = 0;
        self.sent = None;
        let params = SamplingParams {
            stop_ids: self.tokenizer.eos().to_vec(),
            ..SamplingParams::greedy(max_tokens)
        };
        Ok(encode_frame(&Message::OpenSession(OpenSession {
            session: self.session,
            prompt,
            params,
        })))
    }

    /// Drafts the next tree and returns its Verify frame.
    pub fn next_round(&mut self) -> Result<Vec<u8>, BrowserError> {
        if self.finished || self.in_flight {
            return Err(BrowserError::Protocol(
                "no round to start: the answer is finished or a round is in flight".into(),
            ));
        }
        let t0 = now_ms();
        let tree: TokenTree = self
            .speculator
            .draft(&mut self.draft as &mut dyn DraftModel, &self.committed)?;
        let drafted = DraftedPart::of(&tree);
        let tree = ContextLookup::default().extend(
            tree,
            &self.committed,
            self.limits.max_tree_nodes as usize,
            false,
        );
        let sent_ms = now_ms();
        self.draft_ms += sent_ms - t0;
        self.drafted_nodes += tree.len();
        self.sent = Some(SentRound {
            at_ms: sent_ms,
            draft_s: (sent_ms - t0) * 1e-3,
            drafted,
            tree_nodes: tree.len(),
        });
        self.in_flight = true;
        Ok(encode_frame(&Message::Verify(Verify {
            session: self.session,
            round: self.round,
            tree,
        })))
    }

    /// Bytes of the frame body announced by a 4-byte header (checked against the limits before
    /// JavaScript allocates anything).
    pub fn frame_len(&self, header: &[u8]) -> Result<usize, BrowserError> {
        let header: [u8; FRAME_HEADER_BYTES] = header
            .try_into()
            .map_err(|_| BrowserError::Protocol("a frame header is 4 bytes".into()))?;
        frame_len(header, &self.limits).map_err(|e| BrowserError::Protocol(e.to_string()))
    }

    /// Handles one frame body from the verifier; returns a JSON event:
    /// `{"event":"hello","model":NAME}`, `{"event":"opened"}`, or
    /// `{"event":"tokens","ids":[..],"text":NEW_TEXT,"finished":BOOL}`.
    pub fn on_frame(&mut self, body: &[u8]) -> Result<String, BrowserError> {
        let msg =
            decode_frame(body, &self.limits).map_err(|e| BrowserError::Protocol(e.to_string()))?;
        let event = match msg {
            Message::ServerHello(h) => {
                if h.model != self.tokenizer.fingerprint() {
                    return Err(BrowserError::Protocol(
                        "the verifier's model has another tokenizer".into(),
                    ));
                }
                self.limits = h.limits;
                serde_json::json!({"event": "hello", "model": h.model_name})
            }
            Message::SessionOpened(o) if o.session == self.session => {
                serde_json::json!({"event": "opened"})
            }
            Message::Verified(v) if v.session == self.session && v.round == self.round => {
                if !self.in_flight {
                    return Err(BrowserError::Protocol("an answer to no question".into()));
                }
                self.in_flight = false;
                if let Some(r) = self.sent.take() {
                    self.speculator.observe(r.drafted.observation(
                        r.tree_nodes,
                        &v.accepted_nodes,
                        r.draft_s,
                        (now_ms() - r.at_ms) * 1e-3,
                        v.stats.forward_us as f64 * 1e-6,
                    ));
                }
                self.round += 1;
                self.rounds += 1;
                self.committed.extend(&v.tokens);
                self.finished = v.finish.is_some();
                let text = self.new_text()?;
                serde_json::json!({
                    "event": "tokens",
                    "ids": v.tokens,
                    "text": text,
                    "finished": self.finished,
                    "stopped": v.finish == Some(FinishReason::Stop),
                })
            }
            Message::Error(e) => return Err(BrowserError::Verifier(e.message)),
            other => {
                return Err(BrowserError::Protocol(format!(
                    "unexpected {} (or one for another session or round)",
                    other.name()
                )))
            }
        };
        Ok(event.to_string())
    }

    /// Ends the current session (the verifier frees it at once and acknowledges).
    pub fn close_frame(&self) -> Vec<u8> {
        encode_frame(&Message::Close {
            session: self.session,
        })
    }

    /// The tokens generated so far in this answer.
    pub fn token_ids(&self) -> Vec<u32> {
        self.committed[self.prompt_len.min(self.committed.len())..].to_vec()
    }

    /// `{"tokens","rounds","tau","draft_ms","drafted_nodes"}` for this answer.
    pub fn stats(&self) -> String {
        let tokens = self.committed.len().saturating_sub(self.prompt_len);
        serde_json::json!({
            "tokens": tokens,
            "rounds": self.rounds,
            "tau": tokens as f64 / self.rounds.max(1) as f64,
            "draft_ms": self.draft_ms,
            "drafted_nodes": self.drafted_nodes,
        })
        .to_string()
    }
}

impl BrowserClient {
    /// Text not yet shown: end-of-turn tokens left out, an incomplete UTF-8 character held back.
    fn new_text(&mut self) -> Result<String, BrowserError> {
        let eos = self.tokenizer.eos();
        let visible: Vec<u32> = self.committed[self.prompt_len..]
            .iter()
            .copied()
            .filter(|t| !eos.contains(t))
            .collect();
        let text = self.tokenizer.decode(&visible)?;
        if text.ends_with('\u{FFFD}') && !self.finished {
            return Ok(String::new());
        }
        let new = text.get(self.shown_chars..).unwrap_or("").to_string();
        self.shown_chars = text.len();
        Ok(new)
    }
}
