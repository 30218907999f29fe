//! BERT-family encoders from a Hugging Face folder.
//! (Owned by the model/CPU-backend work; signatures fixed.)

use super::{ModelError, ModelInfo, Program};
use crate::config::ModelConfig;

/// A loaded BERT encoder, with weight ids.
#[derive(Clone, Debug)]
pub struct BertArch {}

impl BertArch {
    pub fn program(&self, _batch: usize, _seq: usize) -> Program {
        todo!()
    }
}

pub fn load(_config: &ModelConfig) -> Result<super::Model, ModelError> {
    todo!()
}

pub fn inspect(_config: &ModelConfig) -> Result<ModelInfo, ModelError> {
    todo!()
}
