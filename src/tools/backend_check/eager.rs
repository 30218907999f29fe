//! The eager path (no graph): one batch at a shape no bucket has, run on
//! the GPU and compared with the CPU backend.

use std::time::Instant;

use anyhow::anyhow;

use super::compare::{compare, threshold};
use super::context::{Ctx, Subject};
use super::inputs::random_rows;
use super::padded::cpu_reference;
use super::report::EagerResult;
use crate::backend::Backend;
use crate::config::{BatchingMode, ModelConfig};
use crate::model::{InputSpec, Model};

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

/// Runs one random batch of [`eager_shape`] on the GPU's eager path (for a
/// packed model, the packed program at the batch's exact token count),
/// timed, and compares it with the CPU.
pub(super) fn check_eager(
    c: &mut Ctx<'_>,
    Subject { mc, model, gw, cw }: Subject<'_>,
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
            Err(e) => res.error = Some(e.to_string()),
        },
        Err(e) => res.error = Some(format!("eager: {e}")),
    }
    res
}
