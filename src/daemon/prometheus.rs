//! Prometheus metrics: `GET /metrics` on `metrics.endpoint` (a loopback
//! address; off unless configured), in the text exposition format.
//!
//! Everything is rendered from [`Metrics::snapshot`] — the same document
//! `replayctl stats --json` prints — so the two never disagree. Names follow
//! Prometheus conventions: `_total` counters, `_seconds` and `_bytes` units,
//! ratios in 0..1, and an enum (the device state) as one series per state
//! with value 0 or 1. Every count is since the daemon started; graph rates
//! (`rate(replayd_bucket_padded_tokens_total[5m]) /
//! rate(replayd_bucket_computed_tokens_total[5m])` is the padding waste of
//! the last five minutes).

use super::messages::DeviceStatus;
use super::metrics::Metrics;
use crate::protocol::ErrorCode;
use anyhow::Context;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::Value;
use std::fmt::Write;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

/// The text exposition of the metrics.
pub fn render(metrics: &Metrics) -> String {
    render_snapshot(&metrics.snapshot())
}

/// A label value, escaped (backslash, double quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out {
    text: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", esc(v));
            }
            self.text.push('}');
        }
        if value.is_finite() && value.fract() == 0.0 && value.abs() < 1e15 {
            let _ = writeln!(self.text, " {}", value as i64);
        } else {
            let _ = writeln!(self.text, " {value}");
        }
    }

    /// A histogram from the snapshot's `{le_us, cumulative, sum_us, count}`.
    fn histogram(&mut self, name: &str, help: &str, h: &Value) {
        self.family(name, "histogram", help);
        let bounds = h["le_us"].as_array().cloned().unwrap_or_default();
        let counts = h["cumulative"].as_array().cloned().unwrap_or_default();
        for (le, n) in bounds.iter().zip(&counts) {
            let le = format!("{}", le.as_f64().unwrap_or(0.0) / 1e6);
            self.sample(
                &format!("{name}_bucket"),
                &[("le", &le)],
                n.as_f64().unwrap_or(0.0),
            );
        }
        let count = h["count"].as_f64().unwrap_or(0.0);
        self.sample(&format!("{name}_bucket"), &[("le", "+Inf")], count);
        self.sample(
            &format!("{name}_sum"),
            &[],
            h["sum_us"].as_f64().unwrap_or(0.0) / 1e6,
        );
        self.sample(&format!("{name}_count"), &[], count);
    }
}

fn num(v: &Value) -> f64 {
    v.as_f64()
        .or_else(|| v.as_bool().map(|b| b as u8 as f64))
        .unwrap_or(0.0)
}

fn arr(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

/// The exposition of a stats snapshot.
pub fn render_snapshot(s: &Value) -> String {
    let mut o = Out {
        text: String::with_capacity(16 << 10),
    };
    o.family(
        "replayd_uptime_seconds",
        "gauge",
        "Seconds since the daemon started.",
    );
    o.sample("replayd_uptime_seconds", &[], num(&s["uptime_s"]));
    o.family(
        "replayd_reloads_total",
        "counter",
        "Configuration reloads that took effect.",
    );
    o.sample("replayd_reloads_total", &[], num(&s["reloads"]));

    // Requests by model and outcome; those of no known model under model="".
    o.family(
        "replayd_requests_total",
        "counter",
        "Requests answered, by model and code (\"ok\" or an error code).",
    );
    let models = arr(&s["models"]);
    let mut per_model_errors = std::collections::BTreeMap::<&str, f64>::new();
    for m in models {
        let name = m["name"].as_str().unwrap_or("");
        o.sample(
            "replayd_requests_total",
            &[("model", name), ("code", "ok")],
            num(&m["requests"]["ok"]),
        );
        for code in ErrorCode::ALL {
            let n = num(&m["requests"]["errors"][code.as_str()]);
            *per_model_errors.entry(code.as_str()).or_default() += n;
            o.sample(
                "replayd_requests_total",
                &[("model", name), ("code", code.as_str())],
                n,
            );
        }
    }
    for code in ErrorCode::ALL {
        let all = num(&s["requests"]["errors"][code.as_str()]);
        let rest = all - per_model_errors.get(code.as_str()).copied().unwrap_or(0.0);
        o.sample(
            "replayd_requests_total",
            &[("model", ""), ("code", code.as_str())],
            rest.max(0.0),
        );
    }
    o.family(
        "replayd_requests_accepted_total",
        "counter",
        "Requests the batcher accepted.",
    );
    o.sample(
        "replayd_requests_accepted_total",
        &[],
        num(&s["requests"]["accepted"]),
    );
    o.family(
        "replayd_split_requests_total",
        "counter",
        "Successful requests whose items ran in more than one batch.",
    );
    o.sample(
        "replayd_split_requests_total",
        &[],
        num(&s["requests"]["split"]),
    );

    o.family(
        "replayd_graph_hit_ratio",
        "gauge",
        "Share of a model's successful requests served by graph replays only (none of their items eager).",
    );
    for m in models {
        o.sample(
            "replayd_graph_hit_ratio",
            &[("model", m["name"].as_str().unwrap_or(""))],
            num(&m["graph_hit_rate"]),
        );
    }
    o.family(
        "replayd_model_padding_ratio",
        "gauge",
        "Padding tokens over computed tokens, over all of a model's bucketed batches.",
    );
    for m in models {
        o.sample(
            "replayd_model_padding_ratio",
            &[("model", m["name"].as_str().unwrap_or(""))],
            num(&m["padding"]["padding_waste"]),
        );
    }

    // Per bucket.
    let buckets = arr(&s["buckets"]);
    let per_bucket: [(&str, &str, &str, &str); 8] = [
        (
            "replayd_bucket_requests_total",
            "counter",
            "Successful requests named after the bucket (the largest shape that ran their items).",
            "requests",
        ),
        (
            "replayd_bucket_batches_total",
            "counter",
            "Batches run in the bucket's graph.",
            "batches",
        ),
        (
            "replayd_bucket_rows_total",
            "counter",
            "Real rows (sequences) run in the bucket.",
            "rows",
        ),
        (
            "replayd_bucket_padded_rows_total",
            "counter",
            "Row (sequence) slots of the bucket left empty.",
            "padded_rows",
        ),
        (
            "replayd_bucket_tokens_total",
            "counter",
            "Real tokens run in the bucket.",
            "tokens",
        ),
        (
            "replayd_bucket_padded_tokens_total",
            "counter",
            "Padding tokens computed in the bucket.",
            "padded_tokens",
        ),
        (
            "replayd_bucket_computed_tokens_total",
            "counter",
            "Token slots computed in the bucket (real + padding).",
            "computed_tokens",
        ),
        (
            "replayd_bucket_padding_ratio",
            "gauge",
            "Padding tokens over computed tokens in the bucket, since start.",
            "padding_waste",
        ),
    ];
    for (name, kind, help, field) in per_bucket {
        o.family(name, kind, help);
        for b in buckets {
            o.sample(
                name,
                &[
                    ("model", b["model"].as_str().unwrap_or("")),
                    ("bucket", b["bucket"].as_str().unwrap_or("")),
                ],
                num(&b[field]),
            );
        }
    }
    o.family(
        "replayd_padding_ratio",
        "gauge",
        "Padding tokens over computed tokens, all models.",
    );
    o.sample(
        "replayd_padding_ratio",
        &[],
        num(&s["padding"]["padding_waste"]),
    );

    // Eager work.
    o.family(
        "replayd_eager_requests_total",
        "counter",
        "Requests with items that ran eagerly (no graph), by reason.",
    );
    for (reason, n) in s["eager"]["by_reason"].as_object().into_iter().flatten() {
        o.sample(
            "replayd_eager_requests_total",
            &[("reason", reason)],
            num(n),
        );
    }
    if s["eager"]["by_reason"]
        .as_object()
        .is_none_or(|m| m.is_empty())
    {
        o.sample(
            "replayd_eager_requests_total",
            &[("reason", "seq_too_long")],
            0.0,
        );
    }
    o.family(
        "replayd_eager_batches_total",
        "counter",
        "Eager batches run.",
    );
    o.sample(
        "replayd_eager_batches_total",
        &[],
        num(&s["eager"]["batches"]),
    );
    o.family(
        "replayd_eager_sequences_total",
        "counter",
        "Sequences (rows) run eagerly.",
    );
    o.sample(
        "replayd_eager_sequences_total",
        &[],
        num(&s["eager"]["sequences"]),
    );
    o.family(
        "replayd_retried_batches_total",
        "counter",
        "Batches run again after their worker died.",
    );
    o.sample(
        "replayd_retried_batches_total",
        &[],
        num(&s["retried_batches"]),
    );

    // Queues.
    o.family(
        "replayd_queue_depth",
        "gauge",
        "Requests with items waiting for a graph, per model.",
    );
    for (model, n) in s["queue_depth"]["by_model"]
        .as_object()
        .into_iter()
        .flatten()
    {
        o.sample("replayd_queue_depth", &[("model", model)], num(n));
    }
    o.family(
        "replayd_eager_queue_depth",
        "gauge",
        "Requests with items waiting for an eager worker.",
    );
    o.sample(
        "replayd_eager_queue_depth",
        &[],
        num(&s["queue_depth"]["eager"]),
    );

    // Latency.
    let h = &s["latency"]["histograms"];
    o.histogram(
        "replayd_request_duration_seconds",
        "Successful requests, receipt to reply.",
        &h["total"],
    );
    o.histogram(
        "replayd_queue_duration_seconds",
        "Successful requests, receipt until their first batch was sent.",
        &h["queued"],
    );
    o.histogram(
        "replayd_device_duration_seconds",
        "Successful requests, time their batches spent on the worker (copy in, replay, copy out).",
        &h["compute"],
    );

    // Devices.
    let devices = arr(&s["devices"]);
    o.family(
        "replayd_device_state",
        "gauge",
        "1 for the device's current state, 0 for the others.",
    );
    for d in devices {
        let label = d["label"].as_str().unwrap_or("");
        let role = d["role"].as_str().unwrap_or("");
        let state = d["state"].as_str().unwrap_or("");
        for st in DeviceStatus::ALL {
            o.sample(
                "replayd_device_state",
                &[("device", label), ("role", role), ("state", st.as_str())],
                (st.as_str() == state) as u8 as f64,
            );
        }
    }
    let per_device: [(&str, &str, &str, &str); 7] = [
        (
            "replayd_device_restarts_total",
            "counter",
            "Worker processes started after the first.",
            "restarts",
        ),
        (
            "replayd_device_faults_total",
            "counter",
            "Worker exits caused by a device fault.",
            "device_faults",
        ),
        (
            "replayd_device_hangs_total",
            "counter",
            "Workers killed because the watchdog found them stuck.",
            "hangs",
        ),
        (
            "replayd_device_batches_total",
            "counter",
            "Batches the device's workers finished.",
            "batches",
        ),
        (
            "replayd_device_graph_replays_total",
            "counter",
            "Batches served by replaying a captured graph.",
            "graph_replays",
        ),
        (
            "replayd_device_inflight_batches",
            "gauge",
            "Batches sent to the worker and not yet back.",
            "inflight",
        ),
        (
            "replayd_device_drained",
            "gauge",
            "1 while the operator has drained the device.",
            "drained",
        ),
    ];
    for (name, kind, help, field) in per_device {
        o.family(name, kind, help);
        for d in devices {
            o.sample(
                name,
                &[("device", d["label"].as_str().unwrap_or(""))],
                num(&d[field]),
            );
        }
    }
    o.family(
        "replayd_device_graphs",
        "gauge",
        "Graphs the device's worker holds.",
    );
    for d in devices {
        o.sample(
            "replayd_device_graphs",
            &[("device", d["label"].as_str().unwrap_or(""))],
            arr(&d["graphs"]).len() as f64,
        );
    }
    o.family(
        "replayd_graph_capture_seconds",
        "gauge",
        "Time the graph took to capture.",
    );
    for d in devices {
        for g in arr(&d["graphs"]) {
            o.sample(
                "replayd_graph_capture_seconds",
                &[
                    ("device", d["label"].as_str().unwrap_or("")),
                    ("model", g["model"].as_str().unwrap_or("")),
                    ("bucket", g["bucket"].as_str().unwrap_or("")),
                ],
                num(&g["capture_us"]) / 1e6,
            );
        }
    }
    o.family(
        "replayd_graph_memory_bytes",
        "gauge",
        "Device memory the graph's static buffers hold.",
    );
    for d in devices {
        for g in arr(&d["graphs"]) {
            o.sample(
                "replayd_graph_memory_bytes",
                &[
                    ("device", d["label"].as_str().unwrap_or("")),
                    ("model", g["model"].as_str().unwrap_or("")),
                    ("bucket", g["bucket"].as_str().unwrap_or("")),
                ],
                num(&g["memory_bytes"]),
            );
        }
    }
    // GPUs, from NVML (absent on the CPU backend).
    let gpus: Vec<(&str, &Value)> = devices
        .iter()
        .filter(|d| d["gpu"].is_object() && d["gpu"]["error"].is_null())
        .map(|d| (d["label"].as_str().unwrap_or(""), &d["gpu"]))
        .collect();
    if !gpus.is_empty() {
        let per_gpu: [(&str, &str, &str, f64); 4] = [
            (
                "replayd_gpu_memory_used_bytes",
                "GPU memory in use (all processes).",
                "memory_used_bytes",
                1.0,
            ),
            (
                "replayd_gpu_memory_total_bytes",
                "GPU memory.",
                "memory_total_bytes",
                1.0,
            ),
            (
                "replayd_gpu_utilization_ratio",
                "GPU utilisation (NVML).",
                "utilization_pct",
                0.01,
            ),
            (
                "replayd_gpu_temperature_celsius",
                "GPU temperature.",
                "temperature_c",
                1.0,
            ),
        ];
        for (name, help, field, scale) in per_gpu {
            o.family(name, "gauge", help);
            for (label, g) in &gpus {
                o.sample(name, &[("device", label)], num(&g[field]) * scale);
            }
        }
    }

    // Sockets.
    if let Some(transports) = s["transport"].as_object() {
        let mut fields: Vec<&str> = transports
            .values()
            .filter_map(|t| t.as_object())
            // The counters; not the per-shard list (`shards`).
            .flat_map(|t| {
                t.iter()
                    .filter(|(_, v)| v.is_number())
                    .map(|(k, _)| k.as_str())
            })
            .collect();
        fields.sort_unstable();
        fields.dedup();
        for field in fields {
            let name = format!("replayd_transport_{field}_total");
            o.family(
                &name,
                "counter",
                &format!("Socket counter {field} (see docs/transport.md)."),
            );
            for (socket, t) in transports {
                o.sample(&name, &[("socket", socket)], num(&t[field]));
            }
        }
    }
    o.text
}

/// Binds `addr` (already checked to be loopback) and serves `/metrics`
/// until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot bind metrics.endpoint {addr}"))?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        tokio::pin!(shutdown);
        loop {
            let (stream, _) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("metrics: accept: {e}");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let metrics = metrics.clone();
                        async move { Ok::<_, std::convert::Infallible>(respond(&req, &metrics)) }
                    });
                let io = hyper_util::rt::TokioIo::new(stream);
                let conn = hyper::server::conn::http1::Builder::new()
                    .header_read_timeout(std::time::Duration::from_secs(10))
                    .timer(hyper_util::rt::TokioTimer::new())
                    .serve_connection(io, service);
                let _ = conn.await;
            });
        }
    });
    Ok((bound, task))
}

fn respond<B>(req: &Request<B>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", "text/plain; charset=utf-8")
            .body(Full::new(Bytes::from(body)))
            .expect("a valid response")
    };
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") | (&Method::HEAD, "/metrics") => Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(Full::new(Bytes::from(render(metrics))))
            .expect("a valid response"),
        (&Method::GET, "/") => plain(
            StatusCode::OK,
            "replayd: Prometheus metrics at /metrics\n".into(),
        ),
        (_, "/metrics") => plain(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n".into()),
        _ => plain(StatusCode::NOT_FOUND, "not found: try /metrics\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Bucket, Grid, TokenGrid};
    use crate::daemon::metrics::ModelStats;

    #[test]
    fn the_exposition_has_the_stats_numbers_with_escaped_labels() {
        let m = Metrics::new();
        m.set_models(vec![ModelStats {
            name: "enc\"x".into(),
            batching: "packed".into(),
            grid: serde_json::Value::Null,
            folder: Vec::new(),
        }]);
        m.set_model_grid("enc\"x", &Grid::Packed(TokenGrid::new(vec![64], 8)));
        m.bucket_batch("enc\"x", Bucket::packed(64, 8), 1, 2, 48);
        m.model_reply("enc\"x", Some(Bucket::packed(64, 8)), 700);
        m.model_reply("enc\"x", None, 900);
        m.reply_ok(700, 100, 300, 1);
        m.model_error("enc\"x", ErrorCode::Overloaded);
        m.error(ErrorCode::UnknownModel);
        let text = render(&m);
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
