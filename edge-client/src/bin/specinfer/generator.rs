//! The OpenAI endpoint's generations, one after another on a thread of their own: the draft
//! models, the setup and the verifier connection live there (they are not shared between
//! threads), and HTTP handlers hand it [`Job`]s through a bounded queue. A job whose client
//! has gone (its stop flag set) is skipped if still queued, and stopped after the round in
//! flight if running.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use anyhow::{Context, Result};
use axum::http::StatusCode;
use serde_json::{json, Value};
use specinfer_edge::{Client, ClientOptions, ClientSetup};
use specinfer_model::ChatMessage;
use specinfer_speculator::DraftMode;
use specinfer_wire::{FinishReason, SamplingParams, VerifyMode};
use tokio::sync::mpsc::UnboundedSender;

/// One completion request, its JSON already checked for shape.
pub struct Job {
    /// A chat completion (the chat template over `messages`), else a raw completion.
    pub chat: bool,
    pub messages: Vec<ChatMessage>,
    /// The request, for its sampling fields.
    pub body: Value,
    /// Set when the client is gone.
    pub stop: Arc<AtomicBool>,
    pub replies: UnboundedSender<Reply>,
}

/// What the generator says about a job, in order: `Refused`, or `Started`, then `Text`s, then
/// `Finished` or `Failed`.
pub enum Reply {
    /// Refused before generating: the HTTP status and an OpenAI-style error body.
    Refused(StatusCode, Value),
    Started {
        prompt_tokens: usize,
    },
    Text(String),
    Finished {
        finish_reason: &'static str,
        completion_tokens: usize,
    },
    Failed(String),
}

/// The queue is full: the endpoint answers 503.
pub struct Busy;

pub struct Generator {
    jobs: mpsc::SyncSender<Job>,
    /// The LLM's context, in tokens.
    pub context_tokens: usize,
}

impl Generator {
    /// Sets up `options` on the generator's thread (progress on stderr) and connects to the
    /// verifier; returns once it is ready, or with what went wrong. At most `queue` jobs wait.
    pub fn start(options: ClientOptions, queue: usize) -> Result<Generator> {
        let (jobs, inbox) = mpsc::sync_channel::<Job>(queue);
        let (ready_tx, ready) = mpsc::channel::<Result<usize>>();
        std::thread::Builder::new()
            .name("specinfer-generator".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => return drop(ready_tx.send(Err(e.into()))),
                };
                let setup = match ClientSetup::build(&options, &mut |e| eprintln!("specinfer: {e}"))
                {
                    Ok(s) => s,
                    Err(e) => return drop(ready_tx.send(Err(e.into()))),
                };
                let mut client = match rt.block_on(setup.connect()) {
                    Ok(c) => c,
                    Err(e) => return drop(ready_tx.send(Err(e.into()))),
                };
                let _ = ready_tx.send(Ok(setup.context_tokens));
                while let Ok(job) = inbox.recv() {
                    if job.stop.load(Ordering::Relaxed) {
                        continue;
                    }
                    rt.block_on(run(&setup, &mut client, job));
                }
                rt.block_on(client.shutdown());
            })
            .context("starting the generator thread")?;
        let context_tokens = ready
            .recv()
            .context("the generator thread ended while setting up")??;
        Ok(Generator {
            jobs,
            context_tokens,
        })
    }

    pub fn submit(&self, job: Job) -> Result<(), Busy> {
        self.jobs.try_send(job).map_err(|_| Busy)
    }
}

pub fn invalid_request(message: &str) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error"}})
}

/// One job: its parameters, its prompt within the context, then the generation, streamed.
async fn run(setup: &ClientSetup, client: &mut Client, job: Job) {
    let Job {
        chat,
        messages,
        body,
        stop,
        replies,
    } = job;
    let reply = |r: Reply| {
        let _ = replies.send(r);
    };
    let (params, draft_mode) = match request_params(setup, &body) {
        Ok(p) => p,
        Err(m) => return reply(Reply::Refused(StatusCode::BAD_REQUEST, invalid_request(&m))),
    };
    let ids = match setup.prompt_ids(&messages, !chat) {
        Ok(ids) => ids,
        Err(e) => {
            return reply(Reply::Refused(
                StatusCode::BAD_REQUEST,
                invalid_request(&e.to_string()),
            ))
        }
    };
    // Refused here, as OpenAI does, so that apps which trim their history on this code can.
    let budget = setup.prompt_budget(params.max_new_tokens);
    if ids.len() > budget {
        let message = format!(
            "the prompt has {} tokens, more than the {budget} that fit the model's {}-token context \
             with max_tokens {} and room for speculation",
            ids.len(),
            setup.context_tokens,
            params.max_new_tokens
        );
        let error = json!({"error": {"message": message, "type": "invalid_request_error", "code": "context_length_exceeded"}});
        return reply(Reply::Refused(StatusCode::BAD_REQUEST, error));
    }
    reply(Reply::Started {
        prompt_tokens: ids.len(),
    });
    let generation = async {
        let mut driver = setup.driver(&ids, params, draft_mode)?.with_stop(stop);
        // What OpenAI's API documents of a seed: the same request samples the same answer.
        if body.get("seed").is_some() {
            driver = driver.reproducible();
        }
        let g = client
            .generate(&mut driver, |out| {
                if !out.text.is_empty() {
                    reply(Reply::Text(out.text.clone()))
                }
            })
            .await?;
        anyhow::Ok(g)
    };
    match generation.await {
        Ok(g) if g.finish.is_none() => tracing::info!(
            "the client left: its generation stopped after {} tokens",
            g.token_ids.len()
        ),
        Ok(g) => reply(Reply::Finished {
            finish_reason: match g.finish {
                Some(FinishReason::Length) => "length",
                _ => "stop",
            },
            completion_tokens: g.token_ids.len(),
        }),
        Err(e) => reply(Reply::Failed(format!("{e:#}"))),
    }
}

/// Sampling parameters and draft mode of a request: what it leaves out from the server's
/// defaults (OpenAI's unless the operator set others), a fresh seed unless it gives one.
fn request_params(
    setup: &ClientSetup,
    body: &Value,
) -> Result<(SamplingParams, DraftMode), String> {
    let mut params = setup.request_params();
    if let Some(n) = body
        .get("max_tokens")
        .or_else(|| body.get("max_completion_tokens"))
    {
        params.max_new_tokens = n
            .as_u64()
            .filter(|&n| n > 0 && n <= 8192)
            .ok_or("max_tokens must be 1..=8192")? as u32;
    }
    if let Some(s) = body.get("seed") {
        params.seed = s.as_u64().ok_or("seed must be a non-negative integer")?;
    }
    let top_p = match body.get("top_p") {
        Some(p) => p
            .as_f64()
            .filter(|&p| p > 0.0 && p <= 1.0)
            .ok_or("top_p must be in (0, 1]")? as f32,
        None => params.top_p,
    };
    let temperature = match body.get("temperature") {
        Some(t) => t
            .as_f64()
            .filter(|&t| (0.0..=2.0).contains(&t))
            .ok_or("temperature must be in [0, 2]")? as f32,
        None => params.temperature,
    };
    if temperature == 0.0 {
        params.mode = VerifyMode::Greedy;
        params.temperature = 0.0;
        params.top_p = 1.0;
        return Ok((params, DraftMode::Greedy));
    }
    params.mode = VerifyMode::Stochastic;
    params.temperature = temperature;
    params.top_p = top_p;
    Ok((params, DraftMode::sampled(temperature, top_p)))
}
