//! A soak: 16 clients against one `specinfer-verifier` process for 30 minutes (3 with `--quick`),
//! greedy and seeded sampled answers taking turns, and one answer in ten cut off by dropping its
//! connection mid-answer (the verifier detaches that session and must reclaim it). Every 10 s the
//! verifier's resident memory, its KV bytes and its sessions are sampled; every answer that
//! finishes is compared with the same request answered alone before the soak.
//!
//! The verifier is pinned to core 1 and the clients to core 0, so that neither measures the
//! other. The tree shape is fixed (`dynamic:24`): a seeded sampled answer is then the same
//! whatever else runs (an adaptive shape would follow the timings).

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;
use specinfer_edge::Client;
use specinfer_net::RemoteConfig;
use specinfer_speculator::TreeShape;
use specinfer_wire::{DrawMode, VerifyMode};

use crate::common::{self, Ctx, Section};
use crate::verifier_process::{pin_this_process, VerifierOptions, VerifierProcess};

const CLIENTS: usize = 16;
/// Prompts answered in turn (`--quick` loads six).
const PROMPTS: usize = 6;
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// One answer in this many is cut off mid-way.
const CUT_ONE_IN: usize = 10;

/// One request of the soak: a prompt, and greedy or sampled (seeded by the prompt's index).
#[derive(Clone, Copy)]
struct Request {
    prompt: usize,
    sampled: bool,
}

impl Request {
    fn all() -> Vec<Request> {
        (0..PROMPTS)
            .flat_map(|prompt| [false, true].map(|sampled| Request { prompt, sampled }))
            .collect()
    }

    fn index(self) -> usize {
        self.prompt * 2 + self.sampled as usize
    }
}

/// One sample of the verifier's state.
struct Sample {
    at_s: f64,
    rss_bytes: u64,
    kv_bytes: f64,
    sessions: f64,
    answers: usize,
}

/// Generates `r` on `client`; the token ids.
async fn answer(ctx: &Ctx, client: &mut Client, shape: &TreeShape, r: Request) -> Result<Vec<u32>> {
    let mode = if r.sampled {
        VerifyMode::Stochastic
    } else {
        VerifyMode::Greedy
    };
    let params = common::params(ctx, mode, r.prompt as u64);
    let draft = common::draft_mode(mode, DrawMode::WithoutReplacement);
    let mut driver = common::driver(ctx, &ctx.prompts[r.prompt], params, Some(shape), draft)?;
    Ok(client.generate(&mut driver, |_| {}).await?.token_ids)
}

pub fn run(ctx: &Ctx, llm: &Path, quick: bool) -> Result<Section> {
    anyhow::ensure!(
        ctx.prompts.len() >= PROMPTS,
        "the soak needs {PROMPTS} prompts"
    );
    let minutes = if quick { 3 } else { 30 };
    let verifier = VerifierProcess::start_with(&VerifierOptions {
        core: Some(1),
        llm,
        ssm: None,
        listen: "127.0.0.1:0".parse()?,
        identity: None,
        extra: Vec::new(),
    })?;
    pin_this_process("0")?;
    let remote = verifier.remote(verifier.addr, ctx.tok.fingerprint())?;
    let shape: TreeShape = "dynamic:24".parse().map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    eprintln!(
        "soak: answering each of {} requests alone first",
        PROMPTS * 2
    );
    let solo: Vec<Vec<u32>> = rt.block_on(async {
        let mut client = Client::connect(remote.clone()).await?;
        let mut solo = Vec::new();
        for r in Request::all() {
            solo.push(answer(ctx, &mut client, &shape, r).await?);
        }
        client.shutdown().await;
        anyhow::Ok(solo)
    })?;
    drop(rt);

    let until = Instant::now() + Duration::from_secs(minutes * 60);
    let done = AtomicBool::new(false);
    let answers = AtomicUsize::new(0);
    let cut = AtomicUsize::new(0);
    let mismatches: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let samples: Mutex<Vec<Sample>> = Mutex::new(Vec::new());
    let start = Instant::now();
    eprintln!("soak: {CLIENTS} clients for {minutes} minutes");
    std::thread::scope(|scope| -> Result<()> {
        for c in 0..CLIENTS {
            let (remote, shape, solo) = (&remote, &shape, &solo);
            let (done, answers, cut, mismatches, errors) =
                (&done, &answers, &cut, &mismatches, &errors);
            scope.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(client_loop(
                    ctx, c, remote, shape, solo, done, answers, cut, mismatches, errors,
                ));
            });
        }
        let admin_rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        while Instant::now() < until {
            std::thread::sleep(SAMPLE_EVERY.min(until.saturating_duration_since(Instant::now())));
            let sample = Sample {
                at_s: start.elapsed().as_secs_f64(),
                rss_bytes: verifier.rss_bytes()?,
                kv_bytes: admin_rt.block_on(verifier.counter("specinfer_kv_bytes"))?,
                sessions: admin_rt.block_on(verifier.counter("specinfer_sessions_active"))?,
                answers: answers.load(Ordering::Relaxed),
            };
            eprintln!(
                "soak: {:>5.0} s  RSS {:>6.1} MiB  KV {:>6.1} MiB  sessions {:>3}  answers {}",
                sample.at_s,
                sample.rss_bytes as f64 / 1048576.0,
                sample.kv_bytes / 1048576.0,
                sample.sessions,
                sample.answers
            );
            samples.lock().unwrap().push(sample);
        }
        done.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    let samples = samples.into_inner().unwrap();
    let mismatches = mismatches.into_inner().unwrap();
    let errors = errors.into_inner().unwrap();
    report(
        &samples,
        answers.into_inner(),
        cut.into_inner(),
        &mismatches,
        &errors,
        minutes,
    )
}

/// One client: answers requests in turn until `done`, cutting one in [`CUT_ONE_IN`] off after
/// a while by dropping its connection (and connecting again).
#[allow(clippy::too_many_arguments)]
async fn client_loop(
    ctx: &Ctx,
    c: usize,
    remote: &RemoteConfig,
    shape: &TreeShape,
    solo: &[Vec<u32>],
    done: &AtomicBool,
    answers: &AtomicUsize,
    cut: &AtomicUsize,
    mismatches: &Mutex<Vec<String>>,
    errors: &Mutex<Vec<String>>,
) {
    let requests = Request::all();
    let mut client = None;
    for n in 0.. {
        if done.load(Ordering::Relaxed) {
            break;
        }
        let r = requests[(c + n) % requests.len()];
        if client.is_none() {
            match Client::connect(remote.clone()).await {
                Ok(cl) => client = Some(cl),
                Err(e) => {
                    errors
                        .lock()
                        .unwrap()
                        .push(format!("client {c}: connect: {e}"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
        }
        let cl = client.as_mut().expect("connected above");
        if (c * 7 + n).is_multiple_of(CUT_ONE_IN) {
            // Cut off after 50-500 ms: the generation and its connection are dropped.
            let after = Duration::from_millis(50 + ((c * 131 + n * 17) % 450) as u64);
            let _ = tokio::time::timeout(after, answer(ctx, cl, shape, r)).await;
            client = None;
            cut.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        match answer(ctx, cl, shape, r).await {
            Ok(ids) => {
                answers.fetch_add(1, Ordering::Relaxed);
                if ids != solo[r.index()] {
                    mismatches.lock().unwrap().push(format!(
                        "client {c}: prompt {} ({}) differs from its solo answer",
                        r.prompt,
                        if r.sampled { "sampled" } else { "greedy" }
                    ));
                }
            }
            Err(e) => {
                errors.lock().unwrap().push(format!("client {c}: {e:#}"));
                client = None;
            }
        }
    }
    if let Some(cl) = client {
        cl.shutdown().await;
    }
}

fn report(
    samples: &[Sample],
    answers: usize,
    cut: usize,
    mismatches: &[String],
    errors: &[String],
    minutes: u64,
) -> Result<Section> {
    let mib = |b: f64| b / 1048576.0;
    let third = (samples.len() / 3).max(1);
    let mean_rss =
        |s: &[Sample]| s.iter().map(|x| x.rss_bytes as f64).sum::<f64>() / s.len().max(1) as f64;
    let first = mean_rss(&samples[..third.min(samples.len())]);
    let last = mean_rss(&samples[samples.len().saturating_sub(third)..]);
    let peak_kv = samples.iter().map(|s| s.kv_bytes).fold(0.0, f64::max);
    let last_sample = samples.last().context("no sample taken")?;
    let mut md = format!(
        "## Soak\n\n{CLIENTS} clients against one verifier for {minutes} minutes (verifier on core 1, clients on core 0; SmolLM2-135M verifying, the default SSM drafting `dynamic:24` trees), greedy and seeded sampled answers in turn, one answer in {CUT_ONE_IN} cut off by dropping its connection mid-answer.\n\n\
         - answers finished: {answers}, cut off: {cut}\n\
         - answers different from their solo run: {}\n\
         - client errors: {}\n\
         - verifier RSS: {:.1} MiB mean over the first third of the samples, {:.1} MiB over the last third ({:+.1}%)\n\
         - KV: peak {:.1} MiB, {:.1} MiB at the end; sessions at the end: {}\n\n\
         | time (s) | RSS (MiB) | KV (MiB) | sessions | answers |\n|---:|---:|---:|---:|---:|\n",
        mismatches.len(),
        errors.len(),
        mib(first),
        mib(last),
        (last / first.max(1.0) - 1.0) * 100.0,
        mib(peak_kv),
        mib(last_sample.kv_bytes),
        last_sample.sessions,
    );
    for s in samples {
        md.push_str(&format!(
            "| {:.0} | {:.1} | {:.1} | {} | {} |\n",
            s.at_s,
            mib(s.rss_bytes as f64),
            mib(s.kv_bytes),
            s.sessions,
            s.answers
        ));
    }
    for e in errors.iter().take(5) {
        md.push_str(&format!("\nerror: {e}"));
    }
    for m in mismatches.iter().take(5) {
        md.push_str(&format!("\nmismatch: {m}"));
    }
    let json = json!({
        "minutes": minutes,
        "clients": CLIENTS,
        "answers": answers,
        "cut": cut,
        "mismatches": mismatches.len(),
        "errors": errors.len(),
        "rss_first_third_bytes": first,
        "rss_last_third_bytes": last,
        "samples": samples.iter().map(|s| json!({"at_s": s.at_s, "rss_bytes": s.rss_bytes, "kv_bytes": s.kv_bytes, "sessions": s.sessions, "answers": s.answers})).collect::<Vec<_>>(),
    });
    Ok(Section {
        key: "soak",
        json,
        markdown: md,
    })
}
