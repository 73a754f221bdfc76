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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use specinfer_kernels::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, CudaViewMut, DevicePtr,
    DeviceRepr, LaunchConfig, PushKernelArg,
};
use specinfer_kernels::cuda::cudarc::nvrtc::Ptx;
use specinfer_kernels::cuda::{compile_cubin, compile_ptx, nvrtc_version};
use specinfer_kernels::cuda_libs::loaded_library;
use specinfer_kernels::projection;
use specinfer_wire::TokenTree;

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
    F32(CudaSlice<f32>),
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
}

/// A projection on the device.
struct DeviceLinear {
    w: DeviceWeights,
    b: Option<CudaSlice<f32>>,
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
    attn_norm: CudaSlice<f32>,
    /// The query, key and value projections stacked: each output row is q | k | v.
    qkv: DeviceLinear,
    o: DeviceLinear,
    ffn_norm: CudaSlice<f32>,
    /// The gate and up projections stacked: each output row is gate | up.
    gate_up: DeviceLinear,
    down: DeviceLinear,
}

struct Kernels {
    rms_norm: CudaFunction,
    rope: CudaFunction,
    linear_f32: CudaFunction,
    linear_bf16: CudaFunction,
    swiglu: CudaFunction,
    add_into: CudaFunction,
    gather_rows: CudaFunction,
    /// For the K/V precision chosen.
    store_kv: CudaFunction,
    tree_attention: CudaFunction,
    argmax_rows: CudaFunction,
    sample_walk: CudaFunction,
}

/// A [`Llama`] on one GPU.
pub struct CudaLlama {
    cfg: ModelConfig,
    stream: Arc<CudaStream>,
    f: Kernels,
    embed: CudaSlice<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: DeviceLinear,
    /// A restricted head's tokens (row i of the head is token ids[i]), on the host and device.
    head_ids: Option<(Arc<Vec<u32>>, CudaSlice<u32>)>,
    runtime: String,
    /// The forward's activations, kept between forwards (grown when a batch has more rows):
    /// a forward allocates no activation buffers.
    workspace: Mutex<Workspace>,
    kv: KvPool,
    /// Whether forwards capture and replay CUDA graphs ([`CudaLlama::set_graphs`]).
    graphs: AtomicBool,
}

/// Every sequence's K/V: per layer, `[slots, kv_row]` elements of the engine's [`Precision`]
/// (as u16 units), allocated once for the engine's whole KV memory; sequences hold slots
/// (pages of one position, see [`crate::kv_slots`]).
struct KvPool {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    slots: Arc<Mutex<SlotPool>>,
    /// Device bytes one position holds over all layers, K and V.
    position_bytes: usize,
}

/// A forward's inputs and activations, for up to `rows` rows whose ancestor bitsets have up to
/// `words` words, and the CUDA graphs captured over them (which hold these buffers' addresses).
#[derive(Default)]
struct Workspace {
    rows: usize,
    words: usize,
    bufs: Option<Buffers>,
    graphs: HashMap<(usize, usize), Graph>,
}

/// A captured forward's layers. cudarc's graph is not `Send`: CUDA asks that calls on one graph
/// be serialised, which the workspace's mutex does.
struct Graph(CudaGraph);

// SAFETY: a Graph is only reached through the workspace's Mutex (one thread at a time).
unsafe impl Send for Graph {}

/// Captured shapes kept at once; beyond, all are dropped and shapes are captured again.
const MAX_GRAPHS: usize = 64;

struct Buffers {
    /// Each row's token, position, its sequence's committed count, its node index in its tree
    /// and its sequence's slot table (device address); the ancestor bitsets, [rows, words].
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    committed: CudaSlice<i32>,
    node: CudaSlice<i32>,
    tables: CudaSlice<u64>,
    anc: CudaSlice<u64>,
    /// The residual stream, [rows, d_model].
    x: CudaSlice<f32>,
    /// A norm's output, and each projection back to d_model.
    h: CudaSlice<f32>,
    /// Rows of q | k | v.
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    /// The final norm's rows of the sequences that want the head, gathered.
    selected: CudaSlice<f32>,
    /// Rows of gate | up, and the SwiGLU of them.
    gate_up: CudaSlice<f32>,
    g: CudaSlice<f32>,
    /// The head's rows. Shared with the [`Logits`] of the last forward, which copy rows from it
    /// when read; a forward while those are still alive writes into a fresh buffer instead.
    logits: Arc<CudaSlice<f32>>,
    /// Each head row's argmax.
    ids: CudaSlice<i32>,
}

impl Workspace {
    /// Buffers for `rows` rows of `words` ancestor words, reallocated (to the next power of
    /// two) only when they are too small; the captured graphs go with the old ones.
    fn fit(&mut self, model: &CudaLlama, rows: usize, words: usize) -> Result<()> {
        if self.bufs.is_none() || rows > self.rows || words > self.words {
            let cap = rows.next_power_of_two().max(self.rows);
            let words_cap = words.next_power_of_two().max(self.words);
            let cfg = &model.cfg;
            let alloc = |n: usize| model.stream.alloc_zeros::<f32>(cap * n).map_err(gpu_err);
            let ints = || model.stream.alloc_zeros::<i32>(cap).map_err(gpu_err);
            let words64 = |n: usize| model.stream.alloc_zeros::<u64>(n).map_err(gpu_err);
            self.graphs.clear();
            self.bufs = None;
            self.bufs = Some(Buffers {
                tokens: ints()?,
                positions: ints()?,
                committed: ints()?,
                node: ints()?,
                tables: words64(cap)?,
                anc: words64(cap * words_cap)?,
                x: alloc(cfg.d_model)?,
                h: alloc(cfg.d_model)?,
                qkv: alloc(cfg.n_heads * cfg.head_dim + 2 * cfg.kv_row())?,
                attn: alloc(cfg.n_heads * cfg.head_dim)?,
                selected: alloc(cfg.d_model)?,
                gate_up: alloc(2 * cfg.ffn_dim)?,
                g: alloc(cfg.ffn_dim)?,
                logits: Arc::new(alloc(model.lm_head.out)?),
                ids: model.stream.alloc_zeros::<i32>(cap).map_err(gpu_err)?,
            });
            self.rows = cap;
            self.words = words_cap;
        }
        let bufs = self.bufs.as_mut().expect("allocated above");
        if Arc::get_mut(&mut bufs.logits).is_none() {
            bufs.logits = Arc::new(
                model
                    .stream
                    .alloc_zeros::<f32>(self.rows * model.lm_head.out)
                    .map_err(gpu_err)?,
            );
        }
        Ok(())
    }
}

/// One sequence's K/V on the device: the slots of the engine's pool holding its positions, and
/// that table on the device for the kernels. Its slots go back to the pool when it is dropped.
pub struct CudaKvCache {
    table: SlotTable,
    /// `table`'s slots as i32, room for `device_table.len()` positions (grown by doubling).
    device_table: CudaSlice<i32>,
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

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize, shared_floats: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared_floats * 4,
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
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { specinfer_kernels::cuda::cudarc::driver::sys::is_culib_present() } {
            return Err(gpu_err(
                "no NVIDIA driver (libcuda.so) on this machine: use --device cpu",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(gpu_err)?;
        let (major, minor) = ctx.compute_capability().map_err(gpu_err)?;
        if (major, minor) < (7, 5) {
            return Err(gpu_err(format!(
                "compute capability {major}.{minor} is not supported (sm_75 or newer)"
            )));
        }
        let (nvrtc_major, nvrtc_minor) = nvrtc_version().map_err(gpu_err)?;
        let nvrtc = format!(
            "NVRTC {nvrtc_major}.{nvrtc_minor} ({})",
            loaded_library("libnvrtc").map_or("path unknown".into(), |p| p.display().to_string())
        );
        // Machine code for exactly this GPU, which the driver loads whatever NVRTC minor made
        // it; PTX (JIT-compiled by the driver, refused when newer than it) only if NVRTC does
        // not know the architecture yet.
        let (module, runtime) = match compile_cubin(major, minor) {
            Ok(cubin) => (
                ctx.load_module(Ptx::from_binary(cubin)).map_err(gpu_err)?,
                format!("{nvrtc}, CUBIN for sm_{major}{minor}"),
            ),
            Err(cubin) => {
                let arch = match (major, minor) {
                    (m, _) if m >= 9 => "sm_90",
                    (8, 9) => "sm_89",
                    (8, 6) => "sm_86",
                    (8, _) => "sm_80",
                    _ => "sm_75",
                };
                tracing::warn!(%cubin, "no CUBIN for this GPU; loading PTX for {arch}");
                (
                    ctx.load_module(compile_ptx(arch).map_err(gpu_err)?)
                        .map_err(gpu_err)?,
                    format!("{nvrtc}, PTX for {arch} (JIT)"),
                )
            }
        };
        let load = |name: &str| module.load_function(name).map_err(gpu_err);
        let f = Kernels {
            rms_norm: load("rms_norm")?,
            rope: load("rope")?,
            linear_f32: load("linear_f32")?,
            linear_bf16: load("linear_bf16")?,
            swiglu: load("swiglu")?,
            add_into: load("add_into")?,
            gather_rows: load("gather_rows")?,
            store_kv: load(match precision {
                Precision::Bf16 => "store_kv_bf16",
                Precision::F32 => "store_kv_f32",
            })?,
            tree_attention: load(match precision {
                Precision::Bf16 => "tree_attention_bf16",
                Precision::F32 => "tree_attention_f32",
            })?,
            argmax_rows: load("argmax_rows")?,
            sample_walk: load("sample_walk")?,
        };
        // One stream of our own (the legacy default stream cannot be captured into a graph),
        // and no cudarc event tracking: with a single stream every use is ordered already, and
        // tracking records events around every launch.
        // SAFETY: every buffer of this engine is allocated, used and freed on this one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(gpu_err)?;
        let up = |v: &[f32]| stream.clone_htod(v).map_err(gpu_err);
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
                Precision::Bf16 => DeviceWeights::Bf16(
                    stream
                        .clone_htod(&projection::f32_to_bf16(&w))
                        .map_err(gpu_err)?,
                ),
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
        let cfg = &model.cfg;
        let slot_units = cfg.kv_row() * precision.kv_units();
        let position_bytes = 2 * cfg.n_layers * slot_units * 2;
        let slots = kv_bytes / position_bytes;
        if slots < cfg.max_positions.min(TABLE_CHUNK) {
            return Err(gpu_err(format!(
                "a K/V pool of {kv_bytes} bytes holds {slots} positions ({position_bytes} bytes \
                 each): raise the KV budget"
            )));
        }
        let pool = || -> Result<Vec<CudaSlice<u16>>> {
            (0..cfg.n_layers)
                .map(|_| {
                    stream
                        .alloc_zeros::<u16>(slots * slot_units)
                        .map_err(gpu_err)
                })
                .collect()
        };
        let kv = KvPool {
            k: pool()?,
            v: pool()?,
            slots: Arc::new(Mutex::new(SlotPool::new(slots))),
            position_bytes,
        };
        Ok(CudaLlama {
            cfg: model.cfg.clone(),
            kv,
            embed: up(&model.embed)?,
            final_norm: up(&model.final_norm)?,
            lm_head: linear(&[&model.lm_head])?,
            head_ids: match &model.head_ids {
                Some(ids) => Some((
                    Arc::new(ids.clone()),
                    stream.clone_htod(ids).map_err(gpu_err)?,
                )),
                None => None,
            },
            runtime,
            workspace: Default::default(),
            graphs: AtomicBool::new(true),
            layers,
            f,
            stream,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Which NVRTC compiled the kernels, from where, and to what (for logs and reports).
    pub fn runtime(&self) -> &str {
        &self.runtime
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
        let src = self.stream.alloc_zeros::<f32>(n).map_err(gpu_err)?;
        let mut dst = self.stream.alloc_zeros::<f32>(n).map_err(gpu_err)?;
        self.stream.memcpy_dtod(&src, &mut dst).map_err(gpu_err)?;
        self.stream.synchronize().map_err(gpu_err)?;
        let t = std::time::Instant::now();
        for _ in 0..10 {
            self.stream.memcpy_dtod(&src, &mut dst).map_err(gpu_err)?;
        }
        self.stream.synchronize().map_err(gpu_err)?;
        Ok(10.0 * 2.0 * (n * 4) as f64 / t.elapsed().as_secs_f64())
    }

    /// A new, empty cache (it takes slots of the pool as its sequence grows).
    pub fn new_cache(&self) -> Result<CudaKvCache> {
        Ok(CudaKvCache {
            table: SlotTable::default(),
            device_table: self
                .stream
                .alloc_zeros::<i32>(TABLE_CHUNK)
                .map_err(gpu_err)?,
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
            cache.device_table = self
                .stream
                .alloc_zeros::<i32>(slots.len().next_power_of_two())
                .map_err(gpu_err)?;
            0
        } else {
            from
        };
        if from < slots.len() {
            let host: Vec<i32> = slots[from..].iter().map(|&s| s as i32).collect();
            self.stream
                .memcpy_htod(&host, &mut cache.device_table.slice_mut(from..slots.len()))
                .map_err(gpu_err)?;
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

    /// `y = x W^T (+ b)` for the first `rows` rows of `x` into the first of `y` (row-major in,
    /// row-major out), batch invariant.
    fn linear(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        l: &DeviceLinear,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        assert!(x.len() >= rows * l.inp && y.len() >= rows * l.out);
        let (rows_i, out_i, in_i) = (rows as i32, l.out as i32, l.inp as i32);
        // One warp per (output column, tile of LINEAR_ROWS rows), four warps per block.
        let warps = l.out * rows.div_ceil(LINEAR_ROWS);
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = match &l.w {
            DeviceWeights::F32(w) => {
                let mut launch = self.stream.launch_builder(&self.f.linear_f32);
                launch.arg(y).arg(x).arg(w);
                launch
            }
            DeviceWeights::Bf16(w) => {
                let mut launch = self.stream.launch_builder(&self.f.linear_bf16);
                launch.arg(y).arg(x).arg(w);
                launch
            }
        };
        // A null bias pointer: the kernel adds none.
        let no_bias = 0u64;
        match &l.b {
            Some(b) => launch.arg(b),
            None => launch.arg(&no_bias),
        };
        launch.arg(&rows_i).arg(&out_i).arg(&in_i);
        // SAFETY: x holds [rows, in], w [out, in] and b [out] (or null), y [rows, out], as the
        // kernel reads and writes them.
        unsafe { launch.launch(cfg) }.map_err(gpu_err)?;
        Ok(())
    }

    /// The LM head's projection of `x` (`[rows, d_model]`, taken as they are) on the device,
    /// and the same by `specinfer_kernels::projection::warp_linear` on the host over the weights
    /// the device holds: the two must be equal bit for bit (the kernel's order is fixed).
    pub fn check_lm_head_projection(&self, x: &[f32], rows: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = &self.lm_head;
        assert_eq!(x.len(), rows * l.inp, "x is [rows, d_model]");
        let dx = self.stream.clone_htod(x).map_err(gpu_err)?;
        let mut y = self
            .stream
            .alloc_zeros::<f32>(rows * l.out)
            .map_err(gpu_err)?;
        self.linear(&dx, rows, l, &mut y)?;
        let device = self.stream.clone_dtoh(&y).map_err(gpu_err)?;
        let w = match &l.w {
            DeviceWeights::F32(w) => self.stream.clone_dtoh(w).map_err(gpu_err)?,
            DeviceWeights::Bf16(w) => {
                projection::bf16_to_f32(&self.stream.clone_dtoh(w).map_err(gpu_err)?)
            }
        };
        let b = match &l.b {
            Some(b) => Some(self.stream.clone_dtoh(b).map_err(gpu_err)?),
            None => None,
        };
        let host = projection::warp_linear(x, rows, &w, b.as_deref(), l.out, l.inp);
        Ok((device, host))
    }

    /// RMS norm of the first `rows` rows of `x` into `out`.
    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        assert!(x.len() >= rows * d && out.len() >= rows * d);
        let (d_i, eps) = (d as i32, self.cfg.rms_eps);
        // SAFETY: x and out hold rows * d floats, w holds d.
        unsafe {
            self.stream
                .launch_builder(&self.f.rms_norm)
                .arg(out)
                .arg(x)
                .arg(w)
                .arg(&d_i)
                .arg(&eps)
                .launch(per_row(rows, THREADS))
        }
        .map_err(gpu_err)?;
        Ok(())
    }

    /// `x[..n] += y[..n]`.
    fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        assert!(x.len() >= n && y.len() >= n);
        let n = n as u64;
        // SAFETY: x and y hold n floats.
        unsafe {
            self.stream
                .launch_builder(&self.f.add_into)
                .arg(x)
                .arg(y)
                .arg(&n)
                .launch(elementwise(n as usize))
        }
        .map_err(gpu_err)?;
        Ok(())
    }

    /// Rotates the first `heads` heads of each of `rows` rows of `x`, rows `row_stride` floats
    /// apart (q or k inside rows of q | k | v).
    fn rope(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        row_stride: usize,
        positions: &CudaSlice<i32>,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        let (heads, hd) = (heads as i32, self.cfg.head_dim as i32);
        let stride = row_stride as i32;
        let theta = self.cfg.rope_theta;
        let interleaved = (self.cfg.rope_style == RopeStyle::Interleaved) as i32;
        assert!(x.len() >= (rows - 1) * row_stride + (heads * hd) as usize);
        // SAFETY: x holds rows rows of heads * hd floats, row_stride apart; positions holds rows
        // entries.
        unsafe {
            self.stream
                .launch_builder(&self.f.rope)
                .arg(x)
                .arg(&stride)
                .arg(positions)
                .arg(&heads)
                .arg(&hd)
                .arg(&theta)
                .arg(&interleaved)
                .launch(per_row(rows, 0))
        }
        .map_err(gpu_err)?;
        Ok(())
    }

    /// `dst[i, :] = src[idx[i], :]` for the first `n` entries of `idx`, rows of d_model floats.
    ///
    /// # Safety
    /// Those entries must index rows inside `src` (the kernel reads them unchecked).
    unsafe fn gather_rows(
        &self,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        idx: &CudaSlice<i32>,
        n: usize,
    ) -> Result<()> {
        let d = self.cfg.d_model;
        assert!(idx.len() >= n && dst.len() >= n * d);
        let d_i = d as i32;
        // SAFETY: dst holds n rows and idx n entries (asserted); the caller vouches for src.
        unsafe {
            self.stream
                .launch_builder(&self.f.gather_rows)
                .arg(dst)
                .arg(src)
                .arg(idx)
                .arg(&d_i)
                .launch(per_row(n, 0))
        }
        .map_err(gpu_err)?;
        Ok(())
    }

    /// Copies `host` into the start of `device`.
    fn put<T: DeviceRepr>(&self, host: &[T], device: &mut CudaSlice<T>) -> Result<()> {
        self.stream
            .memcpy_htod(host, &mut device.slice_mut(..host.len()))
            .map_err(gpu_err)
    }

    /// The embeddings and every layer over the workspace's inputs (`rows` nodes, ancestor
    /// bitsets of `words` words): kernel launches only, no copy and no allocation, so that a
    /// stream capture can record them.
    fn launch_layers(&self, ws: &mut Buffers, rows: usize, words: usize) -> Result<()> {
        let cfg = &self.cfg;
        let (d, hd, kv_row) = (cfg.d_model, cfg.head_dim, cfg.kv_row());
        // The embeddings: the table's rows of the tokens.
        // SAFETY: every token is inside the table (checked by forward_wanting).
        unsafe { self.gather_rows(&mut ws.x, &self.embed, &ws.tokens, rows) }?;
        let (words_i, nodes_i) = (words as i32, rows as i32);
        let (heads_i, kvh_i, hd_i) = (cfg.n_heads as i32, cfg.n_kv_heads as i32, hd as i32);
        let kv_row_i = kv_row as i32;
        // Each row of the stacked projection: q (q_row floats), then k and v (kv_row each).
        let q_row = cfg.n_heads * hd;
        let qkv_row = q_row + 2 * kv_row;
        let qkv_row_i = qkv_row as i32;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            // The layer's pools, written by the K/V store (through the slots the tables give).
            let (k_pool, _k_sync) = self.kv.k[li].device_ptr(&self.stream);
            let (v_pool, _v_sync) = self.kv.v[li].device_ptr(&self.stream);
            self.rms_norm(&ws.x, rows, &layer.attn_norm, &mut ws.h)?;
            self.linear(&ws.h, rows, &layer.qkv, &mut ws.qkv)?;
            self.rope(
                &mut ws.qkv.slice_mut(..),
                qkv_row,
                &ws.positions,
                rows,
                cfg.n_heads,
            )?;
            self.rope(
                &mut ws.qkv.slice_mut(q_row..),
                qkv_row,
                &ws.positions,
                rows,
                cfg.n_kv_heads,
            )?;
            // The new nodes' K/V go to each cache's scratch region, behind its committed rows:
            // node n to the slot its table gives position committed[n] + node_in_tree[n].
            // SAFETY: one block per node; its k and v are kv_row floats at q_row and q_row +
            // kv_row of its q | k | v row; every table holds committed + tree slots of the pool
            // (placed above).
            unsafe {
                self.stream
                    .launch_builder(&self.f.store_kv)
                    .arg(&k_pool)
                    .arg(&v_pool)
                    .arg(&ws.tables)
                    .arg(&ws.committed)
                    .arg(&ws.node)
                    .arg(&ws.qkv.slice(q_row..))
                    .arg(&ws.qkv.slice(q_row + kv_row..))
                    .arg(&qkv_row_i)
                    .arg(&kv_row_i)
                    .launch(per_row(rows, 0))
            }
            .map_err(gpu_err)?;
            let warps = (rows * cfg.n_heads) as u32;
            // SAFETY: one warp per (node, head); every pointer and index was built above for
            // exactly these nodes; tables hold committed + tree slots of the pool.
            unsafe {
                self.stream
                    .launch_builder(&self.f.tree_attention)
                    .arg(&mut ws.attn)
                    .arg(&ws.qkv)
                    .arg(&qkv_row_i)
                    .arg(&k_pool)
                    .arg(&v_pool)
                    .arg(&ws.tables)
                    .arg(&ws.committed)
                    .arg(&ws.node)
                    .arg(&ws.anc)
                    .arg(&words_i)
                    .arg(&nodes_i)
                    .arg(&heads_i)
                    .arg(&kvh_i)
                    .arg(&hd_i)
                    .arg(&scale)
                    .launch(LaunchConfig {
                        grid_dim: (warps.div_ceil(4), 1, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: 0,
                    })
            }
            .map_err(gpu_err)?;
            self.linear(&ws.attn, rows, &layer.o, &mut ws.h)?;
            self.add_into(&mut ws.x, &ws.h, rows * d)?;
            self.rms_norm(&ws.x, rows, &layer.ffn_norm, &mut ws.h)?;
            self.linear(&ws.h, rows, &layer.gate_up, &mut ws.gate_up)?;
            let n = (rows * cfg.ffn_dim) as u64;
            let ffn_i = cfg.ffn_dim as i32;
            // SAFETY: g holds n floats, gate_up rows * 2 * ffn_dim.
            unsafe {
                self.stream
                    .launch_builder(&self.f.swiglu)
                    .arg(&mut ws.g)
                    .arg(&ws.gate_up)
                    .arg(&ffn_i)
                    .arg(&n)
                    .launch(elementwise(n as usize))
            }
            .map_err(gpu_err)?;
            self.linear(&ws.g, rows, &layer.down, &mut ws.h)?;
            self.add_into(&mut ws.x, &ws.h, rows * d)?;
        }
        Ok(())
    }

    /// [`CudaLlama::launch_layers`], through a CUDA graph per (rows, words): captured the first
    /// time a shape comes, replayed after (one launch for some 300). A capture that fails turns
    /// graphs off for the engine, with a warning; the kernels then launch one by one.
    fn run_layers(&self, ws: &mut Workspace, rows: usize, words: usize) -> Result<()> {
        use specinfer_kernels::cuda::cudarc::driver::sys;
        let bufs = ws.bufs.as_mut().expect("fit allocates");
        if !self.graphs.load(Ordering::Relaxed) {
            return self.launch_layers(bufs, rows, words);
        }
        if let Some(graph) = ws.graphs.get(&(rows, words)) {
            return graph.0.launch().map_err(gpu_err);
        }
        if ws.graphs.len() >= MAX_GRAPHS {
            ws.graphs.clear();
        }
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(gpu_err)?;
        let launched = self.launch_layers(bufs, rows, words);
        let captured = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (launched, captured) {
            (Ok(()), Ok(Some(graph))) => {
                graph.launch().map_err(gpu_err)?;
                ws.graphs.insert((rows, words), Graph(graph));
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
        // Slots for every new node, and each node's slot table (device address): [node].
        let mut tables: Vec<u64> = Vec::with_capacity(rows);
        for s in seqs.iter_mut() {
            let from =
                s.cache
                    .table
                    .place_tree(&mut locked(&self.kv.slots), s.first, s.tree.len())?;
            self.sync_table(s.cache, from)?;
            let (table, _sync) = s.cache.device_table.device_ptr(&self.stream);
            tables.extend(std::iter::repeat_n(table, s.tree.len() - s.first));
        }

        let mut guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        let ws: &mut Workspace = &mut guard;
        ws.fit(self, rows, words)?;
        // The batch's inputs into the workspace's, then every layer (replaying a CUDA graph of
        // them when one was captured for this shape).
        let b = ws.bufs.as_mut().expect("fit allocates");
        self.put(&tokens, &mut b.tokens)?;
        self.put(&positions, &mut b.positions)?;
        self.put(&committed, &mut b.committed)?;
        self.put(&node_in_tree, &mut b.node)?;
        self.put(&tables, &mut b.tables)?;
        self.put(&anc_words, &mut b.anc)?;
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
            self.rms_norm(&ws.x, rows, &self.final_norm, &mut ws.h)?;
            let logits = Arc::get_mut(&mut ws.logits).expect("fit leaves the head rows unshared");
            if head_rows == rows {
                self.linear(&ws.h, rows, &self.lm_head, logits)?;
            } else {
                let idx = self.stream.clone_htod(&wanted).map_err(gpu_err)?;
                // SAFETY: idx holds head_rows rows of h ([rows, d]).
                unsafe { self.gather_rows(&mut ws.selected, &ws.h, &idx, head_rows) }?;
                self.linear(&ws.selected, head_rows, &self.lm_head, logits)?;
            }
            if wants.contains(&Want::Argmax) {
                let cols = self.lm_head.out as i32;
                let no_head = 0u64;
                let mut launch = self.stream.launch_builder(&self.f.argmax_rows);
                launch.arg(&mut ws.ids).arg(&*ws.logits).arg(&cols);
                match &self.head_ids {
                    Some((_, on_device)) => launch.arg(on_device),
                    None => launch.arg(&no_head),
                };
                // SAFETY: logits holds head_rows rows of `cols` floats, ids head_rows ints, the
                // head's ids (or null) `cols` tokens; shared memory holds THREADS floats and ints.
                unsafe { launch.launch(per_row(head_rows, 2 * THREADS)) }.map_err(gpu_err)?;
                self.stream
                    .memcpy_dtoh(&ws.ids.slice(..head_rows), &mut ids)
                    .map_err(gpu_err)?;
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
                        cols: self.lm_head.out,
                        vocab,
                        head_ids: self.head_ids.as_ref().map(|(ids, _)| ids.clone()),
                        walk_kernel: self.f.sample_walk.clone(),
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
/// `first..` of the forward's head buffer, copied to the host one at a time when read.
struct HeadRows {
    logits: Arc<CudaSlice<f32>>,
    first: usize,
    /// Floats per head row (the vocabulary, or a restricted head's tokens).
    cols: usize,
    vocab: usize,
    head_ids: Option<Arc<Vec<u32>>>,
    walk_kernel: CudaFunction,
}

/// Threads of the `sample_walk` kernel's one block (`WALK_THREADS` in the kernels).
const WALK_THREADS: u32 = 256;

impl HeadRows {
    /// The `sample_walk` kernel over these rows: only the verdict crosses to the host.
    fn walk_on_device(&self, w: &SampleWalk) -> Result<WalkOutcome> {
        let stream = self.logits.stream();
        let n = w.token.len();
        let ints = |v: &[i32]| stream.clone_htod(v).map_err(gpu_err);
        let (kid_start, kids, token) = (ints(&w.kid_start)?, ints(&w.kids)?, ints(&w.token)?);
        let (drawn_from, q_start, q_ids) =
            (ints(&w.drawn_from)?, ints(&w.q_start)?, ints(&w.q_ids)?);
        let q_probs = stream.clone_htod(&w.q_probs).map_err(gpu_err)?;
        let uniforms = stream.clone_htod(&w.uniforms).map_err(gpu_err)?;
        let mut out = stream.alloc_zeros::<i32>(2 * n + 3).map_err(gpu_err)?;
        let mut scratch = stream.alloc_zeros::<f32>(2 * self.vocab).map_err(gpu_err)?;
        let rows = self
            .logits
            .slice(self.first * self.cols..(self.first + n) * self.cols);
        let (vocab, n_i) = (self.vocab as i32, n as i32);
        let without = w.without_replacement as i32;
        let (inv_t, top_p) = (1.0 / w.temperature, w.top_p);
        let mut launch = stream.launch_builder(&self.walk_kernel);
        launch.arg(&mut out).arg(&rows).arg(&vocab);
        launch
            .arg(&kid_start)
            .arg(&kids)
            .arg(&token)
            .arg(&drawn_from);
        launch
            .arg(&q_start)
            .arg(&q_ids)
            .arg(&q_probs)
            .arg(&without)
            .arg(&n_i);
        launch
            .arg(&uniforms)
            .arg(&inv_t)
            .arg(&top_p)
            .arg(&mut scratch);
        // SAFETY: rows holds the tree's n rows of a full-vocabulary head; the tree arrays are
        // SampleWalk's (children, tokens and proposals of these n nodes, one uniform per node);
        // out holds 2n + 3 ints and scratch 2 * vocab floats, as the kernel writes them.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (WALK_THREADS, 1, 1),
                shared_mem_bytes: WALK_THREADS * 4,
            })
        }
        .map_err(gpu_err)?;
        let out = stream.clone_dtoh(&out).map_err(gpu_err)?;
        let accepted = out[0] as usize;
        let next_token = out[1];
        if accepted >= n || !(0..vocab).contains(&next_token) {
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
        let at = (self.first + i) * self.cols;
        let mut row = vec![0f32; self.cols];
        self.logits
            .stream()
            .memcpy_dtoh(&self.logits.slice(at..at + self.cols), &mut row)
            .map_err(gpu_err)?;
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
