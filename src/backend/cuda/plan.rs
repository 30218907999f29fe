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
use crate::model::program::{
    BufId, BufKind, InputRole, Layout, Op, PositionBias, PositionIds, WeightId,
};
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
/// Threads per `gemm_small` block (`GS_THREADS` in gemm_small.cu).
pub const GS_THREADS: u32 = 256;
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

/// Static shared memory of `attn_o_small` (gemm_small's partial sums,
/// `GS_WARPS` × `GS_MAXM / 16` × 256 floats), with room to spare: its
/// dynamic part must fit beside it.
pub const AO_STATIC_SMEM: usize = GS_WARPS * (GS_MAXM / 16) * 256 * 4 + 1024;
/// Head size of `qkv_attn_small` (`QA_HD` in qkv_attn_small.cu).
pub const QA_HEAD_DIM: usize = 32;
/// Blocks per head of `qkv_attn_small` (`QA_PARTS`): the head's q, k and v
/// columns, [`GS_NB`] a block.
pub const QA_PARTS: usize = 3 * QA_HEAD_DIM / GS_NB;
/// Warps of a `gemm_small` block (`GS_WARPS`).
pub const GS_WARPS: usize = 8;
/// Most n8-tiles of `ffn_small`'s second product a warp takes (`FS_TPW`).
pub const FS_TPW: usize = 16;
/// The argument of `ffn_small` (ffn_small.cu) that says how many floats of
/// the next accumulator it zeroes (after its own, 7, and that one, 8).
const FS_ARG_ZERO_N: usize = 9;
/// Widest rows `pool_ln` / `pool_packed_ln` normalise (`POOL_CHUNK` in
/// pool.cu: a warp holds a whole token row).
pub const POOL_LN_MAX_HIDDEN: usize = 512;

/// Whether a Linear of `m` rows, `n` outputs and `k` inputs in `t` runs on
/// `gemm_small`: f16/bf16, at most `max_rows` rows ([`GS_MAXM_PADDED`] or,
/// packed, [`GS_MAXM`]), K in chunks of 32.
pub fn gemm_small_fits(m: usize, n: usize, k: usize, t: DType, max_rows: usize) -> bool {
    matches!(t, DType::F16 | DType::BF16)
        && (1..=max_rows.min(GS_MAXM)).contains(&m)
        && n > 0
        && k > 0
        && k.is_multiple_of(32)
        && k <= i32::MAX as usize
        && n <= i32::MAX as usize
}

/// Largest number of fused (counter-using) ops in one plan.
pub const MAX_COUNTERS: usize = 1024;
/// Floats of one `ffn_small` accumulator ([`Loc::Accum`]): [`GS_MAXM`]
/// rows of up to 1,024 (ffn_small.cu's `FS_TPW`: N2 <= 1024).
pub const ACCUM_FLOATS: usize = GS_MAXM * 1024;
/// `ffn_small` accumulators a stream keeps (see [`Loc::Accum`]).
pub const ACCUMS: usize = 3;
/// Bytes of a stream's zeroed block: [`MAX_COUNTERS`] u32 counters, then
/// [`ACCUMS`] accumulators of [`ACCUM_FLOATS`].
pub const COUNTER_BLOCK_BYTES: usize = MAX_COUNTERS * 4 + ACCUMS * ACCUM_FLOATS * 4;
/// Rows per block (one per warp) of the vectorised LayerNorm kernels
/// (`LNV_WARPS` in vec.cu).
pub const LNV_WARPS: usize = 4;
/// 4-value vectors each lane of a vectorised LayerNorm keeps (`LNV_J`):
/// rows of at most `32 · 4 · LNV_J` values.
pub const LNV_J: usize = 8;
/// Values per thread and step of `bias_act_vec` (one 16-byte f16 vector).
pub const EW_VEC: usize = 8;
/// Threads per block of the fused sublayers (`SL_THREADS` in small_layer.cu).
pub const SL_THREADS: u32 = 128;
/// Warps per fused-sublayer block (`SL_WARPS`).
pub const SL_WARPS: usize = 4;
/// Most token rows of the fused sublayers (`SL_MAXM`).
pub const SL_MAXM: usize = 64;
/// Intermediate columns per block of the fused FFN (`SL_FS`).
pub const SL_FS: usize = 32;
/// n-tiles per GEMM1 pass of the fused attention (`SL_NG`).
pub const SL_NG: usize = 12;
/// n-tiles per phase-2 pass of the fused sublayers (`SL_G2`).
pub const SL_G2: usize = 4;
/// float4s per lane of the fused sublayers' LayerNorm (`SL_LN_J`): hidden
/// sizes up to `32 · 4 · SL_LN_J`.
pub const SL_LN_J: usize = 8;
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

/// Block size of `l2norm_rows` (rownorm.cu) for rows of `width` values: a
/// multiple of 32 (its block reduction), at most 256.
pub fn rownorm_threads(width: usize) -> u32 {
    align_up(width.max(1), 32).min(256) as u32
}

/// The pad id of RoBERTa-style position ids as a kernel argument.
fn pad_arg(pad: u32) -> Result<i32, BackendError> {
    i32::try_from(pad).map_err(|_| BackendError::Unsupported(format!("padding id {pad}")))
}

/// Whether the vectorised LayerNorm kernels (`add_ln_vec`, `embed_ln_vec`)
/// take rows of `hidden` values.
pub fn ln_vec_fits(hidden: usize) -> bool {
    hidden > 0 && hidden.is_multiple_of(4) && hidden <= 32 * 4 * LNV_J
}

/// Row stride (2-byte elements) of a fused-sublayer shared-memory row of
/// `cols` values (`sl_ld` in small_layer.cu): ≡ 64 bytes mod 128.
pub fn sl_ld(cols: usize) -> usize {
    if cols.is_multiple_of(64) {
        cols + 32
    } else {
        cols
    }
}

/// Dynamic shared memory (bytes) of `layer_attn_small` for `m` rows
/// (see small_layer.cu).
pub fn small_attn_smem(m: usize, hidden: usize, head_dim: usize) -> usize {
    let mp = align_up(m, 16);
    mp * sl_ld(hidden) * 2
        + SL_WARPS * 16 * SL_NG * 8 * 4
        + 3 * mp * (head_dim + 1) * 4
        + mp * (mp + 1) * 4
        + 3 * mp * 4
}

/// Dynamic shared memory (bytes) of `layer_ffn_small` for `m` rows.
pub fn small_ffn_smem(m: usize, hidden: usize) -> usize {
    let mp = align_up(m, 16);
    mp * sl_ld(hidden) * 2 + SL_WARPS * 16 * SL_FS.max(SL_G2 * 8) * 4
}

/// Whether the fused sublayers take `m` rows of `hidden` values in `t`
/// (K of every product a multiple of 32 per warp, rows the final LayerNorm
/// holds in registers).
fn small_fits(m: usize, hidden: usize, t: DType) -> bool {
    matches!(t, DType::F16 | DType::BF16)
        && (1..=SL_MAXM).contains(&m)
        && hidden.is_multiple_of(32 * SL_WARPS)
        && hidden <= 32 * 4 * SL_LN_J
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
    /// Index of an f32 accumulator of [`ACCUM_FLOATS`] after the counters,
    /// zero between graphs: `ffn_small` adds into one and zeroes the next
    /// (see [`Planner::ffn_small`]).
    Accum(usize),
    /// Byte offsets into the batch's pinned host slot, as the device
    /// addresses it: its input block, and its output. Only the steps of a
    /// staged plan ([`Plan::with_staged_io`], [`Plan::staged`]) name these,
    /// and the backend points them at each batch's slot before it launches
    /// the graph.
    StagedInput(usize),
    StagedOutput(usize),
}

/// A step of a staged plan whose arguments name the batch's slot
/// ([`Loc::StagedInput`], [`Loc::StagedOutput`]): the backend re-points them
/// before each launch, and sets its `count` argument to the batch's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedStep {
    pub step: usize,
    /// The index of the argument that bounds what the step writes into the
    /// slot, and in what unit.
    pub count: Option<(usize, StagedCount)>,
}

/// What a staged step's `count` argument counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedCount {
    /// Output floats (`stage_out`).
    Values,
    /// Output rows (`pool_ln`, `pool_packed_ln`: `out_rows`).
    Rows,
}

/// A kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(Loc),
    Null,
    /// The plan's input block by value ([`INLINE_WORDS`] u32, the kernel's
    /// `InlineBlock`, kernels/common.cuh): zeros as planned; a staged
    /// graph's backend writes each batch's block into it before the launch
    /// ([`Plan::with_staged_io`]).
    Inline,
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
    /// Bytes of the fused sublayers' f32 accumulator (rows × hidden, one
    /// region of the arena that all of them share: they run one after the
    /// other); 0 when the plan has none.
    pub accum_bytes: usize,
    /// Launch each kernel that follows another kernel with programmatic
    /// dependent launch (sm_90+): it may start, and read its weights, while
    /// the one before it finishes; every kernel waits for its predecessor in
    /// `pdl_wait` (kernels/common.cuh) before it touches activations.
    pub pdl: bool,
    /// The steps that read or write the batch's pinned slot (empty unless
    /// [`Plan::with_staged_io`]).
    pub staged: Vec<StagedStep>,
    /// Words after the output in the batch's slot that the last kernel sets,
    /// one per block, once its output is there (0: none; the host then waits
    /// for the graph's event). The host zeroes them before each launch and
    /// polls the first [`Plan::done_polled`] of them.
    pub done_words: usize,
    /// The host zeroes nothing and waits for no event: it fills the
    /// batch's output in the slot with [`OUTPUT_SENTINEL`] before the launch
    /// and polls until the last kernel has overwritten every value
    /// ([`Limits::poll_output`]; staged plans only).
    pub poll_output: bool,
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

    /// Whether step `i` is launched with programmatic dependent launch: a
    /// kernel right after another of our kernels (each waits in
    /// `pdl_wait`), never the first step or one after a matmul.
    pub fn programmatic(&self, i: usize) -> bool {
        self.pdl
            && i > 0
            && matches!(self.steps.get(i), Some(Step::Kernel { .. }))
            && matches!(self.steps[i - 1], Step::Kernel { .. })
    }

    /// Kernels and matmuls: the graph's nodes (cuBLASLt may add a split-K
    /// reduction or fall back to a matmul plus an epilogue kernel).
    pub fn node_count(&self) -> usize {
        self.steps.len()
    }

    /// Whether the graph of this plan stages its inputs and output through
    /// its own kernels ([`Plan::with_staged_io`]): an input block of at most
    /// [`STAGED_INPUT_MAX_BYTES`] and an output of at most
    /// [`STAGED_OUTPUT_MAX_BYTES`], where the copy engine's fixed cost per
    /// copy is more than moving the bytes; larger ones keep the copies.
    pub fn fits_staged_io(&self) -> bool {
        self.input_bytes > 0
            && self.input_bytes <= STAGED_INPUT_MAX_BYTES
            && self.input_bytes.is_multiple_of(4)
            && self.output_elems > 0
            && self.output_elems * 4 <= STAGED_OUTPUT_MAX_BYTES
    }

    /// The plan with zero-copy staging: its first step reads the input block
    /// from the batch's pinned slot ([`Loc::StagedInput`]) and its last
    /// writes the output into the slot ([`Loc::StagedOutput`]), so a replay
    /// needs no copy before or after it.
    ///
    /// Where the first step is `embed_ln_vec` it does the staging itself (it
    /// copies the block to the static inputs for the later kernels, and
    /// reads its own ids from the slot), and where the last is `pool_ln` or
    /// `pool_packed_ln` writing the whole output it writes into the slot;
    /// otherwise a kernel `stage_in` goes first and `stage_out` last (plain
    /// kernels of the graph; the first step is never a programmatic launch,
    /// the one after it waits in `pdl_wait` as every kernel does). Each
    /// folded end is one dependent node fewer (~0.8 µs on an H200,
    /// scripts/probe-io-copies.cu).
    pub fn with_staged_io(mut self, limits: &Limits) -> Plan {
        let fold = limits.stage_fold;
        let words = self.input_bytes.div_ceil(4);
        let inline = limits.inline_input && words <= INLINE_WORDS;
        let done_offset = self.done_offset();
        let grid = |n: usize| (n.div_ceil(STAGE_THREADS as usize).clamp(1, 64) as u32, 1, 1);
        let unique = |steps: &[Step], name: &str| {
            steps
                .iter()
                .filter(|s| matches!(s, Step::Kernel { name: n, .. } if n == name))
                .count()
                == 1
        };
        let steps = &mut self.steps;
        let fold_in = match steps.first() {
            Some(Step::Kernel { name, args, .. }) if fold => {
                name.starts_with("embed_ln_vec_")
                    && unique(steps, name)
                    && args.len() == 20
                    && args[16..] == [Arg::Null, Arg::Null, Arg::I32(0), Arg::I32(0)]
            }
            _ => false,
        };
        if fold_in {
            let Some(Step::Kernel { name, args, .. }) = steps.first_mut() else {
                unreachable!("checked above")
            };
            // Packed plans: the next kernel (gemm_small) reads the live rows
            // from the inputs before its pdl_wait, so it may launch only
            // once the copy is visible (vec.cu).
            let sync = matches!(self.layout, Layout::Packed { .. });
            let stage = [
                Arg::Ptr(Loc::Input(0)),
                Arg::I32(words as i32),
                Arg::I32(sync as i32),
            ];
            // ids, types, positions (or none): word offsets in the block.
            let offsets = args[..3].iter().map(|a| match *a {
                Arg::Ptr(Loc::Input(o)) if o % 4 == 0 => Some((o / 4) as i32),
                Arg::Null => Some(-1),
                _ => None,
            });
            let offsets: Option<Vec<i32>> = offsets.collect();
            match offsets {
                Some(o) if inline && o[0] >= 0 && o[1] >= 0 => {
                    let mut a = vec![Arg::Inline, Arg::I32(o[0]), Arg::I32(o[1]), Arg::I32(o[2])];
                    a.extend_from_slice(&args[3..16]);
                    a.extend(stage);
                    *args = a;
                    *name = name.replacen("embed_ln_vec_", "embed_ln_vec_inl_", 1);
                }
                _ => {
                    for a in args.iter_mut() {
                        if let Arg::Ptr(Loc::Input(o)) = *a {
                            *a = Arg::Ptr(Loc::StagedInput(o));
                        }
                    }
                    args.truncate(16);
                    args.push(Arg::Ptr(Loc::StagedInput(0)));
                    args.extend(stage);
                }
            }
        } else {
            let src = if inline {
                Arg::Inline
            } else {
                Arg::Ptr(Loc::StagedInput(0))
            };
            steps.insert(
                0,
                Step::Kernel {
                    name: if inline { "stage_in_inl" } else { "stage_in" }.into(),
                    grid: grid(words),
                    block: (STAGE_THREADS, 1, 1),
                    smem: 0,
                    args: vec![src, Arg::Ptr(Loc::Input(0)), Arg::I32(words as i32)],
                },
            );
        }
        if limits.embed_qkv {
            fuse_embed_into_linear(steps);
        }
        self.staged.push(StagedStep {
            step: 0,
            count: None,
        });
        // The done words, after the output in the slot.
        // Polling the output itself needs no done words.
        let poll_done = limits.poll_done && !limits.poll_output;
        self.poll_output = limits.poll_output;
        let done = if poll_done {
            Arg::Ptr(Loc::StagedOutput(done_offset))
        } else {
            Arg::Null
        };
        // pool_ln / pool_packed_ln: (x, mask or offsets, out, ..., out_rows, done).
        let rows = self.output_elems / self.output_dim.max(1);
        let fold_out = match steps.last() {
            Some(Step::Kernel {
                name, args, grid, ..
            }) if fold => {
                (name.starts_with("pool_ln_") || name.starts_with("pool_packed_ln_"))
                    && unique(steps, name)
                    && args.len() == 12
                    && args[2] == Arg::Ptr(Loc::Output(0))
                    && args[10] == Arg::I32(rows as i32)
                    && args[11] == Arg::Null
                    && grid.0 as usize == rows
                    && rows * self.output_dim == self.output_elems
            }
            _ => false,
        };
        let last_grid = if fold_out {
            let last = steps.len() - 1;
            let Some(Step::Kernel { args, grid, .. }) = steps.last_mut() else {
                unreachable!("checked above")
            };
            args[2] = Arg::Ptr(Loc::StagedOutput(0));
            args[11] = done;
            self.staged.push(StagedStep {
                step: last,
                count: Some((10, StagedCount::Rows)),
            });
            grid.0
        } else {
            let g = grid(self.output_elems);
            steps.push(Step::Kernel {
                name: "stage_out".into(),
                grid: g,
                block: (STAGE_THREADS, 1, 1),
                smem: 0,
                args: vec![
                    Arg::Ptr(Loc::Output(0)),
                    Arg::Ptr(Loc::StagedOutput(0)),
                    Arg::I32(self.output_elems as i32),
                    done,
                ],
            });
            self.staged.push(StagedStep {
                step: steps.len() - 1,
                count: Some((2, StagedCount::Values)),
            });
            g.0
        };
        if poll_done {
            self.done_words = last_grid as usize;
        }
        self
    }

    /// Where a staged plan's done words start, in bytes after the start of
    /// its output in the slot (see [`Plan::done_words`]).
    pub fn done_offset(&self) -> usize {
        (self.output_elems * 4).next_multiple_of(64)
    }

    /// The kernel names and `mm` for matmuls, in order (tests, logs).
    pub fn step_names(&self) -> Vec<String> {
        self.steps
            .iter()
            .map(|s| match s {
                Step::Kernel { name, .. } => name.clone(),
                Step::Matmul { .. } => "mm".into(),
            })
            .collect()
    }
}

/// In a padded staged graph that starts with `embed_ln_vec_inl` and then
/// the QKV `gemm_small` reading its output (mode 0, no deferred LayerNorm),
/// both become one `gemm_small_embed` (kernels/gemm_small.cu): every block
/// of the Linear computes the embedding's LayerNorm as it loads its rows,
/// block 0 stores it for the residual, one node fewer. Anything else is left
/// as it is.
fn fuse_embed_into_linear(steps: &mut Vec<Step>) {
    let [Step::Kernel {
        name: en, args: ea, ..
    }, Step::Kernel {
        name: gn,
        grid,
        block,
        smem,
        args: ga,
    }, ..] = &steps[..]
    else {
        return;
    };
    let Some(t) = en.strip_prefix("embed_ln_vec_inl_") else {
        return;
    };
    let fits = gn == &format!("gemm_small_{t}")
        && ea.len() == 20
        && ga.len() == 22
        && ea[3] == Arg::I32(-1) // padded: position = row % seq
        && ea[19] == Arg::I32(0) // no synchronised copy
        && ga[0] == ea[10] // x: the embedding's output
        && ga[4] == ea[11] // M: its rows
        && ga[6] == ea[13] // K: its width
        && ga[8] == Arg::I32(0) // mode 0
        && ga[15] == Arg::Null // padded
        && ga[17] == Arg::Null; // no deferred LayerNorm of its own
    if !fits {
        return;
    }
    let args = vec![
        Arg::Inline,
        ea[1],
        ea[2],
        ea[12], // seq
        ea[4],  // word, position, type tables
        ea[5],
        ea[6],
        ea[14], // their rows
        ea[15],
        ea[16],
        ea[17], // stage_dst, words
        ea[18],
        ga[1], // w, bias, out, M, N, K, act
        ga[2],
        ga[3],
        ga[4],
        ga[5],
        ga[6],
        ga[7],
        ea[7], // the embedding's gamma, beta, eps
        ea[8],
        ea[9],
        ea[10], // xout: the embedding's output, for the residual
    ];
    let fused = Step::Kernel {
        name: format!("gemm_small_embed_{t}"),
        grid: *grid,
        block: *block,
        smem: *smem,
        args,
    };
    steps.splice(0..2, [fused]);
}

/// What the host writes over a staged batch's output before the launch
/// ([`Plan::poll_output`]): a negative NaN with every payload bit set, a bit
/// pattern the kernels' arithmetic never produces (a computed NaN is the
/// canonical 0x7fffffff), so a value that is no longer this was written by
/// the graph. PCIe writes of aligned words do not tear.
pub const OUTPUT_SENTINEL: u32 = 0xffff_ffff;

/// Alignment of the integer inputs (ids, masks, offsets, tile tables) in
/// the input block: enough for the kernels' 16-byte loads, and tight, so
/// the (1, 16) block is 192 bytes rather than 768: it travels whole as a
/// kernel parameter ([`INLINE_WORDS`]) or across PCIe at every replay.
/// Float features keep [`ALIGN`] (cuBLASLt reads them).
pub const INT_INPUT_ALIGN: usize = 64;

fn input_align(role: InputRole) -> usize {
    if role == InputRole::Features {
        ALIGN
    } else {
        INT_INPUT_ALIGN
    }
}

/// Words of the input block a staged graph's first kernel takes as its
/// parameter ([`Limits::inline_input`]; `INLINE_WORDS` of
/// kernels/common.cuh): 512 bytes, the padded (1, 16), (1, 32) and (2, 16)
/// MiniLM buckets (ids, types and mask), where a short text lands at light
/// load. A larger parameter would cost every launch of the graph its copy.
pub const INLINE_WORDS: usize = 128;

/// The largest input block a graph stages through its own kernels
/// ([`Plan::fits_staged_io`]); it is read whole at every replay.
pub const STAGED_INPUT_MAX_BYTES: usize = 64 * 1024;
/// The largest output a graph stages: `stage_out` writes only the batch's
/// rows, so this covers the small packed budgets (64 tokens, 64 sequences of
/// 384 floats: 96 KiB) where a lone short text lands.
pub const STAGED_OUTPUT_MAX_BYTES: usize = 128 * 1024;
/// Threads of a block of `stage_in` / `stage_out`.
pub const STAGE_THREADS: u32 = 256;

/// Device limits the planner needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest dynamic shared memory a block may use (after opt-in).
    pub max_dyn_smem: usize,
    /// Use the tensor-core attention kernel where it applies.
    pub tc_attention: bool,
    /// Use the skinny matmul kernel (and its LayerNorm fusion) for few rows.
    pub skinny: bool,
    /// Use the warp-per-row LayerNorm kernels (`add_ln_vec`, `embed_ln_vec`).
    pub ln_vec: bool,
    /// Use the 8-wide element-wise kernel (`bias_act_vec`) for activations
    /// applied after a matmul.
    pub ew_vec: bool,
    /// Fuse QKV → attention → output projection → add + LayerNorm into one
    /// kernel per layer for few token rows (`layer_attn_small`).
    pub small_attn: bool,
    /// Fuse FFN1 + activation → FFN2 → add + LayerNorm into one kernel per
    /// layer for few token rows (`layer_ffn_small`).
    pub small_ffn: bool,
    /// Linears of few rows (f16/bf16) on the tensor-core kernel
    /// `gemm_small`, with the bias, the activation, and a following
    /// add + LayerNorm in the same kernel, instead of cuBLASLt.
    pub gemm_small: bool,
    /// The QKV Linear of few rows with each head's attention in the same
    /// kernel (`qkv_attn_small`, head size 32), on `gemm_small`'s product.
    pub qkv_attn: bool,
    /// Defer the LayerNorm of a `gemm_small` Linear + AddLayerNorm to the
    /// `gemm_small` Linear that reads its output: the first writes the
    /// pre-norm rows (f32), the second normalises them as it loads them
    /// (see gemm_small.cu), so no kernel ends in a last-block LayerNorm.
    pub ln_defer: bool,
    /// The feed-forward block of few rows in one kernel (`ffn_small`): the
    /// second Linear split over K across the first's blocks, its partial
    /// rows added into an accumulator, the AddLayerNorm deferred.
    pub ffn_splitk: bool,
    /// A layer's attention and the output Linear after it in one kernel for
    /// few rows (`attn_o_small`): every block of the Linear computes the
    /// attention into shared memory, the attention node is gone.
    pub attn_o: bool,
    /// Programmatic dependent launch between consecutive kernels (see
    /// [`Plan::pdl`]); the device must be sm_90 or newer.
    pub pdl: bool,
    /// Graphs of small inputs and outputs read and write the batch's pinned
    /// slot from their first and last kernels ([`Plan::with_staged_io`])
    /// instead of copies before and after the replay.
    pub staged_io: bool,
    /// In a staged graph, the embedding reads the slot and the pooling
    /// writes it themselves where they can, instead of `stage_in` /
    /// `stage_out` nodes ([`Plan::with_staged_io`]).
    pub stage_fold: bool,
    /// In a staged graph whose input block fits [`INLINE_WORDS`], the block
    /// travels as the first kernel's parameter (`embed_ln_vec_inl`,
    /// `stage_in_inl`), set with the batch's values before each launch: no
    /// read of host memory starts the replay.
    pub inline_input: bool,
    /// A staged graph's last kernel sets a word per block in the slot once
    /// its output is there, and the host polls those words instead of
    /// waiting for the graph's completion event ([`Plan::done_words`]).
    pub poll_done: bool,
    /// A staged graph's output polled by the host for the sentinel it
    /// wrote there ([`Plan::poll_output`]): no fence and no done word in the
    /// last kernel. Takes precedence over `poll_done`.
    pub poll_output: bool,
    /// With `inline_input`, a padded graph's embedding inside the QKV
    /// `gemm_small` after it (`gemm_small_embed`), one node fewer.
    pub embed_qkv: bool,
    /// Padded sequences of at most [`ATTN_S16_MAX_SEQ`] tokens take the
    /// tensor-core attention in 16-key blocks (`attention_tc_s16_<t>_d<D>`,
    /// head sizes 32 and 64) instead of 64-key ones.
    pub attn_s16: bool,
    /// Streaming multiprocessors: the fused sublayers' grid barrier needs
    /// every block resident at once, so their grids stay within this.
    pub sms: usize,
}

/// The longest padded sequence that takes `attention_tc_s16` ([`Limits::attn_s16`]).
pub const ATTN_S16_MAX_SEQ: usize = 16;

/// The names `REPLAYD_CUDA_DISABLE` takes, one per specialised path (and
/// the groups of [`DISABLE_GROUPS`]).
pub const DISABLE_SWITCHES: &[&str] = &[
    "tc_attention",
    "skinny",
    "ln_vec",
    "ew_vec",
    "small_attn",
    "small_ffn",
    "gemm_small",
    "qkv_attn",
    "ln_defer",
    "ffn_splitk",
    "attn_o",
    "pdl",
    "staged_io",
    "stage_fold",
    "inline_input",
    "poll_done",
    "poll_output",
    "embed_qkv",
    "attn_s16",
];

/// What is switched off when `REPLAYD_CUDA_DISABLE` is not set: the two
/// one-kernel sublayers, measured slower than the separate kernels they
/// replace (H200, 2026-12-01, MiniLM f16 64t: 712 µs in 14 nodes against
/// 184 µs in 50; `layer_attn_small` 66 µs and `layer_ffn_small` 50 µs a
/// layer, latency-bound on 12 and 48 blocks; docs/perf-log.md), the QKV
/// Linear with the attention (slower too, 2026-12-02/03), the one-kernel
/// feed-forward block `ffn_splitk` and the attention inside the output
/// Linear `attn_o` (both correct and slower, 2026-12-04: (1, 16) 118.6 and
/// 115.3 µs against 97.5–98.3), and the embedding inside the first QKV
/// Linear `embed_qkv` (correct and slower, 2026-12-04: (1, 16) 96.1–97.2
/// against 94.7–95.1 µs, (1, 32) 132 against 126). Set
/// `REPLAYD_CUDA_DISABLE=` (empty) to run them anyway.
pub const DEFAULT_DISABLED: &str = "small,qkv_attn,ffn_splitk,attn_o,embed_qkv";

/// Groups of [`DISABLE_SWITCHES`] that `REPLAYD_CUDA_DISABLE` takes by one
/// name: `small`, the two fused sublayers; `fused`, every path the
/// small-shape work added (the sublayers and the vectorised LayerNorm and
/// element-wise kernels), so that plans are those of before it; `all`,
/// every specialised path.
pub const DISABLE_GROUPS: &[(&str, &[&str])] = &[
    ("small", &["small_attn", "small_ffn"]),
    (
        "fused",
        &[
            "ln_vec",
            "ew_vec",
            "small_attn",
            "small_ffn",
            "gemm_small",
            "qkv_attn",
            "ln_defer",
            "ffn_splitk",
            "attn_o",
            "pdl",
            "attn_s16",
        ],
    ),
    ("all", DISABLE_SWITCHES),
];

impl Limits {
    /// All kernels enabled, with this shared-memory limit.
    pub const fn new(max_dyn_smem: usize) -> Limits {
        Limits {
            max_dyn_smem,
            tc_attention: true,
            skinny: true,
            ln_vec: true,
            ew_vec: true,
            small_attn: true,
            small_ffn: true,
            gemm_small: true,
            qkv_attn: true,
            ln_defer: true,
            ffn_splitk: true,
            attn_o: true,
            pdl: true,
            staged_io: true,
            stage_fold: true,
            inline_input: true,
            poll_done: true,
            poll_output: true,
            embed_qkv: true,
            attn_s16: true,
            sms: usize::MAX,
        }
    }

    /// The device's SM count (see [`Limits::sms`]).
    pub const fn with_sms(mut self, sms: usize) -> Limits {
        self.sms = sms;
        self
    }

    /// Applies `REPLAYD_CUDA_DISABLE` (comma-separated names from
    /// [`DISABLE_SWITCHES`] or [`DISABLE_GROUPS`]), a switch for debugging,
    /// for measuring a path against the one it replaces, and for falling
    /// back without a rebuild should one of the specialised kernels
    /// misbehave on some device. Unknown names are ignored (and logged by
    /// the backend, see [`Limits::unknown_switches`]).
    pub fn with_disabled(mut self, list: &str) -> Limits {
        for item in list.split(',').map(str::trim) {
            let group = DISABLE_GROUPS.iter().find(|(g, _)| *g == item);
            let names = group.map_or(std::slice::from_ref(&item), |(_, n)| *n);
            for name in names {
                match *name {
                    "tc_attention" => self.tc_attention = false,
                    "skinny" => self.skinny = false,
                    "ln_vec" => self.ln_vec = false,
                    "ew_vec" => self.ew_vec = false,
                    "small_attn" => self.small_attn = false,
                    "small_ffn" => self.small_ffn = false,
                    "gemm_small" => self.gemm_small = false,
                    "qkv_attn" => self.qkv_attn = false,
                    "ln_defer" => self.ln_defer = false,
                    "ffn_splitk" => self.ffn_splitk = false,
                    "attn_o" => self.attn_o = false,
                    "pdl" => self.pdl = false,
                    "staged_io" => self.staged_io = false,
                    "stage_fold" => self.stage_fold = false,
                    "inline_input" => self.inline_input = false,
                    "poll_done" => self.poll_done = false,
                    "poll_output" => self.poll_output = false,
                    "embed_qkv" => self.embed_qkv = false,
                    "attn_s16" => self.attn_s16 = false,
                    _ => {}
                }
            }
        }
        self
    }

    /// The names in `list` that [`Limits::with_disabled`] does not know.
    pub fn unknown_switches(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|i| {
                !i.is_empty()
                    && !DISABLE_SWITCHES.contains(i)
                    && !DISABLE_GROUPS.iter().any(|(g, _)| g == i)
            })
            .map(str::to_string)
            .collect()
    }

    /// The specialised paths this configuration has switched off.
    pub fn disabled(&self) -> Vec<&'static str> {
        let on = [
            self.tc_attention,
            self.skinny,
            self.ln_vec,
            self.ew_vec,
            self.small_attn,
            self.small_ffn,
            self.gemm_small,
            self.qkv_attn,
            self.ln_defer,
            self.ffn_splitk,
            self.attn_o,
            self.pdl,
            self.staged_io,
            self.stage_fold,
            self.inline_input,
            self.poll_done,
            self.poll_output,
            self.embed_qkv,
            self.attn_s16,
        ];
        DISABLE_SWITCHES
            .iter()
            .zip(on)
            .filter(|(_, on)| !on)
            .map(|(n, _)| *n)
            .collect()
    }
}

/// A cast still to run after an op: (from, from type, to, to type).
type PendingCast = Option<(Loc, DType, Loc, DType)>;

/// What `attn_o_small` adds to `gemm_small`'s arguments: its name, its
/// dynamic shared memory and the attention's `mask, seq, heads, scale`.
struct AttnPrologue {
    name: String,
    smem: usize,
    args: [Arg; 4],
}

/// An `Op::Linear`'s fields, for the planner's matmul kernels.
#[derive(Clone, Copy)]
struct LinearOp {
    x: BufId,
    w: WeightId,
    bias: Option<WeightId>,
    act: Activation,
    out: BufId,
    m: usize,
    n: usize,
    k: usize,
}

/// What a matmul kernel needs to apply the AddLayerNorm after it (see
/// `Planner::add_ln_after`).
struct AddLnAfter {
    residual: BufId,
    gamma: WeightId,
    beta: WeightId,
    eps: f32,
    out: BufId,
}

/// A pooling's arguments for the LayerNorm it applies: gamma, beta, eps.
fn deferred_ln_args(d: &DeferredLn) -> [Arg; 3] {
    [
        Arg::Ptr(Loc::Weight(d.gamma)),
        Arg::Ptr(Loc::Weight(d.beta)),
        Arg::F32(d.eps),
    ]
}

/// A LayerNorm left to the op that reads its output (see
/// [`Limits::ln_defer`]): the pre-norm rows, the LayerNorm's parameters and
/// output buffer, and the op that must apply it.
struct DeferredLn {
    consumer: usize,
    pre_norm: Loc,
    gamma: WeightId,
    beta: WeightId,
    eps: f32,
    out: BufId,
}

/// ops[idx..idx + 3] as a transformer's feed-forward block: Linear(x →
/// inter, act) → Linear(inter → proj) → AddLayerNorm(proj + x) into `out`,
/// `m` rows, `hidden` wide at both ends and `n1` in between.
#[derive(Clone, Copy)]
struct FfnBlock {
    x: BufId,
    w1: WeightId,
    b1: Option<WeightId>,
    act: Activation,
    inter: BufId,
    w2: WeightId,
    b2: Option<WeightId>,
    proj: BufId,
    gamma: WeightId,
    beta: WeightId,
    eps: f32,
    out: BufId,
    m: usize,
    hidden: usize,
    n1: usize,
}

fn ffn_block(ops: &[Op], idx: usize) -> Option<FfnBlock> {
    let (
        Some(&Op::Linear {
            x,
            w: w1,
            bias: b1,
            act,
            out: inter,
            m,
            n: n1,
            k: hidden,
        }),
        Some(&Op::Linear {
            x: x2,
            w: w2,
            bias: b2,
            act: Activation::Identity,
            out: proj,
            m: m2,
            n: n2,
            k: k2,
        }),
        Some(&Op::AddLayerNorm {
            x: ln_x,
            residual,
            gamma,
            beta,
            eps,
            out,
            rows,
            hidden: ln_hidden,
        }),
    ) = (ops.get(idx), ops.get(idx + 1), ops.get(idx + 2))
    else {
        return None;
    };
    let shaped = (x2, ln_x, residual) == (inter, proj, x)
        && (m2, n2, k2) == (m, hidden, n1)
        && (rows, ln_hidden) == (m, hidden);
    shaped.then_some(FfnBlock {
        x,
        w1,
        b1,
        act,
        inter,
        w2,
        b2,
        proj,
        gamma,
        beta,
        eps,
        out,
        m,
        hidden,
        n1,
    })
}

/// An Attention or PackedAttention op as the fused kernels take it:
/// `rows` query rows, and `mask` / `seq` for a padded batch (sequences of
/// `seq` rows; `None` / 0 when packed, where the offsets say).
#[derive(Clone, Copy)]
struct AttentionView {
    qkv: BufId,
    out: BufId,
    heads: usize,
    head_dim: usize,
    mask: Option<BufId>,
    seq: usize,
    rows: usize,
    bias: Option<PositionBias>,
}

fn attention_view(op: Option<&Op>) -> Option<AttentionView> {
    match *op? {
        Op::Attention {
            qkv,
            mask,
            out,
            batch,
            seq,
            heads,
            head_dim,
            bias,
        } => Some(AttentionView {
            qkv,
            out,
            heads,
            head_dim,
            mask: Some(mask),
            seq,
            rows: batch * seq,
            bias,
        }),
        Op::PackedAttention {
            qkv,
            out,
            tokens,
            heads,
            head_dim,
            bias,
            ..
        } => Some(AttentionView {
            qkv,
            out,
            heads,
            head_dim,
            mask: None,
            seq: 0,
            rows: tokens,
            bias,
        }),
        _ => None,
    }
}

struct Planner<'a> {
    program: &'a Program,
    weights: &'a Weights,
    compute: DType,
    tf32: bool,
    limits: Limits,
    locs: HashMap<BufId, Loc>,
    arena: usize,
    counters: usize,
    /// The fused sublayers' f32 scratch (shared by all of them) and its bytes.
    fused_tmp: Option<(Loc, usize)>,
    /// A LayerNorm the next op must apply (planned by the op before it).
    deferred_ln: Option<DeferredLn>,
    /// `ffn_small` kernels planned so far; the j-th adds into the
    /// accumulator `Loc::Accum(j)` and zeroes `Loc::Accum(j + 1)`, logical
    /// numbers that [`assign_accums`] maps onto the stream's accumulators.
    ffn_smalls: usize,
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
        self.input_bytes += align_up(max_tiles * TILE_ENTRY * 4, INT_INPUT_ALIGN);
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
        if self.limits.ew_vec && from_t == to_t && elems.is_multiple_of(EW_VEC) {
            // In place or a copy of one type: 8 values per thread and step.
            self.kernel(
                format!("bias_act_vec_{}", suffix(from_t)),
                (ew_blocks(elems / EW_VEC), 1, 1),
                EW_THREADS,
                0,
                vec![
                    Arg::Ptr(from),
                    Arg::Null,
                    Arg::Ptr(to),
                    Arg::I32(n),
                    Arg::I32(EW_VEC as i32),
                    Arg::I32(act_code(act)),
                ],
            );
            return Ok(());
        }
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
        let Some(&Op::AddLayerNorm {
            x: ln_x,
            residual,
            gamma,
            beta,
            eps,
            out: ln_out,
            rows,
            hidden,
        }) = self.program.ops.get(idx + 1)
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
    /// too where [`Planner::add_ln_after`] allows (then it consumes 2 ops).
    /// With `attn`, the Linear reads an attention's output, which the kernel
    /// (`attn_o_small`) computes itself from `x_l` (the q, k, v rows).
    fn gemm_small(
        &mut self,
        idx: usize,
        op: LinearOp,
        x_l: Loc,
        attn: Option<AttnPrologue>,
    ) -> Result<usize, BackendError> {
        let LinearOp { act, out, m, n, .. } = op;
        let t = self.compute;
        let grid = u32::try_from(n.div_ceil(GS_NB))
            .map_err(|_| BackendError::Unsupported(format!("op {idx} (Linear): {n} outputs")))?;
        let (offsets, seqs) = self.live_rows_args();
        let ln = self
            .add_ln_after(idx, act, out, m, n)
            .filter(|_| ln_vec_fits(n));
        // This Linear's x may be a LayerNorm the op before left to it (never
        // an attention's output).
        let x_norm = match attn {
            None => Some(self.deferred_ln_args(idx, op.x)?),
            Some(_) => None,
        };
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
        let (name, smem) = match (attn, x_norm) {
            (Some(a), _) => {
                args.extend(a.args);
                (a.name, a.smem)
            }
            (None, Some(x_norm)) => {
                args.extend(x_norm);
                (format!("gemm_small_{}", suffix(t)), 0)
            }
            (None, None) => unreachable!("x_norm is planned without attn"),
        };
        self.kernel(name, (grid, 1, 1), GS_THREADS, smem, args);
        Ok(consumed)
    }

    /// ops[idx..idx + 2] = Attention | PackedAttention → the Linear reading
    /// its output, few rows, where the Linear runs on `gemm_small`: one
    /// `attn_o_small` kernel (attn_o_small.cu) whose every block computes
    /// the attention into shared memory and multiplies it by its columns of
    /// the weight, with gemm_small's epilogue (and the AddLayerNorm after
    /// the Linear where gemm_small takes it). `None` when the ops do not
    /// have that shape or the kernel does not take it (the attention then
    /// runs as its own kernel, which reports its own errors).
    fn attn_o(&mut self, idx: usize) -> Result<Option<usize>, BackendError> {
        let t = self.compute;
        let ops = &self.program.ops;
        let Some(AttentionView {
            qkv,
            out: ctx,
            heads,
            head_dim,
            mask,
            seq,
            rows,
            bias: pos_bias,
        }) = attention_view(ops.get(idx))
        else {
            return Ok(None);
        };
        let Some(&Op::Linear {
            x,
            w,
            bias,
            act,
            out,
            m,
            n,
            k,
        }) = ops.get(idx + 1)
        else {
            return Ok(None);
        };
        let max_rows = if self.program.is_packed() {
            GS_MAXM
        } else {
            GS_MAXM_PADDED
        };
        let hidden = heads * head_dim;
        let (_, seqs) = self.live_rows_args();
        // The q, k, v rows (whole m-tiles, rows padded by 8 values), then
        // the mask and the packed offsets (attn_o_small.cu).
        let smem = m.div_ceil(16) * 16 * (3 * hidden + 8) * t.size() + (m + seqs + 1) * 4;
        let fits = self.limits.attn_o
            && self.limits.gemm_small
            && !self.limits.small_attn
            && !self.limits.small_ffn
            && pos_bias.is_none()
            && super::kernels::ATTN_O_HEAD_DIMS.contains(&head_dim)
            && x == ctx
            && ctx != qkv
            && (m, k) == (rows, hidden)
            && hidden.is_multiple_of(32)
            && (mask.is_some() == (seq > 0))
            && self.program.is_packed() == mask.is_none()
            && [qkv, ctx, out].iter().all(|&b| self.dtype(b) == t)
            && !(self.limits.skinny && skinny_fits(m, n, k, t))
            && gemm_small_fits(m, n, k, t, max_rows)
            && dead_after(ops, idx + 2, ctx)
            && smem + AO_STATIC_SMEM <= self.limits.max_dyn_smem;
        if !fits {
            return Ok(None);
        }
        let x_l = self.float_in(qkv, rows * 3 * hidden, t)?;
        let mask = mask.map(|b| Arg::Ptr(self.int_loc(b))).unwrap_or(Arg::Null);
        let attn = AttnPrologue {
            name: format!("attn_o_small_{}_d{head_dim}", suffix(t)),
            smem,
            args: [
                mask,
                Arg::I32(seq as i32),
                Arg::I32(heads as i32),
                Arg::F32(1.0 / (head_dim as f32).sqrt()),
            ],
        };
        let linear = LinearOp {
            x,
            w,
            bias,
            act,
            out,
            m,
            n,
            k,
        };
        Ok(Some(1 + self.gemm_small(idx + 1, linear, x_l, Some(attn))?))
    }

    /// ops[idx..idx + 3] = Linear(intermediate, act) → Linear(output) →
    /// AddLayerNorm(+ the first Linear's input), few rows, with the
    /// LayerNorm deferrable to ops[idx + 3]: one `ffn_small` kernel
    /// (ffn_small.cu) that adds the block's pre-norm rows into an
    /// accumulator and leaves the LayerNorm to the next op. `None` when the
    /// ops do not have that shape (the Linears then run one by one).
    fn ffn_small(
        &mut self,
        idx: usize,
        op: LinearOp,
        x_l: Loc,
        max_rows: usize,
    ) -> Result<Option<usize>, BackendError> {
        let t = self.compute;
        let ops = &self.program.ops;
        let Some(FfnBlock {
            x,
            w1,
            b1,
            act,
            inter: h,
            w2,
            b2,
            proj: y,
            gamma,
            beta,
            eps,
            out: ln_out,
            m,
            hidden: k,
            n1,
        }) = ffn_block(ops, idx)
        else {
            return Ok(None);
        };
        let n2 = k;
        let activation = |b: BufId| self.program.buffer(b).kind == BufKind::Activation;
        let fits = self.limits.ffn_splitk
            && self.limits.ln_defer
            && x == op.x
            && x_l == self.locs[&x]
            && activation(h)
            && activation(y)
            && [x, h, y, ln_out].iter().all(|&b| self.dtype(b) == t)
            && ln_out != y
            && dead_after(ops, idx + 2, h)
            && dead_after(ops, idx + 3, y)
            && n1.is_multiple_of(GS_NB)
            && n2.is_multiple_of(8)
            && n2 <= 8 * GS_WARPS * FS_TPW
            && m * n2 <= ACCUM_FLOATS
            && gemm_small_fits(m, n1, k, t, max_rows)
            && gemm_small_fits(m, n2, n1, t, max_rows)
            && self.takes_deferred_ln(idx + 3, ln_out, n2, m);
        if !fits {
            return Ok(None);
        }
        let grid = u32::try_from(n1 / GS_NB)
            .map_err(|_| BackendError::Unsupported(format!("op {idx} (Linear): {n1} outputs")))?;
        let x_norm = self.deferred_ln_args(idx, x)?;
        let j = self.ffn_smalls;
        self.ffn_smalls += 1;
        let (offsets, seqs) = self.live_rows_args();
        let opt = |b: Option<WeightId>| b.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        let mut args = vec![
            Arg::Ptr(x_l),
            Arg::Ptr(Loc::Weight(w1)),
            opt(b1),
            Arg::I32(act_code(act)),
            Arg::Ptr(Loc::Weight(w2)),
            opt(b2),
            Arg::Ptr(self.locs[&x]),
            Arg::Ptr(Loc::Accum(j)),
            Arg::Ptr(Loc::Accum(j + 1)),
            // The next one's rows (set again by assign_accums).
            Arg::I32((m * n2) as i32),
            Arg::I32(m as i32),
            Arg::I32(n1 as i32),
            Arg::I32(k as i32),
            Arg::I32(n2 as i32),
            offsets,
            Arg::I32(seqs as i32),
        ];
        args.extend(x_norm);
        self.kernel(
            format!("ffn_small_{}", suffix(t)),
            (grid, 1, 1),
            GS_THREADS,
            0,
            args,
        );
        self.deferred_ln = Some(DeferredLn {
            consumer: idx + 3,
            pre_norm: Loc::Accum(j),
            gamma,
            beta,
            eps,
            out: ln_out,
        });
        Ok(Some(3))
    }

    /// `gemm_small`'s and `ffn_small`'s last five arguments (`xf, xg, xb,
    /// xeps, xout`): the LayerNorm the op before left to ops[idx], which
    /// reads `x`, or none.
    fn deferred_ln_args(&mut self, idx: usize, x: BufId) -> Result<[Arg; 5], BackendError> {
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
    fn take_deferred_ln(
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
    /// × `hidden`) itself ([`Limits::ln_defer`]): a Linear that will run on
    /// `gemm_small` reading `x` (the conditions mirror the Linear's own path
    /// choice in [`Planner::op`]: no fused sublayer, not skinny, on
    /// `gemm_small`), or a mean / max pooling of `x` that nothing reads
    /// after (the LayerNorm's output is then never stored).
    fn takes_deferred_ln(&self, idx: usize, x: BufId, hidden: usize, rows: usize) -> bool {
        let t = self.compute;
        let ops = &self.program.ops;
        let pool_fits = |px: BufId, mode: Pooling, skip: Option<BufId>, prows: usize, ph: usize| {
            self.limits.ln_defer
                && px == x
                && mode != Pooling::Cls
                && skip.is_none()
                && (prows, ph) == (rows, hidden)
                && hidden <= POOL_LN_MAX_HIDDEN
                && self.dtype(x) == t
                && dead_after(ops, idx + 1, x)
        };
        let (m, n, k, out) = match ops.get(idx) {
            Some(&Op::Linear {
                x: lx,
                out,
                m,
                n,
                k,
                ..
            }) if lx == x => (m, n, k, out),
            Some(&Op::Pool {
                x: px,
                mode,
                skip,
                batch,
                seq,
                hidden: ph,
                ..
            }) => return pool_fits(px, mode, skip, batch * seq, ph),
            Some(&Op::PackedPool {
                x: px,
                mode,
                skip,
                tokens,
                hidden: ph,
                ..
            }) => return pool_fits(px, mode, skip, tokens, ph),
            _ => return false,
        };
        let max_rows = if self.program.is_packed() {
            GS_MAXM
        } else {
            GS_MAXM_PADDED
        };
        let out_t = self.dtype(out);
        self.limits.ln_defer
            && self.limits.gemm_small
            && !self.limits.small_attn
            && !self.limits.small_ffn
            && (m, k) == (rows, hidden)
            && k <= 32 * GS_WARPS * 4
            && self.dtype(x) == t
            && !(self.limits.skinny
                && skinny_fits(m, n, k, t)
                && (out_t == t || out_t == DType::F32))
            && out_t == t
            && gemm_small_fits(m, n, k, t, max_rows)
    }

    /// ops[idx..idx + 2] = Linear(qkv) → Attention | PackedAttention of
    /// head size [`QA_HEAD_DIM`], for a Linear that runs on `gemm_small`:
    /// one `qkv_attn_small` kernel (qkv_attn_small.cu), whose blocks of a
    /// head compute its q, k, v columns and the last of them its attention.
    /// `None` when the ops do not have that shape (the Linear then runs
    /// alone); the attention's own errors are left to its op.
    fn qkv_attn(
        &mut self,
        idx: usize,
        op: LinearOp,
        x_l: Loc,
    ) -> Result<Option<usize>, BackendError> {
        let t = self.compute;
        let LinearOp {
            x: _,
            w,
            bias,
            act,
            out: qkv,
            m,
            n,
            k: hidden,
        } = op;
        let Some(AttentionView {
            qkv: att_qkv,
            out: ctx,
            heads,
            head_dim,
            mask,
            seq,
            rows: _,
            bias: pos_bias,
        }) = attention_view(self.program.ops.get(idx + 1)).filter(|a| a.rows == m)
        else {
            return Ok(None);
        };
        // The kernels take a packed batch as sequences of 1 under no mask.
        let (mask, seq) = match mask {
            Some(b) => (Arg::Ptr(self.int_loc(b)), seq),
            None => (Arg::Null, 1),
        };
        let fits = self.limits.qkv_attn
            && self.deferred_ln.is_none()
            && att_qkv == qkv
            && act == Activation::Identity
            && head_dim == QA_HEAD_DIM
            && heads * head_dim == hidden
            && n == 3 * hidden
            && self.dtype(ctx) == t
            && ctx != qkv
            && heads <= u32::MAX as usize / QA_PARTS;
        if !fits {
            return Ok(None);
        }
        let Ok((tag, bias_args)) = self.bias_args(pos_bias, heads, "") else {
            return Ok(None);
        };
        let (offsets, seqs) = self.live_rows_args();
        let counters = Loc::Counter(self.counters);
        self.counters += heads;
        let opt = |b: Option<WeightId>| b.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        let mut args = vec![
            Arg::Ptr(x_l),
            Arg::Ptr(Loc::Weight(w)),
            opt(bias),
            Arg::Ptr(self.locs[&qkv]),
            Arg::Ptr(self.locs[&ctx]),
            Arg::Ptr(counters),
            mask,
            offsets,
            Arg::I32(seqs as i32),
            Arg::I32(seq as i32),
            Arg::I32(m as i32),
            Arg::I32(hidden as i32),
            Arg::F32(1.0 / (head_dim as f32).sqrt()),
        ];
        args.extend(bias_args);
        self.kernel(
            format!("qkv_attn_small{tag}_{}_d{head_dim}", suffix(t)),
            ((heads * QA_PARTS) as u32, 1, 1),
            GS_THREADS,
            0,
            args,
        );
        Ok(Some(2))
    }

    /// A Linear with few rows through the skinny kernel, fused with the
    /// AddLayerNorm after it when that reads only this output (which is then
    /// never materialised). Returns the ops consumed.
    fn skinny(
        &mut self,
        idx: usize,
        op: LinearOp,
        x_l: Loc,
        out_t: DType,
    ) -> Result<usize, BackendError> {
        let LinearOp { act, out, m, n, .. } = op;
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
        op: LinearOp,
        ln: Option<AddLnAfter>,
    ) -> (Vec<Arg>, usize) {
        let LinearOp {
            x: _,
            w,
            bias,
            act,
            out,
            m,
            n,
            k,
        } = op;
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

    /// `embed_ln_vec` over `rows` rows: `ints` = ids, types and positions
    /// (`Null`: `row % seq`), `w` = word, position and type tables, gamma, beta.
    #[allow(clippy::too_many_arguments)]
    fn embed_ln_vec(
        &mut self,
        ints: [Arg; 3],
        w: [WeightId; 5],
        eps: f32,
        dst: Loc,
        rows: usize,
        seq: usize,
        hidden: usize,
    ) -> Result<(), BackendError> {
        let grid = u32::try_from(rows.div_ceil(LNV_WARPS))
            .ok()
            .filter(|_| rows <= i32::MAX as usize)
            .ok_or_else(|| BackendError::Unsupported(format!("embedding of {rows} rows")))?;
        let [word, position, token_type, gamma, beta] = w;
        let mut args = ints.to_vec();
        args.extend([
            Arg::Ptr(Loc::Weight(word)),
            Arg::Ptr(Loc::Weight(position)),
            Arg::Ptr(Loc::Weight(token_type)),
            Arg::Ptr(Loc::Weight(gamma)),
            Arg::Ptr(Loc::Weight(beta)),
            Arg::F32(eps),
            Arg::Ptr(dst),
            Arg::I32(rows as i32),
            Arg::I32(seq as i32),
            Arg::I32(hidden as i32),
            Arg::I32(self.rows_of(word) as i32),
            Arg::I32(self.rows_of(position) as i32),
            Arg::I32(self.rows_of(token_type) as i32),
            // Staging (source, destination, words, sync): set by
            // `Plan::with_staged_io` when this is a staged graph's first step.
            Arg::Null,
            Arg::Null,
            Arg::I32(0),
            Arg::I32(0),
        ]);
        self.kernel(
            format!("embed_ln_vec_{}", suffix(self.compute)),
            (grid, 1, 1),
            (32 * LNV_WARPS) as u32,
            0,
            args,
        );
        Ok(())
    }

    /// The kernel-name tag (`""` or `"_bias"`) and the trailing arguments
    /// (the `[heads, 2·radius + 1]` table and its radius) of an attention
    /// with MPNet's relative position bias, computed in the kernel from the
    /// table (attention.cu `rel_bias`).
    fn bias_args(
        &self,
        bias: Option<PositionBias>,
        heads: usize,
        what: &str,
    ) -> Result<(&'static str, Vec<Arg>), BackendError> {
        let Some(b) = bias else {
            return Ok(("", Vec::new()));
        };
        let shape = &self.weights.get(b.table).shape;
        let cols = 2 * b.radius + 1;
        if shape[..] != [heads, cols] || b.radius > i32::MAX as usize / 4 {
            return Err(BackendError::Unsupported(format!(
                "{what}: position bias table {shape:?} (expected [{heads}, {cols}])"
            )));
        }
        Ok((
            "_bias",
            vec![Arg::Ptr(Loc::Weight(b.table)), Arg::I32(b.radius as i32)],
        ))
    }

    /// Whether `b` is an activation buffer of the compute type that nothing
    /// reads after `ops[from..]` overwrites it (or at all): a fusion may then
    /// leave it unwritten.
    fn scratch_only(&self, b: BufId, from: usize) -> bool {
        self.program.buffer(b).kind == BufKind::Activation && dead_after(&self.program.ops, from, b)
    }

    /// Packed programs: the `cu_seqlens` input and the most sequences;
    /// padded: `(Null, 0)`.
    fn live_rows_args(&self) -> (Arg, usize) {
        match self.program.input(InputRole::SeqOffsets) {
            Some(o) if self.program.is_packed() => (Arg::Ptr(self.int_loc(o)), self.program.batch),
            _ => (Arg::Null, 0),
        }
    }

    /// A counter and the f32 `m` × `hidden` scratch of a fused sublayer
    /// (one scratch for all of a plan's: they run one after the other).
    fn fused_scratch(&mut self, m: usize, hidden: usize) -> (Loc, Loc) {
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

    /// ops[idx..idx + 4] = Linear(qkv) → Attention | PackedAttention →
    /// Linear(o) → AddLayerNorm, for few rows: one `layer_attn_small`
    /// kernel (see small_layer.cu). `None` when the ops do not have that
    /// shape or the kernel does not take it.
    fn small_attn(&mut self, idx: usize) -> Option<usize> {
        let t = self.compute;
        let program = self.program;
        let ops = &program.ops;
        let (
            Some(&Op::Linear {
                x: h,
                w: wqkv,
                bias: bqkv,
                act: Activation::Identity,
                out: qkv,
                m,
                n: n_qkv,
                k: hidden,
            }),
            Some(att),
            Some(&Op::Linear {
                x: ctx_in,
                w: wo,
                bias: bo,
                act: Activation::Identity,
                out: proj,
                m: m_o,
                n: n_o,
                k: k_o,
            }),
            Some(&Op::AddLayerNorm {
                x: ln_x,
                residual,
                gamma,
                beta,
                eps,
                out: ln_out,
                rows,
                hidden: ln_hidden,
            }),
        ) = (
            ops.get(idx),
            ops.get(idx + 1),
            ops.get(idx + 2),
            ops.get(idx + 3),
        )
        else {
            return None;
        };
        let AttentionView {
            qkv: att_qkv,
            out: ctx,
            heads,
            head_dim,
            mask,
            seq,
            rows: _,
            bias,
        } = attention_view(Some(att)).filter(|a| a.rows == m)?;
        // The kernels take a packed batch as sequences of 1 under no mask.
        let (mask, seq) = match mask {
            Some(b) => (Arg::Ptr(self.int_loc(b)), seq),
            None => (Arg::Null, 1),
        };
        let fits = self.limits.small_attn
            && small_fits(m, hidden, t)
            && super::kernels::SMALL_ATTN_HEAD_DIMS.contains(&head_dim)
            && heads * head_dim == hidden
            && n_qkv == 3 * hidden
            && att_qkv == qkv
            && ctx_in == ctx
            && (m_o, n_o, k_o) == (m, hidden, hidden)
            && ln_x == proj
            && residual == h
            && (rows, ln_hidden) == (m, hidden)
            && self.dtype(h) == t
            && self.program.buffer(ln_out).kind == BufKind::Activation
            && ![qkv, ctx, proj].contains(&ln_out)
            && ![qkv, ctx, proj].contains(&h)
            && self.scratch_only(qkv, idx + 4)
            && self.scratch_only(ctx, idx + 4)
            && self.scratch_only(proj, idx + 4)
            && heads <= self.limits.sms;
        let smem = small_attn_smem(m, hidden, head_dim);
        if !fits || smem > self.limits.max_dyn_smem {
            return None;
        }
        // MPNet's relative bias: the `_bias` variant (a malformed table
        // leaves the op to the unfused path, which reports it).
        let (tag, bias_args) = self.bias_args(bias, heads, "").ok()?;
        let (offsets, seqs) = self.live_rows_args();
        let (counter, tmp) = self.fused_scratch(m, hidden);
        let opt = |b: Option<WeightId>| b.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        let mut args = vec![
            Arg::Ptr(self.locs[&h]),
            Arg::Ptr(Loc::Weight(wqkv)),
            opt(bqkv),
            Arg::Ptr(Loc::Weight(wo)),
            opt(bo),
            Arg::Ptr(Loc::Weight(gamma)),
            Arg::Ptr(Loc::Weight(beta)),
            Arg::F32(eps),
            Arg::Ptr(self.locs[&ln_out]),
            Arg::Ptr(self.locs[&ctx]),
            Arg::Ptr(tmp),
            Arg::Ptr(counter),
            mask,
            offsets,
            Arg::I32(seqs as i32),
            Arg::I32(seq as i32),
            Arg::I32(m as i32),
            Arg::I32(hidden as i32),
            Arg::F32(1.0 / (head_dim as f32).sqrt()),
        ];
        args.extend(bias_args);
        self.kernel(
            format!("layer_attn_small{tag}_{}_d{head_dim}", suffix(t)),
            (heads as u32, 1, 1),
            SL_THREADS,
            smem,
            args,
        );
        Some(4)
    }

    /// ops[idx..idx + 3] = Linear(intermediate, act) → Linear(output) →
    /// AddLayerNorm, for few rows: one `layer_ffn_small` kernel.
    fn small_ffn(&mut self, idx: usize) -> Option<usize> {
        let t = self.compute;
        let f = ffn_block(&self.program.ops, idx)?;
        let (h, inter, proj, ln_out, m, hidden, n1) =
            (f.x, f.inter, f.proj, f.out, f.m, f.hidden, f.n1);
        let fits = self.limits.small_ffn
            && small_fits(m, hidden, t)
            && n1.is_multiple_of(32 * SL_WARPS)
            && n1 / SL_FS <= self.limits.sms
            && self.dtype(h) == t
            && self.program.buffer(ln_out).kind == BufKind::Activation
            && ![inter, proj].contains(&ln_out)
            && ![inter, proj].contains(&h)
            && self.scratch_only(inter, idx + 3)
            && self.scratch_only(proj, idx + 3);
        let smem = small_ffn_smem(m, hidden);
        if !fits || smem > self.limits.max_dyn_smem {
            return None;
        }
        let (offsets, seqs) = self.live_rows_args();
        let (counter, tmp) = self.fused_scratch(m, hidden);
        let opt = |b: Option<WeightId>| b.map(|b| Arg::Ptr(Loc::Weight(b))).unwrap_or(Arg::Null);
        self.kernel(
            format!("layer_ffn_small_{}", suffix(t)),
            ((n1 / SL_FS) as u32, 1, 1),
            SL_THREADS,
            smem,
            vec![
                Arg::Ptr(self.locs[&h]),
                Arg::Ptr(Loc::Weight(f.w1)),
                opt(f.b1),
                Arg::I32(act_code(f.act)),
                Arg::Ptr(Loc::Weight(f.w2)),
                opt(f.b2),
                Arg::Ptr(Loc::Weight(f.gamma)),
                Arg::Ptr(Loc::Weight(f.beta)),
                Arg::F32(f.eps),
                Arg::Ptr(self.locs[&ln_out]),
                Arg::Ptr(self.locs[&inter]),
                Arg::Ptr(tmp),
                Arg::Ptr(counter),
                offsets,
                Arg::I32(seqs as i32),
                Arg::I32(m as i32),
                Arg::I32(hidden as i32),
                Arg::I32(n1 as i32),
            ],
        );
        Some(3)
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
                position_ids,
            } => {
                let rows = batch * seq;
                let ids_l = self.int_loc(ids);
                let types_l = self.int_loc(token_types);
                let vocab = self.rows_of(word);
                let npos = self.rows_of(position);
                let ntypes = self.rows_of(token_type);
                let threads = ln_threads(hidden)?;
                let (dst, pending) = self.float_out(out, rows * hidden, t);
                // XLM-R / MPNet: positions counted from pad + 1 over the
                // row's non-pad ids (embed_pos.cu), one more argument.
                let pad = match position_ids {
                    PositionIds::AfterPadding { pad } => Some(pad_arg(pad)?),
                    PositionIds::Index => None,
                };
                if pad.is_none() && self.limits.ln_vec && ln_vec_fits(hidden) {
                    self.embed_ln_vec(
                        [Arg::Ptr(ids_l), Arg::Ptr(types_l), Arg::Null],
                        [word, position, token_type, gamma, beta],
                        eps,
                        dst,
                        rows,
                        seq,
                        hidden,
                    )?;
                    self.finish_out(pending, rows * hidden)?;
                    return Ok(1);
                }
                let mut args = vec![
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
                ];
                let name = match pad {
                    Some(pad) => {
                        args.push(Arg::I32(pad));
                        format!("embed_ln_padpos_{ts}")
                    }
                    None => format!("embed_ln_{ts}"),
                };
                self.kernel(name, (rows as u32, 1, 1), threads, 0, args);
                self.finish_out(pending, rows * hidden)?;
                Ok(1)
            }
            Op::Normalize { x, rows, width } => {
                // In place, in the buffer's own type (the f32 output after
                // the last Dense module, or an activation).
                let grid = u32::try_from(rows)
                    .ok()
                    .filter(|_| width <= i32::MAX as usize)
                    .ok_or_else(|| {
                        BackendError::Unsupported(format!(
                            "op {idx} (Normalize): {rows} rows of {width}"
                        ))
                    })?;
                let xt = self.dtype(x);
                self.kernel(
                    format!("l2norm_rows_{}", suffix(xt)),
                    (grid, 1, 1),
                    rownorm_threads(width),
                    0,
                    vec![Arg::Ptr(self.locs[&x]), Arg::I32(width as i32)],
                );
                Ok(1)
            }
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
                if let Some(n) = self.small_attn(idx).or_else(|| self.small_ffn(idx)) {
                    return Ok(n);
                }
                let x_l = self.float_in(x, m * k, t)?;
                let out_t = self.dtype(out);
                let linear = LinearOp {
                    x,
                    w,
                    bias,
                    act,
                    out,
                    m,
                    n,
                    k,
                };
                if self.limits.skinny
                    && skinny_fits(m, n, k, t)
                    && (out_t == t || out_t == DType::F32)
                {
                    return self.skinny(idx, linear, x_l, out_t);
                }
                let max_rows = if self.program.is_packed() {
                    GS_MAXM
                } else {
                    GS_MAXM_PADDED
                };
                if self.limits.gemm_small && out_t == t && gemm_small_fits(m, n, k, t, max_rows) {
                    if let Some(consumed) = self.qkv_attn(idx, linear, x_l)? {
                        return Ok(consumed);
                    }
                    if let Some(consumed) = self.ffn_small(idx, linear, x_l, max_rows)? {
                        return Ok(consumed);
                    }
                    return self.gemm_small(idx, linear, x_l, None);
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
                if self.limits.ln_vec && ln_vec_fits(hidden) {
                    let grid = u32::try_from(rows.div_ceil(LNV_WARPS)).map_err(|_| {
                        BackendError::Unsupported(format!("op {idx} (AddLayerNorm): {rows} rows"))
                    })?;
                    self.kernel(
                        format!("add_ln_vec_{ts}"),
                        (grid, 1, 1),
                        (32 * LNV_WARPS) as u32,
                        0,
                        vec![
                            Arg::Ptr(x_l),
                            Arg::Ptr(r_l),
                            Arg::Ptr(Loc::Weight(gamma)),
                            Arg::Ptr(Loc::Weight(beta)),
                            Arg::F32(eps),
                            Arg::Ptr(dst),
                            Arg::I32(rows as i32),
                            Arg::I32(hidden as i32),
                        ],
                    );
                    self.finish_out(pending, elems)?;
                    return Ok(1);
                }
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
                bias,
            } => {
                if let Some(consumed) = self.attn_o(idx)? {
                    return Ok(consumed);
                }
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
                let (tag, bias_args) = self.bias_args(bias, heads, &what)?;
                if tensor_cores {
                    let mut args = vec![
                        Arg::Ptr(q_l),
                        Arg::Ptr(mask_l),
                        Arg::Ptr(dst),
                        Arg::I32(seq as i32),
                        Arg::I32(heads as i32),
                        Arg::F32(1.0 / (head_dim as f32).sqrt()),
                    ];
                    args.extend(bias_args);
                    let s16 = if self.limits.attn_s16
                        && seq <= ATTN_S16_MAX_SEQ
                        && super::kernels::ATTENTION_TC_S16_HEAD_DIMS.contains(&head_dim)
                    {
                        "_s16"
                    } else {
                        ""
                    };
                    self.kernel(
                        format!("attention_tc{tag}{s16}_{ts}_d{head_dim}"),
                        (seq.div_ceil(TC_QT) as u32, heads as u32, batch as u32),
                        TC_THREADS,
                        0,
                        args,
                    );
                } else {
                    let mut args = vec![
                        Arg::Ptr(q_l),
                        Arg::Ptr(mask_l),
                        Arg::Ptr(dst),
                        Arg::I32(seq as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(head_dim as i32),
                        Arg::F32(1.0 / (head_dim as f32).sqrt()),
                    ];
                    args.extend(bias_args);
                    self.kernel(
                        format!("attention{tag}_{ts}_d{dmax}"),
                        (seq.div_ceil(ATT_QT) as u32, heads as u32, batch as u32),
                        ATT_THREADS,
                        smem,
                        args,
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
                skip,
            } => {
                let mask_l = self.int_loc(mask);
                let ln = self.take_deferred_ln(idx, x)?;
                let x_l = match &ln {
                    Some(d) => d.pre_norm,
                    None => self.float_in(x, batch * seq * hidden, t)?,
                };
                let (dst, pending) = self.float_out(out, batch * hidden, DType::F32);
                let mut args = vec![Arg::Ptr(x_l), Arg::Ptr(mask_l)];
                // include_prompt = false: the skip counts after the mask.
                if let Some(k) = skip {
                    args.push(Arg::Ptr(self.int_loc(k)));
                }
                args.extend([
                    Arg::Ptr(dst),
                    Arg::I32(seq as i32),
                    Arg::I32(hidden as i32),
                    Arg::I32(pool_code(mode)),
                    Arg::I32(normalize as i32),
                ]);
                let name = match (skip, &ln) {
                    (Some(_), _) => "pool_skip",
                    (None, Some(d)) => {
                        args.extend(deferred_ln_args(d));
                        args.push(Arg::I32(batch as i32)); // out_rows: all
                        args.push(Arg::Null); // done (Plan::with_staged_io)
                        "pool_ln"
                    }
                    (None, None) => "pool",
                };
                self.kernel(
                    format!("{name}_{ts}"),
                    (batch as u32, 1, 1),
                    POOL_THREADS,
                    0,
                    args,
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
                position_ids,
                ..
            } => {
                let what = format!("op {idx} (PackedEmbedLayerNorm)");
                let grid = u32::try_from(tokens)
                    .ok()
                    .filter(|&g| g <= i32::MAX as u32)
                    .ok_or_else(|| BackendError::Unsupported(format!("{what}: {tokens} tokens")))?;
                let threads = ln_threads(hidden)?;
                let (dst, pending) = self.float_out(out, tokens * hidden, t);
                let pad = match position_ids {
                    PositionIds::AfterPadding { pad } => Some(pad_arg(pad)?),
                    PositionIds::Index => None,
                };
                if pad.is_none() && self.limits.ln_vec && ln_vec_fits(hidden) {
                    let ids_l = Arg::Ptr(self.int_loc(ids));
                    let types_l = Arg::Ptr(self.int_loc(token_types));
                    let pos_l = Arg::Ptr(self.int_loc(positions));
                    self.embed_ln_vec(
                        [ids_l, types_l, pos_l],
                        [word, position, token_type, gamma, beta],
                        eps,
                        dst,
                        tokens,
                        1,
                        hidden,
                    )?;
                    self.finish_out(pending, tokens * hidden)?;
                    return Ok(1);
                }
                let mut args = vec![
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
                ];
                let name = match pad {
                    Some(pad) => {
                        args.push(Arg::I32(pad));
                        format!("embed_ln_packed_padpos_{ts}")
                    }
                    None => format!("embed_ln_packed_{ts}"),
                };
                self.kernel(name, (grid, 1, 1), threads, 0, args);
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
                bias,
            } => {
                if let Some(consumed) = self.attn_o(idx)? {
                    return Ok(consumed);
                }
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
                let (tag, bias_args) = self.bias_args(bias, heads, &what)?;
                if tensor_cores {
                    let mut args = vec![
                        Arg::Ptr(q_l),
                        Arg::Ptr(table),
                        Arg::Ptr(dst),
                        Arg::I32(heads as i32),
                        Arg::F32(scale),
                        Arg::I32(tokens as i32),
                    ];
                    args.extend(bias_args);
                    self.kernel(
                        format!("attention_varlen_tc{tag}_{ts}_d{head_dim}"),
                        (blocks as u32, 1, 1),
                        TC_THREADS,
                        0,
                        args,
                    );
                } else {
                    let mut args = vec![
                        Arg::Ptr(q_l),
                        Arg::Ptr(table),
                        Arg::Ptr(dst),
                        Arg::I32(heads as i32),
                        Arg::I32(head_dim as i32),
                        Arg::F32(scale),
                        Arg::I32(tokens as i32),
                        Arg::I32(max_seq_len as i32),
                    ];
                    args.extend(bias_args);
                    self.kernel(
                        format!("attention_varlen{tag}_{ts}_d{dmax}"),
                        (blocks as u32, 1, 1),
                        ATT_THREADS,
                        smem,
                        args,
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
                skip,
            } => {
                if seqs > i32::MAX as usize || tokens > i32::MAX as usize {
                    return Err(BackendError::Unsupported(format!(
                        "op {idx} (PackedPool): {seqs} sequences of {tokens} tokens"
                    )));
                }
                let ln = self.take_deferred_ln(idx, x)?;
                let x_l = match &ln {
                    Some(d) => d.pre_norm,
                    None => self.float_in(x, tokens * hidden, t)?,
                };
                let (dst, pending) = self.float_out(out, seqs * hidden, DType::F32);
                let mut args = vec![Arg::Ptr(x_l), Arg::Ptr(self.int_loc(offsets))];
                if let Some(k) = skip {
                    args.push(Arg::Ptr(self.int_loc(k)));
                }
                args.extend([
                    Arg::Ptr(dst),
                    Arg::I32(tokens as i32),
                    Arg::I32(hidden as i32),
                    Arg::I32(pool_code(mode)),
                    Arg::I32(normalize as i32),
                ]);
                let name = match (skip, &ln) {
                    (Some(_), _) => "pool_packed_skip",
                    (None, Some(d)) => {
                        args.extend(deferred_ln_args(d));
                        args.push(Arg::I32(seqs as i32)); // out_rows: all
                        args.push(Arg::Null); // done (Plan::with_staged_io)
                        "pool_packed_ln"
                    }
                    (None, None) => "pool_packed",
                };
                self.kernel(
                    format!("{name}_{ts}"),
                    (seqs as u32, 1, 1),
                    POOL_THREADS,
                    0,
                    args,
                );
                self.finish_out(pending, seqs * hidden)?;
                Ok(1)
            }
        }
    }
}

/// What of `op` the CUDA kernels cannot run, refused for the whole program
/// before anything is planned (so a graph never computes a model as if it
/// were another). Nothing at present: issue 13's families plan onto their
/// own kernels — RoBERTa-style position ids (`embed_ln[_packed]_padpos`),
/// MPNet's relative attention bias (the `attention*_bias` kernels), pooling
/// that skips a prompt (`pool[_packed]_skip`) and `Normalize`
/// (`l2norm_rows`). Shape limits of one device (shared memory, grid sizes)
/// are refused where the op is planned.
pub fn not_on_cuda(_op: &Op) -> Option<String> {
    None
}

/// Plans `program` for compute type `compute`.
pub fn plan(
    program: &Program,
    weights: &Weights,
    compute: DType,
    tf32: bool,
    limits: Limits,
) -> Result<Plan, BackendError> {
    let mut p = plan_once(program, weights, compute, tf32, limits)?;
    if assign_accums(&mut p.steps) == 1 {
        // A lone `ffn_small` could not leave the first accumulator zero
        // for the next graph (see assign_accums): plan without it.
        let limits = Limits {
            ffn_splitk: false,
            ..limits
        };
        p = plan_once(program, weights, compute, tf32, limits)?;
    }
    Ok(p)
}

/// Maps the logical accumulators of a plan's `ffn_small` kernels (the j-th
/// of J adds into `Accum(j)` and zeroes `Accum(j + 1)`, its consumer reads
/// `Accum(j)`) onto the stream's [`ACCUMS`], and returns J. The invariant:
/// accumulator 0 is zero whenever no graph runs on the stream. So the first
/// kernel adds into 0, each zeroes the next one's (whose last reader has
/// completed when it runs: two kernels never share one in a row), and the
/// last zeroes 0 again; with J odd the last takes accumulator 2, so that it
/// differs from both neighbours. J = 1 cannot keep the invariant (its one
/// accumulator is both the first and the last): the caller re-plans.
fn assign_accums(steps: &mut [Step]) -> usize {
    let is_ffn =
        |s: &Step| matches!(s, Step::Kernel { name, .. } if name.starts_with("ffn_small_"));
    let count = steps.iter().filter(|s| is_ffn(s)).count();
    if count == 0 {
        return 0;
    }
    let phys = |j: usize| match j {
        j if j == count => 0,
        j if j == count - 1 && count % 2 == 1 => 2,
        j => j % 2,
    };
    let zero_n = steps
        .iter()
        .filter(|s| is_ffn(s))
        .filter_map(|s| match s {
            Step::Kernel { args, .. } => match args.get(FS_ARG_ZERO_N) {
                Some(&Arg::I32(n)) => Some(n),
                _ => None,
            },
            _ => None,
        })
        .max()
        .unwrap_or(0);
    for step in steps.iter_mut() {
        let Step::Kernel { name, args, .. } = step else {
            continue;
        };
        let ffn = name.starts_with("ffn_small_");
        for (i, a) in args.iter_mut().enumerate() {
            match a {
                Arg::Ptr(Loc::Accum(j)) => *j = phys(*j),
                Arg::I32(n) if ffn && i == FS_ARG_ZERO_N => *n = zero_n,
                _ => {}
            }
        }
    }
    count
}

fn plan_once(
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
        input_bytes += align_up(decl.elems * 4, input_align(role));
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
        fused_tmp: None,
        deferred_ln: None,
        ffn_smalls: 0,
        steps: Vec::new(),
        input_bytes,
        tile_tables: Vec::new(),
    };
    let mut i = 0;
    while i < program.ops.len() {
        if let Some(d) = p.deferred_ln.as_ref().filter(|d| d.consumer != i) {
            return Err(BackendError::Other(format!(
                "planner: op {i} reached with op {}'s deferred LayerNorm unapplied",
                d.consumer
            )));
        }
        i += p.op(i, &program.ops[i])?;
    }
    if p.deferred_ln.is_some() {
        return Err(BackendError::Other(
            "planner: a deferred LayerNorm has no op to apply it".into(),
        ));
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
        accum_bytes: p.fused_tmp.map_or(0, |(_, bytes)| bytes),
        pdl: p.limits.pdl,
        staged: Vec::new(),
        done_words: 0,
        poll_output: false,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::program::ProgramBuilder;

    const LIMITS: Limits = Limits::new(227 * 1024);
    /// The paths the kernels before the vectorised and fused ones took
    /// (tests of those keep checking them).
    const LEGACY: &str =
        "ln_vec,ew_vec,small,gemm_small,qkv_attn,ln_defer,ffn_splitk,attn_o,pdl,attn_s16";

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
        let plan = plan(&p, &w, DType::F16, false, LIMITS.with_disabled(LEGACY)).unwrap();
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
        let after_inputs =
            3 * align_up(1024 * 4, INT_INPUT_ALIGN) + align_up(33 * 4, INT_INPUT_ALIGN);
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
            after_inputs + align_up(tiles * TILE_ENTRY * 4, INT_INPUT_ALIGN)
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
        let plan2 =
            super::plan(&p2, &w2, DType::BF16, false, LIMITS.with_disabled(LEGACY)).unwrap();
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
        // Without the fused sublayers, MiniLM's widths go through cuBLASLt
        // even at 16 rows ...
        let (p, w) = tiny_bert(1, 16);
        let plan16 = plan(&p, &w, DType::F16, false, LIMITS.with_disabled(LEGACY)).unwrap();
        assert_eq!(plan16.matmul_count(), 4);
        assert_eq!(plan16.counters, 0);
        // ... a narrower encoder through the skinny kernel, fused with its LayerNorms.
        let (p, w) = bert_dims(1, 16, 64, 2, 256);
        let plan = plan(&p, &w, DType::F16, false, LIMITS.with_disabled(LEGACY)).unwrap();
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
        let l = LIMITS.with_disabled("skinny, tc_attention,unknown,small,gemm_small");
        assert!(!l.skinny && !l.tc_attention && !l.small_attn && !l.small_ffn && !l.gemm_small);
        assert!(l.ln_vec && l.ew_vec);
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
        let plan = plan(
            &p,
            &w,
            DType::F16,
            false,
            LIMITS.with_disabled("small,gemm_small"),
        )
        .unwrap();
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
        // At most 16 tokens: the 16-key-block kernel; longer sequences and
        // the switch keep the 64-key one (same grid and arguments).
        assert_eq!(att.0, "attention_tc_s16_f16_d32");
        assert_eq!(att.1, (1, 12, 2));
        assert_eq!(att.2, 0);
        let attention = |p: &Plan| {
            p.steps
                .iter()
                .find_map(|s| match s {
                    Step::Kernel { name, grid, .. } if name.starts_with("attention") => {
                        Some((name.clone(), *grid))
                    }
                    _ => None,
                })
                .unwrap()
        };
        let separate = LIMITS.with_disabled("small,gemm_small");
        let off = super::plan(
            &p,
            &w,
            DType::F16,
            false,
            separate.with_disabled("attn_s16"),
        )
        .unwrap();
        assert_eq!(attention(&off), ("attention_tc_f16_d32".into(), (1, 12, 2)));
        let (p17, w17) = tiny_bert(2, 17);
        let long = super::plan(&p17, &w17, DType::F16, false, separate).unwrap();
        assert_eq!(
            attention(&long),
            ("attention_tc_f16_d32".into(), (1, 12, 2))
        );
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
        let vec = include_str!("../../../kernels/vec.cu");
        assert!(vec.contains(&format!("#define LNV_WARPS {LNV_WARPS}\n")));
        assert!(vec.contains(&format!("#define LNV_J {LNV_J} ")));
        let sl = include_str!("../../../kernels/small_layer.cu");
        assert!(sl.contains(&format!("#define SL_THREADS {SL_THREADS}\n")));
        assert!(sl.contains("#define SL_WARPS (SL_THREADS / 32)\n") && SL_WARPS == 4);
        assert!(sl.contains(&format!("#define SL_MAXM {SL_MAXM}\n")));
        assert!(sl.contains(&format!("#define SL_FS {SL_FS} ")));
        assert!(sl.contains(&format!("#define SL_NG {SL_NG} ")));
        assert!(sl.contains(&format!("#define SL_LN_J {SL_LN_J} ")));
    }

    /// MiniLM's program, from the real builder ([`BertArch`]), with zero
    /// weights of its shapes: `layers` layers of hidden 384, 12 heads of 32,
    /// FFN 1536, exact GELU, mean pooling, normalised (a vocabulary of 1,000
    /// instead of 30,522, to keep the tests small).
    pub(crate) fn minilm(layers: usize) -> (crate::model::bert::BertArch, Weights) {
        use crate::model::bert::{BertArch, BertEmbeddings, BertLayer};
        let (h, inter) = (384, 1536);
        let mut w = Weights::new();
        fn t(w: &mut Weights, name: String, shape: Vec<usize>) -> WeightId {
            let n = shape.iter().product();
            w.push(name, shape, vec![0.0; n])
        }
        let embeddings = BertEmbeddings {
            word: t(&mut w, "word".into(), vec![1000, h]),
            position: t(&mut w, "pos".into(), vec![512, h]),
            token_type: t(&mut w, "tt".into(), vec![2, h]),
            norm_gamma: t(&mut w, "g".into(), vec![h]),
            norm_beta: t(&mut w, "b".into(), vec![h]),
        };
        let layers = (0..layers)
            .map(|l| BertLayer {
                qkv_weight: t(&mut w, format!("{l}.qkv"), vec![3 * h, h]),
                qkv_bias: t(&mut w, format!("{l}.qkv.b"), vec![3 * h]),
                attention_output_weight: t(&mut w, format!("{l}.o"), vec![h, h]),
                attention_output_bias: t(&mut w, format!("{l}.o.b"), vec![h]),
                attention_norm_gamma: t(&mut w, format!("{l}.ln1.g"), vec![h]),
                attention_norm_beta: t(&mut w, format!("{l}.ln1.b"), vec![h]),
                intermediate_weight: t(&mut w, format!("{l}.i"), vec![inter, h]),
                intermediate_bias: t(&mut w, format!("{l}.i.b"), vec![inter]),
                output_weight: t(&mut w, format!("{l}.o2"), vec![h, inter]),
                output_bias: t(&mut w, format!("{l}.o2.b"), vec![h]),
                output_norm_gamma: t(&mut w, format!("{l}.ln2.g"), vec![h]),
                output_norm_beta: t(&mut w, format!("{l}.ln2.b"), vec![h]),
            })
            .collect();
        let arch = BertArch {
            hidden: h,
            heads: 12,
            head_dim: 32,
            intermediate: inter,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-12,
            vocab_size: 1000,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            max_seq_len: 256,
            pooling: Pooling::Mean,
            normalize: true,
            embeddings,
            layers,
            family: crate::model::bert::Family::Bert,
            position_ids: Default::default(),
            position_bias: None,
            pool_skip: false,
            dense: Vec::new(),
            classifier: None,
        };
        (arch, w)
    }

    /// The staged steps of a plan whose embedding (step 0) and pooling
    /// (step `last`, its `out_rows` argument the count) address the slot.
    fn folded_ends(last: usize) -> Vec<StagedStep> {
        vec![
            StagedStep {
                step: 0,
                count: None,
            },
            StagedStep {
                step: last,
                count: Some((10, StagedCount::Rows)),
            },
        ]
    }

    /// Small graphs stage their inputs and output through their own first
    /// and last kernels: the embedding and the pooling where they can (no
    /// extra node), `stage_in` / `stage_out` where they cannot; large ones
    /// keep the copies. (Here with the block read from the slot and the
    /// completion event; the inline block and the done words are
    /// `small_plans_take_their_input_inline_and_signal_done`'s.)
    #[test]
    fn small_plans_stage_their_io_in_the_graph() {
        let (a, w) = minilm(6);
        let default = LIMITS.with_disabled(DEFAULT_DISABLED);
        let slot_io = LIMITS.with_disabled("inline_input,poll_done");
        let small = plan(&a.program(1, 16), &w, DType::F16, false, default).unwrap();
        assert!(small.fits_staged_io(), "{} bytes in", small.input_bytes);
        assert!(small.staged.is_empty());
        let staged = small.clone().with_staged_io(&slot_io);
        // Both ends folded: the same kernels, no node more.
        assert_eq!(staged.step_names(), small.step_names());
        let last = staged.steps.len() - 1;
        assert_eq!(staged.staged, folded_ends(last));
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        let ids = small.inputs[0].offset;
        let types = small.inputs[2].offset;
        assert_eq!(
            &args[..3],
            &[
                Arg::Ptr(Loc::StagedInput(ids)),
                Arg::Ptr(Loc::StagedInput(types)),
                Arg::Null
            ]
        );
        assert_eq!(
            &args[args.len() - 4..],
            &[
                Arg::Ptr(Loc::StagedInput(0)),
                Arg::Ptr(Loc::Input(0)),
                Arg::I32((small.input_bytes / 4) as i32),
                Arg::I32(0) // padded: the next kernel reads no input early
            ]
        );
        let Step::Kernel { args, .. } = &staged.steps[last] else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(args[2], Arg::Ptr(Loc::StagedOutput(0)));
        assert_eq!(args[10], Arg::I32(1));
        // Nothing else names the slot: the later kernels read the static
        // inputs the embedding copied.
        let names_slot = |p: &Plan| -> Vec<usize> {
            (0..p.steps.len())
                .filter(|&i| match &p.steps[i] {
                    Step::Kernel { args, .. } => args
                        .iter()
                        .any(|a| matches!(a, Arg::Ptr(Loc::StagedInput(_) | Loc::StagedOutput(_)))),
                    Step::Matmul { .. } => false,
                })
                .collect()
        };
        assert_eq!(names_slot(&staged), vec![0, last]);
        // The first step is a plain launch, the rest wait in pdl_wait.
        assert!(!staged.programmatic(0));
        assert!(staged.programmatic(1));

        // f32: the embedding folds, the pooling (no deferred LayerNorm) does
        // not: stage_out writes the output.
        let f32 = plan(&a.program(1, 16), &w, DType::F32, false, default).unwrap();
        assert!(f32.fits_staged_io());
        let staged = f32.clone().with_staged_io(&slot_io);
        let names = staged.step_names();
        assert_eq!(names.len(), f32.node_count() + 1);
        assert_eq!(names[0], "embed_ln_vec_f32");
        assert_eq!(names.last().map(String::as_str), Some("stage_out"));
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("stage_out is a kernel")
        };
        assert_eq!(
            args,
            &[
                Arg::Ptr(Loc::Output(0)),
                Arg::Ptr(Loc::StagedOutput(0)),
                Arg::I32(f32.output_elems as i32),
                Arg::Null
            ]
        );
        assert_eq!(staged.done_words, 0);
        assert_eq!(
            staged.staged[1],
            StagedStep {
                step: names.len() - 1,
                count: Some((2, StagedCount::Values))
            }
        );
        assert!(staged.programmatic(names.len() - 1));

        // Without the warp-per-row embedding, stage_in goes first.
        let no_vec = LIMITS.with_disabled(&format!("{DEFAULT_DISABLED},ln_vec"));
        let plain = plan(&a.program(1, 16), &w, DType::F16, false, no_vec).unwrap();
        let staged = plain.clone().with_staged_io(&slot_io);
        let names = staged.step_names();
        assert_eq!(names[0], "stage_in");
        assert_eq!(&names[1..], &plain.step_names()[..]);
        let Step::Kernel { args, grid, .. } = &staged.steps[0] else {
            panic!("stage_in is a kernel")
        };
        assert_eq!(
            args,
            &[
                Arg::Ptr(Loc::StagedInput(0)),
                Arg::Ptr(Loc::Input(0)),
                Arg::I32((plain.input_bytes / 4) as i32)
            ]
        );
        assert!(grid.0 >= 1);
        assert!(!staged.programmatic(0));
        assert!(staged.programmatic(1));

        // (128, 128): 192 KiB of inputs, 192 KiB of output: copies.
        let large = plan(&a.program(128, 128), &w, DType::F16, false, default).unwrap();
        assert!(!large.fits_staged_io());
        // The smallest packed budget (64 tokens, up to 64 sequences), where
        // a lone short text runs in the daemon, is staged at both ends; its
        // pooling writes as many rows as the batch has (64 at capture).
        let packed = plan(&a.packed_program(64, 64), &w, DType::F16, false, default).unwrap();
        assert!(
            packed.fits_staged_io(),
            "{} bytes in, {} floats out",
            packed.input_bytes,
            packed.output_elems
        );
        let staged = packed.clone().with_staged_io(&slot_io);
        assert_eq!(staged.step_names(), packed.step_names());
        let names = staged.step_names();
        assert!(names[0].starts_with("embed_ln_vec_"), "{names:?}");
        assert!(
            names[names.len() - 1].starts_with("pool_packed_ln_"),
            "{names:?}"
        );
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(
            (args[2], args[10]),
            (Arg::Ptr(Loc::StagedOutput(0)), Arg::I32(64))
        );
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(
            args[args.len() - 1],
            Arg::I32(1),
            "packed: the copy synchronised"
        );
        assert!(!LIMITS.with_disabled("staged_io").staged_io);
        // `stage_fold` off: stage_in and stage_out around the same kernels.
        assert!(!LIMITS.with_disabled("stage_fold").stage_fold);
        let names = small
            .clone()
            .with_staged_io(&slot_io.with_disabled("stage_fold"))
            .step_names();
        assert_eq!(names.len(), small.node_count() + 2);
        assert_eq!(
            (names[0].as_str(), names[names.len() - 1].as_str()),
            ("stage_in", "stage_out")
        );
    }

    /// By default a staged graph whose input block fits [`INLINE_WORDS`]
    /// takes it as its first kernel's parameter (ids, types and positions
    /// as word offsets into it), and the host polls its output; a larger
    /// block is read from the slot. With `poll_output` off the last kernel
    /// sets a done word per block after the output instead.
    #[test]
    fn small_plans_take_their_input_inline_and_signal_done() {
        let (a, w) = minilm(6);
        let polled = LIMITS.with_disabled(DEFAULT_DISABLED);
        assert!(polled.inline_input && polled.poll_output && !polled.embed_qkv);
        let small = plan(&a.program(1, 16), &w, DType::F16, false, polled).unwrap();
        let staged = small.clone().with_staged_io(&polled);
        assert!(staged.poll_output);
        assert_eq!(staged.done_words, 0);
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(args[11], Arg::Null, "no done word");

        let default = polled.with_disabled("poll_output");
        assert!(default.poll_done);
        let small = plan(&a.program(1, 16), &w, DType::F16, false, default).unwrap();
        assert_eq!(small.input_bytes, 3 * 16 * 4, "ids, mask, types");
        let staged = small.clone().with_staged_io(&default);
        assert_eq!(staged.steps.len(), small.steps.len());
        assert_eq!(staged.step_names()[0], "embed_ln_vec_inl_f16");
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        let word = |i: usize| Arg::I32((small.inputs[i].offset / 4) as i32);
        assert_eq!(args.len(), 20, "the kernel's parameters");
        assert_eq!(&args[..4], &[Arg::Inline, word(0), word(2), Arg::I32(-1)]);
        let Step::Kernel { args: planned, .. } = &small.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(&args[4..17], &planned[3..16], "tables, shape: unchanged");
        assert_eq!(
            &args[17..],
            &[Arg::Ptr(Loc::Input(0)), Arg::I32(48), Arg::I32(0)]
        );
        // No step reads the slot's input block; the pooling writes the
        // output, then its done word after it.
        assert!(staged.steps.iter().all(|s| match s {
            Step::Kernel { args, .. } => !args.contains(&Arg::Ptr(Loc::StagedInput(0))),
            Step::Matmul { .. } => true,
        }));
        let Some(Step::Kernel { args, grid, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(staged.done_offset(), 384 * 4);
        assert_eq!(args[2], Arg::Ptr(Loc::StagedOutput(0)));
        assert_eq!(args[11], Arg::Ptr(Loc::StagedOutput(384 * 4)));
        assert_eq!((staged.done_words, grid.0), (1, 1));
        assert_eq!(staged.staged, folded_ends(staged.steps.len() - 1));

        // (2, 32): 192 words, over INLINE_WORDS: read from the slot; still
        // a done word per block of the last kernel.
        let two = plan(&a.program(2, 32), &w, DType::F16, false, default).unwrap();
        assert_eq!(two.input_bytes / 4, 3 * 64);
        let staged = two.clone().with_staged_io(&default);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(args[16], Arg::Ptr(Loc::StagedInput(0)));
        let Some(Step::Kernel { grid, .. }) = staged.steps.last() else {
            panic!("the last step is a kernel")
        };
        assert_eq!(staged.done_words, grid.0 as usize);

        // Without the warp-per-row embedding: stage_in_inl takes the block.
        let no_vec = default.with_disabled("ln_vec");
        let plain = plan(&a.program(1, 16), &w, DType::F16, false, no_vec).unwrap();
        let staged = plain.clone().with_staged_io(&no_vec);
        let Step::Kernel { name, args, .. } = &staged.steps[0] else {
            panic!("stage_in_inl is a kernel")
        };
        assert_eq!(name, "stage_in_inl");
        assert_eq!(args, &[Arg::Inline, Arg::Ptr(Loc::Input(0)), Arg::I32(48)]);

        // f32 (pooling without the deferred LayerNorm): stage_out sets a
        // done word per block of its grid.
        let f32 = plan(&a.program(1, 16), &w, DType::F32, false, default).unwrap();
        let staged = f32.clone().with_staged_io(&default);
        let Some(Step::Kernel {
            name, args, grid, ..
        }) = staged.steps.last()
        else {
            panic!("stage_out is a kernel")
        };
        assert_eq!(name, "stage_out");
        assert_eq!(args[3], Arg::Ptr(Loc::StagedOutput(384 * 4)));
        assert_eq!(staged.done_words, grid.0 as usize);

        // The switches.
        let off = default.with_disabled("inline_input,poll_done");
        assert!(!off.inline_input && !off.poll_done);
        let staged = small.clone().with_staged_io(&off);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        assert_eq!((staged.done_words, staged.poll_output), (0, false));
    }

    /// With `embed_qkv` (off by default: measured slower) a padded staged
    /// graph's inline embedding and the QKV Linear after it are one
    /// `gemm_small_embed`, one node fewer; packed graphs and graphs without
    /// the inline block keep both.
    #[test]
    fn embedding_fuses_into_the_first_linear() {
        let (a, w) = minilm(6);
        assert!(!LIMITS.with_disabled(DEFAULT_DISABLED).embed_qkv);
        let default = LIMITS.with_disabled("small,qkv_attn,ffn_splitk,attn_o");
        assert!(default.embed_qkv);
        let small = plan(&a.program(1, 16), &w, DType::F16, false, default).unwrap();
        let apart = small
            .clone()
            .with_staged_io(&default.with_disabled("embed_qkv"));
        let fused = small.clone().with_staged_io(&default);
        assert_eq!(fused.steps.len() + 1, apart.steps.len());
        assert_eq!(fused.steps[1..], apart.steps[2..]);
        let (
            Step::Kernel { args: ea, .. },
            Step::Kernel {
                args: ga,
                grid: gg,
                block: gb,
                ..
            },
            Step::Kernel {
                name,
                args,
                grid,
                block,
                smem,
            },
        ) = (&apart.steps[0], &apart.steps[1], &fused.steps[0])
        else {
            panic!("kernels")
        };
        assert_eq!(name, "gemm_small_embed_f16");
        assert_eq!((grid, block, *smem), (gg, gb, 0));
        assert_eq!(
            (grid.0, ga[0]),
            (1152 / 16, ea[10]),
            "QKV reads the embedding"
        );
        assert_eq!(args.len(), 23, "the kernel's parameters");
        assert_eq!(
            &args[..4],
            &[Arg::Inline, ea[1], ea[2], Arg::I32(16)],
            "block, ids, types, seq"
        );
        assert_eq!(&args[4..7], &ea[4..7], "tables");
        assert_eq!(&args[7..12], &[ea[14], ea[15], ea[16], ea[17], ea[18]]);
        assert_eq!(&args[12..19], &ga[1..8], "w, bias, out, M, N, K, act");
        assert_eq!(&args[19..], &[ea[7], ea[8], ea[9], ea[10]], "LN, xout");
        assert_eq!(fused.staged[0].step, 0);
        assert_eq!(fused.staged[1].step, fused.steps.len() - 1);
        assert!(!fused.programmatic(0) && fused.programmatic(1));
        // bf16 too; not packed, not without the inline block.
        let bf = plan(&a.program(1, 16), &w, DType::BF16, false, default).unwrap();
        assert_eq!(
            bf.with_staged_io(&default).step_names()[0],
            "gemm_small_embed_bf16"
        );
        let packed = plan(&a.packed_program(64, 64), &w, DType::F16, false, default).unwrap();
        assert!(!packed.with_staged_io(&default).step_names()[0].starts_with("gemm_small_embed"));
        let slot = default.with_disabled("inline_input");
        assert_eq!(
            small.with_staged_io(&slot).step_names()[0],
            "embed_ln_vec_f16"
        );
    }

    /// The host's INLINE_WORDS is the kernels' (the parameter's size).
    #[test]
    fn inline_words_match_the_kernels() {
        let common = include_str!("../../../kernels/common.cuh");
        assert!(
            common.contains(&format!("#define INLINE_WORDS {INLINE_WORDS}\n")),
            "kernels/common.cuh defines another INLINE_WORDS"
        );
    }

    /// Step names: `first`, `layer` `layers` times, `last`.
    fn layers_between(first: &str, layers: usize, layer: &[&str], last: &str) -> Vec<String> {
        let mut names = vec![first.to_string()];
        for _ in 0..layers {
            names.extend(layer.iter().map(|s| s.to_string()));
        }
        names.push(last.to_string());
        names
    }

    /// The graphs the host-path targets are about (MiniLM, 6 layers): node
    /// counts before (the legacy kernels) and after the fusions.
    #[test]
    fn minilm_node_counts() {
        let (a, w) = minilm(6);
        let steps = |p: &Program, dtype: DType, limits: Limits| {
            p.validate(&w).unwrap();
            plan(p, &w, dtype, false, limits).unwrap()
        };
        let legacy = LIMITS.with_disabled(LEGACY);
        let default = LIMITS.with_disabled(DEFAULT_DISABLED);
        // Nodes: before the small-shape kernels, with the default switches
        // (gemm_small at <= 64 rows), with every path on (fused sublayers).
        let cases = [
            ("(1, 16)", a.program(1, 16), 50, 32, 14),
            ("(2, 32)", a.program(2, 32), 50, 50, 14),
            ("(32, 128)", a.program(32, 128), 50, 50, 50),
            ("(128, 128)", a.program(128, 128), 50, 50, 50),
            ("64t", a.packed_program(64, 64), 50, 32, 14),
            ("1024t", a.packed_program(1024, 256), 50, 50, 50),
            ("16384t", a.packed_program(16384, 256), 50, 50, 50),
            ("(1, 32)", a.program(1, 32), 50, 32, 14),
        ];
        for (what, p, before, by_default, all_on) in &cases {
            assert_eq!(
                steps(p, DType::F16, legacy).node_count(),
                *before,
                "{what} legacy"
            );
            for (limits, want) in [(default, by_default), (LIMITS, all_on)] {
                let now = steps(p, DType::F16, limits);
                assert_eq!(now.node_count(), *want, "{what}: {:?}", now.step_names());
                assert_eq!(now.node_count(), now.kernel_count() + now.matmul_count());
            }
        }
        // By default (1, 16) is, per layer, QKV, attention, O + add, FFN1 +
        // GELU (normalising its input), FFN2 + add: no cuBLASLt, no separate
        // LayerNorm; the next layer's QKV normalises FFN2's rows, and the
        // pooling the last FFN2's.
        let gs = steps(&cases[0].1, DType::F16, default);
        let gemm = "gemm_small_f16";
        let mut want = layers_between(
            "embed_ln_vec_f16",
            6,
            &[gemm, "attention_tc_s16_f16_d32", gemm, gemm, gemm],
            "pool_ln_f16",
        );
        assert_eq!(gs.step_names(), want);
        assert_eq!((gs.matmul_count(), gs.counters), (0, 12));
        assert_eq!(gs.accum_bytes, 16 * 384 * 4);
        // (grid, act, mode, normalises its x) of each gemm_small.
        let gs_modes = |p: &Plan, steps: std::ops::Range<usize>| -> Vec<(u32, Arg, Arg, bool)> {
            p.steps[steps]
                .iter()
                .filter_map(|s| match s {
                    Step::Kernel {
                        name, grid, args, ..
                    } if name.starts_with("gemm_small") => {
                        Some((grid.0, args[7], args[8], args[17] != Arg::Null))
                    }
                    _ => None,
                })
                .collect()
        };
        let gelu = Arg::I32(act_code(Activation::Gelu));
        let (none, pre_norm, last_ln) = (Arg::I32(0), Arg::I32(2), Arg::I32(1));
        assert_eq!(
            gs_modes(&gs, 1..6),
            vec![
                (1152 / 16, none, none, false),    // QKV of the embedding's LN
                (384 / 16, none, pre_norm, false), // O + residual, pre-norm
                (1536 / 16, gelu, none, true),     // LN, FFN1 + GELU
                (384 / 16, none, pre_norm, false), // FFN2 + residual, pre-norm
            ]
        );
        assert_eq!(gs_modes(&gs, 6..11)[0], (1152 / 16, none, none, true));
        assert_eq!(gs_modes(&gs, 26..31)[3], (384 / 16, none, pre_norm, false));
        let (Step::Kernel { args: ffn2, .. }, Step::Kernel { args: pool, .. }) =
            (&gs.steps[30], &gs.steps[31])
        else {
            panic!("kernels")
        };
        assert_eq!(pool[0], ffn2[10], "the pooling reads the pre-norm rows");
        assert_eq!(pool.len(), 7 + 3 + 2);
        assert_eq!(pool[11], Arg::Null, "done: set by with_staged_io");
        assert_eq!(pool[10], Arg::I32(1), "out_rows: the whole batch");
        // A deferred LayerNorm: the f32 scratch its producer wrote, its
        // gamma, beta and eps, and the buffer the consumer's block 0 fills.
        let (Step::Kernel { args: o, .. }, Step::Kernel { args: f1, .. }) =
            (&gs.steps[3], &gs.steps[4])
        else {
            panic!("kernels")
        };
        assert_eq!(f1[17], o[10]);
        assert!(matches!(f1[18], Arg::Ptr(Loc::Weight(_))));
        assert!(matches!(f1[20], Arg::F32(e) if e > 0.0));
        assert_eq!(f1[21], o[3], "the LayerNorm's output buffer");
        // Switched off: every add + LN in its own kernel's last block again.
        let apart = steps(&cases[0].1, DType::F16, default.with_disabled("ln_defer"));
        want[31] = "pool_f16".into();
        assert_eq!(apart.step_names(), want);
        assert_eq!(
            gs_modes(&apart, 26..31)[3],
            (384 / 16, none, last_ln, false)
        );
        assert!(gs_modes(&apart, 0..32)
            .iter()
            .all(|m| !m.3 && m.2 != pre_norm));
        // Every kernel after the first follows a kernel: all launch
        // programmatically; none with the switch off.
        assert!(!gs.programmatic(0) && (1..32).all(|i| gs.programmatic(i)));
        let no_pdl = steps(&cases[0].1, DType::F16, default.with_disabled("pdl"));
        assert!((0..32).all(|i| !no_pdl.programmatic(i)));
        // With qkv_attn on (and no deferred LayerNorms): the QKV and the
        // attention in one kernel a layer.
        let fused = steps(
            &cases[0].1,
            DType::F16,
            LIMITS.with_disabled("small,ln_defer"),
        );
        assert_eq!(fused.node_count(), 26);
        assert_eq!(fused.counters, 6 * 12 + 12);
        let (name, grid, block, _, args) = kernel(&fused, "qkv_attn_small");
        assert_eq!(
            (name, grid, block),
            ("qkv_attn_small_f16_d32", (72, 1, 1), 256)
        );
        assert_eq!(args[5], Arg::Ptr(Loc::Counter(0)));
        assert!(
            matches!(args[6], Arg::Ptr(Loc::Input(_))),
            "the mask: {:?}",
            args[6]
        );
        assert_eq!(
            args[7..],
            [
                Arg::Null,
                Arg::I32(0),
                Arg::I32(16),
                Arg::I32(16),
                Arg::I32(384),
                Arg::F32(1.0 / 32f32.sqrt()),
            ]
        );
        // It does not apply a deferred LayerNorm: with both on, only the
        // first layer's QKV (after the embedding) fuses.
        let mixed = steps(
            &cases[0].1,
            DType::F16,
            LIMITS.with_disabled("small,ffn_splitk,attn_o"),
        );
        let names = mixed.step_names();
        assert_eq!(mixed.node_count(), 31, "{names:?}");
        assert_eq!(names[1], "qkv_attn_small_f16_d32");
        assert_eq!(
            names.iter().filter(|n| n.starts_with("qkv_attn")).count(),
            1
        );
        let p64 = steps(
            &cases[4].1,
            DType::F16,
            LIMITS.with_disabled("small,ln_defer"),
        );
        assert!(p64.steps.iter().all(|s| match s {
            Step::Kernel { name, args, .. } if name.starts_with("qkv_attn_small") =>
                args[6] == Arg::Null && matches!(args[7], Arg::Ptr(_)) && args[8] == Arg::I32(64),
            _ => true,
        }));
        // Its attention runs in the QKV kernels: no tile table to copy.
        assert!(p64.tile_tables.is_empty());
        // With cuBLASLt, only the kernels after kernels.
        let big = steps(&cases[3].1, DType::F16, default);
        let after_kernel: Vec<usize> = (0..50).filter(|&i| big.programmatic(i)).collect();
        // per layer: add_ln after mm, bias_act after mm, add_ln after mm:
        // none; attention after mm: none; the pooling after the last LN.
        assert_eq!(after_kernel, vec![49], "{:?}", big.step_names());
        // The packed 64-token budget computes its live rows only.
        let p64 = steps(&cases[4].1, DType::F16, default);
        assert!(p64.steps.iter().all(|s| match s {
            Step::Kernel { name, args, .. } if name.starts_with("gemm_small") =>
                matches!(args[15], Arg::Ptr(_)) && args[16] == Arg::I32(64),
            _ => true,
        }));
        assert!(gs.steps.iter().all(|s| match s {
            Step::Kernel { name, args, .. } if name.starts_with("gemm_small") =>
                args[15] == Arg::Null,
            _ => true,
        }));
        // (1, 16): the embedding, two fused kernels per layer, the pooling.
        let small = steps(&cases[0].1, DType::F16, LIMITS);
        let mut want = vec!["embed_ln_vec_f16".to_string()];
        for _ in 0..6 {
            want.push("layer_attn_small_f16_d32".into());
            want.push("layer_ffn_small_f16".into());
        }
        want.push("pool_f16".into());
        assert_eq!(small.step_names(), want);
        assert_eq!(small.counters, 12);
        assert_eq!(small.accum_bytes, 16 * 384 * 4);
        assert_eq!(small.matmul_count(), 0);
        // The packed 64-token budget: the same kernels; no tile table to copy.
        let p64 = steps(&cases[4].1, DType::F16, LIMITS);
        want[13] = "pool_packed_f16".into();
        assert_eq!(p64.step_names(), want);
        assert!(p64.tile_tables.is_empty());
        assert_eq!(p64.accum_bytes, 64 * 384 * 4);
        // (128, 128): cuBLASLt, with the vectorised LayerNorms and GELU.
        let big = steps(&cases[3].1, DType::F16, LIMITS);
        let layer: Vec<&str> = vec![
            "mm",
            "attention_tc_f16_d32",
            "mm",
            "add_ln_vec_f16",
            "mm",
            "bias_act_vec_f16",
            "mm",
            "add_ln_vec_f16",
        ];
        let names = big.step_names();
        assert_eq!(names[0], "embed_ln_vec_f16");
        assert_eq!(&names[1..9], &layer[..]);
        assert_eq!(names[49], "pool_f16");
        assert_eq!((big.counters, big.accum_bytes), (0, 0));
        let packed = steps(&cases[6].1, DType::F16, LIMITS).step_names();
        assert_eq!(packed[2], "attention_varlen_tc_f16_d32");
        assert_eq!(packed[6], "bias_act_vec_f16");
        // f32 keeps its matmuls (the fused sublayers are f16/bf16 only).
        let f32 = steps(&cases[0].1, DType::F32, LIMITS);
        assert_eq!((f32.node_count(), f32.matmul_count()), (50, 24));
        assert!(f32.step_names().contains(&"add_ln_vec_f32".to_string()));
        // bf16 fuses as f16 does.
        let bf = steps(&cases[0].1, DType::BF16, LIMITS);
        assert_eq!(bf.node_count(), 14);
        assert_eq!(bf.step_names()[1], "layer_attn_small_bf16_d32");
    }

    #[test]
    fn fused_sublayer_arguments() {
        let (a, w) = minilm(1);
        // Padded (2, 16): 32 rows, the mask, no offsets.
        let p = a.program(2, 16);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        let h = Loc::Arena(0);
        let (_, grid, block, smem, args) = kernel(&plan, "layer_attn_small");
        assert_eq!((grid, block), ((12, 1, 1), SL_THREADS));
        assert_eq!(smem as usize, small_attn_smem(32, 384, 32));
        assert_eq!(args.len(), 19);
        assert_eq!(args[0], Arg::Ptr(h)); // x: the hidden state ...
        assert_eq!(args[8], Arg::Ptr(h)); // ... normalised in place
                                          // The context (phase 1 → phase 2) is an activation of the program;
                                          // the f32 accumulator lies past every activation.
        let Arg::Ptr(Loc::Arena(ctx)) = args[9] else {
            panic!("ctx {:?}", args[9])
        };
        assert!(ctx != 0 && ctx + 32 * 384 * 2 <= plan.activation_bytes);
        let accum = args[10];
        let Arg::Ptr(Loc::Arena(acc)) = accum else {
            panic!("accumulator {accum:?}")
        };
        assert_eq!(plan.accum_bytes, 32 * 384 * 4);
        assert!(acc >= plan.activation_bytes && acc + plan.accum_bytes <= plan.arena_bytes);
        assert_eq!(args[11], Arg::Ptr(Loc::Counter(0)));
        let mask = plan.inputs[1].offset;
        assert_eq!(plan.inputs[1].role, InputRole::AttentionMask);
        assert_eq!(
            &args[12..],
            &[
                Arg::Ptr(Loc::Input(mask)),
                Arg::Null,
                Arg::I32(0),
                Arg::I32(16),
                Arg::I32(32),
                Arg::I32(384),
                Arg::F32(1.0 / (32f32).sqrt()),
            ]
        );
        let (_, grid, block, smem, args) = kernel(&plan, "layer_ffn_small");
        assert_eq!((grid, block), ((1536 / 32, 1, 1), SL_THREADS));
        assert_eq!(smem as usize, small_ffn_smem(32, 384));
        assert_eq!(args.len(), 18);
        assert_eq!(args[3], Arg::I32(act_code(Activation::Gelu)));
        assert_eq!((args[0], args[9]), (Arg::Ptr(h), Arg::Ptr(h)));
        // The intermediate activation; the one accumulator of both sublayers.
        assert!(matches!(args[10], Arg::Ptr(Loc::Arena(o)) if o != 0 && o < plan.activation_bytes));
        assert_eq!(args[11], accum);
        assert_eq!(args[12], Arg::Ptr(Loc::Counter(1)));
        assert_eq!(
            &args[13..],
            &[
                Arg::Null,
                Arg::I32(0),
                Arg::I32(32),
                Arg::I32(384),
                Arg::I32(1536)
            ]
        );
        // Packed 64 tokens: no mask; the offsets and the most sequences.
        let p = a.packed_program(64, 8);
        let plan = super::plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        let offsets = plan.inputs[3].offset;
        assert_eq!(plan.inputs[3].role, InputRole::SeqOffsets);
        let args = kernel(&plan, "layer_attn_small").4;
        assert_eq!(
            &args[12..17],
            &[
                Arg::Null,
                Arg::Ptr(Loc::Input(offsets)),
                Arg::I32(8),
                Arg::I32(1),
                Arg::I32(64),
            ]
        );
        let args = kernel(&plan, "layer_ffn_small").4;
        assert_eq!(
            &args[13..16],
            &[Arg::Ptr(Loc::Input(offsets)), Arg::I32(8), Arg::I32(64)]
        );
        // Shared memory fits the default 48 KiB at 16 rows, not at 64.
        assert!(small_attn_smem(16, 384, 32) <= 48 << 10);
        assert!(small_attn_smem(64, 384, 32) > 48 << 10);
        assert!(small_attn_smem(64, 384, 32) <= 227 << 10);
    }

    /// What the fused sublayers do not take falls back to the separate ops,
    /// sublayer by sublayer.
    #[test]
    fn fused_sublayers_refuse_what_they_cannot_run() {
        let fused = |p: &Program, w: &Weights, t: DType, l: Limits| {
            let plan = plan(p, w, t, false, l).unwrap();
            let n = |k: &str| {
                plan.step_names()
                    .iter()
                    .filter(|s| s.starts_with(k))
                    .count()
            };
            (n("layer_attn_small"), n("layer_ffn_small"))
        };
        let (a, w) = minilm(2);
        assert_eq!(fused(&a.program(1, 64), &w, DType::F16, LIMITS), (2, 2));
        // More than SL_MAXM rows.
        assert_eq!(fused(&a.program(5, 13), &w, DType::F16, LIMITS), (0, 0));
        assert_eq!(
            fused(&a.packed_program(128, 8), &w, DType::F16, LIMITS),
            (0, 0)
        );
        // f32.
        assert_eq!(fused(&a.program(1, 16), &w, DType::F32, LIMITS), (0, 0));
        // Switched off one at a time.
        let off = |s| LIMITS.with_disabled(s);
        assert_eq!(
            fused(&a.program(1, 16), &w, DType::F16, off("small_attn")),
            (0, 2)
        );
        assert_eq!(
            fused(&a.program(1, 16), &w, DType::F16, off("small_ffn")),
            (2, 0)
        );
        assert_eq!(
            fused(&a.program(1, 16), &w, DType::F16, off("small")),
            (0, 0)
        );
        // Too little shared memory for the attention sublayer (46.5 KiB at 16 rows).
        assert_eq!(
            fused(&a.program(1, 16), &w, DType::F16, Limits::new(40 << 10)),
            (0, 2)
        );
        // Head size 48 (no fused attention kernel), hidden 384: the FFN still fuses.
        let (p, w) = bert_dims(1, 16, 384, 8, 1536);
        assert_eq!(fused(&p, &w, DType::F16, LIMITS), (0, 1));
        // Hidden 320 (not a multiple of 128): neither.
        let (p, w) = bert_dims(1, 16, 320, 10, 1280);
        assert_eq!(fused(&p, &w, DType::F16, LIMITS), (0, 0));
        // Head size 64 and 128 fuse.
        let (p, w) = bert_dims(2, 16, 256, 4, 512);
        assert_eq!(fused(&p, &w, DType::BF16, LIMITS), (1, 1));
        let (p, w) = bert_dims(1, 16, 256, 2, 1024);
        let plan = plan(&p, &w, DType::F16, false, LIMITS).unwrap();
        assert_eq!(kernel(&plan, "layer_attn").0, "layer_attn_small_f16_d128");
        // An intermediate size that is not a multiple of SL_FS.
        let (p, w) = bert_dims(1, 16, 384, 12, 1000);
        assert_eq!(fused(&p, &w, DType::F16, LIMITS), (1, 0));
        // A projection that a later op reads (here: the pooling reads the
        // attention's context buffer) must be materialised: no fusion.
        let (mut p, w) = tiny_bert(1, 16);
        let ctx = BufId(5);
        assert_eq!(p.buffer(ctx).name, "ctx");
        if let Some(Op::Pool { x, .. }) = p.ops.last_mut() {
            *x = ctx;
        }
        p.validate(&w).unwrap();
        assert_eq!(fused(&p, &w, DType::F16, LIMITS), (0, 1));
    }

    /// `ffn_small`: the feed-forward block in one kernel per layer, its
    /// accumulators in rotation, its LayerNorm left to the next Linear.
    #[test]
    fn ffn_small_plans() {
        let on = LIMITS.with_disabled("small,qkv_attn,attn_o");
        assert!(on.ffn_splitk && !LIMITS.with_disabled(DEFAULT_DISABLED).ffn_splitk);
        let ffns = |p: &Plan| -> Vec<Vec<Arg>> {
            p.steps
                .iter()
                .filter_map(|s| match s {
                    Step::Kernel { name, args, .. } if name.starts_with("ffn_small") => {
                        Some(args.clone())
                    }
                    _ => None,
                })
                .collect()
        };
        let acc = |j| Arg::Ptr(Loc::Accum(j));
        let (a, w) = minilm(6);
        let p = plan(&a.program(1, 16), &w, DType::F16, false, on).unwrap();
        // Per layer QKV, attention, O + add (pre-norm), the FFN: 26 nodes.
        let gemm = "gemm_small_f16";
        let want = layers_between(
            "embed_ln_vec_f16",
            6,
            &[gemm, "attention_tc_s16_f16_d32", gemm, "ffn_small_f16"],
            "pool_ln_f16",
        );
        assert_eq!(p.step_names(), want);
        let (name, grid, block, smem, args) = kernel(&p, "ffn_small");
        assert_eq!(
            (name, grid, block, smem),
            ("ffn_small_f16", (96, 1, 1), 256, 0)
        );
        // x (the O Linear's LayerNorm, which this kernel applies: block 0
        // writes it, and adds it as the residual), W1, b1, GELU, W2, b2.
        assert_eq!(args[0], args[6]);
        assert_eq!(args[3], Arg::I32(act_code(Activation::Gelu)));
        assert!([1, 2, 4, 5]
            .iter()
            .all(|&i| matches!(args[i], Arg::Ptr(Loc::Weight(_)))));
        assert_eq!(
            args[9..16],
            [
                Arg::I32(16 * 384),
                Arg::I32(16),
                Arg::I32(1536),
                Arg::I32(384),
                Arg::I32(384),
                Arg::Null,
                Arg::I32(0),
            ]
        );
        let Step::Kernel { args: o, .. } = &p.steps[3] else {
            panic!("the O Linear")
        };
        assert_eq!(
            (o[8], args[16]),
            (Arg::I32(2), o[10]),
            "x = LN(O's pre-norm rows)"
        );
        assert_eq!((args.len(), args[20]), (21, args[0]), "block 0 writes x");
        // The accumulators: 0, 1, 0, 1, … each zeroing the next one's, the
        // last zeroing the first's; the next QKV (and the pooling) reads it.
        let f = ffns(&p);
        assert_eq!(
            f.iter().map(|a| (a[7], a[8])).collect::<Vec<_>>(),
            [(0, 1), (1, 0), (0, 1), (1, 0), (0, 1), (1, 0)].map(|(x, z)| (acc(x), acc(z)))
        );
        for layer in 1..6 {
            let Step::Kernel { name, args: q, .. } = &p.steps[1 + 4 * layer] else {
                panic!("QKV")
            };
            assert_eq!((name.as_str(), q[17]), ("gemm_small_f16", f[layer - 1][7]));
        }
        let Step::Kernel { args: pool, .. } = &p.steps[25] else {
            panic!("pool")
        };
        assert_eq!(pool[0], acc(1));
        // An odd count: the last takes accumulator 2, so that 0 ends zero.
        let (a3, w3) = minilm(3);
        let p3 = plan(&a3.program(1, 16), &w3, DType::F16, false, on).unwrap();
        assert_eq!(
            ffns(&p3).iter().map(|a| (a[7], a[8])).collect::<Vec<_>>(),
            [(0, 1), (1, 2), (2, 0)].map(|(x, z)| (acc(x), acc(z)))
        );
        // One alone cannot: planned as two Linears.
        let (a1, w1) = minilm(1);
        let p1 = plan(&a1.program(1, 16), &w1, DType::F16, false, on).unwrap();
        assert!(ffns(&p1).is_empty());
        assert_eq!(p1.node_count(), 7, "{:?}", p1.step_names());
        // Packed 64t: its live rows, and 64 rows of accumulator zeroed.
        let pk = plan(&a.packed_program(64, 64), &w, DType::BF16, false, on).unwrap();
        let f = ffns(&pk);
        assert_eq!(f.len(), 6);
        assert!(f.iter().all(|a| a[9] == Arg::I32(64 * 384)
            && a[10] == Arg::I32(64)
            && matches!(a[14], Arg::Ptr(Loc::Input(_)))
            && a[15] == Arg::I32(64)));
        assert_eq!(kernel(&pk, "ffn_small").0, "ffn_small_bf16");
        // Not in f32, nor without gemm_small, the deferred LayerNorm or the
        // switch, nor at rows gemm_small does not take.
        for (dtype, limits, program) in [
            (DType::F32, on, a.program(1, 16)),
            (DType::F16, on.with_disabled("ln_defer"), a.program(1, 16)),
            (DType::F16, on.with_disabled("gemm_small"), a.program(1, 16)),
            (DType::F16, on.with_disabled("ffn_splitk"), a.program(1, 16)),
            (DType::F16, on, a.program(4, 16)),
        ] {
            let p = plan(&program, &w, dtype, false, limits).unwrap();
            assert!(ffns(&p).is_empty(), "{dtype:?} {:?}", limits.disabled());
        }
    }

    #[test]
    fn attn_o_plans() {
        let on = LIMITS.with_disabled("small,qkv_attn,ffn_splitk");
        assert!(on.attn_o && !LIMITS.with_disabled(DEFAULT_DISABLED).attn_o);
        let (a, w) = minilm(6);
        let p = plan(&a.program(1, 16), &w, DType::F16, false, on).unwrap();
        // Per layer QKV, attention + O (pre-norm), FFN1, FFN2: 26 nodes.
        let gemm = "gemm_small_f16";
        let want = layers_between(
            "embed_ln_vec_f16",
            6,
            &[gemm, "attn_o_small_f16_d32", gemm, gemm],
            "pool_ln_f16",
        );
        assert_eq!(p.step_names(), want);
        let (name, grid, block, smem, args) = kernel(&p, "attn_o_small");
        // O's 24 blocks; 16 rows of q, k, v (3 × 384 + 8 f16), the mask.
        assert_eq!(
            (name, grid, block, smem),
            (
                "attn_o_small_f16_d32",
                (24, 1, 1),
                256,
                16 * 1160 * 2 + 17 * 4
            )
        );
        let Step::Kernel { args: qkv, .. } = &p.steps[1] else {
            panic!("QKV")
        };
        // x = the QKV Linear's output; gemm_small's arguments with mode 2
        // (the FFN1 normalises), then the mask, seq, heads and scale.
        assert_eq!(args[0], qkv[3]);
        assert_eq!(args[4..9], [16, 384, 384, 0, 2].map(Arg::I32));
        assert_eq!(args[15..17], [Arg::Null, Arg::I32(0)]);
        assert!(matches!(args[17], Arg::Ptr(Loc::Input(_))), "the mask");
        assert_eq!(
            args[18..],
            [Arg::I32(16), Arg::I32(12), Arg::F32(1.0 / 32f32.sqrt())]
        );
        let Step::Kernel { args: ffn1, .. } = &p.steps[3] else {
            panic!("FFN1")
        };
        assert_eq!(ffn1[17], args[10], "FFN1 normalises O's pre-norm rows");
        // Packed 64t (bf16): 64 rows of q, k, v and 65 offsets.
        let pk = plan(&a.packed_program(64, 64), &w, DType::BF16, false, on).unwrap();
        let (name, _, _, smem, args) = kernel(&pk, "attn_o_small");
        assert_eq!(
            (name, smem),
            ("attn_o_small_bf16_d32", 64 * 1160 * 2 + (64 + 65) * 4)
        );
        assert!(matches!(args[15], Arg::Ptr(Loc::Input(_))), "offsets");
        assert_eq!(
            [args[16], args[17], args[18]],
            [Arg::I32(64), Arg::Null, Arg::I32(0)]
        );
        assert_eq!(pk.node_count(), 26, "{:?}", pk.step_names());
        // Not in f32, nor without gemm_small or the switch, nor at rows
        // gemm_small does not take.
        for (dtype, limits, program) in [
            (DType::F32, on, a.program(1, 16)),
            (DType::F16, on.with_disabled("gemm_small"), a.program(1, 16)),
            (DType::F16, on.with_disabled("attn_o"), a.program(1, 16)),
            (DType::F16, on, a.program(4, 16)),
        ] {
            let p = plan(&program, &w, dtype, false, limits).unwrap();
            assert!(
                !p.step_names().iter().any(|n| n.starts_with("attn_o")),
                "{dtype:?} {:?}",
                limits.disabled()
            );
        }
    }

    #[test]
    fn every_switch_turns_off_its_path() {
        let all = LIMITS.with_disabled("all");
        assert_eq!(all.disabled(), DISABLE_SWITCHES.to_vec());
        assert_eq!(all.max_dyn_smem, LIMITS.max_dyn_smem);
        assert!(LIMITS.disabled().is_empty());
        for name in DISABLE_SWITCHES {
            let l = LIMITS.with_disabled(&format!(" {name} "));
            assert_eq!(l.disabled(), vec![*name], "{name}");
        }
        assert_eq!(
            Limits::unknown_switches("ln_vec, nope,,small,fused"),
            vec!["nope"]
        );
        let fused = LIMITS.with_disabled("fused");
        assert_eq!(
            fused.disabled(),
            vec![
                "ln_vec",
                "ew_vec",
                "small_attn",
                "small_ffn",
                "gemm_small",
                "qkv_attn",
                "ln_defer",
                "ffn_splitk",
                "attn_o",
                "pdl",
                "attn_s16"
            ]
        );
        assert_eq!(fused, LIMITS.with_disabled(LEGACY));
        // With everything off, MiniLM (1, 16) plans the kernels of before.
        let (a, w) = minilm(1);
        let plan = plan(&a.program(1, 16), &w, DType::F16, false, all).unwrap();
        assert_eq!(
            plan.step_names(),
            vec![
                "embed_ln_f16",
                "mm",
                "attention_f16_d32",
                "mm",
                "add_ln_f16",
                "mm",
                "bias_act_f16_f16",
                "mm",
                "add_ln_f16",
                "pool_f16"
            ]
        );
    }

    #[test]
    fn vectorised_kernel_arguments() {
        let (a, w) = minilm(1);
        let plan = plan(&a.program(128, 128), &w, DType::F16, false, LIMITS).unwrap();
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
        let plan = super::plan(&a.packed_program(1024, 32), &w, DType::F16, false, LIMITS).unwrap();
        let args = kernel(&plan, "embed_ln_vec_f16").4;
        assert_eq!(args[2], Arg::Ptr(Loc::Input(plan.inputs[2].offset)));
        assert_eq!(plan.inputs[2].role, InputRole::Positions);
        assert_eq!(args[10], Arg::I32(1024));
        // Rows too wide for the vectorised LayerNorm keep the old kernels.
        assert!(ln_vec_fits(1024) && !ln_vec_fits(1028) && !ln_vec_fits(382));
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

    /// small_layer.cu's `sl_mma32` (two k-steps from 16-byte lane vectors,
    /// k permuted alike in A and B), modelled on the host: it adds exactly
    /// A·Wᵀ, every product once, into the C fragment `sl_store_partials`
    /// reads (lane 4g + t: rows g and g + 8, columns 2t, 2t + 1).
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

    /// The shared-memory layout of the fused sublayers: rows padded so that
    /// the 8 lanes of a 16-byte access phase (rows g, g + 1, 16 bytes at
    /// 16·t) hit distinct banks, and every region 16-byte aligned.
    #[test]
    fn fused_shared_memory_layout() {
        for cols in (32..=1024).step_by(32) {
            let ld = sl_ld(cols);
            assert_eq!((2 * ld) % 128, 64, "{cols}");
            let mut groups: Vec<usize> = (0..2)
                .flat_map(|g| (0..4).map(move |t| ((g * 2 * ld + 16 * t) / 16) % 8))
                .collect();
            groups.sort();
            groups.dedup();
            assert_eq!(groups.len(), 8, "{cols}");
        }
        for m in 1..=SL_MAXM {
            let mp = align_up(m, 16);
            for (hidden, hd) in [(384, 32), (768, 64), (1024, 128), (256, 32)] {
                let parts = [
                    mp * sl_ld(hidden) * 2,
                    SL_WARPS * 16 * SL_NG * 8 * 4,
                    mp * (hd + 1) * 4,
                    mp * (hd + 1) * 4,
                    mp * (hd + 1) * 4,
                    mp * (mp + 1) * 4,
                ];
                // xs holds 16-byte rows, red float2 partials: 16-byte
                // aligned; q, k, v and the scores are f32, the rest i32.
                assert!(parts[..2].iter().all(|p| p % 16 == 0), "{m} {hidden} {hd}");
                assert!(parts.iter().all(|p| p % 4 == 0), "{m} {hidden} {hd}");
                assert_eq!(
                    parts.iter().sum::<usize>() + 3 * mp * 4,
                    small_attn_smem(m, hidden, hd)
                );
            }
            assert_eq!(
                small_ffn_smem(m, 384),
                mp * sl_ld(384) * 2 + SL_WARPS * 16 * SL_FS * 4
            );
        }
        // SL_MAXM rows of MiniLM fit an H100/H200 SM (227 KiB); of hidden
        // 1024 with heads of 128 they do not (the planner then keeps the
        // separate ops, see fused_sublayers_refuse_what_they_cannot_run),
        // 32 rows do.
        assert!(small_attn_smem(SL_MAXM, 384, 32) <= 227 << 10);
        assert!(small_attn_smem(SL_MAXM, 1024, 128) > 227 << 10);
        assert!(small_attn_smem(32, 1024, 128) <= 227 << 10);
    }

    /// Issue 13's test folders (tests/data/models), loaded as the daemon
    /// loads them.
    const FAMILY_FOLDERS: [&str; 8] = [
        "bert-st-new",
        "bert-st-old",
        "xlmr-st",
        "mpnet-st",
        "bert-cross-encoder",
        "bert-cross-encoder-legacy",
        "bert-cross-encoder-v4",
        "xlmr-cross-encoder",
    ];

    fn family_model(name: &str) -> crate::model::Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/models")
            .join(name);
        let spec = crate::model::ModelSpec {
            name: name.into(),
            kind: crate::model::ModelKind::Bert,
            path: dir,
            dtype: DType::F32,
            max_seq_len: None,
            activation: None,
            pooling: None,
            normalize: None,
        };
        crate::model::Model::load(&spec).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// The programs the daemon captures for a folder: padded buckets up to
    /// its longest sequence and packed budgets (few tokens, where the fused
    /// sublayers apply, and many).
    fn family_programs(model: &crate::model::Model) -> Vec<(String, Program)> {
        let crate::model::Architecture::Bert(arch) = &model.arch else {
            panic!("not a BERT-family model")
        };
        let max = arch.max_seq_len;
        let mut v = Vec::new();
        for (b, sq) in [(1, 16), (4, 64), (32, 128), (2, max)] {
            let sq = sq.min(max);
            v.push((format!("({b}, {sq})"), model.program(b, sq)));
        }
        for (tokens, seqs) in [(16, 1), (64, 4), (1024, 32)] {
            v.push((
                format!("{tokens}t/{seqs}"),
                arch.packed_program(tokens, seqs),
            ));
        }
        v
    }

    /// Every family folder plans for f32/f16/bf16, padded and packed, with
    /// the fused small-shape kernels and without, onto kernels the module
    /// has; each family's own ops become their own kernels.
    #[test]
    fn family_folders_plan_in_every_dtype_and_layout() {
        let entries: std::collections::HashSet<String> =
            super::super::kernels::expected_entry_points()
                .into_iter()
                .collect();
        for name in FAMILY_FOLDERS {
            let model = family_model(name);
            for (label, program) in family_programs(&model) {
                program
                    .validate(&model.weights)
                    .unwrap_or_else(|e| panic!("{name} {label}: {e}"));
                for op in &program.ops {
                    assert_eq!(not_on_cuda(op), None, "{name} {label}");
                }
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    for limits in [
                        LIMITS,
                        LIMITS.with_disabled("fused"),
                        LIMITS.with_disabled("tc_attention"),
                    ] {
                        let plan = plan(&program, &model.weights, dtype, false, limits)
                            .unwrap_or_else(|e| panic!("{name} {label} {dtype}: {e}"));
                        let steps = names(&plan);
                        for s in &steps {
                            assert!(
                                s == "mm" || entries.contains(s),
                                "{name} {label} {dtype}: no kernel {s}"
                            );
                        }
                        let has = |prefix: &str| steps.iter().any(|s| s.starts_with(prefix));
                        let packed = program.is_packed();
                        let roberta = name.starts_with("xlmr") || name.starts_with("mpnet");
                        assert_eq!(
                            has(if packed {
                                "embed_ln_packed_padpos_"
                            } else {
                                "embed_ln_padpos_"
                            }),
                            roberta,
                            "{name} {label} {dtype}: {steps:?}"
                        );
                        let biased = steps.iter().filter(|s| s.contains("_bias_")).count();
                        let fused_biased = steps
                            .iter()
                            .filter(|s| s.starts_with("layer_attn_small_bias_"))
                            .count();
                        let layers = match &model.arch {
                            crate::model::Architecture::Bert(a) => a.layers.len(),
                            _ => unreachable!(),
                        };
                        if name == "mpnet-st" {
                            // Every layer's attention, fused or not, has the bias.
                            assert_eq!(biased, layers, "{name} {label} {dtype}: {steps:?}");
                            assert_eq!(
                                has("layer_attn_small_"),
                                fused_biased > 0,
                                "{name} {label}: {steps:?}"
                            );
                        } else {
                            assert_eq!(biased, 0, "{name} {label} {dtype}: {steps:?}");
                        }
                        if name == "bert-st-new" {
                            let pool = if packed {
                                "pool_packed_skip_"
                            } else {
                                "pool_skip_"
                            };
                            assert!(has(pool), "{name} {label}: {steps:?}");
                            // Normalize after the Dense, on the f32 output.
                            assert_eq!(steps.last().unwrap(), "l2norm_rows_f32", "{name} {label}");
                        } else {
                            assert!(!has("pool_skip") && !has("pool_packed_skip"));
                            assert!(!has("l2norm_rows"), "{name} {label}: {steps:?}");
                        }
                    }
                }
            }
        }
    }

    /// The family kernels' arguments: the position-bias table and radius
    /// after the attention's own, the pad id after the embedding's, the
    /// skip input after the pooling mask or offsets, the row width of the
    /// normalisation.
    #[test]
    fn family_kernel_arguments() {
        let mpnet = family_model("mpnet-st");
        let crate::model::Architecture::Bert(arch) = &mpnet.arch else {
            unreachable!()
        };
        let bias = arch.position_bias.expect("MPNet has a position bias");
        let heads = arch.heads as i32;
        for dtype in [DType::F32, DType::F16] {
            let ts = suffix(dtype);
            let p = mpnet.program(2, 64);
            let plan_ = plan(&p, &mpnet.weights, dtype, false, LIMITS).unwrap();
            // Head size 8: the CUDA-core kernels in every dtype.
            let (name, grid, _, _, args) = kernel(&plan_, "attention_bias_");
            assert_eq!(name, format!("attention_bias_{ts}_d32"));
            assert_eq!((grid.1, grid.2), (heads as u32, 2), "{name}");
            let n = args.len();
            assert_eq!(
                args[n - 2..],
                [
                    Arg::Ptr(Loc::Weight(bias.table)),
                    Arg::I32(bias.radius as i32)
                ],
                "{name}"
            );
            let (_, grid, _, _, args) = kernel(&plan_, "embed_ln_padpos_");
            assert_eq!(grid.0, 128);
            assert_eq!(args.len(), 15);
            assert_eq!(args[14], Arg::I32(1), "XLM-R / MPNet pad id");
            let pk = arch.packed_program(256, 8);
            let plan_ = plan(&pk, &mpnet.weights, dtype, false, LIMITS).unwrap();
            let (name, _, _, _, args) = kernel(&plan_, "attention_varlen_bias_");
            let n = args.len();
            assert_eq!(
                args[n - 2..],
                [
                    Arg::Ptr(Loc::Weight(bias.table)),
                    Arg::I32(bias.radius as i32)
                ],
                "{name}"
            );
            let (_, grid, _, _, args) = kernel(&plan_, "embed_ln_packed_padpos_");
            assert_eq!((grid.0, args.len(), args[14]), (256, 15, Arg::I32(1)));
        }
        let st = family_model("bert-st-new");
        let p = st.program(4, 32);
        let skip = p
            .input(InputRole::PoolSkip)
            .expect("include_prompt = false");
        let plan_ = plan(&p, &st.weights, DType::F16, false, LIMITS).unwrap();
        let skip_loc = plan_
            .inputs
            .iter()
            .find(|i| i.buf == skip)
            .map(|i| Loc::Input(i.offset))
            .unwrap();
        let (_, grid, _, _, args) = kernel(&plan_, "pool_skip_f16");
        assert_eq!(grid.0, 4);
        assert_eq!((args.len(), args[2]), (8, Arg::Ptr(skip_loc)));
        let (_, grid, block, _, args) = kernel(&plan_, "l2norm_rows_f32");
        assert_eq!((grid.0, block), (4, 32));
        assert_eq!(args[1], Arg::I32(24));
        let crate::model::Architecture::Bert(a) = &st.arch else {
            unreachable!()
        };
        let pk = a.packed_program(64, 4);
        let skip = pk.input(InputRole::PoolSkip).unwrap();
        let plan_ = plan(&pk, &st.weights, DType::BF16, false, LIMITS).unwrap();
        let skip_loc = plan_
            .inputs
            .iter()
            .find(|i| i.buf == skip)
            .map(|i| Loc::Input(i.offset))
            .unwrap();
        let (_, grid, _, _, args) = kernel(&plan_, "pool_packed_skip_bf16");
        assert_eq!(grid.0, 4);
        assert_eq!((args.len(), args[2]), (8, Arg::Ptr(skip_loc)));
    }

    /// A MiniLM-sized encoder with MPNet's bias and position ids: the
    /// tensor-core attention kernels take the bias (head size 32), padded
    /// and packed, and for few tokens the fused attention sublayer's
    /// `_bias` variant does.
    #[test]
    fn biased_attention_on_tensor_cores() {
        let (mut arch, mut w) = minilm(2);
        let table = w.push("rel", vec![12, 257], vec![0.0; 12 * 257]);
        arch.position_bias = Some(PositionBias { table, radius: 128 });
        arch.position_ids = PositionIds::AfterPadding { pad: 1 };
        let bias = [Arg::Ptr(Loc::Weight(table)), Arg::I32(128)];
        for dtype in [DType::F16, DType::BF16] {
            let ts = suffix(dtype);
            let p = arch.program(2, 64);
            p.validate(&w).unwrap();
            let plan_ = plan(&p, &w, dtype, false, LIMITS).unwrap();
            let (name, grid, _, _, args) = kernel(&plan_, "attention_tc_bias_");
            assert_eq!(name, format!("attention_tc_bias_{ts}_d32"));
            assert_eq!(grid, (1, 12, 2));
            assert_eq!(args.len(), 8);
            assert_eq!(args[6..], bias);
            kernel(&plan_, "embed_ln_padpos_");
            for tokens in [16, 1024] {
                let pk = arch.packed_program(tokens, 8.min(tokens));
                pk.validate(&w).unwrap();
                let plan_ = plan(&pk, &w, dtype, false, LIMITS).unwrap();
                let steps = names(&plan_);
                let small = tokens == 16;
                let prefix = if small {
                    "layer_attn_small_bias_"
                } else {
                    "attention_varlen_tc_bias_"
                };
                let (name, _, _, _, args) = kernel(&plan_, prefix);
                assert_eq!(name, format!("{prefix}{ts}_d32"));
                assert_eq!(args.len(), if small { 21 } else { 8 });
                assert_eq!(args[args.len() - 2..], bias);
                assert_eq!(
                    steps.iter().filter(|s| s.starts_with(prefix)).count(),
                    2,
                    "{steps:?}"
                );
                assert_eq!(
                    steps.iter().any(|s| s.starts_with("layer_ffn_small")),
                    small,
                    "{steps:?}"
                );
            }
        }
        // Padded (1, 16) fuses too; without the bias, the plain kernel.
        let plan_ = plan(&arch.program(1, 16), &w, DType::F16, false, LIMITS).unwrap();
        let (_, _, _, _, args) = kernel(&plan_, "layer_attn_small_bias_f16_d32");
        assert_eq!(args[19..], bias);
        arch.position_bias = None;
        let plan_ = plan(&arch.packed_program(16, 8), &w, DType::F16, false, LIMITS).unwrap();
        kernel(&plan_, "layer_attn_small_f16_d32");
        assert!(!names(&plan_).iter().any(|s| s.contains("_bias_")));
    }

    /// The attention kernels add the bias as `PositionBias::column` says:
    /// the kernels' clamp reads the same column for every offset.
    #[test]
    fn relative_bias_column_matches_the_kernels() {
        let att = include_str!("../../../kernels/attention.cu");
        assert!(att.contains("row[min(max(k - q, -radius), radius) + radius]"));
        let kernel_col =
            |radius: i64, q: i64, k: i64| ((k - q).clamp(-radius, radius) + radius) as usize;
        for radius in [0usize, 1, 5, 128] {
            let b = PositionBias {
                table: WeightId(0),
                radius,
            };
            for q in 0..300usize {
                for k in (0..300usize).step_by(7) {
                    assert_eq!(
                        b.column(q, k),
                        kernel_col(radius as i64, q as i64, k as i64)
                    );
                }
            }
        }
    }
}
