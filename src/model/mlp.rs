//! The MLP: `Linear → activation → Linear → …` from a PyTorch `state_dict`.
//! (Owned by the model/CPU-backend work; signatures fixed.)

use super::{ModelError, ModelInfo, Program};
use crate::config::ModelConfig;

/// Layers of a loaded MLP, with weight ids.
#[derive(Clone, Debug)]
pub struct MlpArch {}

impl MlpArch {
    pub fn program(&self, _batch: usize) -> Program {
        todo!()
    }
}

pub fn load(_config: &ModelConfig) -> Result<super::Model, ModelError> {
    todo!()
}

pub fn inspect(_config: &ModelConfig) -> Result<ModelInfo, ModelError> {
    todo!()
}
