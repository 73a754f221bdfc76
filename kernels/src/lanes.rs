//! Float loops written once over 8-lane arrays and compiled twice: plainly (any CPU, WebAssembly)
//! and inside `avx2,fma` functions, where the same code vectorises to 256-bit fused multiply-adds.
//!
//! Each loop's order of operations is fixed by its inputs' lengths only, so a result never
//! depends on the batch around it. The two compilations differ in rounding (fused or separate
//! multiply-add): a process uses one of them throughout.

/// How a multiply-add rounds.
pub(crate) trait Arith {
    fn madd(a: f32, b: f32, c: f32) -> f32;
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
}

/// Whether the `avx2,fma` compilation may run here (`SPECINFER_NO_SIMD` turns it off).
pub(crate) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::env::var_os("SPECINFER_NO_SIMD").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Calls `$f` (an `#[inline(always)]` function generic over [`Arith`]) compiled for AVX2+FMA when the CPU has it.
macro_rules! dispatch {
    ($f:ident :: <A $(, $c:tt)*>($($arg:expr),* $(,)?)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if $crate::lanes::avx2_fma() {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fused<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                // SAFETY: AVX2 and FMA were detected at run time.
                unsafe { fused(|| $f::<$crate::lanes::Fused $(, $c)*>($($arg),*)) }
            } else {
                $f::<$crate::lanes::Plain $(, $c)*>($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f::<$crate::lanes::Plain $(, $c)*>($($arg),*)
        }
    }};
}
pub(crate) use dispatch;

/// The lane sum every loop uses: halves, then pairs, then the last two.
#[inline(always)]
pub(crate) fn hsum8(v: [f32; 8]) -> f32 {
    let t = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Dot product in eight lane accumulators, then [`hsum8`], then the tail.
#[inline(always)]
pub(crate) fn dot<A: Arith>(a: &[f32], b: &[f32]) -> f32 {
    let mut s = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            s[l] = A::madd(x[l], y[l], s[l]);
        }
    }
    let mut tail = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail = A::madd(*x, *y, tail);
    }
    hsum8(s) + tail
}

/// `acc += w * x`, elementwise.
#[inline(always)]
pub(crate) fn axpy<A: Arith>(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, x) in acc.iter_mut().zip(x) {
        *a = A::madd(w, *x, *a);
    }
}

/// `exp(x)` for `x <= 0` (softmax weights), to about 2 ulp, in code that vectorises: range
/// reduction by powers of two and a degree-6 polynomial. Below -87 the result is 0.
#[inline(always)]
fn exp_nonpositive<A: Arith>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in a part exact in a few bits and the rest (Cody-Waite).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let far_below = x < -87.0;
    let x = x.max(-87.0);
    // Round to nearest by adding and removing 1.5 * 2^23 (no libm call; vectorises).
    const ROUND: f32 = 12_582_912.0;
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = A::madd(n, -LN2_LO, A::madd(n, -LN2_HI, x));
    // Taylor coefficients 1/k! for k = 6..0 (|r| <= ln2 / 2: error below 2e-7 relative).
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = A::madd(p, r, c);
    }
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = p * scale;
    if far_below {
        0.0
    } else {
        y
    }
}

/// `g = silu(g) * u` elementwise (the SwiGLU of a feed-forward block), with [`exp_nonpositive`]:
/// `sigmoid(g)` is `1 / (1 + e)` for `g >= 0` and `e / (1 + e)` below, `e = exp(-|g|)`.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "gate and up differ in length");
    dispatch!(swiglu_lanes::<A>(g, u))
}

#[inline(always)]
fn swiglu_lanes<A: Arith>(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        let e = exp_nonpositive::<A>(-g.abs());
        let sigmoid = if *g >= 0.0 { 1.0 } else { e } / (1.0 + e);
        *g = *g * sigmoid * u;
    }
}

/// Quantizes `x` to 8 bits per block of 32 (`d = max|x| / 127`, round to nearest even), writing
/// `q` and one `d` per block.
pub(crate) fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    dispatch!(quantize_lanes::<A>(x, q, d))
}

#[inline(always)]
fn quantize_lanes<A: Arith>(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    const ROUND: f32 = 12_582_912.0;
    for ((x, q), d) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).zip(d) {
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

/// Replaces each score `s` by `exp(s - max)` and returns their sum (8 lanes, then the tail).
#[inline(always)]
pub(crate) fn exp_shifted_sum<A: Arith>(s: &mut [f32], max: f32) -> f32 {
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

    #[test]
    fn swiglu_matches_its_definition() {
        let g: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) * 0.02).collect();
        let u: Vec<f32> = g.iter().map(|x| 1.5 - x * 0.1).collect();
        let mut out = g.clone();
        swiglu(&mut out, &u);
        for ((o, &g), &u) in out.iter().zip(&g).zip(&u) {
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (*o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{g}: {o} vs {want}"
            );
        }
    }
}
