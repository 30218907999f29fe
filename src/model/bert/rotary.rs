//! Encoders with rotary positions and a gated feed-forward, as one
//! program builder ([`RotaryEncoderArch`]) for three families that differ
//! only in where the norms sit and which half of the gate is activated:
//!
//! ```text
//! h = LayerNorm(word[ids])                 (embeddings; GTE/Nomic: + token type 0, folded in)
//! per layer, pre-norm (ModernBERT):
//!   h += Wo · Attention(rotary(Wqkv · LN_attn(h)))      (LN_attn absent in layer 0)
//!   h += Wo' · gated(Wi · LN_mlp(h))
//!   then a final LayerNorm
//! per layer, post-norm (GTE, NomicBERT):
//!   h = LN_attn(h + Wo · Attention(rotary(Wqkv · h)))
//!   h = LN_mlp(h + Wo' · gated(Wi · h))
//! ```
//!
//! `gated` is `act(first half) · second half` (ModernBERT's `[input |
//! gate]`) or `first half · act(second half)` (GTE's `[up | gate]`,
//! Nomic's `[fc11 | fc12]`). Then the sentence-transformers head shared
//! with the other families ([`Head`]). Each family's folder reader
//! (`modernbert.rs`, `gte.rs`) fills the weights.

use super::{DenseLayer, Head};
use crate::model::program::{
    Activation, Add, AddLayerNorm, Attention, BufId, DynamicNtk, Embed, GateOn, Gated, InputRole,
    LayerNorm, Linear, Pooling, Program, ProgramBuilder, Rotary, Seqs, WeightId,
};

/// Where a layer's two LayerNorms sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormPlacement {
    /// Before attention and the feed-forward (ModernBERT), with a final norm.
    Pre,
    /// After each residual add (BERT's place: GTE, NomicBERT).
    Post,
}

/// A LayerNorm's weights (`bias` where the config has `norm_bias`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Norm {
    pub weight: WeightId,
    pub bias: Option<WeightId>,
}

/// Weight ids of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RotaryLayer {
    /// Pre-norm: before attention (absent in ModernBERT's layer 0, where
    /// it is the identity). Post-norm: after the attention's residual add.
    pub attention_norm: Option<Norm>,
    /// `attn.Wqkv`: `[3·hidden, hidden]`, output `[q | k | v]`.
    pub qkv_weight: WeightId,
    pub qkv_bias: Option<WeightId>,
    /// `attn.Wo`: `[hidden, hidden]`.
    pub attention_output_weight: WeightId,
    pub attention_output_bias: Option<WeightId>,
    /// Before (pre-norm) or after (post-norm) the feed-forward.
    pub mlp_norm: Norm,
    /// `[2·intermediate, hidden]`: both halves of the gated unit.
    pub input_weight: WeightId,
    pub input_bias: Option<WeightId>,
    /// `mlp.Wo`: `[hidden, intermediate]`.
    pub output_weight: WeightId,
    pub output_bias: Option<WeightId>,
    /// Sliding-window attention (`±window` keys) and its rotary base, or
    /// global attention with the global base.
    pub window: Option<usize>,
    pub rope_theta: f32,
}

/// A loaded rotary encoder with its sentence-transformers head.
#[derive(Clone, Debug, PartialEq)]
pub struct RotaryEncoderArch {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub hidden_act: Activation,
    /// Every layer's rotary frequency multiplier ([`Rotary::scale`]).
    pub rope_scale: f32,
    /// NomicBERT's dynamic NTK scaling ([`Rotary::dynamic`]).
    pub rope_dynamic: Option<DynamicNtk>,
    /// Which half of the gated unit the activation applies to.
    pub gate_on: GateOn,
    pub placement: NormPlacement,
    pub norm_eps: f32,
    pub vocab_size: usize,
    /// Longest input in tokens, special tokens included.
    pub max_seq_len: usize,
    /// `embeddings.tok_embeddings`: `[vocab, hidden]`.
    pub word: WeightId,
    pub embedding_norm: Norm,
    pub layers: Vec<RotaryLayer>,
    /// Pre-norm encoders' last LayerNorm.
    pub final_norm: Option<Norm>,
    pub pooling: Pooling,
    pub normalize: bool,
    pub pool_skip: bool,
    pub dense: Vec<DenseLayer>,
}

/// The inputs of a model without token types at a padded shape: ids, the
/// mask and (where pooling skips a prompt) the skip counts; returns the
/// ids, the layout and the skip input.
pub(super) fn padded_inputs(
    b: &mut ProgramBuilder,
    batch: usize,
    seq: usize,
    pool_skip: bool,
) -> (BufId, Seqs, Option<BufId>) {
    let rows = batch * seq;
    let ids = b.input("input_ids", InputRole::TokenIds, rows);
    let mask = b.input("attention_mask", InputRole::AttentionMask, rows);
    let skip = pool_skip.then(|| b.input("pool_skip", InputRole::PoolSkip, batch));
    (ids, Seqs::Padded { mask, batch, seq }, skip)
}

/// [`padded_inputs`] of a packed budget: ids, positions, the cumulative
/// lengths and the skip counts.
pub(super) fn packed_inputs(
    b: &mut ProgramBuilder,
    tokens: usize,
    seqs: usize,
    max_seq_len: usize,
    pool_skip: bool,
) -> (BufId, Seqs, Option<BufId>) {
    let ids = b.input("input_ids", InputRole::TokenIds, tokens);
    let positions = b.input("position_ids", InputRole::Positions, tokens);
    let offsets = b.input("cu_seqlens", InputRole::SeqOffsets, seqs + 1);
    let skip = pool_skip.then(|| b.input("pool_skip", InputRole::PoolSkip, seqs));
    let layout = Seqs::Packed {
        offsets,
        positions,
        tokens,
        seqs,
        max_seq_len,
    };
    (ids, layout, skip)
}

impl RotaryEncoderArch {
    /// Width of one output row: the last Dense's outputs, or the hidden size.
    pub fn output_dim(&self) -> usize {
        self.dense.last().map_or(self.hidden, |d| d.outputs)
    }

    /// The encoder at `batch` rows of `seq` tokens (padded).
    pub fn program(&self, batch: usize, seq: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let (ids, seqs, skip) = padded_inputs(&mut b, batch, seq, self.pool_skip);
        let output = self.encoder(&mut b, seqs, ids, skip);
        b.finish(batch, seq, output, self.output_dim())
    }

    /// The encoder over a packed budget of `tokens` slots holding up to
    /// `seqs` sequences of at most `min(max_seq_len, tokens)` tokens.
    pub fn packed_program(&self, tokens: usize, seqs: usize) -> Program {
        self.packed_program_upto(tokens, seqs, self.max_seq_len.min(tokens))
    }

    /// [`RotaryEncoderArch::packed_program`] accepting sequences of at most
    /// `max_seq_len` tokens.
    pub fn packed_program_upto(&self, tokens: usize, seqs: usize, max_seq_len: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let (ids, layout, skip) = packed_inputs(&mut b, tokens, seqs, max_seq_len, self.pool_skip);
        let output = self.encoder(&mut b, layout, ids, skip);
        b.finish_packed(tokens, seqs, max_seq_len, output, self.output_dim())
    }

    /// Five activations serve every layer: the residual stream `hidden`,
    /// `normed` (a norm's output), `qkv`, `context` and `gated` (the
    /// attention output and the gated unit's), with `wide` for `Wi`'s
    /// `[input | gate]` and `proj` for the two output projections.
    fn encoder(
        &self,
        b: &mut ProgramBuilder,
        seqs: Seqs,
        ids: BufId,
        skip: Option<BufId>,
    ) -> BufId {
        let rows = seqs.token_rows();
        let (h, i) = (self.hidden, self.intermediate);
        let hidden = b.activation("hidden", rows * h);
        let normed = b.activation("normed", rows * h);
        let qkv = b.activation("qkv", rows * 3 * h);
        let context = b.activation("context", rows * h);
        let proj = b.activation("proj", rows * h);
        let wide = b.activation("wide", rows * 2 * i);
        let gated = b.activation("gated", rows * i);
        let norm = |x, out, n: Norm| LayerNorm {
            x,
            gamma: n.weight,
            beta: n.bias,
            eps: self.norm_eps,
            out,
            rows,
            hidden: h,
        };
        let linear = |x, w, bias, out, n, k| Linear {
            x,
            w,
            bias,
            act: Activation::Identity,
            out,
            m: rows,
            n,
            k,
        };
        let add = |x| Add {
            x,
            into: hidden,
            rows,
            width: h,
        };
        b.push(Embed {
            ids,
            word: self.word,
            out: hidden,
            hidden: h,
            scale: 1.0,
            seqs,
        });
        b.push(norm(hidden, hidden, self.embedding_norm));
        let post = self.placement == NormPlacement::Post;
        // Post-norm: h = LayerNorm(h + x), fused where the norm has a bias.
        let add_norm = |b: &mut ProgramBuilder, x: BufId, n: Option<Norm>| match n {
            Some(Norm {
                weight,
                bias: Some(beta),
            }) if post => b.push(AddLayerNorm {
                x,
                residual: hidden,
                gamma: weight,
                beta,
                eps: self.norm_eps,
                out: hidden,
                rows,
                hidden: h,
            }),
            Some(n) if post => {
                b.push(add(x));
                b.push(norm(hidden, hidden, n));
            }
            _ => b.push(add(x)),
        };
        for layer in &self.layers {
            let attention_in = match layer.attention_norm {
                Some(n) if !post => {
                    b.push(norm(hidden, normed, n));
                    normed
                }
                _ => hidden,
            };
            b.push(linear(
                attention_in,
                layer.qkv_weight,
                layer.qkv_bias,
                qkv,
                3 * h,
                h,
            ));
            b.push(Rotary {
                qkv,
                heads: self.heads,
                kv_heads: self.heads,
                head_dim: self.head_dim,
                theta: layer.rope_theta,
                scale: self.rope_scale,
                dynamic: self.rope_dynamic,
                seqs,
            });
            b.push(Attention {
                qkv,
                out: context,
                heads: self.heads,
                kv_heads: self.heads,
                head_dim: self.head_dim,
                bias: None,
                window: layer.window,
                causal: false,
                scale: None,
                seqs,
            });
            b.push(linear(
                context,
                layer.attention_output_weight,
                layer.attention_output_bias,
                proj,
                h,
                h,
            ));
            add_norm(b, proj, layer.attention_norm);
            let mlp_in = if post {
                hidden
            } else {
                b.push(norm(hidden, normed, layer.mlp_norm));
                normed
            };
            b.push(linear(
                mlp_in,
                layer.input_weight,
                layer.input_bias,
                wide,
                2 * i,
                h,
            ));
            b.push(Gated {
                x: wide,
                out: gated,
                rows,
                width: i,
                act: self.hidden_act,
                on: self.gate_on,
            });
            b.push(linear(
                gated,
                layer.output_weight,
                layer.output_bias,
                proj,
                h,
                i,
            ));
            add_norm(b, proj, Some(layer.mlp_norm));
        }
        if let Some(n) = self.final_norm {
            b.push(norm(hidden, hidden, n));
        }
        Head {
            hidden: h,
            pooling: self.pooling,
            normalize: self.normalize,
            dense: &self.dense,
            classifier: None,
            mlm: None,
        }
        .push(b, hidden, seqs, skip)
    }
}
