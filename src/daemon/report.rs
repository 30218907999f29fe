//! The one route back from a device's worker to the batcher: what the
//! worker holds, and what became of it.
//!
//! A batch reaches a worker by one of two transports: the shared-memory
//! ring ([`super::fast_link`], written by the batcher) or the worker's
//! socket (through the device actor, [`super::device`]). Each transport only
//! unpacks its own wire: the ring reads the output out of its slot and
//! frees the slot, the socket takes the output frame. Everything after that
//! is here, written once for both: the [`Reporter`] of the device
//!
//! * registers each batch with the device's [`Watchdog`] before it is sent
//!   ([`Reporter::sent`]), and forgets one that never left
//!   ([`Reporter::unsent`]);
//! * takes each outcome ([`Reporter::report`]): the watchdog hears the worker
//!   and learns the batch's cost, the device's counters move (batches, by
//!   transport, graph replays or eager runs, batches and token slots in
//!   flight, busy time — time with at least one batch held —, last error), and the
//!   batcher shard that sent it gets one
//!   [`super::messages::BatcherMsg::Report`] ([`Batchers::report`]), except
//!   for a fatal failure: the worker exits next and its death re-dispatches
//!   the batch;
//! * says when the worker is gone ([`Reporter::worker_gone`]): nothing is in
//!   flight any more and the batcher re-dispatches what the device held.
//!
//! It forwards what it is told: the batcher alone decides whether a report
//! is current (its attempt and device guards), so a late report from a dead
//! worker or a re-dispatched attempt, over either transport, is ignored in
//! one place.

use super::batcher::shards::Batchers;
use super::messages::{Batch, BatchOutcome, BatchReport, DeviceId};
use super::metrics::Metrics;
use super::stats::DeviceStats;
use super::watchdog::Watchdog;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// What a worker holds after a change, and the busy time before it.
#[derive(Clone, Copy)]
struct Holding {
    batches: u64,
    tokens: u64,
    busy_us: u64,
}

impl Holding {
    fn apply(self, d: &mut DeviceStats) {
        d.inflight = self.batches;
        d.inflight_tokens = self.tokens;
        d.busy_us += self.busy_us;
    }
}

/// Which transport brought a report back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The shared-memory ring; `free_slots` are free now that its slot is back.
    Ring { free_slots: usize },
    /// The worker's socket.
    Socket,
}

/// See the module docs. One per device actor, shared with the ring's reader.
pub struct Reporter {
    device: DeviceId,
    batchers: Batchers,
    metrics: Arc<Metrics>,
    metrics_index: usize,
    watchdog: Mutex<Watchdog>,
}

impl Reporter {
    pub fn new(
        device: DeviceId,
        batchers: Batchers,
        metrics: Arc<Metrics>,
        metrics_index: usize,
        watchdog: Watchdog,
    ) -> Self {
        Reporter {
            device,
            batchers,
            metrics,
            metrics_index,
            watchdog: Mutex::new(watchdog),
        }
    }

    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The device's watchdog (the device actor asks it whether the worker hangs).
    pub fn watchdog(&self) -> MutexGuard<'_, Watchdog> {
        self.watchdog.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes what the worker holds through `change`, and returns
    /// (batches, token slots) held after it and the busy time since the
    /// last change (µs; 0 when it held nothing).
    fn hold(&self, change: impl FnOnce(&mut Watchdog)) -> Holding {
        let mut w = self.watchdog();
        let busy_us = w.take_busy_us(Instant::now());
        change(&mut w);
        Holding {
            batches: w.inflight() as u64,
            tokens: w.inflight_tokens() as u64,
            busy_us,
        }
    }

    fn set_holding(&self, h: Holding) {
        self.metrics
            .update_device(self.metrics_index, |d| h.apply(d));
    }

    /// `batch` (attempt `attempt`, `token_slots` computed tokens) is about to
    /// go to the worker. Called before the send: the answer may come back
    /// before the send returns.
    pub fn sent(&self, batch: &Batch, attempt: u32, token_slots: usize) {
        let h = self.hold(|w| w.sent(batch.id, attempt, batch.model, token_slots));
        self.set_holding(h);
    }

    /// A batch registered with [`Self::sent`] never reached the worker.
    pub fn unsent(&self, batch: &Batch, attempt: u32) {
        let h = self.hold(|w| w.forget(batch.id, attempt));
        self.set_holding(h);
    }

    /// What became of a batch the worker held, as `via` brought it back.
    /// Returns how many batches the worker still holds.
    pub fn report(&self, report: BatchReport, via: Via) -> usize {
        let compute_us = match &report.outcome {
            BatchOutcome::Done(output) => Some(output.compute_us),
            BatchOutcome::Failed(_) => None,
        };
        let h = self.hold(|w| w.finished(report.batch, report.attempt, compute_us, Instant::now()));
        let inflight = h.batches as usize;
        let fatal = matches!(&report.outcome, BatchOutcome::Failed(e) if e.is_fatal());
        self.metrics.update_device(self.metrics_index, |d| {
            h.apply(d);
            if let Via::Ring { free_slots } = via {
                d.shm_slots_free = free_slots as u64;
            }
            match &report.outcome {
                BatchOutcome::Done(output) => {
                    d.batches += 1;
                    match via {
                        Via::Ring { .. } => d.shm_batches += 1,
                        Via::Socket => d.socket_batches += 1,
                    }
                    if output.replayed {
                        d.graph_replays += 1;
                    } else {
                        d.eager_runs += 1;
                    }
                }
                BatchOutcome::Failed(e) if fatal => d.last_error = Some(e.to_string()),
                BatchOutcome::Failed(_) => {}
            }
        });
        if !fatal {
            self.batchers.report(self.device, report);
        }
        inflight
    }

    /// The worker is gone (it exited, or could not be started): it holds
    /// nothing now, and the batcher re-dispatches what the device held.
    pub fn worker_gone(&self, reason: String) {
        let h = self.hold(|w| w.reset(Instant::now()));
        self.set_holding(h);
        self.batchers.device_down(self.device, &reason);
    }
}
