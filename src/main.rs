//! `replayd`: the daemon. See `replayd --help`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use replayd::config::Config;
use replayd::daemon::server::{self, ServerOptions};
use std::path::PathBuf;

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

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon (the default).
    Serve,
    /// Capture every bucket on a CUDA device, compare it with the CPU
    /// backend on random inputs, and time replays (for the GPU check).
    BackendCheck(replayd::tools::backend_check::BackendCheckArgs),
    /// Run one device's worker process (started by the daemon).
    #[command(hide = true)]
    Worker(replayd::worker::WorkerArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Some(Command::Worker(args)) => std::process::exit(replayd::worker::run(args)),
        Some(Command::BackendCheck(args)) => replayd::tools::backend_check::run(args),
        Some(Command::Serve) | None => serve(cli.config, cli.ready_file),
    }
}

fn serve(config_path: PathBuf, ready_file: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(&config_path)?;
    let worker_exe = std::env::current_exe().context("cannot find the replayd executable")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("replayd")
        .build()?;
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
