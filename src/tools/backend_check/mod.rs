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
//!
//! # Layout
//!
//! * this file: [`run`] and the loop over models and buckets;
//! * `args.rs`: the flags; `context.rs`: what the checks of a run share;
//! * `padded.rs`, `packed.rs`: one bucket of either kind, captured, checked
//!   and timed; `eager.rs`: the eager-path check;
//! * `timing.rs`: capture and the timing loops both kinds of bucket share;
//! * `reference.rs`: `--reference` files, batched as the daemon would;
//! * `inputs.rs`: the seeded random inputs; `compare.rs`: thresholds and
//!   [`compare()`];
//! * `report.rs`: the JSON result types, the table and lines printed, and
//!   the failures each result counts as.

use std::time::Instant;

use anyhow::{anyhow, bail, Context};

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::plan::{self, Limits};
use crate::backend::cuda::{CapturedGraph, CudaBackend};
use crate::backend::Backend;
use crate::bucket::Bucket;
use crate::config::{BatchingMode, Config, KernelPath, ModelConfig};
use crate::model::{Model, ModelKind};

mod args;
mod compare;
mod context;
mod eager;
mod inputs;
mod packed;
mod padded;
mod reference;
mod report;
mod timing;

pub use args::BackendCheckArgs;
pub use compare::{compare, Check};
pub use report::{
    path_comparison, profile_summary, BucketResult, EagerResult, Latency, ModelResult, PackedCase,
    ReferenceResult, Report, REPLAY_ONLY_BELOW_US,
};

use context::{Ctx, Subject};
use inputs::Rng;
use report::{print_header, print_path_comparison, report_bucket, report_eager, report_reference};

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
    print_header();
    for mc in &config.models {
        if !args.models.is_empty() && !args.models.contains(&mc.name) {
            continue;
        }
        models.push(check_model(&mut ctx, mc)?);
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

/// One model: loaded and uploaded to both backends, every bucket (each
/// with the served paths, then, where it differs, the `--compare-off`
/// paths off), the eager path and the reference file.
fn check_model(ctx: &mut Ctx<'_>, mc: &ModelConfig) -> anyhow::Result<ModelResult> {
    let model = Model::load(&mc.spec()).with_context(|| format!("loading model {}", mc.name))?;
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
    let s = Subject {
        mc,
        model: &model,
        gw: &gw,
        cw: &cw,
    };
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
    let mut graphs = check_buckets(ctx, s, &mut mr.buckets);
    // The eager path and the references run with the served kernels.
    ctx.gpu.set_limits(ctx.served);
    print_path_comparison(&mc.name, &ctx.args.compare_off, &mr.buckets);
    if !ctx.args.no_eager && ctx.gpu.fault().is_none() {
        let e = eager::check_eager(ctx, s);
        report_eager(&mut ctx.failures, &mc.name, &e);
        mr.eager = Some(e);
    }
    let args = ctx.args;
    if let Some((_, path)) = args.references.iter().find(|(n, _)| *n == mc.name) {
        for (i, graphs) in graphs.iter_mut().enumerate() {
            if ctx.gpu.fault().is_some() || (i == 1 && graphs.is_empty()) {
                continue;
            }
            let r = reference::check_reference(ctx, s, graphs, path);
            let what = if i == 0 {
                "reference"
            } else {
                "reference (compared paths off)"
            };
            report_reference(&mut ctx.failures, &mc.name, what, &r);
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
    }
    Ok(mr)
}

/// The buckets of a model, largest first (as the worker captures them):
/// the (batch, seq) grid of a padded model, the token budgets of a packed
/// one, less those the arguments leave out.
fn buckets(mc: &ModelConfig, args: &BackendCheckArgs) -> Vec<Bucket> {
    if mc.batching_mode() == BatchingMode::Packed {
        return mc
            .grid()
            .largest_first()
            .into_iter()
            .filter(|b| args.budgets.is_empty() || args.budgets.contains(&b.tokens()))
            .collect();
    }
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
    v.into_iter().map(|(b, s)| Bucket::new(b, s)).collect()
}

/// Every bucket of the model, largest first, each run with the served
/// kernel paths and, where their plans differ, with the `--compare-off`
/// paths off; stops at a device fault. The captured graphs come back: `[0]`
/// those of the served paths, `[1]` those of the `--compare-off` run.
fn check_buckets(
    ctx: &mut Ctx<'_>,
    s: Subject<'_>,
    results: &mut Vec<BucketResult>,
) -> [Vec<(Bucket, CapturedGraph)>; 2] {
    let mut graphs: [Vec<(Bucket, CapturedGraph)>; 2] = Default::default();
    let (mc, model) = (s.mc, s.model);
    let tf32 = ctx.gpu.options().allow_tf32;
    for bucket in buckets(mc, ctx.args) {
        let program = model.program_for(bucket).ok();
        let plan_of = |limits: Limits| {
            let p = program.as_ref()?;
            plan::plan(p, &model.weights, s.gw.dtype(), tf32, limits).ok()
        };
        let same_plan = |a: Limits, b: Limits| match (plan_of(a), plan_of(b)) {
            (Some(a), Some(b)) => a == b,
            // Let the capture report what does not plan.
            _ => false,
        };
        let runs = variants(ctx.args, ctx.served, same_plan);
        for (i, &(served, limits)) in runs.iter().enumerate() {
            ctx.gpu.set_limits(limits);
            let (mut b, graph) = check_bucket(ctx, s, bucket);
            debug_assert_eq!(b.served, served);
            if let Some(p) = plan_of(limits) {
                (b.plan_kernels, b.plan_matmuls) = (p.kernel_count(), p.matmul_count());
            }
            if let Some(g) = graph {
                graphs[i].push((bucket, g));
            }
            report_bucket(&mut ctx.failures, &mc.name, mc.dtype, &b);
            results.push(b);
            if ctx.gpu.fault().is_some() {
                return graphs;
            }
        }
    }
    graphs
}

/// Captures one bucket, padded or packed, checks it against the CPU and
/// times it (see the module docs); the graph comes back whenever it was
/// captured, whatever failed after.
fn check_bucket(
    ctx: &mut Ctx<'_>,
    s: Subject<'_>,
    bucket: Bucket,
) -> (BucketResult, Option<CapturedGraph>) {
    let mut res = BucketResult::new(bucket, ctx.gpu.limits() == ctx.served);
    let mut graph = None;
    let checked = match bucket {
        Bucket::Padded { batch, seq } => padded::check(ctx, s, (batch, seq), &mut res, &mut graph),
        Bucket::Packed { tokens, seqs } => {
            packed::check(ctx, s, (tokens, seqs), &mut res, &mut graph)
        }
    };
    if let Err(e) = checked {
        res.error = Some(e);
    }
    (res, graph)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compared_paths_run_after_the_served_ones() {
        let mut args = BackendCheckArgs::for_tests();
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
    fn bucket_order_and_filters() {
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nkind = \"bert\"\npath = \"x\"\nbatching = \"padded\"\nbatch_buckets = [1, 8]\nseq_buckets = [16, 128]\n",
        )
        .unwrap();
        let mut args = BackendCheckArgs::for_tests();
        let padded = |v: &[(usize, usize)]| -> Vec<Bucket> {
            v.iter().map(|&(b, s)| Bucket::new(b, s)).collect()
        };
        assert_eq!(
            buckets(&c.models[0], &args),
            padded(&[(8, 128), (8, 16), (1, 128), (1, 16)])
        );
        args.seqs = vec![16];
        assert_eq!(buckets(&c.models[0], &args), padded(&[(8, 16), (1, 16)]));
        // Packed models: their budgets, largest first, filtered.
        let c = Config::parse(
            "[[models]]\nname = \"m\"\nkind = \"bert\"\npath = \"x\"\nbatching = \"packed\"\ntoken_budgets = [64, 512, 4096]\nmax_seqs_per_batch = 100\n",
        )
        .unwrap();
        args.seqs = vec![];
        assert_eq!(
            buckets(&c.models[0], &args),
            vec![
                Bucket::packed(4096, 100),
                Bucket::packed(512, 100),
                Bucket::packed(64, 64)
            ]
        );
        args.budgets = vec![64];
        assert_eq!(buckets(&c.models[0], &args), vec![Bucket::packed(64, 64)]);
    }
}
