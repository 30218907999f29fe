//! The hang watchdog of one device: decides when a worker that has gone
//! quiet is stuck. Pure (time is an argument), so its rules are tested below;
//! the device actor feeds it and kills the worker it condemns.
//!
//! Rules:
//! * The worker's backend thread says something at least every heartbeat
//!   interval while it can: a heartbeat when idle or between batches, a
//!   result when a batch finishes. A worker that is stopped (SIGSTOP), whose
//!   backend thread is blocked on a device that never finishes (a hung
//!   kernel), or that deadlocked says nothing.
//! * With nothing in flight, silence longer than `hang_timeout` is a hang.
//! * With batches in flight the worker may legitimately be busy for as long
//!   as they take: the allowance grows by [`SLACK`] times each in-flight
//!   batch's expected time, estimated from the microseconds per token slot
//!   its model took on this device lately (an exponential average of
//!   completed batches; a cold, generous guess until the first completes).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How many times its expected time a batch may take before the silence
/// around it counts as a hang.
pub const SLACK: f64 = 8.0;
/// Weight of the newest batch in the per-token average.
const EWMA: f64 = 0.2;

#[derive(Clone, Copy, Debug)]
struct InFlight {
    model: usize,
    token_slots: usize,
}

/// See the module docs.
#[derive(Debug)]
pub struct Watchdog {
    hang_timeout: Duration,
    cold_us_per_token: f64,
    last_heard: Instant,
    inflight: HashMap<(u64, u32), InFlight>,
    /// Since when busy time is counted ([`Watchdog::take_busy_us`]).
    busy_mark: Instant,
    us_per_token: HashMap<usize, f64>,
}

impl Watchdog {
    /// `cold_us_per_token`: the guess used for a model before any of its
    /// batches finished on this device.
    pub fn new(hang_timeout: Duration, cold_us_per_token: f64, now: Instant) -> Self {
        Self {
            hang_timeout,
            cold_us_per_token,
            last_heard: now,
            inflight: HashMap::new(),
            busy_mark: now,
            us_per_token: HashMap::new(),
        }
    }

    /// A new worker generation: nothing in flight, heard now. The learned
    /// per-token costs stay (same device, same models).
    pub fn reset(&mut self, now: Instant) {
        self.inflight.clear();
        self.last_heard = now;
    }

    /// The worker said something.
    pub fn heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    /// A batch of `token_slots` computed tokens was sent to the worker.
    pub fn sent(&mut self, batch: u64, attempt: u32, model: usize, token_slots: usize) {
        self.inflight.insert(
            (batch, attempt),
            InFlight {
                model,
                token_slots: token_slots.max(1),
            },
        );
    }

    /// A batch finished (or failed) after `compute_us` on the worker.
    pub fn finished(&mut self, batch: u64, attempt: u32, compute_us: Option<u64>, now: Instant) {
        self.last_heard = now;
        let Some(f) = self.inflight.remove(&(batch, attempt)) else {
            return;
        };
        if let Some(us) = compute_us {
            let sample = us as f64 / f.token_slots as f64;
            let avg = self.us_per_token.entry(f.model).or_insert(sample);
            *avg = (1.0 - EWMA) * *avg + EWMA * sample;
        }
    }

    /// A batch registered with [`Self::sent`] never reached the worker
    /// (the send failed): forget it without counting it as heard.
    pub fn forget(&mut self, batch: u64, attempt: u32) {
        self.inflight.remove(&(batch, attempt));
    }

    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// The time since the last call (or since the watchdog was made) during
    /// which the worker held at least one batch, in µs; the count restarts
    /// at `now`. Called before each change of what the worker holds, so the
    /// holding was constant over the interval.
    pub fn take_busy_us(&mut self, now: Instant) -> u64 {
        let busy = if self.inflight.is_empty() {
            0
        } else {
            now.saturating_duration_since(self.busy_mark).as_micros() as u64
        };
        self.busy_mark = now;
        busy
    }

    /// Token slots the worker computes for the batches it holds.
    pub fn inflight_tokens(&self) -> usize {
        self.inflight.values().map(|f| f.token_slots).sum()
    }

    /// How long the worker may stay silent from the last time it was heard.
    pub fn allowance(&self) -> Duration {
        let busy_us: f64 = self
            .inflight
            .values()
            .map(|f| {
                let per = self
                    .us_per_token
                    .get(&f.model)
                    .copied()
                    .unwrap_or(self.cold_us_per_token);
                SLACK * per * f.token_slots as f64
            })
            .sum();
        self.hang_timeout + Duration::from_micros(busy_us.min(1e12) as u64)
    }

    /// Why the worker counts as hung at `now`, if it does.
    pub fn hung(&self, now: Instant) -> Option<String> {
        let silent = now.saturating_duration_since(self.last_heard);
        let allowed = self.allowance();
        (silent > allowed).then(|| {
            format!(
                "worker hung: nothing heard for {} ms (allowed {} ms with {} batches in flight)",
                silent.as_millis(),
                allowed.as_millis(),
                self.inflight.len()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn silence_while_idle_is_a_hang_after_the_timeout() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 10.0, t0);
        assert!(w.hung(t0 + Duration::from_millis(1900)).is_none());
        w.heard(t0 + Duration::from_millis(1900));
        assert!(w.hung(t0 + Duration::from_millis(3800)).is_none());
        let why = w.hung(t0 + Duration::from_millis(4000)).unwrap();
        assert!(why.contains("nothing heard for 2100 ms"), "{why}");
    }

    #[test]
    fn batches_in_flight_extend_the_allowance_by_what_they_should_take() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(T, 100.0, t0);
        // Cold: 1,000 token slots at 100 µs each, times the slack.
        w.sent(1, 1, 0, 1000);
        assert_eq!(
            w.allowance(),
            T + Duration::from_micros((SLACK * 1e5) as u64)
        );
        // It took 10 ms (10 µs per slot): the estimate learns from it.
        w.finished(1, 1, Some(10_000), t0);
        w.sent(2, 1, 0, 1000);
        assert_eq!(
            w.allowance(),
            T + Duration::from_micros((SLACK * 1e4) as u64)
        );
        assert!(w.hung(t0 + T + Duration::from_millis(70)).is_none());
        assert!(w.hung(t0 + T + Duration::from_millis(90)).is_some());
        // Another model keeps its own estimate.
        w.sent(3, 1, 1, 10);
        assert_eq!(
            w.allowance(),
            T + Duration::from_micros((SLACK * (1e4 + 1e3)) as u64)
        );
        // A stale report of an unknown attempt changes nothing but liveness.
        w.finished(2, 7, Some(1), t0);
        assert_eq!(w.inflight(), 2);
        w.forget(3, 1);
        assert_eq!(w.inflight(), 1);
        w.reset(t0);
        assert_eq!(w.inflight(), 0);
    }
}
