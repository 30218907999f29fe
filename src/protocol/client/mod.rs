//! An async Rust client for the wire protocol (`docs/protocol.md`).
//!
//! One [`Client`] holds one DEALER socket per daemon endpoint. Any number of
//! requests may be in flight at once, from any number of tasks; each send
//! gets a fresh wire id and replies are matched by it, in whatever order
//! they come. The client spreads requests over the healthy endpoints (the
//! one with the fewest requests outstanding), and re-sends a request whose
//! daemon went away — replayd requests are pure functions of their input,
//! so sending one twice is harmless.
//!
//! ```no_run
//! # async fn demo() -> Result<(), replayd::protocol::client::Error> {
//! use replayd::protocol::client::{Call, Client, ClientOptions};
//! use std::time::Duration;
//!
//! // One daemon, default options:
//! let client = Client::connect("tcp://127.0.0.1:5555").await?;
//! let emb = client.embed_texts("all-MiniLM-L6-v2", &["replay the graph", "pad to the bucket"]).await?;
//! assert_eq!((emb.rows, emb.cols), (2, 384));
//! let first: &[f32] = emb.row(0);
//!
//! // Two daemons, a per-request deadline and priority:
//! let client = Client::connect_with(
//!     &["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"],
//!     ClientOptions { liveness_timeout: Duration::from_secs(5), ..ClientOptions::default() },
//! )
//! .await?;
//! let out = client
//!     .call(Call::texts("all-MiniLM-L6-v2", ["urgent query"]).priority(10).timeout(Duration::from_millis(50)))
//!     .await?;
//! println!("ran in {} on {} ({})", out.header.bucket.unwrap_or_default(), out.endpoint, out.header.total_us);
//! # let _ = first; Ok(()) }
//! ```
//!
//! # Failure semantics
//!
//! (The same as the Python client's, `clients/python/README.md`.)
//!
//! A typed call ([`Client::call`], [`Client::embed_texts`], [`Client::embed_ids`],
//! [`Client::infer_f32`]) sends each request at most
//! [`ClientOptions::max_attempts`] times, each send with a fresh wire id; the
//! first reply to any of its sends settles it. It **re-sends** on:
//!
//! * **connection lost** — the daemon was killed, crashed or restarted, or
//!   the TCP connection reset (a ZeroMQ disconnect): every request in flight
//!   on that connection is sent again at once to another connected endpoint,
//!   or, with none, as soon as one connects (the same daemon restarted on the
//!   same address counts: libzmq reconnects by itself);
//! * **`unavailable`** — the daemon is draining: that endpoint gets no new
//!   requests for [`ClientOptions::unavailable_backoff`], and the request
//!   goes at once to another endpoint, or back after the back-off;
//! * **`overloaded`** — after a jittered exponential back-off
//!   ([`ClientOptions::overload_backoff`], doubling, at most
//!   [`ClientOptions::overload_backoff_max`]), to another endpoint if there is one;
//! * **silence** — an endpoint with requests outstanding that has sent
//!   nothing for [`ClientOptions::liveness_timeout`] is *suspect*: new
//!   requests avoid it and its outstanding requests are sent again to another
//!   healthy endpoint (the first send stays outstanding; the first reply
//!   wins). With no other endpoint nothing is re-sent. Any reply clears the mark.
//!
//! It **never re-sends** on `bad_request`, `unknown_model`, `too_long`,
//! `deadline_exceeded`, `internal` (the daemon already re-ran the batch) or a
//! malformed reply: those are returned as [`Error::Server`] (or
//! [`Error::Protocol`]) at once.
//!
//! No call waits longer than its timeout ([`Call::timeout`], default
//! [`ClientOptions::timeout`]); the time left is sent with every send as
//! `timeout_us`, so the daemon gives up at the same moment. At the timeout a
//! call fails with [`Error::Timeout`] when some endpoint is connected, or
//! [`Error::NoHealthyEndpoint`] when none is. A request that used up its
//! attempts fails with its last error ([`Error::ConnectionLost`], or
//! [`Error::Server`] with `overloaded` / `unavailable`) and `attempts` says
//! how many sends were made. A request due to be re-sent after its
//! [`Call::deadline`] fails with `deadline_exceeded` instead. A call whose
//! future is dropped is abandoned: its late replies are counted in
//! [`Client::stray_replies`] and dropped.
//!
//! So a daemon restart under a connected client is invisible to calls whose
//! timeout covers the restart (in-flight requests are re-sent, later calls
//! succeed); with `max_attempts = 1`, in-flight requests fail at once with
//! [`Error::ConnectionLost`]. A daemon that is still starting accepts
//! connections and queues requests until its graphs are captured: that time
//! counts against the timeout.
//!
//! Endpoint choice: among connected endpoints that are neither suspect nor
//! draining, the one with the fewest requests outstanding (ties: round
//! robin). If every connected endpoint is suspect, the suspect ones are used.
//!
//! The low-level [`Client::request`] (and [`Client::embed`] /
//! [`Client::infer`], which use it) sends once and returns whatever reply
//! comes, error replies included, as a [`Response`]; a lost connection is
//! [`Error::ConnectionLost`] and silence past the timeout [`Error::Timeout`].
//! [`RawClient`] sends arbitrary frames and returns whatever comes back (for
//! protocol tests and tools).
//!
//! Connection details: one DEALER per endpoint, `ZMQ_LINGER = 0`, no ZMTP
//! heartbeats; connection state comes from libzmq's socket monitor (a
//! handshake done is *connected*, a disconnect is *lost*), polled every
//! [`MONITOR_TICK`]. A disconnect fails only the sends whose replies had not
//! arrived before it: the transport hands over every message that came
//! before a disconnect before it counts the disconnect, and the client fails
//! the endpoint's outstanding sends once it has read that far, so a daemon
//! that answers everything and then exits loses no reply. CURVE:
//! [`ClientOptions::security`] = [`Security::CurveClient`].
//!
//! Layout: this file holds the public types and the send/retry loop of a
//! call; `endpoints.rs` the state the calls, the reply readers and the
//! monitor share (connection and liveness of each endpoint, the outstanding
//! sends, the choice of endpoint).

use crate::protocol::{
    decode_reply, encode_request, ErrorCode, InputKind, Payload, ReplyData, ReplyHeader,
    RequestHeader, SparseRows, Status,
};
use crate::tensor::{DType, HostTensor};
use crate::transport::{Dealer, DealerReceiver, DealerSender, Security, TransportLimits};
use bytes::Bytes;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use thiserror::Error;
use tokio::sync::mpsc;

mod endpoints;

pub use endpoints::EndpointStats;
use endpoints::{read_replies, Decoded, Outcome, Pick, Shared};

/// How often connection state (libzmq monitor events) and liveness are checked.
pub const MONITOR_TICK: Duration = Duration::from_millis(5);

/// Everything a call can fail with.
#[derive(Clone, Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// The daemon answered with an error code (see `docs/protocol.md`).
    #[error("{code}: {message} (from {endpoint}{})", attempts_note(.attempts))]
    Server {
        code: ErrorCode,
        message: String,
        /// The endpoint that answered (empty when the client decided, e.g. a
        /// deadline that passed before a re-send).
        endpoint: String,
        /// Sends made for this request.
        attempts: u32,
    },
    /// The daemon answered with an error code this client does not know (a
    /// later protocol version); never retried.
    #[error("{code}: {message} (from {endpoint})")]
    UnknownCode {
        code: String,
        message: String,
        endpoint: String,
    },
    /// No reply within the call's timeout while some endpoint was connected.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The timeout passed while no endpoint was connected.
    #[error("no endpoint connected within {0:?}")]
    NoHealthyEndpoint(Duration),
    /// The request was lost with its daemon's connection on every attempt
    /// (or on its only attempt, for [`Client::request`]).
    #[error("the connection to {endpoint} was lost with the request{}", attempts_note(.attempts))]
    ConnectionLost { endpoint: String, attempts: u32 },
    /// The client's sockets are closed.
    #[error("the client is closed")]
    Closed,
    /// A socket could not be created or connected (a malformed endpoint,
    /// bad CURVE keys).
    #[error("cannot connect to {endpoint}: {message}")]
    Connect { endpoint: String, message: String },
    /// A reply that does not follow the protocol; never retried.
    #[error("malformed reply from {endpoint}: {message}")]
    Protocol { endpoint: String, message: String },
    /// An argument refused before anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn attempts_note(attempts: &u32) -> String {
    if *attempts > 1 {
        format!("; gave up after {attempts} attempts")
    } else {
        String::new()
    }
}

impl Error {
    /// The protocol error code, for [`Error::Server`].
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The former name of [`enum@Error`].
pub type ClientError = Error;

/// Bytes left under `max_request_bytes` for a request's header.
const HEADER_ROOM: usize = 4096;

/// A client's settings; `ClientOptions::default()` mirrors the Python client.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// How long a call waits for its reply unless the call says otherwise.
    pub timeout: Duration,
    /// Sends per request at most (the first and the re-sends).
    pub max_attempts: u32,
    /// Silence after which an endpoint with requests outstanding is suspect.
    /// Set it above the longest a single request can take.
    pub liveness_timeout: Duration,
    /// First back-off after `overloaded` (doubles, jittered).
    pub overload_backoff: Duration,
    pub overload_backoff_max: Duration,
    /// How long an endpoint that answered `unavailable` gets no new requests.
    pub unavailable_backoff: Duration,
    /// Most items per request in [`Client::embed_texts`] / [`Client::embed_ids`] /
    /// [`Client::infer_f32`] (larger inputs go as several requests, all in
    /// flight at once); at most the daemon's `server.max_items_per_request`.
    pub max_items_per_request: usize,
    /// Most payload bytes per request in the same calls; at most the
    /// daemon's `server.max_request_bytes`.
    pub max_request_bytes: usize,
    /// `Security::None`, or `Security::CurveClient` for a daemon with CURVE.
    pub security: Security,
    /// The sockets' limits (replies can be large: a 1,024 × 384 f32 reply is 1.5 MiB).
    pub limits: TransportLimits,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            max_attempts: 4,
            liveness_timeout: Duration::from_secs(30),
            overload_backoff: Duration::from_millis(50),
            overload_backoff_max: Duration::from_secs(2),
            unavailable_backoff: Duration::from_secs(1),
            max_items_per_request: 1024,
            max_request_bytes: 64 << 20,
            security: Security::None,
            limits: client_limits(),
        }
    }
}

/// A client's socket limits: replies as large as the daemon may send.
pub fn client_limits() -> TransportLimits {
    TransportLimits {
        max_message_bytes: u32::MAX as usize,
        max_frame_bytes: 1 << 31,
        max_frames: 4,
        heartbeat: None,
        ..TransportLimits::default()
    }
}

/// A reply: its header and, on success, the output tensor (or, from a
/// sparse encoder, its rows' non-zero entries).
#[derive(Clone, Debug)]
pub struct Response {
    pub header: ReplyHeader,
    pub output: Option<HostTensor>,
    pub sparse: Option<SparseRows>,
}

impl Response {
    fn new(header: ReplyHeader, data: Option<ReplyData>) -> Response {
        let (output, sparse) = match data {
            Some(ReplyData::Dense(t)) => (Some(t), None),
            Some(ReplyData::Sparse(s)) => (None, Some(s)),
            None => (None, None),
        };
        Response {
            header,
            output,
            sparse,
        }
    }
}

/// A successful typed call.
#[derive(Clone, Debug)]
pub struct Output {
    /// The output tensor, `[rows, dim]`, in the dtype the call asked for.
    pub tensor: HostTensor,
    /// The reply header (bucket, device, batches, timings).
    pub header: ReplyHeader,
    /// The endpoint that answered.
    pub endpoint: String,
    /// Sends made for this request (1 unless it was re-sent).
    pub attempts: u32,
}

/// A successful call to a sparse encoder ([`Client::call_sparse`]).
#[derive(Clone, Debug)]
pub struct SparseOutput {
    /// Each row's non-zero entries (values widened to f32).
    pub rows: SparseRows,
    pub header: ReplyHeader,
    pub endpoint: String,
    pub attempts: u32,
}

impl Output {
    /// The output as f32 rows (f16 outputs are widened).
    pub fn matrix(&self) -> Matrix {
        Matrix::from_tensor(&self.tensor)
    }
}

/// Rows of f32 values, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    fn from_tensor(t: &HostTensor) -> Matrix {
        let data = match t.dtype {
            DType::F16 => t
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => crate::tensor::f32s_from_le(&t.data),
        };
        Matrix {
            rows: t.shape.first().copied().unwrap_or(0),
            cols: t.shape.get(1).copied().unwrap_or(1),
            data,
        }
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn iter_rows(&self) -> impl Iterator<Item = &[f32]> {
        self.data.chunks(self.cols.max(1))
    }
}

/// One request, built up with its options; run it with [`Client::call`].
#[derive(Clone, Debug)]
pub struct Call {
    model: String,
    input: InputKind,
    payload: Payload,
    priority: u8,
    timeout: Option<Duration>,
    deadline: Option<SystemTime>,
    truncate: bool,
    output_dtype: DType,
    dimensions: Option<u32>,
    top_k: Option<u32>,
}

impl Call {
    fn new(model: impl Into<String>, input: InputKind, payload: Payload) -> Call {
        Call {
            model: model.into(),
            input,
            payload,
            priority: 0,
            timeout: None,
            deadline: None,
            truncate: true,
            output_dtype: DType::F32,
            dimensions: None,
            top_k: None,
        }
    }

    /// Texts for an encoder model (`input = "texts"`).
    pub fn texts<S: Into<String>>(
        model: impl Into<String>,
        texts: impl IntoIterator<Item = S>,
    ) -> Call {
        let texts = texts.into_iter().map(Into::into).collect();
        Call::new(model, InputKind::Texts, Payload::Texts(texts))
    }

    /// Token-id sequences, special tokens included (`input = "ids"`).
    pub fn ids(model: impl Into<String>, sequences: Vec<Vec<u32>>) -> Call {
        Call::new(model, InputKind::Ids, Payload::Ids(sequences))
    }

    /// A `[rows, features]` tensor for an MLP (`input = "tensor"`).
    pub fn tensor(model: impl Into<String>, tensor: HostTensor) -> Call {
        Call::new(model, InputKind::Tensor, Payload::Tensor(tensor))
    }

    /// Higher runs first among queued requests of the same model (default 0).
    pub fn priority(mut self, priority: u8) -> Call {
        self.priority = priority;
        self
    }

    /// How long this call may take in all (default: [`ClientOptions::timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Call {
        self.timeout = Some(timeout);
        self
    }

    /// An absolute deadline, sent as `deadline_unix_us`; a request due to
    /// be re-sent after it fails with `deadline_exceeded`.
    pub fn deadline(mut self, deadline: SystemTime) -> Call {
        self.deadline = Some(deadline);
        self
    }

    /// Truncate texts over the model's maximum (default true); `false`
    /// makes such a text fail the request with `too_long`.
    pub fn truncate(mut self, truncate: bool) -> Call {
        self.truncate = truncate;
        self
    }

    /// `DType::F32` (default) or `DType::F16`.
    pub fn output_dtype(mut self, dtype: DType) -> Call {
        self.output_dtype = dtype;
        self
    }

    /// Embedding models: keep the first `n` values of each embedding
    /// (Matryoshka), normalised again when the model normalises.
    pub fn dimensions(mut self, n: u32) -> Call {
        self.dimensions = Some(n);
        self
    }

    /// Sparse encoders: keep each row's `k` largest entries.
    pub fn top_k(mut self, k: u32) -> Call {
        self.top_k = Some(k);
        self
    }
}

/// A pipelining, multi-endpoint client; see the module docs.
pub struct Client {
    shared: Arc<Shared>,
    options: ClientOptions,
    next_id: AtomicU64,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Client {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// How a call treats replies.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// Typed calls: retries as the module docs say.
    Retry,
    /// [`Client::request`]: one send, any reply returned.
    Once,
}

/// Removes a call's outstanding sends when the call ends or is dropped.
struct CallGuard<'a> {
    shared: &'a Shared,
    live: HashSet<u64>,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        for w in self.live.drain() {
            self.shared.forget(w);
        }
    }
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A little jitter without a random-number crate: ±25 % from the clock.
fn jitter(d: Duration, salt: u64) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos() as u64);
    let x = (nanos ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) % 1000;
    d.mul_f64(0.75 + x as f64 / 2000.0)
}

impl Client {
    /// Connects to one endpoint with the default options (see
    /// [`Client::connect_with`]). The connection is made in the background:
    /// this returns at once, and calls wait (within their timeout) until it is up.
    pub async fn connect(endpoint: &str) -> Result<Client, Error> {
        Self::connect_with(&[endpoint], ClientOptions::default()).await
    }

    /// Connects to every endpoint (`tcp://host:port`, `ipc:///path`); each
    /// entry may also be a comma-separated list.
    pub async fn connect_with<S: AsRef<str>>(
        endpoints: &[S],
        options: ClientOptions,
    ) -> Result<Client, Error> {
        let (mut client, receivers) = Self::open(endpoints, options).await?;
        for (i, recv) in receivers.into_iter().enumerate() {
            let reader = read_replies(client.shared.clone(), i, recv);
            client.tasks.push(tokio::spawn(reader));
        }
        Ok(client)
    }

    /// A client with its sockets and monitor task but no reply readers: the
    /// receivers come back, one per endpoint, in order (tests start their
    /// readers late).
    async fn open<S: AsRef<str>>(
        endpoints: &[S],
        options: ClientOptions,
    ) -> Result<(Client, Vec<DealerReceiver>), Error> {
        let addresses: Vec<String> = endpoints
            .iter()
            .flat_map(|e| e.as_ref().split(','))
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        if addresses.is_empty() {
            return Err(Error::InvalidArgument("no endpoint given".into()));
        }
        if options.max_attempts == 0 {
            return Err(Error::InvalidArgument(
                "max_attempts must be at least 1".into(),
            ));
        }
        let mut sockets = Vec::new();
        for address in addresses {
            let socket = Dealer::connect(&address, &options.limits, &options.security)
                .await
                .map_err(|e| Error::Connect {
                    endpoint: address.clone(),
                    message: e.to_string(),
                })?;
            sockets.push((address, socket));
        }
        let (shared, receivers) = Shared::new(
            sockets,
            options.liveness_timeout,
            options.unavailable_backoff,
        );
        let shared = Arc::new(shared);
        let monitor = shared.clone();
        let tasks = vec![tokio::spawn(async move {
            let mut tick = tokio::time::interval(MONITOR_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                monitor.tick();
            }
        })];
        // The first tick right away, so a daemon that is up is seen at once.
        shared.tick();
        let client = Client {
            shared,
            options,
            next_id: AtomicU64::new(1),
            tasks,
        };
        Ok((client, receivers))
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> Vec<String> {
        self.shared.addresses()
    }

    /// Per endpoint: connection state and counters.
    pub fn stats(&self) -> Vec<EndpointStats> {
        self.shared.stats()
    }

    /// Waits until one endpoint (`every`: all of them) is connected; false
    /// at the timeout. Calls do not need it: they wait by themselves.
    pub async fn wait_connected(&self, timeout: Duration, every: bool) -> bool {
        let end = Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            if self.shared.connected(every) {
                return true;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let _ = tokio::time::timeout(left.min(MONITOR_TICK * 4), notified).await;
        }
    }

    /// Replies received that matched no outstanding send (late replies of
    /// abandoned or re-sent requests).
    pub fn stray_replies(&self) -> u64 {
        self.shared.stray_replies()
    }

    /// A fresh id for [`Client::request`] headers (unique on this client).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs one request with the retries of the module docs.
    pub async fn call(&self, call: Call) -> Result<Output, Error> {
        let model = call.model.clone();
        let (data, header, endpoint, attempts) = self.call_data(call).await?;
        match data {
            ReplyData::Dense(tensor) => Ok(Output {
                tensor,
                header,
                endpoint,
                attempts,
            }),
            ReplyData::Sparse(_) => Err(Error::InvalidArgument(format!(
                "model {model} is a sparse encoder: its rows come back with call_sparse or embed_sparse"
            ))),
        }
    }

    /// Runs one request to a sparse encoder (SPLADE): each row's non-zero
    /// entries, or its [`Call::top_k`] largest.
    pub async fn call_sparse(&self, call: Call) -> Result<SparseOutput, Error> {
        let model = call.model.clone();
        let (data, header, endpoint, attempts) = self.call_data(call).await?;
        match data {
            ReplyData::Sparse(rows) => Ok(SparseOutput {
                rows,
                header,
                endpoint,
                attempts,
            }),
            ReplyData::Dense(_) => Err(Error::InvalidArgument(format!(
                "model {model} returns dense rows: use call or embed_texts"
            ))),
        }
    }

    /// Sparse-encodes texts: one row of (index, weight) entries per text,
    /// in order; `top_k` keeps each row's largest.
    pub async fn embed_sparse<S: Into<String>>(
        &self,
        model: &str,
        texts: impl IntoIterator<Item = S>,
        top_k: Option<u32>,
    ) -> Result<SparseRows, Error> {
        let mut call = Call::texts(model, texts);
        call.top_k = top_k;
        Ok(self.call_sparse(call).await?.rows)
    }

    async fn call_data(&self, call: Call) -> Result<(ReplyData, ReplyHeader, String, u32), Error> {
        // The daemon drops the connection on a message over its limit, with
        // no reply (libzmq refuses it before reading the body): say so now
        // rather than after the timeout.
        let bytes = call.payload.wire_bytes();
        let limit = self.options.max_request_bytes.saturating_sub(HEADER_ROOM);
        if bytes > limit {
            return Err(Error::InvalidArgument(format!(
                "the request carries {bytes} bytes, more than fits under max_request_bytes = {} (the daemon's server.max_request_bytes, less {HEADER_ROOM} for the header); the daemon would drop the connection without a reply: send less per call (embed_texts splits long lists) or raise both limits",
                self.options.max_request_bytes
            )));
        }
        let timeout = call.timeout.unwrap_or(self.options.timeout);
        let mut header = RequestHeader::new(0, call.model, call.input);
        header.priority = call.priority;
        header.truncate = call.truncate;
        if call.output_dtype != DType::F32 {
            header.output_dtype = Some(call.output_dtype);
        }
        header.dimensions = call.dimensions;
        header.top_k = call.top_k;
        header.deadline_unix_us = call.deadline.map(unix_us);
        if let Payload::Tensor(t) = &call.payload {
            header.dtype = Some(t.dtype);
            header.shape = Some(t.shape.iter().map(|&d| d as u64).collect());
        }
        let (reply, endpoint, attempts) = self
            .run(header, &call.payload, timeout, call.deadline, Policy::Retry)
            .await?;
        let (header, data) = reply;
        match (header.status, data) {
            (Status::Ok, Some(data)) => Ok((data, header, endpoint, attempts)),
            _ => Err(Error::Protocol {
                endpoint,
                message: "an ok reply without a tensor".into(),
            }),
        }
    }

    /// Embeds texts with an encoder model: one row per text, in order.
    /// Inputs over [`ClientOptions::max_items_per_request`] (or
    /// `max_request_bytes`) go as several requests, all in flight at once;
    /// the first that fails for good fails the call.
    pub async fn embed_texts<S: AsRef<str>>(
        &self,
        model: &str,
        texts: &[S],
    ) -> Result<Matrix, Error> {
        let texts: Vec<String> = texts.iter().map(|t| t.as_ref().to_string()).collect();
        let lens: Vec<usize> = texts.iter().map(String::len).collect();
        let chunks = self.chunks(&lens);
        let mut rest = texts.into_iter();
        let calls = chunks
            .into_iter()
            .map(|n| Call::texts(model, rest.by_ref().take(n).collect::<Vec<_>>()))
            .collect();
        self.gather(calls).await
    }

    /// Embeds token-id sequences (special tokens included), as [`Client::embed_texts`].
    pub async fn embed_ids(&self, model: &str, sequences: &[Vec<u32>]) -> Result<Matrix, Error> {
        let lens: Vec<usize> = sequences.iter().map(|s| 4 * s.len()).collect();
        let chunks = self.chunks(&lens);
        let mut rest = sequences.iter().cloned();
        let calls = chunks
            .into_iter()
            .map(|n| Call::ids(model, rest.by_ref().take(n).collect()))
            .collect();
        self.gather(calls).await
    }

    /// Runs an MLP on `rows` f32 rows of `features` values each (`data` is
    /// row-major), as [`Client::embed_texts`].
    pub async fn infer_f32(
        &self,
        model: &str,
        features: usize,
        data: &[f32],
    ) -> Result<Matrix, Error> {
        if features == 0 || !data.len().is_multiple_of(features) || data.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{} values are not whole rows of {features} features",
                data.len()
            )));
        }
        let rows = data.len() / features;
        let chunks = self.chunks(&vec![4 * features; rows]);
        let mut start = 0;
        let calls = chunks
            .into_iter()
            .map(|n| {
                let t = HostTensor::from_f32(
                    vec![n, features],
                    &data[start * features..(start + n) * features],
                );
                start += n;
                Call::tensor(model, t)
            })
            .collect();
        self.gather(calls).await
    }

    /// Splits items of these payload sizes into request-sized runs.
    fn chunks(&self, sizes: &[usize]) -> Vec<usize> {
        let o = &self.options;
        let (max_items, max_bytes) = (
            o.max_items_per_request.max(1),
            o.max_request_bytes.saturating_sub(HEADER_ROOM).max(1),
        );
        let mut out = Vec::new();
        let (mut n, mut bytes) = (0usize, 0usize);
        for &s in sizes {
            if n > 0 && (n == max_items || bytes + s > max_bytes) {
                out.push(n);
                n = 0;
                bytes = 0;
            }
            n += 1;
            bytes += s;
        }
        if n > 0 {
            out.push(n);
        }
        out
    }

    async fn gather(&self, calls: Vec<Call>) -> Result<Matrix, Error> {
        if calls.is_empty() {
            return Err(Error::InvalidArgument("no input".into()));
        }
        let outputs =
            futures::future::try_join_all(calls.into_iter().map(|c| self.call(c))).await?;
        let mut data = Vec::new();
        let mut rows = 0;
        let mut cols = 0;
        for o in outputs {
            let m = o.matrix();
            rows += m.rows;
            cols = m.cols;
            data.extend(m.data);
        }
        Ok(Matrix { rows, cols, data })
    }

    /// Sends a request once and waits for its reply, whatever it says (error
    /// replies are `Ok` with `header.status == Status::Error`). The client
    /// sends it under its own wire id and gives `header.id` back in the
    /// reply. A lost connection is [`Error::ConnectionLost`]; no reply
    /// within `timeout`, [`Error::Timeout`] (or [`Error::NoHealthyEndpoint`]).
    pub async fn request(
        &self,
        header: &RequestHeader,
        payload: &Payload,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let ((mut header_out, data), _, _) = self
            .run(header.clone(), payload, timeout, None, Policy::Once)
            .await?;
        header_out.id = header.id;
        Ok(Response::new(header_out, data))
    }

    /// Runs an MLP-style model on rows, once (see [`Client::request`]).
    pub async fn infer(
        &self,
        model: &str,
        input: &HostTensor,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let mut header = RequestHeader::new(self.next_id(), model, InputKind::Tensor);
        header.dtype = Some(input.dtype);
        header.shape = Some(input.shape.iter().map(|&d| d as u64).collect());
        self.request(&header, &Payload::Tensor(input.clone()), timeout)
            .await
    }

    /// Embeds texts, once (see [`Client::request`]).
    pub async fn embed(
        &self,
        model: &str,
        texts: &[&str],
        output_dtype: DType,
        timeout: Duration,
    ) -> Result<Response, Error> {
        let mut header = RequestHeader::new(self.next_id(), model, InputKind::Texts);
        header.output_dtype = Some(output_dtype);
        let payload = Payload::Texts(texts.iter().map(|t| t.to_string()).collect());
        self.request(&header, &payload, timeout).await
    }

    /// The send/retry loop of one request.
    async fn run(
        &self,
        mut header: RequestHeader,
        payload: &Payload,
        timeout: Duration,
        deadline: Option<SystemTime>,
        policy: Policy,
    ) -> Result<((ReplyHeader, Option<ReplyData>), String, u32), Error> {
        let shared = &*self.shared;
        let opts = &self.options;
        let started = Instant::now();
        let end = started + timeout;
        let max_attempts = match policy {
            Policy::Retry => opts.max_attempts,
            Policy::Once => 1,
        };
        // The payload frames once; only the header changes per send.
        let mut frames = encode_request(&header, payload);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut guard = CallGuard {
            shared,
            live: HashSet::new(),
        };
        let mut attempts = 0u32;
        let mut used: HashSet<usize> = HashSet::new();
        let mut retry_at: Option<Instant> = None;
        let mut want_send = true;
        let mut backoff = opts.overload_backoff;
        let mut last_error: Option<Error> = None;
        loop {
            if want_send && attempts >= max_attempts {
                if guard.live.is_empty() {
                    return Err(last_error.unwrap_or(Error::Timeout(timeout)));
                }
                want_send = false;
            }
            // Send when a send is due and allowed.
            if want_send && retry_at.is_none_or(|t| t <= Instant::now()) {
                if deadline.is_some_and(|d| SystemTime::now() >= d) && attempts > 0 {
                    if guard.live.is_empty() {
                        return Err(Error::Server {
                            code: ErrorCode::DeadlineExceeded,
                            message: "the deadline passed before the request could be sent again"
                                .into(),
                            endpoint: String::new(),
                            attempts,
                        });
                    }
                    want_send = false;
                } else {
                    let notified = shared.changed.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    match shared.pick(&used).0 {
                        Pick::Go(ep) => {
                            let wire = shared.next_wire();
                            header.id = wire;
                            if policy == Policy::Retry {
                                // The time left, so the daemon gives up when we do.
                                let left = end.saturating_duration_since(Instant::now());
                                header.timeout_us = Some((left.as_micros() as u64).max(1));
                            }
                            frames[0] = Bytes::from(
                                rmp_serde::to_vec_named(&header)
                                    .expect("request header serialises"),
                            );
                            if !shared.send(ep, wire, frames.clone(), &tx, attempts > 0) {
                                return Err(Error::Closed);
                            }
                            guard.live.insert(wire);
                            used.insert(ep);
                            attempts += 1;
                            want_send = false;
                            retry_at = None;
                        }
                        Pick::WaitUntil(wake) => {
                            // Wait for an endpoint (or a back-off to end), a
                            // reply to an earlier send, or the end.
                            let until = wake.map_or(end, |w| w.min(end));
                            tokio::select! {
                                _ = &mut notified => {}
                                _ = tokio::time::sleep_until(until.into()) => {}
                                o = rx.recv() => {
                                    if let Some(o) = o {
                                        if let Some(done) = self.handle(o, &mut guard, &mut want_send, &mut retry_at, &mut backoff, &mut last_error, &mut used, attempts, policy) {
                                            return done.map(|(r, e)| (r, e, attempts));
                                        }
                                    }
                                }
                            }
                            if Instant::now() >= end {
                                return Err(self.expired(timeout));
                            }
                            continue;
                        }
                    }
                }
            }
            let wake = match retry_at {
                Some(t) if want_send => t.min(end),
                _ => end,
            };
            tokio::select! {
                o = rx.recv() => {
                    let Some(o) = o else { return Err(Error::Closed) };
                    if let Some(done) = self.handle(o, &mut guard, &mut want_send, &mut retry_at, &mut backoff, &mut last_error, &mut used, attempts, policy) {
                        return done.map(|(r, e)| (r, e, attempts));
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {
                    if Instant::now() >= end {
                        return Err(self.expired(timeout));
                    }
                }
            }
        }
    }

    fn expired(&self, timeout: Duration) -> Error {
        if self.shared.connected(false) {
            Error::Timeout(timeout)
        } else {
            Error::NoHealthyEndpoint(timeout)
        }
    }

    /// One outcome of a send: `Some` settles the call.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn handle(
        &self,
        outcome: Outcome,
        guard: &mut CallGuard<'_>,
        want_send: &mut bool,
        retry_at: &mut Option<Instant>,
        backoff: &mut Duration,
        last_error: &mut Option<Error>,
        used: &mut HashSet<usize>,
        attempts: u32,
        policy: Policy,
    ) -> Option<Result<((ReplyHeader, Option<ReplyData>), String), Error>> {
        let shared = &*self.shared;
        let opts = &self.options;
        match outcome {
            Outcome::Reply { wire, ep, reply } => {
                guard.live.remove(&wire);
                let endpoint = shared.address(ep);
                let (header, output) = match *reply {
                    Decoded::Reply(h, o) => (*h, o),
                    Decoded::UnknownCode { code, message } => {
                        return Some(Err(Error::UnknownCode {
                            code,
                            message,
                            endpoint,
                        }))
                    }
                    Decoded::Malformed(message) => {
                        return Some(Err(Error::Protocol { endpoint, message }))
                    }
                };
                if policy == Policy::Once || header.status == Status::Ok {
                    return Some(Ok(((header, output), endpoint)));
                }
                let code = header.code.unwrap_or(ErrorCode::Internal);
                let err = Error::Server {
                    code,
                    message: header.message.unwrap_or_default(),
                    endpoint,
                    attempts,
                };
                match code {
                    ErrorCode::Overloaded => {
                        shared.count_overloaded(ep);
                        *last_error = Some(err);
                        if guard.live.is_empty() {
                            *retry_at = Some(Instant::now() + jitter(*backoff, wire));
                            *backoff = (*backoff * 2).min(opts.overload_backoff_max);
                            // Another endpoint first, if there is one.
                            used.clear();
                            used.insert(ep);
                            *want_send = true;
                        }
                        None
                    }
                    ErrorCode::Unavailable => {
                        shared.set_draining(ep);
                        *last_error = Some(err);
                        if guard.live.is_empty() {
                            *want_send = true;
                        }
                        None
                    }
                    _ => Some(Err(err)),
                }
            }
            Outcome::Lost { wire, ep } => {
                if !guard.live.remove(&wire) {
                    return None;
                }
                *last_error = Some(Error::ConnectionLost {
                    endpoint: shared.address(ep),
                    attempts,
                });
                if policy == Policy::Once {
                    return Some(Err(last_error.take().unwrap()));
                }
                if guard.live.is_empty() {
                    *want_send = true;
                    *retry_at = None;
                }
                None
            }
            Outcome::Suspect { ep } => {
                // A duplicate elsewhere, when there is somewhere else to go.
                if policy == Policy::Retry && !*want_send && shared.other_healthy(ep) {
                    used.insert(ep);
                    *want_send = true;
                    *retry_at = None;
                }
                None
            }
        }
    }
}

/// Sends raw frames and receives raw replies, one at a time.
pub struct RawClient {
    send: DealerSender,
    recv: DealerReceiver,
}

impl RawClient {
    pub async fn connect(endpoint: &str) -> Result<RawClient, Error> {
        Self::connect_secure(endpoint, &Security::None).await
    }

    /// With CURVE (or any [`Security`]).
    pub async fn connect_secure(endpoint: &str, security: &Security) -> Result<RawClient, Error> {
        let (recv, send) = Dealer::connect(endpoint, &client_limits(), security)
            .await
            .map_err(|e| Error::Connect {
                endpoint: endpoint.to_string(),
                message: e.to_string(),
            })?
            .split();
        Ok(RawClient { send, recv })
    }

    pub async fn send(&mut self, frames: Vec<Bytes>) -> Result<(), Error> {
        self.send.send(frames).map_err(|_| Error::Closed)
    }

    pub async fn recv(&mut self, timeout: Duration) -> Result<Vec<Bytes>, Error> {
        match tokio::time::timeout(timeout, self.recv.recv()).await {
            Ok(Ok(m)) => Ok(m.frames),
            Ok(Err(_)) => Err(Error::Closed),
            Err(_) => Err(Error::Timeout(timeout)),
        }
    }

    /// Receives and decodes one reply.
    pub async fn recv_reply(&mut self, timeout: Duration) -> Result<Response, Error> {
        let frames = self.recv(timeout).await?;
        let (header, data) = decode_reply(&frames).map_err(|message| Error::Protocol {
            endpoint: String::new(),
            message,
        })?;
        Ok(Response::new(header, data))
    }
}

/// Counts a client's outstanding sends (tests).
#[doc(hidden)]
pub fn outstanding(client: &Client) -> usize {
    client.shared.outstanding()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode_request, encode_reply, Reply};
    use crate::transport::Router;
    use tokio::time::timeout;

    const WAIT: Duration = Duration::from_secs(5);

    /// A peer that reads `n` requests, answers those whose text is
    /// "answer", then closes, lingering (as the daemon does when it exits).
    async fn answer_then_close(n: usize) -> (String, tokio::task::JoinHandle<()>) {
        let router = Router::loopback(&TransportLimits::default()).await;
        let endpoint = router.endpoint().to_string();
        let (mut rx, tx) = router.split();
        let peer = tokio::spawn(async move {
            for _ in 0..n {
                let m = rx.recv().await.unwrap();
                let request = decode_request(&m.frames, &Default::default()).unwrap();
                if request.payload == Payload::Texts(vec!["answer".into()]) {
                    let reply = Reply::error(request.header.id, ErrorCode::Internal, "answered");
                    tx.send(&m.peer, encode_reply(&reply)).unwrap();
                }
            }
        });
        (endpoint, peer)
    }

    /// `n` requests, the even ones to be answered; their join handles.
    fn requests(
        client: &Arc<Client>,
        n: usize,
    ) -> Vec<tokio::task::JoinHandle<Result<Response, Error>>> {
        (0..n)
            .map(|i| {
                let client = client.clone();
                tokio::spawn(async move {
                    let text = if i % 2 == 0 { "answer" } else { "drop" };
                    let header = RequestHeader::new(i as u64, "m", InputKind::Texts);
                    let payload = Payload::Texts(vec![text.into()]);
                    client.request(&header, &payload, WAIT).await
                })
            })
            .collect()
    }

    /// The answered requests get their replies, the others fail with
    /// `ConnectionLost`.
    async fn check(calls: Vec<tokio::task::JoinHandle<Result<Response, Error>>>) {
        for (i, call) in calls.into_iter().enumerate() {
            let result = timeout(WAIT, call).await.unwrap().unwrap();
            if i % 2 == 0 {
                let reply = result.unwrap_or_else(|e| panic!("request {i}: {e}"));
                assert_eq!(reply.header.id, i as u64);
                assert_eq!(reply.header.code, Some(ErrorCode::Internal));
            } else {
                assert!(
                    matches!(result, Err(Error::ConnectionLost { .. })),
                    "request {i}: {result:?}"
                );
            }
        }
    }

    /// A disconnect seen before the replies that came ahead of it were read
    /// fails only the requests that had no reply, once those are read.
    #[tokio::test]
    async fn replies_that_came_before_a_disconnect_are_not_lost() {
        const N: usize = 40;
        let (endpoint, peer) = answer_then_close(N).await;
        // No reader yet: it is as late as it likes.
        let (client, mut receivers) = Client::open(&[endpoint], ClientOptions::default())
            .await
            .unwrap();
        let client = Arc::new(client);
        assert!(client.wait_connected(WAIT, true).await);
        let calls = requests(&client, N);
        timeout(WAIT, peer).await.unwrap().unwrap();
        let end = Instant::now() + WAIT;
        while client.stats()[0].connected {
            assert!(Instant::now() < end, "the disconnect was never seen");
            tokio::time::sleep(MONITOR_TICK).await;
        }
        // Seen while every reply is unread: nothing is lost yet.
        tokio::time::sleep(MONITOR_TICK * 4).await;
        assert_eq!(outstanding(&client), N);
        let reader = tokio::spawn(read_replies(client.shared.clone(), 0, receivers.remove(0)));
        check(calls).await;
        let stats = &client.stats()[0];
        assert_eq!((stats.replies, stats.lost), (N as u64 / 2, N as u64 / 2));
        assert_eq!(outstanding(&client), 0);
        reader.abort();
    }

    /// With the reader keeping up, a disconnect fails the requests without
    /// a reply at once.
    #[tokio::test]
    async fn a_disconnect_fails_the_unanswered_requests_promptly() {
        const N: usize = 40;
        let (endpoint, peer) = answer_then_close(N).await;
        let client = Arc::new(
            Client::connect_with(&[endpoint], ClientOptions::default())
                .await
                .unwrap(),
        );
        assert!(client.wait_connected(WAIT, true).await);
        let calls = requests(&client, N);
        timeout(WAIT, peer).await.unwrap().unwrap();
        let closed = Instant::now();
        check(calls).await;
        // Known soon after the close, long before the calls' timeout.
        assert!(
            closed.elapsed() < Duration::from_secs(2),
            "{:?}",
            closed.elapsed()
        );
    }
}
