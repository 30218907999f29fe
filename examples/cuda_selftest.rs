//! CUDA backend self-test on synthetic models (no model files needed): every
//! kernel and the graph/eager paths against an f64 reference interpreter of
//! the Program IR (padded and packed programs: the varlen attention for every
//! head-size class, on tensor cores and CUDA cores, packed graphs replayed
//! with batches of changing shapes), replay latency and per-step GPU time on
//! a MiniLM-shaped model (padded and packed), NVML, and (with `--fault`, in
//! its own process) fault injection. Decoders (Qwen3- and EmbeddingGemma-
//! shaped: grouped-query heads, causal and windowed masks, head sizes 32 to
//! 256, RMSNorm and the q/k norms with rotary, last-token pooling, one
//! sequence of 2,048 tokens) against the same reference, and per-step GPU
//! time of Qwen3-0.6B- and EmbeddingGemma-shaped layers (`--decoders-only`:
//! just those).
//!
//! Usage (GPU machine):
//!   cuda_selftest [--gpu 0] [--iters 500] [--json out.json] [--packed-only | --decoders-only]
//!   cuda_selftest --fault [--gpu 0]
//!
//! Exit status: 0 all pass, 1 a failure, 2 no usable GPU.

#![allow(clippy::type_complexity)]

use std::time::Instant;

use replayd::backend::cuda::{CudaBackend, CudaOptions};
use replayd::backend::{Backend, BackendError};
use replayd::gpu::{self, nvml};
use replayd::model::program::{
    Add, AddLayerNorm, Attention, BufId, Embed, EmbedLayerNorm, GateOn, Gated, HeadRmsNorm,
    InputRole, Linear, Pool, ProgramBuilder, RmsNorm, Rotary, Seqs, WeightId,
};
use replayd::model::{Activation, BatchRows, Pooling, Program, Weights};
use replayd::tensor::DType;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

struct Mlp {
    weights: Weights,
    layers: Vec<(WeightId, Option<WeightId>, Activation, usize, usize)>,
}

fn mlp(dims: &[usize], acts: &[Activation], bias: &[bool], rng: &mut Rng) -> Mlp {
    let mut w = Weights::new();
    let mut layers = Vec::new();
    for i in 0..dims.len() - 1 {
        let (k, n) = (dims[i], dims[i + 1]);
        let wid = w.push(
            format!("{i}.weight"),
            vec![n, k],
            rng.vec(n * k, 1.0 / (k as f32).sqrt()),
        );
        let b = bias[i].then(|| w.push(format!("{i}.bias"), vec![n], rng.vec(n, 0.1)));
        layers.push((wid, b, acts[i], k, n));
    }
    Mlp { weights: w, layers }
}

fn mlp_program(m: &Mlp, batch: usize) -> Program {
    let mut b = ProgramBuilder::new();
    let x = b.input("x", InputRole::Features, batch * m.layers[0].3);
    let last = m.layers.len() - 1;
    let out_dim = m.layers[last].4;
    let y = b.output("y", batch * out_dim);
    let mut cur = x;
    for (i, &(w, bias, act, k, n)) in m.layers.iter().enumerate() {
        let out = if i == last {
            y
        } else {
            b.activation(&format!("h{i}"), batch * n)
        };
        b.push(Linear {
            x: cur,
            w,
            bias,
            act,
            out,
            m: batch,
            n,
            k,
        });
        cur = out;
    }
    b.finish(batch, 1, y, out_dim)
}

#[derive(Clone, Copy)]
struct BertDims {
    hidden: usize,
    heads: usize,
    inter: usize,
    layers: usize,
    vocab: usize,
    pooling: Pooling,
    normalize: bool,
    act: Activation,
}

struct Bert {
    d: BertDims,
    weights: Weights,
    emb: [WeightId; 5],
    layers: Vec<[WeightId; 12]>,
}

fn bert(d: BertDims, rng: &mut Rng) -> Bert {
    let h = d.hidden;
    let mut w = Weights::new();
    let ln = |w: &mut Weights, name: &str, rng: &mut Rng| {
        let g = w.push(
            format!("{name}.g"),
            vec![h],
            (0..h).map(|_| 1.0 + 0.1 * rng.unit()).collect(),
        );
        let b = w.push(format!("{name}.b"), vec![h], rng.vec(h, 0.1));
        (g, b)
    };
    let word = w.push("word", vec![d.vocab, h], rng.vec(d.vocab * h, 0.5));
    let pos = w.push("pos", vec![512, h], rng.vec(512 * h, 0.2));
    let tt = w.push("tt", vec![2, h], rng.vec(2 * h, 0.2));
    let (g, b) = ln(&mut w, "emb", rng);
    let emb = [word, pos, tt, g, b];
    let mut layers = Vec::new();
    for l in 0..d.layers {
        let s = |k: usize| 1.0 / (k as f32).sqrt();
        let qkv = w.push(format!("{l}.qkv"), vec![3 * h, h], rng.vec(3 * h * h, s(h)));
        let qkvb = w.push(format!("{l}.qkv.b"), vec![3 * h], rng.vec(3 * h, 0.1));
        let o = w.push(format!("{l}.o"), vec![h, h], rng.vec(h * h, s(h)));
        let ob = w.push(format!("{l}.o.b"), vec![h], rng.vec(h, 0.1));
        let (g1, b1) = ln(&mut w, &format!("{l}.ln1"), rng);
        let i = w.push(
            format!("{l}.i"),
            vec![d.inter, h],
            rng.vec(d.inter * h, s(h)),
        );
        let ib = w.push(format!("{l}.i.b"), vec![d.inter], rng.vec(d.inter, 0.1));
        let o2 = w.push(
            format!("{l}.o2"),
            vec![h, d.inter],
            rng.vec(d.inter * h, s(d.inter)),
        );
        let o2b = w.push(format!("{l}.o2.b"), vec![h], rng.vec(h, 0.1));
        let (g2, b2) = ln(&mut w, &format!("{l}.ln2"), rng);
        layers.push([qkv, qkvb, o, ob, g1, b1, i, ib, o2, o2b, g2, b2]);
    }
    Bert {
        d,
        weights: w,
        emb,
        layers,
    }
}

fn bert_program(m: &Bert, batch: usize, seq: usize) -> Program {
    let rows = batch * seq;
    let mut b = ProgramBuilder::new();
    let ids = b.input("ids", InputRole::TokenIds, rows);
    let mask = b.input("mask", InputRole::AttentionMask, rows);
    let types = b.input("types", InputRole::TokenTypeIds, rows);
    let seqs = Seqs::Padded { mask, batch, seq };
    let out = bert_ops(&mut b, m, seqs, ids, types);
    b.finish(batch, seq, out, m.d.hidden)
}

/// [`bert_program`] packed: `tokens` slots, at most `seqs` sequences of at
/// most `max_len` tokens.
fn packed_bert_program(m: &Bert, tokens: usize, seqs: usize, max_len: usize) -> Program {
    let mut b = ProgramBuilder::new();
    let ids = b.input("ids", InputRole::TokenIds, tokens);
    let types = b.input("types", InputRole::TokenTypeIds, tokens);
    let positions = b.input("positions", InputRole::Positions, tokens);
    let offsets = b.input("offsets", InputRole::SeqOffsets, seqs + 1);
    let layout = Seqs::Packed {
        offsets,
        positions,
        tokens,
        seqs,
        max_seq_len: max_len,
    };
    let out = bert_ops(&mut b, m, layout, ids, types);
    b.finish_packed(tokens, seqs, max_len, out, m.d.hidden)
}

/// The encoder of `m` over the token rows of `seqs`: embedding, layers,
/// pooling; returns the output buffer.
fn bert_ops(b: &mut ProgramBuilder, m: &Bert, seqs: Seqs, ids: BufId, types: BufId) -> BufId {
    let d = m.d;
    let (h, rows) = (d.hidden, seqs.token_rows());
    let hid = b.activation("h", rows * h);
    let qkv = b.activation("qkv", rows * 3 * h);
    let ctx = b.activation("ctx", rows * h);
    let inter = b.activation("inter", rows * d.inter);
    let out = b.output("out", seqs.count() * h);
    let [word, pos, tt, g, be] = m.emb;
    b.push(EmbedLayerNorm {
        position_ids: Default::default(),
        ids,
        token_types: types,
        word,
        position: pos,
        token_type: tt,
        gamma: g,
        beta: be,
        eps: 1e-12,
        out: hid,
        hidden: h,
        seqs,
    });
    for l in &m.layers {
        let [wq, bq, wo, bo, g1, b1, wi, bi, wo2, bo2, g2, b2] = *l;
        b.push(Linear {
            x: hid,
            w: wq,
            bias: Some(bq),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: 3 * h,
            k: h,
        });
        b.push(Attention {
            bias: None,
            window: None,
            causal: false,
            scale: None,
            qkv,
            out: ctx,
            heads: d.heads,
            kv_heads: d.heads,
            head_dim: h / d.heads,
            seqs,
        });
        b.push(Linear {
            x: ctx,
            w: wo,
            bias: Some(bo),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: h,
            k: h,
        });
        b.push(AddLayerNorm {
            x: qkv,
            residual: hid,
            gamma: g1,
            beta: b1,
            eps: 1e-12,
            out: hid,
            rows,
            hidden: h,
        });
        b.push(Linear {
            x: hid,
            w: wi,
            bias: Some(bi),
            act: d.act,
            out: inter,
            m: rows,
            n: d.inter,
            k: h,
        });
        b.push(Linear {
            x: inter,
            w: wo2,
            bias: Some(bo2),
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: h,
            k: d.inter,
        });
        b.push(AddLayerNorm {
            x: qkv,
            residual: hid,
            gamma: g2,
            beta: b2,
            eps: 1e-12,
            out: hid,
            rows,
            hidden: h,
        });
    }
    b.push(Pool {
        skip: None,
        x: hid,
        out,
        hidden: h,
        mode: d.pooling,
        normalize: d.normalize,
        seqs,
    });
    out
}

/// A decoder embedding model's shape (Qwen3 / EmbeddingGemma style).
#[derive(Clone, Copy, Debug)]
struct DecDims {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    layers: usize,
    vocab: usize,
    causal: bool,
    /// The even layers' sliding window (the odd ones are global).
    window: Option<usize>,
    scale: Option<f32>,
    embed_scale: f32,
    /// RMSNorm weight offset: 0 (Qwen3) or 1 (Gemma).
    offset: f32,
    /// Gemma's norms after attention and the MLP.
    post_norms: bool,
    pooling: Pooling,
    act: Activation,
}

struct Dec {
    d: DecDims,
    weights: Weights,
    word: WeightId,
    /// input norm, qkv, q norm, k norm, o, post-attention norm, MLP norm,
    /// gate|up, down, post-MLP norm.
    layers: Vec<[WeightId; 10]>,
    final_norm: WeightId,
}

fn decoder(d: DecDims, rng: &mut Rng) -> Dec {
    let (h, i, hd) = (d.hidden, d.inter, d.heads * d.head_dim);
    let qkv_w = (d.heads + 2 * d.kv_heads) * d.head_dim;
    let mut w = Weights::new();
    let norm = |w: &mut Weights, name: String, n: usize, rng: &mut Rng| {
        let base = 1.0 - d.offset;
        w.push(
            name,
            vec![n],
            (0..n).map(|_| base + 0.2 * rng.unit()).collect(),
        )
    };
    let s = |k: usize| 1.0 / (k as f32).sqrt();
    let word = w.push("word", vec![d.vocab, h], rng.vec(d.vocab * h, 0.5));
    let mut layers = Vec::new();
    for l in 0..d.layers {
        let input = norm(&mut w, format!("{l}.in"), h, rng);
        let qkv = w.push(format!("{l}.qkv"), vec![qkv_w, h], rng.vec(qkv_w * h, s(h)));
        let qn = norm(&mut w, format!("{l}.qn"), d.head_dim, rng);
        let kn = norm(&mut w, format!("{l}.kn"), d.head_dim, rng);
        let o = w.push(format!("{l}.o"), vec![h, hd], rng.vec(h * hd, s(hd)));
        let pa = norm(&mut w, format!("{l}.pa"), h, rng);
        let mn = norm(&mut w, format!("{l}.mn"), h, rng);
        let gu = w.push(format!("{l}.gu"), vec![2 * i, h], rng.vec(2 * i * h, s(h)));
        let down = w.push(format!("{l}.down"), vec![h, i], rng.vec(h * i, s(i)));
        let pm = norm(&mut w, format!("{l}.pm"), h, rng);
        layers.push([input, qkv, qn, kn, o, pa, mn, gu, down, pm]);
    }
    let final_norm = norm(&mut w, "final".into(), h, rng);
    Dec {
        d,
        weights: w,
        word,
        layers,
        final_norm,
    }
}

fn decoder_program(m: &Dec, batch: usize, seq: usize) -> Program {
    let mut b = ProgramBuilder::new();
    let ids = b.input("ids", InputRole::TokenIds, batch * seq);
    let mask = b.input("mask", InputRole::AttentionMask, batch * seq);
    let out = decoder_ops(&mut b, m, Seqs::Padded { mask, batch, seq }, ids);
    b.finish(batch, seq, out, m.d.hidden)
}

fn packed_decoder_program(m: &Dec, tokens: usize, seqs: usize, max_len: usize) -> Program {
    let mut b = ProgramBuilder::new();
    let ids = b.input("ids", InputRole::TokenIds, tokens);
    let positions = b.input("positions", InputRole::Positions, tokens);
    let offsets = b.input("offsets", InputRole::SeqOffsets, seqs + 1);
    let layout = Seqs::Packed {
        offsets,
        positions,
        tokens,
        seqs,
        max_seq_len: max_len,
    };
    let out = decoder_ops(&mut b, m, layout, ids);
    b.finish_packed(tokens, seqs, max_len, out, m.d.hidden)
}

/// The decoder's forward pass as src/model/bert/decoder.rs builds it.
fn decoder_ops(b: &mut ProgramBuilder, m: &Dec, seqs: Seqs, ids: BufId) -> BufId {
    let d = m.d;
    let (h, i, rows) = (d.hidden, d.inter, seqs.token_rows());
    let (heads, kv_heads, hdim) = (d.heads, d.kv_heads, d.head_dim);
    let qkv_w = (heads + 2 * kv_heads) * hdim;
    let hidden = b.activation("hidden", rows * h);
    let normed = b.activation("normed", rows * h);
    let qkv = b.activation("qkv", rows * qkv_w);
    let ctx = b.activation("ctx", rows * heads * hdim);
    let proj = b.activation("proj", rows * h);
    let wide = b.activation("wide", rows * 2 * i);
    let gated = b.activation("gated", rows * i);
    let out = b.output("out", seqs.count() * h);
    let norm = |x, out, gamma| RmsNorm {
        x,
        gamma,
        eps: 1e-6,
        weight_offset: d.offset,
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
    b.push(Embed {
        ids,
        word: m.word,
        out: hidden,
        hidden: h,
        scale: d.embed_scale,
        seqs,
    });
    for (l, w) in m.layers.iter().enumerate() {
        let [input, wqkv, qn, kn, wo, pa, mn, gu, down, pm] = *w;
        b.push(norm(hidden, normed, input));
        b.push(linear(normed, wqkv, qkv, qkv_w, h));
        b.push(HeadRmsNorm {
            qkv,
            rows,
            heads,
            kv_heads,
            head_dim: hdim,
            q_gamma: qn,
            k_gamma: kn,
            eps: 1e-6,
            weight_offset: d.offset,
        });
        b.push(Rotary {
            qkv,
            heads,
            kv_heads,
            head_dim: hdim,
            theta: if l % 2 == 0 { 10000.0 } else { 1e6 },
            scale: 1.0,
            dynamic: None,
            seqs,
        });
        b.push(Attention {
            qkv,
            out: ctx,
            heads,
            kv_heads,
            head_dim: hdim,
            bias: None,
            window: if l % 2 == 0 { d.window } else { None },
            causal: d.causal,
            scale: d.scale,
            seqs,
        });
        b.push(linear(ctx, wo, proj, h, heads * hdim));
        if d.post_norms {
            b.push(norm(proj, proj, pa));
        }
        b.push(add.clone());
        b.push(norm(hidden, normed, mn));
        b.push(linear(normed, gu, wide, 2 * i, h));
        b.push(Gated {
            x: wide,
            out: gated,
            rows,
            width: i,
            act: d.act,
            on: GateOn::First,
        });
        b.push(linear(gated, down, proj, h, i));
        if d.post_norms {
            b.push(norm(proj, proj, pm));
        }
        b.push(add.clone());
    }
    b.push(norm(hidden, hidden, m.final_norm));
    b.push(Pool {
        x: hidden,
        out,
        hidden: h,
        mode: d.pooling,
        normalize: true,
        skip: None,
        seqs,
    });
    out
}

/// Decoders against the f64 reference: every mask (causal, windowed, both,
/// neither), grouped-query heads, head sizes 32 to 256 (tensor cores in
/// f16/bf16, the warp per query in f32), padded and packed, one sequence of
/// 2,048 tokens; then per-step GPU time of Qwen3-0.6B- and
/// EmbeddingGemma-shaped layers.
fn decoder_checks(
    gpu: &mut CudaBackend,
    rep: &mut Report,
    rng: &mut Rng,
) -> Result<(), BackendError> {
    println!("== decoders (Qwen3 / EmbeddingGemma-shaped)");
    let qwen = DecDims {
        hidden: 256,
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        inter: 512,
        layers: 2,
        vocab: 1000,
        causal: true,
        window: None,
        scale: None,
        embed_scale: 1.0,
        offset: 0.0,
        post_norms: false,
        pooling: Pooling::LastToken,
        act: Activation::Silu,
    };
    let gemma = DecDims {
        heads: 3,
        kv_heads: 1,
        head_dim: 256,
        inter: 384,
        causal: false,
        window: Some(7),
        scale: Some(0.07),
        embed_scale: 16.0,
        offset: 1.0,
        post_norms: true,
        pooling: Pooling::Mean,
        act: Activation::GeluTanh,
        ..qwen
    };
    let cases = [
        ("qwen3-like d128 gqa4 causal", qwen),
        ("gemma-like d256 gqa3 window", gemma),
        (
            "d64 mha causal+window",
            DecDims {
                heads: 4,
                kv_heads: 4,
                head_dim: 64,
                window: Some(5),
                ..qwen
            },
        ),
        (
            "d32 gqa2 bidirectional",
            DecDims {
                heads: 8,
                kv_heads: 4,
                head_dim: 32,
                causal: false,
                pooling: Pooling::Mean,
                ..qwen
            },
        ),
        (
            "d256 gqa3 causal+window",
            DecDims {
                causal: true,
                pooling: Pooling::LastToken,
                ..gemma
            },
        ),
    ];
    let dtypes = [
        (DType::F32, 0.99999),
        (DType::F16, 0.999),
        (DType::BF16, 0.99),
    ];
    for (label, d) in cases {
        let m = decoder(d, rng);
        for (b, s, n) in [(1usize, 16usize, 1usize), (3, 100, 3), (2, 256, 2)] {
            let rows = token_rows(n, s, d.vocab, rng);
            for (dt, th) in dtypes {
                let p = decoder_program(&m, b, s);
                let name = format!("{label} b{b} s{s} ({n} rows) {dt}");
                run_case(gpu, rep, &name, &m.weights, dt, &p, &rows, true, th, false)?;
            }
        }
        let (tokens, seqs, max_len) = (512, 8, 300);
        let batches = vec![
            packed_rows(&fill_lens(tokens, seqs, max_len, rng), d.vocab, rng),
            packed_rows(&[1], d.vocab, rng),
            packed_rows(&[max_len, 0, 65, 1], d.vocab, rng),
            packed_rows(&fill_lens(tokens - 7, seqs - 1, max_len, rng), d.vocab, rng),
        ];
        for (dt, th) in dtypes {
            let p = packed_decoder_program(&m, tokens, seqs, max_len);
            let name = format!("{label} packed {tokens}t/{seqs}s/<={max_len} {dt}");
            run_packed_sequence(gpu, rep, &name, &m.weights, dt, &p, &batches, th)?;
        }
    }
    // One long sequence (no score matrix anywhere: the band kernels stream
    // the keys), padded and packed.
    let long = decoder(
        DecDims {
            heads: 4,
            kv_heads: 1,
            layers: 1,
            ..qwen
        },
        rng,
    );
    for (dt, th) in [(DType::F16, 0.999), (DType::BF16, 0.99)] {
        let p = decoder_program(&long, 1, 2048);
        let rows = token_rows(1, 2048, qwen.vocab, rng);
        run_case(
            gpu,
            rep,
            &format!("qwen3-like s2048 {dt}"),
            &long.weights,
            dt,
            &p,
            &rows,
            true,
            th,
            false,
        )?;
        let p = packed_decoder_program(&long, 4096, 4, 2048);
        let batches = vec![packed_rows(&[2048, 1500, 500, 48], qwen.vocab, rng)];
        run_packed_sequence(
            gpu,
            rep,
            &format!("qwen3-like packed 4096t {dt}"),
            &long.weights,
            dt,
            &p,
            &batches,
            th,
        )?;
    }
    // Per-step GPU time of real shapes (two layers, a small vocabulary).
    let shapes = [
        (
            "qwen3-0.6b-shaped",
            DecDims {
                hidden: 1024,
                heads: 16,
                kv_heads: 8,
                inter: 3072,
                ..qwen
            },
            DType::F16,
        ),
        (
            "embeddinggemma-shaped",
            DecDims {
                hidden: 768,
                inter: 1152,
                window: Some(256),
                ..gemma
            },
            DType::BF16,
        ),
    ];
    for (label, d, dt) in shapes {
        let m = decoder(d, rng);
        let gw = gpu.upload_weights(&m.weights, dt)?;
        for (b, s) in [(1usize, 16usize), (8, 512), (1, 8192)] {
            let prof = gpu.profile_program(&m.weights, &gw, &decoder_program(&m, b, s), 10)?;
            let total: f64 = prof.iter().map(|p| p.1).sum();
            println!(
                "  PROFILE {label} {dt} ({b},{s}): {} steps, sum {total:.1} us",
                prof.len()
            );
            for (name, us) in &prof {
                println!("    {us:8.2} us  {name}");
            }
            rep.json.push(
                serde_json::json!({"profile": format!("{label} {dt} ({b},{s})"), "steps": prof}),
            );
        }
    }
    Ok(())
}

/// Sequences of the given lengths with random ids.
fn packed_rows(lens: &[usize], vocab: usize, rng: &mut Rng) -> BatchRows {
    BatchRows::Tokens(
        lens.iter()
            .map(|&l| (0..l).map(|_| rng.range(0, vocab - 1) as u32).collect())
            .collect(),
    )
}

/// Random lengths in `1..=max_len` filling `tokens` exactly (or `seqs` sequences).
fn fill_lens(tokens: usize, seqs: usize, max_len: usize, rng: &mut Rng) -> Vec<usize> {
    let mut lens = Vec::new();
    let mut left = tokens;
    while left > 0 && lens.len() < seqs {
        let l = rng.range(1, max_len).min(left);
        lens.push(l);
        left -= l;
    }
    lens
}

/// One packed graph, captured once, replayed with batches of different
/// shapes one after another (the static buffers' contents change, the graph
/// does not), each against the reference; then the eager path on the last.
#[allow(clippy::too_many_arguments)]
fn run_packed_sequence(
    gpu: &mut CudaBackend,
    rep: &mut Report,
    name: &str,
    w: &Weights,
    dtype: DType,
    prog: &Program,
    batches: &[BatchRows],
    threshold: f64,
) -> Result<(), BackendError> {
    let gw = gpu.upload_weights(w, dtype)?;
    let dim = prog.output_dim;
    let t = Instant::now();
    let mut g = match gpu.capture_program(w, &gw, prog) {
        Ok(g) => g,
        Err(e) => {
            rep.check(&format!("{name} capture"), false, e.to_string());
            return Ok(());
        }
    };
    let cap = t.elapsed().as_secs_f64() * 1e3;
    let facts = prog
        .validate(w)
        .map_err(|e| BackendError::Other(e.to_string()))?;
    let mut last_ref: Vec<f32> = Vec::new();
    for (i, rows) in batches.iter().enumerate() {
        facts
            .check_rows(rows)
            .map_err(|e| BackendError::Other(e.to_string()))?;
        let refv = replayd::model::program::reference::run(prog, w, dtype, rows);
        let out = gpu.launch(&mut g, rows).and_then(|p| gpu.collect(p))?;
        let (rel, cos) = diff(&out, &refv, dim);
        let lens: Vec<usize> = match rows {
            BatchRows::Tokens(s) => s.iter().map(Vec::len).collect(),
            BatchRows::Features { .. } => Vec::new(),
        };
        let shown = if lens.len() > 8 {
            format!("{} seqs, {} tokens", lens.len(), lens.iter().sum::<usize>())
        } else {
            format!("{lens:?}")
        };
        rep.check(
            &format!("{name} graph batch {i} {shown}"),
            cos >= threshold,
            format!(
                "min cos {cos:.7} (>= {threshold}), rel {rel:.2e}; capture {cap:.1} ms, {}",
                g.nodes
            ),
        );
        last_ref = refv;
    }
    if let Some(rows) = batches.last() {
        let refv = last_ref;
        match gpu.run_program_eager(w, &gw, prog, rows) {
            Ok(out) => {
                let (rel, cos) = diff(&out, &refv, dim);
                rep.check(
                    &format!("{name} eager"),
                    cos >= threshold,
                    format!("min cos {cos:.7} (>= {threshold}), rel {rel:.2e}"),
                );
            }
            Err(e) => rep.check(&format!("{name} eager"), false, e.to_string()),
        }
    }
    Ok(())
}

fn token_rows(n: usize, seq: usize, vocab: usize, rng: &mut Rng) -> BatchRows {
    BatchRows::Tokens(
        (0..n)
            .map(|i| {
                let len = if i == 0 { seq } else { rng.range(1, seq) };
                (0..len).map(|_| rng.range(0, vocab - 1) as u32).collect()
            })
            .collect(),
    )
}

fn feature_rows(n: usize, f: usize, rng: &mut Rng) -> BatchRows {
    BatchRows::Features {
        features: f,
        data: rng.vec(n * f, 1.0),
    }
}

/// (max |g-r| / max |r|, min row cosine)
fn diff(g: &[f32], r: &[f32], dim: usize) -> (f64, f64) {
    if g.len() != r.len() {
        return (f64::INFINITY, f64::NEG_INFINITY);
    }
    let scale = r
        .iter()
        .map(|v| v.abs() as f64)
        .fold(0.0, f64::max)
        .max(1e-30);
    let mut max = 0f64;
    for (a, b) in g.iter().zip(r) {
        let d = (*a as f64 - *b as f64).abs();
        max = max.max(if d.is_nan() { f64::INFINITY } else { d });
    }
    let mut cos = 1f64;
    for (a, b) in g.chunks(dim).zip(r.chunks(dim)) {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let na = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let nb = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let c = if na == 0.0 && nb == 0.0 {
            1.0
        } else {
            dot / (na * nb).max(1e-300)
        };
        cos = cos.min(if c.is_nan() { f64::NEG_INFINITY } else { c });
    }
    (max / scale, cos)
}

struct Report {
    fails: Vec<String>,
    json: Vec<serde_json::Value>,
}

impl Report {
    fn check(&mut self, name: &str, ok: bool, detail: String) {
        println!("  {} {name}: {detail}", if ok { "PASS" } else { "FAIL" });
        if !ok {
            self.fails.push(format!("{name}: {detail}"));
        }
        self.json
            .push(serde_json::json!({"check": name, "pass": ok, "detail": detail}));
    }
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (q(0.5), q(0.9), q(0.99), v[0])
}

/// Graph + eager vs the reference for one program.
#[allow(clippy::too_many_arguments)]
fn run_case(
    gpu: &mut CudaBackend,
    rep: &mut Report,
    name: &str,
    w: &Weights,
    dtype: DType,
    prog: &Program,
    rows: &BatchRows,
    metric_cos: bool,
    threshold: f64,
    eager_only: bool,
) -> Result<(), BackendError> {
    let gw = gpu.upload_weights(w, dtype)?;
    let refv = replayd::model::program::reference::run(prog, w, dtype, rows);
    let dim = prog.output_dim;
    let judge = |(rel, cos): (f64, f64)| {
        if metric_cos {
            (
                cos >= threshold,
                format!("min cos {cos:.7} (>= {threshold}), rel {rel:.2e}"),
            )
        } else {
            (
                rel <= threshold,
                format!("max rel err {rel:.3e} (<= {threshold:.0e}), cos {cos:.7}"),
            )
        }
    };
    if !eager_only {
        let t = Instant::now();
        match gpu.capture_program(w, &gw, prog) {
            Ok(mut g) => {
                let cap = t.elapsed().as_secs_f64() * 1e3;
                let out = gpu.launch(&mut g, rows).and_then(|p| gpu.collect(p))?;
                let (ok, d) = judge(diff(&out, &refv, dim));
                let allocs = g.node_counts.contains_key("MEM_ALLOC");
                rep.check(
                    &format!("{name} graph"),
                    ok && !allocs,
                    format!("{d}; capture {cap:.1} ms, {}", g.nodes),
                );
                // Replay again with other data: static buffers really re-read.
                let out2 = gpu.launch(&mut g, rows).and_then(|p| gpu.collect(p))?;
                rep.check(
                    &format!("{name} graph replay deterministic"),
                    out2 == out,
                    String::new(),
                );
            }
            Err(e) => rep.check(&format!("{name} graph"), false, format!("capture: {e}")),
        }
    }
    match gpu.run_program_eager(w, &gw, prog, rows) {
        Ok(out) => {
            let (ok, d) = judge(diff(&out, &refv, dim));
            rep.check(&format!("{name} eager"), ok, d);
        }
        Err(e) => rep.check(&format!("{name} eager"), false, e.to_string()),
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn latency(
    gpu: &mut CudaBackend,
    rep: &mut Report,
    name: &str,
    w: &Weights,
    dtype: DType,
    prog: &Program,
    inputs: &[BatchRows],
    iters: usize,
) -> Result<(), BackendError> {
    let gw = gpu.upload_weights(w, dtype)?;
    let mut g = gpu.capture_program(w, &gw, prog)?;
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters + 50 {
        let t = Instant::now();
        gpu.launch(&mut g, &inputs[i % inputs.len()])
            .and_then(|p| gpu.collect(p))?;
        if i >= 50 {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (p50, p90, p99, min) = stats(v);
    // Pipelined throughput (2 in flight).
    let n = iters.max(100);
    let t = Instant::now();
    let mut q = std::collections::VecDeque::new();
    for i in 0..n {
        q.push_back(gpu.launch(&mut g, &inputs[i % inputs.len()])?);
        if q.len() >= 2 {
            gpu.collect(q.pop_front().unwrap())?;
        }
    }
    while let Some(p) = q.pop_front() {
        gpu.collect(p)?;
    }
    let per = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let mem = g.memory();
    println!(
        "  LAT {name}: launch->collect p50 {p50:.1} us, p90 {p90:.1}, p99 {p99:.1}, min {min:.1}; pipelined {per:.1} us/batch ({:.0} rows/s, {:.0} tokens/s); {}; mem {:.1} MiB",
        inputs[0].rows() as f64 * 1e6 / per,
        inputs[0].tokens() as f64 * 1e6 / per,
        g.nodes,
        mem.total_bytes as f64 / 1048576.0
    );
    rep.json.push(serde_json::json!({"latency": name, "p50_us": p50, "p90_us": p90, "p99_us": p99, "min_us": min,
        "pipelined_us_per_batch": per, "rows_per_s": inputs[0].rows() as f64 * 1e6 / per,
        "tokens_per_s": inputs[0].tokens() as f64 * 1e6 / per, "nodes": g.nodes, "memory": mem}));
    Ok(())
}

fn fault_test(gpu_ord: usize) -> i32 {
    println!("== fault injection on GPU {gpu_ord}");
    let mut gpu = match CudaBackend::new(gpu_ord, CudaOptions::default()) {
        Ok(g) => g,
        Err(e) => {
            println!("  cannot open GPU: {e}");
            return 2;
        }
    };
    println!("  kernels: {:?}", gpu.kernel_origin());
    let uuid = gpu.info().uuid.unwrap_or_default();
    let (tx, rx) = std::sync::mpsc::channel();
    let watcher = nvml::XidWatcher::start(vec![uuid.clone()], move |u, e| {
        let _ = tx.send((u, e));
    });
    match &watcher {
        Ok(w) => println!("  Xid watcher on {:?}", w.watching),
        Err(e) => println!("  Xid watcher: {e}"),
    }
    let mut rng = Rng(7);
    let m = mlp(
        &[16, 32, 4],
        &[Activation::Relu, Activation::Identity],
        &[true, true],
        &mut rng,
    );
    let w = &m.weights;
    let gw = gpu.upload_weights(w, DType::F32).expect("upload");
    let prog = mlp_program(&m, 2);
    let mut g = gpu.capture_program(w, &gw, &prog).expect("capture");
    let rows = feature_rows(2, 16, &mut rng);
    let ok = gpu.launch(&mut g, &rows).and_then(|p| gpu.collect(p));
    println!("  before: {:?}", ok.map(|v| v.len()));
    let r = gpu.inject_fault();
    println!("  inject_fault -> {r:?}; fault = {:?}", gpu.fault());
    let after = gpu.launch(&mut g, &rows).map(|_| ());
    println!("  launch after fault -> {after:?}");
    let mut code = if matches!(after, Err(BackendError::DeviceFault(_))) && r.is_ok() {
        0
    } else {
        1
    };
    // A fresh backend in the same process must fail too (sticky, device-wide).
    match CudaBackend::new(gpu_ord, CudaOptions::default()) {
        Ok(_) => println!("  a new backend in this process opened (unexpected?)"),
        Err(e) => println!(
            "  new backend in this process -> {e} (fatal={})",
            e.is_fatal()
        ),
    }
    match rx.recv_timeout(std::time::Duration::from_secs(5)) {
        Ok((u, e)) => println!("  NVML event: {u} {e:?}"),
        Err(_) => {
            println!("  no NVML event within 5 s");
            if watcher.is_ok() {
                code = code.max(1);
            }
        }
    }
    println!(
        "RESULT fault test: {}",
        if code == 0 { "PASS" } else { "FAIL" }
    );
    // Do not run destructors of a poisoned device.
    std::mem::forget(g);
    std::mem::forget(gpu);
    std::mem::forget(watcher);
    code
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| {
        args.iter()
            .position(|a| a == f)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let ord: usize = flag("--gpu")
        .map(|s| s.parse().expect("--gpu N"))
        .unwrap_or(0);
    let iters: usize = flag("--iters")
        .map(|s| s.parse().expect("--iters N"))
        .unwrap_or(500);
    if args.iter().any(|a| a == "--fault") {
        std::process::exit(fault_test(ord));
    }
    // Only the packed checks, profiles and latencies (with the padded
    // MiniLM-shaped ones to compare with): what a packed-batching change needs.
    let packed_only = args.iter().any(|a| a == "--packed-only");
    let decoders_only = args.iter().any(|a| a == "--decoders-only");
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
    println!("cuda_device_count: {:?}", gpu::cuda_device_count());
    match nvml::discover() {
        Ok(g) => {
            for x in &g {
                println!("  NVML {x:?} sample {:?}", nvml::sample(x));
            }
            println!(
                "  CUDA {ord} -> NVML {:?}",
                nvml::for_cuda_ordinal(ord).map(|g| g.index)
            );
        }
        Err(e) => println!("NVML: {e}"),
    }
    let t = Instant::now();
    let mut gpu = match CudaBackend::new(ord, CudaOptions::default()) {
        Ok(g) => g,
        Err(e) => {
            println!("cannot open GPU {ord}: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "backend: {:?} in {:.0} ms; kernels {:?}",
        gpu.info(),
        t.elapsed().as_secs_f64() * 1e3,
        gpu.kernel_origin()
    );
    let mut rep = Report {
        fails: Vec::new(),
        json: Vec::new(),
    };
    let mut rng = Rng(0x1234_5678);
    let result = (|| -> Result<(), BackendError> {
        if decoders_only {
            return decoder_checks(&mut gpu, &mut rep, &mut rng);
        }
        let base = BertDims {
            hidden: 384,
            heads: 12,
            inter: 1536,
            layers: 2,
            vocab: 1000,
            pooling: Pooling::Mean,
            normalize: true,
            act: Activation::Gelu,
        };
        if !packed_only {
            println!("== MLP");
            let m = mlp(
                &[128, 256, 10],
                &[Activation::Relu, Activation::Identity],
                &[true, true],
                &mut rng,
            );
            for b in [1usize, 8, 13] {
                let p = mlp_program(&m, b);
                let rows = feature_rows(if b == 13 { 13 } else { b.max(1) }, 128, &mut rng);
                run_case(
                    &mut gpu,
                    &mut rep,
                    &format!("mlp128-256-10 f32 b{b}"),
                    &m.weights,
                    DType::F32,
                    &p,
                    &rows,
                    false,
                    1e-5,
                    false,
                )?;
            }
            // Padded batch (fewer rows than the bucket).
            let p = mlp_program(&m, 8);
            let rows = feature_rows(3, 128, &mut rng);
            run_case(
                &mut gpu,
                &mut rep,
                "mlp f32 3 rows in b8",
                &m.weights,
                DType::F32,
                &p,
                &rows,
                false,
                1e-5,
                false,
            )?;
            let acts = [
                Activation::Gelu,
                Activation::GeluTanh,
                Activation::Tanh,
                Activation::Sigmoid,
                Activation::Silu,
                Activation::Relu,
                Activation::Identity,
            ];
            for (i, &a) in acts.iter().enumerate() {
                for (dt, th) in [(DType::F32, 1e-5), (DType::F16, 1e-2), (DType::BF16, 5e-2)] {
                    let m = mlp(
                        &[64, 96, 48, 7],
                        &[a, acts[(i + 3) % 7], Activation::Identity],
                        &[i % 2 == 0, true, i % 3 != 0],
                        &mut rng,
                    );
                    let p = mlp_program(&m, 5);
                    let rows = feature_rows(5, 64, &mut rng);
                    run_case(
                        &mut gpu,
                        &mut rep,
                        &format!("mlp {a:?} {dt}"),
                        &m.weights,
                        dt,
                        &p,
                        &rows,
                        false,
                        th,
                        false,
                    )?;
                }
            }
            println!("== BERT-shaped");
            let cases: Vec<(BertDims, Vec<(usize, usize, usize)>)> = vec![
                (
                    base,
                    vec![
                        (1, 16, 1),
                        (2, 8, 2),
                        (3, 5, 3),
                        (4, 100, 3),
                        (2, 256, 2),
                        (2, 64, 2),
                    ],
                ),
                (
                    BertDims {
                        hidden: 256,
                        heads: 4,
                        pooling: Pooling::Cls,
                        normalize: false,
                        inter: 512,
                        ..base
                    },
                    vec![(3, 70, 3)],
                ),
                (
                    BertDims {
                        hidden: 192,
                        heads: 4,
                        pooling: Pooling::Max,
                        inter: 384,
                        act: Activation::GeluTanh,
                        ..base
                    },
                    vec![(2, 33, 2)],
                ),
                (
                    BertDims {
                        hidden: 256,
                        heads: 2,
                        pooling: Pooling::Mean,
                        inter: 512,
                        ..base
                    },
                    vec![(2, 130, 2)],
                ),
                (
                    BertDims {
                        hidden: 100,
                        heads: 5,
                        pooling: Pooling::Mean,
                        inter: 200,
                        ..base
                    },
                    vec![(3, 20, 2)],
                ),
            ];
            for (d, shapes) in cases {
                let m = bert(d, &mut rng);
                for (b, s, n) in shapes {
                    for (dt, th) in [
                        (DType::F32, 0.99999),
                        (DType::F16, 0.999),
                        (DType::BF16, 0.99),
                    ] {
                        let p = bert_program(&m, b, s);
                        let rows = token_rows(n, s, d.vocab, &mut rng);
                        let name = format!(
                            "bert h{} nh{} {:?} b{b} s{s} ({n} rows) {dt}",
                            d.hidden, d.heads, d.pooling
                        );
                        run_case(
                            &mut gpu, &mut rep, &name, &m.weights, dt, &p, &rows, true, th, false,
                        )?;
                    }
                }
            }
            // Long sequence through the eager path (attention smem opt-in).
            let m = bert(BertDims { layers: 1, ..base }, &mut rng);
            for dt in [DType::F32, DType::F16] {
                let p = bert_program(&m, 2, 512);
                let rows = token_rows(2, 512, base.vocab, &mut rng);
                run_case(
                    &mut gpu,
                    &mut rep,
                    &format!("bert s512 eager {dt}"),
                    &m.weights,
                    dt,
                    &p,
                    &rows,
                    true,
                    if dt == DType::F32 { 0.99999 } else { 0.999 },
                    true,
                )?;
            }
        }
        println!("== packed BERT-shaped (varlen attention, per-sequence pooling)");
        // Head sizes 32, 64, 128 (tensor cores in f16/bf16), 20 and 48 (CUDA
        // cores); f32 always on CUDA cores.
        // Each with budgets (slots, sequences, longest) chosen to keep the f64
        // reference (whose cost grows with the slots) short: small budgets,
        // unused sequence slots, and sequences of 130 and 256 tokens (several
        // key blocks of either kernel).
        let (small, mid, long) = ((64usize, 64usize, 64usize), (300, 12, 130), (512, 4, 256));
        let packed_dims = [
            (base, vec![small, mid]),
            (
                BertDims {
                    hidden: 256,
                    heads: 4,
                    pooling: Pooling::Cls,
                    normalize: false,
                    inter: 512,
                    ..base
                },
                vec![small, long],
            ),
            (
                BertDims {
                    hidden: 256,
                    heads: 2,
                    pooling: Pooling::Max,
                    inter: 512,
                    ..base
                },
                vec![mid, long],
            ),
            (
                BertDims {
                    hidden: 100,
                    heads: 5,
                    inter: 200,
                    ..base
                },
                vec![small, long],
            ),
            (
                BertDims {
                    hidden: 192,
                    heads: 4,
                    pooling: Pooling::Max,
                    inter: 384,
                    act: Activation::GeluTanh,
                    ..base
                },
                vec![mid],
            ),
        ];
        for (d, budgets) in packed_dims {
            let m = bert(d, &mut rng);
            for (tokens, seqs, max_len) in budgets {
                // A random fill, one short text, the longest text with empty
                // ones, as many one-token texts as the graph holds, another fill.
                let mut batches = vec![
                    packed_rows(
                        &fill_lens(tokens, seqs, max_len, &mut rng),
                        d.vocab,
                        &mut rng,
                    ),
                    packed_rows(&[16.min(max_len)], d.vocab, &mut rng),
                    packed_rows(&[max_len.min(tokens - 1), 0, 1], d.vocab, &mut rng),
                    packed_rows(&vec![1; seqs.min(tokens)], d.vocab, &mut rng),
                    packed_rows(
                        &fill_lens(tokens - 7, seqs - 1, max_len, &mut rng),
                        d.vocab,
                        &mut rng,
                    ),
                ];
                if tokens <= 64 {
                    // Only empty sequences: nothing but tail tiles.
                    batches.insert(4, packed_rows(&[0, 0], d.vocab, &mut rng));
                }
                for (dt, th) in [
                    (DType::F32, 0.99999),
                    (DType::F16, 0.999),
                    (DType::BF16, 0.99),
                ] {
                    let p = packed_bert_program(&m, tokens, seqs, max_len);
                    let name = format!(
                        "packed h{} nh{} {:?} {tokens}t/{seqs}s/<={max_len} {dt}",
                        d.hidden, d.heads, d.pooling
                    );
                    run_packed_sequence(
                        &mut gpu, &mut rep, &name, &m.weights, dt, &p, &batches, th,
                    )?;
                }
            }
        }
        // A MiniLM-sized budget of 1024 slots, f16, on tensor cores.
        let m = bert(base, &mut rng);
        let p = packed_bert_program(&m, 1024, 256, 256);
        let batches = vec![packed_rows(
            &fill_lens(1024, 256, 60, &mut rng),
            base.vocab,
            &mut rng,
        )];
        run_packed_sequence(
            &mut gpu,
            &mut rep,
            "packed h384 1024t/256s f16",
            &m.weights,
            DType::F16,
            &p,
            &batches,
            0.999,
        )?;

        if !packed_only {
            decoder_checks(&mut gpu, &mut rep, &mut rng)?;
        }

        println!("== latency (launch -> collect, one at a time; then 2 in flight)");
        if !packed_only {
            let m = mlp(
                &[128, 256, 10],
                &[Activation::Relu, Activation::Identity],
                &[true, true],
                &mut rng,
            );
            for b in [1usize, 8, 128] {
                let p = mlp_program(&m, b);
                let inputs: Vec<BatchRows> =
                    (0..4).map(|_| feature_rows(b, 128, &mut rng)).collect();
                latency(
                    &mut gpu,
                    &mut rep,
                    &format!("mlp f32 b{b}"),
                    &m.weights,
                    DType::F32,
                    &p,
                    &inputs,
                    iters,
                )?;
            }
        }
        let mini = bert(
            BertDims {
                layers: 6,
                vocab: 30522,
                ..base
            },
            &mut rng,
        );
        println!("== per-step GPU time, MiniLM-shaped");
        for (dt, b, s) in [
            (DType::F16, 1usize, 16usize),
            (DType::F16, 32, 128),
            (DType::F16, 128, 128),
            (DType::F32, 1, 16),
        ] {
            let gw = gpu.upload_weights(&mini.weights, dt)?;
            let prof = gpu.profile_program(&mini.weights, &gw, &bert_program(&mini, b, s), 20)?;
            let total: f64 = prof.iter().map(|p| p.1).sum();
            println!(
                "  PROFILE {dt} ({b},{s}): {} steps, sum {total:.1} us",
                prof.len()
            );
            // The embedding, the first layer's steps and the pooling.
            let per_layer = (prof.len() - 2) / 6;
            for (name, us) in prof.iter().take(1 + per_layer).chain(prof.last()) {
                println!("    {us:8.2} us  {name}");
            }
            rep.json
                .push(serde_json::json!({"profile": format!("{dt} ({b},{s})"), "steps": prof}));
        }
        // Packed MiniLM-shaped graphs on the batches the notes predict for
        // (kernels/NOTES.md): one 16-token text in a 64-token budget; 32
        // texts of ~27 tokens in 1,024; a full 16,384-token budget of 256
        // texts. Per-step GPU time (with the batch in the inputs), then latency.
        let packed_shapes: [(DType, usize, usize, Vec<usize>); 4] = [
            (DType::F16, 64, 64, vec![16]),
            (DType::F16, 1024, 256, {
                let mut r = Rng(27);
                (0..32).map(|_| r.range(8, 46)).collect()
            }),
            (DType::F16, 16384, 256, vec![64; 256]),
            (DType::F32, 1024, 256, vec![27; 32]),
        ];
        for (dt, tokens, seqs, lens) in &packed_shapes {
            let (dt, tokens, seqs) = (*dt, *tokens, *seqs);
            let p = packed_bert_program(&mini, tokens, seqs, 256.min(tokens));
            let rows = packed_rows(lens, 30522, &mut rng);
            let gw = gpu.upload_weights(&mini.weights, dt)?;
            let prof = gpu.profile_program_on(&mini.weights, &gw, &p, Some(&rows), 20)?;
            let total: f64 = prof.iter().map(|p| p.1).sum();
            let attention: f64 = prof
                .iter()
                .filter(|(n, _)| n.starts_with("attention"))
                .map(|p| p.1)
                .sum();
            println!(
                "  PROFILE packed {dt} {tokens}t ({} seqs, {} tokens): {} steps, sum {total:.1} us, attention {attention:.1} us",
                lens.len(),
                lens.iter().sum::<usize>(),
                prof.len()
            );
            let per_layer = (prof.len() - 2) / 6;
            for (name, us) in prof.iter().take(1 + per_layer).chain(prof.last()) {
                println!("    {us:8.2} us  {name}");
            }
            rep.json.push(serde_json::json!({
                "profile": format!("packed {dt} {tokens}t {} seqs {} tokens", lens.len(), lens.iter().sum::<usize>()),
                "steps": prof
            }));
            let inputs: Vec<BatchRows> =
                (0..4).map(|_| packed_rows(lens, 30522, &mut rng)).collect();
            latency(
                &mut gpu,
                &mut rep,
                &format!(
                    "minilm-shaped packed {dt} {tokens}t ({} seqs, {} tokens)",
                    lens.len(),
                    lens.iter().sum::<usize>()
                ),
                &mini.weights,
                dt,
                &p,
                &inputs,
                if tokens > 4096 { iters / 4 } else { iters },
            )?;
        }
        let padded_shapes: &[(DType, usize, usize)] = if packed_only {
            &[
                (DType::F16, 1, 16),
                (DType::F16, 32, 64),
                (DType::F16, 32, 128),
                (DType::F16, 128, 128),
            ]
        } else {
            &[
                (DType::F16, 1usize, 16usize),
                (DType::F16, 1, 128),
                (DType::F16, 8, 64),
                (DType::F16, 32, 128),
                (DType::F16, 128, 128),
                (DType::F16, 128, 256),
                (DType::F32, 1, 16),
                (DType::F32, 32, 128),
                (DType::F32, 128, 128),
            ]
        };
        for &(dt, b, s) in padded_shapes {
            let p = bert_program(&mini, b, s);
            let inputs: Vec<BatchRows> = (0..4)
                .map(|_| {
                    BatchRows::Tokens(
                        (0..b)
                            .map(|_| (0..s).map(|_| rng.range(1000, 30000) as u32).collect())
                            .collect(),
                    )
                })
                .collect();
            latency(
                &mut gpu,
                &mut rep,
                &format!("minilm-shaped {dt} ({b},{s})"),
                &mini.weights,
                dt,
                &p,
                &inputs,
                if b * s > 4096 { iters / 4 } else { iters },
            )?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        rep.check("run", false, e.to_string());
    }
    if let Some(path) = flag("--json") {
        let _ = std::fs::write(
            &path,
            serde_json::to_string_pretty(&rep.json).unwrap_or_default(),
        );
    }
    println!(
        "RESULT: {} ({} failures)",
        if rep.fails.is_empty() { "PASS" } else { "FAIL" },
        rep.fails.len()
    );
    for f in &rep.fails {
        println!("  failed: {f}");
    }
    if gpu.fault().is_some() {
        std::mem::forget(gpu);
        std::process::exit(1);
    }
    std::process::exit(if rep.fails.is_empty() { 0 } else { 1 });
}
