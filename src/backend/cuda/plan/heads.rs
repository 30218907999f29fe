//! What follows pooling that is not a `Linear`: `Normalize`, the L2
//! normalisation after a sentence-transformers `Dense` module
//! (`l2norm_rows`, a block per row, in place). A head's Dense layers and a
//! cross-encoder's classifier are `Linear`s ([`super::linear`]).

use super::planner::Planner;
use super::{suffix, Arg};
use crate::backend::cuda::mem::align_up;
use crate::backend::BackendError;
use crate::model::program::Normalize;

/// Block size of `l2norm_rows` (rownorm.cu) for rows of `width` values: a
/// multiple of 32 (its block reduction), at most 256.
pub fn rownorm_threads(width: usize) -> u32 {
    align_up(width.max(1), 32).min(256) as u32
}

impl Planner<'_> {
    /// `Normalize`: in place, in the buffer's own type (the f32 output after
    /// the last Dense module, or an activation).
    pub(super) fn normalize(&mut self, idx: usize, op: &Normalize) -> Result<usize, BackendError> {
        let Normalize { x, rows, width } = *op;
        let grid = u32::try_from(rows)
            .ok()
            .filter(|_| width <= i32::MAX as usize)
            .ok_or_else(|| {
                BackendError::Unsupported(format!("op {idx} (Normalize): {rows} rows of {width}"))
            })?;
        let xt = self.dtype(x);
        self.kernel(
            format!("l2norm_rows_{}", suffix(xt)),
            (grid, 1, 1),
            rownorm_threads(width),
            0,
            vec![Arg::Ptr(self.locs[&x]), Arg::I32(width as i32)],
        );
        Ok(1)
    }
}
