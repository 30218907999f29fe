//! replayd serves neural-network inference by replaying CUDA Graphs captured
//! once per input-shape bucket.
//!
//! The crate follows the two processes of the design (see
//! `docs/architecture.md`):
//!
//! * [`daemon`] — the main process: the client socket (frontend), the
//!   tokenizer pool, the batcher, the supervisor and its device actors (one
//!   per worker process), the control socket, metrics, GPU health and
//!   systemd notification. It never touches a device: it imports neither
//!   [`backend`] nor a CUDA context.
//! * [`worker`] — the per-device process (`replayd worker`): the backend
//!   thread with its graph cache, and the link to its device actor
//!   ([`worker::link`] is the one place that wire is encoded and decoded).
//! * [`backend`] — the [`backend::Backend`] trait with the `cpu` (the
//!   numerical reference) and `cuda` backends; imported only by [`worker`]
//!   and [`tools`].
//! * [`model`] — model loading and the shape-fixed op [`model::Program`],
//!   with its validation rules and the reference interpreter, shared by
//!   every backend.
//! * [`protocol`] — the client wire format (types, codec) and the Rust
//!   [`protocol::client`] (also reachable as [`client`]).
//! * [`gpu`] — host-side device discovery and NVML, used by both processes.
//! * [`transport`] — the ZeroMQ sockets (libzmq) with their limits and
//!   CURVE authentication, for every socket of both processes and the client.
//! * [`tools`] — `replayd backend-check` (a GPU against the CPU backend).
//! * `fuzz` (hidden) — the entry points of the fuzz targets in `fuzz/`.
//! * Shared by all: [`config`] (the TOML file), [`bucket`] (shape buckets),
//!   [`tensor`] (dtypes and host tensors), [`clock`] (the cross-process clock
//!   of per-hop timings).
//!
//! Imports point down this order: `daemon` → `worker` (its link) →
//! `model`/`protocol`/`gpu` → `bucket`/`tensor`; `worker` → `backend` →
//! `model`; `config` reads the model vocabulary (`model`, `bucket`) and
//! nothing of either process. Between these top-level modules there are no
//! cycles (`scripts/dev/module-graph.py HEAD 1`); inside `daemon`, the messages
//! map and the shared-memory link still refer to each other.

pub mod backend;
pub mod bucket;
pub mod clock;
pub mod config;
pub mod daemon;
#[doc(hidden)]
pub mod fuzz;
pub mod gpu;
pub mod model;
pub mod protocol;
pub mod tensor;
pub mod tools;
pub mod transport;
pub mod worker;

/// The async Rust client, [`protocol::client`], under the name users look for.
pub use protocol::client;
