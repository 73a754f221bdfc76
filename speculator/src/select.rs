//! Picking tokens from a draft's logits.

/// The `k` highest logits' token ids, best first (ties to the lower id). One pass keeping the
/// best `k` so far: almost every logit loses to the current k-th at one comparison, where
/// selecting over a copy of the whole (49,152-token) vocabulary took a draft about a tenth of a
/// millisecond per scored node.
pub(crate) fn top_k_tokens(l: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(l.len());
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    // `a` ranks before `b`: a higher logit, or an equal one at a lower id.
    let before = |a: u32, b: u32| {
        l[a as usize]
            .total_cmp(&l[b as usize])
            .then(b.cmp(&a))
            .is_gt()
    };
    // The k-th best logit so far: anything below it loses at one float comparison.
    let mut floor = f32::NEG_INFINITY;
    for (t, &x) in l.iter().enumerate() {
        let t = t as u32;
        if best.len() == k && (x < floor || !before(t, best[k - 1])) {
            continue;
        }
        let at = best
            .iter()
            .position(|&b| before(t, b))
            .unwrap_or(best.len());
        best.insert(at, t);
        best.truncate(k);
        if best.len() == k {
            floor = l[best[k - 1] as usize];
        }
    }
    best
}

/// `ln(sum(exp(l)))`, skipping the `-inf` logits of tokens outside a restricted draft head.
pub(crate) fn log_sum_exp(l: &[f32]) -> f64 {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = l
        .iter()
        .filter(|&&x| x != f32::NEG_INFINITY)
        .map(|&x| (x - max).exp())
        .sum();
    max as f64 + (sum as f64).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn top_k_tokens_are_the_first_k_of_a_full_sort(
            l in proptest::collection::vec(prop_oneof![Just(f32::NEG_INFINITY), Just(0.5f32), -4f32..4.0], 1..300),
            k in 1usize..12,
        ) {
            let mut order: Vec<u32> = (0..l.len() as u32).collect();
            order.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
            order.truncate(k);
            prop_assert_eq!(top_k_tokens(&l, k), order);
        }
    }

    #[test]
    fn log_sum_exp_skips_tokens_outside_the_head() {
        let l = [0.0f32, f32::NEG_INFINITY, 2f32.ln(), f32::NEG_INFINITY];
        assert!((log_sum_exp(&l) - 3f64.ln()).abs() < 1e-6);
    }
}
