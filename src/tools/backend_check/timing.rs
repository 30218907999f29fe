//! Capturing a bucket's graph and timing it, the same for padded and
//! packed buckets: capture time and memory, launch → collect one batch at
//! a time, two batches in flight, and the per-step GPU profile.

use std::collections::VecDeque;
use std::time::Instant;

use super::context::Ctx;
use super::report::{BucketResult, Latency};
use crate::backend::cuda::{CapturedGraph, CudaBackend};
use crate::backend::Backend;
use crate::model::{BatchRows, Model, Program};

/// Captures `program`'s graph, with its capture time, memory and nodes in `res`.
pub(super) fn capture(
    c: &mut Ctx<'_>,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    program: &Program,
    res: &mut BucketResult,
) -> Result<CapturedGraph, String> {
    let t = Instant::now();
    let graph = c
        .gpu
        .capture(model, gw, program)
        .map_err(|e| format!("capture: {e}"))?;
    res.capture_ms = t.elapsed().as_secs_f64() * 1e3;
    res.graph_memory_bytes = c.gpu.graph_memory_bytes(&graph);
    res.memory = c.gpu.graph_memory(&graph);
    res.nodes = graph.nodes.clone();
    Ok(graph)
}

/// Launch → collect of one batch at a time, `inputs` in turn: `--warmup`
/// round trips untimed, then `--iters` timed.
pub(super) fn round_trips(
    c: &mut Ctx<'_>,
    graph: &mut CapturedGraph,
    inputs: &[BatchRows],
) -> Result<Latency, String> {
    let mut samples = Vec::with_capacity(c.args.iters);
    for i in 0..c.args.warmup + c.args.iters {
        let t = Instant::now();
        let r = c
            .gpu
            .launch(graph, &inputs[i % inputs.len()])
            .and_then(|p| c.gpu.collect(p));
        let us = t.elapsed().as_secs_f64() * 1e6;
        if let Err(e) = r {
            return Err(format!("timed replay: {e}"));
        }
        if i >= c.args.warmup {
            samples.push(us);
        }
    }
    Ok(Latency::from_samples(samples))
}

/// `n` batches of `inputs` in turn with two in flight; the seconds they took.
pub(super) fn pipelined(
    c: &mut Ctx<'_>,
    graph: &mut CapturedGraph,
    inputs: &[BatchRows],
    n: usize,
) -> Result<f64, String> {
    let failed = |e| format!("pipelined replay: {e}");
    let t = Instant::now();
    let mut pending = VecDeque::new();
    for i in 0..n {
        pending.push_back(
            c.gpu
                .launch(graph, &inputs[i % inputs.len()])
                .map_err(failed)?,
        );
        if pending.len() >= 2 {
            if let Some(p) = pending.pop_front() {
                c.gpu.collect(p).map_err(failed)?;
            }
        }
    }
    while let Some(p) = pending.pop_front() {
        c.gpu.collect(p).map_err(failed)?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// With `--profile`: every step of one batch of `rows`, timed on its own
/// (mean GPU µs of 20 runs).
pub(super) fn profile(
    c: &mut Ctx<'_>,
    model: &Model,
    gw: &<CudaBackend as Backend>::Weights,
    program: &Program,
    rows: &BatchRows,
) -> Result<Vec<(String, f64)>, String> {
    c.gpu
        .profile_program_on(&model.weights, gw, program, Some(rows), 20)
        .map_err(|e| format!("profile: {e}"))
}
