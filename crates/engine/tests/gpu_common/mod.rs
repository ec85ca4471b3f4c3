//! What the GPU test binaries share.
use std::sync::Arc;

use slowfast_cuda::CudaContext;

/// GPU 0, or None with a skip line (a panic under SLOWFAST_REQUIRE_GPU=1).
pub fn gpu(name: &str) -> Option<Arc<CudaContext>> {
    match CudaContext::new(0) {
        Ok(c) => Some(Arc::new(c)),
        Err(e) => {
            if std::env::var("SLOWFAST_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{name}: no GPU: {e}");
            }
            eprintln!("skipping {name}: {e}");
            None
        }
    }
}
