//! `replayd precompile`: compiles the CUDA kernels into the kernel cache
//! before the daemon first starts, for images and installs whose binary
//! carries no cubins for their GPUs (built without `REPLAYD_EMBED_KERNELS`,
//! or a GPU newer than it names). With `--arch` it needs no GPU, only NVRTC:
//! an image can be prepared on a build host for the GPUs it will run on.
//!
//! The cache is the one the daemon reads (`[devices] kernel_cache_dir`, else
//! the default directory; `--cache-dir` overrides both), keyed by the
//! kernels' source, the NVRTC options and version and the architecture, so
//! the daemon finds these files only with the same NVRTC and binary.

use crate::backend::cuda::kernel_sources::parse_archs;
use crate::backend::cuda::kernels::{self, ImageOrigin, KernelCache, Target};
use crate::config::Config;
use crate::gpu::libs::{self, CudaLib};
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// Compile the CUDA kernels into the kernel cache ahead of the daemon's
/// first start (for binaries without embedded cubins for these GPUs).
#[derive(clap::Args, Debug)]
pub struct PrecompileArgs {
    /// Architectures to compile for, e.g. `80,86,90` or `default` (no GPU
    /// needed); without it, those of this machine's GPUs.
    #[arg(long)]
    pub arch: Option<String>,
    /// The kernel cache directory; default: the config's `[devices]
    /// kernel_cache_dir`, else the directory the daemon would use.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

/// Runs `replayd precompile`; `config` is the daemon's config file (read
/// for its cache directory when it exists).
pub fn run(args: PrecompileArgs, config: &Path) -> anyhow::Result<()> {
    libs::ensure(CudaLib::Nvrtc).map_err(anyhow::Error::msg)?;
    let archs = match &args.arch {
        Some(list) => parse_archs(list).map_err(anyhow::Error::msg)?,
        None => {
            let mut archs: Vec<u32> = crate::gpu::cuda_compute_capabilities()
                .map_err(anyhow::Error::msg)
                .context("no --arch given, and this machine's GPUs cannot be read")?
                .into_iter()
                .map(|(major, minor)| major * 10 + minor)
                .collect();
            archs.sort_unstable();
            archs.dedup();
            archs
        }
    };
    if archs.is_empty() {
        bail!("no architecture to compile for (no GPU here, and --arch names none)");
    }
    let supported = kernels::supported_archs().map_err(anyhow::Error::msg)?;
    let targets: Vec<Target> = archs
        .iter()
        .map(
            |&a| match kernels::choose_target((a / 10, a % 10), &supported) {
                Ok(t) => Ok(t),
                Err(e) => Err(anyhow::anyhow!("sm_{a}: {e}")),
            },
        )
        .collect::<anyhow::Result<_>>()?;
    let configured = match &args.cache_dir {
        Some(dir) => Some(dir.clone()),
        None if config.is_file() => Config::load(config)?.devices.kernel_cache_dir,
        None => None,
    };
    let dir = kernels::resolve_cache_dir(configured.as_deref())
        .context("no writable kernel cache directory")?;
    let cache = KernelCache::new(&dir);
    let (embedded, _) = kernels::embedded_archs();
    println!(
        "compiling for {} into {} ({} in parallel)",
        targets
            .iter()
            .map(|t| format!("{t:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        dir.display(),
        targets.len()
    );
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = targets
            .iter()
            .map(|&t| {
                let cache = &cache;
                s.spawn(move || kernels::build_image(t, Some(cache), |_| {}))
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut failed = 0;
    for (target, result) in targets.iter().zip(results) {
        let note = match target {
            Target::Cubin(a) if kernels::pick_embedded((a / 10, a % 10), &embedded).is_some() => {
                " (this binary also embeds kernels for it)"
            }
            _ => "",
        };
        match result {
            Ok(Ok((_, _, ImageOrigin::Cache(path)))) => {
                println!("{target:?}: already cached at {}{note}", path.display())
            }
            Ok(Ok((_, _, ImageOrigin::Compiled { millis, stored }))) => match stored {
                Some(path) => println!(
                    "{target:?}: compiled in {:.1} s, cached at {}{note}",
                    millis / 1e3,
                    path.display()
                ),
                None => {
                    failed += 1;
                    println!("{target:?}: compiled, but the cache could not be written")
                }
            },
            Ok(Ok((_, _, ImageOrigin::Embedded(_)))) => unreachable!("build_image compiles"),
            Ok(Err(e)) => {
                failed += 1;
                println!("{target:?}: {e}");
            }
            Err(_) => {
                failed += 1;
                println!("{target:?}: the compile panicked");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} architectures failed", targets.len());
    }
    Ok(())
}
