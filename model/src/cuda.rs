//! The GPU engine (feature `cuda`): the same transformer and tree-masked forward as [`Llama`], on
//! an NVIDIA GPU through cudarc. Weights are uploaded once, as bf16 (half the bytes a decode step
//! reads) or f32 ([`Precision`]); everything runs in specinfer's NVRTC-compiled kernels
//! (`kernels/cuda/specinfer.cu`), attention for all nodes of all sequences in one launch. The
//! projections are a kernel of our own rather than cuBLAS: each output is summed in one fixed
//! order whatever the batch (see `specinfer_kernels::projection`), so, as on the CPU engine,
//! greedy speculation is token-identical to incremental decoding and a session's output does not
//! depend on the sessions batched with it. One
//! forward per round, as on the CPU; each sequence's KV cache lives on the device with the same
//! committed-then-scratch layout and compaction.
//!
//! cudarc loads the driver at run time and panics when it is missing, so [`CudaLlama::upload`]
//! checks for it first and returns a clear error on machines without an NVIDIA driver.

use std::sync::Arc;

use specinfer_kernels::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaViewMut, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use specinfer_kernels::cuda::cudarc::nvrtc::Ptx;
use specinfer_kernels::cuda::{compile_cubin, compile_ptx, nvrtc_version};
use specinfer_kernels::cuda_libs::loaded_library;
use specinfer_kernels::projection;
use specinfer_wire::TokenTree;

use crate::llama::{Linear, Logits};
use crate::{Llama, ModelConfig, ModelError, Result, RopeStyle};

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
    gather_rows_u16: CudaFunction,
    /// For the K/V precision chosen.
    store_kv: CudaFunction,
    tree_attention: CudaFunction,
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
    head_ids: Option<Vec<u32>>,
    runtime: String,
    precision: Precision,
    /// The forward's activations, kept between forwards (grown when a batch has more rows):
    /// a forward allocates no activation buffers.
    workspace: std::sync::Mutex<Workspace>,
}

/// Activation buffers of a forward over up to `rows` rows.
#[derive(Default)]
struct Workspace {
    rows: usize,
    bufs: Option<Buffers>,
}

struct Buffers {
    /// The residual stream, [rows, d_model].
    x: CudaSlice<f32>,
    /// A norm's output, and each projection back to d_model.
    h: CudaSlice<f32>,
    /// Rows of q | k | v.
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    /// The final norm's rows of the sequences that want logits, gathered.
    selected: CudaSlice<f32>,
    /// Rows of gate | up, and the SwiGLU of them.
    gate_up: CudaSlice<f32>,
    g: CudaSlice<f32>,
    logits: CudaSlice<f32>,
}

impl Workspace {
    /// Buffers for `rows` rows, reallocated (to the next power of two) only when they are too
    /// small.
    fn fit(&mut self, model: &CudaLlama, rows: usize) -> Result<&mut Buffers> {
        if self.bufs.is_none() || rows > self.rows {
            let cap = rows.next_power_of_two();
            let cfg = &model.cfg;
            let alloc = |n: usize| model.stream.alloc_zeros::<f32>(cap * n).map_err(gpu_err);
            self.bufs = None;
            self.bufs = Some(Buffers {
                x: alloc(cfg.d_model)?,
                h: alloc(cfg.d_model)?,
                qkv: alloc(cfg.n_heads * cfg.head_dim + 2 * cfg.kv_row())?,
                attn: alloc(cfg.n_heads * cfg.head_dim)?,
                selected: alloc(cfg.d_model)?,
                gate_up: alloc(2 * cfg.ffn_dim)?,
                g: alloc(cfg.ffn_dim)?,
                logits: alloc(model.lm_head.out)?,
            });
            self.rows = cap;
        }
        Ok(self.bufs.as_mut().expect("allocated above"))
    }
}

/// One sequence's KV cache on the device: per layer, room for `positions` positions, grown as
/// the sequence grows (doubling, to at most the model's context), so a short chat holds what it
/// uses rather than the whole context.
pub struct CudaKvCache {
    /// Per layer, `[positions, kv_row]` elements of the engine's [`Precision`], as u16 units.
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    positions: usize,
    committed: usize,
    scratch: usize,
}

/// Positions a new cache has room for, and the granularity of its growth.
const KV_CHUNK: usize = 256;

impl CudaKvCache {
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.len() * 2).sum()
    }

    /// Forgets everything after the first `len` committed positions (and the scratch region).
    pub fn rollback(&mut self, len: usize) {
        assert!(len <= self.committed, "cannot roll forward");
        self.committed = len;
        self.scratch = 0;
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
    /// Uploads `model` to GPU `ordinal`, its projection weights (and later its K/V caches) in
    /// `precision`, compiling the kernels for the GPU's architecture.
    pub fn upload(model: &Llama, ordinal: usize, precision: Precision) -> Result<CudaLlama> {
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
            gather_rows_u16: load("gather_rows_u16")?,
            store_kv: load(match precision {
                Precision::Bf16 => "store_kv_bf16",
                Precision::F32 => "store_kv_f32",
            })?,
            tree_attention: load(match precision {
                Precision::Bf16 => "tree_attention_bf16",
                Precision::F32 => "tree_attention_f32",
            })?,
        };
        let stream = ctx.default_stream();
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
        Ok(CudaLlama {
            cfg: model.cfg.clone(),
            embed: up(&model.embed)?,
            final_norm: up(&model.final_norm)?,
            lm_head: linear(&[&model.lm_head])?,
            head_ids: model.head_ids.clone(),
            runtime,
            precision,
            workspace: Default::default(),
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

    /// u16 units of one position's K (or V) row in a cache.
    fn kv_row_units(&self) -> usize {
        self.cfg.kv_row() * self.precision.kv_units()
    }

    /// A new, empty cache (it grows as its sequence does).
    pub fn new_cache(&self) -> Result<CudaKvCache> {
        let positions = KV_CHUNK.min(self.cfg.max_positions);
        let n = positions * self.kv_row_units();
        let alloc = || self.stream.alloc_zeros::<u16>(n).map_err(gpu_err);
        let mut k = Vec::with_capacity(self.cfg.n_layers);
        let mut v = Vec::with_capacity(self.cfg.n_layers);
        for _ in 0..self.cfg.n_layers {
            k.push(alloc()?);
            v.push(alloc()?);
        }
        Ok(CudaKvCache {
            k,
            v,
            positions,
            committed: 0,
            scratch: 0,
        })
    }

    /// Gives `cache` room for `needed` positions (at most the model's context, checked by the
    /// caller): each layer moves to a buffer twice as large or more, its positions in use copied.
    fn reserve(&self, cache: &mut CudaKvCache, needed: usize) -> Result<()> {
        if needed <= cache.positions {
            return Ok(());
        }
        let positions = needed
            .max(2 * cache.positions)
            .next_multiple_of(KV_CHUNK)
            .min(self.cfg.max_positions);
        let row = self.kv_row_units();
        let used = (cache.committed + cache.scratch) * row;
        for layer in cache.k.iter_mut().chain(cache.v.iter_mut()) {
            let mut grown = self
                .stream
                .alloc_zeros::<u16>(positions * row)
                .map_err(gpu_err)?;
            if used > 0 {
                self.stream
                    .memcpy_dtod(&layer.slice(..used), &mut grown.slice_mut(..used))
                    .map_err(gpu_err)?;
            }
            *layer = grown;
        }
        cache.positions = positions;
        Ok(())
    }

    /// Keeps the scratch nodes of `path` (strictly increasing node indices of the last tree) as
    /// committed positions, as [`crate::KvCache::compact`].
    pub fn compact(&self, cache: &mut CudaKvCache, path: &[u32]) -> Result<()> {
        assert!(
            path.windows(2).all(|w| w[0] < w[1]),
            "path must be strictly increasing"
        );
        assert!(
            path.last().is_none_or(|&n| (n as usize) < cache.scratch),
            "path leaves the tree"
        );
        if !path.is_empty() {
            let row = self.kv_row_units();
            let base = cache.committed;
            let idx: Vec<i32> = path.iter().map(|&n| (base + n as usize) as i32).collect();
            let idx = self.stream.clone_htod(&idx).map_err(gpu_err)?;
            let mut tmp = self
                .stream
                .alloc_zeros::<u16>(path.len() * row)
                .map_err(gpu_err)?;
            let row_i = row as i32;
            for layer in cache.k.iter_mut().chain(cache.v.iter_mut()) {
                // SAFETY: idx holds path.len() rows inside the layer buffer; tmp has that many.
                unsafe {
                    self.stream
                        .launch_builder(&self.f.gather_rows_u16)
                        .arg(&mut tmp)
                        .arg(&*layer)
                        .arg(&idx)
                        .arg(&row_i)
                        .launch(per_row(path.len(), 0))
                }
                .map_err(gpu_err)?;
                let mut dst = layer.slice_mut(base * row..(base + path.len()) * row);
                self.stream.memcpy_dtod(&tmp, &mut dst).map_err(gpu_err)?;
            }
        }
        cache.committed += path.len();
        cache.scratch = 0;
        Ok(())
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

    /// Runs every sequence's tree in one pass, as [`Llama::forward`]; logits come back to the
    /// host (whole vocabulary per computed node).
    pub fn forward(&self, seqs: &mut [CudaSeqTree<'_>]) -> Result<Vec<Logits>> {
        self.forward_selected(seqs, &vec![true; seqs.len()])
    }

    /// [`CudaLlama::forward`] computing logits only for the sequences whose `logits` entry is
    /// true, as [`Llama::forward_selected`]: the others (prompt prefill chunks) get empty logits,
    /// and neither their head rows nor their copy to the host are paid.
    pub fn forward_selected(
        &self,
        seqs: &mut [CudaSeqTree<'_>],
        logits: &[bool],
    ) -> Result<Vec<Logits>> {
        assert_eq!(logits.len(), seqs.len(), "one logits flag per sequence");
        let cfg = &self.cfg;
        let (d, hd, kv_row) = (cfg.d_model, cfg.head_dim, cfg.kv_row());
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
            let needed = s.cache.committed + *depths.iter().max().unwrap_or(&0) as usize + 1;
            if needed > cfg.max_positions || s.cache.committed + s.tree.len() > cfg.max_positions {
                return Err(ModelError::ContextFull {
                    needed: needed.max(s.cache.committed + s.tree.len()),
                    limit: cfg.max_positions,
                });
            }
            assert!(s.first <= s.cache.scratch && s.first < s.tree.len());
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
                positions.push((s.cache.committed + depth as usize) as i32);
                committed.push(s.cache.committed as i32);
                node_in_tree.push(node as i32);
                let mine = &anc.words()[node * wpn..(node + 1) * wpn];
                anc_words.extend(mine);
                anc_words.extend(std::iter::repeat_n(0u64, words - wpn));
            }
        }
        let rows = tokens.len();
        for s in seqs.iter_mut() {
            self.reserve(s.cache, s.cache.committed + s.tree.len())?;
        }
        let up_i32 = |v: &[i32]| self.stream.clone_htod(v).map_err(gpu_err);
        let d_tokens = self.stream.clone_htod(&tokens).map_err(gpu_err)?;
        let d_positions = up_i32(&positions)?;
        let d_committed = up_i32(&committed)?;
        let d_node = up_i32(&node_in_tree)?;
        let d_anc = self.stream.clone_htod(&anc_words).map_err(gpu_err)?;

        // Every layer's K/V base addresses for every node, uploaded once: [layer][node].
        let mut k_base: Vec<u64> = Vec::with_capacity(cfg.n_layers * rows);
        let mut v_base: Vec<u64> = Vec::with_capacity(cfg.n_layers * rows);
        for li in 0..cfg.n_layers {
            for s in seqs.iter() {
                let n = s.tree.len() - s.first;
                let (kp, _k_sync) = s.cache.k[li].device_ptr(&self.stream);
                let (vp, _v_sync) = s.cache.v[li].device_ptr(&self.stream);
                k_base.extend(std::iter::repeat_n(kp, n));
                v_base.extend(std::iter::repeat_n(vp, n));
            }
        }
        let d_k = self.stream.clone_htod(&k_base).map_err(gpu_err)?;
        let d_v = self.stream.clone_htod(&v_base).map_err(gpu_err)?;

        let mut guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        let ws = guard.fit(self, rows)?;
        let d_i = d as i32;
        // The embeddings: the table's rows of the tokens.
        // SAFETY: x holds [rows, d]; every token is inside the table (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.f.gather_rows)
                .arg(&mut ws.x)
                .arg(&self.embed)
                .arg(&d_tokens)
                .arg(&d_i)
                .launch(per_row(rows, 0))
        }
        .map_err(gpu_err)?;
        let (words_i, nodes_i) = (words as i32, rows as i32);
        let (heads_i, kvh_i, hd_i) = (cfg.n_heads as i32, cfg.n_kv_heads as i32, hd as i32);
        let kv_row_i = kv_row as i32;
        // Each row of the stacked projection: q (q_row floats), then k and v (kv_row each).
        let q_row = cfg.n_heads * hd;
        let qkv_row = q_row + 2 * kv_row;
        let qkv_row_i = qkv_row as i32;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            let k_bases = d_k.slice(li * rows..(li + 1) * rows);
            let v_bases = d_v.slice(li * rows..(li + 1) * rows);
            self.rms_norm(&ws.x, rows, &layer.attn_norm, &mut ws.h)?;
            self.linear(&ws.h, rows, &layer.qkv, &mut ws.qkv)?;
            self.rope(
                &mut ws.qkv.slice_mut(..),
                qkv_row,
                &d_positions,
                rows,
                cfg.n_heads,
            )?;
            self.rope(
                &mut ws.qkv.slice_mut(q_row..),
                qkv_row,
                &d_positions,
                rows,
                cfg.n_kv_heads,
            )?;
            // The new nodes' K/V go to each cache's scratch region, behind its committed rows:
            // node n to position committed[n] + node_in_tree[n] of its cache.
            // SAFETY: one block per node; its k and v are kv_row floats at q_row and q_row +
            // kv_row of its q | k | v row; every cache holds committed + tree positions (checked
            // above).
            unsafe {
                self.stream
                    .launch_builder(&self.f.store_kv)
                    .arg(&k_bases)
                    .arg(&v_bases)
                    .arg(&d_committed)
                    .arg(&d_node)
                    .arg(&ws.qkv.slice(q_row..))
                    .arg(&ws.qkv.slice(q_row + kv_row..))
                    .arg(&qkv_row_i)
                    .arg(&kv_row_i)
                    .launch(per_row(rows, 0))
            }
            .map_err(gpu_err)?;
            let warps = (rows * cfg.n_heads) as u32;
            // SAFETY: one warp per (node, head); every pointer and index was built above for
            // exactly these nodes; caches hold committed + tree positions.
            unsafe {
                self.stream
                    .launch_builder(&self.f.tree_attention)
                    .arg(&mut ws.attn)
                    .arg(&ws.qkv)
                    .arg(&qkv_row_i)
                    .arg(&k_bases)
                    .arg(&v_bases)
                    .arg(&d_committed)
                    .arg(&d_node)
                    .arg(&d_anc)
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
        for s in seqs.iter_mut() {
            s.cache.scratch = s.tree.len();
        }
        // The rows of the sequences that want logits.
        let mut wanted: Vec<i32> = Vec::with_capacity(rows);
        let mut start = 0;
        for (s, &want) in seqs.iter().zip(logits) {
            let n = s.tree.len() - s.first;
            if want {
                wanted.extend(start as i32..(start + n) as i32);
            }
            start += n;
        }
        let head_rows = wanted.len();
        let mut head = vec![0f32; head_rows * self.lm_head.out];
        if head_rows > 0 {
            self.rms_norm(&ws.x, rows, &self.final_norm, &mut ws.h)?;
            if head_rows == rows {
                self.linear(&ws.h, rows, &self.lm_head, &mut ws.logits)?;
            } else {
                let idx = self.stream.clone_htod(&wanted).map_err(gpu_err)?;
                // SAFETY: idx holds head_rows rows of h ([rows, d]); selected has room for them.
                unsafe {
                    self.stream
                        .launch_builder(&self.f.gather_rows)
                        .arg(&mut ws.selected)
                        .arg(&ws.h)
                        .arg(&idx)
                        .arg(&d_i)
                        .launch(per_row(head_rows, 0))
                }
                .map_err(gpu_err)?;
                self.linear(&ws.selected, head_rows, &self.lm_head, &mut ws.logits)?;
            }
            self.stream
                .memcpy_dtoh(&ws.logits.slice(..head.len()), &mut head)
                .map_err(gpu_err)?;
        }
        drop(guard);
        let vocab = cfg.vocab_size;
        let full = match &self.head_ids {
            None => head,
            Some(ids) => {
                let mut full = vec![f32::NEG_INFINITY; head_rows * vocab];
                for (r, row) in head.chunks(ids.len()).enumerate() {
                    for (&t, &l) in ids.iter().zip(row) {
                        full[r * vocab + t as usize] = l;
                    }
                }
                full
            }
        };
        let mut out = Vec::with_capacity(seqs.len());
        let mut start = 0;
        for (s, &want) in seqs.iter().zip(logits) {
            if !want {
                out.push(Logits::from_rows(Vec::new(), vocab));
                continue;
            }
            let n = s.tree.len() - s.first;
            out.push(Logits::from_rows(
                full[start * vocab..(start + n) * vocab].to_vec(),
                vocab,
            ));
            start += n;
        }
        Ok(out)
    }
}
