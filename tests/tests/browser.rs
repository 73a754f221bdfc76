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

use specinfer_edge::{Client, Generation};
use specinfer_integration::{
    cache_dir, default_ssm_dir, smollm2, start_verifier, verifier_exe, API_KEY,
};
use specinfer_model::{ChatMessage, Llama};
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

/// The native client's greedy answer to `turns` (a conversation ending with a question),
/// drafting with the same SSM as the page.
async fn native_answer(
    remote: &specinfer_net::RemoteConfig,
    turns: &[ChatMessage],
    max_tokens: u32,
) -> Generation {
    let (_, tok) = smollm2();
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
        ..SamplingParams::greedy(max_tokens)
    };
    let ids = tok.encode(&tok.chat_prompt(turns)).unwrap();
    let mut driver = RoundDriver::new(ids, params, Some(drafter)).unwrap();
    let answer = client.generate(&mut driver, |_| {}).await.unwrap();
    client.shutdown().await;
    answer
}

/// A verifier serving the demo page (WebTransport; the page over HTTP), and the reports its
/// page sends.
struct DemoPage {
    server: specinfer_verifier::service::RunningVerifier,
    files: web::WebFiles,
    /// The verifier over QUIC (for the native client).
    remote: specinfer_net::RemoteConfig,
    web: std::net::SocketAddr,
    browser: PathBuf,
    reported: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl DemoPage {
    /// One verifier; `None` (and why, said) when Chromium or the built widget is missing.
    async fn start() -> Option<DemoPage> {
        let web_dir = repo().join("web");
        let Some(browser) = chromium() else {
            missing("no Chromium found");
            return None;
        };
        if !web_dir.join("pkg/specinfer_wasm_bg.wasm").exists() {
            missing("web/pkg is not built (web/build.sh)");
            return None;
        }
        let (llm, tok) = smollm2();
        let identity =
            ServerIdentity::self_signed_for_browsers(&["localhost", "127.0.0.1"]).unwrap();
        let (mut server, remote) = start_verifier(EngineConfig::default());
        let wt = server
            .serve_webtransport(&identity, "127.0.0.1:0".parse().unwrap())
            .unwrap();
        let files = demo_files(
            &web_dir,
            &default_ssm_dir(),
            tok,
            llm.config().max_positions,
            &DemoEndpoint {
                webtransport_port: wt.port(),
                certificate_sha256: identity.fingerprint(),
                api_key: Some(API_KEY.into()),
            },
        )
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let web = listener.local_addr().unwrap();
        let (reports, reported) = tokio::sync::mpsc::unbounded_channel();
        let app = web::router(files.clone(), Vec::new()).merge(page_hooks(reports));
        tokio::spawn(specinfer_net::http::serve(listener, app));
        Some(DemoPage {
            server,
            files,
            remote,
            web,
            browser,
            reported,
        })
    }

    /// Points the page at other verifiers (its `/config.json`).
    fn set_config(&self, config: serde_json::Value) {
        self.files.add(
            "/config.json",
            "application/json",
            config.to_string().into_bytes(),
        );
    }

    async fn shutdown(self) {
        self.server.shutdown().await;
    }

    /// The page asking `prompts` in turn (one conversation), greedy, `extra` query parameters
    /// added; its report (the last answer, and all of them under "answers").
    async fn ask(
        &mut self,
        prompts: &[&str],
        max_tokens: u32,
        extra: &str,
        screenshot: Option<&Path>,
    ) -> serde_json::Value {
        let asked: String = prompts
            .iter()
            .map(|p| format!("prompt={}&", p.replace(' ', "%20").replace('?', "%3F")))
            .collect();
        let url = format!(
            "http://{}/?{asked}max_tokens={max_tokens}&temperature=0{extra}",
            self.web
        );
        run_page(&self.browser, &url, screenshot, &mut self.reported).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_render_as_markdown_with_highlighted_code_and_no_script_runs() {
    let Some(mut page) = DemoPage::start().await else {
        return;
    };
    let encode = |text: &str| -> String {
        text.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    // An answer with markup meant to run: an image whose failure runs a handler, a script, a
    // javascript: link, an SVG handler, handlers in Markdown's own HTML.
    let hostile = "Here you go:\n\n<img src=x onerror=\"window.pwned='img'\">\n\n\
        <script>window.pwned='script'</script>\n\n\
        A [link](javascript:window.pwned='link') and an [ordinary one](https://example.org).\n\n\
        <svg onload=\"window.pwned='svg'\"></svg>\n\n\
        <div onmouseover=\"window.pwned='div'\">text</div>\n\n**bold**";
    let url = format!("http://{}/?render={}", page.web, encode(hostile));
    let report = run_page(&page.browser, &url, None, &mut page.reported).await;
    assert_eq!(
        report["pwned"],
        serde_json::Value::Null,
        "a script ran: {report}"
    );
    assert_eq!(report["scripts"], 0, "{report}");
    assert_eq!(report["handlers"], 0, "{report}");
    assert_eq!(report["script_links"], 0, "{report}");
    // Markdown still renders: the ordinary link and the bold text.
    assert!(report["links"].as_u64().unwrap() >= 1, "{report}");
    assert!(
        report["html"]
            .as_str()
            .unwrap()
            .contains("<strong>bold</strong>"),
        "{report}"
    );
    // A fenced code block: highlighted, and a picture of it for the eye.
    let code = "A function:\n\n```python\ndef add(a, b):\n    # the sum\n    return a + b\n```\n";
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("browser-markdown.png");
    let _ = std::fs::remove_file(&shot);
    let url = format!("http://{}/?render={}", page.web, encode(code));
    let report = run_page(&page.browser, &url, Some(&shot), &mut page.reported).await;
    assert!(
        report["highlighted"].as_u64().unwrap() >= 3,
        "the code block is not highlighted: {report}"
    );
    assert!(report["html"].as_str().unwrap().contains("language-python"));
    eprintln!("screenshot of a rendered code block: {}", shot.display());
    page.shutdown().await;
}

/// A `specinfer-verifier serve --web` process of this build, every port chosen by the system.
struct WebVerifier {
    child: std::process::Child,
    admin: std::net::SocketAddr,
    /// Its entry in a page's `/config.json` (from its own `/config.json`).
    endpoint: serde_json::Value,
}

impl WebVerifier {
    fn start() -> WebVerifier {
        use std::io::BufRead;
        let mut child = Command::new(verifier_exe())
            .args(["serve", "--self-signed", "--insecure-no-auth"])
            .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--web", "127.0.0.1:0", "--webtransport", "127.0.0.1:0"])
            .arg("--web-dir")
            .arg(repo().join("web"))
            .arg("--web-ssm")
            .arg(default_ssm_dir())
            .env("SPECINFER_CACHE", cache_dir())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting specinfer-verifier");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        // "admin on http://ADDR/ ..." and "browser demo on http://ADDR/ ...".
        let (mut admin, mut web) = (None, None);
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while admin.is_none() || web.is_none() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = rx
                .recv_timeout(left)
                .expect("the verifier said where it listens");
            let addr = |prefix: &str| -> Option<std::net::SocketAddr> {
                let rest = line.strip_prefix(prefix)?;
                rest[..rest.find('/')?].parse().ok()
            };
            admin = admin.or_else(|| addr("admin on http://"));
            web = web.or_else(|| addr("browser demo on http://"));
        }
        let config: serde_json::Value =
            serde_json::from_str(&curl(&format!("http://{}/config.json", web.unwrap()), &[]))
                .expect("its /config.json");
        WebVerifier {
            child,
            admin: admin.unwrap(),
            endpoint: serde_json::json!({
                "host": "127.0.0.1",
                "webtransport_port": config["webtransport_port"],
                "certificate_sha256": config["certificate_sha256"],
            }),
        }
    }

    /// A counter or gauge of its `/metrics`.
    fn metric(&self, name: &str) -> u64 {
        let text = curl(&format!("http://{}/metrics", self.admin), &[]);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in its metrics"))
    }

    fn drain(&self) {
        curl(&format!("http://{}/drain", self.admin), &["-X", "POST"]);
    }
}

impl Drop for WebVerifier {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a GET (or what `args` make it) with curl.
fn curl(url: &str, args: &[&str]) -> String {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .arg(url)
        .output()
        .expect("running curl");
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_goes_on_elsewhere_when_its_verifier_drains_or_is_killed() {
    let story = "Write a long story about a dragon who learns to cook.";
    // The greedy answer, from an in-process verifier of the same build and model.
    let Some(mut page) = DemoPage::start().await else {
        return;
    };
    let whole = native_answer(&page.remote, &[ChatMessage::new("user", story)], 200).await;
    assert_eq!(whole.token_ids.len(), 200, "the story is long");
    for killed in [false, true] {
        // Two verifier processes; the page lists both.
        let mut fleet = [WebVerifier::start(), WebVerifier::start()];
        page.set_config(serde_json::json!({
            "verifiers": [fleet[0].endpoint.clone(), fleet[1].endpoint.clone()],
        }));
        let before: Vec<(u64, u64)> = fleet
            .iter()
            .map(|v| {
                (
                    v.metric("specinfer_tokens_total"),
                    v.metric("specinfer_sessions_opened_total"),
                )
            })
            .collect();
        let url = format!(
            "http://{}/?prompt={}&max_tokens=200&temperature=0&round_timeout=3",
            page.web,
            story.replace(' ', "%20")
        );
        // Once the page's verifier has committed a quarter of the answer, it drains (POST
        // /drain: it moves the session at its next round, then exits) or is killed (SIGKILL:
        // its connection goes silent, nothing says goodbye).
        let act = async {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let serving = (0..2).find(|&i| {
                    fleet[i].metric("specinfer_sessions_active") > 0
                        && fleet[i].metric("specinfer_tokens_total") >= before[i].0 + 50
                });
                if let Some(i) = serving {
                    return i;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no verifier served the page"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let DemoPage {
            browser, reported, ..
        } = &mut page;
        let page_run = run_page(browser, &url, None, reported);
        tokio::pin!(page_run);
        // The page runs while the fleet is watched; the chosen verifier leaves mid-answer.
        let left = tokio::select! {
            i = act => i,
            report = &mut page_run => panic!("the answer ended before a verifier left: {report}"),
        };
        if killed {
            fleet[left].child.kill().unwrap();
        } else {
            fleet[left].drain();
        }
        let report = page_run.await;
        let other = 1 - left;
        assert_eq!(
            report_ids(&report),
            whole.token_ids,
            "killed {killed}: the answer finished elsewhere is not the whole greedy answer"
        );
        assert!(
            fleet[other].metric("specinfer_sessions_opened_total") > before[other].1
                && fleet[other].metric("specinfer_tokens_total") > before[other].0,
            "killed {killed}: the other verifier served nothing"
        );
    }
    page.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_browser_widget_answers_like_the_native_client() {
    let Some(mut page) = DemoPage::start().await else {
        return;
    };
    let native = native_answer(
        &page.remote,
        &[ChatMessage::new("user", PROMPT)],
        MAX_TOKENS,
    )
    .await;

    // First in real time (the page's clocks run: tokens/s and the SSM's drafting speed), then
    // under virtual time for a screenshot taken once the answer is in.
    let report = page.ask(&[PROMPT], MAX_TOKENS, "", None).await;
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
    let report = page.ask(&[PROMPT], MAX_TOKENS, "", Some(&shot)).await;
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
    page.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_keeps_its_turns_and_stop_keeps_a_prefix_of_the_answer() {
    let Some(mut page) = DemoPage::start().await else {
        return;
    };
    let questions = ["What is the capital of France?", "And of Italy?"];
    let story = "Write a long story about a dragon who learns to cook.";
    // The native client's conversation: its first answer, then the second question asked with
    // both turns before it.
    let first = native_answer(
        &page.remote,
        &[ChatMessage::new("user", questions[0])],
        MAX_TOKENS,
    )
    .await;
    // The answer's text as streamed: its tokens decoded, end-of-turn left out.
    let (_, tok) = smollm2();
    let visible: Vec<u32> = first
        .token_ids
        .iter()
        .copied()
        .filter(|t| !tok.eos().contains(t))
        .collect();
    let turns = [
        ChatMessage::new("user", questions[0]),
        ChatMessage::new("assistant", &tok.decode(&visible).unwrap()),
        ChatMessage::new("user", questions[1]),
    ];
    let second = native_answer(&page.remote, &turns, MAX_TOKENS).await;
    let whole = native_answer(&page.remote, &[ChatMessage::new("user", story)], 200).await;
    assert_eq!(whole.token_ids.len(), 200, "the story is long");
    // The page talks to a verifier process of this build (the native answers above came from
    // one in this test process: greedy answers are the same on both).
    let verifier = WebVerifier::start();
    page.set_config(serde_json::json!({ "verifiers": [verifier.endpoint.clone()] }));
    let hits_before = verifier.metric("specinfer_prefix_hits_total");
    let report = page.ask(&questions, MAX_TOKENS, "", None).await;
    let answers = report["answers"].as_array().expect("both answers");
    assert_eq!(
        report_ids(&answers[0]),
        first.token_ids,
        "the first answers differ"
    );
    assert_eq!(
        report_ids(&answers[1]),
        second.token_ids,
        "the second answer is not the native client's for the whole conversation"
    );
    assert!(
        verifier.metric("specinfer_prefix_hits_total") > hits_before,
        "the verifier's prefix cache served no earlier turn"
    );

    // Stop, once the answer has 40 characters: it ends after the round in flight, keeping a
    // prefix of the whole answer.
    let report = page.ask(&[story], 200, "&stop_at=40", None).await;
    let stopped = report_ids(&report);
    assert_eq!(report["stopped"], true, "{report}");
    assert!(
        !stopped.is_empty() && stopped.len() < whole.token_ids.len(),
        "stopped after {} tokens",
        stopped.len()
    );
    assert_eq!(
        stopped[..],
        whole.token_ids[..stopped.len()],
        "the stopped answer is not a prefix of the whole one"
    );
    page.shutdown().await;
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
