//! The client-facing socket: a ZeroMQ ROUTER that receives requests, checks
//! them against the model, tokenizes texts on the tokenizer pool, hands them
//! to the batcher and sends each reply back to the peer that asked.
//!
//! The client endpoint may be served by several ROUTER shards
//! (`server.client_sockets`, see [`crate::transport::Router::bind_shards`]):
//! each has its own receive loop here, all sharing one [`Frontend`]; a reply
//! goes out on the shard its request came in on.
//!
//! Every message is handled in its own task, so a request waiting for
//! tokenization or for its batch never delays another. Sending a reply never
//! waits: the transport queues at most `server.send_hwm` unsent replies per
//! client and drops (and counts) the rest, so a client that stops reading
//! cannot hold the daemon's memory or delay other clients.

use super::admission::{Admission, Refusal, Ticket};
use super::batcher::shards::Batchers;
use super::messages::{Stamps, Submission};
use super::metrics::Metrics;
use super::output::OutputForm;
use super::tokenize::{PromptUse, TextInput, TokenizeError, TokenizerPool};
use crate::model::{BatchRows, InputSpec, ModelInfo, Task};
use crate::protocol::header::echo;
use crate::protocol::{
    decode_request, encode_reply, DecodeLimits, ErrorCode, Payload, ProtocolError, Reply, Request,
};
use crate::tensor::DType;
use crate::transport::{Incoming, Router, RouterSender, TransportError};
use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

/// A served model, as the frontend sees it.
pub struct ServedModel {
    pub info: ModelInfo,
    pub tokenizer: Option<TokenizerPool>,
}

/// Everything a request handler needs; shared by all handler tasks.
pub struct Frontend {
    models: Vec<ServedModel>,
    by_name: HashMap<String, usize>,
    batchers: Batchers,
    metrics: Arc<Metrics>,
    limits: DecodeLimits,
    admission: Arc<Admission>,
    /// Turns of each socket loop, one counter per client socket shard (each
    /// turns at least every [`TURN`]), for the health loop that feeds
    /// systemd's watchdog.
    turns: Box<[std::sync::atomic::AtomicU64]>,
    /// Texts of at most this many bytes in all are tokenized inline.
    inline_tokenize_bytes: usize,
}

/// The socket loop turns at least this often, even with no traffic.
pub const TURN: Duration = Duration::from_millis(500);

/// The bytes a request will hold while admitted: its payload, a decoded
/// copy (f32 rows or u32 ids, at most one id per byte of text plus the
/// special tokens, at most the model's longest input), and its output.
fn request_bytes(payload: &Payload, info: &ModelInfo) -> usize {
    let out = payload.items() * info.output_dim * 4;
    let max_len = match info.input {
        InputSpec::Tokens { max_seq_len, .. } => max_seq_len,
        InputSpec::Features { .. } => 0,
    };
    out + match payload {
        Payload::Tensor(t) => 2 * t.data.len(),
        Payload::Ids(seqs) => seqs.iter().map(|s| 8 * s.len()).sum(),
        Payload::Texts(texts) => texts
            .iter()
            .map(|t| t.len() + 4 * (t.len() + 2).min(max_len))
            .sum(),
        Payload::Pairs(pairs) => pairs
            .iter()
            .map(|(a, b)| a.len() + b.len() + 4 * (a.len() + b.len() + 4).min(max_len))
            .sum(),
    }
}

/// The prompt a text request gets (`prompt_name`, else the model's default).
fn prompt_for(info: &ModelInfo, name: Option<&str>) -> Result<Option<PromptUse>, String> {
    let prompts = &info.prompts;
    let Some(p) = prompts.resolve(name)? else {
        return Ok(None);
    };
    Ok(Some(PromptUse {
        text: p.text.clone(),
        unpooled: if prompts.exclude_from_pooling {
            Some(p.tokens.ok_or("the prompt's token count is unknown")?)
        } else {
            None
        },
    }))
}

impl Frontend {
    /// `batchers` takes every accepted request.
    pub fn new(
        models: Vec<ServedModel>,
        batchers: Batchers,
        metrics: Arc<Metrics>,
        limits: DecodeLimits,
        admission: Arc<Admission>,
    ) -> Self {
        let by_name = models
            .iter()
            .enumerate()
            .map(|(i, m)| (m.info.name.clone(), i))
            .collect();
        Self {
            models,
            by_name,
            batchers,
            metrics,
            limits,
            admission,
            turns: Box::new([std::sync::atomic::AtomicU64::new(0)]),
            inline_tokenize_bytes: 0,
        }
    }

    /// How many times the slowest socket loop has turned (see [`TURN`]): it
    /// advances only while every shard's loop turns, so one stuck shard
    /// stops it.
    pub fn turns(&self) -> u64 {
        self.turns
            .iter()
            .map(|t| t.load(std::sync::atomic::Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// The number of client socket shards [`run`] will serve (default 1):
    /// one turn counter each.
    pub fn with_client_sockets(mut self, shards: usize) -> Self {
        self.turns = (0..shards.max(1))
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        self
    }

    /// Requests whose texts take at most `bytes` in all are tokenized on the
    /// task that received them instead of on the tokenizer pool
    /// (`server.inline_tokenize_bytes`; 0: always the pool).
    pub fn with_inline_tokenize(mut self, bytes: usize) -> Self {
        self.inline_tokenize_bytes = bytes;
        self
    }

    /// Decodes, admits, validates and submits one request; resolves to its
    /// reply and, for an admitted request, the ticket to drop once the reply
    /// has been handed to the socket.
    ///
    /// `received_ns` is when the socket's driver took the message
    /// ([`crate::clock::mono_ns`]; 0 when unknown): a successful reply's
    /// `total_us` and per-hop timings start there.
    pub async fn handle(&self, frames: &[Bytes], received_ns: u64) -> (Reply, Option<Ticket>) {
        let received = Instant::now();
        let request = match decode_request(frames, &self.limits) {
            Ok(r) => r,
            Err(e) => return (self.error(e), None),
        };
        let (index, ticket) = match self.admit(&request) {
            Ok(admitted) => admitted,
            Err(e) => {
                let model = self.by_name.get(&request.header.model).copied();
                return (self.model_error(model, e), None);
            }
        };
        let stamps = Stamps {
            received_ns,
            decoded_ns: crate::clock::mono_ns(),
            submitted_ns: 0,
        };
        let mut reply = match self.submit(index, request, received, stamps).await {
            Ok(rx) => rx.await.unwrap_or_else(|_| {
                // The batcher dropped the request without answering: a bug or a
                // shutdown past its grace period.
                self.model_error(
                    Some(index),
                    ProtocolError::new(0, ErrorCode::Internal, "the request was dropped"),
                )
            }),
            Err(e) => self.model_error(Some(index), e),
        };
        if let (Reply::Ok { total_us, hops, .. }, true) = (&mut reply, received_ns > 0) {
            // From the driver's receipt to now, when the reply is encoded;
            // `reply` is what the batcher's hops leave of it.
            *total_us = crate::clock::us_between(received_ns, crate::clock::mono_ns());
            let before: u64 = hops.values().iter().sum();
            hops.reply = total_us.saturating_sub(before);
            self.metrics.reply_hops(hops);
        }
        (reply, Some(ticket))
    }

    /// The served models, in config order (for the HTTP front).
    pub fn models(&self) -> &[ServedModel] {
        &self.models
    }

    /// The served model of that name, or the `unknown_model` error to reply.
    pub fn model(&self, id: u64, name: &str) -> Result<&ServedModel, ProtocolError> {
        match self.by_name.get(name) {
            Some(&i) => Ok(&self.models[i]),
            None => {
                let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
                names.sort_unstable();
                Err(ProtocolError::new(
                    id,
                    ErrorCode::UnknownModel,
                    format!(
                        "no model named {} (served: {})",
                        echo(name),
                        names.join(", ")
                    ),
                ))
            }
        }
    }

    /// Tokenizes texts with a model's tokenizer exactly as a `texts`
    /// request is (the HTTP front sends the ids, so it can count tokens).
    pub async fn tokenize(
        &self,
        model: &ServedModel,
        texts: Vec<String>,
        truncate: bool,
    ) -> Result<Vec<Vec<u32>>, ProtocolError> {
        let name = &model.info.name;
        let pool = model.tokenizer.as_ref().ok_or_else(|| {
            ProtocolError::new(
                0,
                ErrorCode::BadRequest,
                format!("model {name} takes input \"tensor\" (f32 rows), not texts"),
            )
        })?;
        // The folder's default prompt applies, as to a "texts" request
        // without prompt_name.
        let prompt = prompt_for(&model.info, None).map_err(|e| {
            ProtocolError::new(0, ErrorCode::BadRequest, format!("model {name}: {e}"))
        })?;
        self.tokenize_texts(pool, TextInput::Texts(texts), truncate, prompt)
            .await
            .map_err(|e| tokenize_error(0, name, "text", e))
    }

    /// Counts an error answered outside [`Frontend::handle`] (HTTP front).
    pub fn count_error(&self, code: ErrorCode) {
        self.metrics.error(code);
    }

    /// Token ids of `texts`: inline when they are short (a few µs, cheaper
    /// than the hop to the pool and back), else on the tokenizer pool.
    async fn tokenize_texts(
        &self,
        pool: &TokenizerPool,
        input: TextInput,
        truncate: bool,
        prompt: Option<PromptUse>,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let bytes: usize = match &input {
            TextInput::Texts(t) => t.iter().map(String::len).sum(),
            TextInput::Pairs(p) => p.iter().map(|(a, b)| a.len() + b.len()).sum(),
        };
        if bytes <= self.inline_tokenize_bytes {
            pool.tokenizer()
                .encode_request(&input, truncate, prompt.as_ref())
        } else {
            pool.encode_request(input, truncate, prompt).await
        }
    }

    /// Finds the model and takes the request's share of the admission
    /// bounds, before anything waits (see [`super::admission`]).
    fn admit(&self, request: &Request) -> Result<(usize, Ticket), ProtocolError> {
        let header = &request.header;
        let id = header.id;
        self.model(id, &header.model)?;
        let index = self.by_name[&header.model];
        let info = &self.models[index].info;
        let bytes = request_bytes(&request.payload, info);
        let ticket = self.admission.admit(index, bytes).map_err(|r| {
            let message = match r {
                Refusal::ModelFull { limit } => format!(
                    "model {} has {limit} requests admitted and unanswered; retry later",
                    info.name
                ),
                Refusal::MemoryFull { budget, needed } => format!(
                    "the daemon holds its whole request budget ({budget} bytes, server.max_buffered_bytes); this request needs {needed}; retry later"
                ),
            };
            ProtocolError::new(id, ErrorCode::Overloaded, message)
        })?;
        Ok((index, ticket))
    }

    fn error(&self, e: ProtocolError) -> Reply {
        self.metrics.error(e.code);
        e.into_reply()
    }

    /// An error reply counted for its model too, when it is known.
    fn model_error(&self, model: Option<usize>, e: ProtocolError) -> Reply {
        match model {
            Some(i) => self.metrics.model_error(&self.models[i].info.name, e.code),
            None => self.metrics.error(e.code),
        }
        e.into_reply()
    }

    async fn submit(
        &self,
        index: usize,
        request: Request,
        received: Instant,
        mut stamps: Stamps,
    ) -> Result<oneshot::Receiver<Reply>, ProtocolError> {
        let header = request.header;
        let id = header.id;
        let bad = |msg: String| ProtocolError::new(id, ErrorCode::BadRequest, msg);
        let model = &self.models[index];
        let name = &model.info.name;
        let scores = matches!(model.info.task, Task::Score { .. });
        match (&request.payload, scores) {
            (Payload::Pairs(_), false) if model.info.has_seq() => {
                return Err(bad(format!(
                    "model {name} embeds texts (input \"texts\" or \"ids\"); input \"pairs\" is for cross-encoders"
                )))
            }
            (Payload::Texts(_) | Payload::Ids(_), true) => {
                return Err(bad(format!(
                    "model {name} is a cross-encoder: it takes input \"pairs\" (two frames per query and passage)"
                )))
            }
            _ => {}
        }
        // Checked before tokenizing: a bad `dimensions` costs no work.
        let output = OutputForm::for_model(
            &model.info,
            header.output_dtype.unwrap_or(DType::F32),
            header.dimensions,
            header.top_k,
        )
        .map_err(|(code, msg)| ProtocolError::new(id, code, msg))?;
        if header.prompt_name.is_some()
            && !matches!(request.payload, Payload::Texts(_) | Payload::Pairs(_))
        {
            return Err(bad(
                "prompt_name applies to input \"texts\" and \"pairs\" only".into(),
            ));
        }
        let input = match (&model.info.input, request.payload) {
            (InputSpec::Features { features }, Payload::Tensor(t)) => {
                if t.dtype != DType::F32 {
                    return Err(bad(format!(
                        "model {name} takes f32 tensors, got {}",
                        t.dtype
                    )));
                }
                if t.shape.len() != 2 || t.shape[1] != *features || t.shape[0] == 0 {
                    return Err(bad(format!(
                        "model {name} takes a tensor of shape [n, {features}] with n >= 1, got {:?}",
                        t.shape
                    )));
                }
                if t.shape[0] > self.limits.max_items {
                    return Err(bad(format!(
                        "{} rows in one request, more than the limit of {}",
                        t.shape[0], self.limits.max_items
                    )));
                }
                let data = crate::tensor::f32s_from_le(&t.data);
                // PyTorch would propagate NaN/Inf; a graph's ReLU or pooling
                // can turn them into a finite wrong answer, so refuse them.
                if let Some(i) = data.iter().position(|v| !v.is_finite()) {
                    return Err(bad(format!(
                        "input value {i} (row {}, column {}) is {}: inputs must be finite",
                        i / features,
                        i % features,
                        data[i]
                    )));
                }
                BatchRows::Features {
                    features: *features,
                    data,
                }
            }
            (InputSpec::Features { .. }, _) => {
                return Err(bad(format!(
                    "model {name} takes input \"tensor\" (f32 rows)"
                )))
            }
            (InputSpec::Tokens { .. }, Payload::Tensor(_)) => {
                return Err(bad(format!(
                    "model {name} takes input {}",
                    if scores {
                        "\"pairs\""
                    } else {
                        "\"texts\" or \"ids\""
                    }
                )))
            }
            (InputSpec::Tokens { .. }, payload @ (Payload::Texts(_) | Payload::Pairs(_))) => {
                let pool = model.tokenizer.as_ref().ok_or_else(|| {
                    ProtocolError::new(id, ErrorCode::Internal, "model has no tokenizer")
                })?;
                let prompt = prompt_for(&model.info, header.prompt_name.as_deref())
                    .map_err(|e| bad(format!("model {name}: {e}")))?;
                let (input, what) = match payload {
                    Payload::Pairs(p) => (TextInput::Pairs(p), "pair"),
                    Payload::Texts(t) => (TextInput::Texts(t), "text"),
                    _ => unreachable!("matched above"),
                };
                match self
                    .tokenize_texts(pool, input, header.truncate, prompt)
                    .await
                {
                    Ok(ids) => BatchRows::Tokens(ids),
                    Err(e) => return Err(tokenize_error(id, name, what, e)),
                }
            }
            (
                InputSpec::Tokens {
                    vocab_size,
                    max_seq_len,
                },
                Payload::Ids(seqs),
            ) => {
                for (i, seq) in seqs.iter().enumerate() {
                    if seq.len() > *max_seq_len {
                        return Err(ProtocolError::new(
                            id,
                            ErrorCode::TooLong,
                            format!(
                                "id sequence {i} has {} tokens, more than model {name}'s maximum of {max_seq_len}",
                                seq.len()
                            ),
                        ));
                    }
                    if let Some(pos) = seq.iter().position(|&t| t as usize >= *vocab_size) {
                        return Err(bad(format!(
                            "id sequence {i} has id {} at position {pos}, outside the vocabulary of {vocab_size}",
                            seq[pos]
                        )));
                    }
                }
                BatchRows::Tokens(seqs)
            }
        };
        let deadline = deadline(header.timeout_us, header.deadline_unix_us, received);
        let (tx, rx) = oneshot::channel();
        stamps.submitted_ns = crate::clock::mono_ns();
        let submission = Submission {
            model: index,
            client_id: id,
            input,
            priority: header.priority,
            received,
            deadline,
            output,
            reply: tx,
            stamps,
        };
        if !self.batchers.submit(submission) {
            return Err(ProtocolError::new(
                id,
                ErrorCode::Unavailable,
                "the daemon is shutting down",
            ));
        }
        Ok(rx)
    }
}

/// The reply to a text the tokenizer refused.
fn tokenize_error(id: u64, name: &str, what: &str, e: TokenizeError) -> ProtocolError {
    match e {
        TokenizeError::TooLong { index, tokens, max } => ProtocolError::new(
            id,
            ErrorCode::TooLong,
            format!(
                "{what} {index} has {tokens} tokens, more than model {name}'s maximum of {max} (send truncate = true to cut it)"
            ),
        ),
        e => ProtocolError::new(id, ErrorCode::BadRequest, format!("cannot tokenize: {e}")),
    }
}

/// The earlier of a relative timeout and an absolute wall-clock deadline.
fn deadline(
    timeout_us: Option<u64>,
    deadline_unix_us: Option<u64>,
    received: Instant,
) -> Option<Instant> {
    let relative = timeout_us.map(|us| received + Duration::from_micros(us));
    let absolute = deadline_unix_us.map(|unix_us| {
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        if unix_us <= now_us {
            received
        } else {
            received + Duration::from_micros(unix_us - now_us)
        }
    });
    match (relative, absolute) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// How long, after `shutdown`, handlers may take to send their last replies.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves the client ROUTER sockets (one, or the shards of one endpoint; at
/// most the number given to [`Frontend::with_client_sockets`]) until
/// `shutdown` resolves or every socket has closed, then waits (up to
/// `FLUSH_TIMEOUT`) for the handlers still answering, on every shard.
///
/// Each shard has its own receive loop (a task). Each handler task holds a
/// clone of `done`; when the last one ends (however it ends) the channel
/// closes, which is how shutdown knows they are all done.
pub async fn run(
    sockets: Vec<Router>,
    frontend: Arc<Frontend>,
    shutdown: impl Future<Output = ()>,
) {
    let (done, mut all_done) = tokio::sync::mpsc::channel::<()>(1);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut loops = tokio::task::JoinSet::new();
    for (shard, socket) in sockets.into_iter().enumerate() {
        loops.spawn(serve_socket(
            shard,
            socket,
            frontend.clone(),
            done.clone(),
            stop_rx.clone(),
        ));
    }
    drop(done);
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut shutdown => {}
        // Every socket closed on its own: nothing more will come.
        _ = async { while loops.join_next().await.is_some() {} } => {}
    }
    let _ = stop_tx.send(true);
    while loops.join_next().await.is_some() {}
    let _ = tokio::time::timeout(FLUSH_TIMEOUT, all_done.recv()).await;
}

/// One shard's receive loop: spawns a handler per message until `stop` is
/// set or the socket closes.
async fn serve_socket(
    shard: usize,
    socket: Router,
    frontend: Arc<Frontend>,
    done: tokio::sync::mpsc::Sender<()>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let (mut recv, send) = socket.split();
    let mut turn = tokio::time::interval(TURN);
    let turns = &frontend.turns[shard % frontend.turns.len()];
    loop {
        turns.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::select! {
            _ = stopped(&mut stop) => break,
            _ = turn.tick() => {}
            msg = recv.recv() => match msg {
                Ok(incoming) => {
                    let took = crate::clock::mono_ns();
                    let stages = &frontend.metrics.stages;
                    stages.socket_to_frontend.add_since(incoming.received_ns);
                    let frontend = frontend.clone();
                    let send = send.clone();
                    let done = done.clone();
                    tokio::spawn(async move {
                        frontend.metrics.stages.spawn_to_handler.add_since(took);
                        serve_message(frontend, send, incoming).await;
                        drop(done);
                    });
                    stages.frontend_loop.add_since(took);
                }
                // Too many frames or a frame over the limit: answered, so the
                // client knows (its id is unknown: the header is not read).
                Err(TransportError::Rejected { peer, reason }) => {
                    frontend.metrics.error(ErrorCode::BadRequest);
                    let reply = Reply::error(0, ErrorCode::BadRequest, format!("message refused: {reason}"));
                    let _ = send.send(&peer, encode_reply(&reply));
                }
                Err(TransportError::Closed) => break,
                Err(e) => tracing::error!(shard, "client socket: {e}"),
            },
        }
    }
}

/// Resolves once `stop` is set (or its sender is gone).
async fn stopped(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve_message(frontend: Arc<Frontend>, send: RouterSender, incoming: Incoming) {
    let Incoming {
        peer,
        frames,
        permit,
        received_ns,
    } = incoming;
    // A REQ client's empty delimiter is echoed before the reply.
    let (delimiter, frames) = crate::protocol::split_delimiter(&frames);
    let (reply, ticket) = frontend.handle(frames, received_ns).await;
    let mut out: Vec<Bytes> = delimiter.into_iter().collect();
    out.extend(encode_reply(&reply));
    // Never waits: past the client's high-water mark the reply is dropped
    // and counted by the transport.
    let _ = send.send(&peer, out);
    // The request's bytes are given back once the socket has its reply.
    drop(ticket);
    drop(permit);
}
