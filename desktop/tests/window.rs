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
    // The composer has the focus from the first frame on, and Enter sends only once the models
    // are set up: until the question is sent, focus the window, clear the composer, type the
    // question and press Enter (keys sent before the first frame are lost).
    let conversations = data.join("conversations");
    app.wait_for("the question to be sent", Duration::from_secs(240), || {
        xdotool(&display, &["windowfocus", "--sync", &window]);
        xdotool(&display, &["key", "ctrl+a", "BackSpace"]);
        xdotool(&display, &["type", "--delay", "10", QUESTION]);
        xdotool(&display, &["key", "Return"]);
        std::thread::sleep(Duration::from_millis(500));
        std::fs::read_dir(&conversations).is_ok_and(|mut d| d.next().is_some())
    });
    let mut answer = None;
    app.wait_for("the answer", Duration::from_secs(120), || {
        answer = saved_answer(&conversations);
        answer.is_some()
    });
    assert!(!answer.unwrap().is_empty(), "an answer came back");
    // Let the window paint the finished answer and its figures.
    std::thread::sleep(Duration::from_secs(2));

    let shot = target_tmp.join("desktop.png");
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
