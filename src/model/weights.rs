//! A model's weights in host memory, as f32, indexed by [`WeightId`].
//!
//! Loaders read safetensors (f32, f16 or bf16 on disk) and convert to f32;
//! backends convert again to the configured compute dtype when they upload.

use super::program::WeightId;

#[derive(Clone, Debug, PartialEq)]
pub struct WeightTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The weight table a model's programs refer to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Weights {
    tensors: Vec<WeightTensor>,
}

impl Weights {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tensor and returns its id.
    pub fn push(&mut self, name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> WeightId {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        self.tensors.push(WeightTensor {
            name: name.into(),
            shape,
            data,
        });
        WeightId(self.tensors.len() - 1)
    }

    pub fn get(&self, id: WeightId) -> &WeightTensor {
        &self.tensors[id.0]
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (WeightId, &WeightTensor)> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (WeightId(i), t))
    }

    /// Total number of parameters.
    pub fn parameter_count(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }
}
