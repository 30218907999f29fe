//! Decoder-style embedding models — Qwen3-Embedding (`qwen3`) and
//! EmbeddingGemma (`gemma3_text` with bidirectional attention) — as one
//! program builder ([`DecoderArch`]). Both are pre-norm transformers with
//! RMSNorm, grouped-query attention with per-head q/k norms and rotary
//! positions, and a gated feed-forward:
//!
//! ```text
//! h = word[ids] · embed_scale                 (Gemma: √hidden; Qwen3: 1)
//! per layer:
//!   x = qkv(RMS_in(h));  x.q, x.k = RMS_q(x.q), RMS_k(x.k) per head;  rotary(x.q, x.k)
//!   a = Wo · Attention(x)                     (Qwen3: causal; Gemma: bidirectional,
//!                                              sliding-window in local layers)
//!   h += RMS_post_attn(a)                     (the post-norm: Gemma only)
//!   m = Wdown · (act(Wgate · RMS_mlp(h)) ⊙ Wup · RMS_mlp(h))
//!   h += RMS_post_mlp(m)                      (Gemma only)
//! h = RMS_final(h); then pooling (Qwen3: the last token; Gemma: mean), Dense, Normalize
//! ```
//!
//! Gemma's RMSNorms scale by `1 + weight` ([`RmsNorm::weight_offset`]).
//! q, k and v are one projection (`[q | k | v]`, fused at load), and so are
//! gate and up (`[gate | up]`, the activation on the first half). The
//! family readers (`qwen3.rs`) fill the weights.

use super::rotary::{packed_inputs, padded_inputs};
use super::{DenseLayer, Head};
use crate::model::program::{
    Activation, Add, Attention, BufId, Embed, GateOn, Gated, HeadRmsNorm, Linear, Pooling, Program,
    ProgramBuilder, RmsNorm, Rotary, Seqs, WeightId,
};

/// Weight ids of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderLayer {
    /// `input_layernorm`.
    pub input_norm: WeightId,
    /// `[(heads + 2·kv_heads)·head_dim, hidden]`: q, k and v stacked.
    pub qkv_weight: WeightId,
    pub qkv_bias: Option<WeightId>,
    /// `q_norm`, `k_norm`: `[head_dim]`.
    pub q_norm: WeightId,
    pub k_norm: WeightId,
    /// `o_proj`: `[hidden, heads·head_dim]`.
    pub output_weight: WeightId,
    pub output_bias: Option<WeightId>,
    /// Gemma's `post_attention_layernorm` (on the attention's output,
    /// before the residual add).
    pub post_attention_norm: Option<WeightId>,
    /// Before the feed-forward: Qwen3's `post_attention_layernorm`,
    /// Gemma's `pre_feedforward_layernorm`.
    pub mlp_norm: WeightId,
    /// `[2·intermediate, hidden]`: gate and up stacked.
    pub gate_up_weight: WeightId,
    /// `down_proj`: `[hidden, intermediate]`.
    pub down_weight: WeightId,
    /// Gemma's `post_feedforward_layernorm`.
    pub post_mlp_norm: Option<WeightId>,
    /// A local layer's window (`|i − j| ≤ window`), or global attention.
    pub window: Option<usize>,
    pub rope_theta: f32,
}

/// A loaded decoder embedding model with its sentence-transformers head.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderArch {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    /// The gate's activation (Qwen3: SiLU; Gemma: tanh GELU).
    pub act: Activation,
    pub norm_eps: f32,
    /// 0 (Qwen3) or 1 (Gemma's `1 + weight`).
    pub norm_offset: f32,
    /// Gemma's `√hidden`; 1 for Qwen3.
    pub embed_scale: f32,
    /// Each query attends only to earlier tokens of its sequence (Qwen3).
    pub causal: bool,
    /// Gemma's `query_pre_attn_scalar^−½`; `None`: `1/√head_dim`.
    pub attention_scale: Option<f32>,
    pub vocab_size: usize,
    /// Longest input in tokens, special tokens included.
    pub max_seq_len: usize,
    /// `embed_tokens`: `[vocab, hidden]`.
    pub word: WeightId,
    pub layers: Vec<DecoderLayer>,
    /// `norm`: the last RMSNorm.
    pub final_norm: WeightId,
    pub pooling: Pooling,
    pub normalize: bool,
    pub pool_skip: bool,
    pub dense: Vec<DenseLayer>,
}

impl DecoderArch {
    /// Width of one output row: the last Dense's outputs, or the hidden size.
    pub fn output_dim(&self) -> usize {
        self.dense.last().map_or(self.hidden, |d| d.outputs)
    }

    /// The model at `batch` rows of `seq` tokens (padded).
    pub fn program(&self, batch: usize, seq: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let (ids, seqs, skip) = padded_inputs(&mut b, batch, seq, self.pool_skip);
        let output = self.forward(&mut b, seqs, ids, skip);
        b.finish(batch, seq, output, self.output_dim())
    }

    /// The model over a packed budget of `tokens` slots holding up to
    /// `seqs` sequences of at most `min(max_seq_len, tokens)` tokens.
    pub fn packed_program(&self, tokens: usize, seqs: usize) -> Program {
        self.packed_program_upto(tokens, seqs, self.max_seq_len.min(tokens))
    }

    /// [`DecoderArch::packed_program`] accepting sequences of at most
    /// `max_seq_len` tokens.
    pub fn packed_program_upto(&self, tokens: usize, seqs: usize, max_seq_len: usize) -> Program {
        let mut b = ProgramBuilder::new();
        let (ids, layout, skip) = packed_inputs(&mut b, tokens, seqs, max_seq_len, self.pool_skip);
        let output = self.forward(&mut b, layout, ids, skip);
        b.finish_packed(tokens, seqs, max_seq_len, output, self.output_dim())
    }

    /// Activations shared by every layer: the residual stream `hidden`,
    /// `normed` (a norm's output), `qkv`, `context` (the attention's
    /// output), `proj` (either output projection), `wide` (`[gate | up]`)
    /// and `gated`.
    fn forward(
        &self,
        b: &mut ProgramBuilder,
        seqs: Seqs,
        ids: BufId,
        skip: Option<BufId>,
    ) -> BufId {
        let rows = seqs.token_rows();
        let (h, i) = (self.hidden, self.intermediate);
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        let qkv_width = (heads + 2 * kv_heads) * d;
        let hidden = b.activation("hidden", rows * h);
        let normed = b.activation("normed", rows * h);
        let qkv = b.activation("qkv", rows * qkv_width);
        let context = b.activation("context", rows * heads * d);
        let proj = b.activation("proj", rows * h);
        let wide = b.activation("wide", rows * 2 * i);
        let gated = b.activation("gated", rows * i);
        let norm = |x, out, gamma| RmsNorm {
            x,
            gamma,
            eps: self.norm_eps,
            weight_offset: self.norm_offset,
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
        let add = Add {
            x: proj,
            into: hidden,
            rows,
            width: h,
        };
        b.push(Embed {
            ids,
            word: self.word,
            out: hidden,
            hidden: h,
            scale: self.embed_scale,
            seqs,
        });
        for layer in &self.layers {
            b.push(norm(hidden, normed, layer.input_norm));
            b.push(linear(
                normed,
                layer.qkv_weight,
                layer.qkv_bias,
                qkv,
                qkv_width,
                h,
            ));
            b.push(HeadRmsNorm {
                qkv,
                rows,
                heads,
                kv_heads,
                head_dim: d,
                q_gamma: layer.q_norm,
                k_gamma: layer.k_norm,
                eps: self.norm_eps,
                weight_offset: self.norm_offset,
            });
            b.push(Rotary {
                qkv,
                heads,
                kv_heads,
                head_dim: d,
                theta: layer.rope_theta,
                scale: 1.0,
                dynamic: None,
                seqs,
            });
            b.push(Attention {
                qkv,
                out: context,
                heads,
                kv_heads,
                head_dim: d,
                bias: None,
                window: layer.window,
                causal: self.causal,
                scale: self.attention_scale,
                seqs,
            });
            b.push(linear(
                context,
                layer.output_weight,
                layer.output_bias,
                proj,
                h,
                heads * d,
            ));
            if let Some(n) = layer.post_attention_norm {
                b.push(norm(proj, proj, n));
            }
            b.push(add.clone());
            b.push(norm(hidden, normed, layer.mlp_norm));
            b.push(linear(normed, layer.gate_up_weight, None, wide, 2 * i, h));
            b.push(Gated {
                x: wide,
                out: gated,
                rows,
                width: i,
                act: self.act,
                on: GateOn::First,
            });
            b.push(linear(gated, layer.down_weight, None, proj, h, i));
            if let Some(n) = layer.post_mlp_norm {
                b.push(norm(proj, proj, n));
            }
            b.push(add.clone());
        }
        b.push(norm(hidden, hidden, self.final_norm));
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
