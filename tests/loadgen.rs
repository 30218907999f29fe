//! `replayd-loadgen` against a real daemon (CPU backend, the seed MLP): both
//! engines get every reply, each checked against a float64 forward pass, and
//! report what the run measured (and, with `--control`, what the daemon's
//! stats say it added); a daemon that stops answering makes the
//! threads engine report its requests as timed out and exit 1.

mod common;

use common::{data, freeze, mlp_cpu_config, Daemon};
use serde_json::{json, Value};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

/// Runs the generator on the seed MLP's rows with `args`; its exit status,
/// its JSON report and its stderr.
fn loadgen(daemon: &Daemon, args: &[&str]) -> (ExitStatus, Value, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = dir.path().join("report.json");
    let mlp = data("mlp_seed.safetensors");
    let out = Command::new(env!("CARGO_BIN_EXE_replayd-loadgen"))
        .args([
            "--endpoint",
            &daemon.endpoint,
            "--model",
            "mlp",
            "--features",
            "128",
        ])
        .args(["--verify-mlp", mlp.to_str().unwrap()])
        .args(["--json", report.to_str().unwrap()])
        .args(args)
        .output()
        .expect("run replayd-loadgen");
    let report = std::fs::read_to_string(&report)
        .map(|s| serde_json::from_str(&s).expect("the report is JSON"))
        .unwrap_or(Value::Null);
    (
        out.status,
        report,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn both_engines_get_every_reply_and_check_it() {
    let daemon = Daemon::start(&mlp_cpu_config(1, &[1, 2, 4, 8]));
    for engine in ["async", "threads"] {
        let (status, r, err) = loadgen(
            &daemon,
            &[
                "--engine",
                engine,
                "--requests",
                "300",
                "--concurrency",
                "12",
                "--sockets",
                "3",
                "--batch",
                "4",
                "--random-batch",
                "--control",
                &daemon.control,
            ],
        );
        assert!(status.success(), "{engine}: {err}");
        assert_eq!(r["engine"], engine, "{r}");
        assert_eq!(r["ok"], 300, "{engine}: {r}");
        assert_eq!(r["errors"], json!({}), "{engine}");
        assert_eq!(r["stray_replies"], 0, "{engine}");
        assert_eq!(r["mlp_above_1e-5"], 0, "{engine}");
        assert!(
            r["mlp_max_rel_err"].as_f64().unwrap() < 1e-5,
            "{engine}: {r}"
        );
        // 300 requests of 1–4 rows each.
        let rows = r["items_per_s"].as_f64().unwrap() * r["elapsed_s"].as_f64().unwrap();
        assert!((300.0..=1200.5).contains(&rows), "{engine}: {rows} rows");
        assert!(
            r["hops_us"]["daemon_total"]["p50"].as_u64().unwrap() > 0,
            "{r}"
        );
        assert!(r["latency_us"]["p50"].as_u64().unwrap() > 0, "{r}");
        // What the daemon's stats say the run added (--control): the rows
        // of the 300 requests, run in the grid's buckets.
        let p = &r["padding"];
        assert_eq!(p["batching"], "padded", "{engine}: {p}");
        let bucket_rows: u64 = p["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["seqs"].as_u64().unwrap())
            .sum();
        assert!(
            (bucket_rows as f64 - rows).abs() < 0.01,
            "{engine}: {rows} rows, {p}"
        );
        assert!(r["stages"]["busy_share"]["batcher"].is_number(), "{r}");
        assert!(
            r["stages"]["busy_share"]["client_socket_driver"].is_number(),
            "{r}"
        );
    }
}

#[test]
fn the_threads_engine_reports_requests_a_stopped_daemon_never_answers() {
    let daemon = Daemon::start(&mlp_cpu_config(1, &[1, 2, 4, 8]));
    freeze(daemon.pid() as i32);
    let started = Instant::now();
    let (status, r, err) = loadgen(
        &daemon,
        &[
            "--engine",
            "threads",
            "--requests",
            "3",
            // The default 8 sockets: no more than 2 of them hold a request.
            "--concurrency",
            "2",
            "--timeout",
            "1",
        ],
    );
    daemon.signal(libc::SIGCONT);
    assert_eq!(status.code(), Some(1), "{err}");
    assert_eq!(r["ok"], 0, "{r}");
    assert_eq!(r["errors"], json!({"client: timed out": 3}), "{r}");
    // Two in flight time out together, then the third: about 2 s (three
    // at once, one second, had every socket held one).
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(2), "{took:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}
