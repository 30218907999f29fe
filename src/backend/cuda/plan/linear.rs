//! `Linear`: every matmul of a program, the feed-forward block's, the
//! attention's projections and the heads' (Dense modules, a classifier).
//! Few rows take one of two kernels that fold the work after the product
//! into its epilogue (bias, activation, and the AddLayerNorm that follows):
//! `skinny` for small weights (an MLP's layers) and `gemm_small` (f16/bf16,
//! tensor cores) for an encoder's; the rest go to cuBLASLt, its bias
//! epilogue, and `bias_act` for an activation it lacks.

use super::norms::{ln_vec_fits, LNV_WARPS};
use super::planner::{DeferredLn, Planner};
use super::pooling::POOL_LN_MAX_HIDDEN;
use super::{act_code, dead_after, suffix, Arg, Loc, Step};
use crate::backend::cuda::matmul::{split_activation, MatmulShape};
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{AddLayerNorm, BufId, BufKind, Linear, Op, Pool, WeightId};
use crate::model::{Activation, Pooling};
use crate::tensor::DType;

/// Most rows of the skinny matmul (`SK_MAXM` in skinny.cu).
pub const SK_MAXM: usize = 16;
/// Output columns per skinny warp (`SK_COLS`).
pub const SK_COLS: usize = 4;
/// Warps per skinny block, splitting K (`SK_WARPS`).
pub const SK_WARPS: usize = 4;
/// Largest weight matrix (bytes) the skinny kernel takes. Measured on an H200:
/// it wins for the MLP's small layers (batch 8: 21 µs replay+sync against 52
/// µs through cuBLASLt) but loses for MiniLM's (384..1536 wide: 297 µs at
/// (1, 16) against 179-181 µs for (2, 16) and (1, 32) through cuBLASLt).
pub const SKINNY_MAX_WEIGHT_BYTES: usize = 192 << 10;
/// Threads per `gemm_small` block (`GS_THREADS` in gemm_small.cu).
pub const GS_THREADS: u32 = 256;
/// Warps of a `gemm_small` block (`GS_WARPS`).
pub const GS_WARPS: usize = 8;
/// Output columns per `gemm_small` block (`GS_NB`).
pub const GS_NB: usize = 16;
/// Most rows of `gemm_small` (`GS_MAXM`).
pub const GS_MAXM: usize = 64;
/// Most rows of a padded program's Linears on `gemm_small`. Measured on an
/// H200 (MiniLM f16, 2026-12-01, replay with copies): (1, 16) 134 µs
/// against 175 µs through cuBLASLt, (2, 16) and (1, 32) 169 against 178,
/// but (2, 32) and (4, 16) 243 against 178: at 64 rows the 24 blocks of the
/// 384-wide Linears each stream 64 rows of x, where cuBLASLt's wider tiles
/// read them fewer times. A packed program goes up to [`GS_MAXM`], since
/// the kernel computes only its live rows: one short text in the 64-token
/// budget costs what it does at (1, 16).
pub const GS_MAXM_PADDED: usize = 32;

/// The largest weight (`n · k` elements) `gemm_small` takes. Measured on an
/// H100 (2026-12-05, bf16, replay with copies): Qwen3-0.6B's Linears
/// (4096×1024, 6144×1024, 1024×3072) through cuBLASLt give the 64-token
/// packed graph 1,358 µs against 1,898 on `gemm_small` and (1, 16) 1,241
/// against 1,283, while EmbeddingGemma's (at most 2304×768) keep
/// `gemm_small` ((1, 16) 799 µs against 894 through cuBLASLt).
pub const GS_MAX_WEIGHT_ELEMS: usize = 3 << 20;

/// Whether a Linear of `m` rows, `n` outputs and `k` inputs in `t` runs on
/// `gemm_small`: f16/bf16, at most `max_rows` rows ([`GS_MAXM_PADDED`] or,
/// packed, [`GS_MAXM`]), K in chunks of 32, a weight of at most
/// [`GS_MAX_WEIGHT_ELEMS`].
pub fn gemm_small_fits(m: usize, n: usize, k: usize, t: DType, max_rows: usize) -> bool {
    matches!(t, DType::F16 | DType::BF16)
        && (1..=max_rows.min(GS_MAXM)).contains(&m)
        && n > 0
        && k > 0
        && n.saturating_mul(k) <= GS_MAX_WEIGHT_ELEMS
        && k.is_multiple_of(32)
        && k <= i32::MAX as usize
        && n <= i32::MAX as usize
}

/// Whether a Linear of `m` rows, `n` outputs and `k` inputs in `t` uses the
/// skinny kernel: few rows, 16-byte vectors along k, and its `n × k` weight is small enough for it to
/// beat cuBLASLt (see [`SKINNY_MAX_WEIGHT_BYTES`]).
pub fn skinny_fits(m: usize, n: usize, k: usize, t: DType) -> bool {
    let vec = 16 / t.size().max(1);
    (1..=SK_MAXM).contains(&m)
        && k > 0
        && k.is_multiple_of(vec)
        && k <= i32::MAX as usize
        && n.saturating_mul(k).saturating_mul(t.size()) <= SKINNY_MAX_WEIGHT_BYTES
}

/// The kernel a Linear runs on ([`Planner::linear_kernel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LinearKernel {
    Skinny,
    GemmSmall,
    CublasLt,
}

/// What a matmul kernel needs to apply the AddLayerNorm after it (see
/// [`Planner::add_ln_after`]).
struct AddLnAfter {
    residual: BufId,
    gamma: WeightId,
    beta: WeightId,
    eps: f32,
    out: BufId,
}

impl Planner<'_> {
    /// `Linear`: `out = act(x · wᵀ + bias)` on the kernel
    /// [`Planner::linear_kernel`] picks; returns the ops consumed (2 where
    /// the kernel applies the AddLayerNorm after it too).
    pub(super) fn linear(&mut self, idx: usize, op: &Linear) -> Result<usize, BackendError> {
        let Linear {
            x,
            w,
            bias,
            act,
            out,
            m,
            n,
            k,
        } = *op;
        let t = self.compute;
        let x_l = self.float_in(x, m * k, t)?;
        let out_t = self.dtype(out);
        match self.linear_kernel(m, n, k, out_t) {
            LinearKernel::Skinny => return self.skinny(idx, op, x_l, out_t),
            LinearKernel::GemmSmall => return self.gemm_small(idx, op, x_l),
            LinearKernel::CublasLt => {}
        }
        let (epilogue, post) = split_activation(act, bias.is_some());
        // The AddLayerNorm after it, whose residual cuBLASLt can add as C:
        // the LayerNorm then reads one operand ([`KernelPath::MmResidual`]).
        let residual_ln = (self.on(KernelPath::MmResidual)
            && self.on(KernelPath::LnVec)
            && ln_vec_fits(n)
            && out_t == t
            && post.is_none())
        .then(|| self.add_ln_after(idx, act, out, m, n))
        .flatten();
        let shape = MatmulShape {
            dtype: t,
            m,
            n,
            k,
            epilogue,
            tf32: self.tf32 && t == DType::F32,
            accumulate: residual_ln.is_some(),
        };
        if let Some(ln) = residual_ln {
            let o = self.locs[&out];
            self.steps.push(Step::Matmul {
                shape,
                w: Loc::Weight(w),
                x: x_l,
                out: o,
                bias: bias.map(Loc::Weight),
                residual: Some(self.locs[&ln.residual]),
            });
            let rows = u32::try_from(m.div_ceil(LNV_WARPS)).map_err(|_| {
                BackendError::Unsupported(format!("op {} (AddLayerNorm): {m} rows", idx + 1))
            })?;
            let args = vec![
                Arg::Ptr(o),
                Arg::Null, // the residual is in o already
                Arg::Ptr(Loc::Weight(ln.gamma)),
                Arg::Ptr(Loc::Weight(ln.beta)),
                Arg::F32(ln.eps),
                Arg::Ptr(self.locs[&ln.out]),
                Arg::I32(m as i32),
                Arg::I32(n as i32),
            ];
            let name = format!("add_ln_vec_{}", suffix(t));
            self.kernel(name, (rows, 1, 1), (32 * LNV_WARPS) as u32, 0, args);
            return Ok(2);
        }
        // An output of another type: the product into scratch, then a cast
        // (with the activation cuBLASLt's epilogue did not apply).
        let product = if out_t == t {
            self.locs[&out]
        } else {
            self.scratch(m * n, t)
        };
        self.steps.push(Step::Matmul {
            shape,
            w: Loc::Weight(w),
            x: x_l,
            out: product,
            bias: bias.map(Loc::Weight),
            residual: None,
        });
        if out_t != t || post.is_some() {
            let o = self.locs[&out];
            self.cast(
                product,
                t,
                o,
                out_t,
                m * n,
                post.unwrap_or(Activation::Identity),
            )?;
        }
        Ok(1)
    }

    /// The kernel a Linear of `m` × `n` × `k` writing a buffer of `out_t`
    /// runs on: `skinny` for few rows of a small weight, `gemm_small` for
    /// few rows in f16/bf16 (at most [`GS_MAXM_PADDED`], or [`GS_MAXM`]
    /// packed, where only the live rows are computed), else cuBLASLt.
    pub(super) fn linear_kernel(&self, m: usize, n: usize, k: usize, out_t: DType) -> LinearKernel {
        let t = self.compute;
        if self.on(KernelPath::Skinny)
            && skinny_fits(m, n, k, t)
            && (out_t == t || out_t == DType::F32)
        {
            return LinearKernel::Skinny;
        }
        let max_rows = if self.program.is_packed() {
            GS_MAXM
        } else {
            GS_MAXM_PADDED
        };
        if self.on(KernelPath::GemmSmall) && out_t == t && gemm_small_fits(m, n, k, t, max_rows) {
            return LinearKernel::GemmSmall;
        }
        LinearKernel::CublasLt
    }

    /// Whether `ops[idx]` can apply the LayerNorm whose output is `x` (`rows`
    /// × `hidden`) itself ([`KernelPath::LnDefer`]): a Linear reading `x`
    /// that runs on `gemm_small` ([`Planner::linear_kernel`], the Linear's
    /// own choice), or a mean / max / sum pooling of `x` that nothing reads after
    /// (the LayerNorm's output is then never stored).
    pub(super) fn takes_deferred_ln(
        &self,
        idx: usize,
        x: BufId,
        hidden: usize,
        rows: usize,
    ) -> bool {
        let t = self.compute;
        let ops = &self.program.ops;
        if !self.on(KernelPath::LnDefer) || self.dtype(x) != t {
            return false;
        }
        match ops.get(idx) {
            Some(&Op::Linear(Linear {
                x: lx,
                out,
                m,
                n,
                k,
                ..
            })) if lx == x => {
                (m, k) == (rows, hidden)
                    && k <= 32 * GS_WARPS * 4
                    && self.linear_kernel(m, n, k, self.dtype(out)) == LinearKernel::GemmSmall
            }
            Some(&Op::Pool(Pool {
                x: px,
                mode,
                skip,
                hidden: ph,
                seqs,
                ..
            })) => {
                px == x
                    && !matches!(mode, Pooling::Cls | Pooling::LastToken)
                    && skip.is_none()
                    && (seqs.token_rows(), ph) == (rows, hidden)
                    && hidden <= POOL_LN_MAX_HIDDEN
                    && dead_after(ops, idx + 1, x)
            }
            _ => false,
        }
    }

    /// The AddLayerNorm right after op `idx` (a Linear of `m` × `n` into
    /// `out` with activation `act`) when a matmul kernel can apply it in its
    /// epilogue: it normalises `out + residual` over rows of `n`, nothing
    /// else reads `out`, and residual and result are of the compute type.
    fn add_ln_after(
        &self,
        idx: usize,
        act: Activation,
        out: BufId,
        m: usize,
        n: usize,
    ) -> Option<AddLnAfter> {
        let t = self.compute;
        let Some(&Op::AddLayerNorm(AddLayerNorm {
            x: ln_x,
            residual,
            gamma,
            beta,
            eps,
            out: ln_out,
            rows,
            hidden,
        })) = self.program.ops.get(idx + 1)
        else {
            return None;
        };
        let fusable = act == Activation::Identity
            && ln_x == out
            && ln_out != out
            && residual != out
            && rows == m
            && hidden == n
            && self.program.buffer(out).kind == BufKind::Activation
            && self.dtype(residual) == t
            && self.dtype(ln_out) == t
            && dead_after(&self.program.ops, idx + 2, out);
        fusable.then_some(AddLnAfter {
            residual,
            gamma,
            beta,
            eps,
            out: ln_out,
        })
    }

    /// A Linear of few rows (f16/bf16) through `gemm_small` (gemm_small.cu):
    /// bias and activation in its epilogue, and the AddLayerNorm after it
    /// too where [`Planner::add_ln_after`] allows (then it consumes 2 ops),
    /// its LayerNorm left to the op after where that op can apply it.
    fn gemm_small(&mut self, idx: usize, op: &Linear, x_l: Loc) -> Result<usize, BackendError> {
        let Linear { act, out, m, n, .. } = *op;
        let t = self.compute;
        let grid = u32::try_from(n.div_ceil(GS_NB))
            .map_err(|_| BackendError::Unsupported(format!("op {idx} (Linear): {n} outputs")))?;
        let (offsets, seqs) = self.live_rows_args();
        let ln = self
            .add_ln_after(idx, act, out, m, n)
            .filter(|_| ln_vec_fits(n));
        // This Linear's x may be a LayerNorm the op before left to it.
        let x_norm = self.deferred_ln_operands(idx, op.x)?;
        let defer = ln
            .as_ref()
            .map(|l| (l.out, l.gamma, l.beta, l.eps))
            .filter(|&(ln_out, ..)| self.takes_deferred_ln(idx + 2, ln_out, n, m));
        let (mut args, consumed) = self.matmul_epilogue_args(x_l, op, ln);
        if let Some((ln_out, gamma, beta, eps)) = defer {
            // Mode 2: the pre-norm rows into the f32 scratch, no LayerNorm.
            let Arg::Ptr(pre_norm) = args[10] else {
                unreachable!("mode 1 arguments carry the scratch")
            };
            args[8] = Arg::I32(2);
            self.deferred_ln = Some(DeferredLn {
                consumer: idx + 2,
                pre_norm,
                gamma,
                beta,
                eps,
                out: ln_out,
            });
        }
        args.extend([offsets, Arg::I32(seqs as i32)]);
        args.extend(x_norm);
        self.kernel(
            format!("gemm_small_{}", suffix(t)),
            (grid, 1, 1),
            GS_THREADS,
            0,
            args,
        );
        Ok(consumed)
    }

    /// A Linear with few rows through the skinny kernel, fused with the
    /// AddLayerNorm after it when that reads only this output (which is then
    /// never materialised). Returns the ops consumed.
    fn skinny(
        &mut self,
        idx: usize,
        op: &Linear,
        x_l: Loc,
        out_t: DType,
    ) -> Result<usize, BackendError> {
        let Linear { act, out, m, n, .. } = *op;
        let t = self.compute;
        let grid = (n.div_ceil(SK_COLS) as u32, 1, 1);
        let block = (32 * SK_WARPS) as u32;
        let ln = self.add_ln_after(idx, act, out, m, n);
        let out_t = if ln.is_some() { t } else { out_t };
        let (args, consumed) = self.matmul_epilogue_args(x_l, op, ln);
        self.kernel(
            format!("skinny_{}_{}", suffix(t), suffix(out_t)),
            grid,
            block,
            0,
            args,
        );
        Ok(consumed)
    }

    /// The arguments the matmul kernels with epilogues share (skinny.cu,
    /// gemm_small.cu): `x, w, bias, out, M, N, K, act, mode, residual, tmp,
    /// gamma, beta, eps, counter`. Mode 0 is `out = act(x·wᵀ + bias)`; with
    /// `ln`, mode 1 is the AddLayerNorm after it (its output, a counter and
    /// the shared f32 scratch), and the Linear and it are 2 ops consumed.
    fn matmul_epilogue_args(
        &mut self,
        x_l: Loc,
        op: &Linear,
        ln: Option<AddLnAfter>,
    ) -> (Vec<Arg>, usize) {
        let Linear {
            w,
            bias,
            act,
            out,
            m,
            n,
            k,
            ..
        } = *op;
        let bias_arg = bias.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        let mut args = vec![Arg::Ptr(x_l), Arg::Ptr(Loc::Weight(w)), bias_arg];
        let dims = [Arg::I32(m as i32), Arg::I32(n as i32), Arg::I32(k as i32)];
        match ln {
            Some(ln) => {
                let (counter, tmp) = self.fused_scratch(m, n);
                args.push(Arg::Ptr(self.locs[&ln.out]));
                args.extend(dims);
                args.extend([
                    Arg::I32(0),
                    Arg::I32(1),
                    Arg::Ptr(self.locs[&ln.residual]),
                    Arg::Ptr(tmp),
                    Arg::Ptr(Loc::Weight(ln.gamma)),
                    Arg::Ptr(Loc::Weight(ln.beta)),
                    Arg::F32(ln.eps),
                    Arg::Ptr(counter),
                ]);
                (args, 2)
            }
            None => {
                args.push(Arg::Ptr(self.locs[&out]));
                args.extend(dims);
                args.extend([
                    Arg::I32(act_code(act)),
                    Arg::I32(0),
                    Arg::Null,
                    Arg::Null,
                    Arg::Null,
                    Arg::Null,
                    Arg::F32(0.0),
                    Arg::Null,
                ]);
                (args, 1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use crate::backend::cuda::mem::{align_up, ALIGN};

    #[test]
    fn matmul_kernel_sizes_match_the_kernels() {
        assert_defines(
            "skinny.cu",
            &[
                ("SK_MAXM", SK_MAXM as i64),
                ("SK_COLS", SK_COLS as i64),
                ("SK_WARPS", SK_WARPS as i64),
            ],
        );
        let gs = [
            ("GS_WARPS", GS_WARPS),
            ("GS_NB", GS_NB),
            ("GS_MAXM", GS_MAXM),
        ];
        assert_defines("gemm_small.cu", &gs.map(|(n, v)| (n, v as i64)));
        let gs = include_str!("../../../../kernels/gemm_small.cu");
        assert!(gs.contains("#define GS_THREADS (32 * GS_WARPS)\n") && GS_THREADS == 256);
    }

    #[test]
    fn mlp_f32_is_two_fused_matmuls() {
        let (p, w) = mlp(32, Activation::Relu);
        let plan = planned(&p, &w, DType::F32, LIMITS);
        assert_eq!(plan.matmul_count(), 2);
        assert_eq!(plan.kernel_count(), 0, "{:?}", plan.steps);
        assert_eq!(plan.inputs.len(), 1);
        assert_eq!(plan.input_bytes, align_up(32 * 128 * 4, ALIGN));
        assert_eq!(plan.output_elems, 320);
        assert_eq!(plan.arena_bytes, 32 * 256 * 4);
        match &plan.steps[0] {
            Step::Matmul {
                shape,
                x,
                out,
                bias,
                ..
            } => {
                assert_eq!(
                    shape.epilogue,
                    crate::backend::cuda::matmul::Epilogue::ReluBias
                );
                assert_eq!((shape.m, shape.n, shape.k), (32, 256, 128));
                assert!(!shape.tf32);
                assert_eq!(*x, Loc::Input(0));
                assert_eq!(*out, Loc::Arena(0));
                assert!(bias.is_some());
            }
            s => panic!("{s:?}"),
        }
        match &plan.steps[1] {
            Step::Matmul { out, .. } => assert_eq!(*out, Loc::Output(0)),
            s => panic!("{s:?}"),
        }
        let tf = crate::backend::cuda::plan::plan(&p, &w, DType::F32, true, LIMITS).unwrap();
        assert!(matches!(&tf.steps[0], Step::Matmul { shape, .. } if shape.tf32));
    }

    #[test]
    fn mlp_f16_casts_input_and_output() {
        let (p, w) = mlp(20, Activation::Gelu);
        let plan = plan(&p, &w, DType::F16, true, LIMITS).unwrap();
        let names: Vec<String> = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, .. } => name.clone(),
                Step::Matmul { shape, .. } => format!("mm{:?}", shape.epilogue),
            })
            .collect();
        assert_eq!(
            names,
            vec![
                "bias_act_f32_f16", // input f32 -> f16
                "gemm_small_f16",   // 20 rows: bias + exact GELU in the epilogue
                "mmBias",           // last layer into f16 scratch
                "bias_act_f16_f32", // ... converted into the f32 output
            ]
        );
        // tf32 never applies to f16.
        assert!(plan
            .steps
            .iter()
            .all(|s| !matches!(s, Step::Matmul { shape, .. } if shape.tf32)));
        assert!(plan.arena_bytes > plan.activation_bytes);
    }

    #[test]
    fn small_batches_use_the_skinny_kernel() {
        let (p, w) = mlp(8, Activation::Relu);
        let plan = planned(&p, &w, DType::F32, LIMITS);
        let names: Vec<String> = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, grid, .. } => format!("{name} {}", grid.0),
                Step::Matmul { .. } => "mm".into(),
            })
            .collect();
        // 256 columns / 4 per block; the last layer writes the f32 output directly.
        assert_eq!(names, vec!["skinny_f32_f32 64", "skinny_f32_f32 3"]);
        match &plan.steps[0] {
            Step::Kernel { args, .. } => {
                assert_eq!(args[4], Arg::I32(8)); // M
                assert_eq!(args[7], Arg::I32(act_code(Activation::Relu)));
                assert_eq!(args[8], Arg::I32(0)); // mode: activation
            }
            s => panic!("{s:?}"),
        }
        let plan = planned(&p, &w, DType::F16, LIMITS);
        let names: Vec<&str> = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, .. } => name.as_str(),
                Step::Matmul { .. } => "mm",
            })
            .collect();
        assert_eq!(
            names,
            vec!["bias_act_f32_f16", "skinny_f16_f16", "skinny_f16_f32"]
        );
        assert_eq!(plan.counters, 0);
        // More rows than the kernel handles, or unaligned k: cuBLASLt.
        assert!(skinny_fits(16, 64, 384, DType::F16) && !skinny_fits(17, 64, 384, DType::F16));
        assert!(!skinny_fits(4, 8, 12, DType::F16) && skinny_fits(4, 8, 12, DType::F32));
        assert!(!skinny_fits(4, 8, 10, DType::F32) && !skinny_fits(0, 8, 8, DType::F32));
        // The MLP's 128 -> 256 layer in f32 qualifies; MiniLM's 384 x 384 in f16 does not.
        assert!(skinny_fits(8, 256, 128, DType::F32));
        assert!(!skinny_fits(1, 384, 384, DType::F16));
    }

    #[test]
    fn small_bert_fuses_linear_and_layernorm() {
        // Without the fused sublayers, MiniLM's widths go through cuBLASLt
        // even at 16 rows ...
        let (p, w) = tiny_bert(1, 16);
        let plan16 = planned(&p, &w, DType::F16, LIMITS.without(&KernelPath::SMALL_SHAPE));
        assert_eq!(plan16.matmul_count(), 4);
        assert_eq!(plan16.counters, 0);
        // ... a narrower encoder through the skinny kernel, fused with its LayerNorms.
        let (p, w) = bert_dims(1, 16, 64, 2, 256);
        let plan = planned(&p, &w, DType::F16, LIMITS.without(&KernelPath::SMALL_SHAPE));
        let names: Vec<String> = plan
            .steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, args, .. } if name.starts_with("skinny") => {
                    format!("{name} mode {:?}", args[8])
                }
                Step::Kernel { name, .. } => name.clone(),
                Step::Matmul { .. } => "mm".into(),
            })
            .collect();
        assert_eq!(
            names,
            vec![
                "embed_ln_f16",
                "skinny_f16_f16 mode I32(0)", // QKV
                "attention_tc_f16_d32",
                "skinny_f16_f16 mode I32(1)", // O + add + LN
                "skinny_f16_f16 mode I32(0)", // FFN1 + exact GELU
                "skinny_f16_f16 mode I32(1)", // FFN2 + add + LN
                "pool_f16",
            ]
        );
        assert_eq!(plan.counters, 2);
        // The fused kernels write the LayerNorm output (h) and read h as the residual.
        let h = Loc::Arena(0);
        for s in &plan.steps {
            if let Step::Kernel { name, args, .. } = s {
                if name.starts_with("skinny") && args[8] == Arg::I32(1) {
                    assert_eq!(args[3], Arg::Ptr(h));
                    assert_eq!(args[9], Arg::Ptr(h));
                    assert!(matches!(args[14], Arg::Ptr(Loc::Counter(_))));
                }
            }
        }
    }

    /// A host model of one warp's `mma.sync.m16n8k16.row.col` with f32
    /// accumulation, in the PTX ISA's fragment layout (the one
    /// attention_tc.cu uses): lane `4g + t` holds A pairs (row g, k 2t..),
    /// (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..), B pairs (k 2t.., n g),
    /// (k 2t + 8.., n g) and C (g, n 2t..2t + 1), (g + 8, n 2t..2t + 1).
    fn mma_model(c: &mut [[f32; 4]], a: &[[[f32; 2]; 4]], b: &[[[f32; 2]; 2]]) {
        let mut am = [[0f32; 16]; 16];
        let mut bm = [[0f32; 8]; 16];
        for l in 0..32 {
            let (g, t) = (l / 4, l % 4);
            for e in 0..2 {
                am[g][2 * t + e] = a[l][0][e];
                am[g + 8][2 * t + e] = a[l][1][e];
                am[g][2 * t + 8 + e] = a[l][2][e];
                am[g + 8][2 * t + 8 + e] = a[l][3][e];
                bm[2 * t + e][g] = b[l][0][e];
                bm[2 * t + 8 + e][g] = b[l][1][e];
            }
        }
        for (l, cl) in c.iter_mut().enumerate().take(32) {
            let (g, t) = (l / 4, l % 4);
            for e in 0..2 {
                let n = 2 * t + e;
                cl[e] += (0..16).map(|k| am[g][k] * bm[k][n]).sum::<f32>();
                cl[2 + e] += (0..16).map(|k| am[g + 8][k] * bm[k][n]).sum::<f32>();
            }
        }
    }

    /// gemm_small.cu's `gs_mma32` (two k-steps from 16-byte lane vectors,
    /// k permuted alike in A and B), modelled on the host: it adds exactly
    /// A·Wᵀ, every product once, into the C fragment (lane 4g + t: rows g
    /// and g + 8, columns 2t, 2t + 1).
    #[test]
    fn fused_gemm_fragments_compute_the_product() {
        let mut rng = 0x9e37_79b9u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            ((rng % 17) as f32) - 8.0
        };
        // A: 16 rows x 32 k (the m-tile), W: 8 rows (n) x 32 k.
        let a: Vec<Vec<f32>> = (0..16).map(|_| (0..32).map(|_| next()).collect()).collect();
        let wt: Vec<Vec<f32>> = (0..8).map(|_| (0..32).map(|_| next()).collect()).collect();
        let vec8 = |row: &[f32], t: usize| -> [f32; 8] { std::array::from_fn(|i| row[8 * t + i]) };
        let mut c = vec![[0f32; 4]; 32];
        for step in 0..2 {
            let pair = |v: &[f32; 8], r: usize| [v[2 * r], v[2 * r + 1]];
            let mut af = vec![[[0f32; 2]; 4]; 32];
            let mut bf = vec![[[0f32; 2]; 2]; 32];
            for l in 0..32 {
                let (g, t) = (l / 4, l % 4);
                let (lo, hi, bv) = (vec8(&a[g], t), vec8(&a[g + 8], t), vec8(&wt[g], t));
                // {alo.x, ahi.x, alo.y, ahi.y} / {b.x, b.y}, then .z/.w.
                af[l] = [
                    pair(&lo, 2 * step),
                    pair(&hi, 2 * step),
                    pair(&lo, 2 * step + 1),
                    pair(&hi, 2 * step + 1),
                ];
                bf[l] = [pair(&bv, 2 * step), pair(&bv, 2 * step + 1)];
            }
            mma_model(&mut c, &af, &bf);
        }
        let want = |m: usize, n: usize| (0..32).map(|k| a[m][k] * wt[n][k]).sum::<f32>();
        assert_eq!(c.len(), 32);
        for (l, cl) in c.iter().enumerate() {
            let (g, t) = (l / 4, l % 4);
            for e in 0..2 {
                assert_eq!(cl[e], want(g, 2 * t + e));
                assert_eq!(cl[2 + e], want(g + 8, 2 * t + e));
            }
        }
    }
}
