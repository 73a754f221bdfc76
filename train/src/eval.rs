//! Evaluation on held-out prompts, run on the EXPORTED model through the inference engine (what
//! the edge will run): the paper's Table 1 alignment (is the LLM's next token within the SSM's
//! top-k?) and the tokens per round of real greedy speculation against the LLM.

use anyhow::Result;
use specinfer_model::{KvCache, Llama, SeqTree};
use specinfer_wire::{Limits, SamplingParams, TokenTree};

use crate::teacher::Example;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    pub examples: usize,
    pub positions: usize,
    /// Fraction of answer positions where the teacher's (greedy) token is within the SSM's top-k,
    /// k = 1..=5.
    pub top_k_greedy: [f64; 5],
    /// Mean tokens per round of greedy speculation with the paper's tree, SSM drafting and the
    /// LLM verifying.
    pub tau_paper_tree: f64,
    pub tau_prompts: usize,
}

/// Top-k agreement of `ssm` with the teacher's answers.
pub fn alignment(ssm: &Llama, examples: &[Example], report: &mut Report) -> Result<()> {
    let mut hits = [0usize; 5];
    let mut positions = 0;
    for e in examples {
        let mut seq = e.prompt.clone();
        seq.extend(&e.answer);
        let seq = &seq[..seq.len().min(ssm.config().max_positions)];
        let mut kv = KvCache::new(ssm.config());
        let tree = TokenTree::chain(&seq[..seq.len() - 1]);
        let logits = ssm.forward(&mut [SeqTree::new(&mut kv, &tree)])?.remove(0);
        for p in e.prompt.len() - 1..seq.len() - 1 {
            let l = logits.node(p);
            let target = l[seq[p + 1] as usize];
            // Rank = number of tokens with a strictly higher logit (ties favour the target).
            let rank = if target == f32::NEG_INFINITY {
                usize::MAX
            } else {
                l.iter().filter(|&&x| x > target).count()
            };
            for (k, h) in hits.iter_mut().enumerate() {
                *h += (rank <= k) as usize;
            }
            positions += 1;
        }
    }
    report.examples = examples.len();
    report.positions = positions;
    for k in 0..5 {
        report.top_k_greedy[k] = hits[k] as f64 / positions.max(1) as f64;
    }
    Ok(())
}

/// Greedy speculation with the paper's tree on `prompts` (token ids), `max_new` tokens each;
/// checks the output equals the LLM's own greedy output as it goes.
pub fn tau(
    llm: &Llama,
    ssm: &Llama,
    prompts: &[Vec<u32>],
    max_new: u32,
    report: &mut Report,
) -> Result<()> {
    use specinfer_edge::{CachedDraft, DraftMode, Speculator};
    let limits = Limits::default();
    let (mut tokens, mut rounds) = (0usize, 0usize);
    for ids in prompts {
        let mut session =
            specinfer_verifier::Session::open(llm, ids, SamplingParams::greedy(max_new), &limits)?;
        let mut speculator =
            Speculator::new(Speculator::PAPER_EXPANSION.to_vec(), DraftMode::Greedy, 0);
        let mut draft = CachedDraft::new(ssm);
        while session.finish().is_none() {
            let tree = speculator.draft(&mut draft, session.tokens())?;
            let out = session.verify(llm, &limits, &tree)?;
            tokens += out.tokens.len();
            rounds += 1;
        }
    }
    report.tau_paper_tree = tokens as f64 / rounds.max(1) as f64;
    report.tau_prompts = prompts.len();
    Ok(())
}
