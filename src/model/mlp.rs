//! The MLP: `Linear → activation → Linear → …` from a PyTorch `state_dict`.
//!
//! Source ([`ModelSpec::path`]): a `.safetensors` file (or a sharded
//! checkpoint's `.index.json`), or a folder holding `model.safetensors` (or
//! a sharded `model.safetensors.index.json` and its shards) and an optional
//! `config.json` (`{"model_type": "mlp", "activation": "relu"}`).
//! [`ModelSpec::activation`] overrides the folder's activation; the default
//! is ReLU.
//!
//! The layers are the `nn.Sequential` keys `N.weight` (`[out, in]`) and
//! `N.bias` (`[out]`, optional), ordered by `N` (activation modules have no
//! parameters, so `N` has gaps: `0`, `2`, …). A common prefix such as `net.`
//! (a `Sequential` inside a module) is accepted. The activation follows every
//! layer but the last. Weights are kept as stored (memory-mapped).

use super::files::read_json;
use super::program::{Activation, InputRole, Linear, ProgramBuilder, WeightId};
use super::safetensors_file::{checkpoint_in, read_header, Header, TensorFile};
use super::{
    Architecture, InputSpec, Model, ModelError, ModelInfo, ModelKind, ModelSpec, Program, Weights,
};
use std::path::PathBuf;

/// One `nn.Linear` of the MLP.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpLayer {
    /// The state_dict key prefix of this layer, e.g. `"0"` or `"net.2"`.
    pub name: String,
    /// `[out_features, in_features]`.
    pub weight: WeightId,
    /// `[out_features]`, if the layer has one.
    pub bias: Option<WeightId>,
    pub in_features: usize,
    pub out_features: usize,
    /// Applied after this layer (identity for the last layer).
    pub activation: Activation,
}

/// Layers of a loaded MLP, with weight ids.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpArch {
    pub layers: Vec<MlpLayer>,
    /// The activation between layers.
    pub activation: Activation,
}

impl MlpArch {
    pub fn in_features(&self) -> usize {
        self.layers[0].in_features
    }

    pub fn out_features(&self) -> usize {
        self.layers[self.layers.len() - 1].out_features
    }

    /// `features` `[batch, in]` f32 → Linear … → `output` `[batch, out]` f32.
    /// Hidden layers ping-pong between two activation buffers, sized for the
    /// widest hidden layer.
    pub fn program(&self, batch: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let input = b.input("features", InputRole::Features, batch * self.in_features());
        let n = self.layers.len();
        let width = self.layers[..n - 1]
            .iter()
            .map(|l| l.out_features)
            .max()
            .unwrap_or(0);
        let ping: Vec<_> = (0..(n - 1).min(2))
            .map(|i| b.activation(&format!("hidden.{i}"), batch * width))
            .collect();
        let output = b.output("output", batch * self.out_features());
        let mut x = input;
        for (i, layer) in self.layers.iter().enumerate() {
            let out = if i + 1 == n { output } else { ping[i % 2] };
            b.push(Linear {
                x,
                w: layer.weight,
                bias: layer.bias,
                act: layer.activation,
                out,
                m: batch,
                n: layer.out_features,
                k: layer.in_features,
            });
            x = out;
        }
        b.finish(batch, 1, output, self.out_features())
    }
}

/// Where the MLP's files are.
struct Source {
    weights: PathBuf,
    config: Option<PathBuf>,
}

fn source(config: &ModelSpec) -> Result<Source, ModelError> {
    let path = &config.path;
    if path.is_dir() {
        let weights = checkpoint_in(path)?;
        let config_json = path.join("config.json");
        Ok(Source {
            weights,
            config: config_json.is_file().then_some(config_json),
        })
    } else if path.exists() {
        Ok(Source {
            weights: path.clone(),
            config: None,
        })
    } else {
        Err(ModelError::file(
            path,
            "missing file (expected a .safetensors file or a folder with model.safetensors)",
        ))
    }
}

/// The activation: the model config's override, else the folder's config.json, else ReLU.
fn activation(config: &ModelSpec, source: &Source) -> Result<Activation, ModelError> {
    let from_file = match &source.config {
        Some(path) => {
            let json = read_json(path)?;
            if let Some(kind) = json.get("model_type") {
                if kind.as_str() != Some("mlp") {
                    return Err(ModelError::file(
                        path,
                        format!("unknown architecture: model_type {kind} (expected \"mlp\")"),
                    ));
                }
            }
            match json.get("activation") {
                None => None,
                Some(value) => Some(
                    value
                        .as_str()
                        .and_then(Activation::parse)
                        .ok_or_else(|| {
                            ModelError::file(
                                path,
                                format!("unknown activation {value} (relu, gelu, gelu_tanh, tanh, sigmoid, silu, identity)"),
                            )
                        })?,
                ),
            }
        }
        None => None,
    };
    match &config.activation {
        Some(name) => Activation::parse(name).ok_or_else(|| ModelError::Invalid {
            model: config.name.clone(),
            message: format!("unknown activation {name:?}"),
        }),
        None => Ok(from_file.unwrap_or(Activation::Relu)),
    }
}

/// A layer as found in the header: key prefix and tensor names.
struct LayerKeys {
    name: String,
    weight: String,
    bias: Option<String>,
    in_features: usize,
    out_features: usize,
}

/// Finds the `N.weight`/`N.bias` layers, orders them by `N` and checks shapes
/// and chaining.
fn layers(header: &Header) -> Result<Vec<LayerKeys>, ModelError> {
    let err = |m: String| ModelError::file(&header.path, m);
    // (index, is_weight) per key, grouped by prefix.
    let mut prefix: Option<String> = None;
    let mut found: std::collections::BTreeMap<u64, (Option<String>, Option<String>)> =
        Default::default();
    for name in header.tensors.keys() {
        let parsed = name.rsplit_once('.').and_then(|(head, param)| {
            let (pre, index) = match head.rsplit_once('.') {
                Some((pre, index)) => (format!("{pre}."), index),
                None => (String::new(), head),
            };
            let index: u64 = index.parse().ok()?;
            matches!(param, "weight" | "bias").then_some((pre, index, param == "weight"))
        });
        let Some((pre, index, is_weight)) = parsed else {
            return Err(err(format!(
                "unexpected tensor `{name}`: an MLP state_dict holds nn.Sequential keys `N.weight` and `N.bias`"
            )));
        };
        match &prefix {
            None => prefix = Some(pre),
            Some(p) if *p != pre => {
                return Err(err(format!(
                    "unexpected tensor `{name}`: other keys start with `{p}`"
                )))
            }
            Some(_) => {}
        }
        let slot = found.entry(index).or_default();
        if is_weight {
            slot.0 = Some(name.clone());
        } else {
            slot.1 = Some(name.clone());
        }
    }
    if found.is_empty() {
        return Err(err(
            "no tensors: an MLP needs at least one `N.weight`".into()
        ));
    }
    let mut out: Vec<LayerKeys> = Vec::new();
    for (index, (weight, bias)) in found {
        let layer_name = format!("{}{index}", prefix.as_deref().unwrap_or(""));
        let Some(weight) = weight else {
            return Err(err(format!(
                "missing tensor `{layer_name}.weight` (found `{layer_name}.bias`)"
            )));
        };
        let w = header.float_tensor(&weight)?;
        if w.shape.len() != 2 || w.shape[0] == 0 || w.shape[1] == 0 {
            return Err(err(format!(
                "shape mismatch: tensor `{weight}` has shape {:?}, expected [out_features, in_features]",
                w.shape
            )));
        }
        let (out_features, in_features) = (w.shape[0], w.shape[1]);
        if let Some(bias) = &bias {
            header.expect_shape(
                bias,
                &[out_features],
                &format!(" (out_features of `{weight}`)"),
            )?;
        }
        if let Some(prev) = out.last() {
            if prev.out_features != in_features {
                return Err(err(format!(
                    "shape mismatch: tensor `{weight}` has {in_features} input features but the previous layer `{}` has {} outputs",
                    prev.weight, prev.out_features
                )));
            }
        }
        out.push(LayerKeys {
            name: layer_name,
            weight,
            bias,
            in_features,
            out_features,
        });
    }
    Ok(out)
}

fn info(config: &ModelSpec, layers: &[LayerKeys]) -> ModelInfo {
    ModelInfo {
        normalized: false,
        truncate_dim: None,
        matryoshka: Default::default(),
        name: config.name.clone(),
        kind: ModelKind::Mlp,
        input: InputSpec::Features {
            features: layers[0].in_features,
        },
        output_dim: layers[layers.len() - 1].out_features,
        dtype: config.dtype,
        tokenizer_path: None,
        task: Default::default(),
        tokenizer: None,
        prompts: Default::default(),
        derived: Vec::new(),
    }
}

/// Loads the MLP's weights (as stored).
pub fn load(config: &ModelSpec) -> Result<Model, ModelError> {
    let source = source(config)?;
    let activation = activation(config, &source)?;
    let file = TensorFile::open(&source.weights)?;
    let keys = layers(&file.header)?;
    let mut weights = Weights::new();
    let mut arch_layers = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        let (shape, data) = file.stored(&key.weight)?;
        let weight = weights.push_data(key.weight.clone(), shape, data);
        let bias = match &key.bias {
            Some(name) => {
                let (shape, data) = file.stored(name)?;
                Some(weights.push_data(name.clone(), shape, data))
            }
            None => None,
        };
        arch_layers.push(MlpLayer {
            name: key.name.clone(),
            weight,
            bias,
            in_features: key.in_features,
            out_features: key.out_features,
            activation: if i + 1 == keys.len() {
                Activation::Identity
            } else {
                activation
            },
        });
    }
    Ok(Model {
        info: info(config, &keys),
        arch: Architecture::Mlp(MlpArch {
            layers: arch_layers,
            activation,
        }),
        weights,
    })
}

/// Reads the config and the safetensors header only, and checks the layers.
pub fn inspect(config: &ModelSpec) -> Result<ModelInfo, ModelError> {
    let source = source(config)?;
    activation(config, &source)?;
    let header = read_header(&source.weights)?;
    let keys = layers(&header)?;
    Ok(info(config, &keys))
}
