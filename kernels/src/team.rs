//! The compute team: helper threads started once, which spin between the parallel sections of a
//! forward instead of going to sleep.
//!
//! A forward runs about seven parallel sections per layer (the projections and attention's three
//! passes), a few hundred per token, each a few to a few hundred microseconds long. On rayon's
//! pool a worker that finds no work yields, then sleeps, and the next section has to find and
//! wake it. The team's helpers instead watch one atomic word for the next section for [`SPIN`]
//! after the last one and only then park, so a section starts on every thread within a
//! cache-line transfer. Measured in one process, alternating blocks of tokens between the two
//! (2 threads, AMD EPYC Zen 4): Qwen2.5-Coder-1.5B's decode step 1.02-1.07x faster than on
//! rayon's pool, SmolLM2-135M's the same within noise (0.97-1.02x).
//!
//! One caller at a time leads the team (the others, and nested calls from inside a task, fall
//! back to rayon). Each thread of a section first runs its own contiguous span of the tasks in
//! order, then takes what is left of the others' spans, as rayon's halving would: a thread then
//! streams a long run of consecutive rows, which the memory serves faster than interleaved short
//! ones. Which thread runs a task never changes its result: every task writes its own output.

use rayon::prelude::*;

/// Runs `task(i)` for every `i` in `0..n` on the caller and the team's helpers (as many as
/// rayon's current pool has threads, less the caller); returns when all have run.
pub(crate) fn for_each(n: usize, task: impl Fn(usize) + Sync) {
    let helpers = rayon::current_num_threads()
        .saturating_sub(1)
        .min(n.saturating_sub(1));
    if helpers == 0 {
        (0..n).for_each(task);
        return;
    }
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(lead) = native::Team::get().lead(helpers) {
        lead.run(n, &task);
        return;
    }
    (0..n).into_par_iter().for_each(&task);
}

/// Asks the helpers to read `ranges` (byte ranges, in the order the next product's tasks read
/// them) into their caches while they wait between sections: each helper reads ahead the part
/// its share of the next product's tasks will start with. Otherwise memory sits idle while the
/// caller does the serial work between sections (a few microseconds each, about a tenth of
/// SmolLM2's decoding) and while attention runs from cache. A hint, not a contract: a prefetch
/// never faults, so stale or torn ranges cost nothing but bandwidth.
pub(crate) fn read_ahead(ranges: &[(*const u8, usize)]) {
    #[cfg(not(target_arch = "wasm32"))]
    native::Team::get()
        .ahead
        .set(ranges, rayon::current_num_threads());
    #[cfg(target_arch = "wasm32")]
    let _ = ranges;
}

/// The most byte ranges a read-ahead hint holds (a layer's query, key and value weights); any
/// beyond are not read ahead.
pub(crate) const MAX_RANGES: usize = 4;

/// How long a helper watches for the next section before parking: longer than the serial work
/// between two sections of a forward (norms, residuals, the next activations' quantization),
/// short enough that an idle process gives its cores back at once.
#[cfg(not(target_arch = "wasm32"))]
const SPIN: std::time::Duration = std::time::Duration::from_micros(300);

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use super::{MAX_RANGES, SPIN};
    use std::cell::UnsafeCell;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{
        AtomicBool, AtomicU64, AtomicUsize,
        Ordering::{Acquire, Relaxed, Release, SeqCst},
    };
    use std::sync::{Condvar, Mutex, OnceLock};
    use std::time::Instant;

    /// Spin-loop iterations (tens of microseconds) before a waiting thread starts to yield its
    /// core between checks.
    const SPINS_BEFORE_YIELD: u32 = 2048;

    /// One step of a wait, the `spins`-th: a spin-loop hint at first, then, should the wait go
    /// on, the core yielded to other threads. Where threads outnumber cores, the thread waited
    /// for may need this core to finish at all.
    fn wait_step(spins: u32) {
        if spins < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }

    /// A section's tasks, borrowed for the section's duration only (see [`Lead::run`]).
    type Task = *const (dyn Fn(usize) + Sync);

    /// The section word: `epoch << 16 | open << 8 | helpers`. A helper joins a section only
    /// while it is open and its index is below `helpers`.
    const OPEN: u64 = 1 << 8;
    const EPOCH: u64 = 1 << 16;
    const MAX_THREADS: usize = 256;

    /// Bytes each helper reads ahead of a product, at most: half of a core's L2 on this project's
    /// hosts (1 MB on Zen 4), so that the lines are still there when its tasks reach them.
    const READ_AHEAD_BYTES: usize = 512 << 10;

    /// Bytes read ahead per step, between two looks at the section word (about a quarter of a
    /// microsecond of one core's share of the bandwidth).
    const READ_AHEAD_STEP: usize = 4096;

    /// The read-ahead hint (see [`super::read_ahead`]): written by the leading caller, read by
    /// helpers while they wait, with relaxed atomics throughout (a torn read only prefetches
    /// the wrong lines).
    #[derive(Default)]
    #[repr(align(64))]
    pub(super) struct ReadAhead {
        /// Bumped by every hint; a helper starts over when it changes.
        generation: AtomicUsize,
        threads: AtomicUsize,
        count: AtomicUsize,
        ranges: [[AtomicUsize; 2]; MAX_RANGES],
    }

    /// A helper's progress through the current hint.
    #[derive(Default)]
    struct AheadProgress {
        generation: usize,
        /// Where its share starts in the hint's bytes, and how much of it to read.
        share: usize,
        limit: usize,
        done: usize,
    }

    impl ReadAhead {
        pub(super) fn set(&self, ranges: &[(*const u8, usize)], threads: usize) {
            let ranges = &ranges[..ranges.len().min(MAX_RANGES)];
            for (slot, &(at, len)) in self.ranges.iter().zip(ranges) {
                slot[0].store(at as usize, Relaxed);
                slot[1].store(len, Relaxed);
            }
            self.count.store(ranges.len(), Relaxed);
            self.threads.store(threads, Relaxed);
            self.generation.fetch_add(1, Release);
        }

        /// Reads the next step of helper `index`'s share ahead; false when there is none.
        fn step(&self, index: usize, progress: &mut AheadProgress) -> bool {
            let generation = self.generation.load(Acquire);
            let count = self.count.load(Relaxed).min(MAX_RANGES);
            let ranges = &self.ranges[..count];
            if generation != progress.generation {
                let total: usize = ranges.iter().map(|r| r[1].load(Relaxed)).sum();
                // The helper is thread index + 1 of the product's split by bytes.
                let per_thread = total / self.threads.load(Relaxed).max(index + 2);
                *progress = AheadProgress {
                    generation,
                    share: per_thread * (index + 1),
                    limit: per_thread.min(READ_AHEAD_BYTES),
                    done: 0,
                };
            }
            if progress.done >= progress.limit {
                return false;
            }
            let mut offset = progress.share + progress.done;
            for range in ranges {
                let (at, len) = (range[0].load(Relaxed), range[1].load(Relaxed));
                if offset >= len {
                    offset -= len;
                    continue;
                }
                let end = (offset + READ_AHEAD_STEP).min(len);
                for line in (offset..end).step_by(64) {
                    prefetch_l2(at.wrapping_add(line) as *const u8);
                }
                progress.done += end - offset;
                return true;
            }
            false
        }
    }

    /// Asks for the line at `p` in the L2 cache. Never faults, whatever the address.
    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// A span's cursor, on a cache line of its own.
    #[derive(Default)]
    #[repr(align(64))]
    struct Cursor(AtomicUsize);

    pub(super) struct Team {
        /// Held by the caller leading the team.
        busy: AtomicBool,
        section: AtomicU64,
        /// The open section's tasks; written only while no helper is inside a section.
        task: UnsafeCell<Option<Task>>,
        tasks: AtomicUsize,
        /// The next task of each thread's span (the caller's first, then the helpers').
        cursors: [Cursor; MAX_THREADS],
        /// Helpers inside a section (joined and not yet left).
        inside: AtomicUsize,
        /// A task panicked on a helper; the caller panics in turn.
        panicked: AtomicBool,
        /// Helpers parked on `wake`.
        parked: AtomicUsize,
        /// Helpers started so far (indices `0..started`).
        started: AtomicUsize,
        /// Taken to start helpers and to park or wake them.
        lock: Mutex<()>,
        wake: Condvar,
        pub(super) ahead: ReadAhead,
    }

    // SAFETY: `task` is written by the leading caller only while no helper can read it (no
    // section open, `inside == 0`), and read by helpers only inside an open section.
    unsafe impl Sync for Team {}
    // SAFETY: as above; the closure behind `task` is `Sync`.
    unsafe impl Send for Team {}

    impl Team {
        pub(super) fn get() -> &'static Team {
            static TEAM: OnceLock<Team> = OnceLock::new();
            TEAM.get_or_init(|| Team {
                busy: AtomicBool::new(false),
                section: AtomicU64::new(0),
                task: UnsafeCell::new(None),
                tasks: AtomicUsize::new(0),
                cursors: std::array::from_fn(|_| Cursor::default()),
                inside: AtomicUsize::new(0),
                panicked: AtomicBool::new(false),
                parked: AtomicUsize::new(0),
                started: AtomicUsize::new(0),
                lock: Mutex::new(()),
                wake: Condvar::new(),
                ahead: ReadAhead::default(),
            })
        }

        /// Leads the team with `helpers` helpers (started here the first time they are asked
        /// for), or `None` when another caller leads it.
        pub(super) fn lead(&'static self, helpers: usize) -> Option<Lead> {
            if self.busy.swap(true, SeqCst) {
                return None;
            }
            let wanted = helpers.min(MAX_THREADS - 1);
            // Only the leader starts helpers, so `started` changes under no one else here.
            while self.started.load(SeqCst) < wanted {
                let index = self.started.load(SeqCst);
                let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                let spawned = std::thread::Builder::new()
                    .name(format!("specinfer-team-{index}"))
                    .spawn(move || self.help(index));
                if spawned.is_err() {
                    break;
                }
                self.started.store(index + 1, SeqCst);
            }
            let helpers = helpers.min(self.started.load(SeqCst));
            if helpers == 0 {
                self.busy.store(false, SeqCst);
                return None;
            }
            Some(Lead {
                team: self,
                helpers,
            })
        }

        /// A helper's life: wait for a section it may join, take tasks until none are left.
        fn help(&self, index: usize) {
            let mut seen = self.section.load(SeqCst) / EPOCH;
            let mut ahead = AheadProgress::default();
            loop {
                let word = self.wait_for_section(seen, index, &mut ahead);
                seen = word / EPOCH;
                if (word & 0xff) as usize <= index {
                    continue;
                }
                self.inside.fetch_add(1, SeqCst);
                // Joined only if the section is still the open one seen (the caller closes it
                // before waiting for `inside` to drop to zero, see `Lead::run`).
                if self.section.load(SeqCst) == word {
                    // SAFETY: the section is open, so `task` points at the caller's live closure.
                    let task = unsafe { (*self.task.get()).expect("an open section has a task") };
                    let threads = (word & 0xff) as usize + 1;
                    // SAFETY: as above.
                    let ran = catch_unwind(AssertUnwindSafe(|| {
                        self.take_tasks(index + 1, threads, |i| unsafe { (*task)(i) })
                    }));
                    if ran.is_err() {
                        self.panicked.store(true, SeqCst);
                    }
                }
                self.inside.fetch_sub(1, SeqCst);
            }
        }

        /// Runs the tasks of thread `me`'s span, then what is left of the others'.
        fn take_tasks(&self, me: usize, threads: usize, task: impl Fn(usize)) {
            let n = self.tasks.load(SeqCst);
            for span in (me..threads).chain(0..me) {
                let end = (span + 1) * n / threads;
                loop {
                    let i = self.cursors[span].0.fetch_add(1, SeqCst);
                    if i >= end {
                        break;
                    }
                    task(i);
                }
            }
        }

        /// Spins for [`SPIN`], then parks, until an open section newer than `seen` appears.
        /// Meanwhile helper `index` reads its share of the next product ahead.
        fn wait_for_section(&self, seen: u64, index: usize, ahead: &mut AheadProgress) -> u64 {
            let fresh = |word: u64| word / EPOCH != seen && word & OPEN != 0;
            let start = Instant::now();
            let mut spins = 0u32;
            loop {
                let word = self.section.load(SeqCst);
                if fresh(word) {
                    return word;
                }
                if self.ahead.step(index, ahead) {
                    continue;
                }
                // Past the gaps of a forward the caller may need this core to reach its next
                // section.
                wait_step(spins);
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) && start.elapsed() > SPIN {
                    break;
                }
            }
            let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.parked.fetch_add(1, SeqCst);
            loop {
                let word = self.section.load(SeqCst);
                if fresh(word) {
                    self.parked.fetch_sub(1, SeqCst);
                    return word;
                }
                guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// The team, led by one caller until dropped.
    pub(super) struct Lead {
        team: &'static Team,
        helpers: usize,
    }

    impl Lead {
        /// Runs `task(i)` for `i` in `0..n` on this thread and the helpers.
        pub(super) fn run(&self, n: usize, task: &(dyn Fn(usize) + Sync)) {
            let t = self.team;
            // SAFETY: no section is open and no helper is inside one (the previous `run`
            // returned only after both), so no helper reads `task` while it is written. The
            // lifetime is erased: `Close` keeps the closure borrowed until no helper can reach it.
            unsafe {
                *t.task.get() = Some(std::mem::transmute::<
                    &(dyn Fn(usize) + Sync),
                    &'static (dyn Fn(usize) + Sync),
                >(task) as Task)
            };
            t.tasks.store(n, SeqCst);
            let threads = self.helpers + 1;
            for (span, cursor) in t.cursors[..threads].iter().enumerate() {
                cursor.0.store(span * n / threads, SeqCst);
            }
            t.panicked.store(false, SeqCst);
            let epoch = t.section.load(SeqCst) / EPOCH + 1;
            t.section
                .store((epoch * EPOCH) | OPEN | self.helpers as u64, SeqCst);
            if t.parked.load(SeqCst) > 0 {
                let _guard = t.lock.lock().unwrap_or_else(|e| e.into_inner());
                t.wake.notify_all();
            }
            let close = Close {
                team: t,
                epoch,
                threads,
            };
            t.take_tasks(0, threads, task);
            drop(close);
            if t.panicked.swap(false, SeqCst) {
                panic!("a task of the compute team panicked");
            }
        }
    }

    impl Drop for Lead {
        fn drop(&mut self) {
            self.team.busy.store(false, SeqCst);
        }
    }

    /// Closes a section and waits until no helper is inside it, also when the caller's own
    /// task panics (the helpers may still be running the borrowed closure).
    struct Close {
        team: &'static Team,
        epoch: u64,
        threads: usize,
    }

    impl Drop for Close {
        fn drop(&mut self) {
            let t = self.team;
            // Whatever is left is taken by nobody: the caller's loop ended, or it panicked.
            for cursor in &t.cursors[..self.threads] {
                cursor.0.store(usize::MAX / 2, SeqCst);
            }
            t.section.store(self.epoch * EPOCH, SeqCst);
            // A helper's last task takes microseconds; a helper that the scheduler took off its
            // core mid-task (more runnable threads than cores) takes a time slice or more, and
            // spinning through it would keep the core from the very thread it waits for.
            let mut spins = 0u32;
            while t.inside.load(SeqCst) != 0 {
                wait_step(spins);
                spins = spins.saturating_add(1);
            }
            // SAFETY: the section is closed and no helper is inside it.
            unsafe { *t.task.get() = None };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Every task runs exactly once, in sections of every size, from the global pool and from a
    /// caller that is not in it.
    #[test]
    fn every_task_runs_once() {
        for n in [0, 1, 2, 3, 7, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                for_each(n, |i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            rayon::scope(|_| {
                for_each(n, |i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                })
            });
            assert!(
                counts.iter().all(|c| c.load(Ordering::Relaxed) == 51),
                "n = {n}"
            );
        }
    }

    /// Concurrent callers (one leads, the others fall back) and nested calls all finish with
    /// every task run once.
    #[test]
    fn concurrent_and_nested_callers() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        for_each(8, |_| {
                            for_each(3, |_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.into_inner(), 4 * 200 * 8 * 3);
    }

    /// A read-ahead hint naming memory that is not mapped (freed weights, a torn read) only
    /// prefetches nothing: the helpers go on to run every task.
    #[test]
    fn read_ahead_of_unmapped_memory_is_harmless() {
        let ran = AtomicUsize::new(0);
        for round in 0..20 {
            read_ahead(&[
                (std::ptr::null(), 1 << 20),
                (0xdead_0000usize as *const u8, 64 << 10),
                ((usize::MAX - (1 << 12)) as *const u8, 1 << 12),
            ]);
            for_each(64 + round, |_| {
                ran.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(ran.into_inner(), (0..20).map(|r| 64 + r).sum::<usize>());
    }

    /// A panicking task reaches the caller, and the team leads the next section normally.
    #[test]
    fn a_panic_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| {
            for_each(64, |i| {
                if i == 40 {
                    panic!("task {i}");
                }
            })
        });
        assert!(caught.is_err());
        let ran = AtomicUsize::new(0);
        for_each(64, |_| {
            ran.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(ran.into_inner(), 64);
    }
}
