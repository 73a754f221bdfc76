//! What the GPU engine asks of a device: memory, copies, kernel launches and graph capture. Two
//! devices implement it: [`super::driver::CudaDevice`] (an NVIDIA GPU through cudarc) and
//! [`super::emulated::EmulatedDevice`] (the same kernels compiled for the host, each CUDA thread
//! a fiber), so that the engine runs, and is tested, on machines without a GPU.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::Result;

/// An address in a device's memory.
pub type DevicePtr = u64;

/// The kernels of `kernels/cuda/specinfer.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    RmsNorm,
    Rope,
    LinearF32,
    LinearBf16,
    Swiglu,
    AddInto,
    GatherRows,
    StoreKvF32,
    StoreKvBf16,
    TreeAttentionF32,
    TreeAttentionBf16,
    AttentionCombine,
    ArgmaxRows,
    SoftmaxTopP,
    SampleWalk,
}

impl Kernel {
    pub const ALL: [Kernel; 15] = [
        Kernel::RmsNorm,
        Kernel::Rope,
        Kernel::LinearF32,
        Kernel::LinearBf16,
        Kernel::Swiglu,
        Kernel::AddInto,
        Kernel::GatherRows,
        Kernel::StoreKvF32,
        Kernel::StoreKvBf16,
        Kernel::TreeAttentionF32,
        Kernel::TreeAttentionBf16,
        Kernel::AttentionCombine,
        Kernel::ArgmaxRows,
        Kernel::SoftmaxTopP,
        Kernel::SampleWalk,
    ];

    /// The kernel's entry point in the source.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::RmsNorm => "rms_norm",
            Kernel::Rope => "rope",
            Kernel::LinearF32 => "linear_f32",
            Kernel::LinearBf16 => "linear_bf16",
            Kernel::Swiglu => "swiglu",
            Kernel::AddInto => "add_into",
            Kernel::GatherRows => "gather_rows",
            Kernel::StoreKvF32 => "store_kv_f32",
            Kernel::StoreKvBf16 => "store_kv_bf16",
            Kernel::TreeAttentionF32 => "tree_attention_f32",
            Kernel::TreeAttentionBf16 => "tree_attention_bf16",
            Kernel::AttentionCombine => "attention_combine",
            Kernel::ArgmaxRows => "argmax_rows",
            Kernel::SoftmaxTopP => "softmax_top_p",
            Kernel::SampleWalk => "sample_walk",
        }
    }
}

/// One kernel argument, by value (a pointer argument is a device address).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevicePtr),
    I32(i32),
    U64(u64),
    F32(f32),
}

impl Arg {
    /// The argument's bytes, as the kernel's parameter holds them, and their count.
    pub fn bytes(&self) -> ([u8; 8], usize) {
        let mut b = [0u8; 8];
        match *self {
            Arg::Ptr(v) | Arg::U64(v) => {
                b.copy_from_slice(&v.to_ne_bytes());
                (b, 8)
            }
            Arg::I32(v) => {
                b[..4].copy_from_slice(&v.to_ne_bytes());
                (b, 4)
            }
            Arg::F32(v) => {
                b[..4].copy_from_slice(&v.to_ne_bytes());
                (b, 4)
            }
        }
    }
}

/// A launch's shape: blocks in the grid, threads per block, dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// A recorded sequence of launches, replayed as one (a CUDA graph).
pub trait Graph: Send {
    fn replay(&self) -> Result<()>;
}

/// A device the engine runs on. Work on it is ordered as issued (one stream); copies to the host
/// return when the data is there.
pub trait Device: Send + Sync {
    /// What the device is and how its kernels were built, for logs and reports.
    fn describe(&self) -> String;
    /// `bytes` of zeroed device memory.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr>;
    /// Returns memory from [`Device::alloc_zeroed`].
    ///
    /// # Safety
    /// `ptr` came from `alloc_zeroed` on this device and is used by nothing issued after.
    unsafe fn free(&self, ptr: DevicePtr);
    /// Copies `src` to device address `dst`.
    ///
    /// # Safety
    /// `dst` holds `src.len()` bytes of one allocation.
    unsafe fn copy_in(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Copies `dst.len()` bytes at device address `src` into `dst`, once all work issued before
    /// has finished.
    ///
    /// # Safety
    /// `src` holds `dst.len()` bytes of one allocation.
    unsafe fn copy_out(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()>;
    /// Copies `bytes` from `src` to `dst` on the device.
    ///
    /// # Safety
    /// Both hold `bytes` bytes of an allocation.
    unsafe fn copy_within(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()>;
    /// Waits until every piece of work issued so far has finished (timings must, or they time
    /// queueing).
    fn synchronize(&self) -> Result<()>;
    /// Launches `kernel` (recorded instead while capturing).
    ///
    /// # Safety
    /// `args` are what the kernel's signature takes, every pointer holding what the kernel reads
    /// and writes through it for this launch's shape.
    unsafe fn launch(&self, kernel: Kernel, shape: Launch, args: &[Arg]) -> Result<()>;
    /// From now on, launches are recorded into a graph instead of run.
    fn begin_capture(&self) -> Result<()>;
    /// Ends a capture (whether or not what was captured is wanted), giving the graph recorded.
    fn end_capture(&self) -> Result<Option<Box<dyn Graph>>>;
}

/// Plain values that cross between host and device as their bytes.
///
/// # Safety
/// Every bit pattern of the type's size is a value of it, and it has no padding.
pub unsafe trait Plain: Copy + Default + Send + Sync + 'static {}
// SAFETY: plain numbers.
unsafe impl Plain for f32 {}
unsafe impl Plain for f64 {}
unsafe impl Plain for i32 {}
unsafe impl Plain for u16 {}
unsafe impl Plain for u32 {}
unsafe impl Plain for u64 {}

fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: T is plain (no padding), so its memory is bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: T is plain: any bytes written are a value of it.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// `len` values of `T` in a device's memory, freed when dropped.
pub struct DeviceBuf<T: Plain> {
    ptr: DevicePtr,
    len: usize,
    dev: Arc<dyn Device>,
    _values: PhantomData<T>,
}

impl<T: Plain> DeviceBuf<T> {
    /// `len` zeroed values.
    pub fn zeros(dev: &Arc<dyn Device>, len: usize) -> Result<Self> {
        // Never zero bytes: a device refuses an empty allocation.
        let ptr = dev.alloc_zeroed((len * std::mem::size_of::<T>()).max(8))?;
        Ok(DeviceBuf {
            ptr,
            len,
            dev: dev.clone(),
            _values: PhantomData,
        })
    }

    /// A copy of `host` on the device.
    pub fn from_host(dev: &Arc<dyn Device>, host: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(dev, host.len())?;
        buf.write(0, host)?;
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// The device address of value `i` (`i == len` is the end).
    pub fn at(&self, i: usize) -> DevicePtr {
        assert!(i <= self.len, "index {i} past a buffer of {}", self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// The buffer as a kernel's pointer argument.
    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }

    /// Value `i` on as a kernel's pointer argument (a view from there).
    pub fn arg_at(&self, i: usize) -> Arg {
        Arg::Ptr(self.at(i))
    }

    /// Copies `host` into values `at..at + host.len()`.
    pub fn write(&mut self, at: usize, host: &[T]) -> Result<()> {
        assert!(
            at + host.len() <= self.len,
            "writing {} values at {at} into a buffer of {}",
            host.len(),
            self.len
        );
        if host.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside this buffer (asserted).
        unsafe { self.dev.copy_in(self.at(at), as_bytes(host)) }
    }

    /// Values `range` copied to the host.
    pub fn read(&self, range: std::ops::Range<usize>) -> Result<Vec<T>> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "reading {range:?} of a buffer of {}",
            self.len
        );
        let mut host = vec![T::default(); range.len()];
        if !host.is_empty() {
            // SAFETY: the range lies inside this buffer (asserted).
            unsafe {
                self.dev
                    .copy_out(self.at(range.start), as_bytes_mut(&mut host))
            }?;
        }
        Ok(host)
    }

    /// The whole buffer on the host.
    pub fn to_host(&self) -> Result<Vec<T>> {
        self.read(0..self.len)
    }

    /// Copies all of `src` (no longer than this buffer) to the start of this one, on the device.
    pub fn copy_from(&mut self, src: &DeviceBuf<T>) -> Result<()> {
        assert!(
            src.len <= self.len,
            "copying {} values into {}",
            src.len,
            self.len
        );
        // SAFETY: both ranges lie inside their buffers.
        unsafe {
            self.dev
                .copy_within(self.ptr, src.ptr, src.len * std::mem::size_of::<T>())
        }
    }
}

impl<T: Plain> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated on this device by `zeros`; the buffer is gone, so nothing later
        // names it (work already issued on the device's one stream is ordered before the free).
        unsafe { self.dev.free(self.ptr) }
    }
}
