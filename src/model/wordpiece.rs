//! A fast path for BERT-family WordPiece tokenizers on ASCII text.
//!
//! Why: under load the `tokenizers` crate is the daemon's largest CPU
//! consumer. For a short text it spends most of its time on Unicode category
//! look-ups, offset bookkeeping and small allocations (every normalizer
//! step, pre-token and sub-word is its own `String`), none of which changes
//! the ids of plain ASCII text. [`FastWordPiece`] computes the same ids with
//! byte tables and one hash look-up per candidate piece, without allocating
//! per text beyond the output.
//!
//! When: [`FastWordPiece::new`] decides once, at load, from the *built*
//! tokenizer's components (what [`crate::model::tokenizer::build`] or the
//! file produced), and refuses anything it does not reproduce exactly:
//!
//! * normalizer: `BertNormalizer` with `clean_text: true` (any
//!   `handle_chinese_chars` / `strip_accents`, which do nothing to ASCII),
//!   optionally in a `Sequence` with `Lowercase` (sentence-transformers'
//!   `do_lower_case`);
//! * pre-tokenizer: `BertPreTokenizer`;
//! * model: `WordPiece` whose unknown token is in its vocabulary;
//! * post-processor: none, `BertProcessing`, or a `TemplateProcessing`
//!   whose single template is special tokens, `$A`, special tokens, all of
//!   type 0;
//! * and a few probe texts encode to the same ids both ways.
//!
//! So BERT and MiniLM folders get it; XLM-R (Unigram, Metaspace), MPNet
//! (`RobertaProcessing`) and anything unusual stay on the HF tokenizer.
//!
//! Per text, [`FastWordPiece::tokenize`] handles only pure-ASCII text that
//! cannot contain an added token: a text with a non-ASCII byte, or with any
//! byte that could begin an added-token match (the first character of each
//! added token's content, and for `normalized` tokens every byte that
//! normalizes to the first character of the normalized content — `[` for
//! BERT's `[CLS]`, `[SEP]`, `[MASK]`…), returns `false` and the caller
//! uses the HF tokenizer for that text. For the rest, the semantics are
//! those of the HF components restricted to ASCII:
//!
//! * `clean_text` drops `\0` and the other control characters (category
//!   Cc: 0x00–0x1F and 0x7F, except `\t` `\n` `\r`, which become spaces);
//! * `lowercase` lowers `A`–`Z`;
//! * `BertPreTokenizer` splits on whitespace and makes each punctuation
//!   character (ASCII 33–47, 58–64, 91–96, 123–126) a word of its own;
//! * `WordPiece`: a word longer than `max_input_chars_per_word` is the
//!   unknown token; otherwise greedy longest-match-first, pieces after the
//!   first looked up with `continuing_subword_prefix`; a word with a
//!   position where nothing matches is one unknown token.
//!
//! Special tokens and truncation are the caller's
//! ([`crate::daemon::tokenize::TextTokenizer`] adds [`FastWordPiece::prefix`]
//! and [`FastWordPiece::suffix`] around the ids and truncates as the HF
//! path does). The tests below and `replayd::fuzz::tokenizer_text` check the
//! result id for id against the HF tokenizer.

use serde_json::Value;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use tokenizers::{ModelWrapper, NormalizedString, Normalizer, Tokenizer};

/// FxHash (rustc's hasher) over bytes: the keys are short and trusted (the
/// vocabulary), so a fast non-keyed hash is right here.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, mut bytes: &[u8]) {
        while bytes.len() >= 8 {
            self.add(u64::from_le_bytes(bytes[..8].try_into().unwrap()));
            bytes = &bytes[8..];
        }
        if bytes.len() >= 4 {
            self.add(u32::from_le_bytes(bytes[..4].try_into().unwrap()) as u64);
            bytes = &bytes[4..];
        }
        for &b in bytes {
            self.add(b as u64);
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_u128(&mut self, n: u128) {
        self.add(n as u64);
        self.add((n >> 64) as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // As rustc-hash 2 does: the multiply leaves the high bits best
        // mixed, and hashbrown picks buckets with the low ones.
        self.0.rotate_left(26)
    }
}

type Fx = BuildHasherDefault<FxHasher>;

/// Vocabulary pieces by their bytes. Pieces of up to 16 bytes (nearly all)
/// are keyed by the bytes themselves, zero-padded (no word holds a zero
/// byte: `clean_text` drops it), so a look-up reads one table slot and no
/// key on the heap: up to 8 bytes (three pieces in four) in a `u64`, whose
/// table takes half the memory of the `u128` one (16 bytes a slot, not 32),
/// since a look-up's time is mostly that slot's cache miss.
#[derive(Clone, Default)]
struct Pieces {
    short8: HashMap<u64, u32, Fx>,
    short16: HashMap<u128, u32, Fx>,
    long: HashMap<Box<[u8]>, u32, Fx>,
    /// The longest key (no look-up is longer).
    max: usize,
}

#[inline]
fn pack8(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b[..key.len()].copy_from_slice(key);
    u64::from_le_bytes(b)
}

#[inline]
fn pack16(key: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    b[..key.len()].copy_from_slice(key);
    u128::from_le_bytes(b)
}

impl Pieces {
    fn insert(&mut self, key: &[u8], id: u32) {
        if key.contains(&0) {
            return; // never matches a word
        }
        self.max = self.max.max(key.len());
        match key.len() {
            0..=8 => self.short8.insert(pack8(key), id),
            9..=16 => self.short16.insert(pack16(key), id),
            _ => self.long.insert(key.into(), id),
        };
    }

    #[inline]
    fn get(&self, key: &[u8]) -> Option<u32> {
        match key.len() {
            0..=8 => self.short8.get(&pack8(key)),
            9..=16 => self.short16.get(&pack16(key)),
            _ => self.long.get(key),
        }
        .copied()
    }

    fn len(&self) -> usize {
        self.short8.len() + self.short16.len() + self.long.len()
    }
}

/// What [`FastWordPiece`] does with each ASCII byte of a text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// Could start an added token: the whole text goes to HF.
    Fallback,
    /// Removed by `clean_text`.
    Drop,
    /// Whitespace: ends a word.
    Space,
    /// BERT punctuation: a word of its own.
    Punct,
    /// Part of a word, as this byte (lowercased where the normalizer does).
    Word(u8),
}

/// [`FastWordPiece::normalized`]'s entry for a byte `clean_text` removes.
const DROPPED: u8 = 0;
/// [`FastWordPiece::normalized`]'s entry for a byte that sends the text to
/// the HF tokenizer (non-ASCII, or a possible added token's first byte).
const FALLBACK: u8 = 0xff;
/// [`FastWordPiece::boundary`]'s entries.
const IN_WORD: u8 = 0;
const SPACE: u8 = 1;
const PUNCT: u8 = 2;

/// The fast tokenizer; see the module docs.
#[derive(Clone)]
pub struct FastWordPiece {
    /// What each byte is (a [`Class`]) as one byte per input byte, so the normalizing loop has no
    /// branch per byte: the byte it becomes (a space for whitespace, the
    /// lowercased letter…), [`DROPPED`] or [`FALLBACK`]. Measured: the
    /// `match` on [`Class`] per byte was 40 % of `tokenize`'s time on
    /// corpus-like texts (an indirect jump per byte, mispredicted at every
    /// word boundary).
    normalized: [u8; 256],
    /// What a normalized byte is to the pre-tokenizer: [`IN_WORD`],
    /// [`SPACE`] or [`PUNCT`].
    boundary: [u8; 256],
    /// Pieces that start a word (the whole vocabulary's ASCII entries).
    initial: Pieces,
    /// Pieces after the first, keyed without `continuing_subword_prefix`.
    continuing: Pieces,
    unk: u32,
    max_chars: usize,
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

impl std::fmt::Debug for FastWordPiece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastWordPiece")
            .field("pieces", &(self.initial.len() + self.continuing.len()))
            .field("unk", &self.unk)
            .field("prefix", &self.prefix)
            .field("suffix", &self.suffix)
            .finish()
    }
}

/// Whether a normalizer is one the fast path reproduces on ASCII, and if
/// so whether it lowercases.
fn normalizer_lowercases(n: &Value) -> Result<bool, String> {
    let bert = |n: &Value| -> Result<bool, String> {
        if n.get("clean_text") != Some(&Value::Bool(true)) {
            return Err(format!("BertNormalizer without clean_text: {n}"));
        }
        n.get("lowercase")
            .and_then(Value::as_bool)
            .ok_or_else(|| format!("BertNormalizer without lowercase: {n}"))
    };
    match n.get("type").and_then(Value::as_str) {
        Some("BertNormalizer") => bert(n),
        Some("Sequence") => {
            let list = n
                .get("normalizers")
                .and_then(Value::as_array)
                .ok_or("a normalizer Sequence without normalizers")?;
            let mut lower = false;
            let mut berts = 0;
            for m in list {
                match m.get("type").and_then(Value::as_str) {
                    Some("Lowercase") => lower = true,
                    Some("BertNormalizer") => {
                        berts += 1;
                        lower |= bert(m)?;
                    }
                    _ => return Err(format!("normalizer {m} in a Sequence")),
                }
            }
            if berts != 1 {
                return Err(format!(
                    "a normalizer Sequence with {berts} BertNormalizers"
                ));
            }
            Ok(lower)
        }
        _ => Err(format!("normalizer {n}")),
    }
}

/// The single-sequence template as (prefix, suffix) special-token ids.
fn single_template(p: &Value) -> Result<(Vec<u32>, Vec<u32>), String> {
    let id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match p.get("type").and_then(Value::as_str) {
        None if p.is_null() => Ok((Vec::new(), Vec::new())),
        Some("BertProcessing") => {
            let cls = p.get("cls").and_then(|c| c.get(1)).and_then(id);
            let sep = p.get("sep").and_then(|c| c.get(1)).and_then(id);
            match (cls, sep) {
                (Some(c), Some(s)) => Ok((vec![c], vec![s])),
                _ => Err(format!("post-processor {p}")),
            }
        }
        Some("TemplateProcessing") => {
            let specials = p.get("special_tokens").ok_or("no special_tokens")?;
            let pieces = p
                .get("single")
                .and_then(Value::as_array)
                .ok_or("no single template")?;
            let (mut prefix, mut suffix) = (Vec::new(), Vec::new());
            let mut seen_a = false;
            for piece in pieces {
                if let Some(s) = piece.get("SpecialToken") {
                    if s.get("type_id").and_then(Value::as_u64) != Some(0) {
                        return Err(format!("template piece {piece} is not of type 0"));
                    }
                    let name = s.get("id").and_then(Value::as_str).ok_or("special id")?;
                    let ids = specials
                        .get(name)
                        .and_then(|t| t.get("ids"))
                        .and_then(Value::as_array)
                        .ok_or_else(|| format!("special token {name:?} has no ids"))?;
                    for i in ids {
                        let i = id(i).ok_or_else(|| format!("special token id {i}"))?;
                        if seen_a { &mut suffix } else { &mut prefix }.push(i);
                    }
                } else if let Some(s) = piece.get("Sequence") {
                    if seen_a
                        || s.get("id").and_then(Value::as_str) != Some("A")
                        || s.get("type_id").and_then(Value::as_u64) != Some(0)
                    {
                        return Err(format!("template piece {piece}"));
                    }
                    seen_a = true;
                } else {
                    return Err(format!("template piece {piece}"));
                }
            }
            if !seen_a {
                return Err("a single template without $A".into());
            }
            Ok((prefix, suffix))
        }
        _ => Err(format!("post-processor {p}")),
    }
}

/// The bytes `clean_text` removes: control characters (Cc) other than the
/// three that count as whitespace.
fn is_dropped(b: u8) -> bool {
    (b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r')) || b == 0x7f
}

/// BertPreTokenizer's punctuation, on ASCII.
fn is_punct(b: u8) -> bool {
    b.is_ascii_punctuation()
}

impl FastWordPiece {
    /// The fast path for `tokenizer`, or why it has none (see the module
    /// docs). Truncation and padding settings of `tokenizer` are ignored
    /// (the caller does its own).
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        // A part of the pipeline as JSON (Null where the tokenizer has none).
        let json = |v: Option<serde_json::Result<Value>>| {
            v.transpose()
                .map(|v| v.unwrap_or(Value::Null))
                .map_err(|e| e.to_string())
        };
        let normalizer = json(tokenizer.get_normalizer().map(serde_json::to_value))?;
        let lowercase = normalizer_lowercases(&normalizer)?;
        let pre = json(tokenizer.get_pre_tokenizer().map(serde_json::to_value))?;
        if pre.get("type").and_then(Value::as_str) != Some("BertPreTokenizer") {
            return Err(format!("pre-tokenizer {pre}"));
        }
        let post = json(tokenizer.get_post_processor().map(serde_json::to_value))?;
        let (prefix, suffix) = single_template(&post)?;
        let ModelWrapper::WordPiece(wp) = tokenizer.get_model() else {
            return Err("the model is not WordPiece".into());
        };
        let vocab = tokenizers::Model::get_vocab(wp);
        let unk = *vocab.get(&wp.unk_token).ok_or_else(|| {
            format!(
                "the unknown token {:?} is not in the vocabulary",
                wp.unk_token
            )
        })?;
        let cont = wp.continuing_subword_prefix.as_str();
        let (mut initial, mut continuing) = (Pieces::default(), Pieces::default());
        for (piece, &id) in &vocab {
            // Non-ASCII pieces never match an ASCII word.
            if piece.is_ascii() {
                initial.insert(piece.as_bytes(), id);
            }
            if let Some(rest) = piece.strip_prefix(cont) {
                if rest.is_ascii() && !rest.is_empty() {
                    continuing.insert(rest.as_bytes(), id);
                }
            }
        }

        // The byte table: normalizer, pre-tokenizer.
        let mut class = [Class::Drop; 128];
        for (b, c) in class.iter_mut().enumerate() {
            let b = b as u8;
            *c = if is_dropped(b) {
                Class::Drop
            } else if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                Class::Space
            } else if is_punct(b) {
                Class::Punct
            } else if lowercase {
                Class::Word(b.to_ascii_lowercase())
            } else {
                Class::Word(b)
            };
        }
        // What each byte is after normalization (None: removed).
        let normalized = |b: u8| match class[b as usize] {
            Class::Drop => None,
            Class::Space => Some(b' '),
            Class::Word(m) => Some(m),
            _ => Some(b),
        };
        // Added tokens: every byte that could begin a match sends the text
        // to HF. Non-normalized tokens match the raw text; normalized ones
        // the normalized text, against their normalized content.
        let mut trigger = [false; 128];
        for token in tokenizer.get_added_tokens_decoder().values() {
            let raw = token.content.as_bytes();
            let Some(&first) = raw.first() else {
                return Err("an added token with empty content".into());
            };
            if first.is_ascii() {
                trigger[first as usize] = true;
            }
            if token.normalized {
                let mut s = NormalizedString::from(token.content.as_str());
                if let Some(n) = tokenizer.get_normalizer() {
                    n.normalize(&mut s).map_err(|e| e.to_string())?;
                }
                let Some(&nfirst) = s.get().as_bytes().first() else {
                    return Err(format!(
                        "the added token {:?} normalizes to nothing",
                        token.content
                    ));
                };
                for b in 0..128u8 {
                    if normalized(b) == Some(nfirst) {
                        trigger[b as usize] = true;
                    }
                }
            }
        }
        for (b, c) in class.iter_mut().enumerate() {
            if trigger[b] {
                *c = Class::Fallback;
            }
        }

        let mut normalized = [FALLBACK; 256];
        let mut boundary = [IN_WORD; 256];
        for (b, c) in class.iter().enumerate() {
            normalized[b] = match *c {
                Class::Fallback => FALLBACK,
                Class::Drop => DROPPED,
                Class::Space => b' ',
                Class::Punct => b as u8,
                Class::Word(m) => m,
            };
            boundary[b] = match *c {
                Class::Space => SPACE,
                Class::Punct => PUNCT,
                _ => IN_WORD,
            };
        }
        // A word byte is never 0 (dropped) nor 0xff (not ASCII), so the
        // markers cannot be taken for one.
        debug_assert!(class
            .iter()
            .all(|c| !matches!(c, Class::Word(m) if *m == DROPPED || *m == FALLBACK)));
        let fast = FastWordPiece {
            normalized,
            boundary,
            initial,
            continuing,
            unk,
            max_chars: wp.max_input_chars_per_word,
            prefix,
            suffix,
        };
        fast.self_check(tokenizer)?;
        Ok(fast)
    }

    /// A few probe texts must give the HF tokenizer's ids (a last guard
    /// against a component setting the checks above do not know).
    fn self_check(&self, tokenizer: &Tokenizer) -> Result<(), String> {
        let long = "a".repeat(self.max_chars.saturating_add(1).min(4096));
        for probe in [
            "",
            "Hello, World! The quick brown fox.",
            "unaffable xyzzyqq (tokenizers) 42 ... a-b",
            "\tTabs\r\nand\u{7}bells",
            long.as_str(),
        ] {
            let mut ids = Vec::new();
            let mut buf = Vec::new();
            if !self.tokenize(probe, usize::MAX, &mut buf, &mut ids) {
                continue;
            }
            let mut fast = self.prefix.clone();
            fast.extend_from_slice(&ids);
            fast.extend_from_slice(&self.suffix);
            let hf = tokenizer
                .encode_fast(probe, true)
                .map_err(|e| format!("probe {probe:?}: {e}"))?;
            if hf.get_ids() != fast {
                return Err(format!(
                    "probe {probe:?}: the fast path gives {fast:?}, the tokenizer {:?}",
                    hf.get_ids()
                ));
            }
        }
        Ok(())
    }

    /// Special-token ids before a single text's ids.
    pub fn prefix(&self) -> &[u32] {
        &self.prefix
    }

    /// Special-token ids after a single text's ids.
    pub fn suffix(&self) -> &[u32] {
        &self.suffix
    }

    /// Appends the ids of `text` (no special tokens) to `out`, stopping
    /// after the first word that brings `out` to `budget` ids or more
    /// (`out` is then cut to `budget`; `usize::MAX`: all of them).
    /// `buf` is scratch space, reused between calls. Returns `false`, with
    /// `out` unchanged, when the text needs the HF tokenizer (see the
    /// module docs).
    pub fn tokenize(
        &self,
        text: &str,
        budget: usize,
        buf: &mut Vec<u8>,
        out: &mut Vec<u32>,
    ) -> bool {
        // Normalize: each byte becomes its normalized byte, or is dropped;
        // a fallback byte anywhere sends the text to HF. No branch per byte.
        let raw = text.as_bytes();
        buf.clear();
        buf.resize(raw.len(), 0);
        let mut n = 0;
        let mut fallback = false;
        for &b in raw {
            let m = self.normalized[b as usize];
            if let Some(slot) = buf.get_mut(n) {
                *slot = m;
            }
            n += usize::from(m != DROPPED);
            fallback |= m == FALLBACK;
        }
        if fallback {
            return false;
        }
        buf.truncate(n);
        let start_len = out.len();
        let limit = start_len.saturating_add(budget);
        let bytes = buf.as_slice();
        let mut i = 0;
        while i < bytes.len() {
            let end = match self.boundary[bytes[i] as usize] {
                SPACE => {
                    i += 1;
                    continue;
                }
                PUNCT => i + 1,
                _ => {
                    let mut j = i + 1;
                    while j < bytes.len() && self.boundary[bytes[j] as usize] == IN_WORD {
                        j += 1;
                    }
                    j
                }
            };
            self.word(&bytes[i..end], out);
            i = end;
            if out.len() >= limit {
                out.truncate(limit);
                break;
            }
        }
        true
    }

    /// WordPiece on one pre-token.
    #[inline]
    fn word(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.len() > self.max_chars {
            out.push(self.unk);
            return;
        }
        let mark = out.len();
        let mut start = 0;
        while start < word.len() {
            let map = if start == 0 {
                &self.initial
            } else {
                &self.continuing
            };
            let mut end = word.len().min(start + map.max);
            loop {
                if end <= start {
                    out.truncate(mark);
                    out.push(self.unk);
                    return;
                }
                if let Some(id) = map.get(&word[start..end]) {
                    out.push(id);
                    break;
                }
                end -= 1;
            }
            start = end;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    pub(crate) fn minilm_tokenizer() -> Tokenizer {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2/tokenizer.json");
        assert!(
            path.is_file(),
            "{} is missing: run scripts/dev/fetch-model.sh",
            path.display()
        );
        let mut t = Tokenizer::from_file(&path).unwrap();
        t.with_padding(None);
        t.with_truncation(None).unwrap();
        t
    }

    fn models() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models")
    }

    fn fast_ids(f: &FastWordPiece, text: &str) -> Option<Vec<u32>> {
        let (mut buf, mut ids) = (Vec::new(), f.prefix.clone());
        if !f.tokenize(text, usize::MAX, &mut buf, &mut ids) {
            return None;
        }
        ids.extend_from_slice(&f.suffix);
        Some(ids)
    }

    #[test]
    fn minilm_is_eligible_with_its_specials() {
        let f = FastWordPiece::new(&minilm_tokenizer()).unwrap();
        assert_eq!((f.prefix(), f.suffix()), (&[101][..], &[102][..]));
        assert_eq!(f.unk, 100);
        assert_eq!(
            fast_ids(&f, "Hello, world!").unwrap(),
            vec![101, 7592, 1010, 2088, 999, 102]
        );
        // `[` may begin an added token: HF decides.
        assert_eq!(fast_ids(&f, "a [CLS] b"), None);
        assert_eq!(fast_ids(&f, "a ["), None);
        assert_eq!(fast_ids(&f, "café"), None);
    }

    /// Which folders of tests/data/models get the fast path, built as the
    /// daemon builds them.
    #[test]
    fn eligibility_by_folder() {
        use crate::model::{inspect, ModelKind, ModelSpec};
        for (name, eligible) in [
            ("bert-st-new", true),
            ("bert-st-old", true),
            ("bert-cross-encoder", true),
            ("mpnet-st", false),
            ("xlmr-st", false),
            ("xlmr-cross-encoder", false),
        ] {
            let spec = ModelSpec::new(name, ModelKind::Bert, models().join(name));
            let info = inspect(&spec).unwrap();
            let (tok, _) =
                crate::model::tokenizer::build(info.tokenizer.as_ref().unwrap()).unwrap();
            let got = FastWordPiece::new(&tok);
            assert_eq!(got.is_ok(), eligible, "{name}: {got:?}");
        }
    }

    #[test]
    fn unusual_components_are_refused() {
        let base = minilm_tokenizer();
        let file: Value = serde_json::from_str(&base.to_string(false).unwrap()).unwrap();
        let refused = |edit: &dyn Fn(&mut Value)| {
            let mut f = file.clone();
            edit(&mut f);
            let t = Tokenizer::from_bytes(f.to_string().as_bytes()).unwrap();
            FastWordPiece::new(&t).unwrap_err()
        };
        let e = refused(&|f| f["normalizer"]["clean_text"] = false.into());
        assert!(e.contains("clean_text"), "{e}");
        let e = refused(&|f| f["normalizer"] = Value::Null);
        assert!(e.contains("normalizer"), "{e}");
        let e = refused(&|f| f["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"}));
        assert!(e.contains("pre-tokenizer"), "{e}");
        let e = refused(&|f| {
            f["post_processor"] = serde_json::json!({"type": "RobertaProcessing",
                "sep": ["[SEP]", 102], "cls": ["[CLS]", 101], "trim_offsets": true, "add_prefix_space": false})
        });
        assert!(e.contains("RobertaProcessing"), "{e}");
        let e = refused(&|f| f["model"]["unk_token"] = "[NOPE]".into());
        assert!(e.contains("NOPE"), "{e}");
    }

    /// A normalized added token beginning with a letter makes both cases
    /// of that letter (and nothing else) fall back.
    #[test]
    fn added_tokens_choose_the_fallback_bytes() {
        let mut t = minilm_tokenizer();
        t.add_tokens([tokenizers::AddedToken::from("Zork", false).normalized(true)])
            .unwrap();
        let f = FastWordPiece::new(&t).unwrap();
        for b in 0..128u8 {
            let want = matches!(b, b'[' | b'z' | b'Z');
            assert_eq!(f.normalized[b as usize] == FALLBACK, want, "byte {b}");
        }
        assert_eq!(fast_ids(&f, "a ZORK b"), None);
        assert!(fast_ids(&f, "a york b").is_some());
    }
}
