//! `AddLayerNorm` (`add_ln`, the warp-per-row `add_ln_vec`), and the
//! LayerNorm a `gemm_small` Linear leaves to the op that reads its output
//! ([`KernelPath::LnDefer`]): the next `gemm_small` normalises the pre-norm
//! rows as it loads them, or the pooling does (`pool_ln`), so no kernel
//! ends in a last-block LayerNorm.

use super::linear::LinearKernel;
use super::planner::Planner;
use super::pooling::POOL_LN_MAX_HIDDEN;
use super::{dead_after, suffix, Arg, Loc};
use crate::backend::cuda::mem::align_up;
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{BufId, Op, WeightId};
use crate::model::Pooling;

/// Values each LayerNorm thread keeps in registers (`LN_VPT` in layernorm.cu).
pub const LN_VPT: usize = 8;
/// Rows per block (one per warp) of the vectorised LayerNorm kernels
/// (`LNV_WARPS` in vec.cu).
pub const LNV_WARPS: usize = 4;
/// 4-value vectors each lane of a vectorised LayerNorm keeps (`LNV_J`):
/// rows of at most `32 · 4 · LNV_J` values.
pub const LNV_J: usize = 8;

/// Block size of the LayerNorm kernels for a row of `hidden` values: about 4
/// values per thread, a multiple of 32, and at most [`LN_VPT`] per thread.
pub fn ln_threads(hidden: usize) -> Result<u32, BackendError> {
    let threads = align_up(hidden.div_ceil(4), 32).clamp(32, 1024);
    if hidden == 0 || hidden > threads * LN_VPT {
        return Err(BackendError::Unsupported(format!(
            "LayerNorm over {hidden} values (at most {} supported)",
            1024 * LN_VPT
        )));
    }
    Ok(threads as u32)
}

/// Whether the vectorised LayerNorm kernels (`add_ln_vec`, `embed_ln_vec`)
/// take rows of `hidden` values.
pub fn ln_vec_fits(hidden: usize) -> bool {
    hidden > 0 && hidden.is_multiple_of(4) && hidden <= 32 * 4 * LNV_J
}

/// A LayerNorm left to the op that reads its output
/// ([`KernelPath::LnDefer`]): the pre-norm rows, the LayerNorm's parameters
/// and output buffer, and the op that must apply it.
pub(super) struct DeferredLn {
    pub(super) consumer: usize,
    pub(super) pre_norm: Loc,
    pub(super) gamma: WeightId,
    pub(super) beta: WeightId,
    pub(super) eps: f32,
    pub(super) out: BufId,
}

impl DeferredLn {
    /// Its gamma, beta and eps as a pooling's arguments.
    pub(super) fn args(&self) -> [Arg; 3] {
        [
            Arg::Ptr(Loc::Weight(self.gamma)),
            Arg::Ptr(Loc::Weight(self.beta)),
            Arg::F32(self.eps),
        ]
    }
}

impl Planner<'_> {
    /// `AddLayerNorm`: `out = LayerNorm(x + residual)`, a warp per row
    /// where the row fits, else a block per row.
    pub(super) fn add_layer_norm(&mut self, idx: usize, op: &Op) -> Result<usize, BackendError> {
        let Op::AddLayerNorm {
            x,
            residual,
            gamma,
            beta,
            eps,
            out,
            rows,
            hidden,
        } = *op
        else {
            unreachable!("dispatched by op kind")
        };
        let t = self.compute;
        let threads = ln_threads(hidden)?;
        let elems = rows * hidden;
        let x_l = self.float_in(x, elems, t)?;
        let r_l = self.float_in(residual, elems, t)?;
        let (dst, pending) = self.float_out(out, elems, t);
        let mut args = vec![
            Arg::Ptr(x_l),
            Arg::Ptr(r_l),
            Arg::Ptr(Loc::Weight(gamma)),
            Arg::Ptr(Loc::Weight(beta)),
            Arg::F32(eps),
            Arg::Ptr(dst),
        ];
        if self.on(KernelPath::LnVec) && ln_vec_fits(hidden) {
            let grid = u32::try_from(rows.div_ceil(LNV_WARPS)).map_err(|_| {
                BackendError::Unsupported(format!("op {idx} (AddLayerNorm): {rows} rows"))
            })?;
            args.extend([Arg::I32(rows as i32), Arg::I32(hidden as i32)]);
            let name = format!("add_ln_vec_{}", suffix(t));
            self.kernel(name, (grid, 1, 1), (32 * LNV_WARPS) as u32, 0, args);
        } else {
            args.push(Arg::I32(hidden as i32));
            let name = format!("add_ln_{}", suffix(t));
            self.kernel(name, (rows as u32, 1, 1), threads, 0, args);
        }
        self.finish_out(pending, elems)?;
        Ok(1)
    }

    /// `gemm_small`'s last five arguments (`xf, xg, xb, xeps, xout`): the
    /// LayerNorm the op before left to ops[idx], which reads `x`, or none.
    pub(super) fn deferred_ln_operands(
        &mut self,
        idx: usize,
        x: BufId,
    ) -> Result<[Arg; 5], BackendError> {
        Ok(match self.take_deferred_ln(idx, x)? {
            Some(d) => [
                Arg::Ptr(d.pre_norm),
                Arg::Ptr(Loc::Weight(d.gamma)),
                Arg::Ptr(Loc::Weight(d.beta)),
                Arg::F32(d.eps),
                Arg::Ptr(self.locs[&d.out]),
            ],
            None => [Arg::Null, Arg::Null, Arg::Null, Arg::F32(0.0), Arg::Null],
        })
    }

    /// The LayerNorm of `x` that the op before left to ops[idx], if any
    /// (an error if it left one that this op does not read).
    pub(super) fn take_deferred_ln(
        &mut self,
        idx: usize,
        x: BufId,
    ) -> Result<Option<DeferredLn>, BackendError> {
        match self.deferred_ln.take() {
            Some(d) if d.consumer == idx && d.out == x => Ok(Some(d)),
            Some(d) => Err(BackendError::Other(format!(
                "planner: op {idx} cannot apply op {}'s deferred LayerNorm",
                d.consumer
            ))),
            None => Ok(None),
        }
    }

    /// Whether ops[idx] can apply the LayerNorm whose output is `x` (`rows`
    /// × `hidden`) itself ([`KernelPath::LnDefer`]): a Linear reading `x`
    /// that runs on `gemm_small` ([`Planner::linear_kernel`], the Linear's
    /// own choice), or a mean / max pooling of `x` that nothing reads after
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
            Some(&Op::Linear {
                x: lx,
                out,
                m,
                n,
                k,
                ..
            }) if lx == x => {
                (m, k) == (rows, hidden)
                    && k <= 32 * super::GS_WARPS * 4
                    && self.linear_kernel(m, n, k, self.dtype(out)) == LinearKernel::GemmSmall
            }
            Some(&Op::Pool {
                x: px,
                mode,
                skip,
                hidden: ph,
                seqs,
                ..
            }) => {
                px == x
                    && mode != Pooling::Cls
                    && skip.is_none()
                    && (seqs.token_rows(), ph) == (rows, hidden)
                    && hidden <= POOL_LN_MAX_HIDDEN
                    && dead_after(ops, idx + 1, x)
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layernorm_sizes_match_the_kernels() {
        let ln = include_str!("../../../../kernels/layernorm.cu");
        assert!(ln.contains(&format!("#define LN_VPT {LN_VPT}\n")));
        let vec = include_str!("../../../../kernels/vec.cu");
        assert!(vec.contains(&format!("#define LNV_WARPS {LNV_WARPS}\n")));
        assert!(vec.contains(&format!("#define LNV_J {LNV_J} ")));
        assert_eq!(ln_threads(384).unwrap(), 96);
        assert_eq!(ln_threads(768).unwrap(), 192);
        assert_eq!(ln_threads(1).unwrap(), 32);
        assert_eq!(ln_threads(8192).unwrap(), 1024);
        assert!(ln_threads(8193).is_err());
        assert!(ln_threads(0).is_err());
        for h in [1, 31, 100, 384, 1000, 4096, 8192] {
            let t = ln_threads(h).unwrap() as usize;
            assert_eq!(t % 32, 0);
            assert!(h <= t * LN_VPT);
        }
        assert!(ln_vec_fits(384) && ln_vec_fits(1024) && !ln_vec_fits(1028) && !ln_vec_fits(6));
    }
}
