//! The forward pass of a model at one fixed shape, as a flat list of ops over
//! numbered buffers.
//!
//! A [`Program`] is what a backend captures: every buffer has a fixed size,
//! every op a fixed shape, and there is no control flow. The CPU backend
//! executes the ops in order over preallocated host buffers; the CUDA backend
//! launches one kernel (or cuBLASLt matmul) per op inside a stream capture.
//! Models describe themselves once here, so both backends compute the same
//! function by construction.
//!
//! Activation buffers are reused across layers (the builder ping-pongs a
//! handful of them), so a program's memory does not grow with depth.
//!
//! # Layouts
//!
//! A token program has one of two [`Layout`]s:
//!
//! * **padded** — `batch` rows of `seq` token slots; a batch's rows are padded
//!   to `seq` and masked ([`InputRole::AttentionMask`]).
//! * **packed** — the sequences of a batch laid end to end in `tokens` token
//!   slots: sequence `s` occupies slots `offsets[s] .. offsets[s + 1]` and the
//!   slots after the last sequence (the *tail*, `offsets[batch] .. tokens`)
//!   are padding that no real token ever attends to or pools. `batch` is the
//!   most sequences the program holds (its output rows) and `seq` the longest
//!   sequence it accepts. The inputs (all i32) are [`InputRole::TokenIds`],
//!   [`InputRole::TokenTypeIds`] and [`InputRole::Positions`] of `tokens`
//!   elements and [`InputRole::SeqOffsets`] of `batch + 1` (the cumulative
//!   lengths, FlashAttention's `cu_seqlens`; unused sequence slots repeat the
//!   last offset, so they are empty). `Linear` and `AddLayerNorm` run over
//!   all `tokens` rows as in a padded program of `batch · seq` rows.
//!   A packed graph is captured once per token budget and every batch changes
//!   only the *contents* of those inputs.
//!
//!   For example, sequences of 3, 1 and 2 tokens in an 8-slot program of at
//!   most 4 sequences:
//!
//!   ```text
//!   slot        0  1  2  3  4  5  6  7
//!   ids         a0 a1 a2 b0 c0 c1 0  0      (tail: 0)
//!   positions   0  1  2  0  0  1  0  0
//!   types       0  0  0  0  0  0  0  0
//!   offsets     [0, 3, 4, 6, 6]             (slot 3 unused: empty)
//!   output      rows a, b, c, and a zero row
//!   ```
//!
//! The token ops (embedding, attention, pooling) are the same ops in both
//! layouts: each carries the program's [`Seqs`], the layout's inputs and
//! sizes, and a backend picks its kernel from it.
//!
//! * [`validate`]: the IR's rules, checked once before a backend captures a
//!   program, and the check of a batch against it.
//! * [`reference`](mod@reference): a plain f64 interpreter, the yardstick for both backends.

pub mod reference;
pub mod validate;

pub use validate::{BatchError, ProgramError, ProgramFacts, ProgramInput};

use serde::{Deserialize, Serialize};

/// Index into the model's weight table ([`crate::model::Weights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightId(pub usize);

/// Index into [`Program::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BufId(pub usize);

/// What a buffer holds, which decides its element type on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum BufKind {
    /// A static input filled from the batch before each run (see [`InputRole`]).
    Input(InputRole),
    /// Intermediate activations, in the model's compute dtype.
    Activation,
    /// The program's result: always f32, `[batch, output_dim]`.
    Output,
}

/// The meaning of an input buffer; decides how a batch is packed into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InputRole {
    /// f32 `[batch, features]`, padded rows are zero.
    Features,
    /// i32 `[batch, seq]` token ids, padding positions hold 0 (the pad id is
    /// irrelevant: masked); in a packed program `[tokens]`, sequences end to
    /// end and 0 in the tail.
    TokenIds,
    /// i32 `[batch, seq]`, 1 for real tokens, 0 for padding (also 0 for padded rows).
    AttentionMask,
    /// i32 `[batch, seq]` segment ids (all 0 for single-sentence encoders);
    /// `[tokens]` in a packed program.
    TokenTypeIds,
    /// Packed programs: i32 `[tokens]`, the position of each token inside its
    /// sequence (`0 .. len`); 0 in the tail.
    Positions,
    /// Packed programs: i32 `[batch + 1]`, the cumulative sequence lengths
    /// (`offsets[0] = 0`, `offsets[s + 1] = offsets[s] + len(s)`); slots past
    /// the batch's last sequence repeat the total, so they are empty.
    SeqOffsets,
    /// Either layout: i32 `[batch]`, how many leading tokens of each
    /// sequence pooling skips (the prompt of a model whose pooling has
    /// `include_prompt = false`); 0 for padded rows and unused slots.
    /// Filled from the tokens' [`UNPOOLED_BIT`](crate::model::batch::UNPOOLED_BIT).
    PoolSkip,
}

impl InputRole {
    /// Integer inputs are i32; feature inputs f32.
    pub fn is_integer(self) -> bool {
        !matches!(self, InputRole::Features)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BufferDecl {
    pub name: String,
    pub kind: BufKind,
    /// Number of elements (not bytes).
    pub elems: usize,
}

/// How a program's token slots are organised (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// `batch` rows of `seq` slots (or feature rows, `seq = 1`).
    #[default]
    Padded,
    /// Up to `batch` sequences of at most `seq` tokens, end to end in
    /// `tokens` slots.
    Packed { tokens: usize },
}

/// Element-wise activation applied after a linear layer's bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    Identity,
    Relu,
    /// Exact GELU, `0.5·x·(1 + erf(x/√2))` (BERT's `"gelu"`).
    Gelu,
    /// The tanh approximation (`"gelu_new"`, `"gelu_pytorch_tanh"`).
    GeluTanh,
    Tanh,
    Sigmoid,
    /// `x·sigmoid(x)` (`"silu"`, `"swish"`).
    Silu,
    /// `ln(1 + max(x, 0))`: SPLADE's `"relu"` activation over masked-LM
    /// logits (sentence-transformers' `SpladePooling`).
    Log1pRelu,
    /// `ln(1 + ln(1 + max(x, 0)))`: SPLADE's `"log1p_relu"` (OpenSearch's
    /// models).
    Log1pLog1pRelu,
}

impl Activation {
    /// Parses the names used by PyTorch modules and Hugging Face configs.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "identity" | "none" | "linear" => Activation::Identity,
            "relu" => Activation::Relu,
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" | "gelu_tanh" => Activation::GeluTanh,
            "tanh" => Activation::Tanh,
            "sigmoid" => Activation::Sigmoid,
            "silu" | "swish" => Activation::Silu,
            _ => return None,
        })
    }

    /// Reference implementation (f32), shared by the CPU backend and tests.
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Identity => x,
            Activation::Relu => x.max(0.0),
            Activation::Gelu => 0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2)),
            Activation::GeluTanh => {
                let c = (2.0f32 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Log1pRelu => x.max(0.0).ln_1p(),
            Activation::Log1pLog1pRelu => x.max(0.0).ln_1p().ln_1p(),
        }
    }
}

/// The error function in f32, computed in f64 (Rust's std has no erf).
pub fn erf(x: f32) -> f32 {
    erf_f64(x as f64) as f32
}

/// The error function from the C math library, which every target we build for links.
pub fn erf_f64(x: f64) -> f64 {
    extern "C" {
        fn erf(x: f64) -> f64;
    }
    // SAFETY: a pure function of its argument.
    unsafe { erf(x) }
}

/// How token embeddings become one sentence embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// Mean over tokens where the attention mask is 1.
    Mean,
    /// The first token's vector.
    Cls,
    /// Element-wise max over tokens where the attention mask is 1.
    Max,
    /// Sum over tokens where the attention mask is 1 (SPLADE's `"sum"`
    /// pooling; not a sentence-transformers `Pooling` mode).
    Sum,
    /// The last real token's vector (sentence-transformers' `lasttoken`:
    /// a decoder's embedding, its appended end-of-text token).
    LastToken,
}

/// How an embedding op derives each token's row of the position table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionIds {
    /// BERT: the token's index in its sequence, `0 .. len`.
    #[default]
    Index,
    /// RoBERTa / XLM-R / MPNet (`create_position_ids_from_input_ids`): a
    /// token whose id is `pad` gets `pad`; any other gets `pad + 1 +` the
    /// number of tokens before it in its sequence whose id is not `pad`. So
    /// real tokens count from `pad + 1`, and a literal pad token in a text
    /// neither moves nor is counted. The position table needs at least
    /// `pad + 1 + max_seq_len` rows.
    AfterPadding { pad: u32 },
}

impl PositionIds {
    /// The position-table rows a sequence of `len` tokens may use.
    pub fn rows_needed(self, len: usize) -> usize {
        match self {
            PositionIds::Index => len,
            PositionIds::AfterPadding { pad } => pad as usize + 1 + len,
        }
    }

    /// The position of token `i` of `ids` (one sequence).
    pub fn position(self, ids: &[i32], i: usize) -> usize {
        match self {
            PositionIds::Index => i,
            PositionIds::AfterPadding { pad } => {
                let pad = pad as i32;
                if ids[i] == pad {
                    pad as usize
                } else {
                    let before = ids[..i].iter().filter(|&&v| v != pad).count();
                    pad as usize + 1 + before
                }
            }
        }
    }
}

/// A learned bias added to every attention score (MPNet's relative
/// attention bias): `score(h, i, j) += table[h, clamp(j − i, −radius, radius) + radius]`
/// for query `i` and key `j` of one sequence (positions within the
/// sequence, whatever the layout). The table is `[heads, 2·radius + 1]`,
/// built once from the model's bucketed table (the bucket of `j − i` is
/// constant beyond `radius`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PositionBias {
    pub table: WeightId,
    pub radius: usize,
}

impl PositionBias {
    /// The table column for query `i` and key `j`.
    pub fn column(self, i: usize, j: usize) -> usize {
        let r = self.radius as i64;
        ((j as i64 - i as i64).clamp(-r, r) + r) as usize
    }
}

/// How a program's token rows group into sequences: the one parameter that
/// tells the token ops of a padded program from those of a packed one (see
/// [`Layout`]). Every token op of a program carries the same `Seqs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Seqs {
    /// `batch` rows of `seq` slots: sequence `b` is token rows
    /// `b·seq .. (b + 1)·seq`, its real tokens those where `mask` (the
    /// [`InputRole::AttentionMask`] input, `[batch, seq]`) is 1.
    Padded {
        mask: BufId,
        batch: usize,
        seq: usize,
    },
    /// Up to `seqs` sequences end to end in `tokens` slots: sequence `s` is
    /// token rows `offsets[s] .. offsets[s + 1]` ([`InputRole::SeqOffsets`],
    /// `[seqs + 1]`), every one of them real, none longer than
    /// `max_seq_len`; `positions` ([`InputRole::Positions`], `[tokens]`)
    /// holds each token's index in its sequence. The slots after the last
    /// sequence (the tail) belong to none.
    Packed {
        offsets: BufId,
        positions: BufId,
        tokens: usize,
        seqs: usize,
        max_seq_len: usize,
    },
}

impl Seqs {
    /// Token rows: `batch · seq`, or `tokens`.
    pub fn token_rows(self) -> usize {
        match self {
            Seqs::Padded { batch, seq, .. } => batch * seq,
            Seqs::Packed { tokens, .. } => tokens,
        }
    }

    /// Sequences (output rows of a pooling): `batch`, or `seqs`.
    pub fn count(self) -> usize {
        match self {
            Seqs::Padded { batch, .. } => batch,
            Seqs::Packed { seqs, .. } => seqs,
        }
    }

    /// The longest sequence: `seq`, or `max_seq_len`.
    pub fn max_len(self) -> usize {
        match self {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed { max_seq_len, .. } => max_seq_len,
        }
    }

    pub fn is_packed(self) -> bool {
        matches!(self, Seqs::Packed { .. })
    }

    /// The input that says which rows a sequence holds: the mask, or the
    /// offsets.
    pub fn index(self) -> BufId {
        match self {
            Seqs::Padded { mask, .. } => mask,
            Seqs::Packed { offsets, .. } => offsets,
        }
    }
}

/// One step of a forward pass, each op a type of its own. Row-major
/// everywhere. The token ops ([`EmbedLayerNorm`], [`Attention`], [`Pool`])
/// take the program's [`Seqs`]: one op per concept, padded or packed as a
/// parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    EmbedLayerNorm(EmbedLayerNorm),
    Linear(Linear),
    AddLayerNorm(AddLayerNorm),
    Attention(Attention),
    Pool(Pool),
    Normalize(Normalize),
    Embed(Embed),
    LayerNorm(LayerNorm),
    Add(Add),
    Rotary(Rotary),
    Gated(Gated),
    RmsNorm(RmsNorm),
    HeadRmsNorm(HeadRmsNorm),
}

macro_rules! op_from {
    ($($name:ident),*) => {$(
        impl From<$name> for Op {
            fn from(op: $name) -> Op {
                Op::$name(op)
            }
        }
    )*};
}
op_from!(
    EmbedLayerNorm,
    Linear,
    AddLayerNorm,
    Attention,
    Pool,
    Normalize,
    Embed,
    LayerNorm,
    Add,
    Rotary,
    Gated,
    RmsNorm,
    HeadRmsNorm
);

impl Op {
    /// A token op's [`Seqs`] (`None` for the ops that work row by row).
    pub fn seqs(&self) -> Option<Seqs> {
        match self {
            Op::EmbedLayerNorm(EmbedLayerNorm { seqs, .. })
            | Op::Attention(Attention { seqs, .. })
            | Op::Pool(Pool { seqs, .. })
            | Op::Embed(Embed { seqs, .. })
            | Op::Rotary(Rotary { seqs, .. }) => Some(*seqs),
            Op::Linear(_)
            | Op::AddLayerNorm(_)
            | Op::Normalize(_)
            | Op::LayerNorm(_)
            | Op::Add(_)
            | Op::Gated(_)
            | Op::RmsNorm(_)
            | Op::HeadRmsNorm(_) => None,
        }
    }

    /// The token op's [`Seqs`], to change (tests, trimming a plan).
    pub fn seqs_mut(&mut self) -> Option<&mut Seqs> {
        match self {
            Op::EmbedLayerNorm(EmbedLayerNorm { seqs, .. })
            | Op::Attention(Attention { seqs, .. })
            | Op::Pool(Pool { seqs, .. })
            | Op::Embed(Embed { seqs, .. })
            | Op::Rotary(Rotary { seqs, .. }) => Some(seqs),
            Op::Linear(_)
            | Op::AddLayerNorm(_)
            | Op::Normalize(_)
            | Op::LayerNorm(_)
            | Op::Add(_)
            | Op::Gated(_)
            | Op::RmsNorm(_)
            | Op::HeadRmsNorm(_) => None,
        }
    }
}

/// For every token row `r`:
/// `out[r] = LayerNorm(word[ids[r]] + position[p(r)] + token_type[types[r]])`,
/// with `p(r)` the position `position_ids` gives the token at index `i`
/// of its sequence (`i` itself for [`PositionIds::Index`]): `r % seq`
/// padded, `positions[r]` packed (tail slots hold id 0, position 0 and
/// type 0 and get that embedding). The position table has the rows
/// `position_ids` needs for [`Seqs::max_len`] tokens. Ids outside the
/// vocabulary never reach a program (the frontend rejects them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmbedLayerNorm {
    pub ids: BufId,
    pub token_types: BufId,
    pub word: WeightId,
    pub position: WeightId,
    pub token_type: WeightId,
    pub gamma: WeightId,
    pub beta: WeightId,
    pub eps: f32,
    pub out: BufId,
    pub hidden: usize,
    #[serde(default)]
    pub position_ids: PositionIds,
    pub seqs: Seqs,
}

/// `out[m, n] = act(x[m, k] · wᵀ + bias)`, `w` stored `[n, k]` as PyTorch does.
/// `x` may be an f32 input buffer (first layer of an MLP); `out` may be the
/// f32 program output (last layer).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    pub x: BufId,
    pub w: WeightId,
    pub bias: Option<WeightId>,
    pub act: Activation,
    pub out: BufId,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// `out = LayerNorm(x + residual)` over the last dimension (`hidden`).
/// `out` may alias `residual` (never `x`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AddLayerNorm {
    pub x: BufId,
    pub residual: BufId,
    pub gamma: WeightId,
    pub beta: WeightId,
    pub eps: f32,
    pub out: BufId,
    pub rows: usize,
    pub hidden: usize,
}

/// Multi-head self-attention over a fused projection, each query
/// attending to the real tokens of its own sequence. `qkv` is
/// `[token rows, (heads + 2·kv_heads)·head_dim]`, laid out `[q | k | v]`
/// with heads contiguous inside each part (`heads` query heads,
/// `kv_heads` key and value heads); `out` is `[token rows,
/// heads·head_dim]`. Query head `h` reads key/value head
/// `h / (heads / kv_heads)` (grouped-query attention; `kv_heads = heads`
/// is plain multi-head attention). Scale is `scale`, else
/// `1/√head_dim`. Padded: keys with mask 0 get −∞ before the softmax,
/// and a row with none unmasked produces zeros. Packed: the keys are
/// those of the query's sequence; tail slots produce zeros.
///
/// With `bias`, [`PositionBias`] is added to every score after the
/// scaling and before the mask (MPNet), by positions within the
/// sequence. With `window` (ModernBERT's and Gemma's local layers), query
/// `i` sees only the keys `j` of its sequence with `|i − j| ≤ window`;
/// with `causal` (decoders) only those with `j ≤ i`; both may be set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    pub qkv: BufId,
    pub out: BufId,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    #[serde(default)]
    pub bias: Option<PositionBias>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<usize>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub causal: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f32>,
    pub seqs: Seqs,
}

impl Attention {
    /// Width of a `qkv` row: `(heads + 2·kv_heads)·head_dim`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The score scale: `scale`, else `1/√head_dim`.
    pub fn score_scale(&self) -> f32 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// Whether key `j` is visible to query `i` (positions in one
    /// sequence) under the window and causal masks.
    pub fn sees(&self, i: usize, j: usize) -> bool {
        (!self.causal || j <= i) && self.window.is_none_or(|w| i.abs_diff(j) <= w)
    }
}

/// For every token row `r`: `out[r] = word[ids[r]] · scale`: the
/// embedding of a model whose positions are rotary ([`Rotary`]), with no
/// position or token-type table (tail slots hold id 0 and get its row).
/// `scale` is 1, or Gemma's `√hidden`, applied in the compute dtype (the
/// scale itself rounded to it, as Gemma's `embed_scale` is).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Embed {
    pub ids: BufId,
    pub word: WeightId,
    pub out: BufId,
    pub hidden: usize,
    #[serde(default = "unit_scale", skip_serializing_if = "is_unit")]
    pub scale: f32,
    pub seqs: Seqs,
}

fn is_unit(x: &f32) -> bool {
    *x == 1.0
}

/// `out = LayerNorm(x)` over the last dimension (`hidden`), with a bias
/// only where the model has one (ModernBERT's norms have none). `out` may
/// alias `x`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerNorm {
    pub x: BufId,
    pub gamma: WeightId,
    pub beta: Option<WeightId>,
    pub eps: f32,
    pub out: BufId,
    pub rows: usize,
    pub hidden: usize,
}

/// Root-mean-square norm over the last dimension (`hidden`): `out =
/// x / √(mean(x²) + eps) · (weight_offset + gamma)`, computed in f32.
/// `weight_offset` is 0 (Qwen3, Llama) or 1 (Gemma's `1 + weight`).
/// `out` may alias `x`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RmsNorm {
    pub x: BufId,
    pub gamma: WeightId,
    pub eps: f32,
    pub weight_offset: f32,
    pub out: BufId,
    pub rows: usize,
    pub hidden: usize,
}

/// [`RmsNorm`] of every query head (with `q_gamma`) and every key head
/// (with `k_gamma`, both `[head_dim]`) of a fused `qkv` buffer, in place
/// (laid out as [`Attention`] reads it; values untouched): Qwen3's and
/// Gemma 3's `q_norm` and `k_norm`, before [`Rotary`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadRmsNorm {
    pub qkv: BufId,
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q_gamma: WeightId,
    pub k_gamma: WeightId,
    pub eps: f32,
    pub weight_offset: f32,
}

/// `into += x` over `rows × width` values: a pre-norm block's residual add.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Add {
    pub x: BufId,
    pub into: BufId,
    pub rows: usize,
    pub width: usize,
}

/// Rotary position embedding, in place on the `heads` query heads and
/// `kv_heads` key heads of a fused `qkv` buffer (laid out as
/// [`Attention`] reads it), in the
/// "rotate half" form of Hugging Face's `apply_rotary_pos_emb`: for each
/// head, `d < head_dim / 2` and the token's position `p` in its sequence,
/// with `θ_d = p · theta^(−2d / head_dim)`,
/// `x'[d] = x[d]·cos θ_d − x[d + half]·sin θ_d` and
/// `x'[d + half] = x[d + half]·cos θ_d + x[d]·sin θ_d`.
/// The angles are computed in f32, as transformers computes them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rotary {
    pub qkv: BufId,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub theta: f32,
    /// Multiplies every frequency: 1, or GTE's static NTK scaling
    /// (`factor^(−2/head_dim)`, with `theta` already `base · factor`).
    #[serde(default = "unit_scale")]
    pub scale: f32,
    /// NomicBERT's dynamic NTK scaling, decided per sequence: a sequence
    /// longer than `max_trained` tokens rotates with a larger base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic: Option<DynamicNtk>,
    pub seqs: Seqs,
}

/// `base' = θ · (factor · len / max_trained − (factor − 1))^(d / (d − 2))`
/// for a sequence of `len > max_trained` tokens (head size `d`), as
/// NomicBERT's remote code and transformers' `"dynamic"` rope compute it
/// for one unpadded sequence.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicNtk {
    pub factor: f32,
    pub max_trained: usize,
}

fn unit_scale() -> f32 {
    1.0
}

impl Rotary {
    /// The base a sequence of `len` tokens rotates with.
    pub fn theta_for(&self, len: usize) -> f32 {
        match self.dynamic {
            Some(n) if len > n.max_trained => {
                let dim = self.head_dim as f64;
                let f = n.factor as f64;
                (self.theta as f64
                    * (f * len as f64 / n.max_trained as f64 - (f - 1.0)).powf(dim / (dim - 2.0)))
                    as f32
            }
            _ => self.theta,
        }
    }

    /// [`Rotary::angle`] in a sequence of `len` tokens (the base of
    /// [`Rotary::theta_for`]).
    pub fn angle_in(&self, p: usize, len: usize, d: usize) -> (f32, f32) {
        let inv = self.scale
            / self
                .theta_for(len)
                .powf((2 * d) as f32 / self.head_dim as f32);
        let a = p as f32 * inv;
        (a.cos(), a.sin())
    }

    /// `cos θ_d` and `sin θ_d` for position `p`, as transformers computes
    /// them (inverse frequencies and their product with the position in
    /// f32).
    pub fn angle(&self, p: usize, d: usize) -> (f32, f32) {
        let inv = self.scale / self.theta.powf((2 * d) as f32 / self.head_dim as f32);
        let a = p as f32 * inv;
        (a.cos(), a.sin())
    }
}

/// Which half of a gated feed-forward projection goes through the
/// activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateOn {
    /// `act(first) · second` (ModernBERT's `Wi`: input, gate).
    First,
    /// `first · act(second)` (GTE's `up_gate_proj`: up, gate).
    Second,
}

/// A gated linear unit over a projection of twice the width: for every row
/// `r` and `j < width`, with `a = x[r, j]`, `b = x[r, width + j]`:
/// `out[r, j] = act(a) · b` ([`GateOn::First`]) or `a · act(b)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gated {
    pub x: BufId,
    pub out: BufId,
    pub rows: usize,
    pub width: usize,
    pub act: Activation,
    pub on: GateOn,
}

/// Sentence pooling: `x` `[token rows, hidden]` → `out` `[sequences,
/// hidden]` (f32), then optional L2 normalisation of each row
/// (`x / max(‖x‖, 1e-12)`). Mean: the average over the sequence's real
/// tokens (divided by `max(count, 1e-9)` as sentence-transformers
/// does); max: their element-wise maximum; sum: their sum; cls: the first
/// (padded: slot 0); last token: the last real one (padded: the last slot
/// with mask 1). A sequence with no token gives zeros (padded cls: slot 0).
///
/// With `skip` (a [`InputRole::PoolSkip`] input of one count per
/// sequence), sequence `b` pools only its tokens from index `skip[b]`
/// on: mean and max over those, cls the first of them, last token the
/// last if any is left; none left gives zeros.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    pub x: BufId,
    pub out: BufId,
    pub hidden: usize,
    pub mode: Pooling,
    pub normalize: bool,
    #[serde(default)]
    pub skip: Option<BufId>,
    pub seqs: Seqs,
}

/// Either layout: L2 normalisation of each of `rows` rows of `width`
/// values of `x`, in place (`x / max(‖x‖, 1e-12)`), e.g. after a
/// sentence-transformers `Dense` module.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Normalize {
    pub x: BufId,
    pub rows: usize,
    pub width: usize,
}

/// A model's forward pass at one shape: `batch` rows of `seq` tokens
/// (padded), or up to `batch` sequences of at most `seq` tokens in a budget
/// of `tokens` slots (packed; see [`Layout`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// Rows (padded), or most sequences (packed): the output's rows.
    pub batch: usize,
    /// Sequence length (1 for models without a sequence axis); in a packed
    /// program, the longest sequence it accepts.
    pub seq: usize,
    #[serde(default)]
    pub layout: Layout,
    pub buffers: Vec<BufferDecl>,
    pub ops: Vec<Op>,
    /// Input buffers, in the order the model's [`InputRole`]s list them.
    pub inputs: Vec<BufId>,
    /// The f32 `[batch, output_dim]` result.
    pub output: BufId,
    pub output_dim: usize,
}

impl Program {
    pub fn buffer(&self, id: BufId) -> &BufferDecl {
        &self.buffers[id.0]
    }

    /// Token slots of the program: `tokens` (packed) or `batch · seq`.
    pub fn token_slots(&self) -> usize {
        match self.layout {
            Layout::Packed { tokens } => tokens,
            Layout::Padded => self.batch * self.seq,
        }
    }

    pub fn is_packed(&self) -> bool {
        matches!(self.layout, Layout::Packed { .. })
    }

    /// The input buffer with the given role, if the program has one.
    pub fn input(&self, role: InputRole) -> Option<BufId> {
        self.inputs
            .iter()
            .copied()
            .find(|id| self.buffers[id.0].kind == BufKind::Input(role))
    }
}

/// Builds programs: hands out buffers and records ops.
#[derive(Debug, Default)]
pub struct ProgramBuilder {
    buffers: Vec<BufferDecl>,
    ops: Vec<Op>,
    inputs: Vec<BufId>,
}

impl ProgramBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn input(&mut self, name: &str, role: InputRole, elems: usize) -> BufId {
        let id = self.declare(name, BufKind::Input(role), elems);
        self.inputs.push(id);
        id
    }

    pub fn activation(&mut self, name: &str, elems: usize) -> BufId {
        self.declare(name, BufKind::Activation, elems)
    }

    pub fn output(&mut self, name: &str, elems: usize) -> BufId {
        self.declare(name, BufKind::Output, elems)
    }

    fn declare(&mut self, name: &str, kind: BufKind, elems: usize) -> BufId {
        self.buffers.push(BufferDecl {
            name: name.to_string(),
            kind,
            elems,
        });
        BufId(self.buffers.len() - 1)
    }

    pub fn push(&mut self, op: impl Into<Op>) {
        self.ops.push(op.into());
    }

    pub fn finish(self, batch: usize, seq: usize, output: BufId, output_dim: usize) -> Program {
        self.finish_layout(batch, seq, Layout::Padded, output, output_dim)
    }

    /// A packed program of `tokens` slots, at most `seqs` sequences of at
    /// most `max_seq_len` tokens.
    pub fn finish_packed(
        self,
        tokens: usize,
        seqs: usize,
        max_seq_len: usize,
        output: BufId,
        output_dim: usize,
    ) -> Program {
        self.finish_layout(
            seqs,
            max_seq_len,
            Layout::Packed { tokens },
            output,
            output_dim,
        )
    }

    fn finish_layout(
        self,
        batch: usize,
        seq: usize,
        layout: Layout,
        output: BufId,
        output_dim: usize,
    ) -> Program {
        Program {
            batch,
            seq,
            layout,
            buffers: self.buffers,
            ops: self.ops,
            inputs: self.inputs,
            output,
            output_dim,
        }
    }
}

/// `x[batch, 4] → Linear(3, no bias) → y`, zero weights: the smallest
/// well-formed feature program (tests).
#[cfg(test)]
pub(crate) fn one_linear(batch: usize) -> (Program, crate::model::Weights) {
    let mut w = crate::model::Weights::new();
    let w1 = w.push("w", vec![3, 4], vec![0.0; 12]);
    let mut b = ProgramBuilder::new();
    let x = b.input("x", InputRole::Features, batch * 4);
    let y = b.output("y", batch * 3);
    b.push(Linear {
        x,
        w: w1,
        bias: None,
        act: Activation::Identity,
        out: y,
        m: batch,
        n: 3,
        k: 4,
    });
    (b.finish(batch, 1, y, 3), w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_match_known_values() {
        assert_eq!(Activation::Relu.apply(-2.0), 0.0);
        assert!((Activation::Gelu.apply(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-5);
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((erf_f64(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
        assert_eq!(Activation::parse("GELU"), Some(Activation::Gelu));
        assert_eq!(Activation::parse("mish"), None);
    }
}
