//! Finding the CUDA libraries before cudarc touches them.
//!
//! cudarc (with `dynamic-loading`) `dlopen()`s each library by its bare name
//! (`libnvrtc.so`, …, `libnvrtc.so.13`, …) the first time one of its functions
//! is called, and **panics** when none of the names loads. So every entry
//! point of the CUDA backend calls [`require`] first, which returns a clear
//! error instead.
//!
//! Libraries that are not on the loader's default path can be preloaded from a
//! directory: [`preload_from`] `dlopen()`s them by absolute path with
//! `RTLD_GLOBAL`, after which the dynamic loader resolves cudarc's later
//! `dlopen("libnvrtc.so.13")` to the already-loaded object (glibc matches
//! loaded objects by their `DT_SONAME`). Directories come from
//! `REPLAYD_CUDA_LIB_DIR` (colon-separated), `REPLAYD_NVRTC_DIR`, then the usual
//! toolkit locations and Python wheels (`site-packages/nvidia/cu13/lib`).
//! Setting `LD_LIBRARY_PATH` before the process starts works too.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A library the CUDA backend needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLib {
    /// `libcuda.so.1`, installed with the NVIDIA driver.
    Driver,
    /// `libnvrtc.so.13` (+ `libnvrtc-builtins.so.13.x`), the run-time compiler.
    Nvrtc,
    /// `libcublasLt.so.13`.
    CublasLt,
}

impl CudaLib {
    /// The name cudarc builds its candidate list from.
    pub fn stem(self) -> &'static str {
        match self {
            CudaLib::Driver => "cuda",
            CudaLib::Nvrtc => "nvrtc",
            CudaLib::CublasLt => "cublasLt",
        }
    }

    /// File names (in load order) to preload from a directory.
    fn files(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1"],
            // Builtins first: libnvrtc has no RPATH and dlopen()s them by name.
            CudaLib::Nvrtc => &["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"],
            CudaLib::CublasLt => &["libcublasLt.so.13"],
        }
    }

    /// Whether cudarc can load the library now (never panics).
    pub fn is_present(self) -> bool {
        // SAFETY: each tries `dlopen` on cudarc's candidate names and closes it again.
        std::panic::catch_unwind(|| unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
            }
        })
        .unwrap_or(false)
    }
}

impl std::fmt::Display for CudaLib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CudaLib::Driver => "libcuda (NVIDIA driver)",
            CudaLib::Nvrtc => "libnvrtc (CUDA 13 NVRTC)",
            CudaLib::CublasLt => "libcublasLt (CUDA 13 cuBLAS)",
        })
    }
}

static PRELOADED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Directories searched by [`preload_from`], in order.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["REPLAYD_CUDA_LIB_DIR", "REPLAYD_NVRTC_DIR"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda-13.0/lib64",
        "/usr/local/cuda-13/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda/targets/sbsa-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
    ] {
        dirs.push(PathBuf::from(d));
    }
    // Python wheels (nvidia-cuda-nvrtc, nvidia-cublas): <site-packages>/nvidia/cu13/lib.
    let mut roots: Vec<PathBuf> = vec![
        "/usr/local/lib".into(),
        "/usr/lib".into(),
        "/opt/conda/lib".into(),
    ];
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    for r in roots {
        if let Ok(rd) = std::fs::read_dir(&r) {
            let mut found: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
                .flat_map(|e| {
                    ["site-packages", "dist-packages"]
                        .map(|s| e.path().join(s).join("nvidia/cu13/lib"))
                })
                .collect();
            found.sort();
            dirs.extend(found);
        }
    }
    dirs
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, keeping the handle for the life of the process.
fn dlopen_global(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: plain dlopen of a shared library; the handle is deliberately never closed.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(msg);
    }
    Ok(())
}

/// Preloads `lib` from the first directory in `dirs` that holds all its files.
/// Returns the directory used.
pub fn preload_from(lib: CudaLib, dirs: &[PathBuf]) -> Option<PathBuf> {
    for dir in dirs {
        let files: Vec<PathBuf> = lib.files().iter().map(|f| dir.join(f)).collect();
        if !files.iter().all(|f| f.is_file()) {
            continue;
        }
        if files.iter().all(|f| dlopen_global(f).is_ok()) {
            if let Ok(mut p) = PRELOADED.lock() {
                p.push(dir.clone());
            }
            return Some(dir.clone());
        }
    }
    None
}

/// Makes `lib` loadable if it is not already: the loader path first, then the
/// [`search_dirs`]. Returns an error naming what was tried.
pub fn ensure(lib: CudaLib) -> Result<(), String> {
    if lib.is_present() {
        return Ok(());
    }
    let dirs = search_dirs();
    if preload_from(lib, &dirs).is_some() && lib.is_present() {
        return Ok(());
    }
    let hint = match lib {
        CudaLib::Driver => "no NVIDIA driver on this machine (libcuda.so.1 not found)".to_string(),
        _ => format!(
            "install the CUDA 13 toolkit libraries and put their directory on LD_LIBRARY_PATH \
             (e.g. /usr/local/cuda/lib64) or in REPLAYD_CUDA_LIB_DIR; never a lib64/stubs directory. \
             cudarc tried {:?}",
            cudarc::get_lib_name_candidates(lib.stem())
        ),
    };
    Err(format!(
        "{lib} cannot be loaded: {hint}; also searched {} directories",
        dirs.len()
    ))
}

/// [`ensure`] for several libraries; the error lists every missing one.
pub fn require(libs: &[CudaLib]) -> Result<(), String> {
    // Without a driver nothing else matters; say just that.
    if libs.contains(&CudaLib::Driver) {
        ensure(CudaLib::Driver)?;
    }
    let errors: Vec<String> = libs.iter().filter_map(|&l| ensure(l).err()).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Directories libraries were preloaded from in this process (for logs).
pub fn preloaded_dirs() -> Vec<PathBuf> {
    PRELOADED.lock().map(|p| p.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_from_empty_dirs_finds_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            preload_from(CudaLib::Nvrtc, &[dir.path().to_path_buf()]),
            None
        );
    }

    #[test]
    fn search_dirs_honour_environment_first() {
        // Only reads the variable; the test does not set it (tests run in parallel).
        let dirs = search_dirs();
        assert!(dirs.iter().any(|d| d == Path::new("/usr/local/cuda/lib64")));
    }
}
