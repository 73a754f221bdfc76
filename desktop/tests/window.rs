//! The real `specinfer-desktop` binary in a real window: an X server in memory (Xvfb), the
//! keyboard driven by xdotool, one exchange, and a screenshot of it in `target/tmp/desktop.png`
//! (ImageMagick's `import`). `scripts/test` installs the three (Debian: xvfb, xdotool,
//! imagemagick).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// The conversation's answer, once it is saved.
fn saved_answer(conversations: &Path) -> Option<String> {
    let store = Store::open(conversations.to_path_buf()).ok()?;
    let (loaded, _) = store.load_all();
    let c = loaded.first()?;
    c.messages
        .iter()
        .find(|m| m.role == Role::Assistant)
        .map(|m| m.content.clone())
}

#[test]
fn the_binary_answers_in_a_real_window_and_the_screenshot_shows_it() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let data = tmp.join("desktop-window");
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&data).unwrap();
    Settings {
        greedy: true,
        max_tokens: 40,
        draft: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/ssm")
            .display()
            .to_string(),
        ..Settings::default()
    }
    .save(&data.join("settings.json"))
    .unwrap();

    for name in ["Xvfb", "xdotool", "import"] {
        require(name);
    }
    // A display number no other test run holds.
    let number = 90 + std::process::id() % 400;
    let display = format!(":{number}");
    let _xvfb = Running(
        Command::new("Xvfb")
            .args([&display, "-screen", "0", "1280x800x24", "-nolisten", "tcp"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Ready when a client gets an answer from it: its socket appears before it serves (a CI
    // run on a loaded machine started the app in between, and the app could not connect).
    wait_for("Xvfb", Duration::from_secs(20), || {
        xdotool(&display, &["getdisplaygeometry"]).is_some()
    });

    let exe = desktop_exe();
    assert!(exe.exists(), "{} is missing", exe.display());
    let _app = Running(
        Command::new(&exe)
            .args(["--data-dir", data.to_str().unwrap(), "--no-keyring"])
            .env("DISPLAY", &display)
            .env("LIBGL_ALWAYS_SOFTWARE", "1")
            .env_remove("WAYLAND_DISPLAY")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let mut window = String::new();
    wait_for("the window", Duration::from_secs(60), || {
        match xdotool(&display, &["search", "--name", "^specinfer$"]) {
            Some(w) if !w.is_empty() => {
                window = w.lines().next().unwrap().to_string();
                true
            }
            _ => false,
        }
    });
    // The composer has the focus from the first frame on, and Enter sends only once the models
    // are set up: until the question is sent, focus the window, clear the composer, type the
    // question and press Enter (keys sent before the first frame are lost).
    let conversations = data.join("conversations");
    wait_for("the question to be sent", Duration::from_secs(240), || {
        xdotool(&display, &["windowfocus", "--sync", &window]);
        xdotool(&display, &["key", "ctrl+a", "BackSpace"]);
        xdotool(&display, &["type", "--delay", "10", QUESTION]);
        xdotool(&display, &["key", "Return"]);
        std::thread::sleep(Duration::from_millis(500));
        std::fs::read_dir(&conversations).is_ok_and(|mut d| d.next().is_some())
    });
    let mut answer = None;
    wait_for("the answer", Duration::from_secs(120), || {
        answer = saved_answer(&conversations);
        answer.is_some()
    });
    assert!(!answer.unwrap().is_empty(), "an answer came back");
    // Let the window paint the finished answer and its figures.
    std::thread::sleep(Duration::from_secs(2));

    let shot = tmp.join("desktop.png");
    let _ = std::fs::remove_file(&shot);
    let status = Command::new("import")
        .args(["-display", &display, "-window", &window])
        .arg(&shot)
        .status()
        .unwrap();
    assert!(status.success(), "import took the screenshot");
    // A blank screen compresses to a few hundred bytes; text and panels do not.
    let size = std::fs::metadata(&shot).unwrap().len();
    assert!(size > 20_000, "{} is only {size} bytes", shot.display());
    eprintln!("screenshot: {}", shot.display());
}
