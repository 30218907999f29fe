//! `AddLayerNorm` (`add_ln`, the warp-per-row `add_ln_vec`). Where a
//! `gemm_small` Linear comes first, its kernel applies the AddLayerNorm in
//! its epilogue ([`super::linear`]), or leaves it to the op that reads its
//! output ([`KernelPath::LnDefer`]).

use super::planner::Planner;
use super::{suffix, Arg, Loc};
use crate::backend::cuda::mem::align_up;
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::AddLayerNorm;

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

impl Planner<'_> {
    /// `AddLayerNorm`: `out = LayerNorm(x + residual)`, a warp per row
    /// where the row fits, else a block per row.
    pub(super) fn add_layer_norm(
        &mut self,
        idx: usize,
        op: &AddLayerNorm,
    ) -> Result<usize, BackendError> {
        let AddLayerNorm {
            x,
            residual,
            gamma,
            beta,
            eps,
            out,
            rows,
            hidden,
        } = *op;
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
}

#[cfg(test)]
mod tests {
    use super::super::test_support::assert_defines;
    use super::*;

    #[test]
    fn layernorm_sizes_match_the_kernels() {
        assert_defines("layernorm.cu", &[("LN_VPT", LN_VPT as i64)]);
        let vec = [("LNV_WARPS", LNV_WARPS as i64), ("LNV_J", LNV_J as i64)];
        assert_defines("vec.cu", &vec);
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
