//! What the desktop tests share: the CLI of the same build, whose answers the app's must equal.

use std::path::PathBuf;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `specinfer generate`'s greedy answer to `question` (the CLI of this build, in the repository
/// root), with more of the CLI's options.
pub fn cli_answer_with(question: &str, max_tokens: u32, options: &[&str]) -> String {
    let exe = std::env::current_exe().unwrap();
    let cli = exe.parent().unwrap().parent().unwrap().join("specinfer");
    assert!(
        cli.exists(),
        "{} is missing: build it with `cargo build --release -p specinfer-edge`",
        cli.display()
    );
    let out = std::process::Command::new(cli)
        .current_dir(repo())
        .args(["generate", "--greedy", "--json", "--prompt", question])
        .args(["--max-tokens", &max_tokens.to_string()])
        .args(options)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "specinfer generate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    report["text"].as_str().unwrap().to_string()
}
