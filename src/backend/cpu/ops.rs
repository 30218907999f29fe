//! The op kernels of the CPU backend, in f32.
//!
//! Matrix products go through the `gemm` crate (packed, blocked, SIMD); the
//! element-wise and per-row ops are plain loops written so that the compiler
//! vectorises them, parallelised over rows on the backend's own rayon pool
//! (every kernel here runs inside `ThreadPool::install`, so `par_*` and
//! gemm's `Parallelism::Rayon` use that pool, never the global one).
//!
//! No kernel allocates: every buffer, including attention's score scratch,
//! is passed in.

use crate::model::program::{Activation, Attention, GateOn, Pooling, PositionIds, Rotary};
use gemm::Parallelism;
use rayon::prelude::*;

/// Below this many output elements a per-row op runs on the calling thread
/// (splitting it would cost more than it saves).
const PAR_MIN_ELEMS: usize = 1 << 14;

/// Runs `f(row_index, row)` over the `width`-element rows of `out`, split into
/// one contiguous block of rows per thread when that is worth it.
fn for_rows(out: &mut [f32], width: usize, threads: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / width;
    if threads <= 1 || rows < 2 || out.len() < PAR_MIN_ELEMS {
        out.chunks_exact_mut(width)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
        return;
    }
    let per = rows.div_ceil(threads);
    out.par_chunks_mut(per * width)
        .enumerate()
        .for_each(|(c, block)| {
            block
                .chunks_exact_mut(width)
                .enumerate()
                .for_each(|(i, row)| f(c * per + i, row));
        });
}

/// Sum with eight independent accumulators (vectorises; also more accurate
/// than one running sum).
#[inline]
fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    let mut total =
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &t in tail {
        total += t;
    }
    total
}

/// Sum of squared deviations from `mean`, with eight accumulators.
#[inline]
fn sum_sq_dev(xs: &[f32], mean: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            let d = c[i] - mean;
            acc[i] += d * d;
        }
    }
    let mut total =
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &t in tail {
        let d = t - mean;
        total += d * d;
    }
    total
}

/// LayerNorm of one row in place: two-pass mean and (biased) variance in f32.
#[inline]
pub(crate) fn layer_norm_row(row: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let n = row.len() as f32;
    let mean = sum(row) / n;
    let var = sum_sq_dev(row, mean) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, &g), &b) in row.iter_mut().zip(gamma).zip(beta) {
        *v = (*v - mean) * inv * g + b;
    }
}

/// `out[m, n] = act(x[m, k] · wᵀ + bias)`, `w` stored `[n, k]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    threads: usize,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    act: Activation,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    let out = &mut out[..m * n];
    let x = &x[..m * k];
    let w = &w[..n * k];
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: dst is m×n with row stride n (`out` holds m·n); lhs is m×k with
    // row stride k (`x` holds m·k); rhs = wᵀ is k×n with element (i, j) at
    // w[j·k + i], whose largest offset is n·k − 1 < w.len(). No aliasing: out
    // is a unique borrow.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    if bias.is_none() && act == Activation::Identity {
        return;
    }
    for_rows(out, n, threads, |_, row| epilogue(row, bias, act));
}

/// `row = act(row + bias)`, with the activation chosen outside the loop.
#[inline]
fn epilogue(row: &mut [f32], bias: Option<&[f32]>, act: Activation) {
    if let Some(b) = bias {
        row.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
    }
    match act {
        Activation::Identity => {}
        Activation::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
        other => row.iter_mut().for_each(|v| *v = other.apply(*v)),
    }
}

/// Where a batch's sequences lie in its token rows: a program's
/// [`Seqs`](crate::model::program::Seqs) bound to the batch's inputs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SeqIndex<'a> {
    /// Row `b` of `seq` slots is sequence `b`, its real tokens where `mask`
    /// is non-zero (`mask` holds one value per slot).
    Padded { mask: &'a [i32], seq: usize },
    /// Sequence `s` is rows `offsets[s] .. offsets[s + 1]`, every one real,
    /// none longer than `max_len`; `positions` holds each token's index in
    /// its sequence. `offsets` (`seqs + 1` values) is non-decreasing from 0
    /// (what packing a checked batch gives).
    Packed {
        offsets: &'a [i32],
        positions: &'a [i32],
        max_len: usize,
    },
}

impl<'a> SeqIndex<'a> {
    /// Sequences.
    pub(crate) fn count(self) -> usize {
        match self {
            SeqIndex::Padded { mask, seq } => mask.len() / seq,
            SeqIndex::Packed { offsets, .. } => offsets.len() - 1,
        }
    }

    /// Sequence `s`'s first row and rows.
    pub(crate) fn rows(self, s: usize) -> (usize, usize) {
        match self {
            SeqIndex::Padded { seq, .. } => (s * seq, seq),
            SeqIndex::Packed { offsets, .. } => {
                let start = offsets[s] as usize;
                (start, offsets[s + 1] as usize - start)
            }
        }
    }

    /// Sequence `s`'s mask (`None`: every row is real).
    fn mask(self, s: usize) -> Option<&'a [i32]> {
        match self {
            SeqIndex::Padded { mask, seq } => Some(&mask[s * seq..(s + 1) * seq]),
            SeqIndex::Packed { .. } => None,
        }
    }

    /// The longest sequence.
    fn max_len(self) -> usize {
        match self {
            SeqIndex::Padded { seq, .. } => seq,
            SeqIndex::Packed { max_len, .. } => max_len,
        }
    }

    /// The rows the sequences cover, from 0 (a packed batch's tail after).
    fn covered(self) -> usize {
        match self {
            SeqIndex::Padded { mask, .. } => mask.len(),
            SeqIndex::Packed { offsets, .. } => offsets[offsets.len() - 1] as usize,
        }
    }

    /// The length of the sequence row `r` belongs to (its real tokens).
    fn len_of(self, r: usize) -> usize {
        match self {
            SeqIndex::Padded { mask, seq } => {
                let b = r / seq;
                mask[b * seq..(b + 1) * seq]
                    .iter()
                    .filter(|&&m| m != 0)
                    .count()
            }
            SeqIndex::Packed { offsets, .. } => {
                // The sequence s with offsets[s] <= r < offsets[s + 1].
                let s = offsets
                    .partition_point(|&o| o as usize <= r)
                    .saturating_sub(1);
                (offsets[(s + 1).min(offsets.len() - 1)] - offsets[s]).max(0) as usize
            }
        }
    }

    /// The index in its sequence of the token at row `r`.
    fn index_of(self, r: usize) -> usize {
        match self {
            SeqIndex::Padded { seq, .. } => r % seq,
            SeqIndex::Packed { positions, .. } => positions[r] as usize,
        }
    }
}

/// `out[r] = LayerNorm(word[ids[r]] + position[p(r)] + token_type[types[r]])`
/// for every row `r` of `ids`, `p(r)` by `position_ids` from the token's
/// index in its sequence; see [`crate::model::program::Op::EmbedLayerNorm`].
/// Ids and types are checked by the caller (the plan validates batches).
#[allow(clippy::too_many_arguments)]
pub(crate) fn embed_layer_norm(
    threads: usize,
    ids: &[i32],
    types: &[i32],
    seqs: SeqIndex<'_>,
    word: &[f32],
    position: &[f32],
    token_type: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    out: &mut [f32],
    hidden: usize,
    position_ids: PositionIds,
) {
    let rows = ids.len();
    for_rows(&mut out[..rows * hidden], hidden, threads, |r, row| {
        let (id, t, index) = (ids[r] as usize, types[r] as usize, seqs.index_of(r));
        let p = position_ids.position(&ids[r - index..=r], index);
        let w = &word[id * hidden..(id + 1) * hidden];
        let pe = &position[p * hidden..(p + 1) * hidden];
        let te = &token_type[t * hidden..(t + 1) * hidden];
        for (((o, &a), &b), &c) in row.iter_mut().zip(w).zip(pe).zip(te) {
            *o = a + b + c;
        }
        layer_norm_row(row, gamma, beta, eps);
    });
}

/// `out[r] = word[ids[r]] · scale` for every row `r` of `ids` (a rotary
/// model's embedding: no position or token-type table).
pub(crate) fn embed(
    threads: usize,
    ids: &[i32],
    word: &[f32],
    scale: f32,
    out: &mut [f32],
    hidden: usize,
) {
    let rows = ids.len();
    for_rows(&mut out[..rows * hidden], hidden, threads, |r, row| {
        let id = ids[r] as usize;
        let src = &word[id * hidden..(id + 1) * hidden];
        if scale == 1.0 {
            row.copy_from_slice(src);
        } else {
            row.iter_mut().zip(src).for_each(|(o, &w)| *o = w * scale);
        }
    });
}

/// `x = x / √(mean(x²) + eps) · (offset + gamma)` in place over rows of
/// `gamma.len()` values (an RMSNorm; see
/// [`crate::model::program::RmsNorm`]).
pub(crate) fn rms_norm_row(row: &mut [f32], gamma: &[f32], offset: f32, eps: f32) {
    let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    row.iter_mut()
        .zip(gamma)
        .for_each(|(v, &g)| *v *= r * (offset + g));
}

/// [`rms_norm_row`] over `rows` rows of `x`, in place.
pub(crate) fn rms_norm_in_place(
    threads: usize,
    x: &mut [f32],
    gamma: &[f32],
    offset: f32,
    eps: f32,
    rows: usize,
) {
    let hidden = gamma.len();
    for_rows(&mut x[..rows * hidden], hidden, threads, |_, row| {
        rms_norm_row(row, gamma, offset, eps)
    });
}

/// Qwen3's and Gemma's q/k norms: [`rms_norm_row`] over every query head
/// (with `q_gamma`) and key head (`k_gamma`) of `qkv`'s first `rows` rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_rms_norm(
    threads: usize,
    qkv: &mut [f32],
    rows: usize,
    heads: usize,
    kv_heads: usize,
    q_gamma: &[f32],
    k_gamma: &[f32],
    offset: f32,
    eps: f32,
) {
    let d = q_gamma.len();
    let width = (heads + 2 * kv_heads) * d;
    for_rows(&mut qkv[..rows * width], width, threads, |_, row| {
        for (i, head) in row[..(heads + kv_heads) * d]
            .chunks_exact_mut(d)
            .enumerate()
        {
            let g = if i < heads { q_gamma } else { k_gamma };
            rms_norm_row(head, g, offset, eps);
        }
    });
}

/// `x = LayerNorm(x)` in place over `rows` rows; `beta` absent: no bias.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_in_place(
    threads: usize,
    x: &mut [f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    eps: f32,
    rows: usize,
    hidden: usize,
) {
    for_rows(
        &mut x[..rows * hidden],
        hidden,
        threads,
        |_, row| match beta {
            Some(beta) => layer_norm_row(row, gamma, beta, eps),
            None => {
                let n = row.len() as f32;
                let mean = sum(row) / n;
                let inv = 1.0 / (sum_sq_dev(row, mean) / n + eps).sqrt();
                for (v, &g) in row.iter_mut().zip(gamma) {
                    *v = (*v - mean) * inv * g;
                }
            }
        },
    );
}

/// `into += x` over the first `n` values.
pub(crate) fn add(threads: usize, x: &[f32], into: &mut [f32], n: usize, width: usize) {
    for_rows(&mut into[..n], width, threads, |r, row| {
        let xr = &x[r * width..(r + 1) * width];
        row.iter_mut().zip(xr).for_each(|(v, &a)| *v += a);
    });
}

/// Rotary position embedding in place on the query and key parts of
/// `qkv`'s first `tokens` rows; see [`Rotary`]. Each token's position is
/// its index in its sequence (padding and tail rows are rotated too: no
/// real token reads them).
pub(crate) fn rotary(
    threads: usize,
    qkv: &mut [f32],
    seqs: SeqIndex<'_>,
    tokens: usize,
    r: &Rotary,
) {
    let half = r.head_dim / 2;
    let width = (r.heads + 2 * r.kv_heads) * r.head_dim;
    let rotated = (r.heads + r.kv_heads) * r.head_dim;
    let covered = seqs.covered();
    for_rows(
        &mut qkv[..tokens * width],
        width,
        threads,
        |row_index, row| {
            let (p, len) = if row_index < covered {
                (seqs.index_of(row_index), seqs.len_of(row_index))
            } else {
                (0, 0)
            };
            let angles: Vec<(f32, f32)> = (0..half).map(|d| r.angle_in(p, len, d)).collect();
            for head in row[..rotated].chunks_exact_mut(r.head_dim) {
                let (a, b) = head.split_at_mut(half);
                for ((x, y), &(cos, sin)) in a.iter_mut().zip(b.iter_mut()).zip(&angles) {
                    let (u, v) = (*x, *y);
                    *x = u * cos - v * sin;
                    *y = v * cos + u * sin;
                }
            }
        },
    );
}

/// A gated unit: `out[r, j] = act(x[r, j]) · x[r, width + j]` (`GateOn::First`)
/// or `x[r, j] · act(x[r, width + j])`, for `rows` rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated(
    threads: usize,
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    width: usize,
    act: Activation,
    on: GateOn,
) {
    for_rows(&mut out[..rows * width], width, threads, |r, row| {
        let (first, second) = x[r * 2 * width..(r + 1) * 2 * width].split_at(width);
        for ((o, &a), &b) in row.iter_mut().zip(first).zip(second) {
            *o = match on {
                GateOn::First => act.apply(a) * b,
                GateOn::Second => a * act.apply(b),
            };
        }
    });
}

/// `res_out = LayerNorm(x + res_out)` (the residual is updated in place).
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_layer_norm_in_place(
    threads: usize,
    x: &[f32],
    res_out: &mut [f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    rows: usize,
    hidden: usize,
) {
    for_rows(&mut res_out[..rows * hidden], hidden, threads, |r, row| {
        let xr = &x[r * hidden..(r + 1) * hidden];
        row.iter_mut().zip(xr).for_each(|(v, &a)| *v += a);
        layer_norm_row(row, gamma, beta, eps);
    });
}

/// A raw output pointer that attention tasks write disjoint blocks through.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every task writes a disjoint set of elements (see `attention`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}
impl SharedOut {
    /// A method (not a field access) so closures capture the whole wrapper.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Query rows a task scores at once: the score scratch is
/// `ATTENTION_QUERY_BLOCK × len` per worker, so memory stays bounded for
/// long sequences.
pub(crate) const ATTENTION_QUERY_BLOCK: usize = 256;

/// The score scratch one worker needs for sequences of up to `max_len`.
pub(crate) fn attention_scratch(max_len: usize) -> usize {
    max_len.min(ATTENTION_QUERY_BLOCK) * max_len
}

/// Multi-head attention over a fused `[q | k | v]` projection; see
/// [`crate::model::program::Attention`] (grouped-query heads, the
/// window and causal masks, the score scale). A task is one (sequence,
/// query head); it scores blocks of up to [`ATTENTION_QUERY_BLOCK`]
/// queries against the sequence's keys by gemm into a per-worker scratch,
/// softmax per query row (over the keys whose mask is set, max
/// subtracted), then `O = P·V` by gemm straight into the head's columns
/// of `out`. Keys after a padded sequence's last real one are skipped
/// (their probability is exactly 0), so padding cannot change any value;
/// a sequence with no real key produces zeros, and the first `tokens`
/// rows no sequence covers (a packed batch's tail) are zeroed.
///
/// `scratch` holds `workers ·` [`attention_scratch`] floats; tasks are
/// dealt round-robin to the workers. `bias` is a position-bias table
/// `[heads, 2·radius + 1]` and its radius (see
/// [`crate::model::program::PositionBias`]), added to the scaled scores.
pub(crate) fn attention(
    qkv: &[f32],
    seqs: SeqIndex<'_>,
    out: &mut [f32],
    scratch: &mut [f32],
    tokens: usize,
    a: &Attention,
    bias: Option<(&[f32], usize)>,
) {
    let (heads, head_dim) = (a.heads, a.head_dim);
    let h = heads * head_dim;
    let stride = a.qkv_width();
    let group = heads / a.kv_heads;
    let max_len = seqs.max_len();
    let covered = seqs.covered();
    assert!(
        (0..seqs.count()).all(|s| {
            let (start, len) = seqs.rows(s);
            len <= max_len && start + len <= covered
        }) && covered <= tokens,
        "sequences are checked when the batch is packed"
    );
    assert!(qkv.len() >= tokens * stride && out.len() >= tokens * h);
    let chunk = attention_scratch(max_len);
    assert!(scratch.len() >= chunk && max_len > 0);
    out[covered * h..tokens * h].fill(0.0);
    let tasks = seqs.count() * heads;
    let scale = a.score_scale();
    let shared = SharedOut(out.as_mut_ptr());
    let run = |task: usize, s: &mut [f32]| {
        let (seq, head) = (task / heads, task % heads);
        let kv_head = head / group;
        let (start, len) = seqs.rows(seq);
        let mask = seqs.mask(seq);
        let kv_len = mask.map_or(len, |m| {
            m.iter().rposition(|&v| v != 0).map_or(0, |p| p + 1)
        });
        // SAFETY: this task's block of `out` is rows start .. start + len,
        // columns head·head_dim .. (head+1)·head_dim (row stride h): in
        // bounds (asserted above) and disjoint from every other task's
        // (sequences do not overlap).
        let o = unsafe { shared.ptr().add(start * h + head * head_dim) };
        if kv_len == 0 {
            for i in 0..len {
                // SAFETY: row i of this task's block, head_dim elements.
                unsafe { std::slice::from_raw_parts_mut(o.add(i * h), head_dim) }.fill(0.0);
            }
            return;
        }
        let base = start * stride;
        let k = qkv[base + h + kv_head * head_dim..].as_ptr();
        let v = qkv[base + h + a.kv_heads * head_dim + kv_head * head_dim..].as_ptr();
        for q0 in (0..len).step_by(ATTENTION_QUERY_BLOCK) {
            let rows = ATTENTION_QUERY_BLOCK.min(len - q0);
            let q = qkv[base + q0 * stride + head * head_dim..].as_ptr();
            let s = &mut s[..rows * kv_len];
            // SAFETY (both products): Q is rows×head_dim at q + i·stride +
            // d, Kᵀ is head_dim×kv_len at k + j·stride + d, V is
            // kv_len×head_dim at v + j·stride + d; every offset is below
            // (start+len)·stride − base, in `qkv`. S is rows×kv_len in `s`;
            // O is rows q0.. of this task's block of `out`.
            unsafe {
                gemm::gemm(
                    rows,
                    kv_len,
                    head_dim,
                    s.as_mut_ptr(),
                    1,
                    kv_len as isize,
                    false,
                    q,
                    1,
                    stride as isize,
                    k,
                    stride as isize,
                    1,
                    0.0,
                    scale,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
            if let Some((table, radius)) = bias {
                add_position_bias(s, kv_len, q0, table, radius, head);
            }
            for (r, row) in s.chunks_exact_mut(kv_len).enumerate() {
                let i = q0 + r;
                if a.window.is_some() || a.causal {
                    for (j, v) in row.iter_mut().enumerate() {
                        if !a.sees(i, j) {
                            *v = f32::NEG_INFINITY;
                        }
                    }
                }
                match mask {
                    Some(m) => masked_softmax(row, &m[..kv_len]),
                    None => softmax(row),
                }
            }
            unsafe {
                gemm::gemm(
                    rows,
                    head_dim,
                    kv_len,
                    o.add(q0 * h),
                    1,
                    h as isize,
                    false,
                    s.as_ptr(),
                    1,
                    kv_len as isize,
                    v,
                    1,
                    stride as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        }
    };
    let workers = (scratch.len() / chunk).clamp(1, tasks.max(1));
    if workers == 1 {
        let s = &mut scratch[..chunk];
        (0..tasks).for_each(|t| run(t, s));
    } else {
        scratch[..workers * chunk]
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(w, s)| (w..tasks).step_by(workers).for_each(|t| run(t, s)));
    }
}

/// Adds head `head`'s position bias to the scores `s` (rows of `keys`
/// values; row `i` is query `first + i`, column `j` key `j`).
#[inline]
fn add_position_bias(
    s: &mut [f32],
    keys: usize,
    first: usize,
    table: &[f32],
    radius: usize,
    head: usize,
) {
    let cols = 2 * radius + 1;
    let t = &table[head * cols..(head + 1) * cols];
    let r = radius as isize;
    for (i, row) in s.chunks_exact_mut(keys).enumerate() {
        let q = (first + i) as isize;
        for (j, v) in row.iter_mut().enumerate() {
            *v += t[((j as isize - q).clamp(-r, r) + r) as usize];
        }
    }
}

/// Softmax of a non-empty row (max subtracted).
#[inline]
fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        // Every key out of a sliding window (a padding query): zeros.
        row.fill(0.0);
        return;
    }
    let mut total = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        total += *v;
    }
    let inv = 1.0 / total;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Softmax over the keys whose mask is non-zero (others get 0); at least one
/// key is unmasked (the caller ends the row at the last unmasked key).
#[inline]
fn masked_softmax(row: &mut [f32], mask: &[i32]) {
    let mut max = f32::NEG_INFINITY;
    for (&v, &m) in row.iter().zip(mask) {
        if m != 0 && v > max {
            max = v;
        }
    }
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let mut total = 0.0f32;
    for (v, &m) in row.iter_mut().zip(mask) {
        *v = if m != 0 { (*v - max).exp() } else { 0.0 };
        total += *v;
    }
    let inv = 1.0 / total;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Sentence pooling `[token rows, hidden]` → `[sequences, hidden]`, then
/// optional L2 normalisation; see [`crate::model::program::Op::Pool`]. Each
/// sequence pools its real tokens from index `skip[s]` on (0 without a
/// skip): mean divides by their count, max takes their element-wise
/// maximum, cls the first of them (a padded sequence without a skip: slot
/// 0, real or not), last token the last of them; none left gives zeros.
pub(crate) fn pool(
    x: &[f32],
    seqs: SeqIndex<'_>,
    out: &mut [f32],
    hidden: usize,
    mode: Pooling,
    normalize: bool,
    skip: Option<&[i32]>,
) {
    let count = seqs.count();
    for (s, o) in out[..count * hidden].chunks_exact_mut(hidden).enumerate() {
        let (start, len) = seqs.rows(s);
        let token = |t: usize| &x[(start + t) * hidden..(start + t + 1) * hidden];
        let first = skip.map_or(0, |k| (k[s].max(0) as usize).min(len));
        let mask = seqs.mask(s);
        // The pooled positions.
        let pooled = || (first..len).filter(|&t| mask.is_none_or(|m| m[t] != 0));
        match mode {
            Pooling::Mean => {
                o.fill(0.0);
                let mut count = 0usize;
                for t in pooled() {
                    o.iter_mut().zip(token(t)).for_each(|(a, &v)| *a += v);
                    count += 1;
                }
                let denom = (count as f32).max(1e-9);
                o.iter_mut().for_each(|a| *a /= denom);
            }
            Pooling::Sum => {
                o.fill(0.0);
                for t in pooled() {
                    o.iter_mut().zip(token(t)).for_each(|(a, &v)| *a += v);
                }
            }
            Pooling::LastToken => match pooled().next_back() {
                Some(t) => o.copy_from_slice(token(t)),
                None => o.fill(0.0),
            },
            Pooling::Cls if skip.is_none() && mask.is_some() => o.copy_from_slice(token(0)),
            Pooling::Cls => match pooled().next() {
                Some(t) => o.copy_from_slice(token(t)),
                None => o.fill(0.0),
            },
            Pooling::Max => {
                o.fill(f32::NEG_INFINITY);
                let mut any = false;
                for t in pooled() {
                    o.iter_mut().zip(token(t)).for_each(|(a, &v)| *a = a.max(v));
                    any = true;
                }
                if !any {
                    o.fill(0.0);
                }
            }
        }
        if normalize {
            let norm = o.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            o.iter_mut().for_each(|v| *v /= norm);
        }
    }
}

/// L2 normalisation of each `width`-value row of `x`, in place.
pub(crate) fn normalize_rows(x: &mut [f32], width: usize) {
    for row in x.chunks_exact_mut(width) {
        let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
        row.iter_mut().for_each(|v| *v /= norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_matches_f64() {
        let row: Vec<f32> = (0..37)
            .map(|i| (i as f32 * 0.37).sin() * 3.0 + 100.0)
            .collect();
        let gamma: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let beta: Vec<f32> = (0..37).map(|i| i as f32 * -0.02).collect();
        let mut got = row.clone();
        layer_norm_row(&mut got, &gamma, &beta, 1e-12);
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / 37.0;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let want =
                (row[i] as f64 - mean) / (var + 1e-12).sqrt() * gamma[i] as f64 + beta[i] as f64;
            assert!(
                (got[i] as f64 - want).abs() < 1e-4,
                "{i}: {} vs {want}",
                got[i]
            );
        }
    }

    /// Naive f64 attention for one (batch, head), for checking the kernel.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        qkv: &[f32],
        mask: &[i32],
        seq: usize,
        heads: usize,
        d: usize,
        b: usize,
        hd: usize,
        i: usize,
    ) -> Vec<f64> {
        let h = heads * d;
        let at = |t: usize, part: usize, e: usize| {
            qkv[(b * seq + t) * 3 * h + part * h + hd * d + e] as f64
        };
        let scores: Vec<Option<f64>> = (0..seq)
            .map(|j| {
                (mask[b * seq + j] != 0).then(|| {
                    (0..d).map(|e| at(i, 0, e) * at(j, 1, e)).sum::<f64>() / (d as f64).sqrt()
                })
            })
            .collect();
        let max = scores
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return vec![0.0; d];
        }
        let exps: Vec<f64> = scores
            .iter()
            .map(|s| s.map_or(0.0, |s| (s - max).exp()))
            .collect();
        let total: f64 = exps.iter().sum();
        (0..d)
            .map(|e| (0..seq).map(|j| exps[j] / total * at(j, 2, e)).sum())
            .collect()
    }

    /// An attention op of these head counts (buffers unused here).
    fn mha(heads: usize, kv_heads: usize, head_dim: usize) -> Attention {
        use crate::model::program::{BufId, Seqs};
        Attention {
            qkv: BufId(0),
            out: BufId(1),
            heads,
            kv_heads,
            head_dim,
            bias: None,
            window: None,
            causal: false,
            scale: None,
            seqs: Seqs::Padded {
                mask: BufId(2),
                batch: 1,
                seq: 1,
            },
        }
    }

    /// Causal grouped-query attention over a sequence longer than a query
    /// block equals a naive f64 computation (each query head reading its
    /// group's key/value head, keys up to its own position).
    #[test]
    fn causal_grouped_query_attention_over_query_blocks() {
        let (len, heads, kv_heads, d) = (ATTENTION_QUERY_BLOCK + 45, 4, 2, 8);
        let width = (heads + 2 * kv_heads) * d;
        let qkv: Vec<f32> = (0..len * width)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let mut op = mha(heads, kv_heads, d);
        op.causal = true;
        op.scale = Some(0.3);
        let mask = vec![1; len];
        let mut out = vec![f32::NAN; len * heads * d];
        let mut scratch = vec![0.0; 2 * attention_scratch(len)];
        let seqs = SeqIndex::Padded {
            mask: &mask,
            seq: len,
        };
        attention(&qkv, seqs, &mut out, &mut scratch, len, &op, None);
        for h in 0..heads {
            let kv = h / 2;
            for i in [0, 1, 200, ATTENTION_QUERY_BLOCK, len - 1] {
                let q = &qkv[i * width + h * d..][..d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &qkv[j * width + heads * d + kv * d..][..d];
                        q.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.3
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let total: f64 = e.iter().sum();
                for c in 0..d {
                    let want: f64 = (0..=i)
                        .map(|j| {
                            e[j] / total * qkv[j * width + (heads + kv_heads + kv) * d + c] as f64
                        })
                        .sum();
                    let got = out[i * heads * d + h * d + c] as f64;
                    assert!((got - want).abs() < 1e-5, "h{h} i{i} c{c}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn attention_matches_naive_reference_with_masks() {
        let (batch, seq, heads, d) = (3, 7, 2, 4);
        let h = heads * d;
        let qkv: Vec<f32> = (0..batch * seq * 3 * h)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        // Row 0: full; row 1: prefix of 3 plus a hole; row 2: fully masked.
        let mut mask = vec![1; seq];
        mask.extend([1, 0, 1, 0, 0, 0, 0]);
        mask.extend([0; 7]);
        for workers in [1, 2, 4] {
            let mut out = vec![f32::NAN; batch * seq * h];
            let mut scratch = vec![0.0; workers * seq * seq];
            let seqs = SeqIndex::Padded { mask: &mask, seq };
            attention(
                &qkv,
                seqs,
                &mut out,
                &mut scratch,
                batch * seq,
                &mha(heads, heads, d),
                None,
            );
            for b in 0..batch {
                for hd in 0..heads {
                    for i in 0..seq {
                        let want = reference(&qkv, &mask, seq, heads, d, b, hd, i);
                        for e in 0..d {
                            let got = out[(b * seq + i) * h + hd * d + e] as f64;
                            assert!(
                                (got - want[e]).abs() < 1e-5,
                                "b{b} h{hd} i{i} e{e}: {got} vs {}",
                                want[e]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn pooling_modes() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, -6.0, 0.0, 0.0];
        let mask = [1, 1, 1, 0];
        let mut out = [0.0; 4];
        let seqs = SeqIndex::Padded {
            mask: &mask,
            seq: 2,
        };
        pool(&x, seqs, &mut out, 2, Pooling::Mean, false, None);
        assert_eq!(out, [2.0, 3.0, 5.0, -6.0]);
        pool(&x, seqs, &mut out, 2, Pooling::Max, false, None);
        assert_eq!(out, [3.0, 4.0, 5.0, -6.0]);
        pool(&x, seqs, &mut out, 2, Pooling::LastToken, false, None);
        assert_eq!(out, [3.0, 4.0, 5.0, -6.0]);
        pool(&x, seqs, &mut out, 2, Pooling::Cls, true, None);
        let n = (5.0f32).sqrt();
        assert_eq!(out[..2], [1.0 / n, 2.0 / n]);
        let none = SeqIndex::Padded {
            mask: &[0, 0, 0, 0],
            seq: 2,
        };
        pool(&x, none, &mut out, 2, Pooling::Mean, true, None);
        assert_eq!(out, [0.0; 4]);
    }

    /// Packed attention equals the padded one run on each sequence alone (a
    /// batch of one unmasked row), and zeroes the tail.
    #[test]
    fn packed_attention_matches_padded_rows() {
        let (heads, d) = (2, 4);
        let h = heads * d;
        let lens = [3usize, 0, 7, 1, 5];
        let offsets: Vec<i32> = std::iter::once(0)
            .chain(lens.iter().scan(0, |acc, &l| {
                *acc += l as i32;
                Some(*acc)
            }))
            .collect();
        let tokens = 19; // 16 real, 3 tail
        let qkv: Vec<f32> = (0..tokens * 3 * h)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        for workers in [1, 3] {
            let mut out = vec![f32::NAN; tokens * h];
            let mut scratch = vec![0.0; workers * 7 * 7];
            let positions = vec![0; tokens];
            let seqs = SeqIndex::Packed {
                offsets: &offsets,
                positions: &positions,
                max_len: 7,
            };
            attention(
                &qkv,
                seqs,
                &mut out,
                &mut scratch,
                tokens,
                &mha(heads, heads, d),
                None,
            );
            for (s, &len) in lens.iter().enumerate().filter(|(_, &l)| l > 0) {
                let start = offsets[s] as usize;
                let rows = &qkv[start * 3 * h..(start + len) * 3 * h];
                let mut want = vec![0.0; len * h];
                let mut sc = vec![0.0; len * len];
                let mask = vec![1; len];
                let one = SeqIndex::Padded {
                    mask: &mask,
                    seq: len,
                };
                let op = mha(heads, heads, d);
                attention(rows, one, &mut want, &mut sc, len, &op, None);
                let got = &out[start * h..(start + len) * h];
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-6, "seq {s}: {a} vs {b}");
                }
            }
            assert!(out[16 * h..].iter().all(|&v| v == 0.0));
            assert!(out.iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn packed_pooling_modes() {
        // Sequences [1, 2], [3, 4], [5, -6] | [] | [7, 8]; a tail slot.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, -6.0, 7.0, 8.0, 9.0, 9.0];
        let offsets = [0, 3, 3, 4];
        let mut out = [f32::NAN; 6];
        let seqs = SeqIndex::Packed {
            offsets: &offsets,
            positions: &[0, 1, 2, 0, 0],
            max_len: 3,
        };
        pool(&x, seqs, &mut out, 2, Pooling::Mean, false, None);
        assert_eq!(out, [3.0, 0.0, 0.0, 0.0, 7.0, 8.0]);
        pool(&x, seqs, &mut out, 2, Pooling::Max, false, None);
        assert_eq!(out, [5.0, 4.0, 0.0, 0.0, 7.0, 8.0]);
        pool(&x, seqs, &mut out, 2, Pooling::LastToken, false, None);
        assert_eq!(out, [5.0, -6.0, 0.0, 0.0, 7.0, 8.0]);
        pool(&x, seqs, &mut out, 2, Pooling::Cls, true, None);
        let n = (5.0f32).sqrt();
        assert_eq!(out[..2], [1.0 / n, 2.0 / n]);
        assert_eq!(out[2..4], [0.0, 0.0]);
    }
}
