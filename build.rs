//! Embeds the CUDA kernels as cubins, compiled here at build time, when
//! `REPLAYD_EMBED_KERNELS` names GPU architectures (`default`, or a list
//! such as `80,86,89,90`): a GPU of one of them then starts without NVRTC
//! and without compiling (about a minute on a fresh host otherwise). Unset
//! or empty, nothing is compiled here and the kernels are compiled at run
//! time (`src/backend/cuda/kernels.rs`), as a CPU-only build needs.
//!
//! The compiler is NVRTC, the one the daemon uses at run time, on the same
//! source with the same options (`src/backend/cuda/kernel_sources.rs`,
//! included below): from `REPLAYD_NVRTC_DIR`, the wheel that
//! `scripts/dev/install-nvrtc.sh` puts into `.nvrtc/`, `$CUDA_PATH/lib64`,
//! `/usr/local/cuda/lib64`, or the loader's path. The architectures
//! compile in parallel; each cubin is stored deflated.
//!
//! Writes `$OUT_DIR/embedded_kernels.rs` either way; prints a
//! `cargo:warning` line saying what it embedded.

use std::ffi::{c_char, c_int, c_void, CString};
use std::io::Write;
use std::path::{Path, PathBuf};

#[allow(dead_code)]
#[path = "src/backend/cuda/kernel_sources.rs"]
mod kernel_sources;

fn main() {
    println!("cargo:rerun-if-env-changed=REPLAYD_EMBED_KERNELS");
    println!("cargo:rerun-if-env-changed=REPLAYD_NVRTC_DIR");
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=src/backend/cuda/kernel_sources.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let requested = std::env::var("REPLAYD_EMBED_KERNELS").unwrap_or_default();
    let archs = match kernel_sources::parse_archs(&requested) {
        Ok(a) => a,
        Err(e) => fail(&format!("REPLAYD_EMBED_KERNELS: {e}")),
    };
    let source = kernel_sources::combined_source();
    let mut images = Vec::new();
    let mut nvrtc_version = (0, 0);
    if !archs.is_empty() {
        let nvrtc = Nvrtc::load().unwrap_or_else(|e| fail(&e));
        nvrtc_version = nvrtc.version().unwrap_or_else(|e| fail(&e));
        let start = std::time::Instant::now();
        let results: Vec<Result<Vec<u8>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = archs
                .iter()
                .map(|&arch| {
                    let (nvrtc, source) = (&nvrtc, &source);
                    s.spawn(move || nvrtc.cubin(source, arch))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (&arch, cubin) in archs.iter().zip(results) {
            let cubin = cubin.unwrap_or_else(|e| fail(&format!("sm_{arch}: {e}")));
            let file = format!("kernels_sm_{arch}.cubin.deflate");
            let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
            z.write_all(&cubin).unwrap();
            let packed = z.finish().unwrap();
            std::fs::write(out.join(&file), &packed).unwrap();
            images.push((arch, file, cubin.len(), packed.len()));
        }
        println!(
            "cargo:warning=embedded CUDA kernels for {} (NVRTC {}.{}, {:.0} s, {:.1} MB deflated)",
            archs
                .iter()
                .map(|a| format!("sm_{a}"))
                .collect::<Vec<_>>()
                .join(", "),
            nvrtc_version.0,
            nvrtc_version.1,
            start.elapsed().as_secs_f64(),
            images.iter().map(|i| i.3).sum::<usize>() as f64 / 1e6
        );
    }
    let mut rs = String::from(
        "// Written by build.rs: the cubins embedded at build time.\n\
         /// (architecture, deflated cubin, cubin bytes).\n\
         pub const IMAGES: &[(u32, &[u8], usize)] = &[\n",
    );
    for (arch, file, len, _) in &images {
        rs.push_str(&format!(
            "    ({arch}, include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}\")), {len}),\n"
        ));
    }
    rs.push_str("];\n");
    rs.push_str(&format!(
        "/// The NVRTC that compiled them ((0, 0): none embedded).\n\
         pub const NVRTC: (i32, i32) = ({}, {});\n\
         /// What they were compiled from: `content_hash` of the combined source.\n\
         pub const SOURCE_HASH: &str = \"{}\";\n",
        nvrtc_version.0,
        nvrtc_version.1,
        kernel_sources::content_hash(source.as_bytes())
    ));
    std::fs::write(out.join("embedded_kernels.rs"), rs).unwrap();
}

fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1);
}

type NvrtcResult = c_int;
type Program = *mut c_void;

/// The few NVRTC functions a compile needs, loaded with `dlopen`.
struct Nvrtc {
    _builtins: libloading::os::unix::Library,
    lib: libloading::os::unix::Library,
}

// SAFETY: NVRTC's API is thread-safe for distinct programs; the handles are
// only read after loading.
unsafe impl Sync for Nvrtc {}

impl Nvrtc {
    fn load() -> Result<Nvrtc, String> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        if let Some(d) = std::env::var_os("REPLAYD_NVRTC_DIR") {
            dirs.extend(std::env::split_paths(&d));
        }
        let repo = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
        dirs.push(repo.join(".nvrtc/nvidia/cu13/lib"));
        if let Some(d) = std::env::var_os("CUDA_PATH") {
            dirs.push(Path::new(&d).join("lib64"));
        }
        dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
        let open = |path: &Path| {
            // SAFETY: loading NVRTC runs no code of ours; RTLD_GLOBAL so that
            // libnvrtc finds its builtins by name.
            unsafe {
                libloading::os::unix::Library::open(
                    Some(path),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            }
        };
        let mut tried = Vec::new();
        for dir in dirs.iter().map(PathBuf::as_path).chain([Path::new("")]) {
            let builtins = dir.join("libnvrtc-builtins.so.13.0");
            let lib = dir.join("libnvrtc.so.13");
            match (open(&builtins), open(&lib)) {
                (Ok(b), Ok(l)) => {
                    println!("cargo:rerun-if-changed={}", lib.display());
                    return Ok(Nvrtc {
                        _builtins: b,
                        lib: l,
                    });
                }
                (b, l) => tried.push(format!(
                    "{}: {}",
                    if dir.as_os_str().is_empty() {
                        "the loader's path".to_string()
                    } else {
                        dir.display().to_string()
                    },
                    b.err()
                        .or(l.err())
                        .map(|e| e.to_string())
                        .unwrap_or_default()
                )),
            }
        }
        Err(format!(
            "REPLAYD_EMBED_KERNELS is set but NVRTC 13 (libnvrtc.so.13 and \
             libnvrtc-builtins.so.13.0) was not found; run scripts/dev/install-nvrtc.sh \
             or set REPLAYD_NVRTC_DIR (tried {})",
            tried.join("; ")
        ))
    }

    /// A symbol of libnvrtc.
    fn f<T: Copy>(&self, name: &str) -> Result<T, String> {
        // SAFETY: the caller names the symbol's real C type.
        unsafe { self.lib.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{name}: {e}"))
    }

    fn version(&self) -> Result<(i32, i32), String> {
        let f: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult =
            self.f("nvrtcVersion")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two out-parameters.
        match unsafe { f(&mut major, &mut minor) } {
            0 => Ok((major, minor)),
            r => Err(format!("nvrtcVersion: error {r}")),
        }
    }

    /// `source` compiled to a cubin for `sm_<arch>`.
    fn cubin(&self, source: &str, arch: u32) -> Result<Vec<u8>, String> {
        type Create = unsafe extern "C" fn(
            *mut Program,
            *const c_char,
            *const c_char,
            c_int,
            *const *const c_char,
            *const *const c_char,
        ) -> NvrtcResult;
        type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult;
        type Size = unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult;
        type Get = unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult;
        type Destroy = unsafe extern "C" fn(*mut Program) -> NvrtcResult;
        let create: Create = self.f("nvrtcCreateProgram")?;
        let compile: Compile = self.f("nvrtcCompileProgram")?;
        let log_size: Size = self.f("nvrtcGetProgramLogSize")?;
        let get_log: Get = self.f("nvrtcGetProgramLog")?;
        let cubin_size: Size = self.f("nvrtcGetCUBINSize")?;
        let get_cubin: Get = self.f("nvrtcGetCUBIN")?;
        let destroy: Destroy = self.f("nvrtcDestroyProgram")?;
        let src = CString::new(source).map_err(|e| e.to_string())?;
        let name = CString::new("replayd_kernels.cu").unwrap();
        let options: Vec<CString> = kernel_sources::nvrtc_options(&format!("-arch=sm_{arch}"))
            .into_iter()
            .map(|o| CString::new(o).unwrap())
            .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid C strings that outlive the program; the program is
        // destroyed on every path below.
        unsafe {
            let r = create(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if r != 0 {
                return Err(format!("nvrtcCreateProgram: error {r}"));
            }
            let result = (|| {
                let r = compile(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
                if r != 0 {
                    let mut n = 0usize;
                    log_size(prog, &mut n);
                    let mut log = vec![0u8; n.max(1)];
                    get_log(prog, log.as_mut_ptr() as *mut c_char);
                    return Err(format!(
                        "NVRTC compile failed (error {r}):\n{}",
                        String::from_utf8_lossy(&log)
                    ));
                }
                let mut n = 0usize;
                if cubin_size(prog, &mut n) != 0 || n == 0 {
                    return Err("nvrtcGetCUBINSize failed".into());
                }
                let mut cubin = vec![0u8; n];
                if get_cubin(prog, cubin.as_mut_ptr() as *mut c_char) != 0 {
                    return Err("nvrtcGetCUBIN failed".into());
                }
                Ok(cubin)
            })();
            destroy(&mut prog);
            result
        }
    }
}
