//! `replayd backend-check`: every model and bucket of a config, captured on a
//! CUDA device and checked against the CPU backend, with replay latency.
//!
//! For each model (in config order) and each (batch, seq) bucket of its grid
//! (captured largest first, as the worker does):
//!
//! 1. capture the graph on the GPU (capture time, graph memory, node counts);
//! 2. replay it on random inputs (random feature rows for MLPs; random token
//!    ids with random lengths within the bucket for BERT models), and compare
//!    a few of the rows with the CPU backend's eager run of the same rows
//!    (MLP: max error relative to the largest reference value; BERT: minimum
//!    cosine similarity);
//! 3. time launch → collect of a full batch, one at a time (median, p90, p99),
//!    and the throughput with two batches in flight.
//!
//! Models with `batching = "packed"` are checked per token budget instead
//! (largest first, as the worker captures them):
//!
//! 1. capture the packed graph (`Bucket::Packed { tokens, seqs }`);
//! 2. replay it on several batches and compare every output row with the CPU
//!    backend running the same packed program on the same rows (minimum
//!    cosine; rows of empty sequences must be zero on both): `fill`, random
//!    sequences of random lengths (mostly short, some up to the longest the
//!    budget allows) filling the budget exactly; `one`, a single 16-token
//!    sequence (a nearly empty budget); `many`, as many sequences as the
//!    graph holds; `long+empty`, one sequence of the longest length and
//!    empty sequences;
//! 3. time launch → collect of `fill` batches (median, p90, p99) and the
//!    throughput with two in flight, in real tokens/s and sequences/s.
//!
//! The kernel paths are the daemon's (`[devices] kernel_paths_off`), less
//! any `--paths-off`. Every bucket whose plan the `--compare-off` paths
//! change (by default the small-shape ones: the vectorised LayerNorm and
//! element-wise kernels, `gemm_small` and its deferred LayerNorm,
//! programmatic launch, the 16-key attention) is checked twice, with those
//! paths and without, each against the CPU backend and timed; a table per
//! model then sets the two side by side with their node counts (plan steps,
//! kernels, matmuls), so a gain or a mismatch is traced to the path. The
//! reference files run through both sets of graphs. `--no-compare` runs
//! each bucket once.
//!
//! Then each model runs once on the eager path at a shape no bucket has
//! (larger than the largest bucket where the model allows; for a packed
//! model, the packed program at a batch's exact token count), also against
//! the CPU. A table goes to stdout, everything to the JSON file. The command
//! fails (after writing the JSON) when any comparison fails.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use serde::Serialize;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::plan::{self, Limits};
use crate::backend::cuda::{CapturedGraph, CudaBackend, GraphMemory};
use crate::backend::Backend;
use crate::bucket::Bucket;
use crate::config::{BatchingMode, Config, KernelPath, ModelConfig};
use crate::gpu::DeviceInfo;
use crate::model::ModelKind;
use crate::model::{BatchRows, InputSpec, Model};
use crate::tensor::DType;

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
    /// stage_fold, inline_input, poll_output, attn_s16.
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

/// The (served, limits) a bucket runs with: first the served paths, whose
/// graphs serve the reference check and the eager path, then, unless
/// `--no-compare`, the same with the `--compare-off` paths off too. The
/// second run is left out where it would plan the very same steps
/// (`same_plan`: none of the paths applies, e.g. an MLP's), and when the
/// served paths have them off already.
fn variants(
    args: &BackendCheckArgs,
    served: Limits,
    same_plan: impl FnOnce(Limits, Limits) -> bool,
) -> Vec<(bool, Limits)> {
    let compared = served.without(&args.compare_off);
    if args.no_compare || compared == served || same_plan(served, compared) {
        return vec![(true, served)];
    }
    vec![(true, served), (false, compared)]
}

fn parse_reference(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), PathBuf::from(path)))
        }
        _ => Err(format!("expected NAME=FILE, got {s:?}")),
    }
}

/// Distribution of round-trip times, in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub iters: usize,
    pub min_us: f64,
    pub median_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

impl Latency {
    pub fn from_samples(mut v: Vec<f64>) -> Latency {
        if v.is_empty() {
            return Latency::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Latency {
            iters: v.len(),
            min_us: v[0],
            median_us: q(0.5),
            p90_us: q(0.9),
            p99_us: q(0.99),
            max_us: v[v.len() - 1],
        }
    }
}

/// A comparison with the CPU backend.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// `"max_rel_err"` (MLP) or `"min_cosine"` (BERT).
    pub metric: &'static str,
    pub value: f64,
    pub threshold: f64,
    pub pass: bool,
    pub rows: usize,
    /// Largest element-wise |gpu − cpu|.
    pub max_abs_err: f64,
}

/// One batch shape replayed in a packed graph and compared with the CPU.
#[derive(Clone, Debug, Serialize)]
pub struct PackedCase {
    /// `fill`, `one`, `many` or `long+empty`.
    pub name: &'static str,
    pub seqs: usize,
    /// Real tokens of the batch (all sequences).
    pub tokens: usize,
    pub check: Check,
}

/// Replays (with copies, p50) under this many µs are also timed alone.
pub const REPLAY_ONLY_BELOW_US: f64 = 2000.0;

#[derive(Clone, Debug, Serialize)]
pub struct BucketResult {
    /// `"8x16"` or, packed, `"1024t"`.
    pub bucket: String,
    /// Rows, or (packed) the most sequences.
    pub batch: usize,
    /// Tokens per row, or (packed) the longest sequence.
    pub seq: usize,
    /// Packed buckets: the token budget.
    pub tokens: Option<usize>,
    /// Packed buckets: the batches compared with the CPU (`check` is the worst).
    pub cases: Vec<PackedCase>,
    /// Packed buckets: real tokens and sequences per second with two batches
    /// in flight (random `fill` batches).
    pub throughput_tokens_per_s: f64,
    pub throughput_seqs_per_s: f64,
    /// With `--profile`: (step, mean GPU µs) of one batch (packed: `fill`).
    pub profile: Vec<(String, f64)>,
    /// Whether this run had the served kernel paths (false: the
    /// `--compare-off` paths off too).
    pub served: bool,
    /// The plan's kernels and cuBLASLt matmuls (a matmul may be more than
    /// one graph node; `nodes` counts the graph's own).
    pub plan_kernels: usize,
    pub plan_matmuls: usize,
    pub capture_ms: f64,
    pub graph_memory_bytes: u64,
    pub memory: GraphMemory,
    pub nodes: String,
    pub check: Option<Check>,
    pub latency: Latency,
    /// The graph's replay alone (launch, stream synchronised; the inputs of
    /// the last batch, no copies in or out): `latency` minus this is what
    /// the copies around a replay cost. Timed only for replays under
    /// [`REPLAY_ONLY_BELOW_US`] (zero otherwise).
    pub replay_only: Latency,
    /// Rows per second with two batches in flight.
    pub throughput_rows_per_s: f64,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct EagerResult {
    pub batch: usize,
    pub seq: usize,
    pub gpu_ms: f64,
    pub check: Option<Check>,
    pub error: Option<String>,
}

/// Agreement with stored reference outputs.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceResult {
    pub path: PathBuf,
    /// Texts (BERT) or rows (MLP) compared.
    pub items: usize,
    /// Of those, run on the eager path (longer than every seq bucket).
    pub eager_items: usize,
    pub check: Option<Check>,
    /// Mean cosine (BERT) over all items.
    pub mean_cosine: Option<f64>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelResult {
    pub name: String,
    pub kind: ModelKind,
    pub dtype: DType,
    pub allow_tf32: bool,
    pub weights_bytes: u64,
    pub upload_ms: f64,
    pub buckets: Vec<BucketResult>,
    pub eager: Option<EagerResult>,
    pub reference: Option<ReferenceResult>,
    /// The reference through the graphs of the `--compare-off` run.
    pub reference_other: Option<ReferenceResult>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub device: DeviceInfo,
    pub kernels: String,
    pub init_ms: f64,
    pub workspace_bytes: u64,
    pub cpu_threads: usize,
    pub models: Vec<ModelResult>,
    pub failures: Vec<String>,
    pub pass: bool,
}

/// xorshift64* (deterministic inputs without a dependency).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi] (inclusive).
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random rows for a model: `n` feature rows, or `n` token sequences of
/// random lengths in `[min(2, seq), seq]` (`[CLS]`-like first and
/// `[SEP]`-like last ids when the vocabulary has them).
fn random_rows(model: &Model, n: usize, seq: usize, rng: &mut Rng) -> BatchRows {
    match &model.info.input {
        InputSpec::Features { features } => BatchRows::Features {
            features: *features,
            data: (0..n * features).map(|_| rng.unit()).collect(),
        },
        InputSpec::Tokens { vocab_size, .. } => {
            let vocab = (*vocab_size).max(1);
            let lo = if vocab > 2000 { 1000 } else { 0 };
            BatchRows::Tokens(
                (0..n)
                    .map(|_| {
                        let len = rng.range(seq.min(2), seq);
                        let mut ids: Vec<u32> =
                            (0..len).map(|_| rng.range(lo, vocab - 1) as u32).collect();
                        if vocab > 103 && len >= 2 {
                            ids[0] = 101;
                            ids[len - 1] = 102;
                        }
                        ids
                    })
                    .collect(),
            )
        }
    }
}

/// Rows `idx` of a batch, as a batch of their own.
fn subset(rows: &BatchRows, idx: &[usize]) -> BatchRows {
    match rows {
        BatchRows::Features { features, data } => BatchRows::Features {
            features: *features,
            data: idx
                .iter()
                .flat_map(|&i| data[i * features..(i + 1) * features].iter().copied())
                .collect(),
        },
        BatchRows::Tokens(seqs) => {
            BatchRows::Tokens(idx.iter().map(|&i| seqs[i].clone()).collect())
        }
    }
}

/// Up to `k` row indices of `n`, spread out (first and last included).
fn spread(n: usize, k: usize) -> Vec<usize> {
    if n == 0 || k == 0 {
        return Vec::new();
    }
    if k >= n {
        return (0..n).collect();
    }
    if k == 1 {
        return vec![0];
    }
    let mut v: Vec<usize> = (0..k).map(|i| i * (n - 1) / (k - 1)).collect();
    v.dedup();
    v
}

/// Acceptance thresholds by model kind and dtype.
fn threshold(kind: ModelKind, dtype: DType, tf32: bool) -> f64 {
    match (kind, dtype) {
        (ModelKind::Mlp, DType::F32) if tf32 => 5e-3,
        (ModelKind::Mlp, DType::F32) => 1e-5,
        (ModelKind::Mlp, DType::F16) => 1e-2,
        (ModelKind::Mlp, _) => 5e-2,
        (ModelKind::Bert, DType::F32) if tf32 => 0.999,
        (ModelKind::Bert, DType::F32) => 0.9999,
        (ModelKind::Bert, DType::F16) => 0.999,
        (ModelKind::Bert, _) => 0.99,
    }
}

/// The score tolerance (relative to max(1, |score|)) that goes with a
/// BERT cosine threshold: f32 1e-4, f16 1e-2, bf16 5e-2, as
/// `examples/family_check.rs` asserts through the daemon.
fn score_tolerance(cosine_threshold: f64) -> f64 {
    if cosine_threshold >= 0.9999 {
        1e-4
    } else if cosine_threshold >= 0.999 {
        1e-2
    } else {
        5e-2
    }
}

/// Compares `gpu` with `cpu` (both `rows × dim`): MLPs by the largest error
/// relative to the largest reference value, embeddings by the least cosine
/// of a row, one score a row by its error relative to max(1, |score|).
pub fn compare(kind: ModelKind, gpu: &[f32], cpu: &[f32], dim: usize, threshold: f64) -> Check {
    let rows = cpu.len().checked_div(dim).unwrap_or(0);
    let max_abs_err = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| {
            let d = (*g as f64 - *c as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                d
            }
        })
        .fold(0.0, f64::max);
    let length_ok = gpu.len() == cpu.len();
    match kind {
        ModelKind::Mlp => {
            let scale = cpu
                .iter()
                .map(|c| (*c as f64).abs())
                .fold(0.0, f64::max)
                .max(1e-30);
            let value = if length_ok {
                max_abs_err / scale
            } else {
                f64::INFINITY
            };
            Check {
                metric: "max_rel_err",
                value,
                threshold,
                pass: value <= threshold,
                rows,
                max_abs_err,
            }
        }
        // One score a row (cross-encoders): a cosine is only the signs'
        // agreement, which rounding flips for a score near 0; the error
        // relative to max(1, |score|) is what family_check asserts too.
        ModelKind::Bert if dim == 1 => {
            let value = if length_ok {
                gpu.iter()
                    .zip(cpu)
                    .map(|(g, c)| {
                        let d = (*g as f64 - *c as f64).abs() / (*c as f64).abs().max(1.0);
                        if d.is_nan() {
                            f64::INFINITY
                        } else {
                            d
                        }
                    })
                    .fold(0.0, f64::max)
            } else {
                f64::INFINITY
            };
            let threshold = score_tolerance(threshold);
            Check {
                metric: "max_score_err",
                value,
                threshold,
                pass: value <= threshold,
                rows,
                max_abs_err,
            }
        }
        ModelKind::Bert => {
            let mut min_cos = if length_ok { 1.0f64 } else { f64::NEG_INFINITY };
            for r in 0..rows.min(gpu.len() / dim.max(1)) {
                let (g, c) = (&gpu[r * dim..(r + 1) * dim], &cpu[r * dim..(r + 1) * dim]);
                let dot: f64 = g.iter().zip(c).map(|(a, b)| *a as f64 * *b as f64).sum();
                let ng: f64 = g.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
                let nc: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
                let cos = if ng == 0.0 && nc == 0.0 {
                    1.0
                } else {
                    dot / (ng * nc).max(1e-30)
                };
                min_cos = min_cos.min(if cos.is_nan() { f64::NEG_INFINITY } else { cos });
            }
            Check {
                metric: "min_cosine",
                value: min_cos,
                threshold,
                pass: min_cos >= threshold,
                rows,
                max_abs_err,
            }
        }
    }
}

/// The buckets of a model, largest first (as the worker captures them).
fn buckets(mc: &ModelConfig, args: &BackendCheckArgs) -> Vec<(usize, usize)> {
    let batches: Vec<usize> = mc
        .batch_buckets
        .iter()
        .copied()
        .filter(|b| args.batches.is_empty() || args.batches.contains(b))
        .collect();
    let seqs: Vec<usize> = match mc.kind {
        ModelKind::Mlp => vec![1],
        ModelKind::Bert => mc
            .seq_buckets
            .iter()
            .copied()
            .filter(|s| args.seqs.is_empty() || args.seqs.contains(s))
            .collect(),
    };
    let mut v: Vec<(usize, usize)> = batches
        .iter()
        .flat_map(|&b| seqs.iter().map(move |&s| (b, s)))
        .collect();
    v.sort_by_key(|&(b, s)| std::cmp::Reverse((b * s, b, s)));
    v
}

/// A shape the eager path must handle: past the largest bucket where allowed.
fn eager_shape(mc: &ModelConfig, model: &Model) -> (usize, usize) {
    let max_batch = mc.max_batch_bucket().max(1);
    match &model.info.input {
        InputSpec::Features { .. } => (max_batch + 3, 1),
        InputSpec::Tokens { max_seq_len, .. } => {
            let max_seq_bucket = mc.seq_buckets.iter().copied().max().unwrap_or(16);
            let seq = if *max_seq_len > max_seq_bucket {
                (*max_seq_len).min(max_seq_bucket * 2)
            } else {
                max_seq_bucket.saturating_sub(3).max(2)
            };
            (3, seq)
        }
    }
}

/// Whether `--profile` times the padded bucket (batch, seq).
fn profiles_padded(args: &BackendCheckArgs, batch: usize, seq: usize) -> bool {
    args.profile
        && args
            .profile_buckets
            .iter()
            .any(|b| b.trim() == format!("{batch}x{seq}"))
}

/// The steps of a profile grouped by kernel (matmuls by shape), largest
/// total first: `"name n× mean µs (total)"`, and the sum of all steps.
pub fn profile_summary(steps: &[(String, f64)]) -> (f64, Vec<String>) {
    let mut groups: Vec<(String, usize, f64)> = Vec::new();
    for (label, us) in steps {
        // "name grid AxBxC" for kernels, "cublasLt ..." for matmuls.
        let key = label.split(" grid ").next().unwrap_or(label).to_string();
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => {
                g.1 += 1;
                g.2 += us;
            }
            None => groups.push((key, 1, *us)),
        }
    }
    groups.sort_by(|a, b| b.2.total_cmp(&a.2));
    let total = steps.iter().map(|(_, us)| us).sum();
    let lines = groups
        .into_iter()
        .map(|(k, n, t)| format!("{k} {n}x {:.1} us ({t:.1})", t / n as f64))
        .collect();
    (total, lines)
}

fn print_profile(bucket: &str, steps: &[(String, f64)]) {
    let (total, lines) = profile_summary(steps);
    println!(
        "    profile {bucket}: {} steps, {total:.1} us of GPU time",
        steps.len()
    );
    for l in lines {
        println!("      {l}");
    }
}

fn fmt_err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

struct Ctx<'a> {
    gpu: &'a mut CudaBackend,
    cpu: &'a mut CpuBackend,
    args: &'a BackendCheckArgs,
    /// The kernel paths the daemon would serve with (`--paths-off` applied).
    served: Limits,
    rng: Rng,
    failures: Vec<String>,
}

fn cpu_reference(
    cpu: &mut CpuBackend,
    model: &Model,
    cpu_weights: &<CpuBackend as Backend>::Weights,
    rows: &BatchRows,
    seq: usize,
) -> anyhow::Result<Vec<f32>> {
    let program = model.program(rows.rows(), seq);
    cpu.run_eager(model, cpu_weights, &program, rows)
        .map_err(|e| anyhow!("CPU reference: {e}"))
}

fn check_bucket(
    c: &mut Ctx<'_>,
    mc: &ModelConfig,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    cw: &<CpuBackend as Backend>::Weights,
    (batch, seq): (usize, usize),
) -> (BucketResult, Option<CapturedGraph>) {
    let mut res = BucketResult {
        bucket: Bucket::new(batch, seq).to_string(),
        batch,
        seq,
        tokens: None,
        cases: Vec::new(),
        throughput_tokens_per_s: 0.0,
        throughput_seqs_per_s: 0.0,
        profile: Vec::new(),
        served: c.gpu.limits() == c.served,
        plan_kernels: 0,
        plan_matmuls: 0,
        capture_ms: 0.0,
        graph_memory_bytes: 0,
        memory: GraphMemory::default(),
        nodes: String::new(),
        check: None,
        latency: Latency::default(),
        replay_only: Latency::default(),
        throughput_rows_per_s: 0.0,
        error: None,
    };
    let program = model.program(batch, seq);
    if let Err(e) = program.validate(&model.weights) {
        res.error = Some(format!("capture: {e}"));
        return (res, None);
    }
    let t = Instant::now();
    let mut graph = match c.gpu.capture(model, gw, &program) {
        Ok(g) => g,
        Err(e) => {
            res.error = Some(format!("capture: {e}"));
            return (res, None);
        }
    };
    res.capture_ms = t.elapsed().as_secs_f64() * 1e3;
    res.graph_memory_bytes = c.gpu.graph_memory_bytes(&graph);
    res.memory = c.gpu.graph_memory(&graph);
    res.nodes = graph.nodes.clone();
    let prog_seq = program.seq;

    // Correctness: a full random batch through the graph, a few rows on the CPU.
    let rows = random_rows(model, batch, prog_seq, &mut c.rng);
    let out = c
        .gpu
        .launch(&mut graph, &rows)
        .and_then(|p| c.gpu.collect(p));
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            res.error = Some(format!("replay: {e}"));
            return (res, Some(graph));
        }
    };
    let dim = model.info.output_dim;
    let idx = spread(batch, c.args.check_rows);
    let gpu_rows: Vec<f32> = idx
        .iter()
        .flat_map(|&i| out[i * dim..(i + 1) * dim].iter().copied())
        .collect();
    match cpu_reference(c.cpu, model, cw, &subset(&rows, &idx), prog_seq) {
        Ok(cpu_rows) => {
            let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
            res.check = Some(compare(mc.kind, &gpu_rows, &cpu_rows, dim, th));
        }
        Err(e) => res.error = Some(fmt_err(e)),
    }

    // Latency: one batch at a time, launch → collect.
    let inputs: Vec<BatchRows> = (0..4)
        .map(|_| random_rows(model, batch, prog_seq, &mut c.rng))
        .collect();
    let mut samples = Vec::with_capacity(c.args.iters);
    for i in 0..c.args.warmup + c.args.iters {
        let t = Instant::now();
        let r = c
            .gpu
            .launch(&mut graph, &inputs[i % inputs.len()])
            .and_then(|p| c.gpu.collect(p));
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Err(e) = r {
            res.error = Some(format!("timed replay: {e}"));
            return (res, Some(graph));
        }
        if i >= c.args.warmup {
            samples.push(us);
        }
    }
    res.latency = Latency::from_samples(samples);
    // The replay alone, for small graphs only: there the copies are a
    // large share of a replay, and timing large ones again would stretch
    // the check's bounded run.
    if res.latency.median_us < REPLAY_ONLY_BELOW_US {
        match c.gpu.time_replay_only(&graph, c.args.warmup, c.args.iters) {
            Ok(s) => res.replay_only = Latency::from_samples(s),
            Err(e) => {
                res.error = Some(format!("replay alone: {e}"));
                return (res, Some(graph));
            }
        }
    }

    // Throughput: two batches in flight.
    let n = c.args.iters.max(2);
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    for i in 0..n {
        match c.gpu.launch(&mut graph, &inputs[i % inputs.len()]) {
            Ok(p) => pending.push_back(p),
            Err(e) => {
                res.error = Some(format!("pipelined replay: {e}"));
                return (res, Some(graph));
            }
        }
        if pending.len() >= 2 {
            if let Some(p) = pending.pop_front() {
                if let Err(e) = c.gpu.collect(p) {
                    res.error = Some(format!("pipelined replay: {e}"));
                    return (res, Some(graph));
                }
            }
        }
    }
    while let Some(p) = pending.pop_front() {
        if let Err(e) = c.gpu.collect(p) {
            res.error = Some(format!("pipelined replay: {e}"));
            return (res, Some(graph));
        }
    }
    res.throughput_rows_per_s = (n * batch) as f64 / t.elapsed().as_secs_f64();
    if mc.kind == ModelKind::Bert && profiles_padded(c.args, batch, seq) {
        match c
            .gpu
            .profile_program_on(&model.weights, gw, &program, Some(&inputs[0]), 20)
        {
            Ok(p) => {
                print_profile(&bucket_label(&res), &p);
                res.profile = p;
            }
            Err(e) => res.error = Some(format!("profile: {e}")),
        }
    }
    (res, Some(graph))
}

/// One reference item: token ids and embedding, or an MLP batch.
enum RefItem {
    Tokens(Vec<u32>, Vec<f32>),
    Batch(Vec<Vec<f32>>, Vec<Vec<f32>>),
}

/// Reads a reference file. Lines with `text` instead of `ids` (what
/// scripts/bench/torch-baseline.py writes) are tokenized with the model's own
/// tokenizer, as the daemon would.
fn read_reference(path: &std::path::Path, model: &Model) -> anyhow::Result<Vec<RefItem>> {
    let mut tokenizer = None;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let floats = |v: &serde_json::Value| -> Option<Vec<f32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect()
    };
    let mut items = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        let bad = || {
            anyhow!(
                "{}:{}: expected ids+embedding, text+embedding or input+output",
                path.display(),
                i + 1
            )
        };
        if let (Some(ids), Some(emb)) = (v.get("ids"), v.get("embedding")) {
            let ids: Vec<u32> = ids
                .as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| x.as_u64().map(|u| u as u32))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            items.push(RefItem::Tokens(ids, floats(emb).ok_or_else(bad)?));
        } else if let (Some(t), Some(emb)) =
            (v.get("text").and_then(|t| t.as_str()), v.get("embedding"))
        {
            if tokenizer.is_none() {
                let (Some(file), InputSpec::Tokens { max_seq_len, .. }) =
                    (&model.info.tokenizer_path, &model.info.input)
                else {
                    bail!(
                        "{}: texts, but model {} has no tokenizer",
                        path.display(),
                        model.info.name
                    );
                };
                tokenizer = Some(crate::daemon::tokenize::TextTokenizer::load(
                    file,
                    *max_seq_len,
                )?);
            }
            let tok = tokenizer.as_ref().expect("loaded above");
            let ids = tok.encode(&[t], true)?.remove(0);
            items.push(RefItem::Tokens(ids, floats(emb).ok_or_else(bad)?));
        } else if let (Some(inp), Some(out)) = (v.get("input"), v.get("output")) {
            let rows = |x: &serde_json::Value| -> Option<Vec<Vec<f32>>> {
                x.as_array()?.iter().map(floats).collect()
            };
            items.push(RefItem::Batch(
                rows(inp).ok_or_else(bad)?,
                rows(out).ok_or_else(bad)?,
            ));
        } else {
            return Err(bad());
        }
    }
    Ok(items)
}

/// Runs a reference file through the model's graphs (or the eager path).
fn check_reference(
    c: &mut Ctx<'_>,
    mc: &ModelConfig,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    graphs: &mut [((usize, usize), CapturedGraph)],
    path: &std::path::Path,
) -> ReferenceResult {
    let mut res = ReferenceResult {
        path: path.to_path_buf(),
        items: 0,
        eager_items: 0,
        check: None,
        mean_cosine: None,
        error: None,
    };
    let items = match read_reference(path, model) {
        Ok(i) => i,
        Err(e) => {
            res.error = Some(e.to_string());
            return res;
        }
    };
    let dim = model.info.output_dim;
    let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
    // The smallest captured graph that holds `n` rows of `len` tokens.
    let pick = |graphs: &[((usize, usize), CapturedGraph)], n: usize, len: usize| {
        graphs
            .iter()
            .enumerate()
            .filter(|(_, ((b, s), _))| *b >= n && *s >= len)
            .min_by_key(|(_, ((b, s), _))| (*s, *b))
            .map(|(i, _)| i)
    };
    let mut gpu_all: Vec<f32> = Vec::new();
    let mut ref_all: Vec<f32> = Vec::new();
    let result: anyhow::Result<()> = (|| {
        match mc.kind {
            ModelKind::Bert => {
                let mut texts: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
                for it in items {
                    if let RefItem::Tokens(ids, emb) = it {
                        if emb.len() != dim {
                            bail!("embedding of {} values for a model of {dim}", emb.len());
                        }
                        texts.push((ids, emb));
                    }
                }
                let max_batch = graphs.iter().map(|((b, _), _)| *b).max().unwrap_or(1);
                // Group by the seq bucket they fall into, keep the file order inside.
                let mut order: Vec<usize> = (0..texts.len()).collect();
                let seq_buckets: Vec<usize> = graphs.iter().map(|((_, s), _)| *s).collect();
                let bucket_of =
                    |len: usize| seq_buckets.iter().copied().filter(|s| *s >= len).min();
                order.sort_by_key(|&i| bucket_of(texts[i].0.len()).unwrap_or(usize::MAX));
                let mut out = vec![0f32; texts.len() * dim];
                let mut i = 0;
                while i < order.len() {
                    let len0 = texts[order[i]].0.len();
                    let bucket = bucket_of(len0);
                    let mut j = i;
                    while j < order.len()
                        && j - i < max_batch
                        && bucket_of(texts[order[j]].0.len()) == bucket
                    {
                        j += 1;
                    }
                    let chunk: Vec<usize> = order[i..j].to_vec();
                    let longest = chunk.iter().map(|&k| texts[k].0.len()).max().unwrap_or(1);
                    let rows =
                        BatchRows::Tokens(chunk.iter().map(|&k| texts[k].0.clone()).collect());
                    let values = match pick(graphs, chunk.len(), longest) {
                        Some(g) => {
                            let graph = &mut graphs[g].1;
                            c.gpu.launch(graph, &rows).and_then(|p| c.gpu.collect(p))
                        }
                        None => {
                            res.eager_items += chunk.len();
                            let program = model.program(chunk.len(), longest);
                            c.gpu.run_eager(model, gw, &program, &rows)
                        }
                    }
                    .map_err(|e| anyhow!("{e}"))?;
                    for (r, &k) in chunk.iter().enumerate() {
                        out[k * dim..(k + 1) * dim]
                            .copy_from_slice(&values[r * dim..(r + 1) * dim]);
                    }
                    i = j;
                }
                for (k, (_, emb)) in texts.iter().enumerate() {
                    gpu_all.extend_from_slice(&out[k * dim..(k + 1) * dim]);
                    ref_all.extend_from_slice(emb);
                }
                res.items = texts.len();
            }
            ModelKind::Mlp => {
                for it in items {
                    if let RefItem::Batch(inp, outp) = it {
                        let n = inp.len();
                        let features = inp.first().map(Vec::len).unwrap_or(0);
                        let rows = BatchRows::Features {
                            features,
                            data: inp.concat(),
                        };
                        let values = match pick(graphs, n, 1) {
                            Some(g) => {
                                let graph = &mut graphs[g].1;
                                c.gpu.launch(graph, &rows).and_then(|p| c.gpu.collect(p))
                            }
                            None => {
                                res.eager_items += n;
                                c.gpu.run_eager(model, gw, &model.program(n, 1), &rows)
                            }
                        }
                        .map_err(|e| anyhow!("{e}"))?;
                        gpu_all.extend_from_slice(&values);
                        ref_all.extend(outp.concat());
                        res.items += n;
                    }
                }
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            let check = compare(mc.kind, &gpu_all, &ref_all, dim, th);
            if mc.kind == ModelKind::Bert && res.items > 0 {
                let mut sum = 0.0;
                for (g, r) in gpu_all.chunks(dim).zip(ref_all.chunks(dim)) {
                    sum += compare(mc.kind, g, r, dim, th).value;
                }
                res.mean_cosine = Some(sum / res.items as f64);
            }
            res.check = Some(check);
        }
        Err(e) => res.error = Some(e.to_string()),
    }
    res
}

fn check_eager(
    c: &mut Ctx<'_>,
    mc: &ModelConfig,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    cw: &<CpuBackend as Backend>::Weights,
) -> EagerResult {
    let (batch, seq) = eager_shape(mc, model);
    let mut res = EagerResult {
        batch,
        seq,
        gpu_ms: 0.0,
        check: None,
        error: None,
    };
    let rows = random_rows(model, batch, seq, &mut c.rng);
    // Packed models run the packed program at the batch's exact token count.
    let program = if mc.batching_mode() == BatchingMode::Packed {
        model.eager_program(&rows, true)
    } else {
        model.program(batch, seq)
    };
    if let Err(e) = program.validate(&model.weights) {
        res.error = Some(format!("eager: {e}"));
        return res;
    }
    // Once to warm up (plans, buffers), once timed.
    let mut out = Err(anyhow!("not run"));
    for _ in 0..2 {
        let t = Instant::now();
        out = c
            .gpu
            .run_eager(model, gw, &program, &rows)
            .map_err(|e| anyhow!("{e}"));
        res.gpu_ms = t.elapsed().as_secs_f64() * 1e3;
        if out.is_err() {
            break;
        }
    }
    let cpu = if program.is_packed() {
        c.cpu
            .run_eager(model, cw, &program, &rows)
            .map_err(|e| anyhow!("CPU reference: {e}"))
    } else {
        cpu_reference(c.cpu, model, cw, &rows, program.seq)
    };
    match out {
        Ok(out) => match cpu {
            Ok(cpu) => {
                let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
                res.check = Some(compare(mc.kind, &out, &cpu, model.info.output_dim, th));
            }
            Err(e) => res.error = Some(fmt_err(e)),
        },
        Err(e) => res.error = Some(format!("eager: {e}")),
    }
    res
}

/// The packed buckets of a model, largest first (as the worker captures them).
fn packed_buckets(mc: &ModelConfig, args: &BackendCheckArgs) -> Vec<Bucket> {
    mc.grid()
        .largest_first()
        .into_iter()
        .filter(|b| args.budgets.is_empty() || args.budgets.contains(&b.tokens()))
        .collect()
}

/// A random token sequence of `len` ids (`[CLS]`/`[SEP]`-like ends when the
/// vocabulary has them).
fn random_ids(vocab: usize, len: usize, rng: &mut Rng) -> Vec<u32> {
    let vocab = vocab.max(1);
    let lo = if vocab > 2000 { 1000 } else { 0 };
    let mut ids: Vec<u32> = (0..len).map(|_| rng.range(lo, vocab - 1) as u32).collect();
    if vocab > 103 && len >= 2 {
        ids[0] = 101;
        ids[len - 1] = 102;
    }
    ids
}

/// The batch shapes a packed graph is checked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PackedShape {
    /// Random lengths filling the budget exactly (or up to its sequences):
    /// three in four up to 64 tokens, the rest up to the longest allowed.
    Fill,
    /// One sequence of 16 tokens (fewer if the budget is smaller).
    One,
    /// As many sequences as the graph holds, equally long.
    Many,
    /// One sequence of the longest length, and empty sequences.
    LongAndEmpty,
}

impl PackedShape {
    fn name(self) -> &'static str {
        match self {
            PackedShape::Fill => "fill",
            PackedShape::One => "one",
            PackedShape::Many => "many",
            PackedShape::LongAndEmpty => "long+empty",
        }
    }

    /// Sequence lengths of this shape for a budget of `tokens` slots, at most
    /// `seqs` sequences of at most `max_len` tokens.
    fn lens(self, tokens: usize, seqs: usize, max_len: usize, rng: &mut Rng) -> Vec<usize> {
        match self {
            PackedShape::Fill => {
                let mut lens = Vec::new();
                let mut left = tokens;
                while left > 0 && lens.len() < seqs {
                    let hi = if rng.range(0, 3) < 3 {
                        max_len.min(64)
                    } else {
                        max_len
                    };
                    let len = rng.range(1, hi.max(1)).min(left);
                    lens.push(len);
                    left -= len;
                }
                lens
            }
            PackedShape::One => vec![16.min(max_len)],
            PackedShape::Many => vec![(tokens / seqs).clamp(1, max_len); seqs],
            PackedShape::LongAndEmpty => {
                let mut lens = vec![max_len];
                lens.extend(std::iter::repeat_n(0, (seqs - 1).min(2)));
                if seqs >= 4 {
                    lens.insert(1, 0);
                }
                lens.truncate(seqs);
                lens
            }
        }
    }
}

fn packed_rows(model: &Model, lens: &[usize], rng: &mut Rng) -> BatchRows {
    let vocab = match &model.info.input {
        InputSpec::Tokens { vocab_size, .. } => *vocab_size,
        InputSpec::Features { .. } => 1,
    };
    BatchRows::Tokens(lens.iter().map(|&l| random_ids(vocab, l, rng)).collect())
}

/// Captures one packed bucket, compares its batches with the CPU backend
/// running the same packed program, and times it (see the module docs).
fn check_packed_bucket(
    c: &mut Ctx<'_>,
    mc: &ModelConfig,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    cw: &<CpuBackend as Backend>::Weights,
    bucket: Bucket,
) -> (BucketResult, Option<CapturedGraph>) {
    let Bucket::Packed { tokens, seqs } = bucket else {
        unreachable!("a packed bucket")
    };
    let mut res = BucketResult {
        bucket: bucket.to_string(),
        batch: seqs,
        seq: 0,
        tokens: Some(tokens),
        cases: Vec::new(),
        throughput_tokens_per_s: 0.0,
        throughput_seqs_per_s: 0.0,
        profile: Vec::new(),
        served: c.gpu.limits() == c.served,
        plan_kernels: 0,
        plan_matmuls: 0,
        capture_ms: 0.0,
        graph_memory_bytes: 0,
        memory: GraphMemory::default(),
        nodes: String::new(),
        check: None,
        latency: Latency::default(),
        replay_only: Latency::default(),
        throughput_rows_per_s: 0.0,
        error: None,
    };
    let program = match model.program_for(bucket) {
        Ok(p) => p,
        Err(e) => {
            res.error = Some(format!("program: {e}"));
            return (res, None);
        }
    };
    let facts = match program.validate(&model.weights) {
        Ok(f) => f,
        Err(e) => {
            res.error = Some(format!("capture: {e}"));
            return (res, None);
        }
    };
    let max_len = program.seq;
    res.seq = max_len;
    let t = Instant::now();
    let mut graph = match c.gpu.capture(model, gw, &program) {
        Ok(g) => g,
        Err(e) => {
            res.error = Some(format!("capture: {e}"));
            return (res, None);
        }
    };
    res.capture_ms = t.elapsed().as_secs_f64() * 1e3;
    res.graph_memory_bytes = c.gpu.graph_memory_bytes(&graph);
    res.memory = c.gpu.graph_memory(&graph);
    res.nodes = graph.nodes.clone();

    // Correctness: every row of each shape against the CPU's packed program.
    let dim = model.info.output_dim;
    let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
    for shape in [
        PackedShape::Fill,
        PackedShape::One,
        PackedShape::Many,
        PackedShape::LongAndEmpty,
    ] {
        let lens = shape.lens(tokens, seqs, max_len, &mut c.rng);
        let rows = packed_rows(model, &lens, &mut c.rng);
        if let Err(e) = facts.check_rows(&rows) {
            res.error = Some(format!("{}: {e}", shape.name()));
            return (res, Some(graph));
        }
        let gpu = c
            .gpu
            .launch(&mut graph, &rows)
            .and_then(|p| c.gpu.collect(p));
        let gpu = match gpu {
            Ok(o) => o,
            Err(e) => {
                res.error = Some(format!("replay ({}): {e}", shape.name()));
                return (res, Some(graph));
            }
        };
        let cpu = match c.cpu.run_eager(model, cw, &program, &rows) {
            Ok(o) => o,
            Err(e) => {
                res.error = Some(format!("CPU reference ({}): {e}", shape.name()));
                return (res, Some(graph));
            }
        };
        let check = compare(mc.kind, &gpu, &cpu, dim, th);
        let worse = res
            .check
            .as_ref()
            .is_none_or(|w| check.value < w.value || !check.pass);
        if worse {
            res.check = Some(check.clone());
        }
        res.cases.push(PackedCase {
            name: shape.name(),
            seqs: lens.len(),
            tokens: lens.iter().sum(),
            check,
        });
    }

    // Latency and throughput on random fills.
    let inputs: Vec<BatchRows> = (0..4)
        .map(|_| {
            let lens = PackedShape::Fill.lens(tokens, seqs, max_len, &mut c.rng);
            packed_rows(model, &lens, &mut c.rng)
        })
        .collect();
    let mut samples = Vec::with_capacity(c.args.iters);
    for i in 0..c.args.warmup + c.args.iters {
        let t = Instant::now();
        let r = c
            .gpu
            .launch(&mut graph, &inputs[i % inputs.len()])
            .and_then(|p| c.gpu.collect(p));
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Err(e) = r {
            res.error = Some(format!("timed replay: {e}"));
            return (res, Some(graph));
        }
        if i >= c.args.warmup {
            samples.push(us);
        }
    }
    res.latency = Latency::from_samples(samples);
    let n = c.args.iters.max(2);
    let (mut real_tokens, mut real_seqs) = (0usize, 0usize);
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    for i in 0..n {
        let rows = &inputs[i % inputs.len()];
        real_tokens += rows.tokens();
        real_seqs += rows.rows();
        match c.gpu.launch(&mut graph, rows) {
            Ok(p) => pending.push_back(p),
            Err(e) => {
                res.error = Some(format!("pipelined replay: {e}"));
                return (res, Some(graph));
            }
        }
        while pending.len() >= 2 || (i + 1 == n && !pending.is_empty()) {
            let Some(p) = pending.pop_front() else { break };
            if let Err(e) = c.gpu.collect(p) {
                res.error = Some(format!("pipelined replay: {e}"));
                return (res, Some(graph));
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    if c.args.profile {
        match c
            .gpu
            .profile_program_on(&model.weights, gw, &program, Some(&inputs[0]), 20)
        {
            Ok(p) => {
                let total: f64 = p.iter().map(|(_, us)| us).sum();
                let attention: f64 = p
                    .iter()
                    .filter(|(n, _)| n.starts_with("attention"))
                    .map(|(_, us)| us)
                    .sum();
                println!(
                    "    profile {}: {total:.1} µs of GPU time per batch, attention {attention:.1} µs ({} tokens, {} seqs)",
                    res.bucket,
                    inputs[0].tokens(),
                    inputs[0].rows()
                );
                print_profile(&bucket_label(&res), &p);
                res.profile = p;
            }
            Err(e) => {
                res.error = Some(format!("profile: {e}"));
                return (res, Some(graph));
            }
        }
    }
    res.throughput_rows_per_s = real_seqs as f64 / secs;
    res.throughput_seqs_per_s = real_seqs as f64 / secs;
    res.throughput_tokens_per_s = real_tokens as f64 / secs;
    (res, Some(graph))
}

/// Groups sequences of lengths `lens`, in order, into batches for packed
/// graphs of the given (bucket, longest sequence) shapes, as a packed
/// batcher does: each batch takes as many of the next sequences as the
/// largest graph holds, and runs in the smallest graph that holds it
/// (`Some(index into shapes)`); a sequence no graph holds runs alone on the
/// eager path (`None`).
fn packed_batches(
    lens: &[usize],
    shapes: &[(Bucket, usize)],
) -> Vec<(std::ops::Range<usize>, Option<usize>)> {
    let pick = |tokens: usize, n: usize, longest: usize| {
        shapes
            .iter()
            .enumerate()
            .filter(|(_, (b, ml))| b.tokens() >= tokens && b.rows() >= n && *ml >= longest)
            .min_by_key(|(_, (b, _))| b.tokens())
            .map(|(i, _)| i)
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let (mut j, mut tokens, mut longest) = (i, 0, 0);
        while j < lens.len() && pick(tokens + lens[j], j + 1 - i, longest.max(lens[j])).is_some() {
            tokens += lens[j];
            longest = longest.max(lens[j]);
            j += 1;
        }
        if j == i {
            out.push((i..i + 1, None));
            i += 1;
        } else {
            out.push((i..j, pick(tokens, j - i, longest)));
            i = j;
        }
    }
    out
}

/// The reference texts through a packed model's graphs, batched as the
/// daemon does: texts in file order into the smallest budget that holds
/// them (eager when a text is longer than every budget allows).
fn check_reference_packed(
    c: &mut Ctx<'_>,
    mc: &ModelConfig,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    graphs: &mut [(Bucket, CapturedGraph)],
    path: &std::path::Path,
) -> ReferenceResult {
    let mut res = ReferenceResult {
        path: path.to_path_buf(),
        items: 0,
        eager_items: 0,
        check: None,
        mean_cosine: None,
        error: None,
    };
    let items = match read_reference(path, model) {
        Ok(i) => i,
        Err(e) => {
            res.error = Some(e.to_string());
            return res;
        }
    };
    let dim = model.info.output_dim;
    let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
    let texts: Vec<(Vec<u32>, Vec<f32>)> = items
        .into_iter()
        .filter_map(|it| match it {
            RefItem::Tokens(ids, emb) if emb.len() == dim => Some((ids, emb)),
            _ => None,
        })
        .collect();
    let max_len_of = |b: Bucket| match model.program_for(b) {
        Ok(p) => p.seq,
        Err(_) => 0,
    };
    let shapes: Vec<(Bucket, usize)> = graphs.iter().map(|(b, _)| (*b, max_len_of(*b))).collect();
    let lens: Vec<usize> = texts.iter().map(|t| t.0.len()).collect();
    let batches = packed_batches(&lens, &shapes);
    let mut gpu_all: Vec<f32> = Vec::new();
    let mut ref_all: Vec<f32> = Vec::new();
    let result: anyhow::Result<()> = (|| {
        for (range, graph) in batches {
            let rows =
                BatchRows::Tokens(texts[range.clone()].iter().map(|t| t.0.clone()).collect());
            let values = match graph {
                Some(g) => {
                    let graph = &mut graphs[g].1;
                    c.gpu.launch(graph, &rows).and_then(|p| c.gpu.collect(p))
                }
                None => {
                    res.eager_items += rows.rows();
                    let program = model.eager_program(&rows, true);
                    c.gpu.run_eager(model, gw, &program, &rows)
                }
            }
            .map_err(|e| anyhow!("{e}"))?;
            gpu_all.extend_from_slice(&values);
            for t in &texts[range] {
                ref_all.extend_from_slice(&t.1);
            }
        }
        res.items = texts.len();
        Ok(())
    })();
    match result {
        Ok(()) => {
            let check = compare(mc.kind, &gpu_all, &ref_all, dim, th);
            if res.items > 0 {
                let sum: f64 = gpu_all
                    .chunks(dim)
                    .zip(ref_all.chunks(dim))
                    .map(|(g, r)| compare(mc.kind, g, r, dim, th).value)
                    .sum();
                res.mean_cosine = Some(sum / res.items as f64);
            }
            res.check = Some(check);
        }
        Err(e) => res.error = Some(e.to_string()),
    }
    res
}

/// A bucket's name in the table and in failures: `1x16`, or `1x16/off`
/// for the run with the `--compare-off` paths off.
fn bucket_label(b: &BucketResult) -> String {
    if b.served {
        b.bucket.clone()
    } else {
        format!("{}/off", b.bucket)
    }
}

/// Prints a reference result and records its failure.
fn report_reference(c: &mut Ctx<'_>, model: &str, what: &str, r: &ReferenceResult) {
    println!(
        "{:<14} {what} {} ({} items, {} eager): {}",
        model,
        r.path.display(),
        r.items,
        r.eager_items,
        match (&r.check, &r.error) {
            (_, Some(err)) => format!("ERROR {err}"),
            (Some(ch), None) => format!(
                "{} {:.6}{} {}",
                ch.metric,
                ch.value,
                r.mean_cosine
                    .map(|m| format!(" (mean {m:.6})"))
                    .unwrap_or_default(),
                if ch.pass { "ok" } else { "FAIL" }
            ),
            (None, None) => "-".into(),
        }
    );
    if let Some(err) = &r.error {
        c.failures.push(format!("{model} {what}: {err}"));
    } else if let Some(ch) = r.check.as_ref().filter(|ch| !ch.pass) {
        c.failures
            .push(format!("{model} {what}: {} {}", ch.metric, ch.value));
    }
}

/// The lines comparing each bucket run with the served paths and with the
/// `--compare-off` ones off: plan steps (kernels + matmuls), graph nodes,
/// replay p50 and their ratio.
pub fn path_comparison(buckets: &[BucketResult]) -> Vec<String> {
    let mut lines = Vec::new();
    for on in buckets.iter().filter(|b| b.served) {
        let Some(off) = buckets.iter().find(|b| !b.served && b.bucket == on.bucket) else {
            continue;
        };
        let steps = |b: &BucketResult| {
            format!(
                "{} steps ({} kernels + {} mm), graph {}",
                b.plan_kernels + b.plan_matmuls,
                b.plan_kernels,
                b.plan_matmuls,
                b.nodes
                    .split(' ')
                    .next()
                    .filter(|n| !n.is_empty())
                    .unwrap_or("-")
            )
        };
        let ratio = if off.latency.median_us > 0.0 && on.latency.median_us > 0.0 {
            format!("{:.2}x", on.latency.median_us / off.latency.median_us)
        } else {
            "-".into()
        };
        lines.push(format!(
            "{:<9} served {:>9.1} us, {} | off {:>9.1} us, {} | served/off {ratio}",
            on.bucket,
            on.latency.median_us,
            steps(on),
            off.latency.median_us,
            steps(off)
        ));
    }
    lines
}

fn print_path_comparison(model: &str, off: &[KernelPath], buckets: &[BucketResult]) {
    let lines = path_comparison(buckets);
    if lines.is_empty() {
        return;
    }
    let off: Vec<&str> = off.iter().map(|p| p.name()).collect();
    println!(
        "{model}: replay p50 with the served kernel paths and with {} off",
        off.join(",")
    );
    for l in lines {
        println!("  {l}");
    }
}

fn print_row(model: &str, dtype: DType, b: &BucketResult) {
    let check = match &b.check {
        Some(c) => format!(
            "{} {:.3e} {}",
            if c.metric == "min_cosine" {
                "cos"
            } else {
                "rel"
            },
            if c.metric == "min_cosine" {
                1.0 - c.value
            } else {
                c.value
            },
            if c.pass { "ok" } else { "FAIL" }
        ),
        None => "-".into(),
    };
    let packed = if b.tokens.is_some() {
        format!(
            "  ({} seqs max; {:.0} tokens/s, {:.0} seqs/s)",
            b.batch, b.throughput_tokens_per_s, b.throughput_seqs_per_s
        )
    } else {
        String::new()
    };
    println!(
        "{:<14} {:<5} {:>11} {:>9.1} {:>9.2} {:>6} {:<22} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>12.0}{packed}{}",
        model,
        dtype.as_str(),
        bucket_label(b),
        b.capture_ms,
        b.graph_memory_bytes as f64 / (1 << 20) as f64,
        b.nodes.split(' ').next().unwrap_or(""),
        check,
        b.latency.median_us,
        b.latency.p90_us,
        b.latency.p99_us,
        b.replay_only.median_us,
        b.throughput_rows_per_s,
        b.error
            .as_ref()
            .map(|e| format!("  ERROR {e}"))
            .unwrap_or_default()
    );
}

/// Runs the check; see the module docs.
pub fn run(args: BackendCheckArgs) -> anyhow::Result<()> {
    let mut config =
        Config::load(&args.config).with_context(|| format!("loading {}", args.config.display()))?;
    // The models run on the GPU: dtype = "auto" means f16 here.
    config.resolve_for_backend(true);
    let t0 = Instant::now();
    let options = crate::worker::executor::cuda_options(&config.devices);
    let mut gpu = CudaBackend::new(args.gpu, options)
        .map_err(|e| anyhow!("CUDA device {}: {e}", args.gpu))?;
    let init_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut cpu = CpuBackend::new(0, args.cpu_threads);
    let device = gpu.info();
    let kernels = format!("{:?}", gpu.kernel_origin());
    println!(
        "device: {} (cuda:{}, sm_{:?}, {}), init {init_ms:.0} ms, kernels {kernels}",
        device.name,
        device.ordinal,
        device.compute_capability,
        device.pci_bus_id.clone().unwrap_or_default()
    );
    let workspace_bytes = gpu.workspace_bytes();
    let served_limits = gpu.limits().without(&args.paths_off);
    gpu.set_limits(served_limits);
    let names = |paths: &[KernelPath]| {
        let v: Vec<&str> = paths.iter().map(|p| p.name()).collect();
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(",")
        }
    };
    println!(
        "kernel paths off: {}; compared against: {}",
        names(&served_limits.paths.off()),
        if args.no_compare {
            "nothing (--no-compare)".to_string()
        } else {
            format!("{} off", names(&args.compare_off))
        }
    );
    let mut ctx = Ctx {
        gpu: &mut gpu,
        cpu: &mut cpu,
        args: &args,
        served: served_limits,
        rng: Rng::new(args.seed),
        failures: Vec::new(),
    };
    let mut models = Vec::new();
    println!(
        "{:<14} {:<5} {:>11} {:>9} {:>9} {:>6} {:<22} {:>9} {:>9} {:>9} {:>9} {:>12}",
        "model",
        "dtype",
        "bucket",
        "capt_ms",
        "mem_MiB",
        "nodes",
        "check (1-cos | rel)",
        "p50_us",
        "p90_us",
        "p99_us",
        "alone_us",
        "rows/s"
    );
    for mc in &config.models {
        if !args.models.is_empty() && !args.models.contains(&mc.name) {
            continue;
        }
        let model =
            Model::load(&mc.spec()).with_context(|| format!("loading model {}", mc.name))?;
        let t = Instant::now();
        let gw = ctx
            .gpu
            .upload(&model)
            .map_err(|e| anyhow!("{}: upload to GPU: {e}", mc.name))?;
        let upload_ms = t.elapsed().as_secs_f64() * 1e3;
        let cw = ctx
            .cpu
            .upload(&model)
            .map_err(|e| anyhow!("{}: upload to CPU: {e}", mc.name))?;
        let mut mr = ModelResult {
            name: mc.name.clone(),
            kind: mc.kind,
            dtype: mc.dtype,
            allow_tf32: ctx.gpu.options().allow_tf32,
            weights_bytes: gw.bytes(),
            upload_ms,
            buckets: Vec::new(),
            eager: None,
            reference: None,
            reference_other: None,
        };
        // [0]: the graphs of the served kernel paths, [1]: those of the
        // `--compare-off` run.
        let mut graphs: [Vec<((usize, usize), CapturedGraph)>; 2] = Default::default();
        let mut packed_graphs: [Vec<(Bucket, CapturedGraph)>; 2] = Default::default();
        let shapes: Vec<Bucket> = match mc.batching_mode() {
            BatchingMode::Padded => buckets(mc, &args)
                .into_iter()
                .map(|(b, s)| Bucket::new(b, s))
                .collect(),
            BatchingMode::Packed => packed_buckets(mc, &args),
        };
        let tf32 = ctx.gpu.options().allow_tf32;
        'buckets: for bucket in shapes {
            let program = match bucket {
                Bucket::Padded { batch, seq } => Some(model.program(batch, seq)),
                Bucket::Packed { .. } => model.program_for(bucket).ok(),
            };
            let plan_of = |limits: Limits| {
                let p = program.as_ref()?;
                plan::plan(p, &model.weights, gw.dtype(), tf32, limits).ok()
            };
            let same_plan = |a: Limits, b: Limits| match (plan_of(a), plan_of(b)) {
                (Some(a), Some(b)) => a == b,
                // Let the capture report what does not plan.
                _ => false,
            };
            let runs = variants(&args, served_limits, same_plan);
            for (i, &(served, limits)) in runs.iter().enumerate() {
                ctx.gpu.set_limits(limits);
                let (mut b, graph) = match bucket {
                    Bucket::Padded { batch, seq } => {
                        check_bucket(&mut ctx, mc, &model, &gw, &cw, (batch, seq))
                    }
                    Bucket::Packed { .. } => {
                        check_packed_bucket(&mut ctx, mc, &model, &gw, &cw, bucket)
                    }
                };
                debug_assert_eq!(b.served, served);
                if let Some(p) = plan_of(limits) {
                    (b.plan_kernels, b.plan_matmuls) = (p.kernel_count(), p.matmul_count());
                }
                if let Some(g) = graph {
                    match bucket {
                        Bucket::Padded { batch, seq } => graphs[i].push(((batch, seq), g)),
                        Bucket::Packed { .. } => packed_graphs[i].push((bucket, g)),
                    }
                }
                print_row(&mc.name, mc.dtype, &b);
                let label = bucket_label(&b);
                if let Some(e) = &b.error {
                    ctx.failures.push(format!("{} {label}: {e}", mc.name));
                } else if let Some(c) = b.check.as_ref().filter(|c| !c.pass) {
                    ctx.failures.push(format!(
                        "{} {label}: {} {} beyond {}",
                        mc.name, c.metric, c.value, c.threshold
                    ));
                }
                let fatal = ctx.gpu.fault().is_some();
                mr.buckets.push(b);
                if fatal {
                    break 'buckets;
                }
            }
        }
        // The eager path and the references run with the served kernels.
        ctx.gpu.set_limits(served_limits);
        print_path_comparison(&mc.name, &args.compare_off, &mr.buckets);
        if !args.no_eager && ctx.gpu.fault().is_none() {
            let e = check_eager(&mut ctx, mc, &model, &gw, &cw);
            println!(
                "{:<14} eager {}x{}: {:.2} ms, {}",
                mc.name,
                e.batch,
                e.seq,
                e.gpu_ms,
                match (&e.check, &e.error) {
                    (_, Some(err)) => format!("ERROR {err}"),
                    (Some(c), None) => format!(
                        "{} {:.6} {}",
                        c.metric,
                        c.value,
                        if c.pass { "ok" } else { "FAIL" }
                    ),
                    (None, None) => "-".into(),
                }
            );
            if let Some(err) = &e.error {
                ctx.failures.push(format!("{} eager: {err}", mc.name));
            } else if let Some(c) = e.check.as_ref().filter(|c| !c.pass) {
                ctx.failures
                    .push(format!("{} eager: {} {}", mc.name, c.metric, c.value));
            }
            mr.eager = Some(e);
        }
        if let Some((_, path)) = args.references.iter().find(|(n, _)| *n == mc.name) {
            for i in 0..2 {
                let have = !graphs[i].is_empty() || !packed_graphs[i].is_empty();
                if ctx.gpu.fault().is_some() || (i == 1 && !have) {
                    continue;
                }
                let r = if mc.batching_mode() == BatchingMode::Packed {
                    check_reference_packed(&mut ctx, mc, &model, &gw, &mut packed_graphs[i], path)
                } else {
                    check_reference(&mut ctx, mc, &model, &gw, &mut graphs[i], path)
                };
                let what = if i == 0 {
                    "reference"
                } else {
                    "reference (compared paths off)"
                };
                report_reference(&mut ctx, &mc.name, what, &r);
                if i == 0 {
                    mr.reference = Some(r);
                } else {
                    mr.reference_other = Some(r);
                }
            }
        }
        if ctx.gpu.fault().is_some() {
            // Never drop graphs of a poisoned device.
            std::mem::forget(graphs);
            std::mem::forget(packed_graphs);
        } else {
            drop(graphs);
            drop(packed_graphs);
        }
        models.push(mr);
        if ctx.gpu.fault().is_some() {
            break;
        }
    }
    let failures = std::mem::take(&mut ctx.failures);
    let report = Report {
        device,
        kernels,
        init_ms,
        workspace_bytes,
        cpu_threads: cpu.threads(),
        models,
        pass: failures.is_empty(),
        failures: failures.clone(),
    };
    if let Some(path) = &args.out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(f) = gpu.fault() {
        // The device is poisoned: do not run its destructors.
        let msg = format!("device fault: {f}");
        std::mem::forget(gpu);
        bail!(msg);
    }
    if !failures.is_empty() {
        bail!(
            "{} check(s) failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        );
    }
    println!("all checks passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_percentiles() {
        let l = Latency::from_samples((1..=100).rev().map(|v| v as f64).collect());
        assert_eq!(l.iters, 100);
        assert_eq!(l.min_us, 1.0);
        assert_eq!(l.max_us, 100.0);
        assert!((l.median_us - 50.0).abs() <= 1.0);
        assert!((l.p99_us - 99.0).abs() <= 1.0);
        assert_eq!(Latency::from_samples(vec![]).iters, 0);
    }

    #[test]
    fn comparisons() {
        // Scores: a sign flip near zero is within bf16's tolerance; a
        // wrong score is not, whatever its sign.
        let c = compare(ModelKind::Bert, &[0.004, 3.0], &[-0.005, 3.02], 1, 0.99);
        assert!(c.pass && c.metric == "max_score_err", "{c:?}");
        let c = compare(ModelKind::Bert, &[0.004, 3.0], &[-0.005, 3.02], 1, 0.9999);
        assert!(!c.pass, "{c:?}");
        let c = compare(ModelKind::Bert, &[0.5], &[0.9], 1, 0.99);
        assert!(!c.pass && (c.value - 0.4).abs() < 1e-6, "{c:?}");
        let c = compare(ModelKind::Mlp, &[1.0, 2.0], &[1.0, 2.0], 2, 1e-5);
        assert!(c.pass && c.value == 0.0);
        let c = compare(ModelKind::Mlp, &[1.0, 2.1], &[1.0, 2.0], 2, 1e-5);
        assert!(!c.pass && (c.value - 0.05).abs() < 1e-6, "{c:?}");
        let c = compare(ModelKind::Mlp, &[f32::NAN, 2.0], &[1.0, 2.0], 2, 1e-5);
        assert!(!c.pass);
        let c = compare(
            ModelKind::Bert,
            &[1.0, 0.0, 0.0, 2.0],
            &[2.0, 0.0, 0.0, 1.0],
            2,
            0.999,
        );
        assert!(c.pass && c.rows == 2);
        let c = compare(ModelKind::Bert, &[1.0, 0.0], &[0.0, 1.0], 2, 0.999);
        assert!(!c.pass && c.value.abs() < 1e-12);
        assert!(!compare(ModelKind::Bert, &[1.0], &[1.0, 0.0], 2, 0.9).pass);
    }

    #[test]
    fn row_selection_and_subsets() {
        assert_eq!(spread(1, 4), vec![0]);
        assert_eq!(spread(8, 4), vec![0, 2, 4, 7]);
        assert_eq!(spread(3, 4), vec![0, 1, 2]);
        assert_eq!(spread(128, 2), vec![0, 127]);
        let rows = BatchRows::Features {
            features: 2,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        };
        assert_eq!(
            subset(&rows, &[0, 2]),
            BatchRows::Features {
                features: 2,
                data: vec![1.0, 2.0, 5.0, 6.0]
            }
        );
        let rows = BatchRows::Tokens(vec![vec![1], vec![2, 3], vec![4]]);
        assert_eq!(subset(&rows, &[1]), BatchRows::Tokens(vec![vec![2, 3]]));
    }

    #[test]
    fn random_tokens_fit_the_bucket() {
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let v = r.range(2, 16);
            assert!((2..=16).contains(&v));
            let u = r.unit();
            assert!((-1.0..1.0).contains(&u));
        }
    }

    #[test]
    fn profile_summary_groups_steps_by_kernel() {
        let steps: Vec<(String, f64)> = vec![
            ("embed_ln_vec_f16 grid 4x1x1".into(), 2.0),
            ("gemm_small_f16 grid 72x1x1".into(), 5.0),
            ("pool_ln_f16 grid 1x1x1".into(), 4.0),
            ("gemm_small_f16 grid 24x1x1".into(), 7.0),
            ("cublasLt f16 m16 n1152 k384 Bias".into(), 3.0),
        ];
        let (total, lines) = profile_summary(&steps);
        assert_eq!(total, 21.0);
        assert_eq!(
            lines,
            vec![
                "gemm_small_f16 2x 6.0 us (12.0)",
                "pool_ln_f16 1x 4.0 us (4.0)",
                "cublasLt f16 m16 n1152 k384 Bias 1x 3.0 us (3.0)",
                "embed_ln_vec_f16 1x 2.0 us (2.0)",
            ]
        );
    }

    fn test_args() -> BackendCheckArgs {
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
    fn compared_paths_run_after_the_served_ones() {
        let mut args = test_args();
        let served = Limits::new(48 << 10);
        let off = served.without(&KernelPath::SMALL_SHAPE);
        let differ = |_: Limits, _: Limits| false;
        let same = |_: Limits, _: Limits| true;
        assert_eq!(
            variants(&args, served, differ),
            vec![(true, served), (false, off)]
        );
        // Nothing the paths apply to: one run.
        assert_eq!(variants(&args, served, same), vec![(true, served)]);
        // The served paths have them off already: one run.
        assert_eq!(variants(&args, off, differ), vec![(true, off)]);
        // Switching off one path leaves the others to compare.
        let some = served.without(&[KernelPath::Pdl]);
        assert_eq!(variants(&args, some, differ)[1], (false, off));
        args.no_compare = true;
        assert_eq!(variants(&args, served, differ), vec![(true, served)]);
        args.no_compare = false;
        args.compare_off = vec![KernelPath::TcAttention];
        assert_eq!(
            variants(&args, served, differ)[1],
            (false, served.without(&[KernelPath::TcAttention]))
        );
    }

    #[test]
    fn path_comparison_pairs_the_runs_of_a_bucket() {
        let run = |bucket: &str, served: bool, us: f64, kernels: usize, mm: usize| BucketResult {
            bucket: bucket.into(),
            batch: 1,
            seq: 16,
            tokens: None,
            cases: Vec::new(),
            throughput_tokens_per_s: 0.0,
            throughput_seqs_per_s: 0.0,
            profile: Vec::new(),
            served,
            plan_kernels: kernels,
            plan_matmuls: mm,
            capture_ms: 0.0,
            graph_memory_bytes: 0,
            memory: GraphMemory::default(),
            nodes: format!("{} nodes [kernel:{}]", kernels + 2 * mm, kernels + 2 * mm),
            check: None,
            latency: Latency {
                median_us: us,
                ..Latency::default()
            },
            replay_only: Latency::default(),
            throughput_rows_per_s: 0.0,
            error: None,
        };
        let buckets = vec![
            run("8x16", true, 80.0, 20, 10),
            run("1x16", true, 60.0, 14, 0),
            run("1x16", false, 170.0, 26, 24),
            run("8x16", false, 100.0, 26, 24),
            run("128x128", true, 900.0, 26, 24),
        ];
        let lines = path_comparison(&buckets);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(
            lines[1],
            "1x16      served      60.0 us, 14 steps (14 kernels + 0 mm), graph 14 | \
             off     170.0 us, 50 steps (26 kernels + 24 mm), graph 74 | served/off 0.35x"
        );
        assert!(lines[0].starts_with("8x16 ") && lines[0].ends_with("served/off 0.80x"));
        assert_eq!(bucket_label(&buckets[2]), "1x16/off");
        assert_eq!(bucket_label(&buckets[1]), "1x16");
    }

    #[test]
    fn bucket_order_and_filters() {
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nkind = \"bert\"\npath = \"x\"\nbatch_buckets = [1, 8]\nseq_buckets = [16, 128]\n",
        )
        .unwrap();
        let mut args = test_args();
        assert!(!profiles_padded(&args, 1, 16));
        args.profile = true;
        assert!(profiles_padded(&args, 1, 16) && profiles_padded(&args, 128, 128));
        assert!(!profiles_padded(&args, 32, 128) && !profiles_padded(&args, 16, 1));
        args.profile = false;
        assert_eq!(
            parse_reference("m=a/b.jsonl"),
            Ok(("m".into(), PathBuf::from("a/b.jsonl")))
        );
        assert!(parse_reference("m").is_err() && parse_reference("=x").is_err());
        assert_eq!(
            buckets(&c.models[0], &args),
            vec![(8, 128), (8, 16), (1, 128), (1, 16)]
        );
        args.seqs = vec![16];
        assert_eq!(buckets(&c.models[0], &args), vec![(8, 16), (1, 16)]);
        assert!(threshold(ModelKind::Mlp, DType::F32, false) <= 1e-5);
        assert!(threshold(ModelKind::Bert, DType::F16, false) >= 0.999);
        // Packed models: their budgets, largest first, filtered.
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nkind = \"bert\"\npath = \"x\"\nbatching = \"packed\"\ntoken_budgets = [64, 512, 4096]\nmax_seqs_per_batch = 100\n",
        )
        .unwrap();
        args.seqs = vec![];
        assert_eq!(
            packed_buckets(&c.models[0], &args),
            vec![
                Bucket::packed(4096, 100),
                Bucket::packed(512, 100),
                Bucket::packed(64, 64)
            ]
        );
        args.budgets = vec![64];
        assert_eq!(
            packed_buckets(&c.models[0], &args),
            vec![Bucket::packed(64, 64)]
        );
    }

    #[test]
    fn reference_texts_are_batched_into_the_smallest_holding_graph() {
        let shapes = [(Bucket::packed(256, 4), 256), (Bucket::packed(64, 64), 64)];
        let lens = [10, 20, 30, 300, 5, 100, 100, 60, 1, 1, 1, 1, 1];
        let b = packed_batches(&lens, &shapes);
        assert_eq!(
            b,
            vec![
                (0..3, Some(1)),   // 60 tokens: the 64-token graph
                (3..4, None),      // longer than any graph allows: eager
                (4..7, Some(0)),   // 205 tokens; with the 60 it would be 265
                (7..12, Some(1)),  // 64 tokens exactly
                (12..13, Some(1)), // the rest
            ]
        );
        // Every text in exactly one batch, in order; every graph batch fits.
        let mut next = 0;
        for (r, g) in &b {
            assert_eq!(r.start, next);
            next = r.end;
            if let Some(g) = g {
                let (bucket, max_len) = shapes[*g];
                let l = &lens[r.clone()];
                assert!(l.iter().sum::<usize>() <= bucket.tokens() && l.len() <= bucket.rows());
                assert!(l.iter().all(|&x| x <= max_len));
            }
        }
        assert_eq!(next, lens.len());
        assert!(packed_batches(&[], &shapes).is_empty());
    }

    /// The packed check's batches fit the bucket they are made for.
    #[test]
    fn packed_shapes_fit_their_budget() {
        let mut rng = Rng::new(3);
        for (tokens, seqs, max_len) in [
            (64, 64, 64),
            (1024, 256, 256),
            (16384, 256, 256),
            (16, 4, 16),
        ] {
            for shape in [
                PackedShape::Fill,
                PackedShape::One,
                PackedShape::Many,
                PackedShape::LongAndEmpty,
            ] {
                for _ in 0..50 {
                    let lens = shape.lens(tokens, seqs, max_len, &mut rng);
                    let total: usize = lens.iter().sum();
                    assert!(!lens.is_empty() && lens.len() <= seqs, "{shape:?} {lens:?}");
                    assert!(total <= tokens && lens.iter().all(|&l| l <= max_len));
                    match shape {
                        // Filled exactly unless the sequences ran out first.
                        PackedShape::Fill => assert!(total == tokens || lens.len() == seqs),
                        PackedShape::Many => assert_eq!(lens.len(), seqs),
                        PackedShape::LongAndEmpty => {
                            assert_eq!(lens[0], max_len);
                            assert!(seqs < 2 || lens[1..].iter().all(|&l| l == 0));
                        }
                        PackedShape::One => assert_eq!(lens, vec![16.min(max_len)]),
                    }
                }
            }
        }
    }
}
