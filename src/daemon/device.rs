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
//! With `ring` set, each generation also gets a shared-memory ring in the
//! runtime directory and a doorbell socket pair ([`crate::worker::shm`]),
//! made before the worker starts; once it is ready the actor hands the
//! batcher a [`FastLink`] over them, and batches then go to the worker
//! without passing through this actor ([`super::fast_link`]). The ring file
//! is removed when its worker exits.

use super::fast_link::{self, FastLink};
use super::messages::{
    Batch, BatchOutput, BatcherMsg, DeviceId, DeviceMsg, DeviceStatus, StatusSender, WorkerEvent,
};
use super::metrics::{GraphStats, Metrics};
use super::watchdog::Watchdog;
use crate::transport::{Dealer, DealerSender, Security};
use crate::worker::link::{self, FaultKind, FromWorker, GraphReport, ToWorker};
use crate::worker::shm::{self, Ring, RingSpec};
use crate::worker::WorkerBackend;
use bytes::Bytes;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
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
}

#[derive(Clone)]
pub struct DeviceArgs {
    pub device: DeviceId,
    /// Index of this device in [`Metrics`]' device list.
    pub metrics_index: usize,
    /// e.g. "cuda:0", "cpu:1", "eager:0".
    pub label: String,
    pub worker: WorkerCommand,
    pub runtime_dir: PathBuf,
    pub batcher: ActorRef<BatcherMsg>,
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
    /// Shared with the generation's [`FastLink`], which feeds it too.
    watchdog: Arc<Mutex<Watchdog>>,
    /// This generation's ring and the daemon's end of its doorbell, until
    /// the worker is ready and they become a [`FastLink`].
    fast_parts: Option<(Ring, OwnedFd)>,
    /// The task reading the [`FastLink`]'s doorbell.
    fast_task: Option<tokio::task::JoinHandle<()>>,
    ring_path: Option<PathBuf>,
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
        let watchdog = Arc::new(Mutex::new(Watchdog::new(
            args.hang_timeout,
            args.cold_us_per_token,
            std::time::Instant::now(),
        )));
        Ok(DeviceState {
            watchdog,
            fast_parts: None,
            fast_task: None,
            ring_path: None,
            killed_for_hang: false,
            backoff: args.backoff_initial,
            args,
            generation: 0,
            status: DeviceStatus::Down,
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
            DeviceMsg::Worker { generation, event } => {
                if generation == state.generation {
                    state.worker_event(&myself, event);
                }
            }
        }
        Ok(())
    }
}

fn lock(w: &Mutex<Watchdog>) -> std::sync::MutexGuard<'_, Watchdog> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceState {
    fn label(&self) -> &str {
        &self.args.label
    }

    /// Stops reading this generation's doorbell and removes its ring file
    /// (the mapping lives on in whoever still holds the [`FastLink`]).
    fn drop_ring(&mut self) {
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
        if self.stopping || matches!(self.status, DeviceStatus::Starting | DeviceStatus::Ready) {
            return;
        }
        self.generation += 1;
        let generation = self.generation;
        if self.started_once {
            self.args
                .metrics
                .update_device(self.args.metrics_index, |d| d.restarts += 1);
        }
        self.started_once = true;
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
            .arg(&w.config_path)
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
            .kill_on_drop(true);
        if w.eager {
            cmd.arg("--eager");
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
        lock(&self.watchdog).reset(std::time::Instant::now());
        tracing::info!(device = %self.label(), pid = ?self.pid, generation, "worker started");
        self.set_status(DeviceStatus::Starting);

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
        self.set_status(DeviceStatus::Down);
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
                if self.status == DeviceStatus::Starting {
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
        lock(&self.watchdog).heard(now);
        let device = self.args.device;
        match msg {
            FromWorker::Ready {
                info,
                graphs,
                startup_ms,
            } => {
                tracing::info!(
                    device = %self.label(),
                    name = %info.name,
                    graphs = graphs.len(),
                    startup_ms,
                    "worker ready"
                );
                self.backoff = self.args.backoff_initial;
                let graph_stats = graph_stats(&graphs, &self.args.model_names);
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.name = info.name.clone();
                        d.graphs = graph_stats;
                        d.startup_ms = Some(startup_ms);
                    });
                self.set_status(DeviceStatus::Ready);
                if self.stopping {
                    self.send(link::encode(&ToWorker::Shutdown, []));
                } else {
                    self.start_fast_link();
                    let _ = self.args.batcher.cast(BatcherMsg::DeviceUp { device });
                    self.schedule_watchdog(myself);
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
                lock(&self.watchdog).finished(batch, attempt, Some(compute_us), now);
                self.args
                    .metrics
                    .update_device(self.args.metrics_index, |d| {
                        d.batches += 1;
                        d.socket_batches += 1;
                        if replayed {
                            d.graph_replays += 1;
                        } else {
                            d.eager_runs += 1;
                        }
                    });
                let output = BatchOutput {
                    data: data.first().cloned().unwrap_or_default(),
                    output_dim,
                    compute_us,
                    started_ns,
                    finished_ns,
                };
                let _ = self.args.batcher.cast(BatcherMsg::BatchDone {
                    device,
                    batch,
                    attempt,
                    output,
                });
            }
            FromWorker::Failed {
                batch,
                attempt,
                error,
                slot: _,
            } => {
                lock(&self.watchdog).finished(batch, attempt, None, now);
                if error.is_fatal() {
                    // The worker exits next; the batch is re-dispatched then.
                    self.set_error(error.to_string());
                } else {
                    let _ = self.args.batcher.cast(BatcherMsg::BatchFailed {
                        device,
                        batch,
                        attempt,
                        error,
                    });
                }
            }
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
        let _ = self.args.batcher.cast(BatcherMsg::DeviceDown {
            device: self.args.device,
            reason: format!("worker exited: {how}"),
        });
        if self.stopping {
            tracing::info!(device = %self.label(), "worker stopped ({how})");
            self.set_status(DeviceStatus::Stopped);
            for port in self.stop_waiters.drain(..) {
                let _ = port.send(());
            }
            return;
        }
        tracing::warn!(device = %self.label(), state = was.as_str(), "worker exited ({how}); restarting");
        if was == DeviceStatus::Ready {
            self.set_error(format!("worker exited ({how})"));
        }
        self.set_status(DeviceStatus::Down);
        self.schedule_restart(myself);
    }

    /// Hands the batcher a [`FastLink`] over this generation's ring, and
    /// starts the task that reads its answers.
    fn start_fast_link(&mut self) {
        let Some((ring, doorbell)) = self.fast_parts.take() else {
            return;
        };
        let link = match FastLink::new(self.args.device, ring, doorbell, self.watchdog.clone()) {
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
            self.args.batcher.clone(),
            self.args.metrics.clone(),
            self.args.metrics_index,
        )));
        let _ = self.args.batcher.cast(BatcherMsg::FastLink {
            device: self.args.device,
            link,
        });
    }

    fn send(&self, frames: Vec<Bytes>) -> bool {
        self.outbox.as_ref().is_some_and(|o| o.send(frames).is_ok())
    }

    fn run(&mut self, batch: &Batch, attempt: u32) {
        if self.status != DeviceStatus::Ready {
            // The batcher re-dispatches it when it processes our DeviceDown.
            return;
        }
        let token_slots = match batch.bucket {
            Some(bucket) => bucket.tokens(),
            None => batch.tokens,
        };
        lock(&self.watchdog).sent(batch.id, attempt, batch.model, token_slots);
        self.send(link::encode_run(
            batch.id,
            attempt,
            batch.model,
            batch.bucket,
            batch.parts.iter().map(|p| p.rows.as_ref()),
        ));
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
        if self.status != DeviceStatus::Ready || self.stopping {
            return;
        }
        let hung = lock(&self.watchdog).hung(std::time::Instant::now());
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
        if self.status != DeviceStatus::Ready {
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
        if self.status == DeviceStatus::Ready {
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
