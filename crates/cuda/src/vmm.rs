//! The CUDA driver's virtual memory management behind [`PageBackend`]: physical pages
//! (`cuMemCreate`), mapped one page at a time into address ranges reserved for the KV caches
//! (`cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`).

use std::sync::Arc;

use cudarc::driver::sys;

use crate::error::CudaError;
use crate::pages::PageBackend;

fn check(rc: sys::CUresult, op: &'static str) -> Result<(), CudaError> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            op,
            reason: format!("{rc:?}"),
        })
    }
}

/// Pages of the device's memory, and the calls that map them.
pub(crate) struct Vmm {
    ctx: Arc<cudarc::driver::CudaContext>,
    prop: sys::CUmemAllocationProp,
    access: sys::CUmemAccessDesc,
    page: usize,
}

impl Vmm {
    pub fn new(ctx: Arc<cudarc::driver::CudaContext>) -> Result<Self, CudaError> {
        ctx.bind_to_thread()
            .map_err(crate::context::drv("bind context"))?;
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ctx.ordinal() as i32;
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let mut page = 0usize;
        check(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut page,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "cuMemGetAllocationGranularity",
        )?;
        if page == 0 {
            return Err(CudaError::Driver {
                op: "cuMemGetAllocationGranularity",
                reason: "granularity 0".into(),
            });
        }
        Ok(Vmm {
            ctx,
            prop,
            access,
            page,
        })
    }

    /// Bytes of one physical page (the allocation granularity).
    pub fn page_bytes(&self) -> usize {
        self.page
    }

    /// Reserves `bytes` (a multiple of the page) of virtual addresses.
    pub fn reserve(&self, bytes: usize) -> Result<Reservation, CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(crate::context::drv("bind context"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        check(
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, self.page, 0, 0) },
            "cuMemAddressReserve (KV)",
        )?;
        Ok(Reservation {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }
}

impl PageBackend for Vmm {
    type Handle = sys::CUmemGenericAllocationHandle;

    fn create(&mut self) -> Result<Self::Handle, CudaError> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        check(
            unsafe { sys::cuMemCreate(&mut h, self.page, &self.prop, 0) },
            "cuMemCreate (KV page)",
        )?;
        Ok(h)
    }

    fn map(&mut self, va: u64, h: Self::Handle) -> Result<(), CudaError> {
        check(
            unsafe { sys::cuMemMap(va, self.page, 0, h, 0) },
            "cuMemMap (KV page)",
        )
    }

    fn grant(&mut self, va: u64, bytes: usize) -> Result<(), CudaError> {
        check(
            unsafe { sys::cuMemSetAccess(va, bytes, &self.access, 1) },
            "cuMemSetAccess (KV pages)",
        )
    }

    fn unmap(&mut self, va: u64) -> Result<(), CudaError> {
        check(
            unsafe { sys::cuMemUnmap(va, self.page) },
            "cuMemUnmap (KV page)",
        )
    }

    fn release(&mut self, h: Self::Handle) {
        unsafe {
            sys::cuMemRelease(h);
        }
    }
}

/// A range of reserved virtual addresses (freed on drop; its pages are unmapped before).
pub(crate) struct Reservation {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            sys::cuMemAddressFree(self.ptr, self.bytes);
        }
    }
}
