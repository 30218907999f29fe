//! The CPU backend: a real backend and the numerical reference for CUDA.
//!
//! * Weights are kept as f32: the model's (held as the checkpoint stores
//!   them, [`crate::model::WeightData`]) are converted at upload, and for
//!   f16/bf16 models every weight is rounded through that dtype (a no-op for
//!   one stored in it); all arithmetic is f32.
//! * "Capture" ([`Backend::capture`]) allocates the program's static inputs
//!   and output once and resolves its ops into a replayable plan bound to
//!   those buffers (see `plan.rs`); a replay packs the batch into the static
//!   inputs and runs the plan without allocating.
//! * Activations and attention's score scratch live in one arena owned by the
//!   backend and shared by all its graphs, as the CUDA backend shares its
//!   activation arena: a worker replays one graph at a time (the backend is
//!   `&mut self`), so a grid of 40 buckets holds the activations of its
//!   largest bucket once rather than of every bucket. Each plan lays its
//!   activations out from the start of the arena; capture grows the arena
//!   when a plan needs more (never shrinks it). [`Backend::graph_memory_bytes`]
//!   charges a graph its own static buffers plus the bytes by which its
//!   capture grew the arena, so the figures of a backend's graphs add up to
//!   the memory really held (the CUDA backend's rule).
//! * By default a replay computes only the batch's real rows and its longest
//!   sequence inside those buffers (padding costs real work on a CPU, and
//!   skipping it cannot change a real row's result); for a packed program
//!   (see [`crate::model::program`]), only its real tokens (the tail of the
//!   budget is skipped) and its real sequences. [`CpuBackend::set_trim_padding`]
//!   turns that off.
//! * Packed programs run the same way: their attention per (sequence, head)
//!   over the sequence's own keys, their pooling per sequence; the output
//!   has one row per sequence of the batch.
//! * Matrix products go through the `gemm` crate with
//!   `Parallelism::Rayon(threads)`; every op runs inside this backend's own
//!   rayon pool of `threads` threads (never the global pool), which gemm and
//!   the per-row kernels use.
//! * [`Backend::launch`] runs the replay to completion on the pool and hands
//!   the output rows to the returned [`CpuPending`]: on the CPU the "device"
//!   is these threads, so there is nothing to overlap with. Consecutive
//!   launches are therefore safe to collect in any order.
//! * [`Backend::inject_fault`] poisons the backend like a sticky CUDA error:
//!   every later call that touches the "device" returns
//!   [`BackendError::DeviceFault`]; [`Backend::inject_hang`] makes the next
//!   launch block its thread for good, like a hung GPU.

mod arena;
mod ops;
mod plan;
#[cfg(test)]
mod tests;

use self::arena::Arena;
use self::plan::Plan;
use super::{Backend, BackendError, DeviceInfo};
use crate::model::{BatchRows, Model, Program};
use crate::tensor::DType;
use std::sync::Arc;

/// One weight tensor as the CPU backend computes with it.
#[derive(Debug)]
pub struct CpuTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A model's weights, resident in host memory, indexed by `WeightId`.
/// Cheap to clone (graphs keep a handle).
#[derive(Clone, Debug)]
pub struct CpuWeights {
    tensors: Arc<Vec<CpuTensor>>,
    dtype: DType,
}

impl CpuWeights {
    /// The dtype the weights were rounded through.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of the uploaded weights (the CPU backend holds them as f32,
    /// whatever the checkpoint stores).
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64 * 4).sum()
    }
}

/// A captured program: its static buffers and replay plan (its activations
/// are in the backend's shared arena).
#[derive(Debug)]
pub struct CpuGraph {
    plan: Plan,
    /// Bytes by which this graph's capture grew the backend's arena.
    arena_charge: u64,
}

impl CpuGraph {
    pub fn batch(&self) -> usize {
        self.plan.batch
    }

    pub fn seq(&self) -> usize {
        self.plan.seq
    }

    /// Bytes of the graph's own static buffers (inputs and output).
    pub fn static_bytes(&self) -> u64 {
        self.plan.static_bytes()
    }

    /// Bytes of the shared arena its program uses (activations and attention
    /// scratch): what the graph would hold on its own without the arena.
    pub fn arena_needed_bytes(&self) -> u64 {
        self.plan.arena_needs().bytes()
    }
}

/// A launched batch: the output rows that belong to real inputs.
#[derive(Debug)]
pub struct CpuPending {
    output: Vec<f32>,
}

/// Runs programs on host threads.
pub struct CpuBackend {
    ordinal: usize,
    threads: usize,
    pool: rayon::ThreadPool,
    /// Set by [`Backend::inject_fault`]: the "device" is unusable.
    fault: Option<String>,
    /// Set by [`Backend::inject_hang`]: the next launch never returns.
    hung: bool,
    /// Compute only the real rows and tokens of a batch (see [`CpuBackend::set_trim_padding`]).
    trim_padding: bool,
    /// Activations and attention scratch shared by every graph.
    arena: Arena,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("ordinal", &self.ordinal)
            .field("threads", &self.threads)
            .field("fault", &self.fault)
            .field("trim_padding", &self.trim_padding)
            .field("arena_bytes", &self.arena.bytes())
            .finish()
    }
}

impl CpuBackend {
    /// A CPU "device" numbered `ordinal` computing with `threads` threads
    /// (0 = the number of available cores).
    ///
    /// Panics if the operating system refuses to start the threads.
    pub fn new(ordinal: usize, threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("cpu{ordinal}-compute-{i}"))
            .build()
            .expect("cannot start the CPU backend's compute threads");
        CpuBackend {
            ordinal,
            threads,
            pool,
            fault: None,
            hung: false,
            trim_padding: true,
            arena: Arena::default(),
        }
    }

    /// Whether replays compute only a batch's real rows and its longest
    /// sequence (the default) or the graph's whole padded shape.
    ///
    /// On a GPU the padded rows of a bucket cost little; on the CPU they cost
    /// their full share of every matrix product. Rows are independent and
    /// attention never sees masked keys, so skipping them cannot change a
    /// real row's result (beyond float rounding in the blocking of gemm); the
    /// buffers stay those allocated at capture. Turn it off to measure or
    /// test the full bucket shape.
    pub fn set_trim_padding(&mut self, on: bool) {
        self.trim_padding = on;
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Bytes of the activation arena shared by this backend's graphs (the
    /// largest need of any graph captured so far; 0 before the first).
    pub fn arena_bytes(&self) -> u64 {
        self.arena.bytes()
    }

    /// After [`Backend::inject_hang`] the "device" never finishes again:
    /// the calling thread blocks for good, as on a hung GPU.
    fn hang_if_hung(&self) {
        if self.hung {
            loop {
                std::thread::park();
            }
        }
    }

    fn check_fault(&self) -> Result<(), BackendError> {
        match &self.fault {
            Some(why) => Err(BackendError::DeviceFault(why.clone())),
            None => Ok(()),
        }
    }
}

/// Runs `plan` on `rows` in `pool`, with its activations in `arena`.
///
/// The arena already fits every graph captured by the same backend; it grows
/// here only for a plan it has never seen (a graph of another backend).
fn replay(
    pool: &rayon::ThreadPool,
    arena: &mut Arena,
    trim_padding: bool,
    plan: &mut Plan,
    rows: &BatchRows,
) -> Result<Vec<f32>, BackendError> {
    arena.ensure(plan.arena_needs());
    plan.pack(rows, trim_padding);
    pool.install(|| plan.run(arena));
    Ok(plan.output_rows(rows.rows()).to_vec())
}

/// Rounds `x` through `dtype` (identity for f32).
pub(crate) fn round_through(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

impl Backend for CpuBackend {
    type Weights = CpuWeights;
    type Graph = CpuGraph;
    type Pending = CpuPending;

    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cpu".into(),
            name: format!("cpu ({} threads)", self.threads),
            ordinal: self.ordinal,
            ..DeviceInfo::default()
        }
    }

    fn upload(&mut self, model: &Model) -> Result<CpuWeights, BackendError> {
        self.check_fault()?;
        let dtype = model.info.dtype;
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(BackendError::Unsupported(format!(
                "compute dtype {dtype} (the CPU backend computes f32, f16 or bf16 models)"
            )));
        }
        let tensors = model
            .weights
            .iter()
            .map(|(_, t)| CpuTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                // As stored or computed, in f32 (exact), then rounded
                // through the compute dtype (a no-op when stored in it).
                data: if dtype == DType::F32 || t.data.dtype() == dtype {
                    t.data.to_f32().into_owned()
                } else {
                    t.data
                        .to_f32()
                        .iter()
                        .map(|&x| round_through(dtype, x))
                        .collect()
                },
            })
            .collect();
        Ok(CpuWeights {
            tensors: Arc::new(tensors),
            dtype,
        })
    }

    fn capture(
        &mut self,
        _model: &Model,
        weights: &CpuWeights,
        program: &Program,
    ) -> Result<CpuGraph, BackendError> {
        self.check_fault()?;
        // No warm-up run: there is no JIT or workspace to prime on the CPU,
        // and a full forward pass per bucket would slow start-up for nothing.
        let plan = Plan::new(program, weights, self.threads);
        let arena_charge = self.arena.ensure(plan.arena_needs());
        Ok(CpuGraph { plan, arena_charge })
    }

    /// The graph's own static buffers, plus the bytes by which its capture
    /// grew the shared arena (all of it for the first, largest graph; 0 for
    /// the graphs that fit in it), so that a backend's graphs add up to the
    /// memory it holds. [`CpuGraph::arena_needed_bytes`] is the arena share
    /// its program uses.
    fn graph_memory_bytes(&self, graph: &CpuGraph) -> u64 {
        graph.static_bytes() + graph.arena_charge
    }

    fn launch(
        &mut self,
        graph: &mut CpuGraph,
        rows: &BatchRows,
    ) -> Result<CpuPending, BackendError> {
        self.check_fault()?;
        self.hang_if_hung();
        let output = replay(
            &self.pool,
            &mut self.arena,
            self.trim_padding,
            &mut graph.plan,
            rows,
        )?;
        Ok(CpuPending { output })
    }

    fn collect(&mut self, pending: CpuPending) -> Result<Vec<f32>, BackendError> {
        self.check_fault()?;
        Ok(pending.output)
    }

    fn run_eager(
        &mut self,
        _model: &Model,
        weights: &CpuWeights,
        program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        self.check_fault()?;
        let mut plan = Plan::new(program, weights, self.threads);
        // Within the shared arena if it fits (no allocation beyond the
        // plan's inputs and output); otherwise (a shape larger than every
        // bucket) in an arena of its own, freed on return rather than kept
        // for the life of the worker.
        let mut own = Arena::default();
        let arena = if self.arena.fits(plan.arena_needs()) {
            &mut self.arena
        } else {
            &mut own
        };
        replay(&self.pool, arena, self.trim_padding, &mut plan, rows)
    }

    fn inject_hang(&mut self) -> Result<(), BackendError> {
        self.hung = true;
        Ok(())
    }

    fn inject_fault(&mut self) -> Result<(), BackendError> {
        self.fault = Some(format!(
            "injected fault on cpu device {} (the backend is poisoned until the process restarts)",
            self.ordinal
        ));
        Ok(())
    }
}
