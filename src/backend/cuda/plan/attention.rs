//! `Attention`: multi-head self-attention over a fused `[q | k | v]`
//! projection, each query attending to the real tokens of its own sequence.
//! Tensor cores (`attention_tc`, `attention_varlen_tc`; f16/bf16, head sizes
//! 32, 64, 128) or CUDA cores (`attention`, `attention_varlen`; any head
//! size up to 128, shared memory sized by the sequence). A padded batch's
//! grid is (query tiles, heads, rows), the mask saying which keys are real;
//! a packed batch's blocks take their work from a tile table the host
//! writes for every batch ([`write_tile_table`]). MPNet's relative position
//! bias is the `_bias` variant of each.
//!
//! Decoders (grouped-query heads, a causal mask, head size 256) take the
//! `_band` kernels: the same tensor-core kernels with `kv_heads`, the head
//! size and the key band `[i − left, i + right]` ([`band_bounds`]: causal is
//! `right = 0`, a sliding window bounds both sides), head-size classes 32,
//! 64, 128 and 256 (any multiple of 8 up to 256: [`band_tc_class`]), and
//! off the tensor cores (f32, other head sizes, `tc_attention` off) a warp
//! per query (`attention_band_<t>_d{128,256}`, prenorm.cu), whose state is
//! in registers, so no sequence is too long for it. Sliding windows without
//! those (ModernBERT) keep `_win` and `attention_window`.

use super::planner::Planner;
use super::INT_INPUT_ALIGN;
use super::{suffix, Arg, Loc, TileTable};
use crate::backend::cuda::kernels::{
    ATTENTION_DMAX, ATTENTION_TC_BAND_HEAD_DIMS, ATTENTION_TC_HEAD_DIMS,
    ATTENTION_TC_Q128_HEAD_DIMS, ATTENTION_TC_S16_HEAD_DIMS,
};
use crate::backend::cuda::mem::align_up;
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{Attention, PositionBias, Seqs};
use crate::tensor::DType;

/// Threads per block of the attention kernel (`ATT_THREADS` in attention.cu).
pub const ATT_THREADS: u32 = 128;
/// Queries per attention block (`ATT_QT`).
pub const ATT_QT: usize = 32;
/// Keys per shared-memory chunk (`ATT_KC`).
pub const ATT_KC: usize = 64;
/// Threads per tensor-core attention block (`TC_THREADS` in attention_tc.cu).
pub const TC_THREADS: u32 = 128;
/// Queries per tensor-core attention block (`TC_QT`).
pub const TC_QT: usize = 64;
/// Queries per tile of the tensor-core varlen attention (`VT_QT` in
/// attention_varlen.cu, = `TC_QT`).
pub const VARLEN_TC_QT: usize = TC_QT;
/// Queries per tile of the CUDA-core varlen attention (`VA_QT`, = `ATT_QT`).
pub const VARLEN_QT: usize = ATT_QT;
/// i32 values per tile-table entry: `{q_start, q_count, kv_start, kv_len}`.
pub const TILE_ENTRY: usize = 4;
/// The longest padded sequence that takes `attention_tc_s16`
/// ([`KernelPath::AttnS16`]).
pub const ATTN_S16_MAX_SEQ: usize = 16;
/// The shortest padded sequence that takes `attention_tc_q128` (128
/// queries a block, [`KernelPath::AttnQ128`]) at head size 64.
pub const ATTN_Q128_MIN_SEQ: usize = 128;
/// The same at head size 32, where 128-query blocks measured slower at 128
/// tokens (MiniLM (128, 128) on an H100: 44.2 µs a layer against 40.8 for
/// 64-query blocks) and faster at 512 ((32, 512): 92.3 against 96.3);
/// between them is unmeasured, so they keep the 64-query blocks.
pub const ATTN_Q128_MIN_SEQ_D32: usize = 512;

/// The shortest padded sequence that takes `attention_tc_q128` at
/// `head_dim`.
pub fn attn_q128_min_seq(head_dim: usize) -> usize {
    if head_dim <= 32 {
        ATTN_Q128_MIN_SEQ_D32
    } else {
        ATTN_Q128_MIN_SEQ
    }
}

/// Whether `op` takes the band kernels: grouped-query heads, the causal
/// mask, or a head size over 128 (EmbeddingGemma's 256).
pub fn is_band(op: &Attention) -> bool {
    op.kv_heads != op.heads || op.causal || op.head_dim > 128
}

/// The key band `(left, right)` of a band kernel: query `i` sees keys
/// `i − left ..= i + right` of its sequence. Causal: `right = 0`; a window
/// `w`: at most `w` on either side; unbounded sides are `slots` (the
/// longest a sequence can be: the padded length, or the packed budget),
/// at most 2²⁸ so that the kernels' `i + right` cannot overflow.
pub fn band_bounds(op: &Attention, slots: usize) -> (i32, i32) {
    let slots = slots.min(1 << 28);
    let side = op.window.map_or(slots, |w| w.min(slots)) as i32;
    (side, if op.causal { 0 } else { side })
}

/// The tensor-core band kernel's head-size class for `head_dim` (the
/// `d<N>` suffix, [`ATTENTION_TC_BAND_HEAD_DIMS`]): the smallest that holds
/// it, for head sizes that are a multiple of 8 (16-byte rows); the columns
/// past the head are zeros in the kernel.
pub fn band_tc_class(head_dim: usize) -> Option<usize> {
    if head_dim == 0 || !head_dim.is_multiple_of(8) {
        return None;
    }
    ATTENTION_TC_BAND_HEAD_DIMS
        .iter()
        .copied()
        .find(|&d| head_dim <= d)
}

/// The attention kernel's head-size class (the `d<N>` suffix).
pub fn attention_dmax(head_dim: usize) -> Option<usize> {
    ATTENTION_DMAX
        .iter()
        .copied()
        .find(|&d| head_dim <= d && head_dim > 0)
}

/// Dynamic shared memory of the attention kernel, in bytes.
pub fn attention_smem_bytes(seq: usize, dmax: usize) -> usize {
    4 * (ATT_QT * (dmax + 1) + ATT_KC * (dmax + 1) + ATT_QT * (seq | 1))
}

/// The most query tiles of at most `qt` tokens a packed batch of `tokens`
/// slots and at most `seqs` sequences can need, the tail included: each
/// sequence and the tail split into `ceil(len / qt)` tiles, at most
/// `floor(tokens / qt)` of them full and at most one partial tile per
/// non-empty part (`seqs + 1` parts), and never more tiles than slots.
pub fn max_tiles(tokens: usize, seqs: usize, qt: usize) -> usize {
    tokens.min(tokens / qt + seqs + 1)
}

/// Writes the tile table of a packed batch whose sequences have lengths
/// `lens` (end to end from slot 0) in a budget of `tokens` slots, for tiles
/// of at most `qt` queries. `dst` holds [`max_tiles`] entries of
/// [`TILE_ENTRY`] i32: `{q_start, q_count, kv_start, kv_len}`.
///
/// Order: the tiles of the longest sequences first (their blocks cost the
/// most, and blocks are dispatched in table order, so the short ones fill
/// in at the end), then the tail's tiles (`kv_len = 0`: their rows get
/// zeros), then unused entries (all zero: `q_count = 0`, the block exits).
/// `order` is scratch for the sort (kept by the caller so a replay does not
/// allocate once it has grown).
///
/// Panics if the lengths do not fit (more tokens than the budget, or more
/// tiles than `dst` holds); a checked batch never does.
pub fn write_tile_table(
    lens: impl IntoIterator<Item = usize>,
    tokens: usize,
    qt: usize,
    dst: &mut [i32],
    order: &mut Vec<(usize, usize)>,
) {
    assert!(qt > 0 && dst.len().is_multiple_of(TILE_ENTRY));
    order.clear();
    let mut start = 0;
    for len in lens {
        order.push((len, start));
        start += len;
    }
    assert!(start <= tokens, "{start} tokens in a budget of {tokens}");
    // Longest first; equal lengths in batch order (the start breaks ties, so
    // an unstable sort, which does not allocate, gives the same order).
    order.sort_unstable_by_key(|&(len, start)| (std::cmp::Reverse(len), start));
    let mut entries = dst.chunks_exact_mut(TILE_ENTRY);
    let mut push = |q_start: usize, q_count: usize, kv_start: usize, kv_len: usize| {
        let e = entries
            .next()
            .expect("the tile table is sized for the worst case");
        e.copy_from_slice(&[
            q_start as i32,
            q_count as i32,
            kv_start as i32,
            kv_len as i32,
        ]);
    };
    for &(len, seq_start) in order.iter() {
        for q in (0..len).step_by(qt) {
            push(seq_start + q, qt.min(len - q), seq_start, len);
        }
    }
    for q in (start..tokens).step_by(qt) {
        push(q, qt.min(tokens - q), q, 0);
    }
    for e in entries {
        e.fill(0);
    }
}

impl Planner<'_> {
    /// `Attention` on the kernel of its layout, dtype and head size.
    pub(super) fn attention(&mut self, idx: usize, op: &Attention) -> Result<usize, BackendError> {
        let (heads, head_dim, seqs) = (op.heads, op.head_dim, op.seqs);
        let t = self.compute;
        let band = is_band(op);
        // The band kernels take any head size of a multiple of 8 up to 256
        // (in the class above it); the others exactly theirs.
        let tc_class = if band {
            band_tc_class(head_dim)
        } else {
            ATTENTION_TC_HEAD_DIMS
                .contains(&head_dim)
                .then_some(head_dim)
        };
        let tensor_cores = self.on(KernelPath::TcAttention)
            && matches!(t, DType::F16 | DType::BF16)
            && tc_class.is_some();
        // Off the tensor cores, a decoder's attention takes the warp per
        // query (`attention_band`, any length); so does a sliding window
        // (`attention_window`, f32, other head sizes).
        if band && !tensor_cores {
            return self.attention_band(idx, op);
        }
        if let Some(window) = op.window {
            if !band && (!tensor_cores || op.bias.is_some()) {
                return self.attention_window(idx, op, window);
            }
        }
        let what = format!("op {idx} (Attention)");
        let dmax = if let (true, Some(class)) = (tensor_cores, tc_class) {
            class
        } else {
            attention_dmax(head_dim).ok_or_else(|| {
                BackendError::Unsupported(format!("{what}: head size {head_dim} (at most 128)"))
            })?
        };
        // The grid: a padded batch's (query tiles, heads, rows); a packed
        // one's tiles × heads, each block reading its tile from the table.
        // Long padded sequences (no bias, band or window): 128 queries a
        // block, two 16-row tiles a warp.
        let q128 = tensor_cores
            && !band
            && op.window.is_none()
            && op.bias.is_none()
            && self.on(KernelPath::AttnQ128)
            && matches!(seqs, Seqs::Padded { seq, .. } if seq >= attn_q128_min_seq(head_dim))
            && ATTENTION_TC_Q128_HEAD_DIMS.contains(&head_dim);
        let grid = match seqs {
            Seqs::Padded { batch, seq, .. } => {
                if batch > 65535 || heads > 65535 {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: batch {batch} x heads {heads}"
                    )));
                }
                let qt = match (tensor_cores, q128) {
                    (true, true) => 2 * TC_QT,
                    (true, false) => TC_QT,
                    (false, _) => ATT_QT,
                };
                (seq.div_ceil(qt) as u32, heads as u32, batch as u32)
            }
            Seqs::Packed { tokens, seqs, .. } => {
                let tiles = max_tiles(tokens, seqs, self.varlen_qt(tensor_cores));
                let blocks = tiles
                    .checked_mul(heads)
                    .filter(|&b| b <= i32::MAX as usize && tokens <= i32::MAX as usize);
                let Some(blocks) = blocks else {
                    return Err(BackendError::Unsupported(format!(
                        "{what}: {tokens} tokens x {heads} heads"
                    )));
                };
                (blocks as u32, 1, 1)
            }
        };
        let max_len = seqs.max_len();
        let smem = if tensor_cores {
            0
        } else {
            attention_smem_bytes(max_len, dmax)
        };
        if smem > self.limits.max_dyn_smem {
            return Err(BackendError::Unsupported(format!(
                "{what}: sequences of up to {max_len} tokens need {smem} bytes of shared memory, the device allows {}",
                self.limits.max_dyn_smem
            )));
        }
        // What says which keys a query sees: the mask, or the tile table.
        let (index, variant) = match seqs {
            Seqs::Padded { mask, .. } => (self.int_loc(mask), ""),
            Seqs::Packed { tokens, seqs, .. } => {
                let qt = self.varlen_qt(tensor_cores);
                (self.tile_table(qt, tokens, seqs), "_varlen")
            }
        };
        let rows = seqs.token_rows();
        let hd = heads * head_dim;
        let q_l = self.float_in(op.qkv, rows * op.qkv_width(), t)?;
        let (dst, pending) = self.float_out(op.out, rows * hd, t);
        let scale = Arg::F32(op.score_scale());
        let slots = match seqs {
            Seqs::Padded { seq, .. } => seq,
            Seqs::Packed { tokens, .. } => tokens,
        };
        let (tag, bias_args) = match op.window {
            _ if band => {
                let (left, right) = band_bounds(op, slots);
                ("_band", vec![Arg::I32(left), Arg::I32(right)])
            }
            Some(w) => ("_win", vec![Arg::I32(i32::try_from(w).unwrap_or(i32::MAX))]),
            None => self.bias_args(op.bias, heads, &what)?,
        };
        let mut args = vec![Arg::Ptr(q_l), Arg::Ptr(index), Arg::Ptr(dst)];
        let i32s = |v: &[usize]| v.iter().map(|&v| Arg::I32(v as i32)).collect::<Vec<_>>();
        // The band kernels take the key/value heads and the head size after
        // the query heads.
        let kv = if band {
            vec![op.kv_heads, head_dim]
        } else {
            vec![]
        };
        match (seqs, tensor_cores) {
            (Seqs::Padded { seq, .. }, true) => {
                args.extend(i32s(&[seq, heads]));
                args.extend(i32s(&kv));
                args.push(scale);
            }
            (Seqs::Padded { seq, .. }, false) => {
                args.extend(i32s(&[seq, heads, head_dim]));
                args.push(scale);
            }
            (Seqs::Packed { tokens, .. }, true) => {
                args.extend(i32s(&[heads]));
                args.extend(i32s(&kv));
                args.push(scale);
                args.extend(i32s(&[tokens]));
            }
            (
                Seqs::Packed {
                    tokens,
                    max_seq_len,
                    ..
                },
                false,
            ) => {
                args.extend(i32s(&[heads, head_dim]));
                args.push(scale);
                args.extend(i32s(&[tokens, max_seq_len]));
            }
        }
        args.extend(bias_args);
        let ts = suffix(t);
        let (name, block) = if tensor_cores {
            // Padded sequences of at most 16 tokens: 16-key blocks.
            let s16 = !seqs.is_packed()
                && op.window.is_none()
                && !band
                && self.on(KernelPath::AttnS16)
                && max_len <= ATTN_S16_MAX_SEQ
                && ATTENTION_TC_S16_HEAD_DIMS.contains(&head_dim);
            let s16 = match (s16, q128) {
                (true, _) => "_s16",
                (false, true) => "_q128",
                (false, false) => "",
            };
            (
                format!("attention{variant}_tc{tag}{s16}_{ts}_d{dmax}"),
                TC_THREADS,
            )
        } else {
            (format!("attention{variant}{tag}_{ts}_d{dmax}"), ATT_THREADS)
        };
        self.kernel(name, grid, block, smem, args);
        self.finish_out(pending, rows * hd)?;
        Ok(1)
    }

    /// Queries per tile of the varlen attention.
    fn varlen_qt(&self, tensor_cores: bool) -> usize {
        if tensor_cores {
            VARLEN_TC_QT
        } else {
            VARLEN_QT
        }
    }

    /// The tile table for tiles of `qt` queries (one per tile size, shared
    /// by every layer's attention): its location in the input block.
    fn tile_table(&mut self, qt: usize, tokens: usize, seqs: usize) -> Loc {
        if let Some(t) = self.tile_tables.iter().find(|t| t.qt == qt) {
            return Loc::Input(t.offset);
        }
        let max_tiles = max_tiles(tokens, seqs, qt);
        let offset = self.input_bytes;
        self.input_bytes += align_up(max_tiles * TILE_ENTRY * 4, INT_INPUT_ALIGN);
        self.tile_tables.push(TileTable {
            qt,
            max_tiles,
            offset,
        });
        Loc::Input(offset)
    }

    /// The kernel-name tag (`""` or `"_bias"`) and the trailing arguments
    /// (the `[heads, 2·radius + 1]` table and its radius) of an attention
    /// with MPNet's relative position bias, computed in the kernel from the
    /// table (attention.cu `rel_bias`).
    fn bias_args(
        &self,
        bias: Option<PositionBias>,
        heads: usize,
        what: &str,
    ) -> Result<(&'static str, Vec<Arg>), BackendError> {
        let Some(b) = bias else {
            return Ok(("", Vec::new()));
        };
        let shape = &self.weights.get(b.table).shape;
        let cols = 2 * b.radius + 1;
        if shape[..] != [heads, cols] || b.radius > i32::MAX as usize / 4 {
            return Err(BackendError::Unsupported(format!(
                "{what}: position bias table {shape:?} (expected [{heads}, {cols}])"
            )));
        }
        Ok((
            "_bias",
            vec![Arg::Ptr(Loc::Weight(b.table)), Arg::I32(b.radius as i32)],
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use crate::backend::BackendError;

    #[test]
    fn attention_sizes_match_the_kernels() {
        assert_defines(
            "attention.cu",
            &[
                ("ATT_QT", ATT_QT as i64),
                ("ATT_KC", ATT_KC as i64),
                ("ATT_THREADS", ATT_THREADS as i64),
            ],
        );
        let varlen = include_str!("../../../../kernels/attention_varlen.cu");
        assert!(varlen.contains("#define VT_QT TC_QT\n") && VARLEN_TC_QT == TC_QT);
        assert!(varlen.contains("#define VA_QT ATT_QT\n") && VARLEN_QT == ATT_QT);
        let tc = include_str!("../../../../kernels/attention_tc.cu");
        assert!(tc.contains("#define TC_WARPS 4\n") && TC_THREADS == 128 && TC_QT == 64);
        assert_eq!(attention_dmax(32), Some(32));
        assert_eq!(attention_dmax(33), Some(64));
        assert_eq!(attention_dmax(64), Some(64));
        assert_eq!(attention_dmax(80), Some(128));
        assert_eq!(attention_dmax(129), None);
        assert_eq!(attention_dmax(0), None);
        // MiniLM at seq 256: under the default 48 KiB; seq 512 needs the opt-in.
        assert!(attention_smem_bytes(256, 32) <= 48 * 1024);
        assert!(attention_smem_bytes(512, 32) > 48 * 1024);
        assert!(attention_smem_bytes(512, 128) < 227 * 1024);
        assert_eq!(
            attention_smem_bytes(16, 32),
            4 * (32 * 33 + 64 * 33 + 32 * 17)
        );
    }

    #[test]
    fn tile_bounds() {
        // One full tile per 64 slots plus a partial one per sequence and the tail.
        assert_eq!(max_tiles(16384, 256, 64), 256 + 257);
        assert_eq!(max_tiles(16384, 256, 32), 512 + 257);
        assert_eq!(max_tiles(64, 64, 64), 64); // never more tiles than slots
        assert_eq!(max_tiles(1024, 32, 64), 16 + 33);
        assert_eq!(max_tiles(1, 1, 64), 1);
    }

    /// Every batch a budget can hold fits its table, and the table covers
    /// each slot exactly once: real tiles inside their sequence, the tail in
    /// zero tiles, longest sequences first, unused entries zero.
    #[test]
    fn tile_tables_cover_every_slot_once() {
        let mut order = Vec::new();
        // Sequences of 130, 1, 0, 64 and 2 tokens, a tail of 59, in 256 slots.
        let lens = [130usize, 1, 0, 64, 2];
        let cap = max_tiles(256, 5, 64);
        let mut t = vec![-7; cap * TILE_ENTRY];
        write_tile_table(lens, 256, 64, &mut t, &mut order);
        let e: Vec<&[i32]> = t.chunks(4).collect();
        assert_eq!(
            &e[..8],
            &[
                &[0, 64, 0, 130][..],
                &[64, 64, 0, 130],
                &[128, 2, 0, 130],
                &[131, 64, 131, 64],
                &[195, 2, 195, 2],
                &[130, 1, 130, 1],
                &[197, 59, 197, 0], // the tail
                &[0, 0, 0, 0],
            ]
        );
        assert!(e[8..].iter().all(|x| x == &[0, 0, 0, 0]));

        // Random batches, budgets, tile sizes: bounds and coverage.
        let mut seed = 0x1234_5678u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..2000 {
            let tokens = 1 + next(700);
            let seqs = 1 + next(tokens.min(80));
            let qt = [16, 32, 64][next(3)];
            // Random lengths filling a random part of the budget (sometimes all).
            let mut left = if next(4) == 0 {
                tokens
            } else {
                next(tokens + 1)
            };
            let n = 1 + next(seqs);
            let mut lens = Vec::new();
            for i in 0..n {
                let l = if i + 1 == n {
                    left
                } else {
                    next(left + 1).min(next(left + 1) + 1)
                };
                lens.push(l.min(left));
                left -= l.min(left);
            }
            let cap = max_tiles(tokens, seqs, qt);
            let mut t = vec![-1; cap * TILE_ENTRY];
            write_tile_table(lens.iter().copied(), tokens, qt, &mut t, &mut order);
            let mut covered = vec![0u8; tokens];
            let starts: Vec<usize> = lens
                .iter()
                .scan(0, |a, &l| {
                    let s = *a;
                    *a += l;
                    Some(s)
                })
                .collect();
            let mut last_len = usize::MAX;
            let mut in_tail = false;
            for e in t.chunks(4) {
                let [q0, qc, k0, kl] = [e[0], e[1], e[2], e[3]].map(|v| v as usize);
                if qc == 0 {
                    assert_eq!(e, [0, 0, 0, 0]);
                    continue;
                }
                assert!(qc <= qt && q0 + qc <= tokens);
                if kl == 0 {
                    in_tail = true;
                } else {
                    assert!(!in_tail, "tail tiles come after every real tile");
                    assert!(k0 <= q0 && q0 + qc <= k0 + kl && k0 + kl <= tokens);
                    assert!(starts.iter().zip(&lens).any(|(&s, &l)| s == k0 && l == kl));
                    assert!(kl <= last_len, "longest sequences first");
                    last_len = kl;
                }
                covered[q0..q0 + qc].iter_mut().for_each(|c| *c += 1);
            }
            assert!(
                covered.iter().all(|&c| c == 1),
                "{lens:?} in {tokens}: {covered:?}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "in a budget of")]
    fn tile_table_refuses_too_many_tokens() {
        let mut t = vec![0; 64 * TILE_ENTRY];
        write_tile_table([40, 30], 64, 64, &mut t, &mut Vec::new());
    }

    /// A host emulation of attention_varlen.cu's decomposition: each block
    /// (tile, head) checks its entry as `varlen_tile` does and computes its
    /// queries against its sequence's keys. Driven by a written table it
    /// gives exactly the IR's packed attention (the reference interpreter's
    /// semantics), tail zeros included, whatever the tile size.
    #[test]
    fn tile_decomposition_computes_packed_attention() {
        let (heads, d) = (2usize, 3usize);
        let hd = heads * d;
        let lens = [5usize, 0, 12, 1, 33];
        let tokens = 60;
        let qkv: Vec<f64> = (0..tokens * 3 * hd)
            .map(|i| (((i * 7919) % 211) as f64 / 105.0 - 1.0) * 1.3)
            .collect();
        // Direct: each sequence alone.
        let attend = |q: usize, k0: usize, kl: usize, h: usize| -> Vec<f64> {
            let s: Vec<f64> = (k0..k0 + kl)
                .map(|j| {
                    (0..d)
                        .map(|e| qkv[q * 3 * hd + h * d + e] * qkv[j * 3 * hd + hd + h * d + e])
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = p.iter().sum();
            (0..d)
                .map(|e| {
                    (0..kl)
                        .map(|j| p[j] / z * qkv[(k0 + j) * 3 * hd + 2 * hd + h * d + e])
                        .sum()
                })
                .collect()
        };
        let mut want = vec![0.0; tokens * hd];
        let mut at = 0;
        for &l in &lens {
            for q in at..at + l {
                for h in 0..heads {
                    want[q * hd + h * d..][..d].copy_from_slice(&attend(q, at, l, h));
                }
            }
            at += l;
        }
        for qt in [VARLEN_QT, VARLEN_TC_QT, 4] {
            let cap = max_tiles(tokens, 6, qt);
            let mut table = vec![0; cap * TILE_ENTRY];
            write_tile_table(lens, tokens, qt, &mut table, &mut Vec::new());
            let mut got = vec![f64::NAN; tokens * hd];
            for block in 0..cap * heads {
                let (tile, h) = (block / heads, block % heads);
                let e = &table[tile * 4..tile * 4 + 4];
                let (q0, qc, k0, kl) = (e[0], e[1], e[2], e[3]);
                let t = tokens as i32;
                if qc <= 0 || qc > qt as i32 || q0 < 0 || q0 > t - qc {
                    continue;
                }
                let (q0, qc, k0, kl) = (q0 as usize, qc as usize, k0 as usize, kl as usize);
                for q in q0..q0 + qc {
                    let o = if kl == 0 {
                        vec![0.0; d]
                    } else {
                        assert!(k0 <= q0 && q0 + qc <= k0 + kl);
                        attend(q, k0, kl, h)
                    };
                    got[q * hd + h * d..][..d].copy_from_slice(&o);
                }
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-12, "qt {qt}, element {i}: {g} vs {w}");
            }
        }
    }

    /// f32, other head sizes and a disabled tensor-core kernel take the
    /// CUDA-core varlen kernel: 32-query tiles, shared memory sized by the
    /// longest sequence.
    #[test]
    fn packed_cuda_core_attention() {
        let (p, w) = packed_bert_dims(512, 16, 256, 384, 12, 1536);
        for (dtype, limits) in [
            (DType::F32, LIMITS),
            (DType::F16, LIMITS.without(&[KernelPath::TcAttention])),
        ] {
            let plan = plan(&p, &w, dtype, false, limits).unwrap();
            let ts = suffix(dtype);
            let (name, grid, block, smem, args) = kernel(&plan, "attention_varlen");
            let tiles = max_tiles(512, 16, 32);
            assert_eq!(name, format!("attention_varlen_{ts}_d32"));
            assert_eq!(plan.tile_tables[0].qt, 32);
            assert_eq!(plan.tile_tables[0].max_tiles, tiles);
            assert_eq!((grid, block), ((tiles as u32 * 12, 1, 1), ATT_THREADS));
            assert_eq!(smem as usize, attention_smem_bytes(256, 32));
            assert_eq!(args.len(), 8);
            assert_eq!(
                &args[3..],
                &[
                    Arg::I32(12),
                    Arg::I32(32),
                    Arg::F32(1.0 / (32f32).sqrt()),
                    Arg::I32(512),
                    Arg::I32(256),
                ]
            );
        }
        // Head size 80 (f16): the d128 class with hd = 80.
        let (p, w) = packed_bert_dims(256, 8, 128, 320, 4, 640);
        let plan = planned(&p, &w, DType::F16, LIMITS);
        let (name, _, _, smem, args) = kernel(&plan, "attention_varlen");
        assert_eq!(name, "attention_varlen_f16_d128");
        assert_eq!(smem as usize, attention_smem_bytes(128, 128));
        assert_eq!(args[4], Arg::I32(80));
        // Sequences too long for the shared memory: the device cannot run it.
        let (p, w) = packed_bert_dims(1024, 4, 512, 384, 12, 1536);
        let e = crate::backend::cuda::plan::plan(&p, &w, DType::F32, false, Limits::new(48 * 1024))
            .unwrap_err();
        assert!(
            matches!(e, BackendError::Unsupported(ref m) if m.contains("512")),
            "{e:?}"
        );
        // f32 packed outputs: the pooled rows go straight to the f32 output.
        let (p, w) = packed_bert_dims(64, 4, 64, 384, 12, 1536);
        let plan = planned(&p, &w, DType::F32, LIMITS);
        assert_eq!(
            kernel(&plan, "pool_split_packed_f32").4[3],
            Arg::Ptr(Loc::Output(0))
        );
    }

    /// A MiniLM-sized encoder with MPNet's bias and position ids: the
    /// tensor-core attention kernels take the bias (head size 32), padded
    /// and packed, and for few tokens the fused attention sublayer's
    /// `_bias` variant does.
    #[test]
    fn biased_attention_on_tensor_cores() {
        let (mut arch, mut w) = minilm(2);
        let table = w.push("rel", vec![12, 257], vec![0.0; 12 * 257]);
        arch.position_bias = Some(PositionBias { table, radius: 128 });
        arch.position_ids = PositionIds::AfterPadding { pad: 1 };
        let bias = [Arg::Ptr(Loc::Weight(table)), Arg::I32(128)];
        for dtype in [DType::F16, DType::BF16] {
            let ts = suffix(dtype);
            let p = arch.program(2, 64);
            p.validate(&w).unwrap();
            let plan_ = plan(&p, &w, dtype, false, LIMITS).unwrap();
            let (name, grid, _, _, args) = kernel(&plan_, "attention_tc_bias_");
            assert_eq!(name, format!("attention_tc_bias_{ts}_d32"));
            assert_eq!(grid, (1, 12, 2));
            assert_eq!(args.len(), 8);
            assert_eq!(args[6..], bias);
            kernel(&plan_, "embed_ln_padpos_");
            for tokens in [16, 1024] {
                let pk = arch.packed_program(tokens, 8.min(tokens));
                pk.validate(&w).unwrap();
                let plan_ = plan(&pk, &w, dtype, false, LIMITS).unwrap();
                let steps = plan_.step_names();
                let prefix = "attention_varlen_tc_bias_";
                let (name, _, _, _, args) = kernel(&plan_, prefix);
                assert_eq!(name, format!("{prefix}{ts}_d32"));
                assert_eq!(args.len(), 8);
                assert_eq!(args[args.len() - 2..], bias);
                assert_eq!(
                    steps.iter().filter(|s| s.starts_with(prefix)).count(),
                    2,
                    "{steps:?}"
                );
            }
        }
        // Padded (1, 16): the 16-key kernel with the bias; without the
        // bias, the plain one.
        let plan_ = planned(&arch.program(1, 16), &w, DType::F16, LIMITS);
        let (_, _, _, _, args) = kernel(&plan_, "attention_tc_bias_s16_f16_d32");
        assert_eq!(args[6..], bias);
        arch.position_bias = None;
        let plan_ = planned(&arch.packed_program(16, 8), &w, DType::F16, LIMITS);
        kernel(&plan_, "attention_varlen_tc_f16_d32");
        assert!(!plan_.step_names().iter().any(|s| s.contains("_bias_")));
    }

    /// The attention kernels add the bias as `PositionBias::column` says:
    /// the kernels' clamp reads the same column for every offset.
    #[test]
    fn relative_bias_column_matches_the_kernels() {
        let att = include_str!("../../../../kernels/attention.cu");
        assert!(att.contains("row[min(max(k - q, -radius), radius) + radius]"));
        let kernel_col =
            |radius: i64, q: i64, k: i64| ((k - q).clamp(-radius, radius) + radius) as usize;
        for radius in [0usize, 1, 5, 128] {
            let b = PositionBias {
                table: WeightId(0),
                radius,
            };
            for q in 0..300usize {
                for k in (0..300usize).step_by(7) {
                    assert_eq!(
                        b.column(q, k),
                        kernel_col(radius as i64, q as i64, k as i64)
                    );
                }
            }
        }
    }

    /// A host emulation of the band kernels' key skipping (attention_tc.cu
    /// `tc_attend` with BAND: the block's key-block range, each warp's
    /// skipped and uncut blocks, the per-score test; prenorm.cu's warp
    /// kernel's key range) with the bounds [`band_bounds`] gives: a query
    /// scores exactly the keys `Attention::sees`, for every mask, tile,
    /// key-block size and sequence length.
    #[test]
    fn band_skipping_is_the_mask() {
        let mut seed = 0x9e37_79b9u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let mut op = Attention {
            qkv: BufId(0),
            out: BufId(1),
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            bias: None,
            window: None,
            causal: false,
            scale: None,
            seqs: Seqs::Padded {
                mask: BufId(2),
                batch: 1,
                seq: 1,
            },
        };
        for _ in 0..3000 {
            let seq = 1 + next(300);
            op.causal = next(2) == 0;
            op.window = [None, Some(0), Some(1), Some(next(80)), Some(1000)][next(5)];
            // The unbounded side: the padded length, or a packed budget.
            let slots = seq + next(3) * next(200);
            let (left, right) = band_bounds(&op, slots);
            let (left, right) = (left as i64, right as i64);
            let kb = [16i64, 32, 64][next(3)];
            let seq = seq as i64;
            // Every 64-query tile of the sequence (the last one partial).
            for q_first in (0..seq).step_by(64) {
                let q_end = seq.min(q_first + 64);
                let q_last = q_end - 1;
                let nblocks = (seq + kb - 1) / kb;
                let kb_begin = (q_first - left).max(0) / kb;
                let kb_end = (q_last + right).min(seq - 1) / kb + 1;
                assert!(kb_begin < kb_end && kb_end <= nblocks);
                let mut seen = vec![false; (seq * seq) as usize];
                for w in 0..4 {
                    let q0 = q_first + 16 * w;
                    if q0 >= q_end {
                        continue;
                    }
                    for b in kb_begin..kb_end {
                        let kb0 = b * kb;
                        let skip = kb0 > q0 + 15 + right || kb0 + kb - 1 < q0 - left;
                        let full = kb0 >= q0 + 15 - left && kb0 + kb - 1 <= q0 + right;
                        if skip {
                            continue;
                        }
                        for q in q0..(q0 + 16).min(q_end) {
                            for k in kb0..(kb0 + kb).min(seq) {
                                let d = q - k;
                                if full || !(d > left || d < -right) {
                                    seen[(q * seq + k) as usize] = true;
                                }
                            }
                        }
                    }
                }
                for q in q_first..q_end {
                    // The warp kernel's range.
                    let (lo, hi) = ((q - left).max(0), (seq - 1).min(q + right));
                    for k in 0..seq {
                        let want = op.sees(q as usize, k as usize);
                        assert_eq!(
                            seen[(q * seq + k) as usize],
                            want,
                            "tc: seq {seq}, window {:?}, causal {}, kb {kb}, query {q}, key {k}",
                            op.window,
                            op.causal
                        );
                        assert_eq!((lo..=hi).contains(&k), want, "warp kernel");
                    }
                }
            }
        }
    }
}
