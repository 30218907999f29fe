//! The daemon's configuration, read from TOML.
//!
//! `config/replayd.toml` is the documented default; every key there is
//! described. Unknown keys are rejected (`deny_unknown_fields`) and every value
//! is checked in [`Config::validate`], so a typo fails at start-up with a
//! message that names the key rather than being silently ignored.

use crate::bucket::{BucketGrid, Grid, TokenGrid};
use crate::model::{Activation, ModelKind, ModelSpec, Pooling};
use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

mod http;
mod kernel_paths;
pub use http::HttpConfig;
pub use kernel_paths::{KernelPath, KernelPaths};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

/// No upper bound, for [`within`].
const NO_MAX: u64 = u64::MAX;

/// `key`'s `value` is within `min..=max`; the message says the bound it breaks.
fn within(key: &str, value: u64, min: u64, max: u64) -> Result<(), ConfigError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(invalid(
        key,
        match (min, max) {
            (_, NO_MAX) => format!("must be at least {min}"),
            (0, _) => format!("must be at most {max}"),
            _ => format!("must be between {min} and {max}"),
        },
    ))
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub batching: BatchingConfig,
    pub devices: DevicesConfig,
    pub eager: EagerConfig,
    pub metrics: MetricsConfig,
    /// The optional HTTP front (`[http]`, off by default).
    pub http: HttpConfig,
    pub models: Vec<ModelConfig>,
}

/// Prometheus `/metrics` over HTTP (off unless `endpoint` is set).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `HOST:PORT` to serve `/metrics` (and `/stats`, `/health`) on, a
    /// loopback address (e.g. `127.0.0.1:9464`; port 0 picks a free one).
    /// Unset: no metrics listener.
    pub endpoint: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// ZeroMQ endpoint clients connect to (ROUTER): `tcp://host:port` or `ipc:///path`.
    pub endpoint: String,
    /// ZeroMQ endpoint for `replayctl` (ROUTER); default
    /// `ipc://<runtime_dir>/control.sock`.
    #[serde(default)]
    pub control_endpoint: String,
    /// Directory for the worker IPC sockets and other run-time files.
    pub runtime_dir: PathBuf,
    /// A group whose members may also use the sockets in `runtime_dir`
    /// (files 0660, directories 0770); default: owner only (0600/0700).
    pub runtime_group: Option<String>,
    /// Largest request message accepted, in bytes (all frames together).
    pub max_request_bytes: usize,
    /// Most texts (or id sequences, or feature rows) in one request.
    pub max_items_per_request: usize,
    /// Bytes all admitted requests may hold together (payloads, token ids,
    /// outputs awaiting send); beyond it requests get `overloaded` at once.
    pub max_buffered_bytes: usize,
    /// Threads that tokenize texts, off the async runtime (0 = number of cores, at most 8).
    /// A request of fewer than 8 texts takes one; larger requests are spread
    /// over a second pool of as many (idle, both sleep).
    pub tokenizer_threads: usize,
    /// The async runtime's worker threads (0 = one per core): fewer leave
    /// more of the cores to the worker processes, the tokenizer pool and
    /// libzmq's I/O threads on a host that runs other work too.
    pub runtime_threads: usize,
    /// Requests whose texts are at most this many bytes in all are
    /// tokenized on the task that received them (a few microseconds),
    /// skipping the hop to the tokenizer pool; plain-ASCII texts of a
    /// WordPiece model (the fast path) count a quarter of their bytes;
    /// 0 = always use the pool.
    pub inline_tokenize_bytes: usize,
    /// Replies queued for one client that is not reading; past it they are
    /// dropped (and counted), so a stalled client holds no more memory.
    pub send_hwm: usize,
    /// Requests libzmq queues from one client before it stops reading that
    /// connection (TCP back-pressure; nothing is lost).
    pub recv_hwm: usize,
    /// Time a new connection has to complete the ZMTP handshake, in ms.
    pub handshake_timeout_ms: u64,
    /// ZMTP heartbeat interval towards clients, in ms (0 = off); a client
    /// silent for three intervals is disconnected.
    pub client_heartbeat_ms: u64,
    /// libzmq I/O threads for each client socket shard; its connections are
    /// spread over them. One thread's TCP work capped a single busy socket
    /// near 100,000 requests/s on an H200 host; with the default four
    /// `client_sockets`, one each measured faster than two (fewer threads
    /// to wake).
    pub io_threads: usize,
    /// After it last handled an event, each libzmq I/O thread of the daemon
    /// polls its sockets this many µs before it sleeps (0: it sleeps at
    /// once, libzmq's own behaviour), so a request arriving, or a reply
    /// leaving, soon after finds it awake instead of waiting for a wake-up.
    /// At most 10000. Unset: [`AUTO_WORKER_SPIN_US`] on hosts of 8 or more
    /// CPUs, else 0 (see [`ServerConfig::io_spin`]); only while the load is
    /// light ([`crate::daemon::admission`]).
    pub io_spin_us: Option<u64>,
    /// ROUTER sockets ("shards") that serve `endpoint` together, 1 to 16:
    /// each has its own libzmq context (`io_threads` I/O threads), its own
    /// driver task and receive loop, and listens on the same address with
    /// `SO_REUSEPORT`, so the kernel spreads client connections over them.
    /// Clients see one endpoint. Applies to tcp endpoints on an IPv4
    /// address or `*`; ipc:// (and an interface name) always use one socket.
    pub client_sockets: usize,
    /// CURVE: a file holding the daemon's secret key (40 Z85 characters).
    /// With `curve_allowed_clients_file`, clients must authenticate and
    /// everything on the client socket is encrypted.
    pub curve_secret_key_file: Option<PathBuf>,
    /// CURVE: a file of allowed client public keys, one Z85 key per line
    /// (`#` comments allowed).
    pub curve_allowed_clients_file: Option<PathBuf>,
    /// Serve clients on a non-loopback TCP address without CURVE.
    pub allow_unauthenticated: bool,
    /// Time to finish queued and in-flight work after SIGTERM/SIGINT, in milliseconds.
    pub shutdown_grace_ms: u64,
}

/// `$XDG_RUNTIME_DIR/replayd` (a per-user directory systemd creates 0700),
/// else `$TMPDIR/replayd-<uid>`: never a name another user could have taken.
fn default_runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("replayd"),
        _ => {
            // SAFETY: geteuid has no preconditions.
            let uid = unsafe { libc::geteuid() };
            std::env::temp_dir().join(format!("replayd-{uid}"))
        }
    }
}

/// The control socket's default: `control.sock` in the runtime directory.
pub fn default_control_endpoint(runtime_dir: &Path) -> String {
    format!("ipc://{}", runtime_dir.join("control.sock").display())
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5555".into(),
            control_endpoint: default_control_endpoint(&default_runtime_dir()),
            runtime_dir: default_runtime_dir(),
            runtime_group: None,
            max_request_bytes: 64 << 20,
            max_items_per_request: 1024,
            max_buffered_bytes: 1 << 30,
            tokenizer_threads: 0,
            runtime_threads: 0,
            inline_tokenize_bytes: 256,
            send_hwm: 1000,
            recv_hwm: 64,
            handshake_timeout_ms: 10_000,
            io_threads: 1,
            io_spin_us: None,
            client_sockets: 4,
            client_heartbeat_ms: 10_000,
            curve_secret_key_file: None,
            curve_allowed_clients_file: None,
            allow_unauthenticated: false,
            shutdown_grace_ms: 30_000,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchingConfig {
    /// Longest time the oldest queued request waits for a fuller batch while
    /// every device is busy, in microseconds. An idle device takes work at once.
    pub max_wait_us: u64,
    /// Most requests queued per model; beyond it requests get `overloaded` at once.
    pub max_queue: usize,
    /// Batches a device may hold at once (one running, the rest staged so the
    /// host never waits between replays).
    pub max_inflight_per_device: usize,
    /// Times a batch is retried after its worker died before its requests get `internal`.
    pub max_attempts: u32,
    /// Batcher shards, each scheduling for its own group of graph devices
    /// (eager devices serve every shard); 0 = one per two graph devices,
    /// at most 8. Not changed by a reload.
    pub shards: usize,
}

impl Default for BatchingConfig {
    fn default() -> Self {
        Self {
            max_wait_us: 500,
            max_queue: 4096,
            max_inflight_per_device: 2,
            max_attempts: 3,
            shards: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// CUDA where a GPU is present, otherwise the CPU.
    Auto,
    Cuda,
    Cpu,
    /// Computes nothing (`src/backend/null.rs`): for measuring the host path
    /// only; `cpu_devices` sets how many.
    Null,
}

/// Which GPUs to use: `"all"` or a list of CUDA ordinals.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GpuSelection {
    Named(String),
    List(Vec<usize>),
}

impl Default for GpuSelection {
    fn default() -> Self {
        GpuSelection::Named("all".into())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    pub backend: BackendKind,
    /// GPUs to serve on (CUDA backend).
    pub gpus: GpuSelection,
    /// Number of CPU devices (worker processes) when the CPU backend is used.
    pub cpu_devices: usize,
    /// Threads each CPU device uses for matrix products (0 = cores / cpu_devices).
    pub cpu_threads: usize,
    /// Allow TF32 tensor cores for f32 models (faster, ~1e-3 relative error).
    pub allow_tf32: bool,
    /// Pick cuBLASLt algorithms by timing them at capture (may be faster;
    /// results then differ in the last bits between GPUs and restarts).
    pub matmul_autotune: bool,
    /// Enable the `inject-fault` control command (tests only).
    pub fault_injection: bool,
    /// First delay before restarting a dead worker, in milliseconds (doubles up to the max).
    pub restart_backoff_ms: u64,
    pub restart_backoff_max_ms: u64,
    /// How long a worker may take to start and capture every graph, in milliseconds.
    pub start_timeout_ms: u64,
    /// How long a ready worker may stay silent, beyond what the batches it
    /// holds should take, before it counts as hung and is killed, in ms.
    pub hang_timeout_ms: u64,
    /// How often a worker's backend thread says it is alive, in milliseconds.
    pub heartbeat_ms: u64,
    /// Where NVRTC-compiled kernels are cached (by source hash and architecture).
    pub kernel_cache_dir: Option<PathBuf>,
    /// The CUDA planner's specialised kernel paths to switch off (all on
    /// by default; see [`KernelPath`]).
    pub kernel_paths_off: Vec<KernelPath>,
    /// Worker processes per GPU (CUDA backend), each with its own graphs:
    /// more links and device actors for the same GPUs (host-side scaling).
    pub workers_per_gpu: usize,
    /// Batches and their outputs travel between the daemon and its workers
    /// through a shared-memory ring (one per worker, in `server.runtime_dir`);
    /// false: through the worker's socket, as before.
    pub shm_link: bool,
    /// After each batch, a worker's backend thread polls its doorbell for
    /// this many µs before it sleeps (0: it sleeps at once). A busy core for
    /// the next request's wake-up; at most 10000. Unset:
    /// [`AUTO_WORKER_SPIN_US`] where the host has at least
    /// [`AUTO_SPIN_MIN_CPUS`] CPUs for each worker process, else 0 (see
    /// [`DevicesConfig::worker_spin_for`]).
    pub worker_spin_us: Option<u64>,
    /// The null backend's modelled time per batch and per real token, in µs.
    pub null_us_per_batch: f64,
    pub null_us_per_token: f64,
    /// The null backend's per-bucket batch times: a JSON file, such as what
    /// `replayd backend-check --out` writes (src/backend/null.rs).
    pub null_timings: Option<PathBuf>,
}

/// `devices.worker_spin_us` when unset, on a host of at least
/// [`AUTO_SPIN_MIN_CPUS`] CPUs a worker: on the 16-vCPU H200 host it took
/// 44 µs off a short text's p50 and added 10 % to many small requests'
/// throughput with one worker
/// (docs/perf-log.md#run-record-2026-12-02-h200-bench-host-b239445).
pub const AUTO_WORKER_SPIN_US: u64 = 300;
/// Below this many CPUs the spinning core costs the rest of the host more
/// than the wake-up it saves (−9 % throughput on 2 cores), so unset means 0.
/// For the workers' spin it is CPUs per worker process: 8 zero-time devices
/// on the 16-vCPU H100 host answered 15 % more requests with their workers
/// not spinning (2.5 cores of spin given back; docs/perf-log.md, 2026-12-07
/// host tuning).
pub const AUTO_SPIN_MIN_CPUS: usize = 8;

/// A spin setting in µs, or when unset the automatic choice for `cpus`.
fn spin_for(configured: Option<u64>, cpus: usize) -> std::time::Duration {
    spin_per(configured, cpus, 1)
}

/// A spin setting in µs, or when unset the automatic choice for `cpus`
/// shared by `spinners` threads that would each spin.
fn spin_per(configured: Option<u64>, cpus: usize, spinners: usize) -> std::time::Duration {
    let us = configured.unwrap_or(if cpus >= AUTO_SPIN_MIN_CPUS * spinners.max(1) {
        AUTO_WORKER_SPIN_US
    } else {
        0
    });
    std::time::Duration::from_micros(us)
}

/// This host's CPUs, as the automatic spin settings count them.
fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl ServerConfig {
    /// How long the daemon's libzmq I/O threads poll after an event: the
    /// configured `io_spin_us`, or when unset the automatic choice for `cpus`.
    pub fn io_spin_for(&self, cpus: usize) -> std::time::Duration {
        spin_for(self.io_spin_us, cpus)
    }

    /// [`Self::io_spin_for`] this host's CPUs.
    pub fn io_spin(&self) -> std::time::Duration {
        self.io_spin_for(host_cpus())
    }
}

impl DevicesConfig {
    /// How long each of `workers` worker processes polls its doorbell after
    /// a batch: the configured `worker_spin_us`, or when unset the automatic
    /// choice: spin where the host has [`AUTO_SPIN_MIN_CPUS`] CPUs for each.
    pub fn worker_spin_for(&self, cpus: usize, workers: usize) -> std::time::Duration {
        spin_per(self.worker_spin_us, cpus, workers)
    }

    /// [`Self::worker_spin_for`] this host's CPUs.
    pub fn worker_spin(&self, workers: usize) -> std::time::Duration {
        self.worker_spin_for(host_cpus(), workers)
    }
}

impl Default for DevicesConfig {
    fn default() -> Self {
        Self {
            backend: BackendKind::Auto,
            gpus: GpuSelection::default(),
            cpu_devices: 1,
            cpu_threads: 0,
            allow_tf32: false,
            matmul_autotune: false,
            fault_injection: false,
            restart_backoff_ms: 100,
            restart_backoff_max_ms: 10_000,
            start_timeout_ms: 300_000,
            hang_timeout_ms: 2_000,
            heartbeat_ms: 100,
            kernel_cache_dir: None,
            kernel_paths_off: Vec::new(),
            workers_per_gpu: 1,
            shm_link: true,
            worker_spin_us: None,
            null_us_per_batch: 0.0,
            null_us_per_token: 0.0,
            null_timings: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EagerConfig {
    /// Worker processes that run requests too large for every bucket (0 = such requests get `too_long`).
    pub workers: usize,
    /// GPU the eager workers use on the CUDA backend (default: the first served GPU).
    pub gpu: Option<usize>,
    /// Most eager requests queued; beyond it `overloaded`.
    pub max_queue: usize,
}

impl Default for EagerConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            gpu: None,
            max_queue: 256,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Name clients use in requests.
    pub name: String,
    pub kind: ModelKind,
    /// BERT: the model folder. MLP: a `.safetensors` file, or a folder with
    /// `model.safetensors` and an optional `config.json` naming the activation.
    pub path: PathBuf,
    /// Compute dtype on the device: `auto` (f16 on CUDA — bf16 for the
    /// decoder embedding models, Qwen3 and Gemma 3 — and f32 on the CPU
    /// backend), f32, f16 or bf16. As written in the file; [`Self::dtype`]
    /// is what it resolves to.
    #[serde(rename = "dtype", default)]
    pub dtype_setting: DTypeSetting,
    /// The compute dtype in force: `dtype_setting` resolved for the backend
    /// by [`Config::resolve_for_backend`] (f32 until then).
    #[serde(skip, default = "default_dtype")]
    pub dtype: DType,
    /// Batch sizes a graph is captured for.
    #[serde(default = "default_batch_buckets")]
    pub batch_buckets: Vec<usize>,
    /// Sequence lengths a graph is captured for (BERT, padded batching).
    #[serde(default = "default_seq_buckets")]
    pub seq_buckets: Vec<usize>,
    /// `"padded"` or `"packed"` (BERT only; MLPs are always padded).
    /// Default: packed.
    #[serde(default)]
    pub batching: Option<BatchingMode>,
    /// Token budgets packed graphs are captured for (BERT, packed batching).
    #[serde(default = "default_token_budgets")]
    pub token_budgets: Vec<usize>,
    /// Most sequences in one packed graph.
    #[serde(default = "default_max_seqs_per_batch")]
    pub max_seqs_per_batch: usize,
    /// Longest input in tokens (BERT); default: the folder's `max_seq_length`.
    #[serde(default)]
    pub max_seq_len: Option<usize>,
    /// MLP activation between linear layers (overrides the folder's config.json).
    #[serde(default)]
    pub activation: Option<String>,
    /// Sentence pooling override (BERT; default: the folder's 1_Pooling/config.json, else mean).
    #[serde(default)]
    pub pooling: Option<Pooling>,
    /// L2-normalise embeddings (default: whether modules.json has a Normalize module).
    #[serde(default)]
    pub normalize: Option<bool>,
}

/// A model's `dtype` key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DTypeSetting {
    /// f16 on the CUDA backend (several times faster than f32 on GPUs),
    /// f32 on the CPU backend (its reference numerics).
    #[default]
    Auto,
    F32,
    F16,
    Bf16,
    /// Not a compute dtype: rejected by validation with a message.
    I32,
    U32,
}

impl DTypeSetting {
    /// The dtype on the CUDA backend (`cuda`) or the CPU backend.
    pub fn resolve(self, cuda: bool) -> DType {
        match self {
            DTypeSetting::Auto if cuda => DType::F16,
            DTypeSetting::Auto => DType::F32,
            DTypeSetting::F32 => DType::F32,
            DTypeSetting::F16 => DType::F16,
            DTypeSetting::Bf16 => DType::BF16,
            DTypeSetting::I32 => DType::I32,
            DTypeSetting::U32 => DType::U32,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DTypeSetting::Auto => "auto",
            DTypeSetting::F32 => "f32",
            DTypeSetting::F16 => "f16",
            DTypeSetting::Bf16 => "bf16",
            DTypeSetting::I32 => "i32",
            DTypeSetting::U32 => "u32",
        }
    }
}

/// How a model's requests are batched into graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BatchingMode {
    /// (batch, seq) rectangles: every row padded to the bucket's seq.
    Padded,
    /// Token budgets: sequences end to end, no padding inside the graph.
    Packed,
}

fn default_dtype() -> DType {
    DType::F32
}
fn default_batch_buckets() -> Vec<usize> {
    vec![1, 2, 4, 8, 16, 32, 64, 128]
}
fn default_seq_buckets() -> Vec<usize> {
    vec![16, 32, 64, 128, 256]
}
/// Eight budgets an octave (steps of 64 tokens up to 1,024, then an eighth
/// of each power of two), so that a batch's unused tail is at most an
/// eighth of its budget: on the realistic corpus the powers of two alone
/// left 29–31 % of the computed tokens empty (H200, 2026-12-01). The
/// graphs share their activation memory, so the count costs capture time
/// (a few ms each), not memory.
fn default_token_budgets() -> Vec<usize> {
    let mut budgets: Vec<usize> = (1..=16).map(|i| 64 * i).collect();
    let mut octave = 1024;
    while octave < 16384 {
        budgets.extend((1..=8).map(|i| octave + i * octave / 8));
        octave *= 2;
    }
    budgets
}
fn default_max_seqs_per_batch() -> usize {
    256
}

impl ModelConfig {
    /// The shapes to capture for this model (the config owns the mapping
    /// from its keys to a grid; `bucket` knows nothing of the config).
    pub fn grid(&self) -> Grid {
        match self.batching_mode() {
            BatchingMode::Padded => Grid::Padded(self.padded_grid()),
            BatchingMode::Packed => Grid::Packed(TokenGrid::new(
                self.token_budgets.clone(),
                self.max_seqs_per_batch,
            )),
        }
    }

    /// The (batch, seq) rectangles of `batch_buckets` × `seq_buckets`
    /// (`[1]` for models without a sequence axis).
    pub fn padded_grid(&self) -> BucketGrid {
        let seqs = match self.seq_grid() {
            [] => vec![1],
            grid => grid.to_vec(),
        };
        BucketGrid::new(self.batch_buckets.clone(), seqs)
    }
}

impl ModelConfig {
    /// The seq buckets that apply to this model (none for MLPs).
    pub fn seq_grid(&self) -> &[usize] {
        match self.kind {
            ModelKind::Bert => &self.seq_buckets,
            ModelKind::Mlp => &[],
        }
    }

    /// How this model is batched (MLPs: always padded).
    pub fn batching_mode(&self) -> BatchingMode {
        match self.kind {
            ModelKind::Mlp => BatchingMode::Padded,
            ModelKind::Bert => self.batching.unwrap_or(BatchingMode::Packed),
        }
    }

    pub fn max_batch_bucket(&self) -> usize {
        self.batch_buckets.iter().copied().max().unwrap_or(0)
    }

    /// What the model loader needs of this entry.
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: self.name.clone(),
            kind: self.kind,
            path: self.path.clone(),
            dtype: self.dtype,
            max_seq_len: self.max_seq_len,
            activation: self.activation.clone(),
            pooling: self.pooling,
            normalize: self.normalize,
        }
    }
}

impl Config {
    /// Reads, parses and validates a config file. Relative model paths are
    /// resolved against the current directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<config>"),
            message: e.to_string(),
        })?;
        if config.server.control_endpoint.is_empty() {
            config.server.control_endpoint = default_control_endpoint(&config.server.runtime_dir);
        }
        config.validate()?;
        Ok(config)
    }

    /// Resolves every model's `dtype = "auto"` for the backend the models
    /// run on (`cuda`: the CUDA backend); the daemon, each worker and the
    /// tools call it once they know.
    pub fn resolve_for_backend(&mut self, cuda: bool) {
        for m in &mut self.models {
            m.dtype = match m.dtype_setting {
                // Decoder embedding models are trained in bf16 and overflow
                // f16 (Gemma 3's activations reach inf).
                DTypeSetting::Auto
                    if cuda
                        && m.kind == ModelKind::Bert
                        && crate::model::bert::prefers_bf16(&m.path) =>
                {
                    DType::BF16
                }
                setting => setting.resolve(cuda),
            };
        }
    }

    /// Checks every value; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_endpoint("server.endpoint", &self.server.endpoint)?;
        check_endpoint("server.control_endpoint", &self.server.control_endpoint)?;
        // Equal endpoints can't both bind, except port 0 (each gets a free port).
        if self.server.endpoint == self.server.control_endpoint
            && !self.server.endpoint.ends_with(":0")
        {
            return Err(invalid(
                "server.control_endpoint",
                "must differ from server.endpoint",
            ));
        }
        // The bounds that name no other key.
        let n = |v: usize| v as u64;
        let (s, b, d) = (&self.server, &self.batching, &self.devices);
        for (key, value, min, max) in [
            (
                "server.max_request_bytes",
                n(s.max_request_bytes),
                1024,
                NO_MAX,
            ),
            ("server.io_spin_us", s.io_spin_us.unwrap_or(0), 0, 10_000),
            ("server.io_threads", n(s.io_threads), 1, 16),
            (
                "server.handshake_timeout_ms",
                s.handshake_timeout_ms,
                100,
                NO_MAX,
            ),
            (
                "server.max_items_per_request",
                n(s.max_items_per_request),
                1,
                NO_MAX,
            ),
            ("server.runtime_threads", n(s.runtime_threads), 0, 256),
            // Longer texts would hold an async-runtime thread for milliseconds.
            (
                "server.inline_tokenize_bytes",
                n(s.inline_tokenize_bytes),
                0,
                65_536,
            ),
            ("batching.max_queue", n(b.max_queue), 1, NO_MAX),
            (
                "batching.max_inflight_per_device",
                n(b.max_inflight_per_device),
                1,
                NO_MAX,
            ),
            ("batching.max_wait_us", b.max_wait_us, 0, 10_000_000),
            ("batching.shards", n(b.shards), 0, 64),
            (
                "batching.max_attempts",
                u64::from(b.max_attempts),
                1,
                NO_MAX,
            ),
            ("devices.cpu_devices", n(d.cpu_devices), 1, 64),
            ("devices.workers_per_gpu", n(d.workers_per_gpu), 1, 16),
            ("devices.heartbeat_ms", d.heartbeat_ms, 1, 10_000),
            (
                "devices.worker_spin_us",
                d.worker_spin_us.unwrap_or(0),
                0,
                10_000,
            ),
            ("devices.start_timeout_ms", d.start_timeout_ms, 1000, NO_MAX),
            ("eager.workers", n(self.eager.workers), 0, 64),
            ("eager.max_queue", n(self.eager.max_queue), 1, NO_MAX),
        ] {
            within(key, value, min, max)?;
        }
        if self.server.send_hwm == 0 || self.server.recv_hwm == 0 {
            return Err(invalid(
                "server.send_hwm",
                "server.send_hwm and server.recv_hwm must be at least 1",
            ));
        }
        if !(1..=16).contains(&self.server.client_sockets) {
            return Err(invalid(
                "server.client_sockets",
                format!(
                    "must be 1 to 16 (ROUTER sockets serving server.endpoint), got {}",
                    self.server.client_sockets
                ),
            ));
        }
        if self.server.curve_secret_key_file.is_some()
            != self.server.curve_allowed_clients_file.is_some()
        {
            return Err(invalid(
                "server.curve_secret_key_file",
                "CURVE needs both server.curve_secret_key_file and server.curve_allowed_clients_file",
            ));
        }
        if self.server.curve_secret_key_file.is_none()
            && !self.server.allow_unauthenticated
            && !is_local_endpoint(&self.server.endpoint)
        {
            return Err(invalid(
                "server.endpoint",
                format!(
                    "{} accepts clients from other hosts without authentication; configure CURVE (server.curve_secret_key_file and server.curve_allowed_clients_file) or set server.allow_unauthenticated = true",
                    self.server.endpoint
                ),
            ));
        }
        if !is_local_endpoint(&self.server.control_endpoint) {
            return Err(invalid(
                "server.control_endpoint",
                "the control socket (drain, restart, reload, fault injection) must be ipc:// or a loopback tcp:// address",
            ));
        }
        if let Some(path) = self.server.control_endpoint.strip_prefix("ipc://") {
            // sockaddr_un holds 107 bytes and a NUL.
            if path.len() > 107 {
                return Err(invalid(
                    "server.control_endpoint",
                    format!("the socket path {path} is longer than the 107 bytes a unix socket allows (choose a shorter server.runtime_dir or set server.control_endpoint)"),
                ));
            }
        }
        if let Some(endpoint) = &self.metrics.endpoint {
            match endpoint.parse::<std::net::SocketAddr>() {
                Ok(addr) if addr.ip().is_loopback() => {}
                Ok(_) => {
                    return Err(invalid(
                        "metrics.endpoint",
                        format!("{endpoint} is not a loopback address: /metrics is served on 127.0.0.1 or [::1] only (scrape it through a local agent)"),
                    ))
                }
                Err(_) => {
                    return Err(invalid(
                        "metrics.endpoint",
                        format!("{endpoint:?} is not HOST:PORT (e.g. \"127.0.0.1:9464\")"),
                    ))
                }
            }
        }
        if self.server.max_buffered_bytes < self.server.max_request_bytes {
            return Err(invalid(
                "server.max_buffered_bytes",
                "must be at least server.max_request_bytes",
            ));
        }
        if let GpuSelection::Named(name) = &self.devices.gpus {
            if name != "all" {
                return Err(invalid(
                    "devices.gpus",
                    format!("expected \"all\" or a list of GPU numbers, got {name:?}"),
                ));
            }
        }
        if let GpuSelection::List(list) = &self.devices.gpus {
            if list.is_empty() {
                return Err(invalid("devices.gpus", "the list is empty"));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != list.len() {
                return Err(invalid("devices.gpus", "lists a GPU twice"));
            }
        }
        for (key, v) in [
            ("devices.null_us_per_batch", self.devices.null_us_per_batch),
            ("devices.null_us_per_token", self.devices.null_us_per_token),
        ] {
            if !(0.0..=1e6).contains(&v) {
                return Err(invalid(key, "must be between 0 and 1000000"));
            }
        }
        if let (BackendKind::Null, Some(path)) = (self.devices.backend, &self.devices.null_timings)
        {
            crate::backend::null_timings::Timings::load(path)
                .map_err(|e| invalid("devices.null_timings", e))?;
        }
        if self.devices.restart_backoff_ms == 0
            || self.devices.restart_backoff_max_ms < self.devices.restart_backoff_ms
        {
            return Err(invalid(
                "devices.restart_backoff_max_ms",
                "must be at least devices.restart_backoff_ms, which must be positive",
            ));
        }
        if self.devices.hang_timeout_ms < 2 * self.devices.heartbeat_ms {
            return Err(invalid(
                "devices.hang_timeout_ms",
                "must be at least twice devices.heartbeat_ms",
            ));
        }
        self.http.validate(&self.models)?;
        if self.models.is_empty() {
            return Err(invalid(
                "models",
                "at least one [[models]] entry is required",
            ));
        }
        for (i, model) in self.models.iter().enumerate() {
            let key = |k: &str| format!("models[{i}].{k}");
            if model.name.is_empty()
                || !model
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                return Err(invalid(
                    key("name"),
                    format!(
                        "{:?} must be non-empty ASCII letters, digits, '-', '_' or '.'",
                        model.name
                    ),
                ));
            }
            if self.models[..i].iter().any(|m| m.name == model.name) {
                return Err(invalid(
                    key("name"),
                    format!("{:?} is used twice", model.name),
                ));
            }
            if matches!(model.dtype_setting, DTypeSetting::I32 | DTypeSetting::U32) {
                return Err(invalid(
                    key("dtype"),
                    format!(
                        "{} is not a compute dtype (use auto, f32, f16 or bf16)",
                        model.dtype_setting.as_str()
                    ),
                ));
            }
            check_grid(&key("batch_buckets"), &model.batch_buckets, 4096)?;
            match model.kind {
                ModelKind::Bert => {
                    check_grid(&key("seq_buckets"), &model.seq_buckets, 8192)?;
                    check_grid(&key("token_budgets"), &model.token_budgets, 1 << 20)?;
                    if model.max_seqs_per_batch == 0 || model.max_seqs_per_batch > 65536 {
                        return Err(invalid(
                            key("max_seqs_per_batch"),
                            "must be between 1 and 65536",
                        ));
                    }
                    if model.activation.is_some() {
                        return Err(invalid(key("activation"), "applies to kind = \"mlp\" only"));
                    }
                    if let Some(max) = model.max_seq_len {
                        if max < 2 {
                            return Err(invalid(key("max_seq_len"), "must be at least 2"));
                        }
                    }
                }
                ModelKind::Mlp => {
                    if model.batching == Some(BatchingMode::Packed) {
                        return Err(invalid(
                            key("batching"),
                            "\"packed\" needs a sequence axis (kind = \"bert\"); MLPs are padded",
                        ));
                    }
                    if model.max_seq_len.is_some() || model.pooling.is_some() {
                        return Err(invalid(
                            key("max_seq_len"),
                            "max_seq_len and pooling apply to kind = \"bert\" only",
                        ));
                    }
                    if let Some(act) = &model.activation {
                        if Activation::parse(act).is_none() {
                            return Err(invalid(
                                key("activation"),
                                format!("unknown activation {act:?} (relu, gelu, gelu_tanh, tanh, sigmoid, silu, identity)"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }
}

/// True for `ipc://` and for TCP on a loopback address (127.0.0.0/8, ::1,
/// localhost): reachable from this host only.
pub fn is_local_endpoint(endpoint: &str) -> bool {
    if endpoint.starts_with("ipc://") {
        return true;
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return false;
    };
    let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn check_endpoint(key: &str, endpoint: &str) -> Result<(), ConfigError> {
    let ok = endpoint
        .strip_prefix("tcp://")
        .map(|rest| {
            rest.rsplit_once(':')
                .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
        })
        .unwrap_or(false)
        || endpoint
            .strip_prefix("ipc://")
            .is_some_and(|p| !p.is_empty());
    if ok {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!("{endpoint:?} is not a ZeroMQ endpoint (tcp://HOST:PORT or ipc:///PATH)"),
        ))
    }
}

fn check_grid(key: &str, grid: &[usize], max: usize) -> Result<(), ConfigError> {
    if grid.is_empty() {
        return Err(invalid(key, "must list at least one size"));
    }
    if grid.iter().any(|&b| b == 0 || b > max) {
        return Err(invalid(key, format!("sizes must be between 1 and {max}")));
    }
    if grid.windows(2).any(|w| w[0] >= w[1]) {
        return Err(invalid(key, "sizes must be strictly increasing"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[models]]
name = "mlp"
kind = "mlp"
path = "mlp.safetensors"
"#;

    #[test]
    fn defaults_fill_everything_but_models() {
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.batching.max_wait_us, 500);
        assert_eq!(c.models[0].batch_buckets, vec![1, 2, 4, 8, 16, 32, 64, 128]);
        assert_eq!(c.models[0].dtype_setting, DTypeSetting::Auto);
        assert_eq!(c.devices.backend, BackendKind::Auto);
        assert_eq!(c.metrics.endpoint, None);
        assert_eq!(
            c.server.control_endpoint,
            format!("ipc://{}/control.sock", c.server.runtime_dir.display())
        );
    }

    #[test]
    fn runtime_threads_is_bounded() {
        let c = Config::parse(&format!("[server]\nruntime_threads = 4\n{MINIMAL}")).unwrap();
        assert_eq!(c.server.runtime_threads, 4);
        assert_eq!(Config::parse(MINIMAL).unwrap().server.runtime_threads, 0);
        let err =
            Config::parse(&format!("[server]\nruntime_threads = 300\n{MINIMAL}")).unwrap_err();
        assert!(err.to_string().contains("server.runtime_threads"), "{err}");
    }

    #[test]
    fn worker_spin_us_is_bounded_and_automatic_when_unset() {
        use std::time::Duration;
        let d = Config::parse(MINIMAL).unwrap().devices;
        assert_eq!(d.worker_spin_us, None);
        assert_eq!(d.worker_spin_for(2, 1), Duration::ZERO);
        assert_eq!(d.worker_spin_for(16, 1), Duration::from_micros(300));
        // Eight CPUs a spinning worker: 2 workers spin on 16, 8 do not.
        assert_eq!(d.worker_spin_for(16, 2), Duration::from_micros(300));
        assert_eq!(d.worker_spin_for(16, 8), Duration::ZERO);
        assert_eq!(d.worker_spin_for(128, 8), Duration::from_micros(300));
        let c = Config::parse(&format!("{MINIMAL}\n[devices]\nworker_spin_us = 0\n")).unwrap();
        assert_eq!(c.devices.worker_spin_for(16, 1), Duration::ZERO);
        let c = Config::parse(&format!("{MINIMAL}\n[server]\nio_spin_us = 40\n")).unwrap();
        assert_eq!(c.server.io_spin_for(2), Duration::from_micros(40));
        assert_eq!(c.server.io_spin_us, Some(40));
        assert_eq!(
            ServerConfig::default().io_spin_for(16),
            Duration::from_micros(300)
        );
        assert_eq!(ServerConfig::default().io_spin_for(2), Duration::ZERO);
        let e = Config::parse(&format!("{MINIMAL}\n[server]\nio_spin_us = 20000\n")).unwrap_err();
        assert!(e.to_string().contains("server.io_spin_us"), "{e}");
        let c = Config::parse(&format!("{MINIMAL}\n[devices]\nworker_spin_us = 50\n")).unwrap();
        assert_eq!(c.devices.worker_spin_for(2, 8), Duration::from_micros(50));
        let err =
            Config::parse(&format!("{MINIMAL}\n[devices]\nworker_spin_us = 20000\n")).unwrap_err();
        assert!(err.to_string().contains("devices.worker_spin_us"), "{err}");
    }

    #[test]
    fn auto_dtype_is_f16_on_cuda_and_f32_on_the_cpu() {
        let mut c = Config::parse(MINIMAL).unwrap();
        c.resolve_for_backend(true);
        assert_eq!(c.models[0].dtype, DType::F16);
        c.resolve_for_backend(false);
        assert_eq!(c.models[0].dtype, DType::F32);
        let mut c = Config::parse(&MINIMAL.replace("path", "dtype = \"bf16\"\npath")).unwrap();
        c.resolve_for_backend(false);
        assert_eq!(c.models[0].dtype, DType::BF16);
    }

    /// Decoder embedding models (trained in bf16; Gemma 3 overflows f16)
    /// get bf16 from `auto` on CUDA; encoders keep f16.
    #[test]
    fn auto_dtype_is_bf16_for_decoders_on_cuda() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models");
        for (folder, want) in [
            ("qwen3-st", DType::BF16),
            ("gemma3-st", DType::BF16),
            ("bert-st-new", DType::F16),
        ] {
            let toml = format!(
                "[[models]]\nname = \"m\"\nkind = \"bert\"\npath = \"{}\"\n",
                dir.join(folder).display()
            );
            let mut c = Config::parse(&toml).unwrap();
            c.resolve_for_backend(true);
            assert_eq!(c.models[0].dtype, want, "{folder}");
            c.resolve_for_backend(false);
            assert_eq!(c.models[0].dtype, DType::F32, "{folder}");
        }
    }

    #[test]
    fn the_control_socket_follows_the_runtime_dir_unless_set() {
        let c = Config::parse(&format!("[server]\nruntime_dir = \"/run/x\"\n{MINIMAL}")).unwrap();
        assert_eq!(c.server.control_endpoint, "ipc:///run/x/control.sock");
        let c = Config::parse(&format!(
            "[server]\nruntime_dir = \"/run/x\"\ncontrol_endpoint = \"tcp://127.0.0.1:5556\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.server.control_endpoint, "tcp://127.0.0.1:5556");
        let long = "/tmp/".to_string() + &"d".repeat(120);
        let err =
            Config::parse(&format!("[server]\nruntime_dir = \"{long}\"\n{MINIMAL}")).unwrap_err();
        assert!(err.to_string().contains("server.control_endpoint"), "{err}");
    }

    #[test]
    fn metrics_are_off_by_default_and_loopback_only() {
        let c = Config::parse(&format!(
            "[metrics]\nendpoint = \"127.0.0.1:9464\"\n{MINIMAL}"
        ))
        .unwrap();
        assert_eq!(c.metrics.endpoint.as_deref(), Some("127.0.0.1:9464"));
        for bad in ["0.0.0.0:9464", "10.1.2.3:80", "localhost"] {
            let err =
                Config::parse(&format!("[metrics]\nendpoint = \"{bad}\"\n{MINIMAL}")).unwrap_err();
            assert!(err.to_string().contains("metrics.endpoint"), "{bad}: {err}");
        }
    }

    /// config/replayd.toml documents the defaults: it must parse and agree with them.
    #[test]
    fn the_documented_default_config_matches_the_defaults() {
        let c = Config::parse(include_str!("../config/replayd.toml")).unwrap();
        assert_eq!(c.server, ServerConfig::default());
        assert_eq!(c.batching, BatchingConfig::default());
        assert_eq!(c.devices, DevicesConfig::default());
        assert_eq!(c.eager, EagerConfig::default());
        assert_eq!(c.metrics, MetricsConfig::default());
        assert_eq!(c.http, HttpConfig::default());
        let m = &c.models[0];
        assert_eq!(
            (m.kind, m.dtype_setting),
            (ModelKind::Bert, DTypeSetting::Auto)
        );
        assert_eq!(m.batch_buckets, default_batch_buckets());
        assert_eq!(m.seq_buckets, default_seq_buckets());
        assert_eq!(m.batching_mode(), BatchingMode::Packed);
        assert_eq!(
            c.models[0].batching, None,
            "the default, documented as a comment"
        );
    }

    #[test]
    fn bert_models_are_packed_unless_they_say_padded_and_mlps_are_always_padded() {
        let bert = "[[models]]\nname = \"e\"\nkind = \"bert\"\npath = \"x\"\n";
        let c = Config::parse(bert).unwrap();
        assert_eq!(c.models[0].batching_mode(), BatchingMode::Packed);
        let c = Config::parse(&format!("{bert}batching = \"padded\"\n")).unwrap();
        assert_eq!(c.models[0].batching_mode(), BatchingMode::Padded);
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.models[0].batching_mode(), BatchingMode::Padded);
    }

    #[test]
    fn client_sockets_default_to_four_and_take_1_to_16() {
        let c = Config::parse(MINIMAL).unwrap();
        assert_eq!(c.server.client_sockets, 4);
        for n in [1, 2, 16] {
            let c = Config::parse(&format!("[server]\nclient_sockets = {n}\n{MINIMAL}")).unwrap();
            assert_eq!(c.server.client_sockets, n);
        }
        for bad in ["0", "17", "1000"] {
            let err = Config::parse(&format!("[server]\nclient_sockets = {bad}\n{MINIMAL}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("server.client_sockets") && err.contains("1 to 16"),
                "{bad}: {err}"
            );
        }
        let err = Config::parse(&format!("[server]\nclient_sockets = -1\n{MINIMAL}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("client_sockets"), "{err}");
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = Config::parse(&format!("[batching]\nmax_wait = 5\n{MINIMAL}")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("max_wait"), "{msg}");
        let err = Config::parse(&format!("{MINIMAL}colour = \"red\"\n")).unwrap_err();
        assert!(err.to_string().contains("colour"), "{err}");
    }

    #[test]
    fn invalid_values_name_the_key() {
        let cases = [
            ("[batching]\nmax_queue = 0\n", "batching.max_queue"),
            ("[devices]\nbackend = \"tpu\"\n", "backend"),
            ("[devices]\ngpus = \"some\"\n", "devices.gpus"),
            ("[server]\nendpoint = \"http://x\"\n", "server.endpoint"),
            (
                "[server]\nendpoint = \"tcp://0.0.0.0:5555\"\n",
                "without authentication",
            ),
            (
                "[server]\ncontrol_endpoint = \"tcp://10.0.0.1:5556\"\n",
                "server.control_endpoint",
            ),
            ("[server]\nsend_hwm = 0\n", "server.send_hwm"),
            ("[server]\nclient_sockets = 0\n", "server.client_sockets"),
            ("[server]\nclient_sockets = 17\n", "server.client_sockets"),
        ];
        for (prefix, key) in cases {
            let err = Config::parse(&format!("{prefix}{MINIMAL}")).unwrap_err();
            assert!(err.to_string().contains(key), "{key}: {err}");
        }
        let err =
            Config::parse(&MINIMAL.replace("path", "batch_buckets = [4, 2]\npath")).unwrap_err();
        assert!(err.to_string().contains("models[0].batch_buckets"), "{err}");
        let err = Config::parse(&MINIMAL.replace("path", "dtype = \"i32\"\npath")).unwrap_err();
        assert!(err.to_string().contains("models[0].dtype"), "{err}");
        let err = Config::parse("").unwrap_err();
        assert!(err.to_string().contains("models"), "{err}");
    }
}
