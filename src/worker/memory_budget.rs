//! The start-up memory budget: which of a model's buckets get a graph on
//! a device whose memory would not hold them all.
//!
//! Before a model's graphs are captured, each bucket's program is planned
//! without allocating ([`Backend::graph_need`]): the activation arena it
//! needs (shared by the model's graphs, so the largest counts once) and its
//! own static buffers. [`fit`] keeps buckets largest first while the arena's
//! growth plus every kept graph's buffers plus a reserve fit in the free
//! memory, and drops the rest: a device too small for the grid comes up
//! with a reduced grid (each dropped bucket logged with the numbers, its
//! batches run on a smaller graph or eagerly) instead of failing with an
//! out-of-memory error in the middle of a capture. Weights that do not fit
//! at all are refused before the upload, with the numbers
//! ([`check_weights`]).

use crate::backend::{Backend, BackendError, GraphNeed};
use crate::bucket::Bucket;
use crate::model::Model;

/// Device memory left free after the weights and graphs: cuBLAS's
/// workspace, CUDA graph executables and the eager path's own arenas.
pub const RESERVE_BYTES: u64 = 512 << 20;

/// What the budget decided for one model's grid.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fit {
    /// The buckets to capture, in the order given.
    pub kept: Vec<Bucket>,
    /// The buckets left out, with the bytes each would have needed more
    /// than was free.
    pub dropped: Vec<(Bucket, Need)>,
}

/// Why a bucket was dropped: what it needed and what was free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    pub needed: u64,
    pub free: u64,
}

/// Keeps `buckets` (largest first, each with its need) while they fit in
/// `free` bytes minus `reserve`, the model's arena being `arena_now` bytes
/// already.
pub fn fit(buckets: &[(Bucket, GraphNeed)], arena_now: u64, free: u64, reserve: u64) -> Fit {
    let budget = free.saturating_sub(reserve);
    let mut arena = arena_now;
    let mut fixed = 0u64;
    let mut out = Fit::default();
    for &(bucket, need) in buckets {
        let grown = arena.max(need.arena_bytes);
        let total = (grown - arena_now) + fixed + need.fixed_bytes;
        if total <= budget {
            arena = grown;
            fixed += need.fixed_bytes;
            out.kept.push(bucket);
        } else {
            out.dropped.push((
                bucket,
                Need {
                    needed: total,
                    free: budget,
                },
            ));
        }
    }
    out
}

/// Plans every bucket of `buckets` (largest first) and fits them in the
/// device's free memory; everything is kept on a backend with no budget.
pub fn plan_buckets<B: Backend>(
    backend: &mut B,
    model: &Model,
    weights: &B::Weights,
    buckets: &[Bucket],
) -> Result<Fit, BackendError> {
    let Some(free) = backend.free_memory()? else {
        return Ok(Fit {
            kept: buckets.to_vec(),
            dropped: Vec::new(),
        });
    };
    let mut needs = Vec::with_capacity(buckets.len());
    for &bucket in buckets {
        let program = model
            .program_for(bucket)
            .map_err(|e| BackendError::Unsupported(e.to_string()))?;
        needs.push((bucket, backend.graph_need(model, weights, &program)?));
    }
    let (_, arena_now) = backend.resident_bytes(weights);
    Ok(fit(&needs, arena_now, free, RESERVE_BYTES))
}

/// Refuses a model whose weights would not fit the device's free memory,
/// with the numbers, before an upload that would fail half way.
pub fn check_weights<B: Backend>(backend: &mut B, model: &Model) -> Result<(), String> {
    let free = match backend.free_memory() {
        Ok(Some(free)) => free,
        _ => return Ok(()),
    };
    let bytes = model.weights.parameter_count() as u64 * model.info.dtype.size() as u64;
    if bytes + RESERVE_BYTES > free {
        return Err(format!(
            "model {}: its weights take {} in {} and the device has {} free ({} kept in reserve): it does not fit (serve it on a larger device, in a smaller dtype, or fewer models per device)",
            model.info.name,
            mib(bytes),
            model.info.dtype,
            mib(free),
            mib(RESERVE_BYTES)
        ));
    }
    Ok(())
}

/// `n` bytes as MiB, for log lines and errors.
pub fn mib(n: u64) -> String {
    format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(arena: u64, fixed: u64) -> GraphNeed {
        GraphNeed {
            arena_bytes: arena,
            fixed_bytes: fixed,
        }
    }

    #[test]
    fn everything_fits_when_memory_is_plenty() {
        let buckets = [
            (Bucket::packed(4096, 64), need(1000, 10)),
            (Bucket::packed(1024, 64), need(300, 5)),
        ];
        let f = fit(&buckets, 0, 10_000, 100);
        assert_eq!(f.kept.len(), 2);
        assert!(f.dropped.is_empty());
    }

    /// The arena is shared: the largest bucket sets it, the smaller ones
    /// add only their own buffers.
    #[test]
    fn the_largest_buckets_are_dropped_first() {
        let buckets = [
            (Bucket::packed(16384, 64), need(4000, 40)),
            (Bucket::packed(4096, 64), need(1000, 10)),
            (Bucket::packed(1024, 64), need(300, 5)),
        ];
        // 1,500 free, 100 reserved: 4,040 does not fit, 1,010 + 5 does.
        let f = fit(&buckets, 0, 1_500, 100);
        assert_eq!(
            f.kept,
            vec![Bucket::packed(4096, 64), Bucket::packed(1024, 64)]
        );
        assert_eq!(
            f.dropped,
            vec![(
                Bucket::packed(16384, 64),
                Need {
                    needed: 4040,
                    free: 1400
                }
            )]
        );
        // An arena already as large as needed costs nothing more.
        let f = fit(&buckets, 4000, 200, 100);
        assert_eq!(f.kept.len(), 3, "{f:?}");
        // Nothing fits: everything is dropped (the model runs eagerly).
        let f = fit(&buckets, 0, 200, 100);
        assert!(f.kept.is_empty() && f.dropped.len() == 3);
    }
}
