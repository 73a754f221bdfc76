//! Everything slow runs here, on a thread of its own, so the window never waits: setting up the
//! models and the verifier, and generating. The UI sends [`Command`]s and reads [`Event`]s; each
//! event wakes the UI for a repaint.

use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use specinfer_edge::{Client, ClientOptions, ClientSetup, SetupError, SetupEvent};
use specinfer_model::fetch::FetchEvent;
use specinfer_model::ChatMessage;
use specinfer_speculator::RoundDriver;
use specinfer_wire::SamplingParams;

use crate::explain::{explain, UiError};
use crate::stats::{AnswerStats, LiveStats};

/// Tokens plain decoding generates to measure its rate, once per conversation.
const PLAIN_PROBE_TOKENS: u32 = 32;

pub enum Command {
    /// Set up (again) for these options: models, tokenizer checks, verifier connection.
    Configure(Box<ClientOptions>),
    Generate(GenerateRequest),
}

pub struct GenerateRequest {
    pub conversation: String,
    /// The conversation so far, ending with the question.
    pub history: Vec<ChatMessage>,
    /// Set to stop the answer after the round in flight.
    pub stop: Arc<AtomicBool>,
    /// Also measure plain decoding on this prompt (for the speed-up), after the answer.
    pub measure_plain: bool,
}

#[derive(Debug)]
pub enum Event {
    /// Setting up: what is happening, and how far a download is (0 to 1) when known.
    Progress {
        line: String,
        fraction: Option<f32>,
    },
    /// Ready to answer; says with what.
    Ready(String),
    SetupFailed(UiError),
    /// The oldest messages were left out of the prompt to fit the context.
    Forgot {
        conversation: String,
        messages: usize,
    },
    /// More of the answer, with the figures so far.
    Text {
        conversation: String,
        text: String,
        stats: AnswerStats,
    },
    Done {
        conversation: String,
        text: String,
        stats: AnswerStats,
        stopped: bool,
    },
    Failed {
        conversation: String,
        error: UiError,
    },
    /// Plain decoding's rate on this conversation's verifier, for the speed-up.
    PlainMeasured {
        conversation: String,
        tokens_per_s: f64,
    },
}

/// The UI's end of the worker.
pub struct Worker {
    commands: mpsc::Sender<Command>,
    events: mpsc::Receiver<Event>,
}

impl Worker {
    /// Starts the worker thread; `wake` is called after every event (the UI's repaint).
    pub fn start(wake: impl Fn() + Send + 'static) -> Worker {
        let (commands, inbox) = mpsc::channel();
        let (outbox, events) = mpsc::channel();
        let sink = Sink {
            events: outbox,
            wake: Box::new(wake),
        };
        std::thread::Builder::new()
            .name("specinfer-worker".into())
            .spawn(move || run(inbox, sink))
            .expect("spawning the worker thread");
        Worker { commands, events }
    }

    pub fn send(&self, command: Command) {
        // The worker only ends when this end is dropped.
        let _ = self.commands.send(command);
    }

    pub fn try_recv(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }
}

struct Sink {
    events: mpsc::Sender<Event>,
    wake: Box<dyn Fn() + Send>,
}

impl Sink {
    fn send(&self, event: Event) {
        if self.events.send(event).is_ok() {
            (self.wake)();
        }
    }
}

/// What a configured worker holds.
struct Ready {
    setup: ClientSetup,
    client: Client,
}

/// The worker's loop. Setting up blocks this thread (it loads models); the network runs on a
/// runtime whose own thread keeps the connection alive between answers.
fn run(inbox: mpsc::Receiver<Command>, sink: Sink) {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("specinfer-net")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            sink.send(Event::SetupFailed(UiError::new(
                "The network runtime could not start.",
                e.to_string(),
            )));
            return;
        }
    };
    let mut ready: Option<Ready> = None;
    while let Ok(command) = inbox.recv() {
        match command {
            Command::Configure(options) => {
                if let Some(old) = ready.take() {
                    rt.block_on(old.client.shutdown());
                }
                match configure(&rt, &options, &sink) {
                    Ok(r) => {
                        sink.send(Event::Ready(describe(&options, &r.setup)));
                        ready = Some(r);
                    }
                    Err(e) => sink.send(Event::SetupFailed(explain(&e))),
                }
            }
            Command::Generate(request) => {
                let conversation = request.conversation.clone();
                let Some(r) = ready.as_mut() else {
                    sink.send(Event::Failed {
                        conversation,
                        error: UiError::new(
                            "Not ready: the models and the verifier are not set up.",
                            "see the status line; Settings can change them",
                        ),
                    });
                    continue;
                };
                if let Err(e) = rt.block_on(answer(r, request, &sink)) {
                    sink.send(Event::Failed {
                        conversation,
                        error: explain(&e),
                    });
                }
            }
        }
    }
    if let Some(r) = ready {
        rt.block_on(r.client.shutdown());
    }
}

fn configure(
    rt: &tokio::runtime::Runtime,
    options: &ClientOptions,
    sink: &Sink,
) -> Result<Ready, SetupError> {
    let setup = ClientSetup::build(options, &mut |e| {
        let fraction = match e {
            SetupEvent::Fetch(FetchEvent::Downloading { index, of, .. }) => {
                Some((*index as f32 - 1.0) / (*of).max(1) as f32)
            }
            _ => None,
        };
        sink.send(Event::Progress {
            line: e.to_string(),
            fraction,
        });
    })?;
    sink.send(Event::Progress {
        line: "connecting to the verifier".into(),
        fraction: None,
    });
    let client = rt.block_on(setup.connect())?;
    Ok(Ready { setup, client })
}

/// The status line's words for a working setup.
fn describe(options: &ClientOptions, setup: &ClientSetup) -> String {
    let verifier = match &options.verifier {
        specinfer_edge::VerifierChoice::Embedded => "embedded verifier".to_string(),
        specinfer_edge::VerifierChoice::Remote { server, .. } => format!("verifier {server}"),
    };
    let decoding = match options.decoding {
        specinfer_edge::Decoding::Greedy => "greedy".to_string(),
        specinfer_edge::Decoding::Sample {
            temperature, top_p, ..
        } => format!("sampling at temperature {temperature}, top-p {top_p}"),
    };
    let tree = match &setup.tree {
        Some(_) => format!("tree {}", options.tree),
        None => "no tree (plain decoding)".into(),
    };
    format!(
        "Ready: {} answers ({verifier}), {tree}, {decoding}, {}-token context",
        options.llm.display_name(),
        setup.context_tokens
    )
}

/// One answer, streamed; then plain decoding's rate if asked for.
async fn answer(r: &mut Ready, request: GenerateRequest, sink: &Sink) -> Result<(), SetupError> {
    let GenerateRequest {
        conversation,
        mut history,
        stop,
        measure_plain,
    } = request;
    let forgotten = r.setup.fit_history(&mut history, false)?;
    if forgotten > 0 {
        sink.send(Event::Forgot {
            conversation: conversation.clone(),
            messages: forgotten,
        });
    }
    let ids = r.setup.prompt_ids(&history, false)?;
    let params = r.setup.request_params();
    let mut driver = r
        .setup
        .driver(&ids, params.clone(), r.setup.draft_mode)?
        .with_stop(stop);
    let mut live = LiveStats::default();
    let g = r
        .client
        .generate(&mut driver, |out| {
            live.on_round(out.tokens.len());
            sink.send(Event::Text {
                conversation: conversation.clone(),
                text: out.text.clone(),
                stats: live.snapshot(),
            });
        })
        .await?;
    let stopped = g.finish.is_none() && driver.is_stopped();
    sink.send(Event::Done {
        conversation: conversation.clone(),
        text: g.text.clone(),
        stats: AnswerStats::from_generation(&g),
        stopped,
    });
    if measure_plain && !stopped {
        if let Some(tokens_per_s) = plain_rate(&mut r.client, &ids, params).await? {
            sink.send(Event::PlainMeasured {
                conversation,
                tokens_per_s,
            });
        }
    }
    Ok(())
}

/// Plain decoding's rate (one token per LLM pass, no tree, no lookup) on the same prompt and
/// verifier: what speculation is measured against.
async fn plain_rate(
    client: &mut Client,
    ids: &[u32],
    params: SamplingParams,
) -> Result<Option<f64>, SetupError> {
    let t0 = Instant::now();
    let params = SamplingParams {
        max_new_tokens: PLAIN_PROBE_TOKENS,
        ..params
    };
    let mut driver = RoundDriver::new(ids.to_vec(), params, None)?;
    let g = client.generate(&mut driver, |_| {}).await?;
    tracing::debug!(
        "plain decoding: {} tokens in {:.2}s",
        g.token_ids.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(AnswerStats::from_generation(&g).decode_tokens_per_s())
}
