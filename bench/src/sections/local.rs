//! Speculation on the user's own machine, beside llama.cpp in the same run.
//!
//! What a user runs: the `specinfer generate` binary with its embedded verifier (client and
//! verifier in one process on the same cores), per catalogue LLM with its default drafter, on
//! code prompts (HumanEval) and chat prompts (held-out ShareGPT). For each set: plain decoding
//! (`--tree none --lookup 0`), the context lookup alone, the default, and fixed arrangements
//! without the hand-off (whole trees, the adaptive tree drafting to the end, the pipelined
//! client), greedy and sampled at T 0.8 / top-p 0.95. Beside them, on the same GGUF files,
//! threads and cores: llama.cpp's plain decoding (`llama-bench`, tg of the same length) and its
//! speculative example with the same draft GGUF where the pair has one. Greedy answers are
//! checked token for token against plain decoding.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use specinfer_edge::{CatalogueModel, CATALOGUE};
use specinfer_model::{fetch, gguf_tokenizer_and_context, ChatMessage};
use specinfer_train::data;

use super::engine::{llama_cpp_rates, llama_cpp_tool, LLAMA_CPP_PYTHON};
use crate::common::{humaneval_prompts, sibling_exe, Section};

/// One arrangement of our client: its name in the report and its flags.
struct Arrangement {
    name: &'static str,
    args: &'static [&'static str],
    /// Sampled (T 0.8, top-p 0.95, the CLI's default) instead of greedy.
    sampled: bool,
    /// Drafted by the pair's smaller GGUF (`--ssm NAME`) instead of the shipped drafter; run
    /// only for LLMs that have one.
    family_draft: bool,
}

const ARRANGEMENTS: &[Arrangement] = &[
    Arrangement {
        name: "plain (--tree none --lookup 0)",
        args: &["--tree", "none", "--lookup", "0"],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "lookup alone (--tree none)",
        args: &["--tree", "none"],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "default",
        args: &[],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "adaptive tree, no hand-off",
        args: &["--no-hand-off"],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "adaptive tree pipelined, no hand-off",
        args: &["--no-hand-off", "--pipeline"],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "dynamic:8 whole, no hand-off",
        args: &["--tree", "dynamic:8", "--no-hand-off"],
        sampled: false,
        family_draft: false,
    },
    Arrangement {
        name: "default, drafted by the smaller GGUF of the family",
        args: &[],
        sampled: false,
        family_draft: true,
    },
    Arrangement {
        name: "plain (--tree none --lookup 0)",
        args: &["--tree", "none", "--lookup", "0"],
        sampled: true,
        family_draft: false,
    },
    Arrangement {
        name: "lookup alone (--tree none)",
        args: &["--tree", "none"],
        sampled: true,
        family_draft: false,
    },
    Arrangement {
        name: "default",
        args: &[],
        sampled: true,
        family_draft: false,
    },
    Arrangement {
        name: "adaptive tree, no hand-off",
        args: &["--no-hand-off"],
        sampled: true,
        family_draft: false,
    },
];

/// One arrangement's run over a prompt set, summed from the CLI's JSON reports.
struct Measured {
    tokens: usize,
    rounds: usize,
    wall_s: f64,
    /// After each answer's first token: what `llama-bench`'s tg measures (no prompt).
    decode_tokens: usize,
    decode_s: f64,
    draft_s: f64,
    /// Tree nodes sent (roots and the lookup's chains included).
    tree_nodes: usize,
    /// Token ids per prompt (greedy runs are checked against plain decoding).
    answers: Vec<Value>,
}

impl Measured {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall_s
    }

    fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_s
    }

    /// Drafting time per tree node as a fraction of `plain`'s time per decoded token: what a
    /// drafted token costs next to one of the LLM's (an upper bound on the LLM's side: its
    /// decode step includes the client's round overhead).
    fn draft_cost_vs(&self, plain: &Measured) -> f64 {
        let per_node = self.draft_s / self.tree_nodes.max(1) as f64;
        per_node * plain.decode_tokens_per_s()
    }
}

fn run_ours(
    exe: &Path,
    cores: &str,
    model: &CatalogueModel,
    prompts: &Path,
    max_new: u32,
    a: &Arrangement,
) -> Result<Measured> {
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", cores])
        .arg(exe)
        .args(["generate", "--model", model.name, "--prompt-file"])
        .arg(prompts)
        .args(["--max-tokens", &max_new.to_string()])
        .args(a.args);
    if a.family_draft {
        cmd.args(["--ssm", model.family_draft.context("no smaller GGUF")?]);
    }
    if !a.sampled {
        cmd.arg("--greedy");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("running specinfer")?;
    if !out.status.success() {
        bail!("specinfer generate failed: {cmd:?}");
    }
    let mut m = Measured {
        tokens: 0,
        rounds: 0,
        wall_s: 0.0,
        decode_tokens: 0,
        decode_s: 0.0,
        draft_s: 0.0,
        tree_nodes: 0,
        answers: Vec::new(),
    };
    for line in String::from_utf8(out.stdout)?.lines() {
        let r: Value = serde_json::from_str(line).context("a JSON report")?;
        let ids = r["token_ids"].as_array().context("token_ids")?;
        m.tokens += ids.len();
        m.rounds += r["rounds"].as_u64().context("rounds")? as usize;
        let wall_s = r["wall_ms"].as_f64().context("wall_ms")? / 1e3;
        m.wall_s += wall_s;
        m.decode_tokens += ids.len().saturating_sub(1);
        m.decode_s += wall_s - r["ttft_ms"].as_f64().context("ttft_ms")? / 1e3;
        m.draft_s += r["draft_ms"].as_f64().context("draft_ms")? / 1e3;
        m.tree_nodes += r["tree_nodes"].as_u64().context("tree_nodes")? as usize;
        m.answers.push(r["token_ids"].clone());
    }
    Ok(m)
}

/// llama.cpp's plain decoding of `max_new` tokens (`llama-bench` tg, mean of 3, tokens/s).
fn llama_plain(exe: &Path, gguf: &Path, cores: &str, threads: usize, max_new: u32) -> Result<f64> {
    let rates = llama_cpp_rates(exe, gguf, cores, threads, 3, "0", &max_new.to_string())?;
    rates
        .iter()
        .find(|r| r.1 == max_new as u64)
        .map(|r| r.2)
        .context("llama-bench gave no decoding rate")
}

/// llama.cpp's speculative example on `prompts` (chat-formatted text), greedy, drafting up to
/// 8 tokens with `draft`: decoded tokens/s over all prompts and its acceptance rate.
fn llama_speculative(
    exe: &Path,
    llm: &Path,
    draft: &Path,
    prompts: &[String],
    cores: &str,
    threads: usize,
    max_new: u32,
) -> Result<(f64, f64)> {
    let (mut tokens, mut seconds, mut drafted, mut accepted) = (0.0, 0.0, 0.0, 0.0);
    for p in prompts {
        let out = Command::new("taskset")
            .args(["-c", cores])
            .arg(exe)
            .arg("-m")
            .arg(llm)
            .arg("-md")
            .arg(draft)
            .arg("-p")
            .arg(p)
            .args(["-n", &max_new.to_string(), "-t", &threads.to_string()])
            .args(["--spec-draft-n-max", "8", "-c", "4096", "--temp", "0"])
            .output()
            .context("running llama-speculative")?;
        let log = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        let field = |key: &str| -> Option<f64> {
            let line = log.lines().find(|l| l.contains(key))?;
            let rest = &line[line.find(key)? + key.len()..];
            rest.split_whitespace()
                .next()?
                .trim_end_matches('%')
                .parse()
                .ok()
        };
        let decoded = log
            .lines()
            .find(|l| l.contains("decoded") && l.contains("speed:"))
            .with_context(|| format!("llama-speculative printed no speed:\n{log}"))?;
        let words: Vec<&str> = decoded.split_whitespace().collect();
        let at = |w: &str| words.iter().position(|x| *x == w);
        let n: f64 = at("decoded")
            .and_then(|i| words.get(i + 1)?.parse().ok())
            .context("decoded tokens")?;
        let s: f64 = at("in")
            .and_then(|i| words.get(i + 1)?.parse().ok())
            .context("decoding seconds")?;
        tokens += n;
        seconds += s;
        drafted += field("n_drafted =").unwrap_or(0.0);
        accepted += field("n_accept  =").unwrap_or(0.0);
    }
    Ok((tokens / seconds, accepted / drafted.max(1.0)))
}

/// The prompt sets: HumanEval problems as chat requests, and held-out ShareGPT first turns.
fn prompt_sets(n: usize) -> Result<Vec<(&'static str, Vec<String>)>> {
    let code = humaneval_prompts(n)?
        .iter()
        .map(|p| format!("Complete this Python function.\n```python\n{p}```"))
        .collect();
    let chat = data::prompts(&fetch::cache_dir(), 1000)?
        .into_iter()
        .filter(|p| data::held_out(p))
        .take(n)
        .collect();
    Ok(vec![
        ("code (HumanEval)", code),
        ("chat (ShareGPT held out)", chat),
    ])
}

/// Measures the catalogue LLMs named in `models` (all of them when it is empty).
pub fn run(quick: bool, models: &[String]) -> Result<Section> {
    for name in models {
        specinfer_edge::catalogue_model(name)?;
    }
    let threads = rayon::current_num_threads();
    let cores = format!("0-{}", threads - 1);
    let cache = fetch::cache_dir();
    let (n_prompts, max_new, n_llama_spec) = if quick { (4, 64, 2) } else { (16, 128, 4) };
    let exe = sibling_exe("specinfer", "specinfer-edge")?;
    let bench_exe = llama_cpp_tool(&cache, "llama-bench")?;
    let spec_exe = llama_cpp_tool(&cache, "llama-speculative")?;
    let sets = prompt_sets(n_prompts)?;
    let scratch = tempfile::tempdir()?;
    let mut md = format!(
        "## Speculation on the user's own machine\n\n\
         `specinfer generate --model M --prompt-file F --max-tokens {max_new}` with its embedded verifier (client and \
         verifier in one process), every process pinned to cores {cores} (`taskset`), {threads} threads; {n_prompts} \
         prompts per set. Greedy rows pass `--greedy`; sampled rows use the CLI's default sampling (T 0.8, top-p 0.95, \
         a fresh seed per answer). Decode tokens/s count each answer after its first token (prompt processing \
         left out, as llama-bench's tg leaves it out); the ratios use them. llama.cpp from the `{LLAMA_CPP_PYTHON}` sdist on the same GGUF, threads and cores in \
         the same run: plain decoding is `llama-bench -p 0 -n {max_new} -r 3` (decoding alone, no prompt), its \
         speculative example is `llama-speculative --spec-draft-n-max 8 --temp 0` with the pair's draft GGUF on the first \
         {n_llama_spec} prompts of the set (chat-formatted; its own decoding speed). Greedy answers are checked token for token against our plain decoding.\n\n"
    );
    let mut json_models = Vec::new();
    for model in CATALOGUE
        .iter()
        .filter(|m| models.is_empty() || models.iter().any(|n| n == m.name))
    {
        let llm = fetch::ensure_with(model.llm, &cache, &mut |e| eprintln!("[local] {e}"))?;
        let draft_gguf = match model.family_draft.and_then(fetch::named_model) {
            Some(src) => Some(fetch::ensure_with(src, &cache, &mut |e| {
                eprintln!("[local] {e}")
            })?),
            None => None,
        };
        let (tok, _) = gguf_tokenizer_and_context(&llm)?;
        eprintln!("[local] {}: llama.cpp plain decoding", model.name);
        let llama_tg = llama_plain(&bench_exe, &llm, &cores, threads, max_new)?;
        md += &format!(
            "### {}\n\n{}. llama.cpp plain decoding: **{llama_tg:.1} tokens/s**.\n\n",
            model.name, model.about
        );
        let mut json_sets = Vec::new();
        for (i, (set_name, prompts)) in sets.iter().enumerate() {
            let file = scratch.path().join(format!("{}-set{i}.jsonl", model.name));
            let lines: Vec<String> = prompts
                .iter()
                .map(|p| json!({ "prompt": p }).to_string())
                .collect();
            std::fs::write(&file, lines.join("\n") + "\n")?;
            let llama_spec = match &draft_gguf {
                Some(draft) => {
                    eprintln!("[local] {} {set_name}: llama.cpp speculative", model.name);
                    let formatted: Vec<String> = prompts
                        .iter()
                        .take(n_llama_spec)
                        .map(|p| tok.chat_prompt(&[ChatMessage::new("user", p)]))
                        .collect();
                    Some(llama_speculative(
                        &spec_exe, &llm, draft, &formatted, &cores, threads, max_new,
                    )?)
                }
                None => None,
            };
            md += &format!(
                "**{set_name}**{}\n\n\
                 | arrangement | decoding | decode tokens/s | vs llama.cpp plain | vs our plain | whole answers tokens/s | tokens per LLM pass | drafting ms per pass | drafting per node / LLM per token | greedy answers equal plain |\n\
                 |---|---|---|---|---|---|---|---|---|---|\n",
                match llama_spec {
                    Some((rate, accept)) => format!(
                        ": llama.cpp's speculative example {rate:.1} tokens/s ({:.2}x its plain decoding, {:.0} % of drafted tokens accepted)",
                        rate / llama_tg,
                        accept * 100.0
                    ),
                    None => String::new(),
                }
            );
            let mut rows = Vec::new();
            let mut plain: [Option<Measured>; 2] = [None, None];
            for a in ARRANGEMENTS
                .iter()
                .filter(|a| !a.family_draft || model.family_draft.is_some())
            {
                eprintln!(
                    "[local] {} {set_name}: {} ({})",
                    model.name,
                    a.name,
                    if a.sampled { "sampled" } else { "greedy" }
                );
                let m = run_ours(&exe, &cores, model, &file, max_new, a)?;
                let base = plain[a.sampled as usize].as_ref().unwrap_or(&m);
                let same = if a.sampled {
                    "-".to_string()
                } else if m.answers == base.answers {
                    "yes".to_string()
                } else {
                    bail!(
                        "{} {set_name}: greedy answers of {:?} differ from plain decoding",
                        model.name,
                        a.name
                    );
                };
                md += &format!(
                    "| {} | {} | {:.1} | {:.2}x | {:.2}x | {:.1} | {:.2} | {:.2} | {:.4} | {same} |\n",
                    a.name,
                    if a.sampled { "sampled" } else { "greedy" },
                    m.decode_tokens_per_s(),
                    m.decode_tokens_per_s() / llama_tg,
                    m.decode_tokens_per_s() / base.decode_tokens_per_s(),
                    m.tokens_per_s(),
                    m.tokens as f64 / m.rounds.max(1) as f64,
                    m.draft_s * 1e3 / m.rounds.max(1) as f64,
                    m.draft_cost_vs(base),
                );
                rows.push(json!({
                    "arrangement": a.name,
                    "sampled": a.sampled,
                    "args": a.args,
                    "family_draft": a.family_draft,
                    "tokens": m.tokens,
                    "rounds": m.rounds,
                    "wall_s": m.wall_s,
                    "draft_s": m.draft_s,
                    "tree_nodes": m.tree_nodes,
                    "draft_per_node_vs_llm_token": m.draft_cost_vs(base),
                    "tokens_per_s": m.tokens_per_s(),
                    "decode_tokens_per_s": m.decode_tokens_per_s(),
                    "vs_llama_cpp_plain": m.decode_tokens_per_s() / llama_tg,
                }));
                if a.args == ["--tree", "none", "--lookup", "0"] {
                    plain[a.sampled as usize] = Some(m);
                }
            }
            md += "\n";
            json_sets.push(json!({
                "set": set_name,
                "prompts": prompts.len(),
                "llama_cpp_speculative": llama_spec.map(|(rate, accept)| json!({"tokens_per_s": rate, "accepted": accept})),
                "rows": rows,
            }));
        }
        json_models.push(json!({
            "model": model.name,
            "about": model.about,
            "llama_cpp_plain_tokens_per_s": llama_tg,
            "sets": json_sets,
        }));
    }
    Ok(Section {
        key: "local",
        json: json!({
            "threads": threads,
            "cores": cores,
            "max_new_tokens": max_new,
            "prompts_per_set": n_prompts,
            "models": json_models,
        }),
        markdown: md,
    })
}
