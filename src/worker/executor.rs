//! The worker's backend thread: loads the models, captures every graph, then
//! runs batches as they arrive.
//!
//! Batches are pipelined: a batch is launched (inputs copied in, replay
//! started) as soon as it arrives, and collected when the next one has been
//! launched or nothing else is waiting, so the device never idles while the
//! host prepares the next batch. At most [`MAX_PIPELINE`] are in flight.

use super::graph_cache::GraphCache;
use super::link::{self, FaultKind, FromWorker, ToWorker, WorkerError};
use super::memory_budget;
use super::shm::{self, Ring};
use super::{WorkerArgs, WorkerBackend};
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{Backend, BackendError};
use crate::bucket::Grid;
use crate::config::{Config, DevicesConfig, KernelPaths};
use crate::model::Model;
use bytes::Bytes;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Batches launched but not yet collected.
pub const MAX_PIPELINE: usize = 2;

/// A message from the daemon, as the I/O thread hands it over.
pub struct Command {
    pub msg: ToWorker,
    pub data: Vec<Bytes>,
}

/// What the backend thread asks the I/O thread to do.
pub enum Outgoing {
    Message(Vec<Bytes>),
    /// Send nothing more; exit the process with this status.
    Exit(i32),
}

/// The worker's end of the shared-memory link ([`super::shm`]): the ring,
/// the doorbell socket, and the eventfd the I/O thread writes when it has
/// handed this thread a command (so one wait covers both).
pub struct FastEnd {
    pub ring: Ring,
    pub doorbell: OwnedFd,
    pub wake: std::sync::Arc<OwnedFd>,
}

/// Where a batch came from, and so where its answer goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// The socket: the output travels in a data frame.
    Socket,
    /// A ring slot: the output goes into the slot, the answer on the doorbell.
    Slot(u32),
}

pub struct Outbox {
    pub tx: UnboundedSender<Outgoing>,
    pub fast: Option<FastEnd>,
}

impl Outbox {
    fn send(&self, msg: &FromWorker, data: Option<Bytes>) {
        let _ = self.tx.send(Outgoing::Message(link::encode(msg, data)));
    }

    /// Answers a batch where it came from. `output`: its rows, for a `Done`.
    fn answer(&self, route: Route, msg: &FromWorker, output: Option<&[f32]>) {
        let fast = match (route, &self.fast) {
            (Route::Slot(slot), Some(fast)) => (slot, fast),
            _ => return self.send(msg, output.map(crate::tensor::f32s_to_le)),
        };
        let (slot, fast) = fast;
        let mut msg = msg.clone();
        if let (Some(out), FromWorker::Done { batch, attempt, .. }) = (output, &msg) {
            if let Err(e) = fast.ring.write_output(slot, out) {
                msg = FromWorker::Failed {
                    batch: *batch,
                    attempt: *attempt,
                    error: WorkerError::Other(e),
                    slot: Some(slot),
                };
            }
        }
        if let FromWorker::Failed {
            error:
                WorkerError::DeviceFault(m)
                | WorkerError::OutOfMemory(m)
                | WorkerError::Unsupported(m)
                | WorkerError::InvalidBatch(m)
                | WorkerError::Other(m),
            ..
        } = &mut msg
        {
            if m.len() > shm::MAX_DOORBELL_MESSAGE / 2 {
                let mut cut = shm::MAX_DOORBELL_MESSAGE / 2;
                while !m.is_char_boundary(cut) {
                    cut -= 1;
                }
                m.truncate(cut);
            }
        }
        let bytes = rmp_serde::to_vec_named(&msg).expect("link messages serialise");
        // Blocking: the daemon reads its doorbell all the time, and at most
        // one answer per slot is ever outstanding. An error means the
        // daemon is gone; this worker is about to be told so.
        if let Err(e) = shm::ring_send(fast.doorbell.as_raw_fd(), &bytes, false) {
            tracing::warn!("doorbell: {e}");
        }
    }

    /// Reports a fatal error and stops this thread without dropping the
    /// backend (a poisoned device's destructors may panic).
    fn die(&self, message: String, code: i32) -> ! {
        tracing::error!("{message}");
        self.send(&FromWorker::Fatal { message }, None);
        let _ = self.tx.send(Outgoing::Exit(code));
        loop {
            std::thread::park();
        }
    }
}

/// The next command, from the I/O thread or the doorbell: `Ok(None)` when
/// `wait` passed (or at once, for `None`) with nothing there, `Err(())` when
/// the daemon is gone. Until `spin_until` the doorbell is polled rather than
/// slept on (`devices.worker_spin_us`): on a VM a sleeping thread's wake-up
/// costs tens of µs.
fn next_command(
    rx: &Receiver<Command>,
    fast: Option<&FastEnd>,
    wait: Option<Duration>,
    spin_until: Instant,
    buf: &mut [u8],
) -> Result<Option<Command>, ()> {
    let Some(fast) = fast else {
        return match wait {
            None => match rx.try_recv() {
                Ok(c) => Ok(Some(c)),
                Err(TryRecvError::Empty) => Ok(None),
                Err(TryRecvError::Disconnected) => Err(()),
            },
            Some(wait) => match rx.recv_timeout(wait) {
                Ok(c) => Ok(Some(c)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Err(()),
            },
        };
    };
    let until = wait.map(|w| Instant::now() + w);
    loop {
        match rx.try_recv() {
            Ok(c) => return Ok(Some(c)),
            Err(TryRecvError::Empty) => {}
            Err(TryRecvError::Disconnected) => return Err(()),
        }
        match shm::ring_recv(fast.doorbell.as_raw_fd(), buf) {
            Ok(Some(n)) => match rmp_serde::from_slice::<ToWorker>(&buf[..n]) {
                Ok(msg) => {
                    return Ok(Some(Command {
                        msg,
                        data: Vec::new(),
                    }))
                }
                Err(e) => {
                    tracing::error!("bad doorbell message: {e}");
                    continue;
                }
            },
            Ok(None) => {}
            Err(_) => return Err(()),
        }
        let Some(until) = until else {
            return Ok(None);
        };
        let now = Instant::now();
        let left = until.saturating_duration_since(now);
        if left.is_zero() {
            return Ok(None);
        }
        if now < spin_until {
            std::hint::spin_loop();
            continue;
        }
        let mut fds = [
            libc::pollfd {
                fd: fast.doorbell.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: fast.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: two valid pollfds and a timeout; no signal mask change.
        unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if fds[1].revents & libc::POLLIN != 0 {
            let mut counter = [0u8; 8];
            // SAFETY: reads the eventfd's 8-byte counter, resetting it.
            unsafe {
                libc::read(
                    fast.wake.as_raw_fd(),
                    counter.as_mut_ptr() as *mut libc::c_void,
                    8,
                )
            };
        }
    }
}

/// Entry point of the backend thread.
pub fn run(
    args: WorkerArgs,
    config: Config,
    rx: Receiver<Command>,
    tx: UnboundedSender<Outgoing>,
    fast: Option<FastEnd>,
) {
    let outbox = Outbox { tx, fast };
    match args.backend {
        WorkerBackend::Cpu => {
            let backend = crate::backend::cpu::CpuBackend::new(args.ordinal, args.threads.max(1));
            serve(backend, &args, &config, &rx, &outbox)
        }
        WorkerBackend::Null => {
            match crate::backend::null::NullBackend::from_config(args.ordinal, &config.devices) {
                Ok(backend) => serve(backend, &args, &config, &rx, &outbox),
                Err(e) => outbox.die(e, link::EXIT_STARTUP_FAILED),
            }
        }
        WorkerBackend::Cuda => {
            let on_compile = |target: crate::backend::cuda::kernels::Target| {
                let target = format!("{target:?}");
                outbox.send(&FromWorker::CompilingKernels { target }, None);
            };
            match CudaBackend::open(args.ordinal, cuda_options(&config.devices), &on_compile) {
                Ok(backend) => serve(backend, &args, &config, &rx, &outbox),
                Err(e) => outbox.die(
                    format!("cuda:{}: {e}", args.ordinal),
                    if e.is_fatal() {
                        link::EXIT_DEVICE_FAULT
                    } else {
                        link::EXIT_STARTUP_FAILED
                    },
                ),
            }
        }
    }
}

/// The CUDA backend's options from `[devices]` (also used by the tools,
/// which run backends as a worker does).
pub fn cuda_options(devices: &DevicesConfig) -> CudaOptions {
    CudaOptions {
        allow_tf32: devices.allow_tf32,
        kernel_cache_dir: devices.kernel_cache_dir.clone(),
        matmul_autotune: devices.matmul_autotune,
        kernel_paths: KernelPaths::ALL_ON.without(&devices.kernel_paths_off),
    }
}

struct InFlight<P> {
    job: Job,
    rows: usize,
    output_dim: usize,
    started: Instant,
    pending: P,
}

/// A batch being answered: who it is and where the answer goes.
#[derive(Clone, Copy)]
struct Job {
    batch: u64,
    attempt: u32,
    route: Route,
    /// When this thread took it ([`crate::clock::mono_ns`]).
    taken_ns: u64,
}

fn serve<B: Backend>(
    mut backend: B,
    args: &WorkerArgs,
    config: &Config,
    rx: &Receiver<Command>,
    outbox: &Outbox,
) {
    let started = Instant::now();
    let startup_code = |e: &BackendError| {
        if e.is_fatal() {
            link::EXIT_DEVICE_FAULT
        } else {
            link::EXIT_STARTUP_FAILED
        }
    };
    let mut models = Vec::new();
    for model_config in &config.models {
        let model = match Model::load(&model_config.spec()) {
            Ok(m) => m,
            Err(e) => outbox.die(e.to_string(), link::EXIT_STARTUP_FAILED),
        };
        if let Err(message) = memory_budget::check_weights(&mut backend, &model) {
            outbox.die(message, link::EXIT_STARTUP_FAILED);
        }
        let weights = match backend.upload(&model) {
            Ok(w) => w,
            Err(e) => outbox.die(
                format!("uploading model {}: {e}", model.info.name),
                startup_code(&e),
            ),
        };
        models.push((model, weights, model_config.grid()));
    }
    let mut cache: GraphCache<B> = GraphCache::new();
    let mut graphs = Vec::new();
    let mut memory = Vec::new();
    if !args.eager {
        // Progress for the daemon's status line (and its watchdog).
        let total: usize = models.iter().map(|(_, _, g)| g.largest_first().len()).sum();
        let mut captured = 0;
        outbox.send(&FromWorker::Progress { captured, total }, None);
        for (index, (model, weights, grid)) in models.iter().enumerate() {
            // The grid as the device's memory holds it (largest first).
            let fit = match memory_budget::plan_buckets(
                &mut backend,
                model,
                weights,
                &grid.largest_first(),
            ) {
                Ok(f) => f,
                Err(e) => outbox.die(
                    format!("planning model {}: {e}", model.info.name),
                    startup_code(&e),
                ),
            };
            for (bucket, need) in &fit.dropped {
                tracing::warn!(
                    model = %model.info.name,
                    %bucket,
                    needs = %memory_budget::mib(need.needed),
                    free = %memory_budget::mib(need.free),
                    "bucket dropped: its graph does not fit in the device memory left after the weights and the larger graphs (its batches run on a smaller graph or eagerly)"
                );
            }
            captured += fit.dropped.len();
            let each = |_: &link::GraphReport| {
                captured += 1;
                outbox.send(&FromWorker::Progress { captured, total }, None);
            };
            match cache.capture_buckets(&mut backend, index, model, weights, &fit.kept, each) {
                Ok(reports) => graphs.extend(reports),
                Err(e) => outbox.die(
                    format!("capturing model {}: {e}", model.info.name),
                    startup_code(&e),
                ),
            }
            let (weights_bytes, arena_bytes) = backend.resident_bytes(weights);
            memory.push(link::ModelMemory {
                model: index,
                weights_bytes,
                arena_bytes,
                dropped: fit
                    .dropped
                    .iter()
                    .map(|(b, n)| (*b, n.needed, n.free))
                    .collect(),
            });
        }
    }
    outbox.send(
        &FromWorker::Ready {
            info: backend.info(),
            graphs,
            startup_ms: started.elapsed().as_millis() as u64,
            memory,
        },
        None,
    );

    let mut inflight: VecDeque<InFlight<B::Pending>> = VecDeque::new();
    // The watchdog in the daemon hears this thread at least every
    // heartbeat while it is idle or between batches; a thread stuck on its
    // device (or a stopped process) goes silent.
    let heartbeat = Duration::from_millis(args.heartbeat_ms.max(1));
    let mut last_said = Instant::now();
    let fast = outbox.fast.as_ref();
    // One doorbell buffer for the worker's life (a message is at most this).
    let mut doorbell_buf = vec![
        0u8;
        if fast.is_some() {
            shm::MAX_DOORBELL_MESSAGE
        } else {
            0
        }
    ];
    // devices.worker_spin_us: the doorbell is polled, not slept on, this
    // long after the last command or finished batch.
    let spin = args.spin_us.map_or_else(
        || config.devices.worker_spin(1),
        std::time::Duration::from_micros,
    );
    let mut busy_at = Instant::now();
    loop {
        if last_said.elapsed() >= heartbeat {
            outbox.send(&FromWorker::Heartbeat, None);
            last_said = Instant::now();
        }
        let wait = inflight
            .is_empty()
            .then(|| heartbeat.saturating_sub(last_said.elapsed()));
        let command = match next_command(rx, fast, wait, busy_at + spin, &mut doorbell_buf) {
            Ok(Some(c)) => c,
            Ok(None) if inflight.is_empty() => continue,
            Ok(None) => {
                collect_oldest(&mut backend, &mut inflight, outbox);
                last_said = Instant::now();
                busy_at = last_said;
                continue;
            }
            Err(()) => return,
        };
        let taken_ns = crate::clock::mono_ns();
        busy_at = Instant::now();
        let (job, model, bucket, rows) = match command.msg {
            ToWorker::Run {
                batch,
                attempt,
                model,
                bucket,
                layout,
            } => (
                Job {
                    batch,
                    attempt,
                    route: Route::Socket,
                    taken_ns,
                },
                model,
                bucket,
                link::rows_from_frames(&layout, &command.data),
            ),
            ToWorker::RunShm {
                batch,
                attempt,
                model,
                bucket,
                slot,
                rows,
            } => (
                Job {
                    batch,
                    attempt,
                    route: Route::Slot(slot),
                    taken_ns,
                },
                model,
                bucket,
                match fast {
                    Some(f) => f.ring.read_rows(slot, rows),
                    None => Err("a ring batch, but this worker has no ring".into()),
                },
            ),
            ToWorker::InjectFault { kind } => {
                let result = match kind {
                    FaultKind::Corrupt => backend.inject_fault(),
                    FaultKind::Hang => backend.inject_hang(),
                };
                let (ok, message) = match result {
                    Ok(()) => (true, format!("{kind:?} fault injected").to_lowercase()),
                    Err(e) => (false, e.to_string()),
                };
                tracing::warn!("inject-fault: {message}");
                outbox.send(&FromWorker::FaultInjected { ok, message }, None);
                continue;
            }
            ToWorker::Shutdown => {
                while !inflight.is_empty() {
                    collect_oldest(&mut backend, &mut inflight, outbox);
                }
                let _ = outbox.tx.send(Outgoing::Exit(0));
                return;
            }
            // A reload: capture the new grid beside the old one.
            ToWorker::Capture { model, grid } => {
                while !inflight.is_empty() {
                    collect_oldest(&mut backend, &mut inflight, outbox);
                }
                let Some((m, weights, current)) = models.get_mut(model) else {
                    outbox.send(
                        &FromWorker::Captured {
                            model,
                            graphs: Vec::new(),
                            error: Some(format!("no model {model}")),
                        },
                        None,
                    );
                    continue;
                };
                // An eager worker captures nothing; it only follows the batching mode.
                let buckets = if args.eager {
                    Vec::new()
                } else {
                    grid.largest_first()
                };
                let total = buckets
                    .iter()
                    .filter(|b| !cache.contains(model, **b))
                    .count();
                let mut captured = 0;
                let each = |_: &link::GraphReport| {
                    captured += 1;
                    outbox.send(&FromWorker::Progress { captured, total }, None);
                };
                let result = cache.capture_buckets(&mut backend, model, m, weights, &buckets, each);
                *current = grid;
                let (graphs, error) = match result {
                    Ok(graphs) => (graphs, None),
                    Err(e) if e.is_fatal() => outbox.die(
                        format!("capturing model {}: {e}", m.info.name),
                        link::EXIT_DEVICE_FAULT,
                    ),
                    Err(e) => (Vec::new(), Some(e.to_string())),
                };
                tracing::info!(model = %m.info.name, graphs = graphs.len(), error = ?error, "reload: captured");
                outbox.send(
                    &FromWorker::Captured {
                        model,
                        graphs,
                        error,
                    },
                    None,
                );
                last_said = Instant::now();
                continue;
            }
            ToWorker::Release { model, grid } => {
                // Batches launched in a graph about to go are collected first.
                while !inflight.is_empty() {
                    collect_oldest(&mut backend, &mut inflight, outbox);
                }
                let dropped = cache.release(model, |b| grid.contains(b));
                if let Some((_, _, current)) = models.get_mut(model) {
                    *current = grid;
                }
                outbox.send(&FromWorker::Released { model, dropped }, None);
                continue;
            }
        };
        let fail = |error: WorkerError| answer_failed(outbox, job, error);
        let Some((m, weights, grid)) = models.get(model) else {
            fail(WorkerError::InvalidBatch(format!("no model {model}")));
            continue;
        };
        let rows = match rows {
            Ok(r) => r,
            Err(e) => {
                fail(WorkerError::InvalidBatch(e));
                continue;
            }
        };
        let output_dim = m.info.output_dim;
        let n = rows.rows();
        // A bucket with no graph here (a batch formed under another grid,
        // reaching this worker across a reload) runs eagerly at its exact
        // shape: a grid change never fails a batch.
        if let Some(b) = bucket.filter(|&b| !cache.contains(model, b)) {
            tracing::debug!(model, bucket = %b, "no graph for the batch's bucket; running it eagerly");
        }
        match bucket.and_then(|b| cache.get_mut(model, b)) {
            Some(cached) => {
                if let Err(e) = cached.facts.check_rows(&rows) {
                    fail(WorkerError::InvalidBatch(e.to_string()));
                    continue;
                }
                let t0 = Instant::now();
                match backend.launch(&mut cached.graph, &rows) {
                    Ok(pending) => {
                        cached.replays += 1;
                        inflight.push_back(InFlight {
                            job,
                            rows: n,
                            output_dim,
                            started: t0,
                            pending,
                        });
                        if inflight.len() >= MAX_PIPELINE {
                            collect_oldest(&mut backend, &mut inflight, outbox);
                        }
                    }
                    Err(e) => report_error(outbox, job, e),
                }
            }
            None => {
                let t0 = Instant::now();
                // At the batch's exact shape: for a packed model a
                // packed program of exactly its tokens.
                let packed = matches!(grid, Grid::Packed(_));
                let program = m.eager_program(&rows, packed);
                let checked = program
                    .validate(&m.weights)
                    .map_err(|e| WorkerError::Unsupported(e.to_string()))
                    .and_then(|facts| {
                        facts
                            .check_rows(&rows)
                            .map_err(|e| WorkerError::InvalidBatch(e.to_string()))
                    });
                if let Err(e) = checked {
                    fail(e);
                    continue;
                }
                match backend.run_eager(m, weights, &program, &rows) {
                    Ok(out) => send_done(outbox, job, n, output_dim, t0, &out, false),
                    Err(e) => report_error(outbox, job, e),
                }
            }
        }
    }
}

fn collect_oldest<B: Backend>(
    backend: &mut B,
    inflight: &mut VecDeque<InFlight<B::Pending>>,
    outbox: &Outbox,
) {
    let Some(f) = inflight.pop_front() else {
        return;
    };
    match backend.collect(f.pending) {
        Ok(out) => send_done(outbox, f.job, f.rows, f.output_dim, f.started, &out, true),
        Err(e) => report_error(outbox, f.job, e),
    }
}

fn answer_failed(outbox: &Outbox, job: Job, error: WorkerError) {
    let slot = match job.route {
        Route::Slot(s) => Some(s),
        Route::Socket => None,
    };
    outbox.answer(
        job.route,
        &FromWorker::Failed {
            batch: job.batch,
            attempt: job.attempt,
            error,
            slot,
        },
        None,
    );
}

fn send_done(
    outbox: &Outbox,
    job: Job,
    rows: usize,
    output_dim: usize,
    started: Instant,
    out: &[f32],
    replayed: bool,
) {
    if out.len() != rows * output_dim {
        report_error(
            outbox,
            job,
            BackendError::Other(format!(
                "backend returned {} values for {rows} rows of {output_dim}",
                out.len()
            )),
        );
        return;
    }
    let slot = match job.route {
        Route::Slot(s) => Some(s),
        Route::Socket => None,
    };
    outbox.answer(
        job.route,
        &FromWorker::Done {
            batch: job.batch,
            attempt: job.attempt,
            rows,
            output_dim,
            compute_us: started.elapsed().as_micros() as u64,
            replayed,
            slot,
            started_ns: job.taken_ns,
            finished_ns: crate::clock::mono_ns(),
        },
        Some(out),
    );
}

/// Reports a failed batch; on a device fault, also exits the worker.
fn report_error(outbox: &Outbox, job: Job, error: WorkerError) {
    answer_failed(outbox, job, error.clone());
    if error.is_fatal() {
        outbox.die(error.to_string(), link::EXIT_DEVICE_FAULT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::Bucket;
    use crate::model::BatchRows;
    use std::path::PathBuf;

    struct Worker {
        to: std::sync::mpsc::Sender<Command>,
        from: tokio::sync::mpsc::UnboundedReceiver<Outgoing>,
        thread: std::thread::JoinHandle<()>,
    }

    impl Worker {
        /// A CPU worker serving all-MiniLM-L6-v2 with the config's `extra` keys.
        fn start(extra: &str) -> Worker {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2");
            let config = Config::parse(&format!(
                "[[models]]\nname = \"minilm\"\nkind = \"bert\"\npath = \"{}\"\n{extra}\n",
                dir.display()
            ))
            .unwrap();
            let args = WorkerArgs {
                config: PathBuf::from("unused.toml"),
                endpoint: String::new(),
                backend: WorkerBackend::Cpu,
                ordinal: 0,
                threads: 2,
                eager: false,
                heartbeat_ms: 100,
                spin_us: None,
                shm: None,
                doorbell_fd: None,
            };
            let (to, rx) = std::sync::mpsc::channel();
            let (tx, from) = tokio::sync::mpsc::unbounded_channel();
            let thread = std::thread::spawn(move || {
                let backend = crate::backend::cpu::CpuBackend::new(0, args.threads);
                serve(backend, &args, &config, &rx, &Outbox { tx, fast: None })
            });
            Worker { to, from, thread }
        }

        fn send(&self, frames: Vec<Bytes>) {
            let (msg, data) = link::decode::<ToWorker>(&frames).unwrap();
            let data = data.to_vec();
            self.to.send(Command { msg, data }).unwrap();
        }

        /// The next message other than a heartbeat.
        fn recv(&mut self) -> (FromWorker, Vec<Bytes>) {
            loop {
                match self.from.blocking_recv() {
                    Some(Outgoing::Message(frames)) => {
                        let (msg, data) = link::decode::<FromWorker>(&frames).unwrap();
                        let quiet =
                            matches!(msg, FromWorker::Heartbeat | FromWorker::Progress { .. });
                        if !quiet {
                            return (msg, data.to_vec());
                        }
                    }
                    Some(Outgoing::Exit(code)) => panic!("worker exited with {code}"),
                    None => panic!("worker gone"),
                }
            }
        }

        /// Runs `rows` in `bucket` (None: eager); the output values, or the error.
        fn run(
            &mut self,
            batch: u64,
            bucket: Option<Bucket>,
            rows: &BatchRows,
        ) -> Result<(Vec<f32>, bool), WorkerError> {
            self.send(link::encode_run(batch, 0, 0, bucket, [rows]));
            match self.recv() {
                (
                    FromWorker::Done {
                        batch: b,
                        rows: n,
                        output_dim,
                        replayed,
                        ..
                    },
                    data,
                ) => {
                    assert_eq!((b, n, output_dim), (batch, rows.rows(), 384));
                    let values: Vec<f32> = data[0]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    assert_eq!(values.len(), n * 384);
                    Ok((values, replayed))
                }
                (
                    FromWorker::Failed {
                        batch: b, error, ..
                    },
                    _,
                ) => {
                    assert_eq!(b, batch);
                    Err(error)
                }
                (other, _) => panic!("unexpected {other:?}"),
            }
        }

        fn stop(mut self) {
            self.send(link::encode(&ToWorker::Shutdown, []));
            loop {
                match self.from.blocking_recv() {
                    Some(Outgoing::Exit(code)) => {
                        assert_eq!(code, 0);
                        break;
                    }
                    Some(Outgoing::Message(_)) => continue, // heartbeats
                    None => panic!("worker gone without exiting"),
                }
            }
            self.thread.join().unwrap();
        }
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// A packed model's worker captures its token budgets, runs packed
    /// batches in them (one output row per sequence, in order) and eager
    /// batches as packed programs of their exact size, and refuses batches
    /// that do not fit the bucket they were sent to.
    #[test]
    fn a_packed_worker_serves_packed_buckets_and_packed_eager_runs() {
        let mut w = Worker::start(
            "batching = \"packed\"\ntoken_budgets = [32, 128]\nmax_seqs_per_batch = 6",
        );
        let graphs = match w.recv() {
            (FromWorker::Ready { graphs, .. }, _) => graphs,
            (other, _) => panic!("not ready: {other:?}"),
        };
        let buckets: Vec<Bucket> = graphs.iter().map(|g| g.bucket).collect();
        assert_eq!(buckets, vec![Bucket::packed(128, 6), Bucket::packed(32, 6)]);
        let texts = BatchRows::Tokens(vec![
            vec![101, 7592, 2088, 102],
            vec![],
            vec![101, 2023, 2003, 1037, 3231, 1012, 102],
            vec![101, 102],
        ]);
        let (small, replayed) = w.run(1, Some(Bucket::packed(32, 6)), &texts).unwrap();
        assert!(replayed);
        assert!(small[384..768].iter().all(|&v| v == 0.0), "empty sequence");
        let (large, _) = w.run(2, Some(Bucket::packed(128, 6)), &texts).unwrap();
        assert!(max_diff(&small, &large) < 1e-5);
        // Eager: the packed program at the batch's exact shape.
        let (eager, replayed) = w.run(3, None, &texts).unwrap();
        assert!(!replayed);
        assert!(max_diff(&eager, &small) < 1e-5);
        // Each sequence alone gives its row of the batch.
        for i in [0usize, 2, 3] {
            let alone = BatchRows::Tokens(vec![texts_of(&texts)[i].clone()]);
            let (one, _) = w
                .run(10 + i as u64, Some(Bucket::packed(32, 6)), &alone)
                .unwrap();
            assert!(
                max_diff(&one, &small[i * 384..(i + 1) * 384]) < 1e-5,
                "row {i}"
            );
        }
        // Too many tokens or sequences for the bucket.
        let long = BatchRows::Tokens(vec![vec![101; 20], vec![101; 13]]);
        let err = w.run(20, Some(Bucket::packed(32, 6)), &long).unwrap_err();
        assert!(
            matches!(&err, WorkerError::InvalidBatch(m) if m.contains("budget of 32")),
            "{err:?}"
        );
        let many = BatchRows::Tokens(vec![vec![101, 102]; 7]);
        assert!(matches!(
            w.run(21, Some(Bucket::packed(128, 6)), &many),
            Err(WorkerError::InvalidBatch(_))
        ));
        // A bucket this worker never captured (a batch from before a
        // reload) runs eagerly, not in a graph, and still answers.
        let (late, replayed) = w.run(22, Some(Bucket::new(1, 16)), &texts).unwrap();
        assert!(!replayed);
        assert_eq!(late.len(), texts.rows() * 384);
        // The larger batch still runs eagerly.
        let (e2, _) = w.run(23, None, &long).unwrap();
        assert_eq!(e2.len(), 2 * 384);
        w.stop();
    }

    fn texts_of(rows: &BatchRows) -> &[Vec<u32>] {
        match rows {
            BatchRows::Tokens(t) => t,
            BatchRows::Features { .. } => unreachable!(),
        }
    }

    /// A padded model's worker (the default batching) still captures its
    /// (batch, seq) grid from the same `Grid`, and its eager runs agree with
    /// its graphs.
    #[test]
    fn a_padded_worker_serves_its_grid_and_eager_runs() {
        let mut w = Worker::start("batching = \"padded\"\nbatch_buckets = [2]\nseq_buckets = [16]");
        let graphs = match w.recv() {
            (FromWorker::Ready { graphs, .. }, _) => graphs,
            (other, _) => panic!("not ready: {other:?}"),
        };
        assert_eq!(graphs.len(), 1);
        assert_eq!(graphs[0].bucket, Bucket::new(2, 16));
        let texts = BatchRows::Tokens(vec![vec![101, 7592, 102], vec![101, 2088, 2088, 102]]);
        let (graph, _) = w.run(1, Some(Bucket::new(2, 16)), &texts).unwrap();
        let (eager, replayed) = w.run(2, None, &texts).unwrap();
        assert!(!replayed);
        assert!(max_diff(&graph, &eager) < 1e-5);
        w.stop();
    }

    /// A reload's capture adds the new grid's buckets beside the old ones
    /// (old batches still run), and the release drops the old ones.
    #[test]
    fn a_worker_captures_a_new_grid_beside_the_old_and_releases_the_old() {
        use crate::bucket::{BucketGrid, Grid};
        let mut w = Worker::start("batching = \"padded\"\nbatch_buckets = [2]\nseq_buckets = [16]");
        assert!(matches!(w.recv().0, FromWorker::Ready { .. }));
        let texts = BatchRows::Tokens(vec![vec![101, 7592, 102], vec![101, 2088, 2088, 102]]);
        let new = Grid::Padded(BucketGrid::new(vec![1, 2], vec![8, 16]));
        w.send(link::encode(
            &ToWorker::Capture {
                model: 0,
                grid: new.clone(),
            },
            [],
        ));
        match w.recv() {
            (
                FromWorker::Captured {
                    model: 0,
                    graphs,
                    error: None,
                },
                _,
            ) => {
                let mut got: Vec<Bucket> = graphs.iter().map(|g| g.bucket).collect();
                got.sort();
                // (2, 16) was there already.
                assert_eq!(
                    got,
                    vec![Bucket::new(1, 8), Bucket::new(1, 16), Bucket::new(2, 8)]
                );
            }
            other => panic!("{other:?}"),
        }
        let (old, _) = w.run(1, Some(Bucket::new(2, 16)), &texts).unwrap();
        let (small, replayed) = w.run(2, Some(Bucket::new(2, 8)), &texts).unwrap();
        assert!(replayed);
        assert!(max_diff(&old, &small) < 1e-5);
        let only_8 = Grid::Padded(BucketGrid::new(vec![1, 2], vec![8]));
        w.send(link::encode(
            &ToWorker::Release {
                model: 0,
                grid: only_8,
            },
            [],
        ));
        match w.recv() {
            (FromWorker::Released { model: 0, dropped }, _) => {
                assert_eq!(dropped, vec![Bucket::new(1, 16), Bucket::new(2, 16)]);
            }
            other => panic!("{other:?}"),
        }
        // A released bucket's batch (one formed under the old grid) still
        // runs, eagerly, with the same numbers.
        let (late, replayed) = w.run(3, Some(Bucket::new(2, 16)), &texts).unwrap();
        assert!(!replayed);
        assert!(max_diff(&old, &late) < 1e-5);
        assert!(w.run(4, Some(Bucket::new(2, 8)), &texts).is_ok());
        w.stop();
    }
}
