//! Hugging Face tokenizers, run on a dedicated thread pool.
//!
//! [`TextTokenizer`] wraps a model's `tokenizer.json` with our own
//! truncation and padding settings: whatever the file enables, there is no
//! padding (batches are padded to a bucket later) and truncation is at the
//! model's `max_seq_len`, special tokens ([CLS]/[SEP]) included, or off
//! when the caller asks for an error on over-long texts instead.
//!
//! [`TokenizerPool`] runs encodes on its own rayon pool and hands results
//! back over `tokio::sync::oneshot`, so tokenization never occupies the
//! async runtime's threads.
//!
//! A model folder's tokenizer is built by [`TextTokenizer::from_spec`] as
//! transformers 5 builds it ([`crate::model::tokenizer`]). Texts may get a
//! prompt (prepended, as sentence-transformers does; with
//! `include_prompt = false` its tokens carry
//! [`UNPOOLED_BIT`](crate::model::batch::UNPOOLED_BIT)), and cross-encoder
//! pairs are encoded together (`longest_first` truncation; the second
//! segment's tokens carry [`SEGMENT_BIT`](crate::model::batch::SEGMENT_BIT)
//! for models with token types).

use crate::model::batch::{SEGMENT_BIT, UNPOOLED_BIT};
use crate::model::tokenizer::TokenizerSpec;
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;
use tokenizers::{
    EncodeInput, Encoding, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

#[derive(Debug, Error, Clone, PartialEq)]
pub enum TokenizeError {
    /// The tokenizer file could not be read or parsed.
    #[error("{path}: cannot load tokenizer: {message}")]
    Load { path: PathBuf, message: String },
    /// Text `index` of a request is longer than the model takes and
    /// truncation was not requested.
    #[error("input {index} has {tokens} tokens, more than the model's maximum of {max}")]
    TooLong {
        index: usize,
        tokens: usize,
        max: usize,
    },
    /// The tokenizer failed on a text.
    #[error("cannot tokenize text {index}: {message}")]
    Encode { index: usize, message: String },
    /// The pool's worker went away (a panic inside the tokenizer).
    #[error("tokenizer pool failed: {0}")]
    Pool(String),
}

/// A model's tokenizer with our truncation settings.
#[derive(Clone)]
pub struct TextTokenizer {
    /// No truncation, no padding: exact lengths (to report `TooLong`).
    full: Tokenizer,
    /// Truncation at `max_seq_len`, no padding.
    truncating: Tokenizer,
    max_seq_len: usize,
    path: PathBuf,
    /// Pairs: the second segment gets token type 1.
    token_types: bool,
}

/// What a request asks to tokenize.
#[derive(Clone, Debug, PartialEq)]
pub enum TextInput {
    Texts(Vec<String>),
    /// (query, passage) pairs of a cross-encoder.
    Pairs(Vec<(String, String)>),
}

/// A prompt to prepend to each text (the first element of a pair).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptUse {
    pub text: String,
    /// Leading tokens to exclude from pooling (`include_prompt = false`):
    /// the prompt's `prompt_length`.
    pub unpooled: Option<usize>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("max_seq_len", &self.max_seq_len)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a model folder, or the file itself.
    /// `max_seq_len` counts special tokens.
    pub fn load(
        folder_or_tokenizer_json: &Path,
        max_seq_len: usize,
    ) -> Result<Self, TokenizeError> {
        let path = if folder_or_tokenizer_json.is_dir() {
            folder_or_tokenizer_json.join("tokenizer.json")
        } else {
            folder_or_tokenizer_json.to_path_buf()
        };
        let load_error = |message: String| TokenizeError::Load {
            path: path.clone(),
            message,
        };
        if !path.is_file() {
            return Err(load_error("missing file".into()));
        }
        let full = Tokenizer::from_file(&path).map_err(|e| load_error(e.to_string()))?;
        Self::with_limits(full, path, max_seq_len, true)
    }

    /// Builds a model folder's tokenizer as transformers 5 does (see
    /// [`crate::model::tokenizer::build`]), truncating at the spec's maximum.
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self, TokenizeError> {
        let (tokenizer, _) =
            crate::model::tokenizer::build(spec).map_err(|e| TokenizeError::Load {
                path: spec.path.clone(),
                message: e.to_string(),
            })?;
        Self::with_limits(tokenizer, spec.path.clone(), spec.max_len, spec.token_types)
    }

    fn with_limits(
        mut full: Tokenizer,
        path: PathBuf,
        max_seq_len: usize,
        token_types: bool,
    ) -> Result<Self, TokenizeError> {
        let load_error = |message: String| TokenizeError::Load {
            path: path.clone(),
            message,
        };
        full.with_padding(None);
        full.with_truncation(None)
            .map_err(|e| load_error(e.to_string()))?;
        let mut truncating = full.clone();
        truncating
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: max_seq_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| load_error(format!("cannot truncate at {max_seq_len} tokens: {e}")))?;
        // The special tokens must fit: an empty text must encode within the limit.
        let empty = truncating
            .encode_fast("", true)
            .map_err(|e| load_error(e.to_string()))?;
        if empty.len() > max_seq_len {
            return Err(load_error(format!(
                "max_seq_len {max_seq_len} leaves no room for the {} special tokens",
                empty.len()
            )));
        }
        Ok(TextTokenizer {
            full,
            truncating,
            max_seq_len,
            path,
            token_types,
        })
    }

    /// Token ids of each text, special tokens included. With `truncate`,
    /// texts are cut to `max_seq_len` tokens; without it an over-long text
    /// is a [`TokenizeError::TooLong`] naming its index.
    ///
    /// Parallel over texts when called inside a rayon pool (as
    /// [`TokenizerPool`] does).
    pub fn encode(&self, texts: &[&str], truncate: bool) -> Result<Vec<Vec<u32>>, TokenizeError> {
        self.encode_inputs(
            texts.iter().map(|&t| EncodeInput::from(t)).collect(),
            truncate,
            None,
        )
    }

    /// [`TextTokenizer::encode`] for a request: texts with an optional
    /// prompt (prepended; with `unpooled`, its tokens are flagged), or
    /// pairs encoded together (the prompt goes before the first element;
    /// the second segment is flagged as type 1 where the model has token
    /// types).
    pub fn encode_request(
        &self,
        input: &TextInput,
        truncate: bool,
        prompt: Option<&PromptUse>,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        // With a prompt, the prompted first texts; the inputs borrow them
        // (or the request's own strings), so the retry on an error is cheap.
        let prompted: Vec<String> = match (input, prompt) {
            (_, None) => Vec::new(),
            (TextInput::Texts(texts), Some(p)) => {
                texts.iter().map(|t| format!("{}{t}", p.text)).collect()
            }
            (TextInput::Pairs(pairs), Some(p)) => pairs
                .iter()
                .map(|(a, _)| format!("{}{a}", p.text))
                .collect(),
        };
        let inputs: Vec<EncodeInput> = match input {
            TextInput::Texts(texts) => texts
                .iter()
                .enumerate()
                .map(|(i, t)| match prompted.get(i) {
                    Some(p) => p.as_str().into(),
                    None => t.as_str().into(),
                })
                .collect(),
            TextInput::Pairs(pairs) => pairs
                .iter()
                .enumerate()
                .map(|(i, (a, b))| match prompted.get(i) {
                    Some(p) => (p.as_str(), b.as_str()).into(),
                    None => (a.as_str(), b.as_str()).into(),
                })
                .collect(),
        };
        self.encode_inputs(inputs, truncate, prompt.and_then(|p| p.unpooled))
    }

    fn encode_inputs(
        &self,
        inputs: Vec<EncodeInput>,
        truncate: bool,
        unpooled: Option<usize>,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let tokenizer = if truncate {
            &self.truncating
        } else {
            &self.full
        };
        let pairs = inputs.iter().any(|i| matches!(i, EncodeInput::Dual(..)));
        let encoded = if truncate && pairs {
            inputs
                .par_iter()
                .map(|i| self.encode_pair_longest_first(i))
                .collect()
        } else {
            tokenizer.encode_batch_fast(inputs.clone(), true)
        };
        let encodings: Vec<Encoding> = match encoded {
            Ok(e) => e,
            Err(e) => {
                // encode_batch does not say which input failed: find it.
                let index = inputs
                    .into_iter()
                    .position(|t| tokenizer.encode_fast(t, true).is_err())
                    .unwrap_or(0);
                return Err(TokenizeError::Encode {
                    index,
                    message: e.to_string(),
                });
            }
        };
        let mut out = Vec::with_capacity(encodings.len());
        for (index, encoding) in encodings.into_iter().enumerate() {
            let ids = encoding.get_ids();
            if ids.len() > self.max_seq_len {
                return Err(TokenizeError::TooLong {
                    index,
                    tokens: ids.len(),
                    max: self.max_seq_len,
                });
            }
            let mut ids = ids.to_vec();
            if self.token_types {
                for (id, &ty) in ids.iter_mut().zip(encoding.get_type_ids()) {
                    if ty != 0 {
                        *id |= SEGMENT_BIT;
                    }
                }
            }
            if let Some(n) = unpooled {
                ids.iter_mut().take(n).for_each(|id| *id |= UNPOOLED_BIT);
            }
            out.push(ids);
        }
        Ok(out)
    }

    /// A pair truncated `longest_first` to `max_seq_len` as the
    /// `tokenizers` library's `truncate_encodings` does (see
    /// [`longest_first`]), computed here rather than by the crate: its
    /// early-exit tokenization (0.23.2, `do_tokenize`) cuts *each* side to
    /// `max_seq_len` tokens before splitting the budget, so two long sides
    /// look equally long and the odd token goes to the wrong side (the
    /// bert-cross-encoder `both-long` reference: 31 + 30 kept, the crate
    /// keeps 30 + 31).
    fn encode_pair_longest_first(&self, input: &EncodeInput) -> tokenizers::Result<Encoding> {
        let EncodeInput::Dual(a, b) = input else {
            return self.truncating.encode_fast(input.clone(), true);
        };
        let tok = &self.full;
        let mut first = tok.encode_fast(a.clone(), false)?;
        let mut second = tok.encode_fast(b.clone(), false)?;
        let added = tok
            .get_post_processor()
            .map_or(0, |p| tokenizers::PostProcessor::added_tokens(p, true));
        let budget = self.max_seq_len.saturating_sub(added);
        let (n1, n2) = longest_first(first.len(), second.len(), budget);
        first.truncate(n1, 0, TruncationDirection::Right);
        second.truncate(n2, 0, TruncationDirection::Right);
        tok.post_process(first, Some(second), true)
    }

    /// Vocabulary size, added tokens included (every id is below it).
    pub fn vocab_size(&self) -> usize {
        self.full.get_vocab_size(true)
    }

    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// The tokenizer.json this was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// How many tokens of each side of a pair `longest_first` keeps within
/// `budget` (the maximum less the pair's special tokens), as
/// `tokenizers::utils::truncation::truncate_encodings` decides: nothing is
/// cut when both fit; a shorter side that fits in half is kept whole and
/// the longer gets the rest; otherwise both get half, and an odd budget's
/// extra token goes to the longer side (to the second when they are equally
/// long). A returned count may exceed the side's length (keep it whole).
pub fn longest_first(first: usize, second: usize, budget: usize) -> (usize, usize) {
    if first + second <= budget {
        return (first, second);
    }
    let swap = first > second;
    // n1: the shorter side. As the crate does, n2 may exceed the longer
    // side's length (truncating to more than a side holds keeps it whole).
    let mut n1 = first.min(second);
    let mut n2 = if n1 > budget { n1 } else { n1.max(budget - n1) };
    if n1 + n2 > budget {
        n1 = budget / 2;
        n2 = n1 + budget % 2;
    }
    if swap {
        (n2, n1)
    } else {
        (n1, n2)
    }
}

/// Tokenizes on a dedicated pool of threads, off the async runtime.
#[derive(Clone)]
pub struct TokenizerPool {
    tokenizer: Arc<TextTokenizer>,
    pool: Arc<rayon::ThreadPool>,
}

impl std::fmt::Debug for TokenizerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerPool")
            .field("tokenizer", &self.tokenizer)
            .field("threads", &self.pool.current_num_threads())
            .finish()
    }
}

impl TokenizerPool {
    /// A pool of `threads` threads (0 = the number of cores, at most 8).
    ///
    /// Panics if the operating system refuses to start the threads.
    pub fn new(tokenizer: Arc<TextTokenizer>, threads: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tokenize-{i}"))
            .build()
            .expect("cannot start the tokenizer threads");
        TokenizerPool {
            tokenizer,
            pool: Arc::new(pool),
        }
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// Encodes a request's texts or pairs on the pool; see
    /// [`TextTokenizer::encode_request`].
    pub async fn encode_request(
        &self,
        input: TextInput,
        truncate: bool,
        prompt: Option<PromptUse>,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tokenizer = Arc::clone(&self.tokenizer);
        self.pool.spawn(move || {
            let _ = tx.send(tokenizer.encode_request(&input, truncate, prompt.as_ref()));
        });
        rx.await
            .map_err(|_| TokenizeError::Pool("the tokenizer worker stopped (panic)".into()))?
    }

    /// Encodes `texts` on the pool; see [`TextTokenizer::encode`].
    pub async fn encode(
        &self,
        texts: Vec<String>,
        truncate: bool,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tokenizer = Arc::clone(&self.tokenizer);
        self.pool.spawn(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            // The receiver may be gone (request cancelled): nothing to do then.
            let _ = tx.send(tokenizer.encode(&refs, truncate));
        });
        rx.await
            .map_err(|_| TokenizeError::Pool("the tokenizer worker stopped (panic)".into()))?
    }
}

#[cfg(test)]
mod tests {
    /// The bert-cross-encoder references' `truncation` fields (budget 61 =
    /// 64 − 3 special tokens).
    #[test]
    fn longest_first_splits_as_the_tokenizers_library() {
        let kept = |a, b, m| {
            let (x, y) = super::longest_first(a, b, m);
            (x.min(a), y.min(b))
        };
        assert_eq!(kept(33, 33, 61), (30, 31));
        assert_eq!(kept(10, 126, 61), (10, 51));
        assert_eq!(kept(126, 123, 61), (31, 30));
        assert_eq!(kept(126, 10, 61), (51, 10));
        assert_eq!(kept(20, 30, 61), (20, 30));
        assert_eq!(kept(0, 100, 61), (0, 61));
    }

    use super::*;
    use serde::Deserialize;

    pub(crate) fn model_dir() -> PathBuf {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2");
        assert!(
            dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file(),
            "{} is missing: run scripts/fetch-model.sh",
            dir.display()
        );
        dir
    }

    #[derive(Deserialize)]
    struct Line {
        text: String,
        ids: Vec<u32>,
    }

    fn reference() -> Vec<Line> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/minilm_set_a.jsonl");
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn ids_match_reference_for_all_lines() {
        let tok = TextTokenizer::load(&model_dir(), 256).unwrap();
        let lines = reference();
        assert_eq!(lines.len(), 300);
        let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
        let ids = tok.encode(&texts, true).unwrap();
        for (i, (line, got)) in lines.iter().zip(&ids).enumerate() {
            assert_eq!(got, &line.ids, "line {i}: {:?}", line.text);
        }
        // Nothing in the set is over 256 tokens, so no truncation either way.
        assert_eq!(tok.encode(&texts, false).unwrap(), ids);
        assert_eq!(tok.vocab_size(), 30522);
    }

    #[test]
    fn truncation_and_too_long() {
        let tok = TextTokenizer::load(&model_dir().join("tokenizer.json"), 16).unwrap();
        let long = "word ".repeat(40);
        let texts = ["short text", long.as_str()];
        let ids = tok.encode(&texts, true).unwrap();
        assert_eq!(ids[1].len(), 16);
        assert_eq!((ids[1][0], ids[1][15]), (101, 102));
        let full = TextTokenizer::load(&model_dir(), 512)
            .unwrap()
            .encode(&[long.as_str()], false)
            .unwrap();
        assert_eq!(ids[1][..15], full[0][..15]);
        let err = tok.encode(&texts, false).unwrap_err();
        assert_eq!(
            err,
            TokenizeError::TooLong {
                index: 1,
                tokens: 42,
                max: 16
            }
        );
        // No padding, whatever tokenizer.json says (it asks for Fixed(128)).
        assert_eq!(ids[0].len(), 4);
    }

    #[test]
    fn missing_tokenizer_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = TextTokenizer::load(dir.path(), 256)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("missing"),
            "{err}"
        );
        std::fs::write(dir.path().join("tokenizer.json"), "{oops").unwrap();
        let err = TextTokenizer::load(dir.path(), 256)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tokenizer.json") && err.contains("cannot load"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn pool_encodes_off_the_runtime() {
        let tok = Arc::new(TextTokenizer::load(&model_dir(), 256).unwrap());
        let pool = TokenizerPool::new(tok.clone(), 2);
        let texts: Vec<String> = (0..50).map(|i| format!("sentence number {i}")).collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let want = tok.encode(&refs, true).unwrap();
        let (a, b) = tokio::join!(
            pool.encode(texts.clone(), true),
            pool.encode(vec!["x ".repeat(300)], false)
        );
        assert_eq!(a.unwrap(), want);
        assert!(
            matches!(b, Err(TokenizeError::TooLong { index: 0, .. })),
            "{b:?}"
        );
    }
}
