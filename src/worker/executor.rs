//! The worker's backend thread: loads the models, captures every graph, then
//! runs batches as they arrive.
//!
//! Batches are pipelined: a batch is launched (inputs copied in, replay
//! started) as soon as it arrives, and collected when the next one has been
//! launched or nothing else is waiting, so the device never idles while the
//! host prepares the next batch. At most [`MAX_PIPELINE`] are in flight.

use super::graph_cache::GraphCache;
use super::link::{self, FaultKind, FromWorker, RowsLayout, ToWorker, WorkerError};
use super::{WorkerArgs, WorkerBackend};
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{Backend, BackendError};
use crate::bucket::BucketGrid;
use crate::config::{Config, DevicesConfig};
use crate::model::Model;
use bytes::Bytes;
use std::collections::VecDeque;
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

struct Outbox {
    tx: UnboundedSender<Outgoing>,
}

impl Outbox {
    fn send(&self, msg: &FromWorker, data: Option<Bytes>) {
        let _ = self.tx.send(Outgoing::Message(link::encode(msg, data)));
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

/// Entry point of the backend thread.
pub fn run(args: WorkerArgs, config: Config, rx: Receiver<Command>, tx: UnboundedSender<Outgoing>) {
    let outbox = Outbox { tx };
    match args.backend {
        WorkerBackend::Cpu => {
            let backend = crate::backend::cpu::CpuBackend::new(args.ordinal, args.threads.max(1));
            serve(backend, &args, &config, &rx, &outbox)
        }
        WorkerBackend::Cuda => {
            match CudaBackend::new(args.ordinal, cuda_options(&config.devices)) {
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
    }
}

impl From<BackendError> for WorkerError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::DeviceFault(m) => WorkerError::DeviceFault(m),
            BackendError::OutOfMemory(m) => WorkerError::OutOfMemory(m),
            BackendError::Unsupported(m) => WorkerError::Unsupported(m),
            BackendError::InvalidBatch(m) => WorkerError::InvalidBatch(m),
            BackendError::Other(m) => WorkerError::Other(m),
        }
    }
}

struct InFlight<P> {
    batch: u64,
    attempt: u32,
    rows: usize,
    output_dim: usize,
    started: Instant,
    pending: P,
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
        let weights = match backend.upload(&model) {
            Ok(w) => w,
            Err(e) => outbox.die(
                format!("uploading model {}: {e}", model.info.name),
                startup_code(&e),
            ),
        };
        models.push((model, weights, BucketGrid::for_model(model_config)));
    }
    let mut cache: GraphCache<B> = GraphCache::new();
    let mut graphs = Vec::new();
    if !args.eager {
        for (index, (model, weights, grid)) in models.iter().enumerate() {
            match cache.capture_model(&mut backend, index, model, weights, grid) {
                Ok(reports) => graphs.extend(reports),
                Err(e) => outbox.die(
                    format!("capturing model {}: {e}", model.info.name),
                    startup_code(&e),
                ),
            }
        }
    }
    outbox.send(
        &FromWorker::Ready {
            info: backend.info(),
            graphs,
            startup_ms: started.elapsed().as_millis() as u64,
        },
        None,
    );

    let mut inflight: VecDeque<InFlight<B::Pending>> = VecDeque::new();
    // The watchdog in the daemon hears this thread at least every
    // heartbeat while it is idle or between batches; a thread stuck on its
    // device (or a stopped process) goes silent.
    let heartbeat = Duration::from_millis(args.heartbeat_ms.max(1));
    let mut last_said = Instant::now();
    loop {
        if last_said.elapsed() >= heartbeat {
            outbox.send(&FromWorker::Heartbeat, None);
            last_said = Instant::now();
        }
        let command = if inflight.is_empty() {
            match rx.recv_timeout(heartbeat.saturating_sub(last_said.elapsed())) {
                Ok(c) => c,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.try_recv() {
                Ok(c) => c,
                Err(TryRecvError::Empty) => {
                    collect_oldest(&mut backend, &mut inflight, outbox);
                    last_said = Instant::now();
                    continue;
                }
                Err(TryRecvError::Disconnected) => return,
            }
        };
        match command.msg {
            ToWorker::Run {
                batch,
                attempt,
                model,
                bucket,
                layout,
            } => {
                let fail = |error: WorkerError| {
                    outbox.send(
                        &FromWorker::Failed {
                            batch,
                            attempt,
                            error,
                        },
                        None,
                    )
                };
                let Some((m, weights, _)) = models.get(model) else {
                    fail(WorkerError::InvalidBatch(format!("no model {model}")));
                    continue;
                };
                let rows = match link::rows_from_frames(&layout, &command.data) {
                    Ok(r) => r,
                    Err(e) => {
                        fail(WorkerError::InvalidBatch(e));
                        continue;
                    }
                };
                let output_dim = m.info.output_dim;
                let n = rows.rows();
                match bucket {
                    Some(bucket) => {
                        let Some(cached) = cache.get_mut(model, bucket) else {
                            fail(WorkerError::InvalidBatch(format!(
                                "no graph captured for bucket {bucket}"
                            )));
                            continue;
                        };
                        if let Err(e) = cached.facts.check_rows(&rows) {
                            fail(WorkerError::InvalidBatch(e.to_string()));
                            continue;
                        }
                        let t0 = Instant::now();
                        match backend.launch(&mut cached.graph, &rows) {
                            Ok(pending) => {
                                cached.replays += 1;
                                inflight.push_back(InFlight {
                                    batch,
                                    attempt,
                                    rows: n,
                                    output_dim,
                                    started: t0,
                                    pending,
                                });
                                if inflight.len() >= MAX_PIPELINE {
                                    collect_oldest(&mut backend, &mut inflight, outbox);
                                }
                            }
                            Err(e) => report_error(outbox, batch, attempt, e),
                        }
                    }
                    None => {
                        let t0 = Instant::now();
                        let seq = match layout {
                            RowsLayout::Features { .. } => 1,
                            RowsLayout::Tokens { .. } => rows.max_len(),
                        };
                        let program = m.program(n, seq);
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
                            Ok(out) => {
                                send_done(outbox, batch, attempt, n, output_dim, t0, &out, false)
                            }
                            Err(e) => report_error(outbox, batch, attempt, e),
                        }
                    }
                }
            }
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
            }
            ToWorker::Shutdown => {
                while !inflight.is_empty() {
                    collect_oldest(&mut backend, &mut inflight, outbox);
                }
                let _ = outbox.tx.send(Outgoing::Exit(0));
                return;
            }
        }
    }
}

fn collect_oldest<B: Backend>(
    backend: &mut B,
    inflight: &mut VecDeque<InFlight<B::Pending>>,
    outbox: &Outbox,
) {
    let Some(job) = inflight.pop_front() else {
        return;
    };
    match backend.collect(job.pending) {
        Ok(out) => send_done(
            outbox,
            job.batch,
            job.attempt,
            job.rows,
            job.output_dim,
            job.started,
            &out,
            true,
        ),
        Err(e) => report_error(outbox, job.batch, job.attempt, e),
    }
}

#[allow(clippy::too_many_arguments)]
fn send_done(
    outbox: &Outbox,
    batch: u64,
    attempt: u32,
    rows: usize,
    output_dim: usize,
    started: Instant,
    out: &[f32],
    replayed: bool,
) {
    if out.len() != rows * output_dim {
        report_error(
            outbox,
            batch,
            attempt,
            BackendError::Other(format!(
                "backend returned {} values for {rows} rows of {output_dim}",
                out.len()
            )),
        );
        return;
    }
    outbox.send(
        &FromWorker::Done {
            batch,
            attempt,
            rows,
            output_dim,
            compute_us: started.elapsed().as_micros() as u64,
            replayed,
        },
        Some(crate::tensor::f32s_to_le(out)),
    );
}

/// Reports a failed batch; on a device fault, also exits the worker.
fn report_error(outbox: &Outbox, batch: u64, attempt: u32, error: BackendError) {
    let error = WorkerError::from(error);
    outbox.send(
        &FromWorker::Failed {
            batch,
            attempt,
            error: error.clone(),
        },
        None,
    );
    if error.is_fatal() {
        outbox.die(error.to_string(), link::EXIT_DEVICE_FAULT);
    }
}
