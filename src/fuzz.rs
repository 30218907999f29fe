//! Entry points for the fuzz targets in `fuzz/` (and for replaying their
//! corpora as ordinary tests): each takes arbitrary bytes, feeds them to one
//! decoder the outside world reaches, and checks what must hold whatever
//! the input — it never panics, errors say something, and what decodes
//! round-trips.

use crate::protocol::{decode_request, encode_request, DecodeLimits, ErrorCode};
use bytes::Bytes;

/// Splits fuzz input into multipart frames: the first byte is the frame
/// count (1–8), then each frame is a little-endian u16 length and its bytes
/// (cut short at the end of the input).
pub fn frames(data: &[u8]) -> Vec<Bytes> {
    let Some((&count, mut rest)) = data.split_first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for _ in 0..(count % 8) + 1 {
        if rest.len() < 2 {
            break;
        }
        let len = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        out.push(Bytes::copy_from_slice(&rest[2..2 + len]));
        rest = &rest[2 + len..];
    }
    out
}

/// The client protocol's request decoder.
pub fn protocol_request(data: &[u8]) {
    let limits = DecodeLimits {
        max_bytes: 1 << 16,
        max_items: 16,
    };
    match decode_request(&frames(data), &limits) {
        Ok(req) => {
            let again = decode_request(&encode_request(&req.header, &req.payload), &limits)
                .expect("a decoded request re-encodes to a valid one");
            assert_eq!(again, req);
        }
        Err(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(!e.message.is_empty());
            assert!(e.message.len() < 2048, "error messages stay short");
        }
    }
}

/// The worker link's decoders, both directions.
pub fn worker_link(data: &[u8]) {
    use crate::worker::link::{decode, rows_from_frames, FromWorker, ToWorker};
    let frames = frames(data);
    if let Ok((ToWorker::Run { layout, .. }, rows)) = decode::<ToWorker>(&frames) {
        let _ = rows_from_frames(&layout, rows);
    }
    let _ = decode::<FromWorker>(&frames);
}

/// The configuration parser.
pub fn config_text(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = crate::config::Config::parse(text) {
            assert!(!e.to_string().is_empty());
        }
    }
}

/// The tokenizer front: arbitrary UTF-8 through a model's tokenizer, with
/// and without truncation. The ids (or the error) must be the HF
/// tokenizer's alone ([`TextTokenizer::encode_reference`]), for the text and
/// for its bytes masked to ASCII (so that the fast path of
/// [`crate::model::wordpiece`] sees most inputs, not only the ASCII ones):
/// a mismatch is a crash.
///
/// [`TextTokenizer::encode_reference`]: crate::daemon::tokenize::TextTokenizer::encode_reference
pub fn tokenizer_text(tokenizer: &crate::daemon::tokenize::TextTokenizer, data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let ascii: String = data.iter().map(|&b| (b & 0x7f) as char).collect();
    for t in [text.as_ref(), ascii.as_str()] {
        for truncate in [true, false] {
            assert_eq!(
                tokenizer.encode(&[t], truncate),
                tokenizer.encode_reference(&[t], truncate),
                "fast path and HF differ on {t:?} (truncate {truncate})"
            );
        }
    }
    let max = tokenizer.max_seq_len();
    match tokenizer.encode(&[text.as_ref()], true) {
        Ok(ids) => {
            assert_eq!(ids.len(), 1);
            assert!(ids[0].len() <= max, "truncation holds");
            assert!(ids[0]
                .iter()
                .all(|&id| (id as usize) < tokenizer.vocab_size()));
        }
        Err(e) => panic!("truncating encode failed: {e}"),
    }
    let _ = tokenizer.encode(&[text.as_ref()], false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{InputKind, Payload, RequestHeader};
    use crate::tensor::{DType, HostTensor};
    use std::path::{Path, PathBuf};

    fn corpus_dir(target: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target)
    }

    /// Frames in the layout [`frames`] reads.
    fn pack(frames: &[Bytes]) -> Vec<u8> {
        let mut out = vec![(frames.len() - 1) as u8];
        for f in frames {
            out.extend_from_slice(&(f.len() as u16).to_le_bytes());
            out.extend_from_slice(f);
        }
        out
    }

    fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut t = RequestHeader::new(1, "mlp", InputKind::Tensor);
        t.dtype = Some(DType::F32);
        t.shape = Some(vec![1, 2]);
        let tensor = Payload::Tensor(HostTensor::from_f32(vec![1, 2], &[0.5, -1.0]));
        out.push((
            "protocol_decode",
            "tensor".into(),
            pack(&encode_request(&t, &tensor)),
        ));
        let texts = Payload::Texts(vec!["a sentence".into(), String::new()]);
        let mut h = RequestHeader::new(2, "minilm", InputKind::Texts);
        h.priority = 3;
        h.timeout_us = Some(1000);
        out.push((
            "protocol_decode",
            "texts".into(),
            pack(&encode_request(&h, &texts)),
        ));
        let ids = Payload::Ids(vec![vec![101, 7592, 102]]);
        let h = RequestHeader::new(3, "minilm", InputKind::Ids);
        out.push((
            "protocol_decode",
            "ids".into(),
            pack(&encode_request(&h, &ids)),
        ));
        let run = crate::worker::link::encode_run(
            5,
            1,
            0,
            Some(crate::bucket::Bucket::new(2, 16)),
            [&crate::model::BatchRows::Tokens(vec![
                vec![101, 102],
                vec![101, 5, 102],
            ])],
        );
        out.push(("link_decode", "run_tokens".into(), pack(&run)));
        let done = crate::worker::link::encode(
            &crate::worker::link::FromWorker::Heartbeat,
            std::iter::empty(),
        );
        out.push(("link_decode", "heartbeat".into(), pack(&done)));
        out.push((
            "config_parse",
            "default".into(),
            include_bytes!("../config/replayd.toml").to_vec(),
        ));
        out.push((
            "tokenizer_front",
            "text".into(),
            "Replay the graph, not the kernels. é 漢字 🙂".into(),
        ));
        out
    }

    /// Writes the seed corpora (run by hand after a format change:
    /// `cargo test --lib write_fuzz_seeds -- --ignored`).
    #[test]
    #[ignore]
    fn write_fuzz_seeds() {
        for (target, name, bytes) in seeds() {
            let dir = corpus_dir(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
        }
    }

    /// Every committed corpus entry (seeds, and any input a fuzzer found and
    /// we fixed) runs through its entry point without panicking.
    #[test]
    fn fuzz_corpora_replay_cleanly() {
        let mut n = 0;
        for target in ["protocol_decode", "link_decode", "config_parse"] {
            let Ok(entries) = std::fs::read_dir(corpus_dir(target)) else {
                continue;
            };
            for e in entries {
                let data = std::fs::read(e.unwrap().path()).unwrap();
                match target {
                    "protocol_decode" => protocol_request(&data),
                    "link_decode" => worker_link(&data),
                    _ => config_text(&data),
                }
                n += 1;
            }
        }
        assert!(n >= 6, "the seed corpora are committed ({n} entries)");
        // The seeds decode (they are valid messages, not just bytes).
        for (target, _, bytes) in seeds() {
            if target == "protocol_decode" {
                let limits = DecodeLimits::default();
                decode_request(&frames(&bytes), &limits).unwrap();
            }
        }
    }
}
