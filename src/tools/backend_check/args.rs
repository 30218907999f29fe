//! The arguments of `replayd backend-check` (its flags, with their
//! documentation as `--help` prints it).

use std::path::PathBuf;

use crate::config::KernelPath;

/// Arguments of `replayd backend-check`.
#[derive(clap::Args, Clone, Debug)]
pub struct BackendCheckArgs {
    /// The daemon's config file (models, buckets, dtype, devices).
    #[arg(long, short = 'c', default_value = "config/replayd.toml")]
    pub config: PathBuf,
    /// CUDA device ordinal to check.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Write the results as JSON here.
    #[arg(long, short = 'o')]
    pub out: Option<PathBuf>,
    /// Timed launch→collect round trips per bucket.
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
    /// Untimed round trips per bucket before timing.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Rows per bucket compared with the CPU backend (spread over the batch).
    #[arg(long, default_value_t = 4)]
    pub check_rows: usize,
    /// Threads of the CPU reference backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub cpu_threads: usize,
    /// Only these models (comma-separated names; default all).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// Only these batch buckets (comma-separated; default the config's).
    #[arg(long, value_delimiter = ',')]
    pub batches: Vec<usize>,
    /// Only these seq buckets (comma-separated; default the config's).
    #[arg(long, value_delimiter = ',')]
    pub seqs: Vec<usize>,
    /// Only these token budgets of packed models (comma-separated; default
    /// the config's).
    #[arg(long, value_delimiter = ',')]
    pub budgets: Vec<usize>,
    /// Skip the eager-path check.
    #[arg(long)]
    pub no_eager: bool,
    /// Also time every step of one batch (GPU time per kernel and matmul,
    /// outside the graph, steps queued back to back) and print a summary per
    /// kernel: every packed bucket (a `fill` batch; with the attention's
    /// share), and the padded BERT buckets of `--profile-buckets`.
    #[arg(long)]
    pub profile: bool,
    /// Padded buckets `--profile` times, as `BATCHxSEQ` (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_values_t = ["1x16".to_string(), "32x128".to_string(), "128x128".to_string()]
    )]
    pub profile_buckets: Vec<String>,
    /// Kernel paths to switch off for the whole run (comma-separated), in
    /// addition to the config's `[devices] kernel_paths_off`: tc_attention,
    /// skinny, ln_vec, ew_vec, gemm_small, ln_defer, pdl, staged_io,
    /// stage_fold, inline_input, poll_output, attn_s16, attn_q128,
    /// mm_residual, pool_split.
    #[arg(long, value_delimiter = ',')]
    pub paths_off: Vec<KernelPath>,
    /// Kernel paths to measure against: each bucket whose plan they change
    /// runs a second time with them off too, checked and timed side by
    /// side (comma-separated; default: the small-shape paths).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ln_vec,ew_vec,gemm_small,ln_defer,pdl,attn_s16"
    )]
    pub compare_off: Vec<KernelPath>,
    /// Run each bucket once, with the served paths only.
    #[arg(long)]
    pub no_compare: bool,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Reference outputs for a model, `NAME=FILE.jsonl` (repeatable): lines of
    /// `{"ids": [...], "embedding": [...]}` (BERT; e.g. sentence-transformers
    /// embeddings of real texts) or `{"input": [[...]], "output": [[...]]}`
    /// (MLP batches), run through the captured graphs (eager beyond the
    /// largest seq bucket) and compared.
    #[arg(long = "reference", value_parser = parse_reference)]
    pub references: Vec<(String, PathBuf)>,
}

/// `NAME=FILE` of `--reference`.
fn parse_reference(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!("expected NAME=FILE, got {s:?}")),
    }
}

#[cfg(test)]
impl BackendCheckArgs {
    /// Arguments as clap would make them, but for one fast iteration.
    pub(super) fn for_tests() -> BackendCheckArgs {
        BackendCheckArgs {
            config: "x".into(),
            gpu: 0,
            out: None,
            iters: 1,
            warmup: 0,
            check_rows: 1,
            cpu_threads: 1,
            models: vec![],
            batches: vec![],
            seqs: vec![],
            budgets: vec![],
            no_eager: false,
            profile: false,
            profile_buckets: vec!["1x16".into(), "128x128".into()],
            paths_off: vec![],
            compare_off: KernelPath::SMALL_SHAPE.to_vec(),
            no_compare: false,
            seed: 1,
            references: vec![],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_path_flags_parse_and_default_to_the_small_shape_paths() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: BackendCheckArgs,
        }
        let cli = Cli::parse_from(["backend-check"]);
        assert_eq!(cli.args.compare_off, KernelPath::SMALL_SHAPE.to_vec());
        assert!(cli.args.paths_off.is_empty() && !cli.args.no_compare);
        let cli = Cli::parse_from(["backend-check", "--paths-off", "pdl,attn_s16"]);
        assert_eq!(
            cli.args.paths_off,
            vec![KernelPath::Pdl, KernelPath::AttnS16]
        );
        let err = Cli::try_parse_from(["backend-check", "--paths-off", "small_attn"])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("unknown kernel path") && err.contains("gemm_small"),
            "{err}"
        );
    }

    #[test]
    fn reference_flags_name_a_model_and_a_file() {
        assert_eq!(
            parse_reference("m=a/b.jsonl"),
            Ok(("m".into(), PathBuf::from("a/b.jsonl")))
        );
        assert!(parse_reference("m").is_err() && parse_reference("=x").is_err());
    }
}
