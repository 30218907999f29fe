//! From a [`Program`](crate::model::Program) to the kernel launches and
//! matmuls that compute it: the plan (pure host code, unit-tested without a
//! GPU). [`super::resolve`] turns a plan's symbolic locations into device
//! addresses and [`super::launch`] issues its steps on a stream, the same
//! code for warm-up, capture and the eager path.
//!
//! [`plan`] takes a program that passed
//! [`Program::validate`](crate::model::Program::validate) (so every buffer,
//! weight and shape is as the ops say; what is left to refuse here is what
//! this device cannot run, as [`BackendError::Unsupported`]), decides the
//! storage type of every buffer, lays the activations out in one arena,
//! inserts the casts where the program mixes f32 inputs/outputs with
//! f16/bf16 activations, and computes every launch configuration. Each op
//! is planned by one function, padded or packed ([`Seqs`]) a parameter of
//! it, in the file of its stage:
//!
//! | file | what it plans |
//! |---|---|
//! | `program.rs` | the assembly: inputs and arena laid out, each op handed to its stage, the [`Plan`] |
//! | `planner.rs` | the `Planner` the stages share: buffer locations, scratch, casts, kernel steps |
//! | `embeddings.rs` | `EmbedLayerNorm` (`embed_ln[_vec|_padpos|_packed]`) |
//! | `attention.rs` | `Attention` (tensor-core and CUDA-core, padded and varlen, the tile tables) |
//! | `linear.rs` | `Linear`: the feed-forward block's, attention's projections and the heads' (`skinny`, `gemm_small`, cuBLASLt) |
//! | `norms.rs` | `AddLayerNorm` (`add_ln[_vec]`) and the LayerNorm a Linear leaves to the op after it |
//! | `pooling.rs` | `Pool` (`pool[_ln|_skip]`, `pool_packed*`) |
//! | `prenorm.rs` | pre-norm rotary encoders' ops: `Embed`, `LayerNorm`, `Add`, `Rotary`, `Gated`, sliding-window `Attention` (prenorm.cu) |
//! | `decoder.rs` | the decoders' ops (decoder.cu): `RmsNorm` with the residual `Add`s around it, `HeadRmsNorm` with the `Rotary` after it, a scaled `Embed` |
//! | `heads.rs` | `Normalize` after a Dense module (`l2norm_rows`) |
//! | `staged_io.rs` | small graphs reading and writing the batch's pinned slot themselves |
//!
//! A packed program's attention takes its work from a **tile table**, a
//! static buffer at the end of the input block whose contents the host
//! writes for every batch ([`write_tile_table`]), since a graph's grid is
//! fixed at capture: one entry per query tile of at most `qt` tokens of one
//! sequence, sized for the worst case a budget can produce ([`max_tiles`]);
//! blocks whose entry is unused exit at once.
//!
//! [`Limits`] says what the device allows and which kernel paths are on
//! (`[devices] kernel_paths_off`, [`KernelPath`]).

mod attention;
mod decoder;
mod embeddings;
mod heads;
mod linear;
mod norms;
mod planner;
mod pooling;
mod prenorm;
mod program;
mod staged_io;
#[cfg(test)]
pub(crate) mod test_support;

pub use attention::{
    attention_dmax, attention_smem_bytes, band_bounds, band_tc_class, is_band, max_tiles,
    write_tile_table, ATTN_S16_MAX_SEQ, ATT_KC, ATT_QT, ATT_THREADS, TC_QT, TC_THREADS, TILE_ENTRY,
    VARLEN_QT, VARLEN_TC_QT,
};
pub use decoder::{rms_threads, RMS_MAX_THREADS, RMS_VPT};
pub use heads::rownorm_threads;
pub use linear::{
    gemm_small_fits, skinny_fits, GS_MAXM, GS_MAXM_PADDED, GS_MAX_WEIGHT_ELEMS, GS_NB, GS_THREADS,
    GS_WARPS, SKINNY_MAX_WEIGHT_BYTES, SK_COLS, SK_MAXM, SK_WARPS,
};
pub use norms::{ln_threads, ln_vec_fits, LNV_J, LNV_WARPS, LN_VPT};
pub use planner::{
    ew_blocks, COUNTER_BLOCK_BYTES, EW_MAX_BLOCKS, EW_THREADS, EW_VEC, MAX_COUNTERS,
};
pub use pooling::{pool_code, POOL_LN_MAX_HIDDEN, POOL_THREADS};
pub use program::{not_on_cuda, plan};

/// Alignment of the integer inputs (ids, masks, offsets, tile tables) in
/// the input block: enough for the kernels' 16-byte loads, and tight, so
/// the (1, 16) block is 192 bytes rather than 768: it travels whole as a
/// kernel parameter ([`INLINE_WORDS`]) or across PCIe
/// at every replay. Float features keep [`ALIGN`](crate::backend::cuda::mem::ALIGN) (cuBLASLt reads them).
pub const INT_INPUT_ALIGN: usize = 64;

pub use staged_io::{
    INLINE_WORDS, OUTPUT_SENTINEL, STAGED_INPUT_MAX_BYTES, STAGED_OUTPUT_MAX_BYTES, STAGE_THREADS,
};

use super::matmul::MatmulShape;
use crate::config::{KernelPath, KernelPaths};
use crate::model::program::validate::op_buffers;
#[cfg(doc)]
use crate::model::program::Seqs;
use crate::model::program::{BufId, BufKind, InputRole, Layout, Op, WeightId};
use crate::model::Activation;
use crate::tensor::DType;

#[cfg(doc)]
use crate::backend::BackendError;

/// What the planner may use on this device: its shared memory, and the
/// kernel paths switched on (`[devices] kernel_paths_off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest dynamic shared memory a block may use (after opt-in).
    pub max_dyn_smem: usize,
    pub paths: KernelPaths,
}

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
        Activation::Log1pRelu => 7,
        Activation::Log1pLog1pRelu => 8,
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
        /// Added to the product (`shape.accumulate`): cuBLASLt's C with β = 1.
        residual: Option<Loc>,
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
    /// kernel has overwritten every value ([`KernelPath::PollOutput`]; staged
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

#[cfg(test)]
mod tests {
    use super::test_support::{assert_defines, tiny_bert};
    use super::*;

    #[test]
    fn liveness() {
        let (p, _) = tiny_bert(1, 16);
        // qkv (buffer 4) is overwritten by the next layer's / read by attention.
        let qkv = BufId(4);
        assert!(!dead_after(&p.ops, 2, qkv)); // attention reads it
        assert!(dead_after(&p.ops, 8, qkv)); // nothing after the last LN reads it
        assert!(dead_after(&p.ops, 5, qkv)); // FFN2 overwrites it
    }

    /// The activation codes are common.cuh's.
    #[test]
    fn activation_codes_match_the_kernels() {
        let codes = [
            ("ACT_IDENTITY", Activation::Identity),
            ("ACT_RELU", Activation::Relu),
            ("ACT_GELU", Activation::Gelu),
            ("ACT_GELU_TANH", Activation::GeluTanh),
            ("ACT_TANH", Activation::Tanh),
            ("ACT_SIGMOID", Activation::Sigmoid),
            ("ACT_SILU", Activation::Silu),
            ("ACT_LOG1P_RELU", Activation::Log1pRelu),
            ("ACT_LOG1P_LOG1P_RELU", Activation::Log1pLog1pRelu),
        ];
        assert_defines("common.cuh", &codes.map(|(n, a)| (n, act_code(a) as i64)));
    }
}
