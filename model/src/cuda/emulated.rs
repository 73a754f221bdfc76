//! A CUDA device emulated on the host: memory is host memory, and a launch runs the kernel of
//! `kernels/cuda/specinfer.cu` (the very source NVRTC compiles, built as C++ by this crate's
//! dependency `specinfer-kernels`) over its grid, each CUDA thread a fiber, barriers and warp
//! shuffles real meeting points (`specinfer_kernels::cuda::emulated`). Launches are checked as
//! the driver checks them, copies against the allocations they touch, and a capture records
//! launches for replay, as a CUDA graph does. Everything runs in order when issued, so timings
//! here mean nothing; results are the point.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::device::{Arg, Device, DevicePtr, Graph, Kernel, Launch};
use super::gpu_err;
use crate::Result;

/// The emulated device (clones are the same device). Allocations are 256-byte aligned, as
/// `cuMemAlloc`'s.
#[derive(Clone, Default)]
pub struct EmulatedDevice(Arc<State>);

#[derive(Default)]
struct State {
    /// Live allocations: address to size.
    allocations: Mutex<BTreeMap<DevicePtr, usize>>,
    /// The launches recorded since `begin_capture`, while capturing.
    capture: Mutex<Option<Vec<Recorded>>>,
    /// Launches run so far, by kernel.
    by_kernel: Mutex<HashMap<Kernel, usize>>,
    /// Calls of `synchronize` so far.
    synchronizations: AtomicUsize,
    /// Launches issued so far (recorded into a graph or run).
    issued: AtomicUsize,
    /// Fault injection for tests: the issued launch with this number (counted from 1, over the
    /// device's life) panics instead of being issued.
    panic_at_launch: AtomicUsize,
}

const ALIGN: usize = 256;

#[derive(Clone)]
struct Recorded {
    kernel: Kernel,
    shape: Launch,
    args: Vec<Arg>,
}

struct EmulatedGraph {
    launches: Vec<Recorded>,
    device: EmulatedDevice,
}

impl Graph for EmulatedGraph {
    fn replay(&self) -> Result<()> {
        for l in &self.launches {
            // SAFETY: recorded from launches whose callers vouched for their arguments, which
            // the graph's owner keeps alive for as long as it replays the graph.
            unsafe { self.device.run(l.kernel, l.shape, &l.args) }?;
        }
        Ok(())
    }
}

impl EmulatedDevice {
    pub fn new() -> EmulatedDevice {
        EmulatedDevice::default()
    }

    /// The device for the engine ([`super::CudaLlama::upload_to`]).
    pub fn shared(&self) -> Arc<dyn Device> {
        Arc::new(self.clone())
    }

    /// Launches of `kernel` run so far.
    pub fn launched(&self, kernel: Kernel) -> usize {
        let counts = self.0.by_kernel.lock().unwrap_or_else(|e| e.into_inner());
        counts.get(&kernel).copied().unwrap_or(0)
    }

    /// How often the engine waited for the device (`Device::synchronize`).
    pub fn synchronizations(&self) -> usize {
        self.0.synchronizations.load(Ordering::Relaxed)
    }

    /// Launches issued so far, recorded into a graph or run.
    pub fn issued(&self) -> usize {
        self.0.issued.load(Ordering::Relaxed)
    }

    /// Makes issued launch number `n` (counted from 1 over the device's life, 0: none) panic,
    /// as an assertion inside the engine's launch code would: to test that a panic, during a
    /// graph capture too, leaves the device usable.
    pub fn panic_at_launch(&self, n: usize) {
        self.0.panic_at_launch.store(n, Ordering::Relaxed);
    }

    /// Whether `[ptr, ptr + bytes)` lies inside one live allocation.
    fn check(&self, ptr: DevicePtr, bytes: usize, what: &str) -> Result<()> {
        let allocations = self.0.allocations.lock().unwrap_or_else(|e| e.into_inner());
        match allocations.range(..=ptr).next_back() {
            Some((&start, &size)) if ptr + bytes as u64 <= start + size as u64 => Ok(()),
            _ => Err(gpu_err(format!(
                "{what}: {bytes} bytes at {ptr:#x} are not inside one allocation"
            ))),
        }
    }

    fn capturing(&self) -> bool {
        self.0
            .capture
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// # Safety
    /// As [`Device::launch`].
    unsafe fn run(&self, kernel: Kernel, shape: Launch, args: &[Arg]) -> Result<()> {
        *self
            .0
            .by_kernel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kernel)
            .or_default() += 1;
        let mut values: Vec<[u8; 8]> = Vec::with_capacity(args.len());
        let mut sizes = Vec::with_capacity(args.len());
        for a in args {
            let (bytes, size) = a.bytes();
            values.push(bytes);
            sizes.push(size);
        }
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        // SAFETY: params point to the argument values, alive for the call; the caller vouches
        // for what they point to.
        unsafe {
            specinfer_kernels::cuda::emulated::launch(
                kernel.name(),
                shape.grid,
                shape.block,
                shape.shared_bytes,
                &mut params,
                &sizes,
            )
        }
        .map_err(gpu_err)
    }
}

impl Device for EmulatedDevice {
    fn describe(&self) -> String {
        "emulated CUDA device (specinfer.cu built as C++ for the host, a fiber per CUDA thread)"
            .into()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| gpu_err(format!("allocating {bytes} bytes: {e}")))?;
        // SAFETY: a layout of non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(gpu_err(format!("out of memory allocating {bytes} bytes")));
        }
        let ptr = p as DevicePtr;
        self.0
            .allocations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ptr, bytes.max(1));
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        let size = self
            .0
            .allocations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ptr);
        let Some(size) = size else {
            panic!("freeing {ptr:#x}, which is not an allocation of this device");
        };
        let layout = std::alloc::Layout::from_size_align(size, ALIGN).expect("allocated with it");
        // SAFETY: allocated by alloc_zeroed with this layout, not freed before (it was live).
        unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
    }

    unsafe fn copy_in(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        if self.capturing() {
            return Err(gpu_err("a copy while capturing a graph"));
        }
        self.check(dst, src.len(), "copy to the device")?;
        // SAFETY: dst holds src.len() bytes of a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn copy_out(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        if self.capturing() {
            return Err(gpu_err("a copy while capturing a graph"));
        }
        self.check(src, dst.len(), "copy from the device")?;
        // SAFETY: src holds dst.len() bytes of a live allocation (checked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn copy_within(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        if self.capturing() {
            return Err(gpu_err("a copy while capturing a graph"));
        }
        self.check(src, bytes, "copy on the device (source)")?;
        self.check(dst, bytes, "copy on the device (destination)")?;
        // SAFETY: both ranges lie in live allocations (checked); `copy` allows overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // Work runs when issued here; the count lets tests check that the engine waits where a
        // real device needs it.
        self.0.synchronizations.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn launch(&self, kernel: Kernel, shape: Launch, args: &[Arg]) -> Result<()> {
        let n = self.0.issued.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.0.panic_at_launch.load(Ordering::Relaxed) {
            panic!("injected fault: launch {n} ({})", kernel.name());
        }
        {
            let mut capture = self.0.capture.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(recorded) = capture.as_mut() {
                recorded.push(Recorded {
                    kernel,
                    shape,
                    args: args.to_vec(),
                });
                return Ok(());
            }
        }
        // SAFETY: the caller vouches for the arguments.
        unsafe { self.run(kernel, shape, args) }
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.0.capture.lock().unwrap_or_else(|e| e.into_inner());
        if capture.is_some() {
            return Err(gpu_err("begin_capture while capturing"));
        }
        *capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>> {
        let recorded = self
            .0
            .capture
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match recorded {
            None => Err(gpu_err("end_capture without begin_capture")),
            Some(launches) if launches.is_empty() => Ok(None),
            Some(launches) => Ok(Some(Box::new(EmulatedGraph {
                launches,
                device: self.clone(),
            }))),
        }
    }
}
