//! Padded buckets: the (batch, seq) grid of a model, largest first. Each is
//! captured, a full random batch replayed and a few of its rows compared
//! with the CPU backend's eager run of the same rows, then timed.

use super::args::BackendCheckArgs;
use super::compare::{compare, threshold};
use super::context::{Ctx, Subject};
use super::inputs::{random_rows, spread, subset};
use super::report::{print_profile, BucketResult, Latency, REPLAY_ONLY_BELOW_US};
use super::timing;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CapturedGraph;
use crate::backend::Backend;
use crate::model::{BatchRows, Model, ModelKind};

/// Whether `--profile` times the padded bucket (batch, seq).
fn profiles_padded(args: &BackendCheckArgs, batch: usize, seq: usize) -> bool {
    args.profile
        && args
            .profile_buckets
            .iter()
            .any(|b| b.trim() == format!("{batch}x{seq}"))
}

/// The CPU backend's eager run of `rows` in a padded program of `seq` tokens.
pub(super) fn cpu_reference(
    cpu: &mut CpuBackend,
    model: &Model,
    cpu_weights: &<CpuBackend as Backend>::Weights,
    rows: &BatchRows,
    seq: usize,
) -> anyhow::Result<Vec<f32>> {
    let program = model.program(rows.rows(), seq);
    cpu.run_eager(model, cpu_weights, &program, rows)
        .map_err(|e| anyhow::anyhow!("CPU reference: {e}"))
}

/// Captures one padded bucket, checks it against the CPU and times it (see
/// the module docs). An `Err` ends the bucket with that error; `graph`
/// holds the graph once it is captured.
pub(super) fn check(
    c: &mut Ctx<'_>,
    Subject { mc, model, gw, cw }: Subject<'_>,
    (batch, seq): (usize, usize),
    res: &mut BucketResult,
    graph: &mut Option<CapturedGraph>,
) -> Result<(), String> {
    let program = model.program(batch, seq);
    program
        .validate(&model.weights)
        .map_err(|e| format!("capture: {e}"))?;
    let graph = graph.insert(timing::capture(c, model, gw, &program, res)?);
    let prog_seq = program.seq;

    // Correctness: a full random batch through the graph, a few rows on the CPU.
    let rows = random_rows(model, batch, prog_seq, &mut c.rng);
    let out = c
        .gpu
        .launch(graph, &rows)
        .and_then(|p| c.gpu.collect(p))
        .map_err(|e| format!("replay: {e}"))?;
    let dim = model.info.output_dim;
    let idx = spread(batch, c.args.check_rows);
    let gpu_rows: Vec<f32> = idx
        .iter()
        .flat_map(|&i| out[i * dim..(i + 1) * dim].iter().copied())
        .collect();
    // A CPU failure is reported, and the bucket is still timed.
    match cpu_reference(c.cpu, model, cw, &subset(&rows, &idx), prog_seq) {
        Ok(cpu_rows) => {
            let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
            res.check = Some(compare(mc.kind, &gpu_rows, &cpu_rows, dim, th));
        }
        Err(e) => res.error = Some(e.to_string()),
    }

    // Latency: one batch at a time, launch → collect.
    let inputs: Vec<BatchRows> = (0..4)
        .map(|_| random_rows(model, batch, prog_seq, &mut c.rng))
        .collect();
    res.latency = timing::round_trips(c, graph, &inputs)?;
    // The replay alone, for small graphs only: there the copies are a
    // large share of a replay, and timing large ones again would stretch
    // the check's bounded run.
    if res.latency.median_us < REPLAY_ONLY_BELOW_US {
        let samples = c
            .gpu
            .time_replay_only(graph, c.args.warmup, c.args.iters)
            .map_err(|e| format!("replay alone: {e}"))?;
        res.replay_only = Latency::from_samples(samples);
    }

    // Throughput: two batches in flight.
    let n = c.args.iters.max(2);
    let secs = timing::pipelined(c, graph, &inputs, n)?;
    res.throughput_rows_per_s = (n * batch) as f64 / secs;
    if mc.kind == ModelKind::Bert && profiles_padded(c.args, batch, seq) {
        let p = timing::profile(c, model, gw, &program, &inputs[0])?;
        print_profile(&res.label(), &p);
        res.profile = p;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_buckets_name_padded_shapes() {
        let mut args = BackendCheckArgs::for_tests();
        assert!(!profiles_padded(&args, 1, 16));
        args.profile = true;
        assert!(profiles_padded(&args, 1, 16) && profiles_padded(&args, 128, 128));
        assert!(!profiles_padded(&args, 32, 128) && !profiles_padded(&args, 16, 1));
    }
}
