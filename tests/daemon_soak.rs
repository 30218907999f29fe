//! Soak: high load for a bounded time while workers are killed, stopped,
//! faulted and hung at random. Every request gets exactly one reply, every
//! `ok` reply is correct, and the daemon's memory and file descriptors end
//! where they started. `SOAK_SECONDS` sets the length (default 40 s in CI;
//! `SOAK_SECONDS=600` for the documented long run). The figures are printed.

mod common;

use common::{data, rel_err, Daemon, MlpReference, Rng};
use replayd::protocol::Status;
use replayd::tensor::HostTensor;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    ok: AtomicU64,
    errors: Mutex<Vec<String>>,
    ids: Mutex<HashSet<u64>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_random_worker_faults_loses_nothing() {
    let seconds: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let daemon = Daemon::start(&format!(
        r#"
[batching]
max_wait_us = 500
max_attempts = 6
max_queue = 100000

[devices]
backend = "cpu"
cpu_devices = 3
cpu_threads = 1
fault_injection = true
restart_backoff_ms = 20
restart_backoff_max_ms = 200
hang_timeout_ms = 500
heartbeat_ms = 50

[eager]
workers = 0

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
batch_buckets = [1, 4, 16, 64]
"#,
        data("mlp_seed.safetensors").display()
    ));
    let pid = daemon.pid();
    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let client = Arc::new(daemon.client().await);
    // Warm up, then take the baseline.
    for _ in 0..50 {
        let r = client
            .infer(
                "mlp",
                &HostTensor::from_f32(vec![2, 128], &[0.1; 256]),
                Duration::from_secs(30),
            )
            .await
            .unwrap();
        assert_eq!(r.header.status, Status::Ok);
    }
    let (rss0, fd0) = (rss_kib(pid), fds(pid));

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for worker in 0..16u64 {
        let (client, tally, stop, reference) = (
            client.clone(),
            tally.clone(),
            stop.clone(),
            reference.clone(),
        );
        load.push(tokio::spawn(async move {
            let mut rng = Rng::new(100 + worker);
            while !stop.load(Ordering::Relaxed) {
                let rows = rng.range(1, 41);
                let x: Vec<f32> = (0..rows * 128).map(|_| rng.normal()).collect();
                tally.sent.fetch_add(1, Ordering::Relaxed);
                let r = client
                    .infer(
                        "mlp",
                        &HostTensor::from_f32(vec![rows, 128], &x),
                        Duration::from_secs(60),
                    )
                    .await;
                match r {
                    Ok(r) => {
                        assert!(
                            tally.ids.lock().unwrap().insert(r.header.id),
                            "two replies for request {}",
                            r.header.id
                        );
                        match r.header.status {
                            Status::Ok => {
                                let out = r.output.unwrap().to_f32_vec().unwrap();
                                let err = rel_err(&out, &reference.forward(&x, rows));
                                assert!(err < 1e-5, "wrong output: rel err {err}");
                                tally.ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Status::Error => tally
                                .errors
                                .lock()
                                .unwrap()
                                .push(format!("{:?}: {:?}", r.header.code, r.header.message)),
                        }
                    }
                    Err(e) => tally.errors.lock().unwrap().push(format!("no reply: {e}")),
                }
            }
        }));
    }

    // Chaos: every 0.5–2 s, one worker is killed, stopped, faulted or hung.
    let mut rng = Rng::new(7);
    let started = Instant::now();
    let mut faults = [0u32; 4];
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(rng.range(500, 2000) as u64));
        let label = format!("cpu:{}", rng.range(0, 3));
        let dev = daemon.device(&label);
        if dev["state"] != "ready" {
            continue;
        }
        let kind = rng.range(0, 4);
        match kind {
            0 | 1 => {
                let Some(p) = dev["worker_pid"].as_i64() else {
                    continue;
                };
                let sig = if kind == 0 {
                    libc::SIGKILL
                } else {
                    libc::SIGSTOP
                };
                // SAFETY: signalling a worker of the daemon under test.
                unsafe { libc::kill(p as i32, sig) };
            }
            _ => {
                let what = if kind == 2 { "corrupt" } else { "hang" };
                let _ = daemon.ctl(&["inject-fault", "--device", &label, "--kind", what]);
            }
        }
        faults[kind] += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    // Everything recovers.
    daemon.wait_for("every device ready", Duration::from_secs(60), |s| {
        s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["state"] == "ready")
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss1, fd1) = (rss_kib(pid), fds(pid));
    let sent = tally.sent.load(Ordering::Relaxed);
    let ok = tally.ok.load(Ordering::Relaxed);
    let errors = tally.errors.lock().unwrap().clone();
    let stats = daemon.stats();
    let restarts: u64 = stats["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["restarts"].as_u64().unwrap())
        .sum();
    println!(
        "soak {seconds} s: {sent} requests, {ok} ok, {} errors, replies lost 0; faults injected: \
         {} kill -9, {} SIGSTOP, {} corrupt, {} hang; {restarts} worker restarts, {} batches retried; \
         RSS {rss0} -> {rss1} KiB, fds {fd0} -> {fd1}",
        errors.len(),
        faults[0],
        faults[1],
        faults[2],
        faults[3],
        stats["retried_batches"]
    );
    assert!(
        errors.is_empty(),
        "{} errors, e.g. {:?}",
        errors.len(),
        &errors[..errors.len().min(3)]
    );
    assert_eq!(ok, sent);
    assert_eq!(tally.ids.lock().unwrap().len() as u64, sent);
    assert!(faults.iter().sum::<u32>() >= 4, "chaos ran ({faults:?})");
    assert!(fd1 <= fd0 + 4, "fds {fd0} -> {fd1}");
    assert!(rss1 < rss0 + 32 * 1024, "RSS {rss0} -> {rss1} KiB");
}
