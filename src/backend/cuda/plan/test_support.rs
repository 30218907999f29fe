//! What the planner's tests share: small programs built by the real
//! builders (MiniLM-shaped BERT encoders, the seed-sized MLP, the family
//! test folders), and readers of a plan's steps.

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
