//! The browser end to end: headless Chromium loads the demo page, the widget's WebAssembly SSM
//! drafts, the verifier verifies over WebTransport, and the greedy answer's token ids equal the
//! native client's for the same prompt. A screenshot of the widget with the answer is saved as
//! `browser-e2e.png` in Cargo's temporary folder for tests (`target/tmp/`; the path is printed).
//!
//! Needs Chromium and the built widget (`web/pkg`, from `web/build.sh`); `scripts/test` provides
//! both. Without them the test says what is missing and passes only when
//! SPECINFER_REQUIRE_BROWSER is unset (a developer machine without a browser).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use specinfer_edge::Client;
use specinfer_integration::{chat_ids, default_ssm_dir, smollm2, start_verifier, API_KEY};
use specinfer_model::Llama;
use specinfer_net::ServerIdentity;
use specinfer_speculator::{CachedDraft, DraftMode, Drafter, RoundDriver, Speculator, TreeShape};
use specinfer_verifier::engine::EngineConfig;
use specinfer_verifier::web::{self, demo_files, DemoEndpoint};
use specinfer_wire::SamplingParams;

const PROMPT: &str = "Name two oceans.";
const MAX_TOKENS: u32 = 48;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            let out = Command::new("which").arg(name).output().ok()?;
            out.status
                .success()
                .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
}

fn missing(what: &str) {
    let required = std::env::var_os("SPECINFER_REQUIRE_BROWSER").is_some();
    eprintln!("browser end-to-end test NOT RUN: {what} (scripts/test sets everything up)");
    assert!(!required, "SPECINFER_REQUIRE_BROWSER is set but {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_browser_widget_answers_like_the_native_client() {
    let web_dir = repo().join("web");
    let Some(browser) = chromium() else {
        return missing("no Chromium found");
    };
    if !web_dir.join("pkg/specinfer_wasm_bg.wasm").exists() {
        return missing("web/pkg is not built (web/build.sh)");
    }
    let (mut server, remote) = start_verifier(EngineConfig::default());
    let (_, tok) = smollm2();

    // The native client, drafting with the same SSM and tree shape as the page.
    let ssm = Llama::from_safetensors(&default_ssm_dir()).unwrap();
    let mut client = Client::connect(remote.clone()).await.unwrap();
    let drafter = Drafter {
        speculator: Speculator::with_shape(
            TreeShape::Expansion(vec![1, 1, 3, 1]),
            DraftMode::Greedy,
            0,
        ),
        drafts: vec![Box::new(CachedDraft::new(&ssm))],
    };
    let params = SamplingParams {
        stop_ids: tok.eos().to_vec(),
        ..SamplingParams::greedy(MAX_TOKENS)
    };
    let mut driver = RoundDriver::new(chat_ids(PROMPT), params, Some(drafter)).unwrap();
    let native = client.generate(&mut driver, |_| {}).await.unwrap();
    client.shutdown().await;

    let identity = ServerIdentity::self_signed_for_browsers(&["localhost", "127.0.0.1"]).unwrap();
    let wt = server
        .serve_webtransport(&identity, "127.0.0.1:0".parse().unwrap())
        .unwrap();
    let files = demo_files(
        &web_dir,
        &default_ssm_dir(),
        tok,
        &DemoEndpoint {
            webtransport_port: wt.port(),
            certificate_sha256: identity.fingerprint(),
            api_key: Some(API_KEY.into()),
        },
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let web = listener.local_addr().unwrap();
    let (reports, mut reported) = tokio::sync::mpsc::unbounded_channel();
    let app = web::router(files, Vec::new()).merge(page_hooks(reports));
    tokio::spawn(specinfer_net::http::serve(listener, app));

    let url = format!(
        "http://{web}/?prompt={}&max_tokens={MAX_TOKENS}&temperature=0",
        PROMPT.replace(' ', "%20")
    );
    // First in real time (the page's clocks run: tokens/s and the SSM's drafting speed), then
    // under virtual time for a screenshot taken once the answer is in.
    let report = run_page(&browser, &url, None, &mut reported).await;
    let stats = &report["stats"];
    let secs = |ms: &serde_json::Value| ms.as_f64().unwrap_or(0.0) / 1e3;
    eprintln!(
        "browser answer: {:?}\nChromium: {} tokens in {:.2} s = {:.1} tokens/s, {:.2} tokens per round; \
         the WebAssembly SSM drafted {} tree nodes in {:.2} s = {:.0} nodes/s",
        report["text"].as_str().unwrap_or(""),
        stats["tokens"],
        secs(&stats["wall_ms"]),
        stats["tokens"].as_f64().unwrap_or(0.0) / secs(&stats["wall_ms"]),
        stats["tau"].as_f64().unwrap_or(0.0),
        stats["drafted_nodes"],
        secs(&stats["draft_ms"]),
        stats["drafted_nodes"].as_f64().unwrap_or(0.0) / secs(&stats["draft_ms"]),
    );
    assert_eq!(
        report_ids(&report),
        native.token_ids,
        "browser and native answers differ"
    );

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("browser-e2e.png");
    let _ = std::fs::remove_file(&shot);
    let report = run_page(&browser, &url, Some(&shot), &mut reported).await;
    assert_eq!(
        report_ids(&report),
        native.token_ids,
        "the screenshot run answered differently"
    );
    assert!(
        Path::new(&shot).exists(),
        "Chromium left no screenshot at {}",
        shot.display()
    );
    eprintln!("screenshot of the widget: {}", shot.display());
    server.shutdown().await;
}

/// The test's own routes beside the demo's (the verifier serves none of them): the page POSTs
/// its finished answer to `/report`, which goes to `reports`; `GET /hold` stays open until the
/// next report, which keeps a headless browser's virtual clock still while the answer is
/// generated.
fn page_hooks(reports: tokio::sync::mpsc::UnboundedSender<String>) -> axum::Router {
    let (reported, hold) = tokio::sync::watch::channel(0u64);
    let reported = std::sync::Arc::new(reported);
    axum::Router::new()
        .route(
            "/report",
            axum::routing::post(move |body: String| {
                let (reports, reported) = (reports.clone(), reported.clone());
                async move {
                    let _ = reports.send(body);
                    reported.send_modify(|n| *n += 1);
                    "ok\n"
                }
            }),
        )
        .route(
            "/hold",
            axum::routing::get(move || {
                let mut hold = hold.clone();
                async move {
                    hold.borrow_and_update();
                    let _ = tokio::time::timeout(Duration::from_secs(600), hold.changed()).await;
                    "done\n"
                }
            }),
        )
}

fn report_ids(report: &serde_json::Value) -> Vec<u32> {
    assert!(report.get("error").is_none(), "the page failed: {report}");
    report["ids"]
        .as_array()
        .expect("ids in the report")
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Loads `url` in headless Chromium until the page reports its answer. With `screenshot`, under
/// virtual time (the page's pending `/hold` request keeps the clock still until the answer is
/// in) and Chromium exits after writing the picture; without, in real time, and Chromium is
/// stopped once the report is in.
async fn run_page(
    browser: &Path,
    url: &str,
    screenshot: Option<&Path>,
    reported: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
) -> serde_json::Value {
    // A fresh profile of its own: Chromium refuses a profile another instance holds.
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--window-size=900,640",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .kill_on_drop(true);
    if let Some(shot) = screenshot {
        cmd.arg("--virtual-time-budget=4000")
            .arg(format!("--screenshot={}", shot.display()));
    }
    let mut chrome = cmd.arg(url).spawn().expect("starting Chromium");
    let report = tokio::time::timeout(Duration::from_secs(240), reported.recv())
        .await
        .expect("the page reported nothing within 4 minutes")
        .expect("the web server stopped");
    if screenshot.is_some() {
        let _ = tokio::time::timeout(Duration::from_secs(60), chrome.wait()).await;
    }
    let _ = chrome.kill().await;
    drop(profile);
    serde_json::from_str(&report).expect("a JSON report")
}
