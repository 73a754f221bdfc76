use crate::ModelConfig;

/// One sequence's keys and values, per layer, position-major (`[position, kv_head, head_dim]`).
///
/// Positions `0..committed` hold the committed tokens. After a tree forward, the tree's nodes sit
/// behind them in tree order (the scratch region). [`KvCache::compact`] keeps the accepted path by
/// moving its entries into place; nothing is recomputed.
#[derive(Clone, Debug)]
pub struct KvCache {
    kv_row: usize,
    committed: usize,
    scratch: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_shape(cfg.n_layers, cfg.kv_row())
    }

    /// A cache for `layers` layers of `kv_row` floats per position (for models that are not a
    /// [`crate::Llama`], such as an ONNX export).
    pub fn with_shape(layers: usize, kv_row: usize) -> Self {
        KvCache {
            kv_row,
            committed: 0,
            scratch: 0,
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
        }
    }

    /// Positions whose K/V are final.
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Tree nodes currently held behind the committed region.
    pub fn scratch(&self) -> usize {
        self.scratch
    }

    /// Bytes held, for memory budgets.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.capacity() * 4).sum()
    }

    /// Keeps the tree nodes of `path` (root-to-leaf node indices into the last tree, strictly
    /// increasing) as committed positions, in order, and drops the rest of the scratch region.
    pub fn compact(&mut self, path: &[u32]) {
        assert!(
            path.windows(2).all(|w| w[0] < w[1]),
            "path must be strictly increasing"
        );
        assert!(
            path.last().is_none_or(|&n| (n as usize) < self.scratch),
            "path leaves the tree"
        );
        let row = self.kv_row;
        let base = self.committed;
        for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
            for (i, &node) in path.iter().enumerate() {
                let (from, to) = ((base + node as usize) * row, (base + i) * row);
                if from != to {
                    layer.copy_within(from..from + row, to);
                }
            }
            layer.truncate((base + path.len()) * row);
        }
        self.committed += path.len();
        self.scratch = 0;
    }

    /// Commits every scratch node in place: after a chain (a prompt, or tokens a draft catches
    /// up on), whose nodes are already the positions in order.
    pub fn commit_scratch(&mut self) {
        self.committed += self.scratch;
        self.scratch = 0;
    }

    /// Forgets everything after the first `len` committed positions (and the scratch region).
    pub fn rollback(&mut self, len: usize) {
        assert!(len <= self.committed, "cannot roll forward");
        self.committed = len;
        self.scratch = 0;
        for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
            layer.truncate(len * self.kv_row);
        }
    }

    /// Keeps the first `keep` scratch nodes, drops the rest, and makes room for `n` new nodes.
    pub fn begin_tree(&mut self, keep: usize, n: usize) {
        self.scratch = keep;
        for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
            layer.truncate((self.committed + keep) * self.kv_row);
            layer.reserve(n * self.kv_row);
        }
    }

    /// Appends the new nodes' K and V of one layer (`[n, kv_heads, head_dim]`).
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
        if layer == self.k.len() - 1 {
            self.scratch = self.k[layer].len() / self.kv_row - self.committed;
        }
    }

    /// Layer `layer`'s K and V: committed positions, then the scratch nodes.
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// A new cache holding a copy of the first `len` committed positions (at most all of them),
    /// sized to them alone.
    pub fn prefix(&self, len: usize) -> KvCache {
        let len = len.min(self.committed);
        let copy = |layers: &[Vec<f32>]| -> Vec<Vec<f32>> {
            layers
                .iter()
                .map(|l| l[..len * self.kv_row].to_vec())
                .collect()
        };
        KvCache {
            kv_row: self.kv_row,
            committed: len,
            scratch: 0,
            k: copy(&self.k),
            v: copy(&self.v),
        }
    }
}
