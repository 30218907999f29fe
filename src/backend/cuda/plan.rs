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
use crate::config::{KernelPath, KernelPaths};
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

/// Warps of a `gemm_small` block (`GS_WARPS`).
pub const GS_WARPS: usize = 8;
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
/// Bytes of a stream's zeroed block of [`MAX_COUNTERS`] u32 counters.
pub const COUNTER_BLOCK_BYTES: usize = MAX_COUNTERS * 4;
/// Rows per block (one per warp) of the vectorised LayerNorm kernels
/// (`LNV_WARPS` in vec.cu).
pub const LNV_WARPS: usize = 4;
/// 4-value vectors each lane of a vectorised LayerNorm keeps (`LNV_J`):
/// rows of at most `32 · 4 · LNV_J` values.
pub const LNV_J: usize = 8;
/// Values per thread and step of `bias_act_vec` (one 16-byte f16 vector).
pub const EW_VEC: usize = 8;
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
    /// The host waits for no event: it fills the batch's output in the slot
    /// with [`OUTPUT_SENTINEL`] before the launch and polls until the last
    /// kernel has overwritten every value ([`Limits::poll_output`]; staged
    /// plans only).
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

    /// The plan a graph captures: staged ([`Plan::with_staged_io`]) where it
    /// [fits](Plan::fits_staged_io) and [`KernelPath::StagedIo`] is on, as it
    /// is otherwise (the replay then copies its input block in and its
    /// output out).
    pub fn for_graph(self, limits: &Limits) -> Plan {
        if limits.on(KernelPath::StagedIo) && self.fits_staged_io() {
            self.with_staged_io(limits)
        } else {
            self
        }
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
    /// scripts/gpu/probe-io-copies.cu).
    pub fn with_staged_io(mut self, limits: &Limits) -> Plan {
        let fold = limits.on(KernelPath::StageFold);
        let words = self.input_bytes.div_ceil(4);
        let inline = limits.on(KernelPath::InlineInput) && words <= INLINE_WORDS;
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
        self.staged.push(StagedStep {
            step: 0,
            count: None,
        });
        self.poll_output = limits.on(KernelPath::PollOutput);
        // pool_ln / pool_packed_ln: (x, mask or offsets, out, ..., out_rows).
        let rows = self.output_elems / self.output_dim.max(1);
        let fold_out = match steps.last() {
            Some(Step::Kernel {
                name, args, grid, ..
            }) if fold => {
                (name.starts_with("pool_ln_") || name.starts_with("pool_packed_ln_"))
                    && unique(steps, name)
                    && args.len() == 11
                    && args[2] == Arg::Ptr(Loc::Output(0))
                    && args[10] == Arg::I32(rows as i32)
                    && grid.0 as usize == rows
                    && rows * self.output_dim == self.output_elems
            }
            _ => false,
        };
        if fold_out {
            let last = steps.len() - 1;
            let Some(Step::Kernel { args, .. }) = steps.last_mut() else {
                unreachable!("checked above")
            };
            args[2] = Arg::Ptr(Loc::StagedOutput(0));
            self.staged.push(StagedStep {
                step: last,
                count: Some((10, StagedCount::Rows)),
            });
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
                ],
            });
            self.staged.push(StagedStep {
                step: steps.len() - 1,
                count: Some((2, StagedCount::Values)),
            });
        }
        self
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

/// What the planner may use on this device: its shared memory, and the
/// kernel paths switched on (`[devices] kernel_paths_off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest dynamic shared memory a block may use (after opt-in).
    pub max_dyn_smem: usize,
    pub paths: KernelPaths,
}

/// The longest padded sequence that takes `attention_tc_s16` ([`KernelPath::AttnS16`]).
pub const ATTN_S16_MAX_SEQ: usize = 16;

impl Limits {
    /// Every kernel path on, with this shared-memory limit.
    pub const fn new(max_dyn_smem: usize) -> Limits {
        Limits {
            max_dyn_smem,
            paths: KernelPaths::ALL_ON,
        }
    }

    /// These paths also off.
    pub fn without(mut self, paths: &[KernelPath]) -> Limits {
        self.paths = self.paths.without(paths);
        self
    }

    /// Whether `path` is on.
    pub fn on(&self, path: KernelPath) -> bool {
        self.paths.on(path)
    }
}

/// A cast still to run after an op: (from, from type, to, to type).
type PendingCast = Option<(Loc, DType, Loc, DType)>;

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
        if self.limits.on(KernelPath::EwVec) && from_t == to_t && elems.is_multiple_of(EW_VEC) {
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
    fn gemm_small(&mut self, idx: usize, op: LinearOp, x_l: Loc) -> Result<usize, BackendError> {
        let LinearOp { act, out, m, n, .. } = op;
        let t = self.compute;
        let grid = u32::try_from(n.div_ceil(GS_NB))
            .map_err(|_| BackendError::Unsupported(format!("op {idx} (Linear): {n} outputs")))?;
        let (offsets, seqs) = self.live_rows_args();
        let ln = self
            .add_ln_after(idx, act, out, m, n)
            .filter(|_| ln_vec_fits(n));
        // This Linear's x may be a LayerNorm the op before left to it.
        let x_norm = self.deferred_ln_args(idx, op.x)?;
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

    /// `gemm_small`'s last five arguments (`xf, xg, xb,
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
            self.limits.on(KernelPath::LnDefer)
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
        self.limits.on(KernelPath::LnDefer)
            && self.limits.on(KernelPath::GemmSmall)
            && (m, k) == (rows, hidden)
            && k <= 32 * GS_WARPS * 4
            && self.dtype(x) == t
            && !(self.limits.on(KernelPath::Skinny)
                && skinny_fits(m, n, k, t)
                && (out_t == t || out_t == DType::F32))
            && out_t == t
            && gemm_small_fits(m, n, k, t, max_rows)
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
                if pad.is_none() && self.limits.on(KernelPath::LnVec) && ln_vec_fits(hidden) {
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
                if self.limits.on(KernelPath::Skinny)
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
                if self.limits.on(KernelPath::GemmSmall)
                    && out_t == t
                    && gemm_small_fits(m, n, k, t, max_rows)
                {
                    return self.gemm_small(idx, linear, x_l);
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
                if self.limits.on(KernelPath::LnVec) && ln_vec_fits(hidden) {
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
                let tensor_cores = self.limits.on(KernelPath::TcAttention)
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
                    let s16 = if self.limits.on(KernelPath::AttnS16)
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
                if pad.is_none() && self.limits.on(KernelPath::LnVec) && ln_vec_fits(hidden) {
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
                let what = format!("op {idx} (PackedAttention)");
                let dmax = attention_dmax(head_dim).ok_or_else(|| {
                    BackendError::Unsupported(format!("{what}: head size {head_dim} (at most 128)"))
                })?;
                let tensor_cores = self.limits.on(KernelPath::TcAttention)
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
        pdl: p.limits.on(KernelPath::Pdl),
        staged: Vec::new(),
        poll_output: false,
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
        let plan = plan(
            &p,
            &w,
            DType::F16,
            false,
            LIMITS.without(&KernelPath::SMALL_SHAPE),
        )
        .unwrap();
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
        let plan2 = super::plan(
            &p2,
            &w2,
            DType::BF16,
            false,
            LIMITS.without(&KernelPath::SMALL_SHAPE),
        )
        .unwrap();
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
            (DType::F16, LIMITS.without(&[KernelPath::TcAttention])),
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
        let plan16 = plan(
            &p,
            &w,
            DType::F16,
            false,
            LIMITS.without(&KernelPath::SMALL_SHAPE),
        )
        .unwrap();
        assert_eq!(plan16.matmul_count(), 4);
        assert_eq!(plan16.counters, 0);
        // ... a narrower encoder through the skinny kernel, fused with its LayerNorms.
        let (p, w) = bert_dims(1, 16, 64, 2, 256);
        let plan = plan(
            &p,
            &w,
            DType::F16,
            false,
            LIMITS.without(&KernelPath::SMALL_SHAPE),
        )
        .unwrap();
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
        let l = LIMITS.without(&[
            KernelPath::Skinny,
            KernelPath::TcAttention,
            KernelPath::GemmSmall,
        ]);
        assert!(!l.on(KernelPath::Skinny) && !l.on(KernelPath::TcAttention));
        assert!(l.on(KernelPath::LnVec) && l.on(KernelPath::EwVec));
        let (p, w) = tiny_bert(1, 16);
        let plan = plan(&p, &w, DType::F16, false, l).unwrap();
        assert_eq!(plan.matmul_count(), 4);
        assert!(plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::Kernel { name, .. } if name == "attention_f16_d32")));
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
            LIMITS.without(&[KernelPath::GemmSmall]),
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
        let separate = LIMITS.without(&[KernelPath::GemmSmall]);
        let off = super::plan(
            &p,
            &w,
            DType::F16,
            false,
            separate.without(&[KernelPath::AttnS16]),
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
        let gs = include_str!("../../../kernels/gemm_small.cu");
        assert!(gs.contains(&format!("#define GS_WARPS {GS_WARPS}\n")));
        assert!(gs.contains("#define GS_THREADS (32 * GS_WARPS)\n") && GS_THREADS == 256);
        assert!(gs.contains(&format!("#define GS_NB {GS_NB} ")));
        assert!(gs.contains(&format!("#define GS_MAXM {GS_MAXM} ")));
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
    /// keep the copies. (Here with the block read from the slot; the inline
    /// block and the polled output are
    /// `small_plans_take_their_input_inline_and_poll_their_output`'s.)
    #[test]
    fn small_plans_stage_their_io_in_the_graph() {
        let (a, w) = minilm(6);
        let default = LIMITS;
        let slot_io = LIMITS.without(&[KernelPath::InlineInput]);
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
            ]
        );
        assert_eq!(
            staged.staged[1],
            StagedStep {
                step: names.len() - 1,
                count: Some((2, StagedCount::Values))
            }
        );
        assert!(staged.programmatic(names.len() - 1));

        // Without the warp-per-row embedding, stage_in goes first.
        let no_vec = LIMITS.without(&[KernelPath::LnVec]);
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
        // `stage_fold` off: stage_in and stage_out around the same kernels.
        let names = small
            .clone()
            .with_staged_io(&slot_io.without(&[KernelPath::StageFold]))
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
    /// block is read from the slot. With `poll_output` off the host waits
    /// for the graph's event.
    #[test]
    fn small_plans_take_their_input_inline_and_poll_their_output() {
        let (a, w) = minilm(6);
        let default = LIMITS;
        let small = plan(&a.program(1, 16), &w, DType::F16, false, default).unwrap();
        assert_eq!(small.input_bytes, 3 * 16 * 4, "ids, mask, types");
        let staged = small.clone().with_staged_io(&default);
        assert!(staged.poll_output);
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
        // output.
        assert!(staged.steps.iter().all(|s| match s {
            Step::Kernel { args, .. } => !args.contains(&Arg::Ptr(Loc::StagedInput(0))),
            Step::Matmul { .. } => true,
        }));
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(args.len(), 11);
        assert_eq!(args[2], Arg::Ptr(Loc::StagedOutput(0)));
        assert_eq!(staged.staged, folded_ends(staged.steps.len() - 1));

        // (2, 32): 192 words, over INLINE_WORDS: read from the slot.
        let two = plan(&a.program(2, 32), &w, DType::F16, false, default).unwrap();
        assert_eq!(two.input_bytes / 4, 3 * 64);
        let staged = two.clone().with_staged_io(&default);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(args[16], Arg::Ptr(Loc::StagedInput(0)));

        // Without the warp-per-row embedding: stage_in_inl takes the block.
        let no_vec = default.without(&[KernelPath::LnVec]);
        let plain = plan(&a.program(1, 16), &w, DType::F16, false, no_vec).unwrap();
        let staged = plain.clone().with_staged_io(&no_vec);
        let Step::Kernel { name, args, .. } = &staged.steps[0] else {
            panic!("stage_in_inl is a kernel")
        };
        assert_eq!(name, "stage_in_inl");
        assert_eq!(args, &[Arg::Inline, Arg::Ptr(Loc::Input(0)), Arg::I32(48)]);

        // The switches.
        let off = default.without(&[KernelPath::InlineInput, KernelPath::PollOutput]);
        let staged = small.clone().with_staged_io(&off);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        assert!(!staged.poll_output);
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
        let legacy = LIMITS.without(&KernelPath::SMALL_SHAPE);
        let default = LIMITS;
        // Nodes: before the small-shape kernels, and with every path on
        // (gemm_small at <= 32 padded or 64 packed rows).
        let cases = [
            ("(1, 16)", a.program(1, 16), 50, 32),
            ("(2, 32)", a.program(2, 32), 50, 50),
            ("(32, 128)", a.program(32, 128), 50, 50),
            ("(128, 128)", a.program(128, 128), 50, 50),
            ("64t", a.packed_program(64, 64), 50, 32),
            ("1024t", a.packed_program(1024, 256), 50, 50),
            ("16384t", a.packed_program(16384, 256), 50, 50),
            ("(1, 32)", a.program(1, 32), 50, 32),
        ];
        for (what, p, before, by_default) in &cases {
            assert_eq!(
                steps(p, DType::F16, legacy).node_count(),
                *before,
                "{what} legacy"
            );
            let now = steps(p, DType::F16, default);
            assert_eq!(
                now.node_count(),
                *by_default,
                "{what}: {:?}",
                now.step_names()
            );
            assert_eq!(now.node_count(), now.kernel_count() + now.matmul_count());
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
        assert_eq!(pool.len(), 7 + 3 + 1);
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
        let apart = steps(
            &cases[0].1,
            DType::F16,
            default.without(&[KernelPath::LnDefer]),
        );
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
        let no_pdl = steps(&cases[0].1, DType::F16, default.without(&[KernelPath::Pdl]));
        assert!((0..32).all(|i| !no_pdl.programmatic(i)));
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
        // f32 keeps its matmuls (gemm_small is f16/bf16 only).
        let f32 = steps(&cases[0].1, DType::F32, LIMITS);
        assert_eq!((f32.node_count(), f32.matmul_count()), (50, 24));
        assert!(f32.step_names().contains(&"add_ln_vec_f32".to_string()));
        // bf16 takes gemm_small as f16 does.
        let bf = steps(&cases[0].1, DType::BF16, LIMITS);
        assert_eq!(bf.node_count(), 32);
        assert_eq!(bf.step_names()[1], "gemm_small_bf16");
    }

    /// Each kernel path, switched off alone, changes what MiniLM's small
    /// graphs run (the staged plan where the path is about staging); with
    /// every path off, (1, 16) plans the kernels of before them.
    #[test]
    fn every_switch_turns_off_its_path() {
        let (a, w) = minilm(1);
        let staged = |limits: Limits, program: &Program, dtype: DType| {
            let p = plan(program, &w, dtype, false, limits).unwrap();
            assert!(p.fits_staged_io());
            p.for_graph(&limits)
        };
        let (p16, p17, p64) = (a.program(1, 16), a.program(1, 17), a.packed_program(64, 64));
        let (mlp8, mw) = mlp(8, Activation::Relu);
        for path in KernelPath::ALL {
            let off = LIMITS.without(&[path]);
            assert_eq!(off.paths.off(), vec![path]);
            let changed = [
                (&p16, DType::F16),
                (&p16, DType::F32),
                (&p17, DType::F32),
                (&p64, DType::F16),
            ]
            .iter()
            .any(|&(p, dtype)| staged(LIMITS, p, dtype) != staged(off, p, dtype))
                || plan(&mlp8, &mw, DType::F32, false, LIMITS)
                    != plan(&mlp8, &mw, DType::F32, false, off);
            assert!(changed, "{path}: no plan changes");
        }
        let all = LIMITS.without(&KernelPath::ALL);
        assert_eq!(all.max_dyn_smem, LIMITS.max_dyn_smem);
        let plan = plan(&p16, &w, DType::F16, false, all).unwrap();
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
                        LIMITS.without(&KernelPath::SMALL_SHAPE),
                        LIMITS.without(&[KernelPath::TcAttention]),
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
                        let layers = match &model.arch {
                            crate::model::Architecture::Bert(a) => a.layers.len(),
                            _ => unreachable!(),
                        };
                        if name == "mpnet-st" {
                            // Every layer's attention has the bias.
                            assert_eq!(biased, layers, "{name} {label} {dtype}: {steps:?}");
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
                let prefix = "attention_varlen_tc_bias_";
                let (name, _, _, _, args) = kernel(&plan_, prefix);
                assert_eq!(name, format!("{prefix}{ts}_d32"));
                assert_eq!(args.len(), 8);
                assert_eq!(args[args.len() - 2..], bias);
                assert_eq!(
                    steps.iter().filter(|s| s.starts_with(prefix)).count(),
                    2,
                    "{steps:?}"
                );
            }
        }
        // Padded (1, 16): the 16-key kernel with the bias; without the
        // bias, the plain one.
        let plan_ = plan(&arch.program(1, 16), &w, DType::F16, false, LIMITS).unwrap();
        let (_, _, _, _, args) = kernel(&plan_, "attention_tc_bias_s16_f16_d32");
        assert_eq!(args[6..], bias);
        arch.position_bias = None;
        let plan_ = plan(&arch.packed_program(16, 8), &w, DType::F16, false, LIMITS).unwrap();
        kernel(&plan_, "attention_varlen_tc_f16_d32");
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
