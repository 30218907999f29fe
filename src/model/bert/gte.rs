//! GTE (`model_type` `new` — Alibaba-NLP's remote code — or `gte`,
//! transformers 5's GteModel) and NomicBERT (`nomic_bert`, in the Hub
//! remote code's GPT-2 style config or transformers 5's): post-norm
//! encoders with rotary positions and a gated feed-forward, run by
//! [`RotaryEncoderArch`] (`rotary.rs`).
//!
//! transformers 5 saves both families in the remote code's tensor names,
//! so one set of names serves both config layouts:
//!
//! | | GTE | NomicBERT |
//! |---|---|---|
//! | embeddings | `embeddings.{word,token_type}_embeddings`, `embeddings.LayerNorm` | the same, `emb_ln` |
//! | q, k, v | `encoder.layer.N.attention.qkv_proj` (bias) | `encoder.layers.N.attn.Wqkv` |
//! | output | `attention.o_proj` (bias), `attn_ln` | `attn.out_proj`, `norm1` |
//! | gated unit | `mlp.up_gate_proj` `[up; gate]` | `mlp.fc11` (up), `mlp.fc12` (gate) |
//! | down | `mlp.down_proj` (bias), `mlp_ln` | `mlp.fc2`, `norm2` |
//!
//! Linear biases are read where the checkpoint has them (NomicBERT's
//! `qkv_proj_bias`, `mlp_fc1_bias`, `mlp_fc2_bias`). Token type 0 (these
//! encoders embed single texts) is added into the word table at load.
//! GTE's `rope_scaling: {type: "ntk", factor}` is its remote code's static
//! NTK scaling: base `θ·factor` and every frequency times
//! `factor^(−2/head_dim)`, at every length. NomicBERT's dynamic NTK
//! (`rotary_scaling_factor`, past `max_trained_positions`) is decided per
//! sequence from its own length, never per batch; partial and interleaved
//! rotary are refused by name.

use super::config::EncoderConfig;
use super::rotary::{Norm, RotaryLayer};
use super::Family;
use crate::model::program::{DynamicNtk, WeightId};
use crate::model::safetensors_file::{Header, TensorFile};
use crate::model::{ModelError, Weights};
use serde_json::Value;
use std::path::Path;

/// Rotary settings of a GTE or NomicBERT config.json.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct RotaryConfig {
    pub theta: f32,
    /// [`crate::model::program::Rotary::scale`]: 1, or GTE's NTK factor^(−2/d).
    pub scale: f32,
    /// NomicBERT's dynamic NTK scaling past `max_trained_positions`.
    pub dynamic: Option<DynamicNtk>,
}

impl RotaryConfig {
    pub(super) fn read(c: &EncoderConfig, path: &Path) -> Result<RotaryConfig, ModelError> {
        let json = &c.json;
        let err = |m: String| ModelError::file(path, m);
        let number = |v: &Value, key: &str| -> Result<f64, ModelError> {
            v.as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| err(format!("`{key}` is {v}, expected a positive number")))
        };
        // transformers 5: rope_parameters {rope_type, rope_theta}; the
        // remote code: rope_theta / rotary_emb_base, rope_scaling.
        if let Some(rp) = json.get("rope_parameters").filter(|v| !v.is_null()) {
            let ty = rp
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
            let theta = match rp.get("rope_theta") {
                Some(v) => number(v, "rope_parameters.rope_theta")?,
                None => default_theta(c.family),
            };
            let dynamic = match ty {
                "default" => None,
                // transformers' dynamic NTK: the same formula, from the
                // original maximum (for one unpadded sequence).
                "dynamic" if c.family == Family::NomicBert => {
                    let factor = number(
                        rp.get("factor").unwrap_or(&Value::Null),
                        "rope_parameters.factor",
                    )?;
                    let max = rp
                        .get("original_max_position_embeddings")
                        .and_then(Value::as_u64)
                        .map_or(c.max_position, |m| m as usize);
                    Some(DynamicNtk {
                        factor: factor as f32,
                        max_trained: max,
                    })
                }
                _ => {
                    return Err(err(format!(
                        "unsupported rope_parameters.rope_type {ty:?} (\"default\"{})",
                        if c.family == Family::NomicBert {
                            " or \"dynamic\""
                        } else {
                            ""
                        }
                    )))
                }
            };
            return Ok(RotaryConfig {
                theta: theta as f32,
                scale: 1.0,
                dynamic,
            });
        }
        match c.family {
            Family::Gte => {
                if let Some(t) = json.get("position_embedding_type") {
                    if t.as_str() != Some("rope") {
                        return Err(err(format!(
                            "unsupported position_embedding_type {t} (GTE: \"rope\")"
                        )));
                    }
                }
                for (key, ok) in [
                    ("logn_attention_scale", Value::Bool(false)),
                    ("layer_norm_type", Value::from("layer_norm")),
                    ("pack_qkv", Value::Bool(true)),
                ] {
                    if let Some(v) = json.get(key).filter(|v| **v != ok) {
                        return Err(err(format!(
                            "unsupported `{key}` {v} (replayd serves {ok})"
                        )));
                    }
                }
                let theta = match json.get("rope_theta") {
                    Some(v) => number(v, "rope_theta")?,
                    None => 10_000.0,
                };
                match json.get("rope_scaling").filter(|v| !v.is_null()) {
                    None => Ok(RotaryConfig {
                        theta: theta as f32,
                        scale: 1.0,
                        dynamic: None,
                    }),
                    Some(s) => {
                        let ty = s.get("type").or_else(|| s.get("rope_type"));
                        if ty.and_then(Value::as_str) != Some("ntk") || s.get("mixed_b").is_some() {
                            return Err(err(format!(
                                "unsupported rope_scaling {s} (GTE's {{\"type\": \"ntk\", \"factor\": f}})"
                            )));
                        }
                        let f = number(
                            s.get("factor").unwrap_or(&Value::Null),
                            "rope_scaling.factor",
                        )?;
                        let d = (c.hidden / c.heads) as f64;
                        Ok(RotaryConfig {
                            theta: (theta * f) as f32,
                            scale: f.powf(-2.0 / d) as f32,
                            dynamic: None,
                        })
                    }
                }
            }
            _ => {
                // The remote code's keys.
                for (key, ok) in [
                    ("rotary_emb_interleaved", Value::Bool(false)),
                    ("prenorm", Value::Bool(false)),
                    ("causal", Value::Bool(false)),
                    ("rotary_emb_scale_base", Value::Null),
                ] {
                    if let Some(v) = json.get(key).filter(|v| **v != ok) {
                        return Err(err(format!(
                            "unsupported `{key}` {v} (replayd serves NomicBERT with {ok})"
                        )));
                    }
                }
                // Dynamic NTK past max_trained_positions, per sequence (the
                // remote code decides it per padded batch: a text's
                // embedding would depend on its batch-mates).
                let dynamic = match json.get("rotary_scaling_factor") {
                    None | Some(Value::Null) => None,
                    Some(v) => Some(DynamicNtk {
                        factor: number(v, "rotary_scaling_factor")? as f32,
                        max_trained: match json.get("max_trained_positions") {
                            None | Some(Value::Null) => 2048,
                            Some(m) => m.as_u64().filter(|&m| m > 0).ok_or_else(|| {
                                err(format!(
                                    "`max_trained_positions` is {m}, expected a positive integer"
                                ))
                            })? as usize,
                        },
                    }),
                };
                if let Some(v) = json.get("rotary_emb_fraction") {
                    if v.as_f64() != Some(1.0) {
                        return Err(err(format!(
                            "unsupported rotary_emb_fraction {v} (replayd rotates whole heads: 1.0)"
                        )));
                    }
                }
                let theta = match json.get("rotary_emb_base") {
                    Some(v) => number(v, "rotary_emb_base")?,
                    None => 10_000.0,
                };
                Ok(RotaryConfig {
                    theta: theta as f32,
                    scale: 1.0,
                    dynamic,
                })
            }
        }
    }
}

/// transformers 5's default rope_theta per family.
fn default_theta(family: Family) -> f64 {
    match family {
        Family::Gte => 160_000.0,
        _ => 1_000.0,
    }
}

/// The tensor names of one family (module docs), with the checkpoint's prefix.
struct Names {
    prefix: String,
    family: Family,
}

impl Names {
    fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    fn embed_norm(&self) -> String {
        self.name(match self.family {
            Family::Gte => "embeddings.LayerNorm",
            _ => "emb_ln",
        })
    }

    fn layer(&self, l: usize) -> String {
        self.name(&match self.family {
            Family::Gte => format!("encoder.layer.{l}."),
            _ => format!("encoder.layers.{l}."),
        })
    }

    /// (qkv, out, norm after attention, down, norm after the feed-forward).
    fn parts(&self) -> [&'static str; 5] {
        match self.family {
            Family::Gte => [
                "attention.qkv_proj",
                "attention.o_proj",
                "attn_ln",
                "mlp.down_proj",
                "mlp_ln",
            ],
            _ => ["attn.Wqkv", "attn.out_proj", "norm1", "mlp.fc2", "norm2"],
        }
    }
}

/// Checks every tensor's presence and shape; the names to load.
fn check(header: &Header, c: &EncoderConfig) -> Result<Names, ModelError> {
    let word = "embeddings.word_embeddings.weight";
    let prefix = ["", "new.", "gte.", "nomic_bert.", "model."]
        .into_iter()
        .find(|p| header.get(&format!("{p}{word}")).is_some())
        .ok_or_else(|| {
            ModelError::file(
                &header.path,
                format!(
                    "missing tensor `{word}`: not a {} checkpoint",
                    c.family.model_type()
                ),
            )
        })?;
    let names = Names {
        prefix: prefix.to_string(),
        family: c.family,
    };
    let (h, i) = (c.hidden, c.intermediate);
    let why = format!(" (config.json: hidden size {h}, intermediate size {i})");
    header.expect_shape(&names.name(word), &[c.vocab, h], &why)?;
    if c.type_vocab > 0 {
        header.expect_shape(
            &names.name("embeddings.token_type_embeddings.weight"),
            &[c.type_vocab, h],
            &why,
        )?;
    }
    let norm = |base: String| -> Result<(), ModelError> {
        header.expect_shape(&format!("{base}.weight"), &[h], &why)?;
        header.expect_shape(&format!("{base}.bias"), &[h], &why)
    };
    // Its bias is optional (NomicBERT's config decides; checked if present).
    let linear = |base: String, out: usize, inp: usize| -> Result<(), ModelError> {
        header.expect_shape(&format!("{base}.weight"), &[out, inp], &why)?;
        if header.get(&format!("{base}.bias")).is_some() {
            header.expect_shape(&format!("{base}.bias"), &[out], &why)?;
        }
        Ok(())
    };
    norm(names.embed_norm())?;
    let [qkv, out, norm1, down, norm2] = names.parts();
    for l in 0..c.layers {
        let p = names.layer(l);
        linear(format!("{p}{qkv}"), 3 * h, h)?;
        linear(format!("{p}{out}"), h, h)?;
        norm(format!("{p}{norm1}"))?;
        match c.family {
            Family::Gte => linear(format!("{p}mlp.up_gate_proj"), 2 * i, h)?,
            _ => {
                linear(format!("{p}mlp.fc11"), i, h)?;
                linear(format!("{p}mlp.fc12"), i, h)?;
            }
        }
        linear(format!("{p}{down}"), h, i)?;
        norm(format!("{p}{norm2}"))?;
    }
    let beyond = names.layer(0).trim_end_matches("0.").to_string();
    for name in header.tensors.keys() {
        let index = name
            .strip_prefix(&beyond)
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        if index.is_some_and(|n| n >= c.layers) {
            return Err(ModelError::file(
                &header.path,
                format!(
                    "tensor `{name}` belongs to a layer beyond config.json's {} layers",
                    c.layers
                ),
            ));
        }
    }
    Ok(names)
}

/// Checks the names and shapes (`replayd inspect`, start-up before loading).
pub(super) fn check_names(header: &Header, c: &EncoderConfig) -> Result<(), ModelError> {
    check(header, c).map(drop)
}

/// The encoder's weights, before the head is known.
pub(super) struct EncoderWeights {
    /// The word table with token type 0 added to every row.
    pub word: WeightId,
    pub embedding_norm: Norm,
    pub layers: Vec<RotaryLayer>,
}

/// Reads the encoder's weights into `weights`: as stored, but the word
/// table (token type 0 added, in f32).
pub(super) fn load(
    file: &TensorFile,
    c: &EncoderConfig,
    rope: &RotaryConfig,
    weights: &mut Weights,
) -> Result<EncoderWeights, ModelError> {
    let names = check(&file.header, c)?;
    let h = c.hidden;
    let (word_name, mut word) = {
        let name = names.name("embeddings.word_embeddings.weight");
        let (_, data) = file.f32(&name)?;
        (name, data)
    };
    if c.type_vocab > 0 {
        let (_, types) = file.f32(&names.name("embeddings.token_type_embeddings.weight"))?;
        for row in word.chunks_exact_mut(h) {
            row.iter_mut().zip(&types[..h]).for_each(|(w, t)| *w += t);
        }
    }
    let word = weights.push(
        format!("{word_name} (+ token type 0)"),
        vec![c.vocab, h],
        word,
    );
    let header = &file.header;
    let embedding_norm = norm_of(file, weights, names.embed_norm())?;
    let [qkv, out, norm1, down, norm2] = names.parts();
    let mut layers = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let p = names.layer(l);
        let (qkv_weight, qkv_bias) = linear(file, weights, format!("{p}{qkv}"))?;
        let (attention_output_weight, attention_output_bias) =
            linear(file, weights, format!("{p}{out}"))?;
        let attention_norm = Some(norm_of(file, weights, format!("{p}{norm1}"))?);
        let (input_weight, input_bias) = match c.family {
            Family::Gte => linear(file, weights, format!("{p}mlp.up_gate_proj"))?,
            _ => {
                // [fc11 (up); fc12 (gate)]: the gate is the second half.
                let (shape, data) = file.concat_rows(&[
                    &format!("{p}mlp.fc11.weight"),
                    &format!("{p}mlp.fc12.weight"),
                ])?;
                let w = weights.push_data(format!("{p}mlp.[fc11; fc12].weight"), shape, data);
                let has = |n: &str| header.get(&format!("{p}mlp.{n}.bias")).is_some();
                let b = match (has("fc11"), has("fc12")) {
                    (false, false) => None,
                    (true, true) => {
                        let (shape, data) = file.concat_rows(&[
                            &format!("{p}mlp.fc11.bias"),
                            &format!("{p}mlp.fc12.bias"),
                        ])?;
                        Some(weights.push_data(format!("{p}mlp.[fc11; fc12].bias"), shape, data))
                    }
                    _ => {
                        return Err(ModelError::file(
                            &header.path,
                            format!("{p}mlp: fc11 and fc12 must both have a bias or neither"),
                        ))
                    }
                };
                (w, b)
            }
        };
        let (output_weight, output_bias) = linear(file, weights, format!("{p}{down}"))?;
        let mlp_norm = norm_of(file, weights, format!("{p}{norm2}"))?;
        layers.push(RotaryLayer {
            attention_norm,
            qkv_weight,
            qkv_bias,
            attention_output_weight,
            attention_output_bias,
            mlp_norm,
            input_weight,
            input_bias,
            output_weight,
            output_bias,
            window: None,
            rope_theta: rope.theta,
        });
    }
    Ok(EncoderWeights {
        word,
        embedding_norm,
        layers,
    })
}

fn push_one(
    file: &TensorFile,
    weights: &mut Weights,
    name: String,
) -> Result<WeightId, ModelError> {
    let (shape, data) = file.stored(&name)?;
    Ok(weights.push_data(name, shape, data))
}

/// A linear layer's weight, and its bias where the checkpoint has one.
fn linear(
    file: &TensorFile,
    weights: &mut Weights,
    base: String,
) -> Result<(WeightId, Option<WeightId>), ModelError> {
    let w = push_one(file, weights, format!("{base}.weight"))?;
    let bias = format!("{base}.bias");
    let b = match file.header.get(&bias) {
        Some(_) => Some(push_one(file, weights, bias)?),
        None => None,
    };
    Ok((w, b))
}

fn norm_of(file: &TensorFile, weights: &mut Weights, base: String) -> Result<Norm, ModelError> {
    Ok(Norm {
        weight: push_one(file, weights, format!("{base}.weight"))?,
        bias: Some(push_one(file, weights, format!("{base}.bias"))?),
    })
}
