//! Counters and latency histograms, and the one place the typed stats are
//! made from them ([`super::stats`]): [`Metrics::snapshot`] (`replayctl
//! stats`, Prometheus's `/metrics`, HTTP `/stats`), [`Metrics::buckets_report`]
//! (`replayctl buckets`), [`Metrics::health`] and [`Metrics::devices`].
//!
//! One [`Metrics`] is shared (behind an `Arc`) by the frontend, the batcher
//! and the device actors. Updates take a short mutex: they happen once per
//! request or batch, never per row.
//!
//! Every count is since start-up (the uptime is in the snapshot); rates are
//! the reader's business (`replayctl stats --watch`, Prometheus's `rate()`).
//!
//! * A model's **graph hit rate** is the share of its successful replies
//!   whose every item ran in a captured graph (none eagerly).
//! * A bucket's **padding waste** is its padding tokens over its computed
//!   tokens (padded buckets: `batch · seq` slots per batch; packed buckets:
//!   the budget); `row_fill` is real rows over the bucket's rows.

use super::messages::{DeviceKind, DeviceStatus};
use super::stats::{
    BucketReport, BucketsReport, CumulativeHistogram, DevicesReport, Eager, GraphUse, Health,
    HistogramSummary, Latency, LatencyHistograms, ModelGrid, ModelReport, ModelRequests, Padding,
    Percentiles, QueueDepth, Requests, SeqCapAdvice, Stats, TransportReport,
};
use super::tuning::{Histogram as Hist, LadderKey, LadderSuggestion};
use crate::bucket::{Bucket, Grid, GridSpec};
use crate::protocol::{ErrorCode, Hops};
use crate::transport::{StatsSnapshot, TransportStats};
use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::watch;

// The device and graph records live with the other stats types; the device
// actors and the batcher name them from here.
pub use super::stats::{DeviceStats, EagerReason, GraphStats, ModelMemoryStats};

/// Use of one (model, bucket), counted when its batches complete (see
/// [`BucketReport`] for each count).
#[derive(Clone, Debug, Default)]
struct BucketCounters {
    requests: u64,
    parts: u64,
    batches: u64,
    rows: u64,
    padded_rows: u64,
    tokens: u64,
    padded_tokens: u64,
}

/// How a model is batched, for the stats (set at start-up; a reload
/// replaces its grid).
#[derive(Clone, Debug)]
pub struct ModelStats {
    pub name: String,
    /// `"padded"` or `"packed"`.
    pub batching: String,
    pub grid: GridSpec,
    /// What was read from the model folder and derived, each with the file
    /// and key it came from (the start-up log's list).
    pub folder: Vec<crate::model::Derived>,
}

/// Eager work, counted when eager batches complete.
#[derive(Clone, Debug, Default)]
struct EagerCounters {
    batches: u64,
    sequences: u64,
    tokens: u64,
}

struct Latencies {
    total: Histogram<u64>,
    queued: Histogram<u64>,
    compute: Histogram<u64>,
    /// The same, in fixed buckets (for Prometheus).
    total_buckets: Buckets,
    queued_buckets: Buckets,
    compute_buckets: Buckets,
}

/// Shards of the per-hop histograms ([`HopShards`]).
const HOP_SHARDS: usize = 8;

/// The per-hop histograms (one per [`Hops::NAMES`]), sharded by thread:
/// every reply records its hops, from whichever runtime thread sends it,
/// and one lock for all of them was the reply path's one contended lock.
/// Merged when the stats are taken.
struct HopShards(Box<[Mutex<Vec<Histogram<u64>>>]>);

impl HopShards {
    fn new() -> Self {
        HopShards((0..HOP_SHARDS).map(|_| Mutex::new(Self::empty())).collect())
    }

    fn empty() -> Vec<Histogram<u64>> {
        Hops::NAMES.iter().map(|_| histogram()).collect()
    }

    fn record(&self, hops: &Hops) {
        thread_local! {
            static SHARD: usize = {
                static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % HOP_SHARDS
            };
        }
        let shard = SHARD.with(|s| *s);
        let mut h = self.0[shard].lock().unwrap_or_else(|p| p.into_inner());
        for (h, v) in h.iter_mut().zip(hops.values()) {
            // 0 µs is recorded as the histogram's lowest value, 1 µs.
            let _ = h.record(v.max(1));
        }
    }

    fn merged(&self) -> Vec<Histogram<u64>> {
        let mut all = Self::empty();
        for shard in self.0.iter() {
            let shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            for (a, h) in all.iter_mut().zip(shard.iter()) {
                let _ = a.add(h);
            }
        }
        all
    }
}

/// A socket the stats report under `transport.<name>`.
pub(crate) struct Transport {
    name: &'static str,
    shards: Vec<Arc<TransportStats>>,
    /// Report each shard's counters too (`transport.<name>.shards`).
    sharded: bool,
}

pub(crate) struct Inner {
    requests_accepted: u64,
    replies_ok: u64,
    buckets: PerBucket<BucketCounters>,
    eager_requests: BTreeMap<EagerReason, u64>,
    eager_by_model: BTreeMap<String, u64>,
    eager_work: EagerCounters,
    /// Replies whose items ran in more than one batch.
    split_requests: u64,
    models: Vec<ModelStats>,
    errors: BTreeMap<ErrorCode, u64>,
    retried_batches: u64,
    /// Per model, each batcher shard's queued requests (index: shard).
    queue_depth: BTreeMap<String, Vec<u64>>,
    /// Each shard's requests waiting for an eager worker.
    eager_queue_depth: Vec<u64>,
    devices: Vec<DeviceStats>,
    statuses: Vec<watch::Receiver<DeviceStatus>>,
    /// Each socket's counters: one, or (`sharded`) one per shard of it.
    transports: Vec<Transport>,
    latency: Latencies,
    /// Per model: replies, errors, observed lengths.
    per_model: BTreeMap<String, ModelCounters>,
    /// Per (model, bucket): latency of the replies it is named in.
    bucket_latency: PerBucket<Histogram<u64>>,
    /// Each model's grid in force (a reload replaces it).
    grids: BTreeMap<String, Grid>,
    reloads: u64,
}

/// Values per (model, bucket), in that order; nested so that counting a
/// reply borrows the model's name (the batcher counts one per reply, under
/// the lock) instead of allocating a key each time.
#[derive(Debug)]
struct PerBucket<V>(BTreeMap<String, BTreeMap<Bucket, V>>);

impl<V> Default for PerBucket<V> {
    fn default() -> Self {
        PerBucket(BTreeMap::new())
    }
}

impl<V> PerBucket<V> {
    fn entry(&mut self, model: &str, bucket: Bucket, init: impl FnOnce() -> V) -> &mut V {
        if !self.0.contains_key(model) {
            self.0.insert(model.to_string(), BTreeMap::new());
        }
        let per_model = self.0.get_mut(model).expect("inserted");
        per_model.entry(bucket).or_insert_with(init)
    }

    fn get(&self, model: &str, bucket: Bucket) -> Option<&V> {
        self.0.get(model).and_then(|b| b.get(&bucket))
    }

    fn iter(&self) -> impl Iterator<Item = ((&str, Bucket), &V)> {
        self.0.iter().flat_map(|(model, b)| {
            b.iter()
                .map(move |(bucket, v)| ((model.as_str(), *bucket), v))
        })
    }
}

/// What is counted per model.
#[derive(Clone, Debug)]
struct ModelCounters {
    replies: u64,
    /// Replies whose every item ran in a graph.
    graph: u64,
    errors: BTreeMap<ErrorCode, u64>,
    /// Tokens of every item submitted (1 for feature rows).
    lengths: Hist,
    /// Real rows of each bucketed padded batch.
    batch_rows: Hist,
    /// Real tokens of each bucketed packed batch (as the budget counts them).
    batch_tokens: Hist,
    /// Sequences of each bucketed packed batch.
    batch_seqs: Hist,
}

impl ModelCounters {
    fn new(grid: Option<&Grid>) -> Self {
        // Exact lengths; batch token counts to 1/2048 of the largest budget.
        let token_granularity = match grid {
            Some(Grid::Packed(g)) => (g.max_tokens() as u64 / 2048).max(1),
            _ => 1,
        };
        ModelCounters {
            replies: 0,
            graph: 0,
            errors: BTreeMap::new(),
            lengths: Hist::new(1),
            batch_rows: Hist::new(1),
            batch_tokens: Hist::new(token_granularity),
            batch_seqs: Hist::new(1),
        }
    }
}

/// Upper bounds of the latency histograms Prometheus gets, in microseconds.
pub const LATENCY_BOUNDS_US: [u64; 18] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000, 30_000_000,
];

/// Exact cumulative counts at [`LATENCY_BOUNDS_US`], and the exact sum.
#[derive(Clone, Debug, Default)]
struct Buckets {
    le: [u64; LATENCY_BOUNDS_US.len()],
    sum_us: u64,
    count: u64,
}

impl Buckets {
    fn record(&mut self, us: u64) {
        for (n, &bound) in self.le.iter_mut().zip(&LATENCY_BOUNDS_US) {
            if us <= bound {
                *n += 1;
            }
        }
        self.sum_us += us;
        self.count += 1;
    }

    fn report(&self) -> CumulativeHistogram {
        CumulativeHistogram {
            le_us: LATENCY_BOUNDS_US.to_vec(),
            cumulative: self.le.to_vec(),
            sum_us: self.sum_us,
            count: self.count,
        }
    }
}

impl Inner {
    fn model_error(&mut self, model: &str, code: ErrorCode) {
        *self.errors.entry(code).or_default() += 1;
        *Inner::model(self, model).errors.entry(code).or_default() += 1;
    }

    fn model_reply(&mut self, model: &str, bucket: Option<Bucket>, total_us: u64) {
        let c = Inner::model(self, model);
        c.replies += 1;
        if let Some(bucket) = bucket {
            c.graph += 1;
            self.buckets.entry(model, bucket, Default::default).requests += 1;
            let _ = self
                .bucket_latency
                .entry(model, bucket, bucket_histogram)
                .record(total_us.max(1));
        }
    }

    fn observe_items(&mut self, model: &str, lens: &[u32]) {
        self.requests_accepted += 1;
        let c = Inner::model(self, model);
        for &len in lens {
            c.lengths.record(len as u64);
        }
    }

    fn eager_request(&mut self, model: &str, reason: EagerReason) {
        *self.eager_requests.entry(reason).or_default() += 1;
        *self.eager_by_model.entry(model.to_string()).or_default() += 1;
    }

    fn bucket_batch(&mut self, model: &str, bucket: Bucket, parts: u64, rows: u64, tokens: u64) {
        let c = self.buckets.entry(model, bucket, Default::default);
        c.parts += parts;
        c.batches += 1;
        c.rows += rows;
        c.padded_rows += bucket.rows() as u64 - rows;
        c.tokens += tokens;
        c.padded_tokens += bucket.tokens() as u64 - tokens;
        let mc = Inner::model(self, model);
        if bucket.is_packed() {
            mc.batch_tokens.record(tokens);
            mc.batch_seqs.record(rows);
        } else {
            mc.batch_rows.record(rows);
        }
    }

    fn eager_batch(&mut self, sequences: u64, tokens: u64) {
        self.eager_work.batches += 1;
        self.eager_work.sequences += sequences;
        self.eager_work.tokens += tokens;
    }

    fn reply_ok(&mut self, total_us: u64, queued_us: u64, compute_us: u64, batches: u32) {
        self.replies_ok += 1;
        if batches > 1 {
            self.split_requests += 1;
        }
        let l = &mut self.latency;
        let _ = l.total.record(total_us.max(1));
        let _ = l.queued.record(queued_us.max(1));
        let _ = l.compute.record(compute_us.max(1));
        l.total_buckets.record(total_us);
        l.queued_buckets.record(queued_us);
        l.compute_buckets.record(compute_us);
    }

    fn model<'a>(m: &'a mut Inner, model: &str) -> &'a mut ModelCounters {
        if !m.per_model.contains_key(model) {
            let c = ModelCounters::new(m.grids.get(model));
            m.per_model.insert(model.to_string(), c);
        }
        m.per_model.get_mut(model).expect("inserted")
    }
}

/// What the batcher observed while handling one message, recorded into
/// [`Metrics`] under one lock at its end ([`Metrics::record`]): the batcher
/// is the daemon's serial stage, and taking the shared lock three times a
/// request made it queue behind the request handlers that hold it too.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: Vec<Entry>,
    /// The token counts of every accepted request's items, in order.
    lens: Vec<u32>,
}

#[derive(Debug)]
enum Entry {
    /// A request accepted with the next `items` values of `lens`.
    Accepted {
        model: usize,
        items: usize,
    },
    Other(Observation),
}

/// One thing the batcher saw; `model` is the model's index.
#[derive(Debug)]
pub enum Observation {
    Eager {
        model: usize,
        reason: EagerReason,
    },
    ModelError {
        model: usize,
        code: ErrorCode,
    },
    /// A successful reply; see [`Metrics::model_reply`] and [`Metrics::reply_ok`].
    Reply {
        model: usize,
        bucket: Option<Bucket>,
        total_us: u64,
        queued_us: u64,
        compute_us: u64,
        batches: u32,
    },
    BucketBatch {
        model: usize,
        bucket: Bucket,
        parts: u64,
        rows: u64,
        tokens: u64,
    },
    EagerBatch {
        rows: u64,
        tokens: u64,
    },
    Retried,
}

impl Ledger {
    /// A request for `model` was accepted with items of these token counts.
    pub fn accepted(&mut self, model: usize, lens: &[u32]) {
        self.lens.extend_from_slice(lens);
        self.entries.push(Entry::Accepted {
            model,
            items: lens.len(),
        });
    }

    pub fn push(&mut self, o: Observation) {
        self.entries.push(Entry::Other(o));
    }
}

pub struct Metrics {
    started: Instant,
    inner: Mutex<Inner>,
    hops: HopShards,
    /// Busy time of the serial stages, outside the lock.
    pub stages: super::stages::Stages,
}

fn histogram() -> Histogram<u64> {
    // 1 µs .. 1 h, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// Per-bucket latency: 2 significant digits (about 25 KiB each).
fn bucket_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 2).expect("valid histogram bounds")
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            stages: Default::default(),
            hops: HopShards::new(),
            inner: Mutex::new(Inner {
                requests_accepted: 0,
                replies_ok: 0,
                buckets: PerBucket::default(),
                eager_requests: BTreeMap::new(),
                eager_by_model: BTreeMap::new(),
                eager_work: EagerCounters::default(),
                split_requests: 0,
                models: Vec::new(),
                errors: BTreeMap::new(),
                retried_batches: 0,
                queue_depth: BTreeMap::new(),
                eager_queue_depth: Vec::new(),
                devices: Vec::new(),
                statuses: Vec::new(),
                transports: Vec::new(),
                latency: Latencies {
                    total: histogram(),
                    queued: histogram(),
                    compute: histogram(),
                    total_buckets: Buckets::default(),
                    queued_buckets: Buckets::default(),
                    compute_buckets: Buckets::default(),
                },
                per_model: BTreeMap::new(),
                bucket_latency: PerBucket::default(),
                grids: BTreeMap::new(),
                reloads: 0,
            }),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn request_accepted(&self) {
        self.lock().requests_accepted += 1;
    }

    pub fn error(&self, code: ErrorCode) {
        *self.lock().errors.entry(code).or_default() += 1;
    }

    /// An error reply to a request for `model` (counted overall and for the model).
    pub fn model_error(&self, model: &str, code: ErrorCode) {
        self.lock().model_error(model, code);
    }

    /// A successful reply to a request for `model`, named after `bucket`
    /// (the largest shape that ran its items; `None`: some ran eagerly).
    pub fn model_reply(&self, model: &str, bucket: Option<Bucket>, total_us: u64) {
        self.lock().model_reply(model, bucket, total_us);
    }

    /// A request for `model` was accepted with items of these token counts.
    pub fn observe_items(&self, model: &str, lens: &[u32]) {
        self.lock().observe_items(model, lens);
    }

    /// Says which grid a model is served with (start-up, and each reload).
    pub fn set_model_grid(&self, model: &str, grid: &Grid) {
        let mut m = self.lock();
        if let Some(ms) = m.models.iter_mut().find(|ms| ms.name == model) {
            ms.batching = grid.batching().into();
            ms.grid = grid.describe();
        }
        if !m.per_model.contains_key(model) {
            m.per_model
                .insert(model.to_string(), ModelCounters::new(Some(grid)));
        }
        m.grids.insert(model.to_string(), grid.clone());
    }

    /// A reload took effect.
    pub fn reloaded(&self) {
        self.lock().reloads += 1;
    }

    pub fn eager_request(&self, model: &str, reason: EagerReason) {
        self.lock().eager_request(model, reason);
    }

    /// Says how each model is batched (start-up).
    pub fn set_models(&self, models: Vec<ModelStats>) {
        self.lock().models = models;
    }

    /// A bucketed batch completed: `parts` request parts, `rows` real rows,
    /// `tokens` real tokens over all rows.
    pub fn bucket_batch(&self, model: &str, bucket: Bucket, parts: u64, rows: u64, tokens: u64) {
        self.lock().bucket_batch(model, bucket, parts, rows, tokens);
    }

    /// A reply named `bucket` (the largest shape that ran its items).
    pub fn bucket_request(&self, model: &str, bucket: Bucket) {
        let mut m = self.lock();
        m.buckets.entry(model, bucket, Default::default).requests += 1;
    }

    /// An eager batch of `sequences` rows and `tokens` real tokens completed.
    pub fn eager_batch(&self, sequences: u64, tokens: u64) {
        self.lock().eager_batch(sequences, tokens);
    }

    /// A request was answered successfully; its items ran in `batches` batches.
    pub fn reply_ok(&self, total_us: u64, queued_us: u64, compute_us: u64, batches: u32) {
        self.lock()
            .reply_ok(total_us, queued_us, compute_us, batches);
    }

    /// Applies the batcher's observations of one turn under one lock, and
    /// empties `ledger`; `model_name` names a model by its index.
    pub fn record<'a>(&self, ledger: &mut Ledger, model_name: impl Fn(usize) -> &'a str) {
        if ledger.entries.is_empty() {
            return;
        }
        let mut m = self.lock();
        let mut lens = ledger.lens.as_slice();
        for e in ledger.entries.drain(..) {
            let o = match e {
                Entry::Accepted { model, items } => {
                    let (these, rest) = lens.split_at(items);
                    lens = rest;
                    m.observe_items(model_name(model), these);
                    continue;
                }
                Entry::Other(o) => o,
            };
            match o {
                Observation::Eager { model, reason } => m.eager_request(model_name(model), reason),
                Observation::ModelError { model, code } => m.model_error(model_name(model), code),
                Observation::Reply {
                    model,
                    bucket,
                    total_us,
                    queued_us,
                    compute_us,
                    batches,
                } => {
                    m.model_reply(model_name(model), bucket, total_us);
                    m.reply_ok(total_us, queued_us, compute_us, batches);
                }
                Observation::BucketBatch {
                    model,
                    bucket,
                    parts,
                    rows,
                    tokens,
                } => m.bucket_batch(model_name(model), bucket, parts, rows, tokens),
                Observation::EagerBatch { rows, tokens } => m.eager_batch(rows, tokens),
                Observation::Retried => m.retried_batches += 1,
            }
        }
        ledger.lens.clear();
    }

    /// Where a successful reply's time went (recorded as it is sent).
    pub fn reply_hops(&self, hops: &Hops) {
        self.hops.record(hops);
    }

    /// Batcher shard `shard` holds `depth` of `model`'s requests queued.
    pub fn set_queue_depth(&self, shard: usize, model: &str, depth: u64) {
        let mut m = self.lock();
        let per_shard = m.queue_depth.entry(model.to_string()).or_default();
        set_at(per_shard, shard, depth);
    }

    /// Batcher shard `shard` holds `depth` requests waiting for an eager worker.
    pub fn set_eager_queue_depth(&self, shard: usize, depth: u64) {
        set_at(&mut self.lock().eager_queue_depth, shard, depth);
    }

    /// Registers a device slot and the channel its status is published on;
    /// returns its index for [`Self::update_device`].
    pub fn add_device(&self, stats: DeviceStats, status: watch::Receiver<DeviceStatus>) -> usize {
        let mut m = self.lock();
        m.devices.push(stats);
        m.statuses.push(status);
        m.devices.len() - 1
    }

    pub fn update_device(&self, index: usize, f: impl FnOnce(&mut DeviceStats)) {
        if let Some(d) = self.lock().devices.get_mut(index) {
            f(d);
        }
    }

    /// Adds a socket whose counters the stats report under `transport.<name>`.
    pub fn set_transport(&self, name: &'static str, stats: Arc<TransportStats>) {
        self.lock().transports.push(Transport {
            name,
            shards: vec![stats],
            sharded: false,
        });
    }

    /// Adds a socket served by several shards (the client endpoint's
    /// ROUTERs): `transport.<name>` reports their counters summed, as one
    /// socket's, and `transport.<name>.shards` each shard's, in order.
    pub fn set_transport_shards(&self, name: &'static str, shards: Vec<Arc<TransportStats>>) {
        self.lock().transports.push(Transport {
            name,
            shards,
            sharded: true,
        });
    }

    /// Every device slot, with its current status.
    pub fn devices(&self) -> Vec<DeviceStats> {
        let m = self.lock();
        m.devices
            .iter()
            .zip(&m.statuses)
            .map(|(d, status)| DeviceStats {
                state: *status.borrow(),
                queued: device_queue(d, &m.queue_depth, &m.eager_queue_depth),
                ..d.clone()
            })
            .collect()
    }

    /// Every device slot's label, in slot order.
    pub fn device_labels(&self) -> Vec<String> {
        self.lock()
            .devices
            .iter()
            .map(|d| d.label.clone())
            .collect()
    }

    /// `replayctl devices`: every device slot, with its current status.
    pub fn devices_report(&self) -> DevicesReport {
        DevicesReport {
            devices: self.devices(),
        }
    }

    /// `replayctl health`, the HTTP `/health` routes (see [`Health::of`]).
    pub fn health(&self) -> Health {
        Health::of(&self.devices())
    }

    /// Everything `replayctl stats` shows; Prometheus's `/metrics` is
    /// encoded from it too.
    pub fn snapshot(&self) -> Stats {
        let hop_histograms = self.hops.merged();
        let m = self.lock();
        // Per model and overall: real and computed tokens over every bucket.
        let mut by_model: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for ((model, _), c) in m.buckets.iter() {
            let t = by_model.entry(model).or_default();
            t.0 += c.tokens;
            t.1 += c.tokens + c.padded_tokens;
        }
        let overall = by_model
            .values()
            .fold((0, 0), |(a, b), (t, c)| (a + t, b + c));
        let models = m
            .models
            .iter()
            .map(|ms| {
                let c = m.per_model.get(&ms.name);
                let (replies, graph) = c.map_or((0, 0), |c| (c.replies, c.graph));
                ModelReport {
                    name: ms.name.clone(),
                    batching: ms.batching.clone(),
                    grid: ms.grid.clone(),
                    folder: ms.folder.clone(),
                    padding: padding(by_model.get(ms.name.as_str()).copied().unwrap_or_default()),
                    requests: ModelRequests {
                        ok: replies,
                        graph,
                        eager: replies - graph,
                        errors: every_code(c.map(|c| &c.errors)),
                    },
                    graph_hit_rate: ratio(graph, replies),
                }
            })
            .collect();
        let buckets = m
            .buckets
            .iter()
            .map(|((model, bucket), c)| {
                let slots = c.rows + c.padded_rows;
                let computed = c.tokens + c.padded_tokens;
                let lat = m.bucket_latency.get(model, bucket);
                let q = |q: f64| lat.map_or(0, |h| h.value_at_quantile(q));
                BucketReport {
                    model: model.to_string(),
                    bucket: bucket.to_string(),
                    packed: bucket.is_packed(),
                    batch: bucket.rows(),
                    seq: match bucket {
                        Bucket::Padded { seq, .. } => seq,
                        Bucket::Packed { .. } => 0,
                    },
                    token_slots: bucket.tokens(),
                    requests: c.requests,
                    parts: c.parts,
                    batches: c.batches,
                    rows: c.rows,
                    padded_rows: c.padded_rows,
                    seq_slots: slots,
                    tokens: c.tokens,
                    padded_tokens: c.padded_tokens,
                    computed_tokens: computed,
                    padding_waste: ratio(c.padded_tokens, computed),
                    row_fill: ratio(c.rows, slots),
                    seq_fill: ratio(c.rows, slots),
                    token_fill: ratio(c.tokens, computed),
                    seqs_per_batch: ratio(c.rows, c.batches),
                    tokens_per_batch: ratio(c.tokens, c.batches),
                    p50_us: q(0.50),
                    p99_us: q(0.99),
                    in_grid: m.grids.get(model).is_none_or(|g| g.contains(bucket)),
                }
            })
            .collect();
        let mut devices = m.devices.clone();
        for (d, status) in devices.iter_mut().zip(&m.statuses) {
            d.state = *status.borrow();
        }
        Stats {
            uptime_s: self.started.elapsed().as_secs_f64(),
            requests: Requests {
                accepted: m.requests_accepted,
                ok: m.replies_ok,
                split: m.split_requests,
                errors: every_code(Some(&m.errors)),
            },
            models,
            buckets,
            padding: padding(overall),
            eager: Eager {
                requests: m.eager_requests.values().sum(),
                batches: m.eager_work.batches,
                sequences: m.eager_work.sequences,
                tokens: m.eager_work.tokens,
                by_reason: m.eager_requests.clone(),
                by_model: m.eager_by_model.clone(),
            },
            retried_batches: m.retried_batches,
            queue_depth: queue_depth(&m.queue_depth, &m.eager_queue_depth),
            latency: Latency {
                total: percentiles(&m.latency.total),
                queued: percentiles(&m.latency.queued),
                compute: percentiles(&m.latency.compute),
                histograms: LatencyHistograms {
                    total: m.latency.total_buckets.report(),
                    queued: m.latency.queued_buckets.report(),
                    compute: m.latency.compute_buckets.report(),
                },
                hops: Hops::NAMES
                    .iter()
                    .zip(&hop_histograms)
                    .map(|(name, h)| (name.to_string(), percentiles(h)))
                    .collect(),
            },
            reloads: m.reloads,
            devices,
            stages: self.stages.report(),
            transport: m
                .transports
                .iter()
                .map(|t| (t.name.to_string(), t.report()))
                .collect(),
        }
    }
}

impl Transport {
    fn report(&self) -> TransportReport {
        let shards: Vec<StatsSnapshot> = self.shards.iter().map(|s| s.snapshot()).collect();
        TransportReport {
            total: shards.iter().copied().sum(),
            shards: if self.sharded { shards } else { Vec::new() },
        }
    }
}

/// Writes `value` at `index`, growing `v` with zeros as needed.
fn set_at(v: &mut Vec<u64>, index: usize, value: u64) {
    if v.len() <= index {
        v.resize(index + 1, 0);
    }
    v[index] = value;
}

/// The queue depths over every shard, and each shard's over every model.
fn queue_depth(by_model: &BTreeMap<String, Vec<u64>>, eager: &[u64]) -> QueueDepth {
    let mut shards = vec![0u64; eager.len()];
    for per_shard in by_model.values() {
        for (s, &n) in per_shard.iter().enumerate() {
            let sum = shards.get(s).copied().unwrap_or(0) + n;
            set_at(&mut shards, s, sum);
        }
    }
    QueueDepth {
        by_model: by_model
            .iter()
            .map(|(name, per_shard)| (name.clone(), per_shard.iter().sum()))
            .collect(),
        eager: eager.iter().sum(),
        by_shard: shards,
    }
}

/// What waits for a device: its shard's queued requests (a graph device), or
/// every shard's eager queue (an eager device serves them all).
fn device_queue(d: &DeviceStats, by_model: &BTreeMap<String, Vec<u64>>, eager: &[u64]) -> u64 {
    match (d.role, d.shard) {
        (DeviceKind::Eager, _) => eager.iter().sum(),
        (_, Some(s)) => by_model.values().filter_map(|v| v.get(s)).sum(),
        (_, None) => 0,
    }
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    Percentiles {
        count: h.len(),
        p50_us: h.value_at_quantile(0.50),
        p90_us: h.value_at_quantile(0.90),
        p99_us: h.value_at_quantile(0.99),
        max_us: h.max(),
    }
}

fn padding((tokens, computed): (u64, u64)) -> Padding {
    Padding {
        tokens,
        computed_tokens: computed,
        padding_waste: ratio(computed - tokens, computed),
    }
}

/// Every error code with its count (0 for the codes never counted).
fn every_code(counts: Option<&BTreeMap<ErrorCode, u64>>) -> BTreeMap<ErrorCode, u64> {
    ErrorCode::ALL
        .iter()
        .map(|code| {
            (
                *code,
                counts.and_then(|c| c.get(code)).copied().unwrap_or(0),
            )
        })
        .collect()
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Seq-bucket sizes round to multiples of 8 and token budgets to 8 tokens
/// (tile-friendly on GPUs); batch sizes are exact.
const SEQ_ALIGN: u64 = 8;
const BUDGET_ALIGN: u64 = 8;

fn to_u64(v: &[usize]) -> Vec<u64> {
    v.iter().map(|&x| x as u64).collect()
}

impl Metrics {
    /// The grid view of `replayctl buckets`: per model, its buckets with
    /// their capture time and graph memory, the observed histograms, and a
    /// suggested grid of as many graphs that would have padded less.
    pub fn buckets_report(&self) -> BucketsReport {
        let m = self.lock();
        let empty = ModelCounters::new(None);
        let models = m
            .models
            .iter()
            .map(|ms| {
                let grid = m.grids.get(&ms.name);
                let c = m.per_model.get(&ms.name).unwrap_or(&empty);
                let graphs = grid
                    .map(|g| g.largest_first())
                    .unwrap_or_default()
                    .into_iter()
                    .rev()
                    .map(|bucket| {
                        let label = bucket.to_string();
                        let on: Vec<&GraphStats> = m
                            .devices
                            .iter()
                            .flat_map(|d| d.graphs.iter())
                            .filter(|g| g.model == ms.name && g.bucket == label)
                            .collect();
                        let counters = m.buckets.get(&ms.name, bucket);
                        let computed = counters.map_or(0, |c| c.tokens + c.padded_tokens);
                        GraphUse {
                            bucket: label,
                            devices: on.len() as u64,
                            capture_us: on.iter().map(|g| g.capture_us).max().unwrap_or(0),
                            memory_bytes: on.iter().map(|g| g.memory_bytes).max().unwrap_or(0),
                            batches: counters.map_or(0, |c| c.batches),
                            requests: counters.map_or(0, |c| c.requests),
                            padding_waste: counters
                                .map_or(0.0, |c| ratio(c.padded_tokens, computed)),
                        }
                    })
                    .collect();
                let mut suggestions: Vec<LadderSuggestion> = Vec::new();
                let mut seq_cap = None;
                match grid {
                    Some(Grid::Padded(g)) => {
                        if g.seqs() != [1] {
                            suggestions.push(LadderSuggestion::new(
                                LadderKey::SeqBuckets,
                                &c.lengths,
                                &to_u64(g.seqs()),
                                SEQ_ALIGN,
                            ));
                        }
                        suggestions.push(LadderSuggestion::new(
                            LadderKey::BatchBuckets,
                            &c.batch_rows,
                            &to_u64(g.batches()),
                            1,
                        ));
                    }
                    Some(Grid::Packed(g)) => {
                        suggestions.push(LadderSuggestion::new(
                            LadderKey::TokenBudgets,
                            &c.batch_tokens,
                            &to_u64(g.budgets()),
                            BUDGET_ALIGN,
                        ));
                        seq_cap = Some(seq_cap_advice(g, &c.batch_seqs, &c.lengths));
                    }
                    None => {}
                }
                ModelGrid {
                    name: ms.name.clone(),
                    batching: ms.batching.clone(),
                    grid: ms.grid.clone(),
                    graphs,
                    lengths: HistogramSummary::of(&c.lengths),
                    batch_rows: HistogramSummary::of(&c.batch_rows),
                    batch_tokens: HistogramSummary::of(&c.batch_tokens),
                    batch_seqs: HistogramSummary::of(&c.batch_seqs),
                    suggestions,
                    seq_cap,
                }
            })
            .collect();
        BucketsReport {
            uptime_s: self.started.elapsed().as_secs_f64(),
            models,
        }
    }
}

/// Whether a packed model's sequence cap limits its batches: the share of
/// batches that stopped at the cap, and the cap at which a full largest
/// budget of the shorter texts (the 10th percentile) would fit.
fn seq_cap_advice(g: &crate::bucket::TokenGrid, seqs: &Hist, lengths: &Hist) -> SeqCapAdvice {
    let cap = g.max_seqs_cap() as u64;
    let at_cap: u64 = seqs
        .counts
        .iter()
        .filter(|(&v, _)| v >= cap)
        .map(|(_, &c)| c)
        .sum();
    let share = ratio(at_cap, seqs.total());
    let short = lengths.quantile(0.10).unwrap_or(1).max(1);
    let wanted = (g.max_tokens() as u64)
        .div_ceil(short)
        .next_power_of_two()
        .min(65536);
    let suggested = if share > 0.05 && wanted > cap {
        wanted
    } else {
        cap
    };
    SeqCapAdvice {
        current: cap,
        batches_at_cap: at_cap,
        share_at_cap: share,
        suggested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batcher's ledger, recorded at the end of a turn, counts exactly
    /// what the same observations made one by one do.
    #[test]
    fn a_recorded_ledger_counts_what_direct_calls_count() {
        let names = ["enc", "mlp"];
        let (direct, deferred) = (Metrics::new(), Metrics::new());
        let mut ledger = Ledger::default();
        direct.observe_items("enc", &[20, 40]);
        ledger.accepted(0, &[20, 40]);
        direct.observe_items("mlp", &[1; 3]);
        ledger.accepted(1, &[1; 3]);
        direct.eager_request("enc", EagerReason::SeqTooLong);
        ledger.push(Observation::Eager {
            model: 0,
            reason: EagerReason::SeqTooLong,
        });
        direct.bucket_batch("enc", Bucket::packed(64, 8), 1, 2, 60);
        ledger.push(Observation::BucketBatch {
            model: 0,
            bucket: Bucket::packed(64, 8),
            parts: 1,
            rows: 2,
            tokens: 60,
        });
        direct.eager_batch(1, 300);
        ledger.push(Observation::EagerBatch {
            rows: 1,
            tokens: 300,
        });
        direct.model_reply("enc", Some(Bucket::packed(64, 8)), 700);
        direct.reply_ok(700, 100, 300, 2);
        ledger.push(Observation::Reply {
            model: 0,
            bucket: Some(Bucket::packed(64, 8)),
            total_us: 700,
            queued_us: 100,
            compute_us: 300,
            batches: 2,
        });
        direct.model_error("mlp", ErrorCode::Overloaded);
        ledger.push(Observation::ModelError {
            model: 1,
            code: ErrorCode::Overloaded,
        });
        direct.lock().retried_batches += 1;
        ledger.push(Observation::Retried);
        // Nothing is counted until the ledger is recorded.
        assert_eq!(deferred.snapshot().requests.accepted, 0);
        deferred.record(&mut ledger, |i| names[i]);
        let (mut want, mut got) = (direct.snapshot(), deferred.snapshot());
        for s in [&mut want, &mut got] {
            s.uptime_s = 0.0;
        }
        assert_eq!(got.requests.accepted, 2);
        assert_eq!(got, want);
        // Recording empties it.
        deferred.record(&mut ledger, |i| names[i]);
        assert_eq!(deferred.snapshot().requests.accepted, 2);
    }

    #[test]
    fn bucket_counters_and_padding() {
        let m = Metrics::new();
        m.bucket_batch("mlp", Bucket::new(8, 1), 2, 5, 5);
        m.bucket_batch("mlp", Bucket::new(8, 1), 1, 8, 8);
        m.bucket_request("mlp", Bucket::new(8, 1));
        m.bucket_request("mlp", Bucket::new(8, 1));
        m.error(ErrorCode::Overloaded);
        m.reply_ok(100, 10, 50, 1);
        m.reply_ok(100, 10, 50, 2);
        let s = m.snapshot();
        let b = &s.buckets[0];
        assert_eq!(b.bucket, "8x1");
        assert_eq!((b.requests, b.parts), (2, 3));
        assert_eq!(b.batches, 2);
        assert_eq!(b.rows, 13);
        assert_eq!(b.padded_rows, 3);
        assert_eq!(b.seq_slots, 16);
        assert_eq!(b.seqs_per_batch, 6.5);
        assert_eq!(s.requests.split, 1);
        assert_eq!(s.requests.errors[&ErrorCode::Overloaded], 1);
        assert_eq!(s.requests.errors[&ErrorCode::Internal], 0);
        assert_eq!(s.latency.total.count, 2);
        m.reply_hops(&Hops {
            decode: 3,
            device: 100,
            ..Default::default()
        });
        let hops = m.snapshot().latency.hops;
        assert_eq!(hops["decode"].p50_us, 3);
        assert_eq!(hops["device"].count, 1);
        assert_eq!(hops["reply"].max_us, 1);
    }

    #[test]
    fn packed_buckets_count_token_fill_and_padding_per_model_and_overall() {
        let m = Metrics::new();
        m.set_models(vec![ModelStats {
            name: "enc".into(),
            batching: "packed".into(),
            grid: GridSpec::Packed {
                token_budgets: vec![64, 256],
                max_seqs_per_batch: 16,
            },
            folder: Vec::new(),
        }]);
        // 3 sequences of 60 tokens in all, in the 64-token budget (16 slots).
        m.bucket_batch("enc", Bucket::packed(64, 16), 2, 3, 60);
        // 10 sequences, 200 tokens in the 256 budget.
        m.bucket_batch("enc", Bucket::packed(256, 16), 1, 10, 200);
        m.bucket_batch("mlp", Bucket::new(4, 1), 1, 3, 3);
        m.eager_batch(2, 600);
        let s = m.snapshot();
        let b = s.buckets.iter().find(|b| b.bucket == "64t").unwrap();
        assert!(b.packed);
        assert_eq!((b.tokens, b.computed_tokens), (60, 64));
        assert_eq!(b.padding_waste, 4.0 / 64.0);
        assert_eq!(b.token_fill, 60.0 / 64.0);
        assert_eq!(b.seq_fill, 3.0 / 16.0);
        assert_eq!(b.seqs_per_batch, 3.0);
        let enc = &s.models[0];
        assert_eq!(enc.batching, "packed");
        assert!(
            matches!(&enc.grid, GridSpec::Packed { token_budgets, .. } if token_budgets[1] == 256)
        );
        assert_eq!(enc.padding.tokens, 260);
        assert_eq!(enc.padding.computed_tokens, 320);
        assert_eq!(s.padding.tokens, 263);
        assert_eq!(s.padding.computed_tokens, 324);
        assert_eq!(s.padding.padding_waste, 61.0 / 324.0);
        assert_eq!(s.eager.sequences, 2);
        assert_eq!(s.eager.batches, 1);
    }
}
