//! `POST /v1/embeddings`, OpenAI's shape (see `docs/http.md`).

use super::{HttpFront, Shape, Want};
use crate::protocol::{ErrorCode, InputKind, Payload};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

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
    /// Passed on as the protocol header's `dimensions` (the frontend checks
    /// it against the model).
    #[serde(default)]
    dimensions: Option<u32>,
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
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
pub(super) struct OpenAiResponse {
    object: &'static str,
    data: Vec<OpenAiEmbedding>,
    model: String,
    usage: Usage,
}

pub(super) async fn embeddings(
    State(front): State<Arc<HttpFront>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<OpenAiResponse>, super::Failure> {
    let shape = Shape::OpenAi;
    let req: OpenAiRequest = front.request(shape, raw)?;
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
    let model = front.model_for(shape, req.model, Want::Embedding)?;
    // Texts over the model's maximum are truncated, as sentence-transformers
    // (and a protocol request by default) does; an over-long token list is
    // too_long.
    let (kind, tokens, payload) = match req.input {
        OpenAiInput::One(t) => texts(&front, model, vec![t]).await?,
        OpenAiInput::Many(t) => texts(&front, model, t).await?,
        OpenAiInput::Tokens(ids) => (InputKind::Ids, ids.len(), Payload::Ids(vec![ids])),
        OpenAiInput::TokenLists(ids) => {
            let tokens = ids.iter().map(Vec::len).sum();
            (InputKind::Ids, tokens, Payload::Ids(ids))
        }
    };
    let mut header = front.header(model, kind);
    header.dimensions = req.dimensions;
    let rows = front.send(shape, &header, &payload).await?;
    let data = rows
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
        model: model.info.name.clone(),
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    }))
}

/// Texts tokenized with the model's tokenizer, exactly as a `texts` request
/// is (the folder's default prompt included), and sent as ids so that
/// `usage` counts the tokens the model runs. A model whose default prompt
/// is kept out of pooling (`include_prompt = false`) marks the prompt's
/// tokens, which ids cannot carry: its texts are sent as texts (the
/// frontend tokenizes them again, the same way).
async fn texts(
    front: &HttpFront,
    model: &super::ServedModel,
    texts: Vec<String>,
) -> Result<(InputKind, usize, Payload), super::Failure> {
    let shape = Shape::OpenAi;
    if texts.is_empty() {
        return Err(front.refuse(
            shape,
            ErrorCode::BadRequest,
            "no input: expected at least one text",
        ));
    }
    let prompts = &model.info.prompts;
    let unpooled_prompt =
        prompts.exclude_from_pooling && matches!(prompts.resolve(None), Ok(Some(_)));
    let tokenize = |texts: Vec<String>| async {
        front
            .frontend
            .tokenize(model, texts, true)
            .await
            .map_err(|e| {
                front.frontend.count_error(e.code);
                front.fail(shape, e)
            })
    };
    if unpooled_prompt {
        let tokens = tokenize(texts.clone()).await?.iter().map(Vec::len).sum();
        return Ok((InputKind::Texts, tokens, Payload::Texts(texts)));
    }
    let ids = tokenize(texts).await?;
    let tokens = ids.iter().map(Vec::len).sum();
    Ok((InputKind::Ids, tokens, Payload::Ids(ids)))
}

#[cfg(test)]
mod tests {
    use super::*;

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
