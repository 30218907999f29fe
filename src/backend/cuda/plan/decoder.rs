//! The decoders' own ops (Qwen3-Embedding, EmbeddingGemma) on decoder.cu's
//! kernels, fused with their neighbours where the program allows:
//!
//! * `RmsNorm` — `rms_norm_<t>`, a block per row ([`rms_threads`]). The
//!   same kernel also takes the residual `Add` around it: `Add` then the
//!   `RmsNorm` of its sum (Qwen3's every sublayer boundary, planned from the
//!   `Add`, [`Planner::add_rms_norm`]), and `RmsNorm` then `Add` of its
//!   output into the residual (Gemma's post-norms), with the next sublayer's
//!   `RmsNorm` of the residual too when it follows (one pass for the three).
//! * `HeadRmsNorm` — `qk_norm_rope_<t>`, a block per row and a warp per head:
//!   the q/k norms and the `Rotary` right after them on the same buffer in
//!   one read and one write of q and k; alone (no `Rotary` after), the norms
//!   only; a `Rotary` over grouped-query heads alone, the rotation only.
//! * `Embed` with a scale — `embed_scaled_<t>`, the scale rounded to the
//!   compute type first ([`Embed::scale`](crate::model::program::Embed)).
//!
//! A fusion needs every buffer it touches in the compute type, and skips
//! storing a value no later op reads ([`dead_after`]).

use super::planner::Planner;
use super::prenorm::{i32_of, ROTARY_MAX_HALF};
use super::{dead_after, suffix, Arg, Loc};
use crate::backend::BackendError;
use crate::model::program::{Add, BufId, Embed, HeadRmsNorm, Op, RmsNorm, Rotary, Seqs};
use crate::tensor::DType;

/// 16-byte vectors (or as many single values) each `rms_norm` thread holds
/// (`RMS_VPT` in decoder.cu).
pub const RMS_VPT: usize = 2;
/// The largest `rms_norm` block (`RMS_MAX_THREADS`).
pub const RMS_MAX_THREADS: usize = 768;
/// Most warps of a `qk_norm_rope` block.
pub const QK_MAX_WARPS: usize = 8;
/// The largest head `qk_norm_rope` takes (`2 · QK_MAX_HALF`).
pub const QK_MAX_HEAD_DIM: usize = 256;
/// Threads of an `embed_scaled` block (at most).
const EMBED_THREADS: usize = 256;

/// Block size of `rms_norm_<t>` for rows of `hidden` values of type `t`:
/// each thread holds [`RMS_VPT`] 16-byte vectors of them, a multiple of 32
/// threads, at most [`RMS_MAX_THREADS`].
pub fn rms_threads(hidden: usize, t: DType) -> Result<u32, BackendError> {
    let per_thread = RMS_VPT * (16 / t.size());
    let threads = hidden.div_ceil(per_thread).next_multiple_of(32).max(32);
    if hidden == 0 || threads > RMS_MAX_THREADS {
        return Err(BackendError::Unsupported(format!(
            "RMSNorm over {hidden} values of {t} (at most {})",
            RMS_MAX_THREADS * per_thread
        )));
    }
    Ok(threads as u32)
}

/// What one `rms_norm` launch computes (decoder.cu's comment): `x`, then
/// the norm `g1`, the add into `res` (stored where `res_out`), the norm
/// `g2`, stored to `out`.
struct RmsStep {
    x: Loc,
    g1: Option<(Loc, f32, f32)>,
    res: Option<(Loc, bool)>,
    g2: Option<(Loc, f32, f32)>,
    out: Option<Loc>,
    rows: usize,
    hidden: usize,
}

impl Planner<'_> {
    /// Whether every buffer of `bufs` holds the compute type (a fused step
    /// reads and writes them as such).
    fn all_compute(&self, bufs: &[BufId]) -> bool {
        bufs.iter().all(|&b| self.dtype(b) == self.compute)
    }

    fn rms_kernel(&mut self, what: &str, s: RmsStep) -> Result<(), BackendError> {
        let t = self.compute;
        let threads = rms_threads(s.hidden, t)?;
        let grid = u32::try_from(s.rows)
            .map_err(|_| BackendError::Unsupported(format!("{what}: {} rows", s.rows)))?;
        i32_of(s.rows * s.hidden, what)?;
        let norm = |g: Option<(Loc, f32, f32)>| match g {
            Some((gamma, eps, offset)) => [Arg::Ptr(gamma), Arg::F32(eps), Arg::F32(offset)],
            None => [Arg::Null, Arg::F32(0.0), Arg::F32(0.0)],
        };
        let mut args = vec![Arg::Ptr(s.x)];
        args.extend(norm(s.g1));
        match s.res {
            Some((r, store)) => {
                args.extend([Arg::Ptr(r), if store { Arg::Ptr(r) } else { Arg::Null }])
            }
            None => args.extend([Arg::Null, Arg::Null]),
        }
        args.extend(norm(s.g2));
        args.push(s.out.map_or(Arg::Null, Arg::Ptr));
        args.push(Arg::I32(s.hidden as i32));
        self.kernel(
            format!("rms_norm_{}", suffix(t)),
            (grid, 1, 1),
            threads,
            0,
            args,
        );
        Ok(())
    }

    /// `RmsNorm`; with an `Add` of its output into a residual after it
    /// (Gemma's post-norms), the add too, and the `RmsNorm` of that
    /// residual after it too where one follows. Returns the ops consumed.
    pub(super) fn rms_norm(&mut self, idx: usize, op: &RmsNorm) -> Result<usize, BackendError> {
        let what = format!("op {idx} (RmsNorm)");
        let t = self.compute;
        let ops = &self.program.ops;
        let g1 = Some((Loc::Weight(op.gamma), op.eps, op.weight_offset));
        // RmsNorm(x → y); Add(y into r), y read by nothing after.
        let add = match ops.get(idx + 1) {
            Some(Op::Add(a))
                if a.x == op.out
                    && a.into != op.out
                    && (a.rows, a.width) == (op.rows, op.hidden)
                    && self.all_compute(&[op.x, op.out, a.into])
                    && dead_after(ops, idx + 2, op.out) =>
            {
                Some(a.clone())
            }
            _ => None,
        };
        if let Some(a) = add {
            let x = self.locs[&op.x];
            let res = self.locs[&a.into];
            // Then RmsNorm(r → z) too.
            if let Some(Op::RmsNorm(n)) = ops.get(idx + 2) {
                if n.x == a.into
                    && (n.rows, n.hidden) == (op.rows, op.hidden)
                    && self.all_compute(&[n.out])
                {
                    let store = n.out != a.into && !dead_after(ops, idx + 3, a.into);
                    let out = self.locs[&n.out];
                    self.rms_kernel(
                        &what,
                        RmsStep {
                            x,
                            g1,
                            res: Some((res, store)),
                            g2: Some((Loc::Weight(n.gamma), n.eps, n.weight_offset)),
                            out: Some(out),
                            rows: op.rows,
                            hidden: op.hidden,
                        },
                    )?;
                    return Ok(3);
                }
            }
            self.rms_kernel(
                &what,
                RmsStep {
                    x,
                    g1,
                    res: Some((res, true)),
                    g2: None,
                    out: None,
                    rows: op.rows,
                    hidden: op.hidden,
                },
            )?;
            return Ok(2);
        }
        let elems = op.rows * op.hidden;
        let x = if op.x == op.out {
            self.in_place(op.x, &what)?
        } else {
            self.float_in(op.x, elems, t)?
        };
        let (dst, pending) = self.float_out(op.out, elems, t);
        self.rms_kernel(
            &what,
            RmsStep {
                x,
                g1,
                res: None,
                g2: None,
                out: Some(dst),
                rows: op.rows,
                hidden: op.hidden,
            },
        )?;
        self.finish_out(pending, elems)?;
        Ok(1)
    }

    /// `Add` (op `idx`) and the `RmsNorm` of its sum right after it in one
    /// pass (Qwen3's residual add and the next sublayer's norm), where their
    /// buffers allow: `Some(2)`, the ops consumed; `None` to plan the Add
    /// alone.
    pub(super) fn add_rms_norm(
        &mut self,
        idx: usize,
        add: &Add,
        norm: &RmsNorm,
    ) -> Result<Option<usize>, BackendError> {
        let fusable = norm.x == add.into
            && add.x != add.into
            && (norm.rows, norm.hidden) == (add.rows, add.width)
            && self.all_compute(&[add.x, add.into, norm.out]);
        if !fusable {
            return Ok(None);
        }
        let what = format!("op {idx} (Add, RmsNorm)");
        // The sum is stored unless the norm overwrites it or nothing reads it.
        let store = norm.out != add.into && !dead_after(&self.program.ops, idx + 2, add.into);
        let step = RmsStep {
            x: self.locs[&add.x],
            g1: None,
            res: Some((self.locs[&add.into], store)),
            g2: Some((Loc::Weight(norm.gamma), norm.eps, norm.weight_offset)),
            out: Some(self.locs[&norm.out]),
            rows: add.rows,
            hidden: add.width,
        };
        self.rms_kernel(&what, step)?;
        Ok(Some(2))
    }

    /// `HeadRmsNorm`, and the `Rotary` right after it on the same heads in
    /// the same kernel. Returns the ops consumed.
    pub(super) fn head_rms_norm(
        &mut self,
        idx: usize,
        op: &HeadRmsNorm,
    ) -> Result<usize, BackendError> {
        let rotary = match self.program.ops.get(idx + 1) {
            Some(Op::Rotary(r))
                if r.qkv == op.qkv
                    && (r.heads, r.kv_heads, r.head_dim)
                        == (op.heads, op.kv_heads, op.head_dim)
                    && r.seqs.token_rows() == op.rows =>
            {
                Some(r.clone())
            }
            _ => None,
        };
        self.qk_norm_rope(idx, Some(op), rotary.as_ref())
    }

    /// `qk_norm_rope_<t>` for the q/k norms `norm`, the rotation `rotary`
    /// or both (same buffer and heads); returns the ops they are.
    pub(super) fn qk_norm_rope(
        &mut self,
        idx: usize,
        norm: Option<&HeadRmsNorm>,
        rotary: Option<&Rotary>,
    ) -> Result<usize, BackendError> {
        let what = format!(
            "op {idx} ({})",
            match (norm, rotary) {
                (Some(_), Some(_)) => "HeadRmsNorm, Rotary",
                (Some(_), None) => "HeadRmsNorm",
                _ => "Rotary",
            }
        );
        let (qkv, rows, heads, kv_heads, head_dim) = match (norm, rotary) {
            (Some(n), _) => (n.qkv, n.rows, n.heads, n.kv_heads, n.head_dim),
            (None, Some(r)) => (r.qkv, r.seqs.token_rows(), r.heads, r.kv_heads, r.head_dim),
            (None, None) => unreachable!("a norm or a rotation"),
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > QK_MAX_HEAD_DIM {
            return Err(BackendError::Unsupported(format!(
                "{what}: head size {head_dim} (even, at most {QK_MAX_HEAD_DIM})"
            )));
        }
        debug_assert!(head_dim / 2 <= ROTARY_MAX_HALF);
        let grid = u32::try_from(rows)
            .map_err(|_| BackendError::Unsupported(format!("{what}: {rows} rows")))?;
        i32_of(rows * (heads + 2 * kv_heads) * head_dim, &what)?;
        let qkv = self.in_place(qkv, &what)?;
        let mut args = vec![Arg::Ptr(qkv)];
        match norm {
            Some(n) => args.extend([
                Arg::Ptr(Loc::Weight(n.q_gamma)),
                Arg::Ptr(Loc::Weight(n.k_gamma)),
                Arg::F32(n.eps),
                Arg::F32(n.weight_offset),
            ]),
            None => args.extend([Arg::Null, Arg::Null, Arg::F32(0.0), Arg::F32(0.0)]),
        }
        // Where a row's position (and with dynamic NTK its sequence's
        // length) comes from: positions, index, packed, seq, nseqs.
        let (positions, index, packed, seq, nseqs) = match rotary.map(|r| (r.seqs, r.dynamic)) {
            None => (Arg::Null, Arg::Null, 0, 1, 0),
            Some((Seqs::Padded { mask, seq, .. }, dynamic)) => {
                let index = dynamic.map_or(Arg::Null, |_| Arg::Ptr(self.int_loc(mask)));
                (Arg::Null, index, 0, seq, 0)
            }
            Some((
                Seqs::Packed {
                    positions,
                    offsets,
                    seqs,
                    ..
                },
                dynamic,
            )) => {
                let index = dynamic.map_or(Arg::Null, |_| Arg::Ptr(self.int_loc(offsets)));
                (Arg::Ptr(self.int_loc(positions)), index, 1, 1, seqs)
            }
        };
        args.extend([
            positions,
            index,
            Arg::I32(packed),
            Arg::I32(i32_of(seq, &what)?),
            Arg::I32(i32_of(nseqs, &what)?),
            Arg::I32(heads as i32),
            Arg::I32(kv_heads as i32),
            Arg::I32(head_dim as i32),
        ]);
        match rotary {
            Some(r) => {
                let (factor, max_trained) =
                    r.dynamic.map_or((0.0, 0), |n| (n.factor, n.max_trained));
                args.extend([
                    Arg::I32(1),
                    Arg::F32(r.theta),
                    Arg::F32(r.scale),
                    Arg::F32(factor),
                    Arg::I32(i32_of(max_trained, &what)?),
                ]);
            }
            None => args.extend([
                Arg::I32(0),
                Arg::F32(0.0),
                Arg::F32(0.0),
                Arg::F32(0.0),
                Arg::I32(0),
            ]),
        }
        let warps = (heads + kv_heads).min(QK_MAX_WARPS);
        self.kernel(
            format!("qk_norm_rope_{}", suffix(self.compute)),
            (grid, 1, 1),
            (32 * warps) as u32,
            0,
            args,
        );
        Ok(usize::from(norm.is_some()) + usize::from(rotary.is_some()))
    }

    /// `Embed` with a scale other than 1: `embed_scaled_<t>`, the scale
    /// rounded to the compute type (as Gemma's `embed_scale` is).
    pub(super) fn embed_scaled(&mut self, idx: usize, op: &Embed) -> Result<usize, BackendError> {
        let Embed {
            ids,
            word,
            out,
            hidden,
            scale,
            seqs,
        } = *op;
        let t = self.compute;
        let what = format!("op {idx} (Embed)");
        let rows = seqs.token_rows();
        let grid = u32::try_from(rows)
            .map_err(|_| BackendError::Unsupported(format!("{what}: {rows} rows")))?;
        let scale = match t {
            DType::F16 => half::f16::from_f32(scale).to_f32(),
            DType::BF16 => half::bf16::from_f32(scale).to_f32(),
            _ => scale,
        };
        let (dst, pending) = self.float_out(out, rows * hidden, t);
        let args = vec![
            Arg::Ptr(self.int_loc(ids)),
            Arg::Ptr(Loc::Weight(word)),
            Arg::Ptr(dst),
            Arg::I32(i32_of(hidden, &what)?),
            Arg::I32(i32_of(self.rows_of(word), &what)?),
            Arg::F32(scale),
        ];
        let per_thread = 16 / t.size();
        let threads = hidden
            .div_ceil(per_thread)
            .next_multiple_of(32)
            .clamp(32, EMBED_THREADS) as u32;
        self.kernel(
            format!("embed_scaled_{}", suffix(t)),
            (grid, 1, 1),
            threads,
            0,
            args,
        );
        self.finish_out(pending, rows * hidden)?;
        Ok(1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::{rms_threads, QK_MAX_HEAD_DIM, RMS_MAX_THREADS, RMS_VPT};
    use crate::backend::cuda::mem::{align_up, ALIGN};
    use crate::backend::cuda::plan::band_tc_class;
    use crate::backend::BackendError;
    use std::collections::HashMap;

    /// Where `plan` put each activation buffer of `p` (laid out in order).
    fn arena(p: &Program, t: DType) -> HashMap<&str, Arg> {
        let mut at = 0;
        let mut locs = HashMap::new();
        for b in &p.buffers {
            if b.kind == BufKind::Activation {
                locs.insert(b.name.as_str(), Arg::Ptr(Loc::Arena(at)));
                at += align_up(b.elems * t.size(), ALIGN);
            }
        }
        locs
    }

    /// The input `role`'s slot in `plan`'s input block.
    fn input(plan: &Plan, role: InputRole) -> Arg {
        let slot = plan.inputs.iter().find(|i| i.role == role).unwrap();
        Arg::Ptr(Loc::Input(slot.offset))
    }

    fn weight(w: &Weights, name: &str) -> Arg {
        let (id, _) = w.iter().find(|(_, t)| t.name == name).unwrap();
        Arg::Ptr(Loc::Weight(id))
    }

    /// All kernels of `plan` named `name`, in order.
    fn kernels<'p>(plan: &'p Plan, name: &str) -> Vec<(&'p Step, &'p [Arg])> {
        plan.steps
            .iter()
            .filter_map(|s| match s {
                Step::Kernel { name: n, args, .. } if n == name => Some((s, args.as_slice())),
                _ => None,
            })
            .collect()
    }

    fn no_small() -> Limits {
        LIMITS.without(&KernelPath::SMALL_SHAPE)
    }

    #[test]
    fn decoder_sizes_match_the_kernels() {
        assert_defines(
            "decoder.cu",
            &[
                ("RMS_VPT", RMS_VPT as i64),
                ("RMS_MAX_THREADS", RMS_MAX_THREADS as i64),
                ("QK_MAX_HALF", (QK_MAX_HEAD_DIM / 2) as i64),
            ],
        );
        assert_eq!(rms_threads(1024, DType::F16).unwrap(), 64);
        assert_eq!(rms_threads(4096, DType::BF16).unwrap(), 256);
        assert_eq!(rms_threads(768, DType::F16).unwrap(), 64);
        assert_eq!(rms_threads(1024, DType::F32).unwrap(), 128);
        assert_eq!(rms_threads(4096, DType::F32).unwrap(), 512);
        assert_eq!(rms_threads(1, DType::F32).unwrap(), 32);
        assert_eq!(rms_threads(12288, DType::F16).unwrap(), 768);
        assert!(rms_threads(12289, DType::F16).is_err());
        assert!(rms_threads(6145, DType::F32).is_err());
        assert!(rms_threads(0, DType::F32).is_err());
        // Every width a block takes fits its threads' vectors.
        for t in [DType::F32, DType::F16, DType::BF16] {
            for h in [1, 7, 100, 768, 1000, 2560, 4096] {
                let n = rms_threads(h, t).unwrap() as usize;
                assert!(
                    n.is_multiple_of(32) && h <= n * RMS_VPT * (16 / t.size()),
                    "{h} {t}"
                );
            }
        }
    }

    /// Qwen3 (grouped-query, causal, last-token pooling), padded: the q/k
    /// norms and the rotation in one kernel, the causal band on tensor
    /// cores, each residual add with the norm after it, and the kernels'
    /// arguments.
    #[test]
    fn qwen3_padded_plan() {
        let spec = TinyDecoder::qwen3();
        let (p, w) = spec.build(2, 64, false);
        let plan = planned(&p, &w, DType::F16, no_small());
        assert_eq!(
            plan.step_names(),
            vec![
                "embed_rows_f16",
                "rms_norm_f16", // input norm
                "mm",
                "qk_norm_rope_f16", // HeadRmsNorm + Rotary
                "attention_tc_band_f16_d128",
                "mm",
                "rms_norm_f16", // Add + the MLP's norm
                "mm",
                "gated_f16",
                "mm",
                "rms_norm_f16", // Add + the final norm
                "pool_f16",
            ]
        );
        let a = arena(&p, DType::F16);
        let mask = input(&plan, InputRole::AttentionMask);
        let (_, grid, block, smem, args) = kernel(&plan, "attention_tc_band_f16_d128");
        assert_eq!((grid, block, smem), ((1, 16, 2), TC_THREADS, 0));
        assert_eq!(
            args,
            &[
                a["qkv"],
                mask,
                a["context"],
                Arg::I32(64),
                Arg::I32(16),
                Arg::I32(8),
                Arg::I32(128),
                Arg::F32(1.0 / (128f32).sqrt()),
                Arg::I32(64), // left: the whole sequence
                Arg::I32(0),  // right: causal
            ]
        );
        let (_, grid, block, _, args) = kernel(&plan, "qk_norm_rope_f16");
        assert_eq!((grid, block), ((128, 1, 1), 256));
        assert_eq!(
            args,
            &[
                a["qkv"],
                weight(&w, "0.q_norm"),
                weight(&w, "0.k_norm"),
                Arg::F32(1e-6),
                Arg::F32(0.0),
                Arg::Null, // positions: r % seq
                Arg::Null, // no dynamic NTK
                Arg::I32(0),
                Arg::I32(64),
                Arg::I32(0),
                Arg::I32(16),
                Arg::I32(8),
                Arg::I32(128),
                Arg::I32(1), // rotate
                Arg::F32(1e6),
                Arg::F32(1.0),
                Arg::F32(0.0),
                Arg::I32(0),
            ]
        );
        let rms = kernels(&plan, "rms_norm_f16");
        let eps = Arg::F32(1e-6);
        let (none, zero) = (Arg::Null, Arg::F32(0.0));
        // RmsNorm alone: (x, g1, out).
        assert_eq!(
            rms[0].1,
            &[
                a["hidden"],
                weight(&w, "0.input_norm"),
                eps,
                zero,
                none,
                none,
                none,
                zero,
                zero,
                a["normed"],
                Arg::I32(1024)
            ]
        );
        // Add(proj into hidden) + RmsNorm(hidden → normed): the sum stored.
        assert_eq!(
            rms[1].1,
            &[
                a["proj"],
                none,
                zero,
                zero,
                a["hidden"],
                a["hidden"],
                weight(&w, "0.mlp_norm"),
                eps,
                zero,
                a["normed"],
                Arg::I32(1024)
            ]
        );
        // The last Add + the final norm in place: the sum is not stored.
        assert_eq!(
            rms[2].1,
            &[
                a["proj"],
                none,
                zero,
                zero,
                a["hidden"],
                none,
                weight(&w, "final_norm"),
                eps,
                zero,
                a["hidden"],
                Arg::I32(1024)
            ]
        );
        match rms[0].0 {
            Step::Kernel { grid, block, .. } => assert_eq!((*grid, block.0), ((128, 1, 1), 64)),
            s => panic!("{s:?}"),
        }
        // Last-token pooling: mode 4 over the mask.
        let (_, grid, _, _, args) = kernel(&plan, "pool_f16");
        assert_eq!(grid, (2, 1, 1));
        assert_eq!(
            args,
            &[
                a["hidden"],
                mask,
                Arg::Ptr(Loc::Output(0)),
                Arg::I32(64),
                Arg::I32(1024),
                Arg::I32(pool_code(Pooling::LastToken)),
                Arg::I32(1),
            ]
        );
        // Two layers: the first layer's last Add and the second's input
        // norm are one kernel too.
        let two = TinyDecoder { layers: 2, ..spec };
        let (p2, w2) = two.build(2, 64, false);
        let plan2 = planned(&p2, &w2, DType::BF16, no_small());
        let names = plan2.step_names();
        assert_eq!(names.iter().filter(|s| *s == "rms_norm_bf16").count(), 5);
        assert_eq!(names.len(), 1 + 2 * 9 + 2);
        let rms = kernels(&plan2, "rms_norm_bf16");
        assert_eq!(rms[2].1[6], weight(&w2, "1.input_norm"));
        assert_eq!(rms[2].1[5], arena(&p2, DType::BF16)["hidden"]);
    }

    /// Qwen3 packed: the varlen band kernel with its tile table, the
    /// positions for the rotation, last-token pooling over the offsets.
    #[test]
    fn qwen3_packed_plan() {
        let (tokens, seqs) = (512, 16);
        let (p, w) = TinyDecoder::qwen3().build(tokens, seqs, true);
        for t in [DType::F16, DType::BF16] {
            let ts = suffix(t);
            let plan = planned(&p, &w, t, no_small());
            let a = arena(&p, t);
            let tiles = max_tiles(tokens, seqs, VARLEN_TC_QT);
            assert_eq!(plan.tile_tables.len(), 1);
            assert_eq!(plan.tile_tables[0].qt, VARLEN_TC_QT);
            let table = Arg::Ptr(Loc::Input(plan.tile_tables[0].offset));
            let (name, grid, block, _, args) = kernel(&plan, "attention_varlen_tc_band");
            assert_eq!(name, format!("attention_varlen_tc_band_{ts}_d128"));
            assert_eq!((grid, block), ((tiles as u32 * 16, 1, 1), TC_THREADS));
            assert_eq!(
                args,
                &[
                    a["qkv"],
                    table,
                    a["context"],
                    Arg::I32(16),
                    Arg::I32(8),
                    Arg::I32(128),
                    Arg::F32(1.0 / (128f32).sqrt()),
                    Arg::I32(512),
                    Arg::I32(512),
                    Arg::I32(0),
                ]
            );
            let (_, _, _, _, args) = kernel(&plan, "qk_norm_rope");
            assert_eq!(
                &args[5..10],
                &[
                    input(&plan, InputRole::Positions),
                    Arg::Null,
                    Arg::I32(1),
                    Arg::I32(1),
                    Arg::I32(16)
                ]
            );
            let (name, grid, _, _, args) = kernel(&plan, "pool_packed");
            assert_eq!(name, format!("pool_packed_{ts}"));
            assert_eq!(grid, (16, 1, 1));
            assert_eq!(args[1], input(&plan, InputRole::SeqOffsets));
            assert_eq!(args[5], Arg::I32(pool_code(Pooling::LastToken)));
        }
        // Skipping a prompt: the _skip poolings with last-token mode.
        let spec = TinyDecoder {
            skip: true,
            ..TinyDecoder::qwen3()
        };
        for packed in [false, true] {
            let (p, w) = spec.build(
                if packed { 512 } else { 2 },
                if packed { 16 } else { 64 },
                packed,
            );
            let plan = planned(&p, &w, DType::F16, LIMITS);
            let name = if packed {
                "pool_packed_skip_f16"
            } else {
                "pool_skip_f16"
            };
            let (_, _, _, _, args) = kernel(&plan, name);
            assert_eq!(args[2], input(&plan, InputRole::PoolSkip));
            assert_eq!(args[6], Arg::I32(pool_code(Pooling::LastToken)));
        }
    }

    /// EmbeddingGemma: head size 256 on tensor cores with its scale, the
    /// local layer's window on both sides and the global layer unbounded,
    /// the scaled embedding, and each post-norm with its residual add and
    /// the next norm in one kernel.
    #[test]
    fn gemma_plan() {
        let (p, w) = TinyDecoder::gemma().build(1, 512, false);
        let plan = planned(&p, &w, DType::BF16, no_small());
        let layer = [
            "rms_norm_bf16",
            "mm",
            "qk_norm_rope_bf16",
            "attention_tc_band_bf16_d256",
            "mm",
            "rms_norm_bf16", // post-norm + Add + the MLP's norm
            "mm",
            "gated_bf16",
            "mm",
        ];
        let mut want = vec!["embed_scaled_bf16".to_string()];
        want.extend(layer.iter().map(|s| s.to_string()));
        // Layer 0's last post-norm + Add + layer 1's input norm.
        want.extend(layer[..].iter().map(|s| s.to_string()));
        want[10] = "rms_norm_bf16".into();
        want.push("rms_norm_bf16".into()); // post-norm + Add + final norm
        want.push("pool_split_bf16".into()); // 512 tokens over 16 blocks
        let names = plan.step_names();
        assert_eq!(names, want);
        let a = arena(&p, DType::BF16);
        let (_, grid, block, _, args) = kernel(&plan, "embed_scaled_bf16");
        assert_eq!((grid, block), ((512, 1, 1), 96));
        let scale = half::bf16::from_f32(768f32.sqrt()).to_f32();
        assert_eq!(scale, 27.75);
        assert_eq!(
            args,
            &[
                input(&plan, InputRole::TokenIds),
                weight(&w, "embed"),
                a["hidden"],
                Arg::I32(768),
                Arg::I32(1000),
                Arg::F32(scale),
            ]
        );
        let att = kernels(&plan, "attention_tc_band_bf16_d256");
        let tail = |w: i32| {
            [
                Arg::I32(512),
                Arg::I32(3),
                Arg::I32(1),
                Arg::I32(256),
                Arg::F32(0.0625),
                Arg::I32(w),
                Arg::I32(w),
            ]
        };
        assert_eq!(att[0].1[3..], tail(256), "the local layer");
        assert_eq!(att[1].1[3..], tail(512), "the global layer");
        match att[0].0 {
            Step::Kernel { grid, block, .. } => {
                assert_eq!((*grid, block.0), ((512 / 64, 3, 1), TC_THREADS))
            }
            s => panic!("{s:?}"),
        }
        let rms = kernels(&plan, "rms_norm_bf16");
        assert_eq!(rms.len(), 5);
        let (eps, one) = (Arg::F32(1e-6), Arg::F32(1.0));
        assert_eq!(
            rms[1].1,
            &[
                a["proj"],
                weight(&w, "0.post_attention_norm"),
                eps,
                one,
                a["hidden"],
                a["hidden"],
                weight(&w, "0.mlp_norm"),
                eps,
                one,
                a["normed"],
                Arg::I32(768)
            ]
        );
        assert_eq!(rms[2].1[1], weight(&w, "0.post_mlp_norm"));
        assert_eq!(rms[2].1[6], weight(&w, "1.input_norm"));
        assert_eq!(rms[3].1[1], weight(&w, "1.post_attention_norm"));
        // The final norm overwrites the residual: not stored first.
        assert_eq!(rms[4].1[1], weight(&w, "1.post_mlp_norm"));
        assert_eq!(rms[4].1[5], Arg::Null);
        assert_eq!(rms[4].1[6], weight(&w, "final_norm"));
        assert_eq!(rms[4].1[9], a["hidden"]);
        let (_, _, block, _, args) = kernel(&plan, "qk_norm_rope_bf16");
        assert_eq!(block, 128, "4 heads: 4 warps");
        assert_eq!(args[4], one, "Gemma's 1 + weight");
        // Packed: the varlen kernel of head size 256.
        let (pk, wk) = TinyDecoder::gemma().build(1024, 8, true);
        let plan = planned(&pk, &wk, DType::F16, no_small());
        let att = kernels(&plan, "attention_varlen_tc_band_f16_d256");
        assert_eq!(att.len(), 2);
        assert_eq!(
            att[0].1[3..],
            [
                Arg::I32(3),
                Arg::I32(1),
                Arg::I32(256),
                Arg::F32(0.0625),
                Arg::I32(1024),
                Arg::I32(256),
                Arg::I32(256)
            ]
        );
        assert_eq!(att[1].1[8..], [Arg::I32(1024), Arg::I32(1024)]);
    }

    /// Off the tensor cores (f32; f16 with `tc_attention` off; a head size
    /// of no tensor-core kernel) a decoder's attention is the warp per
    /// query with its grouped heads, band and scale.
    #[test]
    fn decoders_fall_back_to_the_warp_kernel() {
        let (p, w) = TinyDecoder::gemma().build(1, 512, false);
        let plan = planned(&p, &w, DType::F32, LIMITS);
        let a = arena(&p, DType::F32);
        let att = kernels(&plan, "attention_band_f32_d256");
        assert_eq!(att.len(), 2);
        assert_eq!(
            att[0].1,
            &[
                a["qkv"],
                input(&plan, InputRole::AttentionMask),
                a["context"],
                Arg::I32(0),
                Arg::I32(512),
                Arg::I32(0),
                Arg::I32(512),
                Arg::I32(3),
                Arg::I32(1),
                Arg::I32(256),
                Arg::F32(0.0625),
                Arg::I32(256),
                Arg::I32(256),
            ]
        );
        match att[0].0 {
            Step::Kernel {
                grid, block, smem, ..
            } => {
                assert_eq!((*grid, block.0, *smem), ((512 * 3 / 4, 1, 1), 128, 0))
            }
            s => panic!("{s:?}"),
        }
        assert!(plan.tile_tables.is_empty());
        // Qwen3 packed in f32: the offsets say which keys a query sees.
        let (pk, wk) = TinyDecoder::qwen3().build(512, 16, true);
        let plan = planned(&pk, &wk, DType::F32, LIMITS);
        let (_, _, _, _, args) = kernel(&plan, "attention_band_f32_d128");
        assert_eq!(args[1], input(&plan, InputRole::SeqOffsets));
        assert_eq!(
            args[3..],
            [
                Arg::I32(1),
                Arg::I32(1),
                Arg::I32(16),
                Arg::I32(512),
                Arg::I32(16),
                Arg::I32(8),
                Arg::I32(128),
                Arg::F32(1.0 / (128f32).sqrt()),
                Arg::I32(512),
                Arg::I32(0),
            ]
        );
        // f16 without the tensor-core path; head sizes of no tensor-core
        // class (100: not a multiple of 8).
        let plan = planned(
            &pk,
            &wk,
            DType::F16,
            LIMITS.without(&[KernelPath::TcAttention]),
        );
        kernel(&plan, "attention_band_f16_d128");
        let odd = TinyDecoder {
            head_dim: 100,
            ..TinyDecoder::qwen3()
        };
        let (p100, w100) = odd.build(2, 64, false);
        let plan = planned(&p100, &w100, DType::BF16, LIMITS);
        let (_, _, _, _, args) = kernel(&plan, "attention_band_bf16_d128");
        assert_eq!(args[9], Arg::I32(100));
        // Its q/k norm and rotation: lanes hold strided pairs.
        kernel(&plan, "qk_norm_rope_bf16");
        // Head size 288: no kernel takes it.
        let big = TinyDecoder {
            head_dim: 288,
            ..TinyDecoder::qwen3()
        };
        let (pb, wb) = big.build(1, 16, false);
        let e = super::super::plan(&pb, &wb, DType::F16, false, LIMITS).unwrap_err();
        assert!(
            matches!(e, BackendError::Unsupported(ref m) if m.contains("288")),
            "{e:?}"
        );
    }

    /// The tensor-core band kernels take any head size of a multiple of 8
    /// up to 256 in the class above it (the test folders' 16 and 24, 96):
    /// the class in the name, the head size an argument.
    #[test]
    fn band_head_size_classes() {
        let classes = [
            (8, 32),
            (16, 32),
            (24, 32),
            (32, 32),
            (40, 64),
            (96, 128),
            (136, 256),
            (256, 256),
        ];
        for (hd, class) in classes {
            assert_eq!(band_tc_class(hd), Some(class), "{hd}");
        }
        for hd in [0, 4, 20, 100, 264] {
            assert_eq!(band_tc_class(hd), None, "{hd}");
        }
        for (hd, class) in [(16, 32), (24, 32), (96, 128)] {
            let d = TinyDecoder {
                head_dim: hd,
                ..TinyDecoder::qwen3()
            };
            for packed in [false, true] {
                let (p, w) = d.build(
                    if packed { 64 } else { 2 },
                    if packed { 4 } else { 16 },
                    packed,
                );
                let plan = planned(&p, &w, DType::F16, LIMITS);
                let name = if packed {
                    "attention_varlen_tc_band"
                } else {
                    "attention_tc_band"
                };
                let (n, _, _, _, args) = kernel(&plan, name);
                assert_eq!(n, format!("{name}_f16_d{class}"));
                // After (seq,) heads and kv_heads.
                assert_eq!(args[if packed { 5 } else { 6 }], Arg::I32(hd as i32));
            }
        }
    }

    /// A HeadRmsNorm not followed by a Rotary of its heads is the norm
    /// alone; a Rotary over grouped heads alone is the rotation alone
    /// (with dynamic NTK, its sequence's base).
    #[test]
    fn head_norm_and_rotary_alone() {
        let (mut p, w) = TinyDecoder::qwen3().build(2, 64, false);
        let is = |op: &Op, rotary: bool| matches!(op, Op::Rotary(_)) == rotary;
        let mut no_rotary = p.clone();
        no_rotary.ops.retain(|op| is(op, false));
        let plan = planned(&no_rotary, &w, DType::F16, no_small());
        let (_, _, _, _, args) = kernel(&plan, "qk_norm_rope_f16");
        assert_ne!(args[1], Arg::Null);
        assert_eq!(args[13], Arg::I32(0), "no rotation");
        assert_eq!(plan.step_names()[4], "attention_tc_band_f16_d128");
        p.ops.retain(|op| !matches!(op, Op::HeadRmsNorm(_)));
        for op in &mut p.ops {
            if let Op::Rotary(r) = op {
                r.dynamic = Some(DynamicNtk {
                    factor: 2.0,
                    max_trained: 32,
                });
            }
        }
        let plan = planned(&p, &w, DType::F16, no_small());
        let (_, _, _, _, args) = kernel(&plan, "qk_norm_rope_f16");
        assert_eq!((args[1], args[2]), (Arg::Null, Arg::Null), "no norm");
        assert_eq!(args[6], input(&plan, InputRole::AttentionMask));
        assert_eq!(
            args[13..],
            [
                Arg::I32(1),
                Arg::F32(1e6),
                Arg::F32(1.0),
                Arg::F32(2.0),
                Arg::I32(32)
            ]
        );
        assert!(!plan.step_names().iter().any(|s| s.starts_with("rotary")));
    }

    /// Every decoder plans in every dtype, layout and with each attention
    /// path, onto kernels the module has; nothing is refused.
    #[test]
    fn decoders_plan_everywhere() {
        let entries: std::collections::HashSet<String> =
            crate::backend::cuda::kernels::expected_entry_points()
                .into_iter()
                .collect();
        for spec in [TinyDecoder::qwen3(), TinyDecoder::gemma()] {
            for (batch, seq, packed) in [
                (1, 16, false),
                (4, 64, false),
                (64, 4, true),
                (512, 16, true),
            ] {
                let (p, w) = spec.build(batch, seq, packed);
                for op in &p.ops {
                    assert_eq!(not_on_cuda(op), None);
                }
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    for limits in [
                        LIMITS,
                        no_small(),
                        LIMITS.without(&[KernelPath::TcAttention]),
                    ] {
                        let plan = super::super::plan(&p, &w, dtype, false, limits)
                            .unwrap_or_else(|e| panic!("{spec:?} {dtype}: {e}"));
                        for s in plan.step_names() {
                            assert!(s == "mm" || entries.contains(&s), "no kernel {s}");
                        }
                        assert_eq!(
                            plan.step_names()
                                .iter()
                                .filter(|s| s.starts_with("qk_norm_rope"))
                                .count(),
                            spec.layers
                        );
                    }
                }
            }
        }
    }

    /// An explicit score scale on plain multi-head attention keeps its
    /// kernel and passes the scale; a position bias with a causal mask is
    /// refused.
    #[test]
    fn attention_scale_and_refusals() {
        let (mut p, w) = tiny_bert(2, 16);
        for op in &mut p.ops {
            if let Op::Attention(a) = op {
                a.scale = Some(0.25);
            }
        }
        let plan = planned(&p, &w, DType::F16, LIMITS);
        let (_, _, _, _, args) = kernel(&plan, "attention_tc_s16_f16_d32");
        assert_eq!(args[5], Arg::F32(0.25));
        let plan = planned(&p, &w, DType::F32, LIMITS);
        let (_, _, _, _, args) = kernel(&plan, "attention_f32_d32");
        assert_eq!(args[6], Arg::F32(0.25));
        for op in &mut p.ops {
            if let Op::Attention(a) = op {
                a.causal = true;
                a.bias = Some(PositionBias {
                    table: WeightId(0),
                    radius: 1,
                });
            }
        }
        let refused = p.ops.iter().filter_map(not_on_cuda).count();
        assert_eq!(refused, 1);
    }
}
