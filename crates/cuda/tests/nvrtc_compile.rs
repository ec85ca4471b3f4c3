//! Compiles every kernel with NVRTC, no GPU needed. Skips (printing why) when libnvrtc or the
//! CUDA headers are absent, unless SLOWFAST_REQUIRE_NVRTC=1. Without SLOWFAST_NVRTC_LIB it
//! also looks for the `nvidia-cuda-nvrtc` pip package through `python3`.

use slowfast_cuda::kernels::KERNEL_NAMES;
use slowfast_cuda::{compile_kernels, CudaError};

/// Points SLOWFAST_NVRTC_LIB at the pip package's libnvrtc when the variable is unset.
fn discover_pip_nvrtc() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("SLOWFAST_NVRTC_LIB").is_some() {
            return;
        }
        let py = "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib', 'libnvrtc.so.13'))";
        let Ok(out) = std::process::Command::new("python3").args(["-c", py]).output() else { return };
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && std::path::Path::new(&path).exists() {
            println!("using libnvrtc from the pip package: {path}");
            std::env::set_var("SLOWFAST_NVRTC_LIB", path);
        }
    });
}

fn require() -> bool {
    std::env::var("SLOWFAST_REQUIRE_NVRTC")
        .map(|v| v == "1")
        .unwrap_or(false)
}

#[test]
fn every_kernel_compiles_for_sm80_sm90_and_sm90a() {
    discover_pip_nvrtc();
    for arch in ["sm_90a", "sm_90", "sm_80"] {
        match compile_kernels(arch) {
            Ok(img) => {
                assert!(
                    img.cubin.len() > 1024,
                    "{arch}: cubin of {} bytes",
                    img.cubin.len()
                );
                for name in KERNEL_NAMES {
                    let found = img.cubin.windows(name.len()).any(|w| w == name.as_bytes());
                    assert!(found, "{arch}: kernel {name} missing from the CUBIN");
                }
                println!(
                    "{arch}: {} kernels, cubin {} bytes",
                    KERNEL_NAMES.len(),
                    img.cubin.len()
                );
            }
            Err(e @ (CudaError::LibraryMissing { .. } | CudaError::MissingHeaders(_)))
                if !require() =>
            {
                println!("skipped: NVRTC not available ({e}); set SLOWFAST_NVRTC_LIB");
                return;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn bad_arch_is_rejected() {
    discover_pip_nvrtc();
    let err = compile_kernels("sm_70").unwrap_err();
    assert!(err.to_string().contains("sm_70"), "{err}");
    let err = compile_kernels("sm_90aa").unwrap_err();
    assert!(err.to_string().contains("sm_90aa"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn stub_context_says_how_to_rebuild() {
    let err = slowfast_cuda::CudaContext::new(0).unwrap_err();
    assert!(err.to_string().contains("--features cuda"), "{err}");
}

#[test]
fn second_compile_comes_from_the_disk_cache() {
    discover_pip_nvrtc();
    let home =
        std::env::temp_dir().join(format!("slowfast-cuda-cache-test-{}", std::process::id()));
    std::env::set_var("SLOWFAST_HOME", &home);
    let first = match slowfast_cuda::load_or_compile_kernels("sm_90") {
        Ok(img) => img,
        Err(e @ (CudaError::LibraryMissing { .. } | CudaError::MissingHeaders(_)))
            if !require() =>
        {
            println!("skipped: NVRTC not available ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert!(
        !first.from_cache,
        "fresh cache dir {} already held an image",
        home.display()
    );
    let path = first.cache_path.clone().expect("cache path");
    assert!(
        path.starts_with(home.join("cuda-cache")),
        "{}",
        path.display()
    );
    let second = slowfast_cuda::load_or_compile_kernels("sm_90").unwrap();
    assert!(second.from_cache, "second load recompiled");
    assert_eq!(first.cubin, second.cubin);
    // another architecture has another key
    assert_ne!(
        slowfast_cuda::nvrtc::cache_key("sm_80").unwrap(),
        slowfast_cuda::nvrtc::cache_key("sm_90").unwrap()
    );
    let _ = std::fs::remove_dir_all(&home);
}
