//! replayd serves neural-network inference by replaying CUDA Graphs captured
//! once per input-shape bucket.
//!
//! Layout (one module per concept):
//!
//! * [`config`] — the TOML configuration and its validation.
//! * [`protocol`] — the client wire format (MessagePack header + raw frames).
//! * [`frontend`] — the client-facing ZeroMQ ROUTER socket: decode, validate,
//!   tokenize off the runtime, hand to the batcher, reply.
//! * [`batcher`] — per-(model, seq bucket) queues and the dispatch rules
//!   ([`batcher::queue`] is the pure state machine, the actor wraps it).
//! * [`supervisor`] — spawns and restarts the device actors.
//! * [`device`] — one actor per device, owning a worker process.
//! * [`worker`] — the `replayd worker` process: a backend, its graph cache and
//!   the IPC loop.
//! * [`backend`] — the [`backend::Backend`] trait, with `cpu` and `cuda`.
//! * [`model`] — model loading and the shape-fixed [`model::Program`]s.
//! * [`tokenize`] — Hugging Face tokenizers on a thread pool.
//! * [`metrics`] — counters and latency histograms behind `replayctl stats`.
//! * [`control`] — the operator socket that `replayctl` talks to.
//! * [`client`] — a Rust client for the wire protocol.

pub mod backend;
pub mod backend_check;
pub mod batcher;
pub mod bucket;
pub mod client;
pub mod config;
pub mod control;
pub mod device;
pub mod frontend;
pub mod gpu_health;
pub mod metrics;
pub mod model;
pub mod notify;
pub mod protocol;
pub mod server;
pub mod supervisor;
pub mod tensor;
pub mod tokenize;
pub mod transport;
pub mod worker;
