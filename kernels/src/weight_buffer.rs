//! Buffers for what every forward streams through (a matrix's packed weights, scales, mins and
//! codes), in memory on transparent huge pages where the kernel gives them.
//!
//! A forward walks hundreds of MB once per token. On 4 KB pages that walk takes a TLB miss every
//! 4 KB, and the CPU's stream prefetchers stop at every 4 KB boundary; on 2 MB pages neither
//! happens. Linux's `madvise` mode (a common default) gives huge pages to no one who does not
//! ask, and memory from the allocator may already be heap touched in 4 KB pages, which advice
//! cannot change; so these buffers come from anonymous mappings, 2 MB aligned, advised before
//! their first write:
//! - a buffer of 2 MB or more gets a mapping of its own (its last partial 2 MB page stays in 4
//!   KB pages, costing no more memory than it holds);
//! - smaller ones (every layer matrix of a small model: SmolLM2-135M's largest is 0.55 MB; the
//!   query, key and value matrices of larger ones; every scale and code stream) are cut one
//!   after another from shared mappings of [`SHARED_BYTES`], each unmapped when the last buffer
//!   cut from it is dropped. Pages that no buffer has touched cost no memory.
//!
//! Against those smaller buffers on the heap, with two copies of a model loaded in one process
//! and blocks of 4 forwards alternating between them (AMD EPYC Zen 4, 2 threads, cores 0-1):
//! SmolLM2-135M's decoding step 1.01-1.10x faster (mostly 1.04), its 8-node tree 1.05x;
//! Qwen2.5-Coder-0.5B's decoding 1.005-1.03x, Qwen2.5-Coder-1.5B's 1.00-1.03x.
//!
//! Where the kernel declines, the pages are ordinary; off Linux the buffers are plain vectors.

#[cfg(target_os = "linux")]
use std::sync::{Arc, Mutex, Weak};

/// Element types whose all-zero bytes are a valid value (a buffer starts zeroed).
pub(crate) trait Zeroed: Copy + Default {}
impl Zeroed for u8 {}
impl Zeroed for u16 {}

/// A zeroed buffer of `T`s that derefs to a slice (see the module documentation).
pub(crate) struct WeightBuffer<T: Zeroed = u8>(Storage<T>);

enum Storage<T> {
    Heap(Vec<T>),
    /// `len` elements at `start`, inside `mapping`, which the buffer keeps alive (and only
    /// tests read).
    #[cfg(target_os = "linux")]
    Mapped {
        #[cfg_attr(not(test), allow(dead_code))]
        mapping: Arc<Mapping>,
        start: std::ptr::NonNull<T>,
        len: usize,
    },
}

// SAFETY: the buffer owns its elements exclusively, as a Vec<T> does: buffers cut from one
// mapping never overlap, and the mapping itself is only unmapped when the last of them drops.
unsafe impl<T: Zeroed + Send> Send for WeightBuffer<T> {}
// SAFETY: shared access is read-only, through `Deref`.
unsafe impl<T: Zeroed + Sync> Sync for WeightBuffer<T> {}

impl<T: Zeroed> WeightBuffer<T> {
    pub(crate) fn zeroed(len: usize) -> WeightBuffer<T> {
        #[cfg(target_os = "linux")]
        if let Some(mapped) = Self::mapped(len) {
            return mapped;
        }
        WeightBuffer(Storage::Heap(vec![T::default(); len]))
    }

    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> Option<WeightBuffer<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        if bytes == 0 {
            return None;
        }
        let (mapping, offset) = if bytes >= HUGE {
            (Arc::new(Mapping::new(bytes)?), 0)
        } else {
            SHARED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .cut(bytes)?
        };
        // SAFETY: `offset + bytes` lies inside the mapping, and `offset` is a multiple of
        // `ALIGN` (at least T's alignment) from a page-aligned start.
        let start = unsafe { mapping.start.as_ptr().add(offset) }.cast::<T>();
        let start = std::ptr::NonNull::new(start)?;
        Some(WeightBuffer(Storage::Mapped {
            mapping,
            start,
            len,
        }))
    }

    /// The start of the mapping the buffer lies in (its own start where the mapping is its own,
    /// an earlier address where it was cut from a shared one); `None` on the heap.
    #[cfg(all(test, target_os = "linux"))]
    pub(crate) fn mapping(&self) -> Option<*const u8> {
        match &self.0 {
            Storage::Heap(_) => None,
            Storage::Mapped { mapping, .. } => Some(mapping.start.as_ptr()),
        }
    }
}

impl<T: Zeroed> std::ops::Deref for WeightBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            Storage::Heap(v) => v,
            // SAFETY: the mapping holds `len` zero-initialised (then written) elements at
            // `start` while self lives.
            #[cfg(target_os = "linux")]
            Storage::Mapped { start, len, .. } => unsafe {
                std::slice::from_raw_parts(start.as_ptr(), *len)
            },
        }
    }
}

impl<T: Zeroed> std::ops::DerefMut for WeightBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.0 {
            Storage::Heap(v) => v,
            // SAFETY: as in deref; `&mut self` makes this the only access, and no other buffer
            // overlaps these elements.
            #[cfg(target_os = "linux")]
            Storage::Mapped { start, len, .. } => unsafe {
                std::slice::from_raw_parts_mut(start.as_ptr(), *len)
            },
        }
    }
}

/// A huge page.
#[cfg(target_os = "linux")]
const HUGE: usize = 2 << 20;

/// Bytes of each mapping that small buffers share: a few huge pages, so that a small model's
/// buffers take a few mappings, not one each.
#[cfg(target_os = "linux")]
const SHARED_BYTES: usize = 16 * HUGE;

/// Buffers cut from a shared mapping start on a cache line of their own.
#[cfg(target_os = "linux")]
const ALIGN: usize = 64;

/// An anonymous private mapping, 2 MB aligned, advised for huge pages over its whole 2 MB pages
/// before anything is written; unmapped on drop.
#[cfg(target_os = "linux")]
struct Mapping {
    start: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; the buffers cut from it access
// disjoint parts (see `WeightBuffer`).
#[cfg(target_os = "linux")]
unsafe impl Send for Mapping {}
// SAFETY: as above.
#[cfg(target_os = "linux")]
unsafe impl Sync for Mapping {}

#[cfg(target_os = "linux")]
impl Mapping {
    /// A mapping of at least `bytes` (whole 4 KB pages), or `None` where mmap refuses.
    fn new(bytes: usize) -> Option<Mapping> {
        const PAGE: usize = 4096;
        let len = bytes.next_multiple_of(PAGE);
        let size = len.checked_add(HUGE)?;
        // SAFETY: an anonymous private mapping, checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // Keep a 2 MB aligned start, give back the rest; advise the whole 2 MB pages.
        let base = p as usize;
        let start = base.next_multiple_of(HUGE);
        // SAFETY: both pieces lie inside the mapping made above and are not used.
        unsafe {
            if start > base {
                libc::munmap(p, start - base);
            }
            let tail = base + size - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            libc::madvise(
                start as *mut libc::c_void,
                len / HUGE * HUGE,
                libc::MADV_HUGEPAGE,
            );
        }
        Some(Mapping {
            start: std::ptr::NonNull::new(start as *mut u8)?,
            len,
        })
    }
}

#[cfg(target_os = "linux")]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.start.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// The shared mapping small buffers are being cut from, and how much of it is taken.
#[cfg(target_os = "linux")]
struct Shared {
    mapping: Weak<Mapping>,
    used: usize,
}

#[cfg(target_os = "linux")]
static SHARED: Mutex<Shared> = Mutex::new(Shared {
    mapping: Weak::new(),
    used: 0,
});

#[cfg(target_os = "linux")]
impl Shared {
    /// The next `bytes` (less than [`HUGE`]) of the current shared mapping, or of a new one
    /// where it is full or gone; never memory another buffer was given (fresh, so zero).
    fn cut(&mut self, bytes: usize) -> Option<(Arc<Mapping>, usize)> {
        let offset = self.used.next_multiple_of(ALIGN);
        if let Some(mapping) = self.mapping.upgrade() {
            if offset + bytes <= mapping.len {
                self.used = offset + bytes;
                return Some((mapping, offset));
            }
        }
        let mapping = Arc::new(Mapping::new(SHARED_BYTES)?);
        self.mapping = Arc::downgrade(&mapping);
        self.used = bytes;
        Some((mapping, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_zeroed_and_never_overlap() {
        let mut bufs: Vec<WeightBuffer<u16>> = [3, 1000, 70_000, 5, 2 << 20]
            .iter()
            .map(|&n| WeightBuffer::zeroed(n))
            .collect();
        assert!(bufs.iter().all(|b| b.iter().all(|&v| v == 0)));
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(i as u16 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&v| v == i as u16 + 1),
                "buffer {i} overwritten"
            );
        }
        let empty = WeightBuffer::<u8>::zeroed(0);
        assert!(empty.is_empty());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn small_buffers_are_cut_from_shared_mappings_that_go_with_their_last_buffer() {
        let mut shared = Shared {
            mapping: Weak::new(),
            used: 0,
        };
        let (first, at) = shared.cut(100).unwrap();
        assert_eq!(at, 0);
        assert_eq!(first.start.as_ptr() as usize % HUGE, 0, "2 MB aligned");
        let (second, at) = shared.cut(1000).unwrap();
        assert!(Arc::ptr_eq(&first, &second));
        assert_eq!(
            at,
            2 * ALIGN,
            "the first line after the first buffer's 100 bytes"
        );
        // One that no longer fits starts a new mapping; the old one lives on with its buffers.
        let (third, at) = shared.cut(SHARED_BYTES - 1000).unwrap();
        assert!(!Arc::ptr_eq(&first, &third));
        assert_eq!(at, 0);
        let old = Arc::downgrade(&first);
        drop((first, second));
        assert!(old.upgrade().is_none(), "unmapped with its last buffer");
        drop(third);
        let (fresh, at) = shared.cut(10).unwrap();
        assert_eq!(
            (at, Arc::strong_count(&fresh)),
            (0, 1),
            "a new mapping once all are gone"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn large_buffers_get_a_mapping_of_their_own() {
        let big = WeightBuffer::<u8>::zeroed(3 << 20);
        assert_eq!(
            big.mapping(),
            Some(big.as_ptr()),
            "a large buffer starts its mapping"
        );
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
        let small = WeightBuffer::<u16>::zeroed(1000);
        assert!(small.mapping().is_some_and(|m| m != big.as_ptr()));
        assert_eq!(small.as_ptr() as usize % ALIGN, 0);
    }
}
