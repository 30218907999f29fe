//! Starting and stopping the whole daemon: [`run`] binds the sockets, starts
//! the actors and workers, serves until `shutdown` resolves, then drains.
//!
//! Shutdown order: the batcher stops accepting (new requests get
//! `unavailable`) and dispatches everything queued at once; once every
//! accepted request is answered — or the grace period ends, and whatever is
//! left is answered `unavailable` — the workers are stopped and `run` returns.

use super::batcher::shards::Batchers;
use super::batcher::start::{start as start_batchers, ShardedArgs};
use super::batcher::ModelSlot;
use super::control::Control;
use super::device::{DeviceArgs, WorkerCommand};
use super::frontend::{Frontend, ServedModel};
use super::http_server;
use super::messages::{DeviceKind, DeviceStatus};
use super::metrics::{DeviceStats, Metrics, ModelStats};
use super::reload::Reloader;
use super::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
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
use std::os::unix::fs::PermissionsExt;
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
    /// `http://HOST:PORT/metrics`, when `[metrics] endpoint` is set.
    pub metrics_endpoint: Option<String>,
    /// The HTTP front's address (`HOST:PORT`), when `[http]` is enabled.
    pub http: Option<String>,
}

/// Marks a start-up error as the configuration's (a bad key, a model folder
/// that cannot be served, an unusable runtime directory): `replayd` exits
/// with status 78 (EX_CONFIG), which the systemd unit does not restart.
#[derive(Debug)]
pub struct ConfigRejected;

impl std::fmt::Display for ConfigRejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("configuration rejected")
    }
}

/// Whether a start-up error means the configuration was rejected.
pub fn is_config_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<crate::config::ConfigError>() || c.is::<super::runtime_dir::RuntimeDirError>()
    }) || e.downcast_ref::<ConfigRejected>().is_some()
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
        BackendKind::Null => {
            tracing::warn!("backend = null: the devices compute nothing (host-path benchmark)");
            WorkerBackend::Null
        }
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
        spin_us: None,
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
            if gpus.is_empty() {
                bail!("devices.gpus selects no GPU");
            }
            let per_gpu = config.devices.workers_per_gpu.max(1);
            for &g in &gpus {
                for w in 0..per_gpu {
                    devices.push(PlannedDevice {
                        // With several workers on a GPU, the first keeps the plain label.
                        label: if w == 0 {
                            format!("cuda:{g}")
                        } else {
                            format!("cuda:{g}.{w}")
                        },
                        kind: DeviceKind::Graph,
                        worker: worker(g, 1, false),
                    });
                }
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
        WorkerBackend::Cpu | WorkerBackend::Null => {
            let prefix = if backend == WorkerBackend::Null {
                "null"
            } else {
                "cpu"
            };
            let n = config.devices.cpu_devices;
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let threads = match config.devices.cpu_threads {
                0 => (cores / n).max(1),
                t => t,
            };
            for i in 0..n {
                devices.push(PlannedDevice {
                    label: format!("{prefix}:{i}"),
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
    // devices.worker_spin_us, when unset, for this many workers on this
    // host: spinning where each would have its share of the CPUs.
    let spin = config.devices.worker_spin(devices.len());
    for d in &mut devices {
        d.worker.spin_us = Some(spin.as_micros() as u64);
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
            log_model(mc, &info);
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

/// One start-up line per model: what was read from its folder, what was
/// derived, and which settings the config overrode.
fn log_model(mc: &crate::config::ModelConfig, info: &crate::model::ModelInfo) {
    let dtype = match mc.dtype_setting {
        crate::config::DTypeSetting::Auto => format!("{} (dtype = auto)", info.dtype),
        _ => info.dtype.to_string(),
    };
    let from = |set: bool| if set { "config" } else { "model folder" };
    match &info.input {
        crate::model::InputSpec::Tokens {
            vocab_size,
            max_seq_len,
        } => tracing::info!(
            model = %info.name,
            kind = ?info.kind,
            path = %mc.path.display(),
            %dtype,
            vocab_size,
            max_seq_len,
            max_seq_len_from = from(mc.max_seq_len.is_some()),
            output_dim = info.output_dim,
            pooling = %mc.pooling.map_or("from the model folder".to_string(), |p| format!("{p:?} (config)")),
            normalize = %mc.normalize.map_or("from the model folder".to_string(), |n| format!("{n} (config)")),
            tokenizer = %info.tokenizer_path.as_ref().map_or("none".into(), |p| p.display().to_string()),
            "model"
        ),
        crate::model::InputSpec::Features { features } => tracing::info!(
            model = %info.name,
            kind = ?info.kind,
            path = %mc.path.display(),
            %dtype,
            features,
            output_dim = info.output_dim,
            activation = %mc.activation.as_deref().unwrap_or("from the model folder"),
            "model"
        ),
    }
}

/// The shared-memory ring that holds the largest batch any model can send
/// to a device of this kind: the largest bucket (or, for eager workers, the
/// most sequences at the model's longest length), with
/// `max_inflight + 1` slots. A batch that does not fit still takes the socket.
fn ring_spec(
    models: &[ServedModel],
    slots: &[ModelSlot],
    eager: bool,
    max_inflight: usize,
) -> crate::worker::shm::RingSpec {
    use crate::model::InputSpec;
    let (mut input, mut output) = (0usize, 0usize);
    for (m, slot) in models.iter().zip(slots) {
        let (rows, tokens) = match (&slot.grid, &m.info.input) {
            (Grid::Padded(g), InputSpec::Tokens { max_seq_len, .. }) if eager => {
                (g.max_batch(), g.max_batch() * max_seq_len)
            }
            (Grid::Packed(g), InputSpec::Tokens { max_seq_len, .. }) if eager => {
                (g.max_seqs(), g.max_seqs() * max_seq_len)
            }
            (Grid::Padded(g), _) => (g.max_batch(), g.max_batch() * g.max_seq()),
            (Grid::Packed(g), _) => (g.max_seqs(), g.max_tokens()),
        };
        let bytes = match m.info.input {
            InputSpec::Tokens { .. } => 4 * (rows + tokens),
            InputSpec::Features { features } => 4 * rows * features,
        };
        input = input.max(bytes);
        output = output.max(4 * rows * m.info.output_dim);
    }
    crate::worker::shm::RingSpec {
        slots: (max_inflight + 1) as u32,
        input_bytes: input as u64,
        output_bytes: output as u64,
    }
}

/// How a model is batched, for the start-up log and the stats.
fn model_stats(slot: &ModelSlot, models: &[ServedModel]) -> ModelStats {
    ModelStats {
        name: slot.name.clone(),
        batching: slot.grid.batching().into(),
        grid: slot.grid.describe(),
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
        io_threads: s.io_threads,
        shared_context: false,
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
        io_threads: 1,
        shared_context: false,
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
    // Like ssh with its private keys: a secret every user can read is no
    // secret, and serving with it would only look authenticated.
    let mode = std::fs::metadata(secret)
        .with_context(|| {
            format!(
                "server.curve_secret_key_file: cannot read {}",
                secret.display()
            )
        })?
        .permissions()
        .mode();
    if mode & 0o004 != 0 {
        anyhow::bail!(
            "server.curve_secret_key_file {} is readable by every user (mode {:o}): chmod o-r it",
            secret.display(),
            mode & 0o777
        );
    }
    let secret_text = read(secret, "curve_secret_key_file")?;
    let keys = z85_decode(secret_text.trim())
        .and_then(CurveKeyPair::from_secret)
        .with_context(|| format!("server.curve_secret_key_file {}", secret.display()))?;
    let mut allowed = Vec::new();
    for (n, line) in read(clients, "curve_allowed_clients_file")?
        .lines()
        .enumerate()
    {
        // Z85 keys may contain '#': a line is a key when its first word has
        // a key's 40 characters, and a comment when it starts with '#'.
        let Some(word) = line.split_whitespace().next() else {
            continue;
        };
        if word.len() != 40 && word.starts_with('#') {
            continue;
        }
        allowed.push(z85_decode(word).with_context(|| {
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
    mut config: Config,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    super::runtime_dir::prepare(
        &config.server.runtime_dir,
        config.server.runtime_group.as_deref(),
    )?;
    let planned = plan_devices(&config, &options)?;
    let cuda = planned
        .iter()
        .any(|d| d.worker.backend == WorkerBackend::Cuda);
    config.resolve_for_backend(cuda);
    let models = load_models(&config).context(ConfigRejected)?;
    // Workers read the configuration in force from the runtime directory
    // (a reload replaces it), not the file that may have been edited since.
    let snapshot = super::reload::write_snapshot(&config, &config.server.runtime_dir, 0)
        .context("cannot write the workers' config into server.runtime_dir")?;
    let mut planned = planned;
    for d in &mut planned {
        d.worker.config_path = snapshot.clone();
    }
    let metrics = Arc::new(Metrics::new());

    let security = client_security(&config).context(ConfigRejected)?;
    // Process-wide: every libzmq I/O thread of the daemon (client shards,
    // control socket, worker links) polls this long after an event while the
    // load is light; the admission below switches it off and on.
    let io_spin = config.server.io_spin();
    crate::transport::set_io_spin(io_spin);
    tracing::debug!(
        io_spin_us = io_spin.as_micros() as u64,
        "libzmq I/O threads' light-load spin"
    );
    // One ROUTER, or `server.client_sockets` shards of the one endpoint
    // (tcp on an IPv4 address), each with its own libzmq context and driver.
    let client_sockets = Router::bind_shards(
        &config.server.endpoint,
        config.server.client_sockets,
        &client_limits(&config),
        &security,
    )
    .await
    .with_context(|| format!("cannot bind server.endpoint {}", config.server.endpoint))?;
    let endpoint = client_sockets[0].endpoint().to_string();
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
    let http_listener = if config.http.enabled {
        Some(http_server::bind(&config.http.listen, "http.listen").await?)
    } else {
        None
    };
    let metrics_listener = match &config.metrics.endpoint {
        Some(address) => Some(http_server::bind(address, "metrics.endpoint").await?),
        None => None,
    };
    let http_address = http_listener
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .map(|a| a.to_string());
    if let Some(address) = &http_address {
        tracing::info!(%address, "HTTP front listening");
    }
    metrics.set_transport_shards("client", client_sockets.iter().map(Router::stats).collect());
    metrics.set_transport("control", control_socket.stats());
    tracing::info!(
        %endpoint,
        %control_endpoint,
        client_sockets = client_sockets.len(),
        curve = matches!(security, Security::CurveServer { .. }),
        "listening"
    );

    let model_slots: Vec<ModelSlot> = config
        .models
        .iter()
        .map(|mc| ModelSlot {
            name: mc.name.clone(),
            grid: mc.grid(),
        })
        .collect();
    let batcher_models = model_slots.clone();
    let model_stats: Vec<ModelStats> = model_slots
        .iter()
        .map(|s| model_stats(s, &models))
        .collect();
    for m in &model_stats {
        tracing::info!(model = %m.name, batching = %m.batching, grid = %m.grid, "batching");
    }
    metrics.set_models(model_stats);
    for slot in &model_slots {
        metrics.set_model_grid(&slot.name, &slot.grid);
    }
    let routes: Vec<Arc<super::route::DeviceRoute>> =
        planned.iter().map(|_| Arc::default()).collect();
    let (batchers, batcher_handles) = start_batchers(ShardedArgs {
        models: model_slots,
        devices: planned.iter().map(|d| (d.kind, d.label.clone())).collect(),
        routes: routes.clone(),
        config: super::reload::scheduler_config(&config),
        max_attempts: config.batching.max_attempts,
        metrics: metrics.clone(),
        shards: config.batching.shards,
    })
    .await
    .context("cannot start the batcher")?;

    let model_names: Vec<String> = config.models.iter().map(|m| m.name.clone()).collect();
    let rings = config.devices.shm_link.then(|| {
        let inflight = config.batching.max_inflight_per_device;
        [false, true].map(|eager| ring_spec(&models, &batcher_models, eager, inflight))
    });
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
                WorkerBackend::Cuda | WorkerBackend::Null => 20.0,
            };
            DeviceArgs {
                device: slot,
                metrics_index: metrics.add_device(
                    DeviceStats {
                        label: d.label.clone(),
                        role: d.kind,
                        shard: (d.kind == DeviceKind::Graph)
                            .then(|| batchers.shard_of_device(slot))
                            .flatten(),
                        ..Default::default()
                    },
                    status_rx,
                ),
                status,
                label: d.label,
                worker: d.worker,
                runtime_dir: config.server.runtime_dir.clone(),
                batchers: batchers.clone(),
                route: routes[slot].clone(),
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
                ring: rings.map(|r| r[usize::from(d.kind == DeviceKind::Eager)]),
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
            batchers: batchers.clone(),
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
        io_spin,
    );
    let frontend = Arc::new(
        Frontend::new(
            models,
            batchers.clone(),
            metrics.clone(),
            DecodeLimits {
                max_bytes: config.server.max_request_bytes,
                max_items: config.server.max_items_per_request,
            },
            admission.clone(),
        )
        .with_inline_tokenize(config.server.inline_tokenize_bytes)
        .with_client_sockets(client_sockets.len()),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let http_task = http_listener.map(|listener| {
        let front = super::http::HttpFront::new(&config, frontend.clone(), metrics.clone());
        let routes = super::http::router(front, config.http.max_body_bytes);
        http_server::serve(listener, routes, "http front", stopped(stop_rx.clone())).1
    });
    let frontend_task = tokio::spawn(super::frontend::run(
        client_sockets,
        frontend.clone(),
        stopped(stop_rx.clone()),
    ));
    let reloader = Arc::new(Reloader::new(
        options.config_path.clone(),
        config.clone(),
        snapshot,
        supervisor.clone(),
        batchers.clone(),
        metrics.clone(),
        admission.clone(),
    ));
    let control = Arc::new(Control {
        metrics: metrics.clone(),
        supervisor: supervisor.clone(),
        reloader: reloader.clone(),
    });
    let control_task = tokio::spawn(super::control::run(
        control_socket,
        control,
        stopped(stop_rx.clone()),
    ));
    let metrics_task = metrics_listener.map(|listener| {
        let routes = super::prometheus::router(metrics.clone());
        let (bound, task) =
            http_server::serve(listener, routes, "metrics", stopped(stop_rx.clone()));
        let url = bound.map_or_else(String::new, |a| format!("http://{a}/metrics"));
        tracing::info!(endpoint = %url, "Prometheus metrics");
        (task, url)
    });
    let status_task = tokio::spawn(super::notify::status_loop(metrics.clone()));
    let watchdog_task = super::notify::watchdog_interval().map(|interval| {
        tracing::info!(
            "systemd watchdog: WATCHDOG=1 every {interval:?} while the batcher and frontend answer"
        );
        let (batchers, frontend) = (batchers.clone(), frontend.clone());
        tokio::spawn(super::notify::watchdog_loop(interval, move |within| {
            let (batchers, frontend) = (batchers.clone(), frontend.clone());
            async move { probe(&batchers, &frontend, within).await }
        }))
    });
    let ready_task = tokio::spawn(announce_ready(
        statuses,
        options.ready_file.clone(),
        options.on_ready,
        Endpoints {
            endpoint: endpoint.to_string(),
            control_endpoint: control_endpoint.to_string(),
            metrics_endpoint: metrics_task.as_ref().map(|(_, url)| url.clone()),
            http: http_address,
        },
        reloader.ready.clone(),
        metrics.clone(),
    ));

    shutdown.await;
    tracing::info!("shutting down: draining queued and in-flight requests");
    super::notify::notify("STOPPING=1");
    ready_task.abort();
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let started = Instant::now();
    if batchers.drain(grace).await {
        tracing::info!("drained in {:?}", started.elapsed())
    } else {
        let left = batchers.abort(Duration::from_secs(5)).await;
        tracing::warn!("grace period of {grace:?} ended; answered the rest unavailable ({left:?})");
    }
    // Every request is answered; the frontend flushes the last replies and stops.
    let _ = stop_tx.send(true);
    let _ = frontend_task.await;
    // Open HTTP connections get a few seconds to finish their requests.
    for task in http_task
        .into_iter()
        .chain(metrics_task.map(|(task, _)| task))
    {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    let _ = control_task.await;
    let _ = supervisor
        .call(SupervisorMsg::StopAll, Some(Duration::from_secs(60)))
        .await;
    supervisor.stop(None);
    batchers.stop();
    let _ = supervisor_handle.await;
    futures::future::join_all(batcher_handles).await;
    status_task.abort();
    if let Some(task) = watchdog_task {
        task.abort();
    }
    remove_snapshots(&config.server.runtime_dir);
    tracing::info!("stopped");
    Ok(())
}

/// Removes this process's config snapshots from the runtime directory.
fn remove_snapshots(dir: &std::path::Path) {
    let prefix = format!("config-{}-", std::process::id());
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The health loop's probe: the batcher actor answers a call and the
/// frontend's socket loop has turned within the last few turns.
async fn probe(batchers: &Batchers, frontend: &Frontend, within: Duration) -> Result<(), String> {
    let before = frontend.turns();
    if batchers.outstanding(within).await.is_none() {
        return Err(format!(
            "a batcher shard did not answer within {within:?} (or is gone)"
        ));
    }
    // The frontend's loop turns at least every TURN; give it three.
    let deadline = Instant::now() + (3 * super::frontend::TURN).min(within);
    while frontend.turns() == before {
        if Instant::now() >= deadline {
            return Err("the frontend's socket loop is stuck".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Waits until every device is ready at once, then tells systemd, writes the
/// ready file and tells `on_ready`.
async fn announce_ready(
    mut statuses: Vec<watch::Receiver<DeviceStatus>>,
    ready_file: Option<PathBuf>,
    on_ready: Option<oneshot::Sender<Endpoints>>,
    endpoints: Endpoints,
    ready_flag: Arc<std::sync::atomic::AtomicBool>,
    metrics: Arc<Metrics>,
) {
    let started = Instant::now();
    loop {
        if statuses.iter_mut().all(|s| s.borrow_and_update().is_up()) {
            break;
        }
        let changes = statuses.iter_mut().map(|s| Box::pin(s.changed()));
        if futures::future::select_all(changes).await.0.is_err() {
            return; // a device actor's channel closed: shutting down
        }
    }
    let devices = metrics.devices();
    let graphs: usize = devices.iter().map(|d| d.graphs.len()).sum();
    tracing::info!(
        devices = devices.len(),
        graphs,
        "all devices ready after {:?}",
        started.elapsed()
    );
    ready_flag.store(true, std::sync::atomic::Ordering::Release);
    super::notify::notify(&format!(
        "READY=1\nSTATUS={}",
        super::notify::status_line(&devices)
    ));
    if let Some(path) = ready_file {
        let info = serde_json::json!({
            "endpoint": endpoints.endpoint,
            "control_endpoint": endpoints.control_endpoint,
            "metrics_endpoint": endpoints.metrics_endpoint,
            "http": endpoints.http,
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
