//! The strict decoder of a request's header frame.
//!
//! `docs/protocol.md` says the header is a MessagePack **map with string
//! keys**; this decoder accepts exactly that and nothing laxer: no array
//! headers, no integer keys, no duplicate keys, no `nil` for a present key,
//! no bytes after the map, no unknown keys. Every error names the key and
//! says what was expected and what came, and any string it echoes is cut to
//! [`ECHO_LIMIT`] characters. The reader is a small hand-written MessagePack
//! reader over a byte slice: it never allocates more than the input holds
//! and its recursion (when skipping an unknown nested value) is bounded.

use super::{InputKind, RequestHeader, PROTOCOL_VERSION};
use crate::tensor::DType;

/// Longest prefix of a client's string echoed back in an error message.
pub const ECHO_LIMIT: usize = 64;

/// Keys a request header may carry, in the order the document lists them.
pub const KEYS: [&str; 14] = [
    "v",
    "id",
    "model",
    "input",
    "dtype",
    "shape",
    "priority",
    "timeout_us",
    "deadline_unix_us",
    "truncate",
    "output_dtype",
    "prompt_name",
    "dimensions",
    "top_k",
];

/// The versions of the protocol this daemon speaks.
pub const SUPPORTED_VERSIONS: [u32; 1] = [PROTOCOL_VERSION];

/// Most entries in a `shape` array (tensors are `[rows, features]`).
const MAX_SHAPE_DIMS: usize = 8;
/// Deepest nesting skipped inside a value (only reached on malformed input).
const MAX_DEPTH: usize = 16;

/// `s` cut to [`ECHO_LIMIT`] characters, with an ellipsis when cut.
pub fn echo(s: &str) -> String {
    match s.char_indices().nth(ECHO_LIMIT) {
        Some((cut, _)) => format!("{:?}…", &s[..cut]),
        None => format!("{s:?}"),
    }
}

/// Why a header was refused; `id` is the request's id when it could be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderError {
    pub id: u64,
    pub message: String,
}

/// What a MessagePack value is, for error messages.
fn kind_of(marker: u8) -> &'static str {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf => "an unsigned integer",
        0xe0..=0xff | 0xd0..=0xd3 => "an integer",
        0x80..=0x8f | 0xde | 0xdf => "a map",
        0x90..=0x9f | 0xdc | 0xdd => "an array",
        0xa0..=0xbf | 0xd9..=0xdb => "a string",
        0xc0 => "nil",
        0xc2 | 0xc3 => "a boolean",
        0xc4..=0xc6 => "binary data",
        0xca | 0xcb => "a float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "an extension value",
        _ => "an invalid byte (0xc1)",
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Read<T> = Result<T, String>;

impl<'a> Reader<'a> {
    fn peek(&self) -> Read<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| "the header ends in the middle of a value".to_string())
    }

    fn take(&mut self, n: usize) -> Read<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| "the header ends in the middle of a value".to_string())?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn be(&mut self, n: usize) -> Read<u64> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    /// A length header: a one-byte form whose marker is in `fix` (the
    /// length in its low bits, `mask`), or a marker of `wide` followed by
    /// that many bytes of big-endian length. None: not this kind of value.
    fn length(
        &mut self,
        fix: std::ops::RangeInclusive<u8>,
        mask: u8,
        wide: &[(u8, usize)],
    ) -> Read<Option<usize>> {
        let m = self.peek()?;
        let n = if fix.contains(&m) {
            self.pos += 1;
            (m & mask) as usize
        } else if let Some(&(_, bytes)) = wide.iter().find(|(w, _)| *w == m) {
            self.pos += 1;
            self.be(bytes)? as usize
        } else {
            return Ok(None);
        };
        Ok(Some(n))
    }

    /// A map header's entry count.
    fn map_len(&mut self) -> Read<Option<usize>> {
        self.length(0x80..=0x8f, 0x0f, &[(0xde, 2), (0xdf, 4)])
    }

    fn array_len(&mut self) -> Read<Option<usize>> {
        self.length(0x90..=0x9f, 0x0f, &[(0xdc, 2), (0xdd, 4)])
    }

    fn str(&mut self) -> Read<Option<&'a str>> {
        let Some(n) = self.length(0xa0..=0xbf, 0x1f, &[(0xd9, 1), (0xda, 2), (0xdb, 4)])? else {
            return Ok(None);
        };
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes)
            .map(Some)
            .map_err(|_| "a string that is not valid UTF-8".to_string())
    }

    /// A non-negative integer in any MessagePack integer encoding.
    fn uint(&mut self) -> Read<Option<u64>> {
        let m = self.peek()?;
        let (len, signed) = match m {
            0x00..=0x7f => {
                self.pos += 1;
                return Ok(Some(m as u64));
            }
            0xcc => (1, false),
            0xcd => (2, false),
            0xce => (4, false),
            0xcf => (8, false),
            0xd0 => (1, true),
            0xd1 => (2, true),
            0xd2 => (4, true),
            0xd3 => (8, true),
            _ => return Ok(None),
        };
        self.pos += 1;
        let raw = self.be(len)?;
        if signed {
            let bits = 8 * len as u32;
            let value = ((raw << (64 - bits)) as i64) >> (64 - bits);
            if value < 0 {
                return Err(format!("the negative integer {value}"));
            }
            return Ok(Some(value as u64));
        }
        Ok(Some(raw))
    }

    fn bool(&mut self) -> Read<Option<bool>> {
        let b = match self.peek()? {
            0xc2 => false,
            0xc3 => true,
            _ => return Ok(None),
        };
        self.pos += 1;
        Ok(Some(b))
    }

    /// Skips one value of any type (bounded nesting).
    fn skip(&mut self, depth: usize) -> Read<()> {
        if depth > MAX_DEPTH {
            return Err("values nested too deeply".into());
        }
        let m = self.peek()?;
        if let Some(n) = self.map_len()? {
            for _ in 0..n {
                self.skip(depth + 1)?;
                self.skip(depth + 1)?;
            }
            return Ok(());
        }
        if let Some(n) = self.array_len()? {
            for _ in 0..n {
                self.skip(depth + 1)?;
            }
            return Ok(());
        }
        self.pos += 1;
        let data = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xce | 0xd2 | 0xca => 4,
            0xcf | 0xd3 | 0xcb => 8,
            0xd9 | 0xc4 => self.be(1)? as usize,
            0xda | 0xc5 => self.be(2)? as usize,
            0xdb | 0xc6 => self.be(4)? as usize,
            0xd4 => 2,
            0xd5 => 3,
            0xd6 => 5,
            0xd7 => 9,
            0xd8 => 17,
            0xc7 => self.be(1)? as usize + 1,
            0xc8 => self.be(2)? as usize + 1,
            0xc9 => self.be(4)? as usize + 1,
            _ => return Err("an invalid byte (0xc1)".into()),
        };
        self.take(data)?;
        Ok(())
    }
}

/// Finds the request id in a header that failed to decode, so the error
/// reply can carry it (0 when there is none to be found).
fn salvage_id(bytes: &[u8]) -> u64 {
    let mut r = Reader { buf: bytes, pos: 0 };
    let Ok(Some(n)) = r.map_len() else { return 0 };
    for _ in 0..n {
        match r.str() {
            Ok(Some("id")) => return r.uint().ok().flatten().unwrap_or(0),
            Ok(Some(_)) => {}
            _ => return 0,
        }
        if r.skip(0).is_err() {
            return 0;
        }
    }
    0
}

/// The `v` of a header that failed to decode, when it can be read, so a
/// newer client's header (with keys this version does not know) is told
/// about the version rather than the key.
pub fn salvage_version(bytes: &[u8]) -> Option<u64> {
    let mut r = Reader { buf: bytes, pos: 0 };
    let n = r.map_len().ok()??;
    for _ in 0..n {
        match r.str() {
            Ok(Some("v")) => return r.uint().ok().flatten(),
            Ok(Some(_)) => {}
            _ => return None,
        }
        r.skip(0).ok()?;
    }
    None
}

/// Decodes a request header frame; see the module docs for the rules.
pub fn decode_header(bytes: &[u8]) -> Result<RequestHeader, HeaderError> {
    decode(bytes).map_err(|message| HeaderError {
        id: salvage_id(bytes),
        message,
    })
}

fn decode(bytes: &[u8]) -> Result<RequestHeader, String> {
    let mut r = Reader { buf: bytes, pos: 0 };
    if bytes.is_empty() {
        return Err("the header frame is empty: expected a MessagePack map".into());
    }
    let entries = match r.map_len()? {
        Some(n) => n,
        None => {
            return Err(format!(
                "the header must be a MessagePack map with string keys, got {}",
                kind_of(bytes[0])
            ))
        }
    };
    let mut seen = [false; KEYS.len()];
    let mut h = RequestHeader::new(0, String::new(), InputKind::Texts);
    for entry in 0..entries {
        let key_marker = r.peek()?;
        let key = match r.str() {
            Ok(Some(k)) => k,
            Ok(None) => {
                return Err(format!(
                    "header keys must be strings; entry {entry} has {} as its key",
                    kind_of(key_marker)
                ))
            }
            Err(e) => return Err(format!("entry {entry}'s key: {e}")),
        };
        let Some(index) = KEYS.iter().position(|k| *k == key) else {
            return Err(format!(
                "unknown key {} (the header's keys are: {})",
                echo(key),
                KEYS.join(", ")
            ));
        };
        if std::mem::replace(&mut seen[index], true) {
            return Err(format!("key `{key}` appears twice"));
        }
        let marker = r.peek()?;
        let got = || kind_of(marker);
        if marker == 0xc0 {
            return Err(format!("`{key}` is nil: leave out a key that has no value"));
        }
        let uint = |r: &mut Reader<'_>, what: &str| -> Result<u64, String> {
            match r.uint() {
                Ok(Some(v)) => Ok(v),
                Ok(None) => Err(format!("`{key}` must be {what}, got {}", got())),
                Err(e) => Err(format!("`{key}` must be {what}, got {e}")),
            }
        };
        let string = |r: &mut Reader<'_>, what: &str| -> Result<String, String> {
            match r.str() {
                Ok(Some(s)) => Ok(s.to_string()),
                Ok(None) => Err(format!("`{key}` must be {what}, got {}", got())),
                Err(e) => Err(format!("`{key}`: {e}")),
            }
        };
        match key {
            "v" => {
                let v = uint(&mut r, "an unsigned integer")?;
                h.v = u32::try_from(v).unwrap_or(u32::MAX);
            }
            "id" => h.id = uint(&mut r, "an unsigned integer")?,
            "model" => h.model = string(&mut r, "a string")?,
            "input" => {
                let s = string(&mut r, "\"tensor\", \"texts\", \"ids\" or \"pairs\"")?;
                h.input = match s.as_str() {
                    "tensor" => InputKind::Tensor,
                    "texts" => InputKind::Texts,
                    "ids" => InputKind::Ids,
                    "pairs" => InputKind::Pairs,
                    _ => {
                        return Err(format!(
                            "`input` must be \"tensor\", \"texts\", \"ids\" or \"pairs\", got {}",
                            echo(&s)
                        ))
                    }
                };
            }
            "prompt_name" => h.prompt_name = Some(string(&mut r, "a string")?),
            "dimensions" => {
                let d = uint(&mut r, "an unsigned integer")?;
                h.dimensions = Some(u32::try_from(d).unwrap_or(u32::MAX));
            }
            "top_k" => {
                let k = uint(&mut r, "an unsigned integer")?;
                h.top_k = Some(u32::try_from(k).unwrap_or(u32::MAX));
            }
            "dtype" | "output_dtype" => {
                let s = string(&mut r, "a dtype name such as \"f32\"")?;
                let dtype: DType = s.parse().map_err(|_| {
                    format!(
                        "`{key}` must be one of \"f32\", \"f16\", \"bf16\", \"i32\", \"u32\", got {}",
                        echo(&s)
                    )
                })?;
                if key == "dtype" {
                    h.dtype = Some(dtype);
                } else {
                    h.output_dtype = Some(dtype);
                }
            }
            "shape" => {
                let Some(n) = r.array_len()? else {
                    return Err(format!(
                        "`shape` must be an array of unsigned integers, got {}",
                        got()
                    ));
                };
                if n > MAX_SHAPE_DIMS {
                    return Err(format!(
                        "`shape` has {n} dimensions, at most {MAX_SHAPE_DIMS} are allowed"
                    ));
                }
                let mut shape = Vec::with_capacity(n);
                for i in 0..n {
                    let m = r.peek()?;
                    match r.uint() {
                        Ok(Some(d)) => shape.push(d),
                        Ok(None) => {
                            return Err(format!(
                                "`shape[{i}]` must be an unsigned integer, got {}",
                                kind_of(m)
                            ))
                        }
                        Err(e) => {
                            return Err(format!(
                                "`shape[{i}]` must be an unsigned integer, got {e}"
                            ))
                        }
                    }
                }
                h.shape = Some(shape);
            }
            "priority" => {
                let p = uint(&mut r, "an unsigned integer 0-255")?;
                h.priority = u8::try_from(p).map_err(|_| {
                    format!("`priority` must be an unsigned integer 0-255, got {p}")
                })?;
            }
            "timeout_us" => h.timeout_us = Some(uint(&mut r, "an unsigned integer")?),
            "deadline_unix_us" => h.deadline_unix_us = Some(uint(&mut r, "an unsigned integer")?),
            "truncate" => {
                h.truncate = r
                    .bool()?
                    .ok_or_else(|| format!("`truncate` must be a boolean, got {}", got()))?
            }
            _ => unreachable!("every key in KEYS is handled"),
        }
    }
    if r.pos != bytes.len() {
        return Err(format!(
            "the header frame has {} bytes after its map",
            bytes.len() - r.pos
        ));
    }
    for (key, seen) in KEYS.iter().zip(seen).take(4) {
        if !seen {
            return Err(format!("missing key `{key}`"));
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;
    use std::collections::BTreeMap;

    /// A map with these entries, in order, as MessagePack.
    fn map(entries: &[(&str, rmpv_lite::Value)]) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv_lite::write_map(&mut out, entries);
        out
    }

    /// The few MessagePack writers the tests need.
    mod rmpv_lite {
        pub enum Value {
            U(u64),
            S(String),
            B(bool),
            Nil,
            A(Vec<Value>),
        }
        pub fn write(out: &mut Vec<u8>, v: &Value) {
            match v {
                Value::U(n) => {
                    rmp::encode::write_uint(out, *n).unwrap();
                }
                Value::S(s) => rmp::encode::write_str(out, s).unwrap(),
                Value::B(b) => rmp::encode::write_bool(out, *b).unwrap(),
                Value::Nil => rmp::encode::write_nil(out).unwrap(),
                Value::A(items) => {
                    rmp::encode::write_array_len(out, items.len() as u32).unwrap();
                    items.iter().for_each(|i| write(out, i));
                }
            }
        }
        pub fn write_map(out: &mut Vec<u8>, entries: &[(&str, Value)]) {
            rmp::encode::write_map_len(out, entries.len() as u32).unwrap();
            for (k, v) in entries {
                rmp::encode::write_str(out, k).unwrap();
                write(out, v);
            }
        }
    }
    use rmpv_lite::Value::{self, *};

    fn s(x: &str) -> Value {
        S(x.into())
    }

    fn base() -> Vec<(&'static str, Value)> {
        vec![
            ("v", U(1)),
            ("id", U(7)),
            ("model", s("m")),
            ("input", s("texts")),
        ]
    }

    fn with(extra: (&'static str, Value)) -> Vec<u8> {
        let mut e = base();
        e.push(extra);
        map(&e)
    }

    fn err(bytes: &[u8]) -> HeaderError {
        decode_header(bytes).unwrap_err()
    }

    #[test]
    fn a_full_header_decodes() {
        let mut e = base();
        e.extend([
            ("dtype", s("f32")),
            ("shape", A(vec![U(2), U(128)])),
            ("priority", U(9)),
            ("timeout_us", U(5000)),
            ("deadline_unix_us", U(u64::MAX)),
            ("truncate", B(false)),
            ("output_dtype", s("f16")),
            ("prompt_name", s("query")),
            ("dimensions", U(64)),
        ]);
        let h = decode_header(&map(&e)).unwrap();
        assert_eq!(h.prompt_name.as_deref(), Some("query"));
        assert_eq!(h.dimensions, Some(64));
        assert_eq!((h.v, h.id, h.model.as_str()), (1, 7, "m"));
        assert_eq!(h.shape, Some(vec![2, 128]));
        assert_eq!((h.priority, h.truncate), (9, false));
        assert_eq!(h.deadline_unix_us, Some(u64::MAX));
        assert_eq!(h.output_dtype, Some(DType::F16));
        // Headers written by serde (the Rust client) decode the same.
        let h2 = RequestHeader::new(3, "x", InputKind::Ids);
        let bytes = rmp_serde::to_vec_named(&h2).unwrap();
        assert_eq!(decode_header(&bytes).unwrap(), h2);
        // Small integers in signed encodings are integers too.
        let mut b = map(&base());
        b[0] = 0x84;
        assert!(decode_header(&b).is_ok());
    }

    #[test]
    fn laxer_forms_are_refused_with_reasons() {
        // An array instead of a map.
        #[derive(Serialize)]
        struct Tuple(u32, u64, &'static str, &'static str);
        let arr = rmp_serde::to_vec(&Tuple(1, 7, "m", "texts")).unwrap();
        assert!(err(&arr)
            .message
            .contains("must be a MessagePack map with string keys, got an array"));
        // Integer keys.
        let mut int_keys = BTreeMap::new();
        int_keys.insert(1u32, 2u32);
        let e = err(&rmp_serde::to_vec(&int_keys).unwrap());
        assert!(e.message.contains("keys must be strings"), "{}", e.message);
        assert!(!e.message.contains("expected a MessagePack map"));
        // Trailing bytes.
        let mut t = map(&base());
        t.push(0x01);
        assert_eq!(
            err(&t).message,
            "the header frame has 1 bytes after its map"
        );
        // A duplicate key.
        let mut e = base();
        e.push(("id", U(8)));
        assert_eq!(err(&map(&e)).message, "key `id` appears twice");
        // nil for a present key.
        assert!(err(&with(("timeout_us", Nil)))
            .message
            .contains("`timeout_us` is nil"));
        // Empty input and a truncated value.
        assert!(err(&[]).message.contains("empty"));
        let full = map(&base());
        assert!(err(&full[..full.len() - 2])
            .message
            .contains("ends in the middle"));
    }

    #[test]
    fn wrong_types_name_the_key() {
        let mut e = base();
        e[0] = ("v", s("1"));
        assert_eq!(
            err(&map(&e)).message,
            "`v` must be an unsigned integer, got a string"
        );
        assert_eq!(
            err(&with(("priority", U(300)))).message,
            "`priority` must be an unsigned integer 0-255, got 300"
        );
        assert!(err(&with(("dtype", U(5))))
            .message
            .starts_with("`dtype` must be a dtype name"));
        assert!(err(&with(("dtype", s("f64")))).message.contains("\"f64\""));
        assert!(err(&with(("shape", A(vec![U(1), s("x")]))))
            .message
            .contains("`shape[1]` must be an unsigned integer, got a string"));
        assert!(err(&with(("truncate", U(1))))
            .message
            .contains("`truncate` must be a boolean"));
        assert_eq!(
            err(&with(("prompt_name", U(1)))).message,
            "`prompt_name` must be a string, got an unsigned integer"
        );
        let mut e = base();
        e[3] = ("input", s("pairs"));
        assert_eq!(decode_header(&map(&e)).unwrap().input, InputKind::Pairs);
        let mut b = map(&base());
        // id as a negative int8
        let pos = b.iter().position(|&x| x == 7).unwrap();
        b.splice(pos..pos + 1, [0xd0, 0xff]);
        assert!(
            err(&b).message.contains("negative integer -1"),
            "{}",
            err(&b).message
        );
    }

    #[test]
    fn missing_and_unknown_keys() {
        let e = err(&map(&base()[..3]));
        assert_eq!((e.id, e.message.as_str()), (7, "missing key `input`"));
        let e = err(&with(("timeout_ms", U(5))));
        assert_eq!(e.id, 7, "the id is recovered for the error reply");
        assert!(
            e.message.contains("unknown key \"timeout_ms\""),
            "{}",
            e.message
        );
        // A huge unknown key is echoed cut.
        let long = "k".repeat(1 << 20);
        let mut e = base();
        e.push((Box::leak(long.into_boxed_str()), U(1)));
        let m = err(&map(&e)).message;
        assert!(m.len() < 400 && m.contains('…'), "{} bytes", m.len());
    }

    #[test]
    fn echo_cuts_long_strings() {
        assert_eq!(echo("abc"), "\"abc\"");
        let cut = echo(&"é".repeat(100));
        assert!(cut.ends_with('…') && cut.chars().filter(|&c| c == 'é').count() == ECHO_LIMIT);
    }

    #[test]
    fn hostile_nesting_is_bounded() {
        // An unknown key is refused before its value is read; salvaging the
        // id skips values, bounded: a deeply nested array before `id`.
        let mut b = vec![0x82, 0xa1, b'x'];
        b.extend(std::iter::repeat_n(0x91, 100_000));
        b.push(0x01);
        b.extend([0xa2, b'i', b'd', 0x05]);
        assert_eq!(err(&b).id, 0);
        // Claimed lengths beyond the input are errors, not allocations.
        let e = err(&[0xdf, 0xff, 0xff, 0xff, 0xff]);
        assert!(e.message.contains("ends in the middle"), "{}", e.message);
        let e = err(&[0x81, 0xdb, 0xff, 0xff, 0xff, 0xff]);
        assert!(e.message.contains("ends in the middle"), "{}", e.message);
    }
}
