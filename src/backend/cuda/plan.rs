//! From a [`Program`] to the kernel launches and matmuls that compute it:
//! the plan (pure host code, unit-tested without a GPU). [`super::resolve`]
//! turns a plan's symbolic locations into device addresses and
//! [`super::launch`] issues the steps on a stream.
//!
//! [`plan`] is pure host code (unit-tested without a GPU). It takes a program
//! that passed [`Program::validate`] (so every buffer, weight and shape is as
//! the ops say; what is left to refuse here is what this device cannot run,
//! as [`BackendError::Unsupported`]), decides the storage type of every
//! buffer, lays the activations out in one arena, inserts the casts where the
//! program mixes f32 inputs/outputs with f16/bf16 activations, and computes
//! every launch configuration. [`resolve`] turns the symbolic locations into
//! device addresses, and [`enqueue`] issues the steps on a stream — the same
//! code for warm-up, capture and the eager path.
//!
//! Packed programs (see [`crate::model::program`]) plan their token ops onto
//! the packed kernels (`embed_ln_packed`, `attention_varlen[_tc]`,
//! `pool_packed`). A graph's grid is fixed at capture, so the varlen
//! attention takes its work from a **tile table**, a static buffer at the end
//! of the input block whose contents the host writes for every batch
//! ([`write_tile_table`]): one entry per query tile of at most `qt` tokens of
//! one sequence, sized for the worst case a budget can produce
//! ([`max_tiles`]); blocks whose entry is unused exit at once.

use super::matmul::{split_activation, MatmulShape};
use super::mem::{align_up, ALIGN};
use crate::backend::BackendError;
use crate::model::program::validate::op_buffers;
use crate::model::program::{BufId, BufKind, InputRole, Layout, Op, WeightId};
use crate::model::{Activation, Pooling, Program, Weights};
use crate::tensor::DType;
use std::collections::HashMap;

/// Threads per block of the attention kernel (`ATT_THREADS` in attention.cu).
pub const ATT_THREADS: u32 = 128;
/// Queries per attention block (`ATT_QT`).
pub const ATT_QT: usize = 32;
/// Keys per shared-memory chunk (`ATT_KC`).
pub const ATT_KC: usize = 64;
/// Threads per tensor-core attention block (`TC_THREADS` in attention_tc.cu).
pub const TC_THREADS: u32 = 128;
/// Queries per tensor-core attention block (`TC_QT`).
pub const TC_QT: usize = 64;
/// Queries per tile of the tensor-core varlen attention (`VT_QT` in
/// attention_varlen.cu, = `TC_QT`).
pub const VARLEN_TC_QT: usize = TC_QT;
/// Queries per tile of the CUDA-core varlen attention (`VA_QT`, = `ATT_QT`).
pub const VARLEN_QT: usize = ATT_QT;
/// i32 values per tile-table entry: `{q_start, q_count, kv_start, kv_len}`.
pub const TILE_ENTRY: usize = 4;
/// Threads per pooling block (`POOL_THREADS` in pool.cu).
pub const POOL_THREADS: u32 = 256;
/// Values each LayerNorm thread keeps in registers (`LN_VPT` in layernorm.cu).
pub const LN_VPT: usize = 8;
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
/// Largest number of fused (counter-using) ops in one plan.
pub const MAX_COUNTERS: usize = 1024;
/// Block size of the element-wise kernel.
pub const EW_THREADS: u32 = 256;
/// Grid cap of the element-wise kernel (it loops over the rest).
pub const EW_MAX_BLOCKS: u32 = 8192;

/// Storage type of a program buffer on the device.
pub fn buffer_dtype(kind: BufKind, compute: DType) -> DType {
    match kind {
        BufKind::Input(InputRole::Features) => DType::F32,
        BufKind::Input(_) => DType::I32,
        BufKind::Activation => compute,
        BufKind::Output => DType::F32,
    }
}

/// Kernel-name suffix of a storage type.
pub fn suffix(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::I32 => "i32",
        DType::U32 => "u32",
    }
}

/// The activation code the kernels use (`ACT_*` in common.cuh).
pub fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Identity => 0,
        Activation::Relu => 1,
        Activation::Gelu => 2,
        Activation::GeluTanh => 3,
        Activation::Tanh => 4,
        Activation::Sigmoid => 5,
        Activation::Silu => 6,
    }
}

/// The pooling code (`POOL_*` in pool.cu).
pub fn pool_code(p: Pooling) -> i32 {
    match p {
        Pooling::Mean => 0,
        Pooling::Cls => 1,
        Pooling::Max => 2,
    }
}

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

/// Grid of the element-wise kernel for `n` elements.
pub fn ew_blocks(n: usize) -> u32 {
    (n.div_ceil(EW_THREADS as usize) as u32).clamp(1, EW_MAX_BLOCKS)
}

/// The attention kernel's head-size class (the `d<N>` suffix).
pub fn attention_dmax(head_dim: usize) -> Option<usize> {
    super::kernels::ATTENTION_DMAX
        .iter()
        .copied()
        .find(|&d| head_dim <= d && head_dim > 0)
}

/// Dynamic shared memory of the attention kernel, in bytes.
pub fn attention_smem_bytes(seq: usize, dmax: usize) -> usize {
    4 * (ATT_QT * (dmax + 1) + ATT_KC * (dmax + 1) + ATT_QT * (seq | 1))
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

/// The most query tiles of at most `qt` tokens a packed batch of `tokens`
/// slots and at most `seqs` sequences can need, the tail included: each
/// sequence and the tail split into `ceil(len / qt)` tiles, at most
/// `floor(tokens / qt)` of them full and at most one partial tile per
/// non-empty part (`seqs + 1` parts), and never more tiles than slots.
pub fn max_tiles(tokens: usize, seqs: usize, qt: usize) -> usize {
    tokens.min(tokens / qt + seqs + 1)
}

/// Writes the tile table of a packed batch whose sequences have lengths
/// `lens` (end to end from slot 0) in a budget of `tokens` slots, for tiles
/// of at most `qt` queries. `dst` holds [`max_tiles`] entries of
/// [`TILE_ENTRY`] i32: `{q_start, q_count, kv_start, kv_len}`.
///
/// Order: the tiles of the longest sequences first (their blocks cost the
/// most, and blocks are dispatched in table order, so the short ones fill
/// in at the end), then the tail's tiles (`kv_len = 0`: their rows get
/// zeros), then unused entries (all zero: `q_count = 0`, the block exits).
/// `order` is scratch for the sort (kept by the caller so a replay does not
/// allocate once it has grown).
///
/// Panics if the lengths do not fit (more tokens than the budget, or more
/// tiles than `dst` holds); a checked batch never does.
pub fn write_tile_table(
    lens: impl IntoIterator<Item = usize>,
    tokens: usize,
    qt: usize,
    dst: &mut [i32],
    order: &mut Vec<(usize, usize)>,
) {
    assert!(qt > 0 && dst.len().is_multiple_of(TILE_ENTRY));
    order.clear();
    let mut start = 0;
    for len in lens {
        order.push((len, start));
        start += len;
    }
    assert!(start <= tokens, "{start} tokens in a budget of {tokens}");
    // Longest first; equal lengths in batch order (the start breaks ties, so
    // an unstable sort, which does not allocate, gives the same order).
    order.sort_unstable_by_key(|&(len, start)| (std::cmp::Reverse(len), start));
    let mut entries = dst.chunks_exact_mut(TILE_ENTRY);
    let mut push = |q_start: usize, q_count: usize, kv_start: usize, kv_len: usize| {
        let e = entries
            .next()
            .expect("the tile table is sized for the worst case");
        e.copy_from_slice(&[
            q_start as i32,
            q_count as i32,
            kv_start as i32,
            kv_len as i32,
        ]);
    };
    for &(len, seq_start) in order.iter() {
        for q in (0..len).step_by(qt) {
            push(seq_start + q, qt.min(len - q), seq_start, len);
        }
    }
    for q in (start..tokens).step_by(qt) {
        push(q, qt.min(tokens - q), q, 0);
    }
    for e in entries {
        e.fill(0);
    }
}

/// True when `buf` is not read by `ops[from..]` before being overwritten.
pub fn dead_after(ops: &[Op], from: usize, buf: BufId) -> bool {
    for op in ops.iter().skip(from) {
        let (reads, writes) = op_buffers(op);
        if reads.contains(&buf) {
            return false;
        }
        if writes == buf {
            return true;
        }
    }
    true
}

/// Where a device address comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    Weight(WeightId),
    /// Byte offset into the static input block.
    Input(usize),
    /// Byte offset into the output buffer.
    Output(usize),
    /// Byte offset into the activation arena.
    Arena(usize),
    /// Index of a u32 counter (zero between kernels) for last-block reductions.
    Counter(usize),
}

/// A kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(Loc),
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
}

/// One thing to enqueue.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Kernel {
        name: String,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Vec<Arg>,
    },
    Matmul {
        shape: MatmulShape,
        w: Loc,
        x: Loc,
        out: Loc,
        bias: Option<Loc>,
    },
}

/// A program input in the static input block (same layout in pinned memory).
#[derive(Clone, Debug, PartialEq)]
pub struct InputSlot {
    pub buf: BufId,
    pub role: InputRole,
    pub elems: usize,
    /// Byte offset in the input block.
    pub offset: usize,
}

/// A varlen attention's tile table in the static input block (see
/// [`write_tile_table`]); the host writes it with the program's inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct TileTable {
    /// Queries per tile.
    pub qt: usize,
    /// Entries (of [`TILE_ENTRY`] i32).
    pub max_tiles: usize,
    /// Byte offset in the input block.
    pub offset: usize,
}

/// Everything needed to run one program on the device.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub compute: DType,
    pub batch: usize,
    pub seq: usize,
    /// The program's layout (packed plans fill their inputs by
    /// [`BatchRows::pack_packed`](crate::model::BatchRows::pack_packed)).
    pub layout: Layout,
    pub steps: Vec<Step>,
    pub inputs: Vec<InputSlot>,
    /// Tile tables of the varlen attention (packed plans), after the inputs
    /// in the input block.
    pub tile_tables: Vec<TileTable>,
    /// Bytes of the static input block.
    pub input_bytes: usize,
    /// f32 elements of the output, `batch · output_dim`.
    pub output_elems: usize,
    pub output_dim: usize,
    /// Activation bytes (the program's activation buffers).
    pub activation_bytes: usize,
    /// Activations plus cast scratch: the arena this plan needs.
    pub arena_bytes: usize,
    /// Counters the plan's fused kernels use (see [`Loc::Counter`]).
    pub counters: usize,
}

impl Plan {
    /// `"(8, 16)"`, or for a packed plan `"1024t (256 seqs of at most 256)"`.
    pub fn label(&self) -> String {
        match self.layout {
            Layout::Padded => format!("({}, {})", self.batch, self.seq),
            Layout::Packed { tokens } => {
                format!("{tokens}t ({} seqs of at most {})", self.batch, self.seq)
            }
        }
    }

    pub fn kernel_count(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s, Step::Kernel { .. }))
            .count()
    }

    pub fn matmul_count(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| matches!(s, Step::Matmul { .. }))
            .count()
    }
}

/// Device limits the planner needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest dynamic shared memory a block may use (after opt-in).
    pub max_dyn_smem: usize,
    /// Use the tensor-core attention kernel where it applies.
    pub tc_attention: bool,
    /// Use the skinny matmul kernel (and its LayerNorm fusion) for few rows.
    pub skinny: bool,
}

impl Limits {
    /// All kernels enabled, with this shared-memory limit.
    pub const fn new(max_dyn_smem: usize) -> Limits {
        Limits {
            max_dyn_smem,
            tc_attention: true,
            skinny: true,
        }
    }

    /// Applies `REPLAYD_CUDA_DISABLE` (comma-separated: `tc_attention`,
    /// `skinny`), a switch for debugging and for falling back should one of
    /// the specialised kernels misbehave on some device.
    pub fn with_disabled(mut self, list: &str) -> Limits {
        for item in list.split(',').map(str::trim) {
            match item {
                "tc_attention" => self.tc_attention = false,
                "skinny" => self.skinny = false,
                _ => {}
            }
        }
        self
    }
}

/// A cast still to run after an op: (from, from type, to, to type).
type PendingCast = Option<(Loc, DType, Loc, DType)>;

struct Planner<'a> {
    program: &'a Program,
    weights: &'a Weights,
    compute: DType,
    tf32: bool,
    limits: Limits,
    locs: HashMap<BufId, Loc>,
    arena: usize,
    counters: usize,
    steps: Vec<Step>,
    /// Bytes of the input block so far (tile tables are appended).
    input_bytes: usize,
    tile_tables: Vec<TileTable>,
}

impl<'a> Planner<'a> {
    fn dtype(&self, b: BufId) -> DType {
        buffer_dtype(self.program.buffer(b).kind, self.compute)
    }

    /// The location of an integer input (validated: ids, types and masks
    /// are integer inputs).
    fn int_loc(&self, b: BufId) -> Loc {
        debug_assert_eq!(self.dtype(b), DType::I32);
        self.locs[&b]
    }

    /// Rows of a 2-D weight (validated: `[rows, width]`).
    fn rows_of(&self, w: WeightId) -> usize {
        self.weights.get(w).shape[0]
    }

    /// The tile table for tiles of `qt` queries (one per tile size, shared
    /// by every layer's attention): its location and entries.
    fn tile_table(&mut self, qt: usize, tokens: usize, seqs: usize) -> (Loc, usize) {
        if let Some(t) = self.tile_tables.iter().find(|t| t.qt == qt) {
            return (Loc::Input(t.offset), t.max_tiles);
        }
        let max_tiles = max_tiles(tokens, seqs, qt);
        let offset = self.input_bytes;
        self.input_bytes += align_up(max_tiles * TILE_ENTRY * 4, ALIGN);
        self.tile_tables.push(TileTable {
            qt,
            max_tiles,
            offset,
        });
        (Loc::Input(offset), max_tiles)
    }

    fn scratch(&mut self, elems: usize, dtype: DType) -> Loc {
        let off = self.arena;
        self.arena += align_up(elems * dtype.size(), ALIGN);
        Loc::Arena(off)
    }

    fn kernel(
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

    fn cast(
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
        self.kernel(
            format!("bias_act_{}_{}", suffix(from_t), suffix(to_t)),
            (ew_blocks(elems), 1, 1),
            EW_THREADS,
            0,
            vec![
                Arg::Ptr(from),
                Arg::Null,
                Arg::Ptr(to),
                Arg::I32(n),
                Arg::I32(1),
                Arg::I32(act_code(act)),
            ],
        );
        Ok(())
    }

    /// The location of float buffer `b` read as `want`: itself, or a scratch
    /// copy converted before the op.
    fn float_in(&mut self, b: BufId, elems: usize, want: DType) -> Result<Loc, BackendError> {
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
    fn float_out(&mut self, b: BufId, elems: usize, native: DType) -> (Loc, PendingCast) {
        let have = self.dtype(b);
        debug_assert!(have.is_float(), "validated: a float operand");
        if have == native {
            return (self.locs[&b], None);
        }
        let s = self.scratch(elems, native);
        (s, Some((s, native, self.locs[&b], have)))
    }

    fn finish_out(&mut self, pending: PendingCast, elems: usize) -> Result<(), BackendError> {
        if let Some((from, ft, to, tt)) = pending {
            self.cast(from, ft, to, tt, elems, Activation::Identity)?;
        }
        Ok(())
    }

    /// A Linear with few rows through the skinny kernel, fused with the
    /// AddLayerNorm after it when that reads only this output (which is then
    /// never materialised). Returns the ops consumed.
    #[allow(clippy::too_many_arguments)]
    fn skinny(
        &mut self,
        idx: usize,
        w: WeightId,
        bias: Option<WeightId>,
        act: Activation,
        x_l: Loc,
        out: BufId,
        out_t: DType,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<usize, BackendError> {
        let t = self.compute;
        let grid = (n.div_ceil(SK_COLS) as u32, 1, 1);
        let block = (32 * SK_WARPS) as u32;
        let bias_arg = bias.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        if let Some(Op::AddLayerNorm {
            x: ln_x,
            residual,
            gamma,
            beta,
            eps,
            out: ln_out,
            rows,
            hidden,
        }) = self.program.ops.get(idx + 1).cloned()
        {
            let fusable = act == Activation::Identity
                && ln_x == out
                && ln_out != out
                && rows == m
                && hidden == n
                && self.program.buffer(out).kind == BufKind::Activation
                && self.dtype(residual) == t
                && self.dtype(ln_out) == t
                && dead_after(&self.program.ops, idx + 2, out);
            if fusable {
                let tmp = self.scratch(m * n, DType::F32);
                let counter = Loc::Counter(self.counters);
                self.counters += 1;
                self.kernel(
                    format!("skinny_{0}_{0}", suffix(t)),
                    grid,
                    block,
                    0,
                    vec![
                        Arg::Ptr(x_l),
                        Arg::Ptr(Loc::Weight(w)),
                        bias_arg,
                        Arg::Ptr(self.locs[&ln_out]),
                        Arg::I32(m as i32),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                        Arg::I32(0),
                        Arg::I32(1),
                        Arg::Ptr(self.locs[&residual]),
                        Arg::Ptr(tmp),
                        Arg::Ptr(Loc::Weight(gamma)),
                        Arg::Ptr(Loc::Weight(beta)),
                        Arg::F32(eps),
                        Arg::Ptr(counter),
                    ],
                );
                return Ok(2);
            }
        }
        self.kernel(
            format!("skinny_{}_{}", suffix(t), suffix(out_t)),
            grid,
            block,
            0,
            vec![
                Arg::Ptr(x_l),
                Arg::Ptr(Loc::Weight(w)),
                bias_arg,
                Arg::Ptr(self.locs[&out]),
                Arg::I32(m as i32),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(act_code(act)),
                Arg::I32(0),
                Arg::Null,
                Arg::Null,
                Arg::Null,
                Arg::Null,
                Arg::F32(0.0),
                Arg::Null,
            ],
        );
        Ok(1)
    }

    /// Plans op `idx` (and possibly the one after it, when fused); returns
    /// how many ops it consumed.
    fn op(&mut self, idx: usize, op: &Op) -> Result<usize, BackendError> {
        let t = self.compute;
        let ts = suffix(t);
        match *op {
            Op::EmbedLayerNorm {
                ids,
                token_types,
                word,
                position,
                token_type,
                gamma,
                beta,
                eps,
                out,
                batch,
                seq,
                hidden,
                ..
            } => {
                let rows = batch * seq;
                let ids_l = self.int_loc(ids);
                let types_l = self.int_loc(token_types);
                let vocab = self.rows_of(word);
                let npos = self.rows_of(position);
                let ntypes = self.rows_of(token_type);
                let threads = ln_threads(hidden)?;
                let (dst, pending) = self.float_out(out, rows * hidden, t);
                self.kernel(
                    format!("embed_ln_{ts}"),
                    (rows as u32, 1, 1),
                    threads,
                    0,
                    vec![
                        Arg::Ptr(ids_l),
                        Arg::Ptr(types_l),
                        Arg::Ptr(Loc::Weight(word)),
                        Arg::Ptr(Loc::Weight(position)),
                        Arg::Ptr(Loc::Weight(token_type)),
                        Arg::Ptr(Loc::Weight(gamma)),
                        Arg::Ptr(Loc::Weight(beta)),
                        Arg::F32(eps),
                        Arg::Ptr(dst),
                        Arg::I32(seq as i32),
                        Arg::I32(hidden as i32),
                        Arg::I32(vocab as i32),
                        Arg::I32(npos as i32),
                        Arg::I32(ntypes as i32),
                    ],
                );
                self.finish_out(pending, rows * hidden)?;
                Ok(1)
            }
            // Refused by `not_on_cuda` before planning; kept an error, not a panic.
            Op::Normalize { .. } => Err(BackendError::Unsupported(format!(
                "op {idx} (Normalize): not implemented on CUDA"
            ))),
            Op::Linear {
                x,
                w,
                bias,
                act,
                out,
                m,
                n,
                k,
            } => {
                let x_l = self.float_in(x, m * k, t)?;
                let out_t = self.dtype(out);
                if self.limits.skinny
                    && skinny_fits(m, n, k, t)
                    && (out_t == t || out_t == DType::F32)
                {
                    return self.skinny(idx, w, bias, act, x_l, out, out_t, m, n, k);
                }
                let (epilogue, post) = split_activation(act, bias.is_some());
                let shape = MatmulShape {
                    dtype: t,
                    m,
                    n,
                    k,
                    epilogue,
                    tf32: self.tf32 && t == DType::F32,
                };
                if out_t == t {
                    let o = self.locs[&out];
                    self.steps.push(Step::Matmul {
                        shape,
                        w: Loc::Weight(w),
                        x: x_l,
                        out: o,
                        bias: bias.map(Loc::Weight),
                    });
                    if let Some(a) = post {
                        self.cast(o, t, o, t, m * n, a)?;
                    }
                } else {
                    let tmp = self.scratch(m * n, t);
                    self.steps.push(Step::Matmul {
                        shape,
                        w: Loc::Weight(w),
                        x: x_l,
                        out: tmp,
                        bias: bias.map(Loc::Weight),
                    });
                    let o = self.locs[&out];
                    self.cast(
                        tmp,
                        t,
                        o,
                        out_t,
                        m * n,
                        post.unwrap_or(Activation::Identity),
                    )?;
                }
                Ok(1)
            }
            Op::AddLayerNorm {
                x,
                residual,
                gamma,
                beta,
                eps,
                out,
                rows,
                hidden,
            } => {
                let threads = ln_threads(hidden)?;
                let elems = rows * hidden;
                let x_l = self.float_in(x, elems, t)?;
                let r_l = self.float_in(residual, elems, t)?;
                let (dst, pending) = self.float_out(out, elems, t);
                self.kernel(
                    format!("add_ln_{ts}"),
                    (rows as u32, 1, 1),
                    threads,
                    0,
                    vec![
                        Arg::Ptr(x_l),
                        Arg::Ptr(r_l),
                        Arg::Ptr(Loc::Weight(gamma)),
                        Arg::Ptr(Loc::Weight(beta)),
                        Arg::F32(eps),
                        Arg::Ptr(dst),
                        Arg::I32(hidden as i32),
                    ],
                );
                self.finish_out(pending, elems)?;
                Ok(1)
            }
            Op::Attention {
                qkv,
                mask,
                out,
                batch,
                seq,
                heads,
                head_dim,
                ..
            } => {
                let what = format!("op {idx} (Attention)");
                let dmax = attention_dmax(head_dim).ok_or_else(|| {
                    BackendError::Unsupported(format!("{what}: head size {head_dim} (at most 128)"))
                })?;
                if batch > 65535 || heads > 65535 {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: batch {batch} x heads {heads}"
                    )));
                }
                let rows = batch * seq;
                let hd = heads * head_dim;
                let tensor_cores = self.limits.tc_attention
                    && matches!(t, DType::F16 | DType::BF16)
                    && super::kernels::ATTENTION_TC_HEAD_DIMS.contains(&head_dim);
                let smem = if tensor_cores {
                    0
                } else {
                    attention_smem_bytes(seq, dmax)
                };
                if smem > self.limits.max_dyn_smem {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: sequence length {seq} needs {smem} bytes of shared memory, the device allows {}",
                        self.limits.max_dyn_smem
                    )));
                }
                let mask_l = self.int_loc(mask);
                let q_l = self.float_in(qkv, rows * 3 * hd, t)?;
                let (dst, pending) = self.float_out(out, rows * hd, t);
                if tensor_cores {
                    self.kernel(
                        format!("attention_tc_{ts}_d{head_dim}"),
                        (seq.div_ceil(TC_QT) as u32, heads as u32, batch as u32),
                        TC_THREADS,
                        0,
                        vec![
                            Arg::Ptr(q_l),
                            Arg::Ptr(mask_l),
                            Arg::Ptr(dst),
                            Arg::I32(seq as i32),
                            Arg::I32(heads as i32),
                            Arg::F32(1.0 / (head_dim as f32).sqrt()),
                        ],
                    );
                } else {
                    self.kernel(
                        format!("attention_{ts}_d{dmax}"),
                        (seq.div_ceil(ATT_QT) as u32, heads as u32, batch as u32),
                        ATT_THREADS,
                        smem,
                        vec![
                            Arg::Ptr(q_l),
                            Arg::Ptr(mask_l),
                            Arg::Ptr(dst),
                            Arg::I32(seq as i32),
                            Arg::I32(heads as i32),
                            Arg::I32(head_dim as i32),
                            Arg::F32(1.0 / (head_dim as f32).sqrt()),
                        ],
                    );
                }
                self.finish_out(pending, rows * hd)?;
                Ok(1)
            }
            Op::Pool {
                x,
                mask,
                out,
                batch,
                seq,
                hidden,
                mode,
                normalize,
                ..
            } => {
                let mask_l = self.int_loc(mask);
                let x_l = self.float_in(x, batch * seq * hidden, t)?;
                let (dst, pending) = self.float_out(out, batch * hidden, DType::F32);
                self.kernel(
                    format!("pool_{ts}"),
                    (batch as u32, 1, 1),
                    POOL_THREADS,
                    0,
                    vec![
                        Arg::Ptr(x_l),
                        Arg::Ptr(mask_l),
                        Arg::Ptr(dst),
                        Arg::I32(seq as i32),
                        Arg::I32(hidden as i32),
                        Arg::I32(pool_code(mode)),
                        Arg::I32(normalize as i32),
                    ],
                );
                self.finish_out(pending, batch * hidden)?;
                Ok(1)
            }
            Op::PackedEmbedLayerNorm {
                ids,
                token_types,
                positions,
                word,
                position,
                token_type,
                gamma,
                beta,
                eps,
                out,
                tokens,
                hidden,
                ..
            } => {
                let what = format!("op {idx} (PackedEmbedLayerNorm)");
                let grid = u32::try_from(tokens)
                    .ok()
                    .filter(|&g| g <= i32::MAX as u32)
                    .ok_or_else(|| BackendError::Unsupported(format!("{what}: {tokens} tokens")))?;
                let threads = ln_threads(hidden)?;
                let (dst, pending) = self.float_out(out, tokens * hidden, t);
                self.kernel(
                    format!("embed_ln_packed_{ts}"),
                    (grid, 1, 1),
                    threads,
                    0,
                    vec![
                        Arg::Ptr(self.int_loc(ids)),
                        Arg::Ptr(self.int_loc(token_types)),
                        Arg::Ptr(self.int_loc(positions)),
                        Arg::Ptr(Loc::Weight(word)),
                        Arg::Ptr(Loc::Weight(position)),
                        Arg::Ptr(Loc::Weight(token_type)),
                        Arg::Ptr(Loc::Weight(gamma)),
                        Arg::Ptr(Loc::Weight(beta)),
                        Arg::F32(eps),
                        Arg::Ptr(dst),
                        Arg::I32(hidden as i32),
                        Arg::I32(self.rows_of(word) as i32),
                        Arg::I32(self.rows_of(position) as i32),
                        Arg::I32(self.rows_of(token_type) as i32),
                    ],
                );
                self.finish_out(pending, tokens * hidden)?;
                Ok(1)
            }
            Op::PackedAttention {
                qkv,
                offsets: _,
                out,
                tokens,
                seqs,
                max_seq_len,
                heads,
                head_dim,
                ..
            } => {
                let what = format!("op {idx} (PackedAttention)");
                let dmax = attention_dmax(head_dim).ok_or_else(|| {
                    BackendError::Unsupported(format!("{what}: head size {head_dim} (at most 128)"))
                })?;
                let tensor_cores = self.limits.tc_attention
                    && matches!(t, DType::F16 | DType::BF16)
                    && super::kernels::ATTENTION_TC_HEAD_DIMS.contains(&head_dim);
                let qt = if tensor_cores {
                    VARLEN_TC_QT
                } else {
                    VARLEN_QT
                };
                let tiles = max_tiles(tokens, seqs, qt);
                let blocks = tiles
                    .checked_mul(heads)
                    .filter(|&b| b <= i32::MAX as usize && tokens <= i32::MAX as usize);
                let Some(blocks) = blocks else {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: {tokens} tokens x {heads} heads"
                    )));
                };
                let smem = if tensor_cores {
                    0
                } else {
                    attention_smem_bytes(max_seq_len, dmax)
                };
                if smem > self.limits.max_dyn_smem {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: sequences of up to {max_seq_len} tokens need {smem} bytes of shared memory, the device allows {}",
                        self.limits.max_dyn_smem
                    )));
                }
                let (table, _) = self.tile_table(qt, tokens, seqs);
                let hd = heads * head_dim;
                let q_l = self.float_in(qkv, tokens * 3 * hd, t)?;
                let (dst, pending) = self.float_out(out, tokens * hd, t);
                let scale = 1.0 / (head_dim as f32).sqrt();
                if tensor_cores {
                    self.kernel(
                        format!("attention_varlen_tc_{ts}_d{head_dim}"),
                        (blocks as u32, 1, 1),
                        TC_THREADS,
                        0,
                        vec![
                            Arg::Ptr(q_l),
                            Arg::Ptr(table),
                            Arg::Ptr(dst),
                            Arg::I32(heads as i32),
                            Arg::F32(scale),
                            Arg::I32(tokens as i32),
                        ],
                    );
                } else {
                    self.kernel(
                        format!("attention_varlen_{ts}_d{dmax}"),
                        (blocks as u32, 1, 1),
                        ATT_THREADS,
                        smem,
                        vec![
                            Arg::Ptr(q_l),
                            Arg::Ptr(table),
                            Arg::Ptr(dst),
                            Arg::I32(heads as i32),
                            Arg::I32(head_dim as i32),
                            Arg::F32(scale),
                            Arg::I32(tokens as i32),
                            Arg::I32(max_seq_len as i32),
                        ],
                    );
                }
                self.finish_out(pending, tokens * hd)?;
                Ok(1)
            }
            Op::PackedPool {
                x,
                offsets,
                out,
                tokens,
                seqs,
                hidden,
                mode,
                normalize,
                ..
            } => {
                if seqs > i32::MAX as usize || tokens > i32::MAX as usize {
                    return Err(BackendError::Unsupported(format!(
                        "op {idx} (PackedPool): {seqs} sequences of {tokens} tokens"
                    )));
                }
                let x_l = self.float_in(x, tokens * hidden, t)?;
                let (dst, pending) = self.float_out(out, seqs * hidden, DType::F32);
                self.kernel(
                    format!("pool_packed_{ts}"),
                    (seqs as u32, 1, 1),
                    POOL_THREADS,
                    0,
                    vec![
                        Arg::Ptr(x_l),
                        Arg::Ptr(self.int_loc(offsets)),
                        Arg::Ptr(dst),
                        Arg::I32(tokens as i32),
                        Arg::I32(hidden as i32),
                        Arg::I32(pool_code(mode)),
                        Arg::I32(normalize as i32),
                    ],
                );
                self.finish_out(pending, seqs * hidden)?;
                Ok(1)
            }
        }
    }
}

/// Plans `program` for compute type `compute`.
/// What of `op` the CUDA kernels do not implement yet (issue 13's encoder
/// families and sentence-transformers heads run on the CPU backend only):
/// RoBERTa-style position ids (XLM-R, MPNet), MPNet's relative attention
/// bias, pooling that skips a prompt (`include_prompt = false`) and the
/// `Normalize` op after a `Dense` module. Refusing the whole program here,
/// before anything is planned, is what keeps a graph from computing such a
/// model as if it were plain BERT (wrong numbers, no error).
pub fn not_on_cuda(op: &Op) -> Option<String> {
    use crate::model::program::PositionIds;
    match op {
        Op::EmbedLayerNorm { position_ids, .. } | Op::PackedEmbedLayerNorm { position_ids, .. }
            if *position_ids != PositionIds::Index =>
        {
            Some(format!(
                "position ids {position_ids:?} (XLM-RoBERTa / MPNet) are not implemented on CUDA yet; serve the model with backend = \"cpu\""
            ))
        }
        Op::Attention { bias: Some(_), .. } | Op::PackedAttention { bias: Some(_), .. } => Some(
            "a relative attention bias (MPNet) is not implemented on CUDA yet; serve the model with backend = \"cpu\"".into(),
        ),
        Op::Pool { skip: Some(_), .. } | Op::PackedPool { skip: Some(_), .. } => Some(
            "pooling that excludes the prompt (include_prompt = false) is not implemented on CUDA yet; serve the model with backend = \"cpu\"".into(),
        ),
        Op::Normalize { .. } => Some(
            "Normalize after a Dense module is not implemented on CUDA yet; serve the model with backend = \"cpu\"".into(),
        ),
        _ => None,
    }
}

pub fn plan(
    program: &Program,
    weights: &Weights,
    compute: DType,
    tf32: bool,
    limits: Limits,
) -> Result<Plan, BackendError> {
    if !compute.is_float() {
        return Err(BackendError::Unsupported(format!(
            "compute dtype {compute}"
        )));
    }
    for (idx, op) in program.ops.iter().enumerate() {
        if let Some(why) = not_on_cuda(op) {
            return Err(BackendError::Unsupported(format!("op {idx}: {why}")));
        }
    }
    // The program has passed `Program::validate`: buffers, inputs and the
    // one output are as declared.
    let output_elems = program.batch * program.output_dim;
    let mut locs = HashMap::new();
    let mut inputs = Vec::new();
    let mut input_bytes = 0usize;
    for &id in &program.inputs {
        let decl = program.buffer(id);
        let BufKind::Input(role) = decl.kind else {
            unreachable!("validated: inputs are Input buffers")
        };
        locs.insert(id, Loc::Input(input_bytes));
        inputs.push(InputSlot {
            buf: id,
            role,
            elems: decl.elems,
            offset: input_bytes,
        });
        input_bytes += align_up(decl.elems * 4, ALIGN);
    }
    let mut arena = 0usize;
    for (i, decl) in program.buffers.iter().enumerate() {
        match decl.kind {
            BufKind::Activation => {
                locs.insert(BufId(i), Loc::Arena(arena));
                arena += align_up(decl.elems * compute.size(), ALIGN);
            }
            BufKind::Output => {
                locs.insert(BufId(i), Loc::Output(0));
            }
            BufKind::Input(_) => {}
        }
    }
    let activation_bytes = arena;
    let mut p = Planner {
        program,
        weights,
        compute,
        tf32,
        limits,
        locs,
        arena,
        counters: 0,
        steps: Vec::new(),
        input_bytes,
        tile_tables: Vec::new(),
    };
    let mut i = 0;
    while i < program.ops.len() {
        i += p.op(i, &program.ops[i])?;
    }
    if p.counters > MAX_COUNTERS {
        return Err(BackendError::Unsupported(format!(
            "{} fused ops in one program (at most {MAX_COUNTERS})",
            p.counters
        )));
    }
    Ok(Plan {
        compute,
        batch: program.batch,
        seq: program.seq,
        layout: program.layout,
        steps: p.steps,
        inputs,
        tile_tables: p.tile_tables,
        input_bytes: p.input_bytes,
        output_elems,
        output_dim: program.output_dim,
        activation_bytes,
        arena_bytes: p.arena.max(ALIGN),
        counters: p.counters,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::program::ProgramBuilder;

    const LIMITS: Limits = Limits::new(227 * 1024);

    fn mlp(batch: usize, act: Activation) -> (Program, Weights) {
        let mut w = Weights::new();
        let w1 = w.push("0.weight", vec![256, 128], vec![0.0; 256 * 128]);
        let b1 = w.push("0.bias", vec![256], vec![0.0; 256]);
        let w2 = w.push("2.weight", vec![10, 256], vec![0.0; 2560]);
        let b2 = w.push("2.bias", vec![10], vec![0.0; 10]);
        let mut b = ProgramBuilder::new();
        let x = b.input("x", InputRole::Features, batch * 128);
        let h = b.activation("h", batch * 256);
        let y = b.output("y", batch * 10);
        b.push(Op::Linear {
            x,
            w: w1,
            bias: Some(b1),
            act,
            out: h,
            m: batch,
            n: 256,
            k: 128,
        });
        b.push(Op::Linear {
            x: h,
            w: w2,
            bias: Some(b2),
            act: Activation::Identity,
            out: y,
            m: batch,
            n: 10,
            k: 256,
        });
        (b.finish(batch, 1, y, 10), w)
    }

    /// A one-layer BERT-shaped program (MiniLM sizes) for planner tests.
    pub(crate) fn tiny_bert(batch: usize, seq: usize) -> (Program, Weights) {
        bert_dims(batch, seq, 384, 12, 1536)
    }

    /// A one-layer BERT-shaped program of the given widths.
    pub(crate) fn bert_dims(
        batch: usize,
        seq: usize,
        hidden: usize,
        heads: usize,
        inter: usize,
    ) -> (Program, Weights) {
        let (hd, vocab) = (hidden / heads, 100);
        let mut w = Weights::new();
        let z = |n: usize| vec![0.0f32; n];
        let word = w.push("word", vec![vocab, hidden], z(vocab * hidden));
        let pos = w.push("pos", vec![512, hidden], z(512 * hidden));
        let tt = w.push("tt", vec![2, hidden], z(2 * hidden));
        let g = w.push("g", vec![hidden], z(hidden));
        let be = w.push("b", vec![hidden], z(hidden));
        let wqkv = w.push("qkv", vec![3 * hidden, hidden], z(3 * hidden * hidden));
        let bqkv = w.push("qkv.b", vec![3 * hidden], z(3 * hidden));
        let wo = w.push("o", vec![hidden, hidden], z(hidden * hidden));
        let bo = w.push("o.b", vec![hidden], z(hidden));
        let wi = w.push("i", vec![inter, hidden], z(inter * hidden));
        let bi = w.push("i.b", vec![inter], z(inter));
        let wo2 = w.push("o2", vec![hidden, inter], z(inter * hidden));
        let bo2 = w.push("o2.b", vec![hidden], z(hidden));
        let rows = batch * seq;
        let mut b = ProgramBuilder::new();
        let ids = b.input("ids", InputRole::TokenIds, rows);
        let mask = b.input("mask", InputRole::AttentionMask, rows);
        let types = b.input("types", InputRole::TokenTypeIds, rows);
        let h = b.activation("h", rows * hidden);
        let qkv = b.activation("qkv", rows * 3 * hidden);
        let ctx = b.activation("ctx", rows * hidden);
        let t = b.activation("t", rows * inter);
        let out = b.output("out", batch * hidden);
        b.push(Op::EmbedLayerNorm {
            position_ids: Default::default(),
            ids,
            token_types: types,
            word,
            position: pos,
            token_type: tt,
            gamma: g,
            beta: be,
            eps: 1e-12,
            out: h,
            batch,
            seq,
            hidden,
        });
        b.push(Op::Linear {
            x: h,
            w: wqkv,
            bias: Some(bqkv),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: 3 * hidden,
            k: hidden,
        });
        b.push(Op::Attention {
            bias: None,
            qkv,
            mask,
            out: ctx,
            batch,
            seq,
            heads,
            head_dim: hd,
        });
        b.push(Op::Linear {
            x: ctx,
            w: wo,
            bias: Some(bo),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: hidden,
            k: hidden,
        });
        b.push(Op::AddLayerNorm {
            x: qkv,
            residual: h,
            gamma: g,
            beta: be,
            eps: 1e-12,
            out: h,
            rows,
            hidden,
        });
        b.push(Op::Linear {
            x: h,
            w: wi,
            bias: Some(bi),
            act: Activation::Gelu,
            out: t,
            m: rows,
            n: inter,
            k: hidden,
        });
        b.push(Op::Linear {
            x: t,
            w: wo2,
            bias: Some(bo2),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: hidden,
            k: inter,
        });
        b.push(Op::AddLayerNorm {
            x: qkv,
            residual: h,
            gamma: g,
            beta: be,
            eps: 1e-12,
            out: h,
            rows,
            hidden,
        });
        b.push(Op::Pool {
            skip: None,
            x: h,
            mask,
            out,
            batch,
            seq,
            hidden,
            mode: Pooling::Mean,
            normalize: true,
        });
        (b.finish(batch, seq, out, hidden), w)
    }

    /// A one-layer packed BERT-shaped program: `tokens` slots, at most
    /// `seqs` sequences of at most `max_len` tokens.
    pub(crate) fn packed_bert_dims(
        tokens: usize,
        seqs: usize,
        max_len: usize,
        hidden: usize,
        heads: usize,
        inter: usize,
    ) -> (Program, Weights) {
        let (padded, w) = bert_dims(1, 1, hidden, heads, inter);
        // Same weights; the token ops become the packed ones.
        let mut b = ProgramBuilder::new();
        let ids = b.input("ids", InputRole::TokenIds, tokens);
        let types = b.input("types", InputRole::TokenTypeIds, tokens);
        let positions = b.input("positions", InputRole::Positions, tokens);
        let offsets = b.input("offsets", InputRole::SeqOffsets, seqs + 1);
        let h = b.activation("h", tokens * hidden);
        let qkv = b.activation("qkv", tokens * 3 * hidden);
        let ctx = b.activation("ctx", tokens * hidden);
        let t = b.activation("t", tokens * inter);
        let out = b.output("out", seqs * hidden);
        let remap = |id: BufId| match padded.buffer(id).name.as_str() {
            "h" => h,
            "qkv" => qkv,
            "ctx" => ctx,
            "t" => t,
            "out" => out,
            other => unreachable!("{other}"),
        };
        for op in &padded.ops {
            b.push(match op.clone() {
                Op::EmbedLayerNorm {
                    word,
                    position,
                    token_type,
                    gamma,
                    beta,
                    eps,
                    out: o,
                    hidden,
                    ..
                } => Op::PackedEmbedLayerNorm {
                    position_ids: Default::default(),
                    ids,
                    token_types: types,
                    positions,
                    word,
                    position,
                    token_type,
                    gamma,
                    beta,
                    eps,
                    out: remap(o),
                    tokens,
                    max_seq_len: max_len,
                    hidden,
                },
                Op::Linear {
                    x,
                    w,
                    bias,
                    act,
                    out: o,
                    n,
                    k,
                    ..
                } => Op::Linear {
                    x: remap(x),
                    w,
                    bias,
                    act,
                    out: remap(o),
                    m: tokens,
                    n,
                    k,
                },
                Op::AddLayerNorm {
                    x,
                    residual,
                    gamma,
                    beta,
                    eps,
                    out: o,
                    hidden,
                    ..
                } => Op::AddLayerNorm {
                    x: remap(x),
                    residual: remap(residual),
                    gamma,
                    beta,
                    eps,
                    out: remap(o),
                    rows: tokens,
                    hidden,
                },
                Op::Attention {
                    qkv: q,
                    out: o,
                    heads,
                    head_dim,
                    ..
                } => Op::PackedAttention {
                    bias: None,
                    qkv: remap(q),
                    offsets,
                    out: remap(o),
                    tokens,
                    seqs,
                    max_seq_len: max_len,
                    heads,
                    head_dim,
                },
                Op::Pool {
                    x,
                    out: o,
                    hidden,
                    mode,
                    normalize,
                    ..
                } => Op::PackedPool {
                    skip: None,
                    x: remap(x),
                    offsets,
                    out: remap(o),
                    tokens,
                    seqs,
                    hidden,
                    mode,
                    normalize,
                },
                other => unreachable!("{other:?}"),
            });
        }
        let p = b.finish_packed(tokens, seqs, max_len, out, hidden);
        p.validate(&w).unwrap();
        (p, w)
    }

    fn names(plan: &Plan) -> Vec<String> {
        plan.steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, .. } => name.clone(),
                Step::Matmul { .. } => "mm".into(),
            })
            .collect()
    }

    fn kernel<'p>(plan: &'p Plan, prefix: &str) -> (&'p str, (u32, u32, u32), u32, u32, &'p [Arg]) {
        plan.steps
            .iter()
            .find_map(|s| match s {
                Step::Kernel {
                    name,
                    grid,
                    block,
                    smem,
                    args,
                } if name.starts_with(prefix) => {
                    Some((name.as_str(), *grid, block.0, *smem, args.as_slice()))
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("no {prefix} kernel in {:?}", names(plan)))
    }

    #[test]
    fn tile_bounds() {
        // One full tile per 64 slots plus a partial one per sequence and the tail.
        assert_eq!(max_tiles(16384, 256, 64), 256 + 257);
        assert_eq!(max_tiles(16384, 256, 32), 512 + 257);
        assert_eq!(max_tiles(64, 64, 64), 64); // never more tiles than slots
        assert_eq!(max_tiles(1024, 32, 64), 16 + 33);
        assert_eq!(max_tiles(1, 1, 64), 1);
    }

    /// Every batch a budget can hold fits its table, and the table covers
    /// each slot exactly once: real tiles inside their sequence, the tail in
    /// zero tiles, longest sequences first, unused entries zero.
    #[test]
    fn tile_tables_cover_every_slot_once() {
        let mut order = Vec::new();
        // Sequences of 130, 1, 0, 64 and 2 tokens, a tail of 59, in 256 slots.
        let lens = [130usize, 1, 0, 64, 2];
        let cap = max_tiles(256, 5, 64);
        let mut t = vec![-7; cap * TILE_ENTRY];
        write_tile_table(lens, 256, 64, &mut t, &mut order);
        let e: Vec<&[i32]> = t.chunks(4).collect();
        assert_eq!(
            &e[..8],
            &[
                &[0, 64, 0, 130][..],
                &[64, 64, 0, 130],
                &[128, 2, 0, 130],
                &[131, 64, 131, 64],
                &[195, 2, 195, 2],
                &[130, 1, 130, 1],
                &[197, 59, 197, 0], // the tail
                &[0, 0, 0, 0],
            ]
        );
        assert!(e[8..].iter().all(|x| x == &[0, 0, 0, 0]));

        // Random batches, budgets, tile sizes: bounds and coverage.
        let mut seed = 0x1234_5678u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..2000 {
            let tokens = 1 + next(700);
            let seqs = 1 + next(tokens.min(80));
            let qt = [16, 32, 64][next(3)];
            // Random lengths filling a random part of the budget (sometimes all).
            let mut left = if next(4) == 0 {
                tokens
            } else {
                next(tokens + 1)
            };
            let n = 1 + next(seqs);
            let mut lens = Vec::new();
            for i in 0..n {
                let l = if i + 1 == n {
                    left
                } else {
                    next(left + 1).min(next(left + 1) + 1)
                };
                lens.push(l.min(left));
                left -= l.min(left);
            }
            let cap = max_tiles(tokens, seqs, qt);
            let mut t = vec![-1; cap * TILE_ENTRY];
            write_tile_table(lens.iter().copied(), tokens, qt, &mut t, &mut order);
            let mut covered = vec![0u8; tokens];
            let starts: Vec<usize> = lens
                .iter()
                .scan(0, |a, &l| {
                    let s = *a;
                    *a += l;
                    Some(s)
                })
                .collect();
            let mut last_len = usize::MAX;
            let mut in_tail = false;
            for e in t.chunks(4) {
                let [q0, qc, k0, kl] = [e[0], e[1], e[2], e[3]].map(|v| v as usize);
                if qc == 0 {
                    assert_eq!(e, [0, 0, 0, 0]);
                    continue;
                }
                assert!(qc <= qt && q0 + qc <= tokens);
                if kl == 0 {
                    in_tail = true;
                } else {
                    assert!(!in_tail, "tail tiles come after every real tile");
                    assert!(k0 <= q0 && q0 + qc <= k0 + kl && k0 + kl <= tokens);
                    assert!(starts.iter().zip(&lens).any(|(&s, &l)| s == k0 && l == kl));
                    assert!(kl <= last_len, "longest sequences first");
                    last_len = kl;
                }
                covered[q0..q0 + qc].iter_mut().for_each(|c| *c += 1);
            }
            assert!(
                covered.iter().all(|&c| c == 1),
                "{lens:?} in {tokens}: {covered:?}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "in a budget of")]
    fn tile_table_refuses_too_many_tokens() {
        let mut t = vec![0; 64 * TILE_ENTRY];
        write_tile_table([40, 30], 64, 64, &mut t, &mut Vec::new());
    }

    /// A host emulation of attention_varlen.cu's decomposition: each block
    /// (tile, head) checks its entry as `varlen_tile` does and computes its
    /// queries against its sequence's keys. Driven by a written table it
    /// gives exactly the IR's packed attention (the reference interpreter's
    /// semantics), tail zeros included, whatever the tile size.
    #[test]
    fn tile_decomposition_computes_packed_attention() {
        let (heads, d) = (2usize, 3usize);
        let hd = heads * d;
        let lens = [5usize, 0, 12, 1, 33];
        let tokens = 60;
        let qkv: Vec<f64> = (0..tokens * 3 * hd)
            .map(|i| (((i * 7919) % 211) as f64 / 105.0 - 1.0) * 1.3)
            .collect();
        // Direct: each sequence alone.
        let attend = |q: usize, k0: usize, kl: usize, h: usize| -> Vec<f64> {
            let s: Vec<f64> = (k0..k0 + kl)
                .map(|j| {
                    (0..d)
                        .map(|e| qkv[q * 3 * hd + h * d + e] * qkv[j * 3 * hd + hd + h * d + e])
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = p.iter().sum();
            (0..d)
                .map(|e| {
                    (0..kl)
                        .map(|j| p[j] / z * qkv[(k0 + j) * 3 * hd + 2 * hd + h * d + e])
                        .sum()
                })
                .collect()
        };
        let mut want = vec![0.0; tokens * hd];
        let mut at = 0;
        for &l in &lens {
            for q in at..at + l {
                for h in 0..heads {
                    want[q * hd + h * d..][..d].copy_from_slice(&attend(q, at, l, h));
                }
            }
            at += l;
        }
        for qt in [VARLEN_QT, VARLEN_TC_QT, 4] {
            let cap = max_tiles(tokens, 6, qt);
            let mut table = vec![0; cap * TILE_ENTRY];
            write_tile_table(lens, tokens, qt, &mut table, &mut Vec::new());
            let mut got = vec![f64::NAN; tokens * hd];
            for block in 0..cap * heads {
                let (tile, h) = (block / heads, block % heads);
                let e = &table[tile * 4..tile * 4 + 4];
                let (q0, qc, k0, kl) = (e[0], e[1], e[2], e[3]);
                let t = tokens as i32;
                if qc <= 0 || qc > qt as i32 || q0 < 0 || q0 > t - qc {
                    continue;
                }
                let (q0, qc, k0, kl) = (q0 as usize, qc as usize, k0 as usize, kl as usize);
                for q in q0..q0 + qc {
                    let o = if kl == 0 {
                        vec![0.0; d]
                    } else {
                        assert!(k0 <= q0 && q0 + qc <= k0 + kl);
                        attend(q, k0, kl, h)
                    };
                    got[q * hd + h * d..][..d].copy_from_slice(&o);
                }
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-12, "qt {qt}, element {i}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn packed_bert_plan() {
        let (tokens, seqs) = (1024, 32);
        let (p, w) = packed_bert_dims(tokens, seqs, 256, 384, 12, 1536);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        assert_eq!(plan.layout, Layout::Packed { tokens: 1024 });
        assert_eq!((plan.batch, plan.seq), (32, 256));
        assert_eq!(plan.label(), "1024t (32 seqs of at most 256)");
        assert_eq!(
            names(&plan),
            vec![
                "embed_ln_packed_f16",
                "mm",
                "attention_varlen_tc_f16_d32",
                "mm",
                "add_ln_f16",
                "mm",
                "bias_act_f16_f16", // exact GELU
                "mm",
                "add_ln_f16",
                "pool_packed_f16",
            ]
        );
        assert_eq!(
            plan.inputs
                .iter()
                .map(|i| (i.role, i.elems))
                .collect::<Vec<_>>(),
            vec![
                (InputRole::TokenIds, 1024),
                (InputRole::TokenTypeIds, 1024),
                (InputRole::Positions, 1024),
                (InputRole::SeqOffsets, 33),
            ]
        );
        // One tile table (64-query tiles) after the inputs, in the input block.
        let tiles = max_tiles(tokens, seqs, 64);
        assert_eq!(tiles, 16 + 33);
        let after_inputs = 3 * align_up(1024 * 4, ALIGN) + align_up(33 * 4, ALIGN);
        assert_eq!(
            plan.tile_tables,
            vec![TileTable {
                qt: 64,
                max_tiles: tiles,
                offset: after_inputs
            }]
        );
        assert_eq!(
            plan.input_bytes,
            after_inputs + align_up(tiles * TILE_ENTRY * 4, ALIGN)
        );
        let (_, grid, block, smem, args) = kernel(&plan, "embed_ln_packed");
        assert_eq!((grid, block, smem), ((1024, 1, 1), 96, 0));
        assert_eq!(
            &args[..3],
            &[
                Arg::Ptr(Loc::Input(0)),
                Arg::Ptr(Loc::Input(4096)),
                Arg::Ptr(Loc::Input(8192))
            ]
        );
        assert_eq!(
            &args[10..],
            &[Arg::I32(384), Arg::I32(100), Arg::I32(512), Arg::I32(2)]
        );
        let (_, grid, block, smem, args) = kernel(&plan, "attention_varlen_tc");
        assert_eq!(
            (grid, block, smem),
            ((tiles as u32 * 12, 1, 1), TC_THREADS, 0)
        );
        let h = Loc::Arena(0);
        let qkv = Loc::Arena(align_up(1024 * 384 * 2, ALIGN));
        let ctx = Loc::Arena(align_up(1024 * 384 * 2, ALIGN) + align_up(1024 * 3 * 384 * 2, ALIGN));
        assert_eq!(
            args,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(Loc::Input(after_inputs)),
                Arg::Ptr(ctx),
                Arg::I32(12),
                Arg::F32(1.0 / (32f32).sqrt()),
                Arg::I32(1024),
            ]
        );
        let (_, grid, block, smem, args) = kernel(&plan, "pool_packed");
        assert_eq!((grid, block, smem), ((32, 1, 1), POOL_THREADS, 0));
        assert_eq!(
            args,
            &[
                Arg::Ptr(h),
                Arg::Ptr(Loc::Input(3 * 4096)),
                Arg::Ptr(Loc::Output(0)),
                Arg::I32(1024),
                Arg::I32(384),
                Arg::I32(pool_code(Pooling::Mean)),
                Arg::I32(1),
            ]
        );
        assert_eq!(plan.output_elems, 32 * 384);
        // Every layer's attention shares the one table.
        let (p2, w2) = packed_bert_dims(64, 64, 64, 384, 12, 1536);
        let plan2 = super::plan(&p2, &w2, DType::BF16, false, LIMITS).unwrap();
        assert_eq!(plan2.tile_tables.len(), 1);
        assert_eq!(plan2.tile_tables[0].max_tiles, 64);
        assert_eq!(
            kernel(&plan2, "attention_varlen_tc_bf16_d32").1,
            (64 * 12, 1, 1)
        );
    }

    /// f32, other head sizes and a disabled tensor-core kernel take the
    /// CUDA-core varlen kernel: 32-query tiles, shared memory sized by the
    /// longest sequence.
    #[test]
    fn packed_cuda_core_attention() {
        let (p, w) = packed_bert_dims(512, 16, 256, 384, 12, 1536);
        for (dtype, limits) in [
            (DType::F32, LIMITS),
            (DType::F16, LIMITS.with_disabled("tc_attention")),
        ] {
            let plan = plan(&p, &w, dtype, false, limits).unwrap();
            let ts = suffix(dtype);
            let (name, grid, block, smem, args) = kernel(&plan, "attention_varlen");
            let tiles = max_tiles(512, 16, 32);
            assert_eq!(name, format!("attention_varlen_{ts}_d32"));
            assert_eq!(plan.tile_tables[0].qt, 32);
            assert_eq!(plan.tile_tables[0].max_tiles, tiles);
            assert_eq!((grid, block), ((tiles as u32 * 12, 1, 1), ATT_THREADS));
            assert_eq!(smem as usize, attention_smem_bytes(256, 32));
            assert_eq!(args.len(), 8);
            assert_eq!(
                &args[3..],
                &[
                    Arg::I32(12),
                    Arg::I32(32),
                    Arg::F32(1.0 / (32f32).sqrt()),
                    Arg::I32(512),
                    Arg::I32(256),
                ]
            );
        }
        // Head size 80 (f16): the d128 class with hd = 80.
        let (p, w) = packed_bert_dims(256, 8, 128, 320, 4, 640);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        let (name, _, _, smem, args) = kernel(&plan, "attention_varlen");
        assert_eq!(name, "attention_varlen_f16_d128");
        assert_eq!(smem as usize, attention_smem_bytes(128, 128));
        assert_eq!(args[4], Arg::I32(80));
        // Sequences too long for the shared memory: the device cannot run it.
        let (p, w) = packed_bert_dims(1024, 4, 512, 384, 12, 1536);
        let e = super::plan(&p, &w, DType::F32, false, Limits::new(48 * 1024)).unwrap_err();
        assert!(
            matches!(e, BackendError::Unsupported(ref m) if m.contains("512")),
            "{e:?}"
        );
        // f32 packed outputs: the pooled rows go straight to the f32 output.
        let (p, w) = packed_bert_dims(64, 4, 64, 384, 12, 1536);
        let plan = super::plan(&p, &w, DType::F32, false, LIMITS).unwrap();
        assert_eq!(
            kernel(&plan, "pool_packed_f32").4[2],
            Arg::Ptr(Loc::Output(0))
        );
    }

    #[test]
    fn launch_arithmetic() {
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
        assert_eq!(ew_blocks(1), 1);
        assert_eq!(ew_blocks(256), 1);
        assert_eq!(ew_blocks(257), 2);
        assert_eq!(ew_blocks(1 << 30), EW_MAX_BLOCKS);
        assert_eq!(attention_dmax(32), Some(32));
        assert_eq!(attention_dmax(33), Some(64));
        assert_eq!(attention_dmax(64), Some(64));
        assert_eq!(attention_dmax(80), Some(128));
        assert_eq!(attention_dmax(129), None);
        assert_eq!(attention_dmax(0), None);
        // MiniLM at seq 256: under the default 48 KiB; seq 512 needs the opt-in.
        assert!(attention_smem_bytes(256, 32) <= 48 * 1024);
        assert!(attention_smem_bytes(512, 32) > 48 * 1024);
        assert!(attention_smem_bytes(512, 128) < 227 * 1024);
        assert_eq!(
            attention_smem_bytes(16, 32),
            4 * (32 * 33 + 64 * 33 + 32 * 17)
        );
    }

    #[test]
    fn mlp_f32_is_two_fused_matmuls() {
        let (p, w) = mlp(32, Activation::Relu);
        let plan = plan(&p, &w, DType::F32, false, LIMITS).unwrap();
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
                assert_eq!(shape.epilogue, super::super::matmul::Epilogue::ReluBias);
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
        let tf = super::plan(&p, &w, DType::F32, true, LIMITS).unwrap();
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
                "mmBias",           // exact GELU is not fused ...
                "bias_act_f16_f16", // ... but applied in place
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
        let plan = plan(&p, &w, DType::F32, false, LIMITS).unwrap();
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
        let plan = super::plan(&p, &w, DType::F16, false, LIMITS).unwrap();
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
        // MiniLM's widths go through cuBLASLt even at 16 rows ...
        let (p, w) = tiny_bert(1, 16);
        let plan16 = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        assert_eq!(plan16.matmul_count(), 4);
        assert_eq!(plan16.counters, 0);
        // ... a narrower encoder through the skinny kernel, fused with its LayerNorms.
        let (p, w) = bert_dims(1, 16, 64, 2, 256);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
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

    #[test]
    fn kernels_can_be_switched_off() {
        let l = LIMITS.with_disabled("skinny, tc_attention,unknown");
        assert!(!l.skinny && !l.tc_attention);
        let (p, w) = tiny_bert(1, 16);
        let plan = plan(&p, &w, DType::F16, false, l).unwrap();
        assert_eq!(plan.matmul_count(), 4);
        assert!(plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::Kernel { name, .. } if name == "attention_f16_d32")));
        assert_eq!(LIMITS.with_disabled(""), LIMITS);
    }

    #[test]
    fn liveness() {
        let (p, _) = tiny_bert(1, 16);
        // qkv (buffer 4) is overwritten by the next layer's / read by attention.
        let qkv = BufId(4);
        assert!(!dead_after(&p.ops, 2, qkv)); // attention reads it
        assert!(dead_after(&p.ops, 8, qkv)); // nothing after the last LN reads it
        assert!(dead_after(&p.ops, 5, qkv)); // FFN2 overwrites it
    }

    #[test]
    fn bert_layer_plan() {
        let (p, w) = tiny_bert(2, 16);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        assert_eq!(plan.matmul_count(), 4);
        // embed, attention, 2 add-LN, GELU, pool
        assert_eq!(plan.kernel_count(), 6);
        assert_eq!(
            plan.inputs.iter().map(|i| i.role).collect::<Vec<_>>(),
            vec![
                InputRole::TokenIds,
                InputRole::AttentionMask,
                InputRole::TokenTypeIds
            ]
        );
        let att = plan
            .steps
            .iter()
            .find_map(|s| match s {
                Step::Kernel {
                    name, grid, smem, ..
                } if name.starts_with("attention") => Some((name.clone(), *grid, *smem)),
                _ => None,
            })
            .unwrap();
        assert_eq!(att.0, "attention_tc_f16_d32");
        assert_eq!(att.1, (1, 12, 2));
        assert_eq!(att.2, 0);
        // f32 keeps the CUDA-core kernel, with dynamic shared memory.
        let plan32 = super::plan(&p, &w, DType::F32, false, LIMITS).unwrap();
        assert!(plan32
            .steps
            .iter()
            .any(|s| matches!(s, Step::Kernel { name, smem, .. }
            if name == "attention_f32_d32" && *smem as usize == attention_smem_bytes(16, 32))));
        match plan.steps.last().unwrap() {
            Step::Kernel { name, args, .. } => {
                assert_eq!(name, "pool_f16");
                assert_eq!(args[2], Arg::Ptr(Loc::Output(0)));
                assert_eq!(args[5], Arg::I32(0));
                assert_eq!(args[6], Arg::I32(1));
            }
            s => panic!("{s:?}"),
        }
    }

    /// Malformed programs are refused by validation before they reach the
    /// planner; what the planner refuses is what the device cannot run.
    #[test]
    fn malformed_programs_are_errors() {
        let (mut p, w) = mlp(2, Activation::Relu);
        if let Op::Linear { k, .. } = &mut p.ops[0] {
            *k = 129;
        }
        let e = p.validate(&w).unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");

        let (mut p, w) = mlp(2, Activation::Relu);
        p.buffers[1].elems = 10; // activation too small
        assert!(p.validate(&w).is_err());

        let (p, w) = tiny_bert(1, 500);
        p.validate(&w).unwrap();
        let e = plan(&p, &w, DType::F32, false, Limits::new(48 * 1024)).unwrap_err();
        assert!(matches!(e, BackendError::Unsupported(_)), "{e:?}");

        let (mut p, w) = tiny_bert(1, 16);
        if let Op::Attention { mask, qkv, .. } = &mut p.ops[2] {
            *mask = *qkv; // a float buffer as the mask
        }
        assert!(p.validate(&w).is_err());
        let (p, w) = tiny_bert(1, 16);
        assert!(plan(&p, &w, DType::I32, false, LIMITS).is_err());
    }

    #[test]
    fn codes_match_kernels() {
        let common = include_str!("../../../kernels/common.cuh");
        for (a, name) in [
            (Activation::Identity, "ACT_IDENTITY"),
            (Activation::Relu, "ACT_RELU"),
            (Activation::Gelu, "ACT_GELU"),
            (Activation::GeluTanh, "ACT_GELU_TANH"),
            (Activation::Tanh, "ACT_TANH"),
            (Activation::Sigmoid, "ACT_SIGMOID"),
            (Activation::Silu, "ACT_SILU"),
        ] {
            assert!(
                common.contains(&format!("#define {name} {}\n", act_code(a))),
                "{name}"
            );
        }
        let pool = include_str!("../../../kernels/pool.cu");
        assert!(pool.contains(&format!("#define POOL_THREADS {POOL_THREADS}\n")));
        for (m, name) in [
            (Pooling::Mean, "POOL_MEAN"),
            (Pooling::Cls, "POOL_CLS"),
            (Pooling::Max, "POOL_MAX"),
        ] {
            assert!(
                pool.contains(&format!("#define {name} {}\n", pool_code(m))),
                "{name}"
            );
        }
        let att = include_str!("../../../kernels/attention.cu");
        assert!(att.contains(&format!("#define ATT_QT {ATT_QT}\n")));
        assert!(att.contains(&format!("#define ATT_KC {ATT_KC}\n")));
        assert!(att.contains(&format!("#define ATT_THREADS {ATT_THREADS}\n")));
        let varlen = include_str!("../../../kernels/attention_varlen.cu");
        assert!(varlen.contains("#define VT_QT TC_QT\n") && VARLEN_TC_QT == TC_QT);
        assert!(varlen.contains("#define VA_QT ATT_QT\n") && VARLEN_QT == ATT_QT);
        let tc = include_str!("../../../kernels/attention_tc.cu");
        assert!(tc.contains("#define TC_WARPS 4\n") && TC_THREADS == 128 && TC_QT == 64);
        let sk = include_str!("../../../kernels/skinny.cu");
        assert!(sk.contains(&format!("#define SK_MAXM {SK_MAXM}\n")));
        assert!(sk.contains(&format!("#define SK_COLS {SK_COLS}\n")));
        assert!(sk.contains(&format!("#define SK_WARPS {SK_WARPS}\n")));
        let ln = include_str!("../../../kernels/layernorm.cu");
        assert!(ln.contains(&format!("#define LN_VPT {LN_VPT}\n")));
    }
}
