//! Operating the daemon (issue 11), end to end on the CPU backend: a real
//! daemon process, real worker processes, the real `replayctl` binary and
//! `/metrics` over real HTTP.
//!
//! * what `replayctl stats --json` and `/metrics` report is exactly what the
//!   test sent, and the stats table stays aligned for a long model name;
//! * `drain` moves work off a device without failing a request; `reload`
//!   with a changed bucket grid under load loses no request and the new
//!   buckets are used; `health` fails while a device restarts;
//! * systemd's notify protocol on a socket the test owns: `READY=1` only
//!   after every graph is captured, then `WATCHDOG=1`; JSON logs;
//! * a clean SIGTERM logs no warning, and text logs carry no colour codes
//!   when written to a file;
//! * `replayctl` without a daemon fails plainly, without waiting out its
//!   timeout.

mod common;

use common::{data, freeze, minilm_dir, Daemon, Rng};
use replayd::protocol::client::{Client, Response};
use replayd::protocol::Status;
use replayd::tensor::{DType, HostTensor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// A model name longer than any column a table would guess.
const LONG: &str = "mlp-with-a-rather-long-name-support-ticket-router-v2-finetuned";

fn mlp_model(name: &str, buckets: &str) -> String {
    format!(
        r#"
[[models]]
name = "{name}"
kind = "mlp"
path = "{}"
activation = "relu"
batch_buckets = {buckets}
"#,
        data("mlp_seed.safetensors").display()
    )
}

fn devices(cpu_devices: usize) -> String {
    format!(
        r#"
[devices]
backend = "cpu"
cpu_devices = {cpu_devices}
cpu_threads = 1
restart_backoff_ms = 50
"#
    )
}

fn rows(rng: &mut Rng, n: usize) -> HostTensor {
    let x: Vec<f32> = (0..n * 128).map(|_| rng.normal()).collect();
    HostTensor::from_f32(vec![n, 128], &x)
}

fn ok(r: &Response) {
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
}

fn ctl_ok(daemon: &Daemon, args: &[&str]) -> String {
    let out = daemon.ctl(args);
    assert!(
        out.status.success(),
        "replayctl {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn bucket<'a>(stats: &'a Value, model: &str, label: &str) -> &'a Value {
    stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["model"] == model && b["bucket"] == label)
        .unwrap_or_else(|| panic!("no bucket {model}/{label} in {:#}", stats["buckets"]))
}

fn model<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no model {name}"))
}

/// `GET /metrics` over a plain HTTP/1.1 exchange; the samples by series.
fn scrape(url: &str) -> BTreeMap<String, f64> {
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse::<f64>().unwrap())
        })
        .collect()
}

fn sample(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    *m.get(series)
        .unwrap_or_else(|| panic!("no series {series} in /metrics"))
}

/// The texts of the MiniLM reference set, with their token counts.
fn reference_texts() -> Vec<(String, usize)> {
    std::fs::read_to_string(data("minilm_set_a.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["text"].as_str().unwrap().to_string(),
                v["ids"].as_array().unwrap().len(),
            )
        })
        .collect()
}

/// Known traffic, one request at a time (so each is its own batch), and
/// then `stats --json`, `/metrics` and the stats table say exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_and_metrics_report_exactly_what_was_sent() {
    let config = format!(
        r#"
[batching]
max_wait_us = 200

[eager]
workers = 1

[metrics]
endpoint = "127.0.0.1:0"
{}{}
[[models]]
name = "minilm"
kind = "bert"
path = "{}"
batching = "padded"
batch_buckets = [1, 2]
seq_buckets = [16, 32]
"#,
        devices(1),
        mlp_model(LONG, "[1, 8]"),
        minilm_dir().display()
    );
    let mut daemon = Daemon::start(&config);
    let client = daemon.client().await;
    let mut rng = Rng::new(7);
    // The MLP: three requests of 5 rows (bucket 8x1, 3 rows of padding
    // each) and two of one row (bucket 1x1, none).
    for n in [5, 5, 5, 1, 1] {
        let r = client.infer(LONG, &rows(&mut rng, n), T).await.unwrap();
        ok(&r);
        let want = if n == 5 { "8x1" } else { "1x1" };
        assert_eq!(r.header.bucket.as_deref(), Some(want));
    }
    // MiniLM: two short texts in one request (bucket 2x16), then a text
    // longer than the largest seq bucket (eager).
    let texts = reference_texts();
    let short: Vec<&(String, usize)> = texts
        .iter()
        .filter(|(_, n)| (6..=16).contains(n))
        .take(2)
        .collect();
    let long = texts.iter().find(|(_, n)| (33..=64).contains(n)).unwrap();
    let r = client
        .embed("minilm", &[&short[0].0, &short[1].0], DType::F32, T)
        .await
        .unwrap();
    ok(&r);
    assert_eq!(r.header.bucket.as_deref(), Some("2x16"));
    let r = client
        .embed("minilm", &[&long.0], DType::F32, T)
        .await
        .unwrap();
    ok(&r);
    assert_eq!(r.header.bucket.as_deref(), Some("eager"), "{:?}", r.header);
    let short_tokens = (short[0].1 + short[1].1) as u64;

    let stats = daemon.stats();
    let b = bucket(&stats, LONG, "8x1");
    assert_eq!(b["requests"], 3);
    assert_eq!(b["batches"], 3);
    assert_eq!(b["rows"], 15);
    assert_eq!(b["padded_rows"], 9);
    assert_eq!(b["padding_waste"].as_f64().unwrap(), 9.0 / 24.0);
    let b = bucket(&stats, LONG, "1x1");
    assert_eq!(b["requests"], 2);
    assert_eq!(b["padded_rows"], 0);
    let b = bucket(&stats, "minilm", "2x16");
    assert_eq!(b["requests"], 1);
    assert_eq!(b["batches"], 1);
    assert_eq!(b["tokens"].as_u64().unwrap(), short_tokens);
    assert_eq!(b["computed_tokens"], 32);
    assert_eq!(b["padded_tokens"].as_u64().unwrap(), 32 - short_tokens);
    assert_eq!(model(&stats, LONG)["graph_hit_rate"].as_f64().unwrap(), 1.0);
    assert_eq!(model(&stats, LONG)["requests"]["ok"], 5);
    assert_eq!(
        model(&stats, "minilm")["graph_hit_rate"].as_f64().unwrap(),
        0.5
    );
    assert_eq!(model(&stats, "minilm")["requests"]["eager"], 1);
    assert_eq!(stats["eager"]["requests"], 1);
    assert_eq!(stats["eager"]["by_reason"]["seq_too_long"], 1);
    assert_eq!(stats["requests"]["ok"], 7);

    // /metrics: the same numbers, Prometheus names.
    let m = scrape(
        daemon
            .metrics
            .as_deref()
            .expect("metrics endpoint in the ready file"),
    );
    let lb = |bucket: &str| format!("{{model=\"{LONG}\",bucket=\"{bucket}\"}}");
    assert_eq!(
        sample(&m, &format!("replayd_bucket_requests_total{}", lb("8x1"))),
        3.0
    );
    assert_eq!(
        sample(&m, &format!("replayd_bucket_requests_total{}", lb("1x1"))),
        2.0
    );
    assert_eq!(
        sample(
            &m,
            &format!("replayd_bucket_padded_rows_total{}", lb("8x1"))
        ),
        9.0
    );
    assert_eq!(
        sample(&m, &format!("replayd_bucket_padding_ratio{}", lb("8x1"))),
        0.375
    );
    assert_eq!(
        sample(
            &m,
            "replayd_bucket_padded_tokens_total{model=\"minilm\",bucket=\"2x16\"}"
        ),
        (32 - short_tokens) as f64
    );
    assert_eq!(
        sample(&m, &format!("replayd_graph_hit_ratio{{model=\"{LONG}\"}}")),
        1.0
    );
    assert_eq!(sample(&m, "replayd_graph_hit_ratio{model=\"minilm\"}"), 0.5);
    assert_eq!(
        sample(&m, "replayd_eager_requests_total{reason=\"seq_too_long\"}"),
        1.0
    );
    assert_eq!(
        sample(&m, "replayd_requests_total{model=\"minilm\",code=\"ok\"}"),
        2.0
    );
    assert_eq!(
        sample(
            &m,
            &format!("replayd_requests_total{{model=\"{LONG}\",code=\"ok\"}}")
        ),
        5.0
    );
    assert_eq!(
        sample(
            &m,
            "replayd_device_state{device=\"cpu:0\",role=\"graph\",state=\"ready\"}"
        ),
        1.0
    );
    assert_eq!(sample(&m, "replayd_request_duration_seconds_count"), 7.0);

    // The same listener's /stats is `replayctl stats --json`'s document, and
    // /health says ready.
    let url = daemon.metrics.as_deref().unwrap();
    let address = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    let (status, body) = common::http(address, "GET", "/stats", None);
    assert_eq!(status, 200);
    let over_http: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(over_http["buckets"], stats["buckets"]);
    assert_eq!(over_http["models"], stats["models"]);
    let (status, body) = common::http(address, "GET", "/health", None);
    let health: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));

    // The table: every row of each table as wide as its header, the long
    // name whole.
    let text = ctl_ok(&daemon, &["stats"]);
    assert!(text.contains(LONG), "{text}");
    for block in text.split("\n\n") {
        let rows: Vec<&str> = block.lines().filter(|l| l.starts_with('|')).collect();
        for r in &rows {
            assert_eq!(
                r.chars().count(),
                rows[0].chars().count(),
                "misaligned:\n{block}"
            );
        }
    }
    assert!(text.contains("graph hit rate"), "{text}");

    // A clean stop: exit 0, and no warning (nor any colour code in a file).
    daemon.signal(libc::SIGTERM);
    let status = daemon.wait(Duration::from_secs(60));
    assert!(status.success(), "{status}\n{}", daemon.log());
    let log = daemon.log();
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "{log}");
    assert!(!log.contains('\x1b'), "colour codes in a log file:\n{log}");
    // Start-up lines: one per model (dtype = auto resolved), one per device.
    assert!(log.contains("dtype=f32 (dtype = auto)"), "{log}");
    assert!(
        log.contains("worker ready") && log.contains("backend=cpu"),
        "{log}"
    );
}

/// Sends requests of 1..=32 rows from `clients` connections until `stop`,
/// counting successes; any failure panics the task.
fn load(
    endpoint: &str,
    model: &'static str,
    clients: u64,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let endpoint = endpoint.to_string();
            let (stop, done) = (stop.clone(), done.clone());
            tokio::spawn(async move {
                let client = Client::connect(&endpoint).await.unwrap();
                let mut rng = Rng::new(100 + c);
                while !stop.load(Ordering::Relaxed) {
                    let n = rng.range(1, 33);
                    let r = client.infer(model, &rows(&mut rng, n), T).await.unwrap();
                    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect()
}

/// Waits until `done` has grown by `n`.
async fn at_least(done: &AtomicU64, n: u64) {
    let start = done.load(Ordering::Relaxed);
    while done.load(Ordering::Relaxed) < start + n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Under load on two devices: `drain cpu:0` returns once it holds nothing,
/// then cpu:1 serves everything; `undrain` gives cpu:0 work again. No
/// request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_moves_work_off_a_device_without_failing_a_request() {
    let config = format!(
        "[batching]\nmax_wait_us = 500\n{}{}",
        devices(2),
        mlp_model("mlp", "[1, 2, 4, 8, 16, 32]")
    );
    let daemon = Daemon::start(&config);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let tasks = load(&daemon.endpoint, "mlp", 6, stop.clone(), done.clone());
    at_least(&done, 50).await;

    let out = tokio::task::block_in_place(|| ctl_ok(&daemon, &["drain", "cpu:0"]));
    assert!(out.contains("drained"), "{out}");
    let d = daemon.device("cpu:0");
    assert_eq!(d["state"], "draining");
    assert_eq!(d["inflight"], 0);
    let before = d["batches"].as_u64().unwrap();
    let other = daemon.device("cpu:1")["batches"].as_u64().unwrap();
    at_least(&done, 200).await;
    assert_eq!(daemon.device("cpu:0")["batches"].as_u64().unwrap(), before);
    assert!(daemon.device("cpu:1")["batches"].as_u64().unwrap() > other);
    let health = daemon.ctl(&["health", "--json"]);
    let h: Value = serde_json::from_slice(&health.stdout).unwrap();
    assert_eq!(h["status"], "degraded", "{h}");

    ctl_ok(&daemon, &["undrain", "cpu:0"]);
    assert_eq!(daemon.device("cpu:0")["state"], "ready");
    daemon.wait_for("cpu:0 to take batches again", T, |s| {
        s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["label"] == "cpu:0" && d["batches"].as_u64().unwrap() > before)
    });
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let stats = daemon.stats();
    let errors: u64 = stats["requests"]["errors"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(errors, 0, "{:#}", stats["requests"]);
    assert_eq!(
        stats["requests"]["ok"].as_u64().unwrap(),
        done.load(Ordering::Relaxed)
    );
}

/// Under load, the config file's grid changes and `replayctl reload`
/// applies it: every request succeeds, and requests of 3 rows then run in
/// the new 3x1 bucket, which the stats show.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_with_a_changed_grid_under_load_loses_no_request() {
    let config = format!(
        "[batching]\nmax_wait_us = 500\n{}{}",
        devices(2),
        mlp_model("mlp", "[1, 8, 32]")
    );
    let daemon = Daemon::start(&config);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let tasks = load(&daemon.endpoint, "mlp", 6, stop.clone(), done.clone());
    at_least(&done, 50).await;

    let text = std::fs::read_to_string(&daemon.config_path).unwrap();
    let edited = text.replace(
        "batch_buckets = [1, 8, 32]",
        "batch_buckets = [1, 3, 8, 16, 32]",
    );
    assert_ne!(text, edited);
    std::fs::write(&daemon.config_path, edited).unwrap();
    let out = tokio::task::block_in_place(|| ctl_ok(&daemon, &["reload", "--json"]));
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["changed"][0], "models[0].batch_buckets", "{r}");
    assert_eq!(
        r["graphs_captured"], 4,
        "two new buckets on two devices: {r}"
    );
    at_least(&done, 200).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }

    let client = daemon.client().await;
    let mut rng = Rng::new(9);
    for _ in 0..4 {
        let r = client.infer("mlp", &rows(&mut rng, 3), T).await.unwrap();
        ok(&r);
        assert_eq!(r.header.bucket.as_deref(), Some("3x1"));
    }
    let stats = daemon.stats();
    let b = bucket(&stats, "mlp", "3x1");
    assert!(b["requests"].as_u64().unwrap() >= 4, "{b}");
    assert_eq!(b["in_grid"], true);
    assert_eq!(stats["reloads"], 1);
    let errors: u64 = stats["requests"]["errors"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(errors, 0, "{:#}", stats["requests"]);
    assert_eq!(
        stats["requests"]["ok"].as_u64().unwrap(),
        done.load(Ordering::Relaxed) + 4
    );
    // Each device has the new grid's graphs, and only those.
    for label in ["cpu:0", "cpu:1"] {
        let d = daemon.device(label);
        let mut graphs: Vec<String> = d["graphs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["bucket"].as_str().unwrap().to_string())
            .collect();
        graphs.sort();
        assert_eq!(graphs, ["16x1", "1x1", "32x1", "3x1", "8x1"], "{label}");
    }
    // A change a reload cannot apply is refused, naming the key.
    let text = std::fs::read_to_string(&daemon.config_path).unwrap();
    std::fs::write(
        &daemon.config_path,
        text.replace("cpu_devices = 2", "cpu_devices = 3"),
    )
    .unwrap();
    let out = daemon.ctl(&["reload"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`devices.cpu_devices`") && err.contains("restart"),
        "{err}"
    );
}

/// `health` exits 1 while a device restarts and 0 once it is back. The old
/// worker is paused (SIGSTOP) before the restart, so the restart cannot
/// finish before `health` looks, however fast the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_fails_while_a_device_restarts() {
    let config = format!(
        "{}hang_timeout_ms = 600000\n{}",
        devices(1),
        mlp_model("mlp", "[1, 8]")
    );
    let daemon = Daemon::start(&config);
    assert_eq!(daemon.ctl(&["health"]).status.code(), Some(0));
    let old = daemon.device("cpu:0");
    let pid = old["worker_pid"].as_i64().unwrap() as i32;
    freeze(pid);
    let out = ctl_ok(&daemon, &["restart", "cpu:0", "--no-wait"]);
    assert!(out.contains("restarting"), "{out}");
    let h = daemon.ctl(&["health"]);
    assert_eq!(
        h.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&h.stdout)
    );
    assert!(
        String::from_utf8_lossy(&h.stdout).contains("degraded")
            || String::from_utf8_lossy(&h.stdout).contains("starting")
    );
    unsafe { libc::kill(pid, libc::SIGCONT) };
    daemon.wait_for("cpu:0 to be back", T, |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:0"
                && d["state"] == "ready"
                && d["restarts"].as_u64().unwrap() > old["restarts"].as_u64().unwrap()
        })
    });
    assert_eq!(daemon.ctl(&["health"]).status.code(), Some(0));
    let r = daemon
        .client()
        .await
        .infer("mlp", &rows(&mut Rng::new(1), 5), T)
        .await
        .unwrap();
    ok(&r);
}

/// The daemon under a notify socket the test owns, as systemd runs it
/// (`Type=notify`, `WatchdogSec=`): `READY=1` comes only once the worker
/// has captured every graph (its "worker ready" line is already in the
/// log), then `WATCHDOG=1` keeps coming; SIGTERM says `STOPPING=1`. The
/// log is JSON lines, with the per-model and per-device start-up lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_socket_hears_ready_after_capture_then_watchdog_pings() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    socket.set_read_timeout(Some(T)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = socket.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = reader.recv(&mut buf) {
            if tx
                .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                .is_err()
            {
                break;
            }
        }
    });
    let config = format!("{}{}", devices(1), mlp_model("mlp", "[1, 2, 4, 8]"));
    let notify = path.to_str().unwrap();
    let mut daemon = Daemon::start_env(
        &config,
        "",
        None,
        &[
            ("NOTIFY_SOCKET", notify),
            ("WATCHDOG_USEC", "200000"),
            ("REPLAYD_LOG_FORMAT", "json"),
        ],
    );
    let next = || rx.recv_timeout(T).expect("a notify message");
    let mut before_ready = Vec::new();
    loop {
        let m = next();
        if m.lines().any(|l| l == "READY=1") {
            // The daemon logs each worker's readiness before it notifies.
            let log = daemon.log();
            let ready: Vec<Value> = log
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|v| {
                    v["fields"]["message"] == "worker ready" && v["fields"]["device"] == "cpu:0"
                })
                .collect();
            assert_eq!(ready.len(), 1, "{log}");
            assert_eq!(ready[0]["fields"]["graphs"], 4);
            assert!(m.contains("STATUS=ready"), "{m}");
            break;
        }
        before_ready.push(m);
    }
    assert!(
        before_ready.iter().any(|m| m.starts_with("STATUS=")),
        "{before_ready:?}"
    );
    assert!(!before_ready.iter().any(|m| m.contains("READY=1")));
    // Two pings after READY (the first could have been queued before).
    let mut pings = 0;
    while pings < 2 {
        if next() == "WATCHDOG=1" {
            pings += 1;
        }
    }
    daemon.signal(libc::SIGTERM);
    while !next().contains("STOPPING=1") {}
    assert!(daemon.wait(T).success(), "{}", daemon.log());

    // Every line is JSON; the start-up lines say what was derived.
    let log = daemon.log();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let model = lines
        .iter()
        .find(|v| v["fields"]["message"] == "model" && v["fields"]["model"] == "mlp")
        .unwrap_or_else(|| panic!("no start-up line for the model:\n{log}"));
    assert_eq!(model["fields"]["dtype"], "f32 (dtype = auto)");
    assert_eq!(model["fields"]["features"], 128);
    assert!(lines.iter().all(|v| v["level"] != "WARN"), "{log}");
}

/// replayctl with no daemon behind the socket says so and exits 2, at once:
/// the message is the plain one, not "no answer within" its (long) timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayctl_without_a_daemon_fails_plainly() {
    let dir = tempfile::tempdir().unwrap();
    let run = |control: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayctl"))
            .args(["--control", control, "--timeout", "300", "health"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(out.stdout.is_empty());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A wrong path.
    let missing = format!("ipc://{}/control.sock", dir.path().display());
    let err = run(&missing);
    assert!(
        err.contains("no socket at") && err.contains("is replayd running"),
        "{err}"
    );
    // A socket file left behind with nothing listening.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let err = run(&format!("ipc://{}", stale.display()));
    assert!(err.contains("nothing listens"), "{err}");
    // A loopback port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = run(&format!("tcp://127.0.0.1:{port}"));
    assert!(err.contains("nothing listens there"), "{err}");
    // Not an endpoint at all.
    let err = run("/run/replayd/control.sock");
    assert!(err.contains("not a control endpoint"), "{err}");

    // A daemon that was running and stopped (the harness's control
    // endpoint is loopback tcp).
    let config = format!("{}{}", devices(1), mlp_model("mlp", "[1]"));
    let mut daemon = Daemon::start(&config);
    assert_eq!(daemon.ctl(&["health"]).status.code(), Some(0));
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait(T).success());
    let out = daemon.ctl(&["--timeout", "300", "stats"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nothing listens there"), "{err}");
}
