//! Commands that exercise a backend outside the daemon.
//!
//! * [`backend_check`] — `replayd backend-check`: every bucket of a config
//!   captured on a CUDA device and checked against the CPU backend, with
//!   replay latency (the GPU check script runs it).

pub mod backend_check;
