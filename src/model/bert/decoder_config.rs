//! Qwen3 (`model_type` `qwen3`) and Gemma 3 (`gemma3_text`) folders: the
//! settings of config.json the shared parser does not read, the tensor
//! names, and loading the weights as stored for [`DecoderArch`]
//! (`decoder.rs`).
//!
//! | | Qwen3 | Gemma 3 |
//! |---|---|---|
//! | embeddings | `embed_tokens` | `embed_tokens`, times `√hidden` |
//! | before attention | `input_layernorm` | `input_layernorm` |
//! | q, k, v, o | `self_attn.{q,k,v,o}_proj` (biases with `attention_bias`) | the same |
//! | q/k norms | `self_attn.{q,k}_norm` | the same |
//! | after attention | — | `post_attention_layernorm` |
//! | before the MLP | `post_attention_layernorm` | `pre_feedforward_layernorm` |
//! | MLP | `mlp.{gate,up,down}_proj`, SiLU | the same, tanh GELU |
//! | after the MLP | — | `post_feedforward_layernorm` |
//! | last | `norm` | `norm` |
//!
//! Every name may carry `model.` in front (a checkpoint saved from
//! `*ForCausalLM`; its `lm_head` is not read). Gemma's RMSNorms scale by
//! `1 + weight`, its attention by `query_pre_attn_scalar^−½`.
//!
//! Attention: Qwen3 is causal (its sliding window, `use_sliding_window`,
//! is refused). Gemma 3 is causal unless `use_bidirectional_attention`
//! (EmbeddingGemma). Its local layers (`layer_types`
//! `sliding_attention`, else every layer but each `sliding_window_pattern`th)
//! see `|i − j| < W`, where transformers 5 sets `W = sliding_window // 2 + 1`
//! for bidirectional models from the saved `sliding_window` (so the window
//! is `sliding_window // 2` keys on each side); causal ones see
//! `i − W < j ≤ i` with `W = sliding_window`. Rotary bases: transformers
//! 5's `rope_parameters` (per layer type for Gemma), or the older
//! `rope_theta` (global) and `rope_local_base_freq` (local); scaled rope
//! types are refused by name.

use super::config::EncoderConfig;
use super::decoder::DecoderLayer;
use super::Family;
use crate::model::program::WeightId;
use crate::model::safetensors_file::{Header, TensorFile};
use crate::model::{ModelError, Weights};
use serde_json::Value;
use std::path::Path;

/// What a decoder's config.json says beyond [`EncoderConfig`].
#[derive(Clone, Debug, PartialEq)]
pub(super) struct DecoderConfig {
    pub head_dim: usize,
    pub kv_heads: usize,
    pub causal: bool,
    /// Each layer's window (`|i − j| ≤ w`; `None`: global) and rotary base.
    pub layers: Vec<(Option<usize>, f32)>,
    /// Gemma's `query_pre_attn_scalar^−½`.
    pub attention_scale: Option<f32>,
    pub embed_scale: f32,
    pub norm_offset: f32,
    /// q, k, v and o have biases (`attention_bias`).
    pub attention_bias: bool,
}

impl DecoderConfig {
    pub(super) fn read(c: &EncoderConfig, path: &Path) -> Result<DecoderConfig, ModelError> {
        let json = &c.json;
        let err = |m: String| ModelError::file(path, m);
        let size = |key: &str, default: usize| -> Result<usize, ModelError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| err(format!("`{key}` is {v}, expected a positive integer"))),
            }
        };
        let flag = |key: &str| -> Result<bool, ModelError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(err(format!("`{key}` is {v}, expected true or false"))),
            }
        };
        let number = |v: &Value, key: &str| -> Result<f32, ModelError> {
            v.as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .map(|x| x as f32)
                .ok_or_else(|| err(format!("`{key}` is {v}, expected a positive number")))
        };
        let head_dim = size("head_dim", c.hidden / c.heads)?;
        if head_dim % 2 != 0 {
            return Err(err(format!(
                "`head_dim` {head_dim} is odd (rotary needs pairs)"
            )));
        }
        let kv_heads = size("num_key_value_heads", c.heads)?;
        if !c.heads.is_multiple_of(kv_heads) {
            return Err(err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {kv_heads}",
                c.heads
            )));
        }
        // Only the default rotary embedding: a scaled rope type is refused.
        let default_rope = |rp: &Value, key: &str| -> Result<(), ModelError> {
            match rp.get("rope_type").or_else(|| rp.get("type")).and_then(Value::as_str) {
                None | Some("default") => Ok(()),
                Some(other) => Err(err(format!(
                    "unsupported `{key}` rope_type {other:?} (replayd serves the default rotary embedding)"
                ))),
            }
        };
        // A rope_parameters entry's base.
        let theta_of = |rp: &Value, key: &str| -> Result<f32, ModelError> {
            default_rope(rp, key)?;
            let theta = rp
                .get("rope_theta")
                .ok_or_else(|| err(format!("`{key}` has no rope_theta")))?;
            number(theta, &format!("{key}.rope_theta"))
        };
        if let Some(v) = json.get("rope_scaling").filter(|v| !v.is_null()) {
            default_rope(v, "rope_scaling")?;
        }
        let rope_parameters = json.get("rope_parameters").filter(|v| !v.is_null());
        let old_theta = |key: &str, default: f32| -> Result<f32, ModelError> {
            json.get(key)
                .filter(|v| !v.is_null())
                .map_or(Ok(default), |v| number(v, key))
        };
        let sliding_window = || -> Result<usize, ModelError> {
            match json.get("sliding_window") {
                Some(v) if !v.is_null() => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        err(format!(
                            "`sliding_window` is {v}, expected a positive integer"
                        ))
                    }),
                _ => Err(err("local layers but no `sliding_window`".into())),
            }
        };
        let (causal, layers, attention_scale, embed_scale, norm_offset) = match c.family {
            Family::Qwen3 => {
                if flag("use_sliding_window")? {
                    return Err(err(
                        "unsupported `use_sliding_window: true` (Qwen3-Embedding attends to the whole text)".into(),
                    ));
                }
                let theta = match rope_parameters {
                    Some(rp) => theta_of(rp, "rope_parameters")?,
                    None => old_theta("rope_theta", 10_000.0)?,
                };
                (true, vec![(None, theta); c.layers], None, 1.0, 0.0)
            }
            Family::Gemma3 => {
                for key in ["attn_logit_softcapping"] {
                    if json.get(key).is_some_and(|v| !v.is_null()) {
                        return Err(err(format!(
                            "unsupported `{key}` {} (replayd serves Gemma 3 without attention soft-capping)",
                            json[key]
                        )));
                    }
                }
                let bidirectional = flag("use_bidirectional_attention")?;
                let types: Vec<bool> = match json.get("layer_types") {
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|t| match t.as_str() {
                            Some("sliding_attention") => Ok(true),
                            Some("full_attention") => Ok(false),
                            _ => Err(err(format!(
                                "`layer_types` entry {t} (sliding_attention or full_attention)"
                            ))),
                        })
                        .collect::<Result<_, _>>()?,
                    _ => {
                        let pattern = size("sliding_window_pattern", 6)?;
                        (0..c.layers).map(|i| (i + 1) % pattern != 0).collect()
                    }
                };
                if types.len() != c.layers {
                    return Err(err(format!(
                        "`layer_types` has {} entries for {} layers",
                        types.len(),
                        c.layers
                    )));
                }
                let (global, local) = match rope_parameters {
                    Some(rp) if rp.get("full_attention").is_some() => (
                        theta_of(&rp["full_attention"], "rope_parameters.full_attention")?,
                        match rp.get("sliding_attention") {
                            Some(l) => theta_of(l, "rope_parameters.sliding_attention")?,
                            None => old_theta("rope_local_base_freq", 10_000.0)?,
                        },
                    ),
                    Some(rp) => (
                        theta_of(rp, "rope_parameters")?,
                        old_theta("rope_local_base_freq", 10_000.0)?,
                    ),
                    None => (
                        old_theta("rope_theta", 1_000_000.0)?,
                        old_theta("rope_local_base_freq", 10_000.0)?,
                    ),
                };
                let window = if types.iter().any(|&t| t) {
                    let w = sliding_window()?;
                    Some(if bidirectional { w / 2 } else { w - 1 })
                } else {
                    None
                };
                let layers = types
                    .iter()
                    .map(|&local_layer| {
                        if local_layer {
                            (window, local)
                        } else {
                            (None, global)
                        }
                    })
                    .collect();
                let scalar = json
                    .get("query_pre_attn_scalar")
                    .filter(|v| !v.is_null())
                    .map_or(Ok(256.0), |v| number(v, "query_pre_attn_scalar"))?;
                // transformers: hidden_size**0.5 in Python, a float32 buffer.
                let embed_scale = (c.hidden as f64).sqrt() as f32;
                (
                    !bidirectional,
                    layers,
                    Some((scalar as f64).powf(-0.5) as f32),
                    embed_scale,
                    1.0,
                )
            }
            other => unreachable!("{other:?} is not a decoder"),
        };
        Ok(DecoderConfig {
            head_dim,
            kv_heads,
            causal,
            layers,
            attention_scale,
            embed_scale,
            norm_offset,
            attention_bias: flag("attention_bias")?,
        })
    }
}

/// The names of a checkpoint's tensors (`model.` in front or not).
struct Names {
    prefix: &'static str,
}

impl Names {
    fn of(header: &Header) -> Result<Names, ModelError> {
        for prefix in ["", "model."] {
            if header
                .get(&format!("{prefix}embed_tokens.weight"))
                .is_some()
            {
                return Ok(Names { prefix });
            }
        }
        Err(ModelError::file(
            &header.path,
            "missing tensor `embed_tokens.weight` (nor `model.embed_tokens.weight`): not a Qwen3 or Gemma 3 checkpoint",
        ))
    }

    fn top(&self, name: &str) -> String {
        format!("{}{name}.weight", self.prefix)
    }

    fn layer(&self, l: usize, part: &str, suffix: &str) -> String {
        format!("{}layers.{l}.{part}.{suffix}", self.prefix)
    }
}

/// Every tensor a layer needs, with its shape: (name, shape).
fn layer_tensors(
    names: &Names,
    c: &EncoderConfig,
    d: &DecoderConfig,
    l: usize,
) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (c.hidden, c.intermediate, d.head_dim);
    let (q, kv) = (c.heads * hd, d.kv_heads * hd);
    let w = |part: &str| names.layer(l, part, "weight");
    let mut v = vec![
        (w("input_layernorm"), vec![h]),
        (w("self_attn.q_proj"), vec![q, h]),
        (w("self_attn.k_proj"), vec![kv, h]),
        (w("self_attn.v_proj"), vec![kv, h]),
        (w("self_attn.o_proj"), vec![h, q]),
        (w("self_attn.q_norm"), vec![hd]),
        (w("self_attn.k_norm"), vec![hd]),
        (w("post_attention_layernorm"), vec![h]),
        (w("mlp.gate_proj"), vec![i, h]),
        (w("mlp.up_proj"), vec![i, h]),
        (w("mlp.down_proj"), vec![h, i]),
    ];
    if c.family == Family::Gemma3 {
        v.push((w("pre_feedforward_layernorm"), vec![h]));
        v.push((w("post_feedforward_layernorm"), vec![h]));
    }
    if d.attention_bias {
        let b = |part: &str| names.layer(l, part, "bias");
        v.push((b("self_attn.q_proj"), vec![q]));
        v.push((b("self_attn.k_proj"), vec![kv]));
        v.push((b("self_attn.v_proj"), vec![kv]));
        v.push((b("self_attn.o_proj"), vec![h]));
    }
    v
}

/// Checks every tensor's presence and shape (no weight data read).
pub(super) fn check_names(
    header: &Header,
    c: &EncoderConfig,
    d: &DecoderConfig,
) -> Result<(), ModelError> {
    let names = Names::of(header)?;
    let why = format!(
        " (config.json: hidden_size {}, num_attention_heads {}, num_key_value_heads {}, head_dim {}, intermediate_size {}, vocab_size {})",
        c.hidden, c.heads, d.kv_heads, d.head_dim, c.intermediate, c.vocab
    );
    header.expect_shape(&names.top("embed_tokens"), &[c.vocab, c.hidden], &why)?;
    header.expect_shape(&names.top("norm"), &[c.hidden], &why)?;
    for l in 0..c.layers {
        for (name, shape) in layer_tensors(&names, c, d, l) {
            header.expect_shape(&name, &shape, &why)?;
        }
    }
    Ok(())
}

/// A decoder's weights, loaded as stored: the word table, its layers and
/// the final norm.
pub(super) struct DecoderWeights {
    pub word: WeightId,
    pub layers: Vec<DecoderLayer>,
    pub final_norm: WeightId,
}

/// Loads the weights as stored (bf16 stays bf16), fusing q/k/v and
/// gate/up by joining their rows.
pub(super) fn load(
    file: &TensorFile,
    c: &EncoderConfig,
    d: &DecoderConfig,
    weights: &mut Weights,
) -> Result<DecoderWeights, ModelError> {
    check_names(&file.header, c, d)?;
    let names = Names::of(&file.header)?;
    let push = |weights: &mut Weights, name: String| -> Result<WeightId, ModelError> {
        let (shape, data) = file.stored(&name)?;
        Ok(weights.push_data(name, shape, data))
    };
    let joined = |weights: &mut Weights, parts: &[String], name: String| {
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        let (shape, data) = file.concat_rows(&refs)?;
        Ok::<_, ModelError>(weights.push_data(name, shape, data))
    };
    let word = push(weights, names.top("embed_tokens"))?;
    let mut layers = Vec::with_capacity(c.layers);
    for (l, &(window, rope_theta)) in d.layers.iter().enumerate() {
        let w = |part: &str| names.layer(l, part, "weight");
        let b = |part: &str| names.layer(l, part, "bias");
        let qkv = ["q_proj", "k_proj", "v_proj"].map(|p| format!("self_attn.{p}"));
        let qkv_weight = joined(
            weights,
            &qkv.clone().map(|p| w(&p)),
            names.layer(l, "self_attn.qkv_proj", "weight"),
        )?;
        let qkv_bias = match d.attention_bias {
            true => Some(joined(
                weights,
                &qkv.map(|p| b(&p)),
                names.layer(l, "self_attn.qkv_proj", "bias"),
            )?),
            false => None,
        };
        let gemma = c.family == Family::Gemma3;
        layers.push(DecoderLayer {
            input_norm: push(weights, w("input_layernorm"))?,
            qkv_weight,
            qkv_bias,
            q_norm: push(weights, w("self_attn.q_norm"))?,
            k_norm: push(weights, w("self_attn.k_norm"))?,
            output_weight: push(weights, w("self_attn.o_proj"))?,
            output_bias: match d.attention_bias {
                true => Some(push(weights, b("self_attn.o_proj"))?),
                false => None,
            },
            post_attention_norm: match gemma {
                true => Some(push(weights, w("post_attention_layernorm"))?),
                false => None,
            },
            mlp_norm: push(
                weights,
                w(if gemma {
                    "pre_feedforward_layernorm"
                } else {
                    "post_attention_layernorm"
                }),
            )?,
            gate_up_weight: joined(
                weights,
                &[w("mlp.gate_proj"), w("mlp.up_proj")],
                names.layer(l, "mlp.gate_up_proj", "weight"),
            )?,
            down_weight: push(weights, w("mlp.down_proj"))?,
            post_mlp_norm: match gemma {
                true => Some(push(weights, w("post_feedforward_layernorm"))?),
                false => None,
            },
            window,
            rope_theta,
        });
    }
    let final_norm = push(weights, names.top("norm"))?;
    Ok(DecoderWeights {
        word,
        layers,
        final_norm,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test folder's config.json with `edit` applied, read as the
    /// loader reads it.
    fn read(folder: &str, edit: impl FnOnce(&mut Value)) -> Result<DecoderConfig, String> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/models")
            .join(folder)
            .join("config.json");
        let mut json: Value = serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
        edit(&mut json);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let c = super::super::folder::parse_config(&path).map_err(|e| e.to_string())?;
        DecoderConfig::read(&c, &path).map_err(|e| e.to_string())
    }

    #[test]
    fn gemma_windows_bases_and_scales() {
        let d = read("gemma3-st", |_| {}).unwrap();
        // Saved sliding_window 10, bidirectional: |i − j| < 10 / 2 + 1.
        let local = (Some(5), 10_000.0);
        assert_eq!(d.layers, vec![local, local, local, (None, 1_000_000.0)]);
        assert_eq!((d.head_dim, d.kv_heads, d.causal), (24, 1, false));
        assert_eq!(d.attention_scale, Some(1.0 / 12f32.sqrt()));
        assert_eq!((d.embed_scale, d.norm_offset), (32f32.sqrt(), 1.0));
        // transformers 4's keys give the same layers.
        let old = read("gemma3-st", |j| {
            let o = j.as_object_mut().unwrap();
            o.remove("rope_parameters");
            o.insert("rope_theta".into(), 1_000_000.0.into());
            o.insert("rope_local_base_freq".into(), 10_000.0.into());
        })
        .unwrap();
        assert_eq!(old.layers, d.layers);
        // A causal Gemma sees i − 10 < j ≤ i.
        let causal = read("gemma3-st", |j| {
            j["use_bidirectional_attention"] = false.into()
        })
        .unwrap();
        assert!(causal.causal);
        assert_eq!(causal.layers[0], (Some(9), 10_000.0));
    }

    #[test]
    fn qwen3_is_causal_and_global() {
        let d = read("qwen3-st", |_| {}).unwrap();
        assert_eq!(d.layers, vec![(None, 1_000_000.0); 2]);
        assert_eq!((d.head_dim, d.kv_heads, d.causal), (16, 2, true));
        assert_eq!(
            (d.attention_scale, d.embed_scale, d.norm_offset),
            (None, 1.0, 0.0)
        );
    }

    /// A folder, an edit of its config.json, and a word the refusal names.
    type Refusal = (&'static str, fn(&mut Value), &'static str);

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let cases: [Refusal; 5] = [
            (
                "qwen3-st",
                |j| j["use_sliding_window"] = true.into(),
                "use_sliding_window",
            ),
            (
                "qwen3-st",
                |j| j["rope_parameters"]["rope_type"] = "yarn".into(),
                "\"yarn\"",
            ),
            (
                "qwen3-st",
                |j| j["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0}),
                "\"linear\"",
            ),
            (
                "qwen3-st",
                |j| j["num_key_value_heads"] = 3.into(),
                "num_key_value_heads 3",
            ),
            (
                "gemma3-st",
                |j| j["attn_logit_softcapping"] = 50.0.into(),
                "soft-capping",
            ),
        ];
        for (folder, edit, needle) in cases {
            let e = read(folder, edit).unwrap_err();
            assert!(e.contains(needle), "{needle}: {e}");
        }
    }
}
