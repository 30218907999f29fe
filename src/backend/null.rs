//! The null backend: computes nothing. It exists to measure the host path —
//! frontend, tokenizer, batcher, worker link, worker — at rates no real
//! device here could reach (`devices.backend = "null"`, for benchmarks only;
//! replies carry all-zero outputs of the right shape).
//!
//! Each batch "runs" for `us_per_batch + us_per_token × real tokens`
//! microseconds (0 by default): set them to what a GPU takes to model its
//! throughput, so that several null devices stand in for several GPUs.
//! Graphs are captured as for any backend (the cache, the bucket checks and
//! the pipelining of the executor are the real ones); a capture costs nothing.

use super::{Backend, BackendError, DeviceInfo};
use crate::model::{BatchRows, Model, Program};
use std::time::{Duration, Instant};

/// See the module docs.
pub struct NullBackend {
    ordinal: usize,
    us_per_batch: f64,
    us_per_token: f64,
    /// When the batch launched last will be done (batches run one after the other).
    busy_until: Instant,
    hung: bool,
    fault: Option<String>,
}

pub struct NullGraph {
    output_dim: usize,
}

pub struct NullPending {
    values: usize,
    ready_at: Instant,
}

impl NullBackend {
    pub fn new(ordinal: usize, us_per_batch: f64, us_per_token: f64) -> Self {
        NullBackend {
            ordinal,
            us_per_batch: us_per_batch.max(0.0),
            us_per_token: us_per_token.max(0.0),
            busy_until: Instant::now(),
            hung: false,
            fault: None,
        }
    }

    fn check(&self) -> Result<(), BackendError> {
        if self.hung {
            loop {
                std::thread::park();
            }
        }
        match &self.fault {
            Some(why) => Err(BackendError::DeviceFault(why.clone())),
            None => Ok(()),
        }
    }

    fn schedule(&mut self, rows: &BatchRows) -> Instant {
        let us = self.us_per_batch + self.us_per_token * rows.tokens() as f64;
        let start = self.busy_until.max(Instant::now());
        self.busy_until = start + Duration::from_nanos((us * 1000.0) as u64);
        self.busy_until
    }
}

/// Waits until `t`: sleeps while far from it, then spins (sleep alone
/// overshoots by tens of microseconds).
fn wait_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        let left = t - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

impl Backend for NullBackend {
    type Weights = ();
    type Graph = NullGraph;
    type Pending = NullPending;

    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "null".into(),
            name: format!(
                "null (computes nothing; {} µs/batch + {} µs/token)",
                self.us_per_batch, self.us_per_token
            ),
            ordinal: self.ordinal,
            ..DeviceInfo::default()
        }
    }

    fn upload(&mut self, _model: &Model) -> Result<(), BackendError> {
        self.check()
    }

    fn capture(
        &mut self,
        model: &Model,
        _weights: &(),
        _program: &Program,
    ) -> Result<NullGraph, BackendError> {
        self.check()?;
        Ok(NullGraph {
            output_dim: model.info.output_dim,
        })
    }

    fn graph_memory_bytes(&self, _graph: &NullGraph) -> u64 {
        0
    }

    fn launch(
        &mut self,
        graph: &mut NullGraph,
        rows: &BatchRows,
    ) -> Result<NullPending, BackendError> {
        self.check()?;
        Ok(NullPending {
            values: rows.rows() * graph.output_dim,
            ready_at: self.schedule(rows),
        })
    }

    fn collect(&mut self, pending: NullPending) -> Result<Vec<f32>, BackendError> {
        self.check()?;
        wait_until(pending.ready_at);
        Ok(vec![0.0; pending.values])
    }

    fn run_eager(
        &mut self,
        model: &Model,
        _weights: &(),
        _program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        self.check()?;
        wait_until(self.schedule(rows));
        Ok(vec![0.0; rows.rows() * model.info.output_dim])
    }

    fn inject_hang(&mut self) -> Result<(), BackendError> {
        self.hung = true;
        Ok(())
    }

    fn inject_fault(&mut self) -> Result<(), BackendError> {
        self.fault = Some(format!("injected fault on null device {}", self.ordinal));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_take_their_modelled_time_one_after_the_other() {
        let mut b = NullBackend::new(0, 300.0, 0.0);
        let mut g = NullGraph { output_dim: 4 };
        let rows = BatchRows::Tokens(vec![vec![101, 102], vec![101, 7, 102]]);
        let t0 = Instant::now();
        let p1 = b.launch(&mut g, &rows).unwrap();
        let p2 = b.launch(&mut g, &rows).unwrap();
        assert_eq!(b.collect(p1).unwrap(), vec![0.0; 8]);
        assert_eq!(b.collect(p2).unwrap().len(), 8);
        assert!(t0.elapsed() >= Duration::from_micros(600));
        b.inject_fault().unwrap();
        assert!(matches!(
            b.launch(&mut g, &rows),
            Err(BackendError::DeviceFault(_))
        ));
    }
}
