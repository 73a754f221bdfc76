//! Distillation: cross-entropy on the teacher's answer tokens, plus cross-entropy against the
//! teacher's top-k probabilities where the teacher data kept them (a soft target says how close
//! the runners-up were, which the top-k proposals of a tree and stochastic verification both
//! use); AdamW, warmup + cosine schedule, checkpoints for resumption.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::{Rng, SeedableRng};

use crate::ssm::Ssm;
use crate::teacher::{Example, TOP_KEPT};

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub steps: usize,
    pub batch: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub warmup: usize,
    pub seed: u64,
    pub checkpoint_every: usize,
}

/// The `head` most frequent answer tokens (end-of-turn tokens always included): the SSM's support.
pub fn head_tokens(examples: &[Example], head: usize, always: &[u32]) -> Vec<u32> {
    let mut count: HashMap<u32, usize> = HashMap::new();
    for e in examples {
        for &t in &e.answer {
            *count.entry(t).or_default() += 1;
        }
    }
    let mut by_freq: Vec<(u32, usize)> = count.into_iter().collect();
    by_freq.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut ids: Vec<u32> = always.to_vec();
    ids.extend(
        by_freq
            .into_iter()
            .map(|(t, _)| t)
            .filter(|t| !always.contains(t))
            .take(head.saturating_sub(always.len())),
    );
    ids
}

/// The learning rate at `step` of `steps`: linear warmup over `warmup` steps, then cosine decay
/// from `peak` to `floor` times it.
pub(crate) fn scheduled_lr(peak: f64, warmup: usize, step: usize, steps: usize, floor: f64) -> f64 {
    let warm = (step + 1) as f64 / warmup.max(1) as f64;
    let progress = step as f64 / steps as f64;
    peak * warm.min(1.0)
        * (floor + (1.0 - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// The batch order's randomness at `step`: a function of (seed, step) only, so a resumed run
/// sees the same data.
pub(crate) fn step_rng(seed: u64, step: usize) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9E37_79B9))
}

/// Weight of the soft (top-k) term against the hard (teacher token) term.
const SOFT_WEIGHT: f64 = 0.5;

/// One training batch: inputs, head-index targets of the answer positions, and where they are;
/// per such position the teacher's top-k as head indices and probabilities (probability 0 where
/// not kept or outside the head).
struct Batch {
    ids: Tensor,
    rows: Tensor,
    targets: Tensor,
    soft_ids: Tensor,
    soft_probs: Tensor,
    soft_rows: usize,
}

fn make_batch(
    examples: &[Example],
    picks: &[usize],
    seq_len: usize,
    head_index: &HashMap<u32, u32>,
) -> Result<Option<Batch>> {
    let seqs: Vec<(Vec<u32>, usize)> = picks
        .iter()
        .map(|&i| {
            let e = &examples[i];
            let mut s = e.prompt.clone();
            s.extend(&e.answer);
            // Keep the end: the answer matters, the start of a long prompt less.
            let cut = s.len().saturating_sub(seq_len + 1);
            (s[cut..].to_vec(), e.prompt.len().saturating_sub(cut))
        })
        .collect();
    let l = seqs.iter().map(|(s, _)| s.len() - 1).max().unwrap_or(0);
    if l == 0 {
        return Ok(None);
    }
    let (mut ids, mut rows, mut targets) = (Vec::new(), Vec::new(), Vec::new());
    let (mut soft_ids, mut soft_probs, mut soft_rows) = (Vec::new(), Vec::new(), 0);
    for (b, (s, answer_from)) in seqs.iter().enumerate() {
        let e = &examples[picks[b]];
        for p in 0..l {
            ids.push(*s.get(p).unwrap_or(&0));
            // Position p predicts s[p + 1]; train on answer tokens inside the head.
            if p + 1 < s.len() && p + 1 >= *answer_from {
                if let Some(&h) = head_index.get(&s[p + 1]) {
                    rows.push((b * l + p) as u32);
                    targets.push(h);
                    let top = e.top.get(p + 1 - answer_from).map_or(&[][..], |t| &t[..]);
                    soft_rows += usize::from(!top.is_empty());
                    for k in 0..TOP_KEPT {
                        let kept = top
                            .get(k)
                            .and_then(|&(t, q)| Some((*head_index.get(&t)?, q)));
                        let (i, q) = kept.unwrap_or((0, 0.0));
                        soft_ids.push(i);
                        soft_probs.push(q);
                    }
                }
            }
        }
    }
    if rows.is_empty() {
        return Ok(None);
    }
    let dev = Device::Cpu;
    let n = rows.len();
    Ok(Some(Batch {
        ids: Tensor::from_vec(ids, (seqs.len(), l), &dev)?,
        rows: Tensor::new(rows.as_slice(), &dev)?,
        targets: Tensor::new(targets.as_slice(), &dev)?,
        soft_ids: Tensor::from_vec(soft_ids, (n, TOP_KEPT), &dev)?,
        soft_probs: Tensor::from_vec(soft_probs, (n, TOP_KEPT), &dev)?,
        soft_rows,
    }))
}

/// Mean cross-entropy of `ssm` on the teacher's tokens of a batch, mixed with the mean
/// cross-entropy against the teacher's top-k over the positions that have them.
fn loss(ssm: &Ssm, batch: &Batch) -> candle_core::Result<Tensor> {
    let logits = ssm.forward(&batch.ids)?;
    let (b, l, h) = logits.dims3()?;
    let picked = logits.reshape((b * l, h))?.index_select(&batch.rows, 0)?;
    let hard = candle_nn::loss::cross_entropy(&picked, &batch.targets)?;
    if batch.soft_rows == 0 {
        return Ok(hard);
    }
    let log_q = candle_nn::ops::log_softmax(&picked, D::Minus1)?;
    let soft = (log_q.gather(&batch.soft_ids, 1)? * &batch.soft_probs)?
        .sum_all()?
        .affine(-1.0 / batch.soft_rows as f64, 0.0)?;
    hard.affine(1.0 - SOFT_WEIGHT, 0.0)? + soft.affine(SOFT_WEIGHT, 0.0)?
}

/// Trains from step `start` (after a resumed checkpoint) to `cfg.steps`; returns the mean loss of
/// each logged window.
pub fn train(
    ssm: &mut Ssm,
    examples: &[Example],
    cfg: &TrainConfig,
    checkpoint: &Path,
    start: usize,
) -> Result<Vec<f32>> {
    let head_index: HashMap<u32, u32> = ssm
        .head_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| (t, i as u32))
        .collect();
    let mut opt = AdamW::new(
        ssm.vars(),
        ParamsAdamW {
            lr: cfg.lr,
            weight_decay: 0.01,
            ..ParamsAdamW::default()
        },
    )?;
    let t0 = Instant::now();
    let mut window = Vec::new();
    let mut curve = Vec::new();
    for step in start..cfg.steps {
        let lr = scheduled_lr(cfg.lr, cfg.warmup, step, cfg.steps, 0.1);
        opt.set_learning_rate(lr);
        let mut rng = step_rng(cfg.seed, step);
        let picks: Vec<usize> = (0..cfg.batch)
            .map(|_| rng.random_range(0..examples.len()))
            .collect();
        let Some(batch) = make_batch(examples, &picks, cfg.seq_len, &head_index)? else {
            continue;
        };
        let l = loss(ssm, &batch)?;
        opt.backward_step(&l)?;
        window.push(l.to_scalar::<f32>()?);
        let done = step + 1 - start;
        if (step + 1) % 25 == 0 || step + 1 == cfg.steps {
            let mean = window.iter().sum::<f32>() / window.len() as f32;
            curve.push(mean);
            window.clear();
            let eta = t0.elapsed().as_secs_f64() / done as f64 * (cfg.steps - step - 1) as f64;
            eprintln!(
                "train: step {}/{} loss {mean:.3} lr {lr:.2e} ETA {eta:.0} s",
                step + 1,
                cfg.steps
            );
        }
        if (step + 1) % cfg.checkpoint_every == 0 {
            ssm.save_checkpoint(checkpoint)?;
            std::fs::write(checkpoint.with_extension("step"), (step + 1).to_string())?;
        }
    }
    ssm.save_checkpoint(checkpoint)?;
    std::fs::write(checkpoint.with_extension("step"), cfg.steps.to_string())?;
    Ok(curve)
}
