//! The null backend: computes nothing. It exists to measure the host path —
//! frontend, tokenizer, batcher, worker link, worker — at rates no real
//! device here could reach (`devices.backend = "null"`, for benchmarks only;
//! replies carry all-zero outputs of the right shape).
//!
//! # Simulated devices
//!
//! Each batch "runs" for a modelled time, so that N null devices stand in
//! for N GPUs (`cpu_devices` sets N):
//!
//! * With a time table (`devices.null_timings`, [`Timings`]), a batch in a
//!   bucket of the table takes that bucket's time. A bucket missing from it
//!   takes the time of the smallest bucket of the table that holds it (a
//!   padded bucket at least as wide and as long, a packed budget at least as
//!   large); where none holds it, the time of the table's bucket nearest
//!   below it in token slots (batch × seq, or the budget; else the
//!   smallest), scaled linearly by token slots. A model without entries of
//!   its bucket kind (padded or packed), and every eager batch (no bucket),
//!   take the formula below.
//! * Otherwise `us_per_batch + us_per_token × real tokens` microseconds
//!   (`devices.null_us_per_batch`, `null_us_per_token`; 0 by default).
//!
//! The time is spent off the CPU: a device's batches run one after the
//! other (each starts when the one before it is done, or when launched if
//! later), and collecting one sleeps until it is done — a timer, never a
//! spin, so 4 simulated devices on 2 cores measure the host path alone.
//! Graphs are captured as for any backend (the cache, the bucket checks and
//! the pipelining of the executor are the real ones); a capture costs
//! nothing.
//!
//! # The time table
//!
//! A JSON file in either of two forms:
//!
//! * what `replayd backend-check --out FILE` writes on a real device: for
//!   each model (`name`, `dtype`) and bucket, the median launch → collect
//!   time of a full batch (`latency.median_us`; the `--compare-off` runs
//!   and buckets that failed are skipped);
//! * written by hand, `{"buckets": [{"model": "minilm", "bucket": "32x128",
//!   "us": 812.0}, {"bucket": "1024t", "us": 450.0}]}`: `bucket` is
//!   `BATCHxSEQ` (an MLP's is `BATCHx1`) or a packed budget `TOKENSt`;
//!   `model` (optional: every model) and `dtype` (optional) as in the
//!   config.
//!
//! A model's entries are those naming it, else those naming no model; of
//! several dtypes, those of the model's own, else of the first listed. The
//! file is read when the config is validated (an unreadable or malformed
//! one stops start-up, naming the file and what is wrong) and again by
//! each null worker as it starts.

use super::{Backend, BackendError, DeviceInfo};
use crate::config::DevicesConfig;
use crate::model::{BatchRows, Model, Program};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use super::null_timings::{Entry, Shape, Timings, MAX_US};

/// See the module docs.
pub struct NullBackend {
    ordinal: usize,
    us_per_batch: f64,
    us_per_token: f64,
    timings: Option<(PathBuf, Timings)>,
    /// When the batch launched last will be done (batches run one after the other).
    busy_until: Instant,
    hung: bool,
    fault: Option<String>,
}

pub struct NullGraph {
    output_dim: usize,
    /// The batch time the table gives this graph's bucket (`None`: the
    /// per-batch and per-token formula).
    us: Option<f64>,
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
            timings: None,
            busy_until: Instant::now(),
            hung: false,
            fault: None,
        }
    }

    /// A null device as `[devices]` configures it, its time table read.
    pub fn from_config(ordinal: usize, devices: &DevicesConfig) -> Result<Self, String> {
        let mut backend = NullBackend::new(
            ordinal,
            devices.null_us_per_batch,
            devices.null_us_per_token,
        );
        if let Some(path) = &devices.null_timings {
            let table = Timings::load(path).map_err(|e| format!("devices.null_timings: {e}"))?;
            backend = backend.with_timings(path.clone(), table);
        }
        Ok(backend)
    }

    /// Batches in the table's buckets take the table's times (`path`: where
    /// it came from, for [`Backend::info`]).
    pub fn with_timings(mut self, path: PathBuf, timings: Timings) -> Self {
        self.timings = Some((path, timings));
        self
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

    /// Books the device for `us` (the formula's when `None`) after what it
    /// holds; returns when the batch will be done.
    fn schedule(&mut self, us: Option<f64>, rows: &BatchRows) -> Instant {
        let us = us.unwrap_or_else(|| self.us_per_batch + self.us_per_token * rows.tokens() as f64);
        let start = self.busy_until.max(Instant::now());
        self.busy_until = start + Duration::from_nanos((us * 1000.0) as u64);
        self.busy_until
    }
}

/// Sleeps until `t` (off the CPU: a timer, never a spin; the wake-up may
/// come tens of µs late, which delays this batch's answer but not the
/// device's schedule).
fn wait_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        std::thread::sleep(t - now);
    }
}

impl Backend for NullBackend {
    type Weights = ();
    type Graph = NullGraph;
    type Pending = NullPending;

    fn info(&self) -> DeviceInfo {
        let timing = match &self.timings {
            Some((path, t)) => format!(
                "{} bucket times from {}, else {} µs/batch + {} µs/token",
                t.entries.len(),
                path.display(),
                self.us_per_batch,
                self.us_per_token
            ),
            None => format!(
                "{} µs/batch + {} µs/token",
                self.us_per_batch, self.us_per_token
            ),
        };
        DeviceInfo {
            backend: "null".into(),
            name: format!("null (computes nothing; {timing})"),
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
        program: &Program,
    ) -> Result<NullGraph, BackendError> {
        self.check()?;
        let us = self.timings.as_ref().and_then(|(_, t)| {
            t.lookup(
                &model.info.name,
                model.info.dtype.as_str(),
                Shape::of(program),
            )
        });
        Ok(NullGraph {
            output_dim: model.info.output_dim,
            us,
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
            ready_at: self.schedule(graph.us, rows),
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
        wait_until(self.schedule(None, rows));
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

    fn graph(us: Option<f64>) -> NullGraph {
        NullGraph { output_dim: 4, us }
    }

    /// CPU time this thread has used.
    fn thread_cpu() -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid timespec to fill.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }

    #[test]
    fn batches_take_their_modelled_time_one_after_the_other() {
        let mut b = NullBackend::new(0, 300.0, 0.0);
        let mut g = graph(None);
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

    /// A graph's table time replaces the formula, and waiting for it
    /// sleeps: two 30 ms batches cost the thread next to no CPU time.
    #[test]
    fn a_graphs_table_time_is_slept_not_spun() {
        let mut b = NullBackend::new(0, 1e6, 1e6);
        let mut g = graph(Some(30_000.0));
        let rows = BatchRows::Tokens(vec![vec![101, 102]]);
        let (t0, cpu0) = (Instant::now(), thread_cpu());
        let p1 = b.launch(&mut g, &rows).unwrap();
        let p2 = b.launch(&mut g, &rows).unwrap();
        b.collect(p1).unwrap();
        b.collect(p2).unwrap();
        let (wall, cpu) = (t0.elapsed(), thread_cpu() - cpu0);
        assert!(wall >= Duration::from_millis(60), "{wall:?}");
        assert!(wall < Duration::from_millis(1000), "{wall:?}");
        assert!(
            cpu < Duration::from_millis(10),
            "{cpu:?} of CPU for {wall:?}"
        );
    }

    #[test]
    fn shapes_parse_and_print() {
        for s in ["32x128", "8x1", "1024t"] {
            assert_eq!(Shape::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(
            Shape::parse("32x128"),
            Some(Shape::Padded {
                batch: 32,
                seq: 128
            })
        );
        for bad in [
            "", "32", "x128", "32x", "0x4", "4x0", "t", "0t", "-1t", "32y128", "3.5x2",
        ] {
            assert_eq!(Shape::parse(bad), None, "{bad}");
        }
    }

    const SIMPLE: &str = r#"{"buckets": [
        {"model": "minilm", "bucket": "8x16", "us": 100.0},
        {"model": "minilm", "bucket": "32x128", "us": 812.0},
        {"model": "minilm", "bucket": "32x16", "us": 200},
        {"model": "minilm", "bucket": "1024t", "us": 450.0},
        {"bucket": "4x1", "us": 50.0}
    ]}"#;

    fn padded(batch: usize, seq: usize) -> Shape {
        Shape::Padded { batch, seq }
    }

    #[test]
    fn the_hand_written_form_parses_and_looks_up() {
        let t = Timings::parse(SIMPLE).unwrap();
        assert_eq!(t.entries.len(), 5);
        assert_eq!(t.entries[2].us, 200.0);
        let at = |s: Shape| t.lookup("minilm", "f32", s);
        // In the table.
        assert_eq!(at(padded(32, 128)), Some(812.0));
        assert_eq!(at(padded(8, 16)), Some(100.0));
        assert_eq!(at(Shape::Packed { tokens: 1024 }), Some(450.0));
        // Not in it: the smallest bucket that holds it.
        assert_eq!(at(padded(4, 16)), Some(100.0));
        assert_eq!(at(padded(16, 16)), Some(200.0));
        assert_eq!(at(padded(16, 64)), Some(812.0));
        assert_eq!(at(Shape::Packed { tokens: 512 }), Some(450.0));
        // Larger than all: the largest scaled by token slots.
        assert_eq!(at(padded(64, 128)), Some(1624.0));
        assert_eq!(at(padded(64, 16)), Some(400.0));
        assert_eq!(at(Shape::Packed { tokens: 2048 }), Some(900.0));
        // Another model: the entries naming none.
        assert_eq!(t.lookup("mlp", "f32", padded(4, 1)), Some(50.0));
        assert_eq!(t.lookup("mlp", "f32", padded(2, 1)), Some(50.0));
        assert_eq!(t.lookup("mlp", "f32", padded(8, 1)), Some(100.0));
        // No entry of the kind: the formula.
        assert_eq!(t.lookup("mlp", "f32", Shape::Packed { tokens: 64 }), None);
        assert_eq!(
            Timings::default().lookup("minilm", "f32", padded(1, 1)),
            None
        );
    }

    /// Trimmed from what `replayd backend-check --out` wrote on an H200.
    const CHECK: &str = r#"{
      "device": {"backend": "cuda", "name": "NVIDIA H200", "ordinal": 0},
      "kernels": "embedded", "init_ms": 210.5, "workspace_bytes": 0, "cpu_threads": 16,
      "models": [
        {"name": "all-MiniLM-L6-v2", "kind": "bert", "dtype": "f16", "allow_tf32": false,
         "weights_bytes": 45000000, "upload_ms": 20.1,
         "buckets": [
           {"bucket": "1x16", "batch": 1, "seq": 16, "tokens": null, "served": true,
            "latency": {"iters": 200, "min_us": 80.0, "median_us": 91.5, "p90_us": 95.0,
                        "p99_us": 120.0, "max_us": 300.0},
            "throughput_rows_per_s": 10000.0, "error": null},
           {"bucket": "1x16", "batch": 1, "seq": 16, "tokens": null, "served": false,
            "latency": {"iters": 200, "min_us": 80.0, "median_us": 140.0, "p90_us": 150.0,
                        "p99_us": 160.0, "max_us": 300.0},
            "error": null},
           {"bucket": "128x256", "batch": 128, "seq": 256, "tokens": null, "served": true,
            "latency": {"iters": 0, "min_us": 0.0, "median_us": 0.0, "p90_us": 0.0,
                        "p99_us": 0.0, "max_us": 0.0},
            "error": "out of device memory"},
           {"bucket": "2048t", "batch": 64, "seq": 256, "tokens": 2048, "served": true,
            "latency": {"iters": 200, "min_us": 600.0, "median_us": 640.25, "p90_us": 650.0,
                        "p99_us": 700.0, "max_us": 900.0},
            "error": null}
         ],
         "eager": {"batch": 3, "seq": 300, "gpu_ms": 1.5, "check": null, "error": null},
         "reference": null, "reference_other": null},
        {"name": "all-MiniLM-L6-v2", "kind": "bert", "dtype": "bf16",
         "buckets": [
           {"bucket": "1x16", "served": true, "latency": {"median_us": 99.0}, "error": null}
         ]}
      ],
      "failures": [], "pass": true
    }"#;

    #[test]
    fn backend_check_reports_give_each_served_buckets_median() {
        let t = Timings::parse(CHECK).unwrap();
        assert_eq!(t.entries.len(), 3, "{t:?}");
        let m = "all-MiniLM-L6-v2";
        // The model's own dtype, else the first listed.
        assert_eq!(t.lookup(m, "f16", padded(1, 16)), Some(91.5));
        assert_eq!(t.lookup(m, "bf16", padded(1, 16)), Some(99.0));
        assert_eq!(t.lookup(m, "f32", padded(1, 16)), Some(91.5));
        assert_eq!(
            t.lookup(m, "f16", Shape::Packed { tokens: 2048 }),
            Some(640.25)
        );
        // The failed bucket is not in it: extrapolated from 1x16.
        assert_eq!(t.lookup(m, "f16", padded(2, 16)), Some(183.0));
        // Only named entries: another model gets the formula.
        assert_eq!(t.lookup("other", "f16", padded(1, 16)), None);
    }

    #[test]
    fn malformed_tables_say_what_is_wrong() {
        let err = |text: &str| Timings::parse(text).unwrap_err();
        assert!(err("{").starts_with("not JSON"), "{}", err("{"));
        assert!(err("[1, 2]").contains("`buckets`"), "{}", err("[1, 2]"));
        assert!(err(r#"{"x": 1}"#).contains("backend-check"));
        let e = err(r#"{"buckets": [{"bucket": "32y1", "us": 1}]}"#);
        assert!(e.contains("buckets[0]") && e.contains("\"32y1\""), "{e}");
        let e = err(r#"{"buckets": [{"bucket": "32x1"}]}"#);
        assert!(e.contains("missing field `us`"), "{e}");
        let e = err(r#"{"buckets": [{"bucket": "32x1", "us": 1, "ms": 2}]}"#);
        assert!(e.contains("unknown field `ms`"), "{e}");
        let e = err(r#"{"buckets": [{"bucket": "32x1", "us": -5}]}"#);
        assert!(e.contains("buckets[0] (32x1)") && e.contains("-5"), "{e}");
        let e = err(r#"{"buckets": [{"bucket": "32x1", "us": 2e6}]}"#);
        assert!(e.contains("between 0 and"), "{e}");
        assert!(err(r#"{"buckets": []}"#).contains("no bucket times"));
        let e = err(r#"{"models": [{"name": "m", "buckets": [{"bucket": "1x1"}]}]}"#);
        assert!(e.contains("backend-check") && e.contains("latency"), "{e}");
        assert!(err(r#"{"models": []}"#).contains("no bucket times"));
    }

    #[test]
    fn table_files_are_read_or_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h200.json");
        std::fs::write(&path, SIMPLE).unwrap();
        assert_eq!(Timings::load(&path).unwrap().entries.len(), 5);
        let missing = dir.path().join("missing.json");
        let e = Timings::load(&missing).unwrap_err();
        assert!(
            e.starts_with(&format!("cannot read {}", missing.display())),
            "{e}"
        );
        let e = Timings::load(dir.path()).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::write(&path, "{\"buckets\": [").unwrap();
        let e = Timings::load(&path).unwrap_err();
        assert!(
            e.starts_with(&format!("{}: not JSON", path.display())),
            "{e}"
        );

        let mut devices = DevicesConfig {
            null_timings: Some(missing),
            ..DevicesConfig::default()
        };
        let e = NullBackend::from_config(0, &devices).err().unwrap();
        assert!(e.starts_with("devices.null_timings: cannot read"), "{e}");
        std::fs::write(&path, SIMPLE).unwrap();
        devices.null_timings = Some(path);
        let b = NullBackend::from_config(0, &devices).unwrap();
        assert!(
            b.info().name.contains("5 bucket times from"),
            "{}",
            b.info().name
        );
    }
}
