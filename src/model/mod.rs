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
//! * [`files`], [`safetensors_file`]: reading JSON and safetensors files, with
//!   errors that name the file.
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
pub mod weights;

pub use batch::BatchRows;
pub use program::{Activation, InputRole, Pooling, Program, ProgramFacts};
pub use weights::Weights;

use crate::tensor::DType;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use thiserror::Error;

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

/// Everything about a model that the main process needs (no weights).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub kind: ModelKind,
    pub input: InputSpec,
    /// Width of one output row (embedding size, or the MLP's last layer).
    pub output_dim: usize,
    /// Compute dtype on the device.
    pub dtype: DType,
    /// Where the tokenizer lives, for token models.
    pub tokenizer_path: Option<PathBuf>,
}

impl ModelInfo {
    /// True for models with a sequence axis (seq buckets apply).
    pub fn has_seq(&self) -> bool {
        matches!(self.input, InputSpec::Tokens { .. })
    }
}

/// The architecture of a loaded model, with weight ids into [`Model::weights`].
#[derive(Clone, Debug)]
pub enum Architecture {
    Mlp(mlp::MlpArch),
    Bert(bert::BertArch),
}

/// A model with its weights in host memory (f32), ready for a backend to upload.
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
