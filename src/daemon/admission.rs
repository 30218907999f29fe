//! Admission: whether a decoded request is taken at all, decided at once,
//! before it waits for anything (tokenization included).
//!
//! Two bounds, both held by a [`Ticket`] from admission until the request's
//! reply has been handed to the socket:
//!
//! * per model, the requests admitted and not yet answered
//!   (`batching.max_queue`): a flood on one model fills only its own gate,
//!   so another model's requests are still admitted;
//! * for the whole daemon, the bytes those requests hold or will hold —
//!   their payload, their token ids, their outputs (`server.max_buffered_bytes`):
//!   overload answers `overloaded` instead of growing the process.
//!
//! Both are lock-free counters; admitting or refusing takes well under a
//! microsecond.
//!
//! The same count, over every model, says whether the daemon is lightly
//! loaded: at most [`LIGHT_LOAD_REQUESTS`] requests in it. Only then do the
//! daemon's libzmq I/O threads spin after each event (`server.io_spin_us`,
//! [`crate::transport::set_io_spin`]): a lone request and its reply then
//! pass them without a thread's wake-up, while under load, where a spinning
//! thread would take a core from the work, they sleep as libzmq's do.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Requests in the daemon up to which its load is light (see the module
/// docs).
pub const LIGHT_LOAD_REQUESTS: usize = 4;

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The model already has `limit` requests admitted and unanswered.
    ModelFull { limit: usize },
    /// Admitting it would hold more than `budget` bytes in all.
    MemoryFull { budget: usize, needed: usize },
}

struct Gate {
    admitted: AtomicUsize,
    /// `batching.max_queue`; a reload may change it.
    limit: AtomicUsize,
}

/// The daemon's admission counters.
pub struct Admission {
    gates: Vec<Gate>,
    bytes: AtomicUsize,
    budget: usize,
    refused: AtomicU64,
    /// Requests admitted and unanswered over every model.
    total: AtomicUsize,
    /// The I/O threads' spin at light load (zero: never spin).
    light_spin: Duration,
    /// The spin last set, µs.
    spin_now_us: AtomicU64,
}

impl Admission {
    /// One gate of `per_model_limit` per model; `budget` bytes in all; the
    /// libzmq I/O threads spin `light_spin` while the load is light (see the
    /// module docs), which is now.
    pub fn new(
        models: usize,
        per_model_limit: usize,
        budget: usize,
        light_spin: Duration,
    ) -> Arc<Admission> {
        let a = Arc::new(Admission {
            gates: (0..models)
                .map(|_| Gate {
                    admitted: AtomicUsize::new(0),
                    limit: AtomicUsize::new(per_model_limit),
                })
                .collect(),
            bytes: AtomicUsize::new(0),
            budget,
            refused: AtomicU64::new(0),
            total: AtomicUsize::new(0),
            light_spin,
            spin_now_us: AtomicU64::new(0),
        });
        a.update_spin();
        a
    }

    /// Sets the I/O threads' spin for the load now. Called where the count
    /// crosses [`LIGHT_LOAD_REQUESTS`]; two racing crossings could store in
    /// the wrong order, so it stores until the count it acted on still
    /// holds.
    fn update_spin(&self) {
        if self.light_spin.is_zero() {
            return;
        }
        loop {
            let light = self.total.load(Ordering::Acquire) <= LIGHT_LOAD_REQUESTS;
            let spin = if light {
                self.light_spin
            } else {
                Duration::ZERO
            };
            crate::transport::set_io_spin(spin);
            self.spin_now_us
                .store(spin.as_micros() as u64, Ordering::Release);
            if (self.total.load(Ordering::Acquire) <= LIGHT_LOAD_REQUESTS) == light {
                return;
            }
        }
    }

    /// The I/O threads' spin this admission set last (zero: none).
    pub fn io_spin(&self) -> Duration {
        Duration::from_micros(self.spin_now_us.load(Ordering::Acquire))
    }

    /// Admits a request to `model` that will hold about `bytes`, or says why not.
    pub fn admit(self: &Arc<Self>, model: usize, bytes: usize) -> Result<Ticket, Refusal> {
        let gate = &self.gates[model];
        let limit = gate.limit.load(Ordering::Relaxed);
        if gate.admitted.fetch_add(1, Ordering::AcqRel) >= limit {
            gate.admitted.fetch_sub(1, Ordering::AcqRel);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::ModelFull { limit });
        }
        let before = self.bytes.fetch_add(bytes, Ordering::AcqRel);
        // A request larger than the whole budget is still admitted when
        // nothing else is held, so a configured budget never makes a valid
        // request impossible.
        if before > 0 && before + bytes > self.budget {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
            gate.admitted.fetch_sub(1, Ordering::AcqRel);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::MemoryFull {
                budget: self.budget,
                needed: bytes,
            });
        }
        if self.total.fetch_add(1, Ordering::AcqRel) == LIGHT_LOAD_REQUESTS {
            self.update_spin();
        }
        Ok(Ticket {
            admission: self.clone(),
            model,
            bytes,
        })
    }

    /// A reload changed `batching.max_queue`: every model's gate takes it
    /// (requests already admitted above a lowered limit are kept).
    pub fn set_limit(&self, per_model_limit: usize) {
        for gate in &self.gates {
            gate.limit.store(per_model_limit, Ordering::Relaxed);
        }
    }

    /// Bytes held by admitted requests now.
    pub fn held_bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Requests admitted and unanswered for `model` now.
    pub fn admitted(&self, model: usize) -> usize {
        self.gates[model].admitted.load(Ordering::Acquire)
    }

    /// Requests refused since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// An admitted request's share of the bounds, given back on drop.
pub struct Ticket {
    admission: Arc<Admission>,
    model: usize,
    bytes: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
        self.admission.gates[self.model]
            .admitted
            .fetch_sub(1, Ordering::AcqRel);
        if self.admission.total.fetch_sub(1, Ordering::AcqRel) == LIGHT_LOAD_REQUESTS + 1 {
            self.admission.update_spin();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gates_are_per_model_and_tickets_give_back() {
        let a = Admission::new(2, 2, 1000, Duration::ZERO);
        let t1 = a.admit(0, 10).unwrap();
        let _t2 = a.admit(0, 10).unwrap();
        assert_eq!(a.admit(0, 10).err(), Some(Refusal::ModelFull { limit: 2 }));
        // Model 1 is unaffected by model 0's full gate.
        let t3 = a.admit(1, 10).unwrap();
        assert_eq!((a.admitted(0), a.held_bytes()), (2, 30));
        drop(t1);
        assert!(a.admit(0, 10).is_ok());
        drop(t3);
        assert_eq!(a.refused(), 1);
    }

    #[test]
    fn the_byte_budget_bounds_everything_held() {
        let a = Admission::new(1, 100, 100, Duration::ZERO);
        let big = a.admit(0, 150).unwrap(); // alone: admitted
        assert_eq!(
            a.admit(0, 1).err(),
            Some(Refusal::MemoryFull {
                budget: 100,
                needed: 1
            })
        );
        drop(big);
        let _a = a.admit(0, 60).unwrap();
        assert!(a.admit(0, 50).is_err());
        let _b = a.admit(0, 40).unwrap();
        assert_eq!(a.held_bytes(), 100);
    }

    #[test]
    fn the_io_threads_spin_only_while_the_load_is_light() {
        let spin = Duration::from_micros(250);
        let a = Admission::new(2, 100, 1 << 20, spin);
        assert_eq!(a.io_spin(), spin, "idle is light");
        let mut tickets: Vec<Ticket> = (0..LIGHT_LOAD_REQUESTS)
            .map(|i| a.admit(i % 2, 10).unwrap())
            .collect();
        assert_eq!(
            a.io_spin(),
            spin,
            "{LIGHT_LOAD_REQUESTS} requests are light"
        );
        tickets.push(a.admit(0, 10).unwrap());
        assert_eq!(a.io_spin(), Duration::ZERO, "one more is not");
        tickets.push(a.admit(1, 10).unwrap());
        tickets.pop();
        assert_eq!(a.io_spin(), Duration::ZERO);
        tickets.pop();
        assert_eq!(a.io_spin(), spin, "back to light when answered");
        // A refused request changes nothing.
        let b = Admission::new(1, LIGHT_LOAD_REQUESTS, 1 << 20, spin);
        let _held: Vec<Ticket> = (0..LIGHT_LOAD_REQUESTS)
            .map(|_| b.admit(0, 1).unwrap())
            .collect();
        assert!(b.admit(0, 1).is_err());
        assert_eq!(b.io_spin(), spin);
        // Zero never spins.
        let c = Admission::new(1, 100, 100, Duration::ZERO);
        let _t: Vec<Ticket> = (0..8).map(|_| c.admit(0, 1).unwrap()).collect();
        assert_eq!(c.io_spin(), Duration::ZERO);
        // The setting is the process's: leave it as the other tests expect.
        crate::transport::set_io_spin(Duration::ZERO);
    }
}
