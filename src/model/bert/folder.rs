//! Reading a BERT-family encoder (BERT, XLM-RoBERTa, MPNet) from a Hugging
//! Face or sentence-transformers folder, as sentence-transformers 6.2 /
//! transformers 5 read it (the rules, with their sources, are in
//! `docs/notes/sentence-transformers-folders.md`).
//!
//! The folder holds:
//!
//! * `modules.json` (optional) — the module list, read by [`crate::model::st`]:
//!   Transformer, then Pooling and any Dense / Normalize modules (a
//!   sentence embedding), or a lone Transformer of task
//!   `sequence-classification` (a cross-encoder). Any other module is refused
//!   by name. Without modules.json a folder is a plain transformers folder:
//!   mean pooling for a base model, a cross-encoder for a
//!   `*ForSequenceClassification` architecture.
//! * In the Transformer module's folder (the root, or e.g. `0_Transformer/`):
//!   `config.json` — `model_type` `bert`, `xlm-roberta`, `mpnet`,
//!   `distilbert` or `modernbert` (its own names: `modernbert.rs`), the
//!   hyper-parameters (required: `hidden_size`,
//!   `num_attention_heads`, `num_hidden_layers`, `intermediate_size`,
//!   `vocab_size`, `max_position_embeddings`; DistilBERT's `dim`,
//!   `n_heads`, `n_layers`, `hidden_dim`); `model.safetensors`, or a
//!   sharded `model.safetensors.index.json` with its shards (the base
//!   model's weights, optionally under `bert.` / `roberta.` / `mpnet.` /
//!   `distilbert.`, with the
//!   classification head for a cross-encoder); `tokenizer.json` and
//!   `tokenizer_config.json` (see [`crate::model::tokenizer`]);
//!   `sentence_bert_config.json` (max length, `do_lower_case`).
//! * `config_sentence_transformers.json` — the model type, prompts,
//!   `truncate_dim` (the default Matryoshka width) and a cross-encoder's
//!   activation.
//!
//! [`ModelSpec`]'s `pooling`, `normalize` and `max_seq_len` override the
//! folder (`normalize`: the normalisation at the end of the module chain);
//! `max_seq_len` may not exceed what the position table holds.
//!
//! [`inspect`] reads the JSON files, the safetensors headers (no weight data)
//! and builds the tokenizer (to report what it rebuilt and count each
//! prompt's tokens); [`load`] maps the weights and keeps them as stored
//! (f32 only where it computes a table), fusing each layer's query, key
//! and value projections into one `[3·hidden, hidden]` weight. Both
//! describe everything they resolved in [`ModelInfo::derived`].

use super::config::EncoderConfig;
use super::decoder_config::{self, DecoderConfig};
use super::gte;
use super::modernbert::{ModernBertConfig, ModernBertNames};
use super::{
    BertArch, BertEmbeddings, BertLayer, Classifier, DecoderArch, DenseLayer, Family, MlmHead,
    Norm, NormPlacement, RotaryEncoderArch, RotaryLayer,
};
use crate::model::files::read_json;
use crate::model::program::{Activation, GateOn, Pooling, PositionBias, WeightId};
use crate::model::safetensors_file::{checkpoint_in, read_header, Header, TensorFile};
use crate::model::st::{self, FolderType, ModuleKind};
use crate::model::tokenizer::{self, ClassSettings, TokenizerClass, TokenizerSpec};
use crate::model::{
    Architecture, Derived, InputSpec, Matryoshka, Model, ModelError, ModelInfo, ModelKind,
    ModelSpec, Prompt, Prompts, Task, Weights,
};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The table radius of MPNet's relative attention bias: distances beyond it
/// fall in the outermost buckets (the bucket is constant from |j − i| = 91).
pub const MPNET_BIAS_RADIUS: usize = 128;

/// MPNet's `relative_position_bucket(j − i, num_buckets = 32,
/// max_distance = 128)`, as `MPNetEncoder` computes it (in f32, truncated
/// toward zero): buckets 0–15 for keys at or before the query, 16–31 after.
pub fn mpnet_bucket(relative: i64) -> usize {
    let n = -relative; // i − j
    let mut ret = 0;
    if n < 0 {
        ret += 16;
    }
    let n = n.abs();
    if n < 8 {
        return ret + n as usize;
    }
    let large = 8 + ((n as f32 / 8.0).ln() / (16.0f64.ln() as f32) * 8.0) as i64;
    ret + large.min(15) as usize
}

pub(super) fn parse_config(path: &Path) -> Result<EncoderConfig, ModelError> {
    let json = read_json(path)?;
    let err = |m: String| ModelError::file(path, m);
    if !json.is_object() {
        return Err(err("expected a JSON object".into()));
    }
    let serves = "replayd serves BERT, XLM-RoBERTa, MPNet, DistilBERT, ModernBERT, GTE and NomicBERT encoders and Qwen3 and Gemma 3 embedding models: model_type \"bert\", \"xlm-roberta\", \"mpnet\", \"distilbert\", \"modernbert\", \"new\" / \"gte\", \"nomic_bert\", \"qwen3\" or \"gemma3_text\"";
    let family = match json.get("model_type").and_then(Value::as_str) {
        Some("bert") => Family::Bert,
        Some("xlm-roberta") => Family::XlmRoberta,
        Some("mpnet") => Family::Mpnet,
        Some("distilbert") => Family::DistilBert,
        Some("modernbert") => Family::ModernBert,
        Some("new" | "gte") => Family::Gte,
        Some("nomic_bert") => Family::NomicBert,
        Some("qwen3") => Family::Qwen3,
        Some("gemma3_text") => Family::Gemma3,
        Some(other) => {
            let arch = json
                .get("architectures")
                .and_then(|a| a.get(0))
                .and_then(Value::as_str)
                .map_or(String::new(), |a| format!(", architecture {a}"));
            return Err(err(format!(
                "unknown architecture: model_type {other:?}{arch} ({serves})"
            )));
        }
        None => {
            return Err(err(format!(
                "unknown architecture: no model_type ({serves})"
            )))
        }
    };
    for flag in ["is_decoder", "add_cross_attention"] {
        if json.get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(err(format!(
                "unsupported architecture: `{flag}` is true (replayd serves bidirectional encoders)"
            )));
        }
    }
    let architecture = match json.get("architectures") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.len() <= 1 => {
            a.first().and_then(Value::as_str).map(String::from)
        }
        Some(v) => {
            return Err(err(format!(
                "unsupported `architectures` {v} (one architecture)"
            )))
        }
    };
    let (base, classifier) = match family {
        Family::Bert => ("BertModel", "BertForSequenceClassification"),
        Family::XlmRoberta => ("XLMRobertaModel", "XLMRobertaForSequenceClassification"),
        Family::Mpnet => ("MPNetModel", "MPNetForSequenceClassification"),
        Family::DistilBert => ("DistilBertModel", "DistilBertForSequenceClassification"),
        Family::ModernBert => ("ModernBertModel", "ModernBertForSequenceClassification"),
        Family::Gte
            if architecture
                .as_deref()
                .is_some_and(|a| a.starts_with("New")) =>
        {
            ("NewModel", "NewForSequenceClassification")
        }
        Family::Gte => ("GteModel", "GteForSequenceClassification"),
        Family::NomicBert => ("NomicBertModel", "NomicBertForSequenceClassification"),
        Family::Qwen3 => ("Qwen3Model", "Qwen3ForSequenceClassification"),
        Family::Gemma3 => ("Gemma3TextModel", "Gemma3TextForSequenceClassification"),
    };
    let masked_lm = format!("{}ForMaskedLM", base.trim_end_matches("Model"));
    let head = match architecture.as_deref() {
        None => false,
        Some(a) if a == base || a == masked_lm => false,
        // Qwen3-Embedding's config names the causal LM; its checkpoint is
        // the base model (the LM head, if saved, is not read).
        Some(a) if family.is_decoder() && a.ends_with("ForCausalLM") => false,
        // Its head is pre_classifier + ReLU + classifier on [CLS], not
        // BERT's tanh pooler: refused rather than run as BERT's.
        Some(a)
            if a == classifier
                && matches!(
                    family,
                    Family::DistilBert
                        | Family::ModernBert
                        | Family::Gte
                        | Family::NomicBert
                        | Family::Qwen3
                        | Family::Gemma3
                ) =>
        {
            return Err(err(format!(
                "unsupported architecture {a}: {} cross-encoders are not served yet ({base} and {masked_lm} are)",
                family.model_type()
            )))
        }
        Some(a) if a == classifier => true,
        Some(a) => {
            return Err(err(format!(
            "unsupported architecture {a} (model_type {:?}: {base}, {masked_lm} or {classifier})",
            family.model_type()
        )))
        }
    };
    let size = |key: &str, default: Option<usize>| -> Result<usize, ModelError> {
        match json.get(key) {
            None if default.is_some() => Ok(default.unwrap_or_default()),
            None => Err(err(format!("missing `{key}`"))),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| err(format!("`{key}` is {v}, expected a positive integer"))),
        }
    };
    // NomicBERT's remote code keeps GPT-2's names (n_embd, …).
    let gpt2_keys = family == Family::NomicBert && json.get("n_embd").is_some();
    // DistilBertConfig names its sizes its own way.
    let [k_hidden, k_heads, k_layers, k_intermediate, k_act] = match family {
        Family::DistilBert => ["dim", "n_heads", "n_layers", "hidden_dim", "activation"],
        _ if gpt2_keys => [
            "n_embd",
            "n_head",
            "n_layer",
            "n_inner",
            "activation_function",
        ],
        Family::ModernBert | Family::Gemma3 => [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "intermediate_size",
            "hidden_activation",
        ],
        _ => [
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "intermediate_size",
            "hidden_act",
        ],
    };
    let hidden = size(k_hidden, None)?;
    let heads = size(k_heads, None)?;
    let layers = size(k_layers, None)?;
    let intermediate = if gpt2_keys {
        // NomicBertMLP: n_inner (null: 4·n_embd), rounded up to 256.
        let n = match json.get("n_inner") {
            None | Some(Value::Null) => 4 * hidden,
            Some(_) => size("n_inner", None)?,
        };
        n.div_ceil(256) * 256
    } else {
        size(k_intermediate, None)?
    };
    let max_position = size(
        if gpt2_keys {
            "n_positions"
        } else {
            "max_position_embeddings"
        },
        None,
    )?;
    let vocab = size("vocab_size", None)?;
    let type_vocab = match family {
        Family::Mpnet
        | Family::DistilBert
        | Family::ModernBert
        | Family::Qwen3
        | Family::Gemma3 => 0,
        // gte-base-en-v1.5 has none (0); the others one row.
        Family::Gte => match json.get("type_vocab_size") {
            Some(v) if v.as_u64() == Some(0) => 0,
            _ => size("type_vocab_size", Some(1))?,
        },
        _ => size("type_vocab_size", Some(2))?,
    };
    // The decoders' head size is a key of its own (`head_dim`).
    if hidden % heads != 0 && !family.is_decoder() {
        return Err(err(format!(
            "{k_hidden} {hidden} is not a multiple of {k_heads} {heads}"
        )));
    }
    let act = match json.get(k_act) {
        // The remote code's gated units: SwiGLU, GeGLU, GLU.
        Some(v) if gpt2_keys => match v.as_str() {
            Some("swiglu") => Activation::Silu,
            Some("geglu") => Activation::Gelu,
            Some("glu") => Activation::Sigmoid,
            _ => {
                return Err(err(format!(
                    "unsupported activation_function {v} (NomicBERT's gated \"swiglu\", \"geglu\" or \"glu\")"
                )))
            }
        },
        None if family == Family::NomicBert || family == Family::Qwen3 => Activation::Silu,
        None if family == Family::Gemma3 => Activation::GeluTanh,
        None => Activation::Gelu,
        Some(v) => v.as_str().and_then(Activation::parse).ok_or_else(|| {
            err(format!(
                "unsupported {k_act} {v} (gelu, gelu_new, relu, silu, tanh, ...)"
            ))
        })?,
    };
    let eps_key = match family {
        Family::ModernBert => "norm_eps",
        Family::Qwen3 | Family::Gemma3 => "rms_norm_eps",
        _ if gpt2_keys => "layer_norm_epsilon",
        _ => "layer_norm_eps",
    };
    let eps = match json.get(eps_key) {
        // DistilBERT's LayerNorms hard-code 1e-12 whatever the config says.
        _ if family == Family::DistilBert => 1e-12,
        None if family == Family::ModernBert || gpt2_keys => 1e-5,
        None if family.is_decoder() => 1e-6,
        None => 1e-12,
        Some(v) => v
            .as_f64()
            .filter(|e| *e > 0.0)
            .ok_or_else(|| err(format!("`{eps_key}` is {v}, expected a positive number")))?
            as f32,
    };
    if let Some(v) = json
        .get("position_embedding_type")
        .filter(|_| family != Family::Gte)
    {
        if v.as_str() != Some("absolute") {
            return Err(err(format!(
                "unsupported position_embedding_type {v} (only \"absolute\")"
            )));
        }
    }
    let pad = match family {
        Family::Bert
        | Family::DistilBert
        | Family::ModernBert
        | Family::Gte
        | Family::NomicBert
        | Family::Qwen3
        | Family::Gemma3 => None,
        // XLMRobertaEmbeddings: padding_idx = config.pad_token_id.
        Family::XlmRoberta => Some(match json.get("pad_token_id") {
            None | Some(Value::Null) => 1,
            Some(v) => v
                .as_u64()
                .filter(|&p| p < vocab as u64)
                .ok_or_else(|| err(format!("`pad_token_id` is {v}, expected a token id")))?
                as u32,
        }),
        // MPNetEmbeddings hard-codes padding_idx = 1.
        Family::Mpnet => Some(1),
    };
    if family == Family::Mpnet {
        let buckets = size("relative_attention_num_buckets", Some(32))?;
        if buckets != 32 {
            return Err(err(format!(
                "unsupported relative_attention_num_buckets {buckets} (MPNet's compute_position_bias always uses 32)"
            )));
        }
    }
    let labels = if head {
        let n = match json.get("id2label").and_then(Value::as_object) {
            Some(m) if !m.is_empty() => m.len(),
            _ => size("num_labels", Some(2))?,
        };
        Some(n)
    } else {
        None
    };
    Ok(EncoderConfig {
        family,
        hidden,
        heads,
        layers,
        intermediate,
        act,
        eps,
        max_position,
        type_vocab,
        vocab,
        pad,
        architecture,
        labels,
        json,
    })
}

/// A Dense module and whether a Normalize follows it.
#[derive(Clone, Debug)]
struct DenseModule {
    config: st::DenseConfig,
    normalize: bool,
}

/// Everything about a folder except the weights.
#[derive(Clone, Debug)]
struct Folder {
    config: EncoderConfig,
    /// The Transformer module's config.json (errors about it name it).
    config_path: PathBuf,
    kind: FolderType,
    pooling: Pooling,
    include_prompt: bool,
    /// Normalise right after pooling.
    normalize: bool,
    dense: Vec<DenseModule>,
    /// A cross-encoder's activation.
    activation: Option<Activation>,
    /// A sparse encoder's `SpladePooling`: the pooling over tokens and the
    /// activation each masked-LM logit gets first.
    splade: Option<(Pooling, Activation)>,
    max_seq_len: usize,
    tokenizer: TokenizerSpec,
    prompts: BTreeMap<String, String>,
    default_prompt: Option<String>,
    /// Matryoshka: the reply width when a request names none.
    truncate_dim: Option<usize>,
    weights: PathBuf,
    derived: Vec<Derived>,
}

fn derived(key: &str, value: impl std::fmt::Display, from: impl Into<String>) -> Derived {
    Derived {
        key: key.into(),
        value: value.to_string(),
        from: from.into(),
    }
}

fn pooling_name(p: Pooling) -> &'static str {
    match p {
        Pooling::Mean => "mean",
        Pooling::Cls => "cls",
        Pooling::Max => "max",
        Pooling::Sum => "sum",
        Pooling::LastToken => "lasttoken",
    }
}

fn activation_name(a: Activation) -> &'static str {
    match a {
        Activation::Identity => "Identity",
        Activation::Relu => "ReLU",
        Activation::Gelu => "GELU",
        Activation::GeluTanh => "GELU(tanh)",
        Activation::Tanh => "Tanh",
        Activation::Sigmoid => "Sigmoid",
        Activation::Silu => "SiLU",
        Activation::Log1pRelu => "log1p(ReLU)",
        Activation::Log1pLog1pRelu => "log1p(log1p(ReLU))",
    }
}

/// `model_max_length` of tokenizer_config.json (transformers writes 1e30
/// for "none", which JSON parses as a float).
fn model_max_length(config: &Value, path: &Path) -> Result<Option<u64>, ModelError> {
    match config.get("model_max_length") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match (v.as_u64(), v.as_f64()) {
            (Some(n), _) if n >= 2 => Ok(Some(n)),
            (None, Some(f)) if f >= 1e19 => Ok(Some(u64::MAX)),
            _ => Err(ModelError::file(
                path,
                format!("`model_max_length` is {v}, expected an integer ≥ 2"),
            )),
        },
    }
}

/// Whether a folder holds a model that `dtype = "auto"` runs in bf16 on
/// CUDA: the decoder families (trained in bf16; Gemma 3 overflows f16).
/// Unreadable folders say no (inspecting them reports why).
pub fn prefers_bf16(dir: &Path) -> bool {
    let transformer = match st::read_modules(dir) {
        Ok(Some(list)) => list
            .iter()
            .find(|m| m.kind == ModuleKind::Transformer)
            .map_or_else(|| dir.to_path_buf(), |m| m.dir.clone()),
        _ => dir.to_path_buf(),
    };
    parse_config(&transformer.join("config.json")).is_ok_and(|c| c.family.is_decoder())
}

fn describe(model: &ModelSpec) -> Result<Folder, ModelError> {
    let dir = &model.path;
    if !dir.is_dir() {
        return Err(ModelError::file(
            dir,
            if dir.exists() {
                "not a folder (a BERT-family model is a Hugging Face folder)"
            } else {
                "missing model folder"
            },
        ));
    }
    let mut derived_list = Vec::new();
    let modules = st::read_modules(dir)?;
    let st_config = st::read_st_config(dir)?;
    let modules_path = dir.join("modules.json");
    // The Transformer module comes first; its folder holds the model.
    let transformer_dir = match &modules {
        Some(list) => {
            let transformers = list
                .iter()
                .filter(|m| m.kind == ModuleKind::Transformer)
                .count();
            match list.first() {
                Some(m) if m.kind == ModuleKind::Transformer && transformers == 1 => m.dir.clone(),
                _ => {
                    return Err(ModelError::file(
                        &modules_path,
                        "expected exactly one Transformer module, first",
                    ))
                }
            }
        }
        None => dir.clone(),
    };
    let config_path = transformer_dir.join("config.json");
    let config = parse_config(&config_path)?;
    if config.family == Family::Gemma3 && model.dtype == crate::tensor::DType::F16 {
        return Err(ModelError::file(
            &config_path,
            "dtype f16 is refused for Gemma 3: its activations overflow f16 (transformers computes NaN in f16); use bf16 or f32 (dtype = \"auto\" picks bf16 on CUDA)",
        ));
    }
    let st_path = || {
        st_config
            .path
            .clone()
            .unwrap_or_else(|| dir.join("config_sentence_transformers.json"))
    };
    let kind = match (st_config.model_type.as_deref(), &modules, config.labels) {
        (Some("CrossEncoder"), Some(_), Some(_)) => FolderType::CrossEncoder,
        (Some("SparseEncoder"), Some(_), None) if config.is_masked_lm() => {
            if config.family == Family::ModernBert {
                return Err(ModelError::file(
                    &config_path,
                    "ModernBERT sparse encoders are not served yet (BERT, DistilBERT and XLM-RoBERTa masked-LM heads are)",
                ));
            }
            FolderType::SparseEncoder
        }
        (Some("SparseEncoder"), Some(_), _) => {
            return Err(ModelError::file(
                &config_path,
                format!(
                    "a SparseEncoder folder needs a *ForMaskedLM architecture (SPLADE pools the masked-LM head's logits), config.json has {}",
                    config.architecture.as_deref().unwrap_or("none")
                ),
            ))
        }
        (Some("CrossEncoder"), _, None) => {
            return Err(ModelError::file(
                &config_path,
                format!(
                    "a CrossEncoder folder needs a *ForSequenceClassification architecture, config.json has {} (sentence-transformers would add a randomly initialised head)",
                    config.architecture.as_deref().unwrap_or("none")
                ),
            ))
        }
        (None | Some("SentenceTransformer"), Some(_), Some(_)) => {
            return Err(ModelError::file(
                &config_path,
                format!(
                    "architecture {} is a classifier, but the folder is a SentenceTransformer ({}): refusing the mismatch",
                    config.architecture.as_deref().unwrap_or("?"),
                    modules_path.display()
                ),
            ))
        }
        (None | Some("SentenceTransformer"), Some(_), None) => FolderType::SentenceTransformer,
        (None, None, Some(_)) => FolderType::CrossEncoder,
        (None, None, None) => FolderType::SentenceTransformer,
        (Some(t @ ("SentenceTransformer" | "CrossEncoder" | "SparseEncoder")), None, _) => {
            return Err(ModelError::file(
                st_path(),
                format!("model_type {t:?} without modules.json"),
            ))
        }
        (Some(other), _, _) => {
            return Err(ModelError::file(
                st_path(),
                format!(
                    "unsupported `model_type` {other:?} (replayd serves SentenceTransformer, CrossEncoder and SparseEncoder folders)"
                ),
            ))
        }
    };
    derived_list.push(derived(
        "family",
        format!(
            "{} ({})",
            config.family.model_type(),
            config.architecture.as_deref().unwrap_or("no architectures")
        ),
        "config.json model_type",
    ));
    derived_list.push(derived(
        "task",
        match kind {
            FolderType::SentenceTransformer => "SentenceTransformer (embedding)".to_string(),
            FolderType::CrossEncoder => format!(
                "CrossEncoder ({} label{})",
                config.labels.unwrap_or(1),
                if config.labels == Some(1) { "" } else { "s" }
            ),
            FolderType::SparseEncoder => format!(
                "SparseEncoder (SPLADE over {} vocabulary logits)",
                config.vocab
            ),
        },
        if modules.is_some() {
            "modules.json, config_sentence_transformers.json"
        } else {
            "no modules.json: config.json architectures"
        },
    ));
    if let Some(pad) = config.pad {
        derived_list.push(derived(
            "position_ids",
            format!("from padding_idx {pad} + 1"),
            match config.family {
                Family::Mpnet => "MPNetEmbeddings (padding_idx 1)",
                _ => "config.json pad_token_id",
            },
        ));
    }
    if kind == FolderType::CrossEncoder {
        if let Some(list) = &modules {
            if list.len() != 1 {
                return Err(ModelError::file(
                    &modules_path,
                    "a CrossEncoder folder has exactly one module (the Transformer)",
                ));
            }
        }
    }

    // The Transformer module's config, the tokenizer and the maximum length.
    let transformer = st::read_transformer_config(&transformer_dir, kind)?;
    for note in &transformer.notes {
        derived_list.push(derived("ignored", note, "sentence_bert_config.json"));
    }
    let tokenizer_json = transformer_dir.join("tokenizer.json");
    if !tokenizer_json.is_file() {
        return Err(ModelError::file(
            &tokenizer_json,
            "missing file (the model's tokenizer is required)",
        ));
    }
    let tokenizer_config_path = transformer_dir.join("tokenizer_config.json");
    let tokenizer_config = if tokenizer_config_path.is_file() {
        read_json(&tokenizer_config_path)?
    } else {
        Value::Object(Default::default())
    };
    let class = TokenizerClass::resolve(
        tokenizer_config
            .get("tokenizer_class")
            .and_then(Value::as_str),
        config.family.model_type(),
    )
    .map_err(|m| ModelError::file(&tokenizer_config_path, m))?;
    let settings = ClassSettings::read(class, &tokenizer_config, &tokenizer_config_path)?;
    let resolved = st::resolve_max_length(
        &transformer,
        model_max_length(&tokenizer_config, &tokenizer_config_path)?,
        &tokenizer_config_path,
        config.max_position,
        config.positions(),
    );
    let max_seq_len = match model.max_seq_len {
        Some(n) if n > config.positions() => {
            return Err(ModelError::Invalid {
                model: model.name.clone(),
                message: format!(
                    "max_seq_len {n} exceeds what the model's max_position_embeddings {} holds ({} tokens; {})",
                    config.max_position,
                    config.positions(),
                    config_path.display()
                ),
            })
        }
        Some(n) => {
            derived_list.push(derived("max_seq_len", n, "the config's max_seq_len"));
            n
        }
        None => {
            derived_list.push(derived("max_seq_len", resolved.value, resolved.from));
            resolved.value
        }
    };
    if transformer.do_lower_case {
        derived_list.push(derived(
            "lowercase",
            "true (Lowercase normalizer in front)",
            "sentence_bert_config.json do_lower_case",
        ));
    }
    derived_list.push(derived(
        "tokenizer",
        class.name(),
        if tokenizer_config.get("tokenizer_class").is_some() {
            "tokenizer_config.json tokenizer_class"
        } else {
            "config.json model_type"
        },
    ));
    let tokenizer = TokenizerSpec {
        path: tokenizer_json,
        class,
        settings,
        lowercase: transformer.do_lower_case,
        max_len: max_seq_len,
        token_types: config.family == Family::Bert,
    };

    // Pooling, Dense and Normalize (sentence embeddings).
    let mut pooling = Pooling::Mean;
    let mut include_prompt = true;
    let mut normalize = false;
    let mut dense: Vec<DenseModule> = Vec::new();
    if kind == FolderType::SentenceTransformer {
        match &modules {
            None => derived_list.push(derived(
                "pooling",
                "mean",
                "no modules.json: sentence-transformers' default modules",
            )),
            Some(list) => {
                let mut seen_pooling = false;
                for (i, m) in list.iter().enumerate().skip(1) {
                    match m.kind {
                        ModuleKind::Pooling if i == 1 => {
                            let path = m.dir.join("config.json");
                            let (mode, include) =
                                st::read_pooling(&path, config.hidden, model.pooling)?;
                            pooling = mode;
                            include_prompt = include;
                            seen_pooling = true;
                            let rel = format!("{}/config.json", m.rel);
                            derived_list.push(derived("pooling", pooling_name(mode), rel.clone()));
                            derived_list.push(derived("include_prompt", include, rel));
                        }
                        ModuleKind::Dense if seen_pooling => {
                            let c = st::read_dense(&m.dir)?;
                            let width = dense.last().map_or(config.hidden, |d| d.config.outputs);
                            if c.inputs != width {
                                return Err(ModelError::file(
                                    m.dir.join("config.json"),
                                    format!(
                                        "in_features {} differs from the {width} values before it",
                                        c.inputs
                                    ),
                                ));
                            }
                            derived_list.push(derived(
                                "dense",
                                format!(
                                    "{}→{}{}, {}",
                                    c.inputs,
                                    c.outputs,
                                    if c.bias { " with bias" } else { "" },
                                    c.act_name
                                ),
                                format!("{}/config.json", m.rel),
                            ));
                            dense.push(DenseModule {
                                config: c,
                                normalize: false,
                            });
                        }
                        ModuleKind::Normalize if seen_pooling => {
                            st::read_normalize(&m.dir)?;
                            match dense.last_mut() {
                                Some(d) => d.normalize = true,
                                None => normalize = true,
                            }
                            derived_list.push(derived(
                                "normalize",
                                "L2",
                                format!(
                                    "modules.json {}{}",
                                    m.rel,
                                    if m.dir.exists() { "" } else { " (no such folder: none needed)" }
                                ),
                            ));
                        }
                        _ => {
                            return Err(ModelError::file(
                                &modules_path,
                                format!(
                                    "unsupported module order: module {i} ({:?}, path {:?}); replayd applies Transformer, Pooling, then Dense/Normalize",
                                    m.kind, m.rel
                                ),
                            ))
                        }
                    }
                }
                if !seen_pooling {
                    return Err(ModelError::file(
                        &modules_path,
                        "no Pooling module after the Transformer (token embeddings are not served)",
                    ));
                }
            }
        }
        if let Some(p) = model.pooling {
            pooling = p;
            derived_list.push(derived("pooling", pooling_name(p), "the config's pooling"));
        }
        if let Some(n) = model.normalize {
            match dense.last_mut() {
                Some(d) => d.normalize = n,
                None => normalize = n,
            }
            derived_list.push(derived("normalize", n, "the config's normalize"));
        }
    }

    // SpladePooling (sparse encoders): the only module after the Transformer.
    let splade = if kind == FolderType::SparseEncoder {
        let list = modules.as_deref().unwrap_or_default();
        match list {
            [_, m] if m.kind == ModuleKind::SpladePooling => {
                let (mode, act) = st::read_splade_pooling(&m.dir, config.vocab)?;
                let rel = if m.rel.is_empty() {
                    "SpladePooling defaults".to_string()
                } else {
                    format!("{}/config.json", m.rel)
                };
                derived_list.push(derived(
                    "splade",
                    format!(
                        "{} over tokens of {}",
                        pooling_name(mode),
                        activation_name(act)
                    ),
                    rel,
                ));
                for (set, key) in [
                    (model.pooling.is_some(), "pooling"),
                    (model.normalize.is_some(), "normalize"),
                ] {
                    if set {
                        return Err(ModelError::Invalid {
                            model: model.name.clone(),
                            message: format!(
                                "`{key}` does not apply to a sparse encoder (its SpladePooling module decides how tokens are pooled)"
                            ),
                        });
                    }
                }
                Some((mode, act))
            }
            _ => {
                return Err(ModelError::file(
                    &modules_path,
                    "a SparseEncoder folder is a masked-LM Transformer then SpladePooling (other sparse modules are not served)",
                ))
            }
        }
    } else {
        None
    };

    // Prompts.
    let mut prompts: BTreeMap<String, String> = BTreeMap::new();
    if kind != FolderType::CrossEncoder {
        // SentenceTransformer._default_prompts: query and document, "" unless saved.
        prompts.insert("query".into(), String::new());
        prompts.insert("document".into(), String::new());
    }
    prompts.extend(st_config.prompts.clone());
    let default_prompt = st_config.default_prompt_name.clone();
    if let Some(name) = &default_prompt {
        if !prompts.contains_key(name) {
            return Err(ModelError::file(
                st_path(),
                format!(
                    "`default_prompt_name` {name:?} is not one of the prompts ({})",
                    prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
    let shown: Vec<String> = prompts
        .iter()
        .filter(|(_, t)| !t.is_empty())
        .map(|(n, t)| format!("{n}={t:?}"))
        .collect();
    if !shown.is_empty() || default_prompt.is_some() {
        derived_list.push(derived(
            "prompts",
            format!(
                "{}; default {}",
                shown.join(", "),
                default_prompt.as_deref().unwrap_or("none")
            ),
            "config_sentence_transformers.json",
        ));
    }

    // A cross-encoder's activation.
    let activation = match (kind, config.labels) {
        (FolderType::CrossEncoder, Some(labels)) => {
            let st_for_rule = if modules.is_some() {
                st_config.clone()
            } else {
                st::StConfig::default()
            };
            let (a, from) =
                st::cross_encoder_activation(&st_for_rule, &config.json, &config_path, labels)?;
            derived_list.push(derived("activation", activation_name(a), from));
            Some(a)
        }
        _ => None,
    };

    let truncate_dim = match (st_config.truncate_dim, kind) {
        (None, _) => None,
        (Some(d), FolderType::SentenceTransformer) => {
            let width = dense.last().map_or(config.hidden, |m| m.config.outputs);
            let from = "config_sentence_transformers.json truncate_dim";
            if d >= width {
                derived_list.push(derived(
                    "truncate_dim",
                    format!("{d}, not below the width {width}: no truncation"),
                    from,
                ));
                None
            } else {
                derived_list.push(derived("truncate_dim", d, from));
                Some(d)
            }
        }
        (Some(d), FolderType::CrossEncoder | FolderType::SparseEncoder) => {
            return Err(ModelError::file(
                dir.join("config_sentence_transformers.json"),
                format!(
                    "`truncate_dim` {d} in a {} folder: its outputs cannot be truncated",
                    if kind == FolderType::CrossEncoder {
                        "cross-encoder"
                    } else {
                        "sparse encoder"
                    }
                ),
            ))
        }
    };

    // model.safetensors, or a sharded checkpoint's index.
    let weights = checkpoint_in(&transformer_dir).map_err(|missing| {
        let pickle = transformer_dir.join("pytorch_model.bin");
        if pickle.is_file() {
            ModelError::file(
                &pickle,
                "a Python pickle: replayd reads weights from safetensors only, model.safetensors or a sharded model.safetensors.index.json (convert it with safetensors)",
            )
        } else {
            missing
        }
    })?;
    Ok(Folder {
        config,
        config_path: config_path.clone(),
        kind,
        pooling,
        include_prompt,
        normalize,
        dense,
        activation,
        splade,
        max_seq_len,
        tokenizer,
        prompts,
        default_prompt,
        truncate_dim,
        weights,
        derived: derived_list,
    })
}

/// Names of a LayerNorm's parameters (`weight`/`bias`, or `gamma`/`beta`).
fn norm_names(header: &Header, base: &str) -> (String, String) {
    let weight = format!("{base}.weight");
    if header.get(&weight).is_none() && header.get(&format!("{base}.gamma")).is_some() {
        return (format!("{base}.gamma"), format!("{base}.beta"));
    }
    (weight, format!("{base}.bias"))
}

/// Tensor names of the embedding block, each layer and the head, resolved
/// against the header (prefix, LayerNorm naming) and checked for shape.
struct TensorNames {
    word: String,
    position: String,
    /// None: MPNet (no token types).
    token_type: Option<String>,
    embed_norm: (String, String),
    layers: Vec<LayerNames>,
    /// MPNet's `[32, heads]` bucket table.
    relative_bias: Option<String>,
    /// A cross-encoder's (pooler / dense, classifier / out_proj).
    classifier: Option<((String, String), (String, String))>,
    /// A sparse encoder's masked-LM head.
    mlm: Option<MlmNames>,
}

/// The masked-LM head's tensors: transform (dense + activation +
/// LayerNorm), then the decoder to the vocabulary and its bias.
struct MlmNames {
    transform: (String, String),
    norm: (String, String),
    /// `None`: tied to the word embeddings (not saved; transformers ties them).
    decoder: Option<String>,
    bias: String,
    act: Activation,
    eps: f32,
}

struct LayerNames {
    /// query, key, value: (weight, bias)
    qkv: [(String, String); 3],
    attention_output: (String, String),
    attention_norm: (String, String),
    intermediate: (String, String),
    output: (String, String),
    output_norm: (String, String),
}

/// Where each family keeps a layer's parts: the same post-norm block
/// (attention, add + LayerNorm, feed-forward, add + LayerNorm) under
/// different names.
struct LayerLayout {
    /// The layers' common prefix (`encoder.layer`, then `.N`).
    layers: &'static str,
    query: &'static str,
    key: &'static str,
    value: &'static str,
    attention_output: &'static str,
    attention_norm: &'static str,
    intermediate: &'static str,
    output: &'static str,
    output_norm: &'static str,
}

impl LayerLayout {
    fn of(family: Family) -> LayerLayout {
        const BERT: LayerLayout = LayerLayout {
            layers: "encoder.layer",
            query: "attention.self.query",
            key: "attention.self.key",
            value: "attention.self.value",
            attention_output: "attention.output.dense",
            attention_norm: "attention.output.LayerNorm",
            intermediate: "intermediate.dense",
            output: "output.dense",
            output_norm: "output.LayerNorm",
        };
        match family {
            Family::Bert | Family::XlmRoberta => BERT,
            Family::Mpnet => LayerLayout {
                query: "attention.attn.q",
                key: "attention.attn.k",
                value: "attention.attn.v",
                attention_output: "attention.attn.o",
                attention_norm: "attention.LayerNorm",
                ..BERT
            },
            Family::ModernBert
            | Family::Gte
            | Family::NomicBert
            | Family::Qwen3
            | Family::Gemma3 => {
                unreachable!("the rotary families' names are modernbert.rs's, gte.rs's and decoder_config.rs's")
            }
            Family::DistilBert => LayerLayout {
                layers: "transformer.layer",
                query: "attention.q_lin",
                key: "attention.k_lin",
                value: "attention.v_lin",
                attention_output: "attention.out_lin",
                attention_norm: "sa_layer_norm",
                intermediate: "ffn.lin1",
                output: "ffn.lin2",
                output_norm: "output_layer_norm",
            },
        }
    }
}

fn tensor_names(
    header: &Header,
    c: &EncoderConfig,
    masked_lm: bool,
) -> Result<TensorNames, ModelError> {
    let base = match c.family {
        Family::Bert => "bert.",
        Family::XlmRoberta => "roberta.",
        Family::Mpnet => "mpnet.",
        Family::DistilBert => "distilbert.",
        Family::ModernBert | Family::Gte | Family::NomicBert | Family::Qwen3 | Family::Gemma3 => {
            unreachable!(
                "the rotary families' names are modernbert.rs's, gte.rs's and decoder_config.rs's"
            )
        }
    };
    let prefix = if header.get("embeddings.word_embeddings.weight").is_some() {
        ""
    } else if header
        .get(&format!("{base}embeddings.word_embeddings.weight"))
        .is_some()
    {
        base
    } else {
        return Err(ModelError::file(
            &header.path,
            format!(
                "missing tensor `embeddings.word_embeddings.weight` (nor `{base}embeddings.word_embeddings.weight`): not a {} checkpoint",
                c.family.model_type()
            ),
        ));
    };
    let (h, i) = (c.hidden, c.intermediate);
    let why_h = format!(" (config.json: hidden_size {h})");
    let why_i = format!(" (config.json: hidden_size {h}, intermediate_size {i})");
    let word = format!("{prefix}embeddings.word_embeddings.weight");
    header.expect_shape(
        &word,
        &[c.vocab, h],
        &format!(" (config.json: vocab_size {}, hidden_size {h})", c.vocab),
    )?;
    let position = format!("{prefix}embeddings.position_embeddings.weight");
    header.expect_shape(
        &position,
        &[c.max_position, h],
        &format!(
            " (config.json: max_position_embeddings {}, hidden_size {h})",
            c.max_position
        ),
    )?;
    let token_type = if c.type_vocab > 0 {
        let name = format!("{prefix}embeddings.token_type_embeddings.weight");
        header.expect_shape(
            &name,
            &[c.type_vocab, h],
            &format!(
                " (config.json: type_vocab_size {}, hidden_size {h})",
                c.type_vocab
            ),
        )?;
        Some(name)
    } else {
        None
    };
    let norm = |base: String| -> Result<(String, String), ModelError> {
        let (g, b) = norm_names(header, &base);
        header.expect_shape(&g, &[h], &why_h)?;
        header.expect_shape(&b, &[h], &why_h)?;
        Ok((g, b))
    };
    let dense =
        |base: String, out: usize, inp: usize, why: &str| -> Result<(String, String), ModelError> {
            let (w, b) = (format!("{base}.weight"), format!("{base}.bias"));
            header.expect_shape(&w, &[out, inp], why)?;
            header.expect_shape(&b, &[out], why)?;
            Ok((w, b))
        };
    let embed_norm = norm(format!("{prefix}embeddings.LayerNorm"))?;
    let n = LayerLayout::of(c.family);
    let mut layers = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let p = format!("{prefix}{}.{l}", n.layers);
        layers.push(LayerNames {
            qkv: [
                dense(format!("{p}.{}", n.query), h, h, &why_h)?,
                dense(format!("{p}.{}", n.key), h, h, &why_h)?,
                dense(format!("{p}.{}", n.value), h, h, &why_h)?,
            ],
            attention_output: dense(format!("{p}.{}", n.attention_output), h, h, &why_h)?,
            attention_norm: norm(format!("{p}.{}", n.attention_norm))?,
            intermediate: dense(format!("{p}.{}", n.intermediate), i, h, &why_i)?,
            output: dense(format!("{p}.{}", n.output), h, i, &why_i)?,
            output_norm: norm(format!("{p}.{}", n.output_norm))?,
        });
    }
    // A checkpoint with more layers than config.json says is a mismatch, not
    // something to truncate silently.
    let layer_prefix = format!("{prefix}{}.", n.layers);
    for name in header.tensors.keys() {
        if let Some(rest) = name.strip_prefix(&layer_prefix) {
            let index = rest.split('.').next().and_then(|n| n.parse::<usize>().ok());
            if index.is_some_and(|n| n >= c.layers) {
                return Err(ModelError::file(
                    &header.path,
                    format!(
                        "tensor `{name}` belongs to a layer beyond config.json's num_hidden_layers {}",
                        c.layers
                    ),
                ));
            }
        }
    }
    let relative_bias = match c.family {
        Family::Mpnet => {
            let name = format!("{prefix}encoder.relative_attention_bias.weight");
            header.expect_shape(
                &name,
                &[32, c.heads],
                &format!(
                    " (32 buckets, config.json: num_attention_heads {})",
                    c.heads
                ),
            )?;
            Some(name)
        }
        _ => None,
    };
    let classifier = match c.labels {
        None => None,
        Some(labels) => {
            let why_l = format!(" (config.json: {labels} labels, hidden_size {h})");
            Some(match c.family {
                Family::Bert => (
                    dense(format!("{prefix}pooler.dense"), h, h, &why_h)?,
                    dense("classifier".into(), labels, h, &why_l)?,
                ),
                _ => (
                    dense("classifier.dense".into(), h, h, &why_h)?,
                    dense("classifier.out_proj".into(), labels, h, &why_l)?,
                ),
            })
        }
    };
    let mlm = if masked_lm {
        Some(mlm_names(header, c, &dense, &norm)?)
    } else {
        None
    };
    Ok(TensorNames {
        word,
        position,
        token_type,
        embed_norm,
        layers,
        relative_bias,
        classifier,
        mlm,
    })
}

/// Checks a linear layer's (weight, bias) of `[out, in]` and names them.
type DenseNames<'a> =
    dyn Fn(String, usize, usize, &str) -> Result<(String, String), ModelError> + 'a;

/// The masked-LM head of a `*ForMaskedLM` checkpoint, by family (BERT's
/// `cls.predictions`, DistilBERT's `vocab_*`, XLM-R's `lm_head`), checked
/// for shape. `dense` and `norm` check a (weight, bias) pair and a
/// LayerNorm of the hidden width.
fn mlm_names(
    header: &Header,
    c: &EncoderConfig,
    dense: &DenseNames<'_>,
    norm: &dyn Fn(String) -> Result<(String, String), ModelError>,
) -> Result<MlmNames, ModelError> {
    let h = c.hidden;
    let why_h = format!(" (config.json: hidden_size {h})");
    // (transform, its activation, LayerNorm, decoder, bias).
    let (transform, act, ln, decoder, biases): (&str, Activation, &str, &str, &[&str]) =
        match c.family {
            Family::Bert => (
                "cls.predictions.transform.dense",
                c.act,
                "cls.predictions.transform.LayerNorm",
                "cls.predictions.decoder",
                &["cls.predictions.bias", "cls.predictions.decoder.bias"],
            ),
            Family::DistilBert => (
                "vocab_transform",
                c.act,
                "vocab_layer_norm",
                "vocab_projector",
                &["vocab_projector.bias"],
            ),
            // RobertaLMHead applies gelu whatever hidden_act says.
            Family::XlmRoberta => (
                "lm_head.dense",
                Activation::Gelu,
                "lm_head.layer_norm",
                "lm_head.decoder",
                &["lm_head.bias", "lm_head.decoder.bias"],
            ),
            Family::Mpnet
            | Family::ModernBert
            | Family::Gte
            | Family::NomicBert
            | Family::Qwen3
            | Family::Gemma3 => {
                return Err(ModelError::file(
                    &header.path,
                    format!(
                "{} masked-LM heads are not served yet (BERT, DistilBERT and XLM-RoBERTa ones are)",
                c.family.model_type()
            ),
                ))
            }
        };
    let (tw, tb) = dense(transform.to_string(), h, h, &why_h)?;
    let norm = norm(ln.to_string())?;
    let why_v = format!(" (config.json: vocab_size {}, hidden_size {h})", c.vocab);
    let decoder_weight = format!("{decoder}.weight");
    let decoder = if header.get(&decoder_weight).is_some() {
        header.expect_shape(&decoder_weight, &[c.vocab, h], &why_v)?;
        Some(decoder_weight)
    } else if c.json.get("tie_word_embeddings").and_then(Value::as_bool) == Some(false) {
        return Err(ModelError::file(
            &header.path,
            format!("missing tensor `{decoder_weight}` (config.json: tie_word_embeddings false)"),
        ));
    } else {
        None
    };
    let bias = biases
        .iter()
        .find(|b| header.get(b).is_some())
        .ok_or_else(|| {
            ModelError::file(
                &header.path,
                format!("missing tensor `{}` (the masked-LM head's bias)", biases[0]),
            )
        })?
        .to_string();
    header.expect_shape(&bias, &[c.vocab], &why_v)?;
    Ok(MlmNames {
        transform: (tw, tb),
        norm,
        decoder,
        bias,
        act,
        // DistilBERT's vocab_layer_norm uses eps 1e-12 (c.eps already is).
        eps: c.eps,
    })
}

/// Checks a Dense module's weights (`linear.weight`, `linear.bias`).
fn dense_names(d: &st::DenseConfig) -> Result<Header, ModelError> {
    let header = read_header(&d.weights)?;
    let why = format!(
        " (config.json: in_features {}, out_features {})",
        d.inputs, d.outputs
    );
    header.expect_shape("linear.weight", &[d.outputs, d.inputs], &why)?;
    if d.bias {
        header.expect_shape("linear.bias", &[d.outputs], &why)?;
    }
    Ok(header)
}

fn info(model: &ModelSpec, folder: &Folder) -> ModelInfo {
    let output_dim = match (folder.config.labels, folder.dense.last()) {
        _ if folder.kind == FolderType::SparseEncoder => folder.config.vocab,
        (Some(labels), _) if folder.kind == FolderType::CrossEncoder => labels,
        (_, Some(d)) => d.config.outputs,
        _ => folder.config.hidden,
    };
    ModelInfo {
        name: model.name.clone(),
        kind: ModelKind::Bert,
        input: InputSpec::Tokens {
            vocab_size: folder.config.vocab,
            max_seq_len: folder.max_seq_len,
        },
        output_dim,
        dtype: model.dtype,
        tokenizer_path: Some(folder.tokenizer.path.clone()),
        task: match folder.kind {
            FolderType::SentenceTransformer => Task::Embed,
            FolderType::CrossEncoder => Task::Score {
                labels: folder.config.labels.unwrap_or(1),
            },
            FolderType::SparseEncoder => Task::Sparse,
        },
        tokenizer: Some(folder.tokenizer.clone()),
        prompts: Prompts {
            prompts: folder
                .prompts
                .iter()
                .map(|(n, t)| {
                    (
                        n.clone(),
                        Prompt {
                            text: t.clone(),
                            tokens: None,
                        },
                    )
                })
                .collect(),
            default: folder.default_prompt.clone(),
            exclude_from_pooling: !folder.include_prompt,
        },
        derived: folder.derived.clone(),
        normalized: folder.kind == FolderType::SentenceTransformer
            && folder
                .dense
                .last()
                .map_or(folder.normalize, |d| d.normalize),
        truncate_dim: folder.truncate_dim,
        matryoshka: if folder.config.family == Family::NomicBert {
            Matryoshka::LayerNormThenTruncate
        } else {
            Matryoshka::Truncate
        },
    }
}

/// Loads the configs and the weights (as stored; q/k/v fused).
pub fn load(config: &ModelSpec) -> Result<Model, ModelError> {
    let folder = describe(config)?;
    let file = TensorFile::open(&folder.weights)?;
    match folder.config.family {
        Family::ModernBert => return load_modernbert(config, &folder, &file),
        Family::Gte | Family::NomicBert => return load_rotary_post(config, &folder, &file),
        Family::Qwen3 | Family::Gemma3 => return load_decoder(config, &folder, &file),
        _ => {}
    }
    let names = tensor_names(
        &file.header,
        &folder.config,
        folder.kind == FolderType::SparseEncoder,
    )?;
    let c = &folder.config;
    let h = c.hidden;
    let mut weights = Weights::new();
    let mut push = |name: &str| -> Result<WeightId, ModelError> {
        let (shape, data) = file.stored(name)?;
        Ok(weights.push_data(name, shape, data))
    };
    let word = push(&names.word)?;
    let position = push(&names.position)?;
    let token_type = match &names.token_type {
        Some(n) => push(n)?,
        None => weights.push(
            "embeddings.token_type_embeddings.weight (none in MPNet or DistilBERT: zeros)",
            vec![1, h],
            vec![0.0; h],
        ),
    };
    let mut push = |name: &str| -> Result<WeightId, ModelError> {
        let (shape, data) = file.stored(name)?;
        Ok(weights.push_data(name, shape, data))
    };
    let embeddings = BertEmbeddings {
        word,
        position,
        token_type,
        norm_gamma: push(&names.embed_norm.0)?,
        norm_beta: push(&names.embed_norm.1)?,
    };
    let mut layers = Vec::with_capacity(names.layers.len());
    for ln in &names.layers {
        // [q; k; v] rows: the fused projection's output is [q | k | v].
        let [(qw, qb), (kw, kb), (vw, vb)] = &ln.qkv;
        let (qkv_shape, qkv_w) = file.concat_rows(&[qw, kw, vw])?;
        let (qkv_b_shape, qkv_b) = file.concat_rows(&[qb, kb, vb])?;
        let (base, _) = qw.rsplit_once(".attention.").expect("a layer tensor");
        let qkv_weight =
            weights.push_data(format!("{base}.attention.qkv.weight"), qkv_shape, qkv_w);
        let qkv_bias = weights.push_data(format!("{base}.attention.qkv.bias"), qkv_b_shape, qkv_b);
        let mut push = |name: &str| -> Result<WeightId, ModelError> {
            let (shape, data) = file.stored(name)?;
            Ok(weights.push_data(name, shape, data))
        };
        layers.push(BertLayer {
            qkv_weight,
            qkv_bias,
            attention_output_weight: push(&ln.attention_output.0)?,
            attention_output_bias: push(&ln.attention_output.1)?,
            attention_norm_gamma: push(&ln.attention_norm.0)?,
            attention_norm_beta: push(&ln.attention_norm.1)?,
            intermediate_weight: push(&ln.intermediate.0)?,
            intermediate_bias: push(&ln.intermediate.1)?,
            output_weight: push(&ln.output.0)?,
            output_bias: push(&ln.output.1)?,
            output_norm_gamma: push(&ln.output_norm.0)?,
            output_norm_beta: push(&ln.output_norm.1)?,
        });
    }
    // MPNet: the bucket table laid out by distance, [heads, 2R + 1].
    let position_bias = match &names.relative_bias {
        None => None,
        Some(name) => {
            let (_, buckets) = file.f32(name)?;
            let r = MPNET_BIAS_RADIUS;
            let mut table = vec![0.0f32; c.heads * (2 * r + 1)];
            for head in 0..c.heads {
                for col in 0..2 * r + 1 {
                    let b = mpnet_bucket(col as i64 - r as i64);
                    table[head * (2 * r + 1) + col] = buckets[b * c.heads + head];
                }
            }
            let id = weights.push(
                format!("{name} (by distance −{r}…{r})"),
                vec![c.heads, 2 * r + 1],
                table,
            );
            Some(PositionBias {
                table: id,
                radius: r,
            })
        }
    };
    let classifier = match (&names.classifier, folder.activation) {
        (Some((pooler, out)), Some(activation)) => {
            let mut push = |name: &str| -> Result<WeightId, ModelError> {
                let (shape, data) = file.stored(name)?;
                Ok(weights.push_data(name, shape, data))
            };
            Some(Classifier {
                pooler_weight: push(&pooler.0)?,
                pooler_bias: push(&pooler.1)?,
                weight: push(&out.0)?,
                bias: push(&out.1)?,
                labels: c.labels.unwrap_or(1),
                activation,
            })
        }
        _ => None,
    };
    let mlm = match (&names.mlm, folder.splade) {
        (Some(n), Some((pooling, splade_act))) => {
            let mut push = |name: &str| -> Result<WeightId, ModelError> {
                let (shape, data) = file.stored(name)?;
                Ok(weights.push_data(name, shape, data))
            };
            Some(MlmHead {
                transform_weight: push(&n.transform.0)?,
                transform_bias: push(&n.transform.1)?,
                act: n.act,
                norm_gamma: push(&n.norm.0)?,
                norm_beta: push(&n.norm.1)?,
                eps: n.eps,
                // Tied: the word embeddings are the decoder's [vocab, hidden] weight.
                decoder_weight: match &n.decoder {
                    Some(name) => push(name)?,
                    None => word,
                },
                decoder_bias: push(&n.bias)?,
                vocab: c.vocab,
                splade_act,
                pooling,
            })
        }
        _ => None,
    };
    let dense = dense_layers(&folder, &mut weights)?;
    let arch = BertArch {
        hidden: c.hidden,
        heads: c.heads,
        head_dim: c.hidden / c.heads,
        intermediate: c.intermediate,
        hidden_act: c.act,
        layer_norm_eps: c.eps,
        vocab_size: c.vocab,
        max_position_embeddings: c.max_position,
        type_vocab_size: c.type_vocab.max(1),
        max_seq_len: folder.max_seq_len,
        pooling: folder.pooling,
        normalize: folder.normalize,
        embeddings,
        layers,
        family: c.family,
        position_ids: c.position_ids(),
        position_bias,
        pool_skip: !folder.include_prompt && classifier.is_none(),
        dense,
        classifier,
        mlm,
    };
    Ok(Model {
        info: info(config, &folder),
        arch: Architecture::Bert(arch),
        weights,
    })
}

/// The sentence-transformers `Dense` modules' weights, in order.
fn dense_layers(folder: &Folder, weights: &mut Weights) -> Result<Vec<DenseLayer>, ModelError> {
    let mut dense = Vec::new();
    for d in &folder.dense {
        dense_names(&d.config)?;
        let f = TensorFile::open(&d.config.weights)?;
        let dir = d
            .config
            .weights
            .parent()
            .and_then(Path::file_name)
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let (shape, data) = f.stored("linear.weight")?;
        let weight = weights.push_data(format!("{dir}/linear.weight"), shape, data);
        let bias = if d.config.bias {
            let (shape, data) = f.stored("linear.bias")?;
            Some(weights.push_data(format!("{dir}/linear.bias"), shape, data))
        } else {
            None
        };
        dense.push(DenseLayer {
            weight,
            bias,
            act: d.config.act,
            inputs: d.config.inputs,
            outputs: d.config.outputs,
            normalize: d.normalize,
        });
    }
    Ok(dense)
}

/// [`load`] for a ModernBERT folder ([`super::modernbert`]).
fn load_modernbert(
    config: &ModelSpec,
    folder: &Folder,
    file: &TensorFile,
) -> Result<Model, ModelError> {
    let c = &folder.config;
    let m = ModernBertConfig::read(&c.json, c.layers, &folder.config_path)?;
    let names = ModernBertNames::check(&file.header, c, &m)?;
    let mut weights = Weights::new();
    let encoder = names.load(file, c, &m, &mut weights)?;
    let dense = dense_layers(folder, &mut weights)?;
    let arch = RotaryEncoderArch {
        final_norm: Some(encoder.final_norm),
        // [input | gate]: GeGLU's activation on the first half.
        gate_on: GateOn::First,
        placement: NormPlacement::Pre,
        ..rotary_arch(
            folder,
            encoder.word,
            encoder.embedding_norm,
            encoder.layers,
            dense,
        )
    };
    Ok(Model {
        info: info(config, folder),
        arch: Architecture::RotaryEncoder(arch),
        weights,
    })
}

/// The parts of a [`RotaryEncoderArch`] every family fills alike: sizes from
/// config.json, the head from the sentence-transformers modules, and the
/// defaults the families' loaders override (pre-norm, no final norm, the
/// gate on the first half, plain rotary).
fn rotary_arch(
    folder: &Folder,
    word: WeightId,
    embedding_norm: Norm,
    layers: Vec<RotaryLayer>,
    dense: Vec<DenseLayer>,
) -> RotaryEncoderArch {
    let c = &folder.config;
    RotaryEncoderArch {
        hidden: c.hidden,
        heads: c.heads,
        head_dim: c.hidden / c.heads,
        intermediate: c.intermediate,
        hidden_act: c.act,
        rope_scale: 1.0,
        rope_dynamic: None,
        gate_on: GateOn::First,
        placement: NormPlacement::Pre,
        norm_eps: c.eps,
        vocab_size: c.vocab,
        max_seq_len: folder.max_seq_len,
        word,
        embedding_norm,
        layers,
        final_norm: None,
        pooling: folder.pooling,
        normalize: folder.normalize,
        pool_skip: !folder.include_prompt,
        dense,
    }
}

/// [`load`] for a GTE or NomicBERT folder ([`super::gte`]).
fn load_rotary_post(
    config: &ModelSpec,
    folder: &Folder,
    file: &TensorFile,
) -> Result<Model, ModelError> {
    let c = &folder.config;
    let rope = gte::RotaryConfig::read(c, &folder.config_path)?;
    let mut weights = Weights::new();
    let encoder = gte::load(file, c, &rope, &mut weights)?;
    let dense = dense_layers(folder, &mut weights)?;
    let arch = RotaryEncoderArch {
        rope_scale: rope.scale,
        rope_dynamic: rope.dynamic,
        // [up | gate]: the activation on the gate, the second half.
        gate_on: GateOn::Second,
        placement: NormPlacement::Post,
        ..rotary_arch(
            folder,
            encoder.word,
            encoder.embedding_norm,
            encoder.layers,
            dense,
        )
    };
    Ok(Model {
        info: info(config, folder),
        arch: Architecture::RotaryEncoder(arch),
        weights,
    })
}

/// [`load`] for a Qwen3 or Gemma 3 folder ([`super::decoder_config`]).
fn load_decoder(
    config: &ModelSpec,
    folder: &Folder,
    file: &TensorFile,
) -> Result<Model, ModelError> {
    let c = &folder.config;
    let d = DecoderConfig::read(c, &folder.config_path)?;
    let mut weights = Weights::new();
    let loaded = decoder_config::load(file, c, &d, &mut weights)?;
    let dense = dense_layers(folder, &mut weights)?;
    let arch = DecoderArch {
        hidden: c.hidden,
        heads: c.heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
        intermediate: c.intermediate,
        act: c.act,
        norm_eps: c.eps,
        norm_offset: d.norm_offset,
        embed_scale: d.embed_scale,
        causal: d.causal,
        attention_scale: d.attention_scale,
        vocab_size: c.vocab,
        max_seq_len: folder.max_seq_len,
        word: loaded.word,
        layers: loaded.layers,
        final_norm: loaded.final_norm,
        pooling: folder.pooling,
        normalize: folder.normalize,
        pool_skip: !folder.include_prompt,
        dense,
    };
    Ok(Model {
        info: info(config, folder),
        arch: Architecture::Decoder(arch),
        weights,
    })
}

/// Reads the configs and the safetensors headers (no weight data), checks
/// every tensor's presence and shape, builds the tokenizer (reporting what
/// it rebuilt) and counts each prompt's tokens as sentence-transformers
/// does (`prompt_length`).
pub fn inspect(config: &ModelSpec) -> Result<ModelInfo, ModelError> {
    let folder = describe(config)?;
    let header = read_header(&folder.weights)?;
    if folder.config.family == Family::ModernBert {
        let c = &folder.config;
        let m = ModernBertConfig::read(&c.json, c.layers, &folder.config_path)?;
        ModernBertNames::check(&header, c, &m)?;
    } else if matches!(folder.config.family, Family::Gte | Family::NomicBert) {
        gte::RotaryConfig::read(&folder.config, &folder.config_path)?;
        gte::check_names(&header, &folder.config)?;
    } else if folder.config.family.is_decoder() {
        let d = DecoderConfig::read(&folder.config, &folder.config_path)?;
        decoder_config::check_names(&header, &folder.config, &d)?;
    } else {
        tensor_names(
            &header,
            &folder.config,
            folder.kind == FolderType::SparseEncoder,
        )?;
    }
    for d in &folder.dense {
        dense_names(&d.config)?;
    }
    let mut info = info(config, &folder);
    let spec = info.tokenizer.clone().expect("encoders have a tokenizer");
    let (tok, notes) = tokenizer::build(&spec)?;
    for n in notes {
        info.derived.push(derived(
            "tokenizer",
            n,
            "tokenizer.json vs tokenizer_config.json",
        ));
    }
    let max = folder.max_seq_len;
    for (name, prompt) in info.prompts.prompts.iter_mut() {
        if prompt.text.is_empty() {
            continue;
        }
        let enc = tok.encode(prompt.text.as_str(), true).map_err(|e| {
            ModelError::file(&spec.path, format!("cannot tokenize prompt {name:?}: {e}"))
        })?;
        let ends_special = enc.get_special_tokens_mask().last() == Some(&1);
        // Transformer._get_prompt_length: the prompt tokenized alone (truncated
        // at the maximum, so it still ends with the closing special token),
        // minus that token.
        let tokens = if enc.len() > max {
            max - 1
        } else {
            enc.len() - usize::from(ends_special)
        };
        if info.prompts.exclude_from_pooling && tokens + 1 > max {
            return Err(ModelError::file(
                config.path.join("config_sentence_transformers.json"),
                format!(
                    "prompt {name:?} has {tokens} tokens: with include_prompt = false it leaves nothing to pool within the maximum of {max}"
                ),
            ));
        }
        prompt.tokens = Some(tokens);
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use std::io::Read;

    use crate::model::minilm_dir as model_dir;

    fn config(path: &Path) -> ModelSpec {
        ModelSpec::new("minilm", ModelKind::Bert, path)
    }

    const FILES: [&str; 6] = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "modules.json",
        "sentence_bert_config.json",
        "1_Pooling/config.json",
    ];

    /// A temp folder whose files are symlinks to the real model's, except
    /// `skip`, which the caller writes (or leaves missing).
    fn linked_folder(skip: &[&str]) -> tempfile::TempDir {
        let src = model_dir();
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        for file in FILES.iter().filter(|f| !skip.contains(f)) {
            std::os::unix::fs::symlink(src.join(file), dir.path().join(file)).unwrap();
        }
        dir
    }

    fn edited_json(file: &str, edit: impl FnOnce(&mut Value)) -> String {
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(model_dir().join(file)).unwrap())
                .unwrap();
        edit(&mut json);
        json.to_string()
    }

    fn assert_error(result: Result<impl std::fmt::Debug, ModelError>, needles: &[&str]) {
        let msg = result.unwrap_err().to_string();
        for needle in needles {
            assert!(msg.contains(needle), "{needle:?} not in {msg:?}");
        }
    }

    #[test]
    fn inspects_minilm_without_weights() {
        let info = inspect(&config(&model_dir())).unwrap();
        assert_eq!(
            info.input,
            InputSpec::Tokens {
                vocab_size: 30522,
                max_seq_len: 256
            }
        );
        assert_eq!(info.output_dim, 384);
        assert_eq!(info.kind, ModelKind::Bert);
        assert!(info.tokenizer_path.unwrap().ends_with("tokenizer.json"));
        let mut c = config(&model_dir());
        c.max_seq_len = Some(512);
        c.dtype = DType::F16;
        let info = inspect(&c).unwrap();
        assert_eq!(info.dtype, DType::F16);
        assert!(matches!(
            info.input,
            InputSpec::Tokens {
                max_seq_len: 512,
                ..
            }
        ));
    }

    #[test]
    fn loads_minilm_with_fused_qkv() {
        let model = load(&config(&model_dir())).unwrap();
        let Architecture::Bert(arch) = &model.arch else {
            panic!("not BERT")
        };
        assert_eq!(
            (arch.hidden, arch.heads, arch.head_dim, arch.intermediate),
            (384, 12, 32, 1536)
        );
        assert_eq!(arch.layers.len(), 6);
        assert_eq!(
            (arch.pooling, arch.normalize, arch.max_seq_len),
            (Pooling::Mean, true, 256)
        );
        assert_eq!(arch.hidden_act, Activation::Gelu);
        let qkv = model.weights.get(arch.layers[2].qkv_weight);
        assert_eq!(qkv.shape, vec![3 * 384, 384]);
        let file = TensorFile::open(&model_dir().join("model.safetensors")).unwrap();
        let key = file
            .f32("encoder.layer.2.attention.self.key.weight")
            .unwrap()
            .1;
        assert_eq!(&qkv.data.to_f32()[384 * 384..2 * 384 * 384], &key[..]);
        let value_bias = file
            .f32("encoder.layer.2.attention.self.value.bias")
            .unwrap()
            .1;
        assert_eq!(
            &model.weights.get(arch.layers[2].qkv_bias).data.to_f32()[768..],
            &value_bias[..]
        );
        // 5 embedding tensors + 12 per layer (q/k/v fused into 2).
        assert_eq!(model.weights.len(), 5 + 6 * 12);

        let program = model.program(8, 128);
        assert_eq!(
            (program.batch, program.seq, program.output_dim),
            (8, 128, 384)
        );
        assert_eq!(program.ops.len(), 1 + 6 * 7 + 1);
        assert_eq!(program.inputs.len(), 3);
        // Activation buffers do not grow with depth.
        assert_eq!(program.buffers.len(), 3 + 5 + 1);
    }

    #[test]
    fn overrides_apply() {
        let mut c = config(&model_dir());
        c.pooling = Some(Pooling::Cls);
        c.normalize = Some(false);
        c.max_seq_len = Some(128);
        let model = load(&c).unwrap();
        let Architecture::Bert(arch) = &model.arch else {
            panic!()
        };
        assert_eq!(
            (arch.pooling, arch.normalize, arch.max_seq_len),
            (Pooling::Cls, false, 128)
        );
        c.max_seq_len = Some(513);
        assert_error(
            inspect(&c),
            &[
                "max_seq_len 513",
                "max_position_embeddings 512",
                "config.json",
            ],
        );
    }

    #[test]
    fn missing_tokenizer_is_named() {
        let dir = linked_folder(&["tokenizer.json"]);
        let c = config(dir.path());
        assert_error(inspect(&c), &["tokenizer.json", "missing file"]);
        assert_error(load(&c), &["tokenizer.json", "missing file"]);
    }

    #[test]
    fn truncated_or_corrupt_safetensors_is_named() {
        let dir = linked_folder(&["model.safetensors"]);
        let path = dir.path().join("model.safetensors");
        let mut head = vec![0u8; 2 << 20];
        std::fs::File::open(model_dir().join("model.safetensors"))
            .unwrap()
            .read_exact(&mut head)
            .unwrap();
        std::fs::write(&path, &head).unwrap();
        let c = config(dir.path());
        let needles = ["model.safetensors", "corrupt or truncated", "holds only"];
        assert_error(inspect(&c), &needles);
        assert_error(load(&c), &needles);
        // A header that is not JSON.
        head[8..16].copy_from_slice(b"garbage!");
        std::fs::write(&path, &head).unwrap();
        assert_error(inspect(&c), &["model.safetensors", "not valid JSON"]);
        // A length prefix pointing past the end.
        std::fs::write(&path, b"\xff\xff\xff\x00\x00\x00\x00\x00{}").unwrap();
        assert_error(load(&c), &["model.safetensors", "runs past the end"]);
    }

    #[test]
    fn shape_mismatch_is_named() {
        let dir = linked_folder(&["config.json"]);
        let json = edited_json("config.json", |j| j["intermediate_size"] = 1000.into());
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        let c = config(dir.path());
        let needles = [
            "model.safetensors",
            "shape mismatch",
            "`encoder.layer.0.intermediate.dense.weight`",
            "[1536, 384]",
            "[1000, 384]",
        ];
        assert_error(inspect(&c), &needles);
        assert_error(load(&c), &needles);
        // Fewer layers than the checkpoint holds.
        let json = edited_json("config.json", |j| j["num_hidden_layers"] = 4.into());
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        assert_error(
            inspect(&c),
            &[
                "model.safetensors",
                "encoder.layer.4.",
                "num_hidden_layers 4",
            ],
        );
        // More layers than the checkpoint holds.
        let json = edited_json("config.json", |j| j["num_hidden_layers"] = 7.into());
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        assert_error(
            inspect(&c),
            &[
                "model.safetensors",
                "missing tensor `encoder.layer.6.attention.self.query.weight`",
            ],
        );
    }

    #[test]
    fn unsupported_pooling_is_named() {
        let dir = linked_folder(&["1_Pooling/config.json"]);
        let path = dir.path().join("1_Pooling/config.json");
        let json = edited_json("1_Pooling/config.json", |j| {
            j["pooling_mode_mean_tokens"] = false.into();
            j["pooling_mode_mean_sqrt_len_tokens"] = true.into();
        });
        std::fs::write(&path, json).unwrap();
        let mut c = config(dir.path());
        assert_error(
            inspect(&c),
            &[
                "1_Pooling/config.json",
                "unsupported pooling mode",
                "mean_sqrt_len",
            ],
        );
        // An explicit pooling in the model config overrides the file's mode.
        c.pooling = Some(Pooling::Mean);
        inspect(&c).unwrap();
        c.pooling = None;
        let json = edited_json("1_Pooling/config.json", |j| {
            j["pooling_mode_cls_token"] = true.into()
        });
        std::fs::write(&path, json).unwrap();
        assert_error(inspect(&c), &["1_Pooling/config.json", "several modes"]);
        let json = edited_json("1_Pooling/config.json", |j| {
            j["pooling_mode_mean_tokens"] = false.into();
            j["pooling_mode_max_tokens"] = true.into();
        });
        std::fs::write(&path, json).unwrap();
        let model = load(&c).unwrap();
        let Architecture::Bert(arch) = &model.arch else {
            panic!()
        };
        assert_eq!(arch.pooling, Pooling::Max);
    }

    #[test]
    fn bad_configs_are_named() {
        let dir = linked_folder(&["config.json", "modules.json"]);
        let c = config(dir.path());
        let config_path = dir.path().join("config.json");
        // Missing config.json.
        assert_error(inspect(&c), &["config.json", "missing file"]);
        // Unparseable JSON.
        std::fs::write(&config_path, "{\"model_type\": \"bert\",").unwrap();
        assert_error(inspect(&c), &["config.json", "unparseable JSON"]);
        // Unknown architecture.
        let json = edited_json("config.json", |j| j["model_type"] = "gpt2".into());
        std::fs::write(&config_path, json).unwrap();
        assert_error(
            inspect(&c),
            &["config.json", "unknown architecture", "gpt2"],
        );
        // Relative positions.
        let json = edited_json("config.json", |j| {
            j["position_embedding_type"] = "relative_key".into()
        });
        std::fs::write(&config_path, json).unwrap();
        assert_error(
            inspect(&c),
            &["config.json", "position_embedding_type", "relative_key"],
        );
        // A missing hyper-parameter.
        let json = edited_json("config.json", |j| {
            j.as_object_mut().unwrap().remove("hidden_size");
        });
        std::fs::write(&config_path, json).unwrap();
        assert_error(inspect(&c), &["config.json", "missing `hidden_size`"]);
        // A sentence-transformers module we cannot apply.
        std::fs::write(&config_path, edited_json("config.json", |_| {})).unwrap();
        let module = |ty: &str| {
            edited_json("modules.json", |j| {
                j.as_array_mut().unwrap().push(serde_json::json!({
                    "idx": 3, "name": "3", "path": "3_Module", "type": ty
                }))
            })
        };
        std::fs::write(
            dir.path().join("modules.json"),
            module("sentence_transformers.models.LSTM"),
        )
        .unwrap();
        assert_error(inspect(&c), &["modules.json", "LSTM"]);
        // A Dense module whose folder is missing: its config is named.
        std::fs::write(
            dir.path().join("modules.json"),
            module("sentence_transformers.models.Dense"),
        )
        .unwrap();
        assert_error(inspect(&c), &["3_Module/config.json", "missing file"]);
        // Missing model folder.
        assert_error(
            inspect(&config(&dir.path().join("nope"))),
            &["nope", "missing model folder"],
        );
    }

    #[test]
    fn truncate_dim_is_read_and_checked() {
        let dir = linked_folder(&["config_sentence_transformers.json"]);
        let c = config(dir.path());
        let path = dir.path().join("config_sentence_transformers.json");
        let write = |v: serde_json::Value| {
            let json = edited_json("config_sentence_transformers.json", |j| {
                j["truncate_dim"] = v
            });
            std::fs::write(&path, json).unwrap();
        };
        write(128.into());
        let info = inspect(&c).unwrap();
        assert_eq!((info.truncate_dim, info.normalized), (Some(128), true));
        // As wide as the model or wider: no truncation, and said so.
        write(384.into());
        let info = inspect(&c).unwrap();
        assert_eq!(info.truncate_dim, None);
        assert!(info.derived_summary().contains("no truncation"));
        for bad in [
            serde_json::json!(0),
            serde_json::json!(-3),
            serde_json::json!("64"),
        ] {
            write(bad);
            assert_error(inspect(&c), &["truncate_dim", "positive integer"]);
        }
    }

    /// A copy of a test folder (tests/data/models) to edit.
    fn test_folder_copy(name: &str) -> tempfile::TempDir {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/models")
            .join(name);
        let dir = tempfile::tempdir().unwrap();
        for entry in walk(&src) {
            let to = dir.path().join(entry.strip_prefix(&src).unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&entry, to).unwrap();
        }
        dir
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn sparse_encoder_folders_are_read_and_checked() {
        let dir = test_folder_copy("splade-st");
        let c = config(dir.path());
        let info = inspect(&c).unwrap();
        assert_eq!((info.task, info.output_dim), (Task::Sparse, 1432));
        assert!(!info.normalized);
        assert!(
            info.derived_summary()
                .contains("max over tokens of log1p(ReLU)"),
            "{}",
            info.derived_summary()
        );
        let model = load(&c).unwrap();
        let Architecture::Bert(arch) = &model.arch else {
            panic!("not BERT")
        };
        let head = arch.mlm.as_ref().expect("a masked-LM head");
        // Tied: the decoder is the word embedding table itself.
        assert_eq!(head.decoder_weight, arch.embeddings.word);
        let write = |file: &str, edit: &dyn Fn(&mut Value)| {
            let path = dir.path().join(file);
            let mut json: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            edit(&mut json);
            std::fs::write(path, json.to_string()).unwrap();
        };
        write("1_SpladePooling/config.json", &|j| {
            j["pooling_strategy"] = "mean".into()
        });
        assert_error(inspect(&c), &["pooling_strategy", "\"max\" or \"sum\""]);
        write("1_SpladePooling/config.json", &|j| {
            j["pooling_strategy"] = "sum".into();
            j["activation_function"] = "gelu".into();
        });
        assert_error(inspect(&c), &["activation_function"]);
        write("1_SpladePooling/config.json", &|j| {
            j["activation_function"] = "log1p_relu".into();
        });
        assert!(inspect(&c)
            .unwrap()
            .derived_summary()
            .contains("sum over tokens of log1p(log1p(ReLU))"));
        write("config_sentence_transformers.json", &|j| {
            j["truncate_dim"] = 64.into()
        });
        assert_error(inspect(&c), &["truncate_dim", "sparse encoder"]);
        write("config_sentence_transformers.json", &|j| {
            j.as_object_mut().unwrap().remove("truncate_dim");
        });
        let mut pooled = c.clone();
        pooled.pooling = Some(Pooling::Mean);
        assert_error(
            inspect(&pooled),
            &["`pooling` does not apply to a sparse encoder"],
        );
        write("config.json", &|j| {
            j["architectures"] = serde_json::json!(["BertModel"])
        });
        assert_error(
            inspect(&c),
            &["SparseEncoder folder needs a *ForMaskedLM", "BertModel"],
        );
    }

    /// GTE's static NTK scaling as its remote code computes it, and the
    /// NomicBERT settings replayd does not serve, refused by name.
    #[test]
    fn gte_ntk_scaling_and_nomic_refusals() {
        let edit = |dir: &Path, key: &str, v: Value| {
            let path = dir.join("config.json");
            let mut json: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            json[key] = v;
            std::fs::write(path, json.to_string()).unwrap();
        };
        let dir = test_folder_copy("gte-hub-st");
        edit(
            dir.path(),
            "rope_scaling",
            serde_json::json!({"type": "ntk", "factor": 2.0}),
        );
        let model = load(&config(dir.path())).unwrap();
        let Architecture::RotaryEncoder(arch) = &model.arch else {
            panic!("not a rotary encoder")
        };
        let d = arch.head_dim;
        let program = arch.program(1, 4);
        let rotary = program
            .ops
            .iter()
            .find_map(|op| match op {
                crate::model::program::Op::Rotary(r) => Some(r.clone()),
                _ => None,
            })
            .unwrap();
        // new-impl's NTKScalingRotaryEmbedding: base = θ · factor, then
        // inv_freq = base^(−2i/d) / factor^(2/d), at every length.
        for i in 0..d / 2 {
            let base = 500.0f64 * 2.0;
            let inv = base.powf(-((2 * i) as f64) / d as f64) / 2f64.powf(2.0 / d as f64);
            for p in [1usize, 7, 300] {
                let (cos, _) = rotary.angle(p, i);
                assert!(
                    (cos as f64 - (p as f64 * inv).cos()).abs() < 1e-4,
                    "position {p}, pair {i}"
                );
            }
        }
        edit(
            dir.path(),
            "rope_scaling",
            serde_json::json!({"type": "dynamic", "factor": 2.0}),
        );
        assert_error(inspect(&config(dir.path())), &["unsupported rope_scaling"]);

        let dir = test_folder_copy("nomic-hub-st");
        let c = config(dir.path());
        assert!(inspect(&c).is_ok());
        for (key, v, needle) in [
            (
                "rotary_scaling_factor",
                serde_json::json!(-1.0),
                "rotary_scaling_factor",
            ),
            (
                "rotary_emb_fraction",
                serde_json::json!(0.5),
                "rotary_emb_fraction",
            ),
            (
                "rotary_emb_interleaved",
                serde_json::json!(true),
                "rotary_emb_interleaved",
            ),
            (
                "activation_function",
                serde_json::json!("gelu"),
                "activation_function",
            ),
        ] {
            let fresh = test_folder_copy("nomic-hub-st");
            edit(fresh.path(), key, v);
            assert_error(inspect(&config(fresh.path())), &[needle]);
        }
    }

    #[test]
    fn sharded_checkpoint_loads_like_the_single_file() {
        let dir = test_folder_copy("bert-st-new");
        let c = config(dir.path());
        let (info, single) = (inspect(&c).unwrap(), load(&c).unwrap());
        // Re-shard it as save_pretrained(max_shard_size=…) does: the tensors
        // over three files, an index naming each one's file.
        let path = dir.path().join("model.safetensors");
        let src = TensorFile::open(&path).unwrap();
        let names: Vec<&String> = src.header.tensors.keys().collect();
        let mut map = serde_json::Map::new();
        for shard in 0..3 {
            let file = format!("model-{:05}-of-00003.safetensors", shard + 1);
            let tensors: Vec<(&String, Vec<usize>, crate::model::WeightData)> = names
                .iter()
                .skip(shard)
                .step_by(3)
                .map(|n| {
                    let (shape, data) = src.stored(n).unwrap();
                    (*n, shape, data)
                })
                .collect();
            let views = tensors.iter().map(|(n, shape, data)| {
                map.insert(n.to_string(), file.clone().into());
                let bytes = data.le_bytes(DType::F32).expect("an f32 checkpoint");
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    bytes,
                );
                (n.to_string(), view.unwrap())
            });
            safetensors::serialize_to_file(views, None, &dir.path().join(&file)).unwrap();
        }
        drop(src);
        std::fs::remove_file(&path).unwrap();
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
        let index_path = dir.path().join("model.safetensors.index.json");
        std::fs::write(&index_path, index.to_string()).unwrap();
        assert_eq!(inspect(&c).unwrap(), info);
        let sharded = load(&c).unwrap();
        assert_eq!(sharded.weights, single.weights);
        // Neither file: the error names both.
        std::fs::remove_file(&index_path).unwrap();
        for result in [inspect(&c).map(drop), load(&c).map(drop)] {
            assert_error(
                result,
                &[
                    "model.safetensors",
                    "missing file",
                    "model.safetensors.index.json",
                ],
            );
        }
    }

    #[test]
    fn bert_prefixed_keys_and_no_sentence_transformers_files() {
        // A BertModel saved inside a task model: every key prefixed `bert.`;
        // no modules.json / pooling config: mean pooling, no normalisation.
        let src = TensorFile::open(&model_dir().join("model.safetensors")).unwrap();
        let names: Vec<String> = src.header.tensors.keys().cloned().collect();
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = names
            .iter()
            .filter(|n| !n.starts_with("encoder.layer.") || n.starts_with("encoder.layer.0."))
            .filter(|n| *n != "embeddings.position_ids")
            .map(|n| {
                let (shape, values) = src.f32(n).unwrap();
                let bytes = values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect();
                (format!("bert.{n}"), shape, bytes)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        let dir = linked_folder(&[
            "model.safetensors",
            "config.json",
            "modules.json",
            "1_Pooling/config.json",
            "sentence_bert_config.json",
        ]);
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let json = edited_json("config.json", |j| j["num_hidden_layers"] = 1.into());
        std::fs::write(dir.path().join("config.json"), json).unwrap();
        let c = config(dir.path());
        let info = inspect(&c).unwrap();
        assert!(matches!(
            info.input,
            InputSpec::Tokens {
                max_seq_len: 512,
                ..
            }
        ));
        let model = load(&c).unwrap();
        let Architecture::Bert(arch) = &model.arch else {
            panic!()
        };
        assert_eq!(
            (arch.layers.len(), arch.pooling, arch.normalize),
            (1, Pooling::Mean, false)
        );
        let word = model.weights.get(arch.embeddings.word);
        assert_eq!(word.name, "bert.embeddings.word_embeddings.weight");
        let want =
            half::bf16::from_f32(src.f32("embeddings.word_embeddings.weight").unwrap().1[1000])
                .to_f32();
        assert_eq!(word.data.dtype(), DType::BF16, "kept as stored");
        assert_eq!(word.data.to_f32()[1000], want);
    }
}
