//! The HTTP front (`[http]`, off by default): the embeddings routes the
//! ecosystem speaks, served by axum on the daemon's runtime.
//!
//! * `POST /v1/embeddings` — OpenAI's shape: `{"input": str | [str] | [int] |
//!   [[int]], "model": str, "encoding_format": "float" | "base64",
//!   "dimensions": int, "user": str}` →
//!   `{"object": "list", "data": [{"object": "embedding", "index": i,
//!   "embedding": [...] | "base64"}], "model": ..., "usage": {"prompt_tokens":
//!   N, "total_tokens": N}}`.
//! * `POST /embed` — text-embeddings-inference's shape: `{"inputs": str |
//!   [str], "normalize": bool (true), "truncate": bool (false)}` → `[[...]]`.
//! * `GET /v1/models`, `GET /health` ([`Health`], as `replayctl health --json`).
//!
//! Every request becomes a protocol request and goes through
//! [`Frontend::handle`] — the same decoding limits, admission, validation and
//! batcher as the ZeroMQ socket. Texts are tokenized first with the model's
//! own tokenizer ([`Frontend::tokenize`], exactly as a `texts` request is)
//! and sent as `ids`, so that `usage` can count the tokens. Errors are JSON
//! carrying the protocol's codes, with the HTTP status of [`status_of`].
//!
//! Bounds: at most `http.max_concurrency` requests are handled at once —
//! the slot is taken before the body is read, so bodies held in memory are
//! at most `max_concurrency × max_body_bytes`; more get 429 at once. Bodies
//! over `http.max_body_bytes` get 413 before they are read whole; each
//! request has the deadline `http.request_timeout_ms`. Unknown routes and
//! methods get JSON errors too (404, 405).
//!
//! [`router`] is served by [`super::http_server`], like `/metrics`.

use super::frontend::{Frontend, ServedModel};
use super::metrics::Metrics;
use super::stats::Health;
use crate::config::HttpConfig;
use crate::model::InputSpec;
use crate::protocol::{
    encode_request, ErrorCode, InputKind, Payload, ProtocolError, Reply, RequestHeader,
};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
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
    default_model: Option<String>,
    /// Ids for the protocol requests (only the frontend sees them).
    next_id: AtomicU64,
}

impl HttpFront {
    pub fn new(config: &HttpConfig, frontend: Arc<Frontend>, metrics: Arc<Metrics>) -> Arc<Self> {
        let default_model = config.default_model.clone().or_else(|| {
            frontend
                .models()
                .iter()
                .find(|m| m.tokenizer.is_some())
                .map(|m| m.info.name.clone())
        });
        Arc::new(HttpFront {
            frontend,
            metrics,
            slots: Semaphore::new(config.max_concurrency),
            timeout: Duration::from_millis(config.request_timeout_ms),
            default_model,
            next_id: AtomicU64::new(1),
        })
    }
}

/// Which JSON shape an error takes.
#[derive(Clone, Copy)]
enum Shape {
    /// `{"error": {"message", "type", "code"}}`
    OpenAi,
    /// `{"error": message, "error_type": code}`
    Tei,
}

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
        .route("/v1/embeddings", post(openai_embeddings))
        .route("/embed", post(tei_embed))
        .route("/v1/models", get(models))
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
    let shape = if request.uri().path() == "/embed" {
        Shape::Tei
    } else {
        Shape::OpenAi
    };
    // /health and /v1/models stay answerable when the embedding slots are full.
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
        "no route {} {} (routes: POST /v1/embeddings, POST /embed, GET /v1/models, GET /health)",
        request.method(),
        request.uri().path()
    );
    bad_request_with_status(StatusCode::NOT_FOUND, message)
}

async fn wrong_method(request: Request) -> Response {
    let message = format!(
        "{} is not allowed on {}",
        request.method(),
        request.uri().path()
    );
    bad_request_with_status(StatusCode::METHOD_NOT_ALLOWED, message)
}

/// An OpenAI-shaped `bad_request` reply with an HTTP status of its own.
fn bad_request_with_status(status: StatusCode, message: String) -> Response {
    let mut f = Failure::new(Shape::OpenAi, ErrorCode::BadRequest, message);
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

/// OpenAI's `input`: a string, strings, one token list, or token lists.
#[derive(Deserialize)]
#[serde(untagged)]
enum OpenAiInput {
    One(String),
    Many(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenAiRequest {
    input: OpenAiInput,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<u64>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TeiInputs {
    One(String),
    Many(Vec<String>),
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TeiRequest {
    inputs: TeiInputs,
    #[serde(default = "default_true")]
    normalize: bool,
    #[serde(default)]
    truncate: bool,
    #[serde(default)]
    truncation_direction: Option<String>,
}

/// What a request asks of an encoder model.
enum Texts {
    Strings(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

/// A successful embedding: rows, their width, and the tokens they took.
struct Embedded {
    model: String,
    rows: Vec<Vec<f32>>,
    tokens: usize,
}

impl HttpFront {
    fn model_for(&self, shape: Shape, requested: Option<String>) -> Result<&ServedModel, Failure> {
        let name = requested
            .or_else(|| self.default_model.clone())
            .ok_or_else(|| {
                Failure::new(
                    shape,
                    ErrorCode::BadRequest,
                    "no `model` given and no default model (http.default_model)",
                )
            })?;
        let model = self.frontend.model(0, &name).map_err(|e| {
            self.frontend.count_error(e.code);
            self.fail(shape, e)
        })?;
        if !matches!(model.info.input, InputSpec::Tokens { .. }) {
            return Err(self.refuse(
                shape,
                ErrorCode::BadRequest,
                format!(
                    "model {name} takes tensors (kind = \"mlp\"); the HTTP front serves encoder models"
                ),
            ));
        }
        Ok(model)
    }

    fn fail(&self, shape: Shape, e: ProtocolError) -> Failure {
        Failure::new(shape, e.code, e.message)
    }

    /// A failure the frontend did not see, counted like its own.
    fn refuse(&self, shape: Shape, code: ErrorCode, message: impl Into<String>) -> Failure {
        self.frontend.count_error(code);
        Failure::new(shape, code, message)
    }

    /// Tokenizes (when given texts), sends the ids through the frontend and
    /// returns the rows.
    async fn embed(
        &self,
        shape: Shape,
        model: &ServedModel,
        texts: Texts,
        truncate: bool,
    ) -> Result<Embedded, Failure> {
        let ids = match texts {
            Texts::Ids(ids) => ids,
            Texts::Strings(texts) => {
                if texts.is_empty() {
                    return Err(self.refuse(
                        shape,
                        ErrorCode::BadRequest,
                        "no input: expected at least one text",
                    ));
                }
                self.frontend
                    .tokenize(model, texts, truncate)
                    .await
                    .map_err(|e| {
                        self.frontend.count_error(e.code);
                        self.fail(shape, e)
                    })?
            }
        };
        let tokens = ids.iter().map(Vec::len).sum();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut header = RequestHeader::new(id, model.info.name.clone(), InputKind::Ids);
        header.timeout_us = Some(self.timeout.as_micros() as u64);
        let frames = encode_request(&header, &Payload::Ids(ids));
        let (reply, ticket) = self.frontend.handle(&frames, crate::clock::mono_ns()).await;
        drop(ticket);
        match reply {
            Reply::Ok { output, .. } => {
                let dim = output.shape.get(1).copied().unwrap_or(0).max(1);
                let data = crate::tensor::f32s_from_le(&output.data);
                Ok(Embedded {
                    model: model.info.name.clone(),
                    rows: data.chunks(dim).map(<[f32]>::to_vec).collect(),
                    tokens,
                })
            }
            Reply::Error { code, message, .. } => Err(Failure::new(shape, code, message)),
        }
    }
}

async fn openai_embeddings(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<OpenAiResponse>, Failure> {
    let shape = Shape::OpenAi;
    let raw =
        body(shape, raw).inspect_err(|_| front.frontend.count_error(ErrorCode::BadRequest))?;
    let req: OpenAiRequest =
        parse(shape, &raw).inspect_err(|_| front.frontend.count_error(ErrorCode::BadRequest))?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(front.refuse(
                shape,
                ErrorCode::BadRequest,
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let model = front.model_for(shape, req.model)?;
    if let Some(d) = req.dimensions {
        if d as usize != model.info.output_dim {
            return Err(front.refuse(
                shape,
                ErrorCode::BadRequest,
                format!(
                    "`dimensions` = {d} is not supported: model {} returns {} dimensions (leave `dimensions` out, or ask for exactly that)",
                    model.info.name, model.info.output_dim
                ),
            ));
        }
    }
    let texts = match req.input {
        OpenAiInput::One(t) => Texts::Strings(vec![t]),
        OpenAiInput::Many(t) => Texts::Strings(t),
        OpenAiInput::Tokens(ids) => Texts::Ids(vec![ids]),
        OpenAiInput::TokenLists(ids) => Texts::Ids(ids),
    };
    // Texts over the model's maximum are truncated, as sentence-transformers
    // (and a protocol request by default) does; an over-long token list is
    // too_long.
    let out = front.embed(shape, model, texts, true).await?;
    let data = out
        .rows
        .into_iter()
        .enumerate()
        .map(|(index, row)| OpenAiEmbedding {
            object: "embedding",
            index,
            embedding: if base64 {
                let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
                Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                Vector::Float(row)
            },
        })
        .collect();
    Ok(Json(OpenAiResponse {
        object: "list",
        data,
        model: out.model,
        usage: Usage {
            prompt_tokens: out.tokens,
            total_tokens: out.tokens,
        },
    }))
}

/// f32 values serialise as the shortest text that reads back as the same
/// f32 (through a `Value` they would be widened to f64 first).
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct OpenAiEmbedding {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

#[derive(Serialize)]
struct OpenAiResponse {
    object: &'static str,
    data: Vec<OpenAiEmbedding>,
    model: String,
    usage: Usage,
}

async fn tei_embed(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<Vec<Vec<f32>>>, Failure> {
    let shape = Shape::Tei;
    let raw =
        body(shape, raw).inspect_err(|_| front.frontend.count_error(ErrorCode::BadRequest))?;
    let req: TeiRequest =
        parse(shape, &raw).inspect_err(|_| front.frontend.count_error(ErrorCode::BadRequest))?;
    if let Some(dir) = req.truncation_direction.as_deref() {
        if !dir.eq_ignore_ascii_case("right") {
            return Err(front.refuse(
                shape,
                ErrorCode::BadRequest,
                format!("`truncation_direction` {dir:?} is not supported (only \"right\")"),
            ));
        }
    }
    let model = front.model_for(shape, None)?;
    let texts = match req.inputs {
        TeiInputs::One(t) => vec![t],
        TeiInputs::Many(t) => t,
    };
    let mut out = front
        .embed(shape, model, Texts::Strings(texts), req.truncate)
        .await?;
    if req.normalize {
        for row in &mut out.rows {
            let norm = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            // Already unit length (a model whose folder normalises): as is.
            if norm > 0.0 && (norm - 1.0).abs() > 1e-6 {
                row.iter_mut().for_each(|v| *v = (*v as f64 / norm) as f32);
            }
        }
    }
    Ok(Json(out.rows))
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
    fn openai_inputs_of_every_shape_parse() {
        let p = |s: &str| serde_json::from_str::<OpenAiRequest>(s).map(|r| r.input);
        assert!(matches!(p(r#"{"input": "a"}"#), Ok(OpenAiInput::One(_))));
        assert!(matches!(p(r#"{"input": ["a", "b"]}"#), Ok(OpenAiInput::Many(v)) if v.len() == 2));
        assert!(
            matches!(p(r#"{"input": [101, 102]}"#), Ok(OpenAiInput::Tokens(v)) if v == [101, 102])
        );
        assert!(matches!(
            p(r#"{"input": [[101, 102]]}"#),
            Ok(OpenAiInput::TokenLists(_))
        ));
        let e = serde_json::from_str::<OpenAiRequest>(r#"{"input": "a", "colour": 1}"#)
            .err()
            .unwrap();
        assert!(e.to_string().contains("colour"), "{e}");
    }
}
