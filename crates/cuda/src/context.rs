//! The GPU context: one device, one stream, a cuBLAS handle and the kernel module compiled by
//! NVRTC for the device's own architecture; plus allocation, copies, launches and timing.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::buffer::{GpuBuffer, GpuElem};
use crate::error::CudaError;
use crate::kernels::KERNEL_NAMES;
use crate::nvrtc::load_or_compile_kernels;

/// One kernel argument (all kernels take device pointers as 64-bit addresses).
#[derive(Clone, Copy, Debug)]
pub(crate) enum KArg {
    /// Device address (0 = null).
    P(u64),
    U(u32),
    F(f32),
}

pub(crate) fn drv(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        reason: format!("{e:?}"),
    }
}

/// Handle on one CUDA device with everything needed to run slowfast's kernels.
pub struct CudaContext {
    pub(crate) ctx: Arc<cudarc::driver::CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// A second stream for work that overlaps the decode stream (SFI's asynchronous refresh).
    side: Arc<CudaStream>,
    /// Set while side work is being queued: `launch` then uses the side stream.
    on_side: std::sync::atomic::AtomicBool,
    pub(crate) blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    compute_capability: (i32, i32),
    sm_count: u32,
    kernels_from_cache: bool,
    /// The step-trace buffer when `SLOWFAST_TRACE` compiled tracing in (see [`crate::trace`]).
    trace: Option<std::sync::Mutex<GpuBuffer<u64>>>,

    /// `linear` with at most this many rows runs the GEMV kernel instead of cuBLAS
    /// (`SLOWFAST_GEMV_MAX_ROWS`, 0 = always cuBLAS; at most 8).
    pub(crate) gemv_max_rows: usize,
    /// `linear` with more rows than `gemv_max_rows` and at most this many runs the tensor-core
    /// GEMV (`gemv_mma_fused_m0`) instead of cuBLAS (`SLOWFAST_GEMV_MMA_ROWS`, default
    /// [`GEMV_MMA_DEFAULT_ROWS`]; at most 8).
    gemv_mma_rows: std::sync::atomic::AtomicUsize,
    /// Whether decode steps at <= `gemv_max_rows` rows run the fused kernels
    /// (ops/fused.rs); `SLOWFAST_DECODE_FUSED=0` turns them off (A/B runs).
    pub(crate) decode_fused: bool,
    /// Whether the fused decode step launches its kernels with programmatic dependent launch
    /// (sm_90+, `SLOWFAST_PDL`, default on there).
    pdl_allowed: bool,
    /// The [`PdlMode`] of the kernels being launched (as u8), set around a decode step.
    pdl_now: std::sync::atomic::AtomicU8,
    /// PDL in decode steps of 3+ rows (cuBLAS GEMMs), `SLOWFAST_PDL_WIDE`: 0 none, 1 the
    /// attention kernels, 2 every PDL kernel of the step; unset: [`pdl_wide_default`].
    pdl_wide: Option<PdlMode>,
    /// Whether dense flash-decoding splits each sequence's keys evenly on the device at every
    /// step (chunk 0, the default) instead of by the host's chunk of whole 64-key tiles from
    /// `max_seq_len` ([`CudaContext::set_decode_balance`], for tests).
    decode_balance: std::sync::atomic::AtomicBool,
    /// Whether the fused dense decode step runs qkv_post inside flash-decoding
    /// (`attn_decode_post_*`; off, [`CudaContext::set_attn_post`] for tests).
    attn_post: std::sync::atomic::AtomicBool,
    /// Shared memory a SM and reserved a block (bytes).
    pub(crate) smem_per_sm: u32,
    pub(crate) smem_reserved: u32,
    /// The argmax kernel's per-row counters (zero between launches) and partials.
    pub(crate) argmax_scratch: GpuBuffer<u32>,
    /// Whether the kernels were built for sm_90a (warpgroup MMA: the Hopper prefill kernels).
    pub(crate) wgmma: bool,
    /// Whether sparse decode steps run qkv_post inside sparse flash-decoding
    /// (`attn_sparse_decode_post_*`): 0 never, 1 always, 2 in steps of 3+ rows (the default;
    /// `SLOWFAST_SPARSE_POST=0|1`, or [`CudaContext::set_sparse_post`]).
    sparse_post: std::sync::atomic::AtomicU8,
    /// Blocks a SM of each verification kernel (`VERIFY_VARIANTS`), from the driver's
    /// occupancy calculator: registers, threads and shared memory together.
    pub(crate) verify_per_sm: HashMap<&'static str, usize>,
}

/// Rows up to which `linear` can stream the weights with the GEMV kernel.
pub const GEMV_MAX_ROWS: usize = 8;
/// The default: on the H200 (Qwen3-4B decode at 8K, crates/cuda/gpu-runs/history.md run 15) the GEMV beat
/// cuBLAS at 1 and 2 rows (4.14 vs 5.10 ms a step, 4.41 vs 5.04) and lost from 4 rows on
/// (5.87 vs 5.61 at 4, 8.27 vs 6.61 at 8: its FMAs then bound it).
pub const GEMV_DEFAULT_ROWS: usize = 2;

/// Rows up to which `linear` runs the tensor-core GEMV above `GEMV_DEFAULT_ROWS`: 0 (off).
/// Alone it beats cuBLAS at 3-8 rows on four of Qwen3-4B's five decode projections (run 47,
/// 6 rows: o 9.4 vs 12.0 us, gate|up 30.5 vs 34.0, down 17.8 vs 20.0; LM head 197.9 vs 192.7),
/// but the graph-captured step did not move (batch 6 at 32K 10.89 vs 10.94 ms, batch 8 12.94 /
/// 12.98 vs 12.93 / 12.93 ms, runs 47-48), so cuBLAS stays the default. A setting of N also
/// runs decode steps of 3..=N rows as the fused step (norm, residual add and GLU inside the
/// tensor-core GEMVs, `gemv_mma_fused_m*`), slower than cuBLAS's: SFI's batch-6 fast step at
/// 128K 4.50 vs 4.16 ms, batch 8 full KV 6.41 vs 6.05 ms at 8K (run 53).
pub const GEMV_MMA_DEFAULT_ROWS: usize = 0;

/// Which kernels `launch` gives programmatic dependent launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PdlMode {
    Off = 0,
    /// The attention kernels (`kernels::is_attn_pdl_kernel`: q/k post-processing,
    /// flash-decoding, its reduce).
    Attention = 1,
    /// Every kernel `kernels::is_pdl_kernel` names.
    All = 2,
}

/// PDL mode of decode steps of 3+ rows when `SLOWFAST_PDL_WIDE` is unset: every PDL kernel in
/// steps that run sparse attention (SFI, StreamingLLM), none in dense ones. Batch 6 at 128K
/// (runs 60-61): SFI 1090-1094 -> 1104-1105 tok/s, full KV 187.3 -> 182.5. (Run 22, with the
/// old Selector, had SFI lose 16 % to it: early-launched blocks starved the side stream.)
pub(crate) fn pdl_wide_default(sparse: bool) -> PdlMode {
    if sparse {
        PdlMode::All
    } else {
        PdlMode::Off
    }
}

/// Whether sparse decode steps (SFI, StreamingLLM) run qkv_post inside sparse flash-decoding
/// (`attn_sparse_decode_post_*`) by default: only in steps of 3+ rows. Measured (run 82,
/// crates/cuda/gpu-runs/history.md): batch 6 at 128K, the StreamingLLM step 3.897 -> 3.842 ms and SFI's
/// fast step 3.897 -> 3.862; batch 1 slower (8K 2.521 -> 2.585 ms, 128K 2.509 -> 2.570).
pub const SPARSE_POST_DEFAULT: Option<bool> = None;

/// The stored sparse post mode of a setting: 0 off, 1 on, 2 the default.
fn post_mode(on: Option<bool>) -> u8 {
    match on.or(SPARSE_POST_DEFAULT) {
        Some(false) => 0,
        Some(true) => 1,
        None => 2,
    }
}

/// Whether the fused dense decode step runs qkv_post inside flash-decoding by default: off
/// (run 49, batch 1: 8K 3.129 -> 3.094 ms but 32K 3.812 -> 3.853 and 128K 7.294 -> 7.317).
pub const ATTN_POST_DEFAULT: bool = false;

/// K/V pipeline stages of the dense head-dim-128 flash-decoding kernel: 0 lets `decode_plan`
/// choose 4 stages (143 KB of shared memory, one block a SM: run 25, Qwen3-4B batch-1 step
/// 4.27 -> 4.19 ms at 32K, 7.87 -> 7.72 ms at 128K; 6 stages no better, removed) when one block
/// a SM still fills the device, else 3 (two blocks a SM).
pub const DECODE_DEFAULT_STAGES: usize = 0;

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaContext({}, sm_{}{})",
            self.name, self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// A numeric `SLOWFAST_*` setting from the environment (None when unset or not a number).
pub(crate) fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The post flash-decoding kernels' shared memory past their K/V rings, before the new k and
/// v rows: RoPE angles [2][128] and a row buffer a warp [4][256], f32.
const POST_SMEM: u32 = (2 * 128 + 4 * 256) * 4;

/// Dynamic shared memory (bytes) each attention kernel is launched with.
pub(crate) fn attn_smem_bytes(kernel: &str) -> Option<u32> {
    // an fp8 twin widens its tiles in place: the bf16 kernel's shared memory
    let kernel = kernel.strip_suffix("_f8").unwrap_or(kernel);
    let s = |rows: u32, d: u32| rows * (d + 8) * 2;
    Some(match kernel {
        "attn_prefill_d64" => s(64 + 4 * 64, 64),
        "attn_prefill_d128" => s(64 + 4 * 64, 128),
        "attn_prefill_d256" => s(64 + 4 * 32, 256),
        "attn_prefill_d64_m2" => s(128 + 4 * 64, 64),
        "attn_prefill_d128_m2" => s(128 + 4 * 32, 128),
        // 1 KiB to align the swizzled tiles, Q [128][128], then K and V [128][128] a stage
        "attn_prefill_d128_wg" => 1024 + 128 * 256 + 2 * 2 * 128 * 256,
        "attn_prefill_d128_wg3" => 1024 + 128 * 256 + 3 * 2 * 128 * 256,
        "attn_decode_d64" | "attn_sparse_decode_d64" => s(16 + 2 * 4 * 64, 64),
        "attn_decode_d128" | "attn_sparse_decode_d128" => s(16 + 2 * 3 * 64, 128),
        "attn_decode_d128_s4" => s(16 + 2 * 4 * 64, 128),
        "attn_decode_d256" | "attn_sparse_decode_d256" => s(16 + 2 * 2 * 64, 256),
        k if k.starts_with("attn_verify_") => crate::ops::attention::VERIFY_VARIANTS
            .iter()
            .find(|v| v.name == k)?
            .smem_bytes() as u32,
        // the same rings, then RoPE angles [2][128] f32, a row a warp [4][256] f32, new k, v [2][d]
        "attn_decode_post_d64" => s(16 + 2 * 4 * 64, 64) + POST_SMEM + 4 * 64,
        "attn_decode_post_d128" => s(16 + 2 * 3 * 64, 128) + POST_SMEM + 4 * 128,
        "attn_decode_post_d128_s4" => s(16 + 2 * 4 * 64, 128) + POST_SMEM + 4 * 128,
        "attn_decode_post_d256" => s(16 + 2 * 2 * 64, 256) + POST_SMEM + 4 * 256,
        "attn_sparse_decode_post_d64" => s(16 + 2 * 4 * 64, 64) + POST_SMEM + 4 * 64,
        "attn_sparse_decode_post_d128" => s(16 + 2 * 3 * 64, 128) + POST_SMEM + 4 * 128,
        "attn_sparse_decode_post_d256" => s(16 + 2 * 2 * 64, 256) + POST_SMEM + 4 * 256,
        // the most it may ask for (the launch passes what its kv heads and span need)
        "sfi_score_fin" => crate::ops::sfi::SCORE_FIN_SMEM as u32,
        _ => return None,
    })
}

impl CudaContext {
    /// Opens device `ordinal`: checks the driver, compiles (or loads from the cache) the kernels
    /// for its compute capability, loads them and creates the stream and cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::LibraryMissing {
                library: "the CUDA driver (libcuda.so)",
                reason: "not found by the dynamic loader; is an NVIDIA driver installed?".into(),
            });
        }
        let count =
            cudarc::driver::CudaContext::device_count().map_err(|e| CudaError::NoDevice {
                ordinal,
                reason: format!("cuDeviceGetCount failed: {e:?}"),
            })?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::NoDevice {
                ordinal,
                reason: format!("the driver reports {count} device(s)"),
            });
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice {
            ordinal,
            reason: format!("{e:?}"),
        })?;
        // One stream, raw pointers: cudarc's per-buffer event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("compute capability"))?;
        if major < 8 {
            return Err(CudaError::UnsupportedDevice { name, major, minor });
        }
        let dev_attr = |a: CUdevice_attribute, what: &'static str| -> Result<u32, CudaError> {
            Ok(ctx.attribute(a).map_err(drv(what))?.max(0) as u32)
        };
        let sm_count = dev_attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "SM count",
        )?;
        let smem_per_sm = dev_attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            "shared memory a SM",
        )?;
        let smem_reserved = dev_attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
            "shared memory reserved a block",
        )?;
        // sm_90 compiles as sm_90a (the Hopper-only warpgroup MMA of the prefill kernels)
        // unless SLOWFAST_CUDA_ARCH names another target, e.g. sm_90 for an A/B.
        let arch = match (std::env::var("SLOWFAST_CUDA_ARCH").ok(), major, minor) {
            (Some(a), _, _) if !a.is_empty() => a,
            (_, 9, 0) => "sm_90a".to_string(),
            _ => format!("sm_{major}{minor}"),
        };
        let image = load_or_compile_kernels(&arch)?;
        let wgmma = arch == "sm_90a";
        let module = ctx
            .load_module(Ptx::from_binary(image.cubin))
            .map_err(drv("cuModuleLoadData"))?;

        let mut funcs = HashMap::new();
        for &k in KERNEL_NAMES {
            let f = module
                .load_function(k)
                .map_err(drv("cuModuleGetFunction"))?;
            if let Some(bytes) = attn_smem_bytes(k) {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(drv("raising the dynamic shared-memory limit"))?;
            }

            funcs.insert(k, f);
        }
        let mut verify_per_sm = HashMap::new();
        for v in crate::ops::attention::VERIFY_VARIANTS {
            let n = funcs[v.name]
                .occupancy_max_active_blocks_per_multiprocessor(
                    v.threads() as u32,
                    v.smem_bytes(),
                    None,
                )
                .map_err(drv("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
            verify_per_sm.insert(v.name, n.max(1) as usize);
        }
        // The decode stream at the highest priority, the side stream (SFI's asynchronous
        // refresh) at the lowest: when both have blocks waiting, the decode step's go first.
        let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(drv("cuCtxGetStreamPriorityRange"))?;
        let stream = ctx
            .new_stream_with_priority(greatest)
            .map_err(drv("cuStreamCreate"))?;
        let side = ctx
            .new_stream_with_priority(least)
            .map_err(drv("cuStreamCreate"))?;
        let argmax_scratch = {
            use crate::ops::sampling::{ARGMAX_BLOCKS, ARGMAX_MAX_ROWS};
            let n = ARGMAX_MAX_ROWS * (1 + 2 * ARGMAX_BLOCKS);
            let slice = stream
                .alloc_zeros::<u32>(n)
                .map_err(drv("cuMemAlloc (argmax scratch)"))?;
            GpuBuffer::from_slice(slice, &stream)
        };
        let trace = if crate::trace::trace_dir().is_some() {
            use crate::trace::{CAPACITY, RECORD_WORDS};
            let buf = stream
                .alloc_zeros::<u64>(CAPACITY * RECORD_WORDS)
                .map_err(drv("cuMemAlloc (trace buffer)"))?;
            let buf = GpuBuffer::from_slice(buf, &stream);
            let mut sym = module
                .get_global("sf_trace_buf", &stream)
                .map_err(drv("cuModuleGetGlobal (sf_trace_buf)"))?;
            stream
                .memcpy_htod(&buf.device_ptr().to_ne_bytes(), &mut sym)
                .map_err(drv("cuMemcpyHtoD (sf_trace_buf)"))?;
            Some(std::sync::Mutex::new(buf))
        } else {
            None
        };
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::LibraryMissing {
                library: "cuBLAS (libcublas.so.13)",
                reason:
                    "not found by the dynamic loader; add the CUDA lib64 folder to LD_LIBRARY_PATH"
                        .into(),
            });
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas {
            op: "cublasCreate",
            reason: format!("{e:?}"),
        })?;
        Ok(CudaContext {
            ctx,
            stream,
            side,
            on_side: std::sync::atomic::AtomicBool::new(false),
            blas,
            funcs,
            name,
            compute_capability: (major, minor),
            sm_count,
            kernels_from_cache: image.from_cache,
            trace,

            gemv_max_rows: env_usize("SLOWFAST_GEMV_MAX_ROWS")
                .unwrap_or(GEMV_DEFAULT_ROWS)
                .min(GEMV_MAX_ROWS),
            gemv_mma_rows: std::sync::atomic::AtomicUsize::new(
                env_usize("SLOWFAST_GEMV_MMA_ROWS")
                    .unwrap_or(GEMV_MMA_DEFAULT_ROWS)
                    .min(GEMV_MAX_ROWS),
            ),
            decode_fused: env_usize("SLOWFAST_DECODE_FUSED") != Some(0),
            pdl_allowed: major >= 9 && env_usize("SLOWFAST_PDL") != Some(0),
            pdl_now: std::sync::atomic::AtomicU8::new(PdlMode::Off as u8),
            pdl_wide: env_usize("SLOWFAST_PDL_WIDE").map(|m| match m {
                0 => PdlMode::Off,
                1 => PdlMode::Attention,
                _ => PdlMode::All,
            }),
            attn_post: std::sync::atomic::AtomicBool::new(ATTN_POST_DEFAULT),
            decode_balance: std::sync::atomic::AtomicBool::new(true),
            smem_per_sm,
            smem_reserved,
            verify_per_sm,
            argmax_scratch,
            wgmma,
            sparse_post: std::sync::atomic::AtomicU8::new(post_mode(
                env_usize("SLOWFAST_SPARSE_POST").map(|v| v != 0),
            )),
        })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.name
    }
    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }
    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }
    /// Whether the kernel image came from the on-disk cache.
    pub fn kernels_from_cache(&self) -> bool {
        self.kernels_from_cache
    }
    /// Whether the kernels record step traces (`SLOWFAST_TRACE`, see [`crate::trace`]).
    pub fn tracing(&self) -> bool {
        self.trace.is_some()
    }
    /// Empties the trace buffer (queued on the stream; nothing when not tracing).
    pub fn trace_reset(&self) -> Result<(), CudaError> {
        if let Some(t) = &self.trace {
            let mut buf = t.lock().unwrap_or_else(|e| e.into_inner());
            let zeros = vec![0u64; buf.len()];
            self.upload_into(&zeros, &mut buf)?;
        }
        Ok(())
    }
    /// Waits for queued work and returns the records since the last [`Self::trace_reset`], in
    /// wait-return order (empty when not tracing; see [`crate::trace`]).
    pub fn trace_take(&self) -> Result<Vec<crate::trace::TraceRecord>, CudaError> {
        match &self.trace {
            Some(t) => {
                let buf = t.lock().unwrap_or_else(|e| e.into_inner());
                Ok(crate::trace::parse_records(&self.download(&buf)?))
            }
            None => Ok(Vec::new()),
        }
    }
    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(drv("cuMemGetInfo"))
    }
    /// The stream every operation is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The raw stream `launch` queues on now (the side stream between `side_begin` and
    /// `side_end`), for driver calls that go with those launches.
    /// Zeroes every byte of `b` on the current stream.
    pub fn memset_zero<T: GpuElem>(&self, b: &GpuBuffer<T>) -> Result<(), CudaError> {
        let bytes = b.len() * std::mem::size_of::<T>();
        // SAFETY: the buffer's own extent, on the stream its users run on.
        unsafe {
            cudarc::driver::result::memset_d8_async(b.device_ptr(), 0, bytes, self.current_stream())
        }
        .map_err(drv("cuMemsetD8Async"))
    }

    pub(crate) fn current_stream(&self) -> cudarc::driver::sys::CUstream {
        if self.on_side.load(std::sync::atomic::Ordering::Relaxed) {
            self.side.cu_stream()
        } else {
            self.stream.cu_stream()
        }
    }

    /// Waits for all queued work; surfaces asynchronous kernel faults.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize"))
    }

    /// A zero-filled buffer of `len` elements.
    pub fn alloc<T: GpuElem>(&self, len: usize) -> Result<GpuBuffer<T>, CudaError> {
        let s = self
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(drv("cuMemAlloc"))?;
        Ok(GpuBuffer::from_slice(s, &self.stream))
    }

    /// Copies `data` to a new device buffer.
    pub fn upload<T: GpuElem>(&self, data: &[T]) -> Result<GpuBuffer<T>, CudaError> {
        if data.is_empty() {
            return self.alloc(0);
        }
        let s = self.stream.clone_htod(data).map_err(drv("cuMemcpyHtoD"))?;
        Ok(GpuBuffer::from_slice(s, &self.stream))
    }

    /// Overwrites the start of `dst` with `data`.
    pub fn upload_into<T: GpuElem>(
        &self,
        data: &[T],
        dst: &mut GpuBuffer<T>,
    ) -> Result<(), CudaError> {
        if data.len() > dst.len() {
            return Err(CudaError::bad(
                "upload_into",
                format!("{} elements into a buffer of {}", data.len(), dst.len()),
            ));
        }
        let mut view = dst.slice_mut()?.slice_mut(0..data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(drv("cuMemcpyHtoD"))
    }

    /// Copies the whole buffer back to the host (waits for queued work first).
    pub fn download<T: GpuElem>(&self, src: &GpuBuffer<T>) -> Result<Vec<T>, CudaError> {
        let v = self
            .stream
            .clone_dtoh(src.slice()?)
            .map_err(drv("cuMemcpyDtoH"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// The first `n` elements of `src` (synchronises).
    pub fn download_prefix<T: GpuElem>(
        &self,
        src: &GpuBuffer<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        self.download_range(src, 0..n)
    }

    /// Elements `range` of `src` (synchronises).
    pub fn download_range<T: GpuElem>(
        &self,
        src: &GpuBuffer<T>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<T>, CudaError> {
        if range.start > range.end || range.end > src.len() {
            return Err(CudaError::bad(
                "download",
                format!(
                    "elements {}..{} of a buffer of {}",
                    range.start,
                    range.end,
                    src.len()
                ),
            ));
        }
        let v = self
            .stream
            .clone_dtoh(&src.slice()?.slice(range))
            .map_err(drv("cuMemcpyDtoH"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// Device-to-device copy of all of `src` into the start of `dst`.
    pub fn copy<T: GpuElem>(
        &self,
        src: &GpuBuffer<T>,
        dst: &mut GpuBuffer<T>,
    ) -> Result<(), CudaError> {
        if src.len() > dst.len() {
            return Err(CudaError::bad(
                "copy",
                format!("{} elements into a buffer of {}", src.len(), dst.len()),
            ));
        }
        let mut view = dst.slice_mut()?.slice_mut(0..src.len());
        self.stream
            .memcpy_dtod(src.slice()?, &mut view)
            .map_err(drv("cuMemcpyDtoD"))
    }

    /// Runs `f` `iters` times between two events and returns the mean milliseconds per call.
    pub fn time_ms(
        &self,
        iters: usize,
        mut f: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<f32, CudaError> {
        use cudarc::driver::sys::CUevent_flags;
        let start = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        for _ in 0..iters {
            f()?;
        }
        let end = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("cuEventRecord"))?;
        end.synchronize().map_err(drv("cuEventSynchronize"))?;
        let ms = start.elapsed_ms(&end).map_err(drv("cuEventElapsedTime"))?;
        Ok(ms / iters.max(1) as f32)
    }

    /// Whether the kernels were built for sm_90a, so the warpgroup-MMA prefill kernels run.
    pub fn has_wgmma(&self) -> bool {
        self.wgmma
    }

    /// Whether programmatic dependent launch may be used on this device (sm_90+, not turned off
    /// by `SLOWFAST_PDL=0`).
    pub fn pdl_allowed(&self) -> bool {
        self.pdl_allowed
    }

    /// `linear` runs the tensor-core GEMV for more than `SLOWFAST_GEMV_MAX_ROWS` and at most
    /// `rows` rows (0: never; at most 8), cuBLAS above; for A/B runs and tests.
    #[doc(hidden)]
    pub fn set_gemv_mma_rows(&self, rows: usize) {
        self.gemv_mma_rows.store(
            rows.min(GEMV_MAX_ROWS),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    pub(crate) fn gemv_mma_rows(&self) -> usize {
        self.gemv_mma_rows
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The fused dense decode step: qkv_post inside flash-decoding (`true`) or before it (for
    /// tests; default [`ATTN_POST_DEFAULT`]). A decoder captures its graph with the setting of
    /// that moment.
    #[doc(hidden)]
    pub fn set_attn_post(&self, on: bool) {
        self.attn_post
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn attn_post(&self) -> bool {
        self.attn_post.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sparse decode steps: qkv_post inside sparse flash-decoding (`Some(true)`), before it
    /// (`Some(false)`), or the default [`SPARSE_POST_DEFAULT`] (`None`: inside in steps of 3+
    /// rows); `SLOWFAST_SPARSE_POST=0|1` sets it at start. For A/B runs and tests; a decoder
    /// captures its graph with the setting of that moment.
    #[doc(hidden)]
    pub fn set_sparse_post(&self, on: Option<bool>) {
        self.sparse_post
            .store(post_mode(on), std::sync::atomic::Ordering::Relaxed);
    }

    /// The sparse post setting (see [`CudaContext::set_sparse_post`]).
    #[doc(hidden)]
    pub fn sparse_post(&self) -> Option<bool> {
        match self.sparse_post.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }

    /// Whether a sparse decode step runs qkv_post inside sparse flash-decoding: `fused` is the
    /// 1-2-row step (fused GEMVs), where the default keeps it separate.
    pub(crate) fn sparse_post_in(&self, fused: bool) -> bool {
        self.sparse_post().unwrap_or(!fused)
    }

    /// Dense flash-decoding's split: even on the device at every step (`true`, the default) or
    /// the host's whole-tile chunk (for A/B runs and tests).
    #[doc(hidden)]
    pub fn set_decode_balance(&self, on: bool) {
        self.decode_balance
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn decode_balance(&self) -> bool {
        self.decode_balance
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns PDL on or off for the kernels launched from now on (on only where allowed); the
    /// decode step sets it around its fused kernels, benchmarks around the kernels they time.
    pub fn set_pdl(&self, on: bool) {
        self.set_pdl_mode(if on { PdlMode::All } else { PdlMode::Off });
    }

    /// [`CudaContext::set_pdl`] with a choice of kernels (Off where PDL is not allowed).
    pub(crate) fn set_pdl_mode(&self, mode: PdlMode) {
        let mode = if self.pdl_allowed { mode } else { PdlMode::Off };
        self.pdl_now
            .store(mode as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// The PDL mode of a decode step of 3+ rows (see `pdl_wide`).
    pub(crate) fn pdl_wide(&self, sparse: bool) -> PdlMode {
        self.pdl_wide.unwrap_or_else(|| pdl_wide_default(sparse))
    }

    /// Captures the work `f` queues on the decode stream as a CUDA graph (relaxed stream
    /// capture), instantiated and uploaded; `CudaGraph::launch` replays it.
    pub fn capture_graph(
        &self,
        f: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<cudarc::driver::CudaGraph, CudaError> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(drv("cuStreamBeginCapture"))?;
        let queued = f();
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(drv("cuStreamEndCapture"))?;
        queued?;
        let g = graph
            .ok_or_else(|| CudaError::bad("gpu decoder", "stream capture produced no graph"))?;
        g.upload().map_err(drv("cuGraphUpload"))?;
        Ok(g)
    }

    /// Starts queueing side work: the side stream waits for everything queued on the decode
    /// stream so far, and kernels launched until [`CudaContext::side_end`] go to the side stream.
    pub(crate) fn side_begin(&self) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUevent_flags;
        let e = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv("cuEventRecord"))?;
        self.side.wait(&e).map_err(drv("cuStreamWaitEvent"))?;
        self.on_side
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Ends side work; the event marks its completion (for [`CudaContext::wait_side`]).
    pub(crate) fn side_end(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        use cudarc::driver::sys::CUevent_flags;
        self.on_side
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.side
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(drv("cuEventRecord"))
    }

    /// The decode stream waits (on the device) for side work that ended with `e`.
    pub(crate) fn wait_side(&self, e: &cudarc::driver::CudaEvent) -> Result<(), CudaError> {
        self.stream.wait(e).map_err(drv("cuStreamWaitEvent"))
    }

    /// Launches kernel `name` on the context's stream (the side stream between `side_begin`
    /// and `side_end`).
    pub(crate) fn launch(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        args: &[KArg],
    ) -> Result<(), CudaError> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| CudaError::bad("launch", format!("unknown kernel {name}")))?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let side = self.on_side.load(std::sync::atomic::Ordering::Relaxed);
        let pdl = match self.pdl_now.load(std::sync::atomic::Ordering::Relaxed) {
            m if m == PdlMode::All as u8 => crate::kernels::is_pdl_kernel(name),
            m if m == PdlMode::Attention as u8 => crate::kernels::is_attn_pdl_kernel(name),
            _ => false,
        };
        if !side && pdl {
            return self.launch_pdl(name, f, grid, block, shared_mem_bytes, args);
        }
        let stream = if side { &self.side } else { &self.stream };
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                KArg::P(v) => b.arg(v),
                KArg::U(v) => b.arg(v),
                KArg::F(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes,
        };
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::Driver {
            op: name,
            reason: format!("launch failed: {e:?}"),
        })?;
        Ok(())
    }

    /// `launch` with the programmatic-stream-serialization attribute (cuLaunchKernelEx): the
    /// kernel may start before the previous one in the stream has finished; it calls
    /// `pdl_wait()` before depending on it.
    fn launch_pdl(
        &self,
        name: &'static str,
        f: &cudarc::driver::CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem_bytes: u32,
        args: &[KArg],
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        // Each argument in its own 8-byte slot; u32 / f32 occupy the first four bytes.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                KArg::P(v) => v,
                KArg::U(v) => v as u64,
                KArg::F(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: a zeroed attribute is valid plain data; id and value are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `params` points at one live slot per kernel parameter, in order, and every
        // kernel parameter is a pointer, u32 or f32 (little-endian: the low bytes come first).
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| CudaError::Driver {
            op: name,
            reason: format!("launch (PDL) failed: {e:?}"),
        })
    }
}
