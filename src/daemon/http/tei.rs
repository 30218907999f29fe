//! text-embeddings-inference's routes: `POST /embed`, `POST /embed_sparse`, `POST /rerank`,
//! `POST /tokenize`, `GET /info` (field names and reply shapes as TEI's
//! `router/src/http/types.rs`; what differs is in `docs/http.md`).

use super::{default_true, Failure, HttpFront, Kind, Rows, ServedModel, Shape, Want};
use crate::bucket::GridSpec;
use crate::daemon::tokenize::{TokenizeError, TokenizerPool};
use crate::model::{Derived, InputSpec, ModelInfo, Prompt, Task};
use crate::protocol::{ErrorCode, InputKind, Payload, RequestHeader};
use crate::tensor::DType;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use tokenizers::TruncationDirection;

const SHAPE: Shape = Shape::Tei;

/// TEI's `inputs`: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum Inputs {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbedRequest {
    inputs: Inputs,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default = "default_true")]
    normalize: bool,
    /// Passed on as the protocol header's `dimensions`.
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EmbedSparseRequest {
    inputs: Inputs,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    #[serde(default)]
    prompt_name: Option<String>,
    /// A replayd extension: keep each row's `top_k` largest entries.
    #[serde(default)]
    top_k: Option<u32>,
    #[serde(default)]
    model: Option<String>,
}

/// TEI's `SparseValue`: one vocabulary entry of a sparse embedding.
#[derive(Serialize)]
pub(super) struct SparseValue {
    index: u32,
    value: f32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RerankRequest {
    query: String,
    texts: Vec<String>,
    #[serde(default)]
    truncate: Option<bool>,
    #[serde(default)]
    truncation_direction: Option<String>,
    #[serde(default)]
    raw_scores: bool,
    #[serde(default)]
    return_text: bool,
    #[serde(default)]
    model: Option<String>,
}

/// One text's place in a `/rerank` reply.
#[derive(Serialize)]
pub(super) struct Rank {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    score: f32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    inputs: Inputs,
    #[serde(default = "default_true")]
    add_special_tokens: bool,
    #[serde(default)]
    prompt_name: Option<String>,
    #[serde(default)]
    model: Option<String>,
}

/// TEI's `SimpleToken`: `start` and `stop` are byte offsets into the text
/// tokenized (the prompt, when one applies, and the input), null for a
/// special token.
#[derive(Serialize)]
pub(super) struct SimpleToken {
    id: u32,
    text: String,
    special: bool,
    start: Option<usize>,
    stop: Option<usize>,
}

/// `truncate` when a request leaves it out (TEI's `auto_truncate`, which
/// `/info` reports): a text over the model's maximum is `too_long`.
const AUTO_TRUNCATE: bool = false;

/// The last value `inspect` derived for `key` (a later one, e.g. the
/// config's override, replaces an earlier).
fn derived<'a>(info: &'a ModelInfo, key: &str) -> Option<&'a Derived> {
    info.derived.iter().rev().find(|d| d.key == key)
}

impl HttpFront {
    /// TEI's `truncation_direction`: `"right"` (default) or `"left"`.
    fn direction(&self, value: Option<&str>) -> Result<TruncationDirection, Failure> {
        match value {
            None => Ok(TruncationDirection::Right),
            Some(v) if v.eq_ignore_ascii_case("right") => Ok(TruncationDirection::Right),
            Some(v) if v.eq_ignore_ascii_case("left") => Ok(TruncationDirection::Left),
            Some(v) => Err(self.refuse(
                SHAPE,
                ErrorCode::BadRequest,
                format!("`truncation_direction` must be \"right\" or \"left\", got {v:?}"),
            )),
        }
    }

    /// The texts of `inputs`, at least one.
    fn inputs(&self, inputs: Inputs) -> Result<Vec<String>, Failure> {
        let texts = match inputs {
            Inputs::One(t) => vec![t],
            Inputs::Many(t) => t,
        };
        if texts.is_empty() {
            return Err(self.refuse(SHAPE, ErrorCode::BadRequest, "`inputs` cannot be empty"));
        }
        Ok(texts)
    }

    /// The prompt texts get on `model` (`prompt_name`'s, else the folder's
    /// default), as the frontend resolves it for a `texts` request.
    fn prompt<'a>(
        &self,
        model: &'a ServedModel,
        name: Option<&str>,
    ) -> Result<Option<&'a Prompt>, Failure> {
        model.info.prompts.resolve(name).map_err(|e| {
            self.refuse(
                SHAPE,
                ErrorCode::BadRequest,
                format!("model {}: {e}", model.info.name),
            )
        })
    }

    fn tokenizer<'a>(&self, model: &'a ServedModel) -> Result<&'a TokenizerPool, Failure> {
        model.tokenizer.as_ref().ok_or_else(|| {
            self.refuse(
                SHAPE,
                ErrorCode::Internal,
                format!("model {} has no tokenizer", model.info.name),
            )
        })
    }

    /// The reply to a text the tokenizer refused.
    fn tokenize_failure(&self, model: &ServedModel, e: TokenizeError) -> Failure {
        let name = &model.info.name;
        match e {
            TokenizeError::TooLong { index, tokens, max } => self.refuse(
                SHAPE,
                ErrorCode::TooLong,
                format!(
                    "text {index} has {tokens} tokens, more than model {name}'s maximum of {max}"
                ),
            ),
            e @ TokenizeError::Pool(_) => self.refuse(SHAPE, ErrorCode::Internal, e.to_string()),
            e => self.refuse(
                SHAPE,
                ErrorCode::BadRequest,
                format!("cannot tokenize: {e}"),
            ),
        }
    }

    /// `/embed` with `truncate` and `truncation_direction: "left"`: the
    /// texts (prompt prepended) tokenized with a cut from the left and sent
    /// as ids. A prompt kept out of pooling (`include_prompt = false`)
    /// marks its tokens, which ids cannot carry (and a cut from the left
    /// would remove): refused.
    async fn left_cut_ids(
        &self,
        model: &ServedModel,
        texts: Vec<String>,
        prompt_name: Option<&str>,
    ) -> Result<Vec<Vec<u32>>, Failure> {
        let prompt = self.prompt(model, prompt_name)?;
        let texts = match prompt {
            Some(p) if model.info.prompts.exclude_from_pooling => {
                return Err(self.refuse(
                    SHAPE,
                    ErrorCode::BadRequest,
                    format!(
                        "`truncation_direction` \"left\" is not available on model {} with its prompt {:?}: the model keeps the prompt's tokens out of pooling (include_prompt = false), which a cut from the left would remove; truncate from the right, or send texts that fit",
                        model.info.name, p.text
                    ),
                ))
            }
            Some(p) => texts.iter().map(|t| format!("{}{t}", p.text)).collect(),
            None => texts,
        };
        let encodings = self
            .tokenizer(model)?
            .encode_detailed(texts, true, Some(TruncationDirection::Left))
            .await
            .map_err(|e| self.tokenize_failure(model, e))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }
}

impl HttpFront {
    /// The protocol request for `/embed`'s and `/embed_sparse`'s `inputs`:
    /// texts (the frontend applies the prompt and cuts from the right), or
    /// with `truncate` and `"left"` the ids tokenized and cut here.
    async fn texts_request(
        &self,
        model: &ServedModel,
        inputs: Inputs,
        truncate: Option<bool>,
        direction: Option<&str>,
        prompt_name: Option<String>,
    ) -> Result<(RequestHeader, Payload), Failure> {
        let direction = self.direction(direction)?;
        let texts = self.inputs(inputs)?;
        let truncate = truncate.unwrap_or(AUTO_TRUNCATE);
        if truncate && direction == TruncationDirection::Left {
            let ids = self
                .left_cut_ids(model, texts, prompt_name.as_deref())
                .await?;
            return Ok((self.header(model, InputKind::Ids), Payload::Ids(ids)));
        }
        let mut header = self.header(model, InputKind::Texts);
        header.prompt_name = prompt_name;
        header.truncate = truncate;
        Ok((header, Payload::Texts(texts)))
    }
}

/// `POST /embed`.
pub(super) async fn embed(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<Rows>, Failure> {
    let req: EmbedRequest = front.request(SHAPE, raw)?;
    let model = front.model_for(SHAPE, req.model, Want::Embedding)?;
    let (mut header, payload) = front
        .texts_request(
            model,
            req.inputs,
            req.truncate,
            req.truncation_direction.as_deref(),
            req.prompt_name,
        )
        .await?;
    header.dimensions = req.dimensions;
    let mut rows = front.send(SHAPE, &header, &payload).await?;
    if req.normalize {
        for row in &mut rows {
            let norm = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            // Already unit length (a model whose folder normalises): as is.
            if norm > 0.0 && (norm - 1.0).abs() > 1e-6 {
                row.iter_mut().for_each(|v| *v = (*v as f64 / norm) as f32);
            }
        }
    }
    Ok(Json(rows))
}

/// `POST /embed_sparse`: a sparse encoder's non-zero vocabulary weights
/// per text, in index order.
pub(super) async fn embed_sparse(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<Vec<Vec<SparseValue>>>, Failure> {
    let req: EmbedSparseRequest = front.request(SHAPE, raw)?;
    let model = front.model_for(SHAPE, req.model, Want::Sparse)?;
    let (mut header, payload) = front
        .texts_request(
            model,
            req.inputs,
            req.truncate,
            req.truncation_direction.as_deref(),
            req.prompt_name,
        )
        .await?;
    header.top_k = req.top_k;
    let rows = front.send_sparse(SHAPE, &header, &payload).await?;
    Ok(Json(
        (0..rows.rows())
            .map(|r| {
                let (indices, values) = rows.row(r);
                indices
                    .iter()
                    .zip(values)
                    .map(|(&index, &value)| SparseValue { index, value })
                    .collect()
            })
            .collect(),
    ))
}

/// `POST /rerank`: one (query, text) pair per text through the
/// cross-encoder, best score first.
pub(super) async fn rerank(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<Vec<Rank>>, Failure> {
    let req: RerankRequest = front.request(SHAPE, raw)?;
    let direction = front.direction(req.truncation_direction.as_deref())?;
    if req.texts.is_empty() {
        return Err(front.refuse(SHAPE, ErrorCode::BadRequest, "`texts` cannot be empty"));
    }
    let model = front.model_for(SHAPE, req.model, Want::Reranker)?;
    let name = &model.info.name;
    if req.raw_scores {
        // The folder's activation runs inside the graph; its input is not
        // kept, and inverting the activation would lose precision where it
        // saturates.
        match derived(&model.info, "activation") {
            Some(a) if a.value == "Identity" => {}
            Some(a) => {
                return Err(front.refuse(
                    SHAPE,
                    ErrorCode::BadRequest,
                    format!(
                        "raw scores are not available for model {name}: it applies its activation ({}, from {}) inside its graph; leave raw_scores out for the activated scores",
                        a.value, a.from
                    ),
                ))
            }
            None => {
                return Err(front.refuse(
                    SHAPE,
                    ErrorCode::BadRequest,
                    format!("raw scores are not available for model {name}: its activation is not known"),
                ))
            }
        }
    }
    let truncate = req.truncate.unwrap_or(AUTO_TRUNCATE);
    if truncate && direction == TruncationDirection::Left {
        return Err(front.refuse(
            SHAPE,
            ErrorCode::BadRequest,
            "`truncation_direction` \"left\" is not supported by /rerank: a pair is cut longest_first from the right, as sentence-transformers' CrossEncoder does",
        ));
    }
    let mut header = front.header(model, InputKind::Pairs);
    header.truncate = truncate;
    let query = req.query;
    let payload = Payload::Pairs(req.texts.into_iter().map(|t| (query.clone(), t)).collect());
    let rows = front.send(SHAPE, &header, &payload).await?;
    let Payload::Pairs(pairs) = payload else {
        unreachable!("built as pairs above")
    };
    let mut ranks: Vec<Rank> = rows
        .iter()
        .zip(pairs)
        .enumerate()
        .map(|(index, (row, (_, text)))| Rank {
            index,
            text: req.return_text.then_some(text),
            score: row.first().copied().unwrap_or(f32::NAN),
        })
        .collect();
    // Best first; equal scores keep the texts' order.
    ranks.sort_by(|a, b| b.score.total_cmp(&a.score));
    Ok(Json(ranks))
}

/// `POST /tokenize`: each text's tokens as the model gets them (the
/// prompt, special tokens, the cut at the model's maximum), with their
/// byte offsets.
pub(super) async fn tokenize(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<Vec<Vec<SimpleToken>>>, Failure> {
    let req: TokenizeRequest = front.request(SHAPE, raw)?;
    let texts = front.inputs(req.inputs)?;
    if texts.len() > front.max_items {
        return Err(front.refuse(
            SHAPE,
            ErrorCode::BadRequest,
            format!(
                "{} texts in one request, more than the limit of {} (server.max_items_per_request)",
                texts.len(),
                front.max_items
            ),
        ));
    }
    let model = front.model_for(SHAPE, req.model, Want::Tokenizer)?;
    let texts: Vec<String> = match front.prompt(model, req.prompt_name.as_deref())? {
        Some(p) => texts.iter().map(|t| format!("{}{t}", p.text)).collect(),
        None => texts,
    };
    let encodings = front
        .tokenizer(model)?
        .encode_detailed(
            texts.clone(),
            req.add_special_tokens,
            Some(TruncationDirection::Right),
        )
        .await
        .map_err(|e| front.tokenize_failure(model, e))?;
    let tokens = encodings
        .iter()
        .zip(&texts)
        .map(|(e, text)| {
            e.get_ids()
                .iter()
                .zip(e.get_offsets())
                .zip(e.get_special_tokens_mask())
                .zip(e.get_tokens())
                .map(|(((&id, &(start, stop)), &special), token)| {
                    if special == 1 {
                        SimpleToken {
                            id,
                            text: token.clone(),
                            special: true,
                            start: None,
                            stop: None,
                        }
                    } else {
                        let text = match text.get(start..stop) {
                            Some(s) => s.to_string(),
                            None => String::from_utf8_lossy(
                                text.as_bytes().get(start..stop).unwrap_or_default(),
                            )
                            .into_owned(),
                        };
                        SimpleToken {
                            id,
                            text,
                            special: false,
                            start: Some(start),
                            stop: Some(stop),
                        }
                    }
                })
                .collect()
        })
        .collect();
    Ok(Json(tokens))
}

/// TEI's dtype names.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        other => other.as_str(),
    }
}

/// The largest batch of a grid: (tokens, sequences).
fn largest_batch(grid: &GridSpec) -> (Option<usize>, Option<usize>) {
    match grid {
        GridSpec::Padded {
            batch_buckets,
            seq_buckets,
        } => {
            let rows = batch_buckets.iter().max().copied();
            let seq = seq_buckets.iter().max().copied();
            (rows.zip(seq).map(|(r, s)| r * s), rows)
        }
        GridSpec::Packed {
            token_budgets,
            max_seqs_per_batch,
        } => (
            token_budgets.iter().max().copied(),
            Some(*max_seqs_per_batch),
        ),
    }
}

impl HttpFront {
    /// TEI's `Info` for one model, and `max_request_bytes`.
    fn info_of(&self, model: &ServedModel, grids: &HashMap<String, GridSpec>) -> Value {
        let info = &model.info;
        // TEI spells sentence-transformers' `lasttoken` `last_token`.
        let pooling = derived(info, "pooling").map(|d| match d.value.as_str() {
            "lasttoken" => "last_token",
            other => other,
        });
        let activation = derived(info, "activation").map(|d| d.value.as_str());
        let model_type = match (Kind::of(info), info.task) {
            (Kind::Embedding, _) => json!({"embedding": {"pooling": pooling}}),
            (Kind::Reranker, Task::Score { labels }) => {
                json!({"reranker": {"num_labels": labels, "activation": activation}})
            }
            (_, Task::Score { labels }) => {
                json!({"classifier": {"num_labels": labels, "activation": activation}})
            }
            // TEI's name: an embedding model whose pooling is "splade".
            (_, Task::Sparse) => json!({"embedding": {"pooling": "splade"}}),
            (_, Task::Embed) => Value::Null,
        };
        let max_input_length = match info.input {
            InputSpec::Tokens { max_seq_len, .. } => Some(max_seq_len),
            InputSpec::Features { .. } => None,
        };
        let (max_batch_tokens, max_batch_requests) =
            grids.get(&info.name).map_or((None, None), largest_batch);
        json!({
            "model_id": info.name,
            "model_sha": null,
            "model_dtype": dtype_name(info.dtype),
            "served_model_name": info.name,
            "model_type": model_type,
            "max_concurrent_requests": self.max_concurrency,
            "max_input_length": max_input_length,
            "max_batch_tokens": max_batch_tokens,
            "max_batch_requests": max_batch_requests,
            "max_client_batch_size": self.max_items,
            "auto_truncate": AUTO_TRUNCATE,
            "tokenization_workers": model.tokenizer.as_ref().map(TokenizerPool::threads),
            "version": env!("CARGO_PKG_VERSION"),
            "sha": null,
            "docker_label": null,
            "max_request_bytes": self.max_request_bytes,
        })
    }
}

/// `GET /info`: TEI's `Info` for the default model (`/embed`'s, else
/// `/rerank`'s), and under `models` the same for every model the HTTP front
/// serves.
pub(super) async fn info(State(front): State<Arc<HttpFront>>) -> Result<Json<Value>, Failure> {
    let default = front.default_for(Want::Tokenizer).ok_or_else(|| {
        front.refuse(
            SHAPE,
            ErrorCode::BadRequest,
            "no encoder model is served (the HTTP front serves no MLP)",
        )
    })?;
    // The grids in force (a reload may have replaced the config's).
    let grids: HashMap<String, GridSpec> = front
        .metrics
        .snapshot()
        .models
        .into_iter()
        .map(|m| (m.name, m.grid))
        .collect();
    let models: Vec<Value> = front
        .frontend
        .models()
        .iter()
        .filter(|m| Kind::of(&m.info) != Kind::Tensor)
        .map(|m| front.info_of(m, &grids))
        .collect();
    let mut top = front.info_of(default, &grids);
    top["models"] = Value::Array(models);
    Ok(Json(top))
}
