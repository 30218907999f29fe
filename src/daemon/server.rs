//! Starting and stopping the whole daemon: [`run`] binds the sockets, starts
//! the actors and workers, serves until `shutdown` resolves, then drains.
//!
//! Shutdown order: the batcher stops accepting (new requests get
//! `unavailable`) and dispatches everything queued at once; once every
//! accepted request is answered — or the grace period ends, and whatever is
//! left is answered `unavailable` — the workers are stopped and `run` returns.

use super::batcher::queue::SchedulerConfig;
use super::batcher::{BatcherActor, BatcherArgs, ModelSlot};
use super::control::Control;
use super::device::{DeviceArgs, WorkerCommand};
use super::frontend::{Frontend, ServedModel};
use super::messages::{BatcherMsg, DeviceKind, DeviceStatus, SupervisorMsg};
use super::metrics::{DeviceStats, Metrics, ModelStats};
use super::supervisor::{Supervisor, SupervisorArgs};
use super::tokenize::{TextTokenizer, TokenizerPool};
use crate::bucket::Grid;
use crate::config::{BackendKind, Config, GpuSelection};
use crate::gpu::cuda_device_count;
use crate::protocol::DecodeLimits;
use crate::transport::{z85_decode, z85_encode, CurveKeyPair, Router, Security, TransportLimits};
use crate::worker::WorkerBackend;
use anyhow::{bail, Context};
use ractor::Actor;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

pub struct ServerOptions {
    /// The config file, passed on to worker processes.
    pub config_path: PathBuf,
    /// The `replayd` executable that runs `replayd worker`.
    pub worker_exe: PathBuf,
    /// Written (JSON: endpoints and pid) once every device is ready.
    pub ready_file: Option<PathBuf>,
    /// Told the bound endpoints once every device is ready (for a caller
    /// that runs the daemon in process, e.g. a test binding port 0).
    pub on_ready: Option<oneshot::Sender<Endpoints>>,
}

/// The addresses the daemon bound (port 0 resolved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub endpoint: String,
    pub control_endpoint: String,
}

/// A device to start: its label and how to run its worker.
struct PlannedDevice {
    label: String,
    kind: DeviceKind,
    worker: WorkerCommand,
}

/// Decides the backend and the device list from the config.
fn plan_devices(config: &Config, options: &ServerOptions) -> anyhow::Result<Vec<PlannedDevice>> {
    let backend = match config.devices.backend {
        BackendKind::Cpu => WorkerBackend::Cpu,
        BackendKind::Cuda => match cuda_device_count() {
            Ok(n) if n > 0 => WorkerBackend::Cuda,
            Ok(_) => bail!("devices.backend = \"cuda\" but no CUDA GPU is present"),
            Err(e) => bail!("devices.backend = \"cuda\" but CUDA is not usable: {e}"),
        },
        BackendKind::Auto => match cuda_device_count() {
            Ok(n) if n > 0 => {
                tracing::info!("backend = auto: {n} CUDA GPU(s) found, using the CUDA backend");
                WorkerBackend::Cuda
            }
            Ok(_) => {
                tracing::info!("backend = auto: no CUDA GPU found, using the CPU backend");
                WorkerBackend::Cpu
            }
            Err(e) => {
                tracing::info!("backend = auto: CUDA not usable ({e}), using the CPU backend");
                WorkerBackend::Cpu
            }
        },
    };
    let worker = |ordinal: usize, threads: usize, eager: bool| WorkerCommand {
        exe: options.worker_exe.clone(),
        config_path: options.config_path.clone(),
        backend,
        ordinal,
        threads,
        eager,
    };
    let mut devices = Vec::new();
    match backend {
        WorkerBackend::Cuda => {
            let count = cuda_device_count().unwrap_or(0);
            let gpus: Vec<usize> = match &config.devices.gpus {
                GpuSelection::Named(_) => (0..count).collect(),
                GpuSelection::List(list) => {
                    if let Some(bad) = list.iter().find(|&&g| g >= count) {
                        bail!("devices.gpus lists GPU {bad}, but only {count} GPU(s) are present");
                    }
                    list.clone()
                }
            };
            for &g in &gpus {
                devices.push(PlannedDevice {
                    label: format!("cuda:{g}"),
                    kind: DeviceKind::Graph,
                    worker: worker(g, 1, false),
                });
            }
            let eager_gpu = config.eager.gpu.unwrap_or(gpus[0]);
            if eager_gpu >= count {
                bail!("eager.gpu = {eager_gpu}, but only {count} GPU(s) are present");
            }
            for i in 0..config.eager.workers {
                devices.push(PlannedDevice {
                    label: format!("eager:{i}"),
                    kind: DeviceKind::Eager,
                    worker: worker(eager_gpu, 1, true),
                });
            }
        }
        WorkerBackend::Cpu => {
            let n = config.devices.cpu_devices;
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let threads = match config.devices.cpu_threads {
                0 => (cores / n).max(1),
                t => t,
            };
            for i in 0..n {
                devices.push(PlannedDevice {
                    label: format!("cpu:{i}"),
                    kind: DeviceKind::Graph,
                    worker: worker(i, threads, false),
                });
            }
            for i in 0..config.eager.workers {
                devices.push(PlannedDevice {
                    label: format!("eager:{i}"),
                    kind: DeviceKind::Eager,
                    worker: worker(i, threads, true),
                });
            }
        }
    }
    Ok(devices)
}

/// Loads what the main process needs of each model (configs, tokenizer).
fn load_models(config: &Config) -> anyhow::Result<Vec<ServedModel>> {
    let threads = match config.server.tokenizer_threads {
        0 => std::thread::available_parallelism()
            .map_or(1, |c| c.get())
            .min(8),
        t => t,
    };
    config
        .models
        .iter()
        .map(|mc| {
            let info = crate::model::inspect(&mc.spec())
                .with_context(|| format!("cannot serve model {:?}", mc.name))?;
            if !info.derived.is_empty() {
                tracing::info!(model = %mc.name, "model folder: {}", info.derived_summary());
            }
            let tokenizer = match (&info.input, &info.tokenizer_path) {
                (crate::model::InputSpec::Tokens { .. }, Some(_)) if info.tokenizer.is_some() => {
                    let spec = info.tokenizer.as_ref().expect("checked");
                    let t = TextTokenizer::from_spec(spec).with_context(|| {
                        format!("model {:?}: tokenizer {}", mc.name, spec.path.display())
                    })?;
                    Some(TokenizerPool::new(Arc::new(t), threads))
                }
                (crate::model::InputSpec::Tokens { max_seq_len, .. }, Some(path)) => {
                    let t = TextTokenizer::load(path, *max_seq_len).with_context(|| {
                        format!("model {:?}: tokenizer {}", mc.name, path.display())
                    })?;
                    Some(TokenizerPool::new(Arc::new(t), threads))
                }
                _ => None,
            };
            Ok(ServedModel { info, tokenizer })
        })
        .collect()
}

/// How a model is batched, for the start-up log and the stats.
fn model_stats(slot: &ModelSlot, models: &[ServedModel]) -> ModelStats {
    let (batching, grid) = match &slot.grid {
        Grid::Padded(g) => (
            "padded",
            serde_json::json!({"batch_buckets": g.batches(), "seq_buckets": g.seqs()}),
        ),
        Grid::Packed(g) => (
            "packed",
            serde_json::json!({"token_budgets": g.budgets(), "max_seqs_per_batch": g.max_seqs()}),
        ),
    };
    ModelStats {
        name: slot.name.clone(),
        batching: batching.into(),
        grid,
        folder: models
            .iter()
            .find(|m| m.info.name == slot.name)
            .map(|m| m.info.derived.clone())
            .unwrap_or_default(),
    }
}

/// The client socket's limits: whole requests up to `max_request_bytes`
/// (with the transport's per-frame accounting), as many frames as items plus
/// the header and a REQ delimiter, the configured queues and handshake.
pub fn client_limits(config: &Config) -> TransportLimits {
    let s = &config.server;
    // Pairs take two frames per item.
    let max_frames = 2 * s.max_items_per_request + 2;
    TransportLimits {
        max_message_bytes: (s.max_request_bytes + 64 * max_frames + 4096).min(u32::MAX as usize),
        max_frame_bytes: s.max_request_bytes,
        max_frames,
        recv_hwm: s.recv_hwm,
        send_hwm: s.send_hwm,
        handshake_timeout: Duration::from_millis(s.handshake_timeout_ms),
        max_buffered_bytes: s.max_buffered_bytes,
        queue_messages: 4096,
        heartbeat: (s.client_heartbeat_ms > 0)
            .then(|| Duration::from_millis(s.client_heartbeat_ms)),
    }
}

/// The control socket takes small JSON commands only.
fn control_limits(config: &Config) -> TransportLimits {
    TransportLimits {
        max_message_bytes: 64 << 10,
        max_frame_bytes: 32 << 10,
        max_frames: 2,
        recv_hwm: 16,
        send_hwm: 64,
        handshake_timeout: Duration::from_millis(config.server.handshake_timeout_ms),
        max_buffered_bytes: 1 << 20,
        queue_messages: 64,
        heartbeat: None,
    }
}

/// CURVE for the client socket when the config names the key files.
fn client_security(config: &Config) -> anyhow::Result<Security> {
    let (Some(secret), Some(clients)) = (
        &config.server.curve_secret_key_file,
        &config.server.curve_allowed_clients_file,
    ) else {
        return Ok(Security::None);
    };
    let read = |path: &std::path::Path, key: &str| {
        std::fs::read_to_string(path)
            .with_context(|| format!("server.{key}: cannot read {}", path.display()))
    };
    let secret_text = read(secret, "curve_secret_key_file")?;
    let keys = z85_decode(secret_text.trim())
        .and_then(CurveKeyPair::from_secret)
        .with_context(|| format!("server.curve_secret_key_file {}", secret.display()))?;
    let mut allowed = Vec::new();
    for (n, line) in read(clients, "curve_allowed_clients_file")?
        .lines()
        .enumerate()
    {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        allowed.push(z85_decode(line).with_context(|| {
            format!(
                "server.curve_allowed_clients_file {} line {}",
                clients.display(),
                n + 1
            )
        })?);
    }
    if allowed.is_empty() {
        anyhow::bail!(
            "server.curve_allowed_clients_file {} lists no client key: nobody could connect",
            clients.display()
        );
    }
    tracing::info!(
        public_key = %z85_encode(&keys.public),
        clients = allowed.len(),
        "CURVE on the client socket"
    );
    Ok(Security::CurveServer {
        keys,
        allowed_clients: allowed,
    })
}

/// Runs the daemon until `shutdown` resolves, then drains and stops.
pub async fn run(
    config: Config,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    super::runtime_dir::prepare(
        &config.server.runtime_dir,
        config.server.runtime_group.as_deref(),
    )?;
    let models = load_models(&config)?;
    let planned = plan_devices(&config, &options)?;
    let metrics = Arc::new(Metrics::new());

    let security = client_security(&config)?;
    let client_socket = Router::bind(&config.server.endpoint, &client_limits(&config), &security)
        .await
        .with_context(|| format!("cannot bind server.endpoint {}", config.server.endpoint))?;
    let endpoint = client_socket.endpoint().to_string();
    let control_socket = Router::bind(
        &config.server.control_endpoint,
        &control_limits(&config),
        &Security::None,
    )
    .await
    .with_context(|| {
        format!(
            "cannot bind server.control_endpoint {}",
            config.server.control_endpoint
        )
    })?;
    let control_endpoint = control_socket.endpoint().to_string();
    metrics.set_transport("client", client_socket.stats());
    metrics.set_transport("control", control_socket.stats());
    tracing::info!(
        %endpoint,
        %control_endpoint,
        curve = matches!(security, Security::CurveServer { .. }),
        "listening"
    );

    let model_slots: Vec<ModelSlot> = config
        .models
        .iter()
        .map(|mc| ModelSlot {
            name: mc.name.clone(),
            grid: Grid::for_model(mc),
        })
        .collect();
    let model_stats: Vec<ModelStats> = model_slots
        .iter()
        .map(|s| model_stats(s, &models))
        .collect();
    for m in &model_stats {
        tracing::info!(model = %m.name, batching = %m.batching, grid = %m.grid, "batching");
    }
    metrics.set_models(model_stats);
    let (batcher, batcher_handle) = Actor::spawn(
        None,
        BatcherActor,
        BatcherArgs {
            models: model_slots,
            devices: planned.iter().map(|d| (d.kind, d.label.clone())).collect(),
            config: SchedulerConfig {
                max_wait: Duration::from_micros(config.batching.max_wait_us),
                max_queue: config.batching.max_queue,
                max_inflight: config.batching.max_inflight_per_device,
                eager_max_queue: config.eager.max_queue,
            },
            max_attempts: config.batching.max_attempts,
            metrics: metrics.clone(),
        },
    )
    .await
    .context("cannot start the batcher")?;

    let model_names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let uses_cuda = planned
        .iter()
        .any(|d| d.worker.backend == WorkerBackend::Cuda);
    let mut statuses = Vec::with_capacity(planned.len());
    let device_args: Vec<DeviceArgs> = planned
        .into_iter()
        .enumerate()
        .map(|(slot, d)| {
            let (status, status_rx) = watch::channel(DeviceStatus::Starting);
            statuses.push(status_rx.clone());
            (slot, d, Arc::new(status), status_rx)
        })
        .map(|(slot, d, status, status_rx)| {
            // Generous first guesses, replaced by what each model's batches
            // take once one has finished.
            let cold_us_per_token = match d.worker.backend {
                WorkerBackend::Cpu => 2000.0 / d.worker.threads.max(1) as f64,
                WorkerBackend::Cuda => 20.0,
            };
            DeviceArgs {
                device: slot,
                metrics_index: metrics.add_device(
                    DeviceStats {
                        label: d.label.clone(),
                        role: match d.kind {
                            DeviceKind::Graph => "graph".into(),
                            DeviceKind::Eager => "eager".into(),
                        },
                        ..Default::default()
                    },
                    status_rx,
                ),
                status,
                label: d.label,
                worker: d.worker,
                runtime_dir: config.server.runtime_dir.clone(),
                batcher: batcher.clone(),
                metrics: metrics.clone(),
                model_names: model_names.clone(),
                backoff_initial: Duration::from_millis(config.devices.restart_backoff_ms),
                backoff_max: Duration::from_millis(config.devices.restart_backoff_max_ms),
                start_timeout: Duration::from_millis(config.devices.start_timeout_ms),
                stop_timeout: Duration::from_secs(10),
                fault_injection: config.devices.fault_injection,
                hang_timeout: Duration::from_millis(config.devices.hang_timeout_ms),
                heartbeat: Duration::from_millis(config.devices.heartbeat_ms),
                cold_us_per_token,
            }
        })
        .collect();
    let gpu_slots: Vec<super::gpu_health::GpuSlot> = device_args
        .iter()
        .map(|d| super::gpu_health::GpuSlot {
            slot: d.device,
            metrics_index: d.metrics_index,
            ordinal: d.worker.ordinal,
        })
        .collect();
    let (supervisor, supervisor_handle) = Actor::spawn(
        None,
        Supervisor,
        SupervisorArgs {
            devices: device_args,
            batcher: batcher.clone(),
        },
    )
    .await
    .context("cannot start the supervisor")?;

    // NVML calls block (briefly): keep them off the async workers.
    let _gpu_health = if uses_cuda {
        let (m, s) = (metrics.clone(), supervisor.clone());
        tokio::task::spawn_blocking(move || super::gpu_health::start(gpu_slots, m, s))
            .await
            .ok()
    } else {
        None
    };
    let admission = super::admission::Admission::new(
        models.len(),
        config.batching.max_queue,
        config.server.max_buffered_bytes,
    );
    let frontend = Arc::new(Frontend::new(
        models,
        batcher.clone(),
        metrics.clone(),
        DecodeLimits {
            max_bytes: config.server.max_request_bytes,
            max_items: config.server.max_items_per_request,
        },
        admission,
    ));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let frontend_task = tokio::spawn(super::frontend::run(
        client_socket,
        frontend,
        stopped(stop_rx.clone()),
    ));
    let control = Arc::new(Control {
        metrics: metrics.clone(),
        supervisor: supervisor.clone(),
    });
    let control_task = tokio::spawn(super::control::run(
        control_socket,
        control,
        stopped(stop_rx.clone()),
    ));
    let ready_task = tokio::spawn(announce_ready(
        statuses,
        options.ready_file.clone(),
        options.on_ready,
        Endpoints {
            endpoint: endpoint.to_string(),
            control_endpoint: control_endpoint.to_string(),
        },
    ));

    shutdown.await;
    tracing::info!("shutting down: draining queued and in-flight requests");
    super::notify::notify("STOPPING=1");
    ready_task.abort();
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let started = Instant::now();
    match batcher.call(BatcherMsg::Drain, Some(grace)).await {
        Ok(ractor::rpc::CallResult::Success(())) => {
            tracing::info!("drained in {:?}", started.elapsed())
        }
        _ => {
            let left = batcher
                .call(BatcherMsg::Abort, Some(Duration::from_secs(5)))
                .await
                .ok();
            tracing::warn!(
                "grace period of {grace:?} ended; answered the rest unavailable ({left:?})"
            );
        }
    }
    // Every request is answered; the frontend flushes the last replies and stops.
    let _ = stop_tx.send(true);
    let _ = frontend_task.await;
    let _ = control_task.await;
    let _ = supervisor
        .call(SupervisorMsg::StopAll, Some(Duration::from_secs(60)))
        .await;
    supervisor.stop(None);
    batcher.stop(None);
    let _ = supervisor_handle.await;
    let _ = batcher_handle.await;
    tracing::info!("stopped");
    Ok(())
}

/// Waits until every device is ready at once, then tells systemd, writes the
/// ready file and tells `on_ready`.
async fn announce_ready(
    mut statuses: Vec<watch::Receiver<DeviceStatus>>,
    ready_file: Option<PathBuf>,
    on_ready: Option<oneshot::Sender<Endpoints>>,
    endpoints: Endpoints,
) {
    let started = Instant::now();
    loop {
        if statuses
            .iter_mut()
            .all(|s| *s.borrow_and_update() == DeviceStatus::Ready)
        {
            break;
        }
        let changes = statuses.iter_mut().map(|s| Box::pin(s.changed()));
        if futures::future::select_all(changes).await.0.is_err() {
            return; // a device actor's channel closed: shutting down
        }
    }
    tracing::info!("all devices ready after {:?}", started.elapsed());
    super::notify::notify("READY=1");
    if let Some(path) = ready_file {
        let info = serde_json::json!({
            "endpoint": endpoints.endpoint,
            "control_endpoint": endpoints.control_endpoint,
            "pid": std::process::id(),
        });
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, info.to_string())
            .and_then(|_| std::fs::rename(&tmp, &path))
            .is_err()
        {
            tracing::error!("cannot write the ready file {}", path.display());
        }
    }
    if let Some(tx) = on_ready {
        let _ = tx.send(endpoints);
    }
}
