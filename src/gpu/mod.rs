//! Host-side facts about the machine's devices, used by both processes: the
//! daemon counts GPUs and watches them through NVML, a worker describes the
//! device it drives.
//!
//! * [`libs`]: finds the CUDA libraries before cudarc touches them (cudarc
//!   panics on a missing library; here that is a clear error).
//! * [`nvml`]: device discovery, health samples and the Xid watcher.
//! * [`cuda_device_count`], [`DeviceInfo`]: what the daemon plans its devices
//!   from, and what a worker reports about its device.
//!
//! Nothing here allocates device memory or creates a CUDA context: the
//! daemon process must never hold one (a fault in any context poisons the
//! whole process; see `docs/architecture.md`).

pub mod libs;
pub mod nvml;

use cudarc::driver::CudaContext;
use libs::CudaLib;
use serde::{Deserialize, Serialize};

/// Static facts about the device a worker drives (a GPU or a CPU device),
/// reported to the daemon when the worker is ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// "cpu" or "cuda".
    pub backend: String,
    /// e.g. "NVIDIA H200" or "cpu (4 threads)".
    pub name: String,
    /// CUDA ordinal or CPU device number.
    pub ordinal: usize,
    pub pci_bus_id: Option<String>,
    pub uuid: Option<String>,
    pub compute_capability: Option<(u32, u32)>,
    pub memory_total_bytes: Option<u64>,
}

/// Number of CUDA devices, or why there are none usable (no driver, driver
/// too old, no GPU visible). Never panics.
pub fn cuda_device_count() -> Result<usize, String> {
    libs::ensure(CudaLib::Driver)?;
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) => Ok(n.max(0) as usize),
        Ok(Err(e)) => Err(format!(
            "cuInit/cuDeviceGetCount failed: {:?} (code {}){}",
            e.0,
            e.0 as u32,
            match e.0 as u32 {
                100 => " — no GPU visible (check CUDA_VISIBLE_DEVICES)",
                34 => " — a stub libcuda from a toolkit's lib64/stubs was loaded; remove it from LD_LIBRARY_PATH",
                35 | 803 => " — the NVIDIA driver is too old or does not match its kernel module",
                _ => "",
            }
        )),
        Err(_) => Err("the CUDA driver library panicked while loading".into()),
    }
}

/// The compute capability of every visible CUDA device, by ordinal (no
/// context is created).
pub fn cuda_compute_capabilities() -> Result<Vec<(u32, u32)>, String> {
    use cudarc::driver::{result::device, sys::CUdevice_attribute as A};
    (0..cuda_device_count()?)
        .map(|i| {
            let dev = device::get(i as i32).map_err(|e| format!("GPU {i}: {e:?}"))?;
            // SAFETY: a device handle the driver just returned.
            let attr = |a| unsafe { device::get_attribute(dev, a) };
            match (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ) {
                (Ok(major), Ok(minor)) => Ok((major as u32, minor as u32)),
                (Err(e), _) | (_, Err(e)) => Err(format!("GPU {i}: compute capability: {e:?}")),
            }
        })
        .collect()
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as NVML and nvidia-smi print it.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| {
        bytes[r]
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

/// Normalises a PCI bus id to NVML's form, `00000000:00:06.0` (CUDA prints a
/// 4-digit domain, NVML 8; both upper-case the hex digits differently).
pub fn normalize_pci_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest))
            if domain.len() < 8 && domain.chars().all(|c| c.is_ascii_hexdigit()) =>
        {
            format!("{:0>8}:{rest}", domain)
        }
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_here_is_an_error_not_a_panic() {
        // On machines with a GPU this returns Ok; here (CI) an error.
        match cuda_device_count() {
            Ok(n) => eprintln!("{n} CUDA devices"),
            Err(e) => assert!(!e.is_empty()),
        }
    }

    #[test]
    fn uuid_and_pci_formats() {
        let b: [u8; 16] = [
            0x69, 0x5d, 0xa9, 0xc6, 0xb8, 0xa8, 0x4e, 0x47, 0xd6, 0xd2, 0x55, 0xf3, 0xc3, 0x3d,
            0x14, 0x59,
        ];
        assert_eq!(format_uuid(&b), "GPU-695da9c6-b8a8-4e47-d6d2-55f3c33d1459");
        assert_eq!(normalize_pci_bus_id("0000:00:06.0"), "00000000:00:06.0");
        assert_eq!(normalize_pci_bus_id("00000000:1A:00.0"), "00000000:1a:00.0");
        assert_eq!(
            normalize_pci_bus_id("0000:1a:00.0"),
            normalize_pci_bus_id("00000000:1A:00.0")
        );
    }
}
