//! The HTTP front (`[http]`, off by default): the embeddings routes the
//! ecosystem speaks, served by axum on the daemon's runtime.
//!
//! * `openai.rs`: `POST /v1/embeddings`, OpenAI's shape: `{"input": str |
//!   [str] | [int] | [[int]], "model": str, "encoding_format": "float" |
//!   "base64", "dimensions": int, "user": str}` → `{"object": "list",
//!   "data": [{"object": "embedding", "index": i, "embedding": [...] |
//!   "base64"}], "model": ..., "usage": {"prompt_tokens": N, "total_tokens":
//!   N}}`.
//! * `tei.rs`: text-embeddings-inference's routes: `POST /embed` (`inputs`,
//!   `truncate`, `truncation_direction`, `prompt_name`, `normalize`,
//!   `dimensions` → `[[...]]`), `POST /embed_sparse` (a sparse encoder's
//!   `inputs` → `[[{"index", "value"}]]`), `POST /rerank` (`query`, `texts`,
//!   `raw_scores`, `return_text`, `truncate` → `[{"index", "score",
//!   "text"}]`, best first, on a cross-encoder), `POST /tokenize` (`inputs`,
//!   `add_special_tokens`, `prompt_name` → `[[{"id", "text", "special",
//!   "start", "stop"}]]`) and `GET /info`; each takes an optional `model`
//!   (a replayd extension; default: the first served model of the route's
//!   kind).
//! * `GET /v1/models`, `GET /health` ([`Health`], as `replayctl health --json`).
//!
//! Every embedding and rerank request becomes a protocol request and goes
//! through [`Frontend::handle`] — the same decoding limits, admission,
//! validation and batcher as the ZeroMQ socket; `dimensions` is passed on as
//! the header's. `/v1/embeddings` tokenizes texts first with the model's own
//! tokenizer ([`Frontend::tokenize`], exactly as a `texts` request is) and
//! sends ids, so that `usage` can count the tokens; `/embed` and `/rerank`
//! send texts and pairs. `/tokenize` runs the model's tokenizer pool
//! ([`super::tokenize::TokenizerPool::encode_detailed`]) and no model.
//! Errors are JSON carrying the protocol's codes, with the HTTP status of
//! [`status_of`]: OpenAI's shape on OpenAI's routes, TEI's on TEI's.
//!
//! Bounds: at most `http.max_concurrency` requests are handled at once —
//! the slot is taken before the body is read, so bodies held in memory are
//! at most `max_concurrency × max_body_bytes`; more get 429 at once. Bodies
//! over `http.max_body_bytes` get 413 before they are read whole; each
//! request has the deadline `http.request_timeout_ms`. Unknown routes and
//! methods get JSON errors too (404, 405).
//!
//! [`router`] is served by [`super::http_server`], like `/metrics`.

mod openai;
mod tei;

use super::frontend::{Frontend, ServedModel};
use super::metrics::Metrics;
use super::stats::Health;
use crate::config::Config;
use crate::model::{InputSpec, ModelInfo, Task};
use crate::protocol::{
    encode_request, ErrorCode, InputKind, Payload, ProtocolError, Reply, RequestHeader, SparseRows,
};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// The HTTP status for a protocol error code.
pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
        ErrorCode::UnknownModel => StatusCode::NOT_FOUND,
        ErrorCode::TooLong => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::Overloaded => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// What the handlers share.
pub struct HttpFront {
    frontend: Arc<Frontend>,
    metrics: Arc<Metrics>,
    slots: Semaphore,
    timeout: Duration,
    /// `http.default_model`: the default of the routes of its kind.
    default_model: Option<String>,
    /// `http.max_concurrency` (TEI's `max_concurrent_requests`).
    max_concurrency: usize,
    /// `server.max_request_bytes`, the protocol's limit on a request.
    max_request_bytes: usize,
    /// `server.max_items_per_request` (TEI's `max_client_batch_size`).
    max_items: usize,
    /// Ids for the protocol requests (only the frontend sees them).
    next_id: AtomicU64,
}

impl HttpFront {
    pub fn new(config: &Config, frontend: Arc<Frontend>, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(HttpFront {
            frontend,
            metrics,
            slots: Semaphore::new(config.http.max_concurrency),
            timeout: Duration::from_millis(config.http.request_timeout_ms),
            default_model: config.http.default_model.clone(),
            max_concurrency: config.http.max_concurrency,
            max_request_bytes: config.server.max_request_bytes,
            max_items: config.server.max_items_per_request,
            next_id: AtomicU64::new(1),
        })
    }
}

/// What a served model is, as the HTTP routes see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Texts in, one embedding each (`/v1/embeddings`, `/embed`).
    Embedding,
    /// A cross-encoder with one score per pair (`/rerank`).
    Reranker,
    /// A cross-encoder with several labels per pair (no route scores it).
    Classifier,
    /// A sparse encoder (SPLADE): texts in, vocabulary weights out (`/embed_sparse`).
    Sparse,
    /// Tensors in (`kind = "mlp"`): not served over HTTP.
    Tensor,
}

impl Kind {
    fn of(info: &ModelInfo) -> Kind {
        match (&info.input, info.task) {
            (InputSpec::Features { .. }, _) => Kind::Tensor,
            (InputSpec::Tokens { .. }, Task::Embed) => Kind::Embedding,
            (InputSpec::Tokens { .. }, Task::Score { labels: 1 }) => Kind::Reranker,
            (InputSpec::Tokens { .. }, Task::Score { .. }) => Kind::Classifier,
            (InputSpec::Tokens { .. }, Task::Sparse) => Kind::Sparse,
        }
    }
}

/// Which models a route takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// `/v1/embeddings`, `/embed`.
    Embedding,
    /// `/rerank`.
    Reranker,
    /// `/embed_sparse`.
    Sparse,
    /// `/tokenize`: any model with a tokenizer (default: an embedding
    /// model's, else a cross-encoder's).
    Tokenizer,
}

impl Want {
    fn takes(self, kind: Kind) -> bool {
        match self {
            Want::Embedding => kind == Kind::Embedding,
            Want::Reranker => kind == Kind::Reranker,
            Want::Sparse => kind == Kind::Sparse,
            Want::Tokenizer => kind != Kind::Tensor,
        }
    }
}

/// Which JSON shape an error takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// `{"error": {"message", "type", "code"}}`
    OpenAi,
    /// `{"error": message, "error_type": code}`
    Tei,
}

/// The error shape of a route (and of the 405 on it).
fn shape_of(path: &str) -> Shape {
    match path {
        "/embed" | "/embed_sparse" | "/rerank" | "/tokenize" | "/info" => Shape::Tei,
        _ => Shape::OpenAi,
    }
}

/// Every route, for the 404 message.
const ROUTES: &str = "POST /v1/embeddings, GET /v1/models, POST /embed, POST /embed_sparse, POST /rerank, POST /tokenize, GET /info, GET /health";

/// An error reply.
struct Failure {
    shape: Shape,
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl Failure {
    fn new(shape: Shape, code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            shape,
            status: status_of(code),
            code: code.as_str(),
            message: message.into(),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = match self.shape {
            Shape::OpenAi => {
                json!({"error": {"message": self.message, "type": self.code, "code": self.code}})
            }
            Shape::Tei => json!({"error": self.message, "error_type": self.code}),
        };
        (self.status, Json(body)).into_response()
    }
}

/// The routes, with the body limit.
pub fn router(front: Arc<HttpFront>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(models))
        .route("/embed", post(tei::embed))
        .route("/embed_sparse", post(tei::embed_sparse))
        .route("/rerank", post(tei::rerank))
        .route("/tokenize", post(tei::tokenize))
        .route("/info", get(tei::info))
        .route("/health", get(health_route))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .route_layer(axum::middleware::from_fn_with_state(front.clone(), admit))
        .with_state(front)
}

/// Takes one of the `http.max_concurrency` slots for the whole request,
/// before its body is read (so a flood of large bodies is refused, not
/// buffered), or answers 429 at once.
async fn admit(State(front): State<Arc<HttpFront>>, request: Request, next: Next) -> Response {
    let shape = shape_of(request.uri().path());
    // The GET routes stay answerable when the slots are full.
    if request.method() != axum::http::Method::POST {
        return next.run(request).await;
    }
    let Ok(_slot) = front.slots.try_acquire() else {
        return front
            .refuse(
                shape,
                ErrorCode::Overloaded,
                "the HTTP front is handling http.max_concurrency requests; retry later",
            )
            .into_response();
    };
    next.run(request).await
}

async fn no_route(request: Request) -> Response {
    let message = format!(
        "no route {} {} (routes: {ROUTES})",
        request.method(),
        request.uri().path()
    );
    bad_request_with_status(Shape::OpenAi, StatusCode::NOT_FOUND, message)
}

async fn wrong_method(request: Request) -> Response {
    let path = request.uri().path();
    let message = format!("{} is not allowed on {path}", request.method());
    bad_request_with_status(shape_of(path), StatusCode::METHOD_NOT_ALLOWED, message)
}

/// A `bad_request` reply with an HTTP status of its own.
fn bad_request_with_status(shape: Shape, status: StatusCode, message: String) -> Response {
    let mut f = Failure::new(shape, ErrorCode::BadRequest, message);
    f.status = status;
    f.into_response()
}

/// The body, or the 413/400 reply for one that could not be read.
fn body(shape: Shape, body: Result<Bytes, BytesRejection>) -> Result<Bytes, Failure> {
    body.map_err(|r| {
        let status = r.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than http.max_body_bytes".to_string()
        } else {
            format!("cannot read the request body: {r}")
        };
        Failure {
            shape,
            status,
            code: ErrorCode::BadRequest.as_str(),
            message,
        }
    })
}

fn parse<T: serde::de::DeserializeOwned>(shape: Shape, bytes: &[u8]) -> Result<T, Failure> {
    serde_json::from_slice(bytes).map_err(|e| {
        Failure::new(
            shape,
            ErrorCode::BadRequest,
            format!("invalid JSON body: {e}"),
        )
    })
}

fn default_true() -> bool {
    true
}

/// A successful reply's rows (embeddings, or a cross-encoder's scores).
type Rows = Vec<Vec<f32>>;

impl HttpFront {
    /// The body read and parsed, or the reply to an unreadable one
    /// (counted as the frontend counts its errors).
    fn request<T: serde::de::DeserializeOwned>(
        &self,
        shape: Shape,
        raw: Result<Bytes, BytesRejection>,
    ) -> Result<T, Failure> {
        body(shape, raw)
            .and_then(|raw| parse(shape, &raw))
            .inspect_err(|_| self.frontend.count_error(ErrorCode::BadRequest))
    }

    /// The default model of a route: `http.default_model` when it is of the
    /// route's kind, else the first served model of that kind (for
    /// `/tokenize`: of an embedding model, else of a cross-encoder).
    fn default_for(&self, want: Want) -> Option<&ServedModel> {
        let models = self.frontend.models();
        let first = |w: Want| {
            let configured = self
                .default_model
                .as_deref()
                .and_then(|name| models.iter().find(|m| m.info.name == name));
            configured
                .filter(|m| w.takes(Kind::of(&m.info)))
                .or_else(|| models.iter().find(|m| w.takes(Kind::of(&m.info))))
        };
        match want {
            Want::Tokenizer => first(Want::Embedding)
                .or_else(|| first(Want::Sparse))
                .or_else(|| first(Want::Reranker)),
            w => first(w),
        }
    }

    /// The model a request names (or the route's default), checked to be of
    /// the kind the route takes.
    fn model_for(
        &self,
        shape: Shape,
        requested: Option<String>,
        want: Want,
    ) -> Result<&ServedModel, Failure> {
        let Some(name) = requested else {
            return self.default_for(want).ok_or_else(|| {
                let kind = match want {
                    Want::Embedding | Want::Tokenizer => "embedding model",
                    Want::Reranker => "cross-encoder with one score per pair",
                    Want::Sparse => "sparse encoder",
                };
                self.refuse(
                    shape,
                    ErrorCode::BadRequest,
                    format!("no `model` given and no {kind} is served"),
                )
            });
        };
        let model = self.frontend.model(0, &name).map_err(|e| {
            self.frontend.count_error(e.code);
            self.fail(shape, e)
        })?;
        let kind = Kind::of(&model.info);
        if want.takes(kind) {
            return Ok(model);
        }
        let what = match kind {
            Kind::Tensor => {
                return Err(self.refuse(
                    shape,
                    ErrorCode::BadRequest,
                    format!(
                        "model {name} takes tensors (kind = \"mlp\"); the HTTP front serves encoder models"
                    ),
                ))
            }
            Kind::Embedding => "an embedding model (use /v1/embeddings or /embed)".to_string(),
            Kind::Reranker => "a cross-encoder (use /rerank)".to_string(),
            Kind::Sparse => "a sparse encoder (use /embed_sparse)".to_string(),
            Kind::Classifier => format!(
                "a cross-encoder with {} labels per pair, not one score",
                match model.info.task {
                    Task::Score { labels } => labels,
                    Task::Embed | Task::Sparse => 0,
                }
            ),
        };
        let route = match want {
            Want::Embedding => "this route embeds texts",
            Want::Sparse => "/embed_sparse needs a sparse encoder (SPLADE)",
            Want::Reranker => "/rerank needs a cross-encoder with one score per pair",
            Want::Tokenizer => "/tokenize needs a model with a tokenizer",
        };
        Err(self.refuse(
            shape,
            ErrorCode::BadRequest,
            format!("model {name} is {what}; {route}"),
        ))
    }

    fn fail(&self, shape: Shape, e: ProtocolError) -> Failure {
        Failure::new(shape, e.code, e.message)
    }

    /// A failure the frontend did not see, counted like its own.
    fn refuse(&self, shape: Shape, code: ErrorCode, message: impl Into<String>) -> Failure {
        self.frontend.count_error(code);
        Failure::new(shape, code, message)
    }

    /// A protocol header for `model`, with the HTTP deadline.
    fn header(&self, model: &ServedModel, input: InputKind) -> RequestHeader {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut header = RequestHeader::new(id, model.info.name.clone(), input);
        header.timeout_us = Some(self.timeout.as_micros() as u64);
        header
    }

    /// Sends one protocol request through the frontend and returns the
    /// reply's rows (the frontend counts its own errors).
    async fn send(
        &self,
        shape: Shape,
        header: &RequestHeader,
        payload: &Payload,
    ) -> Result<Rows, Failure> {
        let frames = encode_request(header, payload);
        let (reply, ticket) = self.frontend.handle(&frames, crate::clock::mono_ns()).await;
        drop(ticket);
        match reply {
            Reply::Ok { output, .. } => {
                let width = output.shape.get(1).copied().unwrap_or(0).max(1);
                let data = crate::tensor::f32s_from_le(&output.data);
                Ok(data.chunks(width).map(<[f32]>::to_vec).collect())
            }
            Reply::Error { code, message, .. } => Err(Failure::new(shape, code, message)),
        }
    }

    /// [`Self::send`] to a sparse encoder: each row's non-zero entries (or
    /// its `top_k` largest).
    async fn send_sparse(
        &self,
        shape: Shape,
        header: &RequestHeader,
        payload: &Payload,
    ) -> Result<SparseRows, Failure> {
        let frames = encode_request(header, payload);
        let (reply, ticket) = self.frontend.handle(&frames, crate::clock::mono_ns()).await;
        drop(ticket);
        match reply {
            Reply::Ok { output, sparse, .. } => {
                let width = output.shape.get(1).copied().unwrap_or(0);
                Ok(SparseRows::from_dense(
                    &output.data,
                    width,
                    sparse.unwrap_or_default(),
                ))
            }
            Reply::Error { code, message, .. } => Err(Failure::new(shape, code, message)),
        }
    }
}

async fn models(State(front): State<Arc<HttpFront>>) -> Json<Value> {
    let data: Vec<Value> = front
        .frontend
        .models()
        .iter()
        .map(|m| json!({"id": m.info.name, "object": "model", "owned_by": "replayd", "dimensions": m.info.output_dim}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `/health` (here and on the metrics listener): 200 while some device is
/// ready (`ok`, `degraded`), else 503; the body is `replayctl health
/// --json`'s.
pub fn health_reply(health: Health) -> Response {
    let status = if health.status.serving() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(health)).into_response()
}

async fn health_route(State(front): State<Arc<HttpFront>>) -> Response {
    health_reply(front.metrics.health())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_status() {
        let want = [
            (ErrorCode::BadRequest, 400),
            (ErrorCode::UnknownModel, 404),
            (ErrorCode::TooLong, 413),
            (ErrorCode::Overloaded, 429),
            (ErrorCode::DeadlineExceeded, 504),
            (ErrorCode::Unavailable, 503),
            (ErrorCode::Internal, 500),
        ];
        for (code, status) in want {
            assert_eq!(status_of(code).as_u16(), status, "{code}");
        }
        assert_eq!(want.len(), ErrorCode::ALL.len());
    }

    #[test]
    fn tei_routes_answer_in_tei_shape() {
        for path in ["/embed", "/rerank", "/tokenize", "/info"] {
            assert_eq!(shape_of(path), Shape::Tei, "{path}");
            assert!(ROUTES.contains(path), "{path} missing from the 404 list");
        }
        for path in ["/v1/embeddings", "/v1/models", "/health", "/nope"] {
            assert_eq!(shape_of(path), Shape::OpenAi, "{path}");
        }
    }
}
