use half::f16;
use half::slice::HalfFloatSliceExt;
use specinfer_kernels::KvRows;

use crate::ModelConfig;

/// How a cache stores keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPrecision {
    /// f16, rounded to nearest: half the bytes of f32, so a decoded token reads half as much of a
    /// long context, and a session holds half the memory. Attention widens each value to f32 as
    /// it reads it; speculative and incremental decoding store the same values, so they stay
    /// token-identical.
    #[default]
    F16,
    /// f32: the projections' outputs as they are. For comparisons with f32 references (the GPU
    /// engine's f32 checks) and for models whose runtime takes f32 caches (ONNX exports).
    F32,
}

impl KvPrecision {
    /// Bytes of one stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvPrecision::F16 => 2,
            KvPrecision::F32 => 4,
        }
    }
}

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
    planes: Planes,
}

/// The values, in the cache's precision.
#[derive(Clone, Debug)]
enum Planes {
    F16(Layers<f16>),
    F32(Layers<f32>),
}

/// Per layer, K and V.
#[derive(Clone, Debug)]
struct Layers<E> {
    k: Vec<Vec<E>>,
    v: Vec<Vec<E>>,
}

impl<E: Stored> Layers<E> {
    fn new(layers: usize) -> Self {
        Layers {
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
        }
    }

    fn all_mut(&mut self) -> impl Iterator<Item = &mut Vec<E>> {
        self.k.iter_mut().chain(self.v.iter_mut())
    }

    fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|l| l.capacity() * std::mem::size_of::<E>())
            .sum()
    }

    fn compact(&mut self, path: &[u32], base: usize, row: usize) {
        for layer in self.all_mut() {
            for (i, &node) in path.iter().enumerate() {
                let (from, to) = ((base + node as usize) * row, (base + i) * row);
                if from != to {
                    layer.copy_within(from..from + row, to);
                }
            }
            layer.truncate((base + path.len()) * row);
        }
    }

    fn truncate_reserve(&mut self, len: usize, reserve: usize) {
        for layer in self.all_mut() {
            layer.truncate(len);
            layer.reserve(reserve);
        }
    }

    /// Appends one layer's new K and V; returns the values that layer now holds.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> usize {
        E::extend_from_f32(&mut self.k[layer], k);
        E::extend_from_f32(&mut self.v[layer], v);
        self.k[layer].len()
    }

    fn prefix(&self, len: usize) -> Self {
        let copy = |layers: &[Vec<E>]| layers.iter().map(|l| l[..len].to_vec()).collect();
        Layers {
            k: copy(&self.k),
            v: copy(&self.v),
        }
    }
}

/// A value type a cache stores.
trait Stored: Copy + Default {
    /// Appends f32 values, rounded to this type.
    fn extend_from_f32(plane: &mut Vec<Self>, x: &[f32]);
}

impl Stored for f16 {
    fn extend_from_f32(plane: &mut Vec<f16>, x: &[f32]) {
        let at = plane.len();
        plane.resize(at + x.len(), f16::ZERO);
        plane[at..].convert_from_f32_slice(x);
    }
}

impl Stored for f32 {
    fn extend_from_f32(plane: &mut Vec<f32>, x: &[f32]) {
        plane.extend_from_slice(x);
    }
}

/// Calls `$body` with `$l` bound to the cache's [`Layers`], whatever their precision.
macro_rules! each {
    ($planes:expr, |$l:ident| $body:expr) => {
        match $planes {
            Planes::F16($l) => $body,
            Planes::F32($l) => $body,
        }
    };
}

impl KvCache {
    /// A cache in the default precision (f16).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_precision(cfg, KvPrecision::default())
    }

    pub fn with_precision(cfg: &ModelConfig, precision: KvPrecision) -> Self {
        Self::with_shape_and_precision(cfg.n_layers, cfg.kv_row(), precision)
    }

    /// An f32 cache for `layers` layers of `kv_row` floats per position (for models that are not
    /// a [`crate::Llama`], such as an ONNX export, whose runtime takes f32).
    pub fn with_shape(layers: usize, kv_row: usize) -> Self {
        Self::with_shape_and_precision(layers, kv_row, KvPrecision::F32)
    }

    fn with_shape_and_precision(layers: usize, kv_row: usize, precision: KvPrecision) -> Self {
        KvCache {
            kv_row,
            committed: 0,
            scratch: 0,
            planes: match precision {
                KvPrecision::F16 => Planes::F16(Layers::new(layers)),
                KvPrecision::F32 => Planes::F32(Layers::new(layers)),
            },
        }
    }

    pub fn precision(&self) -> KvPrecision {
        match self.planes {
            Planes::F16(_) => KvPrecision::F16,
            Planes::F32(_) => KvPrecision::F32,
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
        each!(&self.planes, |l| l.bytes())
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
        let (row, base) = (self.kv_row, self.committed);
        each!(&mut self.planes, |l| l.compact(path, base, row));
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
        let row = self.kv_row;
        each!(&mut self.planes, |l| l.truncate_reserve(len * row, 0));
    }

    /// Keeps the first `keep` scratch nodes, drops the rest, and makes room for `n` new nodes.
    pub fn begin_tree(&mut self, keep: usize, n: usize) {
        self.scratch = keep;
        let (len, row) = ((self.committed + keep) * self.kv_row, self.kv_row);
        each!(&mut self.planes, |l| l.truncate_reserve(len, n * row));
    }

    /// Appends the new nodes' K and V of one layer (`[n, kv_heads, head_dim]`), rounded to the
    /// cache's precision.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        let (layers, held) = each!(&mut self.planes, |l| (l.k.len(), l.append(layer, k, v)));
        if layer == layers - 1 {
            self.scratch = held / self.kv_row - self.committed;
        }
    }

    /// Layer `layer`'s K and V: committed positions, then the scratch nodes.
    pub fn layer(&self, layer: usize) -> (KvRows<'_>, KvRows<'_>) {
        match &self.planes {
            Planes::F16(l) => (KvRows::F16(&l.k[layer]), KvRows::F16(&l.v[layer])),
            Planes::F32(l) => (KvRows::F32(&l.k[layer]), KvRows::F32(&l.v[layer])),
        }
    }

    /// A new cache holding a copy of the first `len` committed positions (at most all of them),
    /// sized to them alone, in the same precision.
    pub fn prefix(&self, len: usize) -> KvCache {
        let len = len.min(self.committed);
        let values = len * self.kv_row;
        KvCache {
            kv_row: self.kv_row,
            committed: len,
            scratch: 0,
            planes: match &self.planes {
                Planes::F16(l) => Planes::F16(l.prefix(values)),
                Planes::F32(l) => Planes::F32(l.prefix(values)),
            },
        }
    }
}
