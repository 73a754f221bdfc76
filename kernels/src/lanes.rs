//! Float loops written once over 8-lane arrays and compiled twice: plainly (any CPU, WebAssembly)
//! and inside `avx2,fma` functions, where the same code vectorises to 256-bit fused multiply-adds.
//!
//! Each loop's order of operations is fixed by its inputs' lengths only, so a result never
//! depends on the batch around it. The two compilations differ in rounding (fused or separate
//! multiply-add): a process uses one of them throughout.

/// How a multiply-add rounds, and the two attention loops, which the fused compilation writes
/// with intrinsics (the compiler does not vectorise their lane arrays reliably).
pub(crate) trait Arith {
    fn madd(a: f32, b: f32, c: f32) -> f32;

    /// Dot products of `a` with each of `R` vectors: eight lane accumulators in order, then
    /// [`hsum8`], then the tail; the `R` chains are interleaved so they overlap, and each result
    /// is the bits `dots::<1>(a, [b[j]])` gives (for f16 vectors, the bits of their f32 values).
    #[inline(always)]
    fn dots<E: CacheValue, const R: usize>(a: &[f32], b: [&[E]; R]) -> [f32; R] {
        dots_lanes::<Self, E, R>(a, b)
    }

    /// `out[p] = dots(a, [row p])[0] * scale` for the eight rows `b[offset + p * stride..]` of a
    /// strided matrix (attention's K rows of one kv head): the bits of [`Arith::dots`], without
    /// slices to build or results to pass through memory.
    #[inline(always)]
    fn scaled_dots8<E: CacheValue>(
        a: &[f32],
        b: &[E],
        offset: usize,
        stride: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        scaled_dots8_rows::<Self, E>(a, b, offset, stride, scale, out)
    }

    /// Replaces each score `s` by `exp(s - max)` and returns their sum (8 lanes, then the tail).
    #[inline(always)]
    fn exp_shifted_sum(s: &mut [f32], max: f32) -> f32 {
        exp_shifted_sum_lanes::<Self>(s, max)
    }

    /// Asks for the cache line at `p` ahead of its use (never faults, whatever the address).
    #[inline(always)]
    fn prefetch(_p: *const u8) {}

    /// `dst[i] = src[i]` as f32 (exact), for the first `src.len()` values.
    #[inline(always)]
    fn widen<E: CacheValue>(src: &[E], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }

    /// For each of `R` rows: `acc[t % 2] += weights[t] * cache[at(t)..][..D]` for `t` in `ts`,
    /// in order: the sums of even and odd positions are two chains in flight; callers add them
    /// at the end. A row's bits are those it gets alone (`R = 1`), and splitting a range into
    /// consecutive calls gives the same bits as one call.
    #[inline(always)]
    fn accumulate<E: CacheValue, const D: usize, const R: usize>(
        acc: &mut [[[f32; D]; 2]; R],
        cache: &[E],
        at: impl Fn(usize) -> usize,
        ts: std::ops::Range<usize>,
        weights: [&[f32]; R],
    ) {
        for (acc, w) in acc.iter_mut().zip(weights) {
            accumulate_lanes::<Self, E, D>(acc, cache, &at, ts.clone(), w)
        }
    }
}

/// A value of the K/V cache as the attention loops read it: f32, or f16 converted to f32 as it
/// is loaded, in registers. Every f16 is an f32, so the loops give an f16 cache the bits of f32
/// arithmetic on the same values, without widening its rows into a buffer first (which took
/// about a third of a decoding step's attention).
pub(crate) trait CacheValue: Copy + Send + Sync + 'static {
    /// Whether the value is an f16 (the SIMD loads convert eight or sixteen at once).
    const HALF: bool;
    fn to_f32(self) -> f32;
}

impl CacheValue for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl CacheValue for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// [`Arith::scaled_dots8`] through [`Arith::dots`] on eight row slices.
#[inline(always)]
fn scaled_dots8_rows<A: Arith + ?Sized, E: CacheValue>(
    a: &[f32],
    b: &[E],
    offset: usize,
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    let mut rows: [&[E]; 8] = [&[]; 8];
    for (p, r) in rows.iter_mut().enumerate() {
        *r = &b[offset + p * stride..][..a.len()];
    }
    for (o, s) in out[..8].iter_mut().zip(A::dots(a, rows)) {
        *o = s * scale;
    }
}

#[inline(always)]
fn accumulate_lanes<A: Arith + ?Sized, E: CacheValue, const D: usize>(
    acc: &mut [[f32; D]; 2],
    cache: &[E],
    at: impl Fn(usize) -> usize,
    ts: std::ops::Range<usize>,
    weights: &[f32],
) {
    for t in ts {
        let row = &cache[at(t)..][..D];
        for (a, x) in acc[t % 2].iter_mut().zip(row) {
            *a = A::madd(weights[t], x.to_f32(), *a);
        }
    }
}

/// `a * b + c` rounded twice: fast everywhere, including CPUs and WebAssembly without FMA.
pub(crate) struct Plain;

impl Arith for Plain {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// One rounding; only used inside functions compiled with the `fma` feature.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Fused;

#[cfg(target_arch = "x86_64")]
impl Arith for Fused {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    #[inline(always)]
    fn dots<E: CacheValue, const R: usize>(a: &[f32], b: [&[E]; R]) -> [f32; R] {
        // SAFETY: `Fused` only runs inside `avx2,fma,f16c` functions (see `dispatch`).
        unsafe { fused::dots(a, b) }
    }

    #[inline(always)]
    fn exp_shifted_sum(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { fused::exp_shifted_sum(s, max) }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never faults.
        unsafe { std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0) }
    }

    #[inline(always)]
    fn widen<E: CacheValue>(src: &[E], dst: &mut [f32]) {
        // SAFETY: as above.
        unsafe { fused::widen(src, dst) }
    }

    #[inline(always)]
    fn accumulate<E: CacheValue, const D: usize, const R: usize>(
        acc: &mut [[[f32; D]; 2]; R],
        cache: &[E],
        at: impl Fn(usize) -> usize,
        ts: std::ops::Range<usize>,
        weights: [&[f32]; R],
    ) {
        // Sixteen registers hold one row's accumulators at most: rows one by one.
        for (acc, w) in acc.iter_mut().zip(weights) {
            if D.is_multiple_of(8) && D <= 32 {
                // SAFETY: as above.
                unsafe { fused::accumulate(acc, cache, &at, ts.clone(), w) }
            } else {
                accumulate_lanes::<Self, E, D>(acc, cache, &at, ts.clone(), w)
            }
        }
    }
}

/// [`exp_nonpositive`] and [`exp_shifted_sum_lanes`] in intrinsics of one register width,
/// operation for operation (the compiler vectorised the lane code only four wide): one body for
/// the 256-bit and the 512-bit compilation, given their intrinsics.
#[cfg(target_arch = "x86_64")]
macro_rules! softmax_exp {
    (features: $features:literal, arith: $arith:ty, lanes: $lanes:literal, float: $f:ty,
     set1: $set1:ident, set1_i: $set1_i:ident, zero: $zero:ident,
     load: $load:ident, store: $store:ident, add: $add:ident, sub: $sub:ident,
     mul: $mul:ident, fmadd: $fmadd:ident, max: $max:ident,
     to_bits: $to_bits:ident, from_bits: $from_bits:ident, add_i: $add_i:ident,
     sub_i: $sub_i:ident, shift_left: $shl:ident,
     below: |$bx:ident, $bf:ident| $below:expr,
     zero_where: |$zm:ident, $zy:ident| $zero_where:expr,
     sum: |$sv:ident| $sum:expr $(,)?) => {
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn exp_nonpositive(x: $f) -> $f {
            use super::{EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E, ROUND};
            let floor = $set1(-87.0);
            let far_below = {
                let ($bx, $bf) = (x, floor);
                $below
            };
            let x = $max(x, floor);
            let round = $set1(ROUND);
            let shifted = $add($mul(x, $set1(LOG2E)), round);
            let n = $sub(shifted, round);
            let n_int = $sub_i($to_bits(shifted), $set1_i(ROUND.to_bits() as i32));
            let r = $fmadd(n, $set1(-LN2_HI), x);
            let r = $fmadd(n, $set1(-LN2_LO), r);
            let mut p = $set1(EXP_TAYLOR[0]);
            for &c in &EXP_TAYLOR[1..] {
                p = $fmadd(p, r, $set1(c));
            }
            let scale = $shl::<23>($add_i(n_int, $set1_i(127)));
            let ($zm, $zy) = (far_below, $mul(p, $from_bits(scale)));
            $zero_where
        }

        /// [`super::exp_shifted_sum_lanes`] with [`exp_nonpositive`].
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn exp_shifted_sum(s: &mut [f32], max: f32) -> f32 {
            let m = $set1(max);
            let mut sum = $zero();
            let chunks = s.len() / $lanes;
            for c in 0..chunks {
                let p = s.as_mut_ptr().add($lanes * c);
                let e = exp_nonpositive($sub($load(p), m));
                $store(p, e);
                sum = $add(sum, e);
            }
            let mut tail = 0f32;
            for x in &mut s[chunks * $lanes..] {
                *x = super::exp_nonpositive::<$arith>(*x - max);
                tail += *x;
            }
            let $sv = sum;
            $sum + tail
        }
    };
}

/// [`Fused`] with the intrinsic loops on 512-bit registers: twice the multiply-adds per
/// instruction where the CPU executes them at full width. Only used inside functions compiled
/// with `avx512f` (see `dispatch`). Its dot products sum in 16 lanes, so its bits differ from
/// [`Fused`]'s; a process uses one of them throughout.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Wide;

#[cfg(target_arch = "x86_64")]
impl Arith for Wide {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    #[inline(always)]
    fn dots<E: CacheValue, const R: usize>(a: &[f32], b: [&[E]; R]) -> [f32; R] {
        // SAFETY: `Wide` only runs inside `avx512f,avx2,fma,f16c` functions (see `dispatch`).
        unsafe { wide::dots(a, b) }
    }

    #[inline(always)]
    fn scaled_dots8<E: CacheValue>(
        a: &[f32],
        b: &[E],
        offset: usize,
        stride: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        if a.len().is_multiple_of(16) {
            // SAFETY: as above.
            unsafe { wide::scaled_dots8(a, b, offset, stride, scale, out) }
        } else {
            scaled_dots8_rows::<Self, E>(a, b, offset, stride, scale, out)
        }
    }

    #[inline(always)]
    fn exp_shifted_sum(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: as above.
        unsafe { wide::exp_shifted_sum(s, max) }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        Fused::prefetch(p)
    }

    #[inline(always)]
    fn widen<E: CacheValue>(src: &[E], dst: &mut [f32]) {
        // SAFETY: as above.
        unsafe { wide::widen(src, dst) }
    }

    #[inline(always)]
    fn accumulate<E: CacheValue, const D: usize, const R: usize>(
        acc: &mut [[[f32; D]; 2]; R],
        cache: &[E],
        at: impl Fn(usize) -> usize,
        ts: std::ops::Range<usize>,
        weights: [&[f32]; R],
    ) {
        // Every row's accumulators and one V row in the 32 registers.
        if D.is_multiple_of(16) && D <= 64 && (2 * R + 1) * D / 16 <= 30 {
            // SAFETY: as above.
            unsafe { wide::accumulate(acc, cache, at, ts, weights) }
        } else {
            Fused::accumulate(acc, cache, at, ts, weights)
        }
    }
}

/// The wide loops: [`fused`]'s on 16 lanes. A 16-lane sum folds its halves first, then goes on
/// as [`hsum8`].
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::{fused, CacheValue};
    use std::arch::x86_64::*;

    /// `lo + hi` of a 16-lane vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn fold(v: __m512) -> __m256 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        _mm256_add_ps(_mm512_castps512_ps256(v), hi)
    }

    /// Sixteen cache values from `p` as f32 (f16 converted exactly).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16<E: CacheValue>(p: *const E) -> __m512 {
        if E::HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dots<E: CacheValue, const R: usize>(a: &[f32], b: [&[E]; R]) -> [f32; R] {
        let chunks = a.len() / 16;
        let mut bp = [std::ptr::null::<E>(); R];
        for j in 0..R {
            assert!(b[j].len() >= a.len(), "vectors differ in length");
            bp[j] = b[j].as_ptr();
        }
        let mut s = [_mm512_setzero_ps(); R];
        for c in 0..chunks {
            let x = _mm512_loadu_ps(a.as_ptr().add(16 * c));
            for j in 0..R {
                s[j] = _mm512_fmadd_ps(x, load16(bp[j].add(16 * c)), s[j]);
            }
        }
        let mut tails = [0f32; R];
        for j in 0..R {
            for (x, y) in a[chunks * 16..].iter().zip(&b[j][chunks * 16..]) {
                tails[j] = x.mul_add(y.to_f32(), tails[j]);
            }
        }
        let mut folded = [_mm256_setzero_ps(); R];
        for j in 0..R {
            folded[j] = fold(s[j]);
        }
        fused::sums_plus_tails(folded, tails)
    }

    /// [`super::Arith::scaled_dots8`] for a length that is a multiple of 16: [`dots`]'s
    /// operations (no tail; the sum of the tails, 0, still added) on raw pointers.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn scaled_dots8<E: CacheValue>(
        a: &[f32],
        b: &[E],
        offset: usize,
        stride: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let n = a.len();
        assert!(
            offset + 7 * stride + n <= b.len() && out.len() >= 8,
            "rows or out out of bounds"
        );
        let base = b.as_ptr().add(offset);
        let mut s = [_mm512_setzero_ps(); 8];
        for c in 0..n / 16 {
            let x = _mm512_loadu_ps(a.as_ptr().add(16 * c));
            for (p, s) in s.iter_mut().enumerate() {
                *s = _mm512_fmadd_ps(x, load16(base.add(p * stride + 16 * c)), *s);
            }
        }
        let mut folded = [_mm256_setzero_ps(); 8];
        for (f, s) in folded.iter_mut().zip(s) {
            *f = fold(s);
        }
        let sums = _mm256_add_ps(fused::hsum8x8(folded), _mm256_setzero_ps());
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    }

    /// [`super::Arith::widen`], sixteen values an instruction.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn widen<E: CacheValue>(src: &[E], dst: &mut [f32]) {
        assert!(dst.len() >= src.len(), "dst too short");
        let chunks = src.len() / 16;
        for c in 0..chunks {
            _mm512_storeu_ps(
                dst.as_mut_ptr().add(16 * c),
                load16(src.as_ptr().add(16 * c)),
            );
        }
        fused::widen(&src[16 * chunks..], &mut dst[16 * chunks..]);
    }

    softmax_exp! {
        features: "avx512f,avx2,fma", arith: super::Wide, lanes: 16, float: __m512,
        set1: _mm512_set1_ps, set1_i: _mm512_set1_epi32, zero: _mm512_setzero_ps,
        load: _mm512_loadu_ps, store: _mm512_storeu_ps, add: _mm512_add_ps, sub: _mm512_sub_ps,
        mul: _mm512_mul_ps, fmadd: _mm512_fmadd_ps, max: _mm512_max_ps,
        to_bits: _mm512_castps_si512, from_bits: _mm512_castsi512_ps, add_i: _mm512_add_epi32,
        sub_i: _mm512_sub_epi32, shift_left: _mm512_slli_epi32,
        below: |x, floor| _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor),
        zero_where: |below, y| _mm512_maskz_mov_ps(!below, y),
        sum: |v| fused::hsum8(fold(v)),
    }

    /// `D` is a multiple of 16, at most 64, and `R` rows' accumulators fit the registers: each
    /// V row is loaded once for all the rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn accumulate<E: CacheValue, const D: usize, const R: usize>(
        acc: &mut [[[f32; D]; 2]; R],
        cache: &[E],
        at: impl Fn(usize) -> usize,
        ts: std::ops::Range<usize>,
        weights: [&[f32]; R],
    ) {
        let mut even = [[_mm512_setzero_ps(); 4]; R];
        let mut odd = [[_mm512_setzero_ps(); 4]; R];
        for r in 0..R {
            assert!(weights[r].len() >= ts.end, "weights too short");
            for c in 0..D / 16 {
                even[r][c] = _mm512_loadu_ps(acc[r][0].as_ptr().add(16 * c));
                odd[r][c] = _mm512_loadu_ps(acc[r][1].as_ptr().add(16 * c));
            }
        }
        let step = |acc: &mut [[__m512; 4]; R], t: usize| {
            let row = cache[at(t)..][..D].as_ptr();
            let mut v = [_mm512_setzero_ps(); 4];
            for (c, v) in v.iter_mut().enumerate().take(D / 16) {
                *v = load16(row.add(16 * c));
            }
            for r in 0..R {
                // SAFETY: t < ts.end <= weights[r].len(), checked above.
                let w = _mm512_set1_ps(*weights[r].get_unchecked(t));
                for c in 0..D / 16 {
                    acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
                }
            }
        };
        let mut t = ts.start;
        if t % 2 == 1 && t < ts.end {
            step(&mut odd, t);
            t += 1;
        }
        while t + 1 < ts.end {
            step(&mut even, t);
            step(&mut odd, t + 1);
            t += 2;
        }
        if t < ts.end {
            step(&mut even, t);
        }
        for r in 0..R {
            for c in 0..D / 16 {
                _mm512_storeu_ps(acc[r][0].as_mut_ptr().add(16 * c), even[r][c]);
                _mm512_storeu_ps(acc[r][1].as_mut_ptr().add(16 * c), odd[r][c]);
            }
        }
    }
}

/// The fused loops in 256-bit intrinsics, operation for operation the lane code's.
#[cfg(target_arch = "x86_64")]
mod fused {
    use super::CacheValue;
    use std::arch::x86_64::*;

    /// Eight cache values from `p` as f32 (f16 converted exactly).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<E: CacheValue>(p: *const E) -> __m256 {
        if E::HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            _mm256_loadu_ps(p as *const f32)
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dots<E: CacheValue, const R: usize>(a: &[f32], b: [&[E]; R]) -> [f32; R] {
        let chunks = a.len() / 8;
        // Plain loops, no closures: a closure here would not inherit the target features and
        // could stay an out-of-line call in the hot loop.
        let mut bp = [std::ptr::null::<E>(); R];
        for j in 0..R {
            assert!(b[j].len() >= a.len(), "vectors differ in length");
            bp[j] = b[j].as_ptr();
        }
        let mut s = [_mm256_setzero_ps(); R];
        for c in 0..chunks {
            let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
            for j in 0..R {
                s[j] = _mm256_fmadd_ps(x, load8(bp[j].add(8 * c)), s[j]);
            }
        }
        let mut tails = [0f32; R];
        for j in 0..R {
            for (x, y) in a[chunks * 8..].iter().zip(&b[j][chunks * 8..]) {
                tails[j] = x.mul_add(y.to_f32(), tails[j]);
            }
        }
        sums_plus_tails(s, tails)
    }

    /// `hsum8(s[j]) + tails[j]`; eight at once through [`hsum8x8`], written with one store
    /// (a caller reading the array back whole then gets it forwarded, not stalled).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sums_plus_tails<const R: usize>(
        s: [__m256; R],
        tails: [f32; R],
    ) -> [f32; R] {
        let mut out = [0f32; R];
        if R == 8 {
            let mut v = [_mm256_setzero_ps(); 8];
            v.copy_from_slice(&s[..8]);
            let r = _mm256_add_ps(hsum8x8(v), _mm256_loadu_ps(tails.as_ptr()));
            _mm256_storeu_ps(out.as_mut_ptr(), r);
        } else {
            for j in 0..R {
                out[j] = hsum8(s[j]) + tails[j];
            }
        }
        out
    }

    /// [`hsum8`] of eight vectors at once, in its order (halves, then pairs, then the last two),
    /// transposing as it adds: a third of the operations of eight separate sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hsum8x8(v: [__m256; 8]) -> __m256 {
        // Halves: [v_p.lo + v_p.hi, v_q.lo + v_q.hi] for the pairs (0, 1), (2, 3), ...
        let halves = |p: __m256, q: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(p, q),
                _mm256_permute2f128_ps::<0x31>(p, q),
            )
        };
        let (h01, h23) = (halves(v[0], v[1]), halves(v[2], v[3]));
        let (h45, h67) = (halves(v[4], v[5]), halves(v[6], v[7]));
        // Pairs: t0 + t2 and t1 + t3 of each; lanes [0, 2 | 1, 3] and [4, 6 | 5, 7] by pairs.
        let pairs = |p: __m256, q: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(p, q),
                _mm256_shuffle_ps::<0b11_10_11_10>(p, q),
            )
        };
        let (u0123, u4567) = (pairs(h01, h23), pairs(h45, h67));
        // The last two: lanes [0, 2, 4, 6 | 1, 3, 5, 7].
        let r = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(u0123, u4567),
            _mm256_shuffle_ps::<0b11_01_11_01>(u0123, u4567),
        );
        _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// [`super::hsum8`]'s additions in its order: halves, pairs, the last two.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn hsum8(v: __m256) -> f32 {
        let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
        _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)))
    }

    /// [`super::Arith::widen`], eight values an instruction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn widen<E: CacheValue>(src: &[E], dst: &mut [f32]) {
        assert!(dst.len() >= src.len(), "dst too short");
        let chunks = src.len() / 8;
        for c in 0..chunks {
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * c), load8(src.as_ptr().add(8 * c)));
        }
        for (d, s) in dst[8 * chunks..].iter_mut().zip(&src[8 * chunks..]) {
            *d = s.to_f32();
        }
    }

    softmax_exp! {
        features: "avx2,fma", arith: super::Fused, lanes: 8, float: __m256,
        set1: _mm256_set1_ps, set1_i: _mm256_set1_epi32, zero: _mm256_setzero_ps,
        load: _mm256_loadu_ps, store: _mm256_storeu_ps, add: _mm256_add_ps, sub: _mm256_sub_ps,
        mul: _mm256_mul_ps, fmadd: _mm256_fmadd_ps, max: _mm256_max_ps,
        to_bits: _mm256_castps_si256, from_bits: _mm256_castsi256_ps, add_i: _mm256_add_epi32,
        sub_i: _mm256_sub_epi32, shift_left: _mm256_slli_epi32,
        below: |x, floor| _mm256_cmp_ps::<_CMP_LT_OQ>(x, floor),
        zero_where: |below, y| _mm256_andnot_ps(below, y),
        sum: |v| hsum8(v),
    }

    /// [`super::quantize_lanes`] in intrinsics, 32 values at a time (the compilers vectorised
    /// the lane code across blocks, with gathers), and the sums of the quantized values by
    /// `sum_len` (16 or 32) from the integers before they are packed. The block's largest
    /// magnitude is folded in registers: the same value as the lane code's fold (no lane holds a
    /// NaN, and a maximum is exact in any order).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_blocks(
        x: &[f32],
        block: usize,
        sum_len: usize,
        q: &mut [i8],
        d: &mut [f32],
        sums: &mut [i32],
    ) {
        use super::ROUND;
        assert!(block.is_multiple_of(32), "blocks of 32 values");
        assert!(sum_len == 16 || sum_len == 32, "sums of 16 or 32 values");
        let blocks = x.len() / block;
        assert!(
            q.len() >= blocks * block
                && d.len() >= blocks
                && sums.len() >= blocks * block / sum_len,
            "q, d or sums too short"
        );
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let round = _mm256_set1_ps(ROUND);
        let round_bits = _mm256_set1_epi32(ROUND.to_bits() as i32);
        // After the two packs a block's bytes sit in 4-byte groups ordered 0, 2, 4, 6, 1, 3, 5, 7.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let sum8 = |v: __m256i| -> i32 {
            let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
        };
        for (b, d) in d.iter_mut().enumerate().take(blocks) {
            let p = x.as_ptr().add(block * b);
            let mut m = _mm256_setzero_ps();
            for c in 0..block / 8 {
                // max(|x|, m): a NaN input loses to m, as f32::max does.
                m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p.add(8 * c)), abs), m);
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            *d = amax / 127.0;
            let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for k in 0..block / 32 {
                let p = p.add(32 * k);
                let mut ints = [_mm256_setzero_si256(); 4];
                for (c, i) in ints.iter_mut().enumerate() {
                    let v = _mm256_loadu_ps(p.add(8 * c));
                    let shifted = _mm256_add_ps(_mm256_mul_ps(v, id), round);
                    *i = _mm256_sub_epi32(_mm256_castps_si256(shifted), round_bits);
                }
                // |q| <= 127: the saturating packs never saturate.
                let words = [
                    _mm256_packs_epi32(ints[0], ints[1]),
                    _mm256_packs_epi32(ints[2], ints[3]),
                ];
                let bytes = _mm256_packs_epi16(words[0], words[1]);
                let bytes = _mm256_permutevar8x32_epi32(bytes, order);
                let at = block * b + 32 * k;
                _mm256_storeu_si256(q.as_mut_ptr().add(at) as *mut __m256i, bytes);
                let (low, high) = (
                    _mm256_add_epi32(ints[0], ints[1]),
                    _mm256_add_epi32(ints[2], ints[3]),
                );
                if sum_len == 32 {
                    *sums.get_unchecked_mut(at / 32) = sum8(_mm256_add_epi32(low, high));
                } else {
                    *sums.get_unchecked_mut(at / 16) = sum8(low);
                    *sums.get_unchecked_mut(at / 16 + 1) = sum8(high);
                }
            }
        }
    }

    /// `D` is a multiple of 8, at most 32: the accumulators stay in registers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn accumulate<E: CacheValue, const D: usize>(
        acc: &mut [[f32; D]; 2],
        cache: &[E],
        at: impl Fn(usize) -> usize,
        ts: std::ops::Range<usize>,
        weights: &[f32],
    ) {
        let load = |a: &[f32; D]| -> [__m256; 4] {
            std::array::from_fn(|c| {
                if c < D / 8 {
                    _mm256_loadu_ps(a.as_ptr().add(8 * c))
                } else {
                    _mm256_setzero_ps()
                }
            })
        };
        let (mut even, mut odd) = (load(&acc[0]), load(&acc[1]));
        let step = |acc: &mut [__m256; 4], t: usize| {
            let row = cache[at(t)..][..D].as_ptr();
            let w = _mm256_set1_ps(weights[t]);
            for (c, acc) in acc.iter_mut().enumerate().take(D / 8) {
                *acc = _mm256_fmadd_ps(w, load8(row.add(8 * c)), *acc);
            }
        };
        let mut t = ts.start;
        if t % 2 == 1 && t < ts.end {
            step(&mut odd, t);
            t += 1;
        }
        while t + 1 < ts.end {
            step(&mut even, t);
            step(&mut odd, t + 1);
            t += 2;
        }
        if t < ts.end {
            step(&mut even, t);
        }
        for c in 0..D / 8 {
            _mm256_storeu_ps(acc[0].as_mut_ptr().add(8 * c), even[c]);
            _mm256_storeu_ps(acc[1].as_mut_ptr().add(8 * c), odd[c]);
        }
    }
}

/// Whether the `avx2,fma,f16c` compilation may run here (`SPECINFER_NO_SIMD` turns it off).
/// F16C (half-precision conversions, for the f16 K/V cache) comes with AVX2 on every CPU that
/// has both AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_fma() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os("SPECINFER_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Whether the 512-bit compilation may run here (`SPECINFER_NO_AVX512` or `SPECINFER_NO_SIMD`
/// turn it off).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        avx2_fma()
            && std::env::var_os("SPECINFER_NO_AVX512").is_none()
            && is_x86_feature_detected!("avx512f")
    })
}

/// Calls `$f` (an `#[inline(always)]` function generic over [`Arith`]) compiled for AVX-512
/// ([`Wide`]) or AVX2+FMA+F16C ([`Fused`]) when the CPU has it. The arguments are written `name: Type = value`: the AVX2 instance is a
/// function of its own with those parameters, so the generic body is inlined into code that has
/// the features from the start (unrolled and vectorised with them). Type parameters of the
/// caller that the call uses are named first, with their bound: `<E: CacheValue> f::<A, E>(..)`.
macro_rules! dispatch {
    ($(<$($g:ident : $bound:path),+>)? $f:ident :: <A $(, $c:tt)*>($($arg:ident : $ty:ty = $val:expr),* $(,)?) $(-> $ret:ty)?) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            unsafe fn wide$(<$($g: $bound),+>)?($($arg: $ty),*) $(-> $ret)? {
                $f::<$crate::lanes::Wide $(, $c)*>($($arg),*)
            }
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn fused$(<$($g: $bound),+>)?($($arg: $ty),*) $(-> $ret)? {
                $f::<$crate::lanes::Fused $(, $c)*>($($arg),*)
            }
            if $crate::lanes::avx512() {
                // SAFETY: AVX-512F, AVX2 and FMA were detected at run time.
                unsafe { wide($($val),*) }
            } else if $crate::lanes::avx2_fma() {
                // SAFETY: AVX2 and FMA were detected at run time.
                unsafe { fused($($val),*) }
            } else {
                $f::<$crate::lanes::Plain $(, $c)*>($($val),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f::<$crate::lanes::Plain $(, $c)*>($($val),*)
        }
    }};
}
pub(crate) use dispatch;

/// A pointer that parallel tasks share to write disjoint elements of one buffer (each use says
/// why its elements are disjoint).
pub(crate) struct SyncPtr<T = f32>(pub(crate) *mut T);
// SAFETY: only used by tasks writing disjoint elements, see above.
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Elements `start..start + len` of the buffer, for the one task that writes them (a method,
    /// so that a closure calling it captures the wrapper, not the bare pointer, which is not
    /// `Sync`).
    ///
    /// # Safety
    /// The elements lie inside the buffer, and nothing else touches them while the slice lives.
    pub(crate) unsafe fn slice_mut<'a>(&self, start: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// The lane sum every loop uses: halves, then pairs, then the last two.
#[inline(always)]
pub(crate) fn hsum8(v: [f32; 8]) -> f32 {
    let t = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

#[inline(always)]
fn dots_lanes<A: Arith + ?Sized, E: CacheValue, const R: usize>(
    a: &[f32],
    b: [&[E]; R],
) -> [f32; R] {
    let (ac, at) = a.as_chunks::<8>();
    let bc = b.map(|y| &y[..a.len()].as_chunks::<8>().0[..ac.len()]);
    let mut s = [[0f32; 8]; R];
    for (c, x) in ac.iter().enumerate() {
        for j in 0..R {
            let y = &bc[j][c];
            for l in 0..8 {
                s[j][l] = A::madd(x[l], y[l].to_f32(), s[j][l]);
            }
        }
    }
    std::array::from_fn(|j| {
        let mut tail = 0f32;
        for (x, y) in at.iter().zip(&b[j][ac.len() * 8..a.len()]) {
            tail = A::madd(*x, y.to_f32(), tail);
        }
        hsum8(s[j]) + tail
    })
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in a few bits and the rest (Cody-Waite).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1.5 * 2^23: adding it rounds a float below 2^22 in magnitude to an integer (ties to even).
const ROUND: f32 = 12_582_912.0;
/// Taylor coefficients 1/k! for k = 6..0 (|r| <= ln2 / 2: error below 2e-7 relative).
const EXP_TAYLOR: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `exp(x)` for `x <= 0` (softmax weights), to about 2 ulp, in code that vectorises: range
/// reduction by powers of two and a degree-6 polynomial. Below -87 the result is 0.
#[inline(always)]
fn exp_nonpositive<A: Arith + ?Sized>(x: f32) -> f32 {
    let far_below = x < -87.0;
    let x = x.max(-87.0);
    // Round to nearest by adding and removing 1.5 * 2^23 (no libm call; vectorises).
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    // n is an integer in -126..=0, held in the low bits of `shifted` (read as an integer: a
    // float-to-int conversion would not vectorise, it saturates).
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = A::madd(n, -LN2_LO, A::madd(n, -LN2_HI, x));
    let mut p = EXP_TAYLOR[0];
    for &c in &EXP_TAYLOR[1..] {
        p = A::madd(p, r, c);
    }
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    let y = p * scale;
    if far_below {
        0.0
    } else {
        y
    }
}

/// Rows from which the row-wise float loops (RMSNorm, SwiGLU, the activations' quantization)
/// split their rows over the compute team: a tree's. A decoding step's row stays on the calling
/// thread, where a parallel section would cost more than the loop.
const TEAM_ROWS: usize = 4;

/// Runs `row(r)` for each of `rows` rows: on the compute team from [`TEAM_ROWS`] rows, else on
/// the calling thread. Each row's result is the same either way (rows are independent).
pub(crate) fn by_rows(rows: usize, row: impl Fn(usize) + Sync) {
    if rows >= TEAM_ROWS {
        crate::team::for_each(rows, row)
    } else {
        (0..rows).for_each(row)
    }
}

/// [`by_rows`] over the rows of `y` (`width` values each): `row(r, y_r)` with row r of `y`.
fn by_rows_of(y: &mut [f32], width: usize, row: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = y.len().checked_div(width).unwrap_or(0);
    let y = SyncPtr(y.as_mut_ptr());
    by_rows(rows, |r| {
        // SAFETY: row r lies inside `y`, and only row r's call touches it.
        row(r, unsafe { y.slice_mut(r * width, width) })
    });
}

/// RMSNorm of each row of `x` (`w.len()` wide), times `w`, into `y`. The sum of squares is the
/// dot routine's (eight lanes in order, then [`hsum8`] and the tail), so a row's result depends
/// on the row alone.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len() % d.max(1), 0, "x is not [rows, w.len()]");
    assert_eq!(y.len(), x.len(), "y is not x's shape");
    by_rows_of(y, d, |r, y| {
        let x = &x[r * d..(r + 1) * d];
        dispatch!(rms_norm_row::<A>(x: &[f32] = x, w: &[f32] = w, eps: f32 = eps, y: &mut [f32] = y));
    });
}

/// The residual step of a layer: `x += h` (a sublayer's output joins the residual stream), then
/// `h` = [`rms_norm`] of the new `x`, row by row: one pass over each row instead of two, and on the
/// compute team for a tree's rows. The same bits as the add followed by [`rms_norm`].
pub fn add_rms_norm(x: &mut [f32], h: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    assert_eq!(x.len() % d.max(1), 0, "x is not [rows, w.len()]");
    assert_eq!(h.len(), x.len(), "h is not x's shape");
    let rows = x.len().checked_div(d).unwrap_or(0);
    let (x, h) = (SyncPtr(x.as_mut_ptr()), SyncPtr(h.as_mut_ptr()));
    by_rows(rows, |r| {
        // SAFETY: row r of `x` and of `h` lie inside them (one shape), and only row r's call
        // touches them.
        let (x, h) = unsafe { (x.slice_mut(r * d, d), h.slice_mut(r * d, d)) };
        dispatch!(add_rms_norm_row::<A>(x: &mut [f32] = x, h: &mut [f32] = h, w: &[f32] = w, eps: f32 = eps));
    });
}

#[inline(always)]
fn rms_norm_row<A: Arith>(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let squares = A::dots(x, [x])[0];
    let scale = 1.0 / (squares / w.len() as f32 + eps).sqrt();
    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
        *y = x * scale * w;
    }
}

#[inline(always)]
fn add_rms_norm_row<A: Arith>(x: &mut [f32], h: &mut [f32], w: &[f32], eps: f32) {
    for (x, &h) in x.iter_mut().zip(h.iter()) {
        *x += h;
    }
    rms_norm_row::<A>(x, w, eps, h);
}

/// `g = silu(g) * u` elementwise (the SwiGLU of a feed-forward block) over `rows` rows, with
/// [`exp_nonpositive`]: `sigmoid(g)` is `1 / (1 + e)` for `g >= 0` and `e / (1 + e)` below,
/// `e = exp(-|g|)`. Each value's operations are the same wherever a row starts, so the split
/// over the compute team ([`by_rows`]) never changes a bit.
pub fn swiglu(g: &mut [f32], u: &[f32], rows: usize) {
    assert_eq!(g.len(), u.len(), "gate and up differ in length");
    assert_eq!(g.len() % rows.max(1), 0, "g is not [rows, width]");
    let width = g.len().checked_div(rows).unwrap_or(0);
    by_rows_of(g, width, |r, g| {
        let u = &u[r * width..(r + 1) * width];
        dispatch!(swiglu_lanes::<A>(g: &mut [f32] = g, u: &[f32] = u))
    });
}

#[inline(always)]
fn swiglu_lanes<A: Arith>(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        let e = exp_nonpositive::<A>(-g.abs());
        let sigmoid = if *g >= 0.0 { 1.0 } else { e } / (1.0 + e);
        *g = *g * sigmoid * u;
    }
}

/// Quantizes `x` to 8 bits per block of `block` values (a multiple of 32; `d = max|x| / 127`,
/// round to nearest even), writing `q`, one `d` per block and `sums[i]`, the sum of the
/// quantized values `i * sum_len..(i + 1) * sum_len` (`sum_len` 16 or 32: a weight block).
/// No multiply-add: every compilation gives the same bits.
pub(crate) fn quantize_blocks(
    x: &[f32],
    block: usize,
    sum_len: usize,
    q: &mut [i8],
    d: &mut [f32],
    sums: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { fused::quantize_blocks(x, block, sum_len, q, d, sums) };
    }
    quantize_lanes(x, block, q, d);
    for (sum, q) in sums.iter_mut().zip(q[..x.len()].chunks_exact(sum_len)) {
        *sum = q.iter().map(|&v| v as i32).sum();
    }
}

fn quantize_lanes(x: &[f32], block: usize, q: &mut [i8], d: &mut [f32]) {
    for ((x, q), d) in x.chunks_exact(block).zip(q.chunks_exact_mut(block)).zip(d) {
        // Eight lanes of maxima (a single running max would be a serial chain).
        let mut lanes = [0f32; 8];
        for c in x.chunks_exact(8) {
            for l in 0..8 {
                lanes[l] = lanes[l].max(c[l].abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
        *d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &v) in q.iter_mut().zip(x) {
            // |v * id| <= 127: adding 1.5 * 2^23 rounds to an integer (ties to even), which
            // is then the low bits of the sum's representation.
            *q = ((v * id + ROUND).to_bits() as i32 - ROUND.to_bits() as i32) as i8;
        }
    }
}

/// The largest value (exact in any order: eight lanes, then the tail); -inf when empty.
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let (chunks, tail) = x.as_chunks::<8>();
    for c in chunks {
        for l in 0..8 {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    tail.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

#[inline(always)]
fn exp_shifted_sum_lanes<A: Arith + ?Sized>(s: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        for l in 0..8 {
            c[l] = exp_nonpositive::<A>(c[l] - max);
            lanes[l] += c[l];
        }
    }
    let mut tail = 0f32;
    for x in chunks.into_remainder() {
        *x = exp_nonpositive::<A>(*x - max);
        tail += *x;
    }
    hsum8(lanes) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_vanishes_far_below_zero() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = exp_nonpositive::<Plain>(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / want);
            x += 0.001_37;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive::<Plain>(0.0), 1.0);
        assert_eq!(exp_nonpositive::<Plain>(-100.0), 0.0);
        assert_eq!(exp_nonpositive::<Plain>(f32::NEG_INFINITY), 0.0);
    }

    /// The 512-bit softmax weights are the lane code's, bit for bit (tails included).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_softmax_weights_are_the_lane_codes() {
        if !avx512() {
            return;
        }
        let scores: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919) % 2003) as f32 * 0.05 - 90.0)
            .collect();
        let max = max(&scores);
        let (mut a, mut b) = (scores.clone(), scores);
        // SAFETY: AVX-512F, AVX2 and FMA were detected.
        let sb = unsafe { wide::exp_shifted_sum(&mut b, max) };
        exp_shifted_sum_lanes::<Wide>(&mut a, max);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let sum: f32 = a.iter().sum();
        assert!((sb - sum).abs() <= 1e-5 * sum);
    }

    /// Eight sums at once are eight [`hsum8`]s, bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transposed_sums_are_the_lane_sums() {
        if !avx2_fma() {
            return;
        }
        let v: [[f32; 8]; 8] = std::array::from_fn(|p| {
            std::array::from_fn(|l| {
                ((p * 8 + l) as f32 * 1.37).sin() * 10f32.powi(l as i32 % 5 - 2)
            })
        });
        // SAFETY: AVX2 and FMA were detected.
        let got = unsafe {
            let sums = fused::hsum8x8(v.map(|x| std::arch::x86_64::_mm256_loadu_ps(x.as_ptr())));
            let mut got = [0f32; 8];
            std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), sums);
            got
        };
        for p in 0..8 {
            assert_eq!(got[p].to_bits(), hsum8(v[p]).to_bits(), "vector {p}");
        }
    }

    /// Eight strided scores at once are eight dots, bit for bit (on each compilation here).
    #[test]
    fn strided_scores_are_dots() {
        fn check<A: Arith>() {
            let (n, stride) = (64, 3 * 64);
            let b: Vec<f32> = (0..9 * stride)
                .map(|i| ((i * 7919) % 977) as f32 * 0.01 - 4.8)
                .collect();
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut out = [0f32; 8];
            A::scaled_dots8(&a, &b, 64, stride, 0.125, &mut out);
            for (p, o) in out.iter().enumerate() {
                let row = &b[64 + p * stride..][..n];
                assert_eq!(
                    o.to_bits(),
                    (A::dots(&a, [row])[0] * 0.125).to_bits(),
                    "row {p}"
                );
            }
        }
        #[inline(never)]
        fn plain() {
            check::<Plain>()
        }
        plain();
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn fused_check() {
                check::<Fused>()
            }
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            unsafe fn wide_check() {
                check::<Wide>()
            }
            // SAFETY: each runs only where its features were detected.
            unsafe {
                if avx2_fma() {
                    fused_check();
                }
                if avx512() {
                    wide_check();
                }
            }
        }
    }

    /// f16 cache values read in registers give the bits their f32 values give, in dots, strided
    /// scores and weighted sums (on each compilation here; lengths with and without tails).
    #[test]
    fn f16_values_give_the_bits_of_their_f32_values() {
        fn check<A: Arith>() {
            use half::f16;
            for n in [64, 40, 7] {
                let stride = 3 * n;
                let halves: Vec<f16> = (0..9 * stride)
                    .map(|i| f16::from_f32(((i * 7919) % 977) as f32 * 0.01 - 4.8))
                    .collect();
                let floats: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
                let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
                let rows = |p: usize| {
                    (
                        &halves[n + p * stride..][..n],
                        &floats[n + p * stride..][..n],
                    )
                };
                let (h, f) = (
                    A::dots(&a, [rows(0).0, rows(1).0]),
                    A::dots(&a, [rows(0).1, rows(1).1]),
                );
                assert_eq!(h.map(f32::to_bits), f.map(f32::to_bits), "dots, n = {n}");
                let (mut h, mut f) = ([0f32; 8], [0f32; 8]);
                A::scaled_dots8(&a, &halves, n, stride, 0.125, &mut h);
                A::scaled_dots8(&a, &floats, n, stride, 0.125, &mut f);
                assert_eq!(h.map(f32::to_bits), f.map(f32::to_bits), "scores, n = {n}");
                let weights: Vec<f32> = (0..9).map(|t| 0.1 + t as f32 * 0.07).collect();
                let (mut h, mut f) = ([[[0f32; 32]; 2]; 3], [[[0f32; 32]; 2]; 3]);
                let at = |t: usize| t * stride + 5;
                A::accumulate(&mut h, &halves, at, 1..8, [&weights[..]; 3]);
                A::accumulate(&mut f, &floats, at, 1..8, [&weights[..]; 3]);
                assert!(
                    h.as_flattened()
                        .as_flattened()
                        .iter()
                        .zip(f.as_flattened().as_flattened())
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "weighted sums, n = {n}"
                );
            }
        }
        #[inline(never)]
        fn plain() {
            check::<Plain>()
        }
        plain();
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn fused_check() {
                check::<Fused>()
            }
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            unsafe fn wide_check() {
                check::<Wide>()
            }
            // SAFETY: each runs only where its features were detected.
            unsafe {
                if avx2_fma() {
                    fused_check();
                }
                if avx512() {
                    wide_check();
                }
            }
        }
    }

    /// The intrinsic activation quantization is the lane code's, byte for byte.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_quantization_is_the_lane_codes() {
        if !avx2_fma() {
            return;
        }
        let mut x: Vec<f32> = (0..256 * 37)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.37 - 187.0)
            .collect();
        x[32..64].iter_mut().for_each(|v| *v = 0.0);
        x[256..512].iter_mut().for_each(|v| *v *= 1e-30);
        for (block, sum_len) in [(32, 32), (32, 16), (256, 32), (256, 16)] {
            let (mut qa, mut da) = (vec![0i8; x.len()], vec![0f32; x.len() / block]);
            let (mut qb, mut db) = (qa.clone(), da.clone());
            let mut sums = vec![0i32; x.len() / sum_len];
            quantize_lanes(&x, block, &mut qa, &mut da);
            // SAFETY: AVX2 and FMA were detected.
            unsafe { fused::quantize_blocks(&x, block, sum_len, &mut qb, &mut db, &mut sums) };
            assert_eq!(qa, qb, "blocks of {block}");
            assert!(da.iter().zip(&db).all(|(a, b)| a.to_bits() == b.to_bits()));
            assert!(qa.contains(&127) && qa.contains(&-127));
            let want: Vec<i32> = qa
                .chunks_exact(sum_len)
                .map(|q| q.iter().map(|&v| v as i32).sum())
                .collect();
            assert_eq!(sums, want, "sums of {sum_len} in blocks of {block}");
        }
    }

    /// The intrinsic softmax weights are the lane code's, bit for bit (tails included).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_softmax_weights_are_the_lane_codes() {
        if !avx2_fma() {
            return;
        }
        let scores: Vec<f32> = (0..1037)
            .map(|i| ((i * 7919) % 2003) as f32 * 0.05 - 90.0)
            .collect();
        let max = max(&scores);
        let (mut a, mut b) = (scores.clone(), scores);
        let sa = exp_shifted_sum_lanes::<Fused>(&mut a, max);
        // SAFETY: AVX2 and FMA were detected.
        let sb = unsafe { fused::exp_shifted_sum(&mut b, max) };
        assert_eq!(sa.to_bits(), sb.to_bits());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(a.contains(&0.0) && a.contains(&1.0));
    }

    /// A row's norm is the same bits alone and among a tree's rows (split over the compute team),
    /// the fused residual step gives the bits of the add followed by the norm, and both are the
    /// norm by its definition.
    #[test]
    fn rms_norm_rows_alone_or_together_and_fused_with_the_residual() {
        let (d, rows, eps) = (200, 9, 1e-5);
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 7919) % 997) as f32 * 0.01 - 4.0)
            .collect();
        let h: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 104_729) % 991) as f32 * 0.002 - 1.0)
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.01).collect();
        let sum: Vec<f32> = x.iter().zip(&h).map(|(x, h)| x + h).collect();
        let mut together = vec![0f32; rows * d];
        rms_norm(&sum, &w, eps, &mut together);
        for r in 0..rows {
            let mut alone = vec![0f32; d];
            rms_norm(&sum[r * d..(r + 1) * d], &w, eps, &mut alone);
            assert!(alone
                .iter()
                .zip(&together[r * d..])
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let row = &sum[r * d..(r + 1) * d];
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
            for ((&v, &w), &got) in row.iter().zip(&w).zip(&alone) {
                let want = v as f64 / (ms + eps as f64).sqrt() * w as f64;
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
        let (mut fused_x, mut fused_h) = (x.clone(), h.clone());
        add_rms_norm(&mut fused_x, &mut fused_h, &w, eps);
        assert!(fused_x
            .iter()
            .zip(&sum)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(fused_h
            .iter()
            .zip(&together)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn swiglu_matches_its_definition_in_rows_or_whole() {
        let g: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) * 0.02).collect();
        let u: Vec<f32> = g.iter().map(|x| 1.5 - x * 0.1).collect();
        let mut out = g.clone();
        swiglu(&mut out, &u, 1);
        let mut rows = g.clone();
        swiglu(&mut rows[..2000], &u[..2000], 8);
        swiglu(&mut rows[2000..], &u[2000..], 1);
        assert!(rows
            .iter()
            .zip(&out)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        for ((o, &g), &u) in out.iter().zip(&g).zip(&u) {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{g}: {o} vs {want}"
            );
        }
    }
}
