//! Mapping CUDA driver, NVRTC and cuBLASLt errors onto [`BackendError`].
//!
//! The classification works on the numeric `CUresult` code, so it does not
//! depend on which enum variants the bindings of a given CUDA version know.
//! Sticky errors (the context is unusable for the rest of the process, and on
//! the H200 so is every other context of that device in the process) become
//! [`BackendError::DeviceFault`]: the worker must exit.

use crate::backend::BackendError;
use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;

/// `CUresult` codes after which the process can no longer use the device.
pub const STICKY_CODES: &[u32] = &[
    4,   // CUDA_ERROR_DEINITIALIZED
    214, // CUDA_ERROR_ECC_UNCORRECTABLE
    220, // CUDA_ERROR_NVLINK_UNCORRECTABLE
    226, // CUDA_ERROR_CONTAINED
    700, // CUDA_ERROR_ILLEGAL_ADDRESS
    702, // CUDA_ERROR_LAUNCH_TIMEOUT
    709, // CUDA_ERROR_CONTEXT_IS_DESTROYED
    710, // CUDA_ERROR_ASSERT
    714, // CUDA_ERROR_HARDWARE_STACK_ERROR
    715, // CUDA_ERROR_ILLEGAL_INSTRUCTION
    716, // CUDA_ERROR_MISALIGNED_ADDRESS
    717, // CUDA_ERROR_INVALID_ADDRESS_SPACE
    718, // CUDA_ERROR_INVALID_PC
    719, // CUDA_ERROR_LAUNCH_FAILED
    721, // CUDA_ERROR_TENSOR_MEMORY_LEAK
    911, // CUDA_ERROR_EXTERNAL_DEVICE
    999, // CUDA_ERROR_UNKNOWN
];

const OUT_OF_MEMORY: u32 = 2;
/// Codes meaning "this device/driver cannot do it" rather than "it failed".
const UNSUPPORTED_CODES: &[u32] = &[
    34,  // CUDA_ERROR_STUB_LIBRARY
    35,  // CUDA_ERROR_INSUFFICIENT_DRIVER
    36,  // CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER
    100, // CUDA_ERROR_NO_DEVICE
    101, // CUDA_ERROR_INVALID_DEVICE
    209, // CUDA_ERROR_NO_BINARY_FOR_GPU
    218, // CUDA_ERROR_INVALID_PTX
    221, // CUDA_ERROR_JIT_COMPILER_NOT_FOUND
    222, // CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    223, // CUDA_ERROR_JIT_COMPILATION_DISABLED
    801, // CUDA_ERROR_NOT_SUPPORTED
    803, // CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
    804, // CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
];

/// How a failure affects the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    Sticky,
    OutOfMemory,
    Unsupported,
    Other,
}

/// Classifies a numeric `CUresult`.
pub fn classify_cu_code(code: u32) -> ErrorClass {
    if STICKY_CODES.contains(&code) {
        ErrorClass::Sticky
    } else if code == OUT_OF_MEMORY {
        ErrorClass::OutOfMemory
    } else if UNSUPPORTED_CODES.contains(&code) {
        ErrorClass::Unsupported
    } else {
        ErrorClass::Other
    }
}

/// The numeric code of a driver error.
pub fn cu_code(e: &DriverError) -> u32 {
    e.0 as u32
}

/// Builds the [`BackendError`] for a classified failure.
pub fn backend_error(class: ErrorClass, message: String) -> BackendError {
    match class {
        ErrorClass::Sticky => BackendError::DeviceFault(message),
        ErrorClass::OutOfMemory => BackendError::OutOfMemory(message),
        ErrorClass::Unsupported => BackendError::Unsupported(message),
        ErrorClass::Other => BackendError::Other(message),
    }
}

/// `what: CUDA_ERROR_X (code): description`.
pub fn driver_error(what: &str, e: DriverError) -> BackendError {
    let code = cu_code(&e);
    // Debug of DriverError asks the driver for the description; it never panics
    // once the driver library is loaded (which it is, or there'd be no error).
    backend_error(
        classify_cu_code(code),
        format!("{what}: {:?} (code {code})", e.0),
    )
}

/// `cublasStatus_t` codes: 3 = ALLOC_FAILED, 7 = INVALID_VALUE,
/// 13 = EXECUTION_FAILED, 15 = NOT_SUPPORTED, 16 = LICENSE_ERROR.
pub fn cublas_error(what: &str, e: CublasError) -> BackendError {
    let code = e.0 as u32;
    let message = format!("{what}: {:?} (cublas status {code})", e.0);
    match code {
        3 => BackendError::OutOfMemory(message),
        15 => BackendError::Unsupported(message),
        _ => BackendError::Other(message),
    }
}

/// Makes `Result<_, DriverError>` convertible with a label.
pub trait DriverResultExt<T> {
    fn cu(self, what: &str) -> Result<T, BackendError>;
}

impl<T> DriverResultExt<T> for Result<T, DriverError> {
    fn cu(self, what: &str) -> Result<T, BackendError> {
        self.map_err(|e| driver_error(what, e))
    }
}

/// Makes `Result<_, CublasError>` convertible with a label.
pub trait CublasResultExt<T> {
    fn lt(self, what: &str) -> Result<T, BackendError>;
}

impl<T> CublasResultExt<T> for Result<T, CublasError> {
    fn lt(self, what: &str) -> Result<T, BackendError> {
        self.map_err(|e| cublas_error(what, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_are_device_faults() {
        for code in [700, 719, 214, 714, 715, 716] {
            assert_eq!(classify_cu_code(code), ErrorClass::Sticky, "{code}");
            assert!(backend_error(classify_cu_code(code), "x".into()).is_fatal());
        }
    }

    #[test]
    fn other_classes() {
        assert_eq!(classify_cu_code(2), ErrorClass::OutOfMemory);
        assert!(matches!(
            backend_error(classify_cu_code(2), "x".into()),
            BackendError::OutOfMemory(_)
        ));
        assert_eq!(classify_cu_code(209), ErrorClass::Unsupported);
        assert_eq!(classify_cu_code(222), ErrorClass::Unsupported);
        assert_eq!(classify_cu_code(1), ErrorClass::Other);
        assert_eq!(classify_cu_code(701), ErrorClass::Other); // too many resources: not sticky
        assert!(!backend_error(classify_cu_code(1), "x".into()).is_fatal());
    }

    #[test]
    fn driver_errors_map_by_code() {
        use cudarc::driver::sys::CUresult;
        let e = driver_error("sync", DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert!(e.is_fatal(), "{e:?}");
        assert!(e.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{e}");
        let e = driver_error("alloc", DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(matches!(e, BackendError::OutOfMemory(_)), "{e:?}");
    }

    #[test]
    fn cublas_errors_map_by_status() {
        use cudarc::cublaslt::sys::cublasStatus_t;
        let e = cublas_error(
            "mm",
            CublasError(cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED),
        );
        assert!(matches!(e, BackendError::OutOfMemory(_)));
        let e = cublas_error(
            "mm",
            CublasError(cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED),
        );
        assert!(matches!(e, BackendError::Unsupported(_)));
    }
}
