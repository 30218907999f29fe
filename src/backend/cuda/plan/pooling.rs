//! `Pool`: a block per sequence averaging (or summing, or taking the max,
//! the first or the last of) its real tokens (`pool`, `pool_packed`; the
//! last token of a padded row is found by the block's threads together);
//! `_skip` variants start each
//! sequence past its prompt, and `_ln` ones apply the LayerNorm the last
//! `gemm_small` left to them ([`KernelPath::LnDefer`](crate::config::KernelPath::LnDefer))
//! as they read each token.

use super::planner::Planner;
use super::{suffix, Arg};
use crate::backend::BackendError;
use crate::model::program::{Pool, Seqs};
use crate::model::Pooling;
use crate::tensor::DType;

/// Threads per pooling block (`POOL_THREADS` in pool.cu).
pub const POOL_THREADS: u32 = 256;
/// Widest rows `pool_ln` / `pool_packed_ln` normalise (`POOL_CHUNK` in
/// pool.cu: a warp holds a whole token row).
pub const POOL_LN_MAX_HIDDEN: usize = 512;

/// The pooling code (`POOL_*` in pool.cu).
pub fn pool_code(p: Pooling) -> i32 {
    match p {
        Pooling::Mean => 0,
        Pooling::Cls => 1,
        Pooling::Max => 2,
        Pooling::Sum => 3,
        Pooling::LastToken => 4,
    }
}

impl Planner<'_> {
    /// `Pool`, a block per sequence, into f32 rows.
    pub(super) fn pool(&mut self, idx: usize, op: &Pool) -> Result<usize, BackendError> {
        let (x, hidden, skip, seqs) = (op.x, op.hidden, op.skip, op.seqs);
        let (count, rows) = (seqs.count(), seqs.token_rows());
        if count > i32::MAX as usize || rows > i32::MAX as usize {
            return Err(BackendError::Unsupported(format!(
                "op {idx} (Pool): {count} sequences of {rows} token rows"
            )));
        }
        let index = self.int_loc(seqs.index());
        let ln = self.take_deferred_ln(idx, x)?;
        let x_l = match &ln {
            Some(d) => d.pre_norm,
            None => self.float_in(x, rows * hidden, self.compute)?,
        };
        let (dst, pending) = self.float_out(op.out, count * hidden, DType::F32);
        let mut args = vec![Arg::Ptr(x_l), Arg::Ptr(index)];
        // include_prompt = false: the skip counts after the mask or offsets.
        if let Some(k) = skip {
            args.push(Arg::Ptr(self.int_loc(k)));
        }
        // The slots a padded kernel walks per row; a packed one's budget.
        let slots = match seqs {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed { tokens, .. } => tokens,
        };
        args.extend([
            Arg::Ptr(dst),
            Arg::I32(slots as i32),
            Arg::I32(hidden as i32),
            Arg::I32(pool_code(op.mode)),
            Arg::I32(op.normalize as i32),
        ]);
        let variant = match (skip, &ln) {
            (Some(_), _) => "_skip",
            (None, Some(d)) => {
                args.extend(d.args());
                args.push(Arg::I32(count as i32)); // out_rows: all
                "_ln"
            }
            (None, None) => "",
        };
        let layout = if seqs.is_packed() { "_packed" } else { "" };
        self.kernel(
            format!("pool{layout}{variant}_{}", suffix(self.compute)),
            (count as u32, 1, 1),
            POOL_THREADS,
            0,
            args,
        );
        self.finish_out(pending, count * hidden)?;
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::assert_defines;
    use super::*;

    #[test]
    fn pooling_codes_match_the_kernels() {
        assert_defines(
            "pool.cu",
            &[
                ("POOL_THREADS", POOL_THREADS as i64),
                ("POOL_MEAN", pool_code(Pooling::Mean) as i64),
                ("POOL_CLS", pool_code(Pooling::Cls) as i64),
                ("POOL_MAX", pool_code(Pooling::Max) as i64),
                ("POOL_SUM", pool_code(Pooling::Sum) as i64),
                ("POOL_LAST", pool_code(Pooling::LastToken) as i64),
            ],
        );
    }
}
