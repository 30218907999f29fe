//! Hugging Face tokenizers, run on a dedicated thread pool.
//!
//! [`TextTokenizer`] wraps a model's `tokenizer.json` with our own
//! truncation and padding settings: whatever the file enables, there is no
//! padding (batches are padded to a bucket later) and truncation is at the
//! model's `max_seq_len`, special tokens (`[CLS]`/`[SEP]`) included, or off
//! when the caller asks for an error on over-long texts instead.
//!
//! [`TokenizerPool`] runs encodes on its own threads (serial workers for
//! requests of a few texts, a rayon pool for larger ones) and hands results
//! back over `tokio::sync::oneshot`, so tokenization never occupies the
//! async runtime's threads.
//!
//! A model folder's tokenizer is built by [`TextTokenizer::from_spec`] as
//! transformers 5 builds it ([`crate::model::tokenizer`]). Texts may get a
//! prompt (prepended, as sentence-transformers does; with
//! `include_prompt = false` its tokens carry
//! [`crate::model::batch::UNPOOLED_BIT`]), and cross-encoder
//! pairs are encoded together (`longest_first` truncation; the second
//! segment's tokens carry [`crate::model::batch::SEGMENT_BIT`]
//! for models with token types).
//!
//! BERT-family WordPiece tokenizers also get a fast path
//! ([`crate::model::wordpiece`]) that computes a single text's ids without
//! the `tokenizers` crate when the text is plain ASCII; any other text (and
//! every pair) takes the HF tokenizer. Both give the same ids, which the
//! tests and the `tokenizer_front` fuzz target check.

use crate::model::batch::{SEGMENT_BIT, UNPOOLED_BIT};
use crate::model::tokenizer::TokenizerSpec;
use crate::model::wordpiece::FastWordPiece;
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;
use tokenizers::{
    EncodeInput, Encoding, InputSequence, Tokenizer, TruncationDirection, TruncationParams,
    TruncationStrategy,
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
    /// The fast path for single ASCII texts, or why there is none.
    fast: Result<Arc<FastWordPiece>, String>,
}

/// What a request asks to tokenize.
#[derive(Clone, Debug, PartialEq)]
pub enum TextInput {
    Texts(Vec<String>),
    /// (query, passage) pairs of a cross-encoder.
    Pairs(Vec<(String, String)>),
}

impl TextInput {
    /// Texts, or pairs, in the request.
    pub fn len(&self) -> usize {
        match self {
            TextInput::Texts(t) => t.len(),
            TextInput::Pairs(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
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
            .field("fast_path", &self.fast.is_ok())
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
        let fast = FastWordPiece::new(&full).map(Arc::new);
        Ok(TextTokenizer {
            full,
            truncating,
            max_seq_len,
            path,
            token_types,
            fast,
        })
    }

    /// Whether single ASCII texts take the fast path
    /// ([`crate::model::wordpiece`]), or why not.
    pub fn fast_path(&self) -> Result<(), &str> {
        self.fast.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// [`TextTokenizer::encode`] on the HF tokenizer alone, never the fast
    /// path: the reference the fast path is checked against (tests, the
    /// fuzz target, the host benchmark).
    pub fn encode_reference(
        &self,
        texts: &[&str],
        truncate: bool,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        self.encode_with(
            texts.iter().map(|&t| EncodeInput::from(t)).collect(),
            truncate,
            None,
            false,
        )
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
        self.encode_with(inputs, truncate, unpooled, true)
    }

    /// The fast path's ids (special tokens included, truncated when
    /// `truncate`) of each single text it takes; `None` for the inputs that
    /// need the HF tokenizer (pairs, non-ASCII, possible added tokens).
    fn fast_ids(
        &self,
        fast: &FastWordPiece,
        inputs: &[EncodeInput],
        truncate: bool,
    ) -> Vec<Option<Vec<u32>>> {
        let (prefix, suffix) = (fast.prefix(), fast.suffix());
        // Truncation keeps the first `max - specials` ids, as the HF
        // tokenizer's (single-sequence `longest_first`) does.
        let budget = if truncate {
            self.max_seq_len.saturating_sub(prefix.len() + suffix.len())
        } else {
            usize::MAX
        };
        let one = |buf: &mut Vec<u8>, input: &EncodeInput| -> Option<Vec<u32>> {
            let EncodeInput::Single(InputSequence::Raw(text)) = input else {
                return None;
            };
            let mut ids = Vec::with_capacity(prefix.len() + suffix.len() + text.len() / 3 + 4);
            ids.extend_from_slice(prefix);
            if !fast.tokenize(text, budget, buf, &mut ids) {
                return None;
            }
            ids.extend_from_slice(suffix);
            Some(ids)
        };
        // A text takes about a microsecond: only large requests are worth
        // spreading over the pool (and only from inside it: elsewhere a
        // parallel iterator would hop to rayon's global pool).
        if inputs.len() >= 64 && rayon::current_thread_index().is_some() {
            inputs
                .par_iter()
                .with_min_len(32)
                .map_init(Vec::new, one)
                .collect()
        } else {
            let mut buf = Vec::new();
            inputs.iter().map(|i| one(&mut buf, i)).collect()
        }
    }

    fn encode_with(
        &self,
        inputs: Vec<EncodeInput>,
        truncate: bool,
        unpooled: Option<usize>,
        use_fast: bool,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        let tokenizer = if truncate {
            &self.truncating
        } else {
            &self.full
        };
        let pairs = inputs.iter().any(|i| matches!(i, EncodeInput::Dual(..)));
        let mut fast = match &self.fast {
            Ok(f) if use_fast && !pairs => self.fast_ids(f, &inputs, truncate),
            _ => vec![None; inputs.len()],
        };
        // What the fast path did not take goes to the HF tokenizer, by its
        // index in `inputs`.
        let hf_index: Vec<usize> = (0..inputs.len()).filter(|&i| fast[i].is_none()).collect();
        let hf_inputs: Vec<EncodeInput> = if hf_index.len() == inputs.len() {
            inputs
        } else {
            hf_index.iter().map(|&i| inputs[i].clone()).collect()
        };
        // In parallel only on the pool's rayon threads; on any other thread
        // (the pool's serial workers, an inline encode on the runtime) the
        // crate's batch encode would hand the texts to rayon's global pool
        // and wait for it.
        let parallel = rayon::current_thread_index().is_some();
        let encoded = if hf_inputs.is_empty() {
            Ok(Vec::new())
        } else if truncate && pairs {
            if parallel {
                hf_inputs
                    .par_iter()
                    .map(|i| self.encode_pair_longest_first(i))
                    .collect()
            } else {
                hf_inputs
                    .iter()
                    .map(|i| self.encode_pair_longest_first(i))
                    .collect()
            }
        } else if parallel {
            tokenizer.encode_batch_fast(hf_inputs.clone(), true)
        } else {
            // encode_batch_fast less its parallelism (padding is off).
            hf_inputs
                .iter()
                .map(|i| tokenizer.encode_fast(i.clone(), true))
                .collect()
        };
        let encodings: Vec<Encoding> = match encoded {
            Ok(e) => e,
            Err(e) => {
                // encode_batch does not say which input failed: find it.
                let index = hf_inputs
                    .into_iter()
                    .position(|t| tokenizer.encode_fast(t, true).is_err())
                    .map_or(0, |p| hf_index[p]);
                return Err(TokenizeError::Encode {
                    index,
                    message: e.to_string(),
                });
            }
        };
        let mut encodings = encodings.into_iter();
        let mut out = Vec::with_capacity(fast.len());
        for (index, fast) in fast.iter_mut().enumerate() {
            let mut ids = match fast.take() {
                Some(ids) => ids,
                None => {
                    let encoding = encodings.next().expect("one encoding per HF input");
                    let mut ids = encoding.get_ids().to_vec();
                    if self.token_types {
                        for (id, &ty) in ids.iter_mut().zip(encoding.get_type_ids()) {
                            if ty != 0 {
                                *id |= SEGMENT_BIT;
                            }
                        }
                    }
                    ids
                }
            };
            if ids.len() > self.max_seq_len {
                return Err(TokenizeError::TooLong {
                    index,
                    tokens: ids.len(),
                    max: self.max_seq_len,
                });
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

    /// One text through the HF tokenizer with what `POST /tokenize` shows
    /// (token strings, byte offsets, the special-tokens mask): special
    /// tokens when `add_special_tokens`; a text over `max_seq_len` tokens is
    /// cut from the `cut` end (special tokens kept), or without `cut` is
    /// [`TokenizeError::TooLong`]. Cut from the right, with special tokens,
    /// its ids are exactly [`TextTokenizer::encode`]'s with truncation; cut
    /// from the left, it keeps the last tokens, as the `tokenizers` library's
    /// `TruncationDirection::Left` does.
    pub fn encode_detailed(
        &self,
        text: &str,
        add_special_tokens: bool,
        cut: Option<TruncationDirection>,
    ) -> Result<Encoding, TokenizeError> {
        let failed = |e: tokenizers::Error| TokenizeError::Encode {
            index: 0,
            message: e.to_string(),
        };
        let encoding = match cut {
            None => self.full.encode(text, add_special_tokens),
            Some(TruncationDirection::Right) => self.truncating.encode(text, add_special_tokens),
            Some(TruncationDirection::Left) => {
                // As the library's post_process truncates (the budget less
                // the special tokens to add), from the other end.
                let tok = &self.full;
                let mut encoding = tok.encode(text, false).map_err(failed)?;
                let added = match (add_special_tokens, tok.get_post_processor()) {
                    (true, Some(p)) => tokenizers::PostProcessor::added_tokens(p, false),
                    _ => 0,
                };
                let budget = self.max_seq_len.saturating_sub(added);
                if encoding.len() > budget {
                    encoding.truncate(budget, 0, TruncationDirection::Left);
                }
                tok.post_process(encoding, None, add_special_tokens)
            }
        }
        .map_err(failed)?;
        if encoding.len() > self.max_seq_len {
            return Err(TokenizeError::TooLong {
                index: 0,
                tokens: encoding.len(),
                max: self.max_seq_len,
            });
        }
        Ok(encoding)
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

/// Tokenizes on dedicated threads, off the async runtime: requests of a few
/// texts on serial workers, larger ones spread over a rayon pool.
#[derive(Clone)]
pub struct TokenizerPool {
    tokenizer: Arc<TextTokenizer>,
    serial: Arc<SerialWorkers>,
    pool: Arc<rayon::ThreadPool>,
}

/// Requests with at least this many inputs go to the rayon pool.
const PARALLEL_INPUTS: usize = 8;

type Job = Box<dyn FnOnce() + Send>;

/// Threads that take one job at a time from a shared queue and sleep while
/// it is empty, so a job wakes one thread and an idle one costs nothing. A
/// rayon pool's idle workers instead spin through `sched_yield` for a while
/// after every job: under one-text requests that was 7 % of the daemon's CPU
/// samples (perf, null backend), on a host whose cores the batcher and the
/// sockets share. A job that panics is caught: its reply channel is dropped
/// (the request gets [`TokenizeError::Pool`]) and the thread goes on.
struct SerialWorkers {
    jobs: std::sync::mpsc::Sender<Job>,
    threads: usize,
}

impl SerialWorkers {
    fn new(threads: usize) -> Self {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let queue = Arc::new(std::sync::Mutex::new(queue));
        for i in 0..threads {
            let queue = Arc::clone(&queue);
            std::thread::Builder::new()
                .name(format!("tokenize-{i}"))
                .spawn(move || loop {
                    // The lock is held while waiting: the other idle workers
                    // sleep on it, and each job wakes exactly one of them.
                    let job = match queue.lock() {
                        Ok(q) => q.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        // Every sender is gone: the pool was dropped.
                        Err(_) => return,
                    }
                })
                .expect("cannot start the tokenizer threads");
        }
        SerialWorkers { jobs, threads }
    }

    fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        // Fails only once every worker has exited, which they do only when
        // this sender is gone (a job's panic is caught): never here.
        let _ = self.jobs.send(Box::new(job));
    }
}

impl std::fmt::Debug for TokenizerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerPool")
            .field("tokenizer", &self.tokenizer)
            .field("threads", &self.serial.threads)
            .finish()
    }
}

impl TokenizerPool {
    /// `threads` serial workers and a rayon pool of as many (0 = the number
    /// of cores, at most 8).
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
            .thread_name(|i| format!("tokenize-par-{i}"))
            .build()
            .expect("cannot start the tokenizer threads");
        TokenizerPool {
            tokenizer,
            serial: Arc::new(SerialWorkers::new(threads)),
            pool: Arc::new(pool),
        }
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// The pool's serial workers (as many again run its rayon pool).
    pub fn threads(&self) -> usize {
        self.serial.threads
    }

    /// Runs `job` on a serial worker, or on the rayon pool when it has
    /// `inputs` enough to spread.
    fn run(&self, inputs: usize, job: impl FnOnce() + Send + 'static) {
        if inputs >= PARALLEL_INPUTS {
            self.pool.spawn(job);
        } else {
            self.serial.spawn(job);
        }
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
        self.run(input.len(), move || {
            let _ = tx.send(tokenizer.encode_request(&input, truncate, prompt.as_ref()));
        });
        rx.await
            .map_err(|_| TokenizeError::Pool("the tokenizer worker stopped (panic)".into()))?
    }

    /// [`TextTokenizer::encode_detailed`] of each text, on the pool; an
    /// error names the text's index.
    pub async fn encode_detailed(
        &self,
        texts: Vec<String>,
        add_special_tokens: bool,
        cut: Option<TruncationDirection>,
    ) -> Result<Vec<Encoding>, TokenizeError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let tokenizer = Arc::clone(&self.tokenizer);
        self.run(texts.len(), move || {
            let encoded = texts
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    tokenizer
                        .encode_detailed(t, add_special_tokens, cut)
                        .map_err(|e| match e {
                            TokenizeError::TooLong { tokens, max, .. } => TokenizeError::TooLong {
                                index: i,
                                tokens,
                                max,
                            },
                            TokenizeError::Encode { message, .. } => {
                                TokenizeError::Encode { index: i, message }
                            }
                            e => e,
                        })
                })
                .collect();
            let _ = tx.send(encoded);
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
        self.run(texts.len(), move || {
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

    pub(crate) use crate::model::minilm_dir as model_dir;

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
    fn detailed_encodings_cut_either_end() {
        let tok = TextTokenizer::load(&model_dir(), 16).unwrap();
        let long = "word ".repeat(40);
        let full = TextTokenizer::load(&model_dir(), 512)
            .unwrap()
            .encode(&[long.as_str()], false)
            .unwrap()
            .remove(0);
        let right = tok
            .encode_detailed(&long, true, Some(TruncationDirection::Right))
            .unwrap();
        assert_eq!(
            right.get_ids(),
            tok.encode(&[long.as_str()], true).unwrap()[0]
        );
        // [CLS], the last 14 words, [SEP]; offsets into the text.
        let left = tok
            .encode_detailed(&long, true, Some(TruncationDirection::Left))
            .unwrap();
        let mut want = vec![full[0]];
        want.extend(&full[full.len() - 15..]);
        assert_eq!(left.get_ids(), want);
        assert_eq!(left.get_offsets()[14], (195, 199));
        assert_eq!(left.get_special_tokens_mask(), {
            let mut m = vec![0; 16];
            (m[0], m[15]) = (1, 1);
            m
        });
        let bare = tok
            .encode_detailed(&long, false, Some(TruncationDirection::Left))
            .unwrap();
        assert_eq!(bare.get_ids(), &full[full.len() - 17..full.len() - 1]);
        assert!(matches!(
            tok.encode_detailed(&long, true, None),
            Err(TokenizeError::TooLong { tokens: 42, .. })
        ));
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

    /// SplitMix64: a seeded generator for the differential tests.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
            &v[self.below(v.len())]
        }
    }

    fn vocab_words() -> Vec<String> {
        std::fs::read_to_string(model_dir().join("vocab.txt"))
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Texts as `scripts/bench/make-corpus.py` makes them: 3–200 alphabetic
    /// vocabulary words (longer than two characters), about 27 tokens on
    /// average (the Python script's log-normal length, approximated).
    pub(crate) fn corpus_like(count: usize, seed: u64) -> Vec<String> {
        let words: Vec<String> = vocab_words()
            .into_iter()
            .filter(|w| w.chars().count() > 2 && w.chars().all(char::is_alphabetic))
            .collect();
        let mut rng = Rng(seed);
        (0..count)
            .map(|_| {
                // exp(N(3.0, 0.7)) with N from the sum of 12 uniforms.
                let n: f64 = (0..12)
                    .map(|_| rng.next() as f64 / u64::MAX as f64)
                    .sum::<f64>()
                    - 6.0;
                let k = ((3.0 + 0.7 * n).exp() as usize).clamp(3, 200);
                (0..k)
                    .map(|_| rng.pick(&words).as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    /// Adversarial texts: every ASCII byte (controls included), punctuation
    /// runs, vocabulary words with odd case, words not in the vocabulary,
    /// words over 100 characters, literal special tokens inside words and
    /// alone, some non-ASCII, empty and whitespace-only texts, and long
    /// texts (over `max_seq_len`).
    fn adversarial(count: usize, seed: u64) -> Vec<String> {
        let words = vocab_words();
        let specials = [
            "[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[cls]", "[", "]",
        ];
        let odd = [
            "é", "漢字", "🙂", "\u{fffd}", "\u{a0}", "\u{200b}", "ß", "İ",
        ];
        let mut rng = Rng(seed);
        let mut out = vec![
            String::new(),
            " ".into(),
            " \t\n\r ".into(),
            "\0\u{1}\u{7f}".into(),
            "[CLS]".into(),
            "[SEP]".into(),
            "[MASK]".into(),
            "[PAD]".into(),
            "[UNK]".into(),
            "a[CLS]b".into(),
            "x[MASK]y [SEP]".into(),
            "!!!...???".into(),
            "a".repeat(100),
            "a".repeat(101),
            "ab".repeat(150),
            "hello ".repeat(300),
            "##ing ##s #".into(),
        ];
        while out.len() < count {
            let mut t = String::new();
            let long = rng.below(10) == 0;
            let parts = rng.below(if long { 400 } else { 30 });
            for _ in 0..parts {
                match rng.below(14) {
                    0 => t.push(rng.below(128) as u8 as char),
                    1 => t.push(*rng.pick(b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") as char),
                    2 => t.push(*rng.pick(&[' ', ' ', '\t', '\n', '\r', '\u{b}', '\u{c}'])),
                    3 => t.push((rng.below(0x20) as u8) as char),
                    4 => t.push_str(specials[rng.below(specials.len())]),
                    5 if rng.below(8) == 0 => t.push_str(odd[rng.below(odd.len())]),
                    6 => {
                        let long = rng.below(4) == 0;
                        let n = 1 + rng.below(if long { 140 } else { 12 });
                        t.extend((0..n).map(|_| (b'a' + rng.below(26) as u8) as char));
                    }
                    7 => {
                        let w = rng.pick(&words);
                        t.push_str(&w.to_uppercase());
                    }
                    _ => {
                        let w = rng.pick(&words).clone();
                        let w: String = w
                            .chars()
                            .map(|c| {
                                if rng.below(5) == 0 {
                                    c.to_ascii_uppercase()
                                } else {
                                    c
                                }
                            })
                            .collect();
                        t.push_str(&w);
                        if rng.below(3) != 0 {
                            t.push(' ');
                        }
                    }
                }
            }
            out.push(t);
        }
        out
    }

    /// The fast path (with its fallback) against the HF tokenizer alone,
    /// text by text, with and without truncation; returns how many texts the
    /// fast path itself took.
    fn assert_same_as_hf(tok: &TextTokenizer, texts: &[String]) -> usize {
        let fast = tok.fast.as_ref().expect("MiniLM has the fast path");
        let mut taken = 0;
        let mut buf = Vec::new();
        for (i, t) in texts.iter().enumerate() {
            if fast.tokenize(t, usize::MAX, &mut buf, &mut Vec::new()) {
                taken += 1;
            }
            for truncate in [true, false] {
                assert_eq!(
                    tok.encode(&[t.as_str()], truncate),
                    tok.encode_reference(&[t.as_str()], truncate),
                    "text {i} {t:?}, truncate {truncate}"
                );
            }
        }
        // Whole batches too (over 64 texts: the parallel path).
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        for chunk in refs.chunks(200) {
            for truncate in [true, false] {
                assert_eq!(
                    tok.encode(chunk, truncate),
                    tok.encode_reference(chunk, truncate)
                );
            }
        }
        taken
    }

    #[test]
    fn fast_path_matches_hf_on_the_reference_set() {
        let tok = TextTokenizer::load(&model_dir(), 256).unwrap();
        assert_eq!(tok.fast_path(), Ok(()));
        let texts: Vec<String> = reference().into_iter().map(|l| l.text).collect();
        let taken = assert_same_as_hf(&tok, &texts);
        assert!(
            taken >= 150,
            "the fast path took {taken} of {}",
            texts.len()
        );
        // And the reference ids themselves, through the fast path.
        let short = TextTokenizer::load(&model_dir(), 16).unwrap();
        assert_same_as_hf(&short, &texts);
    }

    #[test]
    fn fast_path_matches_hf_on_corpus_like_texts() {
        let texts = corpus_like(3000, 7);
        let mean = texts
            .iter()
            .map(|t| t.split(' ').count() + 2)
            .sum::<usize>()
            / texts.len();
        assert!((20..=35).contains(&mean), "mean {mean} tokens");
        for max in [512, 64] {
            let tok = TextTokenizer::load(&model_dir(), max).unwrap();
            // As in the Python corpus, a few words (łodz, wrocław,
            // stanisław) are not ASCII: those texts fall back.
            let taken = assert_same_as_hf(&tok, &texts);
            assert!(taken * 100 >= texts.len() * 98, "{taken}");
        }
    }

    #[test]
    fn fast_path_matches_hf_on_adversarial_ascii() {
        let texts = adversarial(4000, 11);
        for max in [512, 16, 2] {
            let tok = TextTokenizer::load(&model_dir(), max).unwrap();
            let taken = assert_same_as_hf(&tok, &texts);
            assert!(taken > 500 && taken < texts.len(), "{taken}");
        }
    }

    /// The literal special-token strings are HF's (the added tokens, split
    /// out of words): the fast path leaves them to it.
    #[test]
    fn literal_special_tokens_fall_back() {
        let tok = TextTokenizer::load(&model_dir(), 256).unwrap();
        let ids = tok.encode(&["[MASK]", "a[CLS]b", "[cls]"], true).unwrap();
        assert_eq!(ids[0], [101, 103, 102]);
        assert_eq!(ids[1], [101, 1037, 101, 1038, 102]);
        assert_eq!(ids[2].len(), 2 + 4, "[ cl ##s ]: {:?}", ids[2]);
    }

    /// Prompts (with their unpooled bits) and over-long texts give what the
    /// HF path gives; pairs take the HF path.
    #[test]
    fn fast_path_requests_match_hf() {
        let tok = TextTokenizer::load(&model_dir(), 16).unwrap();
        let prompt = PromptUse {
            text: "query: ".into(),
            unpooled: Some(4),
        };
        let texts = vec!["How are you?".to_string(), "caf\u{e9} au lait".to_string()];
        let got = tok
            .encode_request(&TextInput::Texts(texts.clone()), true, Some(&prompt))
            .unwrap();
        for (t, got) in texts.iter().zip(&got) {
            let mut want = tok
                .encode_reference(&[format!("query: {t}").as_str()], true)
                .unwrap()
                .remove(0);
            want.iter_mut().take(4).for_each(|id| *id |= UNPOOLED_BIT);
            assert_eq!(got, &want);
        }
        let long = "word ".repeat(40);
        let input = TextInput::Texts(vec!["short".into(), long.clone(), "x".into()]);
        assert_eq!(
            tok.encode_request(&input, false, None),
            Err(TokenizeError::TooLong {
                index: 1,
                tokens: 42,
                max: 16
            })
        );
        assert_eq!(
            tok.encode_request(&input, false, None),
            tok.encode_reference(&["short", &long, "x"], false)
        );
        let pairs = TextInput::Pairs(vec![("a question".into(), long)]);
        let got = tok.encode_request(&pairs, true, None).unwrap();
        assert_eq!(got[0].len(), 16);
        assert!(got[0][..3].iter().all(|&id| id & SEGMENT_BIT == 0));
    }

    /// The `tokenizer_front` fuzz entry point (which asserts the fast path
    /// equals the HF path) on its committed corpus and a few inputs made to
    /// reach the fallback and the ASCII mask.
    #[test]
    fn fuzz_harness_replays_the_tokenizer_corpus() {
        let tok = TextTokenizer::load(&model_dir(), 256).unwrap();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/tokenizer_front");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            crate::fuzz::tokenizer_text(&tok, &std::fs::read(e.unwrap().path()).unwrap());
            n += 1;
        }
        assert!(n >= 1, "{} has the seed", dir.display());
        for data in [
            &b"[CLS] \x00\xff\x7f hello [MASK]"[..],
            b"\xdb\xc3\xe1 caf\xc3\xa9",
            b"",
            &[b'x'; 300],
        ] {
            crate::fuzz::tokenizer_text(&tok, data);
        }
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

    /// A request of a few texts runs on a serial worker, a larger one on the
    /// rayon pool; both give the ids the tokenizer gives on the caller's
    /// thread, for plain ASCII (the fast path) and other text (the HF
    /// tokenizer), and for pairs.
    #[tokio::test]
    async fn serial_workers_and_the_rayon_pool_give_the_same_ids() {
        let tok = Arc::new(TextTokenizer::load(&model_dir(), 64).unwrap());
        let pool = TokenizerPool::new(tok.clone(), 2);
        for n in [1, PARALLEL_INPUTS - 1, PARALLEL_INPUTS, 70] {
            let texts: Vec<String> = (0..n)
                .map(|i| match i % 3 {
                    0 => format!("sentence number {i}"),
                    1 => format!("café numéro {i} — naïve"),
                    _ => "long words ".repeat(40),
                })
                .collect();
            let input = TextInput::Texts(texts.clone());
            let want = tok.encode_request(&input, true, None).unwrap();
            let got = pool.encode_request(input, true, None).await.unwrap();
            assert_eq!(got, want, "{n} texts");
            assert_eq!(got.len(), n);
            let pairs = TextInput::Pairs(texts.iter().map(|t| (t.clone(), t.repeat(2))).collect());
            let want = tok.encode_request(&pairs, true, None).unwrap();
            let got = pool.encode_request(pairs, true, None).await.unwrap();
            assert_eq!(got, want, "{n} pairs");
            assert!(got.iter().all(|ids| ids.len() <= 64));
        }
    }

    /// A job that panics on a serial worker leaves the worker serving the
    /// next jobs, and its caller gets an error, not a hang.
    #[tokio::test]
    async fn a_panicking_job_does_not_stop_a_serial_worker() {
        let workers = SerialWorkers::new(1);
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        workers.spawn(move || {
            let _keep = tx;
            panic!("a tokenizer bug");
        });
        assert!(
            rx.await.is_err(),
            "the panicked job's reply channel is dropped"
        );
        for i in 0..3 {
            let (tx, rx) = tokio::sync::oneshot::channel();
            workers.spawn(move || {
                let _ = tx.send(i);
            });
            assert_eq!(rx.await.unwrap(), i);
        }
    }
}
