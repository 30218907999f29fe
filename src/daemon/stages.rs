//! Where the host path's serial stages spend their time, counted without a
//! lock so that counting does not become one more thing to wait for.
//!
//! * A [`StageClock`] adds up the time a single task spends working (not
//!   waiting) — the frontend's socket loop, the batcher actor, the tasks that
//!   read the workers' rings. Over a window, busy time / wall time is the
//!   share of one core the stage keeps: near 1.0, that stage is what limits
//!   the daemon, however many cores are idle.
//! * A [`Delay`] adds up how long messages wait between two stages (in a
//!   channel, a mailbox, a run queue), so a queue in front of a stage shows
//!   before the stage itself is saturated.
//!
//! The stats' `stages` object ([`super::stats::StageTotals`]) carries the running totals; `replayd-loadgen
//! --control` turns the difference over a run into shares and mean waits.
//! The client socket's own driver is counted by the transport
//! (`transport.client.busy_us`).

use super::stats::{Busy, StageBusy, StageDelays, StageTotals, Waits};
use crate::clock::mono_ns;
use std::sync::atomic::{AtomicU64, Ordering};

/// Nanoseconds and a count, added to without a lock.
#[derive(Debug, Default)]
struct Tally {
    ns: AtomicU64,
    count: AtomicU64,
}

impl Tally {
    fn add_since(&self, since: u64) {
        self.ns
            .fetch_add(mono_ns().saturating_sub(since), Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// (µs, count).
    fn read(&self) -> (u64, u64) {
        (
            self.ns.load(Ordering::Relaxed) / 1000,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// Busy time of one serial task.
#[derive(Debug, Default)]
pub struct StageClock(Tally);

impl StageClock {
    /// One turn of work that began at `since` ([`mono_ns`]) ends now.
    pub fn add_since(&self, since: u64) {
        self.0.add_since(since);
    }

    fn report(&self) -> Busy {
        let (busy_us, turns) = self.0.read();
        Busy { busy_us, turns }
    }
}

/// Time messages wait between two stages.
#[derive(Debug, Default)]
pub struct Delay(Tally);

impl Delay {
    /// A message that was handed over at `since` ([`mono_ns`]; 0: unknown,
    /// not counted) is taken now.
    pub fn add_since(&self, since: u64) {
        if since != 0 {
            self.0.add_since(since);
        }
    }

    fn report(&self) -> Waits {
        let (sum_us, count) = self.0.read();
        Waits { sum_us, count }
    }
}

/// The daemon's stage clocks and delays (see the module docs).
#[derive(Debug, Default)]
pub struct Stages {
    /// The frontend's loop: takes each message from the client socket and
    /// starts its handler task.
    pub frontend_loop: StageClock,
    /// The batcher actor, every message.
    pub batcher: StageClock,
    /// The tasks that read answers off the workers' shared-memory rings.
    pub ring_reader: StageClock,
    /// Client socket driver → frontend loop (the socket's inbox).
    pub socket_to_frontend: Delay,
    /// Frontend loop → the request's handler task running (the runtime's run queues).
    pub spawn_to_handler: Delay,
    /// Handler → batcher actor (its mailbox), for submissions.
    pub batcher_mailbox: Delay,
}

impl Stages {
    /// The running totals, for the stats.
    pub fn report(&self) -> StageTotals {
        StageTotals {
            busy: StageBusy {
                frontend_loop: self.frontend_loop.report(),
                batcher: self.batcher.report(),
                ring_reader: self.ring_reader.report(),
            },
            delays: StageDelays {
                socket_to_frontend: self.socket_to_frontend.report(),
                spawn_to_handler: self.spawn_to_handler.report(),
                batcher_mailbox: self.batcher_mailbox.report(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_and_delays_add_up_what_they_are_given() {
        let s = Stages::default();
        let t = mono_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        s.batcher.add_since(t);
        s.batcher_mailbox.add_since(t);
        s.batcher_mailbox.add_since(0); // unknown: not counted
        let r = s.report();
        assert!(r.busy.batcher.busy_us >= 2000);
        assert_eq!(r.busy.batcher.turns, 1);
        assert_eq!(r.busy.frontend_loop.turns, 0);
        assert_eq!(r.delays.batcher_mailbox.count, 1);
        assert!(r.delays.batcher_mailbox.sum_us >= 2000);
    }
}
