//! Prometheus metrics: `GET /metrics` on `metrics.endpoint` (a loopback
//! address; off unless configured), in the Prometheus text format (0.0.4),
//! beside the same numbers as JSON (`GET /stats`, `replayctl stats --json`'s
//! document) and `GET /health`.
//!
//! Each scrape takes one [`Stats`] snapshot and encodes it through the
//! `prometheus-client` crate: a [`Registry`] (prefix `replayd`) holding one
//! [`Collector`] over the snapshot, whose families are the crate's constant
//! counters and gauges and, for the latency histograms, a metric that hands
//! the snapshot's exact bucket counts to the crate's histogram encoding. The
//! crate names the series (`_total` on counters) and escapes label values.
//! So `/metrics` and `replayctl stats` never disagree.
//!
//! Names follow Prometheus conventions: `_total` counters, `_seconds` and
//! `_bytes` units, ratios in 0..1, and an enum (the device state) as one
//! series per state with value 0 or 1. Every count is since the daemon
//! started; graph rates (`rate(replayd_bucket_padded_tokens_total[5m]) /
//! rate(replayd_bucket_computed_tokens_total[5m])` is the padding waste of
//! the last five minutes).

use super::messages::DeviceStatus;
use super::metrics::Metrics;
use super::stats::{
    BucketReport, CumulativeHistogram, DeviceStats, EagerReason, GraphStats, ModelReport, Stats,
};
use crate::protocol::ErrorCode;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::fmt;
use std::sync::Arc;

/// The text exposition of a stats snapshot.
pub fn render(stats: Stats) -> String {
    let mut registry = Registry::with_prefix("replayd");
    registry.register_collector(Box::new(Exposition(stats)));
    let mut text = String::with_capacity(16 << 10);
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &registry);
    text
}

/// The routes of the metrics listener: `/metrics`, `/stats`, `/health`.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/stats", get(stats_json))
        .route("/health", get(health_json))
        .route(
            "/",
            get(|| async { "replayd: /metrics (Prometheus), /stats, /health\n" }),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found: try /metrics, /stats or /health\n",
            )
        })
        .with_state(metrics)
}

async fn scrape(State(metrics): State<Arc<Metrics>>) -> Response {
    metrics_reply(metrics.snapshot())
}

async fn stats_json(State(metrics): State<Arc<Metrics>>) -> Response {
    stats_reply(metrics.snapshot())
}

async fn health_json(State(metrics): State<Arc<Metrics>>) -> Response {
    super::http::health_reply(metrics.health())
}

/// `GET /metrics`: the exposition of `stats`.
pub fn metrics_reply(stats: Stats) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        )],
        render(stats),
    )
        .into_response()
}

/// `GET /stats`: `replayctl stats --json`'s document.
pub fn stats_reply(stats: Stats) -> Response {
    Json(stats).into_response()
}

/// The families of one snapshot, encoded on each scrape.
#[derive(Debug)]
struct Exposition(Stats);

/// A label set: (name, value) pairs.
type Labels<'a, const N: usize> = [(&'static str, &'a str); N];

const NONE: Labels<'static, 0> = [];

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: f64) -> ConstGauge<f64> {
    ConstGauge::new(v)
}

fn count(v: u64) -> ConstGauge<u64> {
    ConstGauge::new(v)
}

/// Writes one family: its `# HELP` and `# TYPE`, then a sample per label
/// set (a family with no samples keeps its header, so dashboards see it).
fn family<L, M>(
    out: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: impl IntoIterator<Item = (L, M)>,
) -> fmt::Result
where
    L: EncodeLabelSet,
    M: EncodeMetric + TypedMetric,
{
    let mut encoder = out.encode_descriptor(name, help, None, M::TYPE)?;
    for (labels, metric) in series {
        metric.encode(encoder.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A latency histogram of the snapshot, in seconds.
#[derive(Debug)]
struct Seconds<'a>(&'a CumulativeHistogram);

impl TypedMetric for Seconds<'_> {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Seconds<'_> {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        // The encoder takes each bucket's own count and adds them up again.
        let mut below = 0;
        let buckets: Vec<(f64, u64)> = self
            .0
            .le_us
            .iter()
            .zip(&self.0.cumulative)
            .map(|(&le, &n)| {
                let own = n.saturating_sub(below);
                below = n;
                (le as f64 / 1e6, own)
            })
            .collect();
        encoder.encode_histogram::<NoLabels>(
            self.0.sum_us as f64 / 1e6,
            self.0.count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

type NoLabels = prometheus_client::encoding::NoLabelSet;

/// A family of one series per record: its name, help, and the record's field.
type Field<T, V = u64> = (&'static str, &'static str, fn(&T) -> V);

/// Per-bucket counters.
const BUCKET_COUNTERS: [Field<BucketReport>; 7] = [
    (
        "bucket_requests",
        "Successful requests named after the bucket (the largest shape that ran their items).",
        |b| b.requests,
    ),
    (
        "bucket_batches",
        "Batches run in the bucket's graph.",
        |b| b.batches,
    ),
    (
        "bucket_rows",
        "Real rows (sequences) run in the bucket.",
        |b| b.rows,
    ),
    (
        "bucket_padded_rows",
        "Row (sequence) slots of the bucket left empty.",
        |b| b.padded_rows,
    ),
    ("bucket_tokens", "Real tokens run in the bucket.", |b| {
        b.tokens
    }),
    (
        "bucket_padded_tokens",
        "Padding tokens computed in the bucket.",
        |b| b.padded_tokens,
    ),
    (
        "bucket_computed_tokens",
        "Token slots computed in the bucket (real + padding).",
        |b| b.computed_tokens,
    ),
];

/// Per-device counters.
const DEVICE_COUNTERS: [Field<DeviceStats>; 5] = [
    (
        "device_restarts",
        "Worker processes started after the first.",
        |d| d.restarts,
    ),
    (
        "device_faults",
        "Worker exits caused by a device fault.",
        |d| d.device_faults,
    ),
    (
        "device_hangs",
        "Workers killed because the watchdog found them stuck.",
        |d| d.hangs,
    ),
    (
        "device_batches",
        "Batches the device's workers finished.",
        |d| d.batches,
    ),
    (
        "device_graph_replays",
        "Batches served by replaying a captured graph.",
        |d| d.graph_replays,
    ),
];

impl Collector for Exposition {
    fn encode(&self, mut out: DescriptorEncoder) -> fmt::Result {
        let s = &self.0;
        let o = &mut out;
        family(
            o,
            "uptime_seconds",
            "Seconds since the daemon started.",
            [(NONE, gauge(s.uptime_s))],
        )?;
        family(
            o,
            "reloads",
            "Configuration reloads that took effect.",
            [(NONE, counter(s.reloads))],
        )?;
        requests(o, s)?;
        buckets(o, s)?;
        eager_and_queues(o, s)?;
        latency(o, s)?;
        devices(o, &s.devices)?;
        gpus(o, &s.devices)?;
        transport(o, s)
    }
}

fn requests(o: &mut DescriptorEncoder, s: &Stats) -> fmt::Result {
    let code = |errors: &std::collections::BTreeMap<ErrorCode, u64>, c: &ErrorCode| {
        errors.get(c).copied().unwrap_or(0)
    };
    // Requests by model and outcome; those of no known model under model="".
    let by_model = s.models.iter().flat_map(|m| {
        let ok = (
            [("model", m.name.as_str()), ("code", "ok")],
            counter(m.requests.ok),
        );
        std::iter::once(ok).chain(ErrorCode::ALL.iter().map(|c| {
            (
                [("model", m.name.as_str()), ("code", c.as_str())],
                counter(code(&m.requests.errors, c)),
            )
        }))
    });
    let unattributed = ErrorCode::ALL.iter().map(|c| {
        let of_models: u64 = s.models.iter().map(|m| code(&m.requests.errors, c)).sum();
        (
            [("model", ""), ("code", c.as_str())],
            counter(code(&s.requests.errors, c).saturating_sub(of_models)),
        )
    });
    family(
        o,
        "requests",
        "Requests answered, by model and code (\"ok\" or an error code).",
        by_model.chain(unattributed),
    )?;
    let totals = [
        (
            "requests_accepted",
            "Requests the batcher accepted.",
            s.requests.accepted,
        ),
        (
            "split_requests",
            "Successful requests whose items ran in more than one batch.",
            s.requests.split,
        ),
    ];
    for (name, help, n) in totals {
        family(o, name, help, [(NONE, counter(n))])?;
    }
    let ratios: [Field<ModelReport, f64>; 2] = [
        (
            "graph_hit_ratio",
            "Share of a model's successful requests served by graph replays only (none of their items eager).",
            |m| m.graph_hit_rate,
        ),
        (
            "model_padding_ratio",
            "Padding tokens over computed tokens, over all of a model's bucketed batches.",
            |m| m.padding.padding_waste,
        ),
    ];
    for (name, help, ratio) in ratios {
        family(
            o,
            name,
            help,
            s.models
                .iter()
                .map(|m| ([("model", m.name.as_str())], gauge(ratio(m)))),
        )?;
    }
    Ok(())
}

fn buckets(o: &mut DescriptorEncoder, s: &Stats) -> fmt::Result {
    fn labels(b: &BucketReport) -> Labels<'_, 2> {
        [("model", b.model.as_str()), ("bucket", b.bucket.as_str())]
    }
    for (name, help, field) in BUCKET_COUNTERS {
        family(
            o,
            name,
            help,
            s.buckets.iter().map(|b| (labels(b), counter(field(b)))),
        )?;
    }
    family(
        o,
        "bucket_padding_ratio",
        "Padding tokens over computed tokens in the bucket, since start.",
        s.buckets
            .iter()
            .map(|b| (labels(b), gauge(b.padding_waste))),
    )?;
    family(
        o,
        "padding_ratio",
        "Padding tokens over computed tokens, all models.",
        [(NONE, gauge(s.padding.padding_waste))],
    )
}

fn eager_and_queues(o: &mut DescriptorEncoder, s: &Stats) -> fmt::Result {
    family(
        o,
        "eager_requests",
        "Requests with items that ran eagerly (no graph), by reason.",
        EagerReason::ALL.iter().map(|r| {
            let n = s.eager.by_reason.get(r).copied().unwrap_or(0);
            ([("reason", r.as_str())], counter(n))
        }),
    )?;
    let totals = [
        ("eager_batches", "Eager batches run.", s.eager.batches),
        (
            "eager_sequences",
            "Sequences (rows) run eagerly.",
            s.eager.sequences,
        ),
        (
            "retried_batches",
            "Batches run again after their worker died.",
            s.retried_batches,
        ),
    ];
    for (name, help, n) in totals {
        family(o, name, help, [(NONE, counter(n))])?;
    }
    family(
        o,
        "queue_depth",
        "Requests with items waiting for a graph, per model.",
        s.queue_depth
            .by_model
            .iter()
            .map(|(model, n)| ([("model", model.as_str())], count(*n))),
    )?;
    family(
        o,
        "eager_queue_depth",
        "Requests with items waiting for an eager worker.",
        [(NONE, count(s.queue_depth.eager))],
    )?;
    let shards: Vec<String> = (0..s.queue_depth.by_shard.len())
        .map(|i| i.to_string())
        .collect();
    family(
        o,
        "shard_queue_depth",
        "Requests with items waiting for a graph, per batcher shard.",
        s.queue_depth
            .by_shard
            .iter()
            .zip(&shards)
            .map(|(n, shard)| ([("shard", shard.as_str())], count(*n))),
    )
}

fn latency(o: &mut DescriptorEncoder, s: &Stats) -> fmt::Result {
    let h = &s.latency.histograms;
    family(
        o,
        "request_duration_seconds",
        "Successful requests, receipt to reply.",
        [(NONE, Seconds(&h.total))],
    )?;
    family(
        o,
        "queue_duration_seconds",
        "Successful requests, receipt until their first batch was sent.",
        [(NONE, Seconds(&h.queued))],
    )?;
    family(
        o,
        "device_duration_seconds",
        "Successful requests, time their batches spent on the worker (copy in, replay, copy out).",
        [(NONE, Seconds(&h.compute))],
    )
}

fn devices(o: &mut DescriptorEncoder, devices: &[DeviceStats]) -> fmt::Result {
    fn by_device(d: &DeviceStats) -> Labels<'_, 1> {
        [("device", d.label.as_str())]
    }
    family(
        o,
        "device_state",
        "1 for the device's current state, 0 for the others.",
        devices.iter().flat_map(|d| {
            DeviceStatus::ALL.iter().map(move |st| {
                (
                    [
                        ("device", d.label.as_str()),
                        ("role", d.role.as_str()),
                        ("state", st.as_str()),
                    ],
                    count(u64::from(*st == d.state)),
                )
            })
        }),
    )?;
    for (name, help, field) in DEVICE_COUNTERS {
        family(
            o,
            name,
            help,
            devices.iter().map(|d| (by_device(d), counter(field(d)))),
        )?;
    }
    family(
        o,
        "device_inflight_batches",
        "Batches sent to the worker and not yet back.",
        devices.iter().map(|d| (by_device(d), count(d.inflight))),
    )?;
    family(
        o,
        "device_queued_requests",
        "Requests waiting for the device: its batcher shard's queue (shared with the shard's other devices), or every shard's eager queue for an eager device.",
        devices.iter().map(|d| (by_device(d), count(d.queued))),
    )?;
    family(
        o,
        "device_inflight_tokens",
        "Token slots of the batches the worker holds.",
        devices
            .iter()
            .map(|d| (by_device(d), count(d.inflight_tokens))),
    )?;
    family(
        o,
        "device_busy_seconds",
        "Time during which the worker held at least one batch (its rate is the device's busy fraction).",
        devices.iter().map(|d| {
            (
                by_device(d),
                ConstCounter::new(d.busy_us as f64 / 1e6),
            )
        }),
    )?;
    family(
        o,
        "device_drained",
        "1 while the operator has drained the device.",
        devices
            .iter()
            .map(|d| (by_device(d), count(u64::from(d.drained)))),
    )?;
    family(
        o,
        "device_graphs",
        "Graphs the device's worker holds.",
        devices
            .iter()
            .map(|d| (by_device(d), count(d.graphs.len() as u64))),
    )?;
    let graphs = || {
        devices.iter().flat_map(|d| {
            d.graphs
                .iter()
                .map(move |g: &GraphStats| -> (Labels<'_, 3>, &GraphStats) {
                    (
                        [
                            ("device", d.label.as_str()),
                            ("model", g.model.as_str()),
                            ("bucket", g.bucket.as_str()),
                        ],
                        g,
                    )
                })
        })
    };
    family(
        o,
        "graph_capture_seconds",
        "Time the graph took to capture.",
        graphs().map(|(l, g)| (l, gauge(g.capture_us as f64 / 1e6))),
    )?;
    family(
        o,
        "graph_memory_bytes",
        "Device memory the graph's static buffers hold.",
        graphs().map(|(l, g)| (l, count(g.memory_bytes))),
    )
}

/// GPUs, from NVML (absent on the CPU backend, and for a GPU NVML could not read).
fn gpus(o: &mut DescriptorEncoder, devices: &[DeviceStats]) -> fmt::Result {
    let gpus: Vec<_> = devices
        .iter()
        .filter_map(|d| Some((d.label.as_str(), d.gpu.as_ref()?.sample()?)))
        .collect();
    if gpus.is_empty() {
        return Ok(());
    }
    let per_gpu = |f: fn(&super::stats::GpuSample) -> Option<f64>| {
        gpus.iter()
            .filter_map(move |(label, g)| Some(([("device", *label)], gauge(f(g)?))))
    };
    family(
        o,
        "gpu_memory_used_bytes",
        "GPU memory in use (all processes).",
        per_gpu(|g| Some(g.memory_used_bytes as f64)),
    )?;
    family(
        o,
        "gpu_memory_total_bytes",
        "GPU memory.",
        per_gpu(|g| Some(g.memory_total_bytes as f64)),
    )?;
    family(
        o,
        "gpu_utilization_ratio",
        "GPU utilisation (NVML).",
        per_gpu(|g| g.utilization_pct.map(|p| p as f64 / 100.0)),
    )?;
    family(
        o,
        "gpu_temperature_celsius",
        "GPU temperature.",
        per_gpu(|g| g.temperature_c.map(f64::from)),
    )
}

/// Every counter of every socket, as `replayd_transport_<counter>_total`.
fn transport(o: &mut DescriptorEncoder, s: &Stats) -> fmt::Result {
    // The counters by their field names (serialising the snapshot lists
    // them, so a counter added to the transport is exported too).
    let sockets: Vec<(&str, serde_json::Map<String, serde_json::Value>)> = s
        .transport
        .iter()
        .filter_map(|(name, t)| match serde_json::to_value(t.total) {
            Ok(serde_json::Value::Object(fields)) => Some((name.as_str(), fields)),
            _ => None,
        })
        .collect();
    let Some((_, first)) = sockets.first() else {
        return Ok(());
    };
    for field in first.keys() {
        family(
            o,
            &format!("transport_{field}"),
            &format!("Socket counter {field} (see docs/transport.md)."),
            sockets.iter().map(|(socket, fields)| {
                let n = fields.get(field).and_then(|v| v.as_u64()).unwrap_or(0);
                ([("socket", *socket)], counter(n))
            }),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Bucket, Grid, TokenGrid};
    use crate::daemon::metrics::ModelStats;

    #[test]
    fn the_exposition_has_the_stats_numbers_with_escaped_labels() {
        let m = Metrics::new();
        let grid = Grid::Packed(TokenGrid::new(vec![64], 8));
        m.set_models(vec![ModelStats {
            name: "enc\"x".into(),
            batching: "packed".into(),
            grid: grid.describe(),
            folder: Vec::new(),
        }]);
        m.set_model_grid("enc\"x", &grid);
        m.bucket_batch("enc\"x", Bucket::packed(64, 8), 1, 2, 48);
        m.model_reply("enc\"x", Some(Bucket::packed(64, 8)), 700);
        m.model_reply("enc\"x", None, 900);
        m.reply_ok(700, 100, 300, 1);
        m.model_error("enc\"x", ErrorCode::Overloaded);
        m.error(ErrorCode::UnknownModel);
        let (_tx, status) = tokio::sync::watch::channel(DeviceStatus::Ready);
        let d = m.add_device(
            DeviceStats {
                label: "cuda:0".into(),
                ..Default::default()
            },
            status,
        );
        m.update_device(d, |d| {
            d.inflight = 2;
            d.inflight_tokens = 4096;
            d.busy_us = 1_500_000;
        });
        let text = render(m.snapshot());
        let line = |prefix: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        assert_eq!(
            line(r#"replayd_bucket_requests_total{model="enc\"x",bucket="64t"}"#),
            1.0
        );
        assert_eq!(
            line(r#"replayd_bucket_padding_ratio{model="enc\"x",bucket="64t"}"#),
            16.0 / 64.0
        );
        assert_eq!(line(r#"replayd_graph_hit_ratio{model="enc\"x"}"#), 0.5);
        assert_eq!(
            line(r#"replayd_requests_total{model="enc\"x",code="ok"}"#),
            2.0
        );
        assert_eq!(
            line(r#"replayd_requests_total{model="enc\"x",code="overloaded"}"#),
            1.0
        );
        assert_eq!(
            line(r#"replayd_requests_total{model="",code="unknown_model"}"#),
            1.0
        );
        assert_eq!(
            line(r#"replayd_request_duration_seconds_bucket{le="0.001"}"#),
            1.0
        );
        assert_eq!(
            line(r#"replayd_request_duration_seconds_bucket{le="0.0005"}"#),
            0.0
        );
        assert_eq!(line("replayd_request_duration_seconds_sum"), 0.0007);
        assert!(text.contains("# TYPE replayd_device_duration_seconds histogram"));
        assert_eq!(
            line(r#"replayd_device_inflight_tokens{device="cuda:0""#),
            4096.0
        );
        assert_eq!(
            line(r#"replayd_device_busy_seconds_total{device="cuda:0""#),
            1.5
        );
        assert!(text.contains("# TYPE replayd_requests_total counter"));
        assert!(
            text.contains("# HELP replayd_reloads_total Configuration reloads that took effect.\n")
        );
        // Every sample line belongs to a declared family.
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(
                families.iter().any(|f| name == *f
                    || name
                        .strip_prefix(*f)
                        .is_some_and(|s| ["_bucket", "_sum", "_count"].contains(&s))),
                "{l}"
            );
        }
    }
}
