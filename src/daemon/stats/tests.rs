//! One snapshot, every view: what `replayctl` prints, what Prometheus
//! scrapes and what the HTTP routes answer are made from the same [`Stats`]
//! value and must show the same numbers.

use super::*;
use crate::bucket::{Bucket, BucketGrid, Grid, TokenGrid};
use crate::daemon::metrics::{Metrics, ModelStats};
use crate::daemon::{http, prometheus};
use std::collections::BTreeMap;
use tokio::sync::watch;

const LONG: &str = "sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets";

/// Known traffic: a long-named packed model and a short-named MLP.
pub(crate) fn known_metrics() -> Metrics {
    let m = Metrics::new();
    let grid = Grid::Packed(TokenGrid::new(vec![64, 256], 16));
    let mlp = Grid::Padded(BucketGrid::new(vec![1, 8], vec![1]));
    m.set_models(vec![
        ModelStats {
            name: LONG.into(),
            batching: "packed".into(),
            grid: grid.describe(),
            folder: Vec::new(),
        },
        ModelStats {
            name: "mlp".into(),
            batching: "padded".into(),
            grid: mlp.describe(),
            folder: Vec::new(),
        },
    ]);
    m.set_model_grid(LONG, &grid);
    m.set_model_grid("mlp", &mlp);
    m.observe_items(LONG, &[20, 40]);
    m.bucket_batch(LONG, Bucket::packed(64, 16), 1, 2, 60);
    m.model_reply(LONG, Some(Bucket::packed(64, 16)), 1500);
    m.observe_items(LONG, &[300]);
    m.eager_request(LONG, EagerReason::SeqTooLong);
    m.eager_batch(1, 300);
    m.model_reply(LONG, None, 9000);
    for _ in 0..3 {
        m.observe_items("mlp", &[1; 5]);
        m.bucket_batch("mlp", Bucket::new(8, 1), 1, 5, 5);
        m.model_reply("mlp", Some(Bucket::new(8, 1)), 250);
    }
    m.model_error("mlp", ErrorCode::Overloaded);
    m
}

/// [`known_metrics`]' snapshot, 12 s after start.
pub(crate) fn known() -> Stats {
    let mut s = known_metrics().snapshot();
    s.uptime_s = 12.0;
    s
}

/// A device slot in `state`: its index, and the sender that holds the state.
fn device(m: &Metrics, label: &str, state: DeviceStatus) -> (usize, watch::Sender<DeviceStatus>) {
    let (tx, rx) = watch::channel(state);
    let stats = DeviceStats {
        label: label.into(),
        ..Default::default()
    };
    (m.add_device(stats, rx), tx)
}

/// The known traffic, answered, on one ready device with two graphs, an
/// NVML sample, and one error of no known model.
fn served() -> Stats {
    let m = known_metrics();
    for total_us in [250, 250, 250, 1500, 9000] {
        m.reply_ok(total_us, 50, 100, 1);
    }
    m.error(ErrorCode::UnknownModel);
    let (i, _status) = device(&m, "cuda:0", DeviceStatus::Ready);
    m.update_device(i, |d| {
        d.batches = 4;
        d.graph_replays = 4;
        d.graphs = vec![
            GraphStats {
                model: "mlp".into(),
                bucket: "8x1".into(),
                capture_us: 2500,
                memory_bytes: 3 << 20,
            },
            GraphStats {
                model: LONG.into(),
                bucket: "64t".into(),
                capture_us: 4000,
                memory_bytes: 5 << 20,
            },
        ];
        d.gpu = Some(GpuReading::Sample(GpuSample {
            uuid: "GPU-0".into(),
            pci_bus_id: "00000000:00:06.0".into(),
            memory_used_bytes: 1 << 30,
            memory_total_bytes: 80 << 30,
            temperature_c: Some(41),
            utilization_pct: Some(37),
        }));
    });
    m.snapshot()
}

/// The tables whose header starts with `first`: their rows, by column name.
fn tables(text: &str, first: &str) -> Vec<Vec<BTreeMap<String, String>>> {
    let cells = |l: &str| -> Vec<String> {
        l.trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let lines: Vec<&str> = text.lines().collect();
    let start = format!("| {first} ");
    (0..lines.len())
        .filter(|&i| lines[i].starts_with(&start))
        .map(|i| {
            let header = cells(lines[i]);
            lines[i + 2..]
                .iter()
                .take_while(|l| l.starts_with('|'))
                .map(|l| header.iter().cloned().zip(cells(l)).collect())
                .collect()
        })
        .collect()
}

/// The rows of the first table whose header starts with `first`.
fn rows(text: &str, first: &str) -> Vec<BTreeMap<String, String>> {
    tables(text, first)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no table {first} in {text}"))
}

fn row<'a>(
    rows: &'a [BTreeMap<String, String>],
    key: &[(&str, &str)],
) -> &'a BTreeMap<String, String> {
    rows.iter()
        .find(|r| key.iter().all(|(k, v)| r[*k] == *v))
        .unwrap_or_else(|| panic!("no row {key:?} in {rows:#?}"))
}

/// The exposition's samples by series.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse().unwrap())
        })
        .collect()
}

async fn body(r: axum::response::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 24).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test]
async fn the_table_prometheus_and_http_show_one_snapshot_alike() {
    let snapshot = served();
    let health = Health::of(&snapshot.devices);
    // Every view from this one value.
    let table = table::stats(&snapshot, None);
    let health_table = table::health(&health);
    let (metrics_status, exposition) = body(prometheus::metrics_reply(snapshot.clone())).await;
    let (stats_status, stats_body) = body(prometheus::stats_reply(snapshot.clone())).await;
    let (health_status, health_body) = body(http::health_reply(health.clone())).await;
    assert_eq!(
        (metrics_status, stats_status, health_status),
        (200, 200, 200)
    );
    let prom = samples(&exposition);
    let json: serde_json::Value = serde_json::from_str(&stats_body).unwrap();
    let health_json: serde_json::Value = serde_json::from_str(&health_body).unwrap();
    // What replayctl reads back is what was sent.
    assert_eq!(
        serde_json::from_str::<Stats>(&stats_body).unwrap(),
        snapshot
    );

    // Per model: requests, graph hit rate, errors, padding.
    let models = rows(&table, "model");
    for (name, ok, hit, errors, padding) in [
        (LONG, 2, 0.5, 0, 4.0 / 64.0),
        ("mlp", 3, 1.0, 1, 9.0 / 24.0),
    ] {
        let r = row(&models, &[("model", name)]);
        assert_eq!(r["requests"], ok.to_string());
        assert_eq!(r["graph hit rate"], format!("{:.1}%", 100.0 * hit));
        assert_eq!(r["errors"], errors.to_string());
        assert_eq!(r["padding"], format!("{:.1}%", 100.0 * padding));
        let m = |s: &str| prom[&format!("replayd_{s}{{model=\"{name}\"}}")];
        assert_eq!(
            prom[&format!("replayd_requests_total{{model=\"{name}\",code=\"ok\"}}")],
            ok as f64
        );
        assert_eq!(m("graph_hit_ratio"), hit);
        assert_eq!(m("model_padding_ratio"), padding);
        let j = json["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == name)
            .unwrap();
        assert_eq!(j["requests"]["ok"], ok);
        assert_eq!(j["graph_hit_rate"], hit);
        assert_eq!(j["padding"]["padding_waste"], padding);
    }
    assert_eq!(
        prom["replayd_requests_total{model=\"mlp\",code=\"overloaded\"}"],
        1.0
    );
    assert_eq!(json["requests"]["errors"]["overloaded"], 1);
    assert!(
        table.contains("errors by code: unknown_model 1, overloaded 1"),
        "{table}"
    );
    assert_eq!(
        prom["replayd_requests_total{model=\"\",code=\"unknown_model\"}"],
        1.0
    );

    // Per bucket: batches, tokens, padding, p50.
    let buckets = &tables(&table, "model")[1];
    for (model, bucket, batches, tokens, padding, p50) in [
        ("mlp", "8x1", 3, 15, 9.0 / 24.0, "250 µs"),
        (LONG, "64t", 1, 60, 4.0 / 64.0, "1.50 ms"),
    ] {
        let r = row(buckets, &[("model", model), ("bucket", bucket)]);
        assert_eq!(r["batches"], batches.to_string());
        assert_eq!(r["tokens"], tokens.to_string());
        assert_eq!(r["padding"], format!("{:.1}%", 100.0 * padding));
        assert_eq!(r["p50"], p50);
        let series =
            |s: &str| prom[&format!("replayd_{s}{{model=\"{model}\",bucket=\"{bucket}\"}}")];
        assert_eq!(series("bucket_batches_total"), batches as f64);
        assert_eq!(series("bucket_tokens_total"), tokens as f64);
        assert_eq!(series("bucket_padding_ratio"), padding);
        let j = json["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["model"] == model && j["bucket"] == bucket)
            .unwrap();
        assert_eq!(j["batches"], batches);
        assert_eq!(j["padding_waste"], padding);
    }

    // Eager work and latency.
    assert!(
        table.contains("eager requests: 1 (seq_too_long 1)   batches 1, sequences 1, tokens 300")
    );
    assert_eq!(
        prom["replayd_eager_requests_total{reason=\"seq_too_long\"}"],
        1.0
    );
    assert_eq!(prom["replayd_eager_sequences_total"], 1.0);
    assert_eq!(json["eager"]["by_reason"]["seq_too_long"], 1);
    assert!(
        table.contains("latency p50/p99: total 250 µs / 9.01 ms"),
        "{table}"
    );
    // (9 ms, kept to 3 significant digits: 9007 µs.)
    assert_eq!(json["latency"]["total"]["p99_us"], 9007);
    assert_eq!(prom["replayd_request_duration_seconds_count"], 5.0);
    assert_eq!(
        prom["replayd_request_duration_seconds_bucket{le=\"0.00025\"}"],
        3.0
    );
    assert_eq!(
        prom["replayd_request_duration_seconds_bucket{le=\"+Inf\"}"],
        5.0
    );
    assert_eq!(prom["replayd_request_duration_seconds_sum"], 0.01125);
    assert_eq!(json["latency"]["total"]["count"], 5);
    assert_eq!(json["latency"]["histograms"]["total"]["sum_us"], 11250);

    // The device: its state, batches and graphs; health says the same.
    let device_rows = rows(&table, "device");
    let d = row(&device_rows, &[("device", "cuda:0")]);
    assert_eq!((d["state"].as_str(), d["batches"].as_str()), ("ready", "4"));
    assert_eq!(d["graphs"], "2");
    let state = |st: &str| {
        prom[&format!("replayd_device_state{{device=\"cuda:0\",role=\"graph\",state=\"{st}\"}}")]
    };
    assert_eq!((state("ready"), state("starting")), (1.0, 0.0));
    assert_eq!(prom["replayd_device_batches_total{device=\"cuda:0\"}"], 4.0);
    assert_eq!(prom["replayd_device_graphs{device=\"cuda:0\"}"], 2.0);
    assert_eq!(
        prom["replayd_graph_memory_bytes{device=\"cuda:0\",model=\"mlp\",bucket=\"8x1\"}"],
        (3 << 20) as f64
    );
    assert_eq!(
        prom["replayd_gpu_utilization_ratio{device=\"cuda:0\"}"],
        0.37
    );
    assert_eq!(
        prom["replayd_gpu_temperature_celsius{device=\"cuda:0\"}"],
        41.0
    );
    let devices = table::devices(&snapshot.devices);
    let device_rows = rows(&devices, "device");
    let d = row(&device_rows, &[("device", "cuda:0")]);
    assert_eq!(
        (d["GPU util"].as_str(), d["GPU temp"].as_str()),
        ("37%", "41 °C")
    );
    assert_eq!(json["devices"][0]["state"], "ready");
    assert_eq!(json["devices"][0]["gpu"]["utilization_pct"], 37);
    assert_eq!(health_json["status"], "ok");
    assert_eq!(health_json["devices"][0]["state"], "ready");
    assert!(health_table.starts_with("status: ok\n"), "{health_table}");
    assert_eq!(
        row(&rows(&health_table, "device"), &[("device", "cuda:0")])["state"],
        "ready"
    );
}

/// A device down answers 503 on `/health`, and the table and JSON say why.
#[tokio::test]
async fn health_is_503_when_no_device_is_up() {
    let m = Metrics::new();
    let (i, _status) = device(&m, "cpu:0", DeviceStatus::Faulted);
    m.update_device(i, |d| d.last_error = Some("worker exited".into()));
    let health = m.health();
    let (status, text) = body(http::health_reply(health.clone())).await;
    assert_eq!(status, 503);
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["status"], "down");
    assert_eq!(j["devices"][0]["last_error"], "worker exited");
    let table = table::health(&health);
    assert!(table.starts_with("status: down\n"));
    assert_eq!(
        row(&rows(&table, "device"), &[("device", "cpu:0")])["last error"],
        "worker exited"
    );
}

/// `replayctl` reads every answer back into its type, and an answer from
/// a daemon with fewer fields still reads (with zeros).
#[test]
fn answers_read_back_and_missing_fields_read_as_zero() {
    let s = served();
    let text = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<Stats>(&text).unwrap(), s);
    let b = known_metrics().buckets_report();
    let text = serde_json::to_string(&b).unwrap();
    assert_eq!(serde_json::from_str::<BucketsReport>(&text).unwrap(), b);
    let old: Stats = serde_json::from_str(r#"{"uptime_s": 3.5, "requests": {"ok": 2}}"#).unwrap();
    assert_eq!(
        (old.uptime_s, old.requests.ok, old.models.len()),
        (3.5, 2, 0)
    );
    // The user-facing names of `replayctl stats --json`.
    let v = serde_json::to_value(&s).unwrap();
    for path in [
        "/requests/errors/overloaded",
        "/models/0/grid/token_budgets",
        "/models/1/grid/batch_buckets",
        "/buckets/0/padding_waste",
        "/buckets/0/seq_fill",
        "/latency/hops/decode/p50_us",
        "/latency/histograms/total/le_us",
        "/stages/busy/batcher/busy_us",
        "/stages/delays/batcher_mailbox/count",
        "/devices/0/gpu/memory_total_bytes",
        "/eager/by_model",
        "/queue_depth/eager",
    ] {
        assert!(v.pointer(path).is_some(), "no {path} in {v:#}");
    }
}
