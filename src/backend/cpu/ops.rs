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

use crate::model::program::{Activation, GateOn, Pooling, PositionIds, Rotary};
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

/// `out[r] = word[ids[r]]` for every row `r` of `ids` (a rotary model's
/// embedding: no position or token-type table).
pub(crate) fn embed(threads: usize, ids: &[i32], word: &[f32], out: &mut [f32], hidden: usize) {
    let rows = ids.len();
    for_rows(&mut out[..rows * hidden], hidden, threads, |r, row| {
        let id = ids[r] as usize;
        row.copy_from_slice(&word[id * hidden..(id + 1) * hidden]);
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
    let (hd, half) = (r.heads * r.head_dim, r.head_dim / 2);
    let covered = seqs.covered();
    for_rows(
        &mut qkv[..tokens * 3 * hd],
        3 * hd,
        threads,
        |row_index, row| {
            let (p, len) = if row_index < covered {
                (seqs.index_of(row_index), seqs.len_of(row_index))
            } else {
                (0, 0)
            };
            let angles: Vec<(f32, f32)> = (0..half).map(|d| r.angle_in(p, len, d)).collect();
            for head in row[..2 * hd].chunks_exact_mut(r.head_dim) {
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

/// Multi-head self-attention over a fused `[q | k | v]` projection; see
/// [`crate::model::program::Op::Attention`].
///
/// One task per (sequence, head): scores `S = Q·Kᵀ/√d` by gemm into a
/// per-worker scratch of `max_len²` floats, softmax per query row (over the
/// keys whose mask is set, max subtracted), then `O = P·V` by gemm straight
/// into the head's columns of `out`. Keys after a padded sequence's last
/// real one are skipped (their probability is exactly 0), so a padded
/// sequence costs what its real length costs in the score/value products,
/// and padding cannot change any value; masked keys inside that range get
/// probability 0, and a sequence with no real key produces zeros. Empty
/// sequences cost nothing; the first `tokens` rows no sequence covers (a
/// packed batch's tail) are zeroed.
///
/// `scratch` holds `workers · max_len²` floats; tasks are dealt round-robin
/// to `workers = scratch.len() / max_len²` parallel workers.
///
/// `bias` is a position-bias table `[heads, 2·radius + 1]` and its radius
/// (see [`crate::model::program::PositionBias`]), added to the scaled scores.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    qkv: &[f32],
    seqs: SeqIndex<'_>,
    out: &mut [f32],
    scratch: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    bias: Option<(&[f32], usize)>,
    window: Option<usize>,
) {
    let h = heads * head_dim;
    let stride = 3 * h;
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
    assert!(scratch.len() >= max_len * max_len && max_len > 0);
    out[covered * h..tokens * h].fill(0.0);
    let tasks = seqs.count() * heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let shared = SharedOut(out.as_mut_ptr());
    let run = |task: usize, s: &mut [f32]| {
        let (seq, head) = (task / heads, task % heads);
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
        let base = start * stride + head * head_dim;
        let q = qkv[base..].as_ptr();
        let k = qkv[base + h..].as_ptr();
        let v = qkv[base + 2 * h..].as_ptr();
        let s = &mut s[..len * kv_len];
        // SAFETY (both products): Q is len×head_dim at q + i·stride + d, Kᵀ
        // is head_dim×kv_len at k + j·stride + d, V is kv_len×head_dim at
        // v + j·stride + d; every offset is below (start+len)·stride − base,
        // in `qkv`. S is len×kv_len in `s`; O is this task's block of `out`.
        unsafe {
            gemm::gemm(
                len,
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
            add_position_bias(s, kv_len, 0, table, radius, head);
        }
        for (i, row) in s.chunks_exact_mut(kv_len).enumerate() {
            if let Some(w) = window {
                for (j, v) in row.iter_mut().enumerate() {
                    if i.abs_diff(j) > w {
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
                len,
                head_dim,
                kv_len,
                o,
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
    };
    let chunk = max_len * max_len;
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
/// 0, real or not); none left gives zeros.
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
                heads,
                d,
                None,
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
                heads,
                d,
                None,
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
                attention(rows, one, &mut want, &mut sc, len, heads, d, None, None);
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
        pool(&x, seqs, &mut out, 2, Pooling::Cls, true, None);
        let n = (5.0f32).sqrt();
        assert_eq!(out[..2], [1.0 / n, 2.0 / n]);
        assert_eq!(out[2..4], [0.0, 0.0]);
    }
}
