//! The CPU engine at the hardware's limit, beside llama.cpp in the same run.
//!
//! For each shipped GGUF: llama.cpp's `llama-bench` (built once from the pinned PyPI sdist into
//! the model cache) decoding and prompt processing on the same file and thread count; our
//! single-sequence tree forward for 1 to 64 nodes at 128 and 1,024 cached positions, once on
//! the best x86 path here and once on the AVX2 path (`SPECINFER_NO_AVX512=1`), each in a child
//! process of its own (the kernels choose their path once per process) pinned to the same
//! cores as llama.cpp. Beside them the limits: the machine's streaming read bandwidth and int8
//! multiply-add peak, measured on the same threads, the decode floor they imply (weight bytes
//! per token / bandwidth) and the node count from which a forward must grow (where the
//! multiply-adds of the extra nodes outlast the weight read). The floor our decoding is held to
//! is read on the weights themselves: the decoding process, right before its timed run, reads
//! exactly the bytes a token's forward reads (best of 5 passes on the same threads). On this
//! project's host a 1 GiB probe buffer read at 35-37 GB/s in some processes and 55-61 in others
//! (where a fresh allocation lands), so a probe in another buffer, even a minute apart, says
//! little about the memory the weights sit in; the report gives that probe's floor as well.
//!
//! The headline ratio, plain decoding against llama.cpp's, is measured in alternating rounds:
//! each round runs llama.cpp's tg32 once and our greedy decoding of 32 tokens once on each path
//! (the order rotating from round to round), so that both sides see the same minutes of a shared
//! host whose memory bandwidth moves by a third between minutes; the report gives each round's
//! ratio and their median. Each native decoding process then decodes once more with timers
//! around every product and attention call, so that the report also says where a step's time
//! goes and how fast the products read their weights while they run, beside the floor's read.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use specinfer_kernels::profile;
use specinfer_model::{fetch, load_gguf, KvCache, Llama, SeqTree};
use specinfer_wire::TokenTree;

use crate::common::Section;
use crate::forward_cost::{bushy_tree, median_forward_seconds};
use crate::plot::plot_lines;

/// The llama.cpp every CPU figure is compared with (its vendored build 0c1e570).
pub const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";
const NODES: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// The trees whose time the curve's child also splits (see [`TreeSplit`]), at this many cached
/// positions.
const SPLIT_NODES: [usize; 2] = [8, 32];
const SPLIT_CONTEXT: usize = 128;

/// A model measured: its name in the report and where it comes from.
struct Model {
    name: &'static str,
    source: &'static fetch::ModelSource,
}

const MODELS: [Model; 3] = [
    Model {
        name: "SmolLM2-135M Q4_1",
        source: &fetch::SMOLLM2_135M,
    },
    Model {
        name: "Qwen2.5-Coder-0.5B Q4_K_M",
        source: &fetch::QWEN25_CODER_05B,
    },
    Model {
        name: "Qwen2.5-Coder-1.5B Q4_K_M",
        source: &fetch::QWEN25_CODER_15B,
    },
];

/// Our curve as a child process measures it (see [`child`]).
struct Curve {
    weight_bytes: f64,
    macs: f64,
    /// `(context, nodes, median seconds)`.
    forwards: Vec<(usize, usize, f64)>,
    /// Where the forwards of [`SPLIT_NODES`] spend their time.
    splits: Vec<TreeSplit>,
}

/// Where a tree's forward spends its time ([`child`]): seconds per forward in all, inside the
/// quantized products and inside attention (timed with [`profile`] on, in runs of their own), and
/// the same products' seconds with every weight already in cache
/// ([`Llama::products_seconds_hot`]): what the kernels' arithmetic alone takes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
struct TreeSplit {
    nodes: usize,
    forward: f64,
    products: f64,
    attention: f64,
    hot_products: f64,
}

impl Curve {
    fn seconds(&self, context: usize, nodes: usize) -> Option<f64> {
        self.forwards
            .iter()
            .find(|f| f.0 == context && f.1 == nodes)
            .map(|f| f.2)
    }

    fn from_json(v: &Value) -> Result<Curve> {
        let num = |v: &Value| v.as_f64().context("a number");
        Ok(Curve {
            weight_bytes: num(&v["weight_bytes"])?,
            macs: num(&v["macs"])?,
            forwards: v["forwards"]
                .as_array()
                .context("forwards")?
                .iter()
                .map(|f| Ok((num(&f[0])? as usize, num(&f[1])? as usize, num(&f[2])?)))
                .collect::<Result<_>>()?,
            splits: serde_json::from_value(v["splits"].clone()).context("splits")?,
        })
    }
}

/// The child's side: times our forward on `gguf` and prints the curve as one JSON line; at
/// [`SPLIT_CONTEXT`] cached positions it then splits the time of the trees of [`SPLIT_NODES`]
/// (see [`TreeSplit`]).
pub fn child(gguf: &Path, contexts: &[usize], reps: usize) -> Result<()> {
    let (llm, tok) = load_gguf(gguf)?;
    let prompt =
        tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")?;
    let weights = llm.per_token_weights();
    let mut forwards = Vec::new();
    let mut splits = Vec::new();
    for &context in contexts {
        let tokens: Vec<u32> = prompt.iter().copied().cycle().take(context).collect();
        let mut cache = KvCache::new(llm.config());
        llm.prefill(&mut cache, &tokens)?;
        // Each repetition times every size once, so that a change in the host's speed during
        // the curve (memory bandwidth here moves by a third between minutes) moves every size
        // alike instead of the sizes measured during it, and cost(n) / cost(1) stays fair.
        let trees: Vec<TokenTree> = NODES.iter().map(|&n| bushy_tree(&tokens, n)).collect();
        let mut times = vec![Vec::with_capacity(reps); trees.len()];
        for _ in 0..reps.max(1) {
            for (tree, times) in trees.iter().zip(&mut times) {
                let cache = std::slice::from_mut(&mut cache);
                times.push(median_forward_seconds(&llm, cache, tree, 1)?);
            }
        }
        for (nodes, times) in NODES.iter().zip(times) {
            forwards.push(json!([context, nodes, median(times)]));
        }
        if context == SPLIT_CONTEXT {
            for nodes in SPLIT_NODES {
                splits.push(split_forwards(
                    &llm,
                    &mut cache,
                    &bushy_tree(&tokens, nodes),
                )?);
            }
        }
    }
    println!(
        "{}",
        json!({"weight_bytes": weights.bytes, "macs": weights.macs, "forwards": forwards, "splits": splits})
    );
    Ok(())
}

/// [`TreeSplit`] of `tree` over `cache`: a warm-up forward, 3 timed with [`profile`] on, then
/// the products hot.
fn split_forwards(llm: &Llama, cache: &mut KvCache, tree: &TokenTree) -> Result<TreeSplit> {
    const REPS: usize = 3;
    let cache = std::slice::from_mut(cache);
    median_forward_seconds(llm, cache, tree, 1)?;
    let (seconds, split) = timed(true, || {
        for _ in 0..REPS {
            median_forward_seconds(llm, cache, tree, 1)?;
        }
        Ok(())
    })?;
    let per_forward = |total: f64| total / REPS as f64;
    Ok(TreeSplit {
        nodes: tree.len(),
        forward: per_forward(seconds),
        products: per_forward(split.products.as_secs_f64()),
        attention: per_forward(split.attention.as_secs_f64()),
        hot_products: llm.products_seconds_hot(tree.len(), 4)?,
    })
}

/// The seconds `run` takes and, where `profiled`, where they went: [`profile`] sums over that
/// run alone.
fn timed(profiled: bool, run: impl FnOnce() -> Result<()>) -> Result<(f64, profile::Split)> {
    profile::enable(profiled);
    profile::take();
    let t = Instant::now();
    run()?;
    let seconds = t.elapsed().as_secs_f64();
    profile::enable(false);
    Ok((seconds, profile::take()))
}

/// Tokens each side decodes per round: llama-bench's tg32.
const DECODE_TOKENS: usize = 32;

/// The alternating runs' child: greedy plain decoding of [`DECODE_TOKENS`] tokens after a short
/// prompt, as llama-bench's tg32 does (one warm-up run, then the timed one); between the two,
/// the read bandwidth of the very bytes a token's forward reads; after them a third run that
/// times the products and attention inside the forwards ([`profile`]: a few timer reads per call,
/// kept out of the timed run). Prints tokens/s, bytes/s, and the third run's shares of its time
/// in products and in attention and the products' bytes/s while they ran.
pub fn decode_child(gguf: &Path) -> Result<()> {
    let (llm, tok) = load_gguf(gguf)?;
    let prompt = tok.encode("def fibonacci(n):\n")?;
    let mut rate = 0.0;
    let mut weights_bandwidth = 0.0;
    let mut split = (profile::Split::default(), 0.0);
    for run in 0..3 {
        if run == 1 {
            weights_bandwidth = read_buffers_bandwidth(&llm.per_token_buffers());
        }
        let mut cache = KvCache::new(llm.config());
        let last = llm.prefill(&mut cache, &prompt)?;
        // The first of equal maxima, as the model's own argmax.
        let mut next = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as u32;
        let (seconds, run_split) = timed(run == 2, || {
            for _ in 0..DECODE_TOKENS {
                let tree = TokenTree::root(next);
                let logits = llm.forward(&mut [SeqTree::new(&mut cache, &tree)])?;
                cache.commit_scratch();
                next = logits[0].argmax(0);
            }
            Ok(())
        })?;
        if run == 2 {
            split = (run_split, seconds);
        } else {
            rate = DECODE_TOKENS as f64 / seconds;
        }
    }
    let (split, seconds) = split;
    println!(
        "{rate} {weights_bandwidth} {} {} {}",
        split.products.as_secs_f64() / seconds,
        split.product_bytes as f64 / split.products.as_secs_f64(),
        split.attention.as_secs_f64() / seconds
    );
    Ok(())
}

/// Bytes/s of reading `buffers` once, in order, on rayon's pool (the process's threads): the best
/// of 5 passes, each summing every 8-byte word so that nothing is skipped.
fn read_buffers_bandwidth(buffers: &[&[u8]]) -> f64 {
    use rayon::prelude::*;
    // Pieces small enough for the pool to split the whole read evenly, large enough to stream.
    let pieces: Vec<&[u8]> = buffers.iter().flat_map(|b| b.chunks(256 << 10)).collect();
    let bytes: usize = buffers.iter().map(|b| b.len()).sum();
    let sum_words = |p: &[u8]| {
        // SAFETY: any 8 initialised bytes are a u64; `align_to` keeps the alignment.
        let (head, words, tail) = unsafe { p.align_to::<u64>() };
        let bytes = head
            .iter()
            .chain(tail)
            .fold(0u64, |a, &b| a.wrapping_add(b as u64));
        words.iter().fold(bytes, |a, &w| a.wrapping_add(w))
    };
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = pieces
            .par_iter()
            .map(|p| sum_words(p))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

/// One round of plain decoding: llama.cpp's tg32, ours native, ours AVX2 (tokens/s), the read
/// bandwidth of a 1 GiB probe right before our native run and that of the weights themselves in
/// our native run's process (bytes/s), and where that process's profiled run spent its time.
#[derive(Clone, Copy, Default)]
struct DecodeRound {
    llama: f64,
    native: f64,
    avx2: f64,
    bandwidth: f64,
    weights_bandwidth: f64,
    split: TimeSplit,
}

/// Where a decoding child's profiled run spent its time (see [`decode_child`]).
#[derive(Clone, Copy, Default)]
struct TimeSplit {
    /// Shares of the run's time in quantized products and in attention.
    products: f64,
    attention: f64,
    /// Bytes/s of weights the products read while they ran.
    products_rate: f64,
}

/// A decoding child's line: tokens/s, the weights' read bandwidth, and its profiled run.
fn parse_decode_child(out: &str) -> Result<(f64, f64, TimeSplit)> {
    let fields = out
        .split_whitespace()
        .map(str::parse::<f64>)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("the decoding child printed {out:?}"))?;
    match fields[..] {
        [rate, bandwidth, products, products_rate, attention] => Ok((
            rate,
            bandwidth,
            TimeSplit {
                products,
                attention,
                products_rate,
            },
        )),
        _ => bail!("the decoding child printed {out:?}, not five figures"),
    }
}

/// `rounds` alternating rounds of plain decoding on `gguf` (see the module documentation).
fn decode_rounds(
    exe: &Path,
    gguf: &Path,
    cores: &str,
    threads: usize,
    rounds: usize,
) -> Result<Vec<DecodeRound>> {
    let ours = |env: &[(&str, &str)]| -> Result<(f64, f64, TimeSplit)> {
        let gguf = gguf.as_os_str().to_string_lossy();
        parse_decode_child(&child_output(cores, env, &["--engine-decode", &gguf])?)
    };
    let mut out = Vec::with_capacity(rounds);
    for r in 0..rounds {
        let mut round = DecodeRound::default();
        for k in 0..3 {
            match (r + k) % 3 {
                0 => {
                    let tg = llama_cpp_rates(exe, gguf, cores, threads, 1, "0", "32")?;
                    round.llama = tg.first().context("llama-bench gave no tg32")?.2;
                }
                1 => {
                    round.bandwidth = read_bandwidth(threads)?;
                    (round.native, round.weights_bandwidth, round.split) = ours(&[])?;
                }
                _ => round.avx2 = ours(&[("SPECINFER_NO_AVX512", "1")])?.0,
            }
        }
        eprintln!(
            "[engine] decode round {}: llama.cpp {:.1}, ours {:.1} (AVX2 {:.1}) tokens/s; weights read at {:.1} GB/s in our process, 1 GiB probe {:.1} GB/s",
            r + 1,
            round.llama,
            round.native,
            round.avx2,
            round.weights_bandwidth / 1e9,
            round.bandwidth / 1e9
        );
        out.push(round);
    }
    Ok(out)
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs [`child`] in a process of its own on `cores`, with `env` set.
fn our_curve(
    gguf: &Path,
    cores: &str,
    env: &[(&str, &str)],
    contexts: &str,
    reps: usize,
) -> Result<Curve> {
    let gguf = gguf.as_os_str().to_string_lossy();
    let reps = reps.to_string();
    let args = [
        "--engine-curve",
        &gguf,
        "--engine-contexts",
        contexts,
        "--engine-reps",
        &reps,
    ];
    Curve::from_json(&serde_json::from_str(&child_output(cores, env, &args)?)?)
}

/// This program run again with `args` (one of its hidden child modes) on `cores`, with `env`
/// set: its standard output, trimmed.
fn child_output(cores: &str, env: &[(&str, &str)], args: &[&str]) -> Result<String> {
    let out = Command::new("taskset")
        .args(["-c", cores])
        .arg(std::env::current_exe()?)
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("starting the child process {args:?}"))?;
    if !out.status.success() {
        bail!("the child process {args:?} failed");
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `llama-bench`, built once under `cache` from the pinned sdist (about 8 minutes on 2 cores),
/// or `$SPECINFER_LLAMA_BENCH`.
/// llama.cpp's `llama-bench`, built once (or `SPECINFER_LLAMA_BENCH`).
fn llama_bench(cache: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("SPECINFER_LLAMA_BENCH") {
        return Ok(PathBuf::from(p));
    }
    llama_cpp_tool(cache, "llama-bench")
}

/// A llama.cpp program (`llama-bench`, `llama-speculative`) from the pinned sdist, built into
/// the model cache the first time it is asked for (the sdist's build tools come from PyPI).
pub fn llama_cpp_tool(cache: &Path, target: &str) -> Result<PathBuf> {
    let dir = cache.join("llama.cpp-0.3.36");
    let exe = dir.join("build/bin").join(target);
    if exe.exists() {
        return Ok(exe);
    }
    let run = |what: &str, cmd: &mut Command| -> Result<()> {
        eprintln!("[llama.cpp] {what}");
        let status = cmd.status().with_context(|| format!("{what}: {cmd:?}"))?;
        if !status.success() {
            bail!("{what} failed: {cmd:?}");
        }
        Ok(())
    };
    std::fs::create_dir_all(&dir)?;
    let sdist = dir.join("sdist");
    if !sdist.join("vendor/llama.cpp/CMakeLists.txt").exists() {
        // The sdist's build backend and the build tools, from PyPI (no compiler download).
        run(
            "installing cmake, ninja and scikit-build-core from PyPI",
            Command::new("python3").args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "cmake",
                "ninja",
                "scikit-build-core",
            ]),
        )?;
        run(
            &format!("downloading the {LLAMA_CPP_PYTHON} sdist"),
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-build-isolation",
                    "--quiet",
                    "-d",
                ])
                .arg(&dir)
                .arg(LLAMA_CPP_PYTHON),
        )?;
        std::fs::create_dir_all(&sdist)?;
        run(
            "unpacking the sdist",
            Command::new("tar")
                .arg("xzf")
                .arg(dir.join("llama_cpp_python-0.3.36.tar.gz"))
                .args(["--strip-components=1", "-C"])
                .arg(&sdist),
        )?;
    }
    if !dir.join("build/build.ninja").exists() {
        run(
            "configuring (cmake Release, GGML_NATIVE=ON)",
            Command::new("cmake")
                .arg("-S")
                .arg(sdist.join("vendor/llama.cpp"))
                .arg("-B")
                .arg(dir.join("build"))
                .args([
                    "-G",
                    "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON",
                ])
                .args(["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]),
        )?;
    }
    run(
        &format!("building {target} (the first one about 8 minutes on 2 cores)"),
        Command::new("cmake")
            .arg("--build")
            .arg(dir.join("build"))
            .args(["--target", target]),
    )?;
    Ok(exe)
}

/// llama.cpp's tokens/s on `gguf`: `(n_prompt, n_gen) -> avg_ts` for prompt processing of
/// each of `prompts` tokens and decoding of each of `gens` (comma-separated, as llama-bench
/// takes them; 0 leaves a kind out).
pub fn llama_cpp_rates(
    exe: &Path,
    gguf: &Path,
    cores: &str,
    threads: usize,
    reps: usize,
    prompts: &str,
    gens: &str,
) -> Result<Vec<(u64, u64, f64)>> {
    let out = Command::new("taskset")
        .args(["-c", cores])
        .arg(exe)
        .arg("-m")
        .arg(gguf)
        .args([
            "-t",
            &threads.to_string(),
            "-p",
            prompts,
            "-n",
            gens,
            "-r",
            &reps.to_string(),
            "-o",
            "json",
        ])
        .stderr(Stdio::null())
        .output()
        .context("running llama-bench")?;
    if !out.status.success() {
        bail!("llama-bench failed on {}", gguf.display());
    }
    let v: Value = serde_json::from_slice(&out.stdout).context("llama-bench's JSON")?;
    v.as_array()
        .context("llama-bench's JSON is a list")?
        .iter()
        .map(|t| {
            Ok((
                t["n_prompt"].as_u64().context("n_prompt")?,
                t["n_gen"].as_u64().context("n_gen")?,
                t["avg_ts"].as_f64().context("avg_ts")?,
            ))
        })
        .collect()
}

/// Streaming read bandwidth on `threads` threads, bytes/s: a 1 GiB buffer (far beyond every
/// cache) read as [`read_buffers_bandwidth`] reads the weights, so that the two compare.
fn read_bandwidth(threads: usize) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let buf = vec![1u8; 1 << 30];
    Ok(pool.install(|| read_buffers_bandwidth(&[&buf])))
}

/// The int8 multiply-add peak on `threads` threads (MACs/s) of the instruction the engine's
/// path uses: `vpdpbusd` on 512 bits, or AVX2's `vpmaddubsw` + `vpmaddwd` + `vpaddd`.
fn int8_peak(threads: usize, avx512: bool) -> Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    const ITERS: u64 = 20_000_000;
    let mut best = f64::MAX;
    let mut macs_per_iter = 0.0;
    for _ in 0..3 {
        let t = Instant::now();
        let per: Vec<f64> = pool.broadcast(|_| peak_loop(ITERS, avx512));
        best = best.min(t.elapsed().as_secs_f64());
        macs_per_iter = per[0];
    }
    Ok(threads as f64 * ITERS as f64 * macs_per_iter / best)
}

/// Runs `iters` iterations of independent dot instructions (12 on 512 bits, 6 on AVX2);
/// returns MACs per iteration.
fn peak_loop(iters: u64, avx512: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512 && is_x86_feature_detected!("avx512vnni") {
            // SAFETY: the features were detected just above.
            unsafe { x86::vnni512(iters) };
            return 12.0 * 64.0;
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            unsafe { x86::avx2(iters) };
            return 6.0 * 32.0;
        }
    }
    let _ = (iters, avx512);
    0.0
}

/// The peak loops keep their values in registers: an empty `asm` block takes each accumulator
/// (AVX2: each weight register, whose products would otherwise be computed once, outside the
/// loop) in and out every iteration, so the compiler can neither fold the work nor move it to
/// memory. (Keeping the sums live through `black_box(&acc)` stored all of them every
/// iteration, and the stores, not the dots, set the pace: Zen 4's 512-bit `vpdpbusd` measured
/// at half its rate of one instruction a cycle.)
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni512(iters: u64) {
        let (w, x) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbusd_epi32(*a, w, x);
                asm!("/* {0} */", inout(zmm_reg) * a, options(nomem, nostack));
            }
        }
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2(iters: u64) {
        let (x, ones) = (_mm256_set1_epi8(5), _mm256_set1_epi16(1));
        let mut w = [_mm256_set1_epi8(3); 6];
        let mut acc = [_mm256_setzero_si256(); 6];
        for _ in 0..iters {
            for (a, w) in acc.iter_mut().zip(&mut w) {
                asm!("/* {0} */", inout(ymm_reg) * w, options(nomem, nostack));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_maddubs_epi16(*w, x), ones));
            }
        }
        std::hint::black_box(acc);
    }
}

/// The section: every model, llama.cpp beside our two paths, and the limits.
pub fn run(quick: bool, out: &Path) -> Result<Section> {
    let threads = rayon::current_num_threads();
    let cores = format!("0-{}", threads - 1);
    let cache = fetch::cache_dir();
    let (reps, contexts) = if quick { (3, "128") } else { (7, "128,1024") };
    let exe = llama_bench(&cache)?;
    // Probed again beside each model's runs (a shared host's bandwidth moves between minutes).
    let bandwidth = read_bandwidth(threads)?;
    let native_avx512 = std::env::var_os("SPECINFER_NO_AVX512").is_none()
        && cfg!(target_arch = "x86_64")
        && std::arch::is_x86_feature_detected!("avx512vnni");
    let peak_native = int8_peak(threads, native_avx512)?;
    let peak_avx2 = int8_peak(threads, false)?;
    eprintln!(
        "[engine] read bandwidth {:.1} GB/s; int8 peak {:.0} GMAC/s ({}), {:.0} GMAC/s (AVX2), {threads} threads",
        bandwidth / 1e9,
        peak_native / 1e9,
        if native_avx512 { "AVX-512 VNNI" } else { "AVX2" },
        peak_avx2 / 1e9
    );
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = [
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx_vnni",
        "avx512_bf16",
    ]
    .into_iter()
    .filter(|f| cpuinfo.split_whitespace().any(|w| w == *f))
    .collect();
    let mut md = format!(
        "## The CPU engine beside llama.cpp\n\nThreads: {threads}, every process pinned to cores {cores} (`taskset`). \
         CPU flags: {}. llama.cpp: `llama-bench` from the `{LLAMA_CPP_PYTHON}` sdist (cmake Release, `GGML_NATIVE=ON`), \
         `-t {threads} -p 8,32 -n 32 -r {reps}`, on the same GGUF file in the same run. Ours: one sequence's tree forward \
         (a bushy tree, node i under node i/2) over cached prompts, median of {reps} repetitions that each time every size once, in a child process each for the best \
         path here and for `SPECINFER_NO_AVX512=1` (the AVX2 path).\n\n\
         Limits, measured here in the same run: streaming read bandwidth **{:.1} GB/s** at the start (best of 5 passes \
         over 1 GiB, {threads} threads; probed again beside each model, the figure its floor and n* use); int8 multiply-add peak **{:.0} GMAC/s** on the native path ({}), **{:.0} GMAC/s** on AVX2 \
         (12 independent `vpdpbusd` chains per thread on 512 bits, 6 of `vpmaddubsw` + `vpmaddwd` + `vpaddd` on AVX2, accumulators kept in registers). The decode floor is the weight bytes one token reads / bandwidth; extra \
         nodes cost only multiply-adds until nodes x MACs / peak outlasts the read, so the forward may grow from \
         n* = floor x peak / MACs. Floor / ours is taken from the decode rounds below: in each, our native decoding's \
         process reads exactly the bytes a token's forward reads (its weights, best of 5 passes on the same threads) \
         right before its timed run, and our rate is held to the floor that read implies; the median of the rounds' \
         ratios is the figure. Beside it the same ratio against the 1 GiB probe run just before that process: on this \
         host the probe's buffer reads at 35-37 GB/s in some processes and 55-61 in others (where a fresh allocation \
         lands in memory), so it can misstate the memory the weights sit in either way.\n\n\
         | model | llama.cpp tg32 tok/s | ours 1 node tok/s (native) | ours / llama.cpp | ours AVX2 tok/s | AVX2 / llama.cpp | weights read MB | bandwidth GB/s (1 GiB probe beside it) | floor tok/s (by that probe) | floor / ours, median of decode rounds (weights read in our process) | the same by the 1 GiB probe | n* native |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        flags.join(", "),
        bandwidth / 1e9,
        peak_native / 1e9,
        if native_avx512 { "AVX-512 VNNI" } else { "AVX2" },
        peak_avx2 / 1e9,
    );
    let rounds = if quick { 3 } else { 9 };
    let mut decode_md = format!(
        "\n### Plain decoding against llama.cpp, in alternating rounds\n\n\
         {rounds} rounds per model; each runs llama.cpp's `llama-bench -n 32 -r 1` (tg32: a warm-up, then 32 \
         tokens from an empty context) and our greedy decoding of 32 tokens after the one-line prompt `def fibonacci(n):` (a warm-up, \
         then the timed run, in a child process: `--engine-decode`) on the native and the AVX2 path, the order \
         rotating each round, all pinned to cores {cores}. The ratio is taken within each round; the \
         median of the rounds' ratios is the figure to quote.\n\n\
         | model | llama.cpp tok/s (median) | ours tok/s (median) | ours / llama.cpp, median of rounds | rounds' ratios | AVX2 tok/s (median) | AVX2 / llama.cpp, median | rounds' ratios | weights read GB/s (our process) | floor / ours, rounds | 1 GiB probe GB/s before ours | floor / ours by it, rounds |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let mut split_md = String::from(
        "\n### Where our decoding step's time goes\n\n\
         Each round's native decoding child decodes the same 32 tokens a third time with timers around every \
         quantized product (activations' quantization, the parallel section and its wait) and every attention \
         call (`specinfer_kernels::profile`), after its timed run. The products' read rate is the bytes of weights \
         they read over the time inside them; beside it the read of the same bytes in the same process.\n\n\
         | model | products' share of a step, median (rounds) | products' read rate while they run, GB/s (rounds) | weights read GB/s, same process (rounds) | attention's share, median | the rest, median |\n\
         |---|---|---|---|---|---|\n"
    );
    let mut trees_md = format!(
        "\n### Where a tree's time goes\n\n\
         Each curve's child (native, AVX2) then runs trees of {} nodes at {SPLIT_CONTEXT} cached positions three more \
         times with the same timers as the decoding split, and multiplies the same projections and head once more with \
         every weight already in cache: each matrix 4 times in a row, the fastest counted (\"hot\": the kernels' \
         arithmetic alone, no wait for memory or for the other thread). Rates are the tree's multiply-adds (nodes x \
         MACs per token) over the time inside the products. The last two columns set the hot products alone (nothing \
         else in the forward) and the prediction against the same path's one-node forward: where the first is above \
         1.2x the second, no change outside the kernels' arithmetic can bring the tree within 1.2x of the prediction.\n\n\
         | model | path | nodes | forward ms | products' share | products GMAC/s in the forward | the same products hot, GMAC/s | int8 peak GMAC/s | attention's share | the rest | hot products alone, x one node | predicted, x one node |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        SPLIT_NODES.map(|n| n.to_string()).join(" and ")
    );
    let mut curves_md = String::new();
    let mut json_models = Vec::new();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for model in &MODELS {
        let gguf = fetch::ensure_with(model.source, &cache, &mut |e| eprintln!("[engine] {e}"))?;
        eprintln!("[engine] {}", model.name);
        let llama = llama_cpp_rates(&exe, &gguf, &cores, threads, reps, "8,32", "32")?;
        let bandwidth = read_bandwidth(threads)?;
        let native = our_curve(&gguf, &cores, &[], contexts, reps)?;
        let avx2 = our_curve(
            &gguf,
            &cores,
            &[("SPECINFER_NO_AVX512", "1")],
            contexts,
            reps,
        )?;
        let rate = |n_prompt, n_gen| {
            llama
                .iter()
                .find(|r| r.0 == n_prompt && r.1 == n_gen)
                .map(|r| r.2)
        };
        let tg = rate(0, 32).context("llama-bench gave no tg32")?;
        let decode = decode_rounds(&exe, &gguf, &cores, threads, rounds)?;
        let ratios = |f: fn(&DecodeRound) -> f64| -> Vec<f64> {
            decode.iter().map(|r| f(r) / r.llama).collect()
        };
        let (native_ratios, avx2_ratios) = (ratios(|r| r.native), ratios(|r| r.avx2));
        let list = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // Our rate in each round against the floor a bandwidth implies: the weights' own read in
        // our process (the figure held), or the 1 GiB probe before it.
        let floor_ratios = |bandwidth: fn(&DecodeRound) -> f64| -> Vec<f64> {
            decode
                .iter()
                .map(|r| r.native * native.weight_bytes / bandwidth(r))
                .collect()
        };
        let (weights_floor, probe_floor) = (
            floor_ratios(|r| r.weights_bandwidth),
            floor_ratios(|r| r.bandwidth),
        );
        let gbs = |bandwidth: fn(&DecodeRound) -> f64| {
            decode
                .iter()
                .map(|r| format!("{:.1}", bandwidth(r) / 1e9))
                .collect::<Vec<_>>()
                .join(", ")
        };
        decode_md += &format!(
            "| {} | {:.1} | {:.1} | **{:.2}x** | {} | {:.1} | **{:.2}x** | {} | {} | {} | {} | {} |\n",
            model.name,
            median(decode.iter().map(|r| r.llama).collect()),
            median(decode.iter().map(|r| r.native).collect()),
            median(native_ratios.clone()),
            list(&native_ratios),
            median(decode.iter().map(|r| r.avx2).collect()),
            median(avx2_ratios.clone()),
            list(&avx2_ratios),
            gbs(|r| r.weights_bandwidth),
            list(&weights_floor),
            gbs(|r| r.bandwidth),
            list(&probe_floor),
        );
        let products: Vec<f64> = decode.iter().map(|r| r.split.products).collect();
        let share = |f: fn(&TimeSplit) -> f64| median(decode.iter().map(|r| f(&r.split)).collect());
        split_md += &format!(
            "| {} | {:.2} ({}) | {} | {} | {:.3} | {:.3} |\n",
            model.name,
            median(products.clone()),
            list(&products),
            gbs(|r| r.split.products_rate),
            gbs(|r| r.weights_bandwidth),
            share(|s| s.attention),
            share(|s| 1.0 - s.products - s.attention),
        );
        let (one, one_avx2) = (
            native.seconds(128, 1).context("no 1-node forward")?,
            avx2.seconds(128, 1).context("no 1-node forward")?,
        );
        let floor = native.weight_bytes / bandwidth;
        let grow_from = floor * peak_native / native.macs;
        md += &format!(
            "| {} | {tg:.1} | {:.1} | {:.2}x | {:.1} | {:.2}x | {:.0} | {:.1} | {:.1} | **{:.2}** | {:.2} | {grow_from:.1} |\n",
            model.name,
            1.0 / one,
            1.0 / one / tg,
            1.0 / one_avx2,
            1.0 / one_avx2 / tg,
            native.weight_bytes / 1e6,
            bandwidth / 1e9,
            1.0 / floor,
            median(weights_floor.clone()),
            median(probe_floor.clone()),
        );
        curves_md += &format!(
            "\n**{}**: cost(n) / cost(1) (forward ms in brackets). Predicted: max(floor, n x MACs / peak) / cost(1) \
             with the measured floor and peak, attention aside. llama.cpp for reference: pp8 {:.1} tok/s, pp32 {:.1} \
             tok/s, i.e. an 8-token batch costs {:.2}x and a 32-token one {:.2}x its single-token decode.\n\n\
             | nodes | native, 128 cached | AVX2, 128 cached | predicted native | predicted AVX2 |{}\n|---|---|---|---|---|{}\n",
            model.name,
            rate(8, 0).unwrap_or(f64::NAN),
            rate(32, 0).unwrap_or(f64::NAN),
            8.0 * tg / rate(8, 0).unwrap_or(f64::NAN),
            32.0 * tg / rate(32, 0).unwrap_or(f64::NAN),
            if quick { "" } else { " native, 1,024 cached |" },
            if quick { "" } else { "---|" },
        );
        for (path, curve, peak, base) in [
            ("native", &native, peak_native, one),
            ("AVX2", &avx2, peak_avx2, one_avx2),
        ] {
            for t in &curve.splits {
                let tree_macs = t.nodes as f64 * native.macs;
                trees_md += &format!(
                    "| {} | {path} | {} | {:.1} | {:.3} | {:.0} | {:.0} | {:.0} | {:.3} | {:.3} | {:.2}x | {:.2}x |\n",
                    model.name,
                    t.nodes,
                    t.forward * 1e3,
                    t.products / t.forward,
                    tree_macs / t.products / 1e9,
                    tree_macs / t.hot_products / 1e9,
                    peak / 1e9,
                    t.attention / t.forward,
                    1.0 - (t.products + t.attention) / t.forward,
                    t.hot_products / base,
                    floor.max(tree_macs / peak) / base,
                );
            }
        }
        let mut points = Vec::new();
        for n in NODES {
            let cell = |c: &Curve, ctx: usize, base: f64| {
                c.seconds(ctx, n)
                    .map_or("-".into(), |s| format!("{:.2}x ({:.1})", s / base, s * 1e3))
            };
            let predicted = |peak: f64, base: f64| floor.max(n as f64 * native.macs / peak) / base;
            curves_md += &format!(
                "| {n} | {} | {} | {:.2}x | {:.2}x |{}\n",
                cell(&native, 128, one),
                cell(&avx2, 128, one_avx2),
                predicted(peak_native, one),
                predicted(peak_avx2, one_avx2),
                if quick {
                    String::new()
                } else {
                    let base = native.seconds(1024, 1).unwrap_or(f64::NAN);
                    format!(" {} |", cell(&native, 1024, base))
                }
            );
            if let Some(s) = native.seconds(128, n) {
                points.push((n as f64, s / one));
            }
        }
        series.push((model.name.to_string(), points));
        let tree_splits: Vec<Value> = [("native", &native), ("avx2", &avx2)]
            .iter()
            .flat_map(|(path, c)| {
                c.splits.iter().map(move |t| {
                    json!({"path": path, "nodes": t.nodes, "forward_s": t.forward, "products_s": t.products, "attention_s": t.attention, "hot_products_s": t.hot_products})
                })
            })
            .collect();
        json_models.push(json!({
            "model": model.name,
            "file": gguf.file_name().map(|f| f.to_string_lossy().into_owned()),
            "llama_cpp": llama.iter().map(|r| json!({"n_prompt": r.0, "n_gen": r.1, "tokens_per_s": r.2})).collect::<Vec<_>>(),
            "decode_rounds": decode.iter().map(|r| json!({"llama_cpp": r.llama, "native": r.native, "avx2": r.avx2, "weights_read_bytes_per_s": r.weights_bandwidth, "probe_read_bandwidth_bytes_per_s": r.bandwidth, "products_share": r.split.products, "products_read_bytes_per_s": r.split.products_rate, "attention_share": r.split.attention})).collect::<Vec<_>>(),
            "floor_over_ours_rounds": weights_floor,
            "floor_over_ours_rounds_by_probe": probe_floor,
            "decode_ratio_median": {"native": median(native_ratios.clone()), "avx2": median(avx2_ratios.clone())},
            "weight_bytes_per_token": native.weight_bytes,
            "macs_per_token": native.macs,
            "read_bandwidth_bytes_per_s": bandwidth,
            "floor_tokens_per_s": 1.0 / floor,
            "grows_from_nodes": grow_from,
            "native": native.forwards.iter().map(|f| json!({"context": f.0, "nodes": f.1, "ms": f.2 * 1e3})).collect::<Vec<_>>(),
            "avx2": avx2.forwards.iter().map(|f| json!({"context": f.0, "nodes": f.1, "ms": f.2 * 1e3})).collect::<Vec<_>>(),
            "tree_splits": tree_splits,
        }));
    }
    let plot = out.join("engine.svg");
    let named: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, p)| (n.as_str(), p.clone()))
        .collect();
    plot_lines(
        &plot,
        "Tree forward cost against nodes (native path, 128 cached)",
        "nodes",
        "cost(n) / cost(1)",
        &named,
    )?;
    md += &decode_md;
    md += &split_md;
    md += &curves_md;
    md += &trees_md;
    md += "\n![cost against nodes](engine.svg)\n\n";
    Ok(Section {
        key: "engine",
        json: json!({
            "threads": threads,
            "cpu_flags": flags,
            "read_bandwidth_bytes_per_s": bandwidth,
            "int8_peak_macs_per_s": {"native": peak_native, "avx2": peak_avx2, "native_is_avx512_vnni": native_avx512},
            "models": json_models,
        }),
        markdown: md,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_curve_childs_splits_are_read_or_the_curve_refused() {
        let line = json!({"weight_bytes": 1e9, "macs": 1.5e9, "forwards": [[128, 1, 0.03]],
            "splits": [[8, 0.05, 0.045, 0.003, 0.041]]});
        let curve = Curve::from_json(&line).unwrap();
        assert_eq!(curve.seconds(128, 1), Some(0.03));
        assert_eq!(
            curve.splits,
            vec![TreeSplit {
                nodes: 8,
                forward: 0.05,
                products: 0.045,
                attention: 0.003,
                hot_products: 0.041
            }]
        );
        // A child that split no trees, or printed a torn split, is an error, not an empty table.
        for bad in [
            json!({"weight_bytes": 1e9, "macs": 1.5e9, "forwards": []}),
            json!({"weight_bytes": 1e9, "macs": 1.5e9, "forwards": [], "splits": [[8, 0.05]]}),
        ] {
            assert!(Curve::from_json(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_decoding_childs_line_is_read_whole_or_refused() {
        let (rate, bandwidth, split) =
            parse_decode_child("31.5 3.4e10 0.97 2.8e10 0.013\n").unwrap();
        assert_eq!((rate, bandwidth), (31.5, 3.4e10));
        assert_eq!(
            (split.products, split.products_rate, split.attention),
            (0.97, 2.8e10, 0.013)
        );
        // An older child's two figures, a torn line, or words are errors, not zeros.
        for bad in ["31.5 3.4e10", "31.5 3.4e10 0.97 2.8e10", "fast 1 2 3 4", ""] {
            assert!(parse_decode_child(bad).is_err(), "{bad:?}");
        }
    }
}
