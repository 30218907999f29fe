//! Backends run a model's [`Program`]s on one device.
//!
//! A backend lives on one thread of a worker process (CUDA graphs are not
//! `Send`), so the trait takes `&mut self` and nothing here is shared. The
//! [`GraphCache`](crate::worker::graph_cache::GraphCache) above it decides what
//! to capture and when; a backend only knows how to:
//!
//! * upload a model's weights ([`Backend::upload`]),
//! * capture a program into a replayable graph over static buffers
//!   ([`Backend::capture`]),
//! * replay a graph for a batch in two steps, [`Backend::launch`] (copy the
//!   rows in, start the replay, start the copy out) and [`Backend::collect`]
//!   (wait for that batch and return its rows), so consecutive batches overlap,
//! * run a program without capture for shapes that fit no bucket
//!   ([`Backend::run_eager`]).
//!
//! `cpu` is the reference backend and the one tests run on; `cuda` is the product;
//! `null` computes nothing (host-path benchmarks).

pub mod cpu;
pub mod cuda;
pub mod null;
pub mod null_timings;

pub use crate::gpu::DeviceInfo;
use crate::model::{BatchRows, Model, Program};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// What went wrong in a backend, and whether the device survives it. A
/// worker reports it to the daemon as is (as
/// [`WorkerError`](crate::worker::link::WorkerError)), so it is serialisable.
#[derive(Debug, Error, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendError {
    /// The device is unusable in this process (a sticky CUDA error such as an
    /// illegal address, a launch failure or an uncorrectable ECC error). The
    /// worker must exit so the daemon starts a fresh process, and its batches
    /// are dispatched again.
    #[error("device fault: {0}")]
    DeviceFault(String),
    /// Device memory ran out (capture or eager run).
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// The backend cannot do this (missing library, unsupported dtype, ...).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The batch does not match the graph it was sent to, or another
    /// per-request problem; the device is fine.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// Anything else; the device is assumed fine.
    #[error("{0}")]
    Other(String),
}

impl BackendError {
    /// True when the worker process must exit (the device is poisoned).
    pub fn is_fatal(&self) -> bool {
        matches!(self, BackendError::DeviceFault(_))
    }
}

/// What capturing a program would allocate on a device, known before the
/// capture (the start-up memory budget, [`crate::worker::memory_budget`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphNeed {
    /// The activation arena its program needs. A model's graphs share one
    /// arena, as large as the largest of them needs.
    pub arena_bytes: u64,
    /// Its own static buffers (inputs and output).
    pub fixed_bytes: u64,
}

/// One device's executor. See the module docs for the life cycle.
pub trait Backend {
    /// A model's weights, resident on the device.
    type Weights;
    /// A captured program with its static input and output buffers.
    type Graph;
    /// A launched batch that has not been collected yet.
    type Pending;

    fn info(&self) -> DeviceInfo;

    /// Copies (and converts to the model's dtype) every weight onto the device.
    fn upload(&mut self, model: &Model) -> Result<Self::Weights, BackendError>;

    /// Allocates the program's static buffers, warms up, and captures the
    /// forward pass. The graph reads its inputs from, and writes its output
    /// to, buffers that never move.
    fn capture(
        &mut self,
        model: &Model,
        weights: &Self::Weights,
        program: &Program,
    ) -> Result<Self::Graph, BackendError>;

    /// Device memory the graph holds (its static buffers, plus its share of
    /// any pool), in bytes.
    fn graph_memory_bytes(&self, graph: &Self::Graph) -> u64;

    /// Packs `rows` (at most the graph's batch, each at most its seq; for a
    /// packed graph at most its sequences and token budget, end to end) into
    /// the graph's static inputs, padding the rest, and starts the replay and
    /// the copy of the output to the host. Must not wait for the device.
    fn launch(
        &mut self,
        graph: &mut Self::Graph,
        rows: &BatchRows,
    ) -> Result<Self::Pending, BackendError>;

    /// Waits for a launched batch and returns the output rows that belong to
    /// real inputs: `rows.len() · output_dim` f32 values, row-major (one row
    /// per sequence, in order, for a packed graph).
    fn collect(&mut self, pending: Self::Pending) -> Result<Vec<f32>, BackendError>;

    /// Runs `program` once at its exact shape, without capture (the eager path).
    fn run_eager(
        &mut self,
        model: &Model,
        weights: &Self::Weights,
        program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError>;

    /// Free device memory, on a backend whose graphs must fit a device
    /// (CUDA); `None`: no limit to budget (the CPU and null backends).
    fn free_memory(&mut self) -> Result<Option<u64>, BackendError> {
        Ok(None)
    }

    /// What capturing `program` would allocate, planned without allocating.
    fn graph_need(
        &mut self,
        _model: &Model,
        _weights: &Self::Weights,
        _program: &Program,
    ) -> Result<GraphNeed, BackendError> {
        Ok(GraphNeed::default())
    }

    /// Device bytes of a model's uploaded weights, and of the activation
    /// arena its graphs share now.
    fn resident_bytes(&self, _weights: &Self::Weights) -> (u64, u64) {
        (0, 0)
    }

    /// Deliberately corrupts the device (fault-injection tests). The next
    /// launch or collect then returns [`BackendError::DeviceFault`].
    fn inject_fault(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(
            "fault injection is not available on this backend".into(),
        ))
    }

    /// Makes the device stop making progress (fault-injection tests): the
    /// next batch launched never finishes, and the process stays alive, as
    /// with a hung GPU. Only a new process recovers.
    fn inject_hang(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unsupported(
            "hang injection is not available on this backend".into(),
        ))
    }
}
