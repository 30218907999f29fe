//! The daemon driven in process: `server::run` on port 0 with a shutdown
//! future the test controls, real worker processes (the `replayd` binary)
//! and real sockets. This is how a test reaches the daemon's pieces without
//! a separate process.

mod common;

use common::{data, rel_err, MlpReference};
use replayd::config::Config;
use replayd::daemon::server::{self, ServerOptions};
use replayd::protocol::client::Client;
use replayd::protocol::Status;
use replayd::tensor::HostTensor;
use std::time::Duration;
use tokio::sync::oneshot;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_on_port_0_until_its_shutdown_future_resolves() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("replayd.toml");
    std::fs::write(
        &config_path,
        format!(
            r#"
[server]
endpoint = "tcp://127.0.0.1:0"
control_endpoint = "tcp://127.0.0.1:0"
runtime_dir = "{run}"

[devices]
backend = "cpu"
cpu_threads = 1

[eager]
workers = 0

[[models]]
name = "mlp"
kind = "mlp"
path = "{mlp}"
batch_buckets = [1, 4]
"#,
            run = dir.path().join("run").display(),
            mlp = data("mlp_seed.safetensors").display()
        ),
    )
    .unwrap();
    let config = Config::load(&config_path).unwrap();
    let (ready_tx, ready_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let daemon = tokio::spawn(server::run(
        config,
        ServerOptions {
            config_path,
            worker_exe: env!("CARGO_BIN_EXE_replayd").into(),
            ready_file: None,
            on_ready: Some(ready_tx),
        },
        async move {
            let _ = stop_rx.await;
        },
    ));
    let endpoints = tokio::time::timeout(Duration::from_secs(120), ready_rx)
        .await
        .expect("ready in time")
        .expect("the daemon announces its endpoints");
    assert!(!endpoints.endpoint.ends_with(":0"), "{endpoints:?}");

    let client = Client::connect(&endpoints.endpoint).await.unwrap();
    let reference = MlpReference::load(&data("mlp_seed.safetensors"));
    for rows in [1, 3, 4] {
        let x: Vec<f32> = (0..rows * 128)
            .map(|i| (i % 17) as f32 / 17.0 - 0.5)
            .collect();
        let input = HostTensor::from_f32(vec![rows, 128], &x);
        let r = client
            .infer("mlp", &input, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
        let out = r.output.unwrap().to_f32_vec().unwrap();
        assert!(rel_err(&out, &reference.forward(&x, rows)) < 1e-5);
    }
    // Larger than every bucket, with no eager worker: split over graph
    // batches (4 + 2 rows), not refused.
    let x: Vec<f32> = (0..6 * 128).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
    let r = client
        .infer(
            "mlp",
            &HostTensor::from_f32(vec![6, 128], &x),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
    assert_eq!(r.header.bucket.as_deref(), Some("4x1"));
    assert_eq!(r.header.batches, Some(2));
    let out = r.output.unwrap().to_f32_vec().unwrap();
    assert!(rel_err(&out, &reference.forward(&x, 6)) < 1e-5);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), daemon)
        .await
        .expect("run returns after shutdown")
        .unwrap()
        .unwrap();
}
