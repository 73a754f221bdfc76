//! Where a forward's time goes, for reports (`specinfer-bench --sections engine`): wall time
//! inside weight products (and the bytes of weights they read) and inside attention, summed over
//! every call made while enabled, on whatever thread made it. Off by default: a call then costs
//! one relaxed load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

static ON: AtomicBool = AtomicBool::new(false);
static PRODUCT_NANOS: AtomicU64 = AtomicU64::new(0);
static PRODUCT_BYTES: AtomicU64 = AtomicU64::new(0);
static ATTENTION_NANOS: AtomicU64 = AtomicU64::new(0);

/// The sums since the last [`take`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Time inside quantized products ([`crate::matmul_many`], [`crate::QuantMatrix::matmul`]):
    /// the activations' quantization, the parallel section and its wait included.
    pub products: Duration,
    /// Bytes of weights those products read (each matrix's [`crate::QuantMatrix::bytes`]).
    pub product_bytes: u64,
    /// Time inside [`crate::tree_attention`].
    pub attention: Duration,
}

/// Starts or stops summing.
pub fn enable(on: bool) {
    ON.store(on, Relaxed);
}

/// The sums so far, which start again from zero.
pub fn take() -> Split {
    Split {
        products: Duration::from_nanos(PRODUCT_NANOS.swap(0, Relaxed)),
        product_bytes: PRODUCT_BYTES.swap(0, Relaxed),
        attention: Duration::from_nanos(ATTENTION_NANOS.swap(0, Relaxed)),
    }
}

/// The start of a call to time, where summing is on.
pub(crate) fn start() -> Option<Instant> {
    ON.load(Relaxed).then(Instant::now)
}

/// A product started at `started` ([`start`]) is done, having read `bytes()` of weights.
pub(crate) fn product_done(started: Option<Instant>, bytes: impl FnOnce() -> usize) {
    if let Some(t) = started {
        PRODUCT_NANOS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        PRODUCT_BYTES.fetch_add(bytes() as u64, Relaxed);
    }
}

/// An attention call started at `started` ([`start`]) is done.
pub(crate) fn attention_done(started: Option<Instant>) {
    if let Some(t) = started {
        ATTENTION_NANOS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{tree_attention, AttentionShape, KvRows, QuantFormat, QuantMatrix};

    #[test]
    fn sums_the_products_and_attention_made_while_enabled() {
        // 16 rows of one Q8_0 block each: scale 1.0 (f16 bits), then 32 signed bytes.
        let block: Vec<u8> = [0x00, 0x3C].into_iter().chain(1..=32).collect();
        let m = QuantMatrix::from_ggml(QuantFormat::Q8_0, 16, 32, &block.repeat(16)).unwrap();
        let mut out = vec![0f32; 16];
        let shape = AttentionShape {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let (q, kv) = ([0.5f32; 4], [0.25f32; 4]);
        let mut attended = [0f32; 4];
        enable(true);
        take();
        m.matmul(&[1.0; 32], 1, &mut out);
        tree_attention(
            shape,
            &q,
            KvRows::F32(&kv),
            KvRows::F32(&kv),
            0,
            0,
            &[1],
            1,
            &mut attended,
        );
        let split = take();
        enable(false);
        // Other tests' calls may add to the sums meanwhile, never take from them.
        assert!(split.products > Duration::ZERO, "{split:?}");
        assert!(split.product_bytes >= m.bytes() as u64, "{split:?}");
        assert!(split.attention > Duration::ZERO, "{split:?}");
        assert_eq!(attended, kv, "one visible position: its value row");
    }
}
