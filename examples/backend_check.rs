//! Stand-alone runner for `replayd backend-check` (until the subcommand is
//! wired into the daemon's CLI): `backend_check --config FILE [--gpu N] [--out FILE.json] …`.

use clap::Parser;
use replayd::backend_check::{run, BackendCheckArgs};

#[derive(Parser)]
#[command(about = "Capture every bucket on a CUDA device and check it against the CPU backend")]
struct Cli {
    #[command(flatten)]
    args: BackendCheckArgs,
}

fn main() -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .try_init();
    run(Cli::parse().args)
}
