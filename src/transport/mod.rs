//! The socket transport: ZeroMQ ROUTER and DEALER sockets on libzmq 4.3.5
//! (through the `zmq` crate, built from source with CURVE and one patch, see
//! `third_party/zmq-sys/README.md`), with limits that hold before anything
//! is allocated, and a small async API for tokio. `docs/transport.md` says why
//! libzmq and what was measured.
//!
//! * [`Router`] — the daemon's client socket and the control socket.
//! * [`Dealer`] — the Rust client, and both ends of the daemon ↔ worker link
//!   (the daemon binds, the worker connects).
//!
//! ## Thread model
//!
//! Each socket has its own libzmq context (one libzmq I/O thread and one
//! reaper thread) and one tokio task, the *driver*, that owns the socket and
//! is the only code that touches it. The driver waits on the socket's
//! `ZMQ_FD` through [`tokio::io::unix::AsyncFd`] (edge-triggered: it re-reads
//! `ZMQ_EVENTS` after every operation, before it waits again), and never makes
//! a blocking libzmq call: every send and receive uses `ZMQ_DONTWAIT`.
//! Received messages go into a bounded tokio channel that the receiver half
//! reads; the sender halves put messages into an unbounded channel that the
//! driver drains before it reads more input. A disconnect is counted
//! ([`StatsSnapshot::disconnects`]) only after every message that arrived
//! before it is in that channel ([`StatsSnapshot::messages_received`]), so a reader
//! can tell what came before a connection was lost. Creating the context and
//! terminating it (after the last half is dropped) run on tokio's blocking
//! pool, so no call blocks the runtime.
//!
//! ## Shards
//!
//! [`Router::bind_shards`] serves one tcp endpoint with N ROUTERs, each as
//! above (its own context, I/O threads and driver): the transport binds N
//! listening sockets to the address with `SO_REUSEPORT` and hands each to
//! its ROUTER with `ZMQ_USE_FD`; the kernel spreads incoming connections
//! over them. Every limit and the security below apply to each shard; the
//! high-water marks are per peer, `max_buffered_bytes` and `queue_messages`
//! per shard.
//!
//! ## Limits (see [`TransportLimits`])
//!
//! * A message larger than `max_message_bytes` — counting each frame's size
//!   plus 64 bytes — is refused by libzmq as its frame headers are read,
//!   before the body is allocated, and the connection is dropped
//!   (`ZMQ_MAXMSGSIZE`, patched to bound the whole multipart message, not only
//!   each frame). A message with more than `max_frames` frames or a frame
//!   over `max_frame_bytes` is dropped after receipt and reported as
//!   [`TransportError::Rejected`], so the application can answer it.
//! * libzmq queues at most `recv_hwm` received messages per peer
//!   (`ZMQ_RCVHWM`) while the application is not reading, then stops reading
//!   that connection (TCP back-pressure).
//! * Received messages that the application holds count against
//!   `max_buffered_bytes`, from receipt until their [`BufferPermit`] is
//!   dropped; at the limit the driver stops taking messages from libzmq until
//!   permits are released.
//! * A connection that has not completed the ZMTP handshake after
//!   `handshake_timeout` is closed (`ZMQ_HANDSHAKE_IVL`).
//! * With `heartbeat = Some(ivl)`, peers are pinged every `ivl` and dropped
//!   after `3 × ivl` of silence (`ZMQ_HEARTBEAT_IVL`, `ZMQ_HEARTBEAT_TIMEOUT`).
//! * At most `send_hwm` unsent messages queue per peer (`ZMQ_SNDHWM`). A
//!   ROUTER runs with `ZMQ_ROUTER_MANDATORY`, so a reply to a peer at its
//!   high-water mark fails with `EAGAIN` instead of blocking: it is dropped and
//!   counted in [`StatsSnapshot::dropped_sends`], and replies to other peers
//!   are not delayed. A DEALER (one peer: the client's daemon, the worker
//!   link) keeps a message libzmq cannot take yet and sends it, then the
//!   rest in order, once libzmq has room: back-pressure, nothing lost. A reply to a peer that has gone (`EHOSTUNREACH`) is
//!   counted in `unroutable_sends`. libzmq cannot disconnect one peer of a
//!   ROUTER, so the policy is drop-and-count.
//!
//! ## Security
//!
//! [`Security::CurveServer`] authenticates clients with CURVE (RFC 26): the
//! client must know the server's public key and own a secret key whose public
//! key is in `allowed_clients`; everything after the handshake is encrypted.
//! The driver answers libzmq's ZAP requests (RFC 27) itself. Every server
//! socket also sets a ZAP domain, which makes libzmq refuse ZMTP 1.0 and 2.0
//! peers (their decoder is not the patched one).
//!
//! ## I/O threads' spin
//!
//! [`set_io_spin`] makes every libzmq I/O thread of the process poll its
//! sockets for a while after each event instead of sleeping at once (a
//! patch of libzmq's epoll loop, see `third_party/zmq-sys/README.md`): a
//! message that arrives, or that the application sends, soon after finds the
//! thread awake. The daemon sets it from `server.io_spin_us`.

mod driver;
mod listen;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// Limits of one socket. Every field is enforced by libzmq or by the driver
/// before the application sees a message; see the module docs.
#[derive(Debug, Clone)]
pub struct TransportLimits {
    /// Largest accepted message, as the sum over its frames of (size + 64)
    /// bytes. Checked on each frame header, before allocation; a peer that
    /// exceeds it is disconnected. At most 4 GiB − 1 (the patch's counter is
    /// 32-bit); larger values only bound each frame.
    pub max_message_bytes: usize,
    /// Largest accepted frame; a message with a larger frame is received
    /// (it is within `max_message_bytes`) and then rejected.
    pub max_frame_bytes: usize,
    /// Most frames in one message (the ROUTER's identity frame not counted);
    /// more is rejected after receipt.
    pub max_frames: usize,
    /// Received messages libzmq queues per peer while the application is not
    /// reading (`ZMQ_RCVHWM`).
    pub recv_hwm: usize,
    /// Unsent messages queued per peer (`ZMQ_SNDHWM`); past it, sends to that
    /// peer are dropped and counted.
    pub send_hwm: usize,
    /// Time a new connection has to complete the ZMTP handshake (greeting,
    /// security, READY) before it is closed (`ZMQ_HANDSHAKE_IVL`).
    pub handshake_timeout: Duration,
    /// Global bound on received bytes the application has not released (see
    /// [`BufferPermit`]); at the limit, the driver stops reading.
    pub max_buffered_bytes: usize,
    /// Messages the driver hands over before the receiver must read
    /// (capacity of the channel between them).
    pub queue_messages: usize,
    /// ZMTP heartbeats: ping every interval, drop a peer silent for three.
    pub heartbeat: Option<Duration>,
    /// libzmq I/O threads of the socket's context (`ZMQ_IO_THREADS`): its
    /// connections are spread over them, so a busy many-client socket is
    /// not held to one thread's TCP work.
    pub io_threads: usize,
    /// A [`Dealer`] takes the process's shared context for its
    /// `io_threads` instead of one of its own (a [`Router`] always has its
    /// own): for a process with many client sockets, such as the load
    /// generator, whose sockets otherwise each run an I/O thread.
    pub shared_context: bool,
}

impl Default for TransportLimits {
    fn default() -> Self {
        Self {
            // The protocol's default max_request_bytes (64 MiB) plus room for
            // the 64-byte-per-frame accounting of up to 1,100 frames and the
            // header.
            max_message_bytes: 65 << 20,
            max_frame_bytes: 64 << 20,
            max_frames: 1100,
            recv_hwm: 1000,
            send_hwm: 1000,
            handshake_timeout: Duration::from_secs(10),
            max_buffered_bytes: 1 << 30,
            queue_messages: 4096,
            heartbeat: Some(Duration::from_secs(10)),
            io_threads: 1,
            shared_context: false,
        }
    }
}

/// A CURVE key pair (Curve25519), raw 32-byte keys.
#[derive(Clone, PartialEq, Eq)]
pub struct CurveKeyPair {
    pub public: [u8; 32],
    pub secret: [u8; 32],
}

impl fmt::Debug for CurveKeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CurveKeyPair")
            .field("public", &z85_encode(&self.public))
            .field("secret", &"<hidden>")
            .finish()
    }
}

impl CurveKeyPair {
    /// A fresh key pair from libsodium's random source.
    pub fn generate() -> Result<Self, TransportError> {
        let pair = zmq::CurveKeyPair::new().map_err(|e| TransportError::Setup(e.to_string()))?;
        Ok(Self {
            public: pair.public_key,
            secret: pair.secret_key,
        })
    }

    /// The key pair of a secret key (public = Curve25519 base-point multiple).
    pub fn from_secret(secret: [u8; 32]) -> Result<Self, TransportError> {
        let z85 = z85_encode(&secret);
        let public = zmq::z85_decode(
            &curve_public(&z85)
                .map_err(|e| TransportError::Setup(format!("bad secret key: {e}")))?,
        )
        .map_err(|e| TransportError::Setup(e.to_string()))?;
        Ok(Self {
            public: public.try_into().expect("32-byte public key"),
            secret,
        })
    }
}

fn curve_public(secret_z85: &str) -> Result<String, String> {
    // The zmq crate does not wrap zmq_curve_public (libzmq derives the
    // public key with libsodium's crypto_scalarmult_base); call it directly.
    let secret = std::ffi::CString::new(secret_z85).map_err(|e| e.to_string())?;
    let mut public = [0 as std::os::raw::c_char; 41];
    extern "C" {
        fn zmq_curve_public(
            z85_public_key: *mut std::os::raw::c_char,
            z85_secret_key: *const std::os::raw::c_char,
        ) -> std::os::raw::c_int;
    }
    // SAFETY: both buffers are 41 bytes (40 Z85 characters + NUL) as the
    // function requires; the secret is NUL-terminated by CString.
    let rc = unsafe { zmq_curve_public(public.as_mut_ptr(), secret.as_ptr()) };
    if rc != 0 {
        return Err("zmq_curve_public failed (is CURVE built in?)".into());
    }
    // SAFETY: zmq_curve_public wrote a NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(public.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}

// Defined by the patched libzmq (epoll.cpp): a C `long`, read by each I/O
// thread every turn of its loop.
extern "C" {
    static replayd_zmq_io_spin_us: AtomicI64;
}

/// How long every libzmq I/O thread of this process keeps polling after it
/// last handled an event, before it sleeps (zero: it sleeps at once,
/// libzmq's behaviour). Applies at once to running sockets too; at most
/// 10 ms is taken.
pub fn set_io_spin(spin: Duration) {
    let us = spin.as_micros().min(10_000) as i64;
    // SAFETY: the patched libzmq defines the symbol as a `long` (64-bit on
    // the targets replayd builds for) that it only reads atomically.
    unsafe { replayd_zmq_io_spin_us.store(us, Ordering::Relaxed) }
}

/// Z85 text of a 32-byte key (40 characters), as pyzmq and libzmq tools print keys.
pub fn z85_encode(key: &[u8; 32]) -> String {
    zmq::z85_encode(key).expect("32 bytes is a multiple of 4")
}

/// A 32-byte key from its Z85 text.
pub fn z85_decode(text: &str) -> Result<[u8; 32], TransportError> {
    let bytes = zmq::z85_decode(text.trim())
        .map_err(|e| TransportError::Setup(format!("bad Z85 key: {e}")))?;
    bytes
        .try_into()
        .map_err(|_| TransportError::Setup("a CURVE key is 40 Z85 characters".into()))
}

/// How a socket authenticates (see the module docs).
#[derive(Debug, Clone, Default)]
pub enum Security {
    /// No authentication, no encryption (ZMTP NULL). For ipc:// and
    /// loopback-only deployments.
    #[default]
    None,
    /// Server side of CURVE: `keys` is the server's key pair; only clients
    /// whose public key is in `allowed_clients` complete the handshake (an
    /// empty list refuses everyone).
    CurveServer {
        keys: CurveKeyPair,
        allowed_clients: Vec<[u8; 32]>,
    },
    /// Client side of CURVE: the server's public key and the client's key pair.
    CurveClient {
        server_public: [u8; 32],
        keys: CurveKeyPair,
    },
}

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// Creating, configuring, binding or connecting the socket failed.
    #[error("{0}")]
    Setup(String),
    /// The socket's driver has stopped (all senders dropped and the socket
    /// closed, or an unexpected libzmq error); no more messages will come.
    #[error("the socket is closed")]
    Closed,
    /// One message was refused after receipt (too many frames or a frame too
    /// large). The socket goes on; the application may answer `peer`.
    #[error("message from a peer rejected: {reason}")]
    Rejected { peer: PeerId, reason: String },
}

/// Why a send did not happen. Sends never block.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SendError {
    /// The socket's driver has stopped.
    #[error("the socket is closed")]
    Closed,
    /// An empty message (a ZeroMQ message has at least one frame).
    #[error("a message needs at least one frame")]
    Empty,
}

/// The identity libzmq's ROUTER gave a connected peer (5 bytes by default).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PeerId(pub Bytes);

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId(")?;
        for b in self.0.iter() {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

/// A message received on a [`Router`]: the peer it came from and its frames
/// (after the identity: for a REQ peer the first frame is the empty
/// delimiter, which the application strips and echoes).
#[derive(Debug)]
pub struct Incoming {
    pub peer: PeerId,
    pub frames: Vec<Bytes>,
    /// Holds the message's bytes against `max_buffered_bytes`; drop it (or
    /// the whole `Incoming`) when done, or keep it to extend the bound.
    pub permit: BufferPermit,
    /// When the driver took it from libzmq ([`crate::clock::mono_ns`]): where
    /// a request's per-hop timings start.
    pub received_ns: u64,
}

/// A message received on a [`Dealer`].
#[derive(Debug)]
pub struct DealerIncoming {
    pub frames: Vec<Bytes>,
    pub permit: BufferPermit,
}

/// The received bytes of one message, counted against the socket's
/// `max_buffered_bytes` until this is dropped.
pub struct BufferPermit {
    bytes: usize,
    budget: Arc<Budget>,
}

impl fmt::Debug for BufferPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufferPermit({} bytes)", self.bytes)
    }
}

impl BufferPermit {
    /// Bytes this permit holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BufferPermit {
    fn drop(&mut self) {
        let before = self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        if before >= self.budget.max && before - self.bytes < self.budget.max {
            self.budget.notify.notify_one();
        }
    }
}

struct Budget {
    used: AtomicUsize,
    max: usize,
    notify: Notify,
}

impl Budget {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicUsize::new(0),
            max,
            notify: Notify::new(),
        })
    }

    fn available(&self) -> bool {
        self.used.load(Ordering::Acquire) < self.max
    }

    fn take(self: &Arc<Self>, bytes: usize) -> BufferPermit {
        self.used.fetch_add(bytes, Ordering::AcqRel);
        BufferPermit {
            bytes,
            budget: self.clone(),
        }
    }
}

/// Counters of one socket (cumulative since it was created).
#[derive(Debug, Default)]
pub struct TransportStats {
    messages_received: AtomicU64,
    bytes_received: AtomicU64,
    messages_sent: AtomicU64,
    dropped_sends: AtomicU64,
    unroutable_sends: AtomicU64,
    rejected_messages: AtomicU64,
    connections_accepted: AtomicU64,
    connections_established: AtomicU64,
    disconnects: AtomicU64,
    handshake_failures: AtomicU64,
    protocol_failures: AtomicU64,
    auth_failures: AtomicU64,
    reads_paused: AtomicU64,
    busy_ns: AtomicU64,
    wakes: AtomicU64,
}

/// A copy of [`TransportStats`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct StatsSnapshot {
    /// Messages taken from libzmq, each handed to the receiver half (a
    /// rejected one as a refusal) as it is counted. Every message that
    /// arrived before a disconnect is counted here before that disconnect
    /// is counted in `disconnects`.
    pub messages_received: u64,
    pub bytes_received: u64,
    pub messages_sent: u64,
    /// Sends dropped: a ROUTER's peer was at `send_hwm`, or a DEALER was
    /// dropped while messages still waited for a peer.
    pub dropped_sends: u64,
    /// ROUTER sends to a peer that is no longer connected.
    pub unroutable_sends: u64,
    /// Messages refused after receipt (`max_frames`, `max_frame_bytes`).
    pub rejected_messages: u64,
    /// Incoming TCP/ipc connections accepted (before any handshake).
    pub connections_accepted: u64,
    /// Connections that completed the ZMTP handshake (security included).
    pub connections_established: u64,
    /// Connections closed, for whatever reason: peer gone, heartbeat timeout,
    /// a message over `max_message_bytes` (libzmq reports no reason).
    pub disconnects: u64,
    /// Handshakes that failed without a protocol or auth error: the
    /// `handshake_timeout` expired, or the peer closed mid-handshake.
    pub handshake_failures: u64,
    /// Handshakes that failed on a ZMTP protocol error (bad greeting, wrong
    /// mechanism, ZMTP 1.0/2.0 peer, …).
    pub protocol_failures: u64,
    /// CURVE clients refused (key not allowed, or bad credentials).
    pub auth_failures: u64,
    /// Times the driver stopped reading because `max_buffered_bytes` was reached.
    pub reads_paused: u64,
    /// Time the driver task spent working (not waiting), in microseconds:
    /// over a window, its share of one core — the socket's serial stage.
    pub busy_us: u64,
    /// Times the driver woke up to work.
    pub wakes: u64,
}

impl TransportStats {
    /// A consistent-enough copy of every counter, with one guarantee:
    /// `messages_received` is read after `disconnects`, so it covers every message
    /// that arrived before the disconnects counted.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        // Pairs with the driver's Release increment, made after the
        // deliveries that precede the disconnect.
        let disconnects = self.disconnects.load(Ordering::Acquire);
        StatsSnapshot {
            messages_received: l(&self.messages_received),
            bytes_received: l(&self.bytes_received),
            messages_sent: l(&self.messages_sent),
            dropped_sends: l(&self.dropped_sends),
            unroutable_sends: l(&self.unroutable_sends),
            rejected_messages: l(&self.rejected_messages),
            connections_accepted: l(&self.connections_accepted),
            connections_established: l(&self.connections_established),
            disconnects,
            handshake_failures: l(&self.handshake_failures),
            protocol_failures: l(&self.protocol_failures),
            auth_failures: l(&self.auth_failures),
            reads_paused: l(&self.reads_paused),
            busy_us: l(&self.busy_ns) / 1000,
            wakes: l(&self.wakes),
        }
    }
}

impl std::ops::Add for StatsSnapshot {
    type Output = StatsSnapshot;

    /// Two sockets' counters as one's (the shards of one endpoint).
    fn add(self, o: StatsSnapshot) -> StatsSnapshot {
        StatsSnapshot {
            messages_received: self.messages_received + o.messages_received,
            bytes_received: self.bytes_received + o.bytes_received,
            messages_sent: self.messages_sent + o.messages_sent,
            dropped_sends: self.dropped_sends + o.dropped_sends,
            unroutable_sends: self.unroutable_sends + o.unroutable_sends,
            rejected_messages: self.rejected_messages + o.rejected_messages,
            connections_accepted: self.connections_accepted + o.connections_accepted,
            connections_established: self.connections_established + o.connections_established,
            disconnects: self.disconnects + o.disconnects,
            handshake_failures: self.handshake_failures + o.handshake_failures,
            protocol_failures: self.protocol_failures + o.protocol_failures,
            auth_failures: self.auth_failures + o.auth_failures,
            reads_paused: self.reads_paused + o.reads_paused,
            busy_us: self.busy_us + o.busy_us,
            wakes: self.wakes + o.wakes,
        }
    }
}

impl std::iter::Sum for StatsSnapshot {
    fn sum<I: Iterator<Item = StatsSnapshot>>(iter: I) -> StatsSnapshot {
        iter.fold(StatsSnapshot::default(), |a, b| a + b)
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What the driver hands the receiver half.
enum Received {
    /// Frames, their permit, and when the driver took them ([`crate::clock::mono_ns`]).
    Message(Vec<Bytes>, BufferPermit, u64),
    Rejected(Option<Bytes>, String),
}

/// A ROUTER socket, bound. Split it to receive and send from different tasks.
pub struct Router {
    endpoint: String,
    receiver: RouterReceiver,
    sender: RouterSender,
}

/// The receiving half of a [`Router`].
pub struct RouterReceiver {
    inbox: mpsc::Receiver<Received>,
    stats: Arc<TransportStats>,
}

/// The sending half of a [`Router`]; cheap to clone, usable from any task.
#[derive(Clone)]
pub struct RouterSender {
    outbox: mpsc::UnboundedSender<Vec<Bytes>>,
    stats: Arc<TransportStats>,
}

impl Router {
    /// A ROUTER on a free tcp port of 127.0.0.1, without security (tests).
    #[cfg(test)]
    pub(crate) async fn loopback(limits: &TransportLimits) -> Router {
        Router::bind("tcp://127.0.0.1:0", limits, &Security::None)
            .await
            .unwrap()
    }

    /// Binds a ROUTER at `endpoint` (`tcp://host:port`, port 0 for any free
    /// one, or `ipc:///path`).
    pub async fn bind(
        endpoint: &str,
        limits: &TransportLimits,
        security: &Security,
    ) -> Result<Router, TransportError> {
        let (endpoint, inbox, outbox, stats) = driver::start(
            driver::Kind::Router,
            driver::Attach::Bind(endpoint.to_string()),
            limits.clone(),
            security.clone(),
        )
        .await?;
        Ok(Router {
            endpoint,
            receiver: RouterReceiver {
                inbox,
                stats: stats.clone(),
            },
            sender: RouterSender { outbox, stats },
        })
    }

    /// Binds `shards` ROUTERs that serve one endpoint together: for a tcp
    /// endpoint on an IPv4 address (or `*`) and `shards > 1`, `shards`
    /// listening sockets bound to that address with `SO_REUSEPORT` (port 0:
    /// one free port for all), each served by its own ROUTER — its own
    /// libzmq context, I/O threads and driver task — with the same `limits`
    /// and `security`. Linux spreads incoming connections over them; a
    /// client's connection stays on one shard, so replies go out where its
    /// requests came in. A fixed port another socket is bound to is refused,
    /// as by [`Router::bind`], even when that socket has `SO_REUSEPORT`.
    ///
    /// Otherwise (ipc://, an interface name, `shards <= 1`) one ROUTER,
    /// exactly as [`Router::bind`]. Each shard reports the same endpoint.
    pub async fn bind_shards(
        endpoint: &str,
        shards: usize,
        limits: &TransportLimits,
        security: &Security,
    ) -> Result<Vec<Router>, TransportError> {
        let addr = match listen::shardable(endpoint) {
            Some(addr) if shards > 1 => addr,
            _ => return Ok(vec![Router::bind(endpoint, limits, security).await?]),
        };
        let fds = listen::listeners(endpoint, addr, shards)?;
        let mut routers = Vec::with_capacity(shards);
        // On an error the routers made so far are dropped (their drivers
        // close them) and the descriptors not yet handed over are closed.
        for fd in fds {
            let (endpoint, inbox, outbox, stats) = driver::start(
                driver::Kind::Router,
                driver::Attach::Listen(fd, endpoint.to_string()),
                limits.clone(),
                security.clone(),
            )
            .await?;
            routers.push(Router {
                endpoint,
                receiver: RouterReceiver {
                    inbox,
                    stats: stats.clone(),
                },
                sender: RouterSender { outbox, stats },
            });
        }
        Ok(routers)
    }

    /// The endpoint as bound (a tcp port 0 replaced by the real port).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The socket's counters (shared with both halves).
    pub fn stats(&self) -> Arc<TransportStats> {
        self.sender.stats.clone()
    }

    pub fn split(self) -> (RouterReceiver, RouterSender) {
        (self.receiver, self.sender)
    }
}

impl RouterReceiver {
    /// The next message. [`TransportError::Rejected`] is about one message
    /// only; [`TransportError::Closed`] is final.
    pub async fn recv(&mut self) -> Result<Incoming, TransportError> {
        match self.inbox.recv().await {
            Some(Received::Message(mut frames, permit, received_ns)) => {
                let peer = PeerId(frames.remove(0));
                Ok(Incoming {
                    peer,
                    frames,
                    permit,
                    received_ns,
                })
            }
            Some(Received::Rejected(peer, reason)) => Err(TransportError::Rejected {
                peer: PeerId(peer.unwrap_or_default()),
                reason,
            }),
            None => Err(TransportError::Closed),
        }
    }

    pub fn stats(&self) -> Arc<TransportStats> {
        self.stats.clone()
    }
}

impl RouterSender {
    /// Queues `frames` for `peer` and returns at once. The driver sends it
    /// without waiting; if `peer` is at its `send_hwm` the message is dropped
    /// and counted (`dropped_sends`), if `peer` has gone it is counted in
    /// `unroutable_sends`.
    pub fn send(&self, peer: &PeerId, frames: Vec<Bytes>) -> Result<(), SendError> {
        if frames.is_empty() {
            return Err(SendError::Empty);
        }
        let mut message = Vec::with_capacity(frames.len() + 1);
        message.push(peer.0.clone());
        message.extend(frames);
        self.outbox.send(message).map_err(|_| SendError::Closed)
    }

    pub fn stats(&self) -> Arc<TransportStats> {
        self.stats.clone()
    }
}

/// A DEALER socket, connected or bound.
pub struct Dealer {
    endpoint: String,
    receiver: DealerReceiver,
    sender: DealerSender,
}

/// The receiving half of a [`Dealer`].
pub struct DealerReceiver {
    inbox: mpsc::Receiver<Received>,
    stats: Arc<TransportStats>,
}

/// The sending half of a [`Dealer`]; cheap to clone.
#[derive(Clone)]
pub struct DealerSender {
    outbox: mpsc::UnboundedSender<Vec<Bytes>>,
    stats: Arc<TransportStats>,
}

impl Dealer {
    /// Connects to `endpoint`. As with any ZeroMQ socket the connection is
    /// made (and remade after a loss) in the background: messages sent before
    /// it is up wait in the send queue, up to `send_hwm`.
    pub async fn connect(
        endpoint: &str,
        limits: &TransportLimits,
        security: &Security,
    ) -> Result<Dealer, TransportError> {
        Self::start(
            driver::Attach::Connect(endpoint.to_string()),
            limits,
            security,
        )
        .await
    }

    /// Binds a DEALER at `endpoint` (the daemon's end of the worker link).
    /// Until a peer connects, sends wait in the driver (libzmq has no pipe
    /// to queue them in yet); if both halves are dropped first, they are
    /// dropped and counted.
    pub async fn bind(
        endpoint: &str,
        limits: &TransportLimits,
        security: &Security,
    ) -> Result<Dealer, TransportError> {
        Self::start(driver::Attach::Bind(endpoint.to_string()), limits, security).await
    }

    async fn start(
        attach: driver::Attach,
        limits: &TransportLimits,
        security: &Security,
    ) -> Result<Dealer, TransportError> {
        let (endpoint, inbox, outbox, stats) = driver::start(
            driver::Kind::Dealer,
            attach,
            limits.clone(),
            security.clone(),
        )
        .await?;
        Ok(Dealer {
            endpoint,
            receiver: DealerReceiver {
                inbox,
                stats: stats.clone(),
            },
            sender: DealerSender { outbox, stats },
        })
    }

    /// The endpoint (for a bind, as bound, with the real tcp port).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn stats(&self) -> Arc<TransportStats> {
        self.sender.stats.clone()
    }

    pub fn split(self) -> (DealerReceiver, DealerSender) {
        (self.receiver, self.sender)
    }
}

impl DealerReceiver {
    /// The next message; [`TransportError::Closed`] is final.
    pub async fn recv(&mut self) -> Result<DealerIncoming, TransportError> {
        match self.inbox.recv().await {
            Some(Received::Message(frames, permit, _)) => Ok(DealerIncoming { frames, permit }),
            Some(Received::Rejected(_, reason)) => Err(TransportError::Rejected {
                peer: PeerId(Bytes::new()),
                reason,
            }),
            None => Err(TransportError::Closed),
        }
    }

    pub fn stats(&self) -> Arc<TransportStats> {
        self.stats.clone()
    }
}

impl DealerSender {
    /// Queues `frames` and returns at once. Messages go out in order; while
    /// the peer is at `send_hwm` (or a bound DEALER has no peer yet) they
    /// wait in the driver rather than being dropped.
    pub fn send(&self, frames: Vec<Bytes>) -> Result<(), SendError> {
        if frames.is_empty() {
            return Err(SendError::Empty);
        }
        self.outbox.send(frames).map_err(|_| SendError::Closed)
    }

    pub fn stats(&self) -> Arc<TransportStats> {
        self.stats.clone()
    }
}
