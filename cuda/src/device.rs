//! The CUDA context, one stream, cuBLAS, and the compiled kernel module.
//!
//! Everything runs on one non-blocking stream: kernels, cuBLAS and the
//! host↔device copies are ordered by it, so no event tracking is needed
//! (cudarc's is turned off, which also keeps graph capture free of events).
//! Device memory is held by [`DevBuf`], an owned allocation addressed by raw
//! pointer; kernels take raw pointers, so a buffer's address is all a captured
//! graph needs to stay valid.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::Path;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::error::CudaError;
use crate::ptx;

type Result<T> = std::result::Result<T, CudaError>;

/// An owned device allocation, freed on drop.
#[derive(Debug)]
pub(crate) struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// The address `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // SAFETY: `ptr` came from `malloc_sync` in this context and is freed
        // once, here. Work that used it was queued on the one stream; the
        // owner synchronises before dropping buffers a step still uses.
        let freed = self
            .ctx
            .bind_to_thread()
            .and_then(|()| unsafe { drv::free_sync(self.ptr) });
        if let Err(e) = freed {
            tracing::warn!(error = ?e, "cuMemFree failed");
        }
    }
}

/// The CUDA libraries that cannot be loaded (cudarc would panic on first use).
fn missing_libraries() -> Vec<&'static str> {
    let mut missing = Vec::new();
    // SAFETY: each probe loads a shared library by name (running its
    // initialisers); the CUDA driver and cuBLAS are made to be loaded so.
    unsafe {
        if !drv_sys::is_culib_present() {
            missing.push("libcuda (the driver)");
        }
        if !blas_sys::is_culib_present() {
            missing.push("libcublas");
        }
    }
    if !ptx::nvrtc_available() {
        missing.push("libnvrtc");
    }
    missing
}

/// GPUs this process can use (0 when the CUDA libraries or devices are absent).
pub fn gpu_count() -> usize {
    if !missing_libraries().is_empty() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// A kernel argument: a device pointer or a scalar.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

/// `y[t, n] = x[t, k] · w[n, k]ᵀ + beta · y` (row-major, Hugging Face
/// weight layout) with f32 accumulation and f32 `y`: in cuBLAS's
/// column-major terms `yᵀ = op(w)ᵀ · xᵀ`. Pointers are device addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub ty: GemmType,
    pub x: u64,
    pub w: u64,
    pub y: u64,
    pub t: usize,
    pub n: usize,
    pub k: usize,
    pub beta: f32,
}

/// Element types cuBLAS sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmType {
    F32,
    Bf16,
}

impl GemmType {
    fn cuda(self) -> blas_sys::cudaDataType_t {
        match self {
            Self::F32 => blas_sys::cudaDataType_t::CUDA_R_32F,
            Self::Bf16 => blas_sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// A profiled launch: its name and the events around it.
type TimedLaunch = (&'static str, CudaEvent, CudaEvent);

/// One GPU: context, stream, cuBLAS handle and kernels.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    /// Streaming multiprocessors (for the attention split heuristic).
    pub(crate) sm_count: usize,
    name: String,
    arch: String,
    /// While profiling: each launch's name and its start and end events.
    profile: RefCell<Option<Vec<TimedLaunch>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("arch", &self.arch)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels, compiling them with
    /// NVRTC unless `ptx_cache` holds this source for this architecture.
    pub fn open(ordinal: usize, ptx_cache: &Path) -> Result<Self> {
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(CudaError::Unsupported(format!(
                "CUDA libraries not found: {} (install the driver and CUDA 13 libraries, \
                 or put their lib folders on LD_LIBRARY_PATH)",
                missing.join(", ")
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("open device", e))?;
        // SAFETY: the backend uses one stream for everything (see the module
        // docs), so cudarc's cross-stream events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| CudaError::driver("create stream", e))?;
        let blas =
            CudaBlas::new(stream.clone()).map_err(|e| CudaError::driver("cuBLAS init", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("compute capability", e))?;
        let sm_count = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("SM count", e))? as usize;
        let name = ctx
            .name()
            .map_err(|e| CudaError::driver("device name", e))?;
        let arch = ptx::arch_for(major, minor);
        let key = ptx::cache_key(ptx::KERNELS_CU, &arch, ptx::NVRTC_OPTIONS);
        let source = match ptx::load_cached(ptx_cache, &key) {
            Some(text) => text,
            None => {
                let started = std::time::Instant::now();
                let text = ptx::compile(&arch)?;
                if let Err(e) = ptx::store_cached(ptx_cache, &key, &text) {
                    tracing::warn!(error = %e, dir = %ptx_cache.display(), "PTX cache not written");
                }
                tracing::info!(arch, elapsed = ?started.elapsed(), "compiled CUDA kernels");
                text
            }
        };
        let module = ctx
            .load_module(Ptx::from_src(source))
            .map_err(|e| CudaError::driver("load PTX module", e))?;
        let mut funcs = HashMap::new();
        for &n in crate::KERNEL_NAMES {
            let f = module
                .load_function(n)
                .map_err(|e| CudaError::driver("load kernel", e))?;
            funcs.insert(n, f);
        }
        tracing::info!(%name, %arch, sm_count, "CUDA device ready");
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            sm_count,
            name,
            arch,
            profile: RefCell::new(None),
        })
    }

    /// Starts recording the device time of every launch (events around each
    /// one; for profiling eager steps, never inside a graph capture).
    pub fn start_profile(&self) {
        *self.profile.borrow_mut() = Some(Vec::new());
    }

    /// Stops recording; per launch name: total seconds and launches.
    pub fn finish_profile(&self) -> Result<Vec<(&'static str, f64, usize)>> {
        let Some(records) = self.profile.borrow_mut().take() else {
            return Ok(Vec::new());
        };
        self.sync()?;
        let mut totals: Vec<(&'static str, f64, usize)> = Vec::new();
        for (name, start, end) in records {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| CudaError::driver("event elapsed", e))?;
            match totals.iter_mut().find(|t| t.0 == name) {
                Some(t) => {
                    t.1 += f64::from(ms) / 1e3;
                    t.2 += 1;
                }
                None => totals.push((name, f64::from(ms) / 1e3, 1)),
            }
        }
        totals.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(totals)
    }

    /// An event that records time (for [`Self::time`] and the profiler).
    fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| CudaError::driver("event", e))
    }

    /// Runs `f` between two timing events when profiling.
    fn profiled(&self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.profile.borrow().is_none() {
            return f();
        }
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        start
            .record(&self.stream)
            .map_err(|e| CudaError::driver("event record", e))?;
        f()?;
        end.record(&self.stream)
            .map_err(|e| CudaError::driver("event record", e))?;
        if let Some(p) = self.profile.borrow_mut().as_mut() {
            p.push((name, start, end));
        }
        Ok(())
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("memory info", e))
    }

    /// Waits for all queued work.
    pub fn sync(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronize", e))
    }

    /// Allocates `bytes` of device memory, zeroed.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("bind context", e))?;
        // SAFETY: a plain allocation in the bound context; the pointer is
        // owned by the returned DevBuf, which frees it once.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }
            .map_err(|e| CudaError::driver("cuMemAlloc", e))?;
        let buf = DevBuf {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        };
        // SAFETY: the range lies inside the allocation just made.
        unsafe { drv::memset_d8_async(ptr, 0, bytes.max(1), self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("cuMemset", e))?;
        Ok(buf)
    }

    /// Makes the context current on this thread (the model may be built on
    /// one thread and run on another).
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("bind context", e))
    }

    /// Copies `src` to device address `dst` (stream-ordered; `src` may be
    /// reused as soon as this returns: pageable copies are staged).
    pub(crate) fn upload<T: Copy>(&self, dst: u64, room: usize, src: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        if bytes > room {
            return Err(CudaError::InvalidBatch(format!(
                "upload of {bytes} bytes into a {room}-byte buffer"
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` has at least `room >= bytes` bytes (checked above);
        // the copy reads `src` before returning (pageable host memory).
        unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("copy to device", e))
    }

    /// Copies device memory at `src` into `dst`, waiting for the copy.
    pub(crate) fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes a device range of at least
        // `size_of_val(dst)` bytes; a copy into pageable memory returns only
        // once it has completed.
        unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("copy to host", e))?;
        self.sync()
    }

    /// Device-to-device copy of `bytes` bytes.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller passes two device ranges of `bytes` bytes.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("device copy", e))
    }

    /// Launches kernel `name` on the stream.
    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        shared_mem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.profiled(name, || {
            self.bind()?;
            let f = self
                .funcs
                .get(name)
                .ok_or(CudaError::Unsupported(format!("no kernel `{name}`")))?;
            let mut b = self.stream.launch_builder(f);
            for a in args {
                match a {
                    Arg::Ptr(p) | Arg::U64(p) => b.arg(p),
                    Arg::I32(v) => b.arg(v),
                    Arg::I64(v) => b.arg(v),
                    Arg::F32(v) => b.arg(v),
                };
            }
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: (block, 1, 1),
                shared_mem_bytes: shared_mem,
            };
            // SAFETY: each kernel's argument list is built by its one caller in
            // model.rs to match the signature in kernels.cu (pointers to buffers
            // sized for the step, then scalars).
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| CudaError::driver("kernel launch", e))
        })
    }

    /// Runs a [`Gemm`] on cuBLAS.
    pub(crate) fn gemm(&self, g: Gemm) -> Result<()> {
        self.profiled("cublas_gemm", || self.gemm_now(g))
    }

    fn gemm_now(&self, g: Gemm) -> Result<()> {
        let Gemm {
            ty,
            x,
            w,
            y,
            t,
            n,
            k,
            beta,
        } = g;
        self.bind()?;
        let alpha = 1.0f32;
        // SAFETY: `x` holds t·k and `w` n·k elements of `ty`, `y` t·n f32
        // (the caller sizes them from the model config); alpha and beta are
        // host scalars (the default pointer mode) that outlive the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                ty.cuda(),
                k as i32,
                x as *const c_void,
                ty.cuda(),
                k as i32,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                n as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::driver("cuBLAS GemmEx", e))
    }

    /// Gives cuBLAS a fixed workspace, so a captured GEMM never allocates.
    pub(crate) fn set_blas_workspace(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: `ptr` is a live device allocation of `bytes` bytes owned by
        // the model, which outlives the handle's use of it (the model owns both).
        let status = unsafe {
            blas_sys::cublasSetWorkspace_v2(*self.blas.handle(), ptr as *mut c_void, bytes)
        };
        if status == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(CudaError::driver("cuBLAS workspace", status))
        }
    }

    /// Starts capturing the stream's work into a graph.
    pub(crate) fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::driver("begin graph capture", e))
    }

    /// Ends the capture and instantiates the graph.
    pub(crate) fn end_capture(&self) -> Result<cudarc::driver::CudaGraph> {
        self.stream
            .end_capture(drv_sys::CUgraphInstantiate_flags(0))
            .map_err(|e| CudaError::driver("end graph capture", e))?
            .ok_or(CudaError::Unsupported(
                "graph capture recorded nothing".into(),
            ))
    }

    /// Times `f` on the stream with CUDA events, in seconds.
    pub fn time<F: FnMut() -> Result<()>>(&self, mut f: F) -> Result<f64> {
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        start
            .record(&self.stream)
            .map_err(|e| CudaError::driver("event record", e))?;
        f()?;
        end.record(&self.stream)
            .map_err(|e| CudaError::driver("event record", e))?;
        end.synchronize()
            .map_err(|e| CudaError::driver("event sync", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| CudaError::driver("event elapsed", e))?;
        Ok(f64::from(ms) / 1e3)
    }
}

/// Rooflines measured on the device itself, for benchmarks.
impl Gpu {
    /// Fills `n` bf16 values at `ptr` with uniform noise in `[-scale, scale)`.
    pub(crate) fn fill_uniform_bf16(
        &self,
        ptr: u64,
        n: usize,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        self.launch(
            "fill_uniform_bf16",
            (1024, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(ptr),
                Arg::I64(n as i64),
                Arg::U64(seed),
                Arg::F32(scale),
            ],
        )
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes
    /// written), best of `reps` copies of `bytes` bytes.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let src = self.alloc(bytes)?;
        let dst = self.alloc(bytes)?;
        self.copy(dst.ptr, src.ptr, bytes)?;
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            best = best.min(self.time(|| self.copy(dst.ptr, src.ptr, bytes))?);
        }
        Ok(2.0 * bytes as f64 / best)
    }

    /// cuBLAS bf16 GEMM rate in FLOP/s on an `n`×`n`×`n` product (f32
    /// accumulation and output, as the model's GEMMs), mean of `reps` after
    /// a warm-up.
    pub fn bf16_gemm_flops(&self, n: usize, reps: usize) -> Result<f64> {
        let a = self.alloc(n * n * 2)?;
        let b = self.alloc(n * n * 2)?;
        let c = self.alloc(n * n * 4)?;
        self.fill_uniform_bf16(a.ptr, n * n, 1, 1.0)?;
        self.fill_uniform_bf16(b.ptr, n * n, 2, 1.0)?;
        let run = || {
            self.gemm(Gemm {
                ty: GemmType::Bf16,
                x: a.ptr,
                w: b.ptr,
                y: c.ptr,
                t: n,
                n,
                k: n,
                beta: 0.0,
            })
        };
        run()?;
        let secs = self.time(|| {
            for _ in 0..reps {
                run()?;
            }
            Ok(())
        })?;
        Ok(2.0 * (n as f64).powi(3) * reps as f64 / secs)
    }
}
