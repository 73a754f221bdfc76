//! [`FeatureDraft`]: the [`DraftModel`] of a feature-conditioned drafter
//! ([`FeatureDrafter`], or its ONNX export: any [`FeatureScorer`]), kept in step with the committed tokens and the LLM's features of them,
//! which the verifier sends with its verdicts.
//!
//! Position `p` of the drafter needs the feature of position `p - 1`. For committed positions
//! that is the LLM's own (exact); for a tree node it is the drafter's prediction for the node's
//! parent. After each verdict the accepted path is run again with the LLM's features instead of
//! being kept from the tree: the drafter's predictions were only guesses of them, and one layer
//! over a few positions costs little. Sampled verification stays exact: the drafter's
//! distribution, like any draft's, is only a proposal that the verifier corrects.

use specinfer_model::{FeatureDrafter, KvCache, ModelError};
use specinfer_wire::{Limits, TokenTree};

use crate::DraftModel;

/// What a feature-conditioned draft runs on: the candle [`FeatureDrafter`], or its ONNX export
/// in ONNX Runtime (`specinfer-onnx`), as [`crate::TreeScorer`] is for an SSM.
pub trait FeatureScorer: Sync {
    fn new_cache(&self) -> KvCache;
    /// The longest sequence (committed tokens plus a tree's depth) it can score.
    fn max_positions(&self) -> usize;
    /// Width of the features it reads and predicts (the LLM's).
    fn feature_dim(&self) -> usize;
    /// Logits (whole vocabulary) and predicted features (`[nodes, d]`) of nodes `first..` of
    /// `tree`, whose preceding features are `prev` (`[nodes, d]`); afterwards the cache's scratch
    /// region holds the tree's nodes `0..tree.len()`.
    fn score_features(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
        prev: &[f32],
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>), ModelError>;
    /// Runs committed `tokens` (preceding features `prev`) on top of the cache and commits them.
    fn append_committed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        prev: &[f32],
    ) -> Result<(), ModelError>;
}

impl FeatureScorer for FeatureDrafter {
    fn new_cache(&self) -> KvCache {
        FeatureDrafter::new_cache(self)
    }

    fn max_positions(&self) -> usize {
        self.config().max_positions
    }

    fn feature_dim(&self) -> usize {
        FeatureDrafter::feature_dim(self)
    }

    fn score_features(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
        prev: &[f32],
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>), ModelError> {
        let out = self.forward(cache, tree, first, prev)?;
        let n = tree.len() - first;
        let mut features = Vec::with_capacity(n * self.feature_dim());
        for i in 0..n {
            features.extend_from_slice(out.feature(i).expect("the drafter gives features"));
        }
        Ok(((0..n).map(|i| out.node(i).to_vec()).collect(), features))
    }

    fn append_committed(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        prev: &[f32],
    ) -> Result<(), ModelError> {
        self.append(cache, tokens, prev)
    }
}

pub struct FeatureDraft<'m> {
    model: &'m dyn FeatureScorer,
    cache: KvCache,
    /// The LLM's features of committed positions `known_from..`, row after row.
    known_from: usize,
    known: Vec<f32>,
    /// The committed position the cache's first entry holds.
    window_start: usize,
    /// Committed tokens whose K/V the cache holds, from `window_start`.
    cached: Vec<u32>,
    /// Position of the root of the tree being drafted (the last committed token).
    root_position: usize,
    /// The drafter's predicted features of the tree's scored nodes, in node order.
    tree_features: Vec<f32>,
}

impl<'m> FeatureDraft<'m> {
    pub fn new(model: &'m dyn FeatureScorer) -> Self {
        FeatureDraft {
            model,
            cache: model.new_cache(),
            known_from: 0,
            known: Vec::new(),
            window_start: 0,
            cached: Vec::new(),
            root_position: 0,
            tree_features: Vec::new(),
        }
    }

    fn dim(&self) -> usize {
        self.model.feature_dim()
    }

    fn known_end(&self) -> usize {
        self.known_from + self.known.len() / self.dim()
    }

    /// The LLM's feature of committed position `p`, if held.
    fn known_feature(&self, p: usize) -> Option<&[f32]> {
        let d = self.dim();
        let i = p.checked_sub(self.known_from)?;
        self.known.get(i * d..(i + 1) * d)
    }

    /// Committed positions the cache may hold at once, leaving room for a deep tree.
    fn window(&self) -> usize {
        let limit = self.model.max_positions();
        limit - (limit / 4).min(Limits::default().max_tree_nodes as usize)
    }

    fn restart_window(&mut self, start: usize) {
        self.window_start = start;
        self.cache.rollback(0);
        self.cached.clear();
    }
}

impl DraftModel for FeatureDraft<'_> {
    fn wants_features(&self) -> bool {
        true
    }

    fn take_features(&mut self, first_position: usize, rows: &[f32], dim: usize) {
        if dim != self.dim() {
            tracing::warn!(
                got = dim,
                expected = self.dim(),
                "the verifier's features are not this drafter's width (another LLM?); ignored"
            );
            return;
        }
        if (self.known_from..=self.known_end()).contains(&first_position) {
            // They continue (or restate the end of) what is held.
            self.known
                .truncate((first_position - self.known_from) * dim);
        } else {
            self.known_from = first_position;
            self.known.clear();
        }
        self.known.extend_from_slice(rows);
        // Features older than twice the window will never be read again.
        let keep = 2 * self.window();
        let held = self.known.len() / dim;
        if held > keep {
            self.known.drain(..(held - keep) * dim);
            self.known_from += held - keep;
        }
    }

    /// The root's preceding position must have the LLM's feature.
    fn ready(&self, committed: &[u32]) -> bool {
        committed.len() >= 2 && self.known_feature(committed.len() - 2).is_some()
    }

    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        let end = committed.len().saturating_sub(1);
        self.root_position = end;
        // Where a fresh window starts: late enough to leave half the window free, never
        // before the first position whose preceding feature is known.
        let fresh = (self.known_from + 1).max(end.saturating_sub(self.window() / 2));
        if !(self.window_start <= end && end - self.window_start <= self.window()) {
            self.restart_window(fresh.min(end));
        }
        let common = self
            .cached
            .iter()
            .zip(&committed[self.window_start..end])
            .take_while(|(a, b)| a == b)
            .count();
        self.cache.rollback(common);
        self.cached.truncate(common);
        // The positions to run need the features of `from - 1 .. end - 1`, which are held
        // contiguously: else the window starts again where they are.
        let needs = |s: &Self, from: usize| {
            from >= end || (from > s.known_from && end - 1 <= s.known_end())
        };
        if !needs(self, self.window_start + common) {
            self.restart_window(fresh.min(end));
            if !needs(self, self.window_start) {
                // Nothing can be run before features arrive; `ready` says so.
                return Ok(());
            }
        }
        let from = self.window_start + self.cached.len();
        if from >= end {
            return Ok(());
        }
        let prev: Vec<f32> = (from..end)
            .flat_map(|p| {
                self.known_feature(p - 1)
                    .expect("checked above")
                    .iter()
                    .copied()
            })
            .collect();
        let new = &committed[from..end];
        self.model.append_committed(&mut self.cache, new, &prev)?;
        self.cached.extend_from_slice(new);
        Ok(())
    }

    /// Scores nodes `first..` in waves: a node reads its parent's predicted feature, so it is
    /// computed in a forward after its parent's (a best-first tree usually asks for one wave).
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let d = self.dim();
        self.tree_features.truncate(first * d);
        let mut logits = Vec::with_capacity(tree.len() - first);
        let mut start = first;
        while start < tree.len() {
            let end = (start + 1..tree.len())
                .find(|&i| tree.parent(i).is_some_and(|p| p >= start))
                .unwrap_or(tree.len());
            let mut prev = Vec::with_capacity((end - start) * d);
            for i in start..end {
                let f = match tree.parent(i) {
                    None => self
                        .root_position
                        .checked_sub(1)
                        .and_then(|p| self.known_feature(p))
                        .ok_or_else(|| ModelError::Format {
                            path: "<feature draft>".into(),
                            message: "no LLM feature before the root: call ready() first".into(),
                        })?,
                    Some(parent) => &self.tree_features[parent * d..(parent + 1) * d],
                };
                prev.extend_from_slice(f);
            }
            let mut wave = tree.clone();
            wave.truncate(end);
            let (wave_logits, features) =
                self.model
                    .score_features(&mut self.cache, &wave, start, &prev)?;
            if features.len() != (end - start) * d || wave_logits.len() != end - start {
                return Err(ModelError::Format {
                    path: "<feature draft>".into(),
                    message: "the drafter scored another number of nodes than asked".into(),
                });
            }
            self.tree_features.extend_from_slice(&features);
            logits.extend(wave_logits);
            start = end;
        }
        Ok(logits)
    }
}
