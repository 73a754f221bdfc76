//! Every message either side can send. A connection starts with `ClientHello` / `ServerHello`;
//! then any number of sessions are opened, verified round by round, and closed.

use serde::{Deserialize, Serialize};

use crate::{FeatureRows, Limits, TokenTree, TreeError, PROMPT_FEATURE_ROWS};

/// What identifies a model's token space: two sides only agree on token ids if all of this matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    pub vocab_size: u32,
    pub bos: Option<u32>,
    pub eos: Vec<u32>,
    /// SHA-256 of the tokenizer's canonical JSON.
    pub tokenizer_sha256: [u8; 32],
}

impl std::fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vocab {} bos {:?} eos {:?} tokenizer ",
            self.vocab_size, self.bos, self.eos
        )?;
        self.tokenizer_sha256[..8]
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientHello {
    pub protocol_version: u16,
    /// The client's tokenizer; the server refuses the connection when it differs from its own.
    pub expected_model: ModelFingerprint,
    pub api_key: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerHello {
    pub protocol_version: u16,
    pub model_name: String,
    pub model: ModelFingerprint,
    pub limits: Limits,
    /// How busy the verifier is as it says hello, so a client that knows several can place its
    /// sessions on the least loaded one.
    pub load: ServerLoad,
}

/// A verifier's load, as its hello reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerLoad {
    /// Sessions open (attached or within their grace period).
    pub sessions: u32,
    /// The most sessions it admits.
    pub max_sessions: u32,
    /// Verification rounds waiting for a forward.
    pub queued_rounds: u32,
    /// KV cache bytes its budget has left.
    pub kv_free_bytes: u64,
    /// Tree nodes and prompt tokens its last batched forward carried.
    pub batch_nodes: u32,
    /// It is draining (shutting down or restarting): it opens no new sessions.
    pub draining: bool,
}

impl ServerLoad {
    /// How loaded it is, lower is better: queued rounds weigh most (they are latency every
    /// session on it pays now), then the share of its sessions in use. A draining verifier is
    /// never better than one that is not.
    pub fn score(&self) -> f64 {
        if self.draining {
            return f64::INFINITY;
        }
        let occupancy = self.sessions as f64 / self.max_sessions.max(1) as f64;
        self.queued_rounds as f64 + occupancy
    }
}

/// How the verifier decides which drafted tokens to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VerifyMode {
    /// SpecInfer VerifyGreedy: output is token-identical to greedy decoding of the LLM alone.
    Greedy,
    /// Multi-step speculative sampling (or recursive rejection sampling, by the tree's draw mode):
    /// output is distributed exactly as sampling from the LLM. Needs proposals in the tree.
    Stochastic,
    /// Sample from the LLM and keep the draft only where it happens to match; lossless too, but
    /// accepts less. For ablation.
    Naive,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub mode: VerifyMode,
    /// Applied to the LLM's logits before verification; ignored in greedy mode.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
    /// The verifier's RNG for this session is seeded from this, so a session's output is
    /// reproducible whatever else shared its batches.
    pub seed: u64,
    pub max_new_tokens: u32,
    pub stop_ids: Vec<u32>,
    /// Ask the verifier for the LLM's features of the tokens it runs ([`Verified::features`]),
    /// for a feature-conditioned drafter; refused by a verifier whose engine cannot give them.
    pub return_features: bool,
    /// Repetition penalty (1: none), as llama.cpp's: before verification, the logit of every
    /// token among the last `repeat_last_n` of the node's context (committed tokens, then its
    /// tree path) is divided by it where positive and multiplied where negative. Output is then
    /// distributed exactly as the penalised LLM (greedy: its argmax).
    pub repeat_penalty: f32,
    /// How many of the latest context tokens the penalty looks at (0: none).
    pub repeat_last_n: u32,
}

impl SamplingParams {
    pub fn greedy(max_new_tokens: u32) -> Self {
        SamplingParams {
            mode: VerifyMode::Greedy,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_new_tokens,
            stop_ids: Vec::new(),
            return_features: false,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        }
    }

    /// Whether the repetition penalty changes anything.
    pub fn penalises_repeats(&self) -> bool {
        self.repeat_penalty != 1.0 && self.repeat_last_n > 0
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpenSession {
    /// Chosen by the client, unique on its connection.
    pub session: u64,
    /// Committed tokens so far (prompt, plus any earlier output when re-opening). The last one is
    /// the root of the first round's tree and is not prefilled.
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionOpened {
    pub session: u64,
    /// Presented to resume the session on a new connection within the grace period.
    pub resume_token: [u8; 16],
    /// What a token costs on this verifier now, split and plain, so a client can choose before
    /// its first round.
    pub costs: VerifierCosts,
}

/// What a generated token costs on a verifier now, from its recent rounds (every session's):
/// what a client weighs, before its first round, against sending trees at all. A split round
/// is worth it only while `(round trip + split_round_us) / split_tokens` stays under
/// `plain_step_us`; the client knows its own round trip, the verifier knows the rest. Each
/// field is 0 while the verifier has measured nothing it could put there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifierCosts {
    /// Microseconds of forward a plain step (one node per session) costs a session now.
    pub plain_step_us: u32,
    /// Microseconds a recent client-drafted round cost at the verifier: its wait for a place,
    /// its forward, and its tree's extra nodes at the price they cost the other sessions.
    pub split_round_us: u32,
    /// Thousandths of a token those rounds committed, on average; below 1000 (a round commits
    /// at least one token) means unknown.
    pub split_tokens_milli: u32,
}

impl VerifierCosts {
    /// `(split, plain)` seconds per token for a client `rtt_s` away, once both are known.
    pub fn per_token(&self, rtt_s: f64) -> Option<(f64, f64)> {
        (self.plain_step_us > 0 && self.split_round_us > 0 && self.split_tokens_milli >= 1000).then(
            || {
                let tokens = self.split_tokens_milli as f64 / 1000.0;
                (
                    (rtt_s.max(0.0) + self.split_round_us as f64 * 1e-6) / tokens,
                    self.plain_step_us as f64 * 1e-6,
                )
            },
        )
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verify {
    pub session: u64,
    pub round: u32,
    pub tree: TokenTree,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundStats {
    pub tree_nodes: u32,
    /// How many sequences shared the forward pass.
    pub batch_size: u32,
    pub queue_us: u32,
    pub forward_us: u32,
    /// What one more tree node costs the verifier's users now, in nanoseconds of forward time:
    /// the marginal cost per node of its fitted cost model times the sessions that shared this
    /// forward (each of them waits that much longer). Load-aware trees weigh nodes by it, so
    /// they shrink under load and grow with idle capacity. 0 while the verifier has no fit.
    pub node_price_ns: u32,
    /// When the verifier is busy (rounds waited for a place in a forward), the most nodes the
    /// next tree of this session should hold; 0 when there is no cap.
    pub node_cap: u32,
}

/// Who drafts the rounds of a session the verifier drives itself ([`Message::Generate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerDrafting {
    /// None: plain incremental decoding, one token per forward, as a server-only deployment
    /// runs.
    Plain,
    /// The verifier's own draft model (co-located speculation); refused by a verifier started
    /// without one.
    Speculative,
    /// The context lookup's chain alone: every round also carries up to `max_tokens` tokens
    /// that followed the latest earlier occurrence of the context's last few tokens, cut to
    /// what the verifier's measured costs make pay. It needs no model, so every verifier runs
    /// it; a client that handed an answer off keeps what the lookup was giving it.
    Lookup { max_tokens: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verified {
    pub session: u64,
    pub round: u32,
    /// Tree nodes whose tokens were accepted, root-to-leaf, excluding the root. The edge rolls its
    /// draft state back to this path.
    pub accepted_nodes: Vec<u32>,
    /// Tokens appended to the sequence: the accepted nodes' tokens, then the token the LLM
    /// produced itself (bonus or correction), which roots the next tree. Shorter when a stop
    /// token or the length limit ended the session inside the round.
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub stats: RoundStats,
    /// When the session asked for them: the LLM's features of the positions this round ran
    /// and kept (the root and the accepted nodes, whose tokens precede the ones emitted), and in
    /// a session's first verdict also the prompt's last [`PROMPT_FEATURE_ROWS`] positions.
    pub features: Option<FeatureRows>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    BadFrame,
    UnsupportedVersion,
    Unauthorized,
    ModelMismatch,
    UnknownSession,
    SessionExists,
    Busy,
    LimitExceeded,
    OutOfOrder,
    /// The verifier cannot do what was asked (the message says why).
    Unsupported,
    Internal,
    /// The verifier is draining (a restart or scale-down): it opens no session and resumes
    /// none; open it on another verifier, with the committed tokens.
    Draining,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorFrame {
    pub code: ErrorCode,
    /// Set when the error concerns one session only; the connection stays usable.
    pub session: Option<u64>,
    pub message: String,
    /// For `Busy`: when a retry has a chance.
    pub retry_after_ms: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Message {
    ClientHello(ClientHello),
    ServerHello(ServerHello),
    OpenSession(OpenSession),
    SessionOpened(SessionOpened),
    Verify(Verify),
    Verified(Verified),
    Error(ErrorFrame),
    Close {
        session: u64,
    },
    /// Re-attaches a session whose connection dropped, within the server's grace period.
    Resume {
        session: u64,
        resume_token: [u8; 16],
    },
    /// Answer to `Resume`: the session's committed tokens (prompt and output so far).
    Resumed {
        session: u64,
        committed: Vec<u32>,
    },
    /// Asks the verifier to decode the open session to its end on its own (server-only
    /// generation, as a cloud API serves it) and stream one `Verified` per round, numbered from
    /// the session's next round; no `Verify` may follow.
    Generate {
        session: u64,
        drafting: ServerDrafting,
    },
    /// The verifier's answer to a round, instead of `Verified`, when it is draining: it did not
    /// run the round and has closed the session. The client re-opens the session on another
    /// verifier with its committed tokens (nothing is lost; the round is drafted again there).
    Move {
        session: u64,
    },
}

/// Why a well-framed message was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidMessage {
    #[error("{what} has {got} entries, the limit is {limit}")]
    TooLong {
        what: &'static str,
        got: usize,
        limit: usize,
    },
    #[error("sampling parameter {0}")]
    BadParam(String),
    #[error(transparent)]
    Tree(#[from] TreeError),
}

impl Message {
    /// The variant's name, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Message::ClientHello(_) => "ClientHello",
            Message::ServerHello(_) => "ServerHello",
            Message::OpenSession(_) => "OpenSession",
            Message::SessionOpened(_) => "SessionOpened",
            Message::Verify(_) => "Verify",
            Message::Verified(_) => "Verified",
            Message::Error(_) => "Error",
            Message::Close { .. } => "Close",
            Message::Resume { .. } => "Resume",
            Message::Resumed { .. } => "Resumed",
            Message::Generate { .. } => "Generate",
            Message::Move { .. } => "Move",
        }
    }

    /// Checks sizes and internal consistency. Vocabulary bounds need the model and are checked by
    /// the verifier with [`TokenTree::validate`].
    pub fn validate(&self, limits: &Limits) -> Result<(), InvalidMessage> {
        let bound = |what, got: usize, limit: u32| {
            if got > limit as usize {
                Err(InvalidMessage::TooLong {
                    what,
                    got,
                    limit: limit as usize,
                })
            } else {
                Ok(())
            }
        };
        match self {
            Message::ClientHello(h) => {
                bound(
                    "api key",
                    h.api_key.as_ref().map_or(0, String::len),
                    limits.max_api_key_bytes,
                )?;
                bound("eos ids", h.expected_model.eos.len(), limits.max_stop_ids)
            }
            Message::ServerHello(h) => {
                bound("model name", h.model_name.len(), limits.max_message_bytes)
            }
            Message::OpenSession(o) => {
                bound("prompt", o.prompt.len(), limits.max_prompt_tokens)?;
                if o.prompt.is_empty() {
                    return Err(InvalidMessage::BadParam(
                        "prompt must hold at least one token".into(),
                    ));
                }
                o.params.validate(limits)
            }
            Message::Verify(v) => {
                bound("tree", v.tree.len(), limits.max_tree_nodes)?;
                // The vocabulary is not known here; u32::MAX lets every token id through.
                v.tree.validate(u32::MAX, limits)?;
                Ok(())
            }
            Message::Verified(v) => {
                bound(
                    "accepted path",
                    v.accepted_nodes.len(),
                    limits.max_tree_nodes,
                )?;
                bound("round tokens", v.tokens.len(), limits.max_tree_nodes + 1)?;
                match &v.features {
                    Some(f) => f.validate(limits.max_tree_nodes as usize + PROMPT_FEATURE_ROWS),
                    None => Ok(()),
                }
            }
            Message::Resumed { committed, .. } => bound(
                "committed tokens",
                committed.len(),
                limits.max_prompt_tokens + limits.max_new_tokens,
            ),
            Message::Error(e) => bound("error message", e.message.len(), limits.max_message_bytes),
            Message::Generate {
                drafting: ServerDrafting::Lookup { max_tokens },
                ..
            } => bound("lookup chain", *max_tokens as usize, limits.max_tree_nodes),
            Message::SessionOpened(_)
            | Message::Close { .. }
            | Message::Resume { .. }
            | Message::Generate { .. }
            | Message::Move { .. } => Ok(()),
        }
    }
}

/// The most context tokens a repetition penalty may look at (each costs the verifier a lookup
/// per tree node).
pub const MAX_REPEAT_LAST_N: u32 = 4096;

impl SamplingParams {
    fn validate(&self, limits: &Limits) -> Result<(), InvalidMessage> {
        let bad = |s: String| Err(InvalidMessage::BadParam(s));
        if !(self.temperature.is_finite() && self.temperature >= 0.0 && self.temperature <= 100.0) {
            return bad(format!(
                "temperature {} must be in [0, 100]",
                self.temperature
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.mode != VerifyMode::Greedy && self.temperature == 0.0 {
            return bad("temperature 0 needs greedy mode".into());
        }
        if !(self.repeat_penalty.is_finite()
            && self.repeat_penalty > 0.0
            && self.repeat_penalty <= 10.0)
        {
            return bad(format!(
                "repeat_penalty {} must be in (0, 10]",
                self.repeat_penalty
            ));
        }
        if self.repeat_last_n > MAX_REPEAT_LAST_N {
            return bad(format!(
                "repeat_last_n {} must be at most {MAX_REPEAT_LAST_N}",
                self.repeat_last_n
            ));
        }
        if self.max_new_tokens == 0 || self.max_new_tokens > limits.max_new_tokens {
            return bad(format!(
                "max_new_tokens {} must be in 1..={}",
                self.max_new_tokens, limits.max_new_tokens
            ));
        }
        if self.stop_ids.len() > limits.max_stop_ids as usize {
            return Err(InvalidMessage::TooLong {
                what: "stop ids",
                got: self.stop_ids.len(),
                limit: limits.max_stop_ids as usize,
            });
        }
        Ok(())
    }
}
