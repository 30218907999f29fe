//! Counters and latency histograms, and the JSON that `replayctl stats`
//! prints.
//!
//! One [`Metrics`] is shared (behind an `Arc`) by the frontend, the batcher
//! and the device actors. Updates take a short mutex: they happen once per
//! request or batch, never per row.

use super::messages::DeviceStatus;
use crate::bucket::Bucket;
use crate::protocol::ErrorCode;
use crate::transport::TransportStats;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::watch;

/// Why some of a request's items took the eager path. (A request is never
/// sent eagerly for its number of items: it is split over graph batches.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EagerReason {
    /// A sequence longer than the largest seq bucket (padded) or token
    /// budget (packed).
    SeqTooLong,
}

/// Use of one (model, bucket), counted when its batches complete.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BucketCounters {
    /// Replies whose `bucket` is this one (the largest shape that ran any
    /// of the request's items), counted when the reply is sent.
    pub requests: u64,
    /// Request parts run in this bucket: a request split over several
    /// batches counts once in each.
    pub parts: u64,
    pub batches: u64,
    /// Real rows (sequences) computed.
    pub rows: u64,
    /// Sequence slots left empty: the bucket's rows (batch size, or most
    /// sequences of a packed budget) minus real rows.
    pub padded_rows: u64,
    /// Real tokens (rows · 1 for models without a sequence axis).
    pub tokens: u64,
    /// Padding tokens: the bucket's token slots (batch · seq, or the
    /// budget) minus real tokens.
    pub padded_tokens: u64,
}

/// How a model is batched, for the stats (set once at start-up).
#[derive(Clone, Debug, Serialize)]
pub struct ModelStats {
    pub name: String,
    /// `"padded"` or `"packed"`.
    pub batching: String,
    /// Padded: `batch_buckets` and `seq_buckets`; packed: `token_budgets`
    /// and `max_seqs_per_batch`.
    pub grid: serde_json::Value,
    /// What was read from the model folder and derived (maximum length,
    /// pooling, modules, prompts, …), each with the file and key it came
    /// from; the same list the start-up log shows.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub folder: Vec<crate::model::Derived>,
}

/// Eager work, counted when eager batches complete.
#[derive(Clone, Debug, Default)]
struct EagerCounters {
    batches: u64,
    sequences: u64,
    tokens: u64,
}

/// What a device actor reports about its device and worker.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceStats {
    pub label: String,
    /// "graph" or "eager".
    pub role: String,
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
    pub batches: u64,
    /// Batches served by replaying a captured graph.
    pub graph_replays: u64,
    /// Batches run eagerly (no graph).
    pub eager_runs: u64,
    /// Live figures from NVML where available.
    pub gpu: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GraphStats {
    pub model: String,
    pub bucket: String,
    pub capture_us: u64,
    pub memory_bytes: u64,
}

struct Latencies {
    total: Histogram<u64>,
    queued: Histogram<u64>,
    compute: Histogram<u64>,
}

struct Inner {
    requests_accepted: u64,
    replies_ok: u64,
    buckets: BTreeMap<(String, Bucket), BucketCounters>,
    eager_requests: BTreeMap<EagerReason, u64>,
    eager_by_model: BTreeMap<String, u64>,
    eager_work: EagerCounters,
    /// Replies whose items ran in more than one batch.
    split_requests: u64,
    models: Vec<ModelStats>,
    errors: BTreeMap<ErrorCode, u64>,
    retried_batches: u64,
    queue_depth: BTreeMap<String, u64>,
    eager_queue_depth: u64,
    devices: Vec<DeviceStats>,
    statuses: Vec<watch::Receiver<DeviceStatus>>,
    transports: Vec<(&'static str, Arc<TransportStats>)>,
    latency: Latencies,
}

pub struct Metrics {
    started: Instant,
    inner: Mutex<Inner>,
}

fn histogram() -> Histogram<u64> {
    // 1 µs .. 1 h, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
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
            inner: Mutex::new(Inner {
                requests_accepted: 0,
                replies_ok: 0,
                buckets: BTreeMap::new(),
                eager_requests: BTreeMap::new(),
                eager_by_model: BTreeMap::new(),
                eager_work: EagerCounters::default(),
                split_requests: 0,
                models: Vec::new(),
                errors: BTreeMap::new(),
                retried_batches: 0,
                queue_depth: BTreeMap::new(),
                eager_queue_depth: 0,
                devices: Vec::new(),
                statuses: Vec::new(),
                transports: Vec::new(),
                latency: Latencies {
                    total: histogram(),
                    queued: histogram(),
                    compute: histogram(),
                },
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn request_accepted(&self) {
        self.lock().requests_accepted += 1;
    }

    pub fn error(&self, code: ErrorCode) {
        *self.lock().errors.entry(code).or_default() += 1;
    }

    pub fn eager_request(&self, model: &str, reason: EagerReason) {
        let mut m = self.lock();
        *m.eager_requests.entry(reason).or_default() += 1;
        *m.eager_by_model.entry(model.to_string()).or_default() += 1;
    }

    pub fn batch_retried(&self) {
        self.lock().retried_batches += 1;
    }

    /// Says how each model is batched (start-up).
    pub fn set_models(&self, models: Vec<ModelStats>) {
        self.lock().models = models;
    }

    /// A bucketed batch completed: `parts` request parts, `rows` real rows,
    /// `tokens` real tokens over all rows.
    pub fn bucket_batch(&self, model: &str, bucket: Bucket, parts: u64, rows: u64, tokens: u64) {
        let mut m = self.lock();
        let c = m.buckets.entry((model.to_string(), bucket)).or_default();
        c.parts += parts;
        c.batches += 1;
        c.rows += rows;
        c.padded_rows += bucket.rows() as u64 - rows;
        c.tokens += tokens;
        c.padded_tokens += bucket.tokens() as u64 - tokens;
    }

    /// A reply named `bucket` (the largest shape that ran its items).
    pub fn bucket_request(&self, model: &str, bucket: Bucket) {
        let mut m = self.lock();
        m.buckets
            .entry((model.to_string(), bucket))
            .or_default()
            .requests += 1;
    }

    /// An eager batch of `sequences` rows and `tokens` real tokens completed.
    pub fn eager_batch(&self, sequences: u64, tokens: u64) {
        let mut m = self.lock();
        m.eager_work.batches += 1;
        m.eager_work.sequences += sequences;
        m.eager_work.tokens += tokens;
    }

    /// A request was answered successfully; its items ran in `batches` batches.
    pub fn reply_ok(&self, total_us: u64, queued_us: u64, compute_us: u64, batches: u32) {
        let mut m = self.lock();
        m.replies_ok += 1;
        if batches > 1 {
            m.split_requests += 1;
        }
        let _ = m.latency.total.record(total_us.max(1));
        let _ = m.latency.queued.record(queued_us.max(1));
        let _ = m.latency.compute.record(compute_us.max(1));
    }

    pub fn set_queue_depth(&self, model: &str, depth: u64) {
        self.lock().queue_depth.insert(model.to_string(), depth);
    }

    pub fn set_eager_queue_depth(&self, depth: u64) {
        self.lock().eager_queue_depth = depth;
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
        self.lock().transports.push((name, stats));
    }

    /// Every device slot, with its current status.
    pub fn devices(&self) -> Vec<DeviceStats> {
        let m = self.lock();
        m.devices
            .iter()
            .zip(&m.statuses)
            .map(|(d, status)| DeviceStats {
                state: *status.borrow(),
                ..d.clone()
            })
            .collect()
    }

    /// Everything, as the JSON document `replayctl stats --json` prints.
    pub fn snapshot(&self) -> serde_json::Value {
        let m = self.lock();
        let pct = |h: &Histogram<u64>| {
            serde_json::json!({
                "count": h.len(),
                "p50_us": h.value_at_quantile(0.50),
                "p90_us": h.value_at_quantile(0.90),
                "p99_us": h.value_at_quantile(0.99),
                "max_us": h.max(),
            })
        };
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        // Per model and overall: real and computed tokens over every bucket.
        let mut by_model: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for ((model, _), c) in &m.buckets {
            let t = by_model.entry(model.as_str()).or_default();
            t.0 += c.tokens;
            t.1 += c.tokens + c.padded_tokens;
        }
        let padding = |(tokens, computed): (u64, u64)| {
            serde_json::json!({
                "tokens": tokens,
                "computed_tokens": computed,
                "padding_waste": ratio(computed - tokens, computed),
            })
        };
        let overall = by_model
            .values()
            .fold((0, 0), |(a, b), (t, c)| (a + t, b + c));
        let models: Vec<serde_json::Value> = m
            .models
            .iter()
            .map(|ms| {
                let mut v = serde_json::to_value(ms).expect("model stats serialise");
                let t = by_model.get(ms.name.as_str()).copied().unwrap_or_default();
                v["padding"] = padding(t);
                v
            })
            .collect();
        let buckets: Vec<serde_json::Value> = m
            .buckets
            .iter()
            .map(|((model, bucket), c)| {
                let slots = c.rows + c.padded_rows;
                let computed = c.tokens + c.padded_tokens;
                serde_json::json!({
                    "model": model,
                    "bucket": bucket.to_string(),
                    "packed": bucket.is_packed(),
                    // Padded: rows × tokens per row; packed: most sequences × token budget.
                    "batch": bucket.rows(),
                    "seq": match bucket { Bucket::Padded { seq, .. } => *seq, Bucket::Packed { .. } => 0 },
                    "token_slots": bucket.tokens(),
                    "requests": c.requests,
                    "parts": c.parts,
                    "batches": c.batches,
                    "rows": c.rows,
                    "padded_rows": c.padded_rows,
                    "seq_slots": slots,
                    "tokens": c.tokens,
                    "padded_tokens": c.padded_tokens,
                    "computed_tokens": computed,
                    // 1 − real / computed tokens.
                    "padding_waste": ratio(c.padded_tokens, computed),
                    // Real sequences over the bucket's sequence slots.
                    "row_fill": ratio(c.rows, slots),
                    "seq_fill": ratio(c.rows, slots),
                    // Real tokens over the token slots (the budget, when packed).
                    "token_fill": ratio(c.tokens, computed),
                    "seqs_per_batch": ratio(c.rows, c.batches),
                    "tokens_per_batch": ratio(c.tokens, c.batches),
                })
            })
            .collect();
        let errors: BTreeMap<&str, u64> = ErrorCode::ALL
            .iter()
            .map(|c| (c.as_str(), m.errors.get(c).copied().unwrap_or(0)))
            .collect();
        let eager_total: u64 = m.eager_requests.values().sum();
        let mut devices = m.devices.clone();
        for (d, status) in devices.iter_mut().zip(&m.statuses) {
            d.state = *status.borrow();
        }
        serde_json::json!({
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "requests": {
                "accepted": m.requests_accepted,
                "ok": m.replies_ok,
                "split": m.split_requests,
                "errors": errors,
            },
            "models": models,
            "buckets": buckets,
            "padding": padding(overall),
            "eager": {
                "requests": eager_total,
                "batches": m.eager_work.batches,
                "sequences": m.eager_work.sequences,
                "tokens": m.eager_work.tokens,
                "by_reason": m.eager_requests,
                "by_model": m.eager_by_model,
            },
            "retried_batches": m.retried_batches,
            "queue_depth": {
                "by_model": m.queue_depth,
                "eager": m.eager_queue_depth,
            },
            "latency": {
                "total": pct(&m.latency.total),
                "queued": pct(&m.latency.queued),
                "compute": pct(&m.latency.compute),
            },
            "devices": devices,
            "transport": m
                .transports
                .iter()
                .map(|(name, t)| (name.to_string(), serde_json::to_value(t.snapshot()).unwrap_or_default()))
                .collect::<serde_json::Map<_, _>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let b = &s["buckets"][0];
        assert_eq!(b["bucket"], "8x1");
        assert_eq!(
            (b["requests"].as_u64(), b["parts"].as_u64()),
            (Some(2), Some(3))
        );
        assert_eq!(b["batches"], 2);
        assert_eq!(b["rows"], 13);
        assert_eq!(b["padded_rows"], 3);
        assert_eq!(b["seq_slots"], 16);
        assert_eq!(b["seqs_per_batch"], 6.5);
        assert_eq!(s["requests"]["split"], 1);
        assert_eq!(s["requests"]["errors"]["overloaded"], 1);
        assert_eq!(s["requests"]["errors"]["internal"], 0);
        assert_eq!(s["latency"]["total"]["count"], 2);
    }

    #[test]
    fn packed_buckets_count_token_fill_and_padding_per_model_and_overall() {
        let m = Metrics::new();
        m.set_models(vec![ModelStats {
            name: "enc".into(),
            batching: "packed".into(),
            grid: serde_json::json!({"token_budgets": [64, 256], "max_seqs_per_batch": 16}),
            folder: Vec::new(),
        }]);
        // 3 sequences of 60 tokens in all, in the 64-token budget (16 slots).
        m.bucket_batch("enc", Bucket::packed(64, 16), 2, 3, 60);
        // 10 sequences, 200 tokens in the 256 budget.
        m.bucket_batch("enc", Bucket::packed(256, 16), 1, 10, 200);
        m.bucket_batch("mlp", Bucket::new(4, 1), 1, 3, 3);
        m.eager_batch(2, 600);
        let s = m.snapshot();
        let b = s["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["bucket"] == "64t")
            .unwrap()
            .clone();
        assert_eq!(b["packed"], true);
        assert_eq!(
            (b["tokens"].as_u64(), b["computed_tokens"].as_u64()),
            (Some(60), Some(64))
        );
        assert_eq!(b["padding_waste"], 4.0 / 64.0);
        assert_eq!(b["token_fill"], 60.0 / 64.0);
        assert_eq!(b["seq_fill"], 3.0 / 16.0);
        assert_eq!(b["seqs_per_batch"], 3.0);
        let enc = &s["models"][0];
        assert_eq!(enc["batching"], "packed");
        assert_eq!(enc["grid"]["token_budgets"][1], 256);
        assert_eq!(enc["padding"]["tokens"], 260);
        assert_eq!(enc["padding"]["computed_tokens"], 320);
        assert_eq!(s["padding"]["tokens"], 263);
        assert_eq!(s["padding"]["computed_tokens"], 324);
        assert_eq!(s["padding"]["padding_waste"], 61.0 / 324.0);
        assert_eq!(s["eager"]["sequences"], 2);
        assert_eq!(s["eager"]["batches"], 1);
    }
}
