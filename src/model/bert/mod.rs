//! BERT-family encoders: the architecture (weight ids and hyper-parameters)
//! and the forward pass as a [`Program`].
//!
//! * This module: [`BertArch`] and [`BertArch::program`], the encoder at one
//!   (batch, seq) shape, and [`BertArch::packed_program`], the encoder over
//!   a packed token budget (see [`crate::model::program`] for the layout).
//! * [`folder`]: reading a Hugging Face / sentence-transformers folder
//!   ([`inspect`] without weight data, [`load`] with it).

mod folder;

pub use folder::{inspect, load};

use super::program::{Activation, BufId, InputRole, Op, Pooling, ProgramBuilder, WeightId};
use super::Program;

/// Weight ids of the embedding block.
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
    pub normalize: bool,
    pub embeddings: BertEmbeddings,
    pub layers: Vec<BertLayer>,
}

impl BertArch {
    /// The encoder at `batch` rows of `seq` tokens:
    ///
    /// EmbedLayerNorm → per layer: Linear(qkv) → Attention →
    /// Linear(attention.output.dense) → AddLayerNorm → Linear(intermediate,
    /// hidden_act) → Linear(output.dense) → AddLayerNorm → … → Pool.
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
        let e = &self.embeddings;
        let embed = |hidden| Op::EmbedLayerNorm {
            ids,
            token_types: types,
            word: e.word,
            position: e.position,
            token_type: e.token_type,
            gamma: e.norm_gamma,
            beta: e.norm_beta,
            eps: self.layer_norm_eps,
            out: hidden,
            batch,
            seq,
            hidden: self.hidden,
        };
        let attention = |qkv, context| Op::Attention {
            qkv,
            mask,
            out: context,
            batch,
            seq,
            heads: self.heads,
            head_dim: self.head_dim,
        };
        let pool = |hidden, output| Op::Pool {
            x: hidden,
            mask,
            out: output,
            batch,
            seq,
            hidden: self.hidden,
            mode: self.pooling,
            normalize: self.normalize,
        };
        let output = self.encoder(&mut b, rows, batch, embed, attention, pool);
        b.finish(batch, seq, output, self.hidden)
    }

    /// The encoder over a packed budget of `tokens` slots holding up to
    /// `seqs` sequences of at most `min(max_seq_len, tokens)` tokens: the
    /// same layers as [`BertArch::program`] with `tokens` rows, the packed
    /// embedding (per-token positions), variable-length attention and
    /// per-sequence pooling; `seqs` output rows.
    ///
    /// Inputs, in order: `input_ids`, `token_type_ids`, `position_ids`
    /// (`[tokens]`) and `cu_seqlens` (`[seqs + 1]`).
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
        let e = &self.embeddings;
        let embed = |hidden| Op::PackedEmbedLayerNorm {
            ids,
            token_types: types,
            positions,
            word: e.word,
            position: e.position,
            token_type: e.token_type,
            gamma: e.norm_gamma,
            beta: e.norm_beta,
            eps: self.layer_norm_eps,
            out: hidden,
            tokens,
            max_seq_len,
            hidden: self.hidden,
        };
        let attention = |qkv, context| Op::PackedAttention {
            qkv,
            offsets,
            out: context,
            tokens,
            seqs,
            max_seq_len,
            heads: self.heads,
            head_dim: self.head_dim,
        };
        let pool = |hidden, output| Op::PackedPool {
            x: hidden,
            offsets,
            out: output,
            tokens,
            seqs,
            hidden: self.hidden,
            mode: self.pooling,
            normalize: self.normalize,
        };
        let output = self.encoder(&mut b, tokens, seqs, embed, attention, pool);
        b.finish_packed(tokens, seqs, max_seq_len, output, self.hidden)
    }

    /// Declares the activations and output and pushes every op: `embed`,
    /// `attention` and `pool` build the layout's token ops (given the
    /// buffers they write or read), the rest is the same for both layouts.
    /// Returns the output buffer.
    fn encoder(
        &self,
        b: &mut ProgramBuilder,
        rows: usize,
        out_rows: usize,
        embed: impl Fn(BufId) -> Op,
        attention: impl Fn(BufId, BufId) -> Op,
        pool: impl Fn(BufId, BufId) -> Op,
    ) -> BufId {
        let h = self.hidden;
        let hidden = b.activation("hidden", rows * h);
        let qkv = b.activation("qkv", rows * 3 * h);
        let context = b.activation("context", rows * h);
        let proj = b.activation("proj", rows * h);
        let inter = b.activation("intermediate", rows * self.intermediate);
        let output = b.output("embedding", out_rows * h);
        b.push(embed(hidden));
        for layer in &self.layers {
            let linear = |x, w, bias, act, out, n, k| Op::Linear {
                x,
                w,
                bias: Some(bias),
                act,
                out,
                m: rows,
                n,
                k,
            };
            let add_norm = |gamma, beta| Op::AddLayerNorm {
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
            b.push(attention(qkv, context));
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
        b.push(pool(hidden, output));
        output
    }
}
