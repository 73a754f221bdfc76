//! `specinfer generate` as README's first command runs it: the default trees (a dynamic tree
//! when greedy, the paper's expansion when sampling), the default SSM and an embedded verifier.
//! Greedy output must be token-identical to incremental decoding through the same binary.

use std::path::PathBuf;
use std::process::Command;

fn generate(args: &[&str]) -> Result<serde_json::Value, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(env!("CARGO_BIN_EXE_specinfer"))
        .args(["generate", "--json", "--max-tokens", "48"])
        .args(args)
        .current_dir(&root)
        .output()
        .expect("running specinfer");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let stdout = String::from_utf8(out.stdout).unwrap();
    Ok(serde_json::from_str(stdout.lines().last().expect("one JSON report")).unwrap())
}

#[test]
fn the_default_trees_generate_and_greedy_output_matches_incremental_decoding() {
    let prompt = "List the planets of the solar system, one per line.";
    let speculative = generate(&["--prompt", prompt]).unwrap();
    let incremental = generate(&["--prompt", prompt, "--tree", "none", "--lookup", "0"]).unwrap();
    assert_eq!(
        speculative["token_ids"], incremental["token_ids"],
        "the default tree changed the greedy output"
    );
    assert_eq!(incremental["tau"], 1.0);
    assert!(
        speculative["rounds"].as_u64().unwrap() < incremental["rounds"].as_u64().unwrap(),
        "speculation verified no drafted token: {speculative}"
    );
    // Sampling switches to an expansion tree, whose draws carry proposals.
    let sampled = generate(&["--prompt", prompt, "--mode", "sample", "--seed", "3"]).unwrap();
    assert!(!sampled["token_ids"].as_array().unwrap().is_empty());
    // A dynamic tree asked for by name cannot sample: a clear error, not a wrong answer.
    let err = generate(&[
        "--prompt",
        prompt,
        "--mode",
        "sample",
        "--tree",
        "dynamic:8",
    ])
    .unwrap_err();
    assert!(err.contains("greedy mode only"), "{err}");
}
