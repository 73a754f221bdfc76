//! specinfer in the browser: the SSM, or the feature-conditioned drafter, drafts token trees
//! locally (the same speculator core and model code as the native client, compiled to
//! `wasm32-unknown-unknown`), the verifier decides.
//!
//! Sans-I/O: [`BrowserClient`] turns user actions into protocol frames and frames into text.
//! JavaScript only moves bytes over a WebTransport stream (reading a frame = 4 length bytes,
//! [`BrowserClient::frame_len`], then the body), so everything that decides anything is here and
//! is tested natively as well as in Node.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use specinfer_model::{
    forget_oldest_exchanges, prompt_budget, ChatMessage, FeatureDrafter, Llama, Tokenizer,
};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, FeatureDraft, GenerationStats,
    Recovery, RoundDriver, RoundError, RoundOutput, Speculator, TreeShape,
};
use specinfer_wire::{
    decode_frame, encode_frame, frame_len, ClientHello, ErrorCode, Limits, Message, OpenSession,
    SamplingParams, Verify, VerifyMode, FRAME_HEADER_BYTES, PROTOCOL_VERSION,
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
    /// The LLM's context, in tokens: a conversation is trimmed to fit it.
    #[serde(default = "default_context_tokens")]
    context_tokens: usize,
}

/// The context assumed when `chat.json` does not give one (every shipped LLM has at least it).
fn default_context_tokens() -> usize {
    2048
}

/// A turn of the conversation as the page keeps it (sessionStorage).
#[derive(serde::Serialize, Deserialize)]
struct Turn {
    role: String,
    content: String,
}

/// One browser chat: an SSM drafting through the shared round driver, and the protocol state of
/// the answer's session.
#[wasm_bindgen]
pub struct BrowserClient {
    tokenizer: Arc<Tokenizer>,
    /// The drafter between answers (its speculator keeps what it measured).
    drafter: Option<Drafter<'static>>,
    /// The answer being generated (or the last one).
    driver: Option<RoundDriver<'static>>,
    limits: Limits,
    session: u64,
    /// The next round's number on the session's current stream (a resumed session's stream
    /// counts from 0 again).
    round: u32,
    resume_token: [u8; 16],
    /// A Resume was sent and its answer is awaited.
    resuming: bool,
    /// The conversation before the answer being generated (or the last one): user and
    /// assistant turns, oldest first.
    history: Vec<ChatMessage>,
    /// The answer's text so far (its streamed pieces), joined to `history` when the next
    /// question comes: stopped answers keep what they had.
    answer: Option<String>,
    context_tokens: usize,
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
    /// `ssm_config` and `ssm_weights`: the drafter folder's config.json and model.safetensors,
    /// an SSM or a feature-conditioned drafter (its config says which; the latter asks the
    /// verifier for the LLM's features with every session); `tokenizer_json` and `chat_json`:
    /// the LLM's tokenizer and chat settings; `tree`: a tree shape as the CLI takes it (e.g.
    /// "adaptive:dynamic:32", the CLI's greedy default), cut to what the rounds' measured times
    /// make pay.
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
        let shape: TreeShape = tree.parse().map_err(BrowserError::Settings)?;
        // The page holds one model for its lifetime: leaking it gives the draft a 'static borrow.
        let origin = Path::new("ssm");
        let draft: Box<dyn DraftModel + Send> =
            if FeatureDrafter::describes_feature_draft(ssm_config) {
                let drafter =
                    FeatureDrafter::from_safetensors_bytes(ssm_config, ssm_weights, origin)?;
                Box::new(FeatureDraft::new(Box::leak(Box::new(drafter))))
            } else {
                let ssm = Llama::from_safetensors_bytes(ssm_config, ssm_weights, origin)?;
                Box::new(CachedDraft::new(Box::leak(Box::new(ssm))))
            };
        Ok(BrowserClient {
            tokenizer: Arc::new(tokenizer),
            drafter: Some(Drafter {
                speculator: Speculator::with_shape(shape, DraftMode::Greedy, 0),
                drafts: vec![draft],
            }),
            driver: None,
            limits: Limits::default(),
            session: 0,
            round: 0,
            resume_token: [0; 16],
            resuming: false,
            history: Vec::new(),
            answer: None,
            context_tokens: settings.context_tokens,
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

    /// Starts the answer to `user_message`, the conversation's next question (the whole
    /// conversation is the prompt, its oldest exchanges forgotten where it would not leave room
    /// for the answer in the LLM's context, by the native front ends' rule), sampled at
    /// `temperature` and `top_p` with a fresh seed (speculative sampling: distributed as the
    /// LLM's own sampling), or greedy at temperature 0 (token-identical to the LLM alone).
    pub fn open(
        &mut self,
        user_message: &str,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
    ) -> Result<Vec<u8>, BrowserError> {
        self.keep_answer();
        self.history.push(ChatMessage::new("user", user_message));
        self.open_answer(max_tokens, temperature, top_p)
    }

    /// Answers the last question again, the last answer (whole or stopped) forgotten.
    pub fn regenerate(
        &mut self,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
    ) -> Result<Vec<u8>, BrowserError> {
        if self.answer.take().is_none()
            && self.history.last().is_some_and(|m| m.role == "assistant")
        {
            self.history.pop();
        }
        if !self.history.last().is_some_and(|m| m.role == "user") {
            return Err(BrowserError::Protocol("no question to answer again".into()));
        }
        self.open_answer(max_tokens, temperature, top_p)
    }

    /// Forgets the conversation (a new one starts with the next question).
    pub fn reset(&mut self) {
        self.history.clear();
        self.answer = None;
    }

    /// The conversation so far, the answer being generated included (once it has text), as JSON
    /// `[{"role","content"}, ...]` (what the page keeps in sessionStorage).
    pub fn conversation_json(&self) -> String {
        let mut turns: Vec<Turn> = self
            .history
            .iter()
            .map(|m| Turn {
                role: m.role.clone(),
                content: m.content.clone(),
            })
            .collect();
        if let Some(a) = self.answer.as_ref().filter(|a| !a.is_empty()) {
            turns.push(Turn {
                role: "assistant".into(),
                content: a.clone(),
            });
        }
        serde_json::to_string(&turns).expect("turns serialise")
    }

    /// Takes back a conversation [`BrowserClient::conversation_json`] gave (after a page
    /// reload); refuses anything else. A last question kept without its answer (the page was
    /// reloaded before any text came) is dropped: the conversation goes on from the last answer.
    pub fn restore_conversation(&mut self, json: &str) -> Result<(), BrowserError> {
        let turns: Vec<Turn> = serde_json::from_str(json)
            .map_err(|e| BrowserError::Settings(format!("a kept conversation: {e}")))?;
        if turns
            .iter()
            .any(|t| t.role != "user" && t.role != "assistant")
        {
            return Err(BrowserError::Settings(
                "a kept conversation has a turn that is neither the user's nor the assistant's"
                    .into(),
            ));
        }
        self.history = turns
            .iter()
            .map(|t| ChatMessage::new(&t.role, &t.content))
            .collect();
        if self.history.last().is_some_and(|m| m.role == "user") {
            self.history.pop();
        }
        self.answer = None;
        Ok(())
    }

    /// Drafts the next tree and returns its Verify frame.
    pub fn next_round(&mut self) -> Result<Vec<u8>, BrowserError> {
        let tree = self
            .driver_mut()?
            .draft(&|| now_ms() * 1e-3)
            .map_err(round_error)?;
        let round = self.round;
        self.round += 1;
        Ok(encode_frame(&Message::Verify(Verify {
            session: self.session,
            round,
            tree,
        })))
    }

    /// After the connection was lost mid-answer, on a new connection's stream: the frame asking
    /// the verifier for the session back. Its answer (to [`BrowserClient::on_frame`]) is a
    /// `resumed` event (carry on with [`BrowserClient::next_round`]) or a `reopen` one (send
    /// [`BrowserClient::reopen`]).
    pub fn resume(&mut self) -> Result<Vec<u8>, BrowserError> {
        self.driver_mut()?.connection_lost();
        self.round = 0;
        self.resuming = true;
        Ok(encode_frame(&Message::Resume {
            session: self.session,
            resume_token: self.resume_token,
        }))
    }

    /// The frame opening the answer's session again with everything committed so far (after a
    /// `reopen` event).
    pub fn reopen(&mut self) -> Result<Vec<u8>, BrowserError> {
        self.driver_mut()?.connection_lost();
        self.round = 0;
        self.resuming = false;
        Ok(self.open_frame())
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
    /// `{"event":"hello","model":NAME,"load":SCORE|null,"draining":BOOL}`, `{"event":"opened"}`,
    /// `{"event":"tokens","ids":[..],"text":NEW_TEXT,"finished":BOOL}`, after a resume
    /// `{"event":"resumed",...}` (the same fields: tokens of a round whose answer was lost) or
    /// `{"event":"reopen"}`; `{"event":"move"}` when a draining verifier let the session go
    /// (open it again with [`BrowserClient::reopen`] on another verifier).
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
                // How loaded it is (lower is better), so that the page keeps the less loaded of
                // the verifiers it said hello to; a draining one is never kept.
                let load = h.load.score();
                serde_json::json!({
                    "event": "hello",
                    "model": h.model_name,
                    "load": load.is_finite().then_some(load),
                    "draining": h.load.draining,
                })
            }
            Message::SessionOpened(o) if o.session == self.session => {
                self.resume_token = o.resume_token;
                serde_json::json!({"event": "opened"})
            }
            Message::Resumed { session, committed } if self.resuming && session == self.session => {
                self.resuming = false;
                match self
                    .driver_mut()?
                    .on_resumed(&committed)
                    .map_err(round_error)?
                {
                    Recovery::Resumed(out) => {
                        self.answer
                            .get_or_insert_with(String::new)
                            .push_str(&out.text);
                        tokens_event("resumed", &out)
                    }
                    Recovery::Reopen => serde_json::json!({"event": "reopen"}),
                }
            }
            // The verifier no longer holds the session (its grace period ended, or it restarted).
            Message::Error(e) if self.resuming && e.code == ErrorCode::UnknownSession => {
                self.resuming = false;
                serde_json::json!({"event": "reopen"})
            }
            Message::Verified(v) if v.session == self.session && v.round + 1 == self.round => {
                let out = self
                    .driver_mut()?
                    .on_verified(&v, now_ms() * 1e-3)
                    .map_err(round_error)?;
                self.answer
                    .get_or_insert_with(String::new)
                    .push_str(&out.text);
                tokens_event("tokens", &out)
            }
            // A draining verifier did not run the round (or open the session) and has let it
            // go: the page opens it again, with everything committed, on another verifier.
            Message::Move { session } if session == self.session => {
                self.driver_mut()?.connection_lost();
                serde_json::json!({"event": "move"})
            }
            Message::Error(e) if e.code == ErrorCode::Draining => {
                self.driver_mut()?.connection_lost();
                serde_json::json!({"event": "move"})
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
        self.driver
            .as_ref()
            .map_or_else(Vec::new, |d| d.generated().to_vec())
    }

    /// `{"tokens","rounds","tau","draft_ms","drafted_nodes","lookup_accepted"}` for this answer.
    pub fn stats(&self) -> String {
        let (tokens, stats) = match &self.driver {
            Some(d) => (d.generated().len(), d.stats().clone()),
            None => (0, GenerationStats::default()),
        };
        serde_json::json!({
            "tokens": tokens,
            "rounds": stats.rounds,
            "tau": tokens as f64 / stats.rounds.max(1) as f64,
            "draft_ms": stats.draft_s * 1e3,
            "drafted_nodes": stats.tree_nodes,
            "lookup_accepted": stats.lookup_accepted,
        })
        .to_string()
    }
}

impl BrowserClient {
    /// The last answer, whole or stopped, joins the conversation.
    fn keep_answer(&mut self) {
        if let Some(a) = self.answer.take() {
            self.history.push(ChatMessage::new("assistant", &a));
        }
    }

    /// Opens the answer to the conversation in `history` (ending with a question).
    fn open_answer(
        &mut self,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
    ) -> Result<Vec<u8>, BrowserError> {
        let budget = prompt_budget(self.context_tokens, max_tokens, self.limits.max_tree_nodes);
        let mut history = std::mem::take(&mut self.history);
        let tokenizer = self.tokenizer.clone();
        let prompt_len = |h: &[ChatMessage]| -> Result<usize, BrowserError> {
            Ok(tokenizer.encode(&tokenizer.chat_prompt(h))?.len())
        };
        let trimmed: Result<usize, BrowserError> =
            forget_oldest_exchanges(&mut history, |h| Ok(prompt_len(h)? <= budget));
        self.history = history;
        trimmed?;
        let prompt = self
            .tokenizer
            .encode(&self.tokenizer.chat_prompt(&self.history))?;
        // Refused before the drafter moves into a driver, which would then keep it.
        if prompt.is_empty() {
            return Err(BrowserError::Protocol("empty prompt".into()));
        }
        let greedy = SamplingParams {
            stop_ids: self.tokenizer.eos().to_vec(),
            ..SamplingParams::greedy(max_tokens)
        };
        let (params, draft_mode) = if temperature > 0.0 {
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(BrowserError::Settings(format!(
                    "top-p {top_p} is outside (0, 1]"
                )));
            }
            let mut seed = [0u8; 8];
            getrandom::fill(&mut seed)
                .map_err(|e| BrowserError::Settings(format!("no randomness for a seed: {e}")))?;
            let params = SamplingParams {
                mode: VerifyMode::Stochastic,
                temperature,
                top_p,
                seed: u64::from_le_bytes(seed),
                ..greedy
            };
            (params, DraftMode::sampled(temperature, top_p))
        } else {
            (greedy, DraftMode::Greedy)
        };
        if let Some(previous) = self.driver.take() {
            self.drafter = previous.into_drafter();
        }
        let mut drafter = self.drafter.take();
        if let Some(d) = &mut drafter {
            d.speculator.mode = draft_mode;
        }
        let mut driver = RoundDriver::new(prompt, params, drafter)
            .map_err(|e| BrowserError::Protocol(e.to_string()))?
            .with_lookup(Some(ContextLookup::default()))
            .with_text(self.tokenizer.clone());
        driver.set_limits(&self.limits);
        self.driver = Some(driver);
        self.answer = Some(String::new());
        self.session += 1;
        self.round = 0;
        self.resuming = false;
        Ok(self.open_frame())
    }

    fn driver_mut(&mut self) -> Result<&mut RoundDriver<'static>, BrowserError> {
        self.driver
            .as_mut()
            .ok_or_else(|| BrowserError::Protocol("no answer was started".into()))
    }

    /// OpenSession for the answer's committed tokens (the prompt, at first).
    fn open_frame(&self) -> Vec<u8> {
        let (prompt, params) = self
            .driver
            .as_ref()
            .expect("called with an answer started")
            .open_request();
        encode_frame(&Message::OpenSession(OpenSession {
            session: self.session,
            prompt,
            params,
        }))
    }
}

fn round_error(e: RoundError) -> BrowserError {
    match e {
        RoundError::Draft(m) => BrowserError::Model(m),
        RoundError::Protocol(p) => BrowserError::Protocol(p),
    }
}

/// `{"event":NAME,"ids":[..],"text":NEW_TEXT,"finished":BOOL}`.
fn tokens_event(name: &str, out: &RoundOutput) -> serde_json::Value {
    serde_json::json!({
        "event": name,
        "ids": out.tokens,
        "text": out.text,
        "finished": out.finished,
    })
}
