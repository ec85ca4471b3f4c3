//! NVRTC: finding libnvrtc and the CUDA headers, compiling the kernel sources to a CUBIN
//! for one GPU architecture, and the on-disk cache of compiled images. Needs no GPU.
//!
//! Environment:
//! - `SLOWFAST_NVRTC_LIB`: path of `libnvrtc.so.13` (else the dynamic loader's search path,
//!   e.g. `LD_LIBRARY_PATH`, then `/usr/local/cuda/lib64`).
//! - `SLOWFAST_CUDA_INCLUDE`: folder holding `cuda_bf16.h` (else `/usr/local/cuda/include`,
//!   then `../include` beside the NVRTC library, the layout of the `nvidia-cuda-nvrtc` +
//!   `nvidia-cuda-runtime` pip packages).
//! - `SLOWFAST_HOME` (default `~/.cache/slowfast`): compiled images go to `cuda-cache/` in it.
//! - `SLOWFAST_TRACE`: compiles the step tracing in (see [`crate::trace`]).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

use crate::error::CudaError;
use crate::kernels::kernel_source;

/// Env var naming the libnvrtc shared object.
pub const ENV_NVRTC_LIB: &str = "SLOWFAST_NVRTC_LIB";
/// Env var naming the folder with the CUDA headers.
pub const ENV_CUDA_INCLUDE: &str = "SLOWFAST_CUDA_INCLUDE";

const DEFAULT_NVRTC: &[&str] = &[
    "/usr/local/cuda/lib64/libnvrtc.so.13",
    "/usr/local/cuda/lib64/libnvrtc.so",
];

/// A compiled kernel image for one architecture.
#[derive(Debug, Clone)]
pub struct KernelImage {
    /// Target, e.g. `sm_90`.
    pub arch: String,
    /// The CUBIN bytes (load with `cuModuleLoadData`).
    pub cubin: Vec<u8>,
    /// Whether it came from the on-disk cache rather than a fresh compile.
    pub from_cache: bool,
    /// Where it is cached, if caching is possible.
    pub cache_path: Option<PathBuf>,
}

static NVRTC: OnceLock<Result<Option<PathBuf>, String>> = OnceLock::new();

fn preload(path: &Path) -> Result<(), String> {
    // libnvrtc opens its builtins library (libnvrtc-builtins.so.13.0) by soname at the first
    // compile, and some builds (the nvidia-cuda-nvrtc 13.0.88 wheel) carry no RUNPATH to find
    // it beside themselves: load the one next to `path` first, so that dlopen finds it loaded.
    if let Some(dir) = path.parent() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("libnvrtc-builtins.so") {
                    let _ = preload_one(&e.path());
                }
            }
        }
    }
    preload_one(path)
}

fn preload_one(path: &Path) -> Result<(), String> {
    // RTLD_GLOBAL so cudarc's later dlopen("libnvrtc.so.13") finds this object by its soname.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

/// Makes libnvrtc loadable; returns the explicit path used, if any.
pub fn ensure_nvrtc() -> Result<Option<PathBuf>, CudaError> {
    let r = NVRTC.get_or_init(|| {
        if let Ok(p) = std::env::var(ENV_NVRTC_LIB) {
            let p = PathBuf::from(p);
            preload(&p).map_err(|e| format!("{ENV_NVRTC_LIB}={}: {e}", p.display()))?;
            return Ok(Some(p));
        }
        if unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        for c in DEFAULT_NVRTC {
            let p = PathBuf::from(c);
            if p.exists() && preload(&p).is_ok() {
                return Ok(Some(p));
            }
        }
        Err(format!(
            "libnvrtc not found on the loader path or in /usr/local/cuda/lib64; set {ENV_NVRTC_LIB} \
             (pip install nvidia-cuda-nvrtc==13.0.* puts it in site-packages/nvidia/cu13/lib)"
        ))
    });
    r.clone().map_err(|reason| CudaError::LibraryMissing {
        library: "NVRTC",
        reason,
    })
}

/// The NVRTC version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    let rc = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::LibraryMissing {
            library: "NVRTC",
            reason: format!("nvrtcVersion returned {rc:?}"),
        });
    }
    Ok((major, minor))
}

/// The folder holding `cuda_bf16.h`.
pub fn cuda_include_dir() -> Result<PathBuf, CudaError> {
    let mut tried = Vec::new();
    let mut candidates = Vec::new();
    if let Ok(p) = std::env::var(ENV_CUDA_INCLUDE) {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Ok(Some(lib)) = ensure_nvrtc() {
        if let Some(dir) = lib.parent().and_then(|d| d.parent()) {
            candidates.push(dir.join("include"));
        }
    }
    for c in candidates {
        if c.join("cuda_bf16.h").exists() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(CudaError::MissingHeaders(format!(
        "no cuda_bf16.h in {}",
        tried.join(", ")
    )))
}

fn compile_options(arch: &str, include: &Path) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", include.display()),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
        format!("-DSFI_CAND_TPP={}", crate::kernels::CAND_THREADS_A_PAGE),
    ];
    if crate::trace::trace_dir().is_some() {
        o.push("-DSLOWFAST_TRACE".to_string());
    }
    o
}

fn nvrtc_check(rc: sys::nvrtcResult, what: &str) -> Result<(), String> {
    if rc == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} returned {rc:?}"))
    }
}

/// Compiles every kernel for `arch` (e.g. `sm_90`) to a CUBIN. No GPU and no cache involved.
pub fn compile_kernels(arch: &str) -> Result<KernelImage, CudaError> {
    // sm_XY, or sm_XYa (the architecture-specific feature set, e.g. sm_90a)
    let digits = arch.get(3..).unwrap_or("");
    let digits = digits.strip_suffix('a').unwrap_or(digits);
    if !arch.starts_with("sm_") || digits.parse::<u32>().map(|v| v < 80).unwrap_or(true) {
        return Err(CudaError::bad(
            "compile_kernels",
            format!("arch {arch:?}: expected sm_XY or sm_XYa with XY >= 80"),
        ));
    }
    ensure_nvrtc()?;
    let include = cuda_include_dir()?;
    let options = compile_options(arch, &include);
    let cubin = compile_source(&kernel_source(), &options).map_err(|log| CudaError::Compile {
        arch: arch.to_string(),
        options: options.clone(),
        log,
    })?;
    Ok(KernelImage {
        arch: arch.to_string(),
        cubin,
        from_cache: false,
        cache_path: None,
    })
}

fn compile_source(src: &str, options: &[String]) -> Result<Vec<u8>, String> {
    let c_src = CString::new(src).map_err(|e| format!("source holds a NUL byte: {e}"))?;
    let name = CString::new("slowfast_kernels.cu").expect("static name");
    let c_opts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()).expect("option without NUL"))
        .collect();
    let opt_ptrs: Vec<*const std::ffi::c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    unsafe {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        nvrtc_check(
            sys::nvrtcCreateProgram(
                &mut prog,
                c_src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let rc = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let result = if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0usize;
            let mut log = String::from("(no log)");
            if sys::nvrtcGetProgramLogSize(prog, &mut size) == sys::nvrtcResult::NVRTC_SUCCESS
                && size > 1
            {
                let mut buf = vec![0 as std::ffi::c_char; size];
                if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr())
                    == sys::nvrtcResult::NVRTC_SUCCESS
                {
                    log = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
                }
            }
            Err(format!("nvrtcCompileProgram returned {rc:?}\n{log}"))
        } else {
            let mut size = 0usize;
            nvrtc_check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize").and_then(
                |_| {
                    let mut buf = vec![0u8; size];
                    nvrtc_check(
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char),
                        "nvrtcGetCUBIN",
                    )
                    .map(|_| buf)
                },
            )
        };
        let _ = sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// `$SLOWFAST_HOME/cuda-cache` (SLOWFAST_HOME defaults to `~/.cache/slowfast`).
pub fn cache_dir() -> Option<PathBuf> {
    let home = match std::env::var("SLOWFAST_HOME") {
        Ok(h) => PathBuf::from(h),
        Err(_) => PathBuf::from(std::env::var("HOME").ok()?)
            .join(".cache")
            .join("slowfast"),
    };
    Some(home.join("cuda-cache"))
}

/// Hex key of (source, options, arch, NVRTC version, crate version).
pub fn cache_key(arch: &str) -> Result<String, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let include = cuda_include_dir()?;
    let mut h = Sha256::new();
    h.update(kernel_source().as_bytes());
    for o in compile_options(arch, &include) {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    h.update(
        format!(
            "\0{arch}\0nvrtc {major}.{minor}\0{}",
            env!("CARGO_PKG_VERSION")
        )
        .as_bytes(),
    );
    Ok(h.finalize()
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Returns the cached CUBIN for `arch` when its key matches, else compiles and stores it.
/// A cache that cannot be written is not an error (the image is still returned).
pub fn load_or_compile_kernels(arch: &str) -> Result<KernelImage, CudaError> {
    let key = cache_key(arch)?;
    let path = cache_dir().map(|d| d.join(format!("kernels-{arch}-{key}.cubin")));
    if let Some(p) = &path {
        if let Ok(cubin) = std::fs::read(p) {
            if !cubin.is_empty() {
                return Ok(KernelImage {
                    arch: arch.to_string(),
                    cubin,
                    from_cache: true,
                    cache_path: path.clone(),
                });
            }
        }
    }
    let mut img = compile_kernels(arch)?;
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let tmp = p.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::create_dir_all(dir).is_ok() && std::fs::write(&tmp, &img.cubin).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    img.cache_path = path;
    Ok(img)
}
