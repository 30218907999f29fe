//! Sparse replies (SPLADE encoders): each row's non-zero entries in CSR
//! form, the layout SciPy's `csr_matrix` and PyTorch's `sparse_csr_tensor`
//! take as they are.
//!
//! A sparse encoder's device output is a dense `[rows, vocab]` f32 matrix,
//! mostly zeros; [`SparseRows::from_dense`] keeps the positive entries (or
//! the `top_k` largest of each row) when the reply is encoded, in the
//! request's own task rather than in the batcher. On the wire a sparse
//! reply has three frames (`docs/protocol.md`, "Sparse replies"):
//! `indptr` (u32, `rows + 1`), `indices` (u32, ascending within a row) and
//! `values` (the reply's dtype).

use crate::tensor::{DType, HostTensor};
use bytes::Bytes;

/// How a sparse model's rows are cut down before they are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sparsify {
    /// Keep each row's `top_k` largest entries; `None`: every positive one.
    pub top_k: Option<u32>,
    /// The values' element type on the wire (f32 or f16).
    pub dtype: DType,
}

impl Default for Sparsify {
    fn default() -> Self {
        Sparsify {
            top_k: None,
            dtype: DType::F32,
        }
    }
}

/// Rows in CSR form: row `r`'s entries are `indices[indptr[r]..indptr[r+1]]`
/// with `values` alike.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseRows {
    /// The dense width (the vocabulary size).
    pub width: usize,
    pub indptr: Vec<u32>,
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
}

impl SparseRows {
    /// The positive entries of little-endian f32 rows of `width` values (a
    /// SPLADE weight is never negative; exact zeros are the absent terms),
    /// each row's `top_k` largest when asked (ties: the lower index), in
    /// ascending index order.
    pub fn from_dense(data: &[u8], width: usize, how: Sparsify) -> SparseRows {
        let mut out = SparseRows {
            width,
            indptr: vec![0],
            ..SparseRows::default()
        };
        if width == 0 {
            return out;
        }
        let mut row_entries: Vec<(u32, f32)> = Vec::new();
        for row in data.chunks_exact(width * 4) {
            row_entries.clear();
            for (i, b) in row.chunks_exact(4).enumerate() {
                let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                if v > 0.0 {
                    row_entries.push((i as u32, v));
                }
            }
            if let Some(k) = how.top_k {
                let k = k as usize;
                if row_entries.len() > k {
                    // Largest first, the lower index on ties; then back to index order.
                    row_entries
                        .select_nth_unstable_by(k, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    row_entries.truncate(k);
                    row_entries.sort_unstable_by_key(|e| e.0);
                }
            }
            out.indices.extend(row_entries.iter().map(|e| e.0));
            out.values.extend(row_entries.iter().map(|e| e.1));
            out.indptr.push(out.indices.len() as u32);
        }
        out
    }

    pub fn rows(&self) -> usize {
        self.indptr.len().saturating_sub(1)
    }

    /// Row `r`'s (indices, values).
    pub fn row(&self, r: usize) -> (&[u32], &[f32]) {
        let (a, b) = (self.indptr[r] as usize, self.indptr[r + 1] as usize);
        (&self.indices[a..b], &self.values[a..b])
    }

    /// Row `r` as a dense vector of `width` values.
    pub fn dense_row(&self, r: usize) -> Vec<f32> {
        let mut v = vec![0.0; self.width];
        let (idx, val) = self.row(r);
        for (&i, &x) in idx.iter().zip(val) {
            v[i as usize] = x;
        }
        v
    }

    /// The three payload frames, values in `dtype` (f32 or f16).
    pub fn to_frames(&self, dtype: DType) -> [Bytes; 3] {
        let u32s =
            |v: &[u32]| Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
        let values = HostTensor {
            dtype: DType::F32,
            shape: vec![self.values.len()],
            data: Bytes::from(
                self.values
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
            ),
        };
        let values = match dtype {
            DType::F32 => values,
            other => values.convert_float(other).unwrap_or(values),
        };
        [u32s(&self.indptr), u32s(&self.indices), values.data]
    }

    /// Reads the three frames back (clients), checking that they agree with
    /// each other and with `rows` × `width`.
    pub fn from_frames(
        rows: usize,
        width: usize,
        dtype: DType,
        frames: &[Bytes],
    ) -> Result<SparseRows, String> {
        let [indptr, indices, values] = frames else {
            return Err(format!(
                "a sparse reply has 3 payload frames (indptr, indices, values), got {}",
                frames.len()
            ));
        };
        let u32s = |b: &Bytes, what: &str| -> Result<Vec<u32>, String> {
            if !b.len().is_multiple_of(4) {
                return Err(format!(
                    "{what}: {} bytes is not a whole number of u32",
                    b.len()
                ));
            }
            Ok(b.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let indptr = u32s(indptr, "indptr")?;
        let indices = u32s(indices, "indices")?;
        if indptr.len() != rows + 1 || indptr[0] != 0 {
            return Err(format!(
                "indptr has {} entries starting at {:?}, expected {} starting at 0",
                indptr.len(),
                indptr.first(),
                rows + 1
            ));
        }
        if indptr.windows(2).any(|w| w[0] > w[1]) || indptr[rows] as usize != indices.len() {
            return Err("indptr is not a non-decreasing prefix sum of the indices".into());
        }
        if indices.iter().any(|&i| i as usize >= width) {
            return Err(format!("an index is outside the width {width}"));
        }
        let n = indices.len();
        let values = HostTensor::new(dtype, vec![n], values.clone())
            .and_then(|t| t.to_f32_vec())
            .map_err(|e| format!("values: {e}"))?;
        Ok(SparseRows {
            width,
            indptr,
            indices,
            values,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn keeps_positive_entries_in_index_order() {
        let s = SparseRows::from_dense(
            &le(&[0.0, 1.5, 0.0, 0.25, 0.0, 0.0, 0.0, 2.0]),
            4,
            Sparsify::default(),
        );
        assert_eq!(s.indptr, vec![0, 2, 3]);
        assert_eq!(s.indices, vec![1, 3, 3]);
        assert_eq!(s.values, vec![1.5, 0.25, 2.0]);
        assert_eq!(s.dense_row(0), vec![0.0, 1.5, 0.0, 0.25]);
    }

    #[test]
    fn top_k_keeps_the_largest_with_the_lower_index_on_ties() {
        let row = [0.5, 3.0, 0.5, 1.0, 0.5];
        let s = SparseRows::from_dense(
            &le(&row),
            5,
            Sparsify {
                top_k: Some(3),
                ..Sparsify::default()
            },
        );
        assert_eq!(s.indices, vec![0, 1, 3]);
        assert_eq!(s.values, vec![0.5, 3.0, 1.0]);
        let all = SparseRows::from_dense(
            &le(&row),
            5,
            Sparsify {
                top_k: Some(9),
                ..Sparsify::default()
            },
        );
        assert_eq!(all.indices, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn frames_round_trip_and_are_checked() {
        let s =
            SparseRows::from_dense(&le(&[0.0, 1.0, 2.0, 0.0, 0.0, 0.0]), 3, Sparsify::default());
        for dtype in [DType::F32, DType::F16] {
            let frames = s.to_frames(dtype);
            assert_eq!(SparseRows::from_frames(2, 3, dtype, &frames).unwrap(), s);
        }
        let frames = s.to_frames(DType::F32);
        assert!(SparseRows::from_frames(3, 3, DType::F32, &frames).is_err());
        assert!(SparseRows::from_frames(2, 2, DType::F32, &frames).is_err());
        assert!(SparseRows::from_frames(2, 3, DType::F32, &frames[..2]).is_err());
        let bad_ptr = [
            Bytes::from(le_u32(&[0, 2, 1])),
            frames[1].clone(),
            frames[2].clone(),
        ];
        assert!(SparseRows::from_frames(2, 3, DType::F32, &bad_ptr).is_err());
    }

    fn le_u32(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}
