//! The CUDA C kernels in `kernels/` for one device ([`load_for_device`]),
//! from the first place that has them:
//!
//! 1. the cubins `build.rs` compiled into the binary when it was built with
//!    `REPLAYD_EMBED_KERNELS` (one per architecture; a cubin also runs on
//!    later minor versions of its major one): no NVRTC, no compile;
//! 2. the on-disk cache of an earlier compile (or of `replayd precompile`);
//! 3. NVRTC, at run time, for the device's own architecture, the result
//!    stored in the cache.
//!
//! All `kernels/*.cu` files are compiled as one translation unit (the shared
//! prelude `common.cuh` first; [`super::kernel_sources`]), so a device needs
//! one compile and one module load; `--split-compile` spreads its optimiser
//! over every core. The compiled image is a CUBIN for `sm_XY` when NVRTC
//! supports the device's architecture (the driver loads it without JIT),
//! otherwise PTX for the newest older architecture NVRTC knows (the driver
//! JIT-compiles it).
//!
//! The cache key is a hash of the sources, the NVRTC options, the target and
//! the NVRTC version; the file also records the key and a checksum of the
//! image, so a stale, foreign, truncated or corrupted file is refused with a
//! warning and recompiled, never loaded.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::sys as nvrtc_sys;

use super::error::DriverResultExt;
use super::kernel_sources;
pub use super::kernel_sources::{combined_source, content_hash, KERNEL_FILES};
use crate::backend::BackendError;
use crate::gpu::libs::{self, CudaLib};

/// Suffixes of the storage types the kernels are instantiated for.
pub const DTYPE_SUFFIXES: &[&str] = &["f32", "f16", "bf16"];

/// Head-size classes of the attention kernel (`attention_<t>_d<N>`).
pub const ATTENTION_DMAX: &[usize] = &[32, 64, 128];

/// Head sizes of the tensor-core attention kernel (`attention_tc_<t>_d<N>`, f16/bf16).
pub const ATTENTION_TC_HEAD_DIMS: &[usize] = &[32, 64, 128];

/// Head sizes of the tensor-core band kernels (`attention_tc_band_<t>_d<N>`,
/// `attention_varlen_tc_band_<t>_d<N>`: grouped-query heads, causal and
/// windowed masks; f16/bf16).
pub const ATTENTION_TC_BAND_HEAD_DIMS: &[usize] = &[32, 64, 128, 256];

/// Head-size classes of the CUDA-core band kernel (`attention_band_<t>_d<N>`,
/// a warp per query: decoders off the tensor cores).
pub const ATTENTION_BAND_DMAX: &[usize] = &[128, 256];

/// Head sizes of its 16-key-block variant for short padded sequences
/// (`attention_tc_s16_<t>_d<N>`, plan::ATTN_S16_MAX_SEQ).
pub const ATTENTION_TC_S16_HEAD_DIMS: &[usize] = &[32, 64];

/// Head sizes with a 128-query tensor-core attention kernel
/// (`attention_tc_q128_<t>_d<D>`: two 16-row tiles a warp).
pub const ATTENTION_TC_Q128_HEAD_DIMS: &[usize] = &[32, 64];

/// `<input>_<output>` storage-type pairs of `bias_act_<in>_<out>`.
pub const BIAS_ACT_PAIRS: &[&str] = &[
    "f32_f32",
    "f16_f16",
    "bf16_bf16",
    "f32_f16",
    "f32_bf16",
    "f16_f32",
    "bf16_f32",
];

/// `<input>_<output>` storage-type pairs of `skinny_<in>_<out>`.
pub const SKINNY_PAIRS: &[&str] = &["f32_f32", "f16_f16", "bf16_bf16", "f16_f32", "bf16_f32"];

/// The storage types of the tensor-core kernel families.
const HALF: &[&str] = &["f16", "bf16"];
/// A family without a storage type or head size in its name.
const PLAIN: &[&str] = &[""];

/// Every `extern "C"` kernel family the backend looks up, by the file that
/// holds it: the name with `{t}` for the storage type (or an `<in>_<out>`
/// pair) and `{d}` for the head size, and the types and head sizes it is
/// instantiated for.
const ENTRY_POINTS: &[(&str, &[&str], &[usize])] = &[
    // layernorm.cu, elementwise.cu, pool.cu, attention.cu, skinny.cu
    ("embed_ln_{t}", DTYPE_SUFFIXES, &[]),
    ("add_ln_{t}", DTYPE_SUFFIXES, &[]),
    ("pool_{t}", DTYPE_SUFFIXES, &[]),
    ("attention_{t}_d{d}", DTYPE_SUFFIXES, ATTENTION_DMAX),
    ("bias_act_{t}", BIAS_ACT_PAIRS, &[]),
    ("skinny_{t}", SKINNY_PAIRS, &[]),
    // attention_tc.cu
    ("attention_tc_{t}_d{d}", HALF, ATTENTION_TC_HEAD_DIMS),
    (
        "attention_tc_s16_{t}_d{d}",
        HALF,
        ATTENTION_TC_S16_HEAD_DIMS,
    ),
    (
        "attention_tc_q128_{t}_d{d}",
        HALF,
        ATTENTION_TC_Q128_HEAD_DIMS,
    ),
    // Packed batches: embed_packed.cu, pool_packed.cu, attention_varlen.cu
    ("embed_ln_packed_{t}", DTYPE_SUFFIXES, &[]),
    ("pool_packed_{t}", DTYPE_SUFFIXES, &[]),
    ("attention_varlen_{t}_d{d}", DTYPE_SUFFIXES, ATTENTION_DMAX),
    ("attention_varlen_tc_{t}_d{d}", HALF, ATTENTION_TC_HEAD_DIMS),
    // Vectorised LayerNorm and element-wise kernels (vec.cu), the Linear of
    // few rows with its epilogue (gemm_small.cu), the poolings that apply a
    // deferred LayerNorm (pool.cu, pool_packed.cu)
    ("add_ln_vec_{t}", DTYPE_SUFFIXES, &[]),
    ("embed_ln_vec_{t}", DTYPE_SUFFIXES, &[]),
    ("embed_ln_vec_inl_{t}", DTYPE_SUFFIXES, &[]),
    ("bias_act_vec_{t}", DTYPE_SUFFIXES, &[]),
    ("gemm_small_{t}", HALF, &[]),
    ("pool_ln_{t}", HALF, &[]),
    ("pool_packed_ln_{t}", HALF, &[]),
    // Pooling of long sequences over several blocks (pool_split.cu)
    ("pool_split_{t}", DTYPE_SUFFIXES, &[]),
    ("pool_split_packed_{t}", DTYPE_SUFFIXES, &[]),
    // The encoder families: XLM-R / MPNet position ids (embed_pos.cu), a
    // `Normalize` after a `Dense` module (rownorm.cu), pooling that skips a
    // prompt, and MPNet's relative attention bias in every attention kernel
    ("embed_ln_padpos_{t}", DTYPE_SUFFIXES, &[]),
    ("embed_ln_packed_padpos_{t}", DTYPE_SUFFIXES, &[]),
    ("l2norm_rows_{t}", DTYPE_SUFFIXES, &[]),
    ("pool_skip_{t}", DTYPE_SUFFIXES, &[]),
    ("pool_packed_skip_{t}", DTYPE_SUFFIXES, &[]),
    ("attention_bias_{t}_d{d}", DTYPE_SUFFIXES, ATTENTION_DMAX),
    (
        "attention_varlen_bias_{t}_d{d}",
        DTYPE_SUFFIXES,
        ATTENTION_DMAX,
    ),
    ("attention_tc_bias_{t}_d{d}", HALF, ATTENTION_TC_HEAD_DIMS),
    (
        "attention_varlen_tc_bias_{t}_d{d}",
        HALF,
        ATTENTION_TC_HEAD_DIMS,
    ),
    (
        "attention_tc_bias_s16_{t}_d{d}",
        HALF,
        ATTENTION_TC_S16_HEAD_DIMS,
    ),
    // Pre-norm encoders with rotary positions (prenorm.cu)
    ("embed_rows_{t}", DTYPE_SUFFIXES, &[]),
    ("ln_rows_{t}", DTYPE_SUFFIXES, &[]),
    ("add_rows_{t}", DTYPE_SUFFIXES, &[]),
    ("rotary_{t}", DTYPE_SUFFIXES, &[]),
    ("rotary_ntk_{t}", DTYPE_SUFFIXES, &[]),
    ("gated_{t}", DTYPE_SUFFIXES, &[]),
    ("attention_window_{t}", DTYPE_SUFFIXES, &[]),
    // Sliding windows on tensor cores (attention_tc.cu, attention_varlen.cu)
    ("attention_tc_win_{t}_d{d}", HALF, ATTENTION_TC_HEAD_DIMS),
    (
        "attention_varlen_tc_win_{t}_d{d}",
        HALF,
        ATTENTION_TC_HEAD_DIMS,
    ),
    // Decoders: grouped-query heads with causal / windowed bands on tensor
    // cores (attention_tc.cu, attention_varlen.cu) and a warp per query
    // (prenorm.cu); RMSNorm with its residual adds, the q/k norms with
    // rotary, the scaled embedding (decoder.cu)
    (
        "attention_tc_band_{t}_d{d}",
        HALF,
        ATTENTION_TC_BAND_HEAD_DIMS,
    ),
    (
        "attention_varlen_tc_band_{t}_d{d}",
        HALF,
        ATTENTION_TC_BAND_HEAD_DIMS,
    ),
    (
        "attention_band_{t}_d{d}",
        DTYPE_SUFFIXES,
        ATTENTION_BAND_DMAX,
    ),
    ("rms_norm_{t}", DTYPE_SUFFIXES, &[]),
    ("qk_norm_rope_{t}", DTYPE_SUFFIXES, &[]),
    ("embed_scaled_{t}", DTYPE_SUFFIXES, &[]),
    // stage.cu, fault.cu
    ("stage_in", PLAIN, &[]),
    ("stage_in_inl", PLAIN, &[]),
    ("stage_out", PLAIN, &[]),
    ("fault_oob_write", PLAIN, &[]),
    ("fault_spin", PLAIN, &[]),
];

/// Every `extern "C"` kernel the backend looks up.
pub fn expected_entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for (family, types, dims) in ENTRY_POINTS {
        for t in *types {
            let name = family.replace("{t}", t);
            if dims.is_empty() {
                names.push(name);
            } else {
                names.extend(dims.iter().map(|d| name.replace("{d}", &d.to_string())));
            }
        }
    }
    names
}

/// Kernels launched with dynamic shared memory beyond the default 48 KiB
/// (the CUDA-core attention, `attention_<t>_d<N>` and
/// `attention_varlen_<t>_d<N>`, whose key chunks are sized by the
/// sequence), whose limit is raised at load. The tensor-core attention
/// kernels use static shared memory.
pub fn needs_dynamic_smem(name: &str) -> bool {
    // `attention_window_<t>` and `attention_band_<t>_d<N>` (prenorm.cu) keep
    // their state in registers.
    name.starts_with("attention_")
        && !name.contains("_tc_")
        && !name.starts_with("attention_window_")
        && !name.starts_with("attention_band_")
}

/// What NVRTC produces for a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for `sm_<N>` (loaded without JIT).
    Cubin(u32),
    /// PTX for `compute_<N>` (the driver JIT-compiles it).
    Ptx(u32),
}

impl Target {
    pub fn arch_flag(self) -> String {
        match self {
            Target::Cubin(a) => format!("-arch=sm_{a}"),
            Target::Ptx(a) => format!("-arch=compute_{a}"),
        }
    }

    fn file_tag(self) -> String {
        match self {
            Target::Cubin(a) => format!("sm_{a}.cubin"),
            Target::Ptx(a) => format!("compute_{a}.ptx"),
        }
    }
}

/// Picks the compile target for a device of compute capability `cc` given the
/// architectures NVRTC supports: the device's own as CUBIN when supported,
/// else PTX for the newest older one.
pub fn choose_target(cc: (u32, u32), supported: &[i32]) -> Result<Target, String> {
    let arch = cc.0 * 10 + cc.1;
    if supported.iter().any(|&a| a as u32 == arch) {
        return Ok(Target::Cubin(arch));
    }
    supported
        .iter()
        .filter(|&&a| a > 0 && (a as u32) < arch)
        .max()
        .map(|&a| Target::Ptx(a as u32))
        .ok_or_else(|| {
            format!(
                "NVRTC supports none of the architectures up to sm_{arch} (it supports {supported:?})"
            )
        })
}

/// The NVRTC options for a target (part of the cache key).
pub fn compile_options(target: Target) -> Vec<String> {
    kernel_sources::nvrtc_options(&target.arch_flag())
}

/// NVRTC's (major, minor) version. NVRTC must be loadable (see `libs`).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion: {r:?}"));
    }
    Ok((major, minor))
}

/// The architectures NVRTC can compile for (e.g. `[75, 80, …, 90, 100, …]`).
pub fn supported_archs() -> Result<Vec<i32>, String> {
    let mut n: c_int = 0;
    // SAFETY: out-parameters sized by the first call.
    unsafe {
        let r = nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n);
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcGetNumSupportedArchs: {r:?}"));
        }
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        if n > 0 {
            let r = nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr());
            if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                return Err(format!("nvrtcGetSupportedArchs: {r:?}"));
            }
        }
        Ok(archs)
    }
}

/// An NVRTC program that is destroyed on drop without ever panicking
/// (cudarc's own wrapper unwraps in `Drop`).
struct NvrtcProgram(nvrtc_sys::nvrtcProgram);

impl Drop for NvrtcProgram {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: created by nvrtcCreateProgram, destroyed once; errors ignored.
            let _ = unsafe { nvrtc_sys::nvrtcDestroyProgram(&mut self.0) };
        }
    }
}

fn nvrtc_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: sized by the first call; NUL-terminated by NVRTC.
    unsafe {
        if nvrtc_sys::nvrtcGetProgramLogSize(prog, &mut size)
            != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
            || size == 0
        {
            return String::new();
        }
        let mut buf = vec![0 as c_char; size];
        if nvrtc_sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr())
            != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    }
}

/// Compiles `source` with `options`. Returns the CUBIN (for `-arch=sm_XY`) or
/// the NUL-terminated PTX (for `-arch=compute_XY`), and the compiler log.
pub fn compile(
    source: &str,
    options: &[String],
    target: Target,
) -> Result<(Vec<u8>, String), String> {
    let src = CString::new(source).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let name = CString::new("replayd_kernels.cu").expect("static name");
    let mut prog = NvrtcProgram(std::ptr::null_mut());
    // SAFETY: all pointers are valid for the duration of the calls.
    unsafe {
        let r = nvrtc_sys::nvrtcCreateProgram(
            &mut prog.0,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcCreateProgram: {r:?}"));
        }
        let c_opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| format!("option {o:?} contains NUL")))
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
        let r = nvrtc_sys::nvrtcCompileProgram(prog.0, ptrs.len() as c_int, ptrs.as_ptr());
        let log = nvrtc_log(prog.0);
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!(
                "NVRTC compile failed ({r:?}) with options {options:?}:\n{log}"
            ));
        }
        // The image NVRTC made: machine code or PTX, fetched alike.
        let mut size = 0usize;
        let (r, what) = match target {
            Target::Cubin(_) => (nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size), "CUBIN"),
            Target::Ptx(_) => (nvrtc_sys::nvrtcGetPTXSize(prog.0, &mut size), "PTX"),
        };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(format!("nvrtcGet{what}Size: {r:?}"));
        }
        let mut image = vec![0u8; size];
        let dst = image.as_mut_ptr() as *mut c_char;
        let r = match target {
            Target::Cubin(_) => nvrtc_sys::nvrtcGetCUBIN(prog.0, dst),
            Target::Ptx(_) => nvrtc_sys::nvrtcGetPTX(prog.0, dst),
        };
        if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcGet{what}: {r:?}"));
        }
        Ok((image, log))
    }
}

/// The `.entry` names declared in PTX text.
pub fn ptx_entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let rest = l
                .strip_prefix(".visible .entry ")
                .or_else(|| l.strip_prefix(".entry "))?;
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Whether `image` (a CUBIN) has a symbol called `name` (looks for the
/// NUL-delimited name in its string tables).
pub fn cubin_has_symbol(image: &[u8], name: &str) -> bool {
    let mut needle = Vec::with_capacity(name.len() + 2);
    needle.push(0u8);
    needle.extend_from_slice(name.as_bytes());
    needle.push(0u8);
    image.windows(needle.len()).any(|w| w == needle.as_slice())
}

/// What identifies one compiled image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    pub target: Target,
    pub nvrtc: (i32, i32),
    pub options: Vec<String>,
    /// [`content_hash`] of the source.
    pub source_hash: String,
}

impl CacheKey {
    pub fn new(source: &str, options: &[String], target: Target, nvrtc: (i32, i32)) -> Self {
        CacheKey {
            target,
            nvrtc,
            options: options.to_vec(),
            source_hash: content_hash(source.as_bytes()),
        }
    }

    /// One line that names every part of the key.
    pub fn describe(&self) -> String {
        format!(
            "target={:?} nvrtc={}.{} options={} source={}",
            self.target,
            self.nvrtc.0,
            self.nvrtc.1,
            self.options.join(" "),
            self.source_hash
        )
    }

    /// Hash of the whole key (file names use it).
    pub fn digest(&self) -> String {
        content_hash(self.describe().as_bytes())
    }

    pub fn file_name(&self) -> String {
        format!(
            "replayd-kernels-{}-nvrtc{}.{}-{}",
            &self.digest()[..16],
            self.nvrtc.0,
            self.nvrtc.1,
            self.target.file_tag()
        )
    }
}

const CACHE_MAGIC: &str = "REPLAYD-KERNEL-CACHE 1";

/// The default kernel cache directory: `$CACHE_DIRECTORY/kernels` (systemd's
/// `CacheDirectory=`), else `$XDG_CACHE_HOME/replayd/kernels`, else
/// `$HOME/.cache/replayd/kernels`, else `/var/cache/replayd/kernels`.
pub fn default_cache_dir() -> PathBuf {
    let env_dir = |k: &str| {
        std::env::var_os(k)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(d) = env_dir("CACHE_DIRECTORY") {
        // systemd may pass several, colon-separated; take the first.
        let first = d
            .to_string_lossy()
            .split(':')
            .next()
            .map(PathBuf::from)
            .unwrap_or(d);
        return first.join("kernels");
    }
    if let Some(d) = env_dir("XDG_CACHE_HOME") {
        return d.join("replayd/kernels");
    }
    if let Some(h) = env_dir("HOME") {
        return h.join(".cache/replayd/kernels");
    }
    PathBuf::from("/var/cache/replayd/kernels")
}

fn usable_dir(dir: &Path) -> bool {
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"ok").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// The directory the cache will use: the configured one if it is usable,
/// otherwise the first usable of [`default_cache_dir`], `/var/cache/replayd/kernels`
/// and `<temp dir>/replayd-kernels`. `None` when nothing is writable (no cache).
pub fn resolve_cache_dir(configured: Option<&Path>) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(c) = configured {
        candidates.push(c.to_path_buf());
    }
    candidates.push(default_cache_dir());
    candidates.push(PathBuf::from("/var/cache/replayd/kernels"));
    candidates.push(std::env::temp_dir().join("replayd-kernels"));
    candidates.into_iter().find(|d| usable_dir(d))
}

/// Compiled kernel images on disk.
#[derive(Clone, Debug)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    fn header(key: &CacheKey, image: &[u8]) -> String {
        format!(
            "{CACHE_MAGIC}\nkey {}\nlen {}\nsum {}\n",
            key.describe(),
            image.len(),
            content_hash(image)
        )
    }

    /// The cached image for `key`: `Ok(None)` when there is none, `Err`
    /// (what is wrong) when the file is there but truncated, corrupted or
    /// another key's: the caller compiles and overwrites it.
    pub fn load(&self, key: &CacheKey) -> Result<Option<Vec<u8>>, String> {
        let data = match std::fs::read(self.path(key)) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("unreadable: {e}")),
        };
        // Header: 4 lines of text, then the image.
        let mut pos = 0;
        for _ in 0..4 {
            pos += data[pos..]
                .iter()
                .position(|&b| b == b'\n')
                .ok_or("not a kernel cache file (no header)")?
                + 1;
        }
        let image = &data[pos..];
        let header = std::str::from_utf8(&data[..pos]).map_err(|_| "a header that is not text")?;
        let want = Self::header(key, image);
        if header == want {
            return Ok(Some(image.to_vec()));
        }
        let key_line = |h: &str| h.lines().nth(1).map(str::to_string);
        Err(if !header.starts_with(CACHE_MAGIC) {
            "not a kernel cache file".to_string()
        } else if key_line(header) != key_line(&want) {
            "another key's image".to_string()
        } else {
            format!(
                "truncated or corrupted ({} bytes of image, checksum {})",
                image.len(),
                content_hash(image)
            )
        })
    }

    /// Writes the image atomically (temporary file + rename in the same directory).
    pub fn store(&self, key: &CacheKey, image: &[u8]) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(key);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{nanos}-{}",
            std::process::id(),
            key.file_name()
        ));
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(Self::header(key, image).as_bytes())?;
            f.write_all(image)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map(|_| path)
    }
}

/// The cubins `build.rs` compiled into this binary (`REPLAYD_EMBED_KERNELS`).
mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded_kernels.rs"));
}

/// The architectures this binary carries cubins for (empty: it compiles its
/// kernels at run time), and the NVRTC that compiled them.
pub fn embedded_archs() -> (Vec<u32>, (i32, i32)) {
    (
        embedded::IMAGES.iter().map(|(a, _, _)| *a).collect(),
        embedded::NVRTC,
    )
}

/// Which of `archs` runs on a device of compute capability `cc`: its own
/// architecture, else the newest one of the same major version below it (a
/// cubin runs on later minor versions of its major one; an sm_90 cubin does
/// not run on sm_100).
pub fn pick_embedded(cc: (u32, u32), archs: &[u32]) -> Option<u32> {
    let own = cc.0 * 10 + cc.1;
    archs
        .iter()
        .copied()
        .filter(|&a| a / 10 == cc.0 && a <= own)
        .max()
}

/// The embedded cubin for a device of compute capability `cc`, inflated:
/// `(architecture, cubin)`. `None` when the binary carries none for it.
pub fn embedded_image(cc: (u32, u32)) -> Option<Result<(u32, Vec<u8>), String>> {
    let (archs, _) = embedded_archs();
    let arch = pick_embedded(cc, &archs)?;
    // build.rs compiled the same files this binary holds; say so if not.
    if embedded::SOURCE_HASH != content_hash(combined_source().as_bytes()) {
        return Some(Err(
            "the embedded cubins were built from other kernel sources than this binary's".into(),
        ));
    }
    let (_, deflated, len) = embedded::IMAGES.iter().find(|(a, _, _)| *a == arch)?;
    let mut cubin = Vec::with_capacity(*len);
    let inflated = std::io::Read::read_to_end(
        &mut flate2::read::DeflateDecoder::new(&deflated[..]),
        &mut cubin,
    );
    Some(match inflated {
        Ok(n) if n == *len => Ok((arch, cubin)),
        Ok(n) => Err(format!(
            "the embedded sm_{arch} cubin inflates to {n} bytes, not {len}"
        )),
        Err(e) => Err(format!(
            "the embedded sm_{arch} cubin does not inflate: {e}"
        )),
    })
}

/// Where a kernel image came from.
#[derive(Clone, Debug, PartialEq)]
pub enum ImageOrigin {
    /// Compiled into the binary at build time, for this architecture.
    Embedded(u32),
    Cache(PathBuf),
    Compiled {
        millis: f64,
        stored: Option<PathBuf>,
    },
}

/// The compiled kernels for one target: from the cache, or compiled (and
/// stored). `log` gets a line before a compile, which takes a while.
pub fn build_image(
    target: Target,
    cache: Option<&KernelCache>,
    log: impl Fn(&str),
) -> Result<(Vec<u8>, CacheKey, ImageOrigin), String> {
    let source = combined_source();
    let options = compile_options(target);
    let key = CacheKey::new(&source, &options, target, nvrtc_version()?);
    if let Some(c) = cache {
        let path = c.path(&key);
        match c.load(&key) {
            Ok(Some(image)) => return Ok((image, key, ImageOrigin::Cache(path))),
            Ok(None) => {}
            Err(why) => tracing::warn!(
                target: "replayd::cuda",
                "kernel cache file {} is {why}: compiling the kernels again and replacing it",
                path.display()
            ),
        }
    }
    log(&format!(
        "compiling the kernels for {target:?} with NVRTC {}.{} (no cubin for this GPU in the \
         binary{}); this takes about a minute on a few cores",
        key.nvrtc.0,
        key.nvrtc.1,
        cache
            .map(|c| format!(", none cached in {}", c.dir().display()))
            .unwrap_or_default()
    ));
    let t = Instant::now();
    let (image, log) = compile(&source, &options, target)?;
    let millis = t.elapsed().as_secs_f64() * 1e3;
    if !log.trim().is_empty() {
        tracing::debug!(target: "replayd::cuda", "NVRTC log: {log}");
    }
    let stored = cache.and_then(|c| match c.store(&key, &image) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::warn!(
                target: "replayd::cuda",
                "cannot write the kernel cache in {}: {e} (kernels will be recompiled next start)",
                c.dir().display()
            );
            None
        }
    });
    Ok((image, key, ImageOrigin::Compiled { millis, stored }))
}

/// The kernels for a device of compute capability `cc`, from the first
/// place that has them: the cubin embedded in this binary, the cache in
/// `cache_dir` (else the default one), or NVRTC (whose result is cached).
/// Logs, prefixed by `who`, a line before a compile and one saying where
/// the kernels came from and how long they took; `on_compile` hears of a
/// compile before it starts (the worker tells the daemon, whose status line
/// says so).
pub fn load_for_device(
    ctx: &Arc<CudaContext>,
    cc: (u32, u32),
    cache_dir: Option<&Path>,
    who: &str,
    on_compile: &dyn Fn(Target),
) -> Result<Kernels, BackendError> {
    let log = |line: &str| tracing::info!(target: "replayd::cuda", "{who}: {line}");
    let t0 = Instant::now();
    let embedded = match embedded_image(cc) {
        Some(Ok((arch, cubin))) => {
            match Kernels::load(ctx, cubin, Target::Cubin(arch), ImageOrigin::Embedded(arch)) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(
                        target: "replayd::cuda",
                        "the embedded sm_{arch} kernels did not load ({e}): compiling them with NVRTC"
                    );
                    None
                }
            }
        }
        Some(Err(e)) => {
            tracing::warn!(target: "replayd::cuda", "{e}: compiling the kernels with NVRTC");
            None
        }
        None => None,
    };
    if let Some(k) = embedded {
        let (_, nvrtc) = embedded_archs();
        log(&format!(
            "kernels embedded for {:?} (NVRTC {}.{} at build time), loaded in {:.1} ms",
            k.target,
            nvrtc.0,
            nvrtc.1,
            t0.elapsed().as_secs_f64() * 1e3
        ));
        return Ok(k);
    }
    libs::ensure(CudaLib::Nvrtc).map_err(|e| {
        BackendError::Unsupported(format!(
            "{e} (this binary has no kernels for sm_{}{} built in, so it compiles them; \
             binaries built with REPLAYD_EMBED_KERNELS need no NVRTC)",
            cc.0, cc.1
        ))
    })?;
    let archs = supported_archs().map_err(BackendError::Other)?;
    let target = choose_target(cc, &archs).map_err(BackendError::Unsupported)?;
    let cache = resolve_cache_dir(cache_dir).map(KernelCache::new);
    let (image, key, origin) = build_image(target, cache.as_ref(), |line| {
        log(line);
        on_compile(target);
    })
    .map_err(BackendError::Other)?;
    let kernels = Kernels::load(ctx, image, target, origin.clone()).cu("load kernel module")?;
    log(&format!(
        "kernels {} in {:.1} ms ({})",
        match &origin {
            ImageOrigin::Cache(p) => format!("loaded from {}", p.display()),
            ImageOrigin::Compiled { millis, stored } => format!(
                "compiled by NVRTC in {millis:.0} ms{}",
                stored
                    .as_ref()
                    .map(|p| format!(", cached at {}", p.display()))
                    .unwrap_or_default()
            ),
            ImageOrigin::Embedded(arch) => format!("embedded for sm_{arch}"),
        },
        t0.elapsed().as_secs_f64() * 1e3,
        key.describe()
    ));
    let nvrtc = key.nvrtc;
    let mut drv: i32 = 0;
    // SAFETY: out-parameter.
    if unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) }
        .result()
        .is_ok()
        && nvrtc.0 * 1000 + nvrtc.1 * 10 > drv
    {
        tracing::warn!(
            target: "replayd::cuda",
            "NVRTC {}.{} is newer than the driver's CUDA {}.{}: modules may fail to load",
            nvrtc.0,
            nvrtc.1,
            drv / 1000,
            (drv % 1000) / 10
        );
    }
    Ok(kernels)
}

/// The loaded module and its functions.
pub struct Kernels {
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
    pub target: Target,
    pub origin: ImageOrigin,
}

impl Kernels {
    /// Loads `image` into `ctx` and looks up every expected kernel.
    pub fn load(
        ctx: &Arc<CudaContext>,
        image: Vec<u8>,
        target: Target,
        origin: ImageOrigin,
    ) -> Result<Kernels, cudarc::driver::DriverError> {
        let ptx = match target {
            Target::Cubin(_) => cudarc::nvrtc::Ptx::from_binary(image),
            // PTX images are NUL-terminated text; loading as binary passes the
            // bytes to cuModuleLoadData unchanged.
            Target::Ptx(_) => cudarc::nvrtc::Ptx::from_binary(image),
        };
        let module = ctx.load_module(ptx)?;
        let mut functions = HashMap::new();
        for name in expected_entry_points() {
            let f = module.load_function(&name)?;
            functions.insert(name, f);
        }
        Ok(Kernels {
            _module: module,
            functions,
            target,
            origin,
        })
    }

    pub fn get(&self, name: &str) -> Option<&CudaFunction> {
        self.functions.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &CudaFunction)> {
        self.functions.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_is_compiled() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu") || n.ends_with(".cuh"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNEL_FILES.iter().map(|(n, _)| n.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "kernels/ and KERNEL_FILES differ");
        let src = combined_source();
        assert!(src.starts_with("#line 1 \"common.cuh\""));
        for name in expected_entry_points() {
            // Every name is produced by a macro instantiation or written out.
            let stem = name.split('_').next().unwrap();
            assert!(src.contains(stem), "{name}");
        }
    }

    #[test]
    fn dynamic_shared_memory_kernels() {
        let dynamic: Vec<String> = expected_entry_points()
            .into_iter()
            .filter(|n| needs_dynamic_smem(n))
            .collect();
        // The padded and the varlen CUDA-core attention, each with and
        // without MPNet's bias.
        assert_eq!(
            dynamic.len(),
            2 * 2 * DTYPE_SUFFIXES.len() * ATTENTION_DMAX.len(),
            "{dynamic:?}"
        );
        assert!(dynamic.iter().all(|n| !n.contains("_tc_")));
        assert!(!needs_dynamic_smem("add_ln_vec_f16") && !needs_dynamic_smem("gemm_small_f16"));
        assert!(
            needs_dynamic_smem("attention_f16_d32") && !needs_dynamic_smem("attention_tc_f16_d32")
        );
        assert!(
            needs_dynamic_smem("attention_varlen_f32_d64")
                && !needs_dynamic_smem("attention_varlen_tc_bf16_d64")
        );
        assert!(!needs_dynamic_smem("attention_window_f16"));
        assert!(!needs_dynamic_smem("attention_band_f32_d256"));
        assert!(!needs_dynamic_smem("attention_tc_band_f16_d256"));
        let all = expected_entry_points();
        // 133, prenorm.cu's seven families in three types (rotary_ntk last),
        // the windowed tensor-core attention (padded and varlen, two types,
        // three head sizes), and the decoders' kernels: the tensor-core band
        // attention (padded and varlen, two types, four head sizes), the
        // CUDA-core band attention (three types, two head-size classes) and
        // decoder.cu's three families in three types; then issue 32's split
        // pooling (padded and packed, three types) and the 128-query
        // tensor-core attention (two types, head dims 32 and 64).
        assert_eq!(all.len(), 133 + 18 + 12 + 3 + 16 + 6 + 9 + 6 + 4, "{all:?}");
        for name in [
            "embed_ln_packed_f32",
            "attention_varlen_tc_bf16_d128",
            "skinny_bf16_f32",
            "attention_tc_band_bf16_d256",
            "attention_varlen_tc_band_f16_d128",
            "attention_band_f32_d256",
            "rms_norm_bf16",
            "qk_norm_rope_f16",
            "embed_scaled_f32",
        ] {
            assert!(all.iter().any(|n| n == name), "{name}");
        }
    }

    #[test]
    fn target_choice() {
        let archs = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(choose_target((9, 0), &archs), Ok(Target::Cubin(90)));
        assert_eq!(choose_target((8, 9), &archs), Ok(Target::Cubin(89)));
        // A device newer than NVRTC knows: PTX for the newest older arch.
        assert_eq!(choose_target((13, 0), &archs), Ok(Target::Ptx(121)));
        assert_eq!(choose_target((9, 5), &archs), Ok(Target::Ptx(90)));
        assert!(choose_target((7, 0), &archs).is_err());
        assert_eq!(Target::Cubin(90).arch_flag(), "-arch=sm_90");
        assert_eq!(Target::Ptx(90).arch_flag(), "-arch=compute_90");
    }

    #[test]
    fn cache_key_changes_with_every_part() {
        let opts = compile_options(Target::Cubin(90));
        let base = CacheKey::new("src", &opts, Target::Cubin(90), (13, 0));
        let variants = [
            CacheKey::new("src2", &opts, Target::Cubin(90), (13, 0)),
            CacheKey::new("src", &opts, Target::Cubin(80), (13, 0)),
            CacheKey::new("src", &opts, Target::Ptx(90), (13, 0)),
            CacheKey::new("src", &opts, Target::Cubin(90), (13, 1)),
            CacheKey::new(
                "src",
                &["-arch=sm_90".to_string()],
                Target::Cubin(90),
                (13, 0),
            ),
        ];
        for v in &variants {
            assert_ne!(base.digest(), v.digest(), "{v:?}");
            assert_ne!(base.file_name(), v.file_name(), "{v:?}");
        }
        assert_eq!(
            base.digest(),
            CacheKey::new("src", &opts, Target::Cubin(90), (13, 0)).digest()
        );
        assert!(
            base.file_name().ends_with("nvrtc13.0-sm_90.cubin"),
            "{}",
            base.file_name()
        );
    }

    #[test]
    fn cache_round_trip_and_rejection() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path().join("k"));
        let key = CacheKey::new(
            "source",
            &compile_options(Target::Cubin(90)),
            Target::Cubin(90),
            (13, 0),
        );
        assert_eq!(cache.load(&key), Ok(None));
        let image: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 256) as u8).collect();
        let path = cache.store(&key, &image).unwrap();
        assert_eq!(cache.load(&key), Ok(Some(image.clone())));
        // Another key never sees this file.
        let other = CacheKey::new("source2", &key.options, key.target, key.nvrtc);
        assert_eq!(cache.load(&other), Ok(None));
        // Truncated, corrupted or foreign files are refused, saying why.
        let data = std::fs::read(&path).unwrap();
        let refused = |bytes: &[u8]| {
            std::fs::write(&path, bytes).unwrap();
            cache.load(&key).unwrap_err()
        };
        assert!(refused(&data[..data.len() - 1]).contains("truncated or corrupted"));
        let mut bad = data.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        assert!(refused(&bad).contains("truncated or corrupted"));
        assert!(refused(b"garbage").contains("no header"));
        assert!(refused(b"a\nb\nc\nd\nimage").contains("not a kernel cache file"));
        cache.store(&other, &image).unwrap();
        let foreign = std::fs::read(cache.path(&other)).unwrap();
        assert!(refused(&foreign).contains("another key"));
        std::fs::remove_file(cache.path(&other)).unwrap();
        // Rewriting repairs it; no temporary files are left behind.
        cache.store(&key, &image).unwrap();
        assert_eq!(cache.load(&key), Ok(Some(image)));
        let names: Vec<String> = std::fs::read_dir(cache.dir())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn cache_dir_resolution() {
        let dir = tempfile::tempdir().unwrap();
        let want = dir.path().join("a/b");
        assert_eq!(resolve_cache_dir(Some(&want)), Some(want.clone()));
        assert!(want.is_dir());
        // An unusable configured directory falls back to a default one.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let got = resolve_cache_dir(Some(&file.join("sub"))).unwrap();
        assert_ne!(got, file.join("sub"));
        assert!(default_cache_dir().is_absolute());
    }

    #[test]
    fn ptx_and_cubin_symbol_scans() {
        let ptx = ".version 9.0\n.target sm_90\n.visible .entry add_ln_f16(\n\t.param .u64 a\n)\n.entry fault_oob_write(\n";
        assert_eq!(ptx_entry_points(ptx), vec!["add_ln_f16", "fault_oob_write"]);
        let cubin = b"\x7fELF....\0pool_f32\0attention_f16_d32\0";
        assert!(cubin_has_symbol(cubin, "pool_f32"));
        assert!(cubin_has_symbol(cubin, "attention_f16_d32"));
        assert!(!cubin_has_symbol(cubin, "pool_f3"));
    }

    #[test]
    fn an_embedded_cubin_is_picked_for_its_architecture_and_later_minor_ones() {
        let archs = [80, 86, 89, 90, 100, 120];
        assert_eq!(pick_embedded((9, 0), &archs), Some(90));
        assert_eq!(pick_embedded((8, 0), &archs), Some(80));
        assert_eq!(pick_embedded((8, 7), &archs), Some(86));
        assert_eq!(pick_embedded((8, 9), &archs), Some(89));
        assert_eq!(pick_embedded((12, 1), &archs), Some(120));
        // No cubin of the same major version at or below: compile instead.
        assert_eq!(pick_embedded((10, 3), &[90, 120]), None);
        assert_eq!(pick_embedded((7, 5), &archs), None);
        assert_eq!(pick_embedded((9, 0), &[]), None);
    }

    #[test]
    fn architecture_lists_parse() {
        use super::kernel_sources::{parse_archs, DEFAULT_EMBED_ARCHS};
        assert_eq!(parse_archs(""), Ok(vec![]));
        assert_eq!(parse_archs("90"), Ok(vec![90]));
        assert_eq!(parse_archs("sm_90, 80 86,80"), Ok(vec![80, 86, 90]));
        assert_eq!(parse_archs("default"), Ok(DEFAULT_EMBED_ARCHS.to_vec()));
        assert!(parse_archs("default,121").unwrap().contains(&121));
        for bad in ["ninety", "sm_", "9", "compute_90"] {
            assert!(parse_archs(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_embedded_cubins_match_this_binarys_kernels() {
        // Without REPLAYD_EMBED_KERNELS there are none; with it, each one
        // inflates to its recorded size and was built from these sources.
        let (archs, nvrtc) = embedded_archs();
        assert_eq!(
            embedded::SOURCE_HASH,
            content_hash(combined_source().as_bytes())
        );
        assert_eq!(archs.is_empty(), nvrtc == (0, 0));
        for arch in archs {
            let (got, cubin) = embedded_image((arch / 10, arch % 10)).unwrap().unwrap();
            assert_eq!(got, arch);
            assert!(cubin.starts_with(b"\x7fELF"), "sm_{arch}");
            assert!(
                cubin_has_symbol(&cubin, "attention_tc_f16_d64"),
                "sm_{arch}"
            );
        }
    }

    #[test]
    fn hash_is_stable() {
        assert_eq!(content_hash(b""), "cbf29ce4842223256c62272e07bb0142");
        assert_ne!(content_hash(b"a"), content_hash(b"b"));
    }
}
