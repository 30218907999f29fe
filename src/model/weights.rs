//! A model's weights in host memory, indexed by [`WeightId`].
//!
//! Each [`WeightTensor`] holds a [`WeightData`]: either f32 values a loader
//! computed (a folded table, a concatenation that had to convert, zeros), or
//! a float dtype (F32, F16, BF16) exactly as the checkpoint stores it. Stored
//! data is usually a byte range of the memory-mapped safetensors file
//! (zero-copy: the mapping lives as long as any weight refers to it; see
//! `safetensors_file.rs`), or owned bytes of rows concatenated without
//! conversion (fused q/k/v projections).
//!
//! Backends convert once, to their compute dtype, when they upload:
//! [`WeightData::le_bytes`] hands over the bytes when the dtypes already
//! match, [`WeightData::write_as`] converts element by element into a
//! staging buffer otherwise, and [`WeightData::to_f32`] serves those that
//! compute in f32. An 8B bf16 model therefore never costs 32 GB of f32 in
//! host memory.

use super::program::WeightId;
use crate::tensor::DType;
use bytes::Bytes;
use rayon::prelude::*;
use std::borrow::Cow;

/// A weight tensor's elements: computed f32, or a float dtype as stored.
///
/// Stored bytes are little-endian, as safetensors writes them.
#[derive(Clone)]
pub struct WeightData(Repr);

#[derive(Clone)]
enum Repr {
    F32(Vec<f32>),
    /// `bytes.len()` is a multiple of `dtype.size()`; `dtype` is a float.
    Stored {
        dtype: DType,
        bytes: Bytes,
    },
}

/// Elements converted per task when [`WeightData::write_as`] converts in
/// parallel (a few hundred KB of output each).
const CONVERT_CHUNK: usize = 1 << 16;

impl WeightData {
    /// f32 values (what a loader computed).
    pub fn from_f32(values: Vec<f32>) -> Self {
        WeightData(Repr::F32(values))
    }

    /// Little-endian elements of `dtype`, as stored: a slice of a mapped file
    /// (cheap to clone) or owned bytes.
    ///
    /// # Panics
    /// If `dtype` is not F32, F16 or BF16, or `bytes` is not a whole number
    /// of its elements.
    pub fn from_le_bytes(dtype: DType, bytes: Bytes) -> Self {
        assert!(dtype.is_float(), "stored weights are floats, not {dtype}");
        assert_eq!(
            bytes.len() % dtype.size(),
            0,
            "{} bytes are not whole {dtype} elements",
            bytes.len()
        );
        WeightData(Repr::Stored { dtype, bytes })
    }

    /// The element type as held: F32 for computed values, else as stored.
    pub fn dtype(&self) -> DType {
        match &self.0 {
            Repr::F32(_) => DType::F32,
            Repr::Stored { dtype, .. } => *dtype,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::F32(v) => v.len(),
            Repr::Stored { dtype, bytes } => bytes.len() / dtype.size(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes as held (`len() × dtype().size()`).
    pub fn byte_len(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// The values as f32: borrowed when they are computed f32, else
    /// converted (exactly: F16 and BF16 are subsets of f32).
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        match &self.0 {
            Repr::F32(v) => Cow::Borrowed(v),
            Repr::Stored { dtype, bytes } => Cow::Owned(
                bytes
                    .chunks_exact(dtype.size())
                    .map(|c| read(*dtype, c))
                    .collect(),
            ),
        }
    }

    /// The elements' little-endian bytes, when they are held in `dtype`
    /// already (stored bytes, or computed f32 on a little-endian host):
    /// what a backend of that compute dtype copies as is.
    pub fn le_bytes(&self, dtype: DType) -> Option<&[u8]> {
        match &self.0 {
            Repr::Stored { dtype: d, bytes } if *d == dtype => Some(bytes),
            #[cfg(target_endian = "little")]
            Repr::F32(v) if dtype == DType::F32 => {
                // SAFETY: any f32 is 4 initialised bytes; u8 has alignment 1;
                // the slice borrows `v`.
                Some(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len() * 4) })
            }
            _ => None,
        }
    }

    /// Writes elements `first..first + n` as little-endian `dtype` into
    /// `dst` (`n × dtype.size()` bytes): a copy when held in `dtype`,
    /// else converted element by element (rounding to nearest even), in
    /// parallel for large spans.
    ///
    /// # Panics
    /// If `dtype` is not a float, `dst` is not whole elements, or the span
    /// runs past the end.
    pub fn write_as(&self, dtype: DType, first: usize, dst: &mut [u8]) {
        assert!(dtype.is_float(), "weights convert to floats, not {dtype}");
        let size = dtype.size();
        assert_eq!(dst.len() % size, 0, "not whole {dtype} elements");
        let n = dst.len() / size;
        assert!(first + n <= self.len(), "span past the weight's end");
        if let Some(bytes) = self.le_bytes(dtype) {
            dst.copy_from_slice(&bytes[first * size..(first + n) * size]);
            return;
        }
        let convert = |(i, out): (usize, &mut [u8])| {
            let start = first + i * CONVERT_CHUNK;
            let count = out.len() / size;
            match &self.0 {
                Repr::F32(v) => out
                    .chunks_exact_mut(size)
                    .zip(&v[start..start + count])
                    .for_each(|(o, &x)| write(dtype, x, o)),
                Repr::Stored { dtype: from, bytes } => {
                    let s = from.size();
                    out.chunks_exact_mut(size)
                        .zip(bytes[start * s..(start + count) * s].chunks_exact(s))
                        .for_each(|(o, c)| write(dtype, read(*from, c), o))
                }
            }
        };
        if n > CONVERT_CHUNK {
            dst.par_chunks_mut(CONVERT_CHUNK * size)
                .enumerate()
                .for_each(convert);
        } else {
            convert((0, dst));
        }
    }
}

/// One little-endian element of a float dtype, as f32.
fn read(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => unreachable!("stored weights are floats"),
    }
}

/// Writes `x` as one little-endian element of a float dtype.
fn write(dtype: DType, x: f32, out: &mut [u8]) {
    match dtype {
        DType::F32 => out.copy_from_slice(&x.to_le_bytes()),
        DType::F16 => out.copy_from_slice(&half::f16::from_f32(x).to_le_bytes()),
        DType::BF16 => out.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
        _ => unreachable!("checked by write_as"),
    }
}

impl From<Vec<f32>> for WeightData {
    fn from(values: Vec<f32>) -> Self {
        WeightData::from_f32(values)
    }
}

/// Equal when the dtype and every element are: stored bytes compare
/// bitwise, computed f32 by value.
impl PartialEq for WeightData {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (Repr::F32(a), Repr::F32(b)) => a == b,
            (Repr::Stored { dtype: a, bytes: x }, Repr::Stored { dtype: b, bytes: y }) => {
                a == b && x == y
            }
            _ => self.dtype() == other.dtype() && self.to_f32() == other.to_f32(),
        }
    }
}

/// The dtype and length, not the values (a table has millions).
impl std::fmt::Debug for WeightData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = match &self.0 {
            Repr::F32(_) => "computed",
            Repr::Stored { .. } => "stored",
        };
        write!(f, "WeightData({held} {} × {})", self.dtype(), self.len())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct WeightTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: WeightData,
}

/// The weight table a model's programs refer to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Weights {
    tensors: Vec<WeightTensor>,
}

impl Weights {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tensor of computed f32 values and returns its id.
    pub fn push(&mut self, name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> WeightId {
        self.push_data(name, shape, WeightData::from_f32(data))
    }

    /// Adds a tensor (f32, or as stored) and returns its id.
    pub fn push_data(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        data: WeightData,
    ) -> WeightId {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        self.tensors.push(WeightTensor {
            name: name.into(),
            shape,
            data,
        });
        WeightId(self.tensors.len() - 1)
    }

    pub fn get(&self, id: WeightId) -> &WeightTensor {
        &self.tensors[id.0]
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (WeightId, &WeightTensor)> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (WeightId(i), t))
    }

    /// Total number of parameters.
    pub fn parameter_count(&self) -> usize {
        self.tensors.iter().map(|t| t.data.len()).sum()
    }

    /// Bytes of the weights as held in host memory (stored dtypes, or f32
    /// where computed); mapped bytes count, though the page cache holds them.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.byte_len() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_bytes(values: &[f32]) -> Bytes {
        values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect::<Vec<u8>>()
            .into()
    }

    #[test]
    fn stored_bytes_are_copied_or_converted() {
        let values = [1.5f32, -2.0, 0.1, 3.0e38];
        let data = WeightData::from_le_bytes(DType::BF16, bf16_bytes(&values));
        assert_eq!(
            (data.dtype(), data.len(), data.byte_len()),
            (DType::BF16, 4, 8)
        );
        let want: Vec<f32> = values
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(&data.to_f32()[..], &want[..]);
        // Same dtype: the stored bytes themselves.
        assert_eq!(
            data.le_bytes(DType::BF16).unwrap(),
            &bf16_bytes(&values)[..]
        );
        assert!(data.le_bytes(DType::F16).is_none());
        let mut out = vec![0u8; 4];
        data.write_as(DType::BF16, 1, &mut out);
        assert_eq!(out, bf16_bytes(&values)[2..6]);
        // bf16 → f16: through f32, rounded to nearest (3e38 overflows to inf).
        let mut out = vec![0u8; 8];
        data.write_as(DType::F16, 0, &mut out);
        let f16s: Vec<f32> = out
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let want16: Vec<f32> = want
            .iter()
            .map(|v| half::f16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(f16s, want16);
        assert!(f16s[3].is_infinite());
        // Computed f32: borrowed, and viewed as bytes for an f32 upload.
        let f = WeightData::from(vec![1.0f32, 2.0]);
        assert!(matches!(f.to_f32(), Cow::Borrowed(_)));
        assert_eq!(
            f.le_bytes(DType::F32).unwrap(),
            &[0, 0, 128, 63, 0, 0, 0, 64]
        );
        let mut out = vec![0u8; 4];
        f.write_as(DType::BF16, 0, &mut out);
        assert_eq!(out, bf16_bytes(&[1.0, 2.0])[..]);
    }

    #[test]
    fn large_conversions_split_into_chunks() {
        let n = 3 * CONVERT_CHUNK + 17;
        let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
        let data = WeightData::from_f32(values.clone());
        let first = 5;
        let mut out = vec![0u8; (n - first) * 2];
        data.write_as(DType::F16, first, &mut out);
        for (i, c) in out.chunks_exact(2).enumerate() {
            let want = half::f16::from_f32(values[first + i]);
            assert_eq!(half::f16::from_le_bytes([c[0], c[1]]), want, "element {i}");
        }
        let stored = WeightData::from_le_bytes(DType::F16, out.into());
        let mut back = vec![0u8; 4 * (n - first)];
        stored.write_as(DType::F32, 0, &mut back);
        let want: Vec<u8> = stored
            .to_f32()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(back, want);
    }

    #[test]
    fn equality_is_by_dtype_and_elements() {
        let a = WeightData::from_le_bytes(DType::F32, Bytes::from(1.5f32.to_le_bytes().to_vec()));
        assert_eq!(a, WeightData::from_f32(vec![1.5]));
        let b = WeightData::from_le_bytes(DType::BF16, bf16_bytes(&[1.5]));
        assert_ne!(a, b);
        assert_eq!(format!("{b:?}"), "WeightData(stored bf16 × 1)");
        let mut w = Weights::new();
        w.push("x", vec![1], vec![1.5]);
        w.push_data("y", vec![1], b);
        assert_eq!((w.parameter_count(), w.bytes()), (2, 6));
    }
}
