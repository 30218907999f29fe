//! Models: loading weights and configs from disk, and describing the forward
//! pass as a [`Program`] at a given (batch, seq) shape.
//!
//! * [`mlp`]: the articles' example, `Linear → activation → Linear …`, from a
//!   PyTorch `state_dict` saved with safetensors.
//! * [`bert`]: BERT-family sentence encoders from a Hugging Face folder, with
//!   sentence-transformers pooling and normalisation.
//! * [`program`]: the shape-fixed op list that backends capture.
//! * [`batch`]: the rows of one batch and how they are padded into a program's
//!   static inputs.
//! * [`st`]: the sentence-transformers side of a folder (modules, pooling,
//!   Dense, Normalize, prompts, maximum length, a cross-encoder's activation).
//! * [`tokenizer`]: a folder's tokenizer as transformers 5 builds it;
//!   [`wordpiece`]: the fast path that gives a BERT WordPiece tokenizer's ids
//!   for ASCII text without the `tokenizers` crate.
//! * [`files`], [`safetensors_file`]: reading JSON files and safetensors
//!   checkpoints (one file or sharded, memory-mapped), with errors that name
//!   the file; [`weights`]: the weight table, held as stored.
//!
//! What to load comes in a [`ModelSpec`] (the daemon's config builds one per
//! `[[models]]` entry); nothing here reads the daemon's configuration.
//!
//! The main process only needs [`ModelInfo`] (from [`inspect`], which reads
//! configs and safetensors headers but no weight data); worker processes call
//! [`Model::load`].

pub mod batch;
pub mod bert;
pub mod files;
pub mod mlp;
pub mod program;
pub mod safetensors_file;
pub mod st;
pub mod tokenizer;
pub mod weights;
pub mod wordpiece;

/// The default model's folder, for the tests that read the real MiniLM
/// (`scripts/dev/fetch-model.sh` puts it there; the README's test command
/// runs it).
#[cfg(test)]
pub(crate) fn minilm_dir() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2");
    assert!(
        dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file(),
        "{} is missing: run scripts/dev/fetch-model.sh",
        dir.display()
    );
    dir
}

pub use batch::BatchRows;
pub use program::{Activation, InputRole, Pooling, Program, ProgramFacts};
pub use weights::{WeightData, Weights};

use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use thiserror::Error;
use tokenizer::TokenizerSpec;

/// The families of model replayd serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A BERT-family encoder from a Hugging Face folder.
    Bert,
    /// Linear → activation → Linear … from a safetensors `state_dict`.
    Mlp,
}

/// What to load, and the settings that override the model's own files.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// The name clients use in requests.
    pub name: String,
    pub kind: ModelKind,
    /// BERT: the model folder. MLP: a `.safetensors` file, or a folder with
    /// `model.safetensors` and an optional `config.json` naming the activation.
    pub path: PathBuf,
    /// Compute dtype on the device.
    pub dtype: DType,
    /// Longest input in tokens (BERT); default: the folder's.
    pub max_seq_len: Option<usize>,
    /// MLP activation between linear layers (overrides the folder's).
    pub activation: Option<String>,
    /// Sentence pooling (BERT; overrides the folder's).
    pub pooling: Option<Pooling>,
    /// L2-normalise embeddings (overrides the folder's modules.json).
    pub normalize: Option<bool>,
}

impl ModelSpec {
    /// A model served as its folder (or file) says: f32 compute, no
    /// overrides.
    pub fn new(name: impl Into<String>, kind: ModelKind, path: impl Into<PathBuf>) -> ModelSpec {
        ModelSpec {
            name: name.into(),
            kind,
            path: path.into(),
            dtype: DType::F32,
            max_seq_len: None,
            activation: None,
            pooling: None,
            normalize: None,
        }
    }
}

/// Why a model could not be loaded. Always names the file and the problem.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("model {model}: {message}")]
    Invalid { model: String, message: String },
}

impl ModelError {
    pub fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ModelError::File {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// What a request to a model must carry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum InputSpec {
    /// An f32 tensor `[n, features]`.
    Features { features: usize },
    /// Token ids (or texts the frontend tokenizes), at most `max_seq_len`
    /// tokens each including special tokens; ids must be `< vocab_size`.
    Tokens {
        vocab_size: usize,
        max_seq_len: usize,
    },
}

/// What a model's output rows are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// One embedding (or MLP output) per text, id sequence or row.
    #[default]
    Embed,
    /// A cross-encoder: one row of `labels` scores per (query, passage) pair.
    Score { labels: usize },
    /// A sparse encoder (SPLADE): one row of vocabulary weights per text,
    /// mostly zeros, answered as its non-zero entries.
    Sparse,
}

/// A named prompt of `config_sentence_transformers.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prompt {
    /// Prepended to the text (no separator); empty: no prompt.
    pub text: String,
    /// `prompt_length` as sentence-transformers counts it (the prompt
    /// tokenized alone, minus its closing special token): the leading
    /// tokens pooling skips with `include_prompt = false`. Counted by
    /// [`inspect`] (it needs the tokenizer).
    pub tokens: Option<usize>,
}

/// A model's prompts, as `encode(prompt_name = …)` resolves them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prompts {
    pub prompts: BTreeMap<String, Prompt>,
    /// `default_prompt_name`: applied when a request names none.
    pub default: Option<String>,
    /// Pooling's `include_prompt = false`.
    pub exclude_from_pooling: bool,
}

impl Prompts {
    /// The prompt a request gets: `name`'s (an unknown name is an error
    /// listing the known ones), else the default; `None` for no prompt (an
    /// empty prompt is none).
    pub fn resolve(&self, name: Option<&str>) -> Result<Option<&Prompt>, String> {
        let chosen = match name.or(self.default.as_deref()) {
            None => return Ok(None),
            Some(n) => self.prompts.get(n).ok_or_else(|| {
                let known: Vec<&str> = self.prompts.keys().map(String::as_str).collect();
                format!(
                    "no prompt named {n:?} ({})",
                    if known.is_empty() {
                        "the model has no prompts".to_string()
                    } else {
                        format!("the model has {}", known.join(", "))
                    }
                )
            })?,
        };
        Ok((!chosen.text.is_empty()).then_some(chosen))
    }
}

/// One setting read or derived from a model folder, and where it came from
/// (logged at start-up, reported by the stats).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Derived {
    pub key: String,
    pub value: String,
    /// The file and key (or rule) it came from.
    pub from: String,
}

/// Everything about a model that the main process needs (no weights).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub kind: ModelKind,
    pub input: InputSpec,
    /// Width of one output row (embedding size, the number of labels, or
    /// the MLP's last layer).
    pub output_dim: usize,
    /// Compute dtype on the device.
    pub dtype: DType,
    /// Where the tokenizer lives, for token models.
    pub tokenizer_path: Option<PathBuf>,
    /// Embeddings, or a cross-encoder's scores (input `pairs`).
    #[serde(default)]
    pub task: Task,
    /// How to build the tokenizer (encoder folders).
    #[serde(default)]
    pub tokenizer: Option<TokenizerSpec>,
    #[serde(default)]
    pub prompts: Prompts,
    /// What was read from the folder and derived, with sources.
    #[serde(default)]
    pub derived: Vec<Derived>,
    /// Embedding models: the rows are L2-normalised (a `Normalize` module
    /// ends the folder's chain), so a truncated row is normalised again.
    #[serde(default)]
    pub normalized: bool,
    /// Embedding models: the folder's `truncate_dim`, the Matryoshka width
    /// a reply has when the request names no `dimensions`.
    #[serde(default)]
    pub truncate_dim: Option<usize>,
    /// How a Matryoshka cut is made (`dimensions`, `truncate_dim`).
    #[serde(default)]
    pub matryoshka: Matryoshka,
}

/// How an embedding is cut to fewer dimensions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Matryoshka {
    /// Keep the first values (then L2 again where the model normalises):
    /// sentence-transformers' `truncate_dim`.
    #[default]
    Truncate,
    /// nomic-embed-text's recipe: a LayerNorm without affine over the whole
    /// embedding, keep the first values, then L2. Its scale is undone by the
    /// L2, so it is the row minus its mean, cut, normalised.
    LayerNormThenTruncate,
}

impl ModelInfo {
    /// True for models with a sequence axis (seq buckets apply).
    pub fn has_seq(&self) -> bool {
        matches!(self.input, InputSpec::Tokens { .. })
    }

    /// `derived` as one line: `key=value (from); …`.
    pub fn derived_summary(&self) -> String {
        self.derived
            .iter()
            .map(|d| format!("{}={} ({})", d.key, d.value, d.from))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The architecture of a loaded model, with weight ids into [`Model::weights`].
// One per loaded model: the size difference costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Architecture {
    Mlp(mlp::MlpArch),
    Bert(bert::BertArch),
    RotaryEncoder(bert::RotaryEncoderArch),
    Decoder(bert::DecoderArch),
}

/// A model with its weights in host memory (as the checkpoint stores them,
/// mostly memory-mapped, or f32 where a loader computed them), ready for a
/// backend to upload.
#[derive(Clone, Debug)]
pub struct Model {
    pub info: ModelInfo,
    pub arch: Architecture,
    pub weights: Weights,
}

impl Model {
    /// Loads config and weights. Errors name the file and what is wrong.
    pub fn load(spec: &ModelSpec) -> Result<Model, ModelError> {
        match spec.kind {
            ModelKind::Mlp => mlp::load(spec),
            ModelKind::Bert => bert::load(spec),
        }
    }

    /// The forward pass captured for `bucket`: a padded (batch, seq)
    /// program, or for [`Bucket::Packed`](crate::bucket::Bucket::Packed)
    /// `{ tokens, seqs }` a packed program of `tokens` slots and `seqs`
    /// output rows accepting sequences of up to `min(max_seq_len, tokens)`
    /// tokens ([`bert::BertArch::packed_program`]). Models without a
    /// sequence axis have no packed programs (a [`ModelError`]).
    pub fn program_for(&self, bucket: crate::bucket::Bucket) -> Result<Program, ModelError> {
        match (bucket, &self.arch) {
            (crate::bucket::Bucket::Padded { batch, seq }, _) => Ok(self.program(batch, seq)),
            (crate::bucket::Bucket::Packed { tokens, seqs }, Architecture::Bert(arch)) => {
                Ok(arch.packed_program(tokens, seqs))
            }
            (crate::bucket::Bucket::Packed { tokens, seqs }, Architecture::RotaryEncoder(arch)) => {
                Ok(arch.packed_program(tokens, seqs))
            }
            (crate::bucket::Bucket::Packed { tokens, seqs }, Architecture::Decoder(arch)) => {
                Ok(arch.packed_program(tokens, seqs))
            }
            (crate::bucket::Bucket::Packed { .. }, Architecture::Mlp(_)) => {
                Err(ModelError::Invalid {
                    model: self.info.name.clone(),
                    message: format!("packed bucket {bucket} for a model without a sequence axis"),
                })
            }
        }
    }

    /// The program of the eager path for `rows`, at the batch's exact shape:
    /// with `packed` (and a sequence axis), a packed program of exactly the
    /// batch's tokens and sequences, accepting its longest sequence;
    /// otherwise `rows` rows padded to the longest sequence.
    pub fn eager_program(&self, rows: &BatchRows, packed: bool) -> Program {
        let n = rows.rows().max(1);
        match (&self.arch, rows) {
            (Architecture::Bert(arch), BatchRows::Tokens(_)) if packed => {
                let tokens = rows.tokens().max(1);
                arch.packed_program_upto(tokens, n, rows.max_len().clamp(1, tokens))
            }
            (Architecture::RotaryEncoder(arch), BatchRows::Tokens(_)) if packed => {
                let tokens = rows.tokens().max(1);
                arch.packed_program_upto(tokens, n, rows.max_len().clamp(1, tokens))
            }
            (Architecture::Decoder(arch), BatchRows::Tokens(_)) if packed => {
                let tokens = rows.tokens().max(1);
                arch.packed_program_upto(tokens, n, rows.max_len().clamp(1, tokens))
            }
            (_, BatchRows::Tokens(_)) => self.program(n, rows.max_len().max(1)),
            (_, BatchRows::Features { .. }) => self.program(n, 1),
        }
    }

    /// The forward pass at `batch` rows and `seq` tokens per row (`seq` is
    /// ignored, and the program's `seq` is 1, for models without a sequence axis).
    pub fn program(&self, batch: usize, seq: usize) -> Program {
        match &self.arch {
            Architecture::Mlp(arch) => arch.program(batch),
            Architecture::Bert(arch) => arch.program(batch, seq),
            Architecture::RotaryEncoder(arch) => arch.program(batch, seq),
            Architecture::Decoder(arch) => arch.program(batch, seq),
        }
    }
}

/// Reads a model's configs, tokenizer presence and safetensors header (names,
/// dtypes, shapes) without loading weight data, and checks that the model can
/// be served. The daemon calls this at start-up so a bad folder fails fast.
pub fn inspect(spec: &ModelSpec) -> Result<ModelInfo, ModelError> {
    match spec.kind {
        ModelKind::Mlp => mlp::inspect(spec),
        ModelKind::Bert => bert::inspect(spec),
    }
}
