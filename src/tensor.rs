//! Host-side tensors: the unit that crosses the wire, the worker IPC and the
//! backend boundary.
//!
//! Data is kept as little-endian bytes (`Bytes`, cheap to clone and slice) so
//! a payload frame received from ZeroMQ can be handed on without copying.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Element type of a tensor on the wire or in a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U32,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(DType::F32),
            "f16" | "float16" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "i32" | "int32" => Ok(DType::I32),
            "u32" | "uint32" => Ok(DType::U32),
            other => Err(format!(
                "unknown dtype {other:?} (expected f32, f16, bf16, i32 or u32)"
            )),
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TensorError {
    #[error("shape {shape:?} of {dtype} needs {expected} bytes, got {actual}")]
    SizeMismatch {
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
    #[error("shape {0:?} is too large")]
    Overflow(Vec<usize>),
    #[error("expected dtype {expected}, got {actual}")]
    WrongDType { expected: DType, actual: DType },
}

/// A dense, row-major tensor in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

/// Number of elements of a shape, or `None` on overflow.
pub fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

impl HostTensor {
    /// Wraps raw little-endian bytes, checking that their length matches the shape.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Bytes) -> Result<Self, TensorError> {
        let expected = element_count(&shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| TensorError::Overflow(shape.clone()))?;
        if expected != data.len() {
            return Err(TensorError::SizeMismatch {
                dtype,
                shape,
                expected,
                actual: data.len(),
            });
        }
        Ok(Self { dtype, shape, data })
    }

    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        Self::from_le_words(DType::F32, shape, values.iter().map(|v| v.to_le_bytes()))
    }

    pub fn from_i32(shape: Vec<usize>, values: &[i32]) -> Self {
        Self::from_le_words(DType::I32, shape, values.iter().map(|v| v.to_le_bytes()))
    }

    /// A tensor of 4-byte elements given as little-endian words.
    fn from_le_words(
        dtype: DType,
        shape: Vec<usize>,
        words: impl ExactSizeIterator<Item = [u8; 4]>,
    ) -> Self {
        assert_eq!(
            element_count(&shape),
            Some(words.len()),
            "shape/values mismatch"
        );
        let data = Bytes::from(words.flatten().collect::<Vec<u8>>());
        Self { dtype, shape, data }
    }

    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Decodes the elements as f32 (f16 and bf16 are widened).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, TensorError> {
        let d = &self.data;
        Ok(match self.dtype {
            DType::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => d
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => d
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(TensorError::WrongDType {
                    expected: DType::F32,
                    actual: other,
                })
            }
        })
    }

    /// Re-encodes an f32 tensor as `dtype` (f32, f16 or bf16).
    pub fn convert_float(&self, dtype: DType) -> Result<HostTensor, TensorError> {
        if self.dtype == dtype {
            return Ok(self.clone());
        }
        let values = self.to_f32_vec()?;
        let mut bytes = Vec::with_capacity(values.len() * dtype.size());
        match dtype {
            DType::F32 => values
                .iter()
                .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            DType::F16 => values
                .iter()
                .for_each(|v| bytes.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
            DType::BF16 => values
                .iter()
                .for_each(|v| bytes.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
            other => {
                return Err(TensorError::WrongDType {
                    expected: DType::F32,
                    actual: other,
                })
            }
        }
        Ok(HostTensor {
            dtype,
            shape: self.shape.clone(),
            data: Bytes::from(bytes),
        })
    }

    /// Rows `start..end` of the leading dimension, without copying.
    pub fn slice_rows(&self, start: usize, end: usize) -> HostTensor {
        let row_elems: usize = self.shape[1..].iter().product();
        let row_bytes = row_elems * self.dtype.size();
        let mut shape = self.shape.clone();
        shape[0] = end - start;
        HostTensor {
            dtype: self.dtype,
            shape,
            data: self.data.slice(start * row_bytes..end * row_bytes),
        }
    }
}

/// Reads little-endian f32s out of a byte slice (whose length is a multiple of 4).
pub fn f32s_from_le(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Writes f32s as little-endian bytes.
pub fn f32s_to_le(values: &[f32]) -> Bytes {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_is_checked() {
        let err = HostTensor::new(DType::F32, vec![2, 3], Bytes::from(vec![0u8; 20])).unwrap_err();
        assert_eq!(
            err,
            TensorError::SizeMismatch {
                dtype: DType::F32,
                shape: vec![2, 3],
                expected: 24,
                actual: 20
            }
        );
        assert!(HostTensor::new(DType::F16, vec![usize::MAX, 4], Bytes::new()).is_err());
    }

    #[test]
    fn f16_round_trip_and_row_slices() {
        let t = HostTensor::from_f32(vec![3, 2], &[1.0, 2.0, 3.0, 4.0, 0.5, -1.0]);
        let h = t.convert_float(DType::F16).unwrap();
        assert_eq!(h.data.len(), 12);
        assert_eq!(h.to_f32_vec().unwrap(), t.to_f32_vec().unwrap());
        let rows = t.slice_rows(1, 3);
        assert_eq!(rows.shape, vec![2, 2]);
        assert_eq!(rows.to_f32_vec().unwrap(), vec![3.0, 4.0, 0.5, -1.0]);
    }
}
