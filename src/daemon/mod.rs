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
//!    queues it, forms batches and sends each on its way to a device; it
//!    holds the request's reply channel, so every accepted request gets
//!    exactly one reply.
//! 3. The way out, [`route`] (one [`route::DeviceRoute`] per device slot):
//!    the batcher writes the batch into the worker's shared-memory ring
//!    ([`fast_link`]; [`crate::worker::shm`]) and rings it; a batch the ring
//!    cannot take (too large for a slot, no slot free, no ring) goes to the
//!    device actor, [`device`], which carries it over the worker's socket
//!    ([`crate::worker::link`]). [`device`] (one actor per worker process)
//!    owns the worker and opens and closes its ring on the route.
//! 4. The way back, [`report`], the same for both transports: the ring's
//!    reader task and the device actor each unpack their own wire and hand
//!    the batch's outcome (done or failed) to the device's
//!    [`report::Reporter`], which feeds the hang [`watchdog`] and the device's
//!    counters once and sends the batcher one [`messages::BatcherMsg::Report`].
//!    When the worker dies the same reporter tells the batcher
//!    ([`messages::BatcherMsg::DeviceDown`]), which re-dispatches what the
//!    device held; its attempt and device guards drop any late report.
//! 5. [`supervisor`] starts the device actors and replaces one that fails.
//!
//! [`messages`] is the map of every message between these actors; it holds
//! data only (no actor, route or link). Each file of the route names only
//! those before it in this order: `messages`, `watchdog`, `report`,
//! `fast_link`, `route`, `batcher`, `device`, `supervisor`.
//!
//! Beside the route: [`control`] (the `replayctl` socket: stats, drain, restart,
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
pub mod output;
pub mod prometheus;
pub mod reload;
pub mod report;
pub mod route;
pub mod runtime_dir;
pub mod server;
pub mod stages;
pub mod stats;
pub mod supervisor;
pub mod tokenize;
pub mod tuning;
pub mod watchdog;
