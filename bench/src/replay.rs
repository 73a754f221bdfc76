//! Recorded client rounds, replayed against a verifier: a load generator that stands for many
//! edge devices without drafting for them on the load machine's CPU.
//!
//! Recording runs the real SSM once per prompt: the LLM's greedy answer (the reference), then at
//! every position of it the dynamic tree the client's SSM drafts there, with each node's draft
//! path probability. Greedy verification is deterministic and lossless, so whatever subtree a
//! replayed session sends, the verifier must answer with the reference's next tokens: a replay
//! follows the recorded path, and checks that it does at every round.
//!
//! A replayed session sizes its trees as a load-aware client does: the recorded tree's best-first
//! prefix that pays at the costs it measured (round trip, the verifier's fitted forward cost,
//! the verifier's node price) and within the verifier's node cap, with the same rule and cost
//! model as the client's adaptive dynamic trees
//! ([`specinfer_speculator::GrowthCosts::paying_prefix`], [`DepthController`]).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use specinfer_model::Llama;
use specinfer_net::{Remote, RemoteConfig, RemoteSession};
use specinfer_speculator::{
    CachedDraft, Calibration, DepthController, DraftMode, DraftModel, HandOff, RoundDriver,
    RoundObservation, Speculator, TreeShape,
};
use specinfer_train::eval;
use specinfer_wire::{SamplingParams, ServerDrafting, TokenTree, Verified};

/// One prompt's recording.
pub struct Recording {
    pub prompt: Vec<u32>,
    /// The LLM's greedy answer (to a stop token or the length limit).
    pub reference: Vec<u32>,
    /// `trees[p]`: the tree drafted after the prompt and `reference[..p]`.
    pub trees: Vec<RecordedTree>,
}

pub struct RecordedTree {
    pub tree: TokenTree,
    /// Draft path probability of each non-root node, in node order (best first).
    pub path_p: Vec<f64>,
}

/// Records `prompts` (greedy answers of at most `max_new` tokens ending at `stop_ids`) with
/// `dynamic:budget` trees from `ssm`; `progress` hears each prompt done.
pub fn record(
    llm: &Llama,
    ssm: &Llama,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    budget: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<Recording>> {
    let mut out = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut plain = RoundDriver::new(prompt.clone(), params.clone(), None)?;
        eval::run_in_process(llm, &mut plain)?;
        let reference = plain.generated().to_vec();
        let mut spec = Speculator::with_shape(TreeShape::Dynamic { budget }, DraftMode::Greedy, 0);
        let mut draft = CachedDraft::new(ssm);
        let mut trees = Vec::new();
        for p in 0..reference.len() {
            let committed: Vec<u32> = prompt.iter().chain(&reference[..p]).copied().collect();
            draft.sync(&committed)?;
            let tree = spec.draft(&mut draft, &committed)?;
            let path_p = path_probabilities(&mut draft, &tree)?;
            trees.push(RecordedTree { tree, path_p });
        }
        out.push(Recording {
            prompt: prompt.clone(),
            reference,
            trees,
        });
        progress(i + 1);
    }
    Ok(out)
}

/// The draft's probability of the path to each non-root node of `tree`.
fn path_probabilities(draft: &mut dyn DraftModel, tree: &TokenTree) -> Result<Vec<f64>> {
    let logits = draft.extend(tree, 0)?;
    let mut path = vec![1f64; tree.len()];
    for node in 1..tree.len() {
        let parent = tree.parent(node).context("a non-root node has a parent")?;
        let l = &logits[parent];
        let max = l.iter().copied().fold(f32::MIN, f32::max);
        let sum: f64 = l.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let p = ((l[tree.token(node) as usize] - max) as f64).exp() / sum;
        path[node] = path[parent] * p;
    }
    Ok(path[1..].to_vec())
}

/// How a replayed (or server-driven) session went, timed from its arrival.
#[derive(Clone, Debug, Default)]
pub struct SessionTrace {
    /// (seconds since arrival, tokens) per verdict.
    pub verdicts: Vec<(f64, usize)>,
    /// Tree nodes sent (split sessions).
    pub nodes: usize,
    /// Split rounds before the session handed the rest to the verifier, if it did.
    pub handed_off_after: Option<usize>,
}

impl SessionTrace {
    pub fn tokens(&self) -> usize {
        self.verdicts.iter().map(|v| v.1).sum()
    }

    /// Time to first token.
    pub fn ttft(&self) -> f64 {
        self.verdicts.first().map_or(f64::NAN, |v| v.0)
    }

    /// Time per output token after the first verdict (NaN when one verdict did it all).
    pub fn tpot(&self) -> f64 {
        let (Some(first), Some(last)) = (self.verdicts.first(), self.verdicts.last()) else {
            return f64::NAN;
        };
        let after = self.tokens() - first.1;
        if after == 0 {
            f64::NAN
        } else {
            (last.0 - first.0) / after as f64
        }
    }
}

/// How a replayed session sizes its trees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizing {
    /// The whole recorded tree every round (within a node cap).
    Whole,
    /// The prefix that pays at the measured costs and the verifier's node price, within its
    /// node cap (see the module doc).
    LoadAware,
}

/// What a replaying client measured, to size its next tree: the client's own cost model (the
/// adaptive trees' [`DepthController`], which also takes the verifier's node price) and draft
/// calibration, and the verifier's last node cap.
struct MeasuredCosts {
    costs: DepthController,
    calibration: Calibration,
    cap: Option<usize>,
}

impl Default for MeasuredCosts {
    fn default() -> Self {
        MeasuredCosts {
            costs: DepthController::new(0),
            calibration: Calibration::default(),
            cap: None,
        }
    }
}

impl MeasuredCosts {
    fn nodes(&self, sizing: Sizing, path_p: &[f64]) -> usize {
        let paying = match sizing {
            Sizing::LoadAware => self.costs.growth_costs(self.calibration.factor()),
            Sizing::Whole => None,
        };
        let n = paying.map_or(path_p.len() + 1, |c| c.paying_prefix(path_p));
        self.cap.map_or(n, |c| n.min(c))
    }

    fn observe(&mut self, v: &Verified, round_s: f64, sent_path_p: &[f64]) {
        self.costs
            .set_node_price(v.stats.node_price_ns as f64 * 1e-9);
        // The drafting was paid when the trees were recorded: no draft forwards.
        self.costs.observe(
            RoundObservation {
                tree_depth: 0,
                tree_nodes: v.stats.tree_nodes as usize,
                drafted_nodes: v.stats.tree_nodes as usize,
                accepted: v.accepted_nodes.len(),
                draft_s: 0.0,
                round_s,
                queue_s: v.stats.queue_us as f64 * 1e-6,
                forward_s: v.stats.forward_us as f64 * 1e-6,
            },
            0,
        );
        if !sent_path_p.is_empty() {
            self.calibration
                .observe(v.accepted_nodes.len(), sent_path_p.iter().sum());
        }
        self.cap = (v.stats.node_cap > 0).then_some(v.stats.node_cap as usize);
    }
}

/// Replays `rec` as one client session (its own QUIC connection) against `remote`; fails if
/// the verifier's answer leaves the recorded path. With `hand_off`, the session hands the rest
/// of the answer to the verifier's plain decoding when the client's rule says so
/// ([`HandOff`], as [`RoundDriver::with_hand_off`]; drafting counts as free, as it was paid
/// when the trees were recorded).
pub async fn replay(
    remote: &RemoteConfig,
    rec: &Recording,
    params: &SamplingParams,
    sizing: Sizing,
    hand_off: bool,
    arrival: Instant,
) -> Result<SessionTrace> {
    let conn = Remote::connect(remote).await?;
    let mut s = conn.open(1, rec.prompt.clone(), params.clone()).await?;
    let (mut trace, mut costs, mut pos) = (SessionTrace::default(), MeasuredCosts::default(), 0);
    let mut rule = hand_off.then(|| {
        let mut rule = HandOff::default();
        rule.start_from(s.costs(), s.rtt().as_secs_f64());
        rule
    });
    loop {
        if rule.as_ref().is_some_and(HandOff::server_is_cheaper) {
            trace.handed_off_after = Some(trace.verdicts.len());
            s.generate(ServerDrafting::Plain).await?;
            trace.stream_rest(&mut s, rec, &mut pos, arrival).await?;
            break;
        }
        let recorded = rec
            .trees
            .get(pos)
            .context("the verifier went past the recorded answer")?;
        let n = costs.nodes(sizing, &recorded.path_p);
        let mut tree = recorded.tree.clone();
        tree.truncate(n);
        let sent_path_p = &recorded.path_p[..tree.len() - 1];
        trace.nodes += tree.len();
        let sent = Instant::now();
        let v = s.verify(tree).await?;
        let now = Instant::now();
        costs.observe(&v, (now - sent).as_secs_f64(), sent_path_p);
        if let Some(rule) = &mut rule {
            rule.observe(&v, sent_path_p.len() + 1, 0.0, (now - sent).as_secs_f64());
        }
        if trace.take(rec, &mut pos, &v, (now - arrival).as_secs_f64())? {
            break;
        }
    }
    s.close().await?;
    conn.shutdown().await;
    Ok(trace)
}

/// A session the verifier decodes on its own (`drafting`), streamed back; fails if it leaves
/// the recorded (greedy) answer.
pub async fn server_generated(
    remote: &RemoteConfig,
    rec: &Recording,
    params: &SamplingParams,
    drafting: ServerDrafting,
    arrival: Instant,
) -> Result<SessionTrace> {
    let conn = Remote::connect(remote).await?;
    let mut s = conn.open(1, rec.prompt.clone(), params.clone()).await?;
    s.generate(drafting).await?;
    let (mut trace, mut pos) = (SessionTrace::default(), 0);
    trace.stream_rest(&mut s, rec, &mut pos, arrival).await?;
    s.close().await?;
    conn.shutdown().await;
    Ok(trace)
}

impl SessionTrace {
    /// Takes the rounds the verifier decodes on its own (after `Generate`) to the answer's end.
    async fn stream_rest(
        &mut self,
        s: &mut RemoteSession,
        rec: &Recording,
        pos: &mut usize,
        arrival: Instant,
    ) -> Result<()> {
        loop {
            let v = s.verdict().await?;
            self.nodes += v.stats.tree_nodes as usize;
            if self.take(rec, pos, &v, arrival.elapsed().as_secs_f64())? {
                return Ok(());
            }
        }
    }

    /// Takes the verdict that came `at` seconds after arrival for answer position `*pos`:
    /// checks that it continues the recorded answer, and moves `pos` past it. Returns whether
    /// the session finished.
    fn take(&mut self, rec: &Recording, pos: &mut usize, v: &Verified, at: f64) -> Result<bool> {
        let want = rec.reference.get(*pos..*pos + v.tokens.len());
        if want != Some(&v.tokens[..]) {
            bail!(
                "the verifier left the recorded greedy path at token {pos}: got {:?}, recorded {:?}",
                v.tokens,
                want
            );
        }
        self.verdicts.push((at, v.tokens.len()));
        *pos += v.tokens.len();
        Ok(v.finish.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use specinfer_edge::EmbeddedVerifier;
    use specinfer_integration::{chat_ids, default_ssm, smollm2};
    use specinfer_verifier::engine::EngineConfig;

    /// The tokens a greedy verifier commits for `tree` drafted at answer position `pos`: the
    /// tree's longest root path that spells the reference from `pos`, plus the LLM's own next
    /// token, cut at the answer's end.
    fn greedy_verdict(tree: &TokenTree, reference: &[u32], pos: usize) -> usize {
        let children = tree.children();
        let (mut node, mut accepted) = (0usize, 0usize);
        while let Some(&next) = children[node]
            .iter()
            .find(|&&c| reference.get(pos + accepted) == Some(&tree.token(c as usize)))
        {
            node = next as usize;
            accepted += 1;
        }
        (accepted + 1).min(reference.len() - pos)
    }

    /// Greedy verification is deterministic, so replayed trees come back as the recording
    /// says, round by round: whole trees commit exactly the recorded tree's agreeing path, cut
    /// trees the recorded answer; and a recording the verifier would not reproduce is caught
    /// at the round where it parts from the LLM's answer.
    #[test]
    fn a_replay_reproduces_its_recorded_rounds_and_fails_where_they_are_wrong() {
        let (llm, tok) = smollm2();
        let params = SamplingParams {
            stop_ids: tok.eos().to_vec(),
            ..SamplingParams::greedy(24)
        };
        let prompts = vec![chat_ids("Name the three primary colours.")];
        let mut recordings =
            record(llm, default_ssm(), &prompts, &params, 32, &mut |_| {}).unwrap();
        let rec = &recordings[0];
        assert_eq!(rec.trees.len(), rec.reference.len());
        assert!(rec.reference.len() > 8, "{:?}", rec.reference);
        let verifier = EmbeddedVerifier::start(llm.clone(), tok, EngineConfig::default()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let run = |rec: &Recording, sizing| {
            rt.block_on(replay(
                &verifier.remote,
                rec,
                &params,
                sizing,
                false,
                Instant::now(),
            ))
        };

        let whole = run(rec, Sizing::Whole).unwrap();
        let mut pos = 0;
        for &(_, tokens) in &whole.verdicts {
            assert_eq!(
                tokens,
                greedy_verdict(&rec.trees[pos].tree, &rec.reference, pos),
                "at {pos}"
            );
            pos += tokens;
        }
        assert_eq!(pos, rec.reference.len());
        assert!(
            whole.verdicts.len() < rec.reference.len(),
            "the SSM's trees accepted nothing"
        );
        assert_eq!(
            run(rec, Sizing::LoadAware).unwrap().tokens(),
            rec.reference.len()
        );

        let mut wrong = recordings.remove(0);
        let k = wrong.reference.len() / 2;
        wrong.reference[k] = if wrong.reference[k] == 0 {
            1
        } else {
            wrong.reference[k] - 1
        };
        let err = run(&wrong, Sizing::Whole).unwrap_err().to_string();
        assert!(err.contains("left the recorded greedy path"), "{err}");
    }
}
