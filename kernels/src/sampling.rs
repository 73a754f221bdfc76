//! Turning logits into the distributions that drafting and verification sample from.
//!
//! Both sides of the protocol must agree on these exactly (the draft's proposal probabilities
//! travel on the wire and the verifier's acceptance test divides by them), so one implementation
//! serves the edge, the browser and the verifier.

/// Index of the largest value; ties go to the lowest index so greedy decoding is deterministic.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// Softmax of `logits / temperature`, restricted to the `top_k` most likely tokens (0: all) and
/// then to the smallest set whose mass reaches `top_p`, renormalised. Tokens outside get exactly 0.
/// `temperature` must be > 0 (greedy decoding does not need a distribution).
pub fn distribution(logits: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Vec<f32> {
    assert!(temperature > 0.0, "temperature must be positive");
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    let restrict = (top_k > 0 && top_k < p.len()) || top_p < 1.0;
    if restrict {
        let rank = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
        let mut order: Vec<usize> = (0..p.len()).collect();
        let candidates = if top_k > 0 {
            top_k.min(p.len())
        } else {
            p.len()
        };
        // The nucleus's mass is measured against the candidates' (all tokens, or the top k).
        let total: f64 = if candidates < p.len() {
            rank_first(&mut order, candidates, rank);
            order[..candidates].iter().map(|&i| p[i] as f64).sum()
        } else {
            p.iter().map(|&x| x as f64).sum()
        };
        let mut keep = candidates;
        if top_p < 1.0 {
            // Rank only as many as the nucleus needs: the first `ranked` in the full order,
            // widened until their mass reaches top_p (a peaked distribution needs a few dozen
            // of a 150,000-token vocabulary; sorting them all cost milliseconds per token). The
            // prefix and its running sum are those a full sort gives, so the cut is the same.
            let mut ranked = candidates.min(64);
            'widen: loop {
                rank_first(&mut order[..candidates], ranked, rank);
                let mut mass = 0f64;
                for (n, &i) in order[..ranked].iter().enumerate() {
                    mass += p[i] as f64;
                    if mass >= top_p as f64 * total {
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

/// Scales `p` to sum to 1. Returns false (and leaves `p` unchanged) when it has no mass.
pub fn normalise(p: &mut [f32]) -> bool {
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    if total <= 0.0 || !total.is_finite() {
        return false;
    }
    let inv = (1.0 / total) as f32;
    p.iter_mut().for_each(|x| *x *= inv);
    true
}

/// Inverse-CDF draw from `p` (not necessarily normalised) with a uniform `u` in [0, 1). Never
/// returns an index of probability 0.
pub fn sample(p: &[f32], u: f64) -> usize {
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    let target = u * total;
    let mut acc = 0f64;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            acc += x as f64;
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
            // The full-sort reference.
            let mut full: Vec<f32> = logits.iter().map(|&l| l.exp()).collect();
            let total: f32 = full.iter().sum();
            full.iter_mut().for_each(|x| *x /= total);
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_unstable_by(|&a, &b| full[b].total_cmp(&full[a]).then(a.cmp(&b)));
            let mut keep = if k > 0 { k.min(n) } else { n };
            let mass: f32 = order[..keep].iter().map(|&i| full[i]).sum();
            let mut acc = 0.0;
            for (j, &i) in order[..keep].iter().enumerate() {
                acc += full[i];
                if top_p < 1.0 && acc >= top_p * mass {
                    keep = j + 1;
                    break;
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
                .map(|&l| ((l - max) / temperature).exp())
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_unstable_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
            let total: f64 = e.iter().map(|&x| x as f64).sum();
            let (mut mass, mut keep) = (0f64, n);
            for (j, &i) in order.iter().enumerate() {
                mass += e[i] as f64;
                if mass >= top_p as f64 * total {
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
