//! What the planner's tests share: small programs built by the real
//! builders (MiniLM-shaped BERT encoders, the seed-sized MLP, the family
//! test folders), decoders (Qwen3- and EmbeddingGemma-shaped) built op by
//! op as `src/model/bert/decoder.rs` builds them ([`TinyDecoder`]), and
//! readers of a plan's steps.

pub(crate) use super::*;
pub(crate) use crate::config::KernelPath;
use crate::model::bert::{BertArch, SyntheticSizes};
pub(crate) use crate::model::program::*;
pub(crate) use crate::model::{Program, Weights};
pub(crate) use crate::tensor::DType;

/// Every path on, an H200's shared memory.
pub(crate) const LIMITS: Limits = Limits::new(227 * 1024);

/// `program` planned for `dtype` (no TF32) with `limits`.
pub(crate) fn planned(program: &Program, weights: &Weights, dtype: DType, limits: Limits) -> Plan {
    super::plan(program, weights, dtype, false, limits).unwrap()
}

pub(crate) fn mlp(batch: usize, act: Activation) -> (Program, Weights) {
    let mut w = Weights::new();
    let w1 = w.push("0.weight", vec![256, 128], vec![0.0; 256 * 128]);
    let b1 = w.push("0.bias", vec![256], vec![0.0; 256]);
    let w2 = w.push("2.weight", vec![10, 256], vec![0.0; 2560]);
    let b2 = w.push("2.bias", vec![10], vec![0.0; 10]);
    let mut b = ProgramBuilder::new();
    let x = b.input("x", InputRole::Features, batch * 128);
    let h = b.activation("h", batch * 256);
    let y = b.output("y", batch * 10);
    b.push(Linear {
        x,
        w: w1,
        bias: Some(b1),
        act,
        out: h,
        m: batch,
        n: 256,
        k: 128,
    });
    b.push(Linear {
        x: h,
        w: w2,
        bias: Some(b2),
        act: Activation::Identity,
        out: y,
        m: batch,
        n: 10,
        k: 256,
    });
    (b.finish(batch, 1, y, 10), w)
}

/// A one-layer BERT program (MiniLM sizes) for planner tests.
pub(crate) fn tiny_bert(batch: usize, seq: usize) -> (Program, Weights) {
    bert_dims(batch, seq, 384, 12, 1536)
}

/// A one-layer BERT program of the given widths at (`batch`, `seq`).
pub(crate) fn bert_dims(
    batch: usize,
    seq: usize,
    hidden: usize,
    heads: usize,
    inter: usize,
) -> (Program, Weights) {
    let (arch, w) = bert_arch(1, hidden, heads, inter);
    (arch.program(batch, seq), w)
}

/// A one-layer packed BERT program: `tokens` slots, at most `seqs`
/// sequences of at most `max_len` tokens.
pub(crate) fn packed_bert_dims(
    tokens: usize,
    seqs: usize,
    max_len: usize,
    hidden: usize,
    heads: usize,
    inter: usize,
) -> (Program, Weights) {
    let (arch, w) = bert_arch(1, hidden, heads, inter);
    let p = arch.packed_program_upto(tokens, seqs, max_len);
    p.validate(&w).unwrap();
    (p, w)
}

/// MiniLM's program, from the real builder ([`BertArch`]), with zero
/// weights of its shapes: `layers` layers of hidden 384, 12 heads of 32,
/// FFN 1536, exact GELU, mean pooling, normalised (a vocabulary of 1,000
/// instead of 30,522, to keep the tests small).
pub(crate) fn minilm(layers: usize) -> (BertArch, Weights) {
    bert_arch(layers, 384, 12, 1536)
}

/// A BERT encoder of `layers` layers of `hidden` wide with `heads` heads
/// and an FFN of `inter`, zero weights, built as [`minilm`] is.
pub(crate) fn bert_arch(
    layers: usize,
    hidden: usize,
    heads: usize,
    intermediate: usize,
) -> (BertArch, Weights) {
    let mut w = Weights::new();
    let sizes = SyntheticSizes {
        layers,
        hidden,
        heads,
        intermediate,
        vocab: 1000,
        positions: 512,
        max_seq_len: 256,
        pooling: Pooling::Mean,
        normalize: true,
    };
    let arch = BertArch::synthetic(sizes, |name, shape| {
        let n = shape.iter().product();
        w.push(name, shape, vec![0.0; n])
    });
    (arch, w)
}

pub(crate) fn kernel<'p>(
    plan: &'p Plan,
    prefix: &str,
) -> (&'p str, (u32, u32, u32), u32, u32, &'p [Arg]) {
    plan.steps
        .iter()
        .find_map(|s| match s {
            Step::Kernel {
                name,
                grid,
                block,
                smem,
                args,
            } if name.starts_with(prefix) => {
                Some((name.as_str(), *grid, block.0, *smem, args.as_slice()))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no {prefix} kernel in {:?}", plan.step_names()))
}

/// Step names: `first`, `layer` `layers` times, `last`.
pub(crate) fn layers_between(
    first: &str,
    layers: usize,
    layer: &[&str],
    last: &str,
) -> Vec<String> {
    let mut names = vec![first.to_string()];
    for _ in 0..layers {
        names.extend(layer.iter().map(|s| s.to_string()));
    }
    names.push(last.to_string());
    names
}

/// Issue 13's test folders (tests/data/models), loaded as the daemon
/// loads them.
pub(crate) const FAMILY_FOLDERS: [&str; 9] = [
    "bert-st-new",
    "bert-st-old",
    "xlmr-st",
    "mpnet-st",
    "distilbert-st",
    "bert-cross-encoder",
    "bert-cross-encoder-legacy",
    "bert-cross-encoder-v4",
    "xlmr-cross-encoder",
];

pub(crate) fn family_model(name: &str) -> crate::model::Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/models")
        .join(name);
    let spec = crate::model::ModelSpec::new(name, crate::model::ModelKind::Bert, dir);
    crate::model::Model::load(&spec).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The programs the daemon captures for a folder: padded buckets up to
/// its longest sequence and packed budgets (few tokens, where the fused
/// sublayers apply, and many).
pub(crate) fn family_programs(model: &crate::model::Model) -> Vec<(String, Program)> {
    let crate::model::Architecture::Bert(arch) = &model.arch else {
        panic!("not a BERT-family model")
    };
    let max = arch.max_seq_len;
    let mut v = Vec::new();
    for (b, sq) in [(1, 16), (4, 64), (32, 128), (2, max)] {
        let sq = sq.min(max);
        v.push((format!("({b}, {sq})"), model.program(b, sq)));
    }
    for (tokens, seqs) in [(16, 1), (64, 4), (1024, 32)] {
        v.push((
            format!("{tokens}t/{seqs}"),
            arch.packed_program(tokens, seqs),
        ));
    }
    v
}

/// Asserts that `kernels/<file>` defines each `NAME` as `value`
/// (`#define NAME value`, a comment may follow): the host's constants and
/// the kernels' agree.
pub(crate) fn assert_defines(file: &str, defines: &[(&str, i64)]) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("kernels")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for &(name, value) in defines {
        let found = text.lines().any(|l| {
            let mut w = l.split_whitespace();
            (w.next(), w.next(), w.next())
                == (Some("#define"), Some(name), Some(&value.to_string()))
        });
        assert!(found, "{file} does not define {name} as {value}");
    }
}

/// The shape of a hand-built decoder (Qwen3 / EmbeddingGemma style) for
/// the planner's tests.
#[derive(Clone, Debug)]
pub(crate) struct TinyDecoder {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub causal: bool,
    /// Layer 0's sliding window (the others are global).
    pub window: Option<usize>,
    pub scale: Option<f32>,
    pub embed_scale: f32,
    pub norm_offset: f32,
    /// Gemma's RMSNorms on the attention's and the MLP's outputs.
    pub post_norms: bool,
    pub pooling: Pooling,
    pub skip: bool,
}

impl TinyDecoder {
    /// Qwen3-Embedding-0.6B's shapes (one layer): 16 query heads over 8
    /// key/value heads of 128, causal, last-token pooling.
    pub(crate) fn qwen3() -> TinyDecoder {
        TinyDecoder {
            layers: 1,
            hidden: 1024,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            inter: 3072,
            causal: true,
            window: None,
            scale: None,
            embed_scale: 1.0,
            norm_offset: 0.0,
            post_norms: false,
            pooling: Pooling::LastToken,
            skip: false,
        }
    }

    /// EmbeddingGemma-300m's shapes (two layers, the first local): 3 query
    /// heads over one key/value head of 256, bidirectional, its scales and
    /// post-norms, mean pooling.
    pub(crate) fn gemma() -> TinyDecoder {
        TinyDecoder {
            layers: 2,
            hidden: 768,
            heads: 3,
            kv_heads: 1,
            head_dim: 256,
            inter: 1152,
            causal: false,
            window: Some(256),
            scale: Some(256f32.powf(-0.5)),
            embed_scale: 768f32.sqrt(),
            norm_offset: 1.0,
            post_norms: true,
            pooling: Pooling::Mean,
            skip: false,
        }
    }

    /// The program at `batch` rows of `seq` (padded), or (`packed`) over
    /// `batch` slots holding up to `seq` sequences, with zero weights.
    pub(crate) fn build(&self, batch: usize, seq: usize, packed: bool) -> (Program, Weights) {
        let mut w = Weights::new();
        let mut weight = |name: &str, shape: Vec<usize>| {
            let n = shape.iter().product();
            w.push(name, shape, vec![0.0; n])
        };
        let (h, i) = (self.hidden, self.inter);
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        let qkv_width = (heads + 2 * kv_heads) * d;
        let word = weight("embed", vec![1000, h]);
        let mut b = ProgramBuilder::new();
        let (rows, count, seqs, ids) = if packed {
            let (tokens, nseqs) = (batch, seq);
            let ids = b.input("input_ids", InputRole::TokenIds, tokens);
            let positions = b.input("position_ids", InputRole::Positions, tokens);
            let offsets = b.input("cu_seqlens", InputRole::SeqOffsets, nseqs + 1);
            let seqs = Seqs::Packed {
                offsets,
                positions,
                tokens,
                seqs: nseqs,
                max_seq_len: tokens,
            };
            (tokens, nseqs, seqs, ids)
        } else {
            let ids = b.input("input_ids", InputRole::TokenIds, batch * seq);
            let mask = b.input("attention_mask", InputRole::AttentionMask, batch * seq);
            (batch * seq, batch, Seqs::Padded { mask, batch, seq }, ids)
        };
        let skip = self
            .skip
            .then(|| b.input("pool_skip", InputRole::PoolSkip, count));
        let hidden = b.activation("hidden", rows * h);
        let normed = b.activation("normed", rows * h);
        let qkv = b.activation("qkv", rows * qkv_width);
        let context = b.activation("context", rows * heads * d);
        let proj = b.activation("proj", rows * h);
        let wide = b.activation("wide", rows * 2 * i);
        let gated = b.activation("gated", rows * i);
        let out = b.output("embedding", count * h);
        b.push(Embed {
            ids,
            word,
            out: hidden,
            hidden: h,
            scale: self.embed_scale,
            seqs,
        });
        let norm = |x, out, gamma| RmsNorm {
            x,
            gamma,
            eps: 1e-6,
            weight_offset: self.norm_offset,
            out,
            rows,
            hidden: h,
        };
        let linear = |x, w, out, n, k| Linear {
            x,
            w,
            bias: None,
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
        for l in 0..self.layers {
            let g = weight(&format!("{l}.input_norm"), vec![h]);
            b.push(norm(hidden, normed, g));
            let wqkv = weight(&format!("{l}.qkv"), vec![qkv_width, h]);
            b.push(linear(normed, wqkv, qkv, qkv_width, h));
            let q_gamma = weight(&format!("{l}.q_norm"), vec![d]);
            let k_gamma = weight(&format!("{l}.k_norm"), vec![d]);
            b.push(HeadRmsNorm {
                qkv,
                rows,
                heads,
                kv_heads,
                head_dim: d,
                q_gamma,
                k_gamma,
                eps: 1e-6,
                weight_offset: self.norm_offset,
            });
            b.push(Rotary {
                qkv,
                heads,
                kv_heads,
                head_dim: d,
                theta: 1e6,
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
                window: if l == 0 { self.window } else { None },
                causal: self.causal,
                scale: self.scale,
                seqs,
            });
            let wo = weight(&format!("{l}.o"), vec![h, heads * d]);
            b.push(linear(context, wo, proj, h, heads * d));
            if self.post_norms {
                let g = weight(&format!("{l}.post_attention_norm"), vec![h]);
                b.push(norm(proj, proj, g));
            }
            b.push(add.clone());
            let g = weight(&format!("{l}.mlp_norm"), vec![h]);
            b.push(norm(hidden, normed, g));
            let wgu = weight(&format!("{l}.gate_up"), vec![2 * i, h]);
            b.push(linear(normed, wgu, wide, 2 * i, h));
            b.push(Gated {
                x: wide,
                out: gated,
                rows,
                width: i,
                act: Activation::Silu,
                on: GateOn::First,
            });
            let wd = weight(&format!("{l}.down"), vec![h, i]);
            b.push(linear(gated, wd, proj, h, i));
            if self.post_norms {
                let g = weight(&format!("{l}.post_mlp_norm"), vec![h]);
                b.push(norm(proj, proj, g));
            }
            b.push(add.clone());
        }
        let g = weight("final_norm", vec![h]);
        b.push(norm(hidden, hidden, g));
        b.push(Pool {
            x: hidden,
            out,
            hidden: h,
            mode: self.pooling,
            normalize: true,
            skip,
            seqs,
        });
        let p = if packed {
            b.finish_packed(batch, seq, batch, out, h)
        } else {
            b.finish(batch, seq, out, h)
        };
        p.validate(&w).unwrap_or_else(|e| panic!("{self:?}: {e}"));
        (p, w)
    }
}
