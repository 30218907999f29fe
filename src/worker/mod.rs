//! The `replayd worker` process: one per device (and one per eager worker).
//!
//! * [`link`] — the messages it exchanges with its device actor (the one
//!   place that wire is encoded and decoded).
//! * [`graph_cache`] — the captured graphs, per (model, bucket).
//! * [`memory_budget`] — which buckets get a graph on a device too small
//!   for the whole grid.
//! * [`executor`] — the backend thread: loads models, captures, runs batches.
//! * [`shm`] — the shared-memory ring and doorbell that carry batches and
//!   outputs (the socket then carries only control).
//!
//! The process has two threads that matter: the async I/O thread (the ZeroMQ
//! socket to the daemon) and the backend thread, which owns the device (CUDA
//! graphs are not `Send`). They talk through channels. A device fault makes
//! the worker report it and exit with [`link::EXIT_DEVICE_FAULT`]: only a new
//! process recovers a poisoned GPU.

pub mod executor;
pub mod graph_cache;
pub mod link;
pub mod memory_budget;
pub mod shm;

use crate::config::Config;
use crate::transport::{Dealer, Security};
use bytes::Bytes;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

/// Which backend a worker drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerBackend {
    Cpu,
    Cuda,
    /// Computes nothing (host-path benchmarks; see [`crate::backend::null`]).
    Null,
}

/// Arguments of `replayd worker` (started by the daemon, not by hand).
#[derive(Clone, Debug, clap::Args)]
pub struct WorkerArgs {
    /// The daemon's config file (models, buckets, device options).
    #[arg(long)]
    pub config: PathBuf,
    /// The device actor's IPC endpoint to connect to.
    #[arg(long)]
    pub endpoint: String,
    #[arg(long, value_enum)]
    pub backend: WorkerBackend,
    /// CUDA ordinal, or CPU device number.
    #[arg(long, default_value_t = 0)]
    pub ordinal: usize,
    /// Threads for the CPU backend.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Run requests eagerly only: capture no graphs.
    #[arg(long)]
    pub eager: bool,
    /// How often the backend thread says it is alive, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub heartbeat_ms: u64,
    /// How long the backend thread polls its doorbell after a batch, in µs
    /// (the daemon's choice for its number of workers); unset:
    /// `devices.worker_spin_us` of the config, or its automatic value for
    /// one worker.
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// The shared-memory ring the daemon created for this worker ([`shm`]).
    #[arg(long, requires = "doorbell_fd")]
    pub shm: Option<PathBuf>,
    /// The inherited file descriptor of this worker's end of the doorbell socket.
    #[arg(long, requires = "shm")]
    pub doorbell_fd: Option<i32>,
}

/// Runs a worker until the daemon tells it to stop or its device fails;
/// returns the process exit status.
pub fn run(args: WorkerArgs) -> i32 {
    die_with_parent();
    let mut config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("replayd worker: {e}");
            return link::EXIT_STARTUP_FAILED;
        }
    };
    config.resolve_for_backend(args.backend == WorkerBackend::Cuda);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(serve(args, config))
}

async fn serve(args: WorkerArgs, config: Config) -> i32 {
    let socket =
        match Dealer::connect(&args.endpoint, &link::transport_limits(), &Security::None).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("replayd worker: cannot connect to {}: {e}", args.endpoint);
                return link::EXIT_STARTUP_FAILED;
            }
        };
    let fast = match fast_end(&args) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("replayd worker: {e}");
            return link::EXIT_STARTUP_FAILED;
        }
    };
    let wake = fast.as_ref().map(|f| f.wake.clone());
    let (mut recv, send) = socket.split();
    let (to_backend, from_io) = std::sync::mpsc::channel::<executor::Command>();
    let (to_io, mut from_backend) = tokio::sync::mpsc::unbounded_channel::<executor::Outgoing>();
    let backend_thread = std::thread::Builder::new()
        .name("backend".into())
        .spawn(move || executor::run(args, config, from_io, to_io, fast))
        .expect("spawn backend thread");

    let exit_code = loop {
        tokio::select! {
            incoming = recv.recv() => {
                let frames: Vec<Bytes> = match incoming {
                    Ok(m) => m.frames,
                    Err(e) => {
                        eprintln!("replayd worker: daemon socket closed: {e}");
                        break 0;
                    }
                };
                match link::decode::<link::ToWorker>(&frames) {
                    Ok((msg, data)) => {
                        let data = data.to_vec();
                        if to_backend.send(executor::Command { msg, data }).is_err() {
                            break 0;
                        }
                        if let Some(wake) = &wake {
                            // The backend thread may be waiting on its doorbell.
                            let one = 1u64.to_ne_bytes();
                            // SAFETY: writes 8 bytes to an eventfd we own.
                            unsafe { libc::write(wake.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
                        }
                    }
                    Err(e) => eprintln!("replayd worker: {e}"),
                }
            }
            outgoing = from_backend.recv() => match outgoing {
                Some(executor::Outgoing::Message(frames)) => {
                    if send.send(frames).is_err() {
                        break 0;
                    }
                }
                Some(executor::Outgoing::Exit(code)) => break code,
                None => break 0,
            },
        }
    };
    drop(to_backend);
    if exit_code == 0 {
        let _ = backend_thread.join();
    }
    // Sends only queue: give the socket's driver a moment to hand the last
    // messages (a fatal error's reason) to libzmq, which flushes them as the
    // socket closes.
    drop(send);
    drop(recv);
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    // After a device fault, exit without running the backend's destructors:
    // some of them panic on a poisoned context.
    exit_code
}

/// Opens the ring and takes the doorbell the daemon passed, if it did.
fn fast_end(args: &WorkerArgs) -> Result<Option<executor::FastEnd>, String> {
    let (Some(path), Some(fd)) = (&args.shm, args.doorbell_fd) else {
        return Ok(None);
    };
    let ring = shm::Ring::open(path).map_err(|e| format!("cannot open the ring: {e}"))?;
    // SAFETY: fstat on a number we were told is an inherited fd; checked
    // to be a socket before we take ownership of it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(format!("--doorbell-fd {fd} is not an inherited socket"));
    }
    // SAFETY: the fd is ours alone (inherited for this purpose); close-on-exec
    // again so nothing this worker might start inherits it.
    let doorbell = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        OwnedFd::from_raw_fd(fd)
    };
    // SAFETY: plain eventfd creation.
    let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if wake < 0 {
        return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
    }
    Ok(Some(executor::FastEnd {
        ring,
        doorbell,
        // SAFETY: a fresh fd we own.
        wake: std::sync::Arc::new(unsafe { OwnedFd::from_raw_fd(wake) }),
    }))
}

/// Asks the kernel to kill this process when the daemon dies, so no worker
/// outlives it (e.g. after `kill -9` of the daemon).
fn die_with_parent() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a flag on this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() == 1 {
            libc::_exit(0);
        }
    }
}
