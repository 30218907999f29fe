//! ModernBERT (`model_type` `modernbert`): a pre-norm encoder with rotary
//! positions, alternating global and sliding-window attention and a GeGLU
//! feed-forward, as transformers' `ModernBertModel` computes it:
//!
//! ```text
//! h = LayerNorm(tok_embeddings[ids])                       (embeddings.norm)
//! per layer l:
//!   a   = l == 0 ? h : LayerNorm(h)                        (attn_norm; none in layer 0)
//!   qkv = Wqkv · a, rotary on q and k (θ of the layer's kind)
//!   h  += Wo · Attention(qkv)        (global, or keys within ±local_attention/2)
//!   g   = Wi · LayerNorm(h)                                (mlp_norm; [input | gate])
//!   h  += Wo' · (act(input) · gate)
//! h = LayerNorm(h)                                         (final_norm)
//! ```
//!
//! then the sentence-transformers head shared with the other families
//! ([`Head`]). Norms and linear layers have biases only where the config
//! says so (`norm_bias`, `attention_bias`, `mlp_bias`; all false in the
//! released models).

use super::config::EncoderConfig;
use super::rotary::{Norm, RotaryLayer};
use crate::model::program::WeightId;
use crate::model::safetensors_file::{Header, TensorFile};
use crate::model::{ModelError, Weights};

/// ModernBERT's settings beyond the sizes `folder.rs` reads, from
/// config.json (both layouts: `global_attn_every_n_layers` with
/// `global_rope_theta` / `local_rope_theta`, or `layer_types` with
/// `rope_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct ModernBertConfig {
    pub norm_bias: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Keys a local layer's query sees on each side (`local_attention / 2`).
    pub window: usize,
    /// Per layer: global attention (else sliding-window).
    pub global: Vec<bool>,
    pub global_theta: f32,
    pub local_theta: f32,
}

impl ModernBertConfig {
    pub(super) fn read(
        json: &serde_json::Value,
        layers: usize,
        path: &std::path::Path,
    ) -> Result<ModernBertConfig, ModelError> {
        use serde_json::Value;
        let err = |m: String| ModelError::file(path, m);
        let flag = |key: &str| -> Result<bool, ModelError> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(err(format!("`{key}` is {v}, expected true or false"))),
            }
        };
        let number = |v: &Value, key: &str| -> Result<f64, ModelError> {
            v.as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| err(format!("`{key}` is {v}, expected a positive number")))
        };
        let local =
            match json.get("local_attention") {
                None | Some(Value::Null) => 128,
                Some(v) => v.as_u64().filter(|&n| n >= 2).ok_or_else(|| {
                    err(format!("`local_attention` is {v}, expected an integer ≥ 2"))
                })? as usize,
            };
        let global = match json.get("layer_types") {
            Some(Value::Array(kinds)) => {
                if kinds.len() != layers {
                    return Err(err(format!(
                        "`layer_types` has {} entries for {layers} layers",
                        kinds.len()
                    )));
                }
                kinds
                    .iter()
                    .map(|k| match k.as_str() {
                        Some("full_attention") => Ok(true),
                        Some("sliding_attention") => Ok(false),
                        _ => Err(err(format!(
                            "unsupported layer type {k} (\"full_attention\" or \"sliding_attention\")"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None | Some(Value::Null) => {
                let every = match json.get("global_attn_every_n_layers") {
                    None | Some(Value::Null) => 3,
                    Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                        err(format!(
                            "`global_attn_every_n_layers` is {v}, expected a positive integer"
                        ))
                    })? as usize,
                };
                (0..layers).map(|l| l % every == 0).collect()
            }
            Some(v) => return Err(err(format!("`layer_types` is {v}, expected a list"))),
        };
        // The newer rope_parameters per layer kind, else the older keys.
        let theta = |kind: &str, old: &str, default: f64| -> Result<f32, ModelError> {
            if let Some(p) = json.get("rope_parameters").filter(|v| !v.is_null()) {
                let p = p.get(kind).filter(|v| !v.is_null());
                if let Some(p) = p {
                    match p.get("rope_type").and_then(Value::as_str) {
                        None | Some("default") => {}
                        Some(other) => {
                            return Err(err(format!(
                            "unsupported rope_type {other:?} for {kind} layers (only \"default\")"
                        )))
                        }
                    }
                    if let Some(t) = p.get("rope_theta").filter(|v| !v.is_null()) {
                        return Ok(number(t, &format!("rope_parameters.{kind}.rope_theta"))? as f32);
                    }
                }
            }
            if let Some(s) = json.get("rope_scaling").filter(|v| !v.is_null()) {
                return Err(err(format!("unsupported rope_scaling {s}")));
            }
            match json.get(old).filter(|v| !v.is_null()) {
                Some(t) => Ok(number(t, old)? as f32),
                None => Ok(default as f32),
            }
        };
        Ok(ModernBertConfig {
            norm_bias: flag("norm_bias")?,
            attention_bias: flag("attention_bias")?,
            mlp_bias: flag("mlp_bias")?,
            window: local / 2,
            global,
            global_theta: theta("full_attention", "global_rope_theta", 160_000.0)?,
            local_theta: theta("sliding_attention", "local_rope_theta", 10_000.0)?,
        })
    }
}

/// The tensor names of a ModernBERT checkpoint, checked for shape
/// (`model.` in front for a `ModernBertForMaskedLM` checkpoint).
pub(super) struct ModernBertNames {
    prefix: &'static str,
}

impl ModernBertNames {
    pub(super) fn check(
        header: &Header,
        c: &EncoderConfig,
        m: &ModernBertConfig,
    ) -> Result<ModernBertNames, ModelError> {
        let prefix = if header.get("embeddings.tok_embeddings.weight").is_some() {
            ""
        } else if header
            .get("model.embeddings.tok_embeddings.weight")
            .is_some()
        {
            "model."
        } else {
            return Err(ModelError::file(
                &header.path,
                "missing tensor `embeddings.tok_embeddings.weight` (nor `model.embeddings.tok_embeddings.weight`): not a modernbert checkpoint",
            ));
        };
        let names = ModernBertNames { prefix };
        let (h, i) = (c.hidden, c.intermediate);
        let why = format!(" (config.json: hidden_size {h}, intermediate_size {i})");
        header.expect_shape(
            &names.name("embeddings.tok_embeddings.weight"),
            &[c.vocab, h],
            &why,
        )?;
        let norm = |base: &str, bias: bool| -> Result<(), ModelError> {
            header.expect_shape(&names.name(&format!("{base}.weight")), &[h], &why)?;
            if bias {
                header.expect_shape(&names.name(&format!("{base}.bias")), &[h], &why)?;
            }
            Ok(())
        };
        let linear = |base: &str, out: usize, inp: usize, bias: bool| -> Result<(), ModelError> {
            header.expect_shape(&names.name(&format!("{base}.weight")), &[out, inp], &why)?;
            if bias {
                header.expect_shape(&names.name(&format!("{base}.bias")), &[out], &why)?;
            }
            Ok(())
        };
        norm("embeddings.norm", m.norm_bias)?;
        for l in 0..c.layers {
            if l > 0 {
                norm(&format!("layers.{l}.attn_norm"), m.norm_bias)?;
            }
            linear(&format!("layers.{l}.attn.Wqkv"), 3 * h, h, m.attention_bias)?;
            linear(&format!("layers.{l}.attn.Wo"), h, h, m.attention_bias)?;
            norm(&format!("layers.{l}.mlp_norm"), m.norm_bias)?;
            linear(&format!("layers.{l}.mlp.Wi"), 2 * i, h, m.mlp_bias)?;
            linear(&format!("layers.{l}.mlp.Wo"), h, i, m.mlp_bias)?;
        }
        norm("final_norm", m.norm_bias)?;
        let beyond = format!("{prefix}layers.");
        for name in header.tensors.keys() {
            let index = name
                .strip_prefix(&beyond)
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
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
        Ok(names)
    }

    fn name(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    /// Reads the encoder's weights into `weights` (as stored); the head's
    /// come after.
    pub(super) fn load(
        &self,
        file: &TensorFile,
        c: &EncoderConfig,
        m: &ModernBertConfig,
        weights: &mut Weights,
    ) -> Result<EncoderWeights, ModelError> {
        let mut push = |rest: String| -> Result<WeightId, ModelError> {
            let name = self.name(&rest);
            let (shape, data) = file.stored(&name)?;
            Ok(weights.push_data(name, shape, data))
        };
        let word = push("embeddings.tok_embeddings.weight".into())?;
        // A layer's weight, and its bias where the config has one.
        let mut pair =
            |base: String, bias: bool| -> Result<(WeightId, Option<WeightId>), ModelError> {
                let w = push(format!("{base}.weight"))?;
                let b = if bias {
                    Some(push(format!("{base}.bias"))?)
                } else {
                    None
                };
                Ok((w, b))
            };
        let norm = |(weight, bias)| Norm { weight, bias };
        let embedding_norm = norm(pair("embeddings.norm".into(), m.norm_bias)?);
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let attention_norm = if l > 0 {
                Some(norm(pair(format!("layers.{l}.attn_norm"), m.norm_bias)?))
            } else {
                None
            };
            let (qkv_weight, qkv_bias) = pair(format!("layers.{l}.attn.Wqkv"), m.attention_bias)?;
            let (attention_output_weight, attention_output_bias) =
                pair(format!("layers.{l}.attn.Wo"), m.attention_bias)?;
            let mlp_norm = norm(pair(format!("layers.{l}.mlp_norm"), m.norm_bias)?);
            let (input_weight, input_bias) = pair(format!("layers.{l}.mlp.Wi"), m.mlp_bias)?;
            let (output_weight, output_bias) = pair(format!("layers.{l}.mlp.Wo"), m.mlp_bias)?;
            let global = m.global[l];
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
                window: (!global).then_some(m.window),
                rope_theta: if global {
                    m.global_theta
                } else {
                    m.local_theta
                },
            });
        }
        let final_norm = norm(pair("final_norm".into(), m.norm_bias)?);
        Ok(EncoderWeights {
            word,
            embedding_norm,
            layers,
            final_norm,
        })
    }
}

/// The encoder's weight ids, before the head is known.
pub(super) struct EncoderWeights {
    pub word: WeightId,
    pub embedding_norm: Norm,
    pub layers: Vec<RotaryLayer>,
    pub final_norm: Norm,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn read(j: serde_json::Value, layers: usize) -> Result<ModernBertConfig, String> {
        ModernBertConfig::read(&j, layers, Path::new("config.json")).map_err(|e| e.to_string())
    }

    #[test]
    fn both_config_layouts_read_alike() {
        // The released checkpoints' keys (transformers 4).
        let old = read(
            json!({"global_attn_every_n_layers": 3, "global_rope_theta": 160000.0,
                   "local_rope_theta": 10000.0, "local_attention": 128}),
            6,
        )
        .unwrap();
        assert_eq!(old.global, [true, false, false, true, false, false]);
        assert_eq!(
            (old.window, old.global_theta, old.local_theta),
            (64, 160000.0, 10000.0)
        );
        // transformers 5's.
        let new = read(
            json!({"layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                   "full_attention", "sliding_attention", "sliding_attention"],
                   "rope_parameters": {
                       "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   "local_attention": 128}),
            6,
        )
        .unwrap();
        assert_eq!(old, new);
        // Nothing said: transformers' defaults.
        let bare = read(json!({}), 4).unwrap();
        assert_eq!(bare.global, [true, false, false, true]);
        assert_eq!(
            (bare.window, bare.global_theta, bare.local_theta),
            (64, 160000.0, 10000.0)
        );
        assert!(!bare.norm_bias && !bare.attention_bias && !bare.mlp_bias);
    }

    #[test]
    fn what_it_cannot_compute_is_refused_by_name() {
        for (j, needle) in [
            (
                json!({"layer_types": ["full_attention"]}),
                "1 entries for 2 layers",
            ),
            (
                json!({"layer_types": ["full_attention", "chunked"]}),
                "unsupported layer type",
            ),
            (
                json!({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}),
                "unsupported rope_type \"yarn\"",
            ),
            (
                json!({"rope_scaling": {"type": "linear"}}),
                "unsupported rope_scaling",
            ),
            (json!({"local_attention": 1}), "local_attention"),
            (json!({"norm_bias": "yes"}), "norm_bias"),
        ] {
            let e = read(j.clone(), 2).unwrap_err();
            assert!(e.contains(needle), "{j}: {e}");
        }
    }
}
