//! Draft models behind one trait, so the speculator does not care what computes the logits.

use specinfer_model::{KvCache, Llama, ModelError, SeqTree};
use specinfer_wire::TokenTree;

/// A model that scores a growing token tree on top of the committed tokens.
pub trait DraftModel {
    /// Makes the draft's state hold `committed` minus its last token (the root of the next tree),
    /// reusing whatever prefix it already holds (after a round, its accepted path).
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError>;
    /// Logits of tree nodes `first..`; nodes before `first` were scored by earlier calls on the
    /// same tree since the last `sync`.
    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError>;
}

/// A `specinfer-model` transformer (GGUF or safetensors) as the draft model.
pub struct CandleDraft<'m> {
    model: &'m Llama,
    cache: KvCache,
    /// Tokens whose K/V are committed in `cache`.
    cached: Vec<u32>,
}

impl<'m> CandleDraft<'m> {
    pub fn new(model: &'m Llama) -> Self {
        CandleDraft {
            model,
            cache: KvCache::new(model.config()),
            cached: Vec::new(),
        }
    }
}

impl DraftModel for CandleDraft<'_> {
    fn sync(&mut self, committed: &[u32]) -> Result<(), ModelError> {
        let want = &committed[..committed.len().saturating_sub(1)];
        let common = self
            .cached
            .iter()
            .zip(want)
            .take_while(|(a, b)| a == b)
            .count();
        self.cache.rollback(common);
        self.cached.truncate(common);
        if want.len() > common {
            self.model.prefill(&mut self.cache, &want[common..])?;
            self.cached.extend_from_slice(&want[common..]);
        }
        Ok(())
    }

    fn extend(&mut self, tree: &TokenTree, first: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let out = self
            .model
            .forward(&mut [SeqTree {
                cache: &mut self.cache,
                tree,
                first,
            }])?
            .remove(0);
        Ok((0..out.nodes()).map(|i| out.node(i).to_vec()).collect())
    }
}
