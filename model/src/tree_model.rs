//! What a verifier needs of a model, whatever device it runs on: per-sequence KV caches, one
//! batched forward over several sequences' trees, and keeping a round's accepted path. The CPU
//! engine ([`Llama`]) and, with the `cuda` feature, the GPU engine implement it, so the verifier's
//! sessions, batching and service are written once for both.

use specinfer_wire::TokenTree;

use crate::{KvCache, KvPrecision, Llama, Logits, ModelConfig, Result, SeqTree, Want};

pub trait TreeModel: Send + Sync {
    /// One sequence's KV cache (in host or device memory).
    type Cache: Send;

    fn config(&self) -> &ModelConfig;

    fn new_cache(&self) -> Result<Self::Cache>;

    /// Positions of `cache` whose K/V are final.
    fn committed(cache: &Self::Cache) -> usize;

    /// Bytes `cache` holds, for memory budgets.
    fn cache_bytes(cache: &Self::Cache) -> usize;

    /// Bytes one position of a sequence holds (K and V over all layers): what admission
    /// reserves per position a session may grow to.
    fn kv_position_bytes(&self) -> usize;

    /// Every sequence's tree in one pass (see [`Llama::forward`]), each giving what its `wants`
    /// entry asks for; each tree's nodes are left in its cache's scratch region. An engine may
    /// skip the head of a [`Want::KvOnly`] sequence (empty logits) and give a [`Want::Argmax`]
    /// sequence only its argmaxes ([`Logits::argmax`]); it may give more than was asked.
    fn forward_trees(
        &self,
        seqs: &mut [(&mut Self::Cache, &TokenTree)],
        wants: &[Want],
    ) -> Result<Vec<Logits>>;

    /// Keeps the nodes of `path` (strictly increasing node indices of the last tree) as
    /// committed positions and drops the rest of the scratch region.
    fn keep_path(&self, cache: &mut Self::Cache, path: &[u32]) -> Result<()>;

    /// Keeps the first `len` committed positions of `cache` (at most its committed count) and
    /// forgets the rest: a cached prefix's K/V reused by a session whose prompt shares only
    /// part of it.
    fn truncate(&self, cache: &mut Self::Cache, len: usize);

    /// A new cache holding a copy of `cache`'s first `len` committed positions, or `None` where
    /// this engine cannot copy one (then a reused prefix is moved out of the prefix cache
    /// instead, and the entry's other positions are lost).
    fn copy_prefix(&self, _cache: &Self::Cache, _len: usize) -> Option<Self::Cache> {
        None
    }

    /// Whether [`TreeModel::forward_trees`] gives every node's feature ([`Logits::feature`]),
    /// which a session asks for to feed a feature-conditioned drafter.
    fn gives_features(&self) -> bool;

    /// Waits until the work of every forward issued so far has finished. An engine whose
    /// forwards return before their work is done (a GPU's launches) must: a forward timed
    /// without it measures queueing, not the forward.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

impl TreeModel for Llama {
    type Cache = KvCache;

    fn config(&self) -> &ModelConfig {
        Llama::config(self)
    }

    fn new_cache(&self) -> Result<KvCache> {
        Ok(KvCache::new(Llama::config(self)))
    }

    fn committed(cache: &KvCache) -> usize {
        cache.committed()
    }

    fn cache_bytes(cache: &KvCache) -> usize {
        cache.bytes()
    }

    /// K and V rows in the precision of the caches `new_cache` makes.
    fn kv_position_bytes(&self) -> usize {
        let cfg = Llama::config(self);
        2 * cfg.n_layers * cfg.kv_row() * KvPrecision::default().bytes()
    }

    /// The CPU engine computes its head rows on the host anyway: argmax sequences get them all.
    fn forward_trees(
        &self,
        seqs: &mut [(&mut KvCache, &TokenTree)],
        wants: &[Want],
    ) -> Result<Vec<Logits>> {
        let mut batch: Vec<SeqTree> = seqs
            .iter_mut()
            .map(|(cache, tree)| SeqTree::new(cache, tree))
            .collect();
        let heads: Vec<bool> = wants.iter().map(|w| w.head()).collect();
        self.forward_selected(&mut batch, &heads)
    }

    fn keep_path(&self, cache: &mut KvCache, path: &[u32]) -> Result<()> {
        cache.compact(path);
        Ok(())
    }

    fn truncate(&self, cache: &mut KvCache, len: usize) {
        cache.rollback(len.min(cache.committed()));
    }

    fn copy_prefix(&self, cache: &KvCache, len: usize) -> Option<KvCache> {
        Some(cache.prefix(len))
    }

    fn gives_features(&self) -> bool {
        true
    }
}

#[cfg(feature = "cuda")]
impl TreeModel for crate::cuda::CudaLlama {
    type Cache = crate::cuda::CudaKvCache;

    fn config(&self) -> &ModelConfig {
        crate::cuda::CudaLlama::config(self)
    }

    fn new_cache(&self) -> Result<Self::Cache> {
        crate::cuda::CudaLlama::new_cache(self)
    }

    fn committed(cache: &Self::Cache) -> usize {
        cache.committed()
    }

    fn cache_bytes(cache: &Self::Cache) -> usize {
        cache.bytes()
    }

    fn kv_position_bytes(&self) -> usize {
        crate::cuda::CudaLlama::kv_position_bytes(self)
    }

    fn forward_trees(
        &self,
        seqs: &mut [(&mut Self::Cache, &TokenTree)],
        wants: &[Want],
    ) -> Result<Vec<Logits>> {
        let mut batch: Vec<crate::cuda::CudaSeqTree> = seqs
            .iter_mut()
            .map(|(cache, tree)| crate::cuda::CudaSeqTree {
                cache,
                tree,
                first: 0,
            })
            .collect();
        self.forward_wanting(&mut batch, wants)
    }

    fn keep_path(&self, cache: &mut Self::Cache, path: &[u32]) -> Result<()> {
        self.compact(cache, path)
    }

    fn truncate(&self, cache: &mut Self::Cache, len: usize) {
        cache.rollback(len.min(cache.committed()));
    }

    /// Not yet: its forward keeps the final hidden states on the device.
    fn gives_features(&self) -> bool {
        false
    }

    fn synchronize(&self) -> Result<()> {
        crate::cuda::CudaLlama::synchronize(self)
    }
}
