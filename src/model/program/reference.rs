//! The reference interpreter of the op IR: every op written as plainly as
//! possible, in f64, with no buffer reuse tricks. It is slow and obviously
//! right; the CPU backend's tests and the CUDA self-test compare against it.
//! It expects a program that passed [`Program::validate`] and rows that
//! passed [`super::ProgramFacts::check_rows`].

use super::{
    Activation, Add, AddLayerNorm, Attention, BufKind, Embed, EmbedLayerNorm, GateOn, Gated,
    HeadRmsNorm, InputRole, LayerNorm, Linear, Normalize, Op, Pool, Pooling, PositionBias, Program,
    RmsNorm, Rotary, Seqs, WeightId,
};
use crate::model::batch::PackTarget;
use crate::model::{BatchRows, Weights};
use crate::tensor::DType;

/// `v` as a device storing `dtype` holds it.
fn round(v: f32, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_f32(v).to_f64(),
        DType::BF16 => half::bf16::from_f32(v).to_f64(),
        _ => v as f64,
    }
}

/// Runs `program` on `rows` in f64: weights rounded to `dtype` as a device
/// stores them, every activation kept in f64. Returns the output rows that
/// belong to real inputs (`rows.rows() · output_dim` values).
pub fn run(p: &Program, w: &Weights, dtype: DType, rows: &BatchRows) -> Vec<f32> {
    let mut bufs: Vec<Vec<f64>> = p.buffers.iter().map(|d| vec![0.0; d.elems]).collect();
    for &id in &p.inputs {
        let d = p.buffer(id);
        let BufKind::Input(role) = d.kind else {
            unreachable!()
        };
        if role == InputRole::Features {
            let mut v = vec![0f32; d.elems];
            rows.pack_input(p.layout, role, p.seq, PackTarget::F32(&mut v));
            bufs[id.0] = v.iter().map(|x| *x as f64).collect();
        } else {
            let mut v = vec![0i32; d.elems];
            rows.pack_input(p.layout, role, p.seq, PackTarget::I32(&mut v));
            bufs[id.0] = v.iter().map(|x| *x as f64).collect();
        }
    }
    let wt = |id: WeightId| -> Vec<f64> {
        let data = w.get(id).data.to_f32();
        data.iter().map(|v| round(*v, dtype)).collect()
    };
    let ln = |v: &mut [f64], g: &[f64], b: &[f64], eps: f32| {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
        let r = 1.0 / (var + eps as f64).sqrt();
        for (i, x) in v.iter_mut().enumerate() {
            *x = (*x - mean) * r * g[i] + b[i];
        }
    };
    let rms = |v: &mut [f64], g: &[f64], offset: f32, eps: f32| {
        let ms = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for (x, g) in v.iter_mut().zip(g) {
            *x *= r * (offset as f64 + g);
        }
    };
    let act = |a: Activation, x: f64| -> f64 {
        match a {
            Activation::Gelu => 0.5 * x * (1.0 + super::erf_f64(x / std::f64::consts::SQRT_2)),
            Activation::GeluTanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }
            Activation::Relu => x.max(0.0),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Identity => x,
            Activation::Log1pRelu => x.max(0.0).ln_1p(),
            Activation::Log1pLog1pRelu => x.max(0.0).ln_1p().ln_1p(),
        }
    };
    // Softmax-weighted sum of `v` rows for one query (f64), given its scores
    // (None: masked key); zeros when every key is masked.
    let attend = |scores: &[Option<f64>], value: &dyn Fn(usize, usize) -> f64, o: &mut [f64]| {
        o.fill(0.0);
        let m = scores
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            return;
        }
        let e: Vec<f64> = scores
            .iter()
            .map(|s| s.map_or(0.0, |s| (s - m).exp()))
            .collect();
        let sum: f64 = e.iter().sum();
        for (j, ej) in e.iter().enumerate() {
            for (d, od) in o.iter_mut().enumerate() {
                *od += ej / sum * value(j, d);
            }
        }
    };
    // The bias of query `i` and key `j` (positions in their sequence), head `h`.
    let bias_of = |b: Option<PositionBias>| -> Box<dyn Fn(usize, usize, usize) -> f64> {
        match b {
            None => Box::new(|_, _, _| 0.0),
            Some(b) => {
                let t = wt(b.table);
                let cols = 2 * b.radius + 1;
                Box::new(move |h, i, j| t[h * cols + b.column(i, j)])
            }
        }
    };
    // Each sequence's token rows: (first row, rows, which of them are real).
    let sequences = |seqs: Seqs, bufs: &[Vec<f64>]| -> Vec<(usize, Vec<bool>)> {
        match seqs {
            Seqs::Padded { mask, batch, seq } => (0..batch)
                .map(|b| {
                    let real = bufs[mask.0][b * seq..(b + 1) * seq]
                        .iter()
                        .map(|&m| m != 0.0)
                        .collect();
                    (b * seq, real)
                })
                .collect(),
            Seqs::Packed { offsets, seqs, .. } => (0..seqs)
                .map(|s| {
                    let (start, end) =
                        (bufs[offsets.0][s] as usize, bufs[offsets.0][s + 1] as usize);
                    (start, vec![true; end - start])
                })
                .collect(),
        }
    };
    for op in &p.ops {
        match op {
            Op::EmbedLayerNorm(e) => {
                let EmbedLayerNorm {
                    ids,
                    out,
                    hidden,
                    seqs,
                    ..
                } = *e;
                let (wd, pd, td) = (wt(e.word), wt(e.position), wt(e.token_type));
                let (g, b) = (wt(e.gamma), wt(e.beta));
                let all_ids: Vec<i32> = bufs[ids.0].iter().map(|&v| v as i32).collect();
                for r in 0..seqs.token_rows() {
                    let id = bufs[ids.0][r] as usize;
                    let tt = bufs[e.token_types.0][r] as usize;
                    // The token's index in its sequence, and the sequence's ids.
                    let (index, row) = match seqs {
                        Seqs::Padded { seq, .. } => {
                            (r % seq, &all_ids[r - r % seq..r - r % seq + seq])
                        }
                        Seqs::Packed { positions, .. } => {
                            let index = bufs[positions.0][r] as usize;
                            (index, &all_ids[r - index..])
                        }
                    };
                    let pos = e.position_ids.position(row, index);
                    let mut v: Vec<f64> = (0..hidden)
                        .map(|c| wd[id * hidden + c] + pd[pos * hidden + c] + td[tt * hidden + c])
                        .collect();
                    ln(&mut v, &g, &b, e.eps);
                    bufs[out.0][r * hidden..(r + 1) * hidden].copy_from_slice(&v);
                }
            }
            Op::Attention(a) => {
                let Attention {
                    qkv,
                    out,
                    heads,
                    kv_heads,
                    head_dim,
                    bias,
                    seqs,
                    ..
                } = *a;
                let bias = bias_of(bias);
                let (hd, kvd, width) = (heads * head_dim, kv_heads * head_dim, a.qkv_width());
                let group = heads / kv_heads;
                let q = bufs[qkv.0].clone();
                let scale = a.score_scale() as f64;
                // Rows no sequence covers (a packed tail) stay zero.
                bufs[out.0][..seqs.token_rows() * hd].fill(0.0);
                for (start, real) in sequences(seqs, &bufs) {
                    for h in 0..heads {
                        let kv = h / group;
                        for i in 0..real.len() {
                            let qrow = &q[(start + i) * width + h * head_dim..][..head_dim];
                            let scores: Vec<Option<f64>> = (0..real.len())
                                .map(|j| {
                                    (real[j] && a.sees(i, j)).then(|| {
                                        let krow = &q[(start + j) * width + hd + kv * head_dim..]
                                            [..head_dim];
                                        qrow.iter().zip(krow).map(|(a, c)| a * c).sum::<f64>()
                                            * scale
                                            + bias(h, i, j)
                                    })
                                })
                                .collect();
                            let value = |j: usize, d: usize| {
                                q[(start + j) * width + hd + kvd + kv * head_dim + d]
                            };
                            let o = &mut bufs[out.0][(start + i) * hd + h * head_dim..][..head_dim];
                            attend(&scores, &value, o);
                        }
                    }
                }
            }
            Op::Pool(p) => {
                let Pool {
                    x,
                    out,
                    hidden,
                    mode,
                    normalize,
                    skip,
                    seqs,
                } = *p;
                for (s, (start, real)) in sequences(seqs, &bufs).into_iter().enumerate() {
                    let first = skip.map_or(0, |k| bufs[k.0][s] as usize);
                    let pooled: Vec<usize> = (first..real.len()).filter(|&i| real[i]).collect();
                    // cls: the first pooled token (padded without a skip:
                    // slot 0, real or not).
                    let cls = match (seqs, skip) {
                        (Seqs::Padded { .. }, None) => Some(0),
                        _ => pooled.first().copied(),
                    };
                    let xs = |i: usize, c: usize| bufs[x.0][(start + i) * hidden + c];
                    let mut v = vec![0.0f64; hidden];
                    for (c, vc) in v.iter_mut().enumerate() {
                        *vc = match mode {
                            Pooling::Cls => cls.map_or(0.0, |i| xs(i, c)),
                            _ if pooled.is_empty() => 0.0,
                            Pooling::Mean => {
                                pooled.iter().map(|&i| xs(i, c)).sum::<f64>() / pooled.len() as f64
                            }
                            Pooling::Max => pooled
                                .iter()
                                .map(|&i| xs(i, c))
                                .fold(f64::NEG_INFINITY, f64::max),
                            Pooling::Sum => pooled.iter().map(|&i| xs(i, c)).sum::<f64>(),
                            Pooling::LastToken => pooled.last().map_or(0.0, |&i| xs(i, c)),
                        };
                    }
                    if normalize {
                        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-12);
                        v.iter_mut().for_each(|a| *a /= n);
                    }
                    bufs[out.0][s * hidden..(s + 1) * hidden].copy_from_slice(&v);
                }
            }
            Op::Linear(l) => {
                let Linear {
                    x,
                    bias,
                    out,
                    m,
                    n,
                    k,
                    ..
                } = *l;
                let wm = wt(l.w);
                let bv = bias.map(wt);
                let xs = bufs[x.0].clone();
                for i in 0..m {
                    for j in 0..n {
                        let mut acc = 0.0;
                        for l in 0..k {
                            acc += xs[i * k + l] * wm[j * k + l];
                        }
                        if let Some(b) = &bv {
                            acc += b[j];
                        }
                        bufs[out.0][i * n + j] = act(l.act, acc);
                    }
                }
            }
            Op::AddLayerNorm(a) => {
                let AddLayerNorm {
                    x,
                    residual,
                    out,
                    rows,
                    hidden,
                    ..
                } = *a;
                let (g, b) = (wt(a.gamma), wt(a.beta));
                for r in 0..rows {
                    let mut v: Vec<f64> = (0..hidden)
                        .map(|c| bufs[x.0][r * hidden + c] + bufs[residual.0][r * hidden + c])
                        .collect();
                    ln(&mut v, &g, &b, a.eps);
                    bufs[out.0][r * hidden..(r + 1) * hidden].copy_from_slice(&v);
                }
            }
            Op::Normalize(n) => {
                let Normalize { x, rows, width } = *n;
                for row in bufs[x.0][..rows * width].chunks_mut(width) {
                    let n = row.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-12);
                    row.iter_mut().for_each(|a| *a /= n);
                }
            }
            Op::Embed(e) => {
                let Embed {
                    ids,
                    word,
                    out,
                    hidden,
                    scale,
                    seqs,
                } = *e;
                let wd = wt(word);
                let scale = round(scale, dtype);
                for r in 0..seqs.token_rows() {
                    let id = bufs[ids.0][r] as usize;
                    let row: Vec<f64> = wd[id * hidden..(id + 1) * hidden]
                        .iter()
                        .map(|v| v * scale)
                        .collect();
                    bufs[out.0][r * hidden..(r + 1) * hidden].copy_from_slice(&row);
                }
            }
            Op::LayerNorm(l) => {
                let LayerNorm {
                    x,
                    out,
                    rows,
                    hidden,
                    ..
                } = *l;
                let g = wt(l.gamma);
                let b = l.beta.map_or_else(|| vec![0.0; hidden], wt);
                for r in 0..rows {
                    let mut v = bufs[x.0][r * hidden..(r + 1) * hidden].to_vec();
                    ln(&mut v, &g, &b, l.eps);
                    bufs[out.0][r * hidden..(r + 1) * hidden].copy_from_slice(&v);
                }
            }
            Op::Add(a) => {
                let Add {
                    x,
                    into,
                    rows,
                    width,
                } = *a;
                let xs = bufs[x.0][..rows * width].to_vec();
                for (v, a) in bufs[into.0].iter_mut().zip(xs) {
                    *v += a;
                }
            }
            Op::Rotary(r) => {
                let Rotary {
                    qkv,
                    heads,
                    kv_heads,
                    head_dim,
                    seqs,
                    ..
                } = *r;
                let (width, half) = ((heads + 2 * kv_heads) * head_dim, head_dim / 2);
                for (start, real) in sequences(seqs, &bufs) {
                    let len = real.iter().filter(|&&r| r).count();
                    for i in 0..real.len() {
                        // Queries and keys: the row's first heads + kv_heads heads.
                        for head in 0..heads + kv_heads {
                            let base = (start + i) * width + head * head_dim;
                            for d in 0..half {
                                let (cos, sin) = r.angle_in(i, len, d);
                                let (cos, sin) = (cos as f64, sin as f64);
                                let (a, b) = (bufs[qkv.0][base + d], bufs[qkv.0][base + d + half]);
                                bufs[qkv.0][base + d] = a * cos - b * sin;
                                bufs[qkv.0][base + d + half] = b * cos + a * sin;
                            }
                        }
                    }
                }
            }
            Op::RmsNorm(n) => {
                let RmsNorm {
                    x,
                    out,
                    rows,
                    hidden,
                    ..
                } = *n;
                let g = wt(n.gamma);
                for r in 0..rows {
                    let mut v = bufs[x.0][r * hidden..(r + 1) * hidden].to_vec();
                    rms(&mut v, &g, n.weight_offset, n.eps);
                    bufs[out.0][r * hidden..(r + 1) * hidden].copy_from_slice(&v);
                }
            }
            Op::HeadRmsNorm(n) => {
                let HeadRmsNorm {
                    qkv,
                    rows,
                    heads,
                    kv_heads,
                    head_dim,
                    ..
                } = *n;
                let (gq, gk) = (wt(n.q_gamma), wt(n.k_gamma));
                let width = (heads + 2 * kv_heads) * head_dim;
                for r in 0..rows {
                    for head in 0..heads + kv_heads {
                        let g = if head < heads { &gq } else { &gk };
                        let v = &mut bufs[qkv.0][r * width + head * head_dim..][..head_dim];
                        rms(v, g, n.weight_offset, n.eps);
                    }
                }
            }
            Op::Gated(g) => {
                let Gated {
                    x,
                    out,
                    rows,
                    width,
                    act: a,
                    on,
                } = *g;
                for r in 0..rows {
                    for j in 0..width {
                        let (first, second) = (
                            bufs[x.0][r * 2 * width + j],
                            bufs[x.0][r * 2 * width + width + j],
                        );
                        bufs[out.0][r * width + j] = match on {
                            GateOn::First => act(a, first) * second,
                            GateOn::Second => first * act(a, second),
                        };
                    }
                }
            }
        }
    }
    bufs[p.output.0][..rows.rows() * p.output_dim]
        .iter()
        .map(|v| *v as f32)
        .collect()
}
