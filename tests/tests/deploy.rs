//! The Kubernetes manifests in `deploy/k8s` pass the Kubernetes API's schemas (offline, with
//! `kubernetes-validate` from PyPI, which scripts/test installs), and use the flags and
//! routes the verifier binary really has.

use std::path::{Path, PathBuf};
use std::process::Command;

use specinfer_integration::verifier_exe;

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `kubernetes-validate --strict` on `file`: `None` when the validator is not installed.
fn validate(file: &Path) -> Option<std::process::Output> {
    Command::new("kubernetes-validate")
        .arg("--strict")
        .arg(file)
        .output()
        .ok()
}

#[test]
fn manifests_pass_the_kubernetes_schemas() {
    let manifest = deploy_dir().join("k8s/verifier.yaml");
    let Some(out) = validate(&manifest) else {
        assert!(
            std::env::var_os("SPECINFER_REQUIRE_KUBE_VALIDATE").is_none(),
            "kubernetes-validate is not installed (python3 -m pip install kubernetes-validate)"
        );
        eprintln!("SKIPPED: kubernetes-validate is not installed");
        return;
    };
    let report =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    for kind in [
        "deployment",
        "service",
        "poddisruptionbudget",
        "horizontalpodautoscaler",
    ] {
        assert!(
            report.contains(&format!("passed for resource {kind}/")),
            "{kind} not validated: {report}"
        );
    }
    // The validator can fail: a field of the wrong type is refused.
    let text = std::fs::read_to_string(&manifest).unwrap();
    let broken = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    std::fs::write(
        broken.path(),
        text.replace("replicas: 3", "replicas: three"),
    )
    .unwrap();
    let out = validate(broken.path()).unwrap();
    assert!(!out.status.success(), "a broken manifest passed");
}

#[test]
fn manifests_use_the_verifiers_real_flags_and_routes() {
    let manifest = std::fs::read_to_string(deploy_dir().join("k8s/verifier.yaml")).unwrap();
    let dockerfile = std::fs::read_to_string(deploy_dir().join("Dockerfile")).unwrap();
    let help = |sub: &str| {
        let out = Command::new(verifier_exe())
            .args([sub, "--help"])
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let (serve, drain) = (help("serve"), help("drain"));
    // Every flag of the container's command and of its preStop hook is one the binary takes.
    let container = &manifest[manifest.find("args:").unwrap()..manifest.find("ports:").unwrap()];
    let hook = &manifest[manifest.find("preStop:").unwrap()..manifest.find("resources:").unwrap()];
    let flags = |text: &str| -> Vec<String> {
        text.split_whitespace()
            .filter_map(|w| w.strip_prefix("--"))
            .map(|f| format!("--{}", f.split('=').next().unwrap()))
            .collect()
    };
    assert!(flags(container).len() >= 6);
    for flag in flags(container) {
        assert!(serve.contains(&flag), "serve has no {flag}");
    }
    for flag in flags(hook) {
        assert!(drain.contains(&flag), "drain has no {flag}");
    }
    assert!(serve.contains("/healthz") && serve.contains("/readyz"));
    assert!(manifest.contains("path: /healthz") && manifest.contains("path: /readyz"));
    // The image holds the binary where the hook calls it.
    assert!(hook.contains("/usr/local/bin/specinfer-verifier"));
    assert!(dockerfile.contains(
        "install -m 0755 target/release/specinfer-verifier /usr/local/bin/specinfer-verifier"
    ));
}
