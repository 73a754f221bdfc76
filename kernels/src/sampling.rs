//! Turning logits into the distributions that drafting and verification sample from.
//!
//! Both sides of the protocol must agree on these exactly (the draft's proposal probabilities
//! travel on the wire and the verifier's acceptance test divides by them), so one implementation
//! serves the edge, the browser and the verifier.

/// Index of the largest value; ties go to the lowest index so greedy decoding is deterministic.
/// NaNs never count as larger (a NaN first value is the answer, as nothing exceeds it).
///
/// The largest value is found in 16 independent lanes, then its first position, 16 values at a
/// time: a compare chain through one running index (each step waiting on the last) took 27 us
/// for SmolLM2-135M's 49,152 logits (this way 7.8 us) and 95 us for Qwen2.5's 151,936 (16 us),
/// one core of an AMD EPYC Zen 4: about half a per cent of SmolLM2's decoding step, and more
/// for a tree's rows. Same answer as that loop, NaNs and signed zeros included.
pub fn argmax(x: &[f32]) -> usize {
    let Some(&first) = x.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    // `if v > m { m = v }` per lane: what `maxps` computes, so the loop vectorises.
    let mut lanes = [first; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(first, |m, v| if v > m { v } else { m });
    // The first value equal to the largest: the one a running comparison keeps (-0.0 and 0.0
    // compare equal, and neither exceeds the other). Looked for 16 at a time, then within.
    let at = x
        .chunks(16)
        .position(|c| c.iter().fold(false, |hit, &v| hit | (v == max)))
        .unwrap_or(0);
    16 * at + x[16 * at..].iter().position(|&v| v == max).unwrap_or(0)
}

/// llama.cpp's repetition penalty on `logits`, in place: every distinct token of `recent` has
/// its logit divided by `penalty` where positive, multiplied where not (so that, for a penalty
/// above 1, it always becomes less likely). Tokens outside the logits are ignored.
pub fn penalise_repeats(logits: &mut [f32], recent: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut done: Vec<u32> = Vec::with_capacity(recent.len());
    for &t in recent {
        if done.contains(&t) {
            continue;
        }
        done.push(t);
        if let Some(x) = logits.get_mut(t as usize) {
            *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
        }
    }
}

/// `e^x` for `x <= 0`, computed in a defined sequence of IEEE single-precision operations (no
/// fused multiply-add, no library call), so that every device that verifies (the CUDA kernels'
/// `exp_defined`, op for op) gets these bits: a verifier's sampled decisions must not depend on
/// whose `expf` it linked. Within 2 ulp of `e^x`; 0 below -87 (where `e^x` is under 2^-125, no
/// token's probability is worth keeping) and for NaN.
pub fn exp_defined(x: f32) -> f32 {
    // The constants by their bits, as the CUDA kernels write them: log2(e); ln 2 in two parts,
    // the first exact in few bits so that k * LN2_HI is exact (Cody-Waite); 1/7! .. 1/3!.
    const LOG2_E: u32 = 0x3fb8_aa3b;
    const LN2_HI: u32 = 0x3f31_7200;
    const LN2_LO: u32 = 0x35bf_be8e;
    const TAYLOR: [u32; 5] = [
        0x3950_0d01,
        0x3ab6_0b61,
        0x3c08_8889,
        0x3d2a_aaab,
        0x3e2a_aaab,
    ];
    // Computed for every x (clamped), then selected: a loop over a vocabulary vectorises.
    let xc = x.max(-87.0);
    // Round to nearest even by adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let k = (xc * f32::from_bits(LOG2_E) + ROUND) - ROUND;
    let r = (xc - k * f32::from_bits(LN2_HI)) - k * f32::from_bits(LN2_LO);
    let mut p = f32::from_bits(TAYLOR[0]);
    for c in &TAYLOR[1..] {
        p = p * r + f32::from_bits(*c);
    }
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^k, k in [-126, 0]: a normal power of two, so the scaling is exact but for subnormals.
    let e = p * f32::from_bits(((k as i32 + 127) as u32) << 23);
    // Below -87 (e^x under 2^-125) and NaN: 0.
    if x >= -87.0 {
        e
    } else {
        0.0
    }
}

/// Exact, order-independent sums of non-negative f32 values: each value as a whole number of
/// units of 2^-40 times the largest value's power of two (rounded down), summed as integers.
/// A device summing thousands of values in parallel gets exactly the host's total, so that
/// normalisation, the nucleus cut and the inverse-CDF draw decide alike on both. Values below
/// 2^-41 of the largest count nothing (well under f32's own resolution of the total).
#[derive(Clone, Copy, Debug)]
pub struct FixedMass {
    /// Units per 1.0: 2^(40 - e), e the exponent of the largest value.
    scale: f64,
}

impl FixedMass {
    /// The scale for `values`; `None` when none is positive (and finite).
    pub fn of(values: &[f32]) -> Option<FixedMass> {
        // NaN and infinities count as 0 (a select, so that the loop vectorises).
        let max = values
            .iter()
            .fold(0f32, |m, &x| m.max(if x.is_finite() { x } else { 0.0 }));
        (max > 0.0).then(|| {
            let e = ((max.to_bits() >> 23) & 0xff) as i32 - 127;
            FixedMass {
                scale: 2f64.powi(40 - e),
            }
        })
    }

    /// `x`'s units (0 for anything not positive and finite). Below 2^41 for every value of the
    /// set the scale came from, so sums of up to 2^23 of them fit in a u64.
    pub fn units(&self, x: f32) -> u64 {
        // Through i64 (exact below 2^41, and faster than u64); NaN gives 0, negatives clamp
        // to 0; +inf is selected away.
        let v = ((x as f64 * self.scale) as i64).max(0) as u64;
        if x < f32::INFINITY {
            v
        } else {
            0
        }
    }

    /// A sum of units as a value.
    pub fn value(&self, units: u64) -> f64 {
        units as f64 / self.scale
    }

    fn total(&self, values: &[f32]) -> u64 {
        values.iter().map(|&x| self.units(x)).sum()
    }
}

/// Softmax of `logits / temperature`, restricted to the `top_k` most likely tokens (0: all) and
/// then to the smallest set whose mass reaches `top_p`, renormalised. Tokens outside get exactly 0.
/// `temperature` must be > 0 (greedy decoding does not need a distribution).
///
/// Defined arithmetic throughout ([`exp_defined`], [`FixedMass`]), so that the GPU's
/// verification (`distribution_row` in `kernels/cuda/specinfer.cu`) computes the same bits.
pub fn distribution(logits: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Vec<f32> {
    assert!(temperature > 0.0, "temperature must be positive");
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits
        .iter()
        .map(|&l| exp_defined((l - max) / temperature))
        .collect();
    let restrict = (top_k > 0 && top_k < p.len()) || top_p < 1.0;
    if let (true, Some(mass)) = (restrict, FixedMass::of(&p)) {
        let rank = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = (0..p.len()).collect();
        let candidates = if top_k > 0 {
            top_k.min(p.len())
        } else {
            p.len()
        };
        // The nucleus's mass is measured against the candidates' (all tokens, or the top k).
        let total: u64 = if candidates < p.len() {
            rank_first(&mut order, candidates, rank);
            order[..candidates].iter().map(|&i| mass.units(p[i])).sum()
        } else {
            mass.total(&p)
        };
        let mut keep = candidates;
        if top_p < 1.0 {
            // The shortest prefix of the ranking whose units reach top_p of the total. Rank only
            // as many as the nucleus needs: the first `ranked` in the full order, widened until
            // their mass reaches it (a peaked distribution needs a few dozen of a 150,000-token
            // vocabulary; sorting them all cost milliseconds per token). The prefix and its
            // running sum are those a full sort gives, so the cut is the same.
            let target = (top_p as f64 * total as f64).ceil() as u64;
            let mut ranked = candidates.min(64);
            'widen: loop {
                rank_first(&mut order[..candidates], ranked, rank);
                let mut units = 0u64;
                for (n, &i) in order[..ranked].iter().enumerate() {
                    units += mass.units(p[i]);
                    if units >= target {
                        keep = n + 1;
                        break 'widen;
                    }
                }
                if ranked == candidates {
                    break;
                }
                ranked = (ranked * 4).min(candidates);
            }
        }
        let mut kept = vec![0f32; p.len()];
        for &i in &order[..keep] {
            kept[i] = p[i];
        }
        p = kept;
    }
    normalise(&mut p);
    p
}

/// Scales `p` (non-negative, at most 1 each) to sum to 1: each value times the reciprocal of its
/// [`FixedMass`] total, in f64, rounded to f32. Returns
/// false (and leaves `p` unchanged) when it has no mass.
pub fn normalise(p: &mut [f32]) -> bool {
    let Some(mass) = FixedMass::of(p) else {
        return false;
    };
    let inv = 1.0 / mass.value(mass.total(p));
    p.iter_mut().for_each(|x| *x = (*x as f64 * inv) as f32);
    true
}

/// Inverse-CDF draw from `p` (not necessarily normalised) with a uniform `u` in [0, 1), over
/// [`FixedMass`] units. Never returns an index of probability 0.
pub fn sample(p: &[f32], u: f64) -> usize {
    let Some(mass) = FixedMass::of(p) else {
        return 0;
    };
    let target = (u * mass.total(p) as f64) as u64;
    let mut acc = 0u64;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            acc += mass.units(x);
            last = i;
            if target < acc {
                return i;
            }
        }
    }
    last
}

/// Puts the first `k` of `items` in `rank`'s order (a total order) at the front, sorted; the
/// rest follow in no order. A draft's sampled proposal keeps a few of some 8,000 candidates per
/// tree node, where sorting them all cost about as much as the draft's own forward.
fn rank_first<T>(items: &mut [T], k: usize, rank: impl Fn(&T, &T) -> std::cmp::Ordering) {
    if k == 0 {
        return;
    }
    if k < items.len() {
        items.select_nth_unstable_by(k - 1, &rank);
    }
    let k = k.min(items.len());
    items[..k].sort_unstable_by(&rank);
}

/// The `k` most likely tokens of `p`, renormalised: the sparse proposal a draft sends.
pub fn top_k_sparse(p: &[f32], k: usize) -> (Vec<u32>, Vec<f32>) {
    let mut order: Vec<u32> = (0..p.len() as u32)
        .filter(|&i| p[i as usize] > 0.0)
        .collect();
    let k = k.max(1);
    rank_first(&mut order, k, |&a, &b| {
        p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b))
    });
    order.truncate(k);
    let mut probs: Vec<f32> = order.iter().map(|&i| p[i as usize]).collect();
    normalise(&mut probs);
    (order, probs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_and_top_p_restrict_and_renormalise() {
        let logits = [0.0f32, 3.0, 1.0, 2.0];
        let p = distribution(&logits, 1.0, 2, 1.0);
        assert_eq!(p[0], 0.0);
        assert_eq!(p[2], 0.0);
        assert!((p[1] + p[3] - 1.0).abs() < 1e-6 && p[1] > p[3]);
        // top_p small enough keeps only the mode.
        let p = distribution(&logits, 1.0, 0, 0.1);
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
        // High temperature flattens.
        let p = distribution(&logits, 100.0, 0, 1.0);
        assert!(p.iter().all(|&x| (x - 0.25).abs() < 0.01));
    }

    /// Random distributions with ties (values from a small set) and zeros: selecting the
    /// first k and sorting them gives exactly what sorting everything gives.
    #[test]
    fn ranking_only_the_kept_tokens_equals_a_full_sort() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for _ in 0..500 {
            let n = rng.random_range(1..200);
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..4) {
                    0 => f32::NEG_INFINITY,
                    1 => 0.5,
                    _ => rng.random_range(-4.0f32..4.0),
                })
                .collect();
            let (k, top_p) = (
                rng.random_range(0..12),
                rng.random_range(0.05f32..1.2).min(1.0),
            );
            // The full-sort reference, in the same defined arithmetic.
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let full: Vec<f32> = logits.iter().map(|&l| exp_defined(l - max)).collect();
            let total: f32 = full.iter().sum();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_unstable_by(|&a, &b| full[b].total_cmp(&full[a]).then(a.cmp(&b)));
            let mut keep = if k > 0 { k.min(n) } else { n };
            if let Some(units) = FixedMass::of(&full) {
                let mass: u64 = order[..keep].iter().map(|&i| units.units(full[i])).sum();
                let target = (top_p as f64 * mass as f64).ceil() as u64;
                let mut acc = 0;
                for (j, &i) in order[..keep].iter().enumerate() {
                    acc += units.units(full[i]);
                    if top_p < 1.0 && acc >= target {
                        keep = j + 1;
                        break;
                    }
                }
            }
            let kept = |p: &[f32]| -> Vec<usize> { (0..n).filter(|&i| p[i] > 0.0).collect() };
            let mut want: Vec<usize> = order[..keep]
                .iter()
                .copied()
                .filter(|&i| full[i] > 0.0)
                .collect();
            want.sort_unstable();
            let got = distribution(&logits, 1.0, k, top_p);
            if total > 0.0 {
                assert_eq!(kept(&got), want, "k {k}, top_p {top_p}, logits {logits:?}");
            }
            let (ids, _) = top_k_sparse(&full, k);
            let mut positive: Vec<u32> = order
                .iter()
                .filter(|&&i| full[i] > 0.0)
                .map(|&i| i as u32)
                .collect();
            positive.truncate(k.max(1));
            assert_eq!(ids, positive, "top {k} of {full:?}");
        }
    }

    /// Large vocabularies, peaked and flat: ranking only as many tokens as the nucleus needs
    /// gives, bit for bit, the distribution that ranking them all gives.
    #[test]
    fn the_nucleus_of_a_large_vocabulary_equals_the_full_sorts() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for case in 0..24 {
            let n = rng.random_range(1_000..40_000);
            // Peaked (a few tokens hold the mass), or flat enough to need widening.
            let spread = [0.3f32, 2.0, 12.0][case % 3];
            let logits: Vec<f32> = (0..n)
                .map(|i| {
                    let head = if i % 997 == 0 { 8.0 } else { 0.0 };
                    head + rng.random_range(-spread..spread)
                })
                .collect();
            let (temperature, top_p) = (
                rng.random_range(0.3f32..1.5),
                [0.5f32, 0.9, 0.95, 0.999][case % 4],
            );
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits
                .iter()
                .map(|&l| exp_defined((l - max) / temperature))
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_unstable_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
            let units = FixedMass::of(&e).unwrap();
            let total: u64 = e.iter().map(|&x| units.units(x)).sum();
            let target = (top_p as f64 * total as f64).ceil() as u64;
            let (mut mass, mut keep) = (0u64, n);
            for (j, &i) in order.iter().enumerate() {
                mass += units.units(e[i]);
                if mass >= target {
                    keep = j + 1;
                    break;
                }
            }
            let mut want = vec![0f32; n];
            for &i in &order[..keep] {
                want[i] = e[i];
            }
            normalise(&mut want);
            let got = distribution(&logits, temperature, 0, top_p);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "case {case}: n {n}, T {temperature}, top-p {top_p}, kept {keep}"
            );
        }
    }

    /// The defined exponential against f64's, over the range verification uses.
    #[test]
    fn the_defined_exponential_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = exp_defined(x) as f64;
            let want = (x as f64).exp();
            // Relative to want's ulp in f32 (2^-23 of its power of two).
            let ulp = 2f64.powi((want.log2().floor() as i32) - 23);
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_defined(0.0), 1.0);
        assert_eq!(exp_defined(-88.0), 0.0);
        assert_eq!(exp_defined(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_defined(f32::NAN), 0.0);
    }

    /// Normalised distributions sum to 1 within f32 rounding, whatever the scale of the input
    /// (tiny residuals included), and a value's units do not depend on the others' order.
    #[test]
    fn fixed_mass_normalises_at_any_scale() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for scale in [1.0f32, 1e-3, 1e-12, 1e-30] {
            let mut p: Vec<f32> = (0..5000).map(|_| rng.random::<f32>() * scale).collect();
            p[7] = 0.0;
            assert!(normalise(&mut p));
            let sum: f64 = p.iter().map(|&x| x as f64).sum();
            assert!((sum - 1.0).abs() < 1e-5, "scale {scale}: sums to {sum}");
            assert_eq!(p[7], 0.0);
        }
        assert!(!normalise(&mut [0.0, -1.0, f32::NAN]));
    }

    /// Each repeated token is penalised once, positive logits divided, negative multiplied.
    #[test]
    fn repeats_are_penalised_once_each() {
        let mut l = [2.0f32, -1.0, 0.5, 3.0];
        penalise_repeats(&mut l, &[0, 1, 0, 0, 9], 2.0);
        assert_eq!(l, [1.0, -2.0, 0.5, 3.0]);
        let mut same = [2.0f32, -1.0];
        penalise_repeats(&mut same, &[0, 1], 1.0);
        assert_eq!(same, [2.0, -1.0]);
    }

    /// The lane-wise argmax answers what one running comparison does, on ties, NaNs, signed
    /// zeros, infinities and every length around the lane count.
    #[test]
    fn argmax_is_the_first_of_the_largest() {
        fn running(x: &[f32]) -> usize {
            let mut best = 0;
            for (i, &v) in x.iter().enumerate() {
                if v > x[best] {
                    best = i;
                }
            }
            best
        }
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let specials = [
            f32::NAN,
            -0.0,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0,
            -3.0,
        ];
        for len in (0..40).chain([49152, 151_936]) {
            for trial in 0..20 {
                let x: Vec<f32> = (0..len)
                    .map(|_| {
                        if trial % 2 == 1 && rng.random_range(0..8) == 0 {
                            specials[rng.random_range(0..specials.len())]
                        } else {
                            // Few distinct values: many ties.
                            rng.random_range(-4i32..4) as f32
                        }
                    })
                    .collect();
                assert_eq!(argmax(&x), running(&x), "{x:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn sampling_skips_zero_mass_and_follows_the_cdf() {
        let p = [0.0f32, 0.25, 0.0, 0.75];
        assert_eq!(sample(&p, 0.0), 1);
        assert_eq!(sample(&p, 0.2499), 1);
        assert_eq!(sample(&p, 0.25), 3);
        assert_eq!(sample(&p, 0.999_999_9), 3);
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
        let (ids, probs) = top_k_sparse(&[0.1, 0.5, 0.0, 0.4], 2);
        assert_eq!(ids, vec![1, 3]);
        assert!((probs[0] - 5.0 / 9.0).abs() < 1e-6);
    }
}
