//! Reading safetensors checkpoints, shared by every loader: one
//! `model.safetensors`, or a sharded set — `model.safetensors.index.json`
//! (`{"metadata": {…}, "weight_map": {tensor name: shard file}}`) and the
//! shard files it names, as Hugging Face's `save_pretrained(max_shard_size=…)`
//! writes them.
//!
//! Both entry points take either a `.safetensors` file or an index (any path
//! ending `.json`), and merge a sharded set into one `Header`, so loaders
//! never see shards:
//!
//! * `read_header` reads only the headers (the 8-byte length and the JSON:
//!   names, dtypes, shapes, offsets) and checks each against its file's
//!   size, so `inspect` validates a model without reading weight data;
//! * `TensorFile::open` memory-maps the file(s) (`memmap2`) instead of
//!   reading them (it reads only a file its file system cannot map).
//!   `TensorFile::stored` hands out tensors as stored (F32,
//!   F16, BF16: zero-copy slices that keep the mapping alive),
//!   `TensorFile::concat_rows` joins tensors along their first dimension
//!   without converting (fused projections), and `TensorFile::f32`
//!   converts, for loaders that compute.
//!
//! A sharded set must agree with its index exactly: a shard it lists must
//! exist, every tensor it lists must be in that shard, every tensor of a
//! shard must be listed (in that shard), and no tensor may be in two shards.
//! Each violation is a [`ModelError::File`] naming the shard (and the index
//! or the other shard in its message); a malformed index (bad JSON, no
//! `weight_map`, a shard outside its folder) and a tensor missing from the
//! whole checkpoint name the index.
//!
//! The header is parsed here rather than through `safetensors::SafeTensors`
//! because that needs the whole file in memory; the checks are the same as the
//! format's (offsets in bounds, sizes match dtype × shape, no holes, no
//! trailing bytes), and every error names the file and the tensor.
//!
//! A mapped file must not be truncated or rewritten in place while a model
//! loaded from it is alive (replacing it, e.g. by a rename, is safe): its
//! pages are read on use, and a shorter file would fault.

use crate::model::weights::WeightData;
use crate::model::ModelError;
use crate::tensor::DType;
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The file name of a single-file checkpoint in a model folder.
pub(crate) const SINGLE_FILE: &str = "model.safetensors";
/// The file name of a sharded checkpoint's index in a model folder.
pub(crate) const INDEX_FILE: &str = "model.safetensors.index.json";

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
    /// Byte range inside the data section of its shard.
    pub start: usize,
    pub end: usize,
    /// Index into [`Header::shards`] of the file holding the data.
    pub shard: usize,
}

/// One file of a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Shard {
    pub path: PathBuf,
    /// Where the data section starts in the file (8 + header length).
    pub data_offset: usize,
}

/// The parsed header(s) of a checkpoint: one file's, or a sharded set's
/// merged.
#[derive(Clone, Debug)]
pub(crate) struct Header {
    /// The file, or a sharded checkpoint's index: errors about the whole
    /// (a missing tensor) name it.
    pub path: PathBuf,
    /// Tensors by name (sorted), over every shard.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// The files holding the data: the file itself, or the index's shards
    /// sorted by name.
    pub shards: Vec<Shard>,
}

impl Header {
    pub(crate) fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The file holding `entry`'s data.
    pub(crate) fn file_of(&self, entry: &TensorEntry) -> &Path {
        &self.shards[entry.shard].path
    }

    fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::file(&self.path, message)
    }

    /// An error about one tensor, naming the file that holds it.
    fn error_in(&self, entry: &TensorEntry, message: impl Into<String>) -> ModelError {
        ModelError::file(self.file_of(entry), message)
    }

    /// The entry of a tensor that must exist with a float dtype.
    pub(crate) fn float_tensor(&self, name: &str) -> Result<&TensorEntry, ModelError> {
        let entry = self
            .get(name)
            .ok_or_else(|| self.error(format!("missing tensor `{name}`")))?;
        if !entry.dtype.is_float() {
            return Err(self.error_in(
                entry,
                format!(
                    "tensor `{name}` has dtype {}, expected a float dtype (F32, F16, BF16 or F64)",
                    entry.dtype.name()
                ),
            ));
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
            return Err(self.error_in(
                entry,
                format!(
                    "shape mismatch: tensor `{name}` has shape {:?}, expected {:?}{why}",
                    entry.shape, shape
                ),
            ));
        }
        Ok(())
    }
}

/// Reads and validates the header of a safetensors file, or of every shard
/// of a sharded checkpoint (`path` is then its index), without the data.
pub(crate) fn read_header(path: &Path) -> Result<Header, ModelError> {
    if is_index(path) {
        Ok(read_sharded(path, |p| Ok((read_file_header(p)?, ())))?.0)
    } else {
        read_file_header(path)
    }
}

/// The checkpoint of a model folder: `model.safetensors`, else a sharded
/// checkpoint's `model.safetensors.index.json`; the error names both.
pub(crate) fn checkpoint_in(dir: &Path) -> Result<PathBuf, ModelError> {
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(single);
    }
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        return Ok(index);
    }
    Err(ModelError::file(
        &single,
        format!("missing file (and no {INDEX_FILE}, a sharded checkpoint's index)"),
    ))
}

/// A sharded checkpoint's index, by its name (`*.json`).
fn is_index(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

/// Reads an index and opens each shard it names with `open` (the header,
/// and whatever else the caller keeps per shard), then merges the shards'
/// headers, checking them against the index.
fn read_sharded<T>(
    index: &Path,
    open: impl Fn(&Path) -> Result<(Header, T), ModelError>,
) -> Result<(Header, Vec<T>), ModelError> {
    let weight_map = read_index(index)?;
    let dir = index.parent().unwrap_or(Path::new(""));
    let index_name = file_name(index);
    let names: BTreeSet<&str> = weight_map.values().map(String::as_str).collect();
    let mut headers = Vec::with_capacity(names.len());
    let mut kept = Vec::with_capacity(names.len());
    for name in names {
        let path = dir.join(name);
        if !path.exists() {
            return Err(ModelError::file(
                &path,
                format!("missing shard (no such file; {index_name} lists it)"),
            ));
        }
        let (header, extra) = open(&path)?;
        headers.push((name, header));
        kept.push(extra);
    }
    Ok((merge(index, &weight_map, headers)?, kept))
}

/// The `weight_map` of an index: tensor name → shard file name.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    let json = std::fs::read(path).map_err(|e| open_error(path, e))?;
    let value: serde_json::Value = serde_json::from_slice(&json).map_err(|e| {
        ModelError::file(
            path,
            format!("corrupt safetensors index: not valid JSON ({e})"),
        )
    })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| {
            ModelError::file(
                path,
                "corrupt safetensors index: no `weight_map` object (tensor name → shard file)",
            )
        })?;
    if map.is_empty() {
        return Err(ModelError::file(
            path,
            "corrupt safetensors index: the `weight_map` is empty",
        ));
    }
    let mut out = BTreeMap::new();
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .filter(|s| {
                let mut parts = Path::new(s).components();
                matches!(parts.next(), Some(std::path::Component::Normal(_)))
                    && parts.next().is_none()
            })
            .ok_or_else(|| {
                ModelError::file(
                    path,
                    format!(
                        "corrupt safetensors index: tensor `{tensor}` maps to {shard}, not the name of a file beside the index"
                    ),
                )
            })?;
        out.insert(tensor.clone(), shard.to_string());
    }
    Ok(out)
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Merges the shards' headers (each of one file, sorted by name) into one,
/// checking them against the index's `weight_map`.
fn merge(
    index: &Path,
    weight_map: &BTreeMap<String, String>,
    shards: Vec<(&str, Header)>,
) -> Result<Header, ModelError> {
    let index_name = file_name(index);
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    // First the same tensor in two shards (whatever the index says of it).
    for (i, (_, header)) in shards.iter().enumerate() {
        for name in header.tensors.keys() {
            if let Some((first, _)) = shards[..i]
                .iter()
                .find(|(_, h)| h.tensors.contains_key(name))
            {
                return Err(ModelError::file(
                    &header.path,
                    format!(
                        "tensor `{name}` is also in {first}: a tensor may be in one shard only"
                    ),
                ));
            }
        }
    }
    let mut files = Vec::with_capacity(shards.len());
    for (i, (shard_name, header)) in shards.into_iter().enumerate() {
        let path = header.path;
        for (name, mut entry) in header.tensors {
            match weight_map.get(&name) {
                Some(listed) if listed == shard_name => {}
                Some(listed) => {
                    return Err(ModelError::file(
                        &path,
                        format!(
                        "tensor `{name}` is in this shard, but {index_name} puts it in {listed}"
                    ),
                    ))
                }
                None => {
                    return Err(ModelError::file(
                        &path,
                        format!(
                            "tensor `{name}` is in this shard but not in {index_name}'s weight_map"
                        ),
                    ))
                }
            }
            entry.shard = i;
            tensors.insert(name, entry);
        }
        let data_offset = header.shards[0].data_offset;
        files.push(Shard { path, data_offset });
    }
    for (name, shard) in weight_map {
        if !tensors.contains_key(name) {
            return Err(ModelError::file(
                index.parent().unwrap_or(Path::new("")).join(shard),
                format!("missing tensor `{name}`, which {index_name} puts in this shard"),
            ));
        }
    }
    Ok(Header {
        path: index.to_path_buf(),
        tensors,
        shards: files,
    })
}

/// [`read_header`] of one safetensors file.
fn read_file_header(path: &Path) -> Result<Header, ModelError> {
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
        shards: vec![Shard {
            path: path.to_path_buf(),
            data_offset,
        }],
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
        shard: 0,
    })
}

/// A checkpoint's files, memory-mapped: one safetensors file, or every
/// shard of a sharded one.
pub(crate) struct TensorFile {
    pub header: Header,
    /// Each shard's whole file (`Bytes` over the mapping: slices of it
    /// share the mapping, which lives as long as the last of them).
    maps: Vec<Bytes>,
}

impl TensorFile {
    /// Maps the file (or, for an index, every shard it lists) and validates
    /// the header(s) against the file sizes (and the index).
    pub(crate) fn open(path: &Path) -> Result<TensorFile, ModelError> {
        let (header, maps) = if is_index(path) {
            read_sharded(path, map_file)?
        } else {
            let (header, map) = map_file(path)?;
            (header, vec![map])
        };
        Ok(TensorFile { header, maps })
    }

    /// The stored bytes of a tensor: a slice of its shard's mapping.
    fn raw(&self, entry: &TensorEntry) -> Bytes {
        let offset = self.header.shards[entry.shard].data_offset;
        self.maps[entry.shard].slice(offset + entry.start..offset + entry.end)
    }

    /// A float tensor converted to f32, with its shape.
    pub(crate) fn f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let entry = self.header.float_tensor(name)?;
        let offset = self.header.shards[entry.shard].data_offset;
        let raw = &self.maps[entry.shard][offset + entry.start..offset + entry.end];
        Ok((entry.shape.clone(), to_f32(entry.dtype, raw)))
    }

    /// A float tensor as stored, with its shape: F32, F16 and BF16 as a
    /// zero-copy slice of the mapping; F64 (no backend computes it)
    /// converted to f32.
    pub(crate) fn stored(&self, name: &str) -> Result<(Vec<usize>, WeightData), ModelError> {
        let entry = self.header.float_tensor(name)?;
        let data = match stored_dtype(entry.dtype) {
            Some(dtype) => WeightData::from_le_bytes(dtype, self.raw(entry)),
            None => WeightData::from_f32(self.f32(name)?.1),
        };
        Ok((entry.shape.clone(), data))
    }

    /// Float tensors concatenated along their first dimension (fused
    /// projections: `[q; k; v]` rows, `[up; gate]`), with the joined shape.
    /// Their other dimensions must agree. The bytes are joined as stored
    /// when every tensor has the same dtype (F32, F16 or BF16), else the
    /// values are converted to f32 first.
    pub(crate) fn concat_rows(
        &self,
        names: &[&str],
    ) -> Result<(Vec<usize>, WeightData), ModelError> {
        let entries = names
            .iter()
            .map(|n| self.header.float_tensor(n))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(first) = entries.first() else {
            return Err(self.header.error("no tensors to concatenate"));
        };
        for (entry, name) in entries.iter().zip(names) {
            if entry.shape.is_empty() || entry.shape[1..] != first.shape[1..] {
                return Err(self.header.error_in(
                    entry,
                    format!(
                        "cannot concatenate the rows of `{}` {:?} and `{name}` {:?}: a tensor with rows of the same size is needed",
                        names[0], first.shape, entry.shape
                    ),
                ));
            }
        }
        let mut shape = first.shape.clone();
        shape[0] = entries.iter().map(|e| e.shape[0]).sum();
        let same = entries.iter().all(|e| e.dtype == first.dtype);
        let data = match stored_dtype(first.dtype).filter(|_| same) {
            Some(dtype) => {
                let total = entries.iter().map(|e| e.end - e.start).sum();
                let mut bytes = BytesMut::with_capacity(total);
                for entry in &entries {
                    bytes.extend_from_slice(&self.raw(entry));
                }
                WeightData::from_le_bytes(dtype, bytes.freeze())
            }
            None => {
                let mut values = Vec::with_capacity(shape.iter().product());
                for name in names {
                    values.extend_from_slice(&self.f32(name)?.1);
                }
                WeightData::from_f32(values)
            }
        };
        Ok((shape, data))
    }
}

/// Maps one safetensors file and validates its header against its size.
fn map_file(path: &Path) -> Result<(Header, Bytes), ModelError> {
    let file = std::fs::File::open(path).map_err(|e| open_error(path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?
        .len();
    if file_len < 8 {
        return Err(corrupt(
            path,
            format!("the file is {file_len} bytes, too short for a header"),
        ));
    }
    // SAFETY: the mapping is read-only; the module's documentation states
    // the one rule it relies on (the file is not truncated or rewritten in
    // place while mapped).
    let bytes = match unsafe { memmap2::Mmap::map(&file) } {
        Ok(map) => Bytes::from_owner(map),
        // A file system that cannot map files: read it instead.
        Err(_) => {
            let mut data = Vec::with_capacity(file_len as usize);
            (&file)
                .read_to_end(&mut data)
                .map_err(|e| ModelError::file(path, format!("cannot read: {e}")))?;
            Bytes::from(data)
        }
    };
    if bytes.len() as u64 != file_len {
        return Err(ModelError::file(
            path,
            "the file changed while being opened",
        ));
    }
    let len_bytes: [u8; 8] = bytes[..8].try_into().expect("8 bytes");
    let n = header_len(path, len_bytes, file_len)?;
    let header = parse_header(path, &bytes[8..8 + n], file_len)?;
    Ok((header, bytes))
}

/// The compute dtype a stored float dtype is handed out as (none for F64).
fn stored_dtype(dtype: StDtype) -> Option<DType> {
    match dtype {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::F64 | StDtype::Other(..) => None,
    }
}

/// Little-endian elements of a float dtype, as f32.
fn to_f32(dtype: StDtype, raw: &[u8]) -> Vec<f32> {
    match dtype {
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

    /// A safetensors file of `(name, dtype, shape, little-endian bytes)`.
    fn st_file(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        file_bytes(&serde_json::Value::Object(header).to_string(), &data)
    }

    fn f32s(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn bf16s(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect()
    }

    fn f16s(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect()
    }

    const SHARD_1: &str = "model-00001-of-00002.safetensors";
    const SHARD_2: &str = "model-00002-of-00002.safetensors";

    /// Two shards: `a` (F32 [2, 2]) and `b` (BF16 [3]) in the first, `c`
    /// (F16 [1, 2]) and `d` (F64 [2]) in the second; the index names them
    /// as `map` says (`None`: as they are).
    fn sharded(dir: &Path, map: Option<serde_json::Value>) -> PathBuf {
        let one = st_file(&[
            ("a", "F32", &[2, 2], f32s(&[1.0, 2.0, 3.0, 4.0])),
            ("b", "BF16", &[3], bf16s(&[0.5, -1.0, 8.0])),
        ]);
        let d: Vec<u8> = [1.25f64, -3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let two = st_file(&[
            ("c", "F16", &[1, 2], f16s(&[5.0, 6.0])),
            ("d", "F64", &[2], d),
        ]);
        write(dir, SHARD_1, &one);
        write(dir, SHARD_2, &two);
        let map = map.unwrap_or_else(
            || serde_json::json!({"a": SHARD_1, "b": SHARD_1, "c": SHARD_2, "d": SHARD_2}),
        );
        let index = serde_json::json!({"metadata": {"total_size": 42}, "weight_map": map});
        write(dir, INDEX_FILE, index.to_string().as_bytes())
    }

    #[test]
    fn sharded_checkpoints_read_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let index = sharded(dir.path(), None);
        let h = read_header(&index).unwrap();
        assert_eq!(h.path, index);
        assert_eq!(
            h.tensors.keys().collect::<Vec<_>>(),
            ["a", "b", "c", "d"].iter().collect::<Vec<_>>()
        );
        assert_eq!(h.shards.len(), 2);
        assert!(h.file_of(h.get("c").unwrap()).ends_with(SHARD_2));
        let f = TensorFile::open(&index).unwrap();
        assert_eq!(f.f32("a").unwrap(), (vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]));
        assert_eq!(f.f32("b").unwrap().1, vec![0.5, -1.0, 8.0]);
        assert_eq!(f.f32("c").unwrap(), (vec![1, 2], vec![5.0, 6.0]));
        let (shape, d) = f.stored("d").unwrap();
        assert_eq!((shape, d.dtype()), (vec![2], DType::F32));
        assert_eq!(&d.to_f32()[..], &[1.25, -3.0]);
        let (_, b) = f.stored("b").unwrap();
        assert_eq!(
            b.le_bytes(DType::BF16).unwrap(),
            &bf16s(&[0.5, -1.0, 8.0])[..]
        );
        // Across shards and dtypes: joined in f32.
        let (shape, ac) = f.concat_rows(&["a", "c"]).unwrap();
        assert_eq!((shape, ac.dtype()), (vec![3, 2], DType::F32));
        assert_eq!(&ac.to_f32()[..], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // A missing tensor names the index; a wrong shape, its shard.
        let err = f.f32("e").unwrap_err().to_string();
        assert!(
            err.contains(INDEX_FILE) && err.contains("missing tensor `e`"),
            "{err}"
        );
        let err = f
            .header
            .expect_shape("c", &[2], "")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(SHARD_2) && err.contains("shape mismatch"),
            "{err}"
        );
    }

    #[test]
    fn shard_errors_are_named() {
        use serde_json::json;
        let all = |extra: (&str, &str)| {
            let mut m = json!({"a": SHARD_1, "b": SHARD_1, "c": SHARD_2, "d": SHARD_2});
            m[extra.0] = extra.1.into();
            m
        };
        let cases: Vec<(Option<serde_json::Value>, Option<&str>, &[&str])> = vec![
            (
                Some(all(("e", "model-00003-of-00003.safetensors"))),
                None,
                &[
                    "model-00003-of-00003.safetensors",
                    "missing shard",
                    INDEX_FILE,
                ],
            ),
            (
                Some(all(("e", SHARD_1))),
                None,
                &[SHARD_1, "missing tensor `e`", INDEX_FILE],
            ),
            (
                Some(json!({"a": SHARD_1, "c": SHARD_2, "d": SHARD_2})),
                None,
                &[
                    SHARD_1,
                    "tensor `b` is in this shard but not in",
                    INDEX_FILE,
                ],
            ),
            (
                Some(all(("b", SHARD_2))),
                None,
                &[SHARD_1, "tensor `b` is in this shard, but", "puts it in"],
            ),
            (
                Some(all(("e", "../elsewhere.safetensors"))),
                None,
                &[INDEX_FILE, "not the name of a file"],
            ),
            (
                Some(json!({})),
                None,
                &[INDEX_FILE, "`weight_map` is empty"],
            ),
            (None, Some("{not json"), &[INDEX_FILE, "not valid JSON"]),
            (
                None,
                Some(r#"{"metadata": {}}"#),
                &[INDEX_FILE, "no `weight_map`"],
            ),
        ];
        for (map, raw_index, needles) in cases {
            let dir = tempfile::tempdir().unwrap();
            let index = sharded(dir.path(), map);
            if let Some(raw) = raw_index {
                write(dir.path(), INDEX_FILE, raw.as_bytes());
            }
            for err in [
                read_header(&index).unwrap_err().to_string(),
                TensorFile::open(&index).err().unwrap().to_string(),
            ] {
                for needle in needles {
                    assert!(err.contains(needle), "{needle:?} not in {err:?}");
                }
            }
        }
        // The same tensor in two shards, whatever the index says.
        let dir = tempfile::tempdir().unwrap();
        let index = sharded(dir.path(), None);
        let two = st_file(&[
            ("a", "F32", &[2, 2], f32s(&[0.0; 4])),
            ("c", "F16", &[1, 2], f16s(&[5.0, 6.0])),
            ("d", "F64", &[2], vec![0; 16]),
        ]);
        write(dir.path(), SHARD_2, &two);
        let err = TensorFile::open(&index).err().unwrap().to_string();
        assert!(
            err.contains(SHARD_2) && err.contains("tensor `a` is also in") && err.contains(SHARD_1),
            "{err}"
        );
        // A corrupt shard is named as a single file would be.
        write(dir.path(), SHARD_2, &[1, 2, 3]);
        let err = read_header(&index).unwrap_err().to_string();
        assert!(err.contains(SHARD_2) && err.contains("too short"), "{err}");
    }

    #[test]
    fn stored_keeps_bytes_and_concat_rows_joins_them() {
        let dir = tempfile::tempdir().unwrap();
        // A NaN with a payload and a subnormal: bits a round trip would keep
        // only by luck.
        let mut q = bf16s(&[1.0, -2.5, 3.0, 0.1, 1e-40, 7.0]);
        q[0..2].copy_from_slice(&0x7fc1u16.to_le_bytes());
        let k = bf16s(&[4.0, 5.0, 6.0]);
        let path = write(
            dir.path(),
            "m.safetensors",
            &st_file(&[
                ("q", "BF16", &[2, 3], q.clone()),
                ("k", "BF16", &[1, 3], k.clone()),
                ("v", "F16", &[1, 3], f16s(&[7.0, 8.0, 9.0])),
                ("w", "BF16", &[3, 2], bf16s(&[0.0; 6])),
                ("s", "F32", &[], f32s(&[1.0])),
                ("i", "I64", &[1], vec![0; 8]),
            ]),
        );
        let f = TensorFile::open(&path).unwrap();
        let (shape, data) = f.stored("q").unwrap();
        assert_eq!(
            (shape, data.dtype(), data.len()),
            (vec![2, 3], DType::BF16, 6)
        );
        assert_eq!(data.le_bytes(DType::BF16).unwrap(), &q[..]);
        let (shape, qk) = f.concat_rows(&["q", "k"]).unwrap();
        assert_eq!((shape, qk.dtype()), (vec![3, 3], DType::BF16));
        assert_eq!(
            qk.le_bytes(DType::BF16).unwrap(),
            &[q.clone(), k].concat()[..]
        );
        // Different dtypes: joined in f32.
        let (shape, qv) = f.concat_rows(&["q", "v"]).unwrap();
        assert_eq!((shape, qv.dtype()), (vec![3, 3], DType::F32));
        assert_eq!(&qv.to_f32()[6..], &[7.0, 8.0, 9.0]);
        for (names, needle) in [
            (
                &["q", "w"][..],
                "cannot concatenate the rows of `q` [2, 3] and `w` [3, 2]",
            ),
            (&["s"][..], "cannot concatenate"),
            (&["q", "i"][..], "tensor `i` has dtype I64"),
            (&["q", "x"][..], "missing tensor `x`"),
            (&[][..], "no tensors"),
        ] {
            let err = f.concat_rows(names).unwrap_err().to_string();
            assert!(
                err.contains("m.safetensors") && err.contains(needle),
                "{err}"
            );
        }
        // The stored slices outlive the file object (they share the mapping).
        drop(f);
        assert_eq!(&qk.to_f32()[6..], &[4.0, 5.0, 6.0]);
    }

    #[test]
    fn a_folder_holds_one_file_or_an_index() {
        let dir = tempfile::tempdir().unwrap();
        let err = checkpoint_in(dir.path()).unwrap_err().to_string();
        for needle in [SINGLE_FILE, INDEX_FILE, "missing file"] {
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
        }
        let index = sharded(dir.path(), None);
        assert_eq!(checkpoint_in(dir.path()).unwrap(), index);
        let single = write(dir.path(), SINGLE_FILE, &st_file(&[]));
        assert_eq!(checkpoint_in(dir.path()).unwrap(), single);
    }
}
