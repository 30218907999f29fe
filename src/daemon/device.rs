//! The device actor: one per device (and one per eager worker). It owns the
//! device's worker process and the ZeroMQ socket to it.
//!
//! Life cycle of a worker ("generation"): bind a fresh `ipc://` socket, start
//! `replayd worker`, wait for `Ready` (every graph captured), forward batches
//! and results; when the process exits — killed, crashed, or on purpose after a
//! device fault — tell the batcher (which re-dispatches what the worker held)
//! and start a new generation after a back-off that doubles up to a limit.
//! Events from an older generation are ignored.
//!
//! Operator commands: `drain` keeps the worker but takes no new batches
//! (the batcher is told; what the worker holds finishes); `restart` drains,
//! stops the worker once it holds nothing (it collects what it launched and
//! exits 0) and starts a fresh one at once, which re-captures every graph.
//! A reload sends `Capture` (the worker captures a model's new grid beside
//! the old one) and, once the batcher has switched, `Release` (the old
//! buckets' graphs go). The actor knows which buckets its worker has: a
//! batch for a bucket the worker lacks (a batch formed under the old grid
//! and retried on a worker started under the new one, or the reverse) runs
//! in the smallest captured bucket that holds it, or eagerly in the worker,
//! never failing for the grid change.
//!
//! With `ring` set, each generation also gets a shared-memory ring in the
//! runtime directory and a doorbell socket pair ([`crate::worker::shm`]),
//! made before the worker starts; once it is ready the actor opens a
//! [`FastLink`] over them on the slot's [`DeviceRoute`], and batches then go
//! to the worker without passing through this actor ([`super::fast_link`]).
//! The ring file is removed when its worker exits.
//!
//! Whichever way a batch went, its outcome goes back to the batcher through
//! the actor's [`Reporter`] ([`super::report`]): this actor hands it the
//! socket's answers, the ring's reader task the ring's.

use super::batcher::shards::Batchers;
use super::fast_link::{self, FastLink};
use super::messages::{
    Batch, BatchOutcome, BatchOutput, BatchReport, DeviceId, DeviceMsg, DeviceStatus, StatusSender,
    WorkerEvent,
};
use super::metrics::{GraphStats, Metrics, ModelMemoryStats};
use super::report::{Reporter, Via};
use super::route::DeviceRoute;
use super::watchdog::Watchdog;
use crate::bucket::{Bucket, Grid};
use crate::model::BatchRows;
use crate::transport::{Dealer, DealerSender, Security};
use crate::worker::link::{self, FaultKind, FromWorker, GraphReport, ModelMemory, ToWorker};
use crate::worker::shm::{self, Ring, RingSpec};
use crate::worker::WorkerBackend;
use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How to start this device's worker process.
#[derive(Clone, Debug)]
pub struct WorkerCommand {
    pub exe: PathBuf,
    pub config_path: PathBuf,
    pub backend: WorkerBackend,
    pub ordinal: usize,
    pub threads: usize,
    pub eager: bool,
    /// µs the worker polls its doorbell after a batch (`--spin-us`): the
    /// daemon's choice for its number of workers; `None`: the worker's own
    /// (as for one worker).
    pub spin_us: Option<u64>,
}

#[derive(Clone)]
pub struct DeviceArgs {
    pub device: DeviceId,
    /// The batcher's way to this slot: the actor attaches itself to it and
    /// opens each worker's ring on it.
    pub route: Arc<DeviceRoute>,
    /// Index of this device in [`Metrics`]' device list.
    pub metrics_index: usize,
    /// e.g. "cuda:0", "cpu:1", "eager:0".
    pub label: String,
    pub worker: WorkerCommand,
    pub runtime_dir: PathBuf,
    pub batchers: Batchers,
    pub metrics: Arc<Metrics>,
    /// Where this slot's [`DeviceStatus`] is published.
    pub status: StatusSender,
    pub model_names: Vec<String>,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub start_timeout: Duration,
    pub stop_timeout: Duration,
    pub fault_injection: bool,
    /// Silence after which an idle worker counts as hung (the watchdog adds
    /// the expected time of what it holds).
    pub hang_timeout: Duration,
    /// How often the worker's backend thread says it is alive.
    pub heartbeat: Duration,
    /// The watchdog's guess of a batch's cost per token slot before any of
    /// its model's batches finished here, in microseconds.
    pub cold_us_per_token: f64,
    /// The shared-memory ring each worker generation gets (`None`: batches
    /// go through the worker's socket only).
    pub ring: Option<RingSpec>,
}

pub struct DeviceState {
    args: DeviceArgs,
    generation: u64,
    status: DeviceStatus,
    pid: Option<u32>,
    outbox: Option<DealerSender>,
    io_task: Option<tokio::task::JoinHandle<()>>,
    backoff: Duration,
    started_once: bool,
    stopping: bool,
    stop_waiters: Vec<RpcReplyPort<()>>,
    fault_waiters: Vec<RpcReplyPort<Result<String, String>>>,
    socket_path: Option<PathBuf>,
    /// When the last worker exited with a device fault: NVML reports the
    /// same fault as an Xid a moment later, which must not kill its successor.
    last_fault_exit: Option<std::time::Instant>,
    /// The worker was killed because its GPU reported a fault (NVML).
    killed_for_fault: bool,
    /// The worker was killed because the watchdog found it stuck.
    killed_for_hang: bool,
    /// The route back to the batcher (and the watchdog's ledger of what
    /// the worker holds), shared with the generation's [`FastLink`].
    reporter: Arc<Reporter>,
    /// This generation's ring and the daemon's end of its doorbell, until
    /// the worker is ready and they become a [`FastLink`].
    fast_parts: Option<(Ring, OwnedFd)>,
    /// The task reading the [`FastLink`]'s doorbell.
    fast_task: Option<tokio::task::JoinHandle<()>>,
    ring_path: Option<PathBuf>,
    /// The config file the next worker reads (a reload replaces it).
    worker_config: PathBuf,
    /// Drained by the operator.
    drained: bool,
    /// `restart` asked: draining, then the worker is stopped and replaced.
    restart_pending: bool,
    /// The restart's `Shutdown` was sent.
    restart_stopping: bool,
    /// The (model, bucket)s the current worker has graphs for.
    captured: BTreeSet<(usize, Bucket)>,
    /// Grids a reload set for some models; a worker that comes up without
    /// exactly these buckets is told to capture or release the difference.
    wanted: HashMap<usize, Grid>,
    /// A reload's capture in progress.
    capture: Option<PendingCapture>,
    capture_seq: u64,
}

/// A `DeviceMsg::Capture` waiting for its worker's `Captured` answers.
struct PendingCapture {
    left: BTreeSet<usize>,
    new_graphs: usize,
    error: Option<String>,
    port: RpcReplyPort<Result<usize, String>>,
    seq: u64,
}

/// Xid reports this soon after a device-fault exit are that fault's echo.
const FAULT_ECHO_WINDOW: Duration = Duration::from_secs(10);

pub struct DeviceActor;

impl Actor for DeviceActor {
    type Msg = DeviceMsg;
    type State = DeviceState;
    type Arguments = DeviceArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<DeviceMsg>,
        args: DeviceArgs,
    ) -> Result<DeviceState, ActorProcessingErr> {
        let _ = myself.cast(DeviceMsg::Spawn);
        args.route.attach(myself.clone());
        let reporter = Arc::new(Reporter::new(
            args.device,
            args.batchers.clone(),
            args.metrics.clone(),
            args.metrics_index,
            Watchdog::new(
                args.hang_timeout,
                args.cold_us_per_token,
                std::time::Instant::now(),
            ),
        ));
        Ok(DeviceState {
            reporter,
            fast_parts: None,
            fast_task: None,
            ring_path: None,
            killed_for_hang: false,
            worker_config: args.worker.config_path.clone(),
            drained: false,
            restart_pending: false,
            restart_stopping: false,
            captured: BTreeSet::new(),
            wanted: HashMap::new(),
            capture: None,
            capture_seq: 0,
            backoff: args.backoff_initial,
            args,
            generation: 0,
            status: DeviceStatus::Starting,
            pid: None,
            outbox: None,
            io_task: None,
            started_once: false,
            stopping: false,
            stop_waiters: Vec::new(),
            fault_waiters: Vec::new(),
            socket_path: None,
            last_fault_exit: None,
            killed_for_fault: false,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DeviceMsg>,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        // Never leave a worker behind (e.g. if this actor fails).
        state.kill_worker();
        if let Some(task) = state.io_task.take() {
            task.abort();
        }
        state.drop_ring();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<DeviceMsg>,
        msg: DeviceMsg,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DeviceMsg::Run { batch, attempt } => state.run(&batch, attempt),
            DeviceMsg::InjectFault(kind, port) => state.inject_fault(kind, port),
            DeviceMsg::Kill { reason } => {
                if state
                    .last_fault_exit
                    .is_some_and(|t| t.elapsed() < FAULT_ECHO_WINDOW)
                {
                    tracing::info!(device = %state.args.label, "ignoring {reason}: the worker already exited for a device fault");
                } else {
                    tracing::warn!(device = %state.args.label, "killing worker: {reason}");
                    state.set_error(reason);
                    state.killed_for_fault = state.pid.is_some();
                    state.kill_worker();
                }
            }
            DeviceMsg::Stop(port) => state.stop(&myself, port),
            DeviceMsg::Spawn => state.spawn(&myself).await,
            DeviceMsg::Drain(drain, port) => {
                let _ = port.send(state.drain(drain));
            }
            DeviceMsg::Restart(port) => {
                let _ = port.send(state.restart(&myself));
            }
            DeviceMsg::Capture { grids, port } => state.capture(&myself, grids, port),
            DeviceMsg::Release { grids } => {
                for (model, grid) in grids {
                    if state.status.is_up() && !state.args.worker.eager {
                        state.send(link::encode(
                            &ToWorker::Release {
                                model,
                                grid: grid.clone(),
                            },
                            [],
                        ));
                    }
                    state.wanted.insert(model, grid);
                }
            }
            DeviceMsg::SetWorkerConfig(path) => state.worker_config = path,
            DeviceMsg::Worker { generation, event } => {
                if generation == state.generation {
                    state.worker_event(&myself, event);
                }
            }
        }
        Ok(())
    }
}

impl DeviceState {
    fn label(&self) -> &str {
        &self.args.label
    }

    /// Closes this generation's ring on the route, stops reading its
    /// doorbell and removes its ring file (the mapping lives on in whoever
    /// still holds the [`FastLink`]).
    fn drop_ring(&mut self) {
        self.args.route.close_ring();
        if let Some(task) = self.fast_task.take() {
            task.abort();
        }
        self.fast_parts = None;
        if let Some(path) = self.ring_path.take() {
            let _ = std::fs::remove_file(path);
            self.args
                .metrics
                .update_device(self.args.metrics_index, |d| {
                    d.shm_slots = 0;
                    d.shm_slots_free = 0;
                });
        }
    }

    /// A ring and a doorbell for generation `generation`, or `None` (and the
    /// socket path only) when they cannot be made.
    fn make_ring(&mut self, safe_label: &str, generation: u64) -> Option<(PathBuf, OwnedFd)> {
        let spec = self.args.ring?;
        let path = self.args.runtime_dir.join(format!(
            "worker-{safe_label}-{}-{generation}.ring",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let made = Ring::create(&path, spec).and_then(|ring| Ok((ring, shm::doorbell_pair()?)));
        match made {
            Ok((ring, (ours, theirs))) => {
                self.fast_parts = Some((ring, ours));
                self.ring_path = Some(path.clone());
                Some((path, theirs))
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                tracing::warn!(device = %self.label(), "no shared-memory ring ({}: {e}); batches take the socket", path.display());
                None
            }
        }
    }

    fn set_status(&mut self, status: DeviceStatus) {
        self.status = status;
        self.args.status.send_replace(status);
        let pid = self.pid;
        self.args
            .metrics
            .update_device(self.args.metrics_index, |d| d.worker_pid = pid);
    }

    fn set_error(&self, error: String) {
        self.args
            .metrics
            .update_device(self.args.metrics_index, |d| d.last_error = Some(error));
    }

    async fn spawn(&mut self, myself: &ActorRef<DeviceMsg>) {
        if self.stopping || self.pid.is_some() {
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        let restarting = self.started_once;
        if self.started_once {
            self.args
                .metrics
                .update_device(self.args.metrics_index, |d| d.restarts += 1);
        }
        self.started_once = true;
        self.captured.clear();
        let safe_label: String = self
            .label()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let path = self.args.runtime_dir.join(format!(
            "worker-{safe_label}-{}-{generation}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let endpoint = format!("ipc://{}", path.display());
        let socket = match Dealer::bind(&endpoint, &link::transport_limits(), &Security::None).await
        {
            Ok(s) => s,
            Err(e) => {
                self.start_failed(myself, format!("cannot bind {endpoint}: {e}"));
                return;
            }
        };
        self.socket_path = Some(path);
        let w = self.args.worker.clone();
        let ring = self.make_ring(&safe_label, generation);
        let mut cmd = tokio::process::Command::new(&w.exe);
        cmd.arg("worker")
            .arg("--config")
            .arg(&self.worker_config)
            .arg("--endpoint")
            .arg(&endpoint)
            .arg("--backend")
            .arg(match w.backend {
                WorkerBackend::Cpu => "cpu",
                WorkerBackend::Cuda => "cuda",
                WorkerBackend::Null => "null",
            })
            .arg("--ordinal")
            .arg(w.ordinal.to_string())
            .arg("--threads")
            .arg(w.threads.to_string())
            .arg("--heartbeat-ms")
            .arg(self.args.heartbeat.as_millis().max(1).to_string())
            .stdin(std::process::Stdio::null())
            // Only the main process speaks to systemd (NotifyAccess=main).
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .kill_on_drop(true);
        if w.eager {
            cmd.arg("--eager");
        }
        if let Some(us) = w.spin_us {
            cmd.arg("--spin-us").arg(us.to_string());
        }
        if let Some((path, theirs)) = &ring {
            let fd = theirs.as_raw_fd();
            cmd.arg("--shm")
                .arg(path)
                .arg("--doorbell-fd")
                .arg(fd.to_string());
            // SAFETY: runs in the child between fork and exec, and only
            // clears close-on-exec on the doorbell's worker end (fcntl is
            // async-signal-safe), so the worker, and nothing else, inherits it.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let spawned = cmd.spawn();
        // The worker has its end now (or never will): close ours of it.
        drop(ring);
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                self.drop_ring();
                self.start_failed(myself, format!("cannot start {}: {e}", w.exe.display()));
                return;
            }
        };
        self.pid = child.id();
        self.reporter.watchdog().reset(std::time::Instant::now());
        tracing::info!(device = %self.label(), pid = ?self.pid, generation, "worker started");
        self.set_status(if restarting {
            DeviceStatus::Restarting
        } else {
            DeviceStatus::Starting
        });

        let (mut recv, send) = socket.split();
        self.outbox = Some(send);
        let me = myself.clone();
        self.io_task = Some(tokio::spawn(async move {
            while let Ok(m) = recv.recv().await {
                let event = WorkerEvent::Message(m.frames);
                if me.cast(DeviceMsg::Worker { generation, event }).is_err() {
                    break;
                }
            }
        }));
        let me = myself.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let (code, signal) = match status {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    (s.code(), s.signal())
                }
                Err(_) => (None, None),
            };
            let _ = me.cast(DeviceMsg::Worker {
                generation,
                event: WorkerEvent::Exited { code, signal },
            });
        });
        myself.send_after(self.args.start_timeout, move || DeviceMsg::Worker {
            generation,
            event: WorkerEvent::StartTimeout,
        });
    }

    fn start_failed(&mut self, myself: &ActorRef<DeviceMsg>, error: String) {
        tracing::error!(device = %self.label(), "{error}");
        self.set_error(error);
        self.set_status(DeviceStatus::Faulted);
        self.schedule_restart(myself);
    }

    fn schedule_restart(&mut self, myself: &ActorRef<DeviceMsg>) {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(self.args.backoff_max);
        myself.send_after(delay, || DeviceMsg::Spawn);
    }

    fn worker_event(&mut self, myself: &ActorRef<DeviceMsg>, event: WorkerEvent) {
        match event {
            WorkerEvent::Message(frames) => self.worker_message(myself, &frames),
            WorkerEvent::Exited { code, signal } => self.worker_exited(myself, code, signal),
            WorkerEvent::StartTimeout => {
                if self.status.is_coming_up() {
                    self.set_error(format!(
                        "worker did not become ready within {:?}",
                        self.args.start_timeout
                    ));
                    self.kill_worker();
                }
            }
            WorkerEvent::StopTimeout => {
                if self.stopping && self.pid.is_some() {
                    self.kill_worker();
                }
            }
            WorkerEvent::WatchdogTick => self.watchdog_tick(myself),
            WorkerEvent::RestartTimeout => {
                if self.restart_pending && !self.restart_stopping && self.pid.is_some() {
                    tracing::warn!(device = %self.label(), batches = self.reporter.watchdog().inflight(), "restart: the worker still holds batches; stopping it anyway (they run again elsewhere)");
                    self.stop_for_restart();
                }
            }
            WorkerEvent::CaptureTimeout => {
                let seq = self.capture_seq;
                if self.capture.as_ref().is_some_and(|c| c.seq == seq) {
                    let why = format!(
                        "the worker did not capture the new grid within {:?}",
                        self.args.start_timeout
                    );
                    self.finish_capture(Some(why.clone()));
                    self.set_error(why);
                    self.kill_worker();
                }
            }
        }
    }

    fn worker_message(&mut self, myself: &ActorRef<DeviceMsg>, frames: &[Bytes]) {
        let (msg, data) = match link::decode::<FromWorker>(frames) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(device = %self.label(), "{e}");
                return;
            }
        };
        let now = std::time::Instant::now();
        self.reporter.watchdog().heard(now);
        let device = self.args.device;
        match msg {
            FromWorker::Ready {
                info,
                graphs,
                startup_ms,
                memory,
            } => {
                let models = model_memory(&memory, &graphs, &self.args.model_names);
                for (m, stats) in memory.iter().zip(&models) {
                    for d in &stats.dropped {
                        tracing::warn!(device = %self.label(), model = %stats.model, "no graph for {d} (the device memory does not hold it)");
                    }
                    if !m.dropped.is_empty() {
                        let dropped: Vec<_> = m.dropped.iter().map(|d| d.0).collect();
                        self.args.batchers.cut_grid(m.model, &dropped);
                    }
                }
                let capture_ms = graphs.iter().map(|g| g.capture_us).sum::<u64>() / 1000;
                let memory: u64 = graphs.iter().map(|g| g.memory_bytes).sum();
                tracing::info!(
                    device = %self.label(),
                    backend = %info.backend,
                    name = %info.name,
                    generation = self.generation,
                    graphs = graphs.len(),
                    capture_ms,
                    graph_memory_mib = format!("{:.1}", memory as f64 / (1 << 20) as f64),
                    startup_ms,
                    "worker ready"
                );
                self.backoff = self.args.backoff_initial;
                self.captured = graphs.iter().map(|g| (g.model, g.bucket)).collect();
                let graph_stats = graph_stats(&graphs, &self.args.model_names);
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.name = info.name.clone();
                        d.graphs = graph_stats;
                        d.models = models;
                        d.startup_ms = Some(startup_ms);
                        d.capture = None;
                        d.inflight = 0;
                    });
                self.set_status(if self.drained {
                    DeviceStatus::Draining
                } else {
                    DeviceStatus::Ready
                });
                if self.stopping {
                    self.send(link::encode(&ToWorker::Shutdown, []));
                } else {
                    self.args.batchers.set_drained(device, self.drained);
                    self.start_fast_link();
                    self.args.batchers.device_up(device);
                    self.reconcile_grids();
                    self.schedule_watchdog(myself);
                }
            }
            FromWorker::CompilingKernels { target } => {
                tracing::info!(
                    target: "replayd::device",
                    "{}: compiling kernels for {target} (none built in or cached for this GPU)",
                    self.args.label
                );
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.compiling_kernels = Some(target)
                    });
            }
            FromWorker::Progress { captured, total } => {
                if matches!(
                    self.status,
                    DeviceStatus::Starting | DeviceStatus::Restarting
                ) {
                    self.set_status(DeviceStatus::Capturing);
                }
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.capture = Some((captured, total));
                        d.compiling_kernels = None;
                    });
            }
            FromWorker::Captured {
                model,
                graphs,
                error,
            } => {
                for g in &graphs {
                    self.captured.insert((g.model, g.bucket));
                }
                let added = graph_stats(&graphs, &self.args.model_names);
                let n = graphs.len();
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.graphs.extend(added);
                        d.capture = None;
                    });
                if let Some(e) = &error {
                    tracing::error!(device = %self.label(), model, "capturing the new grid: {e}");
                }
                let done = match self.capture.as_mut() {
                    Some(c) if c.left.contains(&model) => {
                        c.left.remove(&model);
                        c.new_graphs += n;
                        if c.error.is_none() {
                            c.error = error;
                        }
                        c.left.is_empty().then(|| c.error.take())
                    }
                    _ => None,
                };
                if let Some(error) = done {
                    self.finish_capture(error);
                }
            }
            FromWorker::Released { model, dropped } => {
                let name = self
                    .args
                    .model_names
                    .get(model)
                    .cloned()
                    .unwrap_or_default();
                let labels: Vec<String> = dropped.iter().map(|b| b.to_string()).collect();
                for b in &dropped {
                    self.captured.remove(&(model, *b));
                }
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.graphs
                            .retain(|g| !(g.model == name && labels.contains(&g.bucket)))
                    });
                if !dropped.is_empty() {
                    tracing::info!(device = %self.label(), model = %name, graphs = dropped.len(), "released the old grid's graphs");
                }
            }
            FromWorker::Done {
                batch,
                attempt,
                rows: _,
                output_dim,
                compute_us,
                replayed,
                slot: _,
                started_ns,
                finished_ns,
            } => {
                let output = BatchOutput {
                    data: data.first().cloned().unwrap_or_default(),
                    output_dim,
                    compute_us,
                    started_ns,
                    finished_ns,
                    replayed,
                };
                self.socket_report(batch, attempt, BatchOutcome::Done(output));
            }
            FromWorker::Failed {
                batch,
                attempt,
                error,
                slot: _,
            } => self.socket_report(batch, attempt, BatchOutcome::Failed(error)),
            FromWorker::Heartbeat => {}
            FromWorker::FaultInjected { ok, message } => {
                for port in self.fault_waiters.drain(..) {
                    let _ = port.send(if ok {
                        Ok(message.clone())
                    } else {
                        Err(message.clone())
                    });
                }
            }
            FromWorker::Fatal { message } => {
                tracing::error!(device = %self.label(), "worker: {message}");
                self.set_error(message);
            }
        }
    }

    /// A batch's outcome that came over the socket.
    fn socket_report(&mut self, batch: u64, attempt: u32, outcome: BatchOutcome) {
        let report = BatchReport {
            batch,
            attempt,
            outcome,
        };
        self.reporter.report(report, Via::Socket);
        self.restart_when_empty();
    }

    fn worker_exited(
        &mut self,
        myself: &ActorRef<DeviceMsg>,
        code: Option<i32>,
        signal: Option<i32>,
    ) {
        let was = self.status;
        self.pid = None;
        self.outbox = None;
        if let Some(task) = self.io_task.take() {
            task.abort();
        }
        if let Some(path) = self.socket_path.take() {
            let _ = std::fs::remove_file(path);
        }
        self.drop_ring();
        let hung = std::mem::take(&mut self.killed_for_hang);
        let device_fault =
            code == Some(link::EXIT_DEVICE_FAULT) || std::mem::take(&mut self.killed_for_fault);
        let how = match (code, signal) {
            (Some(link::EXIT_DEVICE_FAULT), _) => "device fault".to_string(),
            (None, Some(9)) if hung => "killed: it hung".to_string(),
            (None, Some(9)) if device_fault => "killed: its GPU reported a fault".to_string(),
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(s)) => format!("signal {s}"),
            _ => "unknown exit".to_string(),
        };
        if device_fault {
            self.last_fault_exit = Some(std::time::Instant::now());
            self.args
                .metrics
                .update_device(self.args.metrics_index, |d| d.device_faults += 1);
        }
        for port in self.fault_waiters.drain(..) {
            let _ = port.send(Err(format!("worker exited ({how})")));
        }
        if self.capture.is_some() {
            self.finish_capture(Some(format!(
                "the worker exited during the capture ({how})"
            )));
        }
        self.captured.clear();
        self.args
            .metrics
            .update_device(self.args.metrics_index, |d| d.capture = None);
        self.reporter.worker_gone(format!("worker exited: {how}"));
        if self.stopping {
            tracing::info!(device = %self.label(), "worker stopped ({how})");
            self.set_status(DeviceStatus::Stopped);
            for port in self.stop_waiters.drain(..) {
                let _ = port.send(());
            }
            return;
        }
        if std::mem::take(&mut self.restart_pending) {
            let clean = std::mem::take(&mut self.restart_stopping) && code == Some(0);
            if clean {
                tracing::info!(device = %self.label(), "worker stopped for a restart; starting a fresh one");
            } else {
                tracing::warn!(device = %self.label(), "worker exited during a restart ({how}); starting a fresh one");
                self.set_error(format!("worker exited ({how})"));
            }
            self.backoff = self.args.backoff_initial;
            self.set_status(DeviceStatus::Restarting);
            let _ = myself.cast(DeviceMsg::Spawn);
            return;
        }
        tracing::warn!(device = %self.label(), state = was.as_str(), "worker exited ({how}); restarting");
        if was.is_up() {
            self.set_error(format!("worker exited ({how})"));
        }
        self.set_status(DeviceStatus::Faulted);
        self.schedule_restart(myself);
    }

    /// Opens a [`FastLink`] over this generation's ring on the route, and
    /// starts the task that reads its answers.
    fn start_fast_link(&mut self) {
        let Some((ring, doorbell)) = self.fast_parts.take() else {
            return;
        };
        let link = match FastLink::new(ring, doorbell, self.reporter.clone()) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(device = %self.label(), "no shared-memory link ({e}); batches take the socket");
                return;
            }
        };
        let slots = link.slots() as u64;
        self.args
            .metrics
            .update_device(self.args.metrics_index, |d| {
                d.shm_slots = slots;
                d.shm_slots_free = slots;
            });
        self.fast_task = Some(tokio::spawn(fast_link::serve(
            link.clone(),
            self.args.metrics.clone(),
        )));
        self.args.route.open_ring(link);
    }

    fn send(&self, frames: Vec<Bytes>) -> bool {
        self.outbox.as_ref().is_some_and(|o| o.send(frames).is_ok())
    }

    fn run(&mut self, batch: &Batch, attempt: u32) {
        if !self.status.is_up() {
            // The batcher re-dispatches it when it processes our DeviceDown.
            return;
        }
        let bucket = match batch.bucket {
            Some(b) if !self.args.worker.eager && !self.captured.contains(&(batch.model, b)) => {
                let other = self.fallback_bucket(batch);
                tracing::debug!(device = %self.label(), batch = batch.id, bucket = %b, instead = ?other.map(|b| b.to_string()), "the worker has no graph for the batch's bucket (a grid change)");
                other
            }
            other => other,
        };
        let token_slots = match bucket {
            Some(bucket) => bucket.tokens(),
            None => batch.tokens,
        };
        self.reporter.sent(batch, attempt, token_slots);
        let sent = self.send(link::encode_run(
            batch.id,
            attempt,
            batch.model,
            bucket,
            batch.parts.iter().map(|p| p.rows.as_ref()),
        ));
        if !sent {
            // The worker's socket is gone: its exit re-dispatches the batch.
            self.reporter.unsent(batch, attempt);
        }
    }

    /// The smallest bucket the worker has a graph for that holds `batch`,
    /// or `None` (the worker runs it eagerly).
    fn fallback_bucket(&self, batch: &Batch) -> Option<Bucket> {
        let lens: Vec<usize> = batch
            .parts
            .iter()
            .flat_map(|p| match p.rows.as_ref() {
                BatchRows::Tokens(seqs) => seqs.iter().map(Vec::len).collect::<Vec<_>>(),
                rows @ BatchRows::Features { .. } => vec![1; rows.rows()],
            })
            .collect();
        let mut candidates: Vec<Bucket> = self
            .captured
            .iter()
            .filter(|(m, _)| *m == batch.model)
            .map(|(_, b)| *b)
            .filter(|b| crate::bucket::fits(*b, lens.iter().copied()))
            .collect();
        candidates.sort_by_key(|b| (b.tokens(), b.rows()));
        candidates.first().copied()
    }

    /// Drain (no new batches) or take work again.
    fn drain(&mut self, drain: bool) -> Result<String, String> {
        if self.stopping {
            return Err(format!("{} is stopping", self.label()));
        }
        self.drained = drain;
        self.args
            .metrics
            .update_device(self.args.metrics_index, |d| d.drained = drain);
        self.args
            .batchers
            .set_drained(self.args.device, drain || self.restart_pending);
        let held = self.reporter.watchdog().inflight();
        if drain {
            if self.status == DeviceStatus::Ready {
                self.set_status(DeviceStatus::Draining);
            }
            tracing::info!(device = %self.label(), batches = held, "drained: no new batches");
            Ok(format!(
                "{}: draining, no new batches ({held} in flight)",
                self.label()
            ))
        } else {
            if self.status == DeviceStatus::Draining && !self.restart_pending {
                self.set_status(DeviceStatus::Ready);
            }
            tracing::info!(device = %self.label(), "undrained: taking work again");
            Ok(format!(
                "{}: taking work again ({})",
                self.label(),
                self.status.as_str()
            ))
        }
    }

    /// Drain, stop the worker once empty, start a fresh one.
    fn restart(&mut self, myself: &ActorRef<DeviceMsg>) -> Result<String, String> {
        if self.stopping {
            return Err(format!("{} is stopping", self.label()));
        }
        if self.restart_pending {
            return Err(format!("{} is already restarting", self.label()));
        }
        match self.status {
            DeviceStatus::Faulted => {
                // Skip what is left of the back-off.
                let _ = myself.cast(DeviceMsg::Spawn);
                return Ok(format!(
                    "{}: restarting now (it had no worker)",
                    self.label()
                ));
            }
            s if !s.is_up() => {
                return Err(format!(
                    "{} is {}: its worker is already on its way up",
                    self.label(),
                    s.as_str()
                ))
            }
            _ => {}
        }
        self.restart_pending = true;
        self.args.batchers.set_drained(self.args.device, true);
        self.set_status(DeviceStatus::Draining);
        let held = self.reporter.watchdog().inflight();
        tracing::info!(device = %self.label(), batches = held, "restart: draining, then a fresh worker");
        let generation = self.generation;
        myself.send_after(self.args.stop_timeout, move || DeviceMsg::Worker {
            generation,
            event: WorkerEvent::RestartTimeout,
        });
        self.restart_when_empty();
        Ok(format!(
            "{}: restarting (waiting for {held} batches in flight, then a fresh worker captures every graph)",
            self.label()
        ))
    }

    /// A pending restart stops the worker once it holds no batch.
    fn restart_when_empty(&mut self) {
        if self.restart_pending
            && !self.restart_stopping
            && self.reporter.watchdog().inflight() == 0
        {
            self.stop_for_restart();
        }
    }

    fn stop_for_restart(&mut self) {
        self.restart_stopping = true;
        self.send(link::encode(&ToWorker::Shutdown, []));
    }

    /// A reload's new grids: captured now by a ready worker, else by the next.
    fn capture(
        &mut self,
        myself: &ActorRef<DeviceMsg>,
        grids: Vec<(usize, Grid)>,
        port: RpcReplyPort<Result<usize, String>>,
    ) {
        for (model, grid) in &grids {
            self.wanted.insert(*model, grid.clone());
        }
        if self.args.worker.eager || !self.status.is_up() || grids.is_empty() {
            // Eager workers capture nothing (they read the batching mode
            // from the config file when they start); a worker on its way up
            // reconciles when it is ready.
            if self.args.worker.eager && self.status.is_up() {
                for (model, grid) in grids {
                    self.send(link::encode(&ToWorker::Capture { model, grid }, []));
                }
            }
            let _ = port.send(Ok(0));
            return;
        }
        if self.capture.is_some() {
            let _ = port.send(Err(format!("{}: a capture is in progress", self.label())));
            return;
        }
        self.capture_seq += 1;
        self.capture = Some(PendingCapture {
            left: grids.iter().map(|(m, _)| *m).collect(),
            new_graphs: 0,
            error: None,
            port,
            seq: self.capture_seq,
        });
        for (model, grid) in grids {
            self.send(link::encode(&ToWorker::Capture { model, grid }, []));
        }
        let generation = self.generation;
        myself.send_after(self.args.start_timeout, move || DeviceMsg::Worker {
            generation,
            event: WorkerEvent::CaptureTimeout,
        });
    }

    fn finish_capture(&mut self, error: Option<String>) {
        if let Some(c) = self.capture.take() {
            let _ = c.port.send(match error {
                None => Ok(c.new_graphs),
                Some(e) => Err(format!("{}: {e}", self.args.label)),
            });
        }
    }

    /// A worker that came up with other buckets than a reload set (it
    /// started under an older config file) captures or releases the difference.
    fn reconcile_grids(&mut self) {
        if self.args.worker.eager {
            return;
        }
        let wanted: Vec<(usize, Grid)> = self.wanted.iter().map(|(m, g)| (*m, g.clone())).collect();
        for (model, grid) in wanted {
            let missing = grid
                .largest_first()
                .into_iter()
                .any(|b| !self.captured.contains(&(model, b)));
            let extra = self
                .captured
                .iter()
                .any(|(m, b)| *m == model && !grid.contains(*b));
            if missing {
                tracing::info!(device = %self.label(), model, "the worker lacks the new grid's buckets: capturing them");
                self.send(link::encode(
                    &ToWorker::Capture {
                        model,
                        grid: grid.clone(),
                    },
                    [],
                ));
            }
            if extra {
                self.send(link::encode(&ToWorker::Release { model, grid }, []));
            }
        }
    }

    fn schedule_watchdog(&self, myself: &ActorRef<DeviceMsg>) {
        let generation = self.generation;
        myself.send_after(self.args.heartbeat, move || DeviceMsg::Worker {
            generation,
            event: WorkerEvent::WatchdogTick,
        });
    }

    /// Kills a ready worker the watchdog finds stuck; its exit re-dispatches
    /// what it held and restarts it.
    fn watchdog_tick(&mut self, myself: &ActorRef<DeviceMsg>) {
        if !self.status.is_up() || self.stopping {
            return;
        }
        if self.capture.is_some() {
            // Capturing a reload's grid: the backend thread is busy with
            // that (it reports each graph); CaptureTimeout bounds it.
            self.reporter.watchdog().heard(std::time::Instant::now());
            self.schedule_watchdog(myself);
            return;
        }
        // Batches that finished through the shared-memory link never pass
        // this actor: a pending restart looks at what is left here too.
        self.restart_when_empty();
        let hung = self.reporter.watchdog().hung(std::time::Instant::now());
        if let Some(why) = hung {
            tracing::error!(device = %self.label(), "{why}; killing it");
            self.set_error(why);
            self.args
                .metrics
                .update_device(self.args.metrics_index, |d| d.hangs += 1);
            self.killed_for_hang = true;
            self.kill_worker();
            return;
        }
        self.schedule_watchdog(myself);
    }

    fn inject_fault(&mut self, kind: FaultKind, port: RpcReplyPort<Result<String, String>>) {
        if !self.args.fault_injection {
            let _ = port.send(Err(
                "fault injection is disabled (set devices.fault_injection = true)".into(),
            ));
            return;
        }
        if !self.status.is_up() {
            let _ = port.send(Err(format!(
                "device {} is {}, not ready",
                self.label(),
                self.status.as_str()
            )));
            return;
        }
        self.fault_waiters.push(port);
        self.send(link::encode(&ToWorker::InjectFault { kind }, []));
    }

    fn stop(&mut self, myself: &ActorRef<DeviceMsg>, port: RpcReplyPort<()>) {
        self.stopping = true;
        if self.pid.is_none() {
            self.set_status(DeviceStatus::Stopped);
            let _ = port.send(());
            return;
        }
        self.stop_waiters.push(port);
        if self.status.is_up() {
            self.send(link::encode(&ToWorker::Shutdown, []));
        }
        let generation = self.generation;
        myself.send_after(self.args.stop_timeout, move || DeviceMsg::Worker {
            generation,
            event: WorkerEvent::StopTimeout,
        });
    }

    fn kill_worker(&mut self) {
        if let Some(pid) = self.pid {
            // SAFETY: sending a signal to our own child process.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
}

/// A worker's graph reports, with model names resolved, for the stats.
/// Each model's memory report, with its graphs' buffers summed and its
/// dropped buckets in words.
fn model_memory(
    memory: &[ModelMemory],
    graphs: &[GraphReport],
    model_names: &[String],
) -> Vec<ModelMemoryStats> {
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    memory
        .iter()
        .map(|m| ModelMemoryStats {
            model: model_names.get(m.model).cloned().unwrap_or_default(),
            weights_bytes: m.weights_bytes,
            arena_bytes: m.arena_bytes,
            graph_bytes: graphs
                .iter()
                .filter(|g| g.model == m.model)
                .map(|g| g.memory_bytes)
                .sum::<u64>()
                .saturating_sub(m.arena_bytes),
            dropped: m
                .dropped
                .iter()
                .map(|(b, need, free)| format!("{b} needs {}, {} free", mib(*need), mib(*free)))
                .collect(),
        })
        .collect()
}

fn graph_stats(reports: &[GraphReport], model_names: &[String]) -> Vec<GraphStats> {
    reports
        .iter()
        .map(|g| GraphStats {
            model: model_names.get(g.model).cloned().unwrap_or_default(),
            bucket: g.bucket.to_string(),
            capture_us: g.capture_us,
            memory_bytes: g.memory_bytes,
        })
        .collect()
}
