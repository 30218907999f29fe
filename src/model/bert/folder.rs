//! Reading a BERT-family encoder from a Hugging Face folder, with
//! sentence-transformers pooling and normalisation.
//!
//! The folder holds:
//!
//! * `config.json` — `model_type` `"bert"`; `hidden_size`,
//!   `num_attention_heads`, `num_hidden_layers`, `intermediate_size`,
//!   `vocab_size`, `max_position_embeddings` (required), `type_vocab_size`
//!   (default 2), `hidden_act` (default `"gelu"`), `layer_norm_eps` (default
//!   1e-12), `position_embedding_type` (must be `"absolute"` if present).
//! * `model.safetensors` — the `BertModel` weights, optionally prefixed `bert.`
//!   (f32, f16, bf16 or f64; converted to f32). `embeddings.position_ids`,
//!   the pooler and any task heads are ignored. LayerNorm parameters may be
//!   named `weight`/`bias` or (older checkpoints) `gamma`/`beta`.
//! * `tokenizer.json` — must exist (the frontend loads it).
//! * Optionally the sentence-transformers files: `modules.json` (a `Normalize`
//!   module turns on L2 normalisation; modules other than Transformer, Pooling
//!   and Normalize, e.g. `Dense`, are rejected because we would compute a
//!   different function), the pooling module's `config.json` (default
//!   `1_Pooling/config.json`; mean, cls or max) and
//!   `sentence_bert_config.json` (`max_seq_length`, the default longest input).
//!
//! [`ModelSpec`]'s `pooling`, `normalize` and `max_seq_len` override the
//! folder; `max_seq_len` may not exceed `max_position_embeddings`.
//!
//! [`inspect`] reads the JSON files and the safetensors header only (no
//! weight data) and checks every tensor's presence and shape; [`load`] does
//! the same checks and then reads the weights, fusing each layer's query, key
//! and value projections into one `[3·hidden, hidden]` weight.

use super::{BertArch, BertEmbeddings, BertLayer};
use crate::model::files::read_json;
use crate::model::program::{Activation, Pooling, WeightId};
use crate::model::safetensors_file::{read_header, Header, TensorFile};
use crate::model::{
    Architecture, InputSpec, Model, ModelError, ModelInfo, ModelKind, ModelSpec, Weights,
};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The hyper-parameters from `config.json`.
#[derive(Clone, Debug, PartialEq)]
struct BertConfig {
    hidden: usize,
    heads: usize,
    layers: usize,
    intermediate: usize,
    act: Activation,
    eps: f32,
    max_position: usize,
    type_vocab: usize,
    vocab: usize,
}

fn parse_config(path: &Path) -> Result<BertConfig, ModelError> {
    let json = read_json(path)?;
    let err = |m: String| ModelError::file(path, m);
    if !json.is_object() {
        return Err(err("expected a JSON object".into()));
    }
    match json.get("model_type").and_then(Value::as_str) {
        Some("bert") => {}
        Some(other) => {
            return Err(err(format!(
                "unknown architecture: model_type {other:?} (replayd serves BERT encoders, model_type \"bert\")"
            )))
        }
        None => {
            return Err(err(
                "unknown architecture: no model_type (replayd serves BERT encoders, model_type \"bert\")".into(),
            ))
        }
    }
    for flag in ["is_decoder", "add_cross_attention"] {
        if json.get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(err(format!(
                "unsupported architecture: `{flag}` is true (replayd serves bidirectional encoders)"
            )));
        }
    }
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
    let hidden = size("hidden_size", None)?;
    let heads = size("num_attention_heads", None)?;
    let layers = size("num_hidden_layers", None)?;
    let intermediate = size("intermediate_size", None)?;
    let max_position = size("max_position_embeddings", None)?;
    let vocab = size("vocab_size", None)?;
    let type_vocab = size("type_vocab_size", Some(2))?;
    if hidden % heads != 0 {
        return Err(err(format!(
            "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )));
    }
    let act = match json.get("hidden_act") {
        None => Activation::Gelu,
        Some(v) => v.as_str().and_then(Activation::parse).ok_or_else(|| {
            err(format!(
                "unsupported hidden_act {v} (gelu, gelu_new, relu, silu, tanh, ...)"
            ))
        })?,
    };
    let eps = match json.get("layer_norm_eps") {
        None => 1e-12,
        Some(v) => v.as_f64().filter(|e| *e > 0.0).ok_or_else(|| {
            err(format!(
                "`layer_norm_eps` is {v}, expected a positive number"
            ))
        })? as f32,
    };
    if let Some(v) = json.get("position_embedding_type") {
        if v.as_str() != Some("absolute") {
            return Err(err(format!(
                "unsupported position_embedding_type {v} (only \"absolute\")"
            )));
        }
    }
    Ok(BertConfig {
        hidden,
        heads,
        layers,
        intermediate,
        act,
        eps,
        max_position,
        type_vocab,
        vocab,
    })
}

/// Pooling from a sentence-transformers pooling config.
fn parse_pooling(path: &Path, hidden: usize) -> Result<Pooling, ModelError> {
    let json = read_json(path)?;
    let err = |m: String| ModelError::file(path, m);
    if let Some(dim) = json.get("word_embedding_dimension").and_then(Value::as_u64) {
        if dim as usize != hidden {
            return Err(err(format!(
                "word_embedding_dimension {dim} differs from the model's hidden_size {hidden}"
            )));
        }
    }
    let on = |key: &str| json.get(key).and_then(Value::as_bool) == Some(true);
    let unsupported = [
        "pooling_mode_mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens",
        "pooling_mode_lasttoken",
    ];
    if let Some(mode) = unsupported.iter().find(|m| on(m)) {
        return Err(err(format!(
            "unsupported pooling mode `{mode}` (replayd pools with mean, cls or max)"
        )));
    }
    if let Some(mode) = json.get("pooling_mode").and_then(Value::as_str) {
        // Newer configs may name the mode directly.
        return match mode {
            "mean" => Ok(Pooling::Mean),
            "cls" => Ok(Pooling::Cls),
            "max" => Ok(Pooling::Max),
            other => Err(err(format!(
                "unsupported pooling mode {other:?} (replayd pools with mean, cls or max)"
            ))),
        };
    }
    let modes: Vec<Pooling> = [
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
    ]
    .into_iter()
    .filter(|(key, _)| on(key))
    .map(|(_, mode)| mode)
    .collect();
    match modes[..] {
        [mode] => Ok(mode),
        [] => Err(err("no pooling mode is enabled".into())),
        _ => Err(err(
            "unsupported pooling: several modes are enabled (concatenated embeddings)".into(),
        )),
    }
}

/// Everything about a folder except the weights.
#[derive(Clone, Debug)]
struct Folder {
    config: BertConfig,
    pooling: Pooling,
    normalize: bool,
    max_seq_len: usize,
    tokenizer: PathBuf,
    weights: PathBuf,
}

fn describe(model: &ModelSpec) -> Result<Folder, ModelError> {
    let dir = &model.path;
    if !dir.is_dir() {
        return Err(ModelError::file(
            dir,
            if dir.exists() {
                "not a folder (a BERT model is a Hugging Face folder)"
            } else {
                "missing model folder"
            },
        ));
    }
    let config = parse_config(&dir.join("config.json"))?;
    let tokenizer = dir.join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(ModelError::file(
            &tokenizer,
            "missing file (the model's tokenizer is required)",
        ));
    }
    let weights = dir.join("model.safetensors");
    if !weights.is_file() {
        return Err(ModelError::file(&weights, "missing file"));
    }

    // sentence-transformers modules.
    let modules_path = dir.join("modules.json");
    let mut pooling_dir = None;
    let mut has_normalize = false;
    if modules_path.is_file() {
        let modules = read_json(&modules_path)?;
        let list = modules
            .as_array()
            .ok_or_else(|| ModelError::file(&modules_path, "expected a JSON list of modules"))?;
        for module in list {
            let kind = module.get("type").and_then(Value::as_str).unwrap_or("");
            let short = kind.rsplit('.').next().unwrap_or(kind);
            match short {
                "Transformer" => {}
                "Pooling" => {
                    let sub = module.get("path").and_then(Value::as_str).unwrap_or("1_Pooling");
                    pooling_dir = Some(dir.join(sub));
                }
                "Normalize" => has_normalize = true,
                _ => {
                    return Err(ModelError::file(
                        &modules_path,
                        format!(
                            "unsupported sentence-transformers module {kind:?} (replayd applies Transformer, Pooling and Normalize only)"
                        ),
                    ))
                }
            }
        }
    }
    let pooling = match model.pooling {
        Some(p) => p,
        None => {
            let path = pooling_dir
                .unwrap_or_else(|| dir.join("1_Pooling"))
                .join("config.json");
            if path.is_file() {
                parse_pooling(&path, config.hidden)?
            } else {
                Pooling::Mean
            }
        }
    };
    let normalize = model.normalize.unwrap_or(has_normalize);

    let st_path = dir.join("sentence_bert_config.json");
    let folder_max = if st_path.is_file() {
        match read_json(&st_path)?.get("max_seq_length") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let n = v.as_u64().filter(|&n| n >= 2).ok_or_else(|| {
                    ModelError::file(
                        &st_path,
                        format!("`max_seq_length` is {v}, expected an integer ≥ 2"),
                    )
                })? as usize;
                if n > config.max_position {
                    return Err(ModelError::file(
                        &st_path,
                        format!(
                            "max_seq_length {n} exceeds max_position_embeddings {} of config.json",
                            config.max_position
                        ),
                    ));
                }
                Some(n)
            }
        }
    } else {
        None
    };
    let max_seq_len = match model.max_seq_len {
        Some(n) if n > config.max_position => {
            return Err(ModelError::Invalid {
                model: model.name.clone(),
                message: format!(
                    "max_seq_len {n} exceeds the model's max_position_embeddings {} ({})",
                    config.max_position,
                    dir.join("config.json").display()
                ),
            })
        }
        Some(n) => n,
        None => folder_max.unwrap_or(config.max_position),
    };
    Ok(Folder {
        config,
        pooling,
        normalize,
        max_seq_len,
        tokenizer,
        weights,
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

/// Tensor names of the embedding block and of each layer, resolved against
/// the header (prefix, LayerNorm naming) and checked for shape.
struct TensorNames {
    word: String,
    position: String,
    token_type: String,
    embed_norm: (String, String),
    layers: Vec<LayerNames>,
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

fn tensor_names(header: &Header, c: &BertConfig) -> Result<TensorNames, ModelError> {
    let prefix = if header.get("embeddings.word_embeddings.weight").is_some() {
        ""
    } else if header
        .get("bert.embeddings.word_embeddings.weight")
        .is_some()
    {
        "bert."
    } else {
        return Err(ModelError::file(
            &header.path,
            "missing tensor `embeddings.word_embeddings.weight` (nor `bert.embeddings.word_embeddings.weight`): not a BERT checkpoint",
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
    let token_type = format!("{prefix}embeddings.token_type_embeddings.weight");
    header.expect_shape(
        &token_type,
        &[c.type_vocab, h],
        &format!(
            " (config.json: type_vocab_size {}, hidden_size {h})",
            c.type_vocab
        ),
    )?;
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
    let mut layers = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let p = format!("{prefix}encoder.layer.{l}");
        let qkv = [
            dense(format!("{p}.attention.self.query"), h, h, &why_h)?,
            dense(format!("{p}.attention.self.key"), h, h, &why_h)?,
            dense(format!("{p}.attention.self.value"), h, h, &why_h)?,
        ];
        layers.push(LayerNames {
            qkv,
            attention_output: dense(format!("{p}.attention.output.dense"), h, h, &why_h)?,
            attention_norm: norm(format!("{p}.attention.output.LayerNorm"))?,
            intermediate: dense(format!("{p}.intermediate.dense"), i, h, &why_i)?,
            output: dense(format!("{p}.output.dense"), h, i, &why_i)?,
            output_norm: norm(format!("{p}.output.LayerNorm"))?,
        });
    }
    // A checkpoint with more layers than config.json says is a mismatch, not
    // something to truncate silently.
    let layer_prefix = format!("{prefix}encoder.layer.");
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
    Ok(TensorNames {
        word,
        position,
        token_type,
        embed_norm,
        layers,
    })
}

fn info(model: &ModelSpec, folder: &Folder) -> ModelInfo {
    ModelInfo {
        name: model.name.clone(),
        kind: ModelKind::Bert,
        input: InputSpec::Tokens {
            vocab_size: folder.config.vocab,
            max_seq_len: folder.max_seq_len,
        },
        output_dim: folder.config.hidden,
        dtype: model.dtype,
        tokenizer_path: Some(folder.tokenizer.clone()),
    }
}

/// Loads the configs and the weights (converted to f32; q/k/v fused).
pub fn load(config: &ModelSpec) -> Result<Model, ModelError> {
    let folder = describe(config)?;
    let file = TensorFile::open(&folder.weights)?;
    let names = tensor_names(&file.header, &folder.config)?;
    let mut weights = Weights::new();
    let mut push = |name: &str| -> Result<WeightId, ModelError> {
        let (shape, data) = file.f32(name)?;
        Ok(weights.push(name, shape, data))
    };
    let embeddings = BertEmbeddings {
        word: push(&names.word)?,
        position: push(&names.position)?,
        token_type: push(&names.token_type)?,
        norm_gamma: push(&names.embed_norm.0)?,
        norm_beta: push(&names.embed_norm.1)?,
    };
    let h = folder.config.hidden;
    let mut layers = Vec::with_capacity(names.layers.len());
    for (l, ln) in names.layers.iter().enumerate() {
        // [q; k; v] rows: the fused projection's output is [q | k | v].
        let mut qkv_w = Vec::with_capacity(3 * h * h);
        let mut qkv_b = Vec::with_capacity(3 * h);
        for (w, b) in &ln.qkv {
            qkv_w.extend_from_slice(&file.f32(w)?.1);
            qkv_b.extend_from_slice(&file.f32(b)?.1);
        }
        let base = ln.qkv[0].0.trim_end_matches(".attention.self.query.weight");
        debug_assert!(base.ends_with(&format!("layer.{l}")));
        let qkv_weight = weights.push(
            format!("{base}.attention.self.qkv.weight"),
            vec![3 * h, h],
            qkv_w,
        );
        let qkv_bias = weights.push(
            format!("{base}.attention.self.qkv.bias"),
            vec![3 * h],
            qkv_b,
        );
        let mut push = |name: &str| -> Result<WeightId, ModelError> {
            let (shape, data) = file.f32(name)?;
            Ok(weights.push(name, shape, data))
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
    let c = &folder.config;
    let arch = BertArch {
        hidden: c.hidden,
        heads: c.heads,
        head_dim: c.hidden / c.heads,
        intermediate: c.intermediate,
        hidden_act: c.act,
        layer_norm_eps: c.eps,
        vocab_size: c.vocab,
        max_position_embeddings: c.max_position,
        type_vocab_size: c.type_vocab,
        max_seq_len: folder.max_seq_len,
        pooling: folder.pooling,
        normalize: folder.normalize,
        embeddings,
        layers,
    };
    Ok(Model {
        info: info(config, &folder),
        arch: Architecture::Bert(arch),
        weights,
    })
}

/// Reads the configs and the safetensors header (no weight data), checks
/// every tensor's presence and shape, and that the tokenizer exists.
pub fn inspect(config: &ModelSpec) -> Result<ModelInfo, ModelError> {
    let folder = describe(config)?;
    let header = read_header(&folder.weights)?;
    tensor_names(&header, &folder.config)?;
    Ok(info(config, &folder))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;
    use std::io::Read;

    fn model_dir() -> PathBuf {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2");
        assert!(
            dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file(),
            "{} is missing: run scripts/fetch-model.sh",
            dir.display()
        );
        dir
    }

    fn config(path: &Path) -> ModelSpec {
        ModelSpec {
            name: "minilm".into(),
            kind: ModelKind::Bert,
            path: path.to_path_buf(),
            dtype: DType::F32,
            max_seq_len: None,
            activation: None,
            pooling: None,
            normalize: None,
        }
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
        assert_eq!(&qkv.data[384 * 384..2 * 384 * 384], &key[..]);
        let value_bias = file
            .f32("encoder.layer.2.attention.self.value.bias")
            .unwrap()
            .1;
        assert_eq!(
            &model.weights.get(arch.layers[2].qkv_bias).data[768..],
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
        // An explicit pooling in the model config does not read the file.
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
        let modules = edited_json("modules.json", |j| {
            j.as_array_mut().unwrap().push(serde_json::json!({
                "idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"
            }))
        });
        std::fs::write(dir.path().join("modules.json"), modules).unwrap();
        assert_error(inspect(&c), &["modules.json", "Dense"]);
        // Missing model folder.
        assert_error(
            inspect(&config(&dir.path().join("nope"))),
            &["nope", "missing model folder"],
        );
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
        assert_eq!(word.data[1000], want);
    }
}
