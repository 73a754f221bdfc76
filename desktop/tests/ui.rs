//! The window driven headless (egui_kittest): real models, the embedded verifier over loopback
//! QUIC, and, for the bad pin, a real remote verifier.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{cli_answer_with, repo};

use egui::accesskit::Role;
use egui_kittest::kittest::Queryable;
use egui_kittest::Harness;
use specinfer_desktop::settings::{Settings, TrustSetting, VerifierSetting};
use specinfer_desktop::store::Role as Speaker;
use specinfer_desktop::{AppConfig, DesktopApp, Status};

const QUESTION: &str = "What is the capital of France?";

/// An app data folder of the test's own, removed when dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("desktop-{name}-"))
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
}

/// Greedy settings with the shipped SSM (by its absolute path: tests run in the crate folder).
fn greedy(max_tokens: u32) -> Settings {
    Settings {
        greedy: true,
        max_tokens,
        draft: repo().join("models/ssm").display().to_string(),
        ..Settings::default()
    }
}

fn open(data_dir: &Path) -> Harness<'static, DesktopApp> {
    let app = DesktopApp::new(AppConfig {
        data_dir: data_dir.to_path_buf(),
        keyring: false,
    })
    .unwrap();
    Harness::builder()
        .with_size([1100.0, 720.0])
        // egui_commonmark marks a code block's copy button with U+1F5D0, which egui's bundled
        // fonts cannot draw (the window shows a box there too): an answer with code must not
        // fail the test for it.
        .allow_missing_glyphs()
        .build_ui_state(|ui, app: &mut DesktopApp| app.ui(ui), app)
}

/// Steps the UI until `done` holds, as a window would repaint while the worker works.
fn step_until(
    harness: &mut Harness<'_, DesktopApp>,
    what: &str,
    mut done: impl FnMut(&DesktopApp) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !done(harness.state()) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        harness.step();
        std::thread::sleep(Duration::from_millis(10));
    }
    harness.step();
}

fn wait_ready(harness: &mut Harness<'_, DesktopApp>) {
    step_until(harness, "the setup", |app| {
        if let Status::Failed(e) = app.status() {
            panic!("setup failed: {e:?}");
        }
        app.is_ready()
    });
}

fn ask(harness: &mut Harness<'_, DesktopApp>, question: &str) {
    let input = harness.get_by_role(Role::MultilineTextInput);
    input.focus();
    harness.step();
    harness
        .get_by_role(Role::MultilineTextInput)
        .type_text(question);
    harness.step();
    harness.key_press(egui::Key::Enter);
    harness.step();
}

/// `specinfer generate`'s greedy answer (the CLI of this build).
fn cli_answer(question: &str, max_tokens: u32) -> String {
    cli_answer_with(question, max_tokens, &[])
}

#[test]
fn an_answer_streams_in_equals_the_cli_can_be_stopped_and_survives_a_restart() {
    let data = scratch("chat");
    let data = data.path();
    greedy(48).save(&data.join("settings.json")).unwrap();
    let mut harness = open(&data);
    wait_ready(&mut harness);

    // Enter sends; the answer streams in (text before the answer is done), then equals the
    // CLI's greedy answer for the same question.
    ask(&mut harness, QUESTION);
    assert!(harness.state().is_answering(), "Enter sent the question");
    assert!(
        harness.query_by_label("Stop").is_some(),
        "Stop is offered while answering"
    );
    let mut streamed = false;
    step_until(&mut harness, "the answer", |app| {
        streamed |= app.is_answering() && streamed_len(app) > 0;
        !app.is_answering()
    });
    assert!(streamed, "text appeared before the answer was done");
    let app = harness.state();
    assert!(app.failure().is_none(), "{:?}", app.failure());
    let conversation = app.current().unwrap().clone();
    assert_eq!(conversation.messages.len(), 2);
    let answer = &conversation.messages[1];
    assert_eq!(answer.role, Speaker::Assistant);
    assert!(!answer.stopped);
    assert_eq!(answer.content, cli_answer(QUESTION, 48));
    assert!(answer.stats.as_ref().unwrap().tokens > 0);
    // The speculation panel shows the answer's figures, and the speed-up once plain decoding
    // has been measured on this conversation.
    harness.get_by_label("tokens per round");
    step_until(&mut harness, "plain decoding's rate", |app| {
        app.current().unwrap().plain_tokens_per_s.is_some()
    });
    harness.get_by_label_contains("over plain decoding");

    // Stop: a long answer stopped at its first streamed text keeps what it had. Plain decoding
    // (no tree) makes its 400 tokens take 400 rounds, so Stop lands mid-answer.
    let slow = Settings {
        tree: "none".into(),
        ..greedy(400)
    };
    harness.state_mut().apply_settings(slow, "").unwrap();
    wait_ready(&mut harness);
    ask(
        &mut harness,
        "Write a long story about a dragon who learns to cook.",
    );
    step_until(&mut harness, "the first streamed text", |app| {
        streamed_len(app) > 0 || !app.is_answering()
    });
    harness.get_by_label("Stop").click_accesskit();
    step_until(&mut harness, "the stop", |app| !app.is_answering());
    let stopped = harness
        .state()
        .current()
        .unwrap()
        .messages
        .last()
        .unwrap()
        .clone();
    assert!(
        stopped.stopped,
        "the answer is marked stopped: {:?}",
        stopped
            .stats
            .as_ref()
            .map(|s| (s.tokens, s.rounds, s.wall_s))
    );
    assert!(
        stopped.stats.as_ref().unwrap().tokens < 400,
        "stopped before its 400 tokens"
    );
    harness.get_by_label("(stopped)");
    let before = harness.state().current().unwrap().clone();
    drop(harness);

    // A restart finds the conversation as it was, and shows it.
    let mut harness = open(&data);
    harness.step();
    let app = harness.state();
    assert!(app.notices().is_empty(), "{:?}", app.notices());
    assert_eq!(app.conversations().len(), 1);
    // The same messages (figures as saved: JSON keeps a float to its 17 digits, not its bits).
    let after = app.current().unwrap();
    assert_eq!(after.id, before.id);
    let summary = |c: &specinfer_desktop::store::Conversation| {
        c.messages
            .iter()
            .map(|m| {
                let rounds = m.stats.as_ref().map(|s| s.tokens_per_round.clone());
                (m.role, m.content.clone(), m.stopped, rounds)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(summary(after), summary(&before));
    assert_eq!(after.messages.len(), 4);
    // Shown: in the list, and as the first question of the transcript.
    assert_eq!(harness.query_all_by_label(&before.title).count(), 2);
}

#[test]
fn the_settings_switch_the_llm_to_the_qwen_pair_which_then_answers() {
    let data = scratch("switch");
    let data = data.path();
    greedy(24).save(&data.join("settings.json")).unwrap();
    let mut harness = open(data);
    wait_ready(&mut harness);
    harness.get_by_label_contains("SmolLM2-135M-Instruct answers");
    // Settings: the catalogue's other LLM, applied; its drafter comes with it (the SSM folder
    // set for SmolLM2 is dropped), both fetched with progress on first use.
    // A window takes a few frames to lay itself out.
    let settle = |harness: &mut Harness<'_, DesktopApp>| (0..4).for_each(|_| harness.step());
    harness.get_by_label("Settings").click_accesskit();
    settle(&mut harness);
    harness.get_by_label("qwen2.5-coder-1.5b").click_accesskit();
    settle(&mut harness);
    harness.get_by_label("Apply").click_accesskit();
    settle(&mut harness);
    assert_eq!(harness.state().settings().llm, "qwen2.5-coder-1.5b");
    assert!(harness.state().settings().draft.is_empty());
    wait_ready(&mut harness);
    harness.get_by_label_contains("Qwen2.5-Coder-1.5B-Instruct answers");
    let question = "Write a Python function that adds two numbers.";
    ask(&mut harness, question);
    step_until(&mut harness, "the answer", |app| !app.is_answering());
    let app = harness.state();
    assert!(app.failure().is_none(), "{:?}", app.failure());
    let answer = app
        .current()
        .unwrap()
        .messages
        .last()
        .unwrap()
        .content
        .clone();
    let cli = cli_answer_with(question, 24, &["--model", "qwen2.5-coder-1.5b"]);
    assert_eq!(answer, cli, "the app's Qwen answer is the CLI's");
}

/// The streamed text shown so far for the answer in progress.
fn streamed_len(app: &DesktopApp) -> usize {
    app.answer_in_progress().map_or(0, str::len)
}

#[test]
fn a_wrong_pin_is_shown_in_words_with_retry() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_runtime = rt.enter();
    let (_verifier, remote) = specinfer_integration::start_verifier(Default::default());
    let specinfer_net::Trust::Pinned(pin) = &remote.trust else {
        panic!("the test verifier is pinned")
    };
    let mut wrong: Vec<u8> = pin.to_vec();
    wrong[0] ^= 0xff;
    let wrong_hex: String = wrong.iter().map(|b| format!("{b:02x}")).collect();
    let data = scratch("pin");
    let data = data.path();
    Settings {
        verifier: VerifierSetting::Remote {
            servers: remote.addr.to_string(),
            server_name: "localhost".into(),
            trust: TrustSetting::Pin(wrong_hex),
        },
        ..greedy(16)
    }
    .save(&data.join("settings.json"))
    .unwrap();
    let mut harness = open(&data);
    step_until(&mut harness, "the refusal", |app| {
        matches!(app.status(), Status::Failed(_))
    });
    let failure = harness.state().failure().unwrap().error.clone();
    assert!(
        failure.headline.contains("pin"),
        "the headline names the pin: {failure:?}"
    );
    assert!(
        harness
            .query_all_by_label(&failure.headline)
            .next()
            .is_some(),
        "the window shows it"
    );
    harness.get_by_label("Retry");
    // Nothing can be sent while nothing is set up.
    assert!(!harness.state().is_ready());
}
