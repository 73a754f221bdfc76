//! Quantized matrix x multi-row activations, the projection kernel of the verifier.
//!
//! Every GGML format is repacked at load time into one form: per block of `E` weights (32, or 16
//! for Q6_K) a scale, an optional min and unsigned integers `u` with a per-format zero point `z`,
//! so that `w = scale * (u - z) + min` reproduces GGML's dequantization exactly. Scales and mins
//! are kept as GGML stores them, so the repacked matrix is no larger than the GGUF's: f16 for the
//! 32-weight formats; for the K formats an f16 per super-block of 256 weights times a small
//! integer per block, multiplied out in f32 in the kernel (exact: 11-bit by at most 8-bit
//! mantissas), the same f32 value an f32 copy of the product would hold.
//!
//! Numeric contract (as llama.cpp's): activations are quantized to 8 bits (`da = max|x| / 127`,
//! round to nearest even) per block of 32 values for the 32-weight formats, per super-block of
//! 256 for the K formats (GGML's Q8_K), so that a K format's integer block codes multiply in
//! integers and only one float step is left per super-block. For each output (weight row,
//! activation row):
//! ```text
//! acc = 0; off = 0
//! 32-weight formats, for each weight block s:
//!     isum = sum over the block of (u - z) * qx          exact, in integers
//!     acc  = fma(isum as f32, scale_s * da_s, acc)
//!     off  = fma(min_s, da_s * sum(qx), off)              formats with a min only
//! K formats, for each super-block S (blocks s of 32 or 16 weights, codes c_s and m_s):
//!     isum = sum over s of c_s * sum over s of (u - z) * qx      exact, in integers
//!     msum = sum over s of m_s * sum over s of qx                Q4_K only, exact
//!     acc  = fma(isum as f32, d_S * da_S, acc)
//!     off  = fma(msum as f32, dmin_S * da_S, off)
//! result = acc + off
//! ```
//! (Integer sums stay below 2^31: at most 8 x 63 x 32 x 15 x 127 for Q4_K, 16 x 128 x 16 x 32 x
//! 127 for Q6_K. The conversion to f32 rounds to nearest even alike on every path.)
//! Only the exact integer part differs between code paths, so:
//! * a row's result never depends on the other rows, the batch size or its position in the batch
//!   (batch invariance: speculative output is bit-identical to incremental);
//! * the AVX-512 VNNI, AVX-VNNI, AVX2 and portable paths give bit-identical results.
//!
//! Layout: rows are interleaved in groups of 16, so one 512-bit register (or two 256-bit ones)
//! holds 4 consecutive weights of each of 16 rows and an integer dot instruction against 4
//! broadcast activation bytes yields 16 row sums at once: no horizontal sums, one float step per
//! (block, 16 rows). The weights of a row group (a few KB, L1-resident) are streamed from memory
//! once per call and reused from L1 by later tiles of activation rows, so small batches stay
//! memory-bound like a single row. Every value keeps its bits: 4-bit values two per byte, the 5-
//! and 6-bit ones as such a nibble plus a plane of their high bits (one or two bits per value,
//! beside the nibbles of the same block), 8-bit ones a byte each.

use std::cell::Cell;

use crate::lanes::{self, dispatch, Arith, SyncPtr};
use crate::weight_buffer::WeightBuffer;
use crate::{profile, team};

/// GGML formats this kernel handles (GGML's names).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    /// 32 weights: f16 scale, 16 bytes of 4-bit values, zero point 8.
    Q4_0,
    /// 32 weights: f16 scale, f16 min, 16 bytes of 4-bit values.
    Q4_1,
    /// 256 weights: f16 scale and min of the scales, 6-bit scales and mins per 32, 4-bit values.
    Q4_K,
    /// 32 weights: f16 scale, 32 high bits, 16 bytes of low nibbles, zero point 16.
    Q5_0,
    /// 256 weights: 4+2-bit values, an i8 scale per 16, an f16 scale; zero point 32.
    Q6_K,
    /// 32 weights: f16 scale, 32 signed bytes.
    Q8_0,
}

/// How a product's first pass over a row group asks for the blocks it will read, ahead of
/// reading them, so that memory latency times bandwidth stays covered (x86 paths).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct LookAhead {
    /// How far ahead, in bytes of the group's packed weights.
    bytes: usize,
    /// Whether the packed weights are asked for, or only their scales, mins and codes.
    weights: bool,
}

#[cfg(target_arch = "x86_64")]
impl LookAhead {
    const EVERYTHING: LookAhead = LookAhead {
        bytes: 4096,
        weights: true,
    };
}

/// Bytes of one repacked block of a row group of `elems`-weight blocks: nibbles or bytes, then
/// the plane of high bits where there is one. A `const fn` so that each kernel instantiation
/// gets it as a constant (see `tile`).
const fn packed_block_bytes(nibbles: bool, elems: usize, high_plane: bool) -> usize {
    (if nibbles {
        ROWS * elems / 2
    } else {
        ROWS * elems
    }) + if high_plane { GROUP_BYTES } else { 0 }
}

/// Activations are quantized per block of this many values.
pub const BLOCK: usize = 32;
/// Rows interleaved in one group: the i32 lanes of a 512-bit register, or two 256-bit ones.
const ROWS: usize = 16;
/// Bytes of one 4-weight group of a row group (4 bytes per row).
const GROUP_BYTES: usize = 4 * ROWS;

impl QuantFormat {
    /// Bytes of one GGML block.
    pub fn ggml_block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q4_K => 144,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q6_K => 210,
            QuantFormat::Q8_0 => 34,
        }
    }

    /// Weights in one GGML block.
    pub fn ggml_block_elems(self) -> usize {
        match self {
            QuantFormat::Q4_K | QuantFormat::Q6_K => 256,
            _ => 32,
        }
    }

    /// Activations sharing one 8-bit scale: a super-block for the K formats (see the module
    /// documentation), else a block.
    fn act_block(self) -> usize {
        match self {
            QuantFormat::Q4_K | QuantFormat::Q6_K => 256,
            _ => BLOCK,
        }
    }

    /// Weights sharing one scale after repacking.
    fn elems(self) -> usize {
        match self {
            QuantFormat::Q6_K => 16,
            _ => 32,
        }
    }

    fn zero_point(self) -> i32 {
        match self {
            QuantFormat::Q4_0 => 8,
            QuantFormat::Q4_1 | QuantFormat::Q4_K => 0,
            QuantFormat::Q5_0 => 16,
            QuantFormat::Q6_K => 32,
            QuantFormat::Q8_0 => 128,
        }
    }

    fn has_mins(self) -> bool {
        matches!(self, QuantFormat::Q4_1 | QuantFormat::Q4_K)
    }

    /// The low four bits of each value two per byte (4-weight group `k` of a block in the low
    /// nibbles of load `k % (groups / 2)`, the later half in the high nibbles); all but Q8_0.
    fn nibbles(self) -> bool {
        self != QuantFormat::Q8_0
    }

    /// Bits of each value above its low nibble, stored in a plane after the nibbles: bit(s)
    /// `k * high_bits` of a byte belong to 4-weight group `k`.
    fn high_bits(self) -> usize {
        match self {
            QuantFormat::Q5_0 => 1,
            QuantFormat::Q6_K => 2,
            _ => 0,
        }
    }

    /// Bytes of one repacked block of a row group.
    fn packed_bytes(self) -> usize {
        packed_block_bytes(self.nibbles(), self.elems(), self.high_bits() > 0)
    }

    /// How a first pass over a row group with `rows` activation rows asks for its blocks, on
    /// the VNNI paths: block by block for one or two rows, and in the burst that starts every
    /// task (passes of more rows fetch the next row group whole instead, see `tile`). The CPU's
    /// own prefetchers stream Q8_0's packed weights faster unasked; one-row passes (a decoding
    /// step) of Q4_K, Q6_K and Q4_1 ask 1 KB ahead, Q5_0's 2 KB. Measured on matrices of 94-124
    /// MB (far beyond the caches), 2 threads, AMD EPYC Zen 4, against [`LookAhead::EVERYTHING`],
    /// as fractions of a plain read of the same bytes:
    /// - Q8_0, one row: 1.01-1.02 instead of 0.91-0.94 (0.96 instead of 0.64 in a process whose
    ///   memory read at 71 GB/s); 2 rows 0.97-1.03 instead of 0.83-0.87; 3 and 4 rows 0.94 and
    ///   0.92 instead of 0.73 and 0.72.
    /// - Q5_0, one row: 0.98 at 2 KB instead of 0.89 at 4 KB.
    ///
    /// Q4_K's one-row passes once measured fastest unasked (0.96-0.98 of a plain read, against
    /// 0.87-0.92 at 4 KB). Measured again since (a 113 MB matrix, blocks of 4 products
    /// alternating in one process, 2 threads): asking 1 KB ahead took 0.87-0.95 of the time of
    /// asking nothing, 2 KB 0.87-0.91, 4 KB 0.95-0.98, 16 KB 1.10; Q6_K and Q4_1 at 1 KB took
    /// 0.94-0.97 and 0.93-0.95 of their time at 4 KB (Q8_0 at 1 or 2 KB: 1.18-1.20). In the
    /// model, alternating blocks of 4 decoding steps: Qwen2.5-Coder-1.5B 0.96-0.99 of the time,
    /// SmolLM2-135M (Q4_1) 0.96-0.99, Qwen2.5-Coder-0.5B 1.00.
    ///
    /// The AVX2 path, whose passes take more instructions a block, asks for everything: without
    /// Q4_K's weights asked for, Qwen2.5-Coder-1.5B's decoding step there took 1.09x.
    #[cfg(target_arch = "x86_64")]
    fn look_ahead(self, rows: usize) -> LookAhead {
        match (self, rows) {
            (QuantFormat::Q8_0, 1..=4) => LookAhead {
                weights: false,
                ..LookAhead::EVERYTHING
            },
            (QuantFormat::Q4_K | QuantFormat::Q6_K | QuantFormat::Q4_1, 1) => LookAhead {
                bytes: 1024,
                ..LookAhead::EVERYTHING
            },
            (QuantFormat::Q5_0, 1) => LookAhead {
                bytes: 2048,
                ..LookAhead::EVERYTHING
            },
            _ => LookAhead::EVERYTHING,
        }
    }

    /// Blocks sharing one stored f16 scale (and min): the K formats' super-blocks of 256.
    fn blocks_per_super(self) -> usize {
        match self {
            QuantFormat::Q4_K | QuantFormat::Q6_K => 256 / self.elems(),
            _ => 1,
        }
    }

    /// Decodes one GGML block into `u` (the block's weights, element order), its f16 scale and
    /// min (per GGML block: the K formats' d and minus dmin) and, for the K formats, the integer
    /// multipliers of each repacked block's scale and min.
    fn decode(self, b: &[u8], u: &mut [u8], p: &mut DecodedParams) {
        let bits = |lo: u8, hi: u8| u16::from_le_bytes([lo, hi]);
        let (scales, mins) = (&mut p.scales, &mut p.mins);
        match self {
            QuantFormat::Q4_0 | QuantFormat::Q4_1 => {
                let q = if self == QuantFormat::Q4_1 {
                    mins.push(bits(b[2], b[3]));
                    &b[4..20]
                } else {
                    &b[2..18]
                };
                scales.push(bits(b[0], b[1]));
                for (j, &v) in q.iter().enumerate() {
                    u[j] = v & 0xF;
                    u[j + 16] = v >> 4;
                }
            }
            QuantFormat::Q5_0 => {
                scales.push(bits(b[0], b[1]));
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &v) in b[6..22].iter().enumerate() {
                    u[j] = (v & 0xF) | (((qh >> j) << 4) & 0x10) as u8;
                    u[j + 16] = (v >> 4) | ((qh >> (j + 12)) & 0x10) as u8;
                }
            }
            QuantFormat::Q8_0 => {
                scales.push(bits(b[0], b[1]));
                for (j, &v) in b[2..34].iter().enumerate() {
                    u[j] = (v as i8 as i32 + 128) as u8;
                }
            }
            QuantFormat::Q4_K => {
                // w = d * s * u - dmin * m: the min's f16 is dmin with its sign flipped.
                scales.push(bits(b[0], b[1]));
                mins.push(bits(b[2], b[3]) ^ 0x8000);
                let sc = &b[4..16];
                for j in 0..8 {
                    let (s, m) = if j < 4 {
                        (sc[j] & 63, sc[j + 4] & 63)
                    } else {
                        (
                            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
                            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
                        )
                    };
                    p.scale_codes.push(s);
                    p.min_codes.push(m);
                }
                for c in 0..4 {
                    for (l, &v) in b[16 + 32 * c..16 + 32 * (c + 1)].iter().enumerate() {
                        u[64 * c + l] = v & 0xF;
                        u[64 * c + 32 + l] = v >> 4;
                    }
                }
            }
            QuantFormat::Q6_K => {
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                scales.push(bits(b[208], b[209]));
                // Signed: kept as the i8's bits.
                p.scale_codes.extend_from_slice(sc);
                for h in 0..2 {
                    let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
                    let y = &mut u[128 * h..];
                    for l in 0..32 {
                        y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                        y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                        y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                        y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                    }
                }
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QuantError(String);

/// One GGML row's parameters as [`QuantFormat::decode`] yields them.
#[derive(Default)]
struct DecodedParams {
    /// f16 bits, per GGML block.
    scales: Vec<u16>,
    /// f16 bits, per GGML block; formats with a min.
    mins: Vec<u16>,
    /// Per repacked block; K formats (Q6_K's are i8 bits).
    scale_codes: Vec<u8>,
    /// Per repacked block; Q4_K.
    min_codes: Vec<u8>,
}

impl DecodedParams {
    fn clear(&mut self) {
        self.scales.clear();
        self.mins.clear();
        self.scale_codes.clear();
        self.min_codes.clear();
    }
}

/// A `[rows, cols]` weight matrix repacked for the kernel (see the module documentation).
pub struct QuantMatrix {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    /// Repacked blocks per row.
    blocks: usize,
    /// Super-blocks (blocks sharing a stored scale) per row.
    supers: usize,
    /// `[row group][block]` of `format.packed_bytes()` each.
    qs: WeightBuffer,
    /// f16 bits, `[row group][super-block][16 rows]`: the block scale, or the K formats' d.
    scales: WeightBuffer<u16>,
    /// f16 bits, same layout; formats with a min only (Q4_K: minus dmin).
    mins: WeightBuffer<u16>,
    /// `[row group][block][16 rows]`, K formats: the block scale's multiple of d (Q6_K: i8).
    scale_codes: WeightBuffer,
    /// Same layout, Q4_K: the block min's multiple of minus dmin.
    min_codes: WeightBuffer,
}

fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

impl QuantMatrix {
    /// Repacks GGML blocks (`rows * cols / ggml_block_elems` of them, row-major). Rows need not
    /// be a multiple of 16 (the last group is padded with zero weights).
    pub fn from_ggml(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, QuantError> {
        let ge = format.ggml_block_elems();
        if !cols.is_multiple_of(ge) {
            return Err(QuantError(format!(
                "{cols} columns are not a multiple of {format:?}'s block of {ge}"
            )));
        }
        let row_bytes = cols / ge * format.ggml_block_bytes();
        if data.len() != rows * row_bytes {
            return Err(QuantError(format!(
                "{} bytes for {rows}x{cols} {format:?}, expected {}",
                data.len(),
                rows * row_bytes
            )));
        }
        let (e, blocks) = (format.elems(), cols / format.elems());
        let supers = blocks / format.blocks_per_super();
        let groups = rows.div_ceil(ROWS);
        let coded = format.blocks_per_super() > 1;
        let mut m = QuantMatrix {
            format,
            rows,
            cols,
            blocks,
            supers,
            qs: WeightBuffer::zeroed(groups * blocks * format.packed_bytes()),
            scales: WeightBuffer::zeroed(groups * supers * ROWS),
            mins: WeightBuffer::zeroed(if format.has_mins() {
                groups * supers * ROWS
            } else {
                0
            }),
            scale_codes: WeightBuffer::zeroed(if coded { groups * blocks * ROWS } else { 0 }),
            min_codes: WeightBuffer::zeroed(if coded && format.has_mins() {
                groups * blocks * ROWS
            } else {
                0
            }),
        };
        let (mut u, mut params) = (vec![0u8; cols], DecodedParams::default());
        let (half, high) = (e / 8, format.high_bits());
        for (r, row) in data.chunks_exact(row_bytes).enumerate() {
            params.clear();
            for (b, chunk) in row.chunks_exact(format.ggml_block_bytes()).enumerate() {
                format.decode(chunk, &mut u[b * ge..(b + 1) * ge], &mut params);
            }
            let (g, lane) = (r / ROWS, r % ROWS);
            for s in 0..supers {
                let at = (g * supers + s) * ROWS + lane;
                m.scales[at] = params.scales[s];
                if format.has_mins() {
                    m.mins[at] = params.mins[s];
                }
            }
            for s in 0..blocks {
                let at = (g * blocks + s) * ROWS + lane;
                if coded {
                    m.scale_codes[at] = params.scale_codes[s];
                    if format.has_mins() {
                        m.min_codes[at] = params.min_codes[s];
                    }
                }
                let packed = &mut m.qs[(g * blocks + s) * format.packed_bytes()..];
                for (c, &v) in u[s * e..(s + 1) * e].iter().enumerate() {
                    // 4-weight group k = c / 4 of the block holds elements 4k..4k+4 of each row.
                    let (k, byte) = (c / 4, lane * 4 + c % 4);
                    if format.nibbles() {
                        let nibble = (v & 0xF) << if k >= half { 4 } else { 0 };
                        packed[(k % half) * GROUP_BYTES + byte] |= nibble;
                        if high > 0 {
                            packed[half * GROUP_BYTES + byte] |= (v >> 4) << (k * high);
                        }
                    } else {
                        packed[k * GROUP_BYTES + byte] = v;
                    }
                }
            }
        }
        Ok(m)
    }

    /// Bytes the repacked matrix holds (weights, scales and mins), for comparison with its
    /// GGML size.
    pub fn bytes(&self) -> usize {
        self.streams().iter().map(|s| s.len()).sum()
    }

    /// The stored streams (packed weights, scales, mins and their codes) as bytes: what a
    /// product reads of this matrix.
    pub fn streams(&self) -> [&[u8]; 5] {
        let bytes = |v: &[u16]| {
            // SAFETY: any u16 is two initialised bytes, and u8 needs no alignment.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), 2 * v.len()) }
        };
        [
            &self.qs,
            bytes(&self.scales),
            bytes(&self.mins),
            &self.scale_codes,
            &self.min_codes,
        ]
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Stored integer of weight `(r, c)`.
    fn u(&self, r: usize, c: usize) -> u8 {
        let (g, lane, e) = (r / ROWS, r % ROWS, self.format.elems());
        let (s, c) = (c / e, c % e);
        let packed = &self.qs[(g * self.blocks + s) * self.format.packed_bytes()..];
        let (k, byte, half) = (c / 4, lane * 4 + c % 4, e / 8);
        if !self.format.nibbles() {
            return packed[k * GROUP_BYTES + byte];
        }
        let nibble =
            (packed[(k % half) * GROUP_BYTES + byte] >> if k >= half { 4 } else { 0 }) & 0xF;
        match self.format.high_bits() {
            0 => nibble,
            high => {
                nibble
                    | ((packed[half * GROUP_BYTES + byte] >> (k * high)) & ((1 << high) - 1)) << 4
            }
        }
    }

    /// Row `r`'s stored scale (`mins`: its stored min) of block `s`'s super-block: the block's
    /// own in the 32-weight formats, d (minus dmin) in the K formats.
    fn stored(&self, r: usize, s: usize, mins: bool) -> f32 {
        let at = (r / ROWS * self.supers + s / self.format.blocks_per_super()) * ROWS + r % ROWS;
        f16(if mins { self.mins[at] } else { self.scales[at] })
    }

    /// Row `r`'s integer multiple of the stored scale (`mins`: of the stored min) for block
    /// `s`: the K formats' block code (Q6_K's signed), 1 in the 32-weight formats.
    fn code(&self, r: usize, s: usize, mins: bool) -> i32 {
        let at = (r / ROWS * self.blocks + s) * ROWS + r % ROWS;
        match (self.format, mins) {
            (QuantFormat::Q4_K | QuantFormat::Q6_K, true) => self.min_codes[at] as i32,
            (QuantFormat::Q6_K, false) => self.scale_codes[at] as i8 as i32,
            (QuantFormat::Q4_K, false) => self.scale_codes[at] as i32,
            _ => 1,
        }
    }

    /// Row `r`'s scale of block `s` (exact: an 11-bit mantissa times at most 8 bits).
    fn scale(&self, r: usize, s: usize) -> f32 {
        self.stored(r, s, false) * self.code(r, s, false) as f32
    }

    /// Row `r`'s min of block `s` (formats with a min).
    fn min(&self, r: usize, s: usize) -> f32 {
        self.stored(r, s, true) * self.code(r, s, true) as f32
    }

    /// Row `r` as f32, exactly as GGML dequantizes it (for references and embeddings).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let (e, z) = (self.format.elems(), self.format.zero_point());
        (0..self.cols)
            .map(|c| {
                let w = self.scale(r, c / e) * (self.u(r, c) as i32 - z) as f32;
                if self.format.has_mins() {
                    w + self.min(r, c / e)
                } else {
                    w
                }
            })
            .collect()
    }

    /// `out[i, r] = sum_c x[i, c] * W[r, c]` for `n` activation rows; `x` is `[n, cols]`, `out`
    /// is `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        matmul_many(&[self], x, n, &mut [out]);
    }

    /// Row groups per task: enough work to amortise scheduling.
    const CHUNK: usize = 4;

    /// Bytes of one row group: its weights, scales, mins and codes.
    fn group_bytes(&self) -> usize {
        self.bytes() / self.rows.div_ceil(ROWS)
    }

    /// A task of a product: row groups `g0..g0 + count`, written into their columns of `out`.
    fn chunk(
        &self,
        g0: usize,
        count: usize,
        acts: &QuantizedActs,
        path: Path,
        n: usize,
        out: &SyncPtr,
    ) {
        if (g0 + count) * ROWS <= self.rows {
            // Whole groups: the kernel stores each activation row's 16 dots straight into
            // `out` (`[n, rows]`). Against a copy through the task's buffer (a 64-byte copy and
            // a call a group and row, tens of thousands a token), alternated in one process
            // (AMD EPYC Zen 4, 2 threads): decoding 1.02-1.06x faster (SmolLM2-135M, Qwen2.5-
            // Coder-0.5B and 1.5B), Qwen 1.5B's 8- and 32-node trees 1.01-1.03x.
            let to = GroupsOut {
                first: out.0.wrapping_add(g0 * ROWS),
                group_step: ROWS,
                stride: self.rows,
            };
            // SAFETY: the task's groups' columns of `out` lie within it (g * 16 + 16 <= rows,
            // i < n) and no other task writes them.
            unsafe { self.group_dots(g0, count, acts, path, n, to) };
            return;
        }
        let mut dots = DOTS.take();
        if dots.len() < count * n {
            dots.resize(count * n, [0f32; ROWS]);
        }
        let task_dots = &mut dots[..count * n];
        let to = GroupsOut {
            first: task_dots.as_mut_ptr().cast::<f32>(),
            group_step: n * ROWS,
            stride: ROWS,
        };
        // SAFETY: `task_dots` holds `count` groups of `n` rows of 16.
        unsafe { self.group_dots(g0, count, acts, path, n, to) };
        for (j, group) in task_dots.chunks(n).enumerate() {
            let g = g0 + j;
            let valid = (self.rows - g * ROWS).min(ROWS);
            for (i, d) in group.iter().enumerate() {
                // SAFETY: row group g's columns of `out` (`[n, rows]`) are written by this
                // task only and lie within it (i < n, g * 16 + valid <= rows).
                unsafe {
                    let to = out.0.add(i * self.rows + g * ROWS);
                    if valid == ROWS {
                        // A whole group: one fixed-size store, where a copy of `valid` floats
                        // is a call to `memcpy` (thousands per token).
                        to.cast::<[f32; ROWS]>().write_unaligned(*d);
                    } else {
                        std::ptr::copy_nonoverlapping(d.as_ptr(), to, valid);
                    }
                };
            }
        }
        DOTS.set(dots);
    }

    /// Dots of the rows of groups `g0..g0 + count` with each of `n` activation rows, into `to`.
    ///
    /// # Safety
    /// `to` must be valid for writes of every group's `n` rows of 16.
    unsafe fn group_dots(
        &self,
        g0: usize,
        count: usize,
        a: &QuantizedActs,
        path: Path,
        n: usize,
        to: GroupsOut,
    ) {
        match path {
            // SAFETY: each path is only chosen when its CPU features were detected at run time;
            // `to` as the caller promised.
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => unsafe { avx512::group_dots(self, g0, count, a, n, to) },
            #[cfg(target_arch = "x86_64")]
            Path::Vnni => unsafe { vnni::group_dots(self, g0, count, a, n, to) },
            #[cfg(all(target_arch = "x86_64", test))]
            Path::VnniVl => unsafe { vnni_vl::group_dots(self, g0, count, a, n, to) },
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => unsafe { avx2::group_dots(self, g0, count, a, n, to) },
            Path::Portable => {
                for j in 0..count {
                    // SAFETY: as the caller promised.
                    unsafe { self.group_dots_portable(g0 + j, a, n, to.group(j)) }
                }
            }
        }
    }

    /// The contract written out plainly; the SIMD paths must give the same bits.
    ///
    /// # Safety
    /// `to` must be valid for writes of `n` rows of 16.
    unsafe fn group_dots_portable(&self, g: usize, a: &QuantizedActs, n: usize, to: GroupOut) {
        let (e, z, per) = (
            self.format.elems(),
            self.format.zero_point(),
            self.format.blocks_per_super(),
        );
        let mins = self.format.has_mins();
        for i in 0..n {
            for lane in 0..ROWS {
                let r = g * ROWS + lane;
                // SAFETY: as the caller promised.
                let d = unsafe { &mut *to.at(i, lane) };
                if r >= self.rows {
                    // Padding rows: zero weights.
                    *d = 0.0;
                    continue;
                }
                let (mut acc, mut off) = (0f32, 0f32);
                let (mut isum, mut msum) = (0i32, 0i32);
                for s in 0..self.blocks {
                    let ab = i * self.blocks + s;
                    let block: i32 = (0..e)
                        .map(|c| {
                            (self.u(r, s * e + c) as i32 - z)
                                * a.q[i * self.cols + s * e + c] as i32
                        })
                        .sum();
                    if per == 1 {
                        acc = (block as f32).mul_add(self.scale(r, s) * a.d[ab], acc);
                        if mins {
                            off = self.min(r, s).mul_add(a.dsum[ab], off);
                        }
                        continue;
                    }
                    isum += self.code(r, s, false) * block;
                    if mins {
                        msum += self.code(r, s, true) * a.block_sum(ab);
                    }
                    if (s + 1) % per == 0 {
                        let da = a.d[i * self.supers + s / per];
                        acc = (isum as f32).mul_add(self.stored(r, s, false) * da, acc);
                        if mins {
                            off = (msum as f32).mul_add(self.stored(r, s, true) * da, off);
                        }
                        (isum, msum) = (0, 0);
                    }
                }
                *d = acc + off;
            }
        }
    }
}

/// `x` times each of `mats` (one width, any formats), into `outs` (`[n, rows]` each): the
/// activations are quantized once per format and all the matrices' rows share one parallel
/// section, as the query/key/value and the gate/up projections of a layer do.
pub fn matmul_many(mats: &[&QuantMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    matmul_many_on(Path::detect(n), mats, x, n, outs)
}

fn matmul_many_on(path: Path, mats: &[&QuantMatrix], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    let Some(first) = mats.first() else { return };
    assert_eq!(mats.len(), outs.len(), "one output per matrix");
    for (m, out) in mats.iter().zip(outs.iter()) {
        assert!(m.cols == first.cols, "matrices differ in width");
        assert_eq!(out.len(), n * m.rows, "out is not [n, rows]");
    }
    assert_eq!(x.len(), n * first.cols, "x is not [n, cols]");
    // Taken for the product's duration: a product started on this thread meanwhile (a thread
    // waiting in rayon's fallback may run another caller's forward) finds empty buffers.
    let started = profile::start();
    let mut buffers = PRODUCTS.take();
    product(path, mats, x, n, outs, &mut buffers);
    PRODUCTS.set(buffers);
    profile::product_done(started, || mats.iter().map(|m| m.bytes()).sum());
}

/// A product's bookkeeping, kept per thread from call to call: a forward runs a few hundred
/// products, and each allocated about ten small buffers on the calling thread while the team
/// waited.
#[derive(Default)]
struct Product {
    /// The activations as each format's blocks see them, and which format each entry holds
    /// (entries past `formats.len()` are spare buffers).
    acts: Vec<QuantizedActs>,
    formats: Vec<QuantFormat>,
    /// Each matrix's entry in `acts`.
    act_of: Vec<usize>,
    outs: Vec<SyncPtr>,
    /// Each matrix's first task (and one past the last), tasks being numbered across the
    /// matrices in order, and the runs of them each thread starts with (see [`plan_shares`]).
    first_task: Vec<usize>,
    runs: Vec<std::ops::Range<usize>>,
}

thread_local! {
    static PRODUCTS: Cell<Product> = Cell::new(Product::default());
}

/// Has the compute team's helpers read ahead their shares of `mats`' weights while they wait
/// for the sections before the product of `mats` (see `team::read_ahead`): the forward names
/// what it multiplies next. The packed weights only: scales and codes are a few per cent.
pub fn read_ahead(mats: &[&QuantMatrix]) {
    let mut ranges = [(std::ptr::null::<u8>(), 0); team::MAX_RANGES];
    for (range, m) in ranges.iter_mut().zip(mats) {
        *range = (m.qs.as_ptr(), m.qs.len());
    }
    team::read_ahead(&ranges[..mats.len().min(team::MAX_RANGES)]);
}

/// [`matmul_many_on`]'s work, with `p`'s buffers.
fn product(
    path: Path,
    mats: &[&QuantMatrix],
    x: &[f32],
    n: usize,
    outs: &mut [&mut [f32]],
    p: &mut Product,
) {
    // The activations as each format's blocks see them, once per format.
    p.formats.clear();
    p.act_of.clear();
    for m in mats {
        let at = match p.formats.iter().position(|&f| f == m.format) {
            Some(at) => at,
            None => {
                let at = p.formats.len();
                if p.acts.len() == at {
                    p.acts.push(QuantizedActs::default());
                }
                p.acts[at].fill(x, m);
                p.formats.push(m.format);
                at
            }
        };
        p.act_of.push(at);
    }
    p.outs.clear();
    p.outs
        .extend(outs.iter_mut().map(|o| SyncPtr(o.as_mut_ptr())));
    plan_shares(mats, p);
    let p = &*p;
    team::for_each(p.runs.len(), |r| {
        run_tasks(mats, p, p.runs[r].clone(), path, n)
    });
}

/// Plans a product's tasks: [`QuantMatrix::CHUNK`] row groups each, numbered across `mats` in
/// order (`p.first_task`), and each thread's share of them, of about equal weight bytes, in
/// halving runs (`p.runs`, see [`RUNS_PER_THREAD`]): each thread first streams a long run of
/// consecutive row groups, which a layer's small matrices read faster than many interleaved
/// short ones (SmolLM2's layers: about 7 % faster than tasks taken one at a time, on this
/// project's 2-core host), and a thread that finishes first takes what is left of the others'
/// in ever shorter runs. Planned from the matrices' sizes, a few steps per thread, not task by
/// task: a token runs a few thousand tasks, and listing them one by one (about 3 % of SmolLM2's
/// decoding, alternated in one process) kept the team's helpers waiting on the calling thread.
fn plan_shares(mats: &[&QuantMatrix], p: &mut Product) {
    let threads = rayon::current_num_threads();
    // Bytes of a matrix's whole tasks (its last one may be shorter).
    let step = |m: &QuantMatrix| QuantMatrix::CHUNK * m.group_bytes();
    p.first_task.clear();
    p.first_task.push(0);
    for m in mats {
        let tasks = m.rows.div_ceil(ROWS).div_ceil(QuantMatrix::CHUNK);
        p.first_task.push(p.first_task.last().unwrap() + tasks);
    }
    let total: usize = mats.iter().map(|m| m.bytes()).sum();
    let tasks = *p.first_task.last().unwrap();
    p.runs.clear();
    let mut share_start = 0;
    for share in 1..=threads {
        // Share `share - 1` ends where the first task starting at or past `share / threads` of
        // the bytes begins: task j of matrix k starts at before_k + j * step_k bytes.
        let end = if share == threads {
            tasks
        } else {
            let goal = total * share;
            let mut before = 0;
            let mut end = tasks;
            for (k, m) in mats.iter().enumerate() {
                let (count, step) = (p.first_task[k + 1] - p.first_task[k], step(m));
                // The first j with (before + j * step) * threads >= goal.
                let j = if before * threads >= goal {
                    0
                } else {
                    (goal - before * threads).div_ceil(step * threads)
                };
                if j < count {
                    end = p.first_task[k] + j;
                    break;
                }
                before += m.bytes();
            }
            end.max(share_start)
        };
        halving_runs(&mut p.runs, share_start..end);
        share_start = end;
    }
}

/// Runs tasks `range` (numbered across `mats`, see [`plan_shares`]).
fn run_tasks(
    mats: &[&QuantMatrix],
    p: &Product,
    range: std::ops::Range<usize>,
    path: Path,
    n: usize,
) {
    let mut k = p.first_task.partition_point(|&f| f <= range.start) - 1;
    for t in range {
        while t >= p.first_task[k + 1] {
            k += 1;
        }
        let m = mats[k];
        let g0 = (t - p.first_task[k]) * QuantMatrix::CHUNK;
        let count = QuantMatrix::CHUNK.min(m.rows.div_ceil(ROWS) - g0);
        m.chunk(g0, count, &p.acts[p.act_of[k]], path, n, &p.outs[k]);
    }
}

/// Where a task's row groups' dots go: group j's at `first + j * group_step`, as a [`GroupOut`].
#[derive(Clone, Copy)]
struct GroupsOut {
    first: *mut f32,
    group_step: usize,
    stride: usize,
}

impl GroupsOut {
    fn group(self, j: usize) -> GroupOut {
        GroupOut {
            first: self.first.wrapping_add(j * self.group_step),
            stride: self.stride,
        }
    }
}

/// Where one row group's dots go: activation row i's 16 (one per row of the group) at
/// `first + i * stride`: the product's output (`[n, rows]`, stride `rows`), or a task's buffer.
#[derive(Clone, Copy)]
struct GroupOut {
    first: *mut f32,
    stride: usize,
}

impl GroupOut {
    /// Activation row `i`'s dot with the group's row `lane`.
    fn at(self, i: usize, lane: usize) -> *mut f32 {
        self.first.wrapping_add(i * self.stride + lane)
    }
}

thread_local! {
    /// The dots of a task that holds a matrix's last, partial row group (rows not a multiple of
    /// 16), before their valid columns go to the output; kept per thread from task to task, as a
    /// buffer per task cost its zeroing or an allocation each time. Every element a task reads
    /// back it has written.
    static DOTS: Cell<Vec<[f32; ROWS]>> = const { Cell::new(Vec::new()) };
}

/// Runs of tasks per thread in a product, of halving length (1/2, 1/4, 1/8, 1/16 and 1/16 of
/// the thread's share). One run each streamed SmolLM2's layers fastest, but left no work to
/// steal: Qwen2.5-Coder-1.5B's 8- to 32-node trees on the AVX2 path then cost 1.2-1.4x what they
/// do with tasks taken one at a time. Four equal runs each measured as fast as either on both,
/// but the thread that finished first then waited for up to a quarter of the other's share at
/// the end of every section; with halving runs it waits for a sixteenth. Against four equal
/// runs, alternated in one process (2 threads, AMD EPYC Zen 4): SmolLM2-135M's decode 1.00-1.03x
/// faster, Qwen 1.5B's 1.03x, its 8-node tree on the AVX2 path 1.03-1.10x.
const RUNS_PER_THREAD: usize = 5;

/// Cuts `tasks` into [`RUNS_PER_THREAD`] runs of halving length (the last two alike; some
/// empty where there are few tasks), appended to `runs`.
fn halving_runs(runs: &mut Vec<std::ops::Range<usize>>, tasks: std::ops::Range<usize>) {
    let mut at = tasks.start;
    for r in 0..RUNS_PER_THREAD {
        let rest = tasks.end - at;
        let take = if r + 1 == RUNS_PER_THREAD {
            rest
        } else {
            rest.div_ceil(2)
        };
        runs.push(at..at + take);
        at += take;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// 512-bit registers, 16 rows per dot instruction (AVX-512 VNNI).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// 256-bit registers, `vpdpbusd` (AVX-VNNI).
    #[cfg(target_arch = "x86_64")]
    Vnni,
    /// Tests only: the AVX-VNNI kernel with its dot instruction in the AVX-512 encoding (AVX-512
    /// VNNI and VL), so that hosts without AVX-VNNI test that kernel's bits too. The developers'
    /// and CI's AMD Zen 4 have AVX-512 VNNI but not AVX-VNNI, and there the [`Path::Vnni`]
    /// kernel never ran. Not offered outside tests: on Zen 4 it decoded no faster than the
    /// 512-bit kernel (Qwen2.5-Coder-1.5B 0.99-1.04x the time, SmolLM2-135M 1.03-1.05x).
    #[cfg(all(target_arch = "x86_64", test))]
    VnniVl,
    /// 256-bit registers, `vpmaddubsw` + `vpmaddwd`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Path {
    /// Every path this CPU can run, fastest first. `SPECINFER_NO_SIMD` leaves only the portable
    /// one; `SPECINFER_NO_AVX512` and `SPECINFER_NO_VNNI` drop those (for comparisons).
    fn available() -> Vec<Path> {
        #[allow(unused_mut)]
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let off = |var: &str| std::env::var_os(var).is_some();
            // Every path converts the stored f16 scales (F16C, on every AVX2 CPU in practice).
            if lanes::avx2_fma() && is_x86_feature_detected!("f16c") {
                if !off("SPECINFER_NO_AVX512")
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                {
                    v.push(Path::Avx512);
                }
                if !off("SPECINFER_NO_VNNI") && is_x86_feature_detected!("avxvnni") {
                    v.push(Path::Vnni);
                }
                #[cfg(test)]
                if !off("SPECINFER_NO_VNNI")
                    && !off("SPECINFER_NO_AVX512")
                    && !is_x86_feature_detected!("avxvnni")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl")
                {
                    v.push(Path::VnniVl);
                }
                v.push(Path::Avx2);
            }
        }
        v.push(Path::Portable);
        v
    }

    /// The path for `n` activation rows. All paths give the same bits, so the choice may depend
    /// on the batch: with one or two rows the 256-bit VNNI path measured about 5 % faster than
    /// the 512-bit one on the AMD EPYC with both that this project ran on in November 2026, with
    /// more rows the 512-bit one is faster. (AMD Zen 4 has no AVX-VNNI; there the same 256-bit
    /// kernel with the AVX-512 encoding of its dot was no faster, see `Path::VnniVl`.)
    fn detect(n: usize) -> Path {
        static PATHS: std::sync::OnceLock<Vec<Path>> = std::sync::OnceLock::new();
        let paths = PATHS.get_or_init(Path::available);
        #[cfg(target_arch = "x86_64")]
        if n <= 2 && paths.contains(&Path::Vnni) {
            return Path::Vnni;
        }
        let _ = n;
        paths[0]
    }
}

/// Activation rows quantized to 8 bits per block of the format's [`QuantFormat::act_block`],
/// with per-(row, weight block) terms.
#[derive(Default)]
struct QuantizedActs {
    /// `[n, cols]`.
    q: Vec<i8>,
    /// The activation scales: `[n, blocks]` (one per weight block), or `[n, supers]` for the K
    /// formats (one per super-block).
    d: Vec<f32>,
    /// `[n, blocks]`: `-z * sum(q)` over the block, the zero point's integer correction, which
    /// the SIMD paths add to a block's sum per activation row: an add of a broadcast from memory
    /// is one instruction, where the subtract of `z * sum(q)` compiled to a load, a negation, a
    /// broadcast and an add (hot Q6_K products of 8 to 32 rows 1.13x faster, one row 1.07x;
    /// Q8_0 1.02-1.04x; AMD EPYC Zen 4, 512-bit path).
    corr: Vec<i32>,
    /// `[n, blocks]`: `d * sum(q)` over the block; 32-weight formats with a min (Q4_1).
    dsum: Vec<f32>,
    /// `[n, blocks]`: `sum(q)` over each weight block, which the other terms are made of.
    sums: Vec<i32>,
    /// `[n, blocks / 2]`, K formats: `sum(q)` over blocks `2k` and `2k + 1` as the low and high
    /// i16 of one word (at most 32 x 127 each), for the SIMD paths' pairwise products with two
    /// blocks' codes (`vpmaddwd`): Q4_K's mins' terms on every SIMD path, Q6_K's zero point on
    /// AVX2. The portable path reads one block's sum back ([`QuantizedActs::block_sum`]).
    pair_sums: Vec<i32>,
}

impl QuantizedActs {
    /// Quantizes `x` (`[n, cols]`) as `m`'s format sees it, into these buffers (their memory
    /// reused from call to call). Each weight block's sum of quantized values comes out of the
    /// quantization itself, and the terms made of the sums in loops of their own. A loop that
    /// summed each block's bytes again and pushed its terms one block at a time cost 2-3.5 % of
    /// SmolLM2-135M's and Qwen2.5-Coder-1.5B's forwards (alternated in one process, 2 threads,
    /// AMD EPYC Zen 4), all of it on the calling thread while the team's helpers waited.
    fn fill(&mut self, x: &[f32], m: &QuantMatrix) {
        let (e, z, per) = (
            m.format.elems(),
            m.format.zero_point(),
            m.format.blocks_per_super(),
        );
        let act = m.format.act_block();
        // The 32-weight formats' activation blocks are their weight blocks: `d` holds one scale
        // per weight block, as they want; the K formats keep one per super-block.
        debug_assert!(per > 1 || act == e);
        self.q.clear();
        self.q.resize(x.len(), 0);
        self.d.clear();
        self.d.resize(x.len() / act, 0.0);
        self.sums.clear();
        self.sums.resize(x.len() / e, 0);
        let cols = m.cols;
        let (q, d, sums) = (
            SyncPtr(self.q.as_mut_ptr()),
            SyncPtr(self.d.as_mut_ptr()),
            SyncPtr(self.sums.as_mut_ptr()),
        );
        lanes::by_rows(x.len().checked_div(cols).unwrap_or(0), |r| {
            // SAFETY: row r's values, scales and sums lie inside the buffers sized above (a
            // row's width is a multiple of the activation block), and only row r's call writes
            // them.
            let (q, d, sums) = unsafe {
                (
                    q.slice_mut(r * cols, cols),
                    d.slice_mut(r * cols / act, cols / act),
                    sums.slice_mut(r * cols / e, cols / e),
                )
            };
            lanes::quantize_blocks(&x[r * cols..(r + 1) * cols], act, e, q, d, sums);
        });
        self.corr.clear();
        self.corr.extend(self.sums.iter().map(|&sum| -z * sum));
        self.dsum.clear();
        if m.format.has_mins() && per == 1 {
            let terms = self
                .sums
                .iter()
                .zip(&self.d)
                .map(|(&sum, &d)| d * sum as f32);
            self.dsum.extend(terms);
        }
        self.pair_sums.clear();
        if per > 1 {
            // A K format's rows have an even number of blocks.
            let pairs = self
                .sums
                .chunks_exact(2)
                .map(|p| (p[0] & 0xffff) | (p[1] << 16));
            self.pair_sums.extend(pairs);
        }
    }

    /// `sum(q)` over block `b` (counted across the rows, as `corr`'s), K formats: the half of
    /// `pair_sums` that holds it (a K format's rows have an even number of blocks).
    fn block_sum(&self, b: usize) -> i32 {
        let pair = self.pair_sums[b / 2];
        if b.is_multiple_of(2) {
            pair as i16 as i32
        } else {
            pair >> 16
        }
    }
}

/// The vector operations one x86 path needs. A register holds `LANES` rows (16 or 8) of one
/// row group; 256-bit paths cover a group in two halves.
#[cfg(target_arch = "x86_64")]
macro_rules! vector_ops {
    ($name:ident, $features:literal, $lanes:literal, $i:ty, $f:ty, centers_q8: $centers:literal,
     { $($body:item)* }) => {
        mod $name {
            #[allow(unused_imports)]
            use std::arch::x86_64::*;

            pub type I = $i;
            pub type F = $f;
            pub const LANES: usize = $lanes;
            /// Activation rows per tile: their accumulators must fit the register file (16
            /// registers of 256 bits, 32 of 512).
            pub const MAX_T: usize = if $lanes == 16 { 8 } else { 3 };
            /// Whether `dot::<true>` (Q8_0) re-centres the values itself, so that the caller must
            /// not subtract the zero point's correction. Only the AVX2 path does; its pairwise
            /// 16-bit sums also limit weights to 6 bits (the VNNI paths' dots take any byte).
            pub const CENTERS_Q8: bool = $centers;
            pub const ANY_BYTE: bool = !$centers;

            $(
                #[inline]
                #[target_feature(enable = $features)]
                $body
            )*
        }
    };
}

#[cfg(target_arch = "x86_64")]
vector_ops!(zmm_vnni, "avx512f,avx512bw,avx512vnni,f16c", 16, __m512i, __m512, centers_q8: false, {
    pub unsafe fn zero_i() -> I { _mm512_setzero_si512() }
    pub unsafe fn zero_f() -> F { _mm512_setzero_ps() }
    pub unsafe fn load_i(p: *const u8) -> I { _mm512_loadu_si512(p as *const _) }
    pub unsafe fn low_nibbles(v: I) -> I { _mm512_and_si512(v, _mm512_set1_epi8(0x0F)) }
    pub unsafe fn high_nibbles(v: I) -> I {
        _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))
    }
    pub unsafe fn splat_i(x: i32) -> I { _mm512_set1_epi32(x) }
    pub unsafe fn or_i(a: I, b: I) -> I { _mm512_or_si512(a, b) }
    pub unsafe fn high_nibbles_in_place(v: I) -> I {
        _mm512_and_si512(v, _mm512_set1_epi8(0xF0u8 as i8))
    }
    pub unsafe fn shr4_i(v: I) -> I { _mm512_srai_epi32::<4>(v) }
    pub unsafe fn pairs16(w: I, x: I) -> I { _mm512_maddubs_epi16(w, x) }
    pub unsafe fn add_i16(a: I, b: I) -> I { _mm512_add_epi16(a, b) }
    pub unsafe fn widen16(v: I) -> I { _mm512_madd_epi16(v, _mm512_set1_epi16(1)) }
    pub unsafe fn madd16(a: I, b: I) -> I { _mm512_madd_epi16(a, b) }
    // Q4_K's mins' terms, two blocks at a time (see `tile`).
    pub unsafe fn load_code_pairs(p: *const u8, q: *const u8) -> I {
        let (a, b) = (_mm_loadu_si128(p as *const _), _mm_loadu_si128(q as *const _));
        let lo = _mm_unpacklo_epi8(a, b);
        let hi = _mm_unpackhi_epi8(a, b);
        _mm512_cvtepi8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
    }
    pub unsafe fn high_plane(plane: I, shift: i32, bits: i32) -> I {
        let v = _mm512_srl_epi16(plane, _mm_cvtsi32_si128(shift));
        _mm512_slli_epi16::<4>(_mm512_and_si512(v, _mm512_set1_epi8(((1 << bits) - 1) as i8)))
    }
    pub unsafe fn load_f16(p: *const u16) -> F { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const _)) }
    pub unsafe fn load_u8_i(p: *const u8) -> I { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const _)) }
    pub unsafe fn load_i8_i(p: *const u8) -> I { _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const _)) }
    pub unsafe fn mul_i(a: I, b: I) -> I { _mm512_mullo_epi32(a, b) }
    pub unsafe fn dot<const Q8: bool>(acc: I, w: I, x: I) -> I { _mm512_dpbusd_epi32(acc, w, x) }
    pub unsafe fn add_i(a: I, b: I) -> I { _mm512_add_epi32(a, b) }
    pub unsafe fn sub_i(a: I, b: I) -> I { _mm512_sub_epi32(a, b) }
    pub unsafe fn to_f(v: I) -> F { _mm512_cvtepi32_ps(v) }
    pub unsafe fn splat_f(x: f32) -> F { _mm512_set1_ps(x) }
    pub unsafe fn mul_f(a: F, b: F) -> F { _mm512_mul_ps(a, b) }
    pub unsafe fn add_f(a: F, b: F) -> F { _mm512_add_ps(a, b) }
    pub unsafe fn fmadd_f(a: F, b: F, c: F) -> F { _mm512_fmadd_ps(a, b, c) }
    pub unsafe fn store_f(p: *mut f32, v: F) { _mm512_storeu_ps(p, v) }
});

/// The 256-bit operations both 256-bit paths share, and their exact group dot.
#[cfg(target_arch = "x86_64")]
macro_rules! ymm_ops {
    ($name:ident, $features:literal, centers_q8: $centers:literal, $dot:item) => {
        vector_ops!($name, $features, 8, __m256i, __m256, centers_q8: $centers, {
            pub unsafe fn zero_i() -> I { _mm256_setzero_si256() }
            pub unsafe fn zero_f() -> F { _mm256_setzero_ps() }
            pub unsafe fn load_i(p: *const u8) -> I { _mm256_loadu_si256(p as *const _) }
            pub unsafe fn low_nibbles(v: I) -> I { _mm256_and_si256(v, _mm256_set1_epi8(0x0F)) }
            pub unsafe fn high_nibbles(v: I) -> I {
                _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))
            }
            pub unsafe fn splat_i(x: i32) -> I { _mm256_set1_epi32(x) }
            pub unsafe fn or_i(a: I, b: I) -> I { _mm256_or_si256(a, b) }
            pub unsafe fn high_nibbles_in_place(v: I) -> I {
                _mm256_and_si256(v, _mm256_set1_epi8(0xF0u8 as i8))
            }
            pub unsafe fn shr4_i(v: I) -> I { _mm256_srai_epi32::<4>(v) }
            pub unsafe fn pairs16(w: I, x: I) -> I { _mm256_maddubs_epi16(w, x) }
            pub unsafe fn add_i16(a: I, b: I) -> I { _mm256_add_epi16(a, b) }
            pub unsafe fn widen16(v: I) -> I { _mm256_madd_epi16(v, _mm256_set1_epi16(1)) }
            pub unsafe fn madd16(a: I, b: I) -> I { _mm256_madd_epi16(a, b) }
            pub unsafe fn load_code_pairs(p: *const u8, q: *const u8) -> I {
                let (a, b) = (_mm_loadl_epi64(p as *const _), _mm_loadl_epi64(q as *const _));
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b))
            }
            pub unsafe fn high_plane(plane: I, shift: i32, bits: i32) -> I {
                let v = _mm256_srl_epi16(plane, _mm_cvtsi32_si128(shift));
                _mm256_slli_epi16::<4>(_mm256_and_si256(v, _mm256_set1_epi8(((1 << bits) - 1) as i8)))
            }
            pub unsafe fn load_f16(p: *const u16) -> F { _mm256_cvtph_ps(_mm_loadu_si128(p as *const _)) }
            pub unsafe fn load_u8_i(p: *const u8) -> I {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const _))
            }
            pub unsafe fn load_i8_i(p: *const u8) -> I {
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const _))
            }
            pub unsafe fn mul_i(a: I, b: I) -> I { _mm256_mullo_epi32(a, b) }
            $dot
            pub unsafe fn add_i(a: I, b: I) -> I { _mm256_add_epi32(a, b) }
            pub unsafe fn sub_i(a: I, b: I) -> I { _mm256_sub_epi32(a, b) }
            pub unsafe fn to_f(v: I) -> F { _mm256_cvtepi32_ps(v) }
            pub unsafe fn splat_f(x: f32) -> F { _mm256_set1_ps(x) }
            pub unsafe fn mul_f(a: F, b: F) -> F { _mm256_mul_ps(a, b) }
            pub unsafe fn add_f(a: F, b: F) -> F { _mm256_add_ps(a, b) }
            pub unsafe fn fmadd_f(a: F, b: F, c: F) -> F { _mm256_fmadd_ps(a, b, c) }
            pub unsafe fn store_f(p: *mut f32, v: F) { _mm256_storeu_ps(p, v) }
        });
    };
}

#[cfg(target_arch = "x86_64")]
ymm_ops!(ymm_vnni, "avx2,fma,f16c,avxvnni", centers_q8: false,
    pub unsafe fn dot<const Q8: bool>(acc: I, w: I, x: I) -> I {
        _mm256_dpbusd_avx_epi32(acc, w, x)
    }
);

#[cfg(all(target_arch = "x86_64", test))]
ymm_ops!(ymm_vnni_vl, "avx2,fma,f16c,avx512vnni,avx512vl", centers_q8: false,
    pub unsafe fn dot<const Q8: bool>(acc: I, w: I, x: I) -> I {
        _mm256_dpbusd_epi32(acc, w, x)
    }
);

#[cfg(target_arch = "x86_64")]
ymm_ops!(ymm_avx2, "avx2,fma,f16c", centers_q8: true,
    pub unsafe fn dot<const Q8: bool>(acc: I, w: I, x: I) -> I {
        let pairs = if Q8 {
            // Q8_0's `u x` pairs would saturate 16 bits: re-centre the weights (u - 128) and,
            // as maddubs wants unsigned x signed, move their sign onto x.
            let s = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
            _mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(x, s))
        } else {
            // At most 2 * 63 * 127 per pair: no saturation.
            _mm256_maddubs_epi16(w, x)
        };
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
);

/// One kernel body for the x86 paths, over the operations of `$ops`.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_path {
    ($name:ident, $features:literal, $ops:ident) => {
        mod $name {
            use super::$ops::*;
            use super::{
                packed_block_bytes, GroupOut, GroupsOut, LookAhead, QuantFormat, QuantMatrix,
                QuantizedActs, GROUP_BYTES, ROWS,
            };

            #[inline(always)]
            fn prefetch<const HINT: i32>(p: *const u8) {
                // SAFETY: a prefetch never faults, whatever the address.
                unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(p as *const i8) }
            }

            /// Asks for the scales and mins (and their codes) of block `s` of the row group
            /// `on` groups after `set`'s: a cache line each, and only at blocks where a new line
            /// may start (a row group's 16 stored f16 take 32 bytes, its 16 codes 16, so a line
            /// serves 2 or 4 blocks; a prefetch instruction a block would mostly repeat itself).
            #[inline(always)]
            fn params_ahead<const HINT: i32, const MINS: bool, const PER: usize>(
                m: &QuantMatrix,
                set: &Set,
                on: usize,
                s: usize,
            ) {
                if s % (2 * PER) == 0 {
                    let sup = set.sp + (on * m.supers + s / PER) * ROWS;
                    prefetch::<HINT>(m.scales.as_ptr().wrapping_add(sup) as *const u8);
                    if MINS {
                        prefetch::<HINT>(m.mins.as_ptr().wrapping_add(sup) as *const u8);
                    }
                }
                if PER > 1 && s % 2 == 0 {
                    let code = set.p + (on * m.blocks + s) * ROWS;
                    prefetch::<HINT>(m.scale_codes.as_ptr().wrapping_add(code));
                    if MINS {
                        prefetch::<HINT>(m.min_codes.as_ptr().wrapping_add(code));
                    }
                }
            }

            /// Asks for block `s` of `set` (`on` = 1: of the sets after it, which lie one after
            /// another): its scales, mins and codes (see [`params_ahead`]), and its weights
            /// where `weights`.
            #[inline(always)]
            fn block_ahead<const HINT: i32, const MINS: bool, const PER: usize>(
                m: &QuantMatrix,
                set: &Set,
                on: usize,
                s: usize,
                pb: usize,
                weights: bool,
            ) {
                params_ahead::<HINT, MINS, PER>(m, set, on, s);
                if !weights {
                    return;
                }
                let at = set.w.wrapping_add((on * m.blocks + s) * pb);
                for line in (0..pb).step_by(64) {
                    prefetch::<HINT>(at.wrapping_add(line));
                }
            }

            /// `set`'s stored scales (`mins`: mins) of block `s`'s super-block.
            #[inline(always)]
            unsafe fn stored<const PER: usize>(
                m: &QuantMatrix,
                set: &Set,
                s: usize,
                mins: bool,
            ) -> F {
                let v = if mins { &m.mins } else { &m.scales };
                load_f16(v.as_ptr().add(set.sp + (s / PER) * ROWS))
            }

            /// `set`'s integer codes of block `s`'s scale (K formats; `signed`: Q6_K's i8 ones).
            #[inline(always)]
            unsafe fn scale_codes(m: &QuantMatrix, set: &Set, s: usize, signed: bool) -> I {
                let p = m.scale_codes.as_ptr().add(set.p + s * ROWS);
                if signed {
                    load_i8_i(p)
                } else {
                    load_u8_i(p)
                }
            }

            /// `set`'s codes of blocks `s0` and `s1` (scales, or `mins`), as the low and the
            /// high i16 of each row's lane (both at most 7 bits and a sign).
            #[inline(always)]
            unsafe fn code_pairs(
                m: &QuantMatrix,
                set: &Set,
                s0: usize,
                s1: usize,
                mins: bool,
            ) -> I {
                let v = if mins { &m.min_codes } else { &m.scale_codes };
                let p = v.as_ptr().add(set.p);
                load_code_pairs(p.add(s0 * ROWS), p.add(s1 * ROWS))
            }

            /// Activation row `i`'s sums of blocks `s - 1` and `s` (`s` odd), as i16 pairs.
            #[inline(always)]
            unsafe fn pair_sum(a: &QuantizedActs, m: &QuantMatrix, i: usize, s: usize) -> i32 {
                *a.pair_sums.get_unchecked(i * (m.blocks / 2) + s / 2)
            }

            /// At the end of the super-block of block `s` (K formats): `into += ksum x (stored
            /// scale (`mins`: min) x the activations' scale)`, and the integer sums restart.
            #[allow(clippy::too_many_arguments)]
            #[inline(always)]
            unsafe fn fold_super<const T: usize, const S: usize, const PER: usize>(
                m: &QuantMatrix,
                sets: &[Set; S],
                a: &QuantizedActs,
                i0: usize,
                s: usize,
                mins: bool,
                ksum: &mut [[I; S]; T],
                into: &mut [[F; S]; T],
            ) {
                let stored: [F; S] = std::array::from_fn(|j| stored::<PER>(m, &sets[j], s, mins));
                for t in 0..T {
                    let da = splat_f(*a.d.get_unchecked((i0 + t) * m.supers + s / PER));
                    for j in 0..S {
                        into[t][j] = fmadd_f(to_f(ksum[t][j]), mul_f(stored[j], da), into[t][j]);
                        ksum[t][j] = zero_i();
                    }
                }
            }

            /// A register-wide set of rows: half `half` of row group `g`, results into `dst`.
            #[derive(Clone, Copy)]
            struct Set {
                /// Block 0's weights.
                w: *const u8,
                /// Block 0's scale and min codes (K formats).
                p: usize,
                /// Super-block 0's stored scales and mins.
                sp: usize,
                dst: GroupOut,
                lane0: usize,
                /// The task's first row group: nothing has asked for its first blocks yet (a
                /// later group's were asked for by the look-ahead of the group before it).
                first: bool,
            }

            impl Set {
                fn new(m: &QuantMatrix, g: usize, half: usize, dst: GroupOut, first: bool) -> Set {
                    let lane0 = half * LANES;
                    Set {
                        w: m.qs[g * m.blocks * m.format.packed_bytes() + 4 * lane0..].as_ptr(),
                        p: g * m.blocks * ROWS + lane0,
                        sp: g * m.supers * ROWS + lane0,
                        dst,
                        lane0,
                        first,
                    }
                }
            }

            pub(super) unsafe fn group_dots(
                m: &QuantMatrix,
                g0: usize,
                count: usize,
                a: &QuantizedActs,
                n: usize,
                to: GroupsOut,
            ) {
                // 512 bits: one row group per pass, one weight stream, and up to 8 activation
                // rows per tile (the 32 registers hold their sums), so that a tree of 8 nodes
                // unpacks each weight once. Two row groups per pass in tiles of 4 (each
                // broadcast activation feeding two dots) measured 1.3-1.6x slower for Q6_K at
                // 4 to 32 rows and 3-7 % slower for Q4_K (AMD EPYC Zen 4). 256 bits: a group's
                // two halves, in one pass (one or two rows) or one after the other.
                for j in 0..count {
                    let d = to.group(j);
                    let first = j == 0;
                    if LANES == ROWS {
                        pass::<1>(m, [Set::new(m, g0 + j, 0, d, first)], a, n);
                    } else if n > 2 {
                        // 256 bits, several activation rows: one half per pass, so that a
                        // tile holds twice the rows in the same registers (the second half's
                        // pass reads the group from L1).
                        pass::<1>(m, [Set::new(m, g0 + j, 0, d, first)], a, n);
                        pass::<1>(m, [Set::new(m, g0 + j, 1, d, first)], a, n);
                    } else {
                        let lo = Set::new(m, g0 + j, 0, d, first);
                        let hi = Set::new(m, g0 + j, 1, d, first);
                        pass::<2>(m, [lo, hi], a, n);
                    }
                }
            }

            unsafe fn pass<const S: usize>(
                m: &QuantMatrix,
                sets: [Set; S],
                a: &QuantizedActs,
                n: usize,
            ) {
                match m.format {
                    QuantFormat::Q4_0 => rows::<S, 8, true, false, false, 0, 1>(m, sets, a, n),
                    QuantFormat::Q4_1 => rows::<S, 8, true, true, false, 0, 1>(m, sets, a, n),
                    QuantFormat::Q4_K => rows::<S, 8, true, true, false, 0, 8>(m, sets, a, n),
                    QuantFormat::Q5_0 => rows::<S, 8, true, false, false, 1, 1>(m, sets, a, n),
                    QuantFormat::Q6_K => rows::<S, 4, true, false, false, 2, 16>(m, sets, a, n),
                    QuantFormat::Q8_0 => rows::<S, 8, false, false, true, 0, 1>(m, sets, a, n),
                }
            }

            /// `GROUPS` 4-weight groups per block; `NIB`: nibble storage; `MINS`: the format
            /// has a min; `Q8`: the 8-bit format (zero point 128); `HIGH`: bits per value in
            /// the high-bit plane; `PER`: blocks per stored scale.
            #[target_feature(enable = $features)]
            unsafe fn rows<
                const S: usize,
                const GROUPS: usize,
                const NIB: bool,
                const MINS: bool,
                const Q8: bool,
                const HIGH: usize,
                const PER: usize,
            >(
                m: &QuantMatrix,
                sets: [Set; S],
                a: &QuantizedActs,
                n: usize,
            ) {
                let mut i = 0;
                // Up to MAX_T activation rows per pass (twice that over one set of 256-bit
                // lanes) keep every accumulator in a register.
                let max_t = if S == 1 && LANES != ROWS {
                    // The AVX2 path's K formats keep no block sums (see `tile`): one register
                    // less per row, and 8 rows (a tree of 8 nodes) in one pass, so that the
                    // weights' unpacking is done once for all of them.
                    if !ANY_BYTE && PER > 1 {
                        8
                    } else {
                        2 * MAX_T
                    }
                } else {
                    MAX_T
                };
                while i < n {
                    i += match (n - i).min(max_t) {
                        1 => tile::<1, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        2 => tile::<2, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        3 => tile::<3, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        4 => tile::<4, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        5 => tile::<5, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        6 => tile::<6, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        7 => tile::<7, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                        _ => tile::<8, S, GROUPS, NIB, MINS, Q8, HIGH, PER>(m, sets, a, i, n),
                    };
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<
                const T: usize,
                const S: usize,
                const GROUPS: usize,
                const NIB: bool,
                const MINS: bool,
                const Q8: bool,
                const HIGH: usize,
                const PER: usize,
            >(
                m: &QuantMatrix,
                sets: [Set; S],
                a: &QuantizedActs,
                i0: usize,
                n: usize,
            ) -> usize {
                let e = 4 * GROUPS;
                // Bytes of one packed block: a constant of this instantiation, so that the loops
                // over its cache lines unroll.
                let pb = packed_block_bytes(NIB, e, HIGH > 0);
                debug_assert_eq!(pb, m.format.packed_bytes());
                let mut acc = [[zero_f(); S]; T];
                let mut off = [[zero_f(); S]; T];
                // K formats: the super-block's integer sum of code x block sum (see the contract).
                let mut ksum = [[zero_i(); S]; T];
                // With one activation row, two chains per set hide the dot instruction's
                // latency (integer sums: exact in any order). Where a dot takes any byte, plain
                // 4-bit formats use them for the low and the high nibbles, and the high ones go
                // in unshifted (16 times their value; the chain's sum, a multiple of 16, is
                // shifted back exactly): one instruction less per 4-weight group.
                let chains = if T == 1 { 2 } else { 1 };
                let split = T == 1 && NIB && HIGH == 0 && ANY_BYTE;
                // Without a 4-byte dot (AVX2), `vpmaddubsw` pair sums of several groups add up
                // in 16 bits before one widening `vpmaddwd` (two instructions a group instead of
                // three): at most 2 x 15 x 127 per pair and group for 4-bit values, so 8 groups
                // stay below 32767; 4 for 5-bit values, 2 for 6-bit ones. Exact, as before.
                let narrow = !ANY_BYTE && !Q8;
                // There the K formats multiply each block's codes into the 16-bit pair sums as
                // they widen them (`vpmaddwd` by the code instead of by 1), and the zero point's
                // correction (Q6_K) and the mins' terms (Q4_K) come from two blocks' codes and
                // activation sums at once: no per-block sum, no 32-bit multiply. Exact, as before.
                let coded = narrow && PER > 1;
                let per16 = match HIGH {
                    0 => 8,
                    1 => 4,
                    _ => 2,
                };
                let ahead = if ANY_BYTE {
                    m.format.look_ahead(T)
                } else {
                    LookAhead::EVERYTHING
                };
                let (prefetch_blocks, weights_ahead) = ((ahead.bytes / pb).max(2), ahead.weights);
                // Q4_1's mins' term of block `s` (into `off`: the same sums in the same order,
                // whether in the block loop or a pass of its own after it).
                let min_term = |s: usize, off: &mut [[F; S]; T]| {
                    let mn: [F; S] = std::array::from_fn(|j| stored::<PER>(m, &sets[j], s, true));
                    for t in 0..T {
                        let ds = splat_f(*a.dsum.get_unchecked((i0 + t) * m.blocks + s));
                        for j in 0..S {
                            off[t][j] = fmadd_f(mn[j], ds, off[t][j]);
                        }
                    }
                };
                // With one or two rows' sums to keep (a decoding step, a two-node tree), the
                // mins' terms go in the block loop: their pass of its own, a chain of dependent
                // multiply-adds, took 3-6 % of a hot one-row Q4_1 product (one core), and 1-2 %
                // of SmolLM2-135M's decoding steps and two-node trees (in-process A/B, AMD EPYC
                // Zen 4, 2 threads; AVX2 path 0.2-1.3 %). With more rows their registers would
                // crowd the loop's (4 rows: no faster).
                let fused_mins = MINS && PER == 1 && T * S <= 2;
                if i0 == 0 && (T > 2 || sets[0].first) {
                    // The stream's first blocks, which no look-ahead below asks for: a task
                    // starts with several misses in flight instead of one or two. Passes of one
                    // or two rows ask for them only in a task's first group: the look-ahead of
                    // each group's pass runs on into the next group's first blocks, and asking
                    // again (16 blocks' lines at every group) took 1.01-1.03x in decoding steps
                    // and two-node trees (in-process A/B, SmolLM2-135M and Qwen2.5-Coder; hot
                    // one-row Q4_1 products 1.05x).
                    for s in 0..prefetch_blocks.min(m.blocks) {
                        for set in &sets {
                            block_ahead::<{ std::arch::x86_64::_MM_HINT_T0 }, MINS, PER>(
                                m,
                                set,
                                0,
                                s,
                                pb,
                                weights_ahead,
                            );
                        }
                    }
                }
                for s in 0..m.blocks {
                    if i0 == 0 && T <= 2 {
                        // A first pass of one or two rows streams the weights (and their scales
                        // and mins, a stream of their own) from memory with little arithmetic a
                        // block: ask for them a few blocks ahead so the loads overlap it. Near a
                        // set's end the stream goes on into the set that will follow it in the
                        // next pass (row groups lie one after another), so that no pass starts
                        // cold. Passes of 3 rows and more last long enough a block to fetch the
                        // next set whole, as the last of several passes does below: in-process
                        // A/B against asking 4 KB ahead (AMD EPYC Zen 4, 2 threads, 128 cached),
                        // Qwen2.5-Coder-1.5B's trees of 4 and 6 nodes took 0.87-0.93 of the
                        // time, 8 nodes 0.97-0.99, 3 nodes 0.98-0.99, 16 and 32 nodes 1.00;
                        // Qwen2.5-Coder-0.5B's 4 and 8 nodes 0.92 and 0.94; on the AVX2 path
                        // 0.82-0.93 for 3 to 4 nodes and 0.93-0.99 for 8. One- and two-row
                        // passes that way took 1.01-1.13x.
                        for set in &sets {
                            block_ahead::<{ std::arch::x86_64::_MM_HINT_T0 }, MINS, PER>(
                                m,
                                set,
                                0,
                                s + prefetch_blocks,
                                pb,
                                weights_ahead,
                            );
                        }
                    } else if i0 + T == n {
                        // The last pass over the set (of several, it reads the weights from
                        // L1): meanwhile stream the next sets' into L2, so that memory never
                        // waits for the arithmetic (their first pass then starts from L2).
                        for set in &sets {
                            block_ahead::<{ std::arch::x86_64::_MM_HINT_T1 }, MINS, PER>(
                                m, set, 1, s, pb, true,
                            );
                        }
                    }
                    let mut isum = [[[zero_i(); 2]; S]; T];
                    let half = GROUPS / 2;
                    // The block's plane of high bits (5- and 6-bit formats), after its nibbles.
                    let plane: [I; S] = std::array::from_fn(|j| {
                        if HIGH > 0 {
                            load_i(sets[j].w.add(s * pb + GROUP_BYTES * half))
                        } else {
                            zero_i()
                        }
                    });
                    let code16: [I; S] = std::array::from_fn(|j| {
                        if coded {
                            code_pairs(m, &sets[j], s, s, false)
                        } else {
                            zero_i()
                        }
                    });
                    // Group k's weights of set j, as unsigned bytes.
                    let unpack = |k: usize, j: usize| -> I {
                        let w = sets[j].w.add(s * pb);
                        if NIB {
                            let p = load_i(w.add(GROUP_BYTES * (k % half)));
                            let v = if k < half {
                                low_nibbles(p)
                            } else if split {
                                high_nibbles_in_place(p)
                            } else {
                                high_nibbles(p)
                            };
                            if HIGH > 0 {
                                let shift = (k * HIGH) as i32;
                                or_i(v, high_plane(plane[j], shift, HIGH as i32))
                            } else {
                                v
                            }
                        } else {
                            load_i(w.add(GROUP_BYTES * k))
                        }
                    };
                    if narrow {
                        // Set by set and row by row, each row's 16-bit pair sums in one
                        // register, from the set's block of weights unpacked once: group by
                        // group across the rows instead held a 16-bit sum per row beside the
                        // 32-bit ones, more than AVX2's 16 registers at 8 rows (Qwen2.5-Coder-
                        // 1.5B's 8- and 32-node trees 1.06-1.11x faster this way; SmolLM2-135M's
                        // unchanged). One set at a time: a block of both sets would be 16
                        // registers of weights alone.
                        for j in 0..S {
                            let wks: [I; GROUPS] = std::array::from_fn(|k| unpack(k, j));
                            for t in 0..T {
                                let x = a.q.as_ptr().add((i0 + t) * m.cols + s * e);
                                let mut p16 = zero_i();
                                for (k, &wk) in wks.iter().enumerate() {
                                    let xk = splat_i((x.add(4 * k) as *const i32).read_unaligned());
                                    p16 = add_i16(p16, pairs16(wk, xk));
                                    if (k + 1) % per16 == 0 || k + 1 == GROUPS {
                                        if coded {
                                            let c = &mut ksum[t][j];
                                            *c = add_i(*c, madd16(p16, code16[j]));
                                        } else {
                                            let c = &mut isum[t][j][0];
                                            *c = add_i(*c, widen16(p16));
                                        }
                                        p16 = zero_i();
                                    }
                                }
                            }
                        }
                    } else {
                        for k in 0..GROUPS {
                            let wk: [I; S] = std::array::from_fn(|j| unpack(k, j));
                            for t in 0..T {
                                let x = a.q.as_ptr().add((i0 + t) * m.cols + s * e + 4 * k);
                                let xk = splat_i((x as *const i32).read_unaligned());
                                for j in 0..S {
                                    let chain = if split { k / half } else { k % chains };
                                    let c = &mut isum[t][j][chain];
                                    *c = dot::<Q8>(*c, wk[j], xk);
                                }
                            }
                        }
                    }
                    let block_sum = |t: usize, j: usize| {
                        let [c0, c1] = isum[t][j];
                        let v = add_i(c0, if split { shr4_i(c1) } else { c1 });
                        // Formats with a min have zero point 0: nothing to subtract.
                        if (Q8 && CENTERS_Q8) || MINS {
                            v
                        } else {
                            add_i(v, splat_i(*a.corr.get_unchecked((i0 + t) * m.blocks + s)))
                        }
                    };
                    if PER == 1 {
                        let sc: [F; S] =
                            std::array::from_fn(|j| stored::<PER>(m, &sets[j], s, false));
                        for t in 0..T {
                            let da = splat_f(*a.d.get_unchecked((i0 + t) * m.blocks + s));
                            for j in 0..S {
                                acc[t][j] =
                                    fmadd_f(to_f(block_sum(t, j)), mul_f(sc[j], da), acc[t][j]);
                            }
                        }
                        if fused_mins {
                            min_term(s, &mut off);
                        }
                        continue;
                    }
                    if coded {
                        // Q6_K's zero point: minus z x code x sum(q), two blocks at a time.
                        if !MINS && s % 2 == 1 {
                            let pairs: [I; S] =
                                std::array::from_fn(|j| code_pairs(m, &sets[j], s - 1, s, false));
                            let z = splat_i(m.format.zero_point());
                            for t in 0..T {
                                let q = splat_i(pair_sum(a, m, i0 + t, s));
                                for j in 0..S {
                                    let c = mul_i(madd16(pairs[j], q), z);
                                    ksum[t][j] = sub_i(ksum[t][j], c);
                                }
                            }
                        }
                    } else {
                        let code: [I; S] =
                            std::array::from_fn(|j| scale_codes(m, &sets[j], s, HIGH == 2));
                        for t in 0..T {
                            for j in 0..S {
                                ksum[t][j] = add_i(ksum[t][j], mul_i(block_sum(t, j), code[j]));
                            }
                        }
                    }
                    if (s + 1) % PER == 0 {
                        fold_super::<T, S, PER>(m, &sets, a, i0, s, false, &mut ksum, &mut acc);
                    }
                }
                // The mins' terms accumulate separately (as in the contract): where not fused
                // above, a second pass keeps the integer loop's registers free. The K formats'
                // come two blocks at a time, one `vpmaddwd` of both blocks' codes and activation
                // sums (exact), instead of a 32-bit multiply a block: Q4_K products of 4 to 32
                // activation rows took 0.93-0.94 of the time (a hot 1536 x 1536 matrix, 2
                // threads, AMD EPYC Zen 4), one row 0.99.
                if MINS && PER == 1 {
                    if !fused_mins {
                        for s in 0..m.blocks {
                            min_term(s, &mut off);
                        }
                    }
                } else if MINS {
                    for s in (1..m.blocks).step_by(2) {
                        let pairs: [I; S] =
                            std::array::from_fn(|j| code_pairs(m, &sets[j], s - 1, s, true));
                        for t in 0..T {
                            let q = splat_i(pair_sum(a, m, i0 + t, s));
                            for j in 0..S {
                                ksum[t][j] = add_i(ksum[t][j], madd16(pairs[j], q));
                            }
                        }
                        if (s + 1) % PER == 0 {
                            fold_super::<T, S, PER>(m, &sets, a, i0, s, true, &mut ksum, &mut off);
                        }
                    }
                }
                for t in 0..T {
                    for j in 0..S {
                        store_f(
                            sets[j].dst.at(i0 + t, sets[j].lane0),
                            add_f(acc[t][j], off[t][j]),
                        );
                    }
                }
                T
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
x86_path!(avx512, "avx512f,avx512bw,avx512vnni,f16c", zmm_vnni);
#[cfg(target_arch = "x86_64")]
x86_path!(vnni, "avx2,fma,f16c,avxvnni", ymm_vnni);
#[cfg(all(target_arch = "x86_64", test))]
x86_path!(vnni_vl, "avx2,fma,f16c,avx512vnni,avx512vl", ymm_vnni_vl);
#[cfg(target_arch = "x86_64")]
x86_path!(avx2, "avx2,fma,f16c", ymm_avx2);

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
        // `[row][activation row]`, one dispatch per run of rows.
        let rows = |r0: usize, dst: &mut [f32]| {
            dispatch!(rows_dots::<A>(
                m: &F32Matrix = self,
                r0: usize = r0,
                x: &[f32] = x,
                n: usize = n,
                dst: &mut [f32] = dst,
            ))
        };
        let mut tr = vec![0f32; self.rows * n];
        // Below about a million multiply-adds a parallel section costs more than it saves.
        if self.rows * self.cols * n < 1 << 20 {
            rows(0, &mut tr);
        } else {
            const CHUNK: usize = 32;
            let at = &SyncPtr(tr.as_mut_ptr());
            team::for_each(self.rows.div_ceil(CHUNK), |c| {
                let r0 = c * CHUNK;
                let count = CHUNK.min(self.rows - r0);
                // SAFETY: task c alone writes rows r0..r0 + count of `tr` (`[rows, n]`).
                let chunk = unsafe { at.slice_mut(r0 * n, count * n) };
                rows(r0, chunk)
            });
        }
        for (r, col) in tr.chunks(n).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                out[i * self.rows + r] = v;
            }
        }
    }
}

/// Dots of weight rows `r0..` with every activation row, into `dst` (`[row][activation row]`):
/// four activation rows per pass over a weight row, then one at a time (the same bits).
#[inline(always)]
fn rows_dots<A: Arith>(m: &F32Matrix, r0: usize, x: &[f32], n: usize, dst: &mut [f32]) {
    let act = |i: usize| &x[i * m.cols..(i + 1) * m.cols];
    for (k, dst) in dst.chunks_mut(n).enumerate() {
        let w = &m.w[(r0 + k) * m.cols..(r0 + k + 1) * m.cols];
        let mut i = 0;
        while i + 4 <= n {
            dst[i..i + 4]
                .copy_from_slice(&A::dots(w, [act(i), act(i + 1), act(i + 2), act(i + 3)]));
            i += 4;
        }
        for (i, d) in dst.iter_mut().enumerate().skip(i) {
            *d = A::dots(w, [act(i)])[0];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};

    const FORMATS: [(QuantFormat, GgmlDType); 6] = [
        (QuantFormat::Q4_0, GgmlDType::Q4_0),
        (QuantFormat::Q4_1, GgmlDType::Q4_1),
        (QuantFormat::Q4_K, GgmlDType::Q4K),
        (QuantFormat::Q5_0, GgmlDType::Q5_0),
        (QuantFormat::Q6_K, GgmlDType::Q6K),
        (QuantFormat::Q8_0, GgmlDType::Q8_0),
    ];

    /// GGML blocks quantized by candle (GGML's reference quantizers) from random weights, and
    /// candle's dequantization of them.
    fn ggml(dtype: GgmlDType, rows: usize, cols: usize, rng: &mut impl Rng) -> (Vec<u8>, Vec<f32>) {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0).powi(3) * 0.1)
            .collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let deq = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (q.data().unwrap().to_vec(), deq)
    }

    fn cols_for(format: QuantFormat, c: usize) -> usize {
        c.div_ceil(format.ggml_block_elems()) * format.ggml_block_elems()
    }

    #[test]
    fn repacking_dequantizes_exactly_as_ggml() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for (format, dtype) in FORMATS {
            let (rows, cols) = (13, 512);
            let (data, want) = ggml(dtype, rows, cols, &mut rng);
            let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
            for r in 0..rows {
                assert_eq!(
                    m.dequantize_row(r),
                    &want[r * cols..(r + 1) * cols],
                    "{format:?} row {r}"
                );
            }
        }
    }

    #[test]
    fn a_matrix_of_megabytes_is_mapped_on_its_own_and_multiplies_alike() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
        let (rows, cols, n) = (4096, 1536, 3);
        let (data, want) = ggml(GgmlDType::Q4_1, rows, cols, &mut rng);
        let m = QuantMatrix::from_ggml(QuantFormat::Q4_1, rows, cols, &data).unwrap();
        #[cfg(target_os = "linux")]
        assert!(
            m.qs.mapping() == Some(m.qs.as_ptr()),
            "{} bytes not in a mapping of their own",
            m.qs.len()
        );
        for r in [0, 1000, rows - 1] {
            assert_eq!(
                m.dequantize_row(r),
                &want[r * cols..(r + 1) * cols],
                "row {r}"
            );
        }
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut portable = vec![0f32; n * rows];
        matmul_many_on(Path::Portable, &[&m], &x, n, &mut [&mut portable[..]]);
        let mut out = vec![0f32; n * rows];
        m.matmul(&x, n, &mut out);
        assert_eq!(out, portable);
    }

    /// At most GGML's size; Q4_K keeps its 6-bit block codes a byte each, 4 bytes more per 256
    /// weights than GGML's 144 (2.8 %).
    #[test]
    fn repacked_weights_are_no_larger_than_ggmls() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for (format, dtype) in FORMATS {
            let (rows, cols) = (32, 512);
            let (data, _) = ggml(dtype, rows, cols, &mut rng);
            let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
            let extra = if format == QuantFormat::Q4_K {
                rows * cols / 256 * 4
            } else {
                0
            };
            assert!(
                m.bytes() <= data.len() + extra,
                "{format:?}: {} bytes repacked, {} in GGML",
                m.bytes(),
                data.len()
            );
        }
    }

    /// f64 products of the dequantized weights with the unquantized activations, and for each
    /// output the bound that 8-bit activations allow: half a quantization step (`max|x| / 254`
    /// in x's block) times `|w|`, summed, plus float rounding.
    fn reference(m: &QuantMatrix, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
        let w: Vec<Vec<f32>> = (0..m.rows).map(|r| m.dequantize_row(r)).collect();
        let (mut out, mut bound) = (vec![0f64; n * m.rows], vec![0f64; n * m.rows]);
        for i in 0..n {
            let x = &x[i * m.cols..(i + 1) * m.cols];
            let act = m.format.act_block();
            let step: Vec<f64> = x
                .chunks(act)
                .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 254.0)
                .collect();
            for (r, wr) in w.iter().enumerate() {
                let at = i * m.rows + r;
                for (c, (&w, &x)) in wr.iter().zip(x).enumerate() {
                    out[at] += w as f64 * x as f64;
                    bound[at] += (w as f64).abs() * (step[c / act] * 1.001 + 1e-6 * x.abs() as f64);
                }
            }
        }
        (out, bound)
    }

    #[test]
    fn matches_the_f32_reference_for_every_format_and_odd_shapes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for (format, dtype) in FORMATS {
            for &(rows, cols, n) in &[(1, 32, 1), (37, 96, 3), (70, 320, 17), (33, 64, 64)] {
                let cols = cols_for(format, cols);
                let (data, _) = ggml(dtype, rows, cols, &mut rng);
                let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
                let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                let (want, bound) = reference(&m, &x, n);
                for path in Path::available() {
                    let mut out = vec![f32::NAN; n * rows];
                    matmul_many_on(path, &[&m], &x, n, &mut [&mut out[..]]);
                    for (j, ((o, w), b)) in out.iter().zip(&want).zip(&bound).enumerate() {
                        assert!(
                            (*o as f64 - w).abs() <= *b,
                            "{format:?} {path:?} {rows}x{cols} n={n} output {j}: {o} vs {w} (bound {b})"
                        );
                    }
                }
            }
        }
    }

    /// The plan's runs cover every task once, in order, and the threads' shares of the weight
    /// bytes differ by less than two tasks' (each share ends at the first task past its part).
    #[test]
    fn the_plan_covers_every_task_once_in_shares_of_equal_bytes() {
        let shapes = [
            vec![(960, 576, QuantFormat::Q4_1)],
            vec![
                (1536, 1536, QuantFormat::Q4_K),
                (256, 1536, QuantFormat::Q4_K),
                (256, 1536, QuantFormat::Q6_K),
            ],
            vec![
                (33, 256, QuantFormat::Q4_K),
                (5, 256, QuantFormat::Q6_K),
                (700, 256, QuantFormat::Q8_0),
            ],
            vec![(17, 64, QuantFormat::Q4_0)],
        ];
        for shapes in shapes {
            let ms: Vec<QuantMatrix> = shapes
                .iter()
                .map(|&(r, c, f)| {
                    let bytes = r * c / f.ggml_block_elems() * f.ggml_block_bytes();
                    QuantMatrix::from_ggml(f, r, c, &vec![0u8; bytes]).unwrap()
                })
                .collect();
            let mats: Vec<&QuantMatrix> = ms.iter().collect();
            let mut p = Product::default();
            plan_shares(&mats, &mut p);
            let threads = rayon::current_num_threads();
            assert_eq!(p.runs.len(), threads * RUNS_PER_THREAD);
            let tasks = *p.first_task.last().unwrap();
            let mut at = 0;
            for r in &p.runs {
                assert_eq!(r.start, at, "{shapes:?}: runs in order, none missing");
                at = r.end;
            }
            assert_eq!(at, tasks, "{shapes:?}");
            // Each task's bytes, and each thread's share of them.
            let bytes: Vec<usize> = mats
                .iter()
                .flat_map(|m| {
                    let groups = m.rows.div_ceil(ROWS);
                    (0..groups)
                        .step_by(QuantMatrix::CHUNK)
                        .map(move |g0| QuantMatrix::CHUNK.min(groups - g0) * m.group_bytes())
                })
                .collect();
            assert_eq!(bytes.len(), tasks);
            let shares: Vec<usize> = p
                .runs
                .chunks(RUNS_PER_THREAD)
                .map(|runs| {
                    bytes[runs[0].start..runs[RUNS_PER_THREAD - 1].end]
                        .iter()
                        .sum()
                })
                .collect();
            let largest_task = *bytes.iter().max().unwrap();
            let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
            assert!(hi - lo < 2 * largest_task, "{shapes:?}: shares {shares:?}");
        }
    }

    #[test]
    fn several_matrices_at_once_give_the_bits_of_each_alone() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let (cols, n) = (256, 5);
        // Same formats and mixed ones (a Q4_K_M layer's Q4_K query and key with a Q6_K value).
        let mats: Vec<QuantMatrix> = [(48, 1), (16, 1), (37, 1), (40, 2), (24, 4), (33, 2)]
            .iter()
            .map(|&(rows, f)| {
                let (format, dtype) = FORMATS[f];
                let (data, _) = ggml(dtype, rows, cols, &mut rng);
                QuantMatrix::from_ggml(format, rows, cols, &data).unwrap()
            })
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows]).collect();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
        matmul_many(&mats.iter().collect::<Vec<_>>(), &x, n, &mut slices);
        for (m, got) in mats.iter().zip(&outs) {
            let mut alone = vec![0f32; n * m.rows];
            m.matmul(&x, n, &mut alone);
            assert_eq!(got, &alone);
        }
    }

    #[test]
    fn a_row_is_bit_identical_whatever_the_batch_and_the_code_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        for (format, dtype) in FORMATS {
            let (rows, cols) = (75, cols_for(format, 192));
            let (data, _) = ggml(dtype, rows, cols, &mut rng);
            let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..64 * cols)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let mut all = vec![0f32; 64 * rows];
            matmul_many_on(Path::Portable, &[&m], &x, 64, &mut [&mut all[..]]);
            for path in Path::available() {
                for (i, n) in [
                    (0usize, 1usize),
                    (20, 2),
                    (5, 3),
                    (16, 17),
                    (63, 1),
                    (0, 64),
                ] {
                    let mut part = vec![0f32; n * rows];
                    matmul_many_on(
                        path,
                        &[&m],
                        &x[i * cols..(i + n) * cols],
                        n,
                        &mut [&mut part[..]],
                    );
                    assert_eq!(
                        &part[..],
                        &all[i * rows..(i + n) * rows],
                        "{format:?} {path:?}: rows {i}.. in a batch of {n} vs portable in 64"
                    );
                }
            }
        }
    }
    /// The K formats' blocks at the ends of their ranges (every value, code and min at its
    /// largest, or codes at -128), against activations at +-127 everywhere: the paths' 16-bit
    /// pair sums and code products must stay exact there too.
    #[test]
    fn extreme_k_blocks_give_the_portable_bits_on_every_path() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for format in [QuantFormat::Q4_K, QuantFormat::Q6_K] {
            let (rows, cols) = (40, 512);
            let bytes = format.ggml_block_bytes();
            for fill in [Some(0xffu8), Some(0x80), None] {
                let mut data: Vec<u8> = (0..rows * cols / 256 * bytes)
                    .map(|_| fill.unwrap_or_else(|| rng.random()))
                    .collect();
                // The f16 scales (and Q4_K's min scale): 0.01, so that the sums stay finite.
                let f16_at: &[usize] = if format == QuantFormat::Q6_K {
                    &[208]
                } else {
                    &[0, 2]
                };
                for block in data.chunks_mut(bytes) {
                    for &at in f16_at {
                        block[at..at + 2].copy_from_slice(&0x211fu16.to_le_bytes());
                    }
                }
                let m = QuantMatrix::from_ggml(format, rows, cols, &data).unwrap();
                for n in [1, 3, 8] {
                    let x: Vec<f32> = (0..n * cols)
                        .map(|i| {
                            if (i / cols + i / 7) % 3 == 0 {
                                -1.0
                            } else {
                                1.0
                            }
                        })
                        .collect();
                    let mut want = vec![0f32; n * rows];
                    matmul_many_on(Path::Portable, &[&m], &x, n, &mut [&mut want[..]]);
                    for path in Path::available() {
                        let mut got = vec![0f32; n * rows];
                        matmul_many_on(path, &[&m], &x, n, &mut [&mut got[..]]);
                        assert_eq!(got, want, "{format:?} {path:?} fill {fill:?} n={n}");
                    }
                }
            }
        }
    }

    #[test]
    fn an_f32_row_is_bit_identical_whatever_the_batch() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        // Odd columns exercise the tails; 601 rows the parallel path and a row count that is
        // not a multiple of four.
        for (rows, cols) in [(75, 130), (601, 512)] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let m = F32Matrix::new(rows, cols, w.clone());
            let n = 9;
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-3.0..3.0)).collect();
            let mut all = vec![0f32; n * rows];
            m.matmul(&x, n, &mut all);
            for i in 0..n {
                let mut alone = vec![0f32; rows];
                m.matmul(&x[i * cols..(i + 1) * cols], 1, &mut alone);
                assert_eq!(&alone[..], &all[i * rows..(i + 1) * rows], "row {i} of {n}");
                for r in 0..rows {
                    let exact: f64 = (0..cols)
                        .map(|c| w[r * cols + c] as f64 * x[i * cols + c] as f64)
                        .sum();
                    assert!(
                        (alone[r] as f64 - exact).abs() < 1e-3,
                        "{} vs {exact}",
                        alone[r]
                    );
                }
            }
        }
    }
}
