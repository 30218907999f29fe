//! PLACEHOLDER until the model/CPU-backend branch lands (signature only).
use std::path::Path;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("text {index} has {tokens} tokens, more than the maximum of {max}")]
    TooLong {
        index: usize,
        tokens: usize,
        max: usize,
    },
    #[error("{0}")]
    Failed(String),
}

pub struct TextTokenizer;
impl TextTokenizer {
    pub fn load(_path: &Path, _max_seq_len: usize) -> Result<Self, TokenizeError> {
        unimplemented!()
    }
    pub fn encode(&self, _texts: &[&str], _truncate: bool) -> Result<Vec<Vec<u32>>, TokenizeError> {
        unimplemented!()
    }
    pub fn vocab_size(&self) -> usize {
        0
    }
}
pub struct TokenizerPool;
impl TokenizerPool {
    pub fn new(_t: Arc<TextTokenizer>, _threads: usize) -> Self {
        TokenizerPool
    }
    pub async fn encode(
        &self,
        _texts: Vec<String>,
        _truncate: bool,
    ) -> Result<Vec<Vec<u32>>, TokenizeError> {
        unimplemented!()
    }
}
