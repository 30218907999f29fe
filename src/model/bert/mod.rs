//! BERT-family encoders (BERT, XLM-RoBERTa, MPNet, DistilBERT; ModernBERT
//! in `modernbert.rs`, a pre-norm design of its own): the architecture
//! (weight ids and hyper-parameters) and the forward pass as a [`Program`].
//!
//! * This module: [`BertArch`] and [`BertArch::program`], the encoder at one
//!   (batch, seq) shape, and [`BertArch::packed_program`], the encoder over
//!   a packed token budget (see [`crate::model::program`] for the layout),
//!   each with its head: sentence-transformers pooling, `Dense` and
//!   `Normalize` modules (an embedding), or a sequence-classification head
//!   (a cross-encoder's scores).
//! * `folder.rs`: reading a Hugging Face / sentence-transformers folder
//!   ([`inspect`] without weight data, [`load`] with it).
//!
//! The four families differ only in what the program's ops are told: the
//! position ids ([`PositionIds`]: BERT and DistilBERT count from 0, XLM-R
//! and MPNet from the padding index + 1), MPNet's relative attention bias
//! ([`PositionBias`], shared by every layer) and the missing token types of
//! MPNet and DistilBERT (a zero table of one row stands in). Their tensor
//! and config names differ too; `folder.rs` maps them onto one layout.

mod config;
mod decoder;
mod decoder_config;
mod folder;
mod gte;
mod modernbert;
mod rotary;

pub use decoder::{DecoderArch, DecoderLayer};
pub use folder::{inspect, load, mpnet_bucket, prefers_bf16, MPNET_BIAS_RADIUS};
pub use rotary::{Norm, NormPlacement, RotaryEncoderArch, RotaryLayer};

use super::program::{
    Activation, AddLayerNorm, Attention, BufId, EmbedLayerNorm, InputRole, LayerNorm, Linear,
    Normalize, Pool, Pooling, PositionBias, PositionIds, ProgramBuilder, Seqs, WeightId,
};
use super::Program;
use serde::{Deserialize, Serialize};

/// The encoder families replayd serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// `model_type` `bert`.
    Bert,
    /// `model_type` `xlm-roberta`.
    XlmRoberta,
    /// `model_type` `mpnet`.
    Mpnet,
    /// `model_type` `distilbert`: BERT's block under other names, no token
    /// types.
    DistilBert,
    /// `model_type` `modernbert`: pre-norm, rotary, GeGLU, local and
    /// global attention ([`RotaryEncoderArch`]).
    ModernBert,
    /// `model_type` `new` (GTE's remote code) or `gte` (transformers 5):
    /// post-norm, rotary, gated GELU ([`RotaryEncoderArch`]).
    Gte,
    /// `model_type` `nomic_bert`: post-norm, rotary, SwiGLU, no linear biases.
    NomicBert,
    /// `model_type` `qwen3` (Qwen3-Embedding): a causal decoder with
    /// grouped-query attention, RMSNorm, SwiGLU ([`DecoderArch`]).
    Qwen3,
    /// `model_type` `gemma3_text` with bidirectional attention
    /// (EmbeddingGemma): RMSNorm around every sublayer, GeGLU, local and
    /// global layers ([`DecoderArch`]).
    Gemma3,
}

impl Family {
    /// The `model_type` of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Bert => "bert",
            Family::XlmRoberta => "xlm-roberta",
            Family::Mpnet => "mpnet",
            Family::DistilBert => "distilbert",
            Family::ModernBert => "modernbert",
            Family::Gte => "gte",
            Family::NomicBert => "nomic_bert",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// The decoder families ([`DecoderArch`]).
    pub fn is_decoder(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Gemma3)
    }
}

/// A sentence-transformers `Dense` module after pooling.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseLayer {
    /// `[outputs, inputs]`
    pub weight: WeightId,
    pub bias: Option<WeightId>,
    pub act: Activation,
    pub inputs: usize,
    pub outputs: usize,
    /// A `Normalize` module follows.
    pub normalize: bool,
}

/// A sequence-classification head on the first token:
/// `weight · tanh(pooler · h[0] + pooler_bias) + bias`, then `activation`
/// (BERT: `pooler.dense` and `classifier`; XLM-R: `classifier.dense` and
/// `classifier.out_proj`).
#[derive(Clone, Debug, PartialEq)]
pub struct Classifier {
    pub pooler_weight: WeightId,
    pub pooler_bias: WeightId,
    /// `[labels, hidden]`
    pub weight: WeightId,
    pub bias: WeightId,
    pub labels: usize,
    /// The cross-encoder's activation (Sigmoid, Identity, …).
    pub activation: Activation,
}

/// Weight ids of the embedding block.
/// A sparse encoder's head: the masked-LM head (transform, LayerNorm,
/// decoder to the vocabulary) and SPLADE's pooling of its logits
/// (`splade_act` on each logit, then `pooling` over the tokens).
#[derive(Clone, Debug, PartialEq)]
pub struct MlmHead {
    pub transform_weight: WeightId,
    pub transform_bias: WeightId,
    pub act: Activation,
    pub norm_gamma: WeightId,
    pub norm_beta: WeightId,
    pub eps: f32,
    /// `[vocab, hidden]`; the word embeddings when tied.
    pub decoder_weight: WeightId,
    pub decoder_bias: WeightId,
    pub vocab: usize,
    pub splade_act: Activation,
    /// `Max` or `Sum`.
    pub pooling: Pooling,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BertEmbeddings {
    /// `[vocab_size, hidden]`
    pub word: WeightId,
    /// `[max_position_embeddings, hidden]`
    pub position: WeightId,
    /// `[type_vocab_size, hidden]`
    pub token_type: WeightId,
    pub norm_gamma: WeightId,
    pub norm_beta: WeightId,
}

/// Weight ids of one encoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct BertLayer {
    /// Query, key and value weights stacked: `[3·hidden, hidden]`.
    pub qkv_weight: WeightId,
    /// `[3·hidden]`
    pub qkv_bias: WeightId,
    /// `attention.output.dense`: `[hidden, hidden]`, `[hidden]`.
    pub attention_output_weight: WeightId,
    pub attention_output_bias: WeightId,
    /// `attention.output.LayerNorm`.
    pub attention_norm_gamma: WeightId,
    pub attention_norm_beta: WeightId,
    /// `intermediate.dense`: `[intermediate, hidden]`, `[intermediate]`.
    pub intermediate_weight: WeightId,
    pub intermediate_bias: WeightId,
    /// `output.dense`: `[hidden, intermediate]`, `[hidden]`.
    pub output_weight: WeightId,
    pub output_bias: WeightId,
    /// `output.LayerNorm`.
    pub output_norm_gamma: WeightId,
    pub output_norm_beta: WeightId,
}

/// A loaded BERT encoder, with weight ids.
#[derive(Clone, Debug, PartialEq)]
pub struct BertArch {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f32,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    /// Longest input in tokens, special tokens included.
    pub max_seq_len: usize,
    pub pooling: Pooling,
    /// L2-normalise the pooled vector (a `Normalize` module right after
    /// pooling; one after a `Dense` is that layer's `normalize`).
    pub normalize: bool,
    pub embeddings: BertEmbeddings,
    pub layers: Vec<BertLayer>,
    pub family: Family,
    /// How position ids are derived (from the padding index for XLM-R and MPNet).
    pub position_ids: PositionIds,
    /// MPNet's relative attention bias, the same in every layer.
    pub position_bias: Option<PositionBias>,
    /// Pooling skips each sequence's leading unpooled tokens (a prompt with
    /// `include_prompt = false`): the programs take a `pool_skip` input.
    pub pool_skip: bool,
    /// `Dense` modules after pooling, in order.
    pub dense: Vec<DenseLayer>,
    /// A cross-encoder's head (then `pooling`, `normalize` and `dense` do
    /// not apply).
    pub classifier: Option<Classifier>,
    /// A sparse encoder's head (then `pooling`, `normalize`, `dense` and
    /// `classifier` do not apply).
    pub mlm: Option<MlmHead>,
}

/// The sizes of a synthetic BERT encoder, for tests that need one without
/// a folder ([`BertArch::synthetic`]).
#[cfg(test)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct SyntheticSizes {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub positions: usize,
    pub max_seq_len: usize,
    pub pooling: Pooling,
    pub normalize: bool,
}

#[cfg(test)]
impl BertArch {
    /// A plain BERT encoder (exact GELU, learned positions, no head) of
    /// `sizes`, its weights made by `weight(name, shape)` in the order a
    /// folder's loader pushes them: the embeddings' word, position and
    /// token-type tables and norm, then each layer's.
    pub(crate) fn synthetic(
        sizes: SyntheticSizes,
        mut weight: impl FnMut(&str, Vec<usize>) -> WeightId,
    ) -> BertArch {
        let (h, inter) = (sizes.hidden, sizes.intermediate);
        let embeddings = BertEmbeddings {
            word: weight("word", vec![sizes.vocab, h]),
            position: weight("position", vec![sizes.positions, h]),
            token_type: weight("token_type", vec![2, h]),
            norm_gamma: weight("emb.g", vec![h]),
            norm_beta: weight("emb.b", vec![h]),
        };
        let layers = (0..sizes.layers)
            .map(|l| {
                let mut w = |name: &str, shape| weight(&format!("{l}.{name}"), shape);
                BertLayer {
                    qkv_weight: w("qkv", vec![3 * h, h]),
                    qkv_bias: w("qkv.b", vec![3 * h]),
                    attention_output_weight: w("o", vec![h, h]),
                    attention_output_bias: w("o.b", vec![h]),
                    attention_norm_gamma: w("ln1.g", vec![h]),
                    attention_norm_beta: w("ln1.b", vec![h]),
                    intermediate_weight: w("i", vec![inter, h]),
                    intermediate_bias: w("i.b", vec![inter]),
                    output_weight: w("o2", vec![h, inter]),
                    output_bias: w("o2.b", vec![h]),
                    output_norm_gamma: w("ln2.g", vec![h]),
                    output_norm_beta: w("ln2.b", vec![h]),
                }
            })
            .collect();
        BertArch {
            hidden: h,
            heads: sizes.heads,
            head_dim: h / sizes.heads,
            intermediate: inter,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-12,
            vocab_size: sizes.vocab,
            max_position_embeddings: sizes.positions,
            type_vocab_size: 2,
            max_seq_len: sizes.max_seq_len,
            pooling: sizes.pooling,
            normalize: sizes.normalize,
            embeddings,
            layers,
            family: Family::Bert,
            position_ids: PositionIds::Index,
            position_bias: None,
            pool_skip: false,
            dense: Vec::new(),
            classifier: None,
            mlm: None,
        }
    }
}

impl BertArch {
    /// Width of one output row: the labels, the last Dense's outputs, or the hidden size.
    pub fn output_dim(&self) -> usize {
        if let Some(m) = &self.mlm {
            return m.vocab;
        }
        match (&self.classifier, self.dense.last()) {
            (Some(c), _) => c.labels,
            (None, Some(d)) => d.outputs,
            (None, None) => self.hidden,
        }
    }

    /// The encoder at `batch` rows of `seq` tokens:
    ///
    /// EmbedLayerNorm → per layer: Linear(qkv) → Attention →
    /// Linear(attention.output.dense) → AddLayerNorm → Linear(intermediate,
    /// hidden_act) → Linear(output.dense) → AddLayerNorm → … → the head
    /// (Pool, then any Dense and Normalize; or Pool(cls) → Linear(tanh) →
    /// Linear(activation) for a classifier).
    ///
    /// Five activation buffers serve every layer: the residual stream
    /// `hidden` (updated in place by AddLayerNorm), `qkv`, `context`, `proj`
    /// (the two dense outputs before their residual add) and `intermediate`.
    ///
    /// `seq` must not exceed `max_position_embeddings` (backends reject such
    /// a program when they resolve the embedding op).
    pub fn program(&self, batch: usize, seq: usize) -> Program {
        let rows = batch * seq;
        let mut b = ProgramBuilder::new();
        let ids = b.input("input_ids", InputRole::TokenIds, rows);
        let mask = b.input("attention_mask", InputRole::AttentionMask, rows);
        let types = b.input("token_type_ids", InputRole::TokenTypeIds, rows);
        let skip = self
            .pool_skip
            .then(|| b.input("pool_skip", InputRole::PoolSkip, batch));
        let seqs = Seqs::Padded { mask, batch, seq };
        let output = self.encoder(&mut b, seqs, ids, types, skip);
        b.finish(batch, seq, output, self.output_dim())
    }

    /// The encoder over a packed budget of `tokens` slots holding up to
    /// `seqs` sequences of at most `min(max_seq_len, tokens)` tokens: the
    /// same ops as [`BertArch::program`] over `tokens` rows, their token ops
    /// taking [`Seqs::Packed`] (per-token positions, variable-length
    /// attention, per-sequence pooling); `seqs` output rows.
    ///
    /// Inputs, in order: `input_ids`, `token_type_ids`, `position_ids`
    /// (`[tokens]`) and `cu_seqlens` (`[seqs + 1]`), and for a model with
    /// [`BertArch::pool_skip`] `pool_skip` (`[seqs]`).
    pub fn packed_program(&self, tokens: usize, seqs: usize) -> Program {
        self.packed_program_upto(tokens, seqs, self.max_seq_len.min(tokens))
    }

    /// [`BertArch::packed_program`] accepting sequences of at most
    /// `max_seq_len` tokens (the eager path uses a batch's own longest).
    pub fn packed_program_upto(&self, tokens: usize, seqs: usize, max_seq_len: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let ids = b.input("input_ids", InputRole::TokenIds, tokens);
        let types = b.input("token_type_ids", InputRole::TokenTypeIds, tokens);
        let positions = b.input("position_ids", InputRole::Positions, tokens);
        let offsets = b.input("cu_seqlens", InputRole::SeqOffsets, seqs + 1);
        let skip = self
            .pool_skip
            .then(|| b.input("pool_skip", InputRole::PoolSkip, seqs));
        let layout = Seqs::Packed {
            offsets,
            positions,
            tokens,
            seqs,
            max_seq_len,
        };
        let output = self.encoder(&mut b, layout, ids, types, skip);
        b.finish_packed(tokens, seqs, max_seq_len, output, self.output_dim())
    }

    /// Declares the activations and output and pushes every op over the
    /// token rows of `seqs` (the same ops for either layout). Returns the
    /// output buffer.
    fn encoder(
        &self,
        b: &mut ProgramBuilder,
        seqs: Seqs,
        ids: BufId,
        token_types: BufId,
        skip: Option<BufId>,
    ) -> BufId {
        let rows = seqs.token_rows();
        let e = &self.embeddings;
        let h = self.hidden;
        let hidden = b.activation("hidden", rows * h);
        let qkv = b.activation("qkv", rows * 3 * h);
        let context = b.activation("context", rows * h);
        let proj = b.activation("proj", rows * h);
        let inter = b.activation("intermediate", rows * self.intermediate);
        b.push(EmbedLayerNorm {
            ids,
            token_types,
            word: e.word,
            position: e.position,
            token_type: e.token_type,
            gamma: e.norm_gamma,
            beta: e.norm_beta,
            eps: self.layer_norm_eps,
            out: hidden,
            hidden: self.hidden,
            position_ids: self.position_ids,
            seqs,
        });
        for layer in &self.layers {
            let linear = |x, w, bias, act, out, n, k| Linear {
                x,
                w,
                bias: Some(bias),
                act,
                out,
                m: rows,
                n,
                k,
            };
            let add_norm = |gamma, beta| AddLayerNorm {
                x: proj,
                residual: hidden,
                gamma,
                beta,
                eps: self.layer_norm_eps,
                out: hidden,
                rows,
                hidden: h,
            };
            let id = Activation::Identity;
            b.push(linear(
                hidden,
                layer.qkv_weight,
                layer.qkv_bias,
                id,
                qkv,
                3 * h,
                h,
            ));
            b.push(Attention {
                qkv,
                out: context,
                heads: self.heads,
                kv_heads: self.heads,
                head_dim: self.head_dim,
                bias: self.position_bias,
                window: None,
                causal: false,
                scale: None,
                seqs,
            });
            b.push(linear(
                context,
                layer.attention_output_weight,
                layer.attention_output_bias,
                id,
                proj,
                h,
                h,
            ));
            b.push(add_norm(
                layer.attention_norm_gamma,
                layer.attention_norm_beta,
            ));
            b.push(linear(
                hidden,
                layer.intermediate_weight,
                layer.intermediate_bias,
                self.hidden_act,
                inter,
                self.intermediate,
                h,
            ));
            b.push(linear(
                inter,
                layer.output_weight,
                layer.output_bias,
                id,
                proj,
                h,
                self.intermediate,
            ));
            b.push(add_norm(layer.output_norm_gamma, layer.output_norm_beta));
        }
        self.head(b, hidden, seqs, skip)
    }

    /// The head over the last hidden state: pooling and the modules after
    /// it, or the classifier. Returns the output buffer.
    fn head(
        &self,
        b: &mut ProgramBuilder,
        hidden: BufId,
        seqs: Seqs,
        skip: Option<BufId>,
    ) -> BufId {
        Head {
            hidden: self.hidden,
            pooling: self.pooling,
            normalize: self.normalize,
            dense: &self.dense,
            classifier: self.classifier.as_ref(),
            mlm: self.mlm.as_ref(),
        }
        .push(b, hidden, seqs, skip)
    }
}

/// What follows an encoder's last hidden state, shared by every family.
pub(crate) struct Head<'a> {
    pub hidden: usize,
    pub pooling: Pooling,
    pub normalize: bool,
    pub dense: &'a [DenseLayer],
    pub classifier: Option<&'a Classifier>,
    pub mlm: Option<&'a MlmHead>,
}

impl Head<'_> {
    /// Pooling and the modules after it, or the classifier, over `hidden`
    /// (`[token rows, hidden]`). Returns the output buffer.
    pub(crate) fn push(
        &self,
        b: &mut ProgramBuilder,
        hidden: BufId,
        seqs: Seqs,
        skip: Option<BufId>,
    ) -> BufId {
        let h = self.hidden;
        let out_rows = seqs.count();
        let pool = |x, out, mode, normalize, skip| Pool {
            x,
            out,
            hidden: h,
            mode,
            normalize,
            skip,
            seqs,
        };
        let linear = |x, w, bias, act, out, n, k| Linear {
            x,
            w,
            bias,
            act,
            out,
            m: out_rows,
            n,
            k,
        };
        if let Some(c) = self.classifier {
            let first = b.activation("first_token", out_rows * h);
            let inner = b.activation("classifier_hidden", out_rows * h);
            let output = b.output("scores", out_rows * c.labels);
            b.push(pool(hidden, first, Pooling::Cls, false, None));
            b.push(linear(
                first,
                c.pooler_weight,
                Some(c.pooler_bias),
                Activation::Tanh,
                inner,
                h,
                h,
            ));
            b.push(linear(
                inner,
                c.weight,
                Some(c.bias),
                c.activation,
                output,
                c.labels,
                h,
            ));
            return output;
        }
        if let Some(m) = self.mlm {
            // Every token's logits ([tokens, vocab]: the largest buffer of
            // such a program), activated in the decoder's epilogue, then
            // pooled per sequence.
            let rows = seqs.token_rows();
            let transformed = b.activation("mlm_transform", rows * h);
            let logits = b.activation("mlm_logits", rows * m.vocab);
            let output = b.output("sparse", out_rows * m.vocab);
            let token_linear = |x, w, bias, act, out, n| Linear {
                x,
                w,
                bias: Some(bias),
                act,
                out,
                m: rows,
                n,
                k: h,
            };
            b.push(token_linear(
                hidden,
                m.transform_weight,
                m.transform_bias,
                m.act,
                transformed,
                h,
            ));
            b.push(LayerNorm {
                x: transformed,
                gamma: m.norm_gamma,
                beta: Some(m.norm_beta),
                eps: m.eps,
                out: transformed,
                rows,
                hidden: h,
            });
            b.push(token_linear(
                transformed,
                m.decoder_weight,
                m.decoder_bias,
                m.splade_act,
                logits,
                m.vocab,
            ));
            b.push(Pool {
                x: logits,
                out: output,
                hidden: m.vocab,
                mode: m.pooling,
                normalize: false,
                skip: None,
                seqs,
            });
            return output;
        }
        if self.dense.is_empty() {
            let output = b.output("embedding", out_rows * h);
            b.push(pool(hidden, output, self.pooling, self.normalize, skip));
            return output;
        }
        let mut x = b.activation("pooled", out_rows * h);
        b.push(pool(hidden, x, self.pooling, self.normalize, skip));
        for (i, d) in self.dense.iter().enumerate() {
            let out = if i + 1 == self.dense.len() {
                b.output("embedding", out_rows * d.outputs)
            } else {
                b.activation(&format!("dense{i}"), out_rows * d.outputs)
            };
            b.push(linear(x, d.weight, d.bias, d.act, out, d.outputs, d.inputs));
            if d.normalize {
                b.push(Normalize {
                    x: out,
                    rows: out_rows,
                    width: d.outputs,
                });
            }
            x = out;
        }
        x
    }
}
