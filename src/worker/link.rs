//! The worker link: messages between a device actor (daemon side) and its
//! worker process, over a ZeroMQ DEALER pair on an `ipc://` socket. This file
//! is the one place that wire is encoded and decoded.
//!
//! Each message is a MessagePack header frame followed by raw data frames
//! (row data never goes through MessagePack): a `Run` carries its rows, a
//! `Done` its output. A failed batch comes back as a typed [`WorkerError`],
//! which [`WorkerError::code`] maps to the protocol's error codes.
//!
//! With the shared-memory data plane ([`super::shm`]) the same messages
//! travel on the worker's doorbell socket instead, and the rows and outputs
//! lie in a ring slot: [`ToWorker::RunShm`] names the slot, and the `Done`
//! or `Failed` that answers it names it again (`slot`), handing it back.
//! Control (readiness, heartbeats, faults, shutdown) and batches too large
//! for a slot stay on the socket.

use crate::bucket::{Bucket, Grid};
use crate::gpu::DeviceInfo;
use crate::model::BatchRows;
use crate::protocol::ErrorCode;
use bytes::Bytes;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The link's socket limits (both ends): large batches (many parts, big
/// outputs) from a trusted peer in an owner-only directory; the worker's own
/// heartbeats stand in for ZMTP's.
pub fn transport_limits() -> crate::transport::TransportLimits {
    crate::transport::TransportLimits {
        max_message_bytes: u32::MAX as usize,
        max_frame_bytes: 1 << 31,
        max_frames: 1 << 20,
        heartbeat: None,
        ..Default::default()
    }
}

/// The daemon's id of a batch (opaque to the worker, echoed in replies).
pub type BatchId = u64;

/// Exit status of a worker whose device faulted (sticky CUDA error): the
/// daemon restarts it and counts a device fault.
pub const EXIT_DEVICE_FAULT: i32 = 3;
/// Exit status of a worker that could not start (bad model, no device).
pub const EXIT_STARTUP_FAILED: i32 = 2;

/// How the rows of a `Run` are laid out in its data frames.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RowsLayout {
    /// One frame per request: little-endian f32 rows of `features` values.
    Features { features: usize },
    /// One frame holding every sequence's little-endian u32 ids back to back;
    /// `lens` gives each sequence's length.
    Tokens { lens: Vec<u32> },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ToWorker {
    /// Run a batch: in the graph for `bucket`, or eagerly when `None`.
    Run {
        batch: BatchId,
        attempt: u32,
        model: usize,
        bucket: Option<Bucket>,
        layout: RowsLayout,
    },
    /// Run a batch whose rows lie in ring slot `slot` (sent on the doorbell).
    RunShm {
        batch: BatchId,
        attempt: u32,
        model: usize,
        bucket: Option<Bucket>,
        slot: u32,
        rows: super::shm::SlotRows,
    },
    /// Break the device on purpose (only when the daemon enables fault injection).
    InjectFault { kind: FaultKind },
    /// Finish what is in flight and exit 0.
    Shutdown,
    /// A reload: capture the buckets of `grid` not yet captured for
    /// `model`, beside its other graphs (answered by `Captured`); the model's
    /// eager runs follow the grid's batching from now on.
    Capture { model: usize, grid: Grid },
    /// Drop `model`'s graphs that are not in `grid`, once the batches
    /// already launched are collected (answered by `Released`).
    Release { model: usize, grid: Grid },
}

/// What fault injection does to a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// A sticky error (an out-of-bounds write on a GPU): the worker exits.
    Corrupt,
    /// The device stops making progress (a kernel that spins forever on a
    /// GPU): the next batch never finishes, and the watchdog must notice.
    Hang,
}

/// One captured graph, as reported at start-up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphReport {
    pub model: usize,
    pub bucket: Bucket,
    pub capture_us: u64,
    pub memory_bytes: u64,
}

/// A model's device memory on a worker, as reported at start-up.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelMemory {
    pub model: usize,
    /// Its uploaded weights.
    pub weights_bytes: u64,
    /// The activation arena its graphs share.
    pub arena_bytes: u64,
    /// Buckets the memory budget left without a graph: (bucket, bytes it
    /// needed, bytes that were free beyond the reserve).
    pub dropped: Vec<(Bucket, u64, u64)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FromWorker {
    /// Every model is loaded and every graph captured: the worker takes work.
    Ready {
        info: DeviceInfo,
        graphs: Vec<GraphReport>,
        startup_ms: u64,
        /// Each model's device memory (CUDA; empty on other backends).
        #[serde(default)]
        memory: Vec<ModelMemory>,
    },
    /// A batch finished; one data frame with `rows · output_dim` little-endian
    /// f32, or (with `slot`) no frame: the output lies in that ring slot.
    Done {
        batch: BatchId,
        attempt: u32,
        rows: usize,
        output_dim: usize,
        compute_us: u64,
        /// True when a captured graph ran it, false for the eager path.
        replayed: bool,
        /// The ring slot it came in and its output lies in, handed back.
        #[serde(default)]
        slot: Option<u32>,
        /// When the worker took the batch and when its output was ready
        /// ([`crate::clock::mono_ns`]).
        #[serde(default)]
        started_ns: u64,
        #[serde(default)]
        finished_ns: u64,
    },
    /// A batch failed. When the error is fatal, the worker exits right
    /// after (device fault) and the batch is re-dispatched.
    Failed {
        batch: BatchId,
        attempt: u32,
        error: WorkerError,
        /// The ring slot it came in, handed back.
        #[serde(default)]
        slot: Option<u32>,
    },
    /// The backend thread is alive and not stuck (sent every heartbeat
    /// interval while it is idle or between batches).
    Heartbeat,
    /// Answer to `InjectFault`.
    FaultInjected { ok: bool, message: String },
    /// The worker is exiting because it could not start or its device failed.
    Fatal { message: String },
    /// The binary carries no kernels for this GPU and the cache none: the
    /// worker compiles them with NVRTC for `target` (`Cubin(89)`, say), a
    /// minute or more, before it loads its models.
    CompilingKernels { target: String },
    /// Capture progress: `captured` of `total` graphs (at start-up, after
    /// the models are loaded and after each graph; and during a `Capture`).
    Progress { captured: usize, total: usize },
    /// Answer to `Capture`: the graphs it captured (not those it had), and
    /// why it stopped early, if it did (the worker lives on).
    Captured {
        model: usize,
        graphs: Vec<GraphReport>,
        error: Option<String>,
    },
    /// Answer to `Release`: the buckets whose graphs were dropped.
    Released { model: usize, dropped: Vec<Bucket> },
}

/// Why a worker could not run a batch: its backend's error, as is.
pub use crate::backend::BackendError as WorkerError;

impl WorkerError {
    /// The protocol error code a client gets for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            // The batch was checked against the model by the frontend; a
            // mismatch the worker finds is still the request's.
            WorkerError::InvalidBatch(_) => ErrorCode::BadRequest,
            // Transient: the same request may fit later.
            WorkerError::OutOfMemory(_) => ErrorCode::Overloaded,
            WorkerError::DeviceFault(_) | WorkerError::Unsupported(_) | WorkerError::Other(_) => {
                ErrorCode::Internal
            }
        }
    }
}

/// Encodes a `Run`: the header, then the rows of every part in order
/// (one frame per part for features, zero-copy of nothing but cheap; one
/// frame of all ids for tokens).
pub fn encode_run<'a>(
    batch: BatchId,
    attempt: u32,
    model: usize,
    bucket: Option<Bucket>,
    parts: impl IntoIterator<Item = &'a BatchRows>,
) -> Vec<Bytes> {
    let parts: Vec<&BatchRows> = parts.into_iter().collect();
    let (layout, data) = match parts.first() {
        Some(BatchRows::Features { features, .. }) => (
            RowsLayout::Features {
                features: *features,
            },
            parts
                .iter()
                .map(|p| match p {
                    BatchRows::Features { data, .. } => crate::tensor::f32s_to_le(data),
                    BatchRows::Tokens(_) => Bytes::new(),
                })
                .collect(),
        ),
        _ => {
            let (lens, frame) = tokens_frame(parts.iter().flat_map(|p| match p {
                BatchRows::Tokens(seqs) => seqs.iter(),
                BatchRows::Features { .. } => [].iter(),
            }));
            (RowsLayout::Tokens { lens }, vec![frame])
        }
    };
    encode(
        &ToWorker::Run {
            batch,
            attempt,
            model,
            bucket,
            layout,
        },
        data,
    )
}

/// Encodes a header and its data frames into one multipart message.
pub fn encode<T: Serialize>(header: &T, data: impl IntoIterator<Item = Bytes>) -> Vec<Bytes> {
    let head = rmp_serde::to_vec_named(header).expect("IPC header always serialises");
    std::iter::once(Bytes::from(head)).chain(data).collect()
}

/// Splits a multipart message into its header and data frames.
pub fn decode<T: DeserializeOwned>(frames: &[Bytes]) -> Result<(T, &[Bytes]), String> {
    let (head, data) = frames.split_first().ok_or("empty IPC message")?;
    let header = rmp_serde::from_slice(head).map_err(|e| format!("bad IPC header: {e}"))?;
    Ok((header, data))
}

/// Rebuilds a batch's rows from a `Run`'s layout and data frames.
pub fn rows_from_frames(layout: &RowsLayout, data: &[Bytes]) -> Result<BatchRows, String> {
    match layout {
        RowsLayout::Features { features } => {
            let mut values = Vec::with_capacity(data.iter().map(Bytes::len).sum::<usize>() / 4);
            for frame in data {
                if frame.len() % (4 * features.max(&1)) != 0 {
                    return Err(format!(
                        "feature frame of {} bytes is not whole rows of {features} f32",
                        frame.len()
                    ));
                }
                values.extend(crate::tensor::f32s_from_le(frame));
            }
            Ok(BatchRows::Features {
                features: *features,
                data: values,
            })
        }
        RowsLayout::Tokens { lens } => {
            let [frame] = data else {
                return Err(format!(
                    "token batch needs one data frame, got {}",
                    data.len()
                ));
            };
            let total: usize = lens.iter().map(|&l| l as usize).sum();
            if frame.len() != total * 4 {
                return Err(format!(
                    "token frame is {} bytes, lens need {}",
                    frame.len(),
                    total * 4
                ));
            }
            let mut ids = frame
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            Ok(BatchRows::Tokens(
                lens.iter()
                    .map(|&l| ids.by_ref().take(l as usize).collect())
                    .collect(),
            ))
        }
    }
}

/// Encodes token sequences as one frame (see [`RowsLayout::Tokens`]).
fn tokens_frame<'a>(seqs: impl IntoIterator<Item = &'a Vec<u32>>) -> (Vec<u32>, Bytes) {
    let mut lens = Vec::new();
    let mut bytes = Vec::new();
    for seq in seqs {
        lens.push(seq.len() as u32);
        seq.iter()
            .for_each(|id| bytes.extend_from_slice(&id.to_le_bytes()));
    }
    (lens, Bytes::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_messages_round_trip() {
        let seqs = vec![vec![101, 5, 102], vec![101, 102]];
        let (lens, frame) = tokens_frame(&seqs);
        let msg = ToWorker::Run {
            batch: 9,
            attempt: 1,
            model: 0,
            bucket: Some(Bucket::new(2, 16)),
            layout: RowsLayout::Tokens { lens },
        };
        let frames = encode(&msg, [frame]);
        let (back, data): (ToWorker, _) = decode(&frames).unwrap();
        assert_eq!(back, msg);
        let ToWorker::Run { layout, .. } = back else {
            unreachable!()
        };
        assert_eq!(
            rows_from_frames(&layout, data).unwrap(),
            BatchRows::Tokens(seqs)
        );

        let layout = RowsLayout::Features { features: 2 };
        let rows = rows_from_frames(
            &layout,
            &[
                crate::tensor::f32s_to_le(&[1.0, 2.0]),
                crate::tensor::f32s_to_le(&[3.0, 4.0, 5.0, 6.0]),
            ],
        )
        .unwrap();
        assert_eq!(rows.rows(), 3);
        assert!(rows_from_frames(&layout, &[Bytes::from_static(&[0; 6])]).is_err());
    }
}
