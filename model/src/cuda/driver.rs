//! An NVIDIA GPU through cudarc: the kernels compiled by NVRTC for the device's architecture,
//! everything issued on one stream of our own (the legacy default stream cannot be captured).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use specinfer_kernels::cuda::cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaGraph, CudaStream,
};
use specinfer_kernels::cuda::cudarc::nvrtc::Ptx;
use specinfer_kernels::cuda::{compile_cubin, compile_ptx, nvrtc_version};
use specinfer_kernels::cuda_libs::loaded_library;

use super::device::{Arg, Device, DevicePtr, Graph, Kernel, Launch};
use super::gpu_err;
use crate::Result;

/// GPU `ordinal`, its context, stream and loaded kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<Kernel, CudaFunction>,
    runtime: String,
}

struct CapturedGraph(CudaGraph);

// SAFETY: cudarc's graph is not `Send`; CUDA asks only that calls on one graph be serialised,
// which its owner (the engine's workspace, behind a mutex) does.
unsafe impl Send for CapturedGraph {}

impl Graph for CapturedGraph {
    fn replay(&self) -> Result<()> {
        self.0.launch().map_err(gpu_err)
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` and compiles the kernels for its architecture. cudarc panics when
    /// the driver is missing, so this checks for it first and says so.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(gpu_err(
                "no NVIDIA driver (libcuda.so) on this machine: use --device cpu",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(gpu_err)?;
        let (major, minor) = ctx.compute_capability().map_err(gpu_err)?;
        if (major, minor) < (7, 5) {
            return Err(gpu_err(format!(
                "compute capability {major}.{minor} is not supported (sm_75 or newer)"
            )));
        }
        let (nvrtc_major, nvrtc_minor) = nvrtc_version().map_err(gpu_err)?;
        let nvrtc = format!(
            "NVRTC {nvrtc_major}.{nvrtc_minor} ({})",
            loaded_library("libnvrtc").map_or("path unknown".into(), |p| p.display().to_string())
        );
        // Machine code for exactly this GPU, which the driver loads whatever NVRTC minor made
        // it; PTX (JIT-compiled by the driver, refused when newer than it) only if NVRTC does
        // not know the architecture yet.
        let (module, runtime) = match compile_cubin(major, minor) {
            Ok(cubin) => (
                ctx.load_module(Ptx::from_binary(cubin)).map_err(gpu_err)?,
                format!("cuda:{ordinal}, {nvrtc}, CUBIN for sm_{major}{minor}"),
            ),
            Err(cubin) => {
                let arch = match (major, minor) {
                    (m, _) if m >= 9 => "sm_90",
                    (8, 9) => "sm_89",
                    (8, 6) => "sm_86",
                    (8, _) => "sm_80",
                    _ => "sm_75",
                };
                tracing::warn!(%cubin, "no CUBIN for this GPU; loading PTX for {arch}");
                (
                    ctx.load_module(compile_ptx(arch).map_err(gpu_err)?)
                        .map_err(gpu_err)?,
                    format!("cuda:{ordinal}, {nvrtc}, PTX for {arch} (JIT)"),
                )
            }
        };
        let mut kernels = HashMap::new();
        for k in Kernel::ALL {
            kernels.insert(k, module.load_function(k.name()).map_err(gpu_err)?);
        }
        // No cudarc event tracking: with a single stream every use is ordered already, and
        // tracking records events around every launch.
        // SAFETY: every buffer of this device is allocated, used and freed on this one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(gpu_err)?;
        Ok(CudaDevice {
            ctx,
            stream,
            kernels,
            runtime,
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(gpu_err)
    }
}

impl Device for CudaDevice {
    fn describe(&self) -> String {
        self.runtime.clone()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        self.bind()?;
        let s = self.stream.cu_stream();
        // SAFETY: a stream of this context; the memory is zeroed before any use (in order).
        unsafe {
            let ptr = result::malloc_async(s, bytes).map_err(gpu_err)?;
            result::memset_d8_async(ptr, 0, bytes, s).map_err(gpu_err)?;
            Ok(ptr)
        }
    }

    unsafe fn free(&self, ptr: DevicePtr) {
        if self.bind().is_ok() {
            // SAFETY: allocated by malloc_async on this stream (the caller vouches); work
            // already issued on the stream is ordered before the free.
            let _ = unsafe { result::free_async(ptr, self.stream.cu_stream()) };
        }
    }

    unsafe fn copy_in(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: dst holds src.len() bytes (the caller vouches); a pageable source is staged
        // before the call returns.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(gpu_err)
    }

    unsafe fn copy_out(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: src holds dst.len() bytes (the caller vouches); the synchronisation makes the
        // copy complete before dst is read.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(gpu_err)?;
        self.synchronize()
    }

    unsafe fn copy_within(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: both hold `bytes` (the caller vouches).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(gpu_err)
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(gpu_err)
    }

    unsafe fn launch(&self, kernel: Kernel, shape: Launch, args: &[Arg]) -> Result<()> {
        self.bind()?;
        let mut values: Vec<[u8; 8]> = args.iter().map(|a| a.bytes().0).collect();
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        // SAFETY: params point to the argument values, alive for the call (the driver copies
        // them at launch); the caller vouches for what the pointers among them address.
        unsafe {
            result::launch_kernel(
                self.kernels[&kernel].cu_function(),
                shape.grid,
                shape.block,
                shape.shared_bytes,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(gpu_err)
    }

    fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(gpu_err)
    }

    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>> {
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(gpu_err)?;
        Ok(graph.map(|g| Box::new(CapturedGraph(g)) as Box<dyn Graph>))
    }
}
