//! Counters and latency histograms, and the JSON that `replayctl stats`
//! prints.
//!
//! One [`Metrics`] is shared (behind an `Arc`) by the frontend, the batcher
//! and the device actors. Updates take a short mutex: they happen once per
//! request or batch, never per row.

use super::messages::DeviceStatus;
use crate::bucket::Bucket;
use crate::protocol::ErrorCode;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;
use tokio::sync::watch;

/// Why a request took the eager path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EagerReason {
    /// More rows than the largest batch bucket.
    BatchTooLarge,
    /// More tokens than the largest seq bucket.
    SeqTooLong,
}

/// Use of one (model, bucket), counted when its batches complete.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BucketCounters {
    pub requests: u64,
    pub batches: u64,
    /// Rows that carried a real input.
    pub rows: u64,
    /// Rows of padding (bucket batch size minus real rows).
    pub padded_rows: u64,
    /// Real tokens (rows · 1 for models without a sequence axis).
    pub tokens: u64,
    /// Padding tokens: bucket batch · seq minus real tokens.
    pub padded_tokens: u64,
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
    errors: BTreeMap<ErrorCode, u64>,
    retried_batches: u64,
    queue_depth: BTreeMap<String, u64>,
    eager_queue_depth: u64,
    devices: Vec<DeviceStats>,
    statuses: Vec<watch::Receiver<DeviceStatus>>,
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
                errors: BTreeMap::new(),
                retried_batches: 0,
                queue_depth: BTreeMap::new(),
                eager_queue_depth: 0,
                devices: Vec::new(),
                statuses: Vec::new(),
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

    /// A bucketed batch completed: `tokens` counts real tokens over all rows.
    pub fn bucket_batch(&self, model: &str, bucket: Bucket, requests: u64, rows: u64, tokens: u64) {
        let mut m = self.lock();
        let c = m.buckets.entry((model.to_string(), bucket)).or_default();
        c.requests += requests;
        c.batches += 1;
        c.rows += rows;
        c.padded_rows += bucket.rows() as u64 - rows;
        c.tokens += tokens;
        c.padded_tokens += bucket.tokens() as u64 - tokens;
    }

    /// A request was answered successfully.
    pub fn reply_ok(&self, total_us: u64, queued_us: u64, compute_us: u64) {
        let mut m = self.lock();
        m.replies_ok += 1;
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
        let buckets: Vec<serde_json::Value> = m
            .buckets
            .iter()
            .map(|((model, bucket), c)| {
                let slots = (c.rows + c.padded_rows).max(1);
                serde_json::json!({
                    "model": model,
                    "bucket": bucket.to_string(),
                    "packed": bucket.is_packed(),
                    // Padded: rows × tokens per row; packed: most sequences × token budget.
                    "batch": bucket.rows(),
                    "seq": match bucket { Bucket::Padded { seq, .. } => *seq, Bucket::Packed { .. } => 0 },
                    "token_slots": bucket.tokens(),
                    "requests": c.requests,
                    "batches": c.batches,
                    "rows": c.rows,
                    "padded_rows": c.padded_rows,
                    "tokens": c.tokens,
                    "padded_tokens": c.padded_tokens,
                    "padding_waste": c.padded_tokens as f64 / (c.tokens + c.padded_tokens).max(1) as f64,
                    "row_fill": c.rows as f64 / slots as f64,
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
                "errors": errors,
            },
            "buckets": buckets,
            "eager": {
                "requests": eager_total,
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
        m.error(ErrorCode::Overloaded);
        m.reply_ok(100, 10, 50);
        let s = m.snapshot();
        let b = &s["buckets"][0];
        assert_eq!(b["bucket"], "8x1");
        assert_eq!(b["requests"], 3);
        assert_eq!(b["batches"], 2);
        assert_eq!(b["rows"], 13);
        assert_eq!(b["padded_rows"], 3);
        assert_eq!(s["requests"]["errors"]["overloaded"], 1);
        assert_eq!(s["requests"]["errors"]["internal"], 0);
        assert_eq!(s["latency"]["total"]["count"], 1);
    }
}
