//! Quantized matrix x multi-row activations, the projection kernel of the verifier.
//!
//! Numeric contract (as llama.cpp's): activations are quantized to 8 bits per block of 32 values
//! (scale = max|x| / 127, round to nearest); each weight block's dot product with an activation
//! block is computed EXACTLY in integers; the float part is a fixed sequence of scalar operations
//! per block, in block order. Consequences:
//! * the result for one activation row never depends on the other rows, the batch size or the
//!   row's position (batch invariance: speculative output is bit-identical to incremental);
//! * the AVX2 and the portable paths give bit-identical results (only the exact integer part is
//!   vectorised).
//!
//! Weights are read once per call whatever the number of activation rows: the outer loop runs
//! over weight rows (each a few hundred bytes, kept in L1 while every activation row is dotted
//! with it), so small batches stay memory-bound like a single row.

use rayon::prelude::*;

/// GGML block formats this kernel handles (block of 32 weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    /// f16 scale, 16 bytes of 4-bit values, offset 8.
    Q4_0,
    /// f16 scale, f16 min, 16 bytes of 4-bit values.
    Q4_1,
    /// f16 scale, 32 signed bytes.
    Q8_0,
}

pub const BLOCK: usize = 32;

impl QuantFormat {
    /// Bytes of one block in GGML's layout.
    pub fn ggml_block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q8_0 => 34,
        }
    }

    fn packed_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 | QuantFormat::Q4_1 => 16,
            QuantFormat::Q8_0 => 32,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QuantError(String);

/// A `[rows, cols]` weight matrix, repacked from GGML blocks: quantized values contiguous per
/// row, scales (and mins) as f32 so the hot loop does no f16 conversion.
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    blocks: usize,
    qs: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
    /// Per block: `-8 * scale` (Q4_0) or `min` (Q4_1).
    offsets: Vec<f32>,
}

fn f16(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

impl QuantMatrix {
    /// Repacks GGML blocks (`rows * cols / 32` of them, row-major).
    pub fn from_ggml(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, QuantError> {
        if cols % BLOCK != 0 {
            return Err(QuantError(format!(
                "{cols} columns are not a multiple of {BLOCK}"
            )));
        }
        let blocks = cols / BLOCK;
        let bb = format.ggml_block_bytes();
        if data.len() != rows * blocks * bb {
            return Err(QuantError(format!(
                "{} bytes for {rows}x{cols} {format:?}, expected {}",
                data.len(),
                rows * blocks * bb
            )));
        }
        let pb = format.packed_bytes();
        let mut m = QuantMatrix {
            format,
            rows,
            cols,
            blocks,
            qs: Vec::with_capacity(rows * blocks * pb),
            scales: Vec::with_capacity(rows * blocks),
            mins: Vec::new(),
            offsets: Vec::new(),
        };
        for b in data.chunks_exact(bb) {
            m.scales.push(f16(b[0], b[1]));
            match format {
                QuantFormat::Q4_1 => {
                    m.mins.push(f16(b[2], b[3]));
                    m.qs.extend_from_slice(&b[4..20]);
                }
                _ => m.qs.extend_from_slice(&b[2..]),
            }
        }
        m.offsets = match format {
            QuantFormat::Q4_0 => m.scales.iter().map(|d| -8.0 * d).collect(),
            QuantFormat::Q4_1 => m.mins.clone(),
            QuantFormat::Q8_0 => Vec::new(),
        };
        Ok(m)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Weight `(r, c)` as f32 (for references and embeddings).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let pb = self.format.packed_bytes();
        let mut out = Vec::with_capacity(self.cols);
        for b in 0..self.blocks {
            let i = r * self.blocks + b;
            let qs = &self.qs[i * pb..(i + 1) * pb];
            let d = self.scales[i];
            match self.format {
                QuantFormat::Q8_0 => out.extend(qs.iter().map(|&q| d * (q as i8) as f32)),
                QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                    let m = if self.format == QuantFormat::Q4_1 {
                        self.mins[i]
                    } else {
                        0.0
                    };
                    let off = if self.format == QuantFormat::Q4_0 {
                        8
                    } else {
                        0
                    };
                    let w = |q: u8| d * (q as i32 - off) as f32 + m;
                    out.extend(qs.iter().map(|&q| w(q & 0xF)));
                    out.extend(qs.iter().map(|&q| w(q >> 4)));
                }
            }
        }
        out
    }

    /// `out[i, r] = sum_c x[i, c] * W[r, c]` for `n` activation rows; `x` is `[n, cols]`, `out`
    /// is `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "x is not [n, cols]");
        assert_eq!(out.len(), n * self.rows, "out is not [n, rows]");
        let acts = QuantizedActs::new(x, n, self.cols);
        let simd = simd_available();
        // Rows are split over the thread pool in chunks large enough to amortise scheduling.
        const CHUNK: usize = 32;
        let mut tr = vec![0f32; self.rows * n];
        tr.par_chunks_mut(CHUNK * n)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (k, dst) in chunk.chunks_mut(n).enumerate() {
                    self.row_dots(c * CHUNK + k, &acts, simd, dst);
                }
            });
        for (r, col) in tr.chunks(n).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                out[i * self.rows + r] = v;
            }
        }
    }

    /// Dots of weight row `r` with every activation row.
    ///
    /// Per block: the exact integer products are summed in 8 lanes of 4 consecutive elements,
    /// each lane converted to f32 and fused-multiply-added into a lane accumulator with the block
    /// scale; the offset/min term goes to a scalar accumulator; at the end the lanes are summed
    /// in a fixed tree. The SIMD path and the portable path follow exactly these steps.
    fn row_dots(&self, r: usize, a: &QuantizedActs, simd: bool, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true when AVX2 and FMA were detected at run time.
            return unsafe { avx2::row_dots(self, r, a, dst) };
        }
        let _ = simd;
        let pb = self.format.packed_bytes();
        let base = r * self.blocks;
        for (i, d) in dst.iter_mut().enumerate() {
            let mut acc = [0f32; 8];
            let mut offset = 0f32;
            for b in 0..self.blocks {
                let w = &self.qs[(base + b) * pb..(base + b + 1) * pb];
                let ai = i * self.blocks + b;
                let x = &a.q[ai * BLOCK..(ai + 1) * BLOCK];
                let scale = self.scales[base + b] * a.d[ai];
                let value = |p: usize| -> i32 {
                    match self.format {
                        QuantFormat::Q8_0 => (w[p] as i8) as i32,
                        _ if p < 16 => (w[p] & 0xF) as i32,
                        _ => (w[p - 16] >> 4) as i32,
                    }
                };
                for (m, lane) in acc.iter_mut().enumerate() {
                    let sum: i32 = (4 * m..4 * m + 4).map(|p| value(p) * x[p] as i32).sum();
                    *lane = (sum as f32).mul_add(scale, *lane);
                }
                offset += self.offset_term(base + b, a, ai);
            }
            *d = hsum8(acc) + offset;
        }
    }

    /// The per-block term that does not depend on the weights' values: Q4_0's -8 offset or
    /// Q4_1's min (precomputed per weight block), times the activation block's sum.
    #[inline(always)]
    fn offset_term(&self, wb: usize, a: &QuantizedActs, ai: usize) -> f32 {
        match self.format {
            QuantFormat::Q8_0 => 0.0,
            _ => self.offsets[wb] * a.dsum[ai],
        }
    }
}

/// The lane sum both paths use: halves, then pairs, then the last two.
#[inline(always)]
fn hsum8(v: [f32; 8]) -> f32 {
    let t = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Activation rows quantized to 8 bits per block of 32.
struct QuantizedActs {
    q: Vec<i8>,
    d: Vec<f32>,
    /// `d * sum(q)` per block.
    dsum: Vec<f32>,
}

impl QuantizedActs {
    fn new(x: &[f32], n: usize, cols: usize) -> Self {
        let blocks = n * cols / BLOCK;
        let mut a = QuantizedActs {
            q: Vec::with_capacity(n * cols),
            d: Vec::with_capacity(blocks),
            dsum: Vec::with_capacity(blocks),
        };
        for block in x.chunks_exact(BLOCK) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for &v in block {
                let q = (v * id).round() as i8;
                sum += q as i32;
                a.q.push(q);
            }
            a.d.push(d);
            a.dsum.push(d * sum as f32);
        }
        a
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::env::var_os("SPECINFER_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{QuantFormat, QuantMatrix, QuantizedActs, BLOCK};

    /// Activation rows handled per pass over a weight row (each unpacked block is reused).
    const GROUP: usize = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        super::hsum8(lanes)
    }

    /// The 32 weights of a block as bytes in element order, and whether they are signed.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_block(format: QuantFormat, w: *const u8) -> __m256i {
        match format {
            QuantFormat::Q8_0 => _mm256_loadu_si256(w as *const __m256i),
            _ => {
                let q = _mm_loadu_si128(w as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(q, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                _mm256_set_m128i(hi, lo)
            }
        }
    }

    /// Exact products summed in 8 lanes of 4 consecutive elements.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn lanes(format: QuantFormat, w: __m256i, x: *const i8) -> __m256i {
        let xv = _mm256_loadu_si256(x as *const __m256i);
        let p16 = match format {
            // maddubs wants unsigned x signed: move the weights' sign onto the activations.
            QuantFormat::Q8_0 => {
                _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
            }
            _ => _mm256_maddubs_epi16(w, xv),
        };
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_dots(m: &QuantMatrix, r: usize, a: &QuantizedActs, dst: &mut [f32]) {
        let pb = m.format.packed_bytes();
        let base = r * m.blocks;
        let n = dst.len();
        let mut start = 0;
        while start < n {
            let g = GROUP.min(n - start);
            let mut acc = [_mm256_setzero_ps(); GROUP];
            let mut offset = [0f32; GROUP];
            for b in 0..m.blocks {
                let w = load_block(m.format, m.qs.as_ptr().add((base + b) * pb));
                let sw = m.scales[base + b];
                for j in 0..g {
                    let ai = (start + j) * m.blocks + b;
                    let l = lanes(m.format, w, a.q.as_ptr().add(ai * BLOCK));
                    let scale = _mm256_set1_ps(sw * a.d[ai]);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), scale, acc[j]);
                    offset[j] += m.offset_term(base + b, a, ai);
                }
            }
            for j in 0..g {
                dst[start + j] = hsum(acc[j]) + offset[j];
            }
            start += g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// GGML blocks with random content (scales in a realistic range).
    fn random_ggml(format: QuantFormat, rows: usize, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * cols / BLOCK {
            let d = half::f16::from_f32(rng.random_range(0.001..0.05))
                .to_bits()
                .to_le_bytes();
            out.extend_from_slice(&d);
            if format == QuantFormat::Q4_1 {
                out.extend_from_slice(
                    &half::f16::from_f32(rng.random_range(-0.2..0.2))
                        .to_bits()
                        .to_le_bytes(),
                );
            }
            let n = format.packed_bytes();
            out.extend((0..n).map(|_| rng.random::<u8>()));
        }
        out
    }

    fn reference(m: &QuantMatrix, x: &[f32], n: usize) -> Vec<f64> {
        let w: Vec<Vec<f32>> = (0..m.rows).map(|r| m.dequantize_row(r)).collect();
        let mut out = vec![0f64; n * m.rows];
        for i in 0..n {
            for (r, wr) in w.iter().enumerate() {
                out[i * m.rows + r] = wr
                    .iter()
                    .zip(&x[i * m.cols..(i + 1) * m.cols])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn matches_the_f32_reference_for_every_format_and_odd_shapes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for format in [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0] {
            for &(rows, cols, n) in &[(1, 32, 1), (37, 96, 3), (70, 320, 17), (33, 64, 64)] {
                let m = QuantMatrix::from_ggml(
                    format,
                    rows,
                    cols,
                    &random_ggml(format, rows, cols, &mut rng),
                )
                .unwrap();
                let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut out = vec![0f32; n * rows];
                m.matmul(&x, n, &mut out);
                let want = reference(&m, &x, n);
                // Activations carry 8 bits per block: the error is bounded by the sum of
                // |w| * max|x| / 254 per column, about 1% of the output's scale here.
                let scale = want.iter().fold(0f64, |a, b| a.max(b.abs())).max(1e-3);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (*a as f64 - b).abs())
                    .fold(0f64, f64::max);
                assert!(
                    err / scale < 0.02,
                    "{format:?} {rows}x{cols} n={n}: relative error {}",
                    err / scale
                );
            }
        }
    }

    #[test]
    fn a_row_is_bit_identical_whatever_the_batch_and_the_code_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        for format in [QuantFormat::Q4_0, QuantFormat::Q4_1, QuantFormat::Q8_0] {
            let (rows, cols) = (75, 192);
            let m = QuantMatrix::from_ggml(
                format,
                rows,
                cols,
                &random_ggml(format, rows, cols, &mut rng),
            )
            .unwrap();
            let x: Vec<f32> = (0..64 * cols)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let mut all = vec![0f32; 64 * rows];
            m.matmul(&x, 64, &mut all);
            for (i, n) in [(0usize, 1usize), (5, 3), (16, 17), (63, 1)] {
                let mut part = vec![0f32; n * rows];
                m.matmul(&x[i * cols..(i + n) * cols], n, &mut part);
                assert_eq!(
                    &part[..rows],
                    &all[i * rows..(i + 1) * rows],
                    "{format:?} row {i} alone vs in a batch of 64"
                );
            }
            // The portable path gives the same bits as the SIMD one.
            let acts = QuantizedActs::new(&x[..cols], 1, cols);
            for r in 0..rows {
                let (mut a, mut b) = ([0f32], [0f32]);
                m.row_dots(r, &acts, simd_available(), &mut a);
                m.row_dots(r, &acts, false, &mut b);
                assert_eq!(a, b, "{format:?} row {r}: SIMD and portable differ");
            }
        }
    }
}

/// A plain f32 `[rows, cols]` weight matrix with the same loop structure as [`QuantMatrix`]:
/// weights read once per call, a row's result independent of the batch. Used for small draft
/// models and f32/f16/bf16 checkpoints, where calling into a tensor library costs more than the
/// arithmetic.
pub struct F32Matrix {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
}

impl F32Matrix {
    pub fn new(rows: usize, cols: usize, w: Vec<f32>) -> Self {
        assert_eq!(w.len(), rows * cols, "weights are not [rows, cols]");
        F32Matrix { rows, cols, w }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The weights, row-major `[rows, cols]`.
    pub fn weights(&self) -> &[f32] {
        &self.w
    }

    /// `out[i, r] = sum_c x[i, c] * W[r, c]`; `x` is `[n, cols]`, `out` is `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "x is not [n, cols]");
        assert_eq!(out.len(), n * self.rows, "out is not [n, rows]");
        let row = |r: usize, dst: &mut [f32]| {
            let w = &self.w[r * self.cols..(r + 1) * self.cols];
            for (i, d) in dst.iter_mut().enumerate() {
                *d = dot8(w, &x[i * self.cols..(i + 1) * self.cols]);
            }
        };
        let mut tr = vec![0f32; self.rows * n];
        // Below about a million multiply-adds the thread pool costs more than it saves.
        if self.rows * self.cols * n < 1 << 20 {
            tr.chunks_mut(n)
                .enumerate()
                .for_each(|(r, dst)| row(r, dst));
        } else {
            const CHUNK: usize = 32;
            tr.par_chunks_mut(CHUNK * n)
                .enumerate()
                .for_each(|(c, chunk)| {
                    for (k, dst) in chunk.chunks_mut(n).enumerate() {
                        row(c * CHUNK + k, dst);
                    }
                });
        }
        for (r, col) in tr.chunks(n).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                out[i * self.rows + r] = v;
            }
        }
    }
}

/// Dot product with eight independent accumulators in a fixed order (vectorises, reproducible).
#[inline]
pub fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            s[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for j in chunks * 8..a.len() {
        tail += a[j] * b[j];
    }
    hsum8(s) + tail
}
