//! The [`Planner`] every stage of the plan extends: where each program
//! buffer lives, scratch in the arena, the kernel steps in order, the casts
//! between a buffer's storage type and what a kernel computes in, and the
//! counters and f32 scratch the fused epilogues share.

use super::{buffer_dtype, suffix, Arg, Limits, Loc, Step, TileTable};
use crate::backend::cuda::mem::{align_up, ALIGN};
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{BufId, InputRole, WeightId};
use crate::model::{Activation, Program, Weights};
use crate::tensor::DType;
use std::collections::HashMap;

use super::act_code;

/// Largest number of fused (counter-using) ops in one plan.
pub const MAX_COUNTERS: usize = 1024;
/// Bytes of a stream's zeroed block of [`MAX_COUNTERS`] u32 counters.
pub const COUNTER_BLOCK_BYTES: usize = MAX_COUNTERS * 4;
/// Values per thread and step of `bias_act_vec` (one 16-byte f16 vector).
pub const EW_VEC: usize = 8;
/// Block size of the element-wise kernel.
pub const EW_THREADS: u32 = 256;
/// Grid cap of the element-wise kernel (it loops over the rest).
pub const EW_MAX_BLOCKS: u32 = 8192;

/// Grid of the element-wise kernel for `n` elements.
pub fn ew_blocks(n: usize) -> u32 {
    (n.div_ceil(EW_THREADS as usize) as u32).clamp(1, EW_MAX_BLOCKS)
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

/// A cast still to run after an op: (from, from type, to, to type).
pub(super) type PendingCast = Option<(Loc, DType, Loc, DType)>;

/// A program being planned: what the stages read, and the plan so far.
pub(super) struct Planner<'a> {
    pub(super) program: &'a Program,
    pub(super) weights: &'a Weights,
    pub(super) compute: DType,
    pub(super) tf32: bool,
    pub(super) limits: Limits,
    pub(super) locs: HashMap<BufId, Loc>,
    /// Bytes of the arena so far (activations, then scratch).
    pub(super) arena: usize,
    /// Counters handed out so far ([`Loc::Counter`]).
    pub(super) counters: usize,
    /// The fused epilogues' f32 scratch (shared by all of them: they run
    /// one after the other) and its bytes.
    pub(super) fused_tmp: Option<(Loc, usize)>,
    /// A LayerNorm the next op must apply (planned by the op before it).
    pub(super) deferred_ln: Option<DeferredLn>,
    pub(super) steps: Vec<Step>,
    /// Bytes of the input block so far (tile tables are appended).
    pub(super) input_bytes: usize,
    pub(super) tile_tables: Vec<TileTable>,
}

impl Planner<'_> {
    /// Whether `path` is on.
    pub(super) fn on(&self, path: KernelPath) -> bool {
        self.limits.on(path)
    }

    /// Storage type of buffer `b`.
    pub(super) fn dtype(&self, b: BufId) -> DType {
        buffer_dtype(self.program.buffer(b).kind, self.compute)
    }

    /// The location of an integer input (validated: ids, types, masks,
    /// offsets and positions are integer inputs).
    pub(super) fn int_loc(&self, b: BufId) -> Loc {
        debug_assert_eq!(self.dtype(b), DType::I32);
        self.locs[&b]
    }

    /// Rows of a 2-D weight (validated: `[rows, width]`).
    pub(super) fn rows_of(&self, w: WeightId) -> usize {
        self.weights.get(w).shape[0]
    }

    pub(super) fn scratch(&mut self, elems: usize, dtype: DType) -> Loc {
        let off = self.arena;
        self.arena += align_up(elems * dtype.size(), ALIGN);
        Loc::Arena(off)
    }

    pub(super) fn kernel(
        &mut self,
        name: String,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: Vec<Arg>,
    ) {
        self.steps.push(Step::Kernel {
            name,
            grid,
            block: (block, 1, 1),
            smem: smem as u32,
            args,
        });
    }

    /// `to = act(from)` over `elems` values, converting `from_t` to `to_t`
    /// (`bias_act` without a bias): 8 values per thread and step where the
    /// types agree (in place, or a copy of one type), else one.
    pub(super) fn cast(
        &mut self,
        from: Loc,
        from_t: DType,
        to: Loc,
        to_t: DType,
        elems: usize,
        act: Activation,
    ) -> Result<(), BackendError> {
        let n = i32::try_from(elems)
            .map_err(|_| BackendError::Unsupported(format!("{elems} elements")))?;
        let vec = self.on(KernelPath::EwVec) && from_t == to_t && elems.is_multiple_of(EW_VEC);
        let (name, per_step) = if vec {
            (format!("bias_act_vec_{}", suffix(from_t)), EW_VEC)
        } else {
            (format!("bias_act_{}_{}", suffix(from_t), suffix(to_t)), 1)
        };
        let args = vec![
            Arg::Ptr(from),
            Arg::Null,
            Arg::Ptr(to),
            Arg::I32(n),
            Arg::I32(per_step as i32),
            Arg::I32(act_code(act)),
        ];
        self.kernel(
            name,
            (ew_blocks(elems / per_step), 1, 1),
            EW_THREADS,
            0,
            args,
        );
        Ok(())
    }

    /// The location of float buffer `b` read as `want`: itself, or a scratch
    /// copy converted before the op.
    pub(super) fn float_in(
        &mut self,
        b: BufId,
        elems: usize,
        want: DType,
    ) -> Result<Loc, BackendError> {
        let have = self.dtype(b);
        debug_assert!(have.is_float(), "validated: a float operand");
        if have == want {
            return Ok(self.locs[&b]);
        }
        let s = self.scratch(elems, want);
        self.cast(self.locs[&b], have, s, want, elems, Activation::Identity)?;
        Ok(s)
    }

    /// Where an op producing `native` values should write float buffer `b`:
    /// `b` itself, or scratch plus a cast to run after the op.
    pub(super) fn float_out(
        &mut self,
        b: BufId,
        elems: usize,
        native: DType,
    ) -> (Loc, PendingCast) {
        let have = self.dtype(b);
        debug_assert!(have.is_float(), "validated: a float operand");
        if have == native {
            return (self.locs[&b], None);
        }
        let s = self.scratch(elems, native);
        (s, Some((s, native, self.locs[&b], have)))
    }

    pub(super) fn finish_out(
        &mut self,
        pending: PendingCast,
        elems: usize,
    ) -> Result<(), BackendError> {
        if let Some((from, ft, to, tt)) = pending {
            self.cast(from, ft, to, tt, elems, Activation::Identity)?;
        }
        Ok(())
    }

    /// Packed programs: the `cu_seqlens` input and the most sequences;
    /// padded: `(Null, 0)`.
    pub(super) fn live_rows_args(&self) -> (Arg, usize) {
        match self.program.input(InputRole::SeqOffsets) {
            Some(o) if self.program.is_packed() => (Arg::Ptr(self.int_loc(o)), self.program.batch),
            _ => (Arg::Null, 0),
        }
    }

    /// A counter and the f32 `m` × `hidden` scratch of a fused sublayer
    /// (one scratch for all of a plan's: they run one after the other).
    pub(super) fn fused_scratch(&mut self, m: usize, hidden: usize) -> (Loc, Loc) {
        let counter = Loc::Counter(self.counters);
        self.counters += 1;
        let bytes = m * hidden * 4;
        let tmp = match self.fused_tmp {
            Some((loc, have)) if have >= bytes => loc,
            _ => {
                let loc = self.scratch(m * hidden, DType::F32);
                self.fused_tmp = Some((loc, bytes));
                loc
            }
        };
        (counter, tmp)
    }

    /// `gemm_small`'s last five arguments (`xf, xg, xb, xeps, xout`): the
    /// LayerNorm the op before left to `ops[idx]`, which reads `x`, or none.
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

    /// The LayerNorm of `x` that the op before left to `ops[idx]`, if any
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_wise_grid() {
        assert_eq!(ew_blocks(1), 1);
        assert_eq!(ew_blocks(256), 1);
        assert_eq!(ew_blocks(257), 2);
        assert_eq!(ew_blocks(1 << 30), EW_MAX_BLOCKS);
    }
}
