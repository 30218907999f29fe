//! The daemon's end of a worker's shared-memory link ([`crate::worker::shm`]):
//! the batcher writes a batch straight into a free ring slot and rings the
//! worker ([`FastLink::send`], no actor and no socket driver in between), and
//! one task per worker generation ([`serve`]) reads the answers off the
//! doorbell, copies each output out of its slot, frees the slot and hands the
//! outcome to the device's [`Reporter`], the route back that the socket's
//! answers take too.
//!
//! The device actor still owns the worker: it creates the ring and the
//! doorbell before starting the process, makes the link once the worker is
//! ready and opens it on the device's [`super::route::DeviceRoute`], and
//! closes and drops it (with its slots) when the worker exits; the batcher
//! then re-dispatches what the worker held, exactly as on the socket path
//! (its attempt and device guards ignore any late answer). A batch that does
//! not fit a slot, or finds none free, takes the socket through the device
//! actor instead.

use super::messages::{Batch, BatchOutcome, BatchOutput, BatchReport};
use super::metrics::Metrics;
use super::report::{Reporter, Via};
use crate::worker::link::{FromWorker, ToWorker, WorkerError};
use crate::worker::shm::{self, Ring};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Which batch holds each slot; the free ones.
struct Slots {
    free: Vec<u32>,
    held: Vec<Option<(u64, u32)>>,
}

/// See the module docs.
pub struct FastLink {
    ring: Ring,
    slots: Mutex<Slots>,
    doorbell: AsyncFd<OwnedFd>,
    reporter: Arc<Reporter>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FastLink {
    /// The link over `ring` and the daemon's end of the doorbell (made
    /// non-blocking here). Must run inside the tokio runtime.
    pub fn new(
        ring: Ring,
        doorbell: OwnedFd,
        reporter: Arc<Reporter>,
    ) -> std::io::Result<Arc<FastLink>> {
        let fd = doorbell.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL on a socket we own.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        let n = ring.spec().slots;
        Ok(Arc::new(FastLink {
            ring,
            slots: Mutex::new(Slots {
                free: (0..n).rev().collect(),
                held: vec![None; n as usize],
            }),
            // SAFETY: the AsyncFd owns the socket, so the fd is deregistered
            // before it is closed.
            doorbell: unsafe { AsyncFd::register_with_interest(doorbell, Interest::READABLE) }?,
            reporter,
        }))
    }

    pub fn slots(&self) -> usize {
        self.ring.spec().slots as usize
    }

    /// Puts `batch` in a free slot and rings the worker. False when it does
    /// not fit a slot, no slot is free, or the doorbell refuses it (the
    /// worker is gone): the caller sends it over the socket instead.
    pub fn send(&self, batch: &Batch, attempt: u32) -> bool {
        let Some(slot) = lock(&self.slots).free.pop() else {
            return false;
        };
        let give_back = |why: &str| {
            let mut s = lock(&self.slots);
            s.held[slot as usize] = None;
            s.free.push(slot);
            tracing::debug!(
                device = self.reporter.device(),
                batch = batch.id,
                "not through the ring: {why}"
            );
            false
        };
        let Some(rows) = self
            .ring
            .write_rows(slot, batch.parts.iter().map(|p| p.rows.as_ref()))
        else {
            return give_back("larger than a slot");
        };
        let msg = ToWorker::RunShm {
            batch: batch.id,
            attempt,
            model: batch.model,
            bucket: batch.bucket,
            slot,
            rows,
        };
        let bytes = rmp_serde::to_vec_named(&msg).expect("link messages serialise");
        let token_slots = batch.bucket.map_or(batch.tokens, |b| b.tokens());
        lock(&self.slots).held[slot as usize] = Some((batch.id, attempt));
        self.reporter.sent(batch, attempt, token_slots);
        match shm::ring_send(self.doorbell.get_ref().as_raw_fd(), &bytes, true) {
            Ok(()) => true,
            Err(e) => {
                self.reporter.unsent(batch, attempt);
                give_back(&e.to_string())
            }
        }
    }

    /// Takes back `slot` from batch (`batch`, `attempt`): the slots then
    /// free, or `None` when the slot was not that batch's (a worker bug:
    /// nothing is freed).
    fn take_back(&self, slot: u32, batch: u64, attempt: u32) -> Option<usize> {
        let mut s = lock(&self.slots);
        match s.held.get(slot as usize) {
            Some(Some(held)) if *held == (batch, attempt) => {
                s.held[slot as usize] = None;
                s.free.push(slot);
                Some(s.free.len())
            }
            _ => None,
        }
    }

    /// One answer from the doorbell: its outcome goes to the reporter once
    /// the output is out of its slot and the slot is free again.
    fn handle(&self, bytes: &[u8]) {
        let device = self.reporter.device();
        let msg: FromWorker = match rmp_serde::from_slice(bytes) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(device, "bad doorbell message: {e}");
                return;
            }
        };
        let (batch, attempt, slot, outcome) = match msg {
            FromWorker::Done {
                batch,
                attempt,
                rows,
                output_dim,
                compute_us,
                replayed,
                slot: Some(slot),
                started_ns,
                finished_ns,
            } => {
                // Read the output before the slot can be reused.
                let outcome = match self.ring.read_output(slot, rows * output_dim) {
                    Ok(data) => BatchOutcome::Done(BatchOutput {
                        data,
                        output_dim,
                        compute_us,
                        started_ns,
                        finished_ns,
                        replayed,
                    }),
                    Err(e) => BatchOutcome::Failed(WorkerError::Other(e)),
                };
                (batch, attempt, slot, outcome)
            }
            FromWorker::Failed {
                batch,
                attempt,
                error,
                slot: Some(slot),
            } => (batch, attempt, slot, BatchOutcome::Failed(error)),
            other => {
                tracing::error!(device, "unexpected doorbell message: {other:?}");
                return;
            }
        };
        let Some(free_slots) = self.take_back(slot, batch, attempt) else {
            tracing::error!(
                device,
                slot,
                batch,
                "the worker answered for a slot it did not hold"
            );
            return;
        };
        let report = BatchReport {
            batch,
            attempt,
            outcome,
        };
        self.reporter.report(report, Via::Ring { free_slots });
    }
}

/// Reads the worker's answers until its end of the doorbell closes (it
/// exited) or the task is aborted (the device actor saw it exit).
pub async fn serve(link: Arc<FastLink>, metrics: Arc<Metrics>) {
    let mut buf = vec![0u8; shm::MAX_DOORBELL_MESSAGE];
    loop {
        let Ok(mut ready) = link.doorbell.readable().await else {
            return;
        };
        let began = crate::clock::mono_ns();
        loop {
            match shm::ring_recv(link.doorbell.get_ref().as_raw_fd(), &mut buf) {
                Ok(Some(n)) => link.handle(&buf[..n]),
                Ok(None) => {
                    ready.clear_ready();
                    break;
                }
                Err(_) => return,
            }
        }
        metrics.stages.ring_reader.add_since(began);
    }
}
