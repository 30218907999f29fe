//! The hyper-parameters an encoder folder's `config.json` gives, as
//! `folder.rs` reads them ([`EncoderConfig`]); the families' own readers
//! (`modernbert.rs`) take them from here.

use super::Family;
use crate::model::program::{Activation, PositionIds};
use serde_json::Value;

/// The hyper-parameters from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct EncoderConfig {
    pub(super) family: Family,
    pub(super) hidden: usize,
    pub(super) heads: usize,
    pub(super) layers: usize,
    pub(super) intermediate: usize,
    pub(super) act: Activation,
    pub(super) eps: f32,
    pub(super) max_position: usize,
    /// Rows of the token-type table (0: none, MPNet).
    pub(super) type_vocab: usize,
    pub(super) vocab: usize,
    /// XLM-R / MPNet: the padding index positions count from.
    pub(super) pad: Option<u32>,
    /// `architectures[0]`, if any.
    pub(super) architecture: Option<String>,
    /// A `*ForSequenceClassification` architecture, and its label count.
    pub(super) labels: Option<usize>,
    pub(super) json: Value,
}

impl EncoderConfig {
    pub(super) fn position_ids(&self) -> PositionIds {
        match self.pad {
            None => PositionIds::Index,
            Some(pad) => PositionIds::AfterPadding { pad },
        }
    }

    /// A `*ForMaskedLM` architecture (the masked-LM head SPLADE pools).
    pub(super) fn is_masked_lm(&self) -> bool {
        self.architecture
            .as_deref()
            .is_some_and(|a| a.ends_with("ForMaskedLM"))
    }

    /// The longest sequence the position table holds.
    pub(super) fn positions(&self) -> usize {
        match self.pad {
            None => self.max_position,
            Some(pad) => self.max_position.saturating_sub(pad as usize + 1),
        }
    }
}
