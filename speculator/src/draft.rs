//! Draft models behind one trait, so the speculator does not care what computes the logits.

use specinfer_model::{KvCache, KvPrecision, Llama, ModelError, SeqTree};
use specinfer_wire::{Limits, TokenTree};

/// A model that scores a growing token tree on top of the committed tokens.
pub trait DraftModel {
    /// Makes the draft's state hold `committed` minus its last token (the root of the next tree),
    /// reusing whatever prefix it already holds (after a round, its accepted path).
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError>;
    /// Logits of tree nodes `first..`; nodes before `first` were scored by earlier calls on the
    /// same tree since the last `sync`.
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError>;

    /// Whether the draft reads the LLM's features ([`crate::FeatureDraft`]): its sessions then
    /// ask the verifier for them.
    fn wants_features(&self) -> bool {
        false
    }

    /// The LLM's features (`[rows, dim]`) of consecutive committed positions from
    /// `first_position`, as a verdict brought them.
    fn take_features(&mut self, _first_position: usize, _rows: &[f32], _dim: usize) {}

    /// Whether it can draft a tree rooted at the last of `committed` now (a feature-conditioned
    /// draft needs the LLM's feature of the token before the root); if not, the round's tree is
    /// the root alone.
    fn ready(&self, _committed: &[u32]) -> bool {
        true
    }
}

/// A borrowed draft model drafts as itself (a caller keeps its draft caches across answers).
impl<T: DraftModel + ?Sized> DraftModel for &mut T {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        (**self).sync(committed)
    }
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        (**self).extend(tree, first)
    }
    fn wants_features(&self) -> bool {
        (**self).wants_features()
    }
    fn take_features(&mut self, first_position: usize, rows: &[f32], dim: usize) {
        (**self).take_features(first_position, rows, dim)
    }
    fn ready(&self, committed: &[u32]) -> bool {
        (**self).ready(committed)
    }
}

impl<T: DraftModel + ?Sized> DraftModel for Box<T> {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        (**self).sync(committed)
    }
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        (**self).extend(tree, first)
    }
    fn wants_features(&self) -> bool {
        (**self).wants_features()
    }
    fn take_features(&mut self, first_position: usize, rows: &[f32], dim: usize) {
        (**self).take_features(first_position, rows, dim)
    }
    fn ready(&self, committed: &[u32]) -> bool {
        (**self).ready(committed)
    }
}

/// The compute half of a draft model: scores tree nodes on top of a KV cache that the caller
/// owns, so one loaded model serves many concurrent drafts.
pub trait TreeScorer: Sync {
    fn new_cache(&self) -> KvCache;
    /// The longest sequence (committed tokens plus a tree's depth) the model can score.
    fn max_positions(&self) -> usize;
    /// Logits (whole vocabulary) of nodes `first..` of `tree`; afterwards the cache's scratch
    /// region holds the tree's nodes `0..tree.len()`.
    fn score(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError>;

    /// Runs `tokens` on top of the cache's committed positions and commits them. Their logits
    /// are not needed (a draft catching up on committed tokens), so a model may skip its head.
    fn append(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<(), ModelError> {
        self.score(cache, &TokenTree::chain(tokens), 0)?;
        cache.commit_scratch();
        Ok(())
    }
}

impl TreeScorer for Llama {
    /// f32: a drafter's cache is small, and in f32 the same drafter drafts the same trees on
    /// this engine and on ONNX Runtime (which takes f32 caches).
    fn new_cache(&self) -> KvCache {
        KvCache::with_precision(self.config(), KvPrecision::F32)
    }

    fn max_positions(&self) -> usize {
        self.config().max_positions
    }

    fn score(
        &self,
        cache: &mut KvCache,
        tree: &TokenTree,
        first: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let out = self
            .forward(&mut [SeqTree { cache, tree, first }])?
            .remove(0);
        Ok((0..out.nodes()).map(|i| out.node(i).to_vec()).collect())
    }

    fn append(&self, cache: &mut KvCache, tokens: &[u32]) -> Result<(), ModelError> {
        Llama::append(self, cache, tokens)
    }
}

/// A draft model from any [`TreeScorer`] (the `specinfer-model` transformer, or an ONNX export
/// through ONNX Runtime) plus its cache, kept in step with the committed tokens: after a round
/// the accepted path moves from the scratch region into place instead of being recomputed.
///
/// A conversation may outgrow the draft model's context (the default SSM's is 2,048 positions,
/// the LLM's 8,192): the draft then reads only the most recent committed tokens, a window that
/// jumps forward by half its length when full, so its cost stays bounded. Drafts only propose;
/// the verifier, which holds the whole context, decides, so the output is unchanged.
pub struct CachedDraft<'m> {
    model: &'m dyn TreeScorer,
    cache: KvCache,
    /// How many committed tokens precede the window the cache holds.
    window_start: usize,
    /// Tokens whose K/V are committed in `cache`: the window's start onwards.
    cached: Vec<u32>,
    /// The tree whose nodes sit in the cache's scratch region (the last one drafted).
    scratch_tree: Option<TokenTree>,
}

impl<'m> CachedDraft<'m> {
    pub fn new(model: &'m dyn TreeScorer) -> Self {
        CachedDraft {
            model,
            cache: model.new_cache(),
            window_start: 0,
            cached: Vec::new(),
            scratch_tree: None,
        }
    }

    /// How many of the committed tokens (all but the last) the draft leaves out: 0 until they
    /// outgrow the model's context.
    pub fn window_start(&self) -> usize {
        self.window_start
    }

    /// Where the window over `len` committed tokens starts: the current start while the window
    /// leaves room for a deep tree, else far enough forward to leave half the window free.
    fn next_window_start(&self, len: usize) -> usize {
        let limit = self.model.max_positions();
        // Room for the largest tree a verifier accepts (at most a quarter of the context).
        let tree = Limits::default().max_tree_nodes as usize;
        let window = limit - (limit / 4).min(tree);
        if len <= window {
            0
        } else if self.window_start <= len && len - self.window_start <= window {
            self.window_start
        } else {
            len - window / 2
        }
    }
}

impl DraftModel for CachedDraft<'_> {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        let want = &committed[..committed.len().saturating_sub(1)];
        let start = self.next_window_start(want.len());
        if start != self.window_start {
            // The window moved: its positions start afresh, nothing cached still applies.
            self.window_start = start;
            self.cache.rollback(0);
            self.cached.clear();
            self.scratch_tree = None;
        }
        let want = &want[start..];
        // After a round the accepted path is already in the scratch region: keep it (copy into
        // place) instead of computing it again.
        if let Some(tree) = self.scratch_tree.take() {
            let new = want
                .get(self.cached.len()..)
                .filter(|_| want.starts_with(&self.cached));
            if let Some(path) = new.map(|new| tree_path(&tree, new)) {
                self.cache.compact(&path);
                self.cached
                    .extend(path.iter().map(|&n| tree.token(n as usize)));
            }
        }
        let common = self
            .cached
            .iter()
            .zip(want)
            .take_while(|(a, b)| a == b)
            .count();
        self.cache.rollback(common);
        self.cached.truncate(common);
        if want.len() > common {
            let new = &want[common..];
            self.model.append(&mut self.cache, new)?;
            self.cached.extend_from_slice(new);
        }
        Ok(())
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        self.scratch_tree = Some(tree.clone());
        self.model.score(&mut self.cache, tree, first)
    }
}

/// The nodes of `tree` spelling the longest prefix of `tokens` from the root (root included):
/// the part of an accepted path whose K/V the draft already computed. The rest (typically the
/// last level, which was proposed but never scored) is recomputed.
fn tree_path(tree: &TokenTree, tokens: &[u32]) -> Vec<u32> {
    let mut path = Vec::new();
    let Some((&first, rest)) = tokens.split_first() else {
        return path;
    };
    if tree.token(0) != first {
        return path;
    }
    let children = tree.children();
    path.push(0u32);
    for &t in rest {
        let node = *path.last().expect("non-empty");
        match children[node as usize]
            .iter()
            .copied()
            .find(|&c| tree.token(c as usize) == t)
        {
            Some(next) => path.push(next),
            None => break,
        }
    }
    path
}
