//! `replayd`: the daemon. See `replayd --help`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use replayd::config::Config;
use replayd::daemon::server::{self, ServerOptions};
use std::path::PathBuf;

/// jemalloc rather than glibc malloc: the request path allocates on one
/// runtime thread and frees on another, which glibc's arenas serve slowly
/// (mimalloc, tried before, was worth about a quarter of the host
/// throughput but kept freed memory unpredictably; see docs/perf-log.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its first allocation: a background thread
/// returns freed pages to the OS within `dirty_decay_ms`, so a flood's
/// buffers leave the RSS shortly after it (the never-reading client test
/// bounds the growth), and nothing waits in a muzzy state. `_RJEM_MALLOC_CONF`
/// in the environment overrides them.
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: MallocConf =
    MallocConf(c"background_thread:true,dirty_decay_ms:200,muzzy_decay_ms:0".as_ptr());

#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);
// SAFETY: it points at a string literal, immutable for the program's life.
unsafe impl Sync for MallocConf {}

/// Serve neural-network inference by replaying CUDA Graphs captured per
/// (batch, sequence-length) bucket. Without a subcommand, runs the daemon.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    /// Configuration file (TOML; see config/replayd.toml for every key).
    #[arg(
        long,
        short,
        env = "REPLAYD_CONFIG",
        default_value = "config/replayd.toml",
        global = true
    )]
    config: PathBuf,

    /// Write a JSON file with the bound endpoints and pid once every device is ready.
    #[arg(long, env = "REPLAYD_READY_FILE")]
    ready_file: Option<PathBuf>,

    /// Log filter (tracing env-filter syntax), e.g. "info" or "replayd=debug".
    #[arg(long, env = "REPLAYD_LOG", default_value = "info", global = true)]
    log: String,

    /// Log lines as text (colours only on a terminal) or as one JSON object
    /// per line (for log shippers).
    #[arg(
        long,
        env = "REPLAYD_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Exit status of a configuration the daemon rejects (EX_CONFIG); the
/// systemd unit does not restart on it (`RestartPreventExitStatus=78`).
const EXIT_CONFIG: i32 = 78;

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon (the default).
    Serve,
    /// Capture every bucket on a CUDA device, compare it with the CPU
    /// backend on random inputs, and time replays (for the GPU check).
    BackendCheck(replayd::tools::backend_check::BackendCheckArgs),
    /// Compile the CUDA kernels into the kernel cache ahead of the first
    /// start: for this machine's GPUs, or for `--arch` (no GPU needed). For
    /// binaries without embedded cubins for their GPUs.
    Precompile(replayd::tools::precompile::PrecompileArgs),
    /// Run one device's worker process (started by the daemon).
    #[command(hide = true)]
    Worker(replayd::worker::WorkerArgs),
}

/// `replayd --version`: the version, and which GPU kernels the binary
/// carries (built with `REPLAYD_EMBED_KERNELS`) or that it compiles them.
fn long_version() -> String {
    let (archs, nvrtc) = replayd::backend::cuda::kernels::embedded_archs();
    let kernels = if archs.is_empty() {
        "none built in (compiled with NVRTC at the first start on each GPU, then cached)".into()
    } else {
        format!(
            "built in for {} (NVRTC {}.{}); other GPUs compile them with NVRTC",
            archs
                .iter()
                .map(|a| format!("sm_{a}"))
                .collect::<Vec<_>>()
                .join(", "),
            nvrtc.0,
            nvrtc.1
        )
    };
    format!("{}\nCUDA kernels: {kernels}", env!("CARGO_PKG_VERSION"))
}

fn main() {
    use clap::{CommandFactory, FromArgMatches};
    let version: &'static str = Box::leak(long_version().into_boxed_str());
    let matches = Cli::command().long_version(version).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Worker processes log the same way (they inherit the environment).
    // SAFETY: no other thread exists yet.
    unsafe {
        std::env::set_var("REPLAYD_LOG", &cli.log);
        std::env::set_var(
            "REPLAYD_LOG_FORMAT",
            match cli.log_format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            },
        );
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        // Colours only where a person reads them, not in a file or the journal.
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    let result = match cli.command {
        Some(Command::Worker(args)) => std::process::exit(replayd::worker::run(args)),
        Some(Command::BackendCheck(args)) => replayd::tools::backend_check::run(args),
        Some(Command::Precompile(args)) => replayd::tools::precompile::run(args, &cli.config),
        Some(Command::Serve) | None => serve(cli.config, cli.ready_file),
    };
    if let Err(e) = result {
        let config = server::is_config_error(&e);
        tracing::error!("{e:#}");
        std::process::exit(if config { EXIT_CONFIG } else { 1 });
    }
}

fn serve(config_path: PathBuf, ready_file: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    let worker_exe = std::env::current_exe().context("cannot find the replayd executable")?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if config.server.runtime_threads > 0 {
        runtime.worker_threads(config.server.runtime_threads);
    }
    let runtime = runtime.enable_all().thread_name("replayd").build()?;
    runtime.block_on(async move {
        let options = ServerOptions {
            config_path: std::fs::canonicalize(&config_path).unwrap_or(config_path),
            worker_exe,
            ready_file,
            on_ready: None,
        };
        server::run(config, options, shutdown_signal()).await
    })
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
