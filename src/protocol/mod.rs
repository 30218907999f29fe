//! The client wire protocol (see `docs/protocol.md` for the normative text).
//!
//! A request is one ZeroMQ multipart message to the daemon's ROUTER socket:
//! a MessagePack header frame followed by raw payload frames. A reply is a
//! header frame and, on success, one payload frame with the output tensor.
//! Clients using REQ sockets put an empty delimiter frame first; the daemon
//! echoes it. Requests carry a client-chosen `id`; replies may come back in
//! any order and carry the same `id`.
//!
//! * [`RequestHeader`] / [`ReplyHeader`]: the header frames.
//! * [`decode_request`] / [`encode_reply`]: frames ⇄ values, with every
//!   malformation mapped to an [`ErrorCode`] and a message that says what is wrong.
//! * [`header`]: the strict decoder of the request header (a map with string
//!   keys, nothing laxer; every error names the key).
//! * [`client`]: a Rust client speaking this protocol.

pub mod client;
mod codec;
pub mod header;
pub mod sparse;

pub use codec::{
    decode_reply, decode_request, encode_reply, encode_request, DecodeLimits, ReplyData,
};
pub use sparse::{SparseRows, Sparsify};

use crate::tensor::{DType, HostTensor};
use serde::{Deserialize, Serialize};

/// Splits the frames a ROUTER received from one peer (its identity already
/// removed) into the empty delimiter a REQ socket puts first, if any, and the
/// message. A lone empty frame is the message (an empty one), not a
/// delimiter. Replies go back as `delimiter ++ reply`.
pub fn split_delimiter(frames: &[bytes::Bytes]) -> (Option<bytes::Bytes>, &[bytes::Bytes]) {
    match frames.split_first() {
        Some((first, rest)) if first.is_empty() && !rest.is_empty() => (Some(first.clone()), rest),
        _ => (None, frames),
    }
}

/// The protocol version this daemon speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// Machine-readable failure reasons carried by error replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The message is malformed or inconsistent (header, dtype, shape, payload, ids).
    BadRequest,
    /// No model of that name is served.
    UnknownModel,
    /// An input is longer than the model accepts (and truncation was not asked for).
    TooLong,
    /// The queue for that model is full; retry later.
    Overloaded,
    /// The request's deadline passed before it could run.
    DeadlineExceeded,
    /// The daemon is shutting down, or no device can serve the model.
    Unavailable,
    /// A bug or an unexpected failure inside the daemon.
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 7] = [
        ErrorCode::BadRequest,
        ErrorCode::UnknownModel,
        ErrorCode::TooLong,
        ErrorCode::Overloaded,
        ErrorCode::DeadlineExceeded,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownModel => "unknown_model",
            ErrorCode::TooLong => "too_long",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the payload frames of a request hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputKind {
    /// One frame: a dense little-endian tensor described by `dtype` and `shape`.
    Tensor,
    /// One frame per text, UTF-8.
    Texts,
    /// One frame per sequence of token ids, little-endian u32, special tokens included.
    Ids,
    /// Two frames per (query, passage) pair, UTF-8: a cross-encoder's input.
    Pairs,
}

fn default_true() -> bool {
    true
}

/// The header frame of a request (a MessagePack map with these keys).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestHeader {
    /// Protocol version; must be 1.
    pub v: u32,
    /// Client-chosen id, echoed in the reply.
    pub id: u64,
    /// Name of the model (as configured).
    pub model: String,
    pub input: InputKind,
    /// Element type of a tensor payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    /// Shape of a tensor payload, `[rows, features]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// Higher runs first among queued requests of the same model (default 0).
    #[serde(default)]
    pub priority: u8,
    /// Give up after this many microseconds from receipt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_us: Option<u64>,
    /// Give up at this wall-clock time, microseconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_unix_us: Option<u64>,
    /// Truncate texts longer than the model's maximum (default true); when
    /// false such a text fails the request with `too_long`.
    #[serde(default = "default_true")]
    pub truncate: bool,
    /// Element type of the reply tensor: f32 (default) or f16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_dtype: Option<DType>,
    /// The model's prompt to prepend to each text (sentence-transformers'
    /// `encode(prompt_name = …)`); default: the model's default prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_name: Option<String>,
    /// Embedding models: keep the first `dimensions` values of each
    /// embedding (Matryoshka truncation), re-normalised when the model
    /// normalises; default: the folder's `truncate_dim`, else all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<u32>,
    /// Sparse models: keep each row's `top_k` largest entries; default: all
    /// non-zero ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
}

impl RequestHeader {
    /// A header with the defaults for everything optional.
    pub fn new(id: u64, model: impl Into<String>, input: InputKind) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            id,
            model: model.into(),
            input,
            dtype: None,
            shape: None,
            priority: 0,
            timeout_us: None,
            deadline_unix_us: None,
            truncate: true,
            output_dtype: None,
            prompt_name: None,
            dimensions: None,
            top_k: None,
        }
    }
}

/// A request's decoded payload.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    Tensor(HostTensor),
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
    /// (query, passage) pairs.
    Pairs(Vec<(String, String)>),
}

impl Payload {
    /// Number of rows (tensor rows, texts or sequences).
    pub fn items(&self) -> usize {
        match self {
            Payload::Tensor(t) => t.shape.first().copied().unwrap_or(0),
            Payload::Texts(t) => t.len(),
            Payload::Ids(s) => s.len(),
            Payload::Pairs(p) => p.len(),
        }
    }

    /// The bytes its frames carry (what `server.max_request_bytes` counts,
    /// with the header's).
    pub fn wire_bytes(&self) -> usize {
        match self {
            Payload::Tensor(t) => t.data.len(),
            Payload::Texts(t) => t.iter().map(String::len).sum(),
            Payload::Ids(s) => s.iter().map(|s| 4 * s.len()).sum(),
            Payload::Pairs(p) => p.iter().map(|(a, b)| a.len() + b.len()).sum(),
        }
    }
}

/// A decoded, well-formed request (not yet checked against the model).
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub header: RequestHeader,
    pub payload: Payload,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Error,
}

/// The header frame of a reply (a MessagePack map). Optional keys are left
/// out when they don't apply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplyHeader {
    pub v: u32,
    /// The request's id (0 when the request was too malformed to read one).
    pub id: u64,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// `"csr"`: a sparse model's reply, three payload frames (indptr,
    /// indices, values; see [`SparseRows`]); absent: one dense tensor frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// The bucket the request ran in, `"<batch>x<seq>"` (seq 1 for models
    /// without a sequence axis), `"<tokens>t"` (a packed token budget), or
    /// `"eager"`. When its rows ran in several batches: the largest of
    /// their shapes (`"eager"` above every bucket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
    /// The device that ran it (the batch `bucket` names), e.g. `"cuda:0"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// How many batches its rows ran in (1 unless it was split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<u32>,
    /// Microseconds from receipt until its (first) batch was sent to a device.
    #[serde(default)]
    pub queued_us: u64,
    /// Microseconds the workers spent on its batches (copy in, replay, copy
    /// out), added up.
    #[serde(default)]
    pub compute_us: u64,
    /// Microseconds from receipt until the reply was sent.
    #[serde(default)]
    pub total_us: u64,
    /// Where the time went (see [`Hops`]); on success only. They add up to
    /// `total_us` (within rounding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenize_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_worker_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply_us: Option<u64>,
}

/// Where a successful request's time went, in microseconds, hop by hop
/// (`docs/protocol.md`, "Reply header keys"). The hops follow each other,
/// so they add up to `total_us`. For a request whose rows ran in several
/// batches, `wait` to `reply` are those of the batch that completed it
/// (`wait` then runs from submission to that batch's dispatch).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hops {
    /// Receipt by the socket's driver → decoded and admitted by the frontend
    /// (the hop from the socket to the request's task included).
    pub decode: u64,
    /// Admitted → rows ready and handed to the batcher (tokenization, validation).
    pub tokenize: u64,
    /// Handed to the batcher → its (last) batch dispatched to a worker.
    pub wait: u64,
    /// Dispatched → the worker started on it (the daemon ↔ worker link).
    pub to_worker: u64,
    /// Started → output ready on the worker (copy in, replay, copy out, and
    /// any wait behind the batch ahead of it on the device).
    pub device: u64,
    /// Output ready on the worker → the batcher has it (the link back).
    pub back: u64,
    /// The batcher has the last rows → the reply is encoded for the socket.
    pub reply: u64,
}

impl Hops {
    pub const NAMES: [&'static str; 7] = [
        "decode",
        "tokenize",
        "wait",
        "to_worker",
        "device",
        "back",
        "reply",
    ];

    /// The hops in [`Self::NAMES`] order.
    pub fn values(&self) -> [u64; 7] {
        [
            self.decode,
            self.tokenize,
            self.wait,
            self.to_worker,
            self.device,
            self.back,
            self.reply,
        ]
    }

    /// Read back from a reply header (clients); `None` if it has no hop keys.
    pub fn from_header(h: &ReplyHeader) -> Option<Hops> {
        Some(Hops {
            decode: h.decode_us?,
            tokenize: h.tokenize_us.unwrap_or(0),
            wait: h.wait_us.unwrap_or(0),
            to_worker: h.to_worker_us.unwrap_or(0),
            device: h.device_us.unwrap_or(0),
            back: h.back_us.unwrap_or(0),
            reply: h.reply_us.unwrap_or(0),
        })
    }
}

/// A reply as the daemon produces it, before encoding.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    Ok {
        id: u64,
        /// Full rows; a sparse model's are sent as their non-zero entries (`sparse`).
        output: HostTensor,
        /// A sparse model's rows: cut to CSR form when the reply is encoded.
        sparse: Option<Sparsify>,
        bucket: String,
        device: String,
        queued_us: u64,
        compute_us: u64,
        total_us: u64,
        /// Batches its rows ran in.
        batches: u32,
        /// Where its time went.
        hops: Hops,
    },
    Error {
        id: u64,
        code: ErrorCode,
        message: String,
    },
}

impl Reply {
    pub fn error(id: u64, code: ErrorCode, message: impl Into<String>) -> Self {
        Reply::Error {
            id,
            code,
            message: message.into(),
        }
    }

    pub fn id(&self) -> u64 {
        match self {
            Reply::Ok { id, .. } | Reply::Error { id, .. } => *id,
        }
    }

    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Reply::Ok { .. } => None,
            Reply::Error { code, .. } => Some(*code),
        }
    }
}

/// A request that could not be decoded: what to reply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProtocolError {
    /// The request id, if the header was readable far enough to get it.
    pub id: u64,
    pub code: ErrorCode,
    pub message: String,
}

impl ProtocolError {
    pub fn new(id: u64, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            id,
            code,
            message: message.into(),
        }
    }

    pub fn into_reply(self) -> Reply {
        Reply::Error {
            id: self.id,
            code: self.code,
            message: self.message,
        }
    }
}
