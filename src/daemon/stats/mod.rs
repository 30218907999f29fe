//! The daemon's statistics as typed values, made in one place and read by
//! field everywhere they are shown.
//!
//! * [`super::metrics::Metrics`] makes them: [`Stats`] (`snapshot`),
//!   [`BucketsReport`] (`buckets_report`), [`Health`] (`health`), and
//!   [`DevicesReport`] (`devices`).
//! * The control socket ([`super::control`]) sends them as JSON; these
//!   structs *are* that JSON, so `replayctl COMMAND --json` prints them (see
//!   docs/operating.md for the field names).
//! * `replayctl` reads them back into the same types and draws its tables
//!   from them ([`table`]); Prometheus's `/metrics` is encoded from a
//!   [`Stats`] ([`super::prometheus`]), and the HTTP routes answer
//!   [`Health`] and [`Stats`] ([`super::http`], [`super::prometheus::router`]).
//!
//! Every struct reads leniently (`#[serde(default)]` on each): a `replayctl`
//! of another version reads the fields it knows and zeros the ones the daemon
//! did not send. Every count is since start-up; rates are the reader's
//! business.

pub mod table;

use super::batcher::queue::DeviceKind;
use super::messages::DeviceStatus;
use super::tuning::{Histogram, LadderSuggestion};
use crate::bucket::GridSpec;
use crate::protocol::ErrorCode;
use crate::transport::StatsSnapshot;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[cfg(test)]
mod tests;

/// Why some of a request's items took the eager path. (A request is never
/// sent eagerly for its number of items: it is split over graph batches.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EagerReason {
    /// A sequence longer than the largest seq bucket (padded) or token
    /// budget (packed).
    SeqTooLong,
}

impl EagerReason {
    pub const ALL: [EagerReason; 1] = [EagerReason::SeqTooLong];

    pub fn as_str(self) -> &'static str {
        match self {
            EagerReason::SeqTooLong => "seq_too_long",
        }
    }
}

/// Everything `replayctl stats` shows: the control socket's `stats`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub uptime_s: f64,
    pub requests: Requests,
    /// One per configured model, in config order.
    pub models: Vec<ModelReport>,
    /// One per (model, bucket) that ran anything, by model then bucket.
    pub buckets: Vec<BucketReport>,
    /// Over every model's bucketed batches.
    pub padding: Padding,
    pub eager: Eager,
    /// Batches run again after their worker died.
    pub retried_batches: u64,
    pub queue_depth: QueueDepth,
    pub latency: Latency,
    /// Reloads that took effect.
    pub reloads: u64,
    pub devices: Vec<DeviceStats>,
    pub stages: StageTotals,
    /// Each socket's counters by name (`client`, `control`).
    pub transport: BTreeMap<String, TransportReport>,
}

/// Requests over every model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Requests {
    /// Requests the batcher accepted.
    pub accepted: u64,
    /// Successful replies.
    pub ok: u64,
    /// Successful replies whose items ran in more than one batch.
    pub split: u64,
    /// Error replies by code (every code, 0 included), those of no known
    /// model too.
    pub errors: BTreeMap<ErrorCode, u64>,
}

/// One model: how it is batched and what it served.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelReport {
    pub name: String,
    /// `"padded"` or `"packed"`.
    pub batching: String,
    /// The grid in force.
    pub grid: GridSpec,
    /// What was read from the model folder and derived (maximum length,
    /// pooling, modules, prompts, …), each with the file and key it came
    /// from; the same list the start-up log shows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub folder: Vec<crate::model::Derived>,
    /// Over the model's bucketed batches.
    pub padding: Padding,
    pub requests: ModelRequests,
    /// Replies served by graph replays only, over all successful replies.
    pub graph_hit_rate: f64,
}

/// One model's replies.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelRequests {
    pub ok: u64,
    /// Successful replies whose every item ran in a captured graph.
    pub graph: u64,
    /// Successful replies with some item run eagerly.
    pub eager: u64,
    /// Error replies by code (every code, 0 included).
    pub errors: BTreeMap<ErrorCode, u64>,
}

/// Real and computed tokens, and the share of padding.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Padding {
    pub tokens: u64,
    /// Real + padding tokens.
    pub computed_tokens: u64,
    /// 1 − real / computed tokens.
    pub padding_waste: f64,
}

/// Use of one (model, bucket), counted when its batches complete.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BucketReport {
    pub model: String,
    /// The bucket's label (`8x128`, `1024t`).
    pub bucket: String,
    pub packed: bool,
    /// Padded: rows per batch; packed: most sequences per batch.
    pub batch: usize,
    /// Padded: tokens per row; packed: 0.
    pub seq: usize,
    /// Padded: batch × seq; packed: the token budget.
    pub token_slots: usize,
    /// Replies named after this bucket (the largest shape that ran any of
    /// the request's items).
    pub requests: u64,
    /// Request parts run in this bucket: a request split over several
    /// batches counts once in each.
    pub parts: u64,
    pub batches: u64,
    /// Real rows (sequences) computed.
    pub rows: u64,
    /// Sequence slots left empty.
    pub padded_rows: u64,
    /// Real + empty sequence slots.
    pub seq_slots: u64,
    /// Real tokens (rows · 1 for models without a sequence axis).
    pub tokens: u64,
    pub padded_tokens: u64,
    pub computed_tokens: u64,
    /// 1 − real / computed tokens.
    pub padding_waste: f64,
    /// Real sequences over the bucket's sequence slots (`seq_fill` says the
    /// same; both are kept for scripts).
    pub row_fill: f64,
    pub seq_fill: f64,
    /// Real tokens over the token slots (the budget, when packed).
    pub token_fill: f64,
    pub seqs_per_batch: f64,
    pub tokens_per_batch: f64,
    /// Latency (receipt → reply) of the replies named after this bucket.
    pub p50_us: u64,
    pub p99_us: u64,
    /// Whether the bucket is in the model's grid in force (a reload may
    /// have replaced it; its counts stay).
    pub in_grid: bool,
}

/// Eager work.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Eager {
    /// Requests with items that ran eagerly.
    pub requests: u64,
    pub batches: u64,
    pub sequences: u64,
    pub tokens: u64,
    pub by_reason: BTreeMap<EagerReason, u64>,
    pub by_model: BTreeMap<String, u64>,
}

/// Requests waiting now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct QueueDepth {
    /// Requests with items waiting for a graph, per model.
    pub by_model: BTreeMap<String, u64>,
    /// Requests with items waiting for an eager worker.
    pub eager: u64,
    /// Each batcher shard's requests waiting for a graph, over every model
    /// (`batching.shards`; one entry with one shard).
    pub by_shard: Vec<u64>,
}

/// Latency of successful replies.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Latency {
    /// Receipt → reply.
    pub total: Percentiles,
    /// Receipt → its first batch sent.
    pub queued: Percentiles,
    /// Time its batches spent on the worker.
    pub compute: Percentiles,
    /// The same three in fixed buckets (what Prometheus gets).
    pub histograms: LatencyHistograms,
    /// Per hop (see docs/protocol.md), by hop name.
    pub hops: BTreeMap<String, Percentiles>,
}

/// Percentiles of a latency, in microseconds (0 while nothing was recorded).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Percentiles {
    pub count: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyHistograms {
    pub total: CumulativeHistogram,
    pub queued: CumulativeHistogram,
    pub compute: CumulativeHistogram,
}

/// Exact cumulative counts at fixed upper bounds, and the exact sum.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CumulativeHistogram {
    /// Upper bounds, in microseconds.
    pub le_us: Vec<u64>,
    /// Values at or below each bound.
    pub cumulative: Vec<u64>,
    pub sum_us: u64,
    pub count: u64,
}

/// What a device actor reports about its device and worker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceStats {
    pub label: String,
    /// Graph or eager.
    pub role: DeviceKind,
    /// Read from the device actor's status channel when the stats are taken.
    pub state: DeviceStatus,
    pub name: String,
    pub worker_pid: Option<u32>,
    /// Worker processes started after the first.
    pub restarts: u64,
    /// Worker exits caused by a device fault.
    pub device_faults: u64,
    /// Workers killed because the watchdog found them stuck.
    pub hangs: u64,
    pub last_error: Option<String>,
    pub startup_ms: Option<u64>,
    pub graphs: Vec<GraphStats>,
    /// Each model's device memory on the current worker (CUDA).
    pub models: Vec<ModelMemoryStats>,
    pub batches: u64,
    /// Batches served by replaying a captured graph.
    pub graph_replays: u64,
    /// Batches run eagerly (no graph).
    pub eager_runs: u64,
    /// Batches sent to the worker and not yet back.
    pub inflight: u64,
    /// Token slots those batches compute (a packed batch's budget, a
    /// padded one's batch × seq, an eager one's tokens).
    pub inflight_tokens: u64,
    /// Microseconds during which the worker held at least one batch (its
    /// rate is the device's busy fraction).
    pub busy_us: u64,
    /// The batcher shard that feeds it (`batching.shards`); none for an
    /// eager device, which every shard feeds.
    pub shard: Option<usize>,
    /// Requests waiting for it: its shard's queued requests with items for
    /// a graph (shared with the shard's other devices), or, for an eager
    /// device, every shard's eager queue.
    pub queued: u64,
    /// Drained by the operator (`replayctl drain`): takes no new batches.
    pub drained: bool,
    /// Graphs captured so far / to capture, while the worker captures.
    pub capture: Option<(usize, usize)>,
    /// While the worker compiles its kernels (none built in or cached for
    /// this GPU): the target, e.g. `Cubin(89)`.
    pub compiling_kernels: Option<String>,
    /// Batches that went through the shared-memory ring, and through the socket.
    pub shm_batches: u64,
    pub socket_batches: u64,
    /// The current worker's shared-memory ring: its slots (0 without one),
    /// and how many were free when it last handed one back (all of them
    /// once nothing is in flight; a new worker starts with a new ring).
    pub shm_slots: u64,
    pub shm_slots_free: u64,
    /// Live figures from NVML where available.
    pub gpu: Option<GpuReading>,
}

/// A model's device memory on one device: weights, the activation arena
/// its graphs share, its graphs' own buffers, and the buckets the start-up
/// memory budget left without a graph.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelMemoryStats {
    pub model: String,
    pub weights_bytes: u64,
    pub arena_bytes: u64,
    pub graph_bytes: u64,
    /// `bucket: needs N MiB, M MiB free`, one per dropped bucket.
    pub dropped: Vec<String>,
}

/// One captured graph on a device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GraphStats {
    pub model: String,
    pub bucket: String,
    pub capture_us: u64,
    pub memory_bytes: u64,
}

/// The latest NVML sample of a device's GPU, or why there is none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GpuReading {
    Sample(GpuSample),
    Unreadable { uuid: String, error: String },
}

impl GpuReading {
    /// The sample, when NVML could be read.
    pub fn sample(&self) -> Option<&GpuSample> {
        match self {
            GpuReading::Sample(s) => Some(s),
            GpuReading::Unreadable { .. } => None,
        }
    }
}

/// Live figures of one GPU (all processes on it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub uuid: String,
    pub pci_bus_id: String,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// `None` where NVML does not say.
    pub temperature_c: Option<u32>,
    pub utilization_pct: Option<u32>,
}

/// Busy time of the host path's serial stages and the waits between them
/// (see [`super::stages`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StageTotals {
    pub busy: StageBusy,
    pub delays: StageDelays,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StageBusy {
    /// Summed over the client socket shards' receive loops.
    pub frontend_loop: Busy,
    /// Summed over the batcher shards (`batching.shards`): busy time over
    /// wall time can reach the shard count; each shard is one serial task.
    pub batcher: Busy,
    /// Summed over the workers' ring readers.
    pub ring_reader: Busy,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StageDelays {
    pub socket_to_frontend: Waits,
    pub spawn_to_handler: Waits,
    pub batcher_mailbox: Waits,
}

/// A serial task's time working (not waiting), and its turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Busy {
    pub busy_us: u64,
    pub turns: u64,
}

/// The summed wait of messages between two stages, and how many.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Waits {
    pub sum_us: u64,
    pub count: u64,
}

/// One socket's counters (see docs/transport.md): the sum over its shards,
/// and each shard's when it has several.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TransportReport {
    #[serde(flatten)]
    pub total: StatsSnapshot,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<StatsSnapshot>,
}

/// The answer to `replayctl devices`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DevicesReport {
    pub devices: Vec<DeviceStats>,
}

/// The answer to `replayctl health`, the HTTP `/health` routes and the
/// systemd status line's source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    pub status: HealthStatus,
    pub devices: Vec<DeviceHealth>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Every device is ready.
    Ok,
    /// Some are up (ready or draining), not all are ready.
    Degraded,
    /// None is up yet, some are on their way.
    Starting,
    /// None is up or coming up.
    #[default]
    Down,
}

impl HealthStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthStatus::Ok => "ok",
            HealthStatus::Degraded => "degraded",
            HealthStatus::Starting => "starting",
            HealthStatus::Down => "down",
        }
    }

    /// Some device takes requests (`ok` or `degraded`).
    pub fn serving(self) -> bool {
        matches!(self, HealthStatus::Ok | HealthStatus::Degraded)
    }
}

/// One device in [`Health`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceHealth {
    pub device: String,
    pub role: DeviceKind,
    pub state: DeviceStatus,
    pub restarts: u64,
    pub last_error: Option<String>,
}

impl Health {
    /// `ok` when every device is ready, `degraded` when some are up (ready
    /// or draining) but not all are ready, `starting` while none is up yet
    /// but some are on their way, else `down`.
    pub fn of(devices: &[DeviceStats]) -> Health {
        let ready = devices
            .iter()
            .filter(|d| d.state == DeviceStatus::Ready)
            .count();
        let up = devices.iter().filter(|d| d.state.is_up()).count();
        let coming = devices.iter().filter(|d| d.state.is_coming_up()).count();
        let status = if ready == devices.len() && ready > 0 {
            HealthStatus::Ok
        } else if up > 0 {
            HealthStatus::Degraded
        } else if coming > 0 {
            HealthStatus::Starting
        } else {
            HealthStatus::Down
        };
        Health {
            status,
            devices: devices
                .iter()
                .map(|d| DeviceHealth {
                    device: d.label.clone(),
                    role: d.role,
                    state: d.state,
                    restarts: d.restarts,
                    last_error: d.last_error.clone(),
                })
                .collect(),
        }
    }
}

/// The grid view of `replayctl buckets`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BucketsReport {
    pub uptime_s: f64,
    pub models: Vec<ModelGrid>,
}

/// One model's grid, what it observed, and the grid it suggests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelGrid {
    pub name: String,
    pub batching: String,
    pub grid: GridSpec,
    /// Each bucket of the grid, smallest first.
    pub graphs: Vec<GraphUse>,
    /// Tokens of every item submitted (1 for feature rows).
    pub lengths: HistogramSummary,
    /// Real rows of each padded batch.
    pub batch_rows: HistogramSummary,
    /// Real tokens of each packed batch.
    pub batch_tokens: HistogramSummary,
    /// Sequences of each packed batch.
    pub batch_seqs: HistogramSummary,
    pub suggestions: Vec<LadderSuggestion>,
    /// Packed models: whether the sequence cap limits batches.
    pub seq_cap: Option<SeqCapAdvice>,
}

/// One bucket of a grid: its graphs (the largest capture time and memory
/// over the devices holding it) and its use.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GraphUse {
    pub bucket: String,
    /// Devices holding its graph.
    pub devices: u64,
    pub capture_us: u64,
    pub memory_bytes: u64,
    pub batches: u64,
    pub requests: u64,
    pub padding_waste: f64,
}

/// A histogram's summary, with up to 24 (upper bound, count) bins.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HistogramSummary {
    pub count: u64,
    pub mean: f64,
    pub p50: Option<u64>,
    pub p90: Option<u64>,
    pub p99: Option<u64>,
    pub max: Option<u64>,
    pub granularity: u64,
    pub bins: Vec<(u64, u64)>,
}

impl HistogramSummary {
    pub fn of(h: &Histogram) -> Self {
        HistogramSummary {
            count: h.total(),
            mean: h.mean(),
            p50: h.quantile(0.50),
            p90: h.quantile(0.90),
            p99: h.quantile(0.99),
            max: h.counts.keys().last().copied(),
            granularity: h.granularity,
            bins: h.coarse(24),
        }
    }
}

/// Whether a packed model's sequence cap limits its batches.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SeqCapAdvice {
    /// `max_seqs_per_batch` in force.
    pub current: u64,
    pub batches_at_cap: u64,
    pub share_at_cap: f64,
    /// The cap at which a full largest budget of the shorter texts would fit
    /// (`current` when the cap rarely limits).
    pub suggested: u64,
}

/// The answer to `replayctl reload`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReloadReport {
    /// The config keys that changed (none: nothing to apply).
    pub changed: Vec<String>,
    /// Models whose grid changed, with the grid now in force.
    pub models: Vec<ReloadedModel>,
    /// Graphs captured for the new grids, over every device.
    pub graphs_captured: u64,
    /// `"nothing changed"` when nothing did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReloadedModel {
    pub model: String,
    pub batching: String,
    pub grid: GridSpec,
}
