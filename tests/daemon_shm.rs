//! The shared-memory data plane between the daemon and its workers, end to
//! end on the CPU backend: real daemon, real worker processes, real rings in
//! the runtime directory. A worker killed under load loses nothing, its slots
//! come back with its successor's ring, the ring files are owner-only, and
//! each reply says where its time went.

mod common;

use common::{data, freeze, rel_err, Daemon, MlpReference, Rng};
use replayd::protocol::client::Response;
use replayd::protocol::{Hops, Status};
use replayd::tensor::HostTensor;
use serde_json::Value;
use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn config(shm: bool) -> String {
    format!(
        r#"
[batching]
max_wait_us = 1000

[devices]
backend = "cpu"
cpu_devices = 2
cpu_threads = 1
restart_backoff_ms = 50
shm_link = {shm}

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

/// The ring files in the daemon's runtime directory.
fn rings(daemon: &Daemon) -> BTreeSet<String> {
    std::fs::read_dir(daemon.dir.path().join("run"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ring"))
        .collect()
}

fn assert_owner_only(path: &Path) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(
        meta.file_type().is_file(),
        "{} is not a file",
        path.display()
    );
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{}",
        path.display()
    );
    // SAFETY: geteuid has no preconditions.
    assert_eq!(meta.uid(), unsafe { libc::geteuid() });
}

fn worker_pid(daemon: &Daemon, label: &str) -> i32 {
    daemon.device(label)["worker_pid"]
        .as_i64()
        .expect("worker pid") as i32
}

fn output_of(r: &Response) -> Vec<f32> {
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
    r.output.as_ref().unwrap().to_f32_vec().unwrap()
}

/// One request of 1–4 random rows, its output checked against the float64
/// reference; the reply.
async fn checked_request(
    client: &replayd::protocol::client::Client,
    reference: &MlpReference,
    rng: &mut Rng,
) -> Response {
    let rows = rng.range(1, 5);
    let x: Vec<f32> = (0..rows * 128).map(|_| rng.normal()).collect();
    let r = client
        .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
        .await
        .unwrap();
    assert!(rel_err(&output_of(&r), &reference.forward(&x, rows)) < 1e-5);
    r
}

fn graph_devices(stats: &Value) -> Vec<Value> {
    stats["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["role"] == "graph")
        .cloned()
        .collect()
}

/// kill -9 of a worker holding ring slots, under load: every request gets
/// exactly one correct reply (its batches are re-dispatched), the dead
/// worker's ring file goes, its successor gets a fresh one with every slot
/// free, and every batch travelled through a ring, none through a socket.
/// Started under umask 000: the rings are owner-only all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_worker_loses_nothing_and_its_slots_are_reclaimed() {
    let mut daemon = Daemon::start_full(&config(true), "", Some(0o000));
    let before = rings(&daemon);
    // Two graph workers and one eager worker, one ring each.
    assert_eq!(before.len(), 3, "{before:?}");
    for name in &before {
        assert_owner_only(&daemon.dir.path().join("run").join(name));
    }
    for d in graph_devices(&daemon.stats()) {
        assert_eq!(d["shm_slots"], 3, "max_inflight_per_device + 1: {d}");
        assert_eq!(d["shm_slots_free"], 3, "{d}");
    }

    let reference = Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let victim = worker_pid(&daemon, "cpu:0");
    // Freeze the worker so that it holds slots, then kill it.
    freeze(victim);
    let clients = [
        Arc::new(daemon.client().await),
        Arc::new(daemon.client().await),
    ];
    let mut rng = Rng::new(11);
    let mut tasks = Vec::new();
    for i in 0..600 {
        let rows = rng.range(1, 9);
        let x: Vec<f32> = (0..rows * 128).map(|_| rng.normal()).collect();
        let client = clients[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let r = client
                .infer("mlp", &HostTensor::from_f32(vec![rows, 128], &x), T)
                .await
                .unwrap();
            (i % 2, x, rows, r)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // SAFETY: as above.
    unsafe { libc::kill(victim, libc::SIGKILL) };

    let mut ids = HashSet::new();
    for t in tasks {
        // Ids are per client: two clients each count from 1.
        let (client, x, rows, r) = t.await.unwrap();
        assert!(
            ids.insert((client, r.header.id)),
            "two replies for {client}/{}",
            r.header.id
        );
        let err = rel_err(&output_of(&r), &reference.forward(&x, rows));
        assert!(err < 1e-5, "rel err {err}");
    }
    assert_eq!(ids.len(), 600);

    let stats = daemon.wait_for("cpu:0 to come back", T, |s| {
        s["devices"].as_array().unwrap().iter().any(|d| {
            d["label"] == "cpu:0" && d["state"] == "ready" && d["restarts"].as_u64() == Some(1)
        })
    });
    assert!(
        stats["retried_batches"].as_u64().unwrap() >= 1,
        "no batch was in flight on the killed worker"
    );
    assert_eq!(stats["requests"]["errors"]["internal"], 0);

    // The restarted worker serves through its new ring.
    let served_before = daemon.device("cpu:0")["shm_batches"].as_u64().unwrap();
    for _ in 0..40 {
        let x: Vec<f32> = (0..128).map(|_| rng.normal()).collect();
        let r = clients[0]
            .infer("mlp", &HostTensor::from_f32(vec![1, 128], &x), T)
            .await
            .unwrap();
        assert!(rel_err(&output_of(&r), &reference.forward(&x, 1)) < 1e-5);
    }
    // Both workers idle: every slot is back.
    let stats = daemon.wait_for("cpu:0 to serve again, every slot free", T, |s| {
        graph_devices(s)
            .iter()
            .all(|d| d["shm_slots"] == 3 && d["shm_slots_free"] == 3 && d["socket_batches"] == 0)
            && graph_devices(s).iter().any(|d| {
                d["label"] == "cpu:0" && d["shm_batches"].as_u64().unwrap() > served_before
            })
    });
    let total: u64 = graph_devices(&stats)
        .iter()
        .map(|d| d["shm_batches"].as_u64().unwrap())
        .sum();
    assert!(total >= 1, "{stats:#}");

    // The dead worker's ring is gone; its successor has its own.
    let after = rings(&daemon);
    assert_eq!(after.len(), 3, "{after:?}");
    assert_eq!(
        before.intersection(&after).count(),
        2,
        "{before:?} → {after:?}"
    );
    for name in &after {
        assert_owner_only(&daemon.dir.path().join("run").join(name));
    }

    // A clean stop leaves no ring behind.
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait(T).success());
    assert!(rings(&daemon).is_empty(), "{:?}", rings(&daemon));
}

/// With `shm_link = false` batches take the worker's socket, as before:
/// no ring files, replies right, every batch counted as a socket batch.
/// Either way each reply's hops add up to its `total_us`, and the stats
/// hold a histogram per hop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_path_still_serves_and_replies_carry_their_hops() {
    for shm in [false, true] {
        let daemon = Daemon::start(&config(shm));
        assert_eq!(rings(&daemon).is_empty(), !shm);
        let reference = MlpReference::load(&data("mlp_seed.safetensors"));
        let client = daemon.client().await;
        let mut rng = Rng::new(3);
        for _ in 0..50 {
            let r = checked_request(&client, &reference, &mut rng).await;
            let hops = Hops::from_header(&r.header).expect("hop keys on a success");
            assert_eq!(
                hops.values().iter().sum::<u64>(),
                r.header.total_us,
                "{:?}",
                r.header
            );
        }
        let stats = daemon.stats();
        let devices = graph_devices(&stats);
        let (ring, socket): (u64, u64) = devices.iter().fold((0, 0), |(a, b), d| {
            (
                a + d["shm_batches"].as_u64().unwrap(),
                b + d["socket_batches"].as_u64().unwrap(),
            )
        });
        if shm {
            assert_eq!((ring >= 1, socket), (true, 0), "{stats:#}");
        } else {
            assert_eq!((ring, socket >= 1), (0, true), "{stats:#}");
        }
        for name in Hops::NAMES {
            assert_eq!(stats["latency"]["hops"][name]["count"], 50, "{name}");
        }
    }
}

/// The worker process's CPU time so far (user + system), from /proc.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name's closing parenthesis; utime and
    // stime are the 14th and 15th of the line.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / tick
}

/// `devices.worker_spin_us`: a worker that polls its doorbell between
/// batches answers as one that sleeps, and stops polling once traffic stops
/// (an idle worker does not keep a core busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_worker_answers_and_rests_when_idle() {
    let daemon = Daemon::start(
        &config(true).replace("shm_link = true", "shm_link = true\nworker_spin_us = 5000"),
    );
    let reference = MlpReference::load(&data("mlp_seed.safetensors"));
    let client = daemon.client().await;
    let mut rng = Rng::new(5);
    for _ in 0..200 {
        checked_request(&client, &reference, &mut rng).await;
    }
    let stats = daemon.stats();
    let pids: Vec<i32> = graph_devices(&stats)
        .iter()
        .map(|d| d["worker_pid"].as_i64().unwrap() as i32)
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before: Vec<f64> = pids.iter().map(|&p| cpu_seconds(p)).collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (&pid, before) in pids.iter().zip(before) {
        let used = cpu_seconds(pid) - before;
        // Spinning on would be ~2 s; heartbeats alone are a few ms.
        assert!(
            used < 0.5,
            "worker {pid} used {used:.2} s of CPU in 2 s idle"
        );
    }
}
