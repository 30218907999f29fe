//! `EmbedLayerNorm`: the word, position and token-type embeddings summed and
//! normalised, a warp per row (`embed_ln_vec`) where the row fits and the
//! positions are the plain index, else a block per row (`embed_ln`,
//! `embed_ln_padpos` for RoBERTa-style positions counted past the padding
//! id; `embed_ln_packed[_padpos]` in a packed program).

use super::norms::{ln_threads, ln_vec_fits, LNV_WARPS};
use super::planner::Planner;
use super::{suffix, Arg, Loc};
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{EmbedLayerNorm, PositionIds, Seqs};

/// The pad id of RoBERTa-style position ids as a kernel argument.
fn pad_arg(pad: u32) -> Result<i32, BackendError> {
    i32::try_from(pad).map_err(|_| BackendError::Unsupported(format!("padding id {pad}")))
}

impl Planner<'_> {
    /// `EmbedLayerNorm` over every token row of the program. A padded
    /// kernel finds a token's index in its sequence as `row % seq`; a
    /// packed one reads it from the positions input.
    pub(super) fn embed(&mut self, idx: usize, op: &EmbedLayerNorm) -> Result<usize, BackendError> {
        let (seqs, hidden) = (op.seqs, op.hidden);
        let t = self.compute;
        let rows = seqs.token_rows();
        let grid = u32::try_from(rows)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| {
                BackendError::Unsupported(format!("op {idx} (EmbedLayerNorm): {rows} token rows"))
            })?;
        let threads = ln_threads(hidden)?;
        let (dst, pending) = self.float_out(op.out, rows * hidden, t);
        // XLM-R / MPNet: positions counted from pad + 1 over the sequence's
        // non-pad ids (embed_pos.cu), one more argument.
        let pad = match op.position_ids {
            PositionIds::AfterPadding { pad } => Some(pad_arg(pad)?),
            PositionIds::Index => None,
        };
        let (positions, seq) = match seqs {
            Seqs::Padded { seq, .. } => (None, seq),
            Seqs::Packed { positions, .. } => (Some(Arg::Ptr(self.int_loc(positions))), 1),
        };
        let tables = [op.word, op.position, op.token_type];
        let table_rows = tables.map(|w| Arg::I32(self.rows_of(w) as i32));
        let weights = [op.word, op.position, op.token_type, op.gamma, op.beta];
        let weights = weights.map(|w| Arg::Ptr(Loc::Weight(w)));
        let tables = [&weights[..], &[Arg::F32(op.eps), Arg::Ptr(dst)]].concat();
        let mut args = vec![
            Arg::Ptr(self.int_loc(op.ids)),
            Arg::Ptr(self.int_loc(op.token_types)),
        ];
        if pad.is_none() && self.on(KernelPath::LnVec) && ln_vec_fits(hidden) {
            args.push(positions.unwrap_or(Arg::Null));
            args.extend(tables);
            args.extend([rows, seq, hidden].map(|v| Arg::I32(v as i32)));
            args.extend(table_rows);
            // Staging (source, destination, words, sync): set by
            // `Plan::with_staged_io` when this is a staged graph's first step.
            args.extend([Arg::Null, Arg::Null, Arg::I32(0), Arg::I32(0)]);
            self.kernel(
                format!("embed_ln_vec_{}", suffix(t)),
                (rows.div_ceil(LNV_WARPS) as u32, 1, 1),
                (32 * LNV_WARPS) as u32,
                0,
                args,
            );
        } else {
            args.extend(positions);
            args.extend(tables);
            if !seqs.is_packed() {
                args.push(Arg::I32(seq as i32));
            }
            args.push(Arg::I32(hidden as i32));
            args.extend(table_rows);
            args.extend(pad.map(Arg::I32));
            let layout = if seqs.is_packed() { "_packed" } else { "" };
            let padpos = if pad.is_some() { "_padpos" } else { "" };
            self.kernel(
                format!("embed_ln{layout}{padpos}_{}", suffix(t)),
                (grid, 1, 1),
                threads,
                0,
                args,
            );
        }
        self.finish_out(pending, rows * hidden)?;
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    #[test]
    fn vectorised_kernel_arguments() {
        let (a, w) = minilm(1);
        let plan = planned(&a.program(128, 128), &w, DType::F16, LIMITS);
        let rows = 128 * 128;
        let (_, grid, block, _, args) = kernel(&plan, "add_ln_vec_f16");
        assert_eq!((grid, block), (((rows / LNV_WARPS) as u32, 1, 1), 128));
        assert_eq!(&args[6..], &[Arg::I32(rows as i32), Arg::I32(384)]);
        let (_, grid, block, _, args) = kernel(&plan, "embed_ln_vec_f16");
        assert_eq!((grid, block), (((rows / LNV_WARPS) as u32, 1, 1), 128));
        assert_eq!(args.len(), 20);
        assert_eq!(args[2], Arg::Null); // positions: row % seq
        assert_eq!(
            &args[10..],
            &[
                Arg::I32(rows as i32),
                Arg::I32(128),
                Arg::I32(384),
                Arg::I32(1000),
                Arg::I32(512),
                Arg::I32(2),
                // No staging (a graph this large keeps the copies).
                Arg::Null,
                Arg::Null,
                Arg::I32(0),
                Arg::I32(0)
            ]
        );
        let (_, grid, block, _, args) = kernel(&plan, "bias_act_vec_f16");
        let n = rows * 1536;
        assert_eq!((grid, block), ((ew_blocks(n / 8), 1, 1), EW_THREADS));
        assert_eq!(args[0], args[2]); // in place
        assert_eq!(
            &args[3..],
            &[
                Arg::I32(n as i32),
                Arg::I32(8),
                Arg::I32(act_code(Activation::Gelu))
            ]
        );
        // Packed: the positions input.
        let plan = planned(&a.packed_program(1024, 32), &w, DType::F16, LIMITS);
        let args = kernel(&plan, "embed_ln_vec_f16").4;
        assert_eq!(args[2], Arg::Ptr(Loc::Input(plan.inputs[2].offset)));
        assert_eq!(plan.inputs[2].role, InputRole::Positions);
        assert_eq!(args[10], Arg::I32(1024));
        // Rows too wide for the vectorised LayerNorm keep the old kernels.
        assert!(ln_vec_fits(1024) && !ln_vec_fits(1028) && !ln_vec_fits(382));
    }
}
