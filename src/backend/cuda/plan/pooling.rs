//! `Pool`: a block per sequence averaging (or summing, or taking the max,
//! the first or the last of) its real tokens (`pool`, `pool_packed`; the
//! last token of a padded row is found by the block's threads together);
//! `_skip` variants start each
//! sequence past its prompt, and `_ln` ones apply the LayerNorm the last
//! `gemm_small` left to them ([`KernelPath::LnDefer`](crate::config::KernelPath::LnDefer))
//! as they read each token. Sequences longer than [`PS_TOKENS`] are
//! spread over several blocks each (`pool_split`, `pool_split_packed`;
//! [`KernelPath::PoolSplit`]) for mean, max and sum pooling without a
//! deferred LayerNorm.

use super::planner::{Planner, MAX_COUNTERS};
use super::{suffix, Arg, Loc};
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{Pool, Seqs};
use crate::model::Pooling;
use crate::tensor::DType;

/// Threads per pooling block (`POOL_THREADS` in pool.cu).
pub const POOL_THREADS: u32 = 256;
/// Widest rows `pool_ln` / `pool_packed_ln` normalise (`POOL_CHUNK` in
/// pool.cu: a warp holds a whole token row).
pub const POOL_LN_MAX_HIDDEN: usize = 512;
/// Tokens a `pool_split` block reduces at least (`PS_TOKENS` in
/// pool_split.cu): sequences of at most this many stay on one block.
pub const PS_TOKENS: usize = 32;
/// Most blocks a sequence `pool_split` spreads over (its grid's rows): 512
/// tokens in 16 blocks of 32; longer sequences give each block more.
pub const PS_MAX_SPLITS: usize = 16;

/// Blocks per sequence of a `pool_split` grid for sequences of up to
/// `longest` tokens and rows of `hidden` values, or `None` where one block
/// a sequence (the plain kernels) is the plan: short sequences, rows the
/// kernel's 8-wide threads do not tile (`hidden % 8 == 0`, 64 ..= 2048),
/// or the cls and last-token modes, which read one token a sequence.
pub fn pool_splits(mode: Pooling, longest: usize, hidden: usize) -> Option<usize> {
    let splits = longest.div_ceil(PS_TOKENS).min(PS_MAX_SPLITS);
    let fits = hidden.is_multiple_of(8) && (64..=8 * POOL_THREADS as usize).contains(&hidden);
    let reduces = matches!(mode, Pooling::Mean | Pooling::Max | Pooling::Sum);
    (fits && reduces && splits >= 2).then_some(splits)
}

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
        // The slots a padded kernel walks per row; a packed one's budget.
        let slots = match seqs {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed { tokens, .. } => tokens,
        };
        let longest = match seqs {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed {
                tokens,
                max_seq_len,
                ..
            } => tokens.min(max_seq_len),
        };
        let splits = pool_splits(op.mode, longest, hidden)
            .filter(|_| ln.is_none() && self.on(KernelPath::PoolSplit))
            .filter(|_| self.counters + count <= MAX_COUNTERS);
        if let Some(splits) = splits {
            // Each block's partial row and token count, and a counter a
            // sequence (its last block resets it).
            let part = self.scratch(count * splits * hidden, DType::F32);
            let pcount = self.scratch(count * splits, DType::F32);
            let counter = Loc::Counter(self.counters);
            self.counters += count;
            let skip_l = skip.map_or(Arg::Null, |k| Arg::Ptr(self.int_loc(k)));
            let layout = if seqs.is_packed() { "_packed" } else { "" };
            self.kernel(
                format!("pool_split{layout}_{}", suffix(self.compute)),
                (count as u32, splits as u32, 1),
                POOL_THREADS,
                0,
                vec![
                    Arg::Ptr(x_l),
                    Arg::Ptr(index),
                    skip_l,
                    Arg::Ptr(dst),
                    Arg::I32(slots as i32),
                    Arg::I32(hidden as i32),
                    Arg::I32(pool_code(op.mode)),
                    Arg::I32(op.normalize as i32),
                    Arg::Ptr(part),
                    Arg::Ptr(pcount),
                    Arg::Ptr(counter),
                ],
            );
            self.finish_out(pending, count * hidden)?;
            return Ok(1);
        }
        let mut args = vec![Arg::Ptr(x_l), Arg::Ptr(index)];
        // include_prompt = false: the skip counts after the mask or offsets.
        if let Some(k) = skip {
            args.push(Arg::Ptr(self.int_loc(k)));
        }
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
    fn long_sequences_split_over_blocks_of_32_tokens() {
        assert_defines("pool_split.cu", &[("PS_TOKENS", PS_TOKENS as i64)]);
        assert_eq!(pool_splits(Pooling::Mean, 512, 768), Some(16));
        assert_eq!(pool_splits(Pooling::Sum, 128, 384), Some(4));
        assert_eq!(pool_splits(Pooling::Max, 33, 1024), Some(2));
        assert_eq!(pool_splits(Pooling::Mean, 8192, 1024), Some(PS_MAX_SPLITS));
        // One block: short sequences, one-token modes, rows it cannot tile.
        assert_eq!(pool_splits(Pooling::Mean, 32, 768), None);
        assert_eq!(pool_splits(Pooling::Cls, 512, 768), None);
        assert_eq!(pool_splits(Pooling::LastToken, 512, 768), None);
        assert_eq!(pool_splits(Pooling::Mean, 512, 20), None);
        assert_eq!(pool_splits(Pooling::Mean, 512, 388), None);
        assert_eq!(pool_splits(Pooling::Mean, 512, 4096), None);
        assert_eq!(pool_splits(Pooling::Mean, 512, 2048), Some(16));
    }

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
