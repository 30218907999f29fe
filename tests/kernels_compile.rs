//! CI check: every kernel in `kernels/` compiles with NVRTC for compute
//! capability 9.0 (H100/H200), to CUBIN and to PTX, and declares exactly the
//! `extern "C"` entry points the CUDA backend looks up (the packed-batch
//! kernels among them: `embed_ln_packed_*`, `pool_packed_*`,
//! `attention_varlen[_tc]_*`; the small-shape ones: `add_ln_vec_*`,
//! `embed_ln_vec_*`, `bias_act_vec_*`, `gemm_small_*`, `pool_ln_*`; XLM-R /
//! MPNet position ids, `embed_ln_padpos_*`;
//! row normalisation, `l2norm_rows_*`; MPNet's relative attention bias,
//! `attention*_bias_*`; prompt-skipping pooling, `pool*_skip_*`; the
//! decoders' band attention, `attention*_band_*`, and decoder.cu's
//! `rms_norm_*`, `qk_norm_rope_*`, `embed_scaled_*`); and that
//! `replayd precompile --arch 90` fills a kernel cache the backend then loads
//! without compiling. Needs no GPU and no
//! CUDA toolkit, only NVRTC (`scripts/dev/install-nvrtc.sh` puts the pinned wheel
//! into `.nvrtc/`; `REPLAYD_NVRTC_DIR` or `LD_LIBRARY_PATH` may point
//! elsewhere).
//!
//! Without NVRTC the test fails when `CI` is set, and is skipped with a message
//! otherwise.

use std::collections::BTreeSet;
use std::path::PathBuf;

use replayd::backend::cuda::kernels::{self, KernelCache, Target};
use replayd::gpu::libs::{self, CudaLib};

/// The NVRTC release whose CUDA version matches the GPU machines' driver (580 = CUDA 13.0).
const EXPECTED_NVRTC: (i32, i32) = (13, 0);

fn in_ci() -> bool {
    std::env::var("CI")
        .map(|v| !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false"))
        .unwrap_or(false)
}

/// Makes NVRTC loadable; `Err` says what was tried.
fn find_nvrtc() -> Result<String, String> {
    if CudaLib::Nvrtc.is_present() {
        return Ok("the loader path".into());
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("REPLAYD_NVRTC_DIR") {
        dirs.extend(std::env::split_paths(&d));
    }
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    dirs.push(repo.join(".nvrtc/nvidia/cu13/lib"));
    if let Some(d) = libs::preload_from(CudaLib::Nvrtc, &dirs) {
        if CudaLib::Nvrtc.is_present() {
            return Ok(d.display().to_string());
        }
    }
    libs::ensure(CudaLib::Nvrtc)
        .map(|_| "a standard CUDA location".into())
        .map_err(|e| {
            format!(
                "NVRTC (libnvrtc.so.13) not found. Run `scripts/dev/install-nvrtc.sh` (pip-installs \
             nvidia-cuda-nvrtc=={}.{}.* into {}/.nvrtc) or set REPLAYD_NVRTC_DIR to a directory \
             holding libnvrtc.so.13 and libnvrtc-builtins.so.13.0. Searched {dirs:?}; {e}",
                EXPECTED_NVRTC.0,
                EXPECTED_NVRTC.1,
                repo.display()
            )
        })
}

#[test]
fn kernels_compile_with_nvrtc_for_sm_90() {
    let found = match find_nvrtc() {
        Ok(w) => w,
        Err(msg) if in_ci() => panic!("{msg}"),
        Err(msg) => {
            eprintln!("SKIPPED kernels_compile_with_nvrtc_for_sm_90: {msg}");
            return;
        }
    };
    let version = kernels::nvrtc_version().expect("nvrtcVersion");
    eprintln!("NVRTC {}.{} from {found}", version.0, version.1);
    assert_eq!(
        version.0, EXPECTED_NVRTC.0,
        "NVRTC major version {} (the GPU machines run CUDA {}.{})",
        version.0, EXPECTED_NVRTC.0, EXPECTED_NVRTC.1
    );
    if version != EXPECTED_NVRTC {
        eprintln!(
            "warning: NVRTC {}.{} differs from the GPU driver's CUDA {}.{}",
            version.0, version.1, EXPECTED_NVRTC.0, EXPECTED_NVRTC.1
        );
    }
    let archs = kernels::supported_archs().expect("supported archs");
    assert!(
        archs.contains(&90),
        "NVRTC does not support sm_90: {archs:?}"
    );
    assert_eq!(
        kernels::choose_target((9, 0), &archs),
        Ok(Target::Cubin(90))
    );

    let source = kernels::combined_source();
    let expected: BTreeSet<String> = kernels::expected_entry_points().into_iter().collect();
    // The packed-batch kernels are part of the one translation unit.
    for file in [
        "embed_packed.cu",
        "pool_packed.cu",
        "attention_varlen.cu",
        "embed_pos.cu",
        "rownorm.cu",
    ] {
        assert!(source.contains(&format!("#line 1 \"{file}\"")), "{file}");
    }
    // So are the vectorised kernels and the Linears of few rows.
    for file in ["vec.cu", "gemm_small.cu"] {
        assert!(source.contains(&format!("#line 1 \"{file}\"")), "{file}");
    }
    for name in [
        "embed_ln_packed_f16",
        "attention_varlen_tc_bf16_d64",
        "gemm_small_f16",
        "pool_packed_ln_bf16",
    ] {
        assert!(expected.contains(name), "{name}");
    }

    // PTX: the exact set of entry points.
    let t = Target::Ptx(90);
    let (ptx, log) = kernels::compile(&source, &kernels::compile_options(t), t)
        .unwrap_or_else(|e| panic!("{e}"));
    let text = String::from_utf8_lossy(&ptx);
    assert!(
        text.contains(".target sm_90"),
        "PTX target: {}",
        &text[..text.len().min(400)]
    );
    let entries: BTreeSet<String> = kernels::ptx_entry_points(&text).into_iter().collect();
    assert_eq!(
        entries, expected,
        "PTX entry points differ from expected_entry_points()"
    );
    assert!(!log.contains("warning"), "NVRTC warnings:\n{log}");

    // CUBIN for sm_90, as the backend builds it on an H100/H200.
    let t = Target::Cubin(90);
    let (cubin, _) = kernels::compile(&source, &kernels::compile_options(t), t)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF CUBIN");
    for name in &expected {
        assert!(
            kernels::cubin_has_symbol(&cubin, name),
            "CUBIN lacks {name}"
        );
    }

    // `replayd precompile` fills the cache the daemon reads (no GPU needed
    // with --arch): compiled once there, then loaded here without a compile.
    let dir = tempfile::tempdir().unwrap();
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut nvrtc_dirs = vec![repo.join(".nvrtc/nvidia/cu13/lib")];
    if let Some(d) = std::env::var_os("REPLAYD_NVRTC_DIR") {
        nvrtc_dirs.extend(std::env::split_paths(&d));
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayd"))
        .args(["precompile", "--arch", "90", "--cache-dir"])
        .arg(dir.path())
        .env(
            "REPLAYD_NVRTC_DIR",
            std::env::join_paths(&nvrtc_dirs).unwrap(),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("Cubin(90): compiled in") && stdout.contains("cached at"),
        "{stdout}"
    );
    let cache = KernelCache::new(dir.path());
    let (img1, key, origin1) = kernels::build_image(t, Some(&cache), |_| {}).unwrap();
    assert!(
        matches!(origin1, kernels::ImageOrigin::Cache(_)),
        "{origin1:?}"
    );
    // A second precompile finds it there.
    let again = std::process::Command::new(env!("CARGO_BIN_EXE_replayd"))
        .args(["precompile", "--arch", "sm_90", "--cache-dir"])
        .arg(dir.path())
        .env(
            "REPLAYD_NVRTC_DIR",
            std::env::join_paths(&nvrtc_dirs).unwrap(),
        )
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("already cached"),
        "{}",
        String::from_utf8_lossy(&again.stdout)
    );
    let (img2, key2, origin2) = kernels::build_image(t, Some(&cache), |_| {}).unwrap();
    assert!(
        matches!(origin2, kernels::ImageOrigin::Cache(_)),
        "{origin2:?}"
    );
    assert!(expected.iter().all(|n| kernels::cubin_has_symbol(&img1, n)));
    assert_eq!(key, key2);
    assert_eq!(img1, img2);
}

/// `replayd --version` says which kernels the binary carries.
#[test]
fn version_says_which_kernels_are_built_in() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayd"))
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let (archs, _) = kernels::embedded_archs();
    let line = text
        .lines()
        .find(|l| l.starts_with("CUDA kernels: "))
        .unwrap_or_else(|| panic!("{text}"));
    if archs.is_empty() {
        assert!(line.contains("none built in"), "{line}");
    } else {
        assert!(
            line.contains(&format!("built in for sm_{}", archs[0])),
            "{line}"
        );
    }
}
