//! The Rust client (`replayd::protocol::client`) against real daemons:
//! pipelining on one socket, a client that never reads, daemon restarts
//! under connected clients, and several daemons with one of them killed or
//! frozen.

mod common;

use common::{data, free_port, freeze, rel_err, Daemon, MlpReference, Rng};
use replayd::protocol::client::{outstanding, Call, Client, ClientOptions, Error};
use replayd::protocol::{encode_request, ErrorCode, InputKind, Payload, RequestHeader, Status};
use replayd::tensor::HostTensor;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

fn mlp_config(devices: usize, extra: &str) -> String {
    format!(
        r#"
[batching]
max_wait_us = 500

[devices]
backend = "cpu"
cpu_devices = {devices}
cpu_threads = 1
restart_backoff_ms = 50

[eager]
workers = 0
{extra}

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
activation = "relu"
batch_buckets = [1, 8, 32]
"#,
        data("mlp_seed.safetensors").display()
    )
}

fn rows(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n * 128).map(|_| rng.normal()).collect()
}

fn worker_pid(daemon: &Daemon, label: &str) -> i32 {
    daemon.device(label)["worker_pid"]
        .as_i64()
        .expect("worker pid") as i32
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a process this test started (a daemon or its worker).
    unsafe { libc::kill(pid, sig) };
}

/// One client, 1,000 requests in flight at once on its one socket, each a
/// different input: every reply is matched to its own request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_requests_in_flight_on_one_socket_are_all_matched() {
    let daemon = Daemon::start(&mlp_config(2, ""));
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let client = Arc::new(daemon.client().await);
    let mut rng = Rng::new(7);
    let inputs: Vec<Vec<f32>> = (0..1000).map(|i| rows(&mut rng, 1 + i % 3)).collect();
    let calls = inputs.iter().map(|x| {
        let client = client.clone();
        let n = x.len() / 128;
        let t = HostTensor::from_f32(vec![n, 128], x);
        async move { client.call(Call::tensor("mlp", t).timeout(T)).await }
    });
    let outputs = futures::future::join_all(calls).await;
    for (i, (x, out)) in inputs.iter().zip(outputs).enumerate() {
        let out = out.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let m = out.matrix();
        assert_eq!((m.rows, m.cols), (x.len() / 128, 10), "request {i}");
        let want = reference.forward(x, m.rows);
        assert!(
            rel_err(&m.data, &want) < 1e-5,
            "request {i} got another's reply"
        );
        assert_eq!(out.attempts, 1);
    }
    let stats = &client.stats()[0];
    assert!(stats.peak_in_flight >= 500, "{stats:?}");
    assert_eq!(
        (stats.sent, stats.replies, stats.in_flight),
        (1000, 1000, 0)
    );
    assert_eq!((client.stray_replies(), outstanding(&client)), (0, 0));

    // The low-level request() gives the caller's id back, whatever it is
    // (the same id twice at once included).
    let x = rows(&mut rng, 1);
    let mut header = RequestHeader::new(42, "mlp", InputKind::Tensor);
    header.dtype = Some(replayd::tensor::DType::F32);
    header.shape = Some(vec![1, 128]);
    let payload = Payload::Tensor(HostTensor::from_f32(vec![1, 128], &x));
    let (a, b) = tokio::join!(
        client.request(&header, &payload, T),
        client.request(&header, &payload, T)
    );
    for r in [a.unwrap(), b.unwrap()] {
        assert_eq!((r.header.id, r.header.status), (42, Status::Ok));
    }
    // Error replies of the typed API are errors with the protocol's code.
    let e = client
        .call(Call::tensor("nope", HostTensor::from_f32(vec![1, 128], &x)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownModel), "{e}");
    let e = client
        .call(Call::tensor(
            "mlp",
            HostTensor::from_f32(vec![1, 2], &[1.0, 2.0]),
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Server {
                code: ErrorCode::BadRequest,
                attempts: 1,
                ..
            }
        ),
        "{e}"
    );
    // infer_f32 splits over requests and keeps the order.
    let big = rows(&mut rng, 70);
    let c = Client::connect_with(
        &[daemon.endpoint.as_str()],
        ClientOptions {
            max_items_per_request: 32,
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap();
    let m = c.infer_f32("mlp", 128, &big).await.unwrap();
    assert_eq!((m.rows, m.cols), (70, 10));
    assert!(rel_err(&m.data, &reference.forward(&big, 70)) < 1e-5);
    assert_eq!(c.stats()[0].sent, 3);
    // A call over max_request_bytes fails at once, before anything is sent
    // (the daemon would drop the connection with no reply).
    let small = Client::connect_with(
        &[daemon.endpoint.as_str()],
        ClientOptions {
            max_request_bytes: 64 << 10,
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap();
    let started = Instant::now();
    let e = small
        .infer_f32("mlp", 128, &rows(&mut rng, 200))
        .await
        .map(|m| m.rows);
    assert_eq!(
        e.ok(),
        Some(200),
        "200 rows of 512 bytes are split, not refused"
    );
    let wide = HostTensor::from_f32(vec![1, 20_000], &vec![0.0; 20_000]);
    match small.call(Call::tensor("mlp", wide)).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("max_request_bytes"), "{m}"),
        other => panic!("{:?}", other.map(|o| o.tensor.shape)),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        small.stats()[0].sent,
        2,
        "two requests, and the refused call sent nothing"
    );
}

/// A wide one-layer MLP (4 → 4096), so that each reply is large (16 KiB a row).
fn wide_mlp(dir: &std::path::Path) -> std::path::PathBuf {
    let (out, inp) = (4096usize, 4usize);
    let weights: Vec<f32> = (0..out * inp)
        .map(|i| ((i % 7) as f32 - 3.0) / 8.0)
        .collect();
    let bias = vec![0.25f32; out];
    let header = format!(
        r#"{{"0.weight":{{"dtype":"F32","shape":[{out},{inp}],"data_offsets":[0,{}]}},"0.bias":{{"dtype":"F32","shape":[{out}],"data_offsets":[{},{}]}}}}"#,
        4 * out * inp,
        4 * out * inp,
        4 * out * inp + 4 * out
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    for v in weights.iter().chain(&bias) {
        bytes.extend(v.to_le_bytes());
    }
    let path = dir.join("wide.safetensors");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A client that sends many requests with large replies and never reads
/// them does not delay another client's replies (by more than a second):
/// its replies pile up to `server.send_hwm` and are then dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_never_reads_does_not_delay_another() {
    let dir = tempfile::tempdir().unwrap();
    let model = wide_mlp(dir.path());
    let daemon = Daemon::start_with(
        &format!(
            r#"
[devices]
backend = "cpu"
cpu_threads = 1

[eager]
workers = 0

[[models]]
name = "wide"
kind = "mlp"
path = "{}"
batch_buckets = [1, 64]
"#,
            model.display()
        ),
        "send_hwm = 20",
    );
    // The flood: a libzmq DEALER that reads nothing (receive HWM 1).
    let ctx = zmq::Context::new();
    let flood = ctx.socket(zmq::DEALER).unwrap();
    flood.set_rcvhwm(1).unwrap();
    flood.set_linger(0).unwrap();
    flood.connect(&daemon.endpoint).unwrap();
    let x = vec![0.5f32; 64 * 4];
    let mut header = RequestHeader::new(0, "wide", InputKind::Tensor);
    header.dtype = Some(replayd::tensor::DType::F32);
    header.shape = Some(vec![64, 4]);
    let payload = Payload::Tensor(HostTensor::from_f32(vec![64, 4], &x));
    let n_flood = 300u64; // 300 × 1 MiB of replies
    for id in 1..=n_flood {
        header.id = id;
        let frames = encode_request(&header, &payload);
        let frames: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        flood.send_multipart(frames, 0).unwrap();
    }
    let client = daemon.client().await;
    let one = HostTensor::from_f32(vec![1, 4], &[1.0, 2.0, 3.0, 4.0]);
    let mut worst = Duration::ZERO;
    // While the flood is being answered, then after it.
    for _ in 0..20 {
        let t0 = Instant::now();
        let out = client
            .call(Call::tensor("wide", one.clone()).priority(255))
            .await
            .unwrap();
        worst = worst.max(t0.elapsed());
        assert_eq!(out.tensor.shape, vec![1, 4096]);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = daemon.wait_for("the flood answered", T, |s| {
        s["transport"]["client"]["dropped_sends"]
            .as_u64()
            .unwrap_or(0)
            > 0
    });
    for _ in 0..10 {
        let t0 = Instant::now();
        client
            .call(Call::tensor("wide", one.clone()))
            .await
            .unwrap();
        worst = worst.max(t0.elapsed());
    }
    assert!(
        worst < Duration::from_secs(1),
        "another client's reply took {worst:?} while one client did not read"
    );
    let dropped = stats["transport"]["client"]["dropped_sends"]
        .as_u64()
        .unwrap();
    eprintln!("the non-reading client: {dropped} replies dropped; worst other reply {worst:?}");
    drop(flood);
}

/// The daemon is killed and started again on the same address under two
/// connected clients, with requests in flight: the retrying client's
/// requests are re-sent and succeed; the one-attempt client's fail at once
/// with ConnectionLost; nothing hangs; later requests succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_daemon_restart_under_connected_clients() {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    // The frozen worker holds the requests in flight until the daemon is
    // killed: the watchdog must not answer them first by restarting it.
    let config = mlp_config(1, "").replace(
        "restart_backoff_ms = 50",
        "restart_backoff_ms = 50\nhang_timeout_ms = 120000",
    );
    let mut daemon = Daemon::start_on(&endpoint, &config);
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let retrying = Arc::new(Client::connect(&endpoint).await.unwrap());
    let once = Arc::new(
        Client::connect_with(
            &[endpoint.as_str()],
            ClientOptions {
                max_attempts: 1,
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap(),
    );
    let mut rng = Rng::new(3);
    let x = rows(&mut rng, 1);
    let t = HostTensor::from_f32(vec![1, 128], &x);
    retrying.call(Call::tensor("mlp", t.clone())).await.unwrap();
    once.call(Call::tensor("mlp", t.clone())).await.unwrap();

    // Requests in flight: the worker is frozen, so nothing is answered
    // (frozen for sure: a worker still running after SIGSTOP was sent
    // answered one of them, and the 25 were never all outstanding).
    let worker = worker_pid(&daemon, "cpu:0");
    freeze(worker);
    let inputs: Vec<Vec<f32>> = (0..20).map(|_| rows(&mut rng, 1)).collect();
    let spawn = |c: &Arc<Client>, x: &Vec<f32>| {
        let (c, t) = (c.clone(), HostTensor::from_f32(vec![1, 128], x));
        tokio::spawn(async move {
            let started = Instant::now();
            (
                c.call(Call::tensor("mlp", t).timeout(T)).await,
                started.elapsed(),
            )
        })
    };
    let retried: Vec<_> = inputs.iter().map(|x| spawn(&retrying, x)).collect();
    let failed: Vec<_> = inputs[..5].iter().map(|x| spawn(&once, x)).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while outstanding(&retrying) < 20 || outstanding(&once) < 5 {
        assert!(
            Instant::now() < deadline,
            "the requests were not all outstanding: {} and {}; {:?} {:?}",
            outstanding(&retrying),
            outstanding(&once),
            retrying.stats(),
            once.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    daemon.kill();
    signal(worker, libc::SIGKILL);
    let killed = Instant::now();

    // The one-attempt client: ConnectionLost, promptly.
    for f in failed {
        let (r, _) = f.await.unwrap();
        match r {
            Err(Error::ConnectionLost { attempts: 1, .. }) => {}
            other => panic!("expected ConnectionLost, got {other:?}"),
        }
    }
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "the loss took {:?} to show",
        killed.elapsed()
    );

    daemon.relaunch();
    for (x, r) in inputs.iter().zip(retried) {
        let (r, took) = r.await.unwrap();
        let out = r.unwrap_or_else(|e| panic!("a re-sent request failed: {e}"));
        assert!(out.attempts >= 2, "{:?}", out.attempts);
        assert!(rel_err(&out.matrix().data, &reference.forward(x, 1)) < 1e-5);
        assert!(took < T);
    }
    let s = &retrying.stats()[0];
    assert!(
        s.lost >= 20 && s.resent >= 20 && s.disconnects >= 1,
        "{s:?}"
    );
    // Later requests succeed on both clients.
    for c in [&retrying, &once] {
        let out = c.call(Call::tensor("mlp", t.clone())).await.unwrap();
        assert!(rel_err(&out.matrix().data, &reference.forward(&x, 1)) < 1e-5);
    }
    // A raw request() lost with its connection is ConnectionLost too.
    let worker = worker_pid(&daemon, "cpu:0");
    freeze(worker);
    let raw = {
        let c = retrying.clone();
        let t = t.clone();
        tokio::spawn(async move { c.infer("mlp", &t, T).await })
    };
    while outstanding(&retrying) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    daemon.kill();
    signal(worker, libc::SIGKILL);
    let r = raw.await.unwrap();
    assert!(
        matches!(r, Err(Error::ConnectionLost { .. })),
        "request() after a loss: {r:?}"
    );
    // With nothing listening, a call ends at its timeout, as NoHealthyEndpoint.
    let t0 = Instant::now();
    let e = retrying
        .call(Call::tensor("mlp", t.clone()).timeout(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NoHealthyEndpoint(_)), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

/// Two daemons, one client with both endpoints, a steady load: killing one
/// daemon (with requests in flight on it) loses no request; freezing one
/// (it holds its connections but answers nothing) makes the client re-send
/// its requests to the other after the liveness timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_daemons_one_killed_or_frozen_loses_no_request() {
    let a = Daemon::start(&mlp_config(1, ""));
    // A fixed port, so that b relaunched is found again by the client.
    let mut b = Daemon::start_on(
        &format!("tcp://127.0.0.1:{}", free_port()),
        &mlp_config(1, ""),
    );
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let client = Arc::new(
        Client::connect_with(
            &[a.endpoint.as_str(), b.endpoint.as_str()],
            ClientOptions {
                liveness_timeout: Duration::from_millis(500),
                ..ClientOptions::default()
            },
        )
        .await
        .unwrap(),
    );
    assert!(client.wait_connected(Duration::from_secs(10), true).await);

    // A steady load: 8 tasks, each 60 requests one after another.
    let load = |seed: u64| {
        let (client, reference) = (client.clone(), reference.clone());
        tokio::spawn(async move {
            let mut rng = Rng::new(seed);
            for i in 0..60 {
                let x = rows(&mut rng, 1);
                let out = client
                    .call(Call::tensor("mlp", HostTensor::from_f32(vec![1, 128], &x)).timeout(T))
                    .await
                    .unwrap_or_else(|e| panic!("task {seed} request {i}: {e}"));
                assert!(rel_err(&out.matrix().data, &reference.forward(&x, 1)) < 1e-5);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let tasks: Vec<_> = (0..8).map(load).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Requests pile up on b (its worker frozen), then b is killed.
    let b_worker = worker_pid(&b, "cpu:0");
    freeze(b_worker);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let in_flight_on_b = client.stats()[1].in_flight;
    b.kill();
    signal(b_worker, libc::SIGKILL);
    for t in tasks {
        t.await.unwrap();
    }
    let s = client.stats();
    assert!(s[0].replies > 0 && s[1].replies > 0, "both served: {s:?}");
    assert!(
        in_flight_on_b == 0 || s[1].lost > 0,
        "requests in flight on the killed daemon are counted lost: {s:?}"
    );
    eprintln!("in flight on b when killed: {in_flight_on_b}; {s:?}");

    // Frozen daemon: b again, this time stopped (SIGSTOP on the daemon and
    // its worker), connections held.
    b.relaunch();
    assert!(client.wait_connected(Duration::from_secs(10), true).await);
    let b_pid = b.pid() as i32;
    let b_worker = worker_pid(&b, "cpu:0");
    freeze(b_worker);
    freeze(b_pid);
    let tasks: Vec<_> = (100..104).map(load).collect();
    for t in tasks {
        t.await.unwrap();
    }
    let s = client.stats();
    assert!(s[1].suspect || s[1].resent > 0 || s[1].sent == 0, "{s:?}");
    eprintln!("with b frozen: {s:?}");
    signal(b_pid, libc::SIGCONT);
    signal(b_worker, libc::SIGCONT);
}
