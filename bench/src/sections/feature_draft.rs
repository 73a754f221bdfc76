//! The feature-conditioned drafter beside the SSM, on the same prompts: top-k agreement with the
//! LLM, tokens per LLM pass in process (greedy and sampled, with and without the context lookup),
//! and over QUIC against a verifier process on a core of its own: tokens/s, drafting time per
//! tree node, and bytes per round each way (the feature drafter's verdicts carry the LLM's
//! features, the SSM's do not).

use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use specinfer_edge::Client;
use specinfer_model::FeatureDrafter;
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, FeatureDraft, RoundDriver,
    Speculator, TreeShape,
};
use specinfer_train::feature::{self, FeaturePrecision};
use specinfer_train::{eval, teacher};
use specinfer_wire::VerifyMode;

use crate::common::{params, Ctx, Run, Section};
use crate::verifier_process::{pin_this_process, VerifierOptions, VerifierProcess};

/// The sampled rows' temperature (the terminal chat's default).
const SAMPLED_T: f32 = 0.8;

/// The two drafters compared, in the report's column order.
const DRAFTERS: [&str; 2] = ["SSM", "feature drafter"];

pub fn run(
    ctx: &Ctx,
    examples: &[teacher::Example],
    feature_dir: &Path,
    llm_path: &Path,
) -> Result<Section> {
    ensure!(
        FeatureDrafter::is_feature_draft(feature_dir),
        "{} is not a feature drafter's folder (its config.json lacks \"specinfer_draft\": \"feature\")",
        feature_dir.display()
    );
    let drafter = FeatureDrafter::from_safetensors(feature_dir)
        .with_context(|| format!("loading {}", feature_dir.display()))?;
    let ssm = ctx.ssm.as_ref();
    let draft = |which: usize| -> Box<dyn DraftModel + Send + '_> {
        match which {
            0 => Box::new(CachedDraft::new(ssm)),
            _ => Box::new(FeatureDraft::new(&drafter)),
        }
    };

    eprintln!("      top-k agreement along the teacher's answers");
    let mut ssm_align = eval::Report::default();
    eval::alignment(&ctx.llm, &[ssm], examples, SAMPLED_T, &mut ssm_align)?;
    let (feature_greedy, feature_sampled, _) = feature::alignment(
        &ctx.llm,
        &drafter,
        examples,
        SAMPLED_T,
        FeaturePrecision::Int8,
    )?;
    let align = [
        (ssm_align.top_k_greedy, ssm_align.top_k_stochastic),
        (feature_greedy, feature_sampled),
    ];

    eprintln!("      tokens per pass in process");
    let prompts: Vec<&[u32]> = ctx.prompts.iter().map(Vec::as_slice).collect();
    let uncut = TreeShape::clients_default().uncut();
    // [drafter][lookup][greedy, sampled]
    let mut tau = [[[0f64; 2]; 2]; 2];
    for (which, per_drafter) in tau.iter_mut().enumerate() {
        let drafts = || vec![draft(which)];
        for (lookup, row) in [None, Some(ContextLookup::default())]
            .into_iter()
            .zip(per_drafter.iter_mut())
        {
            for (temperature, t) in [None, Some(SAMPLED_T)].into_iter().zip(row.iter_mut()) {
                *t = eval::tau_decoding_with(
                    &ctx.llm,
                    &drafts,
                    &prompts,
                    ctx.max_new,
                    &uncut,
                    lookup,
                    temperature,
                )?;
            }
        }
    }

    eprintln!("      over QUIC against a verifier process");
    let quic = over_quic(ctx, llm_path, &draft)?;

    let pct = |v: &[f64; 5]| {
        v.iter()
            .map(|x| format!("{:.1}%", x * 100.0))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let mut md = format!(
        "## The feature-conditioned drafter beside the SSM ({} prompts, {} tokens each)\n\n\
         The SSM drafts from tokens alone; the feature drafter (`{}`) from the LLM's final hidden state of the tokens the verifier accepted, which its verdicts carry (8-bit rows). Top-k: along the teacher's greedy answers, is the LLM's greedy token in the drafter's top-k (greedy), and the LLM's probability mass at T = {SAMPLED_T} inside it (sampled); the feature drafter reads the LLM's feature of the position before, as its first tree level does.\n\n\
         | drafter | greedy top-1..5 | sampled top-1..5 |\n|---|---|---|\n",
        ctx.prompts.len(),
        ctx.max_new,
        feature_dir.display()
    );
    for (name, (greedy, sampled)) in DRAFTERS.iter().zip(&align) {
        md += &format!("| {name} | {} | {} |\n", pct(greedy), pct(sampled));
    }
    md += &format!(
        "\nTokens per LLM pass in process (round driver and an in-process verifier session, no network), the clients' default tree at its whole budget (`{uncut}`):\n\n\
         | drafter | greedy | greedy + lookup | sampled (T = {SAMPLED_T}) | sampled + lookup |\n|---|---|---|---|---|\n"
    );
    for (name, t) in DRAFTERS.iter().zip(&tau) {
        md += &format!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            t[0][0], t[1][0], t[0][1], t[1][1]
        );
    }
    md += &quic.markdown();
    Ok(Section {
        key: "feature_draft",
        json: json!({
            "feature_drafter": feature_dir.display().to_string(),
            "prompts": ctx.prompts.len(),
            "max_new": ctx.max_new,
            "top_k": DRAFTERS.iter().zip(&align).map(|(name, (g, s))| (name.to_string(), json!({"greedy": g, "sampled_t08": s}))).collect::<serde_json::Map<_, _>>(),
            "tau_in_process": DRAFTERS.iter().zip(&tau).map(|(name, t)| (name.to_string(), json!({
                "tree": uncut.to_string(),
                "greedy": t[0][0], "greedy_with_lookup": t[1][0],
                "sampled_t08": t[0][1], "sampled_t08_with_lookup": t[1][1]}))).collect::<serde_json::Map<_, _>>(),
            "quic": quic.to_json(),
        }),
        markdown: md,
    })
}

/// What one tree shape and drafter did over QUIC, summed over the prompts.
#[derive(Default)]
struct QuicRun {
    run: Run,
    tree_nodes: usize,
    draft_s: f64,
    bytes_up: usize,
    bytes_down: usize,
    /// Answers token-identical to the verifier's own decoding (server-only).
    identical: usize,
}

impl QuicRun {
    fn add(&mut self, g: &specinfer_edge::Generation, reference: &[u32]) {
        self.run.tokens += g.token_ids.len();
        self.run.rounds += g.stats.rounds;
        self.run.seconds += g.wall.as_secs_f64();
        self.run.verifier_seconds += g.stats.verifier_forward_s;
        self.tree_nodes += g.stats.tree_nodes;
        self.draft_s += g.stats.draft_s;
        self.bytes_up += g.bytes_up;
        self.bytes_down += g.bytes_down;
        self.identical += usize::from(g.token_ids == reference);
    }

    fn per_round(&self, x: usize) -> f64 {
        x as f64 / self.run.rounds.max(1) as f64
    }

    fn draft_us_per_node(&self) -> f64 {
        self.draft_s / self.tree_nodes.max(1) as f64 * 1e6
    }

    fn to_json(&self) -> Value {
        let mut v = self.run.to_json();
        v["draft_us_per_node"] = self.draft_us_per_node().into();
        v["nodes_per_round"] = self.per_round(self.tree_nodes).into();
        v["bytes_up_per_round"] = self.per_round(self.bytes_up).into();
        v["bytes_down_per_round"] = self.per_round(self.bytes_down).into();
        v["identical_to_server_only"] = self.identical.into();
        v
    }
}

/// How a drafter's client runs in the QUIC table.
struct ClientConfig {
    label: &'static str,
    shape: TreeShape,
    lookup: Option<ContextLookup>,
    hand_off: bool,
}

fn client_configs() -> [ClientConfig; 3] {
    [
        ClientConfig {
            label: "as `specinfer` runs it (default tree, lookup, hand-off)",
            shape: TreeShape::clients_default(),
            lookup: Some(ContextLookup::default()),
            hand_off: true,
        },
        ClientConfig {
            label: "default tree alone",
            shape: TreeShape::clients_default(),
            lookup: None,
            hand_off: false,
        },
        ClientConfig {
            label: "default tree uncut",
            shape: TreeShape::clients_default().uncut(),
            lookup: None,
            hand_off: false,
        },
    ]
}

/// Server-only decoding, incremental rounds, then each drafter in each [`client_configs`].
struct QuicTable {
    pinned: bool,
    prompts: usize,
    /// The verifier decodes on its own and streams (`Generate`): a server-only deployment.
    server_only: QuicRun,
    /// The client sends root-only trees, one round trip per token.
    incremental: QuicRun,
    /// [drafter][client config]
    drafted: [[QuicRun; 3]; 2],
}

impl QuicTable {
    fn to_json(&self) -> Value {
        let configs = client_configs();
        json!({
            "client_and_verifier_pinned_to_separate_cores": self.pinned,
            "server_only": self.server_only.to_json(),
            "incremental": self.incremental.to_json(),
            "drafted": DRAFTERS.iter().zip(&self.drafted).map(|(name, runs)| (name.to_string(),
                configs.iter().zip(runs).map(|(c, r)| (c.label.to_string(), r.to_json())).collect::<serde_json::Map<_, _>>().into()))
                .collect::<serde_json::Map<_, _>>(),
        })
    }

    fn markdown(&self) -> String {
        let placement = if self.pinned {
            "the verifier a process pinned to core 1, this client pinned to core 0"
        } else {
            "one core: client and verifier process share it, so drafting time counts twice"
        };
        let mut md = format!(
            "\nOver QUIC on loopback, greedy, {} prompts ({placement}); every answer is checked against the verifier's own decoding (server-only: it decodes and streams, one round per token but no round trip per token). The default tree is `{}`: its adaptive cut grows a tree while its nodes pay on this machine; the hand-off gives the rest of an answer to the verifier's own decoding once split rounds cost more per token. Tau counts the verifier's own steps after a hand-off as rounds.\n\n\
             | drafter | client | tokens/s | tau | nodes/round | drafting us/node | bytes up/round | bytes down/round | identical answers |\n|---|---|---|---|---|---|---|---|---|\n",
            self.prompts,
            TreeShape::clients_default()
        );
        let row = |name: &str, client: &str, r: &QuicRun| {
            format!(
                "| {name} | {client} | {:.1} | {:.2} | {:.1} | {:.0} | {:.0} | {:.0} | {}/{} |\n",
                r.run.tokens_per_s(),
                r.run.tau(),
                r.per_round(r.tree_nodes),
                r.draft_us_per_node(),
                r.per_round(r.bytes_up),
                r.per_round(r.bytes_down),
                r.identical,
                self.prompts
            )
        };
        md += &row("none", "server-only", &self.server_only);
        md += &row("none", "incremental rounds", &self.incremental);
        for (name, runs) in DRAFTERS.iter().zip(&self.drafted) {
            for (c, r) in client_configs().iter().zip(runs) {
                md += &row(name, c.label, r);
            }
        }
        md + "\n"
    }
}

/// Runs every prompt server-only, incrementally and with each drafter and client in turn (prompt by prompt,
/// so a change in the machine's load falls on every configuration alike).
fn over_quic<'d>(
    ctx: &Ctx,
    llm_path: &Path,
    draft: &dyn Fn(usize) -> Box<dyn DraftModel + Send + 'd>,
) -> Result<QuicTable> {
    // Read before the process is pinned, which narrows what it reports.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = cores >= 2;
    let verifier = VerifierProcess::start_with(&VerifierOptions {
        core: pinned.then_some(1),
        llm: llm_path,
        ssm: None,
        listen: "127.0.0.1:0".parse().expect("literal"),
        identity: None,
        extra: Vec::new(),
    })?;
    let remote = verifier.remote(verifier.addr, ctx.tok.fingerprint())?;
    if pinned {
        pin_this_process("0")?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(async {
        let mut client = Client::connect(remote).await?;
        let mut table = QuicTable {
            pinned,
            prompts: ctx.prompts.len(),
            server_only: QuicRun::default(),
            incremental: QuicRun::default(),
            drafted: Default::default(),
        };
        let configs = client_configs();
        for (i, ids) in ctx.prompts.iter().enumerate() {
            let p = params(ctx, VerifyMode::Greedy, i as u64);
            // Once untimed: every configuration then finds the prompt's K/V cached, as a
            // deployment's later requests under the same prompt do, instead of the first paying
            // its prefill.
            let mut warm = RoundDriver::new(ids.clone(), p.clone(), None)?;
            warm.start_server_decoding()?;
            client.generate(&mut warm, |_| {}).await?;
            let mut server = RoundDriver::new(ids.clone(), p.clone(), None)?;
            server.start_server_decoding()?;
            let reference = client.generate(&mut server, |_| {}).await?;
            table.server_only.add(&reference, &reference.token_ids);
            let mut plain = RoundDriver::new(ids.clone(), p.clone(), None)?;
            let g = client.generate(&mut plain, |_| {}).await?;
            table.incremental.add(&g, &reference.token_ids);
            for (which, runs) in table.drafted.iter_mut().enumerate() {
                for (c, run) in configs.iter().zip(runs.iter_mut()) {
                    let drafter = Drafter {
                        speculator: Speculator::for_request(c.shape.clone(), DraftMode::Greedy, 0),
                        drafts: vec![draft(which)],
                    };
                    let mut driver = RoundDriver::new(ids.clone(), p.clone(), Some(drafter))?
                        .with_lookup(c.lookup)
                        .with_hand_off(c.hand_off);
                    let g = client.generate(&mut driver, |_| {}).await?;
                    run.add(&g, &reference.token_ids);
                }
            }
            eprintln!("      prompt {}/{} over QUIC", i + 1, ctx.prompts.len());
        }
        client.shutdown().await;
        anyhow::Ok(table)
    });
    if pinned {
        pin_this_process(&format!("0-{}", cores - 1))?;
    }
    drop(verifier);
    result
}
