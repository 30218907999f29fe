//! The sentence-transformers side of a model folder, read as
//! sentence-transformers 6.2 reads it (`docs/notes/sentence-transformers-folders.md`):
//! `modules.json` and each module's config, the Transformer module's
//! `sentence_bert_config.json`, `config_sentence_transformers.json`
//! (model type, prompts, a cross-encoder's activation), and the resolution
//! of the maximum sequence length.
//!
//! Every file here is read strictly: a key this reader does not know, or a
//! value it cannot honour, is an error naming the file and the key — a
//! setting sentence-transformers would apply is never skipped. Old and new
//! key spellings (`tokenizer_args` / `processor_kwargs`, the boolean
//! `pooling_mode_*_tokens` / `pooling_mode`, old module class paths) are
//! both accepted.

use super::files::read_json;
use super::program::{Activation, Pooling};
use super::ModelError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What kind of sentence-transformers model a folder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FolderType {
    SentenceTransformer,
    CrossEncoder,
    /// A `SparseEncoder` (SPLADE): a masked-LM Transformer, then `SpladePooling`.
    SparseEncoder,
}

/// A module of `modules.json`.
#[derive(Clone, Debug, PartialEq)]
pub enum ModuleKind {
    Transformer,
    Pooling,
    Dense,
    Normalize,
    /// SPLADE's pooling of masked-LM logits (sparse encoders).
    SpladePooling,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    pub kind: ModuleKind,
    /// The module's folder (may not exist: Normalize needs none).
    pub dir: PathBuf,
    /// Its `path` in modules.json (`""` for the root).
    pub rel: String,
}

/// `modules.json`, or `None` for a plain transformers folder.
pub fn read_modules(dir: &Path) -> Result<Option<Vec<Module>>, ModelError> {
    let path = dir.join("modules.json");
    if !path.is_file() {
        return Ok(None);
    }
    let json = read_json(&path)?;
    let err = |m: String| ModelError::file(&path, m);
    let list = json
        .as_array()
        .ok_or_else(|| err("expected a JSON list of modules".into()))?;
    let mut modules = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let obj = m
            .as_object()
            .ok_or_else(|| err(format!("module {i} is not an object")))?;
        for key in obj.keys() {
            if !["idx", "name", "path", "type", "kwargs"].contains(&key.as_str()) {
                return Err(err(format!("module {i}: unknown key `{key}`")));
            }
        }
        if let Some(k) = obj.get("kwargs") {
            if !k.as_array().is_some_and(Vec::is_empty) && !k.is_null() {
                return Err(err(format!(
                    "module {i}: unsupported `kwargs` {k} (per-call module arguments)"
                )));
            }
        }
        let ty = obj
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| err(format!("module {i} has no `type`")))?;
        let rel = obj
            .get("path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let last = ty.rsplit('.').next().unwrap_or(ty);
        let kind = match (ty.starts_with("sentence_transformers."), last) {
            // MLMTransformer: sentence-transformers 5's name for a
            // Transformer with transformer_task "fill-mask".
            (true, "Transformer" | "MLMTransformer") => ModuleKind::Transformer,
            (true, "SpladePooling") => ModuleKind::SpladePooling,
            (true, "Pooling") => ModuleKind::Pooling,
            (true, "Dense") => ModuleKind::Dense,
            (true, "Normalize") => ModuleKind::Normalize,
            (true, _) => {
                return Err(err(format!(
                    "unsupported sentence-transformers module {ty:?} (module {i}, path {rel:?}): replayd applies Transformer, Pooling, Dense and Normalize, and SpladePooling for sparse encoders"
                )))
            }
            (false, _) => {
                return Err(err(format!(
                    "unsupported module {ty:?} (module {i}, path {rel:?}): custom code outside sentence_transformers"
                )))
            }
        };
        if rel.split('/').any(|c| c == "..") || Path::new(&rel).is_absolute() {
            return Err(err(format!("module {i}: path {rel:?} leaves the folder")));
        }
        modules.push(Module {
            kind,
            dir: if rel.is_empty() {
                dir.to_path_buf()
            } else {
                dir.join(&rel)
            },
            rel,
        });
    }
    Ok(Some(modules))
}

/// Rejects keys of `obj` outside `known`.
fn known_keys(obj: &Map<String, Value>, known: &[&str], path: &Path) -> Result<(), ModelError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ModelError::file(
            path,
            format!(
                "unsupported setting `{k}` (replayd knows {})",
                known.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

fn object<'a>(v: &'a Value, path: &Path) -> Result<&'a Map<String, Value>, ModelError> {
    v.as_object()
        .ok_or_else(|| ModelError::file(path, "expected a JSON object"))
}

/// The Transformer module's config (`sentence_bert_config.json` or one of
/// its siblings), as far as it decides anything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TransformerConfig {
    pub path: Option<PathBuf>,
    /// `processor_kwargs.model_max_length` (old: `tokenizer_args`).
    pub processor_max_length: Option<usize>,
    /// `max_seq_length` (old format).
    pub max_seq_length: Option<usize>,
    pub do_lower_case: bool,
    /// Settings read but not applied, with why (logged).
    pub notes: Vec<String>,
}

/// The module config files `Transformer.load_config` tries, in order.
pub const TRANSFORMER_CONFIGS: [&str; 7] = [
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
];

/// Reads the Transformer module's config from `dir` (none: defaults).
pub fn read_transformer_config(
    dir: &Path,
    kind: FolderType,
) -> Result<TransformerConfig, ModelError> {
    let Some(path) = TRANSFORMER_CONFIGS
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
    else {
        return Ok(TransformerConfig::default());
    };
    let json = read_json(&path)?;
    let obj = object(&json, &path)?;
    let err = |m: String| ModelError::file(&path, m);
    known_keys(
        obj,
        &[
            "max_seq_length",
            "do_lower_case",
            "transformer_task",
            "modality_config",
            "module_output_name",
            "processor_kwargs",
            "tokenizer_args",
            "model_kwargs",
            "model_args",
            "config_kwargs",
            "config_args",
            "processing_kwargs",
            "backend",
            "query_expansion",
            "query_length",
            "document_length",
        ],
        &path,
    )?;
    let mut c = TransformerConfig {
        path: Some(path.clone()),
        ..TransformerConfig::default()
    };
    let (task, output_name, method_output) = match kind {
        FolderType::SentenceTransformer => (
            "feature-extraction",
            "token_embeddings",
            "last_hidden_state",
        ),
        FolderType::CrossEncoder => ("sequence-classification", "scores", "logits"),
        FolderType::SparseEncoder => ("fill-mask", "token_embeddings", "logits"),
    };
    for (key, v) in obj {
        match key.as_str() {
            "max_seq_length" => {
                c.max_seq_length = match v {
                    Value::Null => None,
                    v => Some(v.as_u64().filter(|&n| n >= 2).ok_or_else(|| {
                        err(format!("`max_seq_length` is {v}, expected an integer ≥ 2"))
                    })? as usize),
                }
            }
            "do_lower_case" => {
                c.do_lower_case = v
                    .as_bool()
                    .ok_or_else(|| err(format!("`do_lower_case` is {v}, expected a boolean")))?
            }
            "transformer_task" => {
                if v.as_str() != Some(task) {
                    return Err(err(format!(
                        "unsupported `transformer_task` {v} (a {} folder needs {task:?})",
                        match kind {
                            FolderType::CrossEncoder => "CrossEncoder",
                            FolderType::SentenceTransformer => "SentenceTransformer",
                            FolderType::SparseEncoder => "SparseEncoder",
                        }
                    )));
                }
            }
            "module_output_name" => {
                if v.as_str() != Some(output_name) {
                    return Err(err(format!(
                        "unsupported `module_output_name` {v} (replayd computes {output_name:?})"
                    )));
                }
            }
            "modality_config" => {
                let ok = v.as_object().is_some_and(|m| {
                    m.len() == 1
                        && m.get("text").and_then(Value::as_object).is_some_and(|t| {
                            t.get("method").and_then(Value::as_str) == Some("forward")
                                && t.get("method_output_name").and_then(Value::as_str)
                                    == Some(method_output)
                                && t.len() == 2
                        })
                });
                if !ok {
                    return Err(err(format!(
                        "unsupported `modality_config` {v} (replayd serves text through forward → {method_output})"
                    )));
                }
            }
            "processor_kwargs" | "tokenizer_args" => {
                let m = v
                    .as_object()
                    .ok_or_else(|| err(format!("`{key}` is {v}, expected an object")))?;
                for (k, x) in m {
                    match k.as_str() {
                        "model_max_length" => {
                            c.processor_max_length =
                                Some(x.as_u64().filter(|&n| n >= 2).ok_or_else(|| {
                                    err(format!(
                                        "`{key}.model_max_length` is {x}, expected an integer ≥ 2"
                                    ))
                                })? as usize)
                        }
                        other => {
                            return Err(err(format!(
                                "unsupported setting `{key}.{other}` (only model_max_length is applied to the tokenizer)"
                            )))
                        }
                    }
                }
            }
            "model_kwargs" | "model_args" | "config_kwargs" | "config_args" => {
                let m = v
                    .as_object()
                    .ok_or_else(|| err(format!("`{key}` is {v}, expected an object")))?;
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("torch_dtype" | "dtype", _) => c.notes.push(format!(
                            "{key}.{k} = {x} not applied: the compute dtype is the config's `dtype`"
                        )),
                        ("trust_remote_code", Value::Bool(false)) => {}
                        _ => return Err(err(format!("unsupported setting `{key}.{k}` = {x}"))),
                    }
                }
            }
            "processing_kwargs" => {
                let empty = v.is_null()
                    || v.as_object().is_some_and(|m| {
                        m.values()
                            .all(|x| x.is_null() || x.as_object().is_some_and(Map::is_empty))
                    });
                if !empty {
                    return Err(err(format!(
                        "unsupported `processing_kwargs` {v} (per-call tokenizer settings)"
                    )));
                }
            }
            "backend" => {
                if v.as_str() != Some("torch") {
                    return Err(err(format!(
                        "unsupported `backend` {v} (replayd reads the torch weights, model.safetensors)"
                    )));
                }
            }
            "query_expansion" | "query_length" | "document_length" => {
                if !v.is_null() && v != &Value::Bool(false) {
                    return Err(err(format!(
                        "unsupported `{key}` {v} (multi-vector / sparse models)"
                    )));
                }
            }
            _ => unreachable!("known_keys"),
        }
    }
    Ok(c)
}

/// `config_sentence_transformers.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StConfig {
    pub path: Option<PathBuf>,
    pub model_type: Option<String>,
    pub prompts: BTreeMap<String, String>,
    pub default_prompt_name: Option<String>,
    pub activation_fn: Option<String>,
    /// Matryoshka: the width sentence-transformers cuts embeddings to.
    pub truncate_dim: Option<usize>,
}

pub fn read_st_config(dir: &Path) -> Result<StConfig, ModelError> {
    let path = dir.join("config_sentence_transformers.json");
    if !path.is_file() {
        return Ok(StConfig::default());
    }
    let json = read_json(&path)?;
    let obj = object(&json, &path)?;
    let err = |m: String| ModelError::file(&path, m);
    known_keys(
        obj,
        &[
            "__version__",
            "model_type",
            "prompts",
            "default_prompt_name",
            "similarity_fn_name",
            "activation_fn",
            "truncate_dim",
        ],
        &path,
    )?;
    let mut c = StConfig {
        path: Some(path.clone()),
        ..StConfig::default()
    };
    let string = |key: &str| -> Result<Option<String>, ModelError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(err(format!("`{key}` is {v}, expected a string"))),
        }
    };
    c.model_type = string("model_type")?;
    c.default_prompt_name = string("default_prompt_name")?;
    c.activation_fn = string("activation_fn")?;
    match obj.get("truncate_dim") {
        None | Some(Value::Null) => {}
        Some(v) => match v.as_u64().filter(|&d| d > 0) {
            Some(d) => c.truncate_dim = Some(d as usize),
            None => {
                return Err(err(format!(
                    "`truncate_dim` is {v}, expected a positive integer"
                )))
            }
        },
    }
    match obj.get("prompts") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (name, text) in m {
                let text = match text {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    v => return Err(err(format!("prompt {name:?} is {v}, expected a string"))),
                };
                c.prompts.insert(name.clone(), text);
            }
        }
        Some(v) => return Err(err(format!("`prompts` is {v}, expected an object"))),
    }
    Ok(c)
}

/// `1_Pooling/config.json`: the mode and `include_prompt`.
///
/// With `mode_override` (the model config's `pooling`), the file's mode
/// keys are not interpreted (the operator chose the mode; a mode replayd
/// lacks is then no error), the rest of the file still is.
pub fn read_pooling(
    path: &Path,
    hidden: usize,
    mode_override: Option<Pooling>,
) -> Result<(Pooling, bool), ModelError> {
    let json = read_json(path)?;
    let obj = object(&json, path)?;
    let err = |m: String| ModelError::file(path, m);
    const OLD: [(&str, &str); 6] = [
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
        ("pooling_mode_weightedmean_tokens", "weightedmean"),
        ("pooling_mode_lasttoken", "lasttoken"),
    ];
    let mut known = vec![
        "embedding_dimension",
        "word_embedding_dimension",
        "pooling_mode",
        "include_prompt",
        "module_input_name",
        "module_output_name",
    ];
    known.extend(OLD.iter().map(|(k, _)| *k));
    known_keys(obj, &known, path)?;
    for key in ["embedding_dimension", "word_embedding_dimension"] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
            if v.as_u64() != Some(hidden as u64) {
                return Err(err(format!(
                    "`{key}` {v} differs from the model's hidden_size {hidden}"
                )));
            }
        }
    }
    for (key, want) in [
        ("module_input_name", "token_embeddings"),
        ("module_output_name", "sentence_embedding"),
    ] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
            if v.as_str() != Some(want) {
                return Err(err(format!("unsupported `{key}` {v} (only {want:?})")));
            }
        }
    }
    let include_prompt = match obj.get("include_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(err(format!("`include_prompt` is {v}, expected a boolean"))),
    };
    if let Some(mode) = mode_override {
        return Ok((mode, include_prompt));
    }
    let modes: Vec<String> = match obj.get("pooling_mode") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|m| m.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| err(format!("`pooling_mode` {a:?} is not a list of names")))?,
        Some(v) if !v.is_null() => {
            return Err(err(format!("`pooling_mode` is {v}, expected a name")))
        }
        _ => {
            let mut on = Vec::new();
            for (key, mode) in OLD {
                match obj.get(key) {
                    None | Some(Value::Null) | Some(Value::Bool(false)) => {}
                    Some(Value::Bool(true)) => on.push(mode.to_string()),
                    Some(v) => return Err(err(format!("`{key}` is {v}, expected a boolean"))),
                }
            }
            if on.is_empty() {
                on.push("mean".into()); // sentence-transformers' default
            }
            on
        }
    };
    let mode = match modes.as_slice() {
        [m] => match m.as_str() {
            "mean" => Pooling::Mean,
            "cls" => Pooling::Cls,
            "max" => Pooling::Max,
            "lasttoken" => Pooling::LastToken,
            other => {
                return Err(err(format!(
                    "unsupported pooling mode {other:?} (replayd pools with mean, cls, max or lasttoken)"
                )))
            }
        },
        many => {
            return Err(err(format!(
                "unsupported pooling: several modes {many:?} (concatenated embeddings)"
            )))
        }
    };
    Ok((mode, include_prompt))
}

/// A `Dense` module's config.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseConfig {
    pub inputs: usize,
    pub outputs: usize,
    pub bias: bool,
    pub act: Activation,
    pub act_name: String,
    pub weights: PathBuf,
}

/// The activations a `Dense` module or a cross-encoder may name
/// (`torch.nn` classes, instantiated without arguments).
pub fn torch_activation(name: &str) -> Option<Activation> {
    Some(match name {
        "torch.nn.modules.activation.Tanh" => Activation::Tanh,
        "torch.nn.modules.linear.Identity" => Activation::Identity,
        "torch.nn.modules.activation.Sigmoid" => Activation::Sigmoid,
        "torch.nn.modules.activation.ReLU" => Activation::Relu,
        "torch.nn.modules.activation.GELU" => Activation::Gelu,
        "torch.nn.modules.activation.SiLU" => Activation::Silu,
        _ => return None,
    })
}

pub fn read_dense(dir: &Path) -> Result<DenseConfig, ModelError> {
    let path = dir.join("config.json");
    let json = read_json(&path)?;
    let obj = object(&json, &path)?;
    let err = |m: String| ModelError::file(&path, m);
    known_keys(
        obj,
        &[
            "in_features",
            "out_features",
            "bias",
            "activation_function",
            "module_input_name",
            "module_output_name",
            "use_residual",
        ],
        &path,
    )?;
    let size = |key: &str| -> Result<usize, ModelError> {
        obj.get(key)
            .and_then(Value::as_u64)
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| err(format!("`{key}` missing or not a positive integer")))
    };
    let bias = match obj.get("bias") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(err(format!("`bias` is {v}, expected a boolean"))),
    };
    // A missing activation is the constructor's default, Tanh.
    let act_name = match obj.get("activation_function") {
        None | Some(Value::Null) => "torch.nn.modules.activation.Tanh".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            return Err(err(format!(
                "`activation_function` is {v}, expected a class name"
            )))
        }
    };
    let act = torch_activation(&act_name).ok_or_else(|| {
        err(format!(
            "unsupported `activation_function` {act_name:?} (Tanh, Identity, Sigmoid, ReLU, GELU, SiLU of torch.nn)"
        ))
    })?;
    for key in ["module_input_name", "module_output_name"] {
        if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
            if v.as_str() != Some("sentence_embedding") {
                return Err(err(format!(
                    "unsupported `{key}` {v} (replayd applies Dense to the sentence embedding)"
                )));
            }
        }
    }
    match obj.get("use_residual") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(v) => return Err(err(format!("unsupported `use_residual` {v}"))),
    }
    let weights = dir.join("model.safetensors");
    if !weights.is_file() {
        let pickle = dir.join("pytorch_model.bin");
        return Err(if pickle.is_file() {
            ModelError::file(
                &pickle,
                "a Python pickle: replayd reads weights from model.safetensors only (convert it with safetensors)",
            )
        } else {
            ModelError::file(&weights, "missing file (the Dense module's weights)")
        });
    }
    Ok(DenseConfig {
        inputs: size("in_features")?,
        outputs: size("out_features")?,
        bias,
        act,
        act_name,
        weights,
    })
}

/// A `SpladePooling` module's config: the pooling over tokens (`max` or
/// `sum`) and the activation applied to each logit first, as
/// sentence-transformers' `SpladePooling` computes them (`relu`:
/// `log(1 + relu(x))`; `log1p_relu`: `log(1 + log(1 + relu(x)))`).
pub fn read_splade_pooling(dir: &Path, vocab: usize) -> Result<(Pooling, Activation), ModelError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        // SpladePooling's defaults.
        return Ok((Pooling::Max, Activation::Log1pRelu));
    }
    let json = read_json(&path)?;
    let obj = object(&json, &path)?;
    let err = |m: String| ModelError::file(&path, m);
    known_keys(
        obj,
        &[
            "pooling_strategy",
            "activation_function",
            "embedding_dimension",
            "word_embedding_dimension",
            "chunk_size",
        ],
        &path,
    )?;
    let pooling = match obj.get("pooling_strategy") {
        None | Some(Value::Null) => Pooling::Max,
        Some(v) => match v.as_str() {
            Some("max") => Pooling::Max,
            Some("sum") => Pooling::Sum,
            _ => {
                return Err(err(format!(
                    "unsupported `pooling_strategy` {v} (\"max\" or \"sum\")"
                )))
            }
        },
    };
    let act = match obj.get("activation_function") {
        None | Some(Value::Null) => Activation::Log1pRelu,
        Some(v) => match v.as_str() {
            Some("relu") => Activation::Log1pRelu,
            Some("log1p_relu") => Activation::Log1pLog1pRelu,
            _ => {
                return Err(err(format!(
                    "unsupported `activation_function` {v} (\"relu\" or \"log1p_relu\")"
                )))
            }
        },
    };
    for key in ["embedding_dimension", "word_embedding_dimension"] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(v) if v.as_u64() == Some(vocab as u64) => {}
            Some(v) => {
                return Err(err(format!(
                    "`{key}` is {v}, but the masked-LM head has {vocab} outputs (config.json vocab_size)"
                )))
            }
        }
    }
    // chunk_size only bounds sentence-transformers' memory: the result is the same.
    Ok((pooling, act))
}

/// A `Normalize` module's (optional) config.
pub fn read_normalize(dir: &Path) -> Result<(), ModelError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok(()); // old folders list a 2_Normalize that does not exist
    }
    let json = read_json(&path)?;
    let obj = object(&json, &path)?;
    known_keys(obj, &["module_input_name", "module_output_name"], &path)?;
    for (key, v) in obj {
        if !v.is_null() && v.as_str() != Some("sentence_embedding") {
            return Err(ModelError::file(
                &path,
                format!("unsupported `{key}` {v} (replayd normalises the sentence embedding)"),
            ));
        }
    }
    Ok(())
}

/// How the maximum sequence length was resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct MaxLength {
    pub value: usize,
    /// Which setting it came from, and any bound applied.
    pub from: String,
}

/// sentence-transformers' maximum length (§2 of the notes):
/// `processor_kwargs.model_max_length`, else `max_seq_length` (both used as
/// is), else tokenizer_config.json `model_max_length` bounded by
/// `max_position_embeddings`. Then bounded by the position table's real
/// capacity `positions` (`max_position_embeddings − padding_idx − 1` for
/// XLM-R and MPNet, whose positions start at padding_idx + 1), where
/// sentence-transformers would crash on a longer input.
pub fn resolve_max_length(
    transformer: &TransformerConfig,
    tokenizer_max: Option<u64>,
    tokenizer_config: &Path,
    max_position: usize,
    positions: usize,
) -> MaxLength {
    let st_file = || {
        transformer
            .path
            .as_ref()
            .and_then(|p| p.file_name())
            .map_or("sentence_bert_config.json".into(), |f| {
                f.to_string_lossy().into_owned()
            })
    };
    let (value, mut from) = if let Some(n) = transformer.processor_max_length {
        (
            n as u64,
            format!("{} processor_kwargs.model_max_length", st_file()),
        )
    } else if let Some(n) = transformer.max_seq_length {
        (n as u64, format!("{} max_seq_length", st_file()))
    } else {
        let t = tokenizer_max.unwrap_or(1_000_000_000_000_000_000_000_000_000u128 as u64);
        let name = tokenizer_config
            .file_name()
            .map_or("tokenizer_config.json".into(), |f| {
                f.to_string_lossy().into_owned()
            });
        if tokenizer_max.is_none() {
            (
                max_position as u64,
                format!("{name} has no model_max_length: max_position_embeddings {max_position}"),
            )
        } else if t > max_position as u64 {
            (
                max_position as u64,
                format!("{name} model_max_length {t}, bounded by max_position_embeddings {max_position}"),
            )
        } else {
            (t, format!("{name} model_max_length"))
        }
    };
    let value = if value > positions as u64 {
        from.push_str(&format!(
            "; {value} bounded to {positions}, the positions max_position_embeddings {max_position} holds (sentence-transformers fails on longer inputs)"
        ));
        positions
    } else {
        value as usize
    };
    MaxLength { value, from }
}

/// A cross-encoder's activation, by sentence-transformers' rules 2–5 (§9):
/// config_sentence_transformers.json `activation_fn`, config.json
/// `sentence_transformers.activation_fn`, config.json
/// `sbert_ce_default_activation_function`, else Sigmoid for one label and
/// Identity for several. Returns the activation and where it came from.
pub fn cross_encoder_activation(
    st: &StConfig,
    config: &Value,
    config_path: &Path,
    labels: usize,
) -> Result<(Activation, String), ModelError> {
    let candidates: [(Option<&str>, String, PathBuf); 3] = [
        (
            st.activation_fn.as_deref(),
            "activation_fn".into(),
            st.path.clone().unwrap_or_default(),
        ),
        (
            config
                .get("sentence_transformers")
                .and_then(|s| s.get("activation_fn"))
                .and_then(Value::as_str),
            "sentence_transformers.activation_fn".into(),
            config_path.to_path_buf(),
        ),
        (
            config
                .get("sbert_ce_default_activation_function")
                .and_then(Value::as_str),
            "sbert_ce_default_activation_function".into(),
            config_path.to_path_buf(),
        ),
    ];
    for (name, key, path) in candidates {
        if let Some(name) = name {
            let act = torch_activation(name)
                .filter(|a| {
                    matches!(
                        a,
                        Activation::Sigmoid | Activation::Identity | Activation::Tanh
                    )
                })
                .ok_or_else(|| {
                    ModelError::file(
                        &path,
                        format!(
                            "unsupported `{key}` {name:?} (torch.nn Sigmoid, Identity or Tanh)"
                        ),
                    )
                })?;
            let file = path
                .file_name()
                .map_or(String::new(), |f| f.to_string_lossy().into_owned());
            return Ok((act, format!("{file} {key}")));
        }
    }
    Ok(if labels == 1 {
        (Activation::Sigmoid, "default for 1 label".into())
    } else {
        (Activation::Identity, format!("default for {labels} labels"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models")
    }

    #[test]
    fn modules_old_and_new_names() {
        let old = read_modules(&models().join("bert-st-old"))
            .unwrap()
            .unwrap();
        let kinds: Vec<_> = old.iter().map(|m| m.kind.clone()).collect();
        assert_eq!(
            kinds,
            [
                ModuleKind::Transformer,
                ModuleKind::Pooling,
                ModuleKind::Normalize
            ]
        );
        assert!(!old[2].dir.exists(), "2_Normalize is listed but absent");
        let new = read_modules(&models().join("bert-st-new"))
            .unwrap()
            .unwrap();
        assert_eq!(new[2].kind, ModuleKind::Dense);
        assert_eq!(new[0].dir, models().join("bert-st-new"));
        let e = read_modules(&models().join("unsupported-module"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("modules.json") && e.contains("LayerNorm"), "{e}");
        assert!(read_modules(&models().join("bert-cross-encoder-v4"))
            .unwrap()
            .is_none());
    }

    #[test]
    fn pooling_old_and_new_keys() {
        let p = |d: &str| read_pooling(&models().join(d).join("1_Pooling/config.json"), 32, None);
        assert_eq!(p("bert-st-old").unwrap(), (Pooling::Mean, true));
        assert_eq!(p("mpnet-st").unwrap(), (Pooling::Mean, true));
        assert_eq!(p("bert-st-new").unwrap(), (Pooling::Cls, false));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let check = |json: &str, want: Result<(Pooling, bool), &str>| {
            std::fs::write(&path, json).unwrap();
            match (read_pooling(&path, 8, None), want) {
                (Ok(got), Ok(w)) => assert_eq!(got, w, "{json}"),
                (Err(e), Err(needle)) => {
                    let e = e.to_string();
                    assert!(e.contains(needle), "{json}: {e}")
                }
                (got, w) => panic!("{json}: {got:?} vs {w:?}"),
            }
        };
        check(
            r#"{"pooling_mode_mean_tokens": false}"#,
            Ok((Pooling::Mean, true)),
        );
        check(
            r#"{"pooling_mode_max_tokens": true}"#,
            Ok((Pooling::Max, true)),
        );
        check(
            r#"{"pooling_mode": "max", "include_prompt": false}"#,
            Ok((Pooling::Max, false)),
        );
        check(r#"{"pooling_mode": "weightedmean"}"#, Err("weightedmean"));
        check(
            r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}"#,
            Err("several modes"),
        );
        check(r#"{"pooling_mode": ["cls", "mean"]}"#, Err("several modes"));
        check(
            r#"{"pooling_mode_lasttoken": true}"#,
            Ok((Pooling::LastToken, true)),
        );
        check(r#"{"embedding_dimension": 9}"#, Err("hidden_size 8"));
        check(
            r#"{"pooling_mode": "mean", "frobnicate": 1}"#,
            Err("`frobnicate`"),
        );
    }

    #[test]
    fn transformer_configs_are_strict() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sentence_bert_config.json");
        let read = |json: &str, kind| {
            std::fs::write(&path, json).unwrap();
            read_transformer_config(dir.path(), kind)
        };
        let st = FolderType::SentenceTransformer;
        let c = read(r#"{"max_seq_length": 256, "do_lower_case": true}"#, st).unwrap();
        assert_eq!((c.max_seq_length, c.do_lower_case), (Some(256), true));
        let c = read(r#"{"tokenizer_args": {"model_max_length": 77}, "model_args": {"torch_dtype": "float16"}}"#, st).unwrap();
        assert_eq!(c.processor_max_length, Some(77));
        assert_eq!(c.notes.len(), 1);
        for (json, needle) in [
            (
                r#"{"transformer_task": "sequence-classification"}"#,
                "transformer_task",
            ),
            (
                r#"{"processing_kwargs": {"text": {"max_length": 32}}}"#,
                "processing_kwargs",
            ),
            (
                r#"{"processor_kwargs": {"do_lower_case": true}}"#,
                "processor_kwargs.do_lower_case",
            ),
            (r#"{"backend": "onnx"}"#, "backend"),
            (r#"{"max_seq_length": 1}"#, "max_seq_length"),
            (r#"{"mystery": 1}"#, "`mystery`"),
        ] {
            let e = read(json, st).unwrap_err().to_string();
            assert!(
                e.contains(needle) && e.contains("sentence_bert_config.json"),
                "{json}: {e}"
            );
        }
        let c = read_transformer_config(
            &models().join("bert-cross-encoder"),
            FolderType::CrossEncoder,
        );
        assert!(c.is_ok(), "{c:?}");
    }

    #[test]
    fn max_length_follows_sentence_transformers() {
        let tc = Path::new("tokenizer_config.json");
        let none = TransformerConfig::default();
        // 6.x: only model_max_length, bounded by the position table.
        let m = resolve_max_length(&none, Some(128), tc, 512, 512);
        assert_eq!(m.value, 128);
        assert!(m.from.contains("model_max_length"), "{}", m.from);
        let m = resolve_max_length(&none, Some(1000), tc, 512, 512);
        assert_eq!(m.value, 512);
        assert!(m.from.contains("bounded by max_position_embeddings"));
        let m = resolve_max_length(&none, None, tc, 512, 512);
        assert_eq!(m.value, 512);
        // XLM-R: 514 positions hold 512 tokens.
        let m = resolve_max_length(&none, None, tc, 514, 512);
        assert_eq!(m.value, 512);
        assert!(m.from.contains("bounded to 512"), "{}", m.from);
        // Old format: max_seq_length, used as is (not bounded by model_max_length).
        let old = TransformerConfig {
            max_seq_length: Some(256),
            ..TransformerConfig::default()
        };
        assert_eq!(resolve_max_length(&old, Some(128), tc, 512, 512).value, 256);
        let both = TransformerConfig {
            processor_max_length: Some(64),
            max_seq_length: Some(256),
            ..TransformerConfig::default()
        };
        assert_eq!(resolve_max_length(&both, Some(128), tc, 512, 512).value, 64);
    }

    #[test]
    fn cross_encoder_activation_rules() {
        let cfg = |d: &str| -> Value {
            serde_json::from_str(
                &std::fs::read_to_string(models().join(d).join("config.json")).unwrap(),
            )
            .unwrap()
        };
        let st = |d: &str| read_st_config(&models().join(d)).unwrap();
        let p = Path::new("config.json");
        let (a, from) =
            cross_encoder_activation(&st("bert-cross-encoder"), &cfg("bert-cross-encoder"), p, 1)
                .unwrap();
        assert_eq!(a, Activation::Sigmoid);
        assert!(from.contains("activation_fn"), "{from}");
        let (a, _) =
            cross_encoder_activation(&st("xlmr-cross-encoder"), &cfg("xlmr-cross-encoder"), p, 3)
                .unwrap();
        assert_eq!(a, Activation::Identity);
        let (a, from) =
            cross_encoder_activation(&StConfig::default(), &cfg("bert-cross-encoder-v4"), p, 1)
                .unwrap();
        assert_eq!(a, Activation::Identity);
        assert!(
            from.contains("sentence_transformers.activation_fn"),
            "{from}"
        );
        let (a, from) = cross_encoder_activation(
            &StConfig::default(),
            &cfg("bert-cross-encoder-legacy"),
            p,
            1,
        )
        .unwrap();
        assert_eq!(a, Activation::Identity);
        assert!(
            from.contains("sbert_ce_default_activation_function"),
            "{from}"
        );
        let none = serde_json::json!({});
        assert_eq!(
            cross_encoder_activation(&StConfig::default(), &none, p, 1)
                .unwrap()
                .0,
            Activation::Sigmoid
        );
        assert_eq!(
            cross_encoder_activation(&StConfig::default(), &none, p, 2)
                .unwrap()
                .0,
            Activation::Identity
        );
        let odd = serde_json::json!({"sbert_ce_default_activation_function": "my.Act"});
        let e = cross_encoder_activation(&StConfig::default(), &odd, p, 1).unwrap_err();
        assert!(e.to_string().contains("my.Act"), "{e}");
    }
}
