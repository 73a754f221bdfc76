//! The GPU engine's projection kernel (`linear_f32` / `linear_bf16` in `kernels/cuda`) computed
//! on the CPU in the same order, bit for bit: the reference a GPU check compares the device's
//! projections with, and the definition of their batch invariance.
//!
//! Each output `y[r, c] = sum_k x[r, k] w[c, k] (+ b[c])` is summed by a warp of 32 lanes: lane l
//! accumulates k = l, l + 32, ... with fused multiply-adds, then the lanes are combined by an xor
//! butterfly (distance 16, 8, 4, 2, 1). Nothing in that order depends on the number of rows or on
//! a row's place among them, so a row's projection is the same whatever it is batched with.

/// Lanes of a warp.
const LANES: usize = 32;

/// `y = x W^T (+ b)` for `rows` rows of `x` (`[rows, inp]`), `w` row-major `[out, inp]` (weights
/// already as the f32 values the device reads: [`bf16_to_f32`] of bf16 weights).
pub fn warp_linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    b: Option<&[f32]>,
    out: usize,
    inp: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), rows * inp, "x is [rows, inp]");
    assert_eq!(w.len(), out * inp, "w is [out, inp]");
    let mut y = vec![0f32; rows * out];
    for r in 0..rows {
        let xr = &x[r * inp..(r + 1) * inp];
        for c in 0..out {
            let wc = &w[c * inp..(c + 1) * inp];
            let mut lanes = [0f32; LANES];
            for (lane, acc) in lanes.iter_mut().enumerate() {
                for k in (lane..inp).step_by(LANES) {
                    *acc = xr[k].mul_add(wc[k], *acc);
                }
            }
            let mut distance = LANES / 2;
            while distance > 0 {
                let before = lanes;
                for (lane, s) in lanes.iter_mut().enumerate() {
                    *s += before[lane ^ distance];
                }
                distance /= 2;
            }
            y[r * out + c] = b.map_or(lanes[0], |b| lanes[0] + b[c]);
        }
    }
    y
}

/// Weights as bf16 bits (round to nearest, ties to even), as the GPU engine uploads them.
pub fn f32_to_bf16(w: &[f32]) -> Vec<u16> {
    w.iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

/// bf16 bits as the f32 the device computes with (exact: the bits become the high half).
pub fn bf16_to_f32(w: &[u16]) -> Vec<f32> {
    w.iter()
        .map(|&b| f32::from_bits((b as u32) << 16))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(0x9E37_79B9).rotate_left(13);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn the_warp_order_computes_the_projection() {
        let (rows, out, inp) = (3, 5, 100);
        let (x, w, b) = (values(rows * inp, 1), values(out * inp, 2), values(out, 3));
        let y = warp_linear(&x, rows, &w, Some(&b), out, inp);
        for r in 0..rows {
            for c in 0..out {
                let exact: f64 = (0..inp)
                    .map(|k| x[r * inp + k] as f64 * w[c * inp + k] as f64)
                    .sum::<f64>()
                    + b[c] as f64;
                let got = y[r * out + c] as f64;
                assert!(
                    (got - exact).abs() < 1e-4,
                    "y[{r}, {c}] = {got}, exactly {exact}"
                );
            }
        }
    }

    #[test]
    fn a_rows_projection_does_not_depend_on_its_batch() {
        let (rows, out, inp) = (9, 7, 70);
        let (x, w) = (values(rows * inp, 4), values(out * inp, 5));
        let batch = warp_linear(&x, rows, &w, None, out, inp);
        for r in 0..rows {
            let alone = warp_linear(&x[r * inp..(r + 1) * inp], 1, &w, None, out, inp);
            assert_eq!(alone, batch[r * out..(r + 1) * out], "row {r}");
        }
        // The order is fixed, not just close: a plain left-to-right sum differs in the last
        // bits somewhere, which a batch-dependent choice between the two would show.
        let plain: Vec<f32> = (0..out)
            .map(|c| (0..inp).map(|k| x[k] * w[c * inp + k]).sum())
            .collect();
        assert_ne!(plain, batch[..out], "the lanes' order is not a plain sum's");
    }

    #[test]
    fn bf16_weights_round_to_nearest_and_widen_exactly() {
        let w = [1.0f32, -2.5, 1.0 + 1.0 / 256.0, 3.0e-3, f32::MIN_POSITIVE];
        let back = bf16_to_f32(&f32_to_bf16(&w));
        assert_eq!(back[..2], [1.0, -2.5], "representable values survive");
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa, 1.
        assert_eq!(back[2], 1.0);
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 256.0, "{a} -> {b}");
        }
        assert_eq!(
            bf16_to_f32(&f32_to_bf16(&back)),
            back,
            "bf16 values are fixed points"
        );
    }
}
