//! The driver: one tokio task per socket that owns the libzmq sockets (the
//! main socket, its monitor and, for a CURVE server, the ZAP handler) and
//! moves messages between them and the tokio channels of the public halves.

use super::{bump, Budget, Received, Security, TransportError, TransportLimits, TransportStats};
use bytes::Bytes;
use std::collections::{HashSet, VecDeque};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Router,
    Dealer,
}

pub(super) enum Attach {
    Bind(String),
    Connect(String),
    /// Serve a TCP socket that is already bound and listening (a shard of a
    /// [`super::Router::bind_shards`]): libzmq takes it with `ZMQ_USE_FD`
    /// and closes it with the socket. The string is the endpoint it serves,
    /// for messages.
    Listen(std::os::fd::OwnedFd, String),
}

/// Frames up to this size are copied out of libzmq's message; larger ones
/// are kept zero-copy (libzmq gives each of them its own allocation, since
/// they cannot fit its 8 KiB receive batch buffer).
const COPY_BELOW: usize = 8192;
/// Messages taken from libzmq per wake-up before the driver yields.
const RECV_BATCH: usize = 256;
/// Above this size an outgoing frame is handed to libzmq without a copy.
const ZERO_COPY_SEND: usize = 64 << 10;

/// ZAP domain set on every socket: with one set, libzmq refuses ZMTP 1.0 and
/// 2.0 peers (whose decoder does not have the multipart-size patch) and, for
/// CURVE, asks the ZAP handler about every client.
const ZAP_DOMAIN: &str = "replayd";

// libzmq's monitor event numbers (zmq.h; stable ABI).
const EVENT_ACCEPTED: u16 = 0x0020;
const EVENT_DISCONNECTED: u16 = 0x0200;
const EVENT_HANDSHAKE_FAILED_NO_DETAIL: u16 = 0x0800;
const EVENT_HANDSHAKE_SUCCEEDED: u16 = 0x1000;
const EVENT_HANDSHAKE_FAILED_PROTOCOL: u16 = 0x2000;
const EVENT_HANDSHAKE_FAILED_AUTH: u16 = 0x4000;
const MONITORED: i32 = (EVENT_ACCEPTED
    | EVENT_DISCONNECTED
    | EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | EVENT_HANDSHAKE_SUCCEEDED
    | EVENT_HANDSHAKE_FAILED_PROTOCOL
    | EVENT_HANDSHAKE_FAILED_AUTH) as i32;

static MONITOR_SEQ: AtomicU64 = AtomicU64::new(0);

/// A libzmq socket whose `ZMQ_FD` an [`AsyncFd`] watches. The `AsyncFd`
/// owns it, so the fd is deregistered from tokio before the socket (and with
/// it the fd) is closed.
struct Zs {
    socket: zmq::Socket,
    fd: RawFd,
}

// SAFETY: a `Zs` is private to one driver, whose future is the only code
// that ever refers to it; a future is polled by one thread at a time, so the
// libzmq socket (Send, not thread-safe) is never used by two threads at once.
// `Sync` is needed only because `&AsyncFd<Zs>` is held across awaits.
unsafe impl Sync for Zs {}

impl AsRawFd for Zs {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

/// Everything made on the blocking pool before the driver starts.
struct Sockets {
    main: zmq::Socket,
    monitor: zmq::Socket,
    zap: Option<(zmq::Socket, HashSet<[u8; 32]>)>,
    context: zmq::Context,
}

type Started = (
    String,
    mpsc::Receiver<Received>,
    mpsc::UnboundedSender<Vec<Bytes>>,
    Arc<TransportStats>,
);

pub(super) async fn start(
    kind: Kind,
    attach: Attach,
    limits: TransportLimits,
    security: Security,
) -> Result<Started, TransportError> {
    let setup_limits = limits.clone();
    let (sockets, endpoint) =
        tokio::task::spawn_blocking(move || setup(kind, attach, &setup_limits, &security))
            .await
            .map_err(|e| TransportError::Setup(format!("socket setup task: {e}")))??;
    let Sockets {
        main,
        monitor,
        zap,
        context,
    } = sockets;
    let register = |socket: zmq::Socket| -> Result<AsyncFd<Zs>, TransportError> {
        let fd = socket.get_fd().map_err(setup_err("ZMQ_FD"))?;
        // SAFETY: `fd` is the socket's ZMQ_FD, which stays open and the same
        // until the socket is closed; the socket lives inside the AsyncFd, so
        // it is closed only after the AsyncFd has deregistered the fd.
        unsafe { AsyncFd::register_with_interest(Zs { socket, fd }, Interest::READABLE) }
            .map_err(|e| TransportError::Setup(format!("register ZMQ_FD with tokio: {e}")))
    };
    let main = register(main)?;
    let monitor = register(monitor)?;
    let zap = match zap {
        Some((socket, allowed)) => Some((register(socket)?, allowed)),
        None => None,
    };
    let (in_tx, in_rx) = mpsc::channel(limits.queue_messages.max(1));
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let stats = Arc::new(TransportStats::default());
    let driver = Driver {
        kind,
        main,
        monitor,
        zap,
        context: Some(context),
        inbox: in_tx,
        outbox: out_rx,
        budget: Budget::new(limits.max_buffered_bytes.max(1)),
        stats: stats.clone(),
        limits,
        pending: VecDeque::new(),
        disconnects_due: 0,
    };
    tokio::spawn(driver.run());
    Ok((endpoint, in_rx, out_tx, stats))
}

fn setup_err(what: &'static str) -> impl Fn(zmq::Error) -> TransportError {
    move |e| TransportError::Setup(format!("{what}: {e}"))
}

fn millis(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// One libzmq context for every client socket of the process with the same
/// `io_threads` ([`TransportLimits::shared_context`]), as a ZeroMQ
/// application normally has: 16 client sockets otherwise run 16 I/O
/// threads, each woken for its own socket's messages. (A server's context
/// stays its own: a CURVE server binds its ZAP handler in it, at an address
/// fixed per context.)
fn shared_client_context(io_threads: usize) -> Result<zmq::Context, TransportError> {
    static CONTEXTS: std::sync::Mutex<Vec<(usize, zmq::Context)>> =
        std::sync::Mutex::new(Vec::new());
    let io_threads = io_threads.clamp(1, 64);
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = contexts.iter().find(|(n, _)| *n == io_threads) {
        return Ok(c.clone());
    }
    let context = new_context(io_threads)?;
    contexts.push((io_threads, context.clone()));
    Ok(context)
}

fn new_context(io_threads: usize) -> Result<zmq::Context, TransportError> {
    let context = zmq::Context::new();
    context
        .set_io_threads(io_threads.clamp(1, 64) as i32)
        .map_err(setup_err("ZMQ_IO_THREADS"))?;
    Ok(context)
}

fn setup(
    kind: Kind,
    attach: Attach,
    limits: &TransportLimits,
    security: &Security,
) -> Result<(Sockets, String), TransportError> {
    let context = match kind {
        Kind::Dealer if limits.shared_context => shared_client_context(limits.io_threads)?,
        _ => new_context(limits.io_threads)?,
    };
    // The ZAP handler must be bound before the socket it serves is.
    let zap = match security {
        Security::CurveServer {
            allowed_clients, ..
        } => {
            if !zmq::has("curve").unwrap_or(false) {
                return Err(TransportError::Setup(
                    "libzmq was built without CURVE".into(),
                ));
            }
            let zap = context.socket(zmq::REP).map_err(setup_err("ZAP socket"))?;
            zap.set_linger(0).map_err(setup_err("ZMQ_LINGER"))?;
            zap.bind("inproc://zeromq.zap.01")
                .map_err(setup_err("bind the ZAP handler"))?;
            Some((zap, allowed_clients.iter().copied().collect()))
        }
        _ => None,
    };
    let mut socket = context
        .socket(match kind {
            Kind::Router => zmq::ROUTER,
            Kind::Dealer => zmq::DEALER,
        })
        .map_err(setup_err("socket"))?;
    let s = &socket;
    s.set_linger(0).map_err(setup_err("ZMQ_LINGER"))?;
    let max_message = i64::try_from(limits.max_message_bytes).unwrap_or(i64::MAX);
    s.set_maxmsgsize(max_message)
        .map_err(setup_err("ZMQ_MAXMSGSIZE"))?;
    let hwm = |n: usize| i32::try_from(n).unwrap_or(i32::MAX).max(1);
    s.set_rcvhwm(hwm(limits.recv_hwm))
        .map_err(setup_err("ZMQ_RCVHWM"))?;
    s.set_sndhwm(hwm(limits.send_hwm))
        .map_err(setup_err("ZMQ_SNDHWM"))?;
    s.set_handshake_ivl(millis(limits.handshake_timeout))
        .map_err(setup_err("ZMQ_HANDSHAKE_IVL"))?;
    if let Some(ivl) = limits.heartbeat {
        let ivl = millis(ivl);
        let timeout = ivl.saturating_mul(3);
        s.set_heartbeat_ivl(ivl)
            .map_err(setup_err("ZMQ_HEARTBEAT_IVL"))?;
        s.set_heartbeat_timeout(timeout)
            .map_err(setup_err("ZMQ_HEARTBEAT_TIMEOUT"))?;
        // What the peer is told to use as its own timeout (deciseconds on
        // the wire, at most 6553.5 s).
        s.set_heartbeat_ttl(timeout.min(6_553_500))
            .map_err(setup_err("ZMQ_HEARTBEAT_TTL"))?;
    }
    if kind == Kind::Router {
        // Sends to a peer at its HWM fail with EAGAIN (and to a departed
        // peer with EHOSTUNREACH) instead of being dropped silently.
        s.set_router_mandatory(true)
            .map_err(setup_err("ZMQ_ROUTER_MANDATORY"))?;
    }
    s.set_zap_domain(ZAP_DOMAIN)
        .map_err(setup_err("ZMQ_ZAP_DOMAIN"))?;
    match security {
        Security::None => {}
        Security::CurveServer { keys, .. } => {
            s.set_curve_server(true)
                .map_err(setup_err("ZMQ_CURVE_SERVER"))?;
            s.set_curve_secretkey(&keys.secret)
                .map_err(setup_err("ZMQ_CURVE_SECRETKEY"))?;
        }
        Security::CurveClient {
            server_public,
            keys,
        } => {
            s.set_curve_serverkey(server_public)
                .map_err(setup_err("ZMQ_CURVE_SERVERKEY"))?;
            s.set_curve_publickey(&keys.public)
                .map_err(setup_err("ZMQ_CURVE_PUBLICKEY"))?;
            s.set_curve_secretkey(&keys.secret)
                .map_err(setup_err("ZMQ_CURVE_SECRETKEY"))?;
        }
    }
    let monitor_endpoint = format!(
        "inproc://replayd-monitor-{}-{}",
        std::process::id(),
        MONITOR_SEQ.fetch_add(1, Ordering::Relaxed)
    );
    s.monitor(&monitor_endpoint, MONITORED)
        .map_err(setup_err("zmq_socket_monitor"))?;
    let monitor = context
        .socket(zmq::PAIR)
        .map_err(setup_err("monitor socket"))?;
    monitor.set_linger(0).map_err(setup_err("ZMQ_LINGER"))?;
    monitor
        .connect(&monitor_endpoint)
        .map_err(setup_err("connect the monitor"))?;
    let endpoint = match attach {
        Attach::Bind(endpoint) => {
            // libzmq spells "any port" `*`; accept the usual 0 as well.
            let spelled = match endpoint.strip_suffix(":0") {
                Some(host) if endpoint.starts_with("tcp://") => format!("{host}:*"),
                _ => endpoint.clone(),
            };
            s.bind(&spelled)
                .map_err(|e| TransportError::Setup(format!("bind {endpoint}: {e}")))?;
            match s.get_last_endpoint() {
                Ok(Ok(resolved)) => resolved,
                _ => endpoint,
            }
        }
        Attach::Connect(endpoint) => {
            s.connect(&endpoint)
                .map_err(|e| TransportError::Setup(format!("connect {endpoint}: {e}")))?;
            endpoint
        }
        Attach::Listen(fd, endpoint) => {
            use_fd(&mut socket, &fd)?;
            // With ZMQ_USE_FD set, a tcp bind takes that descriptor and does
            // not read the address (it must only parse as tcp://).
            match socket.bind("tcp://0.0.0.0:0") {
                Ok(()) => {
                    // libzmq owns it now: its listener closes it.
                    let _ = fd.into_raw_fd();
                }
                Err(e) => return Err(TransportError::Setup(format!("bind {endpoint}: {e}"))),
            }
            match socket.get_last_endpoint() {
                Ok(Ok(resolved)) => resolved,
                _ => endpoint,
            }
        }
    };
    Ok((
        Sockets {
            main: socket,
            monitor,
            zap,
            context,
        },
        endpoint,
    ))
}

/// Sets `ZMQ_USE_FD` (libzmq 4.2+; the `zmq` crate has no setter for it).
fn use_fd(socket: &mut zmq::Socket, fd: &std::os::fd::OwnedFd) -> Result<(), TransportError> {
    let value: std::os::raw::c_int = fd.as_raw_fd();
    // SAFETY: the pointer is the live socket's, and the option value is a
    // C int read for its size during the call.
    let rc = unsafe {
        zmq_sys::zmq_setsockopt(
            socket.as_mut_ptr(),
            zmq_sys::ZMQ_USE_FD as std::os::raw::c_int,
            (&value as *const std::os::raw::c_int).cast(),
            std::mem::size_of::<std::os::raw::c_int>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: no preconditions; reads this thread's libzmq errno.
        let errno = unsafe { zmq_sys::zmq_errno() };
        Err(TransportError::Setup(format!(
            "ZMQ_USE_FD: {}",
            zmq::Error::from_raw(errno)
        )))
    }
}

/// How long a closing socket keeps trying to deliver what it has queued.
const CLOSE_LINGER_MS: i32 = 1000;

struct Driver {
    kind: Kind,
    // Field order is drop order: the AsyncFds (which own and then close
    // their sockets) go before the context, whose termination waits for
    // every socket to be closed.
    main: AsyncFd<Zs>,
    monitor: AsyncFd<Zs>,
    zap: Option<(AsyncFd<Zs>, HashSet<[u8; 32]>)>,
    context: Option<zmq::Context>,
    inbox: mpsc::Sender<Received>,
    outbox: mpsc::UnboundedReceiver<Vec<Bytes>>,
    budget: Arc<Budget>,
    stats: Arc<TransportStats>,
    limits: TransportLimits,
    /// A DEALER's messages that libzmq could not take yet, oldest first
    /// (see `send`); what the senders queue meanwhile goes behind them.
    pending: VecDeque<Vec<Bytes>>,
    /// Disconnects read from the monitor but not yet counted: a disconnect
    /// counts only once what arrived before it is in the inbox (see `run`).
    disconnects_due: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Blocked {
    No,
    /// The receiver's channel is full.
    Queue,
    /// `max_buffered_bytes` is reached.
    Budget,
}

enum Wake {
    Send(Vec<Bytes>),
    OutboxClosed,
    Other,
}

impl Driver {
    async fn run(mut self) {
        let mut outbox_open = true;
        let mut was_paused = false;
        let mut woke = crate::clock::mono_ns();
        // The monitor and ZAP sockets are read when their descriptor fired
        // (and once at start): each ZMQ_EVENTS read is a poll(2) in libzmq,
        // too dear to make on every turn of a busy socket.
        let mut side_due = true;
        loop {
            // 1. Sends first, so replies never wait behind input; held
            // DEALER messages go before anything newer.
            while let Some(frames) = self.pending.pop_front() {
                let left = self.pending.len();
                if !self.send(frames) {
                    return self.close().await;
                }
                if self.pending.len() > left {
                    break; // put back: libzmq still has no room
                }
            }
            while outbox_open {
                match self.outbox.try_recv() {
                    Ok(frames) => {
                        if !self.pending.is_empty() {
                            self.pending.push_back(frames);
                        } else if !self.send(frames) {
                            return self.close().await;
                        }
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => outbox_open = false,
                }
            }
            // 2. ZAP requests and monitor events.
            if side_due {
                side_due = false;
                self.serve_zap();
                self.read_monitor();
            }
            // 3. Input, while the receiver has room and the budget allows.
            let receiving = !self.inbox.is_closed();
            let mut blocked = Blocked::No;
            let mut taken = 0;
            // Whether libzmq had nothing more to read (EAGAIN) this turn.
            let mut drained = false;
            // Messages are taken until libzmq says EAGAIN; ZMQ_EVENTS is read
            // once after that (below, before any wait), not before each one.
            while receiving && taken < RECV_BATCH {
                if !self.budget.available() {
                    blocked = Blocked::Budget;
                    if !was_paused {
                        bump(&self.stats.reads_paused);
                        was_paused = true;
                    }
                    break;
                }
                was_paused = false;
                let slot = match self.inbox.try_reserve() {
                    Ok(slot) => slot,
                    Err(mpsc::error::TrySendError::Full(())) => {
                        blocked = Blocked::Queue;
                        break;
                    }
                    Err(mpsc::error::TrySendError::Closed(())) => break,
                };
                let received = self.recv_message();
                match received {
                    Ok(Some(received)) => slot.send(received),
                    Ok(None) => {
                        drop(slot);
                        drained = true;
                        break;
                    }
                    Err(()) => {
                        drop(slot);
                        return self.close().await;
                    }
                }
                taken += 1;
            }
            // A disconnect read from the monitor is counted once the main
            // socket has nothing left to read (or nobody reads it): libzmq
            // hands over a connection's messages before it reports the
            // connection gone, so everything that arrived before the
            // disconnect is in the inbox, and counted in `messages_received`
            // (by recv_message, just before it goes there), before
            // `disconnects` moves. A client matches its replies against
            // `messages_received` to tell a lost request from an answered one.
            if self.disconnects_due > 0 && (drained || self.inbox.is_closed()) {
                let due = std::mem::take(&mut self.disconnects_due);
                self.stats.disconnects.fetch_add(due, Ordering::Release);
            }
            if taken == RECV_BATCH {
                let now = crate::clock::mono_ns();
                self.stats
                    .busy_ns
                    .fetch_add(now.saturating_sub(woke), Ordering::Relaxed);
                tokio::task::yield_now().await;
                woke = crate::clock::mono_ns();
                continue;
            }
            if !outbox_open && !receiving {
                // Both halves are gone: messages still held for a peer that
                // never came back (a dead worker) are given up.
                for _ in self.pending.drain(..) {
                    bump(&self.stats.dropped_sends);
                }
                return self.close().await;
            }
            // The one ZMQ_EVENTS read of this turn, which also makes the
            // edge-triggered ZMQ_FD safe to wait on: more input that arrived
            // since the EAGAIN (and room was left for it), or room for held
            // messages, means another turn before any wait.
            let events = match self.main.get_ref().socket.get_events() {
                Ok(events) => events,
                Err(_) => return self.close().await,
            };
            let more_input = receiving && blocked == Blocked::No && events.contains(zmq::POLLIN);
            if more_input || (!self.pending.is_empty() && events.contains(zmq::POLLOUT)) {
                continue;
            }
            // 4. Wait for anything that could let us make progress. Every
            // readiness wait on a socket is preceded by a ZMQ_EVENTS read of
            // it (the main socket just above; the monitor and ZAP sockets in
            // step 2 after their descriptor fired), which is what makes the
            // edge-triggered ZMQ_FD safe.
            let now = crate::clock::mono_ns();
            self.stats
                .busy_ns
                .fetch_add(now.saturating_sub(woke), Ordering::Relaxed);
            let wake = {
                let zap_ready = async {
                    match &self.zap {
                        Some((fd, _)) => fd.readable().await.map(|mut g| g.clear_ready()),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    m = self.outbox.recv(), if outbox_open => match m {
                        Some(frames) => Wake::Send(frames),
                        None => Wake::OutboxClosed,
                    },
                    r = self.main.readable(), if (receiving && blocked == Blocked::No) || !self.pending.is_empty() => {
                        if let Ok(mut g) = r { g.clear_ready() }
                        Wake::Other
                    }
                    r = self.monitor.readable() => {
                        if let Ok(mut g) = r { g.clear_ready() }
                        side_due = true;
                        Wake::Other
                    }
                    _ = zap_ready => {
                        side_due = true;
                        Wake::Other
                    }
                    _ = self.budget.notify.notified(), if blocked == Blocked::Budget => Wake::Other,
                    _ = self.inbox.reserve(), if blocked == Blocked::Queue => Wake::Other,
                    _ = self.inbox.closed(), if receiving => Wake::Other,
                }
            };
            woke = crate::clock::mono_ns();
            bump(&self.stats.wakes);
            match wake {
                Wake::Send(frames) => {
                    if !self.pending.is_empty() {
                        self.pending.push_back(frames);
                    } else if !self.send(frames) {
                        return self.close().await;
                    }
                }
                Wake::OutboxClosed => outbox_open = false,
                Wake::Other => {}
            }
        }
    }

    /// Sends one message without waiting; false if the socket is unusable.
    /// A DEALER whose peer is at its high-water mark keeps the message in
    /// `pending` (and sends nothing more) until libzmq has room: a DEALER's
    /// sender wants back-pressure, not loss. A ROUTER drops and counts.
    fn send(&mut self, frames: Vec<Bytes>) -> bool {
        let socket = &self.main.get_ref().socket;
        let last = frames.len() - 1;
        for (i, frame) in frames.iter().cloned().enumerate() {
            let flags = zmq::DONTWAIT | if i < last { zmq::SNDMORE } else { 0 };
            let message = if frame.len() >= ZERO_COPY_SEND {
                zmq::Message::from(Vec::from(frame))
            } else {
                zmq::Message::from(&frame[..])
            };
            match socket.send(message, flags) {
                Ok(()) => {}
                // libzmq checks the HWM and the route on the first frame
                // only; a refusal there leaves nothing half-sent.
                Err(zmq::Error::EAGAIN) if i == 0 && self.kind == Kind::Dealer => {
                    self.pending.push_front(frames);
                    return true;
                }
                Err(zmq::Error::EAGAIN) if i == 0 => {
                    bump(&self.stats.dropped_sends);
                    return true;
                }
                Err(zmq::Error::EHOSTUNREACH) if i == 0 => {
                    bump(&self.stats.unroutable_sends);
                    return true;
                }
                Err(zmq::Error::ETERM) => return false,
                Err(e) => {
                    tracing::warn!("transport: send failed: {e}");
                    bump(&self.stats.dropped_sends);
                    return true;
                }
            }
        }
        bump(&self.stats.messages_sent);
        true
    }

    /// Takes one whole message from libzmq (all its frames are there once the
    /// first is). Ok(None): nothing to read; Err: the socket is unusable.
    fn recv_message(&self) -> Result<Option<Received>, ()> {
        let socket = &self.main.get_ref().socket;
        let envelope = usize::from(self.kind == Kind::Router);
        let mut frames = Vec::new();
        let mut bytes = 0usize;
        let mut count = 0usize;
        let mut rejected: Option<String> = None;
        let mut peer = None;
        loop {
            let mut message = zmq::Message::new();
            match socket.recv(&mut message, zmq::DONTWAIT) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if count == 0 => return Ok(None),
                Err(zmq::Error::EINTR) if count == 0 => return Ok(None),
                Err(zmq::Error::ETERM) => return Err(()),
                Err(e) => {
                    tracing::warn!("transport: recv failed: {e}");
                    return Err(());
                }
            }
            let more = message.get_more();
            let len = message.len();
            count += 1;
            if count <= envelope {
                peer = Some(Bytes::copy_from_slice(&message));
            } else {
                bytes += len;
                if rejected.is_none() {
                    if len > self.limits.max_frame_bytes {
                        rejected = Some(format!(
                            "a frame of {len} bytes, over the limit of {}",
                            self.limits.max_frame_bytes
                        ));
                    } else if count - envelope > self.limits.max_frames {
                        rejected = Some(format!(
                            "more than {} frames in one message",
                            self.limits.max_frames
                        ));
                    }
                }
                if rejected.is_none() {
                    frames.push(to_bytes(message));
                }
            }
            if !more {
                break;
            }
        }
        bump(&self.stats.messages_received);
        self.stats
            .bytes_received
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if let Some(reason) = rejected {
            bump(&self.stats.rejected_messages);
            return Ok(Some(Received::Rejected(peer, reason)));
        }
        if let Some(peer) = peer {
            frames.insert(0, peer);
        }
        let permit = self.budget.take(bytes);
        Ok(Some(Received::Message(
            frames,
            permit,
            crate::clock::mono_ns(),
        )))
    }

    fn read_monitor(&mut self) {
        let socket = &self.monitor.get_ref().socket;
        loop {
            match socket.get_events() {
                Ok(e) if e.contains(zmq::POLLIN) => {}
                _ => return,
            }
            let Ok(parts) = socket.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            let Some(head) = parts.first().filter(|p| p.len() >= 2) else {
                continue;
            };
            let event = u16::from_ne_bytes([head[0], head[1]]);
            let s = &self.stats;
            match event {
                EVENT_ACCEPTED => bump(&s.connections_accepted),
                // Counted in `run`, after the messages that came before it.
                EVENT_DISCONNECTED => self.disconnects_due += 1,
                EVENT_HANDSHAKE_FAILED_NO_DETAIL => bump(&s.handshake_failures),
                EVENT_HANDSHAKE_SUCCEEDED => bump(&s.connections_established),
                EVENT_HANDSHAKE_FAILED_PROTOCOL => bump(&s.protocol_failures),
                EVENT_HANDSHAKE_FAILED_AUTH => bump(&s.auth_failures),
                _ => {}
            }
        }
    }

    /// Answers ZAP (RFC 27) requests: a CURVE client is allowed when its
    /// public key is in the allow-list.
    fn serve_zap(&self) {
        let Some((fd, allowed)) = &self.zap else {
            return;
        };
        let socket = &fd.get_ref().socket;
        loop {
            match socket.get_events() {
                Ok(e) if e.contains(zmq::POLLIN) => {}
                _ => return,
            }
            let Ok(request) = socket.recv_multipart(zmq::DONTWAIT) else {
                return;
            };
            // version, request id, domain, address, routing id, mechanism, credentials…
            let ok = request.len() >= 7
                && request[5] == b"CURVE"
                && <[u8; 32]>::try_from(&request[6][..]).is_ok_and(|key| allowed.contains(&key));
            let request_id = request.get(1).cloned().unwrap_or_default();
            let (code, text): (&[u8], &[u8]) = if ok {
                (b"200", b"OK")
            } else {
                (b"400", b"client key not allowed")
            };
            let reply: [&[u8]; 6] = [b"1.0", &request_id, code, text, b"", b""];
            if let Err(e) = socket.send_multipart(reply, zmq::DONTWAIT) {
                tracing::warn!("transport: ZAP reply failed: {e}");
            }
        }
    }

    /// Closes the sockets, then terminates the context on the blocking pool
    /// (zmq_ctx_term waits for libzmq's threads).
    async fn close(mut self) {
        // Replies already handed to libzmq get a bounded moment to reach
        // their peers (the context's termination, on the blocking pool,
        // waits for them); until now the socket lingered 0 so that a peer
        // that is gone never holds anything.
        let _ = self.main.get_ref().socket.set_linger(CLOSE_LINGER_MS);
        // Nothing more will be delivered: disconnects still due count now.
        let due = std::mem::take(&mut self.disconnects_due);
        self.stats.disconnects.fetch_add(due, Ordering::Release);
        let context = self.context.take();
        let Driver {
            main, monitor, zap, ..
        } = self;
        drop(zap);
        drop(monitor);
        drop(main);
        if let Some(context) = context {
            let _ = tokio::task::spawn_blocking(move || drop(context)).await;
        }
    }
}

struct Owned(zmq::Message);

impl AsRef<[u8]> for Owned {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn to_bytes(message: zmq::Message) -> Bytes {
    if message.len() < COPY_BELOW {
        Bytes::copy_from_slice(&message)
    } else {
        Bytes::from_owner(Owned(message))
    }
}
