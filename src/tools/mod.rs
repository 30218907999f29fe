//! Commands that exercise a backend outside the daemon.
//!
//! * [`backend_check`] — `replayd backend-check`: every bucket of a config
//!   captured on a CUDA device and checked against the CPU backend, with
//!   replay latency (the GPU check script runs it).
//! * [`precompile`] — `replayd precompile`: the kernels compiled into the
//!   kernel cache ahead of the first start.

pub mod backend_check;
pub mod precompile;
