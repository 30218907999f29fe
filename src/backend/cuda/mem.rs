//! Raw device and pinned host allocations with drop handlers that never panic
//! and never synchronise (cudarc's `CudaSlice`/`PinnedHostSlice` record and
//! wait on events, which would end up inside captures or stall the host).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, DriverError};

/// Alignment of every buffer carved out of an arena: cuBLASLt's heuristics
/// assume 256-byte aligned operands unless told otherwise.
pub const ALIGN: usize = 256;

pub fn align_up(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Device memory from `cuMemAlloc`, freed with `cuMemFree` on drop (errors ignored).
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device pointer is a plain address; the driver API is thread-safe.
unsafe impl Send for DeviceBuf {}
unsafe impl Sync for DeviceBuf {}

impl DeviceBuf {
    /// Allocates `bytes` (at least 1) of device memory, uninitialised.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuf, DriverError> {
        ctx.bind_to_thread()?;
        let bytes = bytes.max(1);
        // SAFETY: plain allocation.
        let ptr = unsafe { result::malloc_sync(bytes) }?;
        Ok(DeviceBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// Allocates and zeroes (synchronously).
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuf, DriverError> {
        let b = Self::alloc(ctx, bytes)?;
        // SAFETY: the range is ours.
        unsafe { sys::cuMemsetD8_v2(b.ptr, 0, b.bytes) }.result()?;
        // The memset runs on the legacy stream, which does not order with our
        // non-blocking streams: wait for it here.
        // SAFETY: plain synchronisation of the current context.
        unsafe { sys::cuCtxSynchronize() }.result()?;
        Ok(b)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemAlloc, freed once. Errors (e.g. after a
        // sticky fault) are ignored: nothing here may panic.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (not write-combined: the host
/// reads outputs back), freed on drop (errors ignored).
pub struct PinnedBuf {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory; access is serialised by the owner.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedBuf, DriverError> {
        ctx.bind_to_thread()?;
        let bytes = align_up(bytes.max(1), 64);
        // SAFETY: plain allocation; zeroed below.
        let ptr = unsafe { result::malloc_host(bytes, 0) }? as *mut u8;
        // SAFETY: `bytes` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(PinnedBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The device's address of this memory (with unified addressing, every
    /// pinned allocation is mapped into the device's address space).
    pub fn device_addr(&self) -> Result<u64, DriverError> {
        self.ctx.bind_to_thread()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` came from cuMemHostAlloc in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr as *mut std::ffi::c_void, 0) }
            .result()?;
        Ok(d)
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc, freed once; errors ignored.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment() {
        assert_eq!(align_up(0, 256), 0);
        assert_eq!(align_up(1, 256), 256);
        assert_eq!(align_up(256, 256), 256);
        assert_eq!(align_up(257, 256), 512);
    }
}
