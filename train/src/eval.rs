//! Evaluation on held-out prompts, run on the EXPORTED models through the inference engine (what
//! the edge will run): the paper's Table 1 alignment (is the LLM's next token within the top-k
//! of the SSM, or of any SSM of an ensemble?) for greedy and stochastic decoding, and the tokens
//! per round of real greedy speculation against the LLM (trees merged across an ensemble).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use specinfer_kernels::sampling::distribution;
use specinfer_model::{FeatureDrafter, KvCache, Llama, SeqTree};
use specinfer_speculator::{
    CachedDraft, ContextLookup, DraftMode, DraftModel, Drafter, FeatureDraft, RoundDriver,
    Speculator, TreeShape,
};
use specinfer_wire::{Limits, RoundStats, SamplingParams, TokenTree, VerifyMode};

use crate::teacher::Example;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    pub examples: usize,
    pub positions: usize,
    /// Fraction of answer positions where the teacher's (greedy) token is within the SSM's top-k,
    /// k = 1..=5.
    pub top_k_greedy: [f64; 5],
    /// Probability that the LLM's token, sampled at `temperature`, is within the SSMs' top-k
    /// (the exact expectation over the LLM's distribution, no sampling noise), k = 1..=5.
    pub top_k_stochastic: [f64; 5],
    pub temperature: f32,
    /// Mean tokens per round of greedy speculation with the paper's tree, SSM drafting and the
    /// LLM verifying.
    pub tau_paper_tree: f64,
    /// The same with the context lookup's chain added to every tree (`ContextLookup::default`).
    pub tau_paper_tree_with_lookup: f64,
    /// The clients' greedy tree (`TreeShape::default_greedy`) at its whole budget (what its
    /// adaptive cut grows to when the round trip dwarfs verification), without and with the
    /// lookup's chain.
    pub tau_default_tree: f64,
    pub tau_default_tree_with_lookup: f64,
    /// That tree's shape, e.g. "dynamic:32".
    pub default_tree: String,
    pub tau_prompts: usize,
}

/// Log-likelihood order of the five best tokens of `logits`.
pub(crate) fn top5(logits: &[f32]) -> [u32; 5] {
    let mut best = [(f32::NEG_INFINITY, u32::MAX); 5];
    for (t, &l) in logits.iter().enumerate() {
        if l > best[4].0 {
            best[4] = (l, t as u32);
            best.sort_by(|a, b| b.0.total_cmp(&a.0));
        }
    }
    best.map(|(_, t)| t)
}

fn chain_logits(m: &Llama, seq: &[u32]) -> Result<specinfer_model::Logits> {
    let mut kv = KvCache::new(m.config());
    let tree = TokenTree::chain(seq);
    Ok(m.forward(&mut [SeqTree::new(&mut kv, &tree)])?.remove(0))
}

/// At one position, the tokens an ensemble proposes for k = 1..=5 (the union of its members'
/// top-k).
type ProposalsByK = [Vec<u32>; 5];

/// The example's prompt + answer (cut to every model's context) and, for each position, the
/// tokens the ensemble proposes at k = 1..=5 (the union of the members' top-k).
fn ensemble_proposals(
    ssms: &[&Llama],
    e: &Example,
    max_positions: usize,
) -> Result<(Vec<u32>, Vec<ProposalsByK>)> {
    let mut seq = e.prompt.clone();
    seq.extend(&e.answer);
    let limit = ssms
        .iter()
        .map(|m| m.config().max_positions)
        .fold(max_positions, usize::min);
    seq.truncate(limit);
    let tops: Vec<Vec<[u32; 5]>> = ssms
        .iter()
        .map(|m| {
            let l = chain_logits(m, &seq[..seq.len() - 1])?;
            Ok((0..l.nodes()).map(|p| top5(l.node(p))).collect())
        })
        .collect::<Result<_>>()?;
    let proposals = (0..seq.len() - 1)
        .map(|p| {
            let mut sets: [Vec<u32>; 5] = Default::default();
            let mut proposed: Vec<u32> = Vec::new();
            for (k, set) in sets.iter_mut().enumerate() {
                for member in &tops {
                    let t = member[p][k];
                    if t != u32::MAX && !proposed.contains(&t) {
                        proposed.push(t);
                    }
                }
                *set = proposed.clone();
            }
            sets
        })
        .collect();
    Ok((seq, proposals))
}

/// Adaptive boosting's coverage of one training prompt by an ensemble: the fraction of its
/// first `positions` answer tokens within some member's top-`k` (whole-answer matches are rare,
/// so coverage is per answer prefix position).
pub fn coverage(ssms: &[&Llama], e: &Example, positions: usize, k: usize) -> Result<f64> {
    let short = Example {
        prompt: e.prompt.clone(),
        answer: e.answer.iter().take(positions).copied().collect(),
        top: Vec::new(),
    };
    let (seq, proposals) = ensemble_proposals(ssms, &short, usize::MAX)?;
    let range = short.prompt.len() - 1..seq.len() - 1;
    let n = range.len();
    let hits = range
        .filter(|&p| proposals[p][k - 1].contains(&seq[p + 1]))
        .count();
    Ok(hits as f64 / n.max(1) as f64)
}

/// Top-k agreement of an ensemble of SSMs (one SSM: an ensemble of one) with the LLM along the
/// teacher's greedy answers: a token counts as proposed at k when it is within any member's top-k,
/// which is what a tree merged from every member's k-wide level holds.
pub fn alignment(
    llm: &Llama,
    ssms: &[&Llama],
    examples: &[Example],
    temperature: f32,
    report: &mut Report,
) -> Result<()> {
    let mut greedy = [0f64; 5];
    let mut stochastic = [0f64; 5];
    let mut positions = 0;
    for e in examples {
        let (seq, proposals) = ensemble_proposals(ssms, e, llm.config().max_positions)?;
        let teacher = chain_logits(llm, &seq[..seq.len() - 1])?;
        for p in e.prompt.len() - 1..seq.len() - 1 {
            let q = distribution(teacher.node(p), temperature, 0, 1.0);
            for (k, proposed) in proposals[p].iter().enumerate() {
                greedy[k] += proposed.contains(&seq[p + 1]) as u8 as f64;
                stochastic[k] += proposed.iter().map(|&t| q[t as usize] as f64).sum::<f64>();
            }
            positions += 1;
        }
    }
    report.examples = examples.len();
    report.positions = positions;
    report.temperature = temperature;
    for k in 0..5 {
        report.top_k_greedy[k] = greedy[k] / positions.max(1) as f64;
        report.top_k_stochastic[k] = stochastic[k] / positions.max(1) as f64;
    }
    Ok(())
}

/// Greedy speculation with the paper's tree and with the clients' default tree on every
/// example's prompt, `max_new` tokens each, drafting with what `drafts` makes (several SSMs'
/// trees merged), with and without the context lookup's chain. All held-out prompts, not a few: tau moves by a few
/// hundredths between models, and ten prompts' answers varied more than that.
pub fn tau<'d>(
    llm: &Llama,
    drafts: &Drafts<'d>,
    examples: &[Example],
    max_new: u32,
    report: &mut Report,
) -> Result<()> {
    let paper = TreeShape::Expansion(Speculator::PAPER_EXPANSION.to_vec());
    let default = TreeShape::clients_default().uncut();
    let lookup = Some(ContextLookup::default());
    report.tau_paper_tree = tau_with(llm, drafts, examples, max_new, &paper, None)?;
    report.tau_paper_tree_with_lookup = tau_with(llm, drafts, examples, max_new, &paper, lookup)?;
    report.tau_default_tree = tau_with(llm, drafts, examples, max_new, &default, None)?;
    report.tau_default_tree_with_lookup =
        tau_with(llm, drafts, examples, max_new, &default, lookup)?;
    report.default_tree = default.to_string();
    report.tau_prompts = examples.len();
    Ok(())
}

/// Mean tokens per round of greedy speculation with trees of `shape` (plus `lookup`'s chain),
/// the adaptive shapes learning from each round as the clients' do.
pub fn tau_with<'d>(
    llm: &Llama,
    drafts: &Drafts<'d>,
    examples: &[Example],
    max_new: u32,
    shape: &TreeShape,
    lookup: Option<ContextLookup>,
) -> Result<f64> {
    let prompts: Vec<&[u32]> = examples.iter().map(|e| e.prompt.as_slice()).collect();
    tau_decoding_with(llm, drafts, &prompts, max_new, shape, lookup, None)
}

/// What makes a generation's draft models afresh.
pub type Drafts<'d> = dyn Fn() -> Vec<Box<dyn DraftModel + Send + 'd>> + 'd;

/// Drafts from every SSM of `ssms` (their trees merged).
pub fn ssm_drafts<'d>(ssms: &'d [&'d Llama]) -> impl Fn() -> Vec<Box<dyn DraftModel + Send + 'd>> {
    move || {
        ssms.iter()
            .map(|&m| Box::new(CachedDraft::new(m)) as Box<dyn DraftModel + Send>)
            .collect()
    }
}

/// A drafter folder, loaded as what its config.json says it is.
pub enum DrafterFolder {
    Ssm(Llama),
    Feature(FeatureDrafter),
}

impl DrafterFolder {
    pub fn load(dir: &Path) -> Result<Self> {
        let loading = || format!("loading {}", dir.display());
        Ok(if FeatureDrafter::is_feature_draft(dir) {
            DrafterFolder::Feature(FeatureDrafter::from_safetensors(dir).with_context(loading)?)
        } else {
            DrafterFolder::Ssm(Llama::from_safetensors(dir).with_context(loading)?)
        })
    }

    /// A fresh draft over it (one per generation).
    pub fn draft(&self) -> Box<dyn DraftModel + Send + '_> {
        match self {
            DrafterFolder::Ssm(m) => Box::new(CachedDraft::new(m)),
            DrafterFolder::Feature(f) => Box::new(FeatureDraft::new(f)),
        }
    }
}

/// Mean tokens per round with trees of `shape` (plus `lookup`'s chain) after each prompt: greedy
/// (`temperature` None), or sampling at that temperature (top-p 1, each prompt its own seed)
/// with the clients' sampled drafts; `drafts` makes the draft models for each prompt.
pub fn tau_decoding_with<'d>(
    llm: &Llama,
    drafts: &Drafts<'d>,
    prompts: &[&[u32]],
    max_new: u32,
    shape: &TreeShape,
    lookup: Option<ContextLookup>,
    temperature: Option<f32>,
) -> Result<f64> {
    let (mut tokens, mut rounds) = (0usize, 0usize);
    for (i, prompt) in prompts.iter().enumerate() {
        let (params, mode) = match temperature {
            None => (SamplingParams::greedy(max_new), DraftMode::Greedy),
            Some(t) => (
                SamplingParams {
                    mode: VerifyMode::Stochastic,
                    temperature: t,
                    seed: i as u64,
                    ..SamplingParams::greedy(max_new)
                },
                DraftMode::sampled(t, 1.0),
            ),
        };
        let drafter = Drafter {
            speculator: Speculator::for_request(shape.clone(), mode, params.seed),
            drafts: drafts(),
        };
        let mut driver =
            RoundDriver::new(prompt.to_vec(), params, Some(drafter))?.with_uncut_lookup(lookup);
        run_in_process(llm, &mut driver)?;
        tokens += driver.generated().len();
        rounds += driver.stats().rounds;
    }
    Ok(tokens as f64 / rounds.max(1) as f64)
}

/// Runs `driver`'s generation against an in-process verifier session of `llm` (compute only, no
/// network): each round's forward is timed and reported in its verdict as a remote verifier
/// reports it, so the adaptive shapes learn from real costs.
pub fn run_in_process(llm: &Llama, driver: &mut RoundDriver<'_>) -> Result<()> {
    let limits = Limits::default();
    let (prompt, params) = driver.open_request();
    let mut session = specinfer_verifier::Session::open(llm, &prompt, params, &limits)?;
    driver.set_limits(&limits);
    let start = Instant::now();
    let clock = move || start.elapsed().as_secs_f64();
    let mut round = 0;
    while !driver.is_finished() {
        let tree = driver.draft(&clock)?;
        let nodes = tree.len() as u32;
        let t = Instant::now();
        let outcome = session.verify(llm, &limits, &tree)?;
        let stats = RoundStats {
            tree_nodes: nodes,
            batch_size: 1,
            queue_us: 0,
            forward_us: t.elapsed().as_micros() as u32,
            ..RoundStats::default()
        };
        driver.on_verified(&outcome.into_verified(0, round, stats), clock())?;
        round += 1;
    }
    Ok(())
}
