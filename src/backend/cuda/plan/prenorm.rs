//! The ops of pre-norm encoders with rotary positions (ModernBERT), on the
//! kernels of `prenorm.cu`: `Embed` (`embed_rows`, a block per row),
//! `LayerNorm` (`ln_rows`, a block per row, bias optional), `Add`
//! (`add_rows`), `Rotary` (`rotary`, in place on q and k), `Gated`
//! (`gated`) and sliding-window `Attention` (`attention_window`, a warp per
//! query and head). One pass each, no fusion yet.
//!
//! The decoders' forms of the same ops go to decoder.cu's kernels
//! ([`super::decoder`]): an `Embed` with a scale (`embed_scaled`), an `Add`
//! the next `RmsNorm` reads (`rms_norm`, both in one pass), a `Rotary` over
//! grouped-query heads (`qk_norm_rope` without the norm); and their
//! attention off the tensor cores to `attention_band_<t>_d<N>`, the warp
//! per query with grouped-query heads and the causal/window band.

use super::attention::band_bounds;
use super::norms::ln_threads;
use super::planner::{ew_blocks, Planner, EW_THREADS};
use super::{act_code, suffix, Arg, Loc};
use crate::backend::BackendError;
use crate::model::program::{Add, Attention, Embed, GateOn, Gated, LayerNorm, Op, Rotary, Seqs};

/// Threads per block of `attention_window` (a warp per query and head).
const WINDOW_THREADS: u32 = 128;
/// The largest head size `attention_window` takes (`WATT_DMAX`).
pub const WINDOW_DMAX: usize = 128;
/// The head-size classes of `attention_band_<t>_d<N>`.
pub const BAND_DMAX: [usize; 2] = [128, 256];
/// Most frequency pairs a rotary head has (`ROTARY_MAX_HALF` in prenorm.cu).
pub(super) const ROTARY_MAX_HALF: usize = 128;
/// Threads of `rotary_ntk_<t>`'s block (one row).
const ROTARY_NTK_THREADS: u32 = 128;

/// `n` as a kernel's i32 argument, or the op's refusal.
pub(super) fn i32_of(n: usize, what: &str) -> Result<i32, BackendError> {
    i32::try_from(n).map_err(|_| BackendError::Unsupported(format!("{what}: {n} elements")))
}

impl Planner<'_> {
    /// A buffer an op updates in place: it must already hold the compute
    /// type (activations do).
    pub(super) fn in_place(
        &self,
        b: crate::model::program::BufId,
        what: &str,
    ) -> Result<Loc, BackendError> {
        if self.dtype(b) != self.compute {
            return Err(BackendError::Unsupported(format!(
                "{what}: updates a {} buffer in place",
                self.dtype(b)
            )));
        }
        Ok(self.locs[&b])
    }

    pub(super) fn embed_rows(&mut self, idx: usize, op: &Embed) -> Result<usize, BackendError> {
        let Embed {
            ids,
            word,
            out,
            hidden,
            scale,
            seqs,
        } = *op;
        if scale != 1.0 {
            return self.embed_scaled(idx, op);
        }
        let t = self.compute;
        let what = format!("op {idx} (Embed)");
        let rows = seqs.token_rows();
        let grid = u32::try_from(rows)
            .map_err(|_| BackendError::Unsupported(format!("{what}: {rows} rows")))?;
        let (dst, pending) = self.float_out(out, rows * hidden, t);
        let args = vec![
            Arg::Ptr(self.int_loc(ids)),
            Arg::Ptr(Loc::Weight(word)),
            Arg::Ptr(dst),
            Arg::I32(i32_of(hidden, &what)?),
            Arg::I32(i32_of(self.rows_of(word), &what)?),
        ];
        let threads = (hidden.next_multiple_of(32)).clamp(32, 256) as u32;
        self.kernel(
            format!("embed_rows_{}", suffix(t)),
            (grid, 1, 1),
            threads,
            0,
            args,
        );
        self.finish_out(pending, rows * hidden)?;
        Ok(1)
    }

    pub(super) fn layer_norm(&mut self, idx: usize, op: &LayerNorm) -> Result<usize, BackendError> {
        let LayerNorm {
            x,
            gamma,
            beta,
            eps,
            out,
            rows,
            hidden,
        } = *op;
        let t = self.compute;
        let what = format!("op {idx} (LayerNorm)");
        let threads = ln_threads(hidden)?;
        let grid = u32::try_from(rows)
            .map_err(|_| BackendError::Unsupported(format!("{what}: {rows} rows")))?;
        let elems = rows * hidden;
        let x_l = if x == out {
            self.in_place(x, &what)?
        } else {
            self.float_in(x, elems, t)?
        };
        let (dst, pending) = self.float_out(out, elems, t);
        let args = vec![
            Arg::Ptr(x_l),
            Arg::Ptr(Loc::Weight(gamma)),
            beta.map_or(Arg::Null, |b| Arg::Ptr(Loc::Weight(b))),
            Arg::F32(eps),
            Arg::Ptr(dst),
            Arg::I32(hidden as i32),
        ];
        self.kernel(
            format!("ln_rows_{}", suffix(t)),
            (grid, 1, 1),
            threads,
            0,
            args,
        );
        self.finish_out(pending, elems)?;
        Ok(1)
    }

    pub(super) fn add(&mut self, idx: usize, op: &Add) -> Result<usize, BackendError> {
        let Add {
            x,
            into,
            rows,
            width,
        } = *op;
        // An Add whose sum the next RmsNorm normalises: one pass for both.
        if let Some(Op::RmsNorm(norm)) = self.program.ops.get(idx + 1) {
            if let Some(consumed) = self.add_rms_norm(idx, op, norm)? {
                return Ok(consumed);
            }
        }
        let t = self.compute;
        let what = format!("op {idx} (Add)");
        let n = rows * width;
        let x_l = self.float_in(x, n, t)?;
        let into_l = self.in_place(into, &what)?;
        let args = vec![Arg::Ptr(x_l), Arg::Ptr(into_l), Arg::I32(i32_of(n, &what)?)];
        self.kernel(
            format!("add_rows_{}", suffix(t)),
            (ew_blocks(n), 1, 1),
            EW_THREADS,
            0,
            args,
        );
        Ok(1)
    }

    pub(super) fn rotary(&mut self, idx: usize, op: &Rotary) -> Result<usize, BackendError> {
        // Grouped-query heads: decoder.cu's rotary (without the q/k norm).
        if op.kv_heads != op.heads {
            return self.qk_norm_rope(idx, None, Some(op));
        }
        let what = format!("op {idx} (Rotary)");
        if op.head_dim / 2 > ROTARY_MAX_HALF {
            return Err(BackendError::Unsupported(format!(
                "{what}: head size {} (at most {})",
                op.head_dim,
                2 * ROTARY_MAX_HALF
            )));
        }
        let rows = op.seqs.token_rows();
        let pairs = rows * op.heads * op.head_dim;
        let qkv = self.in_place(op.qkv, &what)?;
        if let Some(n) = op.dynamic {
            // A block a row: its sequence's length decides its base.
            let (index, packed, seq, nseqs) = match op.seqs {
                Seqs::Padded { mask, seq, .. } => (self.int_loc(mask), 0, seq, 0),
                Seqs::Packed { offsets, seqs, .. } => (self.int_loc(offsets), 1, 1, seqs),
            };
            let args = vec![
                Arg::Ptr(qkv),
                Arg::Ptr(index),
                Arg::I32(packed),
                Arg::I32(i32_of(seq, &what)?),
                Arg::I32(i32_of(nseqs, &what)?),
                Arg::I32(op.heads as i32),
                Arg::I32(op.head_dim as i32),
                Arg::F32(op.theta),
                Arg::F32(op.scale),
                Arg::F32(n.factor),
                Arg::I32(i32_of(n.max_trained, &what)?),
            ];
            let blocks = u32::try_from(rows)
                .map_err(|_| BackendError::Unsupported(format!("{what}: {rows} rows")))?;
            let name = format!("rotary_ntk_{}", suffix(self.compute));
            self.kernel(name, (blocks, 1, 1), ROTARY_NTK_THREADS, 0, args);
            return Ok(1);
        }
        let (positions, seq) = match op.seqs {
            Seqs::Padded { seq, .. } => (Arg::Null, seq),
            Seqs::Packed { positions, .. } => (Arg::Ptr(self.int_loc(positions)), 1),
        };
        let args = vec![
            Arg::Ptr(qkv),
            positions,
            Arg::I32(seq as i32),
            Arg::I32(i32_of(rows, &what)?),
            Arg::I32(op.heads as i32),
            Arg::I32(op.head_dim as i32),
            Arg::F32(op.theta),
            Arg::F32(op.scale),
        ];
        let name = format!("rotary_{}", suffix(self.compute));
        self.kernel(name, (ew_blocks(pairs), 1, 1), EW_THREADS, 0, args);
        Ok(1)
    }

    pub(super) fn gated(&mut self, idx: usize, op: &Gated) -> Result<usize, BackendError> {
        let Gated {
            x,
            out,
            rows,
            width,
            act,
            on,
        } = *op;
        let t = self.compute;
        let what = format!("op {idx} (Gated)");
        let n = rows * width;
        let x_l = self.float_in(x, 2 * n, t)?;
        let (dst, pending) = self.float_out(out, n, t);
        let args = vec![
            Arg::Ptr(x_l),
            Arg::Ptr(dst),
            Arg::I32(i32_of(rows, &what)?),
            Arg::I32(i32_of(width, &what)?),
            Arg::I32(act_code(act)),
            Arg::I32(i32::from(on == GateOn::First)),
        ];
        i32_of(2 * n, &what)?;
        self.kernel(
            format!("gated_{}", suffix(t)),
            (ew_blocks(n), 1, 1),
            EW_THREADS,
            0,
            args,
        );
        self.finish_out(pending, n)?;
        Ok(1)
    }

    /// An `Attention` with a sliding window (no position bias: refused
    /// before planning).
    pub(super) fn attention_window(
        &mut self,
        idx: usize,
        op: &Attention,
        window: usize,
    ) -> Result<usize, BackendError> {
        let what = format!("op {idx} (Attention, window ±{window})");
        if op.head_dim == 0 || op.head_dim > WINDOW_DMAX {
            return Err(BackendError::Unsupported(format!(
                "{what}: head size {} (at most {WINDOW_DMAX})",
                op.head_dim
            )));
        }
        let window = Arg::I32(i32_of(window, &what)?);
        let name = format!("attention_window_{}", suffix(self.compute));
        self.warp_attention(op, &what, name, None, vec![window])
    }

    /// A decoder's `Attention` off the tensor cores (f32, other head sizes,
    /// `tc_attention` off): `attention_band_<t>_d<N>`, a warp per query over
    /// the keys of its band, any sequence length.
    pub(super) fn attention_band(
        &mut self,
        idx: usize,
        op: &Attention,
    ) -> Result<usize, BackendError> {
        let what = format!("op {idx} (Attention)");
        let Some(dmax) = BAND_DMAX.into_iter().find(|&d| op.head_dim <= d) else {
            return Err(BackendError::Unsupported(format!(
                "{what}: head size {} (at most {})",
                op.head_dim, BAND_DMAX[1]
            )));
        };
        let slots = match op.seqs {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed { tokens, .. } => tokens,
        };
        let (left, right) = band_bounds(op, slots);
        let name = format!("attention_band_{}_d{dmax}", suffix(self.compute));
        self.warp_attention(
            op,
            &what,
            name,
            Some(op.kv_heads),
            vec![Arg::I32(left), Arg::I32(right)],
        )
    }

    /// prenorm.cu's warp-per-query attention `name`: its arguments, with
    /// `kv_heads` after the heads where given, then `tail`.
    fn warp_attention(
        &mut self,
        op: &Attention,
        what: &str,
        name: String,
        kv_heads: Option<usize>,
        tail: Vec<Arg>,
    ) -> Result<usize, BackendError> {
        let t = self.compute;
        let (heads, head_dim, seqs) = (op.heads, op.head_dim, op.seqs);
        let rows = seqs.token_rows();
        let hd = heads * head_dim;
        let warps = rows * heads;
        let blocks =
            u32::try_from(warps.div_ceil((WINDOW_THREADS / 32) as usize)).map_err(|_| {
                BackendError::Unsupported(format!("{what}: {rows} rows x {heads} heads"))
            })?;
        let width = op.qkv_width();
        i32_of(rows * width, what)?;
        let (index, packed, seq, nseqs) = match seqs {
            Seqs::Padded { mask, seq, .. } => (self.int_loc(mask), 0, seq, 0),
            Seqs::Packed { offsets, seqs, .. } => (self.int_loc(offsets), 1, 1, seqs),
        };
        let q_l = self.float_in(op.qkv, rows * width, t)?;
        let (dst, pending) = self.float_out(op.out, rows * hd, t);
        let mut args = vec![
            Arg::Ptr(q_l),
            Arg::Ptr(index),
            Arg::Ptr(dst),
            Arg::I32(packed),
            Arg::I32(seq as i32),
            Arg::I32(nseqs as i32),
            Arg::I32(rows as i32),
            Arg::I32(heads as i32),
        ];
        args.extend(kv_heads.map(|k| Arg::I32(k as i32)));
        args.extend([Arg::I32(head_dim as i32), Arg::F32(op.score_scale())]);
        args.extend(tail);
        self.kernel(name, (blocks, 1, 1), WINDOW_THREADS, 0, args);
        self.finish_out(pending, rows * hd)?;
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::assert_defines;
    use super::*;

    #[test]
    fn window_sizes_match_the_kernels() {
        assert_defines(
            "prenorm.cu",
            &[
                ("WATT_DMAX", WINDOW_DMAX as i64),
                ("ROTARY_MAX_HALF", ROTARY_MAX_HALF as i64),
            ],
        );
    }
}
