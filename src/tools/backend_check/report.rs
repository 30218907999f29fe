//! What the check reports: the result types written to the JSON file (their
//! field names are what `scripts/gpu/` reads), the table and lines printed
//! to stdout, and the failures each result counts as.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::compare::Check;
use crate::backend::cuda::GraphMemory;
use crate::bucket::Bucket;
use crate::config::KernelPath;
use crate::gpu::DeviceInfo;
use crate::model::ModelKind;
use crate::tensor::DType;

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

impl BucketResult {
    /// A bucket's result before anything ran: a packed bucket's `seq` (its
    /// longest sequence) is known once its program is.
    pub(super) fn new(bucket: Bucket, served: bool) -> BucketResult {
        let (batch, seq, tokens) = match bucket {
            Bucket::Padded { batch, seq } => (batch, seq, None),
            Bucket::Packed { tokens, seqs } => (seqs, 0, Some(tokens)),
        };
        BucketResult {
            bucket: bucket.to_string(),
            batch,
            seq,
            tokens,
            cases: Vec::new(),
            throughput_tokens_per_s: 0.0,
            throughput_seqs_per_s: 0.0,
            profile: Vec::new(),
            served,
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
        }
    }

    /// The bucket's name in the table and in failures: `1x16`, or
    /// `1x16/off` for the run with the `--compare-off` paths off.
    pub(super) fn label(&self) -> String {
        if self.served {
            self.bucket.clone()
        } else {
            format!("{}/off", self.bucket)
        }
    }
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

impl ReferenceResult {
    pub(super) fn new(path: &Path) -> ReferenceResult {
        ReferenceResult {
            path: path.to_path_buf(),
            items: 0,
            eager_items: 0,
            check: None,
            mean_cosine: None,
            error: None,
        }
    }
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

/// The header of the table [`report_bucket`] prints a row of.
pub(super) fn print_header() {
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
}

/// Prints a bucket's row of the table and records its failure.
pub(super) fn report_bucket(
    failures: &mut Vec<String>,
    model: &str,
    dtype: DType,
    b: &BucketResult,
) {
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
        b.label(),
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
    let label = b.label();
    if let Some(e) = &b.error {
        failures.push(format!("{model} {label}: {e}"));
    } else if let Some(c) = b.check.as_ref().filter(|c| !c.pass) {
        failures.push(format!(
            "{model} {label}: {} {} beyond {}",
            c.metric, c.value, c.threshold
        ));
    }
}

/// Prints the eager-path result and records its failure.
pub(super) fn report_eager(failures: &mut Vec<String>, model: &str, e: &EagerResult) {
    println!(
        "{:<14} eager {}x{}: {:.2} ms, {}",
        model,
        e.batch,
        e.seq,
        e.gpu_ms,
        outcome(e.check.as_ref(), e.error.as_ref(), None)
    );
    failures.extend(failure(
        &format!("{model} eager"),
        e.check.as_ref(),
        e.error.as_ref(),
    ));
}

/// Prints a reference result and records its failure.
pub(super) fn report_reference(
    failures: &mut Vec<String>,
    model: &str,
    what: &str,
    r: &ReferenceResult,
) {
    println!(
        "{:<14} {what} {} ({} items, {} eager): {}",
        model,
        r.path.display(),
        r.items,
        r.eager_items,
        outcome(r.check.as_ref(), r.error.as_ref(), r.mean_cosine)
    );
    failures.extend(failure(
        &format!("{model} {what}"),
        r.check.as_ref(),
        r.error.as_ref(),
    ));
}

/// How a check ended, for the eager and reference lines: `ERROR ...`,
/// `metric value (mean m) ok|FAIL`, or `-` when nothing was compared.
fn outcome(check: Option<&Check>, error: Option<&String>, mean: Option<f64>) -> String {
    match (check, error) {
        (_, Some(err)) => format!("ERROR {err}"),
        (Some(ch), None) => format!(
            "{} {:.6}{} {}",
            ch.metric,
            ch.value,
            mean.map(|m| format!(" (mean {m:.6})")).unwrap_or_default(),
            if ch.pass { "ok" } else { "FAIL" }
        ),
        (None, None) => "-".into(),
    }
}

/// The failure of `what`, if any: its error, or a check that did not pass.
fn failure(what: &str, check: Option<&Check>, error: Option<&String>) -> Option<String> {
    match (check, error) {
        (_, Some(err)) => Some(format!("{what}: {err}")),
        (Some(ch), None) if !ch.pass => Some(format!("{what}: {} {}", ch.metric, ch.value)),
        _ => None,
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

pub(super) fn print_path_comparison(model: &str, off: &[KernelPath], buckets: &[BucketResult]) {
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

pub(super) fn print_profile(bucket: &str, steps: &[(String, f64)]) {
    let (total, lines) = profile_summary(steps);
    println!(
        "    profile {bucket}: {} steps, {total:.1} us of GPU time",
        steps.len()
    );
    for l in lines {
        println!("      {l}");
    }
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

    #[test]
    fn path_comparison_pairs_the_runs_of_a_bucket() {
        let run = |batch: usize, seq: usize, served: bool, us: f64, kernels: usize, mm: usize| {
            let mut b = BucketResult::new(Bucket::new(batch, seq), served);
            (b.plan_kernels, b.plan_matmuls) = (kernels, mm);
            b.nodes = format!("{} nodes [kernel:{}]", kernels + 2 * mm, kernels + 2 * mm);
            b.latency.median_us = us;
            b
        };
        let buckets = vec![
            run(8, 16, true, 80.0, 20, 10),
            run(1, 16, true, 60.0, 14, 0),
            run(1, 16, false, 170.0, 26, 24),
            run(8, 16, false, 100.0, 26, 24),
            run(128, 128, true, 900.0, 26, 24),
        ];
        let lines = path_comparison(&buckets);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(
            lines[1],
            "1x16      served      60.0 us, 14 steps (14 kernels + 0 mm), graph 14 | \
             off     170.0 us, 50 steps (26 kernels + 24 mm), graph 74 | served/off 0.35x"
        );
        assert!(lines[0].starts_with("8x16 ") && lines[0].ends_with("served/off 0.80x"));
        assert_eq!(buckets[2].label(), "1x16/off");
        assert_eq!(buckets[1].label(), "1x16");
    }

    #[test]
    fn results_start_empty_with_their_bucket_shape() {
        let b = BucketResult::new(Bucket::new(8, 128), true);
        assert_eq!(
            (b.bucket.as_str(), b.batch, b.seq, b.tokens),
            ("8x128", 8, 128, None)
        );
        let b = BucketResult::new(Bucket::packed(1024, 64), false);
        assert_eq!(
            (b.bucket.as_str(), b.batch, b.seq, b.tokens),
            ("1024t", 64, 0, Some(1024))
        );
        assert_eq!(b.label(), "1024t/off");
        assert!(b.check.is_none() && b.error.is_none() && b.cases.is_empty());
    }

    #[test]
    fn failures_name_the_error_or_the_failed_check() {
        let check = |value: f64, pass: bool| Check {
            metric: "min_cosine",
            value,
            threshold: 0.999,
            pass,
            rows: 2,
            max_abs_err: 0.0,
        };
        let err = "boom".to_string();
        assert_eq!(
            failure("m eager", Some(&check(0.5, false)), Some(&err)),
            Some("m eager: boom".into())
        );
        assert_eq!(
            failure("m eager", Some(&check(0.5, false)), None),
            Some("m eager: min_cosine 0.5".into())
        );
        assert_eq!(failure("m eager", Some(&check(1.0, true)), None), None);
        assert_eq!(failure("m eager", None, None), None);
        assert_eq!(
            outcome(Some(&check(0.9995, true)), None, Some(0.9999)),
            "min_cosine 0.999500 (mean 0.999900) ok"
        );
        assert_eq!(
            outcome(Some(&check(0.5, false)), None, None),
            "min_cosine 0.500000 FAIL"
        );
        assert_eq!(outcome(None, Some(&err), None), "ERROR boom");
        assert_eq!(outcome(None, None, None), "-");
    }
}
