//! Reading safetensors files, shared by the BERT and MLP loaders.
//!
//! `read_header` reads only the 8-byte length and the JSON header (names,
//! dtypes, shapes, offsets) and checks it against the file's size, so
//! `inspect` can validate a model without reading weight data.
//! `TensorFile::open` reads the whole file and converts tensors to f32.
//!
//! The header is parsed here rather than through `safetensors::SafeTensors`
//! because that needs the whole file in memory; the checks are the same as the
//! format's (offsets in bounds, sizes match dtype × shape, no holes, no
//! trailing bytes), and every error names the file and the tensor.

use crate::model::ModelError;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Largest JSON header we accept (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StDtype {
    F64,
    F32,
    F16,
    BF16,
    /// A dtype we never convert (integers, bool, f8 ...): its name and byte size.
    Other(&'static str, usize),
}

impl StDtype {
    fn parse(name: &str) -> Option<StDtype> {
        Some(match name {
            "F64" => StDtype::F64,
            "F32" => StDtype::F32,
            "F16" => StDtype::F16,
            "BF16" => StDtype::BF16,
            "I64" => StDtype::Other("I64", 8),
            "U64" => StDtype::Other("U64", 8),
            "I32" => StDtype::Other("I32", 4),
            "U32" => StDtype::Other("U32", 4),
            "I16" => StDtype::Other("I16", 2),
            "U16" => StDtype::Other("U16", 2),
            "I8" => StDtype::Other("I8", 1),
            "U8" => StDtype::Other("U8", 1),
            "BOOL" => StDtype::Other("BOOL", 1),
            "F8_E4M3" => StDtype::Other("F8_E4M3", 1),
            "F8_E5M2" => StDtype::Other("F8_E5M2", 1),
            _ => return None,
        })
    }

    pub(crate) fn size(self) -> usize {
        match self {
            StDtype::F64 => 8,
            StDtype::F32 => 4,
            StDtype::F16 | StDtype::BF16 => 2,
            StDtype::Other(_, size) => size,
        }
    }

    pub(crate) fn is_float(self) -> bool {
        !matches!(self, StDtype::Other(..))
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            StDtype::F64 => "F64",
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::Other(name, _) => name,
        }
    }
}

/// One tensor's entry in the header.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorEntry {
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub start: usize,
    pub end: usize,
}

/// The parsed header of a safetensors file.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    pub path: PathBuf,
    /// Tensors by name (sorted).
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Where the data section starts in the file (8 + header length).
    pub data_offset: usize,
}

impl Header {
    pub(crate) fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::file(&self.path, message)
    }

    /// The entry of a tensor that must exist with a float dtype.
    pub(crate) fn float_tensor(&self, name: &str) -> Result<&TensorEntry, ModelError> {
        let entry = self
            .get(name)
            .ok_or_else(|| self.error(format!("missing tensor `{name}`")))?;
        if !entry.dtype.is_float() {
            return Err(self.error(format!(
                "tensor `{name}` has dtype {}, expected a float dtype (F32, F16, BF16 or F64)",
                entry.dtype.name()
            )));
        }
        Ok(entry)
    }

    /// Checks that a tensor exists, is float and has exactly `shape`.
    pub(crate) fn expect_shape(
        &self,
        name: &str,
        shape: &[usize],
        why: &str,
    ) -> Result<(), ModelError> {
        let entry = self.float_tensor(name)?;
        if entry.shape != shape {
            return Err(self.error(format!(
                "shape mismatch: tensor `{name}` has shape {:?}, expected {:?}{why}",
                entry.shape, shape
            )));
        }
        Ok(())
    }
}

/// Reads and validates the header of a safetensors file, without its data.
pub(crate) fn read_header(path: &Path) -> Result<Header, ModelError> {
    let mut file = std::fs::File::open(path).map_err(|e| open_error(path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?
        .len();
    let mut len_bytes = [0u8; 8];
    if file_len < 8 {
        return Err(corrupt(
            path,
            format!("the file is {file_len} bytes, too short for a header"),
        ));
    }
    file.read_exact(&mut len_bytes)
        .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
    let header_len = header_len(path, len_bytes, file_len)?;
    let mut json = vec![0u8; header_len];
    file.read_exact(&mut json)
        .map_err(|e| ModelError::file(path, format!("cannot read the header: {e}")))?;
    parse_header(path, &json, file_len)
}

fn open_error(path: &Path, e: std::io::Error) -> ModelError {
    if e.kind() == std::io::ErrorKind::NotFound {
        ModelError::file(path, "missing file (no such file)")
    } else {
        ModelError::file(path, format!("cannot open: {e}"))
    }
}

fn corrupt(path: &Path, what: impl std::fmt::Display) -> ModelError {
    ModelError::file(
        path,
        format!("corrupt or truncated safetensors file: {what}"),
    )
}

fn header_len(path: &Path, len_bytes: [u8; 8], file_len: u64) -> Result<usize, ModelError> {
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES {
        return Err(corrupt(
            path,
            format!("header length {n} is larger than the format allows"),
        ));
    }
    if n + 8 > file_len {
        return Err(corrupt(
            path,
            format!("header length {n} runs past the end of the {file_len}-byte file"),
        ));
    }
    Ok(n as usize)
}

fn parse_header(path: &Path, json: &[u8], file_len: u64) -> Result<Header, ModelError> {
    let value: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| corrupt(path, format!("the header is not valid JSON ({e})")))?;
    let serde_json::Value::Object(map) = value else {
        return Err(corrupt(path, "the header is not a JSON object"));
    };
    let data_offset = 8 + json.len();
    let data_len = (file_len as usize).saturating_sub(data_offset);
    let mut tensors = BTreeMap::new();
    for (name, info) in map {
        if name == "__metadata__" {
            continue;
        }
        let entry = parse_entry(&info).map_err(|what| {
            corrupt(
                path,
                format!("tensor `{name}` has an invalid header entry: {what}"),
            )
        })?;
        tensors.insert(name, entry);
    }
    // The data section must be covered exactly: entries end to end, no holes.
    let mut ranges: Vec<(usize, usize, &str)> = tensors
        .iter()
        .map(|(name, e)| (e.start, e.end, name.as_str()))
        .collect();
    ranges.sort_unstable();
    let mut expected_start = 0;
    for &(start, end, name) in &ranges {
        if start != expected_start {
            return Err(corrupt(
                path,
                format!("tensor `{name}` starts at byte {start} of the data, expected {expected_start} (overlap or hole)"),
            ));
        }
        expected_start = end;
    }
    let needed = expected_start;
    if needed > data_len {
        let last = ranges.last().map(|r| r.2).unwrap_or("");
        return Err(corrupt(
            path,
            format!(
                "the header describes {needed} bytes of tensor data but the file holds only {data_len} (tensor `{last}` is cut off)"
            ),
        ));
    }
    if needed < data_len {
        return Err(corrupt(
            path,
            format!(
                "the file has {} bytes after the {needed} bytes of tensor data the header describes",
                data_len - needed
            ),
        ));
    }
    Ok(Header {
        path: path.to_path_buf(),
        tensors,
        data_offset,
    })
}

fn parse_entry(info: &serde_json::Value) -> Result<TensorEntry, String> {
    let dtype_name = info
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or("no dtype")?;
    let dtype =
        StDtype::parse(dtype_name).ok_or_else(|| format!("unknown dtype {dtype_name:?}"))?;
    let shape = info
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or("no shape")?
        .iter()
        .map(|d| {
            d.as_u64()
                .map(|d| d as usize)
                .ok_or("shape is not a list of sizes")
        })
        .collect::<Result<Vec<usize>, _>>()?;
    let offsets = info
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .ok_or("no data_offsets [start, end]")?;
    let start = offsets[0].as_u64().ok_or("bad data_offsets")? as usize;
    let end = offsets[1].as_u64().ok_or("bad data_offsets")? as usize;
    if end < start {
        return Err(format!(
            "data_offsets [{start}, {end}] end before they start"
        ));
    }
    let bytes = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or("shape overflows")?;
    if end - start != bytes {
        return Err(format!(
            "{dtype_name} {shape:?} needs {bytes} bytes, data_offsets [{start}, {end}] hold {}",
            end - start
        ));
    }
    Ok(TensorEntry {
        dtype,
        shape,
        start,
        end,
    })
}

/// A whole safetensors file in memory.
pub(crate) struct TensorFile {
    pub header: Header,
    bytes: Vec<u8>,
}

impl TensorFile {
    /// Reads the file and validates its header against its size.
    pub(crate) fn open(path: &Path) -> Result<TensorFile, ModelError> {
        let bytes = std::fs::read(path).map_err(|e| open_error(path, e))?;
        let file_len = bytes.len() as u64;
        if file_len < 8 {
            return Err(corrupt(
                path,
                format!("the file is {file_len} bytes, too short for a header"),
            ));
        }
        let len_bytes: [u8; 8] = bytes[..8].try_into().expect("8 bytes");
        let n = header_len(path, len_bytes, file_len)?;
        let header = parse_header(path, &bytes[8..8 + n], file_len)?;
        Ok(TensorFile { header, bytes })
    }

    /// A float tensor converted to f32, with its shape.
    pub(crate) fn f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let entry = self.header.float_tensor(name)?;
        let raw =
            &self.bytes[self.header.data_offset + entry.start..self.header.data_offset + entry.end];
        let data = match entry.dtype {
            StDtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDtype::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::BF16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            StDtype::F64 => raw
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                .collect(),
            StDtype::Other(..) => unreachable!("float_tensor checked the dtype"),
        };
        Ok((entry.shape.clone(), data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn file_bytes(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn reads_f16_bf16_and_f32() {
        let dir = tempfile::tempdir().unwrap();
        let mut data = Vec::new();
        data.extend_from_slice(&half::f16::from_f32(1.5).to_le_bytes());
        data.extend_from_slice(&half::bf16::from_f32(-2.0).to_le_bytes());
        data.extend_from_slice(&3.25f32.to_le_bytes());
        let header = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F16","shape":[1],"data_offsets":[0,2]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[2,4]},"c":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}}"#;
        let path = write(dir.path(), "t.safetensors", &file_bytes(header, &data));
        let h = read_header(&path).unwrap();
        assert_eq!(h.tensors.len(), 3);
        let f = TensorFile::open(&path).unwrap();
        assert_eq!(f.f32("a").unwrap().1, vec![1.5]);
        assert_eq!(f.f32("b").unwrap().1, vec![-2.0]);
        assert_eq!(f.f32("c").unwrap(), (vec![1, 1], vec![3.25]));
        let err = f.f32("d").unwrap_err().to_string();
        assert!(
            err.contains("t.safetensors") && err.contains("missing tensor `d`"),
            "{err}"
        );
    }

    #[test]
    fn corrupt_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let header = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![1, 2, 3], "too short"),
            (file_bytes(header, &[0; 8]), "holds only 8"),
            (file_bytes(header, &[0; 20]), "4 bytes after"),
            (file_bytes("{not json", &[]), "not valid JSON"),
            (
                file_bytes(
                    r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#,
                    &[0; 16],
                ),
                "needs 12 bytes",
            ),
            (
                {
                    let mut b = file_bytes(header, &[0; 16]);
                    b[..8].copy_from_slice(&1000u64.to_le_bytes());
                    b
                },
                "runs past the end",
            ),
        ];
        for (bytes, needle) in cases {
            let path = write(dir.path(), "bad.safetensors", &bytes);
            let err = read_header(&path).unwrap_err().to_string();
            assert!(
                err.contains("bad.safetensors") && err.contains(needle),
                "{needle}: {err}"
            );
            let err = TensorFile::open(&path).err().unwrap().to_string();
            assert!(
                err.contains("bad.safetensors") && err.contains(needle),
                "{needle}: {err}"
            );
        }
        let err = read_header(&dir.path().join("nope.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nope.safetensors") && err.contains("missing file"),
            "{err}"
        );
    }
}
