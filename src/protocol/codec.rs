//! Frames ⇄ protocol values.

use super::header::{decode_header, salvage_version, SUPPORTED_VERSIONS};
use super::sparse::SparseRows;
use super::{
    ErrorCode, InputKind, Payload, ProtocolError, Reply, ReplyHeader, Request, RequestHeader,
    Status, PROTOCOL_VERSION,
};
use crate::tensor::{element_count, DType, HostTensor};
use bytes::Bytes;

/// Size limits applied while decoding, before anything is allocated for a request.
#[derive(Clone, Copy, Debug)]
pub struct DecodeLimits {
    /// All frames together.
    pub max_bytes: usize,
    /// Texts, id sequences or tensor rows per request.
    pub max_items: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_bytes: 64 << 20,
            max_items: 1024,
        }
    }
}

fn bad(id: u64, message: impl Into<String>) -> ProtocolError {
    ProtocolError::new(id, ErrorCode::BadRequest, message)
}

/// Decodes a request from its frames (identity and delimiter already removed).
pub fn decode_request(frames: &[Bytes], limits: &DecodeLimits) -> Result<Request, ProtocolError> {
    let Some((head, payload)) = frames.split_first() else {
        return Err(bad(0, "empty message: expected a header frame"));
    };
    let total: usize = frames.iter().map(Bytes::len).sum();
    let unsupported = |id: u64, v: u64| {
        let supported: Vec<String> = SUPPORTED_VERSIONS.iter().map(u32::to_string).collect();
        bad(
            id,
            format!(
                "unsupported protocol version {v} (supported versions: {})",
                supported.join(", ")
            ),
        )
    };
    let header = decode_header(head).map_err(|e| {
        // A readable, unsupported `v` is reported as such, whatever else
        // is wrong: a newer client's header may carry keys this version
        // does not know.
        match salvage_version(head) {
            Some(v) if !SUPPORTED_VERSIONS.iter().any(|&s| s as u64 == v) => unsupported(e.id, v),
            _ => bad(e.id, format!("malformed header: {}", e.message)),
        }
    })?;
    let id = header.id;
    if !SUPPORTED_VERSIONS.contains(&header.v) {
        return Err(unsupported(id, header.v as u64));
    }
    if total > limits.max_bytes {
        return Err(bad(
            id,
            format!(
                "request is {total} bytes, more than the limit of {}",
                limits.max_bytes
            ),
        ));
    }
    if let Some(dt) = header.output_dtype {
        if !matches!(dt, DType::F32 | DType::F16) {
            return Err(bad(
                id,
                format!("output_dtype {dt} is not supported (f32 or f16)"),
            ));
        }
    }
    let payload = match header.input {
        InputKind::Tensor => decode_tensor(&header, payload)?,
        InputKind::Texts => {
            check_items(id, payload.len(), limits, "texts")?;
            let mut texts = Vec::with_capacity(payload.len());
            for (i, frame) in payload.iter().enumerate() {
                let text = std::str::from_utf8(frame)
                    .map_err(|e| bad(id, format!("text {i} is not valid UTF-8: {e}")))?;
                texts.push(text.to_owned());
            }
            Payload::Texts(texts)
        }
        InputKind::Ids => {
            check_items(id, payload.len(), limits, "id sequences")?;
            let mut seqs = Vec::with_capacity(payload.len());
            for (i, frame) in payload.iter().enumerate() {
                if frame.is_empty() || frame.len() % 4 != 0 {
                    return Err(bad(
                        id,
                        format!(
                            "id sequence {i} is {} bytes: expected a non-empty multiple of 4 (little-endian u32 ids)",
                            frame.len()
                        ),
                    ));
                }
                seqs.push(
                    frame
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                );
            }
            Payload::Ids(seqs)
        }
        InputKind::Pairs => {
            if payload.len() % 2 != 0 {
                return Err(bad(
                    id,
                    format!(
                        "{} payload frames: pairs take two frames each (query, passage)",
                        payload.len()
                    ),
                ));
            }
            check_items(id, payload.len() / 2, limits, "pairs")?;
            let mut pairs = Vec::with_capacity(payload.len() / 2);
            let text = |i: usize, j: usize, frame: &Bytes| -> Result<String, ProtocolError> {
                std::str::from_utf8(frame).map(str::to_owned).map_err(|e| {
                    bad(
                        id,
                        format!(
                            "pair {i}'s {} is not valid UTF-8: {e}",
                            if j == 0 { "query" } else { "passage" }
                        ),
                    )
                })
            };
            for (i, two) in payload.chunks_exact(2).enumerate() {
                pairs.push((text(i, 0, &two[0])?, text(i, 1, &two[1])?));
            }
            Payload::Pairs(pairs)
        }
    };
    Ok(Request { header, payload })
}

fn check_items(id: u64, n: usize, limits: &DecodeLimits, what: &str) -> Result<(), ProtocolError> {
    if n == 0 {
        return Err(bad(
            id,
            format!("no {what}: expected at least one payload frame"),
        ));
    }
    if n > limits.max_items {
        return Err(bad(
            id,
            format!(
                "{n} {what} in one request, more than the limit of {}",
                limits.max_items
            ),
        ));
    }
    Ok(())
}

fn decode_tensor(header: &RequestHeader, payload: &[Bytes]) -> Result<Payload, ProtocolError> {
    let id = header.id;
    let dtype = header
        .dtype
        .ok_or_else(|| bad(id, "input \"tensor\" needs a \"dtype\""))?;
    let shape = header
        .shape
        .as_ref()
        .ok_or_else(|| bad(id, "input \"tensor\" needs a \"shape\""))?;
    let [frame] = payload else {
        return Err(bad(
            id,
            format!(
                "input \"tensor\" takes exactly one payload frame, got {}",
                payload.len()
            ),
        ));
    };
    let shape: Vec<usize> = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(id, "shape dimension too large")))
        .collect::<Result<_, _>>()?;
    if element_count(&shape).is_none() {
        return Err(bad(id, format!("shape {shape:?} is too large")));
    }
    let tensor = HostTensor::new(dtype, shape, frame.clone())
        .map_err(|e| bad(id, format!("payload does not match dtype and shape: {e}")))?;
    Ok(Payload::Tensor(tensor))
}

/// Encodes a reply as frames (header, then the output payload on success).
pub fn encode_reply(reply: &Reply) -> Vec<Bytes> {
    let (header, payload) = match reply {
        Reply::Ok {
            id,
            output,
            sparse,
            bucket,
            device,
            queued_us,
            compute_us,
            total_us,
            batches,
            hops,
        } => (
            ReplyHeader {
                v: PROTOCOL_VERSION,
                id: *id,
                status: Status::Ok,
                code: None,
                message: None,
                dtype: Some(match sparse {
                    // The rows stay f32 until their entries are picked.
                    Some(how) => how.dtype,
                    None => output.dtype,
                }),
                shape: Some(output.shape.iter().map(|&d| d as u64).collect()),
                format: sparse.map(|_| "csr".to_string()),
                bucket: Some(bucket.clone()),
                device: Some(device.clone()),
                batches: Some(*batches),
                queued_us: *queued_us,
                compute_us: *compute_us,
                total_us: *total_us,
                decode_us: Some(hops.decode),
                tokenize_us: Some(hops.tokenize),
                wait_us: Some(hops.wait),
                to_worker_us: Some(hops.to_worker),
                device_us: Some(hops.device),
                back_us: Some(hops.back),
                reply_us: Some(hops.reply),
            },
            match sparse {
                None => vec![output.data.clone()],
                Some(how) => {
                    let width = output.shape.get(1).copied().unwrap_or(0);
                    SparseRows::from_dense(&output.data, width, *how)
                        .to_frames(how.dtype)
                        .to_vec()
                }
            },
        ),
        Reply::Error { id, code, message } => (
            ReplyHeader {
                v: PROTOCOL_VERSION,
                id: *id,
                status: Status::Error,
                code: Some(*code),
                message: Some(message.clone()),
                dtype: None,
                shape: None,
                format: None,
                bucket: None,
                device: None,
                batches: None,
                queued_us: 0,
                compute_us: 0,
                total_us: 0,
                decode_us: None,
                tokenize_us: None,
                wait_us: None,
                to_worker_us: None,
                device_us: None,
                back_us: None,
                reply_us: None,
            },
            Vec::new(),
        ),
    };
    let head = rmp_serde::to_vec_named(&header).expect("reply header always serialises");
    let mut frames = vec![Bytes::from(head)];
    frames.extend(payload);
    frames
}

/// Encodes a request (for clients).
pub fn encode_request(header: &RequestHeader, payload: &Payload) -> Vec<Bytes> {
    let head = rmp_serde::to_vec_named(header).expect("request header always serialises");
    let mut frames = vec![Bytes::from(head)];
    match payload {
        Payload::Tensor(t) => frames.push(t.data.clone()),
        Payload::Texts(texts) => frames.extend(texts.iter().map(|t| Bytes::from(t.clone()))),
        Payload::Ids(seqs) => frames.extend(seqs.iter().map(|s| {
            let mut b = Vec::with_capacity(s.len() * 4);
            s.iter()
                .for_each(|id| b.extend_from_slice(&id.to_le_bytes()));
            Bytes::from(b)
        })),
        Payload::Pairs(pairs) => {
            for (a, b) in pairs {
                frames.push(Bytes::from(a.clone()));
                frames.push(Bytes::from(b.clone()));
            }
        }
    }
    frames
}

/// A successful reply's payload, as a client reads it.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplyData {
    /// One tensor, `shape` of the header.
    Dense(HostTensor),
    /// A sparse model's rows (`format: "csr"`).
    Sparse(SparseRows),
}

impl ReplyData {
    /// The dense tensor, if the reply is one.
    pub fn dense(self) -> Option<HostTensor> {
        match self {
            ReplyData::Dense(t) => Some(t),
            ReplyData::Sparse(_) => None,
        }
    }
}

/// Decodes a reply (for clients): the header, and the output on success.
pub fn decode_reply(frames: &[Bytes]) -> Result<(ReplyHeader, Option<ReplyData>), String> {
    let (head, rest) = frames.split_first().ok_or("empty reply")?;
    let header: ReplyHeader =
        rmp_serde::from_slice(head).map_err(|e| format!("malformed reply header: {e}"))?;
    let data = match (header.status, header.dtype, &header.shape, rest) {
        (Status::Ok, Some(dtype), Some(shape), frames)
            if header.format.as_deref() == Some("csr") =>
        {
            let [rows, width] = shape[..] else {
                return Err(format!(
                    "a sparse reply's shape is [rows, width], got {shape:?}"
                ));
            };
            Some(ReplyData::Sparse(
                SparseRows::from_frames(rows as usize, width as usize, dtype, frames)
                    .map_err(|e| format!("sparse reply payload: {e}"))?,
            ))
        }
        (Status::Ok, _, _, _) if header.format.is_some() => {
            return Err(format!(
                "unknown reply format {:?}",
                header.format.as_deref().unwrap_or_default()
            ))
        }
        (Status::Ok, Some(dtype), Some(shape), [data]) => Some(ReplyData::Dense(
            HostTensor::new(
                dtype,
                shape.iter().map(|&d| d as usize).collect(),
                data.clone(),
            )
            .map_err(|e| format!("reply payload: {e}"))?,
        )),
        (Status::Ok, ..) => return Err("ok reply without dtype, shape and one payload".into()),
        (Status::Error, ..) => None,
    };
    Ok((header, data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Hops;

    fn limits() -> DecodeLimits {
        DecodeLimits {
            max_bytes: 1 << 20,
            max_items: 4,
        }
    }

    #[test]
    fn pairs_take_two_frames_each() {
        let mut header = RequestHeader::new(4, "ce", InputKind::Pairs);
        header.prompt_name = Some("query".into());
        let p = Payload::Pairs(vec![("q".into(), "p1".into()), ("q".into(), "".into())]);
        let frames = encode_request(&header, &p);
        assert_eq!(frames.len(), 5);
        let req = decode_request(&frames, &limits()).unwrap();
        assert_eq!((req.header, req.payload), (header.clone(), p));
        let e = decode_request(&frames[..4], &limits()).unwrap_err();
        assert!(e.message.contains("two frames each"), "{}", e.message);
        let e = decode_request(&frames[..1], &limits()).unwrap_err();
        assert!(e.message.contains("no pairs"), "{}", e.message);
        let mut bad = frames.clone();
        bad[4] = Bytes::from_static(b"\xff");
        let e = decode_request(&bad, &limits()).unwrap_err();
        assert!(e.message.contains("pair 1's passage"), "{}", e.message);
        let five = Payload::Pairs(vec![("a".into(), "b".into()); 5]);
        let e = decode_request(&encode_request(&header, &five), &limits()).unwrap_err();
        assert!(e.message.contains("5 pairs"), "{}", e.message);
    }

    #[test]
    fn tensor_request_round_trips() {
        let mut header = RequestHeader::new(7, "mlp", InputKind::Tensor);
        header.dtype = Some(DType::F32);
        header.shape = Some(vec![2, 2]);
        header.priority = 3;
        let t = HostTensor::from_f32(vec![2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let frames = encode_request(&header, &Payload::Tensor(t.clone()));
        let req = decode_request(&frames, &limits()).unwrap();
        assert_eq!(req.header, header);
        assert_eq!(req.payload, Payload::Tensor(t));
    }

    #[test]
    fn texts_and_ids_round_trip() {
        let header = RequestHeader::new(1, "m", InputKind::Texts);
        let p = Payload::Texts(vec!["héllo".into(), "".into()]);
        let req = decode_request(&encode_request(&header, &p), &limits()).unwrap();
        assert_eq!(req.payload, p);
        let header = RequestHeader::new(2, "m", InputKind::Ids);
        let p = Payload::Ids(vec![vec![101, 102], vec![101, 7, 102]]);
        let req = decode_request(&encode_request(&header, &p), &limits()).unwrap();
        assert_eq!(req.payload, p);
    }

    fn err(frames: Vec<Bytes>) -> ProtocolError {
        decode_request(&frames, &limits()).unwrap_err()
    }

    #[test]
    fn malformed_requests_are_bad_requests_with_reasons() {
        assert!(err(vec![]).message.contains("empty message"));
        let e = err(vec![Bytes::from_static(b"\xc1garbage")]);
        assert_eq!((e.code, e.id), (ErrorCode::BadRequest, 0));
        // An unknown key is named, and the id is still recovered.
        #[derive(serde::Serialize)]
        struct Typo<'a> {
            v: u32,
            id: u64,
            model: &'a str,
            input: &'a str,
            timeout_ms: u64,
        }
        let head = rmp_serde::to_vec_named(&Typo {
            v: 1,
            id: 42,
            model: "m",
            input: "texts",
            timeout_ms: 5,
        })
        .unwrap();
        let e = err(vec![Bytes::from(head), Bytes::from_static(b"x")]);
        assert_eq!(e.id, 42);
        assert!(e.message.contains("timeout_ms"), "{}", e.message);

        let text = |frames: Vec<&'static [u8]>| {
            let mut f = vec![Bytes::from(
                rmp_serde::to_vec_named(&RequestHeader::new(5, "m", InputKind::Texts)).unwrap(),
            )];
            f.extend(frames.into_iter().map(Bytes::from_static));
            f
        };
        assert!(err(text(vec![b"ok", b"\xff\xfe"]))
            .message
            .contains("text 1 is not valid UTF-8"));
        assert!(err(text(vec![])).message.contains("no texts"));
        assert!(err(text(vec![b"a"; 5])).message.contains("limit of 4"));

        let mut h = RequestHeader::new(6, "m", InputKind::Tensor);
        h.dtype = Some(DType::F32);
        h.shape = Some(vec![2, 3]);
        let head = Bytes::from(rmp_serde::to_vec_named(&h).unwrap());
        let e = err(vec![head.clone(), Bytes::from(vec![0u8; 20])]);
        assert!(
            e.message.contains("needs 24 bytes, got 20"),
            "{}",
            e.message
        );
        let e = err(vec![head.clone()]);
        assert!(
            e.message.contains("exactly one payload frame"),
            "{}",
            e.message
        );

        let mut h = RequestHeader::new(8, "m", InputKind::Ids);
        h.v = 2;
        let e = err(vec![
            Bytes::from(rmp_serde::to_vec_named(&h).unwrap()),
            Bytes::from_static(b"\0\0\0\0"),
        ]);
        assert!(e.message.contains("version 2"), "{}", e.message);
        // A version-2 header with a key version 1 does not know: still the
        // version message (with the id), not the key's.
        #[derive(serde::Serialize)]
        struct V2<'a> {
            v: u32,
            id: u64,
            model: &'a str,
            input: &'a str,
            colour: &'a str,
        }
        let head = rmp_serde::to_vec_named(&V2 {
            v: 2,
            id: 11,
            model: "m",
            input: "texts",
            colour: "red",
        })
        .unwrap();
        let e = err(vec![Bytes::from(head), Bytes::from_static(b"x")]);
        assert_eq!(
            (e.id, e.message.as_str()),
            (11, "unsupported protocol version 2 (supported versions: 1)")
        );
        let h = RequestHeader::new(9, "m", InputKind::Ids);
        let e = err(vec![
            Bytes::from(rmp_serde::to_vec_named(&h).unwrap()),
            Bytes::from_static(b"\0\0\0"),
        ]);
        assert!(e.message.contains("multiple of 4"), "{}", e.message);
    }

    #[test]
    fn req_delimiters_are_split_off_and_lone_empty_frames_are_messages() {
        use crate::protocol::split_delimiter;
        let b = |s: &'static [u8]| Bytes::from_static(s);
        let plain = [b(b"h"), b(b"p")];
        assert_eq!(split_delimiter(&plain), (None, &plain[..]));
        let req = [b(b""), b(b"h")];
        assert_eq!(split_delimiter(&req), (Some(b(b"")), &req[1..]));
        // A lone empty frame is an empty message, not a delimiter.
        let empty = [b(b"")];
        assert_eq!(split_delimiter(&empty), (None, &empty[..]));
        assert_eq!(split_delimiter(&[]), (None, &[][..]));
    }

    #[test]
    fn replies_round_trip() {
        let out = HostTensor::from_f32(vec![1, 2], &[0.5, -0.5]);
        let reply = Reply::Ok {
            id: 3,
            output: out.clone(),
            sparse: None,
            bucket: "8x16".into(),
            device: "cpu:0".into(),
            queued_us: 10,
            compute_us: 20,
            total_us: 40,
            batches: 2,
            hops: Hops {
                decode: 1,
                tokenize: 2,
                wait: 3,
                to_worker: 4,
                device: 20,
                back: 5,
                reply: 5,
            },
        };
        let (h, t) = decode_reply(&encode_reply(&reply)).unwrap();
        let hops = Hops::from_header(&h).unwrap();
        assert_eq!(hops.values(), [1, 2, 3, 4, 20, 5, 5]);
        assert_eq!(hops.values().iter().sum::<u64>(), h.total_us);
        assert_eq!(
            (h.id, h.status, h.bucket.as_deref()),
            (3, Status::Ok, Some("8x16"))
        );
        assert_eq!(h.batches, Some(2));
        assert_eq!(t.unwrap(), ReplyData::Dense(out));
        let (h, t) =
            decode_reply(&encode_reply(&Reply::error(4, ErrorCode::TooLong, "long"))).unwrap();
        assert_eq!(
            (h.code, h.message.as_deref(), t),
            (Some(ErrorCode::TooLong), Some("long"), None)
        );
        assert_eq!(Hops::from_header(&h), None);
    }

    /// A sparse model's rows go out as CSR frames, values in the asked dtype.
    #[test]
    fn sparse_replies_round_trip() {
        let dense = HostTensor::from_f32(vec![2, 4], &[0.0, 2.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0]);
        for (top_k, dtype, want) in [
            (
                None,
                DType::F32,
                vec![vec![(1, 2.0), (3, 0.5)], vec![(0, 1.0)]],
            ),
            (Some(1), DType::F16, vec![vec![(1, 2.0)], vec![(0, 1.0)]]),
        ] {
            let reply = Reply::Ok {
                id: 5,
                output: dense.clone(),
                sparse: Some(crate::protocol::Sparsify { top_k, dtype }),
                bucket: "64t".into(),
                device: "cpu:0".into(),
                queued_us: 0,
                compute_us: 0,
                total_us: 0,
                batches: 1,
                hops: Hops::default(),
            };
            let frames = encode_reply(&reply);
            assert_eq!(frames.len(), 4);
            let (h, data) = decode_reply(&frames).unwrap();
            assert_eq!((h.format.as_deref(), h.dtype), (Some("csr"), Some(dtype)));
            assert_eq!(h.shape, Some(vec![2, 4]));
            let Some(ReplyData::Sparse(rows)) = data else {
                panic!("not sparse: {data:?}")
            };
            for (r, entries) in want.iter().enumerate() {
                let (idx, val) = rows.row(r);
                let got: Vec<(u32, f32)> = idx.iter().copied().zip(val.iter().copied()).collect();
                assert_eq!(&got, entries);
            }
        }
    }

    /// A client of an older daemon (no hop keys) and an older client (which
    /// ignores keys it does not know) both still read replies.
    #[test]
    fn reply_hop_keys_are_optional_and_ignorable() {
        #[derive(serde::Deserialize)]
        struct OldHeader {
            id: u64,
            total_us: u64,
        }
        let reply = Reply::Ok {
            id: 9,
            output: HostTensor::from_f32(vec![1, 1], &[1.0]),
            sparse: None,
            bucket: "64t".into(),
            device: "cpu:0".into(),
            queued_us: 1,
            compute_us: 2,
            total_us: 3,
            batches: 1,
            hops: Hops::default(),
        };
        let frames = encode_reply(&reply);
        let old: OldHeader = rmp_serde::from_slice(&frames[0]).unwrap();
        assert_eq!((old.id, old.total_us), (9, 3));
        let bare = rmp_serde::to_vec_named(&serde_json::json!({
            "v": 1, "id": 2, "status": "error", "code": "internal", "message": "x"
        }))
        .unwrap();
        let (h, _) = decode_reply(&[Bytes::from(bare)]).unwrap();
        assert_eq!((h.id, h.decode_us), (2, None));
    }
}
