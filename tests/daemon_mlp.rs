//! The daemon core, end to end on the CPU backend, with the seed MLP: real
//! daemon process, real worker processes, real ZeroMQ sockets.

mod common;

use bytes::Bytes;
use common::{data, freeze, rel_err, Daemon, MlpReference, Rng};
use replayd::protocol::client::{Client, RawClient, Response};
use replayd::protocol::{ErrorCode, InputKind, RequestHeader, Status};
use replayd::tensor::{DType, HostTensor};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

const BUCKETS: [usize; 6] = [1, 2, 4, 8, 16, 32];

fn mlp_config(extra_batching: &str) -> String {
    format!(
        r#"
[batching]
max_wait_us = 1000
{extra_batching}

[devices]
backend = "cpu"
cpu_devices = 2
cpu_threads = 1
fault_injection = true
restart_backoff_ms = 50

[eager]
workers = 1

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
activation = "relu"
batch_buckets = [1, 2, 4, 8, 16, 32]
"#,
        data("mlp_seed.safetensors").display()
    )
}

fn random_rows(rng: &mut Rng, rows: usize) -> Vec<f32> {
    (0..rows * 128).map(|_| rng.normal()).collect()
}

const T: Duration = Duration::from_secs(60);

fn output_of(r: &Response) -> Vec<f32> {
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
    r.output.as_ref().unwrap().to_f32_vec().unwrap()
}

fn bucket_sum(stats: &Value, field: &str) -> u64 {
    stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b[field].as_u64().unwrap())
        .sum()
}

/// 1,000 requests of random batch sizes from 16 concurrent sockets on two
/// CPU devices: every output is right, and the per-bucket counters add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_requests_from_many_clients_are_correct_and_counted() {
    let daemon = Daemon::start(&mlp_config(""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));

    // The reference batches first, in order.
    let client = daemon.client().await;
    for line in std::fs::read_to_string(data("mlp_seed_io.jsonl"))
        .unwrap()
        .lines()
    {
        let v: Value = serde_json::from_str(line).unwrap();
        let rows: Vec<Vec<f32>> = serde_json::from_value(v["input"].clone()).unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(v["output"].clone()).unwrap();
        let x: Vec<f32> = rows.concat();
        let r = client
            .infer("mlp", &HostTensor::from_f32(vec![rows.len(), 128], &x), T)
            .await
            .unwrap();
        let got = output_of(&r);
        assert_eq!(r.output.as_ref().unwrap().shape, vec![rows.len(), 10]);
        let err = rel_err(&got, &want.concat());
        assert!(
            err < 1e-5,
            "reference batch of {}: rel err {err}",
            rows.len()
        );
    }
    let sent_before = bucket_sum(&daemon.stats(), "requests");

    let mut tasks = Vec::new();
    for c in 0..16u64 {
        let endpoint = daemon.endpoint.clone();
        let reference = reference.clone();
        tasks.push(tokio::spawn(async move {
            let client = Arc::new(Client::connect(&endpoint).await.unwrap());
            let mut rng = Rng::new(c);
            let mut inflight = Vec::new();
            let mut rows_sent = 0;
            for _ in 0..(if c < 8 { 63 } else { 62 }) {
                let rows = rng.range(1, 33);
                rows_sent += rows;
                let x = random_rows(&mut rng, rows);
                let client = client.clone();
                inflight.push(tokio::spawn(async move {
                    let r = client
                        .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                        .await
                        .unwrap();
                    (x, rows, r)
                }));
            }
            let mut n = 0;
            for t in inflight {
                let (x, rows, r) = t.await.unwrap();
                let got = output_of(&r);
                let err = rel_err(&got, &reference.forward(&x, rows));
                assert!(err < 1e-5, "client {c}: {rows} rows, rel err {err}");
                let bucket = r.header.bucket.clone().unwrap();
                let b: usize = bucket.split('x').next().unwrap().parse().unwrap();
                assert!(
                    BUCKETS.contains(&b) && b >= rows,
                    "{rows} rows ran in {bucket}"
                );
                assert!(r.header.device.as_deref().unwrap().starts_with("cpu:"));
                n += 1;
            }
            (n, rows_sent)
        }));
    }
    let mut requests = 0;
    let mut rows = 0;
    for t in tasks {
        let (n, r) = t.await.unwrap();
        requests += n;
        rows += r;
    }
    assert_eq!(requests, 1000);

    let stats = daemon.stats();
    assert_eq!(bucket_sum(&stats, "requests") - sent_before, 1000);
    let ref_rows = 1 + 3 + 8 + 13;
    assert_eq!(bucket_sum(&stats, "rows"), rows as u64 + ref_rows);
    for b in stats["buckets"].as_array().unwrap() {
        let size = b["batch"].as_u64().unwrap();
        assert_eq!(
            b["rows"].as_u64().unwrap() + b["padded_rows"].as_u64().unwrap(),
            size * b["batches"].as_u64().unwrap(),
            "bucket {b}"
        );
    }
    assert_eq!(stats["requests"]["ok"].as_u64().unwrap(), 1004);
    assert_eq!(stats["eager"]["requests"], 0);
    // Both devices served.
    for d in ["cpu:0", "cpu:1"] {
        assert!(
            daemon.device(d)["batches"].as_u64().unwrap() > 0,
            "{d} idle"
        );
    }
}

/// A request with more rows than the largest batch bucket is split over
/// graph batches (never sent to the eager worker for its size), and its
/// reply has every row in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_request_is_split_over_graph_batches() {
    let daemon = Daemon::start(&mlp_config(""));
    let reference = MlpReference::load(&data("mlp_seed.safetensors"));
    let client = daemon.client().await;
    let mut rng = Rng::new(42);
    let rows = 100;
    let x = random_rows(&mut rng, rows);
    let r = client
        .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
        .await
        .unwrap();
    let out = output_of(&r);
    assert_eq!(r.output.as_ref().unwrap().shape, vec![rows, 10]);
    // The largest shape it ran in; 32 + 32 + 32 + 4 rows at least.
    assert_eq!(r.header.bucket.as_deref(), Some("32x1"));
    assert!(r.header.batches.unwrap() >= 4, "{:?}", r.header);
    assert!(r.header.device.as_deref().unwrap().starts_with("cpu:"));
    let err = rel_err(&out, &reference.forward(&x, rows));
    assert!(err < 1e-5, "rel err {err}");
    let stats = daemon.stats();
    assert_eq!(stats["eager"]["requests"], 0);
    assert_eq!(stats["eager"]["sequences"], 0);
    assert_eq!(daemon.device("eager:0")["batches"], 0);
    assert_eq!(bucket_sum(&stats, "requests"), 1);
    assert_eq!(bucket_sum(&stats, "rows"), rows as u64);
    assert_eq!(stats["requests"]["split"], 1);
}

/// Sends `signal` to each worker.
/// An overflow inside the model (finite inputs near f32's largest) gives
/// a request an error naming the item, never NaN or infinity as a result;
/// the next request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_finite_result_is_an_error_not_an_output() {
    let daemon = Daemon::start(&mlp_config(""));
    let client = daemon.client().await;
    let mut rng = Rng::new(9);
    let mut x = random_rows(&mut rng, 3);
    for v in &mut x[128..256] {
        *v = if *v > 0.0 { f32::MAX } else { -f32::MAX };
    }
    let r = client
        .infer("mlp", &HostTensor::from_f32(vec![3, 128], &x), T)
        .await
        .unwrap();
    assert_eq!(r.header.code, Some(ErrorCode::Internal), "{:?}", r.header);
    let message = r.header.message.unwrap_or_default();
    assert!(
        message.contains("non-finite") && message.contains("item 1"),
        "{message}"
    );
    let x = random_rows(&mut rng, 2);
    let r = client
        .infer("mlp", &HostTensor::from_f32(vec![2, 128], &x), T)
        .await
        .unwrap();
    assert!(output_of(&r).iter().all(|v| v.is_finite()));
    assert_eq!(daemon.stats()["requests"]["errors"]["internal"], 1);
}

fn signal_all(pids: &[i32], signal: i32) {
    for &p in pids {
        // SAFETY: signalling a worker process of the daemon under test.
        unsafe { libc::kill(p, signal) };
    }
}

/// Stops each worker (every thread stopped on return), so work piles up on it.
fn freeze_all(pids: &[i32]) {
    for &p in pids {
        freeze(p);
    }
}

fn worker_pid(daemon: &Daemon, label: &str) -> i32 {
    daemon.device(label)["worker_pid"]
        .as_i64()
        .expect("worker pid") as i32
}

/// kill -9 of a worker holding batches: every request still gets exactly one
/// correct reply, the worker comes back with its graphs re-captured.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_worker_loses_nothing_and_comes_back() {
    let daemon = Daemon::start(&mlp_config(""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let victim = worker_pid(&daemon, "cpu:0");
    // Freeze the worker so that batches pile up on it, then kill it.
    freeze_all(&[victim]);

    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(7);
    let mut tasks = Vec::new();
    for _ in 0..500 {
        let rows = rng.range(1, 9);
        let x = random_rows(&mut rng, rows);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = client
                .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                .await
                .unwrap();
            (x, rows, r)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal_all(&[victim], libc::SIGKILL);

    let mut ids = std::collections::HashSet::new();
    for t in tasks {
        let (x, rows, r) = t.await.unwrap();
        assert!(
            ids.insert(r.header.id),
            "two replies for request {}",
            r.header.id
        );
        let err = rel_err(&output_of(&r), &reference.forward(&x, rows));
        assert!(err < 1e-5, "rel err {err}");
    }
    assert_eq!(ids.len(), 500);

    let stats = daemon.wait_for("cpu:0 to come back", Duration::from_secs(60), |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:0" && d["state"] == "ready" && d["restarts"].as_u64() == Some(1)
        })
    });
    assert!(
        stats["retried_batches"].as_u64().unwrap() >= 1,
        "no batch was in flight on the killed worker"
    );
    let dev = daemon.device("cpu:0");
    assert_ne!(dev["worker_pid"].as_i64().unwrap() as i32, victim);
    assert_eq!(
        dev["graphs"].as_array().unwrap().len(),
        BUCKETS.len(),
        "graphs re-captured"
    );
    assert!(
        dev["last_error"].as_str().unwrap().contains("signal 9"),
        "{dev}"
    );
    assert_eq!(stats["requests"]["errors"]["internal"], 0);

    // The restarted worker serves again.
    let before = dev["batches"].as_u64().unwrap();
    for _ in 0..40 {
        let x = random_rows(&mut rng, 1);
        let r = client
            .infer("mlp", &HostTensor::from_f32(vec![1, 128], &x), T)
            .await
            .unwrap();
        assert!(rel_err(&output_of(&r), &reference.forward(&x, 1)) < 1e-5);
    }
    daemon.wait_for("cpu:0 to serve again", Duration::from_secs(10), |_| {
        daemon.device("cpu:0")["batches"].as_u64().unwrap() > before
    });
}

/// Requests larger than every bucket, split over batches on both devices,
/// while the worker holding some of their batches is frozen and then killed:
/// every request gets exactly one reply, with every row right and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_worker_mid_batch_answers_every_split_request_once() {
    let daemon = Daemon::start(&mlp_config(""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let victim = worker_pid(&daemon, "cpu:0");
    freeze_all(&[victim]);
    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(17);
    let mut tasks = Vec::new();
    let mut rows_sent = 0;
    for _ in 0..60 {
        let rows = rng.range(20, 101);
        rows_sent += rows;
        let x = random_rows(&mut rng, rows);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = client
                .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                .await
                .unwrap();
            (x, rows, r)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal_all(&[victim], libc::SIGKILL);
    let mut ids = std::collections::HashSet::new();
    let mut split = 0;
    for t in tasks {
        let (x, rows, r) = t.await.unwrap();
        assert!(ids.insert(r.header.id), "two replies for {}", r.header.id);
        let err = rel_err(&output_of(&r), &reference.forward(&x, rows));
        assert!(err < 1e-5, "{rows} rows: rel err {err}");
        split += u64::from(r.header.batches.unwrap() > 1);
    }
    assert_eq!(ids.len(), 60);
    assert!(split > 0);
    let stats = daemon.wait_for("cpu:0 to come back", Duration::from_secs(60), |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:0" && d["state"] == "ready" && d["restarts"].as_u64() == Some(1)
        })
    });
    assert!(stats["retried_batches"].as_u64().unwrap() >= 1);
    assert_eq!(stats["requests"]["errors"]["internal"], 0);
    assert_eq!(stats["requests"]["ok"].as_u64().unwrap(), 60);
    assert_eq!(stats["eager"]["requests"], 0);
    // Rows of retried batches count once per completed batch.
    assert_eq!(bucket_sum(&stats, "rows"), rows_sent as u64);
    assert_eq!(client.stray_replies(), 0);
}

/// A request whose batch is stuck on a frozen worker is answered
/// `deadline_exceeded` at its deadline, not when the batch comes back, and
/// only once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadline_passing_while_in_flight_is_answered_at_the_deadline() {
    let daemon = Daemon::start(&mlp_config(""));
    let pids = [worker_pid(&daemon, "cpu:0"), worker_pid(&daemon, "cpu:1")];
    freeze_all(&pids);
    let client = daemon.client().await;
    let x = [0.25f32; 3 * 128];
    let mut h = RequestHeader::new(client.next_id(), "mlp", InputKind::Tensor);
    h.dtype = Some(DType::F32);
    h.shape = Some(vec![3, 128]);
    h.timeout_us = Some(300_000);
    let t0 = std::time::Instant::now();
    let r = client
        .request(
            &h,
            &replayd::protocol::Payload::Tensor(HostTensor::from_f32(vec![3, 128], &x)),
            T,
        )
        .await
        .unwrap();
    let took = t0.elapsed();
    assert_eq!(
        r.header.code,
        Some(ErrorCode::DeadlineExceeded),
        "{:?}",
        r.header
    );
    assert!(
        r.header.message.as_deref().unwrap().contains("running"),
        "{:?}",
        r.header.message
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    // The batch comes back once the worker runs again: ignored.
    signal_all(&pids, libc::SIGCONT);
    let reference = MlpReference::load(&data("mlp_seed.safetensors"));
    let r = client
        .infer("mlp", &HostTensor::from_f32(vec![3, 128], &x), T)
        .await
        .unwrap();
    assert!(rel_err(&output_of(&r), &reference.forward(&x, 3)) < 1e-5);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(client.stray_replies(), 0);
    let stats = daemon.stats();
    assert_eq!(stats["requests"]["errors"]["deadline_exceeded"], 1);
    assert_eq!(stats["requests"]["ok"], 1);
}

/// An injected device fault makes the worker exit with the device-fault
/// status; its batches are served anyway and it restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn injected_fault_under_load_is_recovered() {
    let daemon = Daemon::start(&mlp_config(""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let out = daemon.ctl(&["inject-fault", "--device", "cpu:1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(9);
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let rows = rng.range(1, 17);
        let x = random_rows(&mut rng, rows);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            (
                x.clone(),
                rows,
                client
                    .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                    .await
                    .unwrap(),
            )
        }));
    }
    for t in tasks {
        let (x, rows, r) = t.await.unwrap();
        assert!(rel_err(&output_of(&r), &reference.forward(&x, rows)) < 1e-5);
    }
    daemon.wait_for(
        "cpu:1 to recover from the fault",
        Duration::from_secs(60),
        |s| {
            s["devices"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["label"] == "cpu:1" && d["state"] == "ready" && d["device_faults"] == 1)
        },
    );
}

/// 300 requests of random sizes, each checked against the reference.
async fn serve_checked(daemon: &Daemon, seed: u64, n: usize) {
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(seed);
    let mut tasks = Vec::new();
    for _ in 0..n {
        let rows = rng.range(1, 17);
        let x = random_rows(&mut rng, rows);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let r = client
                .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                .await
                .unwrap();
            (x, rows, r)
        }));
    }
    let mut ids = std::collections::HashSet::new();
    for t in tasks {
        let (x, rows, r) = t.await.unwrap();
        assert!(ids.insert(r.header.id), "two replies for {}", r.header.id);
        assert!(rel_err(&output_of(&r), &reference.forward(&x, rows)) < 1e-5);
    }
}

fn watchdog_config() -> String {
    mlp_config("").replace(
        "restart_backoff_ms = 50",
        "restart_backoff_ms = 50\nhang_timeout_ms = 500\nheartbeat_ms = 50",
    )
}

/// A device that stops making progress (an injected hang: the next batch
/// never finishes, the worker process stays alive) is found by the
/// watchdog; its batches run elsewhere and it restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hung_device_is_found_by_the_watchdog_and_loses_nothing() {
    let daemon = Daemon::start(&watchdog_config());
    let out = daemon.ctl(&["inject-fault", "--device", "cpu:0", "--kind", "hang"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = std::time::Instant::now();
    serve_checked(&daemon, 11, 300).await;
    let stats = daemon.wait_for("cpu:0 to be found hung and come back", T, |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:0" && d["state"] == "ready" && d["hangs"] == 1 && d["restarts"] == 1
        })
    });
    let dev = daemon.device("cpu:0");
    assert!(
        dev["last_error"].as_str().unwrap().contains("hung"),
        "{dev}"
    );
    assert_eq!(stats["requests"]["errors"]["internal"], 0);
    println!(
        "hang injected: all 300 requests answered, cpu:0 back after {:?}",
        started.elapsed()
    );
}

/// A stopped worker (SIGSTOP) holding batches is found within the
/// watchdog's bound; every request is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopped_worker_is_found_by_the_watchdog() {
    let daemon = Daemon::start(&watchdog_config());
    let victim = worker_pid(&daemon, "cpu:1");
    freeze_all(&[victim]);
    let stopped = std::time::Instant::now();
    serve_checked(&daemon, 12, 200).await;
    daemon.wait_for("cpu:1 to be found hung", T, |s| {
        s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["label"] == "cpu:1" && d["hangs"] == 1)
    });
    println!(
        "SIGSTOP'd worker found and every request answered after {:?}",
        stopped.elapsed()
    );
    let health = daemon.ctl(&["health", "--json"]);
    assert!(health.status.success() || !health.stdout.is_empty());
    // A new worker replaces it (no pid while it starts).
    daemon.wait_for("a new cpu:1 worker", T, |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:1" && d["worker_pid"].as_i64().is_some_and(|p| p as i32 != victim)
        })
    });
}

fn header_frame(h: &RequestHeader) -> Bytes {
    Bytes::from(rmp_serde::to_vec_named(h).unwrap())
}

async fn expect_error(raw: &mut RawClient, frames: Vec<Bytes>, code: ErrorCode, needle: &str) {
    raw.send(frames).await.unwrap();
    let r = raw.recv_reply(T).await.unwrap();
    assert_eq!(r.header.status, Status::Error);
    assert_eq!(r.header.code, Some(code), "{:?}", r.header.message);
    let msg = r.header.message.unwrap_or_default();
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
}

/// Each kind of bad input gets its error code and a message saying what is
/// wrong, and the daemon keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_clear_errors() {
    let daemon = Daemon::start(&mlp_config(""));
    let mut raw = RawClient::connect(&daemon.endpoint).await.unwrap();
    let good = |id: u64| {
        let mut h = RequestHeader::new(id, "mlp", InputKind::Tensor);
        h.dtype = Some(DType::F32);
        h.shape = Some(vec![2, 128]);
        h
    };
    let payload = Bytes::from(vec![0u8; 2 * 128 * 4]);

    expect_error(
        &mut raw,
        vec![Bytes::from_static(b"not msgpack \xc1")],
        ErrorCode::BadRequest,
        "malformed header",
    )
    .await;
    expect_error(
        &mut raw,
        vec![Bytes::new()],
        ErrorCode::BadRequest,
        "malformed header",
    )
    .await;
    let mut h = good(2);
    h.model = "nope".into();
    expect_error(
        &mut raw,
        vec![header_frame(&h), payload.clone()],
        ErrorCode::UnknownModel,
        "no model named \"nope\"",
    )
    .await;
    // NaN and ±Inf are refused (a graph's ReLU would turn them into a
    // finite wrong answer), naming where they are.
    for (at, bad) in [
        (5usize, f32::NAN),
        (130, f32::INFINITY),
        (255, f32::NEG_INFINITY),
    ] {
        let mut rows = vec![0.5f32; 2 * 128];
        rows[at] = bad;
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        expect_error(
            &mut raw,
            vec![header_frame(&good(100 + at as u64)), Bytes::from(bytes)],
            ErrorCode::BadRequest,
            &format!(
                "input value {at} (row {}, column {}) is",
                at / 128,
                at % 128
            ),
        )
        .await;
    }
    let mut h = good(3);
    h.dtype = Some(DType::F16);
    expect_error(
        &mut raw,
        vec![header_frame(&h), Bytes::from(vec![0u8; 2 * 128 * 2])],
        ErrorCode::BadRequest,
        "takes f32",
    )
    .await;
    let mut h = good(4);
    h.shape = Some(vec![2, 64]);
    expect_error(
        &mut raw,
        vec![header_frame(&h), Bytes::from(vec![0u8; 2 * 64 * 4])],
        ErrorCode::BadRequest,
        "[n, 128]",
    )
    .await;
    expect_error(
        &mut raw,
        vec![header_frame(&good(5)), payload.slice(..1000)],
        ErrorCode::BadRequest,
        "needs 1024 bytes, got 1000",
    )
    .await;
    expect_error(
        &mut raw,
        vec![header_frame(&good(6))],
        ErrorCode::BadRequest,
        "exactly one payload frame",
    )
    .await;
    let mut h = good(7);
    h.deadline_unix_us = Some(1);
    expect_error(
        &mut raw,
        vec![header_frame(&h), payload.clone()],
        ErrorCode::DeadlineExceeded,
        "deadline",
    )
    .await;
    let mut h = good(8);
    h.input = InputKind::Texts;
    expect_error(
        &mut raw,
        vec![header_frame(&h), Bytes::from_static(b"hello")],
        ErrorCode::BadRequest,
        "takes input \"tensor\"",
    )
    .await;

    // The daemon still serves, with the id echoed.
    raw.send(vec![header_frame(&good(99)), payload.clone()])
        .await
        .unwrap();
    let r = raw.recv_reply(T).await.unwrap();
    assert_eq!((r.header.id, r.header.status), (99, Status::Ok));
    let stats = daemon.stats();
    assert!(stats["requests"]["errors"]["bad_request"].as_u64().unwrap() >= 7);
    assert_eq!(stats["requests"]["errors"]["unknown_model"], 1);
    assert_eq!(stats["requests"]["errors"]["deadline_exceeded"], 1);
}

/// A flood beyond the queue limit is answered `overloaded` at once; nothing
/// hangs and nothing is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flood_beyond_the_queue_limit_is_overloaded() {
    let daemon = Daemon::start(&mlp_config("max_queue = 4\nmax_inflight_per_device = 1"));
    // Freeze both workers so the queue cannot drain.
    let pids = [worker_pid(&daemon, "cpu:0"), worker_pid(&daemon, "cpu:1")];
    freeze_all(&pids);
    let client = Arc::new(daemon.client().await);
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            client
                .infer("mlp", &HostTensor::from_f32(vec![1, 128], &[0.5; 128]), T)
                .await
                .unwrap()
        }));
    }
    // Overloaded replies come back while the workers are still frozen.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let overloaded = daemon.stats()["requests"]["errors"]["overloaded"]
        .as_u64()
        .unwrap();
    assert!(
        overloaded >= 190,
        "only {overloaded} overloaded replies while frozen"
    );
    signal_all(&pids, libc::SIGCONT);
    let (mut ok, mut over) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.header.code {
            None => ok += 1,
            Some(ErrorCode::Overloaded) => {
                assert!(r.header.message.unwrap().contains("retry later"));
                over += 1
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ok + over, 200);
    // At most two dispatched (one per device) plus four queued.
    assert!((4..=6).contains(&ok), "{ok} served");
}

/// SIGTERM with work queued: everything accepted is answered, then exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_answers_everything_accepted_before_exit() {
    let mut daemon = Daemon::start(&mlp_config(""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let pids = [worker_pid(&daemon, "cpu:0"), worker_pid(&daemon, "cpu:1")];
    freeze_all(&pids);
    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(3);
    let mut tasks = Vec::new();
    for _ in 0..300 {
        let rows = rng.range(1, 5);
        let x = random_rows(&mut rng, rows);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            (
                x.clone(),
                rows,
                client
                    .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                    .await
                    .unwrap(),
            )
        }));
    }
    daemon.wait_for("300 accepted", Duration::from_secs(10), |s| {
        s["requests"]["accepted"] == 300
    });
    daemon.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A request after SIGTERM is refused, not lost.
    let late = client
        .infer("mlp", &HostTensor::from_f32(vec![1, 128], &[0.0; 128]), T)
        .await
        .unwrap();
    assert_eq!(late.header.code, Some(ErrorCode::Unavailable));
    signal_all(&pids, libc::SIGCONT);
    for t in tasks {
        let (x, rows, r) = t.await.unwrap();
        assert!(rel_err(&output_of(&r), &reference.forward(&x, rows)) < 1e-5);
    }
    let status = daemon.wait(Duration::from_secs(30));
    assert!(status.success(), "exit status {status}\n{}", daemon.log());
}

/// replayctl health reports every device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayctl_health_and_stats() {
    let daemon = Daemon::start(&mlp_config(""));
    let out = daemon.ctl(&["health"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("status: ok"), "{text}");
    for d in ["cpu:0", "cpu:1", "eager:0"] {
        assert!(text.contains(d), "{text}");
    }
    let out = daemon.ctl(&["stats"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("graph hit rate"));
    let out = daemon.ctl(&["inject-fault", "--device", "cuda:7"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no device \"cuda:7\""));
}

/// Invalid configs stop the daemon at start-up (exit 78) with a message
/// naming the key.
#[test]
fn invalid_config_names_the_key() {
    let (status, log) = Daemon::start_failing(
        &format!("{}\n[batching]\nmax_wiat_us = 3\n", mlp_config(""))
            .replace("[batching]\nmax_wait_us = 1000\n", ""),
    );
    // EX_CONFIG: the systemd unit does not restart a config it rejects.
    assert_eq!(status.code(), Some(78), "{log}");
    assert!(log.contains("max_wiat_us"), "{log}");
    let (status, log) = Daemon::start_failing(&mlp_config("max_queue = 0"));
    assert!(!status.success());
    assert!(log.contains("batching.max_queue"), "{log}");
}

/// `backend = "cuda"` on a machine without a usable GPU fails at start-up
/// and says why; `auto` falls back to the CPU and says so in the log.
#[test]
fn cuda_backend_without_a_gpu_fails_clearly_and_auto_falls_back() {
    if matches!(replayd::gpu::cuda_device_count(), Ok(n) if n > 0) {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    let cfg = mlp_config("").replace("backend = \"cpu\"", "backend = \"cuda\"");
    let (status, log) = Daemon::start_failing(&cfg);
    assert!(!status.success());
    assert!(log.contains("devices.backend = \"cuda\""), "{log}");
    let daemon = Daemon::start(&mlp_config("").replace("backend = \"cpu\"", "backend = \"auto\""));
    assert!(
        daemon.log().contains("using the CPU backend"),
        "{}",
        daemon.log()
    );
    assert_eq!(daemon.device("cpu:0")["state"], "ready");
}
