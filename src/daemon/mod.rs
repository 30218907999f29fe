//! The daemon process: everything between the client socket and the worker
//! processes. It never touches a device itself (a fault in any CUDA context
//! poisons the whole process), so it does not import [`crate::backend`].
//!
//! The route of a request, and the module that owns each step:
//!
//! 1. [`frontend`] receives it on the client ROUTER socket, decodes it,
//!    admits or refuses it at once ([`admission`]: per-model and memory
//!    bounds), validates it, tokenizes texts ([`tokenize`]) and submits it.
//! 2. [`batcher`] (an actor around the [`batcher::queue`] state machine)
//!    queues it, forms batches and sends each to a device actor; it holds the
//!    request's reply channel, so every accepted request gets exactly one
//!    reply.
//! 3. The batcher writes the batch into the worker's shared-memory ring
//!    ([`fast_link`]; [`crate::worker::shm`]) and rings it; the link's task
//!    hands the result straight back. [`device`] (one actor per worker
//!    process) owns the worker, carries what the ring cannot take over the
//!    worker's socket ([`crate::worker::link`]), and reports the worker's
//!    death to the batcher, which re-dispatches.
//! 4. [`supervisor`] starts the device actors and replaces one that fails.
//!
//! [`messages`] is the map of every message between these actors. Beside
//! the route: [`control`] (the `replayctl` socket: stats, drain, restart,
//! reload), [`reload`] (re-reading the config and switching grids live),
//! [`metrics`] (counters and histograms, made into the typed [`stats`]
//! that `replayctl`, Prometheus and HTTP read), [`stages`] (busy time of the
//! serial stages and the waits between them), [`prometheus`] (`/metrics` over
//! loopback HTTP), [`http`] (the optional HTTP front, which feeds
//! [`frontend`]; both served by [`http_server`]), [`tuning`] (length histograms and suggested grids),
//! [`gpu_health`] (NVML samples and Xid watching), [`notify`] (systemd:
//! status lines, readiness, the watchdog loop), [`watchdog`] (when a quiet
//! worker counts as hung), [`runtime_dir`] (owner-only sockets and files),
//! and [`server`], which starts and stops it all.

pub mod admission;
pub mod batcher;
pub mod control;
pub mod device;
pub mod fast_link;
pub mod frontend;
pub mod gpu_health;
pub mod http;
pub mod http_server;
pub mod messages;
pub mod metrics;
pub mod notify;
pub mod prometheus;
pub mod reload;
pub mod runtime_dir;
pub mod server;
pub mod stages;
pub mod stats;
pub mod supervisor;
pub mod tokenize;
pub mod tuning;
pub mod watchdog;
