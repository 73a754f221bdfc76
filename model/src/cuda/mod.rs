//! The GPU engine (feature `cuda`): the same transformer and tree-masked forward as [`Llama`], on
//! an NVIDIA GPU through cudarc. Weights are uploaded once, as bf16 (half the bytes a decode step
//! reads) or f32 ([`Precision`]); everything runs in specinfer's NVRTC-compiled kernels
//! (`kernels/cuda/specinfer.cu`), attention for all nodes of all sequences in one launch. The
//! projections are a kernel of our own rather than cuBLAS: each output is summed in one fixed
//! order whatever the batch (see `specinfer_kernels::projection`), so, as on the CPU engine,
//! greedy speculation is token-identical to incremental decoding and a session's output does not
//! depend on the sessions batched with it. One forward per round, as on the CPU. K/V live in one
//! pool on the device, allocated at start for the verifier's whole KV budget, in pages of one
//! position ([`crate::kv_slots`]): a sequence holds the positions it uses, and keeping a round's
//! accepted path is a slot-table update, no K/V row moves. Greedy rounds get each node's argmax
//! reduced on the device; sampled rounds' logits stay on the device, where the `sample_walk`
//! kernel verifies the tree (only the verdict crosses), or cross to the host row by row as a host
//! walk reads them.
//!
//! cudarc loads the driver at run time and panics when it is missing, so [`CudaLlama::upload`]
//! checks for it first and returns a clear error on machines without an NVIDIA driver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use specinfer_kernels::projection;
use specinfer_wire::TokenTree;

pub mod checks;
pub mod device;
pub mod driver;
pub mod emulated;

use device::{Arg, Device, DeviceBuf, Graph, Kernel, Launch};
pub use driver::CudaDevice;
pub use emulated::EmulatedDevice;

use crate::kv_slots::{SlotPool, SlotTable};
use crate::llama::Linear;
use crate::{
    DeviceRows, Llama, Logits, ModelConfig, ModelError, Result, RopeStyle, SampleWalk, WalkOutcome,
    Want,
};

fn gpu_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Runtime {
        backend: "cuda",
        message: e.to_string(),
    }
}

/// How the GPU engine keeps a model's projection weights and its K/V caches (activations and
/// every sum are f32 either way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// bf16 (rounded to nearest): 2 bytes per weight and per K/V element, the serving default.
    #[default]
    Bf16,
    /// f32, weights dequantized exactly: for checks against the CPU engine's f32 models.
    F32,
}

impl Precision {
    /// u16 units per K/V element (K/V buffers are u16 arrays, an f32 element two units).
    fn kv_units(self) -> usize {
        match self {
            Precision::Bf16 => 1,
            Precision::F32 => 2,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "bf16" => Ok(Precision::Bf16),
            "f32" => Ok(Precision::F32),
            other => Err(format!("unknown GPU precision {other:?} (bf16 or f32)")),
        }
    }
}

/// Projection weights on the device, row-major `[out, in]`.
enum DeviceWeights {
    F32(DeviceBuf<f32>),
    /// bf16 bits.
    Bf16(DeviceBuf<u16>),
}

/// A projection on the device.
struct DeviceLinear {
    w: DeviceWeights,
    b: Option<DeviceBuf<f32>>,
    out: usize,
    inp: usize,
}

impl DeviceLinear {
    fn bytes(&self) -> usize {
        let w = match &self.w {
            DeviceWeights::F32(w) => w.len() * 4,
            DeviceWeights::Bf16(w) => w.len() * 2,
        };
        w + self.b.as_ref().map_or(0, |b| b.len() * 4)
    }
}

struct DeviceLayer {
    attn_norm: DeviceBuf<f32>,
    /// The query, key and value projections stacked: each output row is q | k | v.
    qkv: DeviceLinear,
    o: DeviceLinear,
    ffn_norm: DeviceBuf<f32>,
    /// The gate and up projections stacked: each output row is gate | up.
    gate_up: DeviceLinear,
    down: DeviceLinear,
}

/// A [`Llama`] on one GPU.
pub struct CudaLlama {
    cfg: ModelConfig,
    dev: Arc<dyn Device>,
    /// The K/V store and attention kernels for the K/V precision chosen.
    store_kv: Kernel,
    tree_attention: Kernel,
    /// Attention's split over positions: at most `splits` blocks of `split_len` positions
    /// ([`attention_split`]).
    splits: usize,
    split_len: usize,
    embed: DeviceBuf<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: DeviceBuf<f32>,
    lm_head: DeviceLinear,
    /// A restricted head's tokens (row i of the head is token ids[i]), on the host and device.
    head_ids: Option<(Arc<Vec<u32>>, DeviceBuf<u32>)>,
    /// The forward's activations, kept between forwards (grown when a batch has more rows):
    /// a forward allocates no activation buffers.
    workspace: Mutex<Workspace>,
    kv: KvPool,
    /// Whether forwards capture and replay CUDA graphs ([`CudaLlama::set_graphs`]).
    graphs: AtomicBool,
    /// Captured shape buckets kept at once ([`MAX_GRAPHS`] unless set).
    graph_limit: AtomicUsize,
}

/// Every sequence's K/V: per layer, `[slots, kv_row]` elements of the engine's [`Precision`]
/// (as u16 units), allocated once for the engine's whole KV memory; sequences hold slots
/// (pages of one position, see [`crate::kv_slots`]).
struct KvPool {
    k: Vec<DeviceBuf<u16>>,
    v: Vec<DeviceBuf<u16>>,
    slots: Arc<Mutex<SlotPool>>,
    /// Device bytes one position holds over all layers, K and V.
    position_bytes: usize,
    /// The slot past the pool's, which no sequence holds: padding rows' K/V go there.
    spare_slot: usize,
}

/// A forward's inputs and activations, for up to `rows` rows whose ancestor bitsets have up to
/// `words` words, and the CUDA graphs captured over them (which hold these buffers' addresses).
#[derive(Default)]
struct Workspace {
    rows: usize,
    words: usize,
    bufs: Option<Buffers>,
    /// Graphs by shape bucket (rows and ancestor words, each rounded up to a power of two),
    /// with when each was last replayed (a forward count).
    graphs: HashMap<(usize, usize), (Box<dyn Graph>, u64)>,
    forwards: u64,
}

/// Captured shape buckets kept at once; a new one beyond replaces the least recently used. A
/// server's batches come in many sizes: buckets make a few graphs serve them all, and the bound
/// keeps a burst of odd shapes from costing a capture each time.
pub const MAX_GRAPHS: usize = 16;

/// The shape a forward of `rows` rows and `words` ancestor words is captured and replayed at:
/// each rounded up to a power of two (the extra rows are padding, see [`Buffers::pad_table`]).
fn graph_bucket(rows: usize, words: usize) -> (usize, usize) {
    (
        rows.max(1).next_power_of_two(),
        words.max(1).next_power_of_two(),
    )
}

struct Buffers {
    /// Each row's token, position, its sequence's committed count, its node index in its tree
    /// and its sequence's slot table (device address); the ancestor bitsets, [rows, words].
    tokens: DeviceBuf<i32>,
    positions: DeviceBuf<i32>,
    committed: DeviceBuf<i32>,
    node: DeviceBuf<i32>,
    tables: DeviceBuf<u64>,
    anc: DeviceBuf<u64>,
    /// The residual stream, [rows, d_model].
    x: DeviceBuf<f32>,
    /// A norm's output, and each projection back to d_model.
    h: DeviceBuf<f32>,
    /// Rows of q | k | v.
    qkv: DeviceBuf<f32>,
    attn: DeviceBuf<f32>,
    /// Attention's partials per (row, head, split): max and sum, and the weighted values.
    attn_ml: DeviceBuf<f32>,
    attn_acc: DeviceBuf<f32>,
    /// The final norm's rows of the sequences that want the head, gathered.
    selected: DeviceBuf<f32>,
    /// Rows of gate | up, and the SwiGLU of them.
    gate_up: DeviceBuf<f32>,
    g: DeviceBuf<f32>,
    /// The head's rows. Shared with the [`Logits`] of the last forward, which copy rows from it
    /// when read; a forward while those are still alive writes into a fresh buffer instead.
    logits: Arc<DeviceBuf<f32>>,
    /// Each head row's argmax.
    ids: DeviceBuf<i32>,
    /// The slot table of padding rows (a replayed graph's rows past the batch's): one entry,
    /// the K/V pool's spare slot, which no sequence holds.
    pad_table: DeviceBuf<i32>,
}

impl Workspace {
    /// Drops the least recently replayed graphs until at most `n` are left.
    fn keep_graphs(&mut self, n: usize) {
        while self.graphs.len() > n {
            let oldest = self
                .graphs
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
                .expect("not empty");
            self.graphs.remove(&oldest);
        }
    }

    /// Buffers for `rows` rows of `words` ancestor words, reallocated (to the next power of
    /// two) only when they are too small; the captured graphs go with the old ones.
    fn fit(&mut self, model: &CudaLlama, rows: usize, words: usize) -> Result<()> {
        let (rows, words) = graph_bucket(rows, words);
        if self.bufs.is_none() || rows > self.rows || words > self.words {
            let cap = rows.max(self.rows);
            let words_cap = words.max(self.words);
            let cfg = &model.cfg;
            let dev = &model.dev;
            let alloc = |n: usize| DeviceBuf::<f32>::zeros(dev, cap * n);
            let ints = || DeviceBuf::<i32>::zeros(dev, cap);
            self.graphs.clear();
            self.bufs = None;
            self.bufs = Some(Buffers {
                tokens: ints()?,
                positions: ints()?,
                committed: ints()?,
                node: ints()?,
                tables: DeviceBuf::zeros(dev, cap)?,
                anc: DeviceBuf::zeros(dev, cap * words_cap)?,
                x: alloc(cfg.d_model)?,
                h: alloc(cfg.d_model)?,
                qkv: alloc(cfg.n_heads * cfg.head_dim + 2 * cfg.kv_row())?,
                attn: alloc(cfg.n_heads * cfg.head_dim)?,
                attn_ml: alloc(cfg.n_heads * model.splits * 2)?,
                attn_acc: alloc(cfg.n_heads * model.splits * cfg.head_dim)?,
                selected: alloc(cfg.d_model)?,
                gate_up: alloc(2 * cfg.ffn_dim)?,
                g: alloc(cfg.ffn_dim)?,
                logits: Arc::new(alloc(model.lm_head.out)?),
                ids: ints()?,
                pad_table: DeviceBuf::from_host(dev, &[model.kv.spare_slot as i32])?,
            });
            self.rows = cap;
            self.words = words_cap;
        }
        let bufs = self.bufs.as_mut().expect("allocated above");
        if Arc::get_mut(&mut bufs.logits).is_none() {
            bufs.logits = Arc::new(DeviceBuf::zeros(&model.dev, self.rows * model.lm_head.out)?);
        }
        Ok(())
    }
}

/// One sequence's K/V on the device: the slots of the engine's pool holding its positions, and
/// that table on the device for the kernels. Its slots go back to the pool when it is dropped.
pub struct CudaKvCache {
    table: SlotTable,
    /// `table`'s slots as i32, room for `device_table.len()` positions (grown by doubling).
    device_table: DeviceBuf<i32>,
    pool: Arc<Mutex<SlotPool>>,
    position_bytes: usize,
}

/// Positions a new cache's device table has room for.
const TABLE_CHUNK: usize = 256;

fn locked(pool: &Mutex<SlotPool>) -> std::sync::MutexGuard<'_, SlotPool> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaKvCache {
    pub fn committed(&self) -> usize {
        self.table.committed()
    }

    /// Device bytes held: the pool's slots this sequence holds.
    pub fn bytes(&self) -> usize {
        self.table.held() * self.position_bytes
    }

    /// Forgets everything after the first `len` committed positions (and the scratch region),
    /// their slots back to the pool.
    pub fn rollback(&mut self, len: usize) {
        self.table.rollback(&mut locked(&self.pool), len);
    }
}

impl Drop for CudaKvCache {
    fn drop(&mut self) {
        self.table.release(&mut locked(&self.pool));
    }
}

/// One sequence's share of a batched GPU forward (as [`crate::SeqTree`]).
pub struct CudaSeqTree<'a> {
    pub cache: &'a mut CudaKvCache,
    pub tree: &'a TokenTree,
    pub first: usize,
}

const THREADS: u32 = 256;

/// Rows per warp in the projection kernel (`LINEAR_ROWS` in `kernels/cuda/specinfer.cu`).
const LINEAR_ROWS: usize = 8;

/// The largest head the attention kernel holds (`qv[8]` / `acc[8]` per lane of a warp).
pub const MAX_HEAD_DIM: usize = 256;

/// How attention splits a node's keys: blocks of `split_len` absolute positions (a multiple of
/// 256, at least 256), at most 8 of them over the model's context, so that a long context's
/// attention runs on up to 8 warps per (node, head) instead of one. Fixed per model, so a
/// node's result does not depend on its batch.
pub fn attention_split(max_positions: usize) -> (usize, usize) {
    let split_len = 256 * max_positions.div_ceil(8 * 256).max(1);
    (max_positions.div_ceil(split_len).max(1), split_len)
}

fn elementwise(n: usize) -> Launch {
    Launch {
        grid: (n.div_ceil(THREADS as usize) as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// One warp per item, four warps (128 threads) per block: the projection and attention kernels.
fn warps_of(warps: usize) -> Launch {
    Launch {
        grid: (warps.div_ceil(4) as u32, 1, 1),
        block: (128, 1, 1),
        shared_bytes: 0,
    }
}

fn per_row(rows: usize, shared_floats: u32) -> Launch {
    Launch {
        grid: (rows as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: shared_floats * 4,
    }
}

/// Ends a capture however the code between begin and end leaves (a panic included): a stream
/// left capturing would make every later forward fail.
struct Capturing<'a> {
    dev: &'a dyn Device,
    open: bool,
}

impl Capturing<'_> {
    fn end(mut self) -> Result<Option<Box<dyn Graph>>> {
        self.open = false;
        self.dev.end_capture()
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.dev.end_capture();
        }
    }
}
impl CudaLlama {
    /// Uploads `model` to GPU `ordinal`, its projection weights and its K/V in `precision`,
    /// with a K/V pool of `kv_bytes` for all sequences together, compiling the kernels for the
    /// GPU's architecture.
    pub fn upload(
        model: &Llama,
        ordinal: usize,
        precision: Precision,
        kv_bytes: usize,
    ) -> Result<CudaLlama> {
        let dev: Arc<dyn Device> = Arc::new(CudaDevice::open(ordinal)?);
        Self::upload_to(model, dev, precision, kv_bytes)
    }

    /// [`CudaLlama::upload`] to any device (the emulated one included).
    pub fn upload_to(
        model: &Llama,
        dev: Arc<dyn Device>,
        precision: Precision,
        kv_bytes: usize,
    ) -> Result<CudaLlama> {
        let cfg = &model.cfg;
        if cfg.head_dim > MAX_HEAD_DIM || cfg.head_dim % 2 != 0 {
            return Err(gpu_err(format!(
                "head_dim {} is not supported on the GPU (even, at most {MAX_HEAD_DIM})",
                cfg.head_dim
            )));
        }
        if cfg.n_kv_heads == 0 || cfg.n_heads % cfg.n_kv_heads != 0 {
            return Err(gpu_err(format!(
                "{} query heads cannot share {} K/V heads",
                cfg.n_heads, cfg.n_kv_heads
            )));
        }
        let up = |v: &[f32]| DeviceBuf::from_host(&dev, v);
        // Projections that read the same input are stacked into one (their outputs side by side
        // in each row: q|k|v, gate|up), so a layer makes four projection launches, not seven.
        let linear = |parts: &[&Linear]| -> Result<DeviceLinear> {
            let inp = parts[0].w.shape().1;
            let (mut w, mut b, mut out) = (Vec::new(), Vec::new(), 0);
            let biased = parts.iter().any(|l| l.b.is_some());
            for l in parts {
                let (rows, cols) = l.w.shape();
                assert_eq!(cols, inp, "stacked projections read the same input");
                w.extend(l.w.to_f32()?);
                match &l.b {
                    Some(lb) => b.extend_from_slice(lb),
                    None if biased => b.extend(std::iter::repeat_n(0.0, rows)),
                    None => {}
                }
                out += rows;
            }
            let w = match precision {
                Precision::F32 => DeviceWeights::F32(up(&w)?),
                Precision::Bf16 => {
                    DeviceWeights::Bf16(DeviceBuf::from_host(&dev, &projection::f32_to_bf16(&w))?)
                }
            };
            Ok(DeviceLinear {
                w,
                b: biased.then(|| up(&b)).transpose()?,
                out,
                inp,
            })
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DeviceLayer {
                attn_norm: up(&l.attn_norm)?,
                qkv: linear(&[&l.q, &l.k, &l.v])?,
                o: linear(&[&l.o])?,
                ffn_norm: up(&l.ffn_norm)?,
                gate_up: linear(&[&l.gate, &l.up])?,
                down: linear(&[&l.down])?,
            });
        }
        let (splits, split_len) = attention_split(cfg.max_positions);
        let slot_units = cfg.kv_row() * precision.kv_units();
        let position_bytes = 2 * cfg.n_layers * slot_units * 2;
        let slots = kv_bytes / position_bytes;
        if slots < cfg.max_positions.min(TABLE_CHUNK) {
            return Err(gpu_err(format!(
                "a K/V pool of {kv_bytes} bytes holds {slots} positions ({position_bytes} bytes \
                 each): raise the KV budget"
            )));
        }
        // One slot more than sequences may hold: padding rows write there.
        let pool = || -> Result<Vec<DeviceBuf<u16>>> {
            (0..cfg.n_layers)
                .map(|_| DeviceBuf::zeros(&dev, (slots + 1) * slot_units))
                .collect()
        };
        let kv = KvPool {
            k: pool()?,
            v: pool()?,
            slots: Arc::new(Mutex::new(SlotPool::new(slots))),
            position_bytes,
            spare_slot: slots,
        };
        Ok(CudaLlama {
            cfg: model.cfg.clone(),
            kv,
            embed: up(&model.embed)?,
            final_norm: up(&model.final_norm)?,
            lm_head: linear(&[&model.lm_head])?,
            head_ids: match &model.head_ids {
                Some(ids) => Some((Arc::new(ids.clone()), DeviceBuf::from_host(&dev, ids)?)),
                None => None,
            },
            workspace: Default::default(),
            graphs: AtomicBool::new(true),
            graph_limit: AtomicUsize::new(MAX_GRAPHS),
            layers,
            store_kv: match precision {
                Precision::Bf16 => Kernel::StoreKvBf16,
                Precision::F32 => Kernel::StoreKvF32,
            },
            tree_attention: match precision {
                Precision::Bf16 => Kernel::TreeAttentionBf16,
                Precision::F32 => Kernel::TreeAttentionF32,
            },
            splits,
            split_len,
            dev,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device, and how its kernels were built (for logs and reports).
    pub fn runtime(&self) -> String {
        self.dev.describe()
    }

    /// Waits for every piece of work issued to the device (a timing must, or it times how
    /// long launching took, not the work).
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Bytes of weights on the device (what one decode step must read).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.qkv, &l.o, &l.gate_up, &l.down]
                    .iter()
                    .map(|x| x.bytes())
                    .sum::<usize>()
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum();
        // A decode step reads one embedding row, not the table.
        layers + self.lm_head.bytes() + 4 * self.final_norm.len()
    }

    /// Device memory bandwidth in bytes per second, from timing a 1 GiB device-to-device copy
    /// (which reads and writes every byte).
    pub fn measure_bandwidth(&self) -> Result<f64> {
        let n = (1usize << 30) / 4;
        let src = DeviceBuf::<f32>::zeros(&self.dev, n)?;
        let mut dst = DeviceBuf::<f32>::zeros(&self.dev, n)?;
        dst.copy_from(&src)?;
        self.dev.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..10 {
            dst.copy_from(&src)?;
        }
        self.dev.synchronize()?;
        Ok(10.0 * 2.0 * (n * 4) as f64 / t.elapsed().as_secs_f64())
    }

    /// A new, empty cache (it takes slots of the pool as its sequence grows).
    pub fn new_cache(&self) -> Result<CudaKvCache> {
        Ok(CudaKvCache {
            table: SlotTable::default(),
            device_table: DeviceBuf::zeros(&self.dev, TABLE_CHUNK)?,
            pool: self.kv.slots.clone(),
            position_bytes: self.kv.position_bytes,
        })
    }

    /// Positions the K/V pool holds, and how many are free.
    pub fn kv_slots(&self) -> (usize, usize) {
        let pool = locked(&self.kv.slots);
        (pool.capacity(), pool.free())
    }

    /// Device bytes one position of a sequence holds (K and V over all layers).
    pub fn kv_position_bytes(&self) -> usize {
        self.kv.position_bytes
    }

    /// Copies `cache`'s slot table from position `from` on to the device, growing the device
    /// table (doubling) when it has no room.
    fn sync_table(&self, cache: &mut CudaKvCache, from: usize) -> Result<()> {
        let slots = cache.table.slots();
        let from = if slots.len() > cache.device_table.len() {
            cache.device_table = DeviceBuf::zeros(&self.dev, slots.len().next_power_of_two())?;
            0
        } else {
            from
        };
        if from < slots.len() {
            let host: Vec<i32> = slots[from..].iter().map(|&s| s as i32).collect();
            cache.device_table.write(from, &host)?;
        }
        Ok(())
    }

    /// Keeps the scratch nodes of `path` (strictly increasing node indices of the last tree) as
    /// committed positions, as [`crate::KvCache::compact`]: a slot-table update (the path's
    /// slots become the next committed positions, the others return to the pool); no K/V row
    /// moves.
    pub fn compact(&self, cache: &mut CudaKvCache, path: &[u32]) -> Result<()> {
        let from = cache.table.keep_path(&mut locked(&self.kv.slots), path);
        self.sync_table(cache, from)
    }

    fn launch(&self, kernel: Kernel, shape: Launch, args: &[Arg]) -> Result<()> {
        // SAFETY: every caller passes the buffers and sizes the kernel's contract (in
        // kernels/cuda/specinfer.cu) asks for, asserted by the caller where not evident.
        unsafe { self.dev.launch(kernel, shape, args) }
    }

    /// `y = x W^T (+ b)` for the first `rows` rows of `x` into the first of `y` (row-major in,
    /// row-major out), batch invariant.
    fn linear(
        &self,
        x: &DeviceBuf<f32>,
        rows: usize,
        l: &DeviceLinear,
        y: &DeviceBuf<f32>,
    ) -> Result<()> {
        assert!(x.len() >= rows * l.inp && y.len() >= rows * l.out);
        // One warp per (output column, tile of LINEAR_ROWS rows).
        let shape = warps_of(l.out * rows.div_ceil(LINEAR_ROWS));
        let (kernel, w) = match &l.w {
            DeviceWeights::F32(w) => (Kernel::LinearF32, w.arg()),
            DeviceWeights::Bf16(w) => (Kernel::LinearBf16, w.arg()),
        };
        // A null bias pointer: the kernel adds none.
        let b = l.b.as_ref().map_or(Arg::Ptr(0), |b| b.arg());
        self.launch(
            kernel,
            shape,
            &[
                y.arg(),
                x.arg(),
                w,
                b,
                Arg::I32(rows as i32),
                Arg::I32(l.out as i32),
                Arg::I32(l.inp as i32),
            ],
        )
    }

    /// The LM head's projection of `x` (`[rows, d_model]`, taken as they are) on the device,
    /// and the same by `specinfer_kernels::projection::warp_linear` on the host over the weights
    /// the device holds: the two must be equal bit for bit (the kernel's order is fixed).
    pub fn check_lm_head_projection(&self, x: &[f32], rows: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = &self.lm_head;
        assert_eq!(x.len(), rows * l.inp, "x is [rows, d_model]");
        let dx = DeviceBuf::from_host(&self.dev, x)?;
        let y = DeviceBuf::<f32>::zeros(&self.dev, rows * l.out)?;
        self.linear(&dx, rows, l, &y)?;
        let device = y.to_host()?;
        let w = match &l.w {
            DeviceWeights::F32(w) => w.to_host()?,
            DeviceWeights::Bf16(w) => projection::bf16_to_f32(&w.to_host()?),
        };
        let b = l.b.as_ref().map(|b| b.to_host()).transpose()?;
        let host = projection::warp_linear(x, rows, &w, b.as_deref(), l.out, l.inp);
        Ok((device, host))
    }

    /// RMS norm of the first `rows` rows of `x` into `out`.
    fn rms_norm(
        &self,
        x: &DeviceBuf<f32>,
        rows: usize,
        w: &DeviceBuf<f32>,
        out: &DeviceBuf<f32>,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        assert!(x.len() >= rows * d && out.len() >= rows * d && w.len() == d);
        self.launch(
            Kernel::RmsNorm,
            per_row(rows, THREADS),
            &[
                out.arg(),
                x.arg(),
                w.arg(),
                Arg::I32(d as i32),
                Arg::F32(self.cfg.rms_eps),
            ],
        )
    }

    /// `x[..n] += y[..n]`.
    fn add_into(&self, x: &DeviceBuf<f32>, y: &DeviceBuf<f32>, n: usize) -> Result<()> {
        assert!(x.len() >= n && y.len() >= n);
        self.launch(
            Kernel::AddInto,
            elementwise(n),
            &[x.arg(), y.arg(), Arg::U64(n as u64)],
        )
    }

    /// Rotates the first `heads` heads of each of `rows` rows of `x` from value `at` on, rows
    /// `row_stride` floats apart (q or k inside rows of q | k | v).
    fn rope(
        &self,
        x: &DeviceBuf<f32>,
        at: usize,
        row_stride: usize,
        positions: &DeviceBuf<i32>,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        let hd = self.cfg.head_dim;
        assert!(x.len() >= at + (rows - 1) * row_stride + heads * hd && positions.len() >= rows);
        let interleaved = (self.cfg.rope_style == RopeStyle::Interleaved) as i32;
        self.launch(
            Kernel::Rope,
            per_row(rows, 0),
            &[
                x.arg_at(at),
                Arg::I32(row_stride as i32),
                positions.arg(),
                Arg::I32(heads as i32),
                Arg::I32(hd as i32),
                Arg::F32(self.cfg.rope_theta),
                Arg::I32(interleaved),
            ],
        )
    }

    /// `dst[i, :] = src[idx[i], :]` for the first `n` entries of `idx`, rows of d_model floats.
    ///
    /// # Safety
    /// Those entries must index rows inside `src` (the kernel reads them unchecked).
    unsafe fn gather_rows(
        &self,
        dst: &DeviceBuf<f32>,
        src: &DeviceBuf<f32>,
        idx: &DeviceBuf<i32>,
        n: usize,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        assert!(idx.len() >= n && dst.len() >= n * d);
        self.launch(
            Kernel::GatherRows,
            per_row(n, 0),
            &[dst.arg(), src.arg(), idx.arg(), Arg::I32(d as i32)],
        )
    }

    /// The embeddings and every layer over the workspace's inputs (`rows` nodes, ancestor
    /// bitsets of `words` words): kernel launches only, no copy and no allocation, so that a
    /// stream capture can record them.
    fn launch_layers(&self, ws: &Buffers, rows: usize, words: usize) -> Result<()> {
        let cfg = &self.cfg;
        let (d, hd, kv_row) = (cfg.d_model, cfg.head_dim, cfg.kv_row());
        // The embeddings: the table's rows of the tokens.
        // SAFETY: every token is inside the table (checked by forward_wanting; padding rows
        // hold token 0).
        unsafe { self.gather_rows(&ws.x, &self.embed, &ws.tokens, rows) }?;
        // Each row of the stacked projection: q (q_row floats), then k and v (kv_row each).
        let q_row = cfg.n_heads * hd;
        let qkv_row = q_row + 2 * kv_row;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            self.rms_norm(&ws.x, rows, &layer.attn_norm, &ws.h)?;
            self.linear(&ws.h, rows, &layer.qkv, &ws.qkv)?;
            self.rope(&ws.qkv, 0, qkv_row, &ws.positions, rows, cfg.n_heads)?;
            self.rope(&ws.qkv, q_row, qkv_row, &ws.positions, rows, cfg.n_kv_heads)?;
            // The new nodes' K/V go to each cache's scratch region, behind its committed rows:
            // node n to the slot its table gives position committed[n] + node_in_tree[n].
            // One block per node; its k and v are kv_row floats at q_row and q_row + kv_row of
            // its q | k | v row; every table holds committed + tree slots of the pool (placed
            // by forward_wanting).
            let (k_pool, v_pool) = (self.kv.k[li].arg(), self.kv.v[li].arg());
            self.launch(
                self.store_kv,
                per_row(rows, 0),
                &[
                    k_pool,
                    v_pool,
                    ws.tables.arg(),
                    ws.committed.arg(),
                    ws.node.arg(),
                    ws.qkv.arg_at(q_row),
                    ws.qkv.arg_at(q_row + kv_row),
                    Arg::I32(qkv_row as i32),
                    Arg::I32(kv_row as i32),
                ],
            )?;
            // One warp per (node, head, split), then one per (node, head) to merge the splits.
            self.launch(
                self.tree_attention,
                warps_of(rows * cfg.n_heads * self.splits),
                &[
                    ws.attn_ml.arg(),
                    ws.attn_acc.arg(),
                    ws.qkv.arg(),
                    Arg::I32(qkv_row as i32),
                    k_pool,
                    v_pool,
                    ws.tables.arg(),
                    ws.committed.arg(),
                    ws.node.arg(),
                    ws.anc.arg(),
                    Arg::I32(words as i32),
                    Arg::I32(rows as i32),
                    Arg::I32(cfg.n_heads as i32),
                    Arg::I32(cfg.n_kv_heads as i32),
                    Arg::I32(hd as i32),
                    Arg::F32(scale),
                    Arg::I32(self.splits as i32),
                    Arg::I32(self.split_len as i32),
                ],
            )?;
            self.launch(
                Kernel::AttentionCombine,
                warps_of(rows * cfg.n_heads),
                &[
                    ws.attn.arg(),
                    ws.attn_ml.arg(),
                    ws.attn_acc.arg(),
                    ws.committed.arg(),
                    ws.anc.arg(),
                    Arg::I32(words as i32),
                    Arg::I32(rows as i32),
                    Arg::I32(cfg.n_heads as i32),
                    Arg::I32(hd as i32),
                    Arg::I32(self.splits as i32),
                    Arg::I32(self.split_len as i32),
                ],
            )?;
            self.linear(&ws.attn, rows, &layer.o, &ws.h)?;
            self.add_into(&ws.x, &ws.h, rows * d)?;
            self.rms_norm(&ws.x, rows, &layer.ffn_norm, &ws.h)?;
            self.linear(&ws.h, rows, &layer.gate_up, &ws.gate_up)?;
            let n = rows * cfg.ffn_dim;
            assert!(ws.g.len() >= n && ws.gate_up.len() >= 2 * n);
            self.launch(
                Kernel::Swiglu,
                elementwise(n),
                &[
                    ws.g.arg(),
                    ws.gate_up.arg(),
                    Arg::I32(cfg.ffn_dim as i32),
                    Arg::U64(n as u64),
                ],
            )?;
            self.linear(&ws.g, rows, &layer.down, &ws.h)?;
            self.add_into(&ws.x, &ws.h, rows * d)?;
        }
        Ok(())
    }

    /// [`CudaLlama::launch_layers`] for the batch's `rows` rows, through a CUDA graph per shape
    /// bucket ([`graph_bucket`]): captured the first time a bucket comes, replayed after (one
    /// launch for some 300), its rows past the batch's padding (inputs written by
    /// [`CudaLlama::forward_wanting`]). A capture that fails turns graphs off for the engine,
    /// with a warning; the kernels then launch one by one.
    fn run_layers(&self, ws: &mut Workspace, rows: usize, words: usize) -> Result<()> {
        if !self.graphs.load(Ordering::Relaxed) {
            return self.launch_layers(ws.bufs.as_ref().expect("fit allocates"), rows, words);
        }
        let bucket = graph_bucket(rows, words);
        ws.forwards += 1;
        if let Some((graph, used)) = ws.graphs.get_mut(&bucket) {
            *used = ws.forwards;
            return graph.replay();
        }
        ws.keep_graphs(self.graph_limit.load(Ordering::Relaxed) - 1);
        let bufs = ws.bufs.as_ref().expect("fit allocates");
        self.dev.begin_capture()?;
        let capture = Capturing {
            dev: &*self.dev,
            open: true,
        };
        let launched = self.launch_layers(bufs, bucket.0, bucket.1);
        let captured = capture.end();
        match (launched, captured) {
            (Ok(()), Ok(Some(graph))) => {
                graph.replay()?;
                ws.graphs.insert(bucket, (graph, ws.forwards));
                Ok(())
            }
            (launched, captured) => {
                let why = match (launched, captured) {
                    (Err(e), _) => e.to_string(),
                    (_, Err(e)) => e.to_string(),
                    _ => "the capture recorded no graph".to_string(),
                };
                tracing::warn!(%why, "CUDA graph capture failed; launching kernels one by one");
                self.graphs.store(false, Ordering::Relaxed);
                self.launch_layers(bufs, rows, words)
            }
        }
    }

    /// Whether forwards replay captured CUDA graphs (the default) or launch every kernel:
    /// both compute the same bits; the checks compare them.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
    }

    /// How many captured shape buckets to keep (default [`MAX_GRAPHS`], at least 1): each holds
    /// device memory for its launches; a new bucket beyond replaces the least recently used.
    pub fn set_graph_limit(&self, buckets: usize) {
        self.graph_limit.store(buckets.max(1), Ordering::Relaxed);
        self.workspace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keep_graphs(buckets.max(1));
    }

    /// Graphs captured and kept now (at most the limit, [`MAX_GRAPHS`] by default).
    pub fn graphs_cached(&self) -> usize {
        self.workspace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .graphs
            .len()
    }

    /// Runs every sequence's tree in one pass, as [`Llama::forward`], with every node's logits.
    pub fn forward(&self, seqs: &mut [CudaSeqTree<'_>]) -> Result<Vec<Logits>> {
        self.forward_wanting(seqs, &vec![Want::Logits; seqs.len()])
    }

    /// [`CudaLlama::forward`] giving each sequence what its `wants` entry asks for: no head at
    /// all for [`Want::KvOnly`] (prompt prefill chunks; empty logits), each node's argmax,
    /// reduced on the device, for [`Want::Argmax`] (one id per node crosses to the host), and
    /// for [`Want::Logits`] rows left on the device, each copied to the host when first read.
    pub fn forward_wanting(
        &self,
        seqs: &mut [CudaSeqTree<'_>],
        wants: &[Want],
    ) -> Result<Vec<Logits>> {
        assert_eq!(wants.len(), seqs.len(), "one want per sequence");
        let cfg = &self.cfg;
        // Token ids as the embedding table's row indices.
        let mut tokens: Vec<i32> = Vec::new();
        let mut positions: Vec<i32> = Vec::new();
        let mut committed: Vec<i32> = Vec::new();
        let mut node_in_tree: Vec<i32> = Vec::new();
        let words = seqs
            .iter()
            .map(|s| s.tree.len().div_ceil(64))
            .max()
            .unwrap_or(1);
        let mut anc_words: Vec<u64> = Vec::new();
        for s in seqs.iter() {
            let depths = s.tree.depths();
            let base = s.cache.committed();
            let needed = base + *depths.iter().max().unwrap_or(&0) as usize + 1;
            if needed > cfg.max_positions || base + s.tree.len() > cfg.max_positions {
                return Err(ModelError::ContextFull {
                    needed: needed.max(base + s.tree.len()),
                    limit: cfg.max_positions,
                });
            }
            assert!(s.first < s.tree.len());
            let anc = s.tree.ancestors();
            let wpn = anc.words_per_node();
            for (node, &depth) in depths.iter().enumerate().skip(s.first) {
                let t = s.tree.token(node);
                if t as usize >= cfg.vocab_size {
                    return Err(ModelError::Format {
                        path: "<input>".into(),
                        message: format!("token {t} outside the vocabulary of {}", cfg.vocab_size),
                    });
                }
                tokens.push(t as i32);
                positions.push((base + depth as usize) as i32);
                committed.push(base as i32);
                node_in_tree.push(node as i32);
                let mine = &anc.words()[node * wpn..(node + 1) * wpn];
                anc_words.extend(mine);
                anc_words.extend(std::iter::repeat_n(0u64, words - wpn));
            }
        }
        let rows = tokens.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        // Slots for every new node, and each node's slot table (device address): [node].
        let mut tables: Vec<u64> = Vec::with_capacity(rows);
        for s in seqs.iter_mut() {
            let from =
                s.cache
                    .table
                    .place_tree(&mut locked(&self.kv.slots), s.first, s.tree.len())?;
            self.sync_table(s.cache, from)?;
            let table = s.cache.device_table.at(0);
            tables.extend(std::iter::repeat_n(table, s.tree.len() - s.first));
        }

        let mut guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        let ws: &mut Workspace = &mut guard;
        ws.fit(self, rows, words)?;
        let b = ws.bufs.as_mut().expect("fit allocates");
        // A replayed graph runs its bucket's rows: those past the batch's are padding, each a
        // lone root at position 0 whose table is the pool's spare slot, so that its K/V store
        // and attention touch nothing a sequence holds.
        if self.graphs.load(Ordering::Relaxed) {
            let (bucket_rows, bucket_words) = graph_bucket(rows, words);
            tokens.resize(bucket_rows, 0);
            positions.resize(bucket_rows, 0);
            committed.resize(bucket_rows, 0);
            node_in_tree.resize(bucket_rows, 0);
            tables.resize(bucket_rows, b.pad_table.at(0));
            let mut anc = Vec::with_capacity(bucket_rows * bucket_words);
            for r in 0..bucket_rows {
                if r < rows {
                    anc.extend(&anc_words[r * words..(r + 1) * words]);
                    anc.extend(std::iter::repeat_n(0u64, bucket_words - words));
                } else {
                    anc.push(1);
                    anc.extend(std::iter::repeat_n(0u64, bucket_words - 1));
                }
            }
            anc_words = anc;
        }
        // The batch's inputs into the workspace's, then every layer (replaying a CUDA graph of
        // them when one was captured for this shape).
        b.tokens.write(0, &tokens)?;
        b.positions.write(0, &positions)?;
        b.committed.write(0, &committed)?;
        b.node.write(0, &node_in_tree)?;
        b.tables.write(0, &tables)?;
        b.anc.write(0, &anc_words)?;
        self.run_layers(ws, rows, words)?;
        let ws = ws.bufs.as_mut().expect("fit allocates");
        // The rows of the sequences that want the head.
        let mut wanted: Vec<i32> = Vec::with_capacity(rows);
        let mut start = 0;
        for (s, want) in seqs.iter().zip(wants) {
            let n = s.tree.len() - s.first;
            if want.head() {
                wanted.extend(start as i32..(start + n) as i32);
            }
            start += n;
        }
        let head_rows = wanted.len();
        let mut ids = vec![0i32; head_rows];
        if head_rows > 0 {
            self.rms_norm(&ws.x, rows, &self.final_norm, &ws.h)?;
            let logits = Arc::get_mut(&mut ws.logits).expect("fit leaves the head rows unshared");
            if head_rows == rows {
                self.linear(&ws.h, rows, &self.lm_head, logits)?;
            } else {
                let idx = DeviceBuf::from_host(&self.dev, &wanted)?;
                // SAFETY: idx holds head_rows rows of h ([rows, d]).
                unsafe { self.gather_rows(&ws.selected, &ws.h, &idx, head_rows) }?;
                self.linear(&ws.selected, head_rows, &self.lm_head, logits)?;
            }
            if wants.contains(&Want::Argmax) {
                let cols = self.lm_head.out;
                assert!(ws.logits.len() >= head_rows * cols && ws.ids.len() >= head_rows);
                let head = self.head_ids.as_ref().map_or(Arg::Ptr(0), |(_, d)| d.arg());
                // Shared memory holds THREADS floats and THREADS ints.
                self.launch(
                    Kernel::ArgmaxRows,
                    per_row(head_rows, 2 * THREADS),
                    &[ws.ids.arg(), ws.logits.arg(), Arg::I32(cols as i32), head],
                )?;
                ids = ws.ids.read(0..head_rows)?;
            }
        }
        let vocab = cfg.vocab_size;
        let mut out = Vec::with_capacity(seqs.len());
        let mut start = 0;
        for (s, &want) in seqs.iter().zip(wants) {
            let n = s.tree.len() - s.first;
            out.push(match want {
                Want::KvOnly => Logits::from_rows(Vec::new(), vocab),
                Want::Argmax => {
                    let ids = ids[start..start + n].iter().map(|&t| t as u32).collect();
                    Logits::from_argmax(ids, vocab)
                }
                Want::Logits => Logits::on_device(
                    Box::new(HeadRows {
                        logits: ws.logits.clone(),
                        first: start,
                        rows: n,
                        cols: self.lm_head.out,
                        vocab,
                        head_ids: self.head_ids.as_ref().map(|(ids, _)| ids.clone()),
                    }),
                    n,
                    vocab,
                ),
            });
            if want.head() {
                start += n;
            }
        }
        drop(guard);
        Ok(out)
    }
}

/// A sequence's head rows left on the device by a forward ([`Want::Logits`]): its rows
/// `first..first + rows` of the forward's head buffer, copied to the host one at a time when
/// read.
struct HeadRows {
    logits: Arc<DeviceBuf<f32>>,
    first: usize,
    /// The sequence's rows in this forward: its tree's nodes from the forward's `first` on.
    rows: usize,
    /// Floats per head row (the vocabulary, or a restricted head's tokens).
    cols: usize,
    vocab: usize,
    head_ids: Option<Arc<Vec<u32>>>,
}

/// Threads of the `sample_walk` kernel's one block (`WALK_THREADS` in the kernels).
const WALK_THREADS: u32 = 256;

impl HeadRows {
    /// The `sample_walk` kernel over these rows: only the verdict crosses to the host.
    fn walk_on_device(&self, w: &SampleWalk) -> Result<WalkOutcome> {
        let n = w.token.len();
        // The walk starts at the root and reads row i for node i: the rows must be the whole
        // tree's (a forward from `first == 0`).
        if n != self.rows {
            return Err(gpu_err(format!(
                "a sampled walk over a tree of {n} nodes, with the logits of {} of them (the \
                 forward must start at the root)",
                self.rows
            )));
        }
        let dev = self.logits.device();
        let ints = |v: &[i32]| DeviceBuf::from_host(dev, v);
        let (kid_start, kids, token) = (ints(&w.kid_start)?, ints(&w.kids)?, ints(&w.token)?);
        let (drawn_from, q_start, q_ids) =
            (ints(&w.drawn_from)?, ints(&w.q_start)?, ints(&w.q_ids)?);
        let q_probs = DeviceBuf::from_host(dev, &w.q_probs)?;
        let uniforms = DeviceBuf::from_host(dev, &w.uniforms)?;
        let out = DeviceBuf::<i32>::zeros(dev, 2 * n + 3)?;
        let scratch = DeviceBuf::<f32>::zeros(dev, 2 * self.vocab)?;
        assert_eq!(
            self.cols, self.vocab,
            "the device walks full-vocabulary heads only"
        );
        assert!(self.logits.len() >= (self.first + n) * self.cols);
        assert!(w.uniforms.len() >= n && w.kid_start.len() == n + 1);
        // SAFETY: the rows hold the tree's n rows of a full-vocabulary head; the tree arrays are
        // SampleWalk's (children, tokens and proposals of these n nodes, one uniform per node);
        // out holds 2n + 3 ints and scratch 2 * vocab floats, as the kernel writes them.
        unsafe {
            dev.launch(
                Kernel::SampleWalk,
                Launch {
                    grid: (1, 1, 1),
                    block: (WALK_THREADS, 1, 1),
                    shared_bytes: WALK_THREADS * 4,
                },
                &[
                    out.arg(),
                    self.logits.arg_at(self.first * self.cols),
                    Arg::I32(self.vocab as i32),
                    kid_start.arg(),
                    kids.arg(),
                    token.arg(),
                    drawn_from.arg(),
                    q_start.arg(),
                    q_ids.arg(),
                    q_probs.arg(),
                    Arg::I32(w.without_replacement as i32),
                    Arg::I32(n as i32),
                    uniforms.arg(),
                    Arg::F32(w.temperature),
                    Arg::F32(w.top_p),
                    scratch.arg(),
                ],
            )
        }?;
        let out = out.to_host()?;
        let accepted = out[0] as usize;
        let next_token = out[1];
        if accepted >= n || !(0..self.vocab as i32).contains(&next_token) {
            return Err(gpu_err(format!(
                "sample_walk answered {accepted} accepted nodes of {n} and token {next_token}"
            )));
        }
        Ok(WalkOutcome {
            accepted: out[2..2 + accepted].iter().map(|&c| c as u32).collect(),
            next_token: next_token as u32,
            rejected_at_depth: out[2 + n..3 + n + accepted]
                .iter()
                .map(|&r| r as u32)
                .collect(),
        })
    }
}

impl DeviceRows for HeadRows {
    fn row(&self, i: usize) -> Result<Vec<f32>> {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        let at = (self.first + i) * self.cols;
        let row = self.logits.read(at..at + self.cols)?;
        Ok(match &self.head_ids {
            None => row,
            Some(ids) => {
                let mut full = vec![f32::NEG_INFINITY; self.vocab];
                for (&t, &l) in ids.iter().zip(&row) {
                    full[t as usize] = l;
                }
                full
            }
        })
    }

    /// On the device for a full-vocabulary head and a tree with children; a restricted head's
    /// rows are walked on the host.
    fn walk(&self, walk: &SampleWalk) -> Option<Result<WalkOutcome>> {
        (self.head_ids.is_none() && walk.token.len() > 1).then(|| self.walk_on_device(walk))
    }
}
