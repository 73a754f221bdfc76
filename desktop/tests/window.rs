//! The real `specinfer-desktop` binary in a real window: an X server in memory (Xvfb), the
//! keyboard and mouse driven by xdotool, one exchange with SmolLM2, a switch of the LLM to the
//! catalogue's Qwen coder in the settings window and an exchange with it, and screenshots of both
//! in `target/tmp/desktop.png` and `desktop-qwen.png` (ImageMagick's `import`). `scripts/test` installs the three (Debian: xvfb, xdotool,
//! imagemagick).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{cli_answer_with, repo};

use specinfer_desktop::settings::Settings;
use specinfer_desktop::store::{Role, Store};

/// Kills the process when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Fails with what to install when `name` is not on the PATH.
fn require(name: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "{name} is missing: install xvfb, xdotool and imagemagick (scripts/test does)"
    );
}

/// Starts Xvfb on a display number it picks itself (`-displayfd`), so that a display another
/// server holds, or a stale lock file a crashed one left, cannot put the test on the wrong screen.
/// Returns the server and its display once it has said the number; its stderr goes to `log`.
fn start_xvfb(log: &Path) -> (Running, String) {
    let mut xvfb = Command::new("Xvfb")
        .args([
            "-displayfd",
            "1",
            "-screen",
            "0",
            "1280x800x24",
            "-nolisten",
            "tcp",
        ])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let stdout = xvfb.stdout.take().unwrap();
    let xvfb = Running(xvfb);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
        let _ = tx.send(line);
    });
    let number = rx
        .recv_timeout(Duration::from_secs(20))
        .ok()
        .and_then(|line| line.trim().parse::<u32>().ok())
        .unwrap_or_else(|| {
            panic!(
                "Xvfb did not say its display; its log ({}):\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            )
        });
    (xvfb, format!(":{number}"))
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn xdotool(display: &str, args: &[&str]) -> Option<String> {
    let out = Command::new("xdotool")
        .env("DISPLAY", display)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The app under test, its log kept in a file so that a failure can say what the app said (a CI
/// log shows only the end of the run, where an inherited stderr is long gone).
struct App {
    process: Running,
    log: PathBuf,
}

impl App {
    fn start(exe: &Path, data: &Path, display: &str, log: PathBuf) -> App {
        let process = Running(
            Command::new(exe)
                .args(["--data-dir", data.to_str().unwrap(), "--no-keyring"])
                .env("DISPLAY", display)
                .env("LIBGL_ALWAYS_SOFTWARE", "1")
                .env("SPECINFER_LOG", "info")
                .env("RUST_BACKTRACE", "1")
                .env_remove("WAYLAND_DISPLAY")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        );
        App { process, log }
    }

    /// The end of the app's log.
    fn said(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut start = text.len().saturating_sub(4000);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        let xvfb = self.log.with_file_name("desktop-xvfb.log");
        format!(
            "the app's log ({}) ends:\n{}\nthe X server's log ({}):\n{}",
            self.log.display(),
            &text[start..],
            xvfb.display(),
            std::fs::read_to_string(&xvfb).unwrap_or_default()
        )
    }

    /// Waits for the app's window and returns it with its X id, or what the app said when it
    /// exited first.
    fn window(mut self, display: &str) -> Result<(App, String), String> {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(id) = xdotool(display, &["search", "--name", "^specinfer$"])
                .and_then(|w| w.lines().next().map(str::to_string))
            {
                return Ok((self, id));
            }
            if let Ok(Some(status)) = self.process.0.try_wait() {
                return Err(format!("exit {status}; {}", self.said()));
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for the window; {}",
                self.said()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits for `done`, failing with the app's log when the app exits or time runs out.
    fn wait_for(&mut self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + timeout;
        while !done() {
            if let Ok(Some(status)) = self.process.0.try_wait() {
                panic!(
                    "the app exited ({status}) waiting for {what}; {}",
                    self.said()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; {}",
                self.said()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Asks for code, so that the screenshot shows a rendered code block.
const QUESTION: &str = "Write a Python function that adds two numbers.";

fn desktop_exe() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("specinfer-desktop")
}

/// The first answer of each saved conversation, oldest conversation first.
fn saved_answers(conversations: &Path) -> Vec<String> {
    let Ok(store) = Store::open(conversations.to_path_buf()) else {
        return Vec::new();
    };
    let (mut loaded, _) = store.load_all();
    // Ids are creation times in milliseconds, made unique: their order is the creation order.
    loaded.sort_by(|a, b| (a.id.len(), &a.id).cmp(&(b.id.len(), &b.id)));
    loaded
        .iter()
        .filter_map(|c| {
            c.messages
                .iter()
                .find(|m| m.role == Role::Assistant)
                .map(|m| m.content.clone())
        })
        .collect()
}

fn conversation_files(conversations: &Path) -> usize {
    std::fs::read_dir(conversations).map_or(0, |d| d.count())
}

/// Types `question` into the composer and sends it. The composer has the focus from the first
/// frame on, and Enter sends only once the models are set up: until a conversation file more than
/// `before` exists, focus the window, clear the composer, type and press Enter (keys sent before
/// the first frame, or while a model loads, are lost).
fn send(app: &mut App, display: &str, window: &str, conversations: &Path, question: &str) {
    let before = conversation_files(conversations);
    app.wait_for(
        &format!("{question:?} to be sent"),
        Duration::from_secs(600),
        || {
            xdotool(display, &["windowfocus", "--sync", window]);
            xdotool(display, &["key", "ctrl+a", "BackSpace"]);
            xdotool(display, &["type", "--delay", "10", question]);
            xdotool(display, &["key", "Return"]);
            std::thread::sleep(Duration::from_millis(500));
            conversation_files(conversations) > before
        },
    );
}

/// Where the switch's clicks land, in window coordinates: egui lays the window out the same way
/// every time at its default size with its built-in fonts (checked below). A layout change that
/// moves them fails the settings check, with a screenshot of where things were.
const WINDOW_SIZE: &str = "1100x720";
const SETTINGS_BUTTON: (u32, u32) = (39, 12);
const QWEN_CHOICE: (u32, u32) = (140, 170);
const APPLY_BUTTON: (u32, u32) = (47, 439);
const NEW_CONVERSATION: (u32, u32) = (67, 41);

fn click(display: &str, window: &str, (x, y): (u32, u32)) {
    let (x, y) = (x.to_string(), y.to_string());
    xdotool(
        display,
        &["mousemove", "--window", window, &x, &y, "click", "1"],
    )
    .expect("xdotool clicks");
    // A frame or two to react.
    std::thread::sleep(Duration::from_millis(800));
}

fn screenshot(display: &str, window: &str, shot: &Path) {
    let _ = std::fs::remove_file(shot);
    let status = Command::new("import")
        .args(["-display", display, "-window", window])
        .arg(shot)
        .status()
        .unwrap();
    assert!(status.success(), "import took the screenshot");
    // A blank screen compresses to a few hundred bytes; text and panels do not.
    let size = std::fs::metadata(shot).unwrap().len();
    assert!(size > 20_000, "{} is only {size} bytes", shot.display());
    eprintln!("screenshot: {}", shot.display());
}

#[test]
fn the_binary_answers_in_a_real_window_switches_to_the_qwen_coder_and_answers_again() {
    // The app's data and the logs in a folder of this run's own (removed at the end; a failure
    // prints the logs); the screenshot where a reviewer finds it.
    let target_tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let run = tempfile::Builder::new()
        .prefix("desktop-window-")
        .tempdir_in(&target_tmp)
        .unwrap();
    let tmp = run.path();
    let data = tmp.join("data");
    std::fs::create_dir_all(&data).unwrap();
    Settings {
        greedy: true,
        max_tokens: 40,
        draft: repo().join("models/ssm").display().to_string(),
        ..Settings::default()
    }
    .save(&data.join("settings.json"))
    .unwrap();

    for name in ["Xvfb", "xdotool", "import"] {
        require(name);
    }
    let xvfb_log = tmp.join("desktop-xvfb.log");
    let (_xvfb, display) = start_xvfb(&xvfb_log);
    // Ready when a client gets an answer from it: its socket appears before it serves (a CI
    // run on a loaded machine started the app in between, and the app could not connect).
    wait_for("Xvfb", Duration::from_secs(20), || {
        xdotool(&display, &["getdisplaygeometry"]).is_some()
    });

    let exe = desktop_exe();
    assert!(exe.exists(), "{} is missing", exe.display());
    // A window system that fails once (a GL context under Xvfb) is the machine's, not the
    // app's: start the app once more, after printing what it said. A fault of the app fails both.
    let start = |attempt: usize| {
        App::start(
            &exe,
            &data,
            &display,
            tmp.join(format!("desktop-window-{attempt}.log")),
        )
    };
    let (mut app, window) = match start(1).window(&display) {
        Ok(ready) => ready,
        Err(said) => {
            eprintln!("the app exited before its window appeared, starting it once more; {said}");
            start(2)
                .window(&display)
                .unwrap_or_else(|said| panic!("the app exited before its window appeared; {said}"))
        }
    };
    let conversations = data.join("conversations");
    send(&mut app, &display, &window, &conversations, QUESTION);
    let mut answers = Vec::new();
    app.wait_for("the answer", Duration::from_secs(120), || {
        answers = saved_answers(&conversations);
        !answers.is_empty()
    });
    assert!(!answers[0].is_empty(), "an answer came back");
    // Let the window paint the finished answer and its figures.
    std::thread::sleep(Duration::from_secs(2));
    screenshot(&display, &window, &target_tmp.join("desktop.png"));

    // Switch the LLM once, by the mouse: Settings, the catalogue's Qwen coder, Apply. Its drafter
    // comes with it (fetched, like the GGUF, with a progress bar when missing).
    let geometry = xdotool(&display, &["getwindowgeometry", &window]).unwrap_or_default();
    assert!(
        geometry.contains(WINDOW_SIZE),
        "the clicks below are placed for a {WINDOW_SIZE} window: {geometry}"
    );
    click(&display, &window, SETTINGS_BUTTON);
    click(&display, &window, QWEN_CHOICE);
    click(&display, &window, APPLY_BUTTON);
    let settings_file = data.join("settings.json");
    let switched = || Settings::load(&settings_file).is_ok_and(|s| s.llm == "qwen2.5-coder-1.5b");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !switched() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    if !switched() {
        let shot = target_tmp.join("desktop-switch-failed.png");
        screenshot(&display, &window, &shot);
        panic!(
            "the clicks did not switch the LLM (has the settings window's layout moved? see {}); {}",
            shot.display(),
            app.said()
        );
    }
    // A new conversation, so that the answer depends on the question alone, as the CLI's does.
    click(&display, &window, NEW_CONVERSATION);
    const QWEN_QUESTION: &str = "Write a Python function that reverses a string.";
    send(&mut app, &display, &window, &conversations, QWEN_QUESTION);
    app.wait_for("the Qwen coder's answer", Duration::from_secs(180), || {
        answers = saved_answers(&conversations);
        answers.len() == 2
    });
    let log = std::fs::read_to_string(&app.log).unwrap_or_default();
    assert!(
        log.contains("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"),
        "the app did not load the Qwen coder; {}",
        app.said()
    );
    std::thread::sleep(Duration::from_secs(2));
    screenshot(&display, &window, &target_tmp.join("desktop-qwen.png"));
    // Greedy, so token-identical to the Qwen coder alone: the CLI's answer with the same model.
    let cli = cli_answer_with(QWEN_QUESTION, 40, &["--model", "qwen2.5-coder-1.5b"]);
    assert_eq!(answers[1], cli, "the window's Qwen answer is the CLI's");
}
