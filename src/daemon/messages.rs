//! The map of the daemon's messages: what travels between the frontend, the
//! batcher and the device actors, and the one enum that says what state a
//! device is in. Data only: apart from reply channels these types hold no
//! actor handle, route or link, and this file imports no module of the
//! route, so every one of them can name these types and the arrows between
//! the files go one way. The handles live beside their owners:
//! [`super::route`] is the way to a device, [`super::report`] the way back,
//! and the supervisor's messages are in [`super::supervisor`].
//!
//! A request's route (see [`super`]): the frontend builds a [`Submission`]
//! and queues it ([`super::batcher::SubmitQueue`]); the batcher forms a
//! [`Batch`] and hands it to the device's [`super::route::DeviceRoute`],
//! which puts it in a slot of the worker's shared-memory ring or, when the
//! ring cannot take it, sends it as [`DeviceMsg::Run`] to the device actor
//! (and over the worker's socket). Whichever way it went, its outcome comes
//! back to the batcher as one [`BatcherMsg::Report`] ([`BatchReport`]: done
//! or failed), made in one place ([`super::report::Reporter`]). The device
//! actor reports [`BatcherMsg::DeviceDown`] when the worker dies (the
//! batcher then re-dispatches what that device held). The batcher answers
//! the request on the [`Submission::reply`] channel, exactly once.
//!
//! Every report from a device carries the batch's `attempt` and the device
//! it ran on, so the batcher can ignore a stale report from an attempt it has
//! already re-dispatched.

use super::output::OutputForm;
use crate::bucket::{Bucket, Grid};
use crate::model::BatchRows;
use crate::protocol::Reply;
use crate::worker::link::{FaultKind, WorkerError};
use bytes::Bytes;
use ractor::RpcReplyPort;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{oneshot, watch};

pub use super::batcher::queue::{BatchId, DeviceId, DeviceKind, RequestId, SchedulerConfig};

/// A request handed from the frontend to the batcher: its rows are validated
/// against the model (shapes, vocabulary, lengths).
pub struct Submission {
    /// Index of the model in the config.
    pub model: usize,
    /// The client's id, echoed in the reply.
    pub client_id: u64,
    pub input: BatchRows,
    pub priority: u8,
    pub received: Instant,
    pub deadline: Option<Instant>,
    /// The reply tensor's dtype and width.
    pub output: OutputForm,
    pub reply: oneshot::Sender<Reply>,
    /// When it got this far, for the reply's per-hop timings.
    pub stamps: Stamps,
}

/// When a request passed each point before the batcher
/// ([`crate::clock::mono_ns`]; 0 = not recorded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamps {
    /// The client socket's driver took it from libzmq.
    pub received_ns: u64,
    /// The frontend decoded and admitted it.
    pub decoded_ns: u64,
    /// Its rows were ready and it was handed to the batcher.
    pub submitted_ns: u64,
}

/// A formed batch: request parts in row order, and the bucket it runs in
/// (`None`: the eager path, exact shape). A request's items may be spread
/// over several batches; each part says which of its items it holds.
#[derive(Debug)]
pub struct Batch {
    pub id: BatchId,
    pub model: usize,
    pub bucket: Option<Bucket>,
    pub parts: Vec<BatchPart>,
    /// Real rows (sequences) over all parts: the worker returns one output
    /// row for each, in part order.
    pub rows: usize,
    /// Real tokens over all parts (rows, for models without a sequence axis).
    pub tokens: usize,
}

/// The items of one request that a batch holds.
#[derive(Debug)]
pub struct BatchPart {
    pub request: RequestId,
    /// Indices into the request's rows, increasing.
    pub items: Vec<u32>,
    /// Those rows (shared with the request when the part holds all of them).
    pub rows: Arc<BatchRows>,
}

/// What a finished batch brings back from the worker.
#[derive(Debug)]
pub struct BatchOutput {
    /// `rows · output_dim` little-endian f32, in the batch's row order.
    pub data: Bytes,
    pub output_dim: usize,
    /// Microseconds the worker spent on it (copy in, replay, copy out).
    pub compute_us: u64,
    /// When the worker took it and when its output was ready
    /// ([`crate::clock::mono_ns`]; 0 when not reported).
    pub started_ns: u64,
    pub finished_ns: u64,
    /// True when a captured graph ran it, false for the eager path.
    pub replayed: bool,
}

/// What became of one attempt of a batch on a device's worker, whichever
/// transport carried it.
#[derive(Debug)]
pub struct BatchReport {
    pub batch: BatchId,
    pub attempt: u32,
    pub outcome: BatchOutcome,
}

#[derive(Debug)]
pub enum BatchOutcome {
    Done(BatchOutput),
    /// The worker could not run the batch. A fatal error (the worker exits
    /// next) never reaches the batcher as a report: the worker's death
    /// re-dispatches the batch instead.
    Failed(WorkerError),
}

/// Messages to the batcher actor.
pub enum BatcherMsg {
    /// The [`super::batcher::SubmitQueue`] had been empty and holds submissions now.
    SubmitQueued,
    /// A timer fired: expire deadlines, dispatch aged queues.
    Tick,
    /// The device's worker captured every graph and takes work.
    DeviceUp { device: DeviceId },
    /// The device's worker is gone; re-dispatch what it held.
    DeviceDown { device: DeviceId, reason: String },
    /// What became of a batch this device ran (or was asked to run).
    Report {
        device: DeviceId,
        report: BatchReport,
    },
    /// Stop accepting, dispatch everything queued; answer when no request is left.
    Drain(RpcReplyPort<()>),
    /// Answer every request still held with `unavailable` (end of the grace period).
    Abort(RpcReplyPort<usize>),
    /// Requests accepted and not yet answered.
    Outstanding(RpcReplyPort<usize>),
    /// Send no new batches to this device (`true`) or take it back (`false`).
    SetDrained { device: DeviceId, drained: bool },
    /// A device's memory holds no graph for these buckets of `model`: the
    /// model's grid loses them (so no batch is formed that only the eager
    /// path, short of memory too, could run).
    CutGrid { model: usize, dropped: Vec<Bucket> },
    /// A reload: new scheduling limits, and the grids of the models whose
    /// grid changed (their queued items move to the new grid's lanes).
    /// Answers once in force.
    Reconfigure {
        config: SchedulerConfig,
        max_attempts: u32,
        grids: Vec<(usize, Grid)>,
        port: RpcReplyPort<()>,
    },
}

/// Messages to a device actor.
pub enum DeviceMsg {
    /// Run a batch on this device's worker.
    Run { batch: Arc<Batch>, attempt: u32 },
    /// Make the worker break its device (tests); answers the worker's reply.
    InjectFault(FaultKind, RpcReplyPort<Result<String, String>>),
    /// Kill the worker now (e.g. NVML reported a critical Xid); it restarts.
    Kill { reason: String },
    /// Stop the worker for good (daemon shutdown); answers once it exited.
    Stop(RpcReplyPort<()>),
    /// Start a new worker generation.
    Spawn,
    /// Take no new batches (`true`), or take them again; answers a line for the operator.
    Drain(bool, RpcReplyPort<Result<String, String>>),
    /// Finish what the worker holds, stop it and start a fresh one (which
    /// re-captures every graph); answers once the restart has begun.
    Restart(RpcReplyPort<Result<String, String>>),
    /// A reload changed these models' grids: capture the new buckets beside
    /// the old ones (or, without a ready worker, remember them for the next
    /// one). Answers once captured, with the number of new graphs.
    Capture {
        grids: Vec<(usize, Grid)>,
        port: RpcReplyPort<Result<usize, String>>,
    },
    /// Drop the graphs of these models that are not in these grids (after
    /// the batcher switched to them, or to roll a failed reload back).
    Release { grids: Vec<(usize, Grid)> },
    /// Workers started from now on read this config file (the daemon's
    /// configuration in force, written to the runtime directory).
    SetWorkerConfig(std::path::PathBuf),
    /// Something happened to worker generation `generation`.
    Worker { generation: u64, event: WorkerEvent },
}

/// What a device actor hears about its worker process.
pub enum WorkerEvent {
    /// A message on the worker link.
    Message(Vec<Bytes>),
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    StartTimeout,
    StopTimeout,
    /// Time to ask the watchdog whether the worker is stuck.
    WatchdogTick,
    /// A restart's drain took too long: stop the worker anyway.
    RestartTimeout,
    /// A reload's capture took too long: the worker is killed.
    CaptureTimeout,
}

/// The state of one device slot, as its device actor publishes it.
///
/// A worker's life: `starting` (the first one) or `restarting` (any later
/// one) while it loads its models, `capturing` while it captures graphs,
/// then `ready`. `draining` is a ready device that takes no new batches
/// (`replayctl drain`, or the first step of `replayctl restart`); `faulted`
/// has no worker (it exited, crashed or could not start) and a restart is
/// scheduled; `stopped` is for good (daemon shutdown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceStatus {
    /// The first worker process is starting: loading models.
    #[default]
    Starting,
    /// The worker is capturing its graphs.
    Capturing,
    /// The worker captured every graph and takes batches.
    Ready,
    /// Ready, but taking no new batches (drained by the operator or for a restart).
    Draining,
    /// No worker: it exited or could not start; a restart is scheduled.
    Faulted,
    /// A later worker process is starting (after a fault, a hang or `restart`).
    Restarting,
    /// Stopped for good (daemon shutdown).
    Stopped,
}

impl DeviceStatus {
    pub const ALL: [DeviceStatus; 7] = [
        DeviceStatus::Starting,
        DeviceStatus::Capturing,
        DeviceStatus::Ready,
        DeviceStatus::Draining,
        DeviceStatus::Faulted,
        DeviceStatus::Restarting,
        DeviceStatus::Stopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeviceStatus::Starting => "starting",
            DeviceStatus::Capturing => "capturing",
            DeviceStatus::Ready => "ready",
            DeviceStatus::Draining => "draining",
            DeviceStatus::Faulted => "faulted",
            DeviceStatus::Restarting => "restarting",
            DeviceStatus::Stopped => "stopped",
        }
    }

    /// A worker is running and has captured its graphs (ready or draining).
    pub fn is_up(self) -> bool {
        matches!(self, DeviceStatus::Ready | DeviceStatus::Draining)
    }

    /// A worker is on its way up (loading or capturing).
    pub fn is_coming_up(self) -> bool {
        matches!(
            self,
            DeviceStatus::Starting | DeviceStatus::Capturing | DeviceStatus::Restarting
        )
    }
}

/// Where a device actor publishes its [`DeviceStatus`]; the server, the
/// metrics and the control socket hold receivers. It outlives any one device
/// actor (the supervisor's replacement publishes on the same channel).
pub type StatusSender = Arc<watch::Sender<DeviceStatus>>;
