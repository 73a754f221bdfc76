//! The GPU engine (feature `cuda`): the same transformer and tree-masked forward as [`Llama`], on
//! an NVIDIA GPU through cudarc. Weights are uploaded once as f32 (dequantized), projections run
//! on cuBLAS, everything between them in specinfer's NVRTC-compiled kernels
//! (`kernels/cuda/specinfer.cu`), attention for all nodes of all sequences in one launch. One
//! forward per round, as on the CPU; each sequence's KV cache lives on the device with the same
//! committed-then-scratch layout and compaction.
//!
//! cudarc loads the driver at run time and panics when it is missing, so [`CudaLlama::upload`]
//! checks for it first and returns a clear error on machines without an NVIDIA driver.

use std::sync::Arc;

use specinfer_kernels::cuda::cudarc::cublas::sys::cublasOperation_t;
use specinfer_kernels::cuda::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use specinfer_kernels::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use specinfer_kernels::cuda::cudarc::nvrtc::Ptx;
use specinfer_kernels::cuda::{compile_cubin, compile_ptx, nvrtc_version};
use specinfer_kernels::cuda_libs::loaded_library;
use specinfer_wire::TokenTree;

use crate::llama::{Linear, Logits};
use crate::{Llama, ModelConfig, ModelError, Result, RopeStyle};

fn gpu_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Runtime {
        backend: "cuda",
        message: e.to_string(),
    }
}

/// A projection on the device: `W` row-major `[out, in]`.
struct DeviceLinear {
    w: CudaSlice<f32>,
    b: Option<CudaSlice<f32>>,
    out: usize,
    inp: usize,
}

struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    q: DeviceLinear,
    k: DeviceLinear,
    v: DeviceLinear,
    o: DeviceLinear,
    ffn_norm: CudaSlice<f32>,
    gate: DeviceLinear,
    up: DeviceLinear,
    down: DeviceLinear,
}

struct Kernels {
    embed_rows: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    add_bias: CudaFunction,
    add_into: CudaFunction,
    gather_rows: CudaFunction,
    tree_attention: CudaFunction,
}

/// A [`Llama`] on one GPU.
pub struct CudaLlama {
    cfg: ModelConfig,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Kernels,
    embed: CudaSlice<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: DeviceLinear,
    head_ids: Option<Vec<u32>>,
    runtime: String,
}

/// One sequence's KV cache on the device, `max_positions` rows per layer allocated up front.
pub struct CudaKvCache {
    k: Vec<CudaSlice<f32>>,
    v: Vec<CudaSlice<f32>>,
    committed: usize,
    scratch: usize,
}

impl CudaKvCache {
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Device bytes held (the whole context is allocated up front).
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.len() * 4).sum()
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
    /// Uploads `model` to GPU `ordinal`, compiling the kernels for its architecture.
    pub fn upload(model: &Llama, ordinal: usize) -> Result<CudaLlama> {
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { specinfer_kernels::cuda::cudarc::driver::sys::is_culib_present() } {
            return Err(gpu_err(
                "no NVIDIA driver (libcuda.so) on this machine: use --device cpu",
            ));
        }
        // SAFETY: as above, for cuBLAS (cudarc would panic at the first projection without it).
        if !unsafe { specinfer_kernels::cuda::cudarc::cublas::sys::is_culib_present() } {
            return Err(gpu_err(
                "cuBLAS cannot be loaded (cudarc opens libcublas.so or libcublas.so.12): on a GPU \
                 machine `specinfer_kernels::cuda_libs::prepare` links the cuBLAS the driver supports \
                 (.so.12 or .so.13, the CUDA toolkit's or the PyPI wheel nvidia-cublas-cu12/-cu13's)",
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
            embed_rows: load("embed_rows")?,
            rms_norm: load("rms_norm")?,
            rope: load("rope")?,
            silu_mul: load("silu_mul")?,
            add_bias: load("add_bias")?,
            add_into: load("add_into")?,
            gather_rows: load("gather_rows")?,
            tree_attention: load("tree_attention")?,
        };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(gpu_err)?;
        let up = |v: &[f32]| stream.clone_htod(v).map_err(gpu_err);
        let linear = |l: &Linear| -> Result<DeviceLinear> {
            let (out, inp) = l.w.shape();
            Ok(DeviceLinear {
                w: up(&l.w.to_f32()?)?,
                b: l.b.as_deref().map(up).transpose()?,
                out,
                inp,
            })
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DeviceLayer {
                attn_norm: up(&l.attn_norm)?,
                q: linear(&l.q)?,
                k: linear(&l.k)?,
                v: linear(&l.v)?,
                o: linear(&l.o)?,
                ffn_norm: up(&l.ffn_norm)?,
                gate: linear(&l.gate)?,
                up: linear(&l.up)?,
                down: linear(&l.down)?,
            });
        }
        Ok(CudaLlama {
            cfg: model.cfg.clone(),
            embed: up(&model.embed)?,
            final_norm: up(&model.final_norm)?,
            lm_head: linear(&model.lm_head)?,
            head_ids: model.head_ids.clone(),
            runtime,
            layers,
            f,
            blas,
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
        let lin = |l: &DeviceLinear| l.w.len() + l.b.as_ref().map_or(0, |b| b.len());
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
                    .iter()
                    .map(|x| lin(x))
                    .sum::<usize>()
                    + l.attn_norm.len()
                    + l.ffn_norm.len()
            })
            .sum();
        // A decode step reads one embedding row, not the table.
        4 * (layers + lin(&self.lm_head) + self.final_norm.len())
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

    /// A cache with room for the model's whole context.
    pub fn new_cache(&self) -> Result<CudaKvCache> {
        let n = self.cfg.max_positions * self.cfg.kv_row();
        let alloc = || self.stream.alloc_zeros::<f32>(n).map_err(gpu_err);
        let mut k = Vec::with_capacity(self.cfg.n_layers);
        let mut v = Vec::with_capacity(self.cfg.n_layers);
        for _ in 0..self.cfg.n_layers {
            k.push(alloc()?);
            v.push(alloc()?);
        }
        Ok(CudaKvCache {
            k,
            v,
            committed: 0,
            scratch: 0,
        })
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
            let row = self.cfg.kv_row();
            let base = cache.committed;
            let idx: Vec<i32> = path.iter().map(|&n| (base + n as usize) as i32).collect();
            let idx = self.stream.clone_htod(&idx).map_err(gpu_err)?;
            let mut tmp = self
                .stream
                .alloc_zeros::<f32>(path.len() * row)
                .map_err(gpu_err)?;
            let row_i = row as i32;
            for layer in cache.k.iter_mut().chain(cache.v.iter_mut()) {
                // SAFETY: idx holds path.len() rows inside the layer buffer; tmp has that many.
                unsafe {
                    self.stream
                        .launch_builder(&self.f.gather_rows)
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

    /// `y = x W^T (+ b)` for `rows` rows on cuBLAS (row-major in, row-major out).
    fn linear(&self, x: &CudaSlice<f32>, rows: usize, l: &DeviceLinear) -> Result<CudaSlice<f32>> {
        let mut y = self
            .stream
            .alloc_zeros::<f32>(rows * l.out)
            .map_err(gpu_err)?;
        // Row-major y[rows, out] is column-major y^T[out, rows] = W (stored as column-major
        // W^T[in, out], hence transposed) times x^T (column-major [in, rows]).
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: l.out as i32,
            n: rows as i32,
            k: l.inp as i32,
            alpha: 1.0f32,
            lda: l.inp as i32,
            ldb: l.inp as i32,
            beta: 0.0f32,
            ldc: l.out as i32,
        };
        // SAFETY: the buffers have the sizes the config describes.
        unsafe { self.blas.gemm(cfg, &l.w, x, &mut y) }.map_err(gpu_err)?;
        if let Some(b) = &l.b {
            let n = (rows * l.out) as u64;
            let cols = l.out as i32;
            // SAFETY: y holds n floats, b holds cols.
            unsafe {
                self.stream
                    .launch_builder(&self.f.add_bias)
                    .arg(&mut y)
                    .arg(b)
                    .arg(&n)
                    .arg(&cols)
                    .launch(elementwise(n as usize))
            }
            .map_err(gpu_err)?;
        }
        Ok(y)
    }

    fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        w: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let d = self.cfg.d_model;
        let mut out = self.stream.alloc_zeros::<f32>(rows * d).map_err(gpu_err)?;
        let (d_i, eps) = (d as i32, self.cfg.rms_eps);
        // SAFETY: x and out hold rows * d floats, w holds d.
        unsafe {
            self.stream
                .launch_builder(&self.f.rms_norm)
                .arg(&mut out)
                .arg(x)
                .arg(w)
                .arg(&d_i)
                .arg(&eps)
                .launch(per_row(rows, THREADS))
        }
        .map_err(gpu_err)?;
        Ok(out)
    }

    fn add_into(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        let n = x.len() as u64;
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

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        rows: usize,
        heads: usize,
    ) -> Result<()> {
        let (heads, hd) = (heads as i32, self.cfg.head_dim as i32);
        let theta = self.cfg.rope_theta;
        let interleaved = (self.cfg.rope_style == RopeStyle::Interleaved) as i32;
        // SAFETY: x is [rows, heads, hd]; positions holds rows entries.
        unsafe {
            self.stream
                .launch_builder(&self.f.rope)
                .arg(x)
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
        let cfg = &self.cfg;
        let (d, hd, kv_row) = (cfg.d_model, cfg.head_dim, cfg.kv_row());
        let mut tokens: Vec<u32> = Vec::new();
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
                tokens.push(t);
                positions.push((s.cache.committed + depth as usize) as i32);
                committed.push(s.cache.committed as i32);
                node_in_tree.push(node as i32);
                let mine = &anc.words()[node * wpn..(node + 1) * wpn];
                anc_words.extend(mine);
                anc_words.extend(std::iter::repeat_n(0u64, words - wpn));
            }
        }
        let rows = tokens.len();
        let up_i32 = |v: &[i32]| self.stream.clone_htod(v).map_err(gpu_err);
        let d_tokens = self.stream.clone_htod(&tokens).map_err(gpu_err)?;
        let d_positions = up_i32(&positions)?;
        let d_committed = up_i32(&committed)?;
        let d_node = up_i32(&node_in_tree)?;
        let d_anc = self.stream.clone_htod(&anc_words).map_err(gpu_err)?;

        let mut x = self.stream.alloc_zeros::<f32>(rows * d).map_err(gpu_err)?;
        let d_i = d as i32;
        // SAFETY: x is [rows, d]; every token is inside the table (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.f.embed_rows)
                .arg(&mut x)
                .arg(&self.embed)
                .arg(&d_tokens)
                .arg(&d_i)
                .launch(per_row(rows, 0))
        }
        .map_err(gpu_err)?;
        let mut attn = self
            .stream
            .alloc_zeros::<f32>(rows * cfg.n_heads * hd)
            .map_err(gpu_err)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = self.rms_norm(&x, rows, &layer.attn_norm)?;
            let mut q = self.linear(&h, rows, &layer.q)?;
            let mut k = self.linear(&h, rows, &layer.k)?;
            let v = self.linear(&h, rows, &layer.v)?;
            self.rope(&mut q, &d_positions, rows, cfg.n_heads)?;
            self.rope(&mut k, &d_positions, rows, cfg.n_kv_heads)?;
            // The new nodes' K/V go to each cache's scratch region, behind its committed rows.
            let mut start = 0;
            let mut k_base: Vec<u64> = Vec::with_capacity(rows);
            let mut v_base: Vec<u64> = Vec::with_capacity(rows);
            for s in seqs.iter_mut() {
                let n = s.tree.len() - s.first;
                let at = (s.cache.committed + s.first) * kv_row;
                let src = start * kv_row..(start + n) * kv_row;
                let mut kd = s.cache.k[li].slice_mut(at..at + n * kv_row);
                self.stream
                    .memcpy_dtod(&k.slice(src.clone()), &mut kd)
                    .map_err(gpu_err)?;
                let mut vd = s.cache.v[li].slice_mut(at..at + n * kv_row);
                self.stream
                    .memcpy_dtod(&v.slice(src), &mut vd)
                    .map_err(gpu_err)?;
                let (kp, _k_sync) = s.cache.k[li].device_ptr(&self.stream);
                let (vp, _v_sync) = s.cache.v[li].device_ptr(&self.stream);
                k_base.extend(std::iter::repeat_n(kp, n));
                v_base.extend(std::iter::repeat_n(vp, n));
                start += n;
            }
            let d_k = self.stream.clone_htod(&k_base).map_err(gpu_err)?;
            let d_v = self.stream.clone_htod(&v_base).map_err(gpu_err)?;
            let (words_i, nodes_i) = (words as i32, rows as i32);
            let (heads_i, kvh_i, hd_i) = (cfg.n_heads as i32, cfg.n_kv_heads as i32, hd as i32);
            let scale = 1.0 / (hd as f32).sqrt();
            let warps = (rows * cfg.n_heads) as u32;
            // SAFETY: one warp per (node, head); every pointer and index was built above for
            // exactly these nodes; caches hold committed + tree positions.
            unsafe {
                self.stream
                    .launch_builder(&self.f.tree_attention)
                    .arg(&mut attn)
                    .arg(&q)
                    .arg(&d_k)
                    .arg(&d_v)
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
            let o = self.linear(&attn, rows, &layer.o)?;
            self.add_into(&mut x, &o)?;
            let h = self.rms_norm(&x, rows, &layer.ffn_norm)?;
            let mut g = self.linear(&h, rows, &layer.gate)?;
            let u = self.linear(&h, rows, &layer.up)?;
            let n = g.len() as u64;
            // SAFETY: g and u hold n floats.
            unsafe {
                self.stream
                    .launch_builder(&self.f.silu_mul)
                    .arg(&mut g)
                    .arg(&u)
                    .arg(&n)
                    .launch(elementwise(n as usize))
            }
            .map_err(gpu_err)?;
            let down = self.linear(&g, rows, &layer.down)?;
            self.add_into(&mut x, &down)?;
        }
        for s in seqs.iter_mut() {
            s.cache.scratch = s.tree.len();
        }
        let h = self.rms_norm(&x, rows, &self.final_norm)?;
        let logits = self.linear(&h, rows, &self.lm_head)?;
        let head = self.stream.clone_dtoh(&logits).map_err(gpu_err)?;
        let vocab = cfg.vocab_size;
        let full = match &self.head_ids {
            None => head,
            Some(ids) => {
                let mut full = vec![f32::NEG_INFINITY; rows * vocab];
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
        for s in seqs.iter() {
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
