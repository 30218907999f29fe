//! The CUDA C kernels in `kernels/`: run-time compilation with NVRTC for the
//! device's own architecture, an on-disk cache of the result, and the table
//! of loaded functions.
//!
//! All `kernels/*.cu` files are compiled as one translation unit (the shared
//! prelude `common.cuh` first), so a device needs one compile and one module
//! load. The compiled image is a CUBIN for `sm_XY` when NVRTC supports the
//! device's architecture (the driver loads it without JIT), otherwise PTX for
//! the newest older architecture NVRTC knows (the driver JIT-compiles it).
//!
//! The cache key is a hash of the sources, the NVRTC options, the target and
//! the NVRTC version; the file also records the key and a checksum of the
//! image, so a stale, foreign or truncated file is recompiled, never loaded.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::sys as nvrtc_sys;

/// `(name, source)` of each named file of `kernels/`, embedded at build time.
macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../kernels/", $name)))),*]
    };
}

/// The kernel sources, in compile order (embedded at build time).
pub const KERNEL_FILES: &[(&str, &str)] = kernel_files![
    "common.cuh",
    "layernorm.cu",
    "elementwise.cu",
    "attention.cu",
    "pool.cu",
    "skinny.cu",
    "attention_tc.cu",
    // Packed batches (after the files whose helpers they share).
    "embed_packed.cu",
    "pool_packed.cu",
    "attention_varlen.cu",
    // Issue 13's encoder families (after layernorm.cu, whose ln_finish
    // embed_pos.cu shares): XLM-R / MPNet position ids and the Normalize
    // after a Dense module.
    "embed_pos.cu",
    "rownorm.cu",
    // Vectorised LayerNorm / element-wise kernels (after skinny.cu and
    // attention_tc.cu, whose helpers they use).
    "vec.cu",
    // Linears of few rows with their epilogues (attention_tc.cu's mma,
    // vec.cu's vector loads).
    "gemm_small.cu",
    "stage.cu",
    "fault.cu",
];

/// Suffixes of the storage types the kernels are instantiated for.
pub const DTYPE_SUFFIXES: &[&str] = &["f32", "f16", "bf16"];

/// Head-size classes of the attention kernel (`attention_<t>_d<N>`).
pub const ATTENTION_DMAX: &[usize] = &[32, 64, 128];

/// Head sizes of the tensor-core attention kernel (`attention_tc_<t>_d<N>`, f16/bf16).
pub const ATTENTION_TC_HEAD_DIMS: &[usize] = &[32, 64, 128];

/// Head sizes of its 16-key-block variant for short padded sequences
/// (`attention_tc_s16_<t>_d<N>`, plan::ATTN_S16_MAX_SEQ).
pub const ATTENTION_TC_S16_HEAD_DIMS: &[usize] = &[32, 64];

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
    name.starts_with("attention_") && !name.contains("_tc_")
}

/// All kernel files concatenated into one translation unit, with `#line`
/// directives so compiler messages name the original file and line.
pub fn combined_source() -> String {
    let mut s = String::new();
    for (name, text) in KERNEL_FILES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        if !text.ends_with('\n') {
            s.push('\n');
        }
    }
    s
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
    vec![target.arch_flag(), "--std=c++17".to_string()]
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

/// 64-bit FNV-1a with a chosen offset basis.
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    let mut h = basis;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A 128-bit content hash as 32 hex digits (two FNV-1a passes); stable across
/// builds and Rust versions, which `DefaultHasher` is not.
pub fn content_hash(bytes: &[u8]) -> String {
    format!(
        "{:016x}{:016x}",
        fnv1a(bytes, 0xcbf2_9ce4_8422_2325),
        fnv1a(bytes, 0x6c62_272e_07bb_0142)
    )
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

    /// The cached image for `key`, if a valid one is there.
    pub fn load(&self, key: &CacheKey) -> Option<Vec<u8>> {
        let data = std::fs::read(self.path(key)).ok()?;
        // Header: 4 lines of text, then the image.
        let mut pos = 0;
        for _ in 0..4 {
            pos += data[pos..].iter().position(|&b| b == b'\n')? + 1;
        }
        let image = &data[pos..];
        let header = std::str::from_utf8(&data[..pos]).ok()?;
        if header != Self::header(key, image) {
            return None;
        }
        Some(image.to_vec())
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

/// Where a kernel image came from.
#[derive(Clone, Debug, PartialEq)]
pub enum ImageOrigin {
    Cache(PathBuf),
    Compiled {
        millis: f64,
        stored: Option<PathBuf>,
    },
}

/// The compiled kernels for one target: from the cache, or compiled (and stored).
pub fn build_image(
    target: Target,
    cache: Option<&KernelCache>,
) -> Result<(Vec<u8>, CacheKey, ImageOrigin), String> {
    let source = combined_source();
    let options = compile_options(target);
    let key = CacheKey::new(&source, &options, target, nvrtc_version()?);
    if let Some(c) = cache {
        if let Some(image) = c.load(&key) {
            let path = c.path(&key);
            return Ok((image, key, ImageOrigin::Cache(path)));
        }
    }
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
        let all = expected_entry_points();
        assert_eq!(all.len(), 133, "{all:?}");
        for name in [
            "embed_ln_packed_f32",
            "attention_varlen_tc_bf16_d128",
            "skinny_bf16_f32",
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
        assert_eq!(cache.load(&key), None);
        let image: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 256) as u8).collect();
        let path = cache.store(&key, &image).unwrap();
        assert_eq!(cache.load(&key), Some(image.clone()));
        // Another key never sees this file.
        let other = CacheKey::new("source2", &key.options, key.target, key.nvrtc);
        assert_eq!(cache.load(&other), None);
        // Truncated or corrupted files are rejected.
        let data = std::fs::read(&path).unwrap();
        std::fs::write(&path, &data[..data.len() - 1]).unwrap();
        assert_eq!(cache.load(&key), None);
        let mut bad = data.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(cache.load(&key), None);
        std::fs::write(&path, b"garbage").unwrap();
        assert_eq!(cache.load(&key), None);
        // Rewriting repairs it; no temporary files are left behind.
        cache.store(&key, &image).unwrap();
        assert_eq!(cache.load(&key), Some(image));
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
    fn hash_is_stable() {
        assert_eq!(content_hash(b""), "cbf29ce4842223256c62272e07bb0142");
        assert_ne!(content_hash(b"a"), content_hash(b"b"));
    }
}
