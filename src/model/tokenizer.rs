//! The tokenizer of a model folder, built as transformers 5 builds it.
//!
//! transformers 5 does not use a folder's `tokenizer.json` as is: the
//! tokenizer class (`tokenizer_config.json` `tokenizer_class`, else the
//! `model_type`'s) takes only parts of the file (the vocabulary and merges,
//! the post-processor for the decoder classes, the truncation direction)
//! and builds the rest itself from `tokenizer_config.json` (see
//! `docs/notes/sentence-transformers-folders.md` §3). [`build`] does the
//! same with the `tokenizers` crate: it reads the file as JSON, computes the
//! components the class would build, compares them with the file's
//! (ids-relevant fields only) and replaces those that differ, then loads
//! the result. Every replacement is reported (the start-up log and the
//! model's `derived` settings say so), so a folder whose file disagrees with
//! its class is visible.
//!
//! * `BertTokenizer`, `MPNetTokenizer`, `XLMRobertaTokenizer`: normalizer,
//!   pre-tokenizer and post-processor rebuilt from tokenizer_config.json.
//! * `Qwen2Tokenizer` (Qwen2/Qwen3 folders): BPE with the class's own flags,
//!   NFC, the Qwen2 split regex + ByteLevel; the post-processor is the
//!   file's (Qwen3-Embedding's appends `<|endoftext|>`). The class also
//!   re-adds its special tokens with plain flags (no lstrip/rstrip, not
//!   normalized).
//! * `GemmaTokenizer`: byte-fallback BPE, `Replace(" ", "▁")`,
//!   `Split(" ", merged_with_previous)`; the post-processor is the file's.
//!
//! For the two decoder classes transformers would rebuild the
//! post-processor from `add_bos_token` / `add_eos_token` only when the
//! file has none (or when they are passed to `from_pretrained` by the
//! caller): `PreTrainedTokenizerBase._from_pretrained` drops both keys of
//! tokenizer_config.json whenever a tokenizer.json exists, so with a file
//! post-processor the flags are never read, and without one the rebuilt
//! template adds nothing (`$A` / `$A $B`), which is what no post-processor
//! does too. So the file's post-processor is kept as is.
//!
//! `TokenizersBackend` / `PreTrainedTokenizerFast` folders are loaded whole,
//! as transformers does; any other class is refused by name.
//!
//! On top, as sentence-transformers does: an old folder's
//! `sentence_bert_config.json` `do_lower_case: true` puts a `Lowercase`
//! normalizer in front (unless the normalizer already has one), and the
//! file's own truncation and padding are dropped (the caller truncates at
//! the resolved maximum, `longest_first`, and never pads; the tokenizers
//! crate truncates the text before the post-processor adds its tokens, so
//! an appended end token survives truncation).

use super::ModelError;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The tokenizer classes whose transformers 5 `__init__` we rebuild.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerClass {
    /// `BertTokenizer`: BertNormalizer, BertPreTokenizer, `[CLS] A [SEP] B [SEP]`.
    Bert,
    /// `MPNetTokenizer`: as BERT, with RobertaProcessing (`<s> A </s></s> B </s>`).
    MpNet,
    /// `XLMRobertaTokenizer`: the file's Precompiled charsmap only,
    /// WhitespaceSplit + Metaspace, `<s> A </s></s> B </s>`.
    XlmRoberta,
    /// `Qwen2Tokenizer`: byte-level BPE (no unk, no byte fallback), NFC,
    /// Qwen2's split regex + ByteLevel; the file's post-processor.
    Qwen2,
    /// `GemmaTokenizer`: BPE with byte fallback and `<unk>`,
    /// `Replace(" ", "▁")`, `Split(" ", merged_with_previous)`; the file's
    /// post-processor.
    Gemma,
    /// `TokenizersBackend` / `PreTrainedTokenizerFast`: the file as is.
    File,
}

/// The classes [`TokenizerClass::resolve`] knows, for its error message.
const KNOWN_CLASSES: &str =
    "BertTokenizer, MPNetTokenizer, XLMRobertaTokenizer, Qwen2Tokenizer and GemmaTokenizer";

impl TokenizerClass {
    /// The class transformers uses for `tokenizer_class` (or, when absent,
    /// for the `model_type`). As `AutoTokenizer` does, a `qwen2` model
    /// (transformers lists its Hub `tokenizer_class` as unreliable) always
    /// gets `Qwen2Tokenizer`.
    pub fn resolve(tokenizer_class: Option<&str>, model_type: &str) -> Result<Self, String> {
        let name = match (tokenizer_class, model_type) {
            // MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: a hub class other
            // than the model type's registered one is replaced by it.
            (_, "qwen2") => "Qwen2Tokenizer".into(),
            (Some(n), _) => n.strip_suffix("Fast").unwrap_or(n).to_string(),
            (None, _) => match model_type {
                "bert" | "distilbert" => "BertTokenizer".into(),
                "mpnet" => "MPNetTokenizer".into(),
                "xlm-roberta" => "XLMRobertaTokenizer".into(),
                "qwen3" => "Qwen2Tokenizer".into(),
                "gemma" | "gemma2" | "gemma3" | "gemma3_text" => "GemmaTokenizer".into(),
                other => {
                    return Err(format!(
                        "no tokenizer_class, and model_type {other:?} has no known tokenizer (replayd knows {KNOWN_CLASSES})"
                    ))
                }
            },
        };
        Ok(match name.as_str() {
            // transformers 5: DistilBertTokenizer is BertTokenizer without
            // token_type_ids among its inputs.
            "BertTokenizer" | "DistilBertTokenizer" => TokenizerClass::Bert,
            "MPNetTokenizer" => TokenizerClass::MpNet,
            "XLMRobertaTokenizer" => TokenizerClass::XlmRoberta,
            "Qwen2Tokenizer" => TokenizerClass::Qwen2,
            "GemmaTokenizer" => TokenizerClass::Gemma,
            "TokenizersBackend" | "PreTrainedTokenizer" => TokenizerClass::File,
            other => {
                return Err(format!(
                    "unsupported tokenizer_class {other:?} (replayd rebuilds {KNOWN_CLASSES} as transformers 5 does, and loads TokenizersBackend / PreTrainedTokenizerFast files whole)"
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenizerClass::Bert => "BertTokenizer",
            TokenizerClass::MpNet => "MPNetTokenizer",
            TokenizerClass::XlmRoberta => "XLMRobertaTokenizer",
            TokenizerClass::Qwen2 => "Qwen2Tokenizer",
            TokenizerClass::Gemma => "GemmaTokenizer",
            TokenizerClass::File => "TokenizersBackend",
        }
    }
}

/// The `tokenizer_config.json` settings a class builds from (its defaults
/// where a key is absent).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassSettings {
    pub do_lower_case: bool,
    /// `None`: follows `do_lower_case` (BertNormalizer's rule).
    pub strip_accents: Option<bool>,
    pub tokenize_chinese_chars: bool,
    /// XLM-R's Metaspace (default true), Qwen2's ByteLevel (default false).
    pub add_prefix_space: bool,
    /// `None` for the classes without one (Qwen2, Gemma).
    pub cls_token: Option<String>,
    pub sep_token: Option<String>,
    /// `None`: Qwen2 with `unk_token: null` (its BPE has no unknown token
    /// either way).
    pub unk_token: Option<String>,
    /// Special tokens the class registers (cls, sep, pad, mask, unk, bos,
    /// eos, the extra / additional special tokens and model-specific
    /// `*_token` keys): each must be an added special token of the file.
    pub special_tokens: Vec<String>,
}

/// Everything needed to build a model's tokenizer (part of
/// [`ModelInfo`](super::ModelInfo), so the daemon builds it without
/// re-reading the folder's configs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// The `tokenizer.json`.
    pub path: PathBuf,
    pub class: TokenizerClass,
    pub settings: ClassSettings,
    /// Put a `Lowercase` normalizer in front (sentence-transformers'
    /// `do_lower_case`).
    pub lowercase: bool,
    /// Longest sequence, special tokens included (truncation is there).
    pub max_len: usize,
    /// Whether the second segment of a pair gets token type 1 (BERT; the
    /// XLM-R and MPNet tokenizers return no token types).
    pub token_types: bool,
}

/// A string or `{"content": ...}` special token of tokenizer_config.json.
fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the named special tokens.
const NAMED_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl ClassSettings {
    /// The settings `class` reads from `tokenizer_config.json` (`config`,
    /// an empty object when the file is absent). Errors name the key.
    pub fn read(class: TokenizerClass, config: &Value, path: &Path) -> Result<Self, ModelError> {
        use TokenizerClass::*;
        let err = |m: String| ModelError::file(path, m);
        let boolean = |key: &str, default: bool| -> Result<bool, ModelError> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(err(format!("`{key}` is {v}, expected true or false"))),
            }
        };
        // Each class's `__init__` defaults for the named special tokens.
        let default = |key: &str| -> Option<&'static str> {
            let d = match class {
                Bert => ["", "", "[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]"],
                MpNet => ["", "", "[UNK]", "</s>", "<pad>", "<s>", "<mask>"],
                XlmRoberta => ["", "", "<unk>", "</s>", "<pad>", "<s>", "<mask>"],
                Qwen2 => [
                    "",
                    "<|endoftext|>",
                    "<|endoftext|>",
                    "",
                    "<|endoftext|>",
                    "",
                    "",
                ],
                Gemma => ["<bos>", "<eos>", "<unk>", "", "<pad>", "", "<mask>"],
                File => [""; 7],
            };
            let i = NAMED_TOKENS.iter().position(|k| *k == key)?;
            Some(d[i]).filter(|t| !t.is_empty())
        };
        // A named token: the key's string, else the class default. An
        // explicit null is passed to the class as None; the encoder
        // classes here have always read it as their default.
        let token = |key: &str| -> Result<Option<String>, ModelError> {
            match config.get(key) {
                None => Ok(default(key).map(str::to_string)),
                Some(Value::Null) if matches!(class, Qwen2 | Gemma) => Ok(None),
                Some(Value::Null) => Ok(default(key).map(str::to_string)),
                Some(v) => token_string(v)
                    .map(Some)
                    .ok_or_else(|| err(format!("`{key}` is {v}, expected a token string"))),
            }
        };
        if matches!(class, Bert | MpNet) {
            if !boolean("do_basic_tokenize", true)? {
                return Err(err(
                    "unsupported `do_basic_tokenize: false` (replayd builds the basic tokenizer)"
                        .into(),
                ));
            }
            match config.get("never_split") {
                None | Some(Value::Null) => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(v) => {
                    return Err(err(format!(
                        "unsupported `never_split` {v} (replayd cannot keep words whole)"
                    )))
                }
            }
        }
        let strip_accents = match config.get("strip_accents") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                return Err(err(format!(
                    "`strip_accents` is {v}, expected true, false or null"
                )))
            }
        };
        let unk_token = token("unk_token")?;
        if class == Gemma && unk_token.is_none() {
            // GemmaTokenizer would build its BPE with the unknown token "None".
            return Err(err(
                "unsupported `unk_token: null` for GemmaTokenizer (its BPE needs an unknown token)"
                    .into(),
            ));
        }
        let mut special = Vec::new();
        for key in NAMED_TOKENS {
            special.extend(token(key)?);
        }
        if class != File {
            // transformers 5: `extra_special_tokens` (a list, or a dict of
            // model-specific tokens), else the older
            // `additional_special_tokens`; and every other `*_token` key with
            // a string value is a model-specific special token.
            let nonempty = |v: &&Value| match v {
                Value::Array(a) => !a.is_empty(),
                Value::Object(m) => !m.is_empty(),
                _ => false,
            };
            let extra = config
                .get("extra_special_tokens")
                .filter(nonempty)
                .or_else(|| config.get("additional_special_tokens"));
            match extra {
                Some(Value::Array(a)) => special.extend(a.iter().filter_map(token_string)),
                Some(Value::Object(m)) => special.extend(m.values().filter_map(token_string)),
                _ => {}
            }
            if let Some(m) = config.as_object() {
                for (key, v) in m {
                    if key.ends_with("_token") && !NAMED_TOKENS.contains(&key.as_str()) {
                        if let Value::String(t) = v {
                            special.push(t.clone());
                        }
                    }
                }
            }
        }
        special.sort();
        special.dedup();
        let settings = ClassSettings {
            do_lower_case: boolean("do_lower_case", true)?,
            strip_accents,
            tokenize_chinese_chars: boolean("tokenize_chinese_chars", true)?,
            // Qwen2Tokenizer: `add_prefix_space=None` → False.
            add_prefix_space: boolean("add_prefix_space", class != Qwen2)?,
            cls_token: token("cls_token")?,
            sep_token: token("sep_token")?,
            unk_token,
            special_tokens: special,
        };
        // TokenizersBackend sets `encode_special_tokens` from it: special
        // tokens written in a text would be tokenized as text.
        if boolean("split_special_tokens", false)? {
            return Err(err(
                "unsupported `split_special_tokens: true` (replayd matches special tokens in the text)"
                    .into(),
            ));
        }
        match config.get("truncation_side").and_then(Value::as_str) {
            None | Some("right") => {}
            Some(side) => {
                return Err(err(format!(
                    "unsupported `truncation_side` {side:?} (replayd truncates on the right)"
                )))
            }
        }
        Ok(settings)
    }
}

/// The ids-relevant part of a component, for comparing the file's with the
/// one the class builds: RobertaProcessing's offset flags and a ByteLevel
/// pre-tokenizer's `trim_offsets` (anywhere in a Sequence) change offsets
/// only.
fn ids_relevant(v: &Value) -> Value {
    let mut v = v.clone();
    strip_offset_flags(&mut v);
    v
}

fn strip_offset_flags(v: &mut Value) {
    match v {
        Value::Object(m) => {
            match m.get("type").and_then(Value::as_str) {
                Some("RobertaProcessing") => {
                    m.remove("trim_offsets");
                    m.remove("add_prefix_space");
                }
                Some("ByteLevel") => {
                    m.remove("trim_offsets");
                }
                _ => {}
            }
            m.values_mut().for_each(strip_offset_flags);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_offset_flags),
        _ => {}
    }
}

/// Qwen2Tokenizer's `PRETOKENIZE_REGEX` (`models/qwen2/tokenization_qwen2.py`).
const QWEN2_PRETOKENIZE_REGEX: &str = r#"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"#;

/// Whether a BPE model field of the file means the same as the class's
/// value for the ids: an absent key is the `tokenizers` default (null /
/// false), an empty prefix or suffix is none, and dropout 0 is none.
fn bpe_field_same(key: &str, have: Option<&Value>, want: &Value) -> bool {
    let norm = |v: Option<&Value>| -> Value {
        match (key, v) {
            ("fuse_unk" | "byte_fallback" | "ignore_merges", None | Some(Value::Null)) => {
                json!(false)
            }
            (_, None) => Value::Null,
            ("continuing_subword_prefix" | "end_of_word_suffix", Some(Value::String(s)))
                if s.is_empty() =>
            {
                Value::Null
            }
            ("dropout", Some(Value::Number(n))) if n.as_f64() == Some(0.0) => Value::Null,
            (_, Some(v)) => v.clone(),
        }
    };
    norm(have) == norm(Some(want))
}

/// The id of `token` in the file: an added token, else the model's vocabulary.
fn token_id(file: &Value, token: &str) -> Option<u64> {
    let added = file.get("added_tokens").and_then(Value::as_array);
    if let Some(t) = added
        .into_iter()
        .flatten()
        .find(|t| t.get("content").and_then(Value::as_str) == Some(token))
    {
        return t.get("id").and_then(Value::as_u64);
    }
    let vocab = file.get("model")?.get("vocab")?;
    match vocab {
        // WordPiece / BPE: {token: id}
        Value::Object(m) => m.get(token).and_then(Value::as_u64),
        // Unigram: [[piece, score], ...]
        Value::Array(a) => a
            .iter()
            .position(|e| e.get(0).and_then(Value::as_str) == Some(token))
            .map(|p| p as u64),
        _ => None,
    }
}

/// BERT's template: `[CLS]:0 $A:0 [SEP]:0`, pair `… $B:1 [SEP]:1`; XLM-R's:
/// `<s> $A </s>`, pair `<s> $A </s> </s> $B </s>`, all type 0.
fn template(cls: (&str, u64), sep: (&str, u64), roberta_pair: bool) -> Value {
    let special = |t: &str, ty: u32| json!({"SpecialToken": {"id": t, "type_id": ty}});
    let seq = |s: &str, ty: u32| json!({"Sequence": {"id": s, "type_id": ty}});
    let pair = if roberta_pair {
        vec![
            special(cls.0, 0),
            seq("A", 0),
            special(sep.0, 0),
            special(sep.0, 0),
            seq("B", 0),
            special(sep.0, 0),
        ]
    } else {
        vec![
            special(cls.0, 0),
            seq("A", 0),
            special(sep.0, 0),
            seq("B", 1),
            special(sep.0, 1),
        ]
    };
    let mut specials = serde_json::Map::new();
    for (t, id) in [cls, sep] {
        specials.insert(t.into(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({
        "type": "TemplateProcessing",
        "single": [special(cls.0, 0), seq("A", 0), special(sep.0, 0)],
        "pair": pair,
        "special_tokens": specials,
    })
}

/// A component's JSON, cut to 160 characters for a note.
fn brief(v: &Value) -> String {
    let t = v.to_string();
    match t.char_indices().nth(160) {
        Some((cut, _)) => format!("{}…", &t[..cut]),
        None => t,
    }
}

/// Where two components differ, for a note: descends while exactly one
/// field (or Sequence element) differs and returns its path
/// (`pretokenizers[1].add_prefix_space: `, empty at the top) and the two
/// differing parts.
fn difference<'a>(have: &'a Value, want: &'a Value) -> (String, &'a Value, &'a Value) {
    let (mut h, mut w) = (have, want);
    let mut path = String::new();
    loop {
        let step = match (h, w) {
            (Value::Object(ho), Value::Object(wo)) => {
                let mut keys = ho
                    .keys()
                    .chain(wo.keys().filter(|k| !ho.contains_key(*k)))
                    .filter(|k| ho.get(*k) != wo.get(*k));
                match (keys.next(), keys.next()) {
                    (Some(k), None) => match (ho.get(k), wo.get(k)) {
                        (Some(hv), Some(wv)) => Some((
                            if path.is_empty() {
                                k.clone()
                            } else {
                                format!(".{k}")
                            },
                            hv,
                            wv,
                        )),
                        _ => None,
                    },
                    _ => None,
                }
            }
            (Value::Array(ha), Value::Array(wa)) if ha.len() == wa.len() => {
                let mut idx = (0..ha.len()).filter(|&i| ha[i] != wa[i]);
                match (idx.next(), idx.next()) {
                    (Some(i), None) => Some((format!("[{i}]"), &ha[i], &wa[i])),
                    _ => None,
                }
            }
            _ => None,
        };
        match step {
            Some((seg, hv, wv)) => {
                path.push_str(&seg);
                (h, w) = (hv, wv);
            }
            None => break,
        }
    }
    if !path.is_empty() {
        path.push_str(": ");
    }
    (path, h, w)
}

/// The first `Precompiled` normalizer of `n` (itself or inside a Sequence).
fn precompiled(n: &Value) -> Option<Value> {
    match n.get("type").and_then(Value::as_str) {
        Some("Precompiled") => Some(n.clone()),
        Some("Sequence") => n
            .get("normalizers")
            .and_then(Value::as_array)?
            .iter()
            .find_map(precompiled),
        _ => None,
    }
}

/// Whether a normalizer is or contains `Lowercase` (sentence-transformers'
/// `_has_lowercase`).
fn has_lowercase(n: &Value) -> bool {
    match n.get("type").and_then(Value::as_str) {
        Some("Lowercase") => true,
        Some("Sequence") => n
            .get("normalizers")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(has_lowercase)),
        _ => false,
    }
}

/// Builds the tokenizer (no truncation, no padding) and says what was
/// rebuilt. Errors name the file and what is wrong.
pub fn build(spec: &TokenizerSpec) -> Result<(Tokenizer, Vec<String>), ModelError> {
    let path = &spec.path;
    let err = |m: String| ModelError::file(path, m);
    let mut file = super::files::read_json(path)?;
    if !file.is_object() {
        return Err(err("expected a JSON object".into()));
    }
    let mut notes = Vec::new();
    if let Some(dir) = file
        .get("truncation")
        .and_then(|t| t.get("direction"))
        .and_then(Value::as_str)
    {
        if dir != "Right" {
            return Err(err(format!(
                "unsupported truncation direction {dir:?} (transformers takes it as the truncation side; replayd truncates on the right)"
            )));
        }
    }
    let s = &spec.settings;
    let class = spec.class;
    if class != TokenizerClass::File {
        use TokenizerClass::*;
        let id_of = |t: &str| {
            token_id(&file, t).ok_or_else(|| {
                err(format!(
                    "the {} token {t:?} (tokenizer_config.json) is not in the vocabulary",
                    class.name()
                ))
            })
        };
        let added: Vec<(String, bool)> = file
            .get("added_tokens")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|t| {
                Some((
                    t.get("content")?.as_str()?.to_string(),
                    t.get("special").and_then(Value::as_bool).unwrap_or(false),
                ))
            })
            .collect();
        for t in &s.special_tokens {
            if !added.iter().any(|(c, special)| c == t && *special) {
                return Err(err(format!(
                    "{} registers the special token {t:?} (tokenizer_config.json), which is not a special added token of tokenizer.json; replayd cannot add it",
                    class.name()
                )));
            }
        }
        // The encoder classes' [CLS]/[SEP] (with their ids), for their
        // post-processors.
        let named = |t: &Option<String>, what: &str| -> Result<(String, u64), ModelError> {
            let t = t
                .as_deref()
                .ok_or_else(|| err(format!("{} needs a {what} token", class.name())))?;
            Ok((t.to_string(), id_of(t)?))
        };
        let (cls, sep) = match class {
            Bert | MpNet | XlmRoberta => (named(&s.cls_token, "cls")?, named(&s.sep_token, "sep")?),
            _ => Default::default(),
        };
        let (cls, sep) = ((cls.0.as_str(), cls.1), (sep.0.as_str(), sep.1));
        // XLMRobertaTokenizer's Unigram takes the unknown token's id.
        let xlmr_unk = match class {
            XlmRoberta => Some(id_of(s.unk_token.as_deref().unwrap_or_default())?),
            _ => None,
        };
        let bert_normalizer = json!({
            "type": "BertNormalizer",
            "clean_text": true,
            "handle_chinese_chars": s.tokenize_chinese_chars,
            "strip_accents": s.strip_accents,
            "lowercase": s.do_lower_case,
        });
        // (normalizer, pre-tokenizer, post-processor); no post-processor:
        // the file's is kept (the decoder classes, see the module docs).
        let (normalizer, pre, post) = match class {
            Bert => (
                bert_normalizer,
                json!({"type": "BertPreTokenizer"}),
                Some(template(cls, sep, false)),
            ),
            MpNet => (
                bert_normalizer,
                json!({"type": "BertPreTokenizer"}),
                Some(
                    json!({"type": "RobertaProcessing", "sep": [sep.0, sep.1], "cls": [cls.0, cls.1],
                           "trim_offsets": true, "add_prefix_space": false}),
                ),
            ),
            XlmRoberta => (
                file.get("normalizer")
                    .and_then(precompiled)
                    .unwrap_or(Value::Null),
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "WhitespaceSplit"},
                    {"type": "Metaspace", "replacement": "\u{2581}",
                     "prepend_scheme": if s.add_prefix_space { "always" } else { "never" },
                     "split": true}]}),
                Some(template(cls, sep, true)),
            ),
            Qwen2 => (
                json!({"type": "NFC"}),
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX},
                     "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": s.add_prefix_space,
                     "trim_offsets": true, "use_regex": false}]}),
                None,
            ),
            Gemma => (
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
                json!({"type": "Split", "pattern": {"String": " "},
                       "behavior": "MergedWithPrevious", "invert": false}),
                None,
            ),
            File => unreachable!(),
        };
        let mut rebuilt = vec![("normalizer", normalizer), ("pre_tokenizer", pre)];
        rebuilt.extend(post.map(|p| ("post_processor", p)));
        for (key, want) in rebuilt {
            let have = file.get(key).cloned().unwrap_or(Value::Null);
            let (have_ids, want_ids) = (ids_relevant(&have), ids_relevant(&want));
            if have_ids != want_ids {
                let (at, h, w) = difference(&have_ids, &want_ids);
                notes.push(format!(
                    "{key} rebuilt as {} does from tokenizer_config.json: {at}{} (the file had {})",
                    class.name(),
                    brief(w),
                    brief(h)
                ));
                file[key] = want;
            }
        }
        // The model: the unknown token and the class's fixed settings.
        let model = file
            .get_mut("model")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| err("no `model`".into()))?;
        let kind = model
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let mut want: Vec<(&str, Value)> = Vec::new();
        let unk = s.unk_token.clone().unwrap_or_default();
        match (class, kind.as_str()) {
            (Bert | MpNet, "WordPiece") => {
                want.push(("unk_token", json!(unk)));
                want.push(("continuing_subword_prefix", json!("##")));
                want.push(("max_input_chars_per_word", json!(100)));
            }
            (XlmRoberta, "Unigram") => {}
            // `BPE(vocab, merges, dropout=None, unk_token=None,
            // continuing_subword_prefix="", end_of_word_suffix="",
            // fuse_unk=False, byte_fallback=False)`.
            (Qwen2, "BPE") => want.extend([
                ("dropout", Value::Null),
                ("unk_token", Value::Null),
                ("continuing_subword_prefix", json!("")),
                ("end_of_word_suffix", json!("")),
                ("fuse_unk", json!(false)),
                ("byte_fallback", json!(false)),
                ("ignore_merges", json!(false)),
            ]),
            // `BPE(vocab, merges, fuse_unk=True, unk_token=str(unk_token),
            // dropout=None, byte_fallback=True)`.
            (Gemma, "BPE") => want.extend([
                ("dropout", Value::Null),
                ("unk_token", json!(unk)),
                ("continuing_subword_prefix", Value::Null),
                ("end_of_word_suffix", Value::Null),
                ("fuse_unk", json!(true)),
                ("byte_fallback", json!(true)),
                ("ignore_merges", json!(false)),
            ]),
            (c, k) => {
                return Err(err(format!(
                    "{} builds a {} model, the file has {k:?}",
                    c.name(),
                    match c {
                        XlmRoberta => "Unigram",
                        Qwen2 | Gemma => "BPE",
                        _ => "WordPiece",
                    }
                )))
            }
        }
        for (key, v) in want {
            let same = match kind.as_str() {
                "BPE" => bpe_field_same(key, model.get(key), &v),
                _ => model.get(key) == Some(&v),
            };
            if !same {
                notes.push(format!(
                    "model.{key} set to {v} as {} does (the file had {})",
                    class.name(),
                    model.get(key).map_or("nothing".into(), |x| x.to_string())
                ));
                model.insert(key.into(), v);
            }
        }
        if let Some(unk) = xlmr_unk {
            let model = file["model"].as_object_mut().expect("checked above");
            for (key, v) in [("unk_id", json!(unk)), ("byte_fallback", json!(false))] {
                if model.get(key) != Some(&v) {
                    notes.push(format!(
                        "model.{key} set to {v} as XLMRobertaTokenizer does (the file had {})",
                        model.get(key).map_or("nothing".into(), |x| x.to_string())
                    ));
                    model.insert(key.into(), v);
                }
            }
        }
        // Qwen2Tokenizer ends its `__init__` with `add_tokens([AddedToken(t,
        // special=True) for t in all_special_tokens])`, which replaces each
        // special token's flags with plain ones (no lstrip / rstrip /
        // single_word, not normalized). GemmaTokenizer keeps the file's.
        if class == Qwen2 {
            let plain = [
                ("single_word", false),
                ("lstrip", false),
                ("rstrip", false),
                ("normalized", false),
                ("special", true),
            ];
            for t in file
                .get_mut("added_tokens")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                let Some(content) = t.get("content").and_then(Value::as_str).map(str::to_string)
                else {
                    continue;
                };
                if !s.special_tokens.contains(&content) {
                    continue;
                }
                for (key, v) in plain {
                    if t.get(key).and_then(Value::as_bool) != Some(v) {
                        notes.push(format!(
                            "added token {content:?}: {key} set to {v} as Qwen2Tokenizer does (the file had {})",
                            t.get(key).map_or("nothing".into(), |x| x.to_string())
                        ));
                        t[key] = json!(v);
                    }
                }
            }
        }
    }
    if spec.lowercase {
        let n = file.get("normalizer").cloned().unwrap_or(Value::Null);
        if !has_lowercase(&n) {
            let mut list = vec![json!({"type": "Lowercase"})];
            match n.get("type").and_then(Value::as_str) {
                None => {}
                Some("Sequence") => list.extend(
                    n.get("normalizers")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default(),
                ),
                Some(_) => list.push(n),
            }
            file["normalizer"] = json!({"type": "Sequence", "normalizers": list});
            notes.push(
                "Lowercase put in front of the normalizer (sentence_bert_config.json do_lower_case: true)"
                    .into(),
            );
        }
    }
    file["truncation"] = Value::Null;
    file["padding"] = Value::Null;
    let tokenizer = Tokenizer::from_bytes(file.to_string().as_bytes())
        .map_err(|e| err(format!("cannot load tokenizer: {e}")))?;
    Ok((tokenizer, notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models")
    }

    #[test]
    fn classes_resolve_as_transformers_does() {
        use TokenizerClass::*;
        assert_eq!(
            TokenizerClass::resolve(Some("BertTokenizerFast"), "x"),
            Ok(Bert)
        );
        assert_eq!(TokenizerClass::resolve(None, "mpnet"), Ok(MpNet));
        assert_eq!(TokenizerClass::resolve(None, "xlm-roberta"), Ok(XlmRoberta));
        assert_eq!(
            TokenizerClass::resolve(Some("PreTrainedTokenizerFast"), "bert"),
            Ok(File)
        );
        let e = TokenizerClass::resolve(Some("GPT2Tokenizer"), "gpt2").unwrap_err();
        assert!(e.contains("GPT2Tokenizer"), "{e}");
        assert!(
            e.contains("Qwen2Tokenizer") && e.contains("GemmaTokenizer"),
            "{e}"
        );
        // The decoder classes: by name (with or without Fast) and by model type.
        assert_eq!(
            TokenizerClass::resolve(Some("Qwen2TokenizerFast"), "qwen3"),
            Ok(Qwen2)
        );
        assert_eq!(TokenizerClass::resolve(None, "qwen3"), Ok(Qwen2));
        assert_eq!(TokenizerClass::resolve(None, "qwen2"), Ok(Qwen2));
        assert_eq!(
            TokenizerClass::resolve(Some("GemmaTokenizerFast"), "x"),
            Ok(Gemma)
        );
        for t in ["gemma", "gemma2", "gemma3", "gemma3_text"] {
            assert_eq!(TokenizerClass::resolve(None, t), Ok(Gemma), "{t}");
        }
        // AutoTokenizer replaces a qwen2 folder's hub class (checked with
        // transformers 5.24: PreTrainedTokenizerFast → Qwen2Tokenizer), not
        // a qwen3 folder's.
        assert_eq!(
            TokenizerClass::resolve(Some("PreTrainedTokenizerFast"), "qwen2"),
            Ok(Qwen2)
        );
        assert_eq!(
            TokenizerClass::resolve(Some("PreTrainedTokenizerFast"), "qwen3"),
            Ok(File)
        );
        let e = TokenizerClass::resolve(None, "llama").unwrap_err();
        assert!(e.contains("llama") && e.contains("GemmaTokenizer"), "{e}");
        // Serialized names stay snake_case.
        assert_eq!(serde_json::to_value(Qwen2).unwrap(), json!("qwen2"));
        assert_eq!(serde_json::to_value(Gemma).unwrap(), json!("gemma"));
        assert_eq!(
            serde_json::to_value(XlmRoberta).unwrap(),
            json!("xlm_roberta")
        );
    }

    /// A tokenizer.json whose normalizer does not lowercase, under a
    /// tokenizer_config.json without `do_lower_case`: transformers 5
    /// lowercases (BertTokenizer's default), and so do we (the notes'
    /// "Hello World" check).
    #[test]
    fn bert_normalizer_is_rebuilt_from_tokenizer_config() {
        let src = models().join("bert-st-old/tokenizer.json");
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(&src, dir.path().join("tokenizer.json")).unwrap();
        let settings = ClassSettings::read(TokenizerClass::Bert, &json!({}), &src).unwrap();
        assert!(settings.do_lower_case);
        let spec = TokenizerSpec {
            path: dir.path().join("tokenizer.json"),
            class: TokenizerClass::Bert,
            settings,
            lowercase: false,
            max_len: 64,
            token_types: true,
        };
        let (tok, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("normalizer rebuilt"), "{notes:?}");
        let raw = Tokenizer::from_file(&src).unwrap();
        let upper = tok.encode("HELLO", true).unwrap();
        let lower = tok.encode("hello", true).unwrap();
        assert_eq!(upper.get_ids(), lower.get_ids());
        assert_ne!(
            raw.encode("HELLO", true).unwrap().get_ids(),
            upper.get_ids()
        );
        // The file's own truncation and padding are gone.
        assert!(tok.get_truncation().is_none() && tok.get_padding().is_none());
    }

    #[test]
    fn missing_special_tokens_and_odd_settings_are_named() {
        let p = Path::new("tokenizer_config.json");
        let e = ClassSettings::read(TokenizerClass::Bert, &json!({"truncation_side": "left"}), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncation_side") && e.contains("left"), "{e}");
        let e = ClassSettings::read(
            TokenizerClass::Qwen2,
            &json!({"split_special_tokens": true}),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("split_special_tokens"), "{e}");
        let e = ClassSettings::read(TokenizerClass::Bert, &json!({"never_split": ["x"]}), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("never_split"), "{e}");
        let src = models().join("bert-st-new/tokenizer.json");
        let mut settings = ClassSettings::read(TokenizerClass::Bert, &json!({}), p).unwrap();
        settings.special_tokens.push("[NOPE]".into());
        let spec = TokenizerSpec {
            path: src,
            class: TokenizerClass::Bert,
            settings,
            lowercase: false,
            max_len: 64,
            token_types: true,
        };
        let e = build(&spec).unwrap_err().to_string();
        assert!(e.contains("[NOPE]") && e.contains("tokenizer.json"), "{e}");
    }

    /// A test folder's tokenizer spec, read as `bert/folder.rs` reads it:
    /// the class from tokenizer_config.json / config.json, the maximum from
    /// sentence_bert_config.json `max_seq_length`.
    fn folder_spec(dir: &Path) -> TokenizerSpec {
        let read = |f: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
        };
        let config = read("config.json");
        let tc = read("tokenizer_config.json");
        let class = TokenizerClass::resolve(
            tc.get("tokenizer_class").and_then(Value::as_str),
            config["model_type"].as_str().unwrap(),
        )
        .unwrap();
        let settings = ClassSettings::read(class, &tc, &dir.join("tokenizer_config.json")).unwrap();
        TokenizerSpec {
            path: dir.join("tokenizer.json"),
            class,
            settings,
            lowercase: false,
            max_len: read("sentence_bert_config.json")["max_seq_length"]
                .as_u64()
                .unwrap() as usize,
            token_types: false,
        }
    }

    /// The daemon's truncation (`daemon::tokenize::TextTokenizer::with_limits`):
    /// the tokenizers crate's, at `max_len` tokens, specials included.
    fn truncating(tok: &Tokenizer, max_len: usize) -> Tokenizer {
        let mut t = tok.clone();
        t.with_truncation(Some(tokenizers::TruncationParams {
            direction: tokenizers::TruncationDirection::Right,
            max_length: max_len,
            strategy: tokenizers::TruncationStrategy::LongestFirst,
            stride: 0,
        }))
        .unwrap();
        t
    }

    /// reference.jsonl rows: (case, prompt + text, ids, untruncated_length).
    fn reference(dir: &Path) -> Vec<(String, String, Vec<u32>, Option<usize>)> {
        std::fs::read_to_string(dir.join("reference.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let r: Value = serde_json::from_str(l).unwrap();
                let text = format!(
                    "{}{}",
                    r["prompt"].as_str().unwrap_or(""),
                    r["text"].as_str().unwrap()
                );
                let ids = r["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect();
                let untruncated = r.get("untruncated_length").and_then(Value::as_u64);
                (
                    r["case"].as_str().unwrap().to_string(),
                    text,
                    ids,
                    untruncated.map(|n| n as usize),
                )
            })
            .collect()
    }

    /// Every reference row of `dir` through `build` and the daemon's
    /// truncation gives sentence-transformers' ids; truncated rows keep
    /// the post-processor's tokens (checked by `check`).
    fn assert_reference_ids(dir: &Path, tok: &Tokenizer, max_len: usize) -> usize {
        let trunc = truncating(tok, max_len);
        let rows = reference(dir);
        let mut truncated = 0;
        for (case, text, want, untruncated) in &rows {
            let got = trunc.encode(text.as_str(), true).unwrap();
            assert_eq!(got.get_ids(), &want[..], "{}: {case}", dir.display());
            if let Some(n) = untruncated {
                truncated += 1;
                assert_eq!(want.len(), max_len, "{case}");
                let full = tok.encode(text.as_str(), true).unwrap();
                assert_eq!(
                    full.len(),
                    *n,
                    "{}: {case} before truncation",
                    dir.display()
                );
            }
        }
        assert!(rows.len() > 20);
        truncated
    }

    /// Qwen3 (Qwen2Tokenizer): the file was written by the class, so nothing
    /// is rebuilt; every row's ids are sentence-transformers', and every
    /// row (truncated ones included) ends with the `<|endoftext|>` the
    /// file's post-processor appends.
    #[test]
    fn qwen3_folder_gives_sentence_transformers_ids() {
        let dir = models().join("qwen3-st");
        let spec = folder_spec(&dir);
        assert_eq!(spec.class, TokenizerClass::Qwen2);
        assert!(!spec.settings.add_prefix_space);
        let (tok, notes) = build(&spec).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        let eot = tok.token_to_id("<|endoftext|>").unwrap();
        let truncated = assert_reference_ids(&dir, &tok, spec.max_len);
        assert!(truncated >= 3, "the folder has over-long rows");
        let trunc = truncating(&tok, spec.max_len);
        for (case, text, _, _) in reference(&dir) {
            let ids = trunc.encode(text.as_str(), true).unwrap();
            assert_eq!(ids.get_ids().last(), Some(&eot), "{case}");
        }
        // A text far over the maximum: cut to max_len − 1 tokens, then the
        // end token.
        let long = "replay the graph ".repeat(200);
        let ids = trunc.encode(long.as_str(), true).unwrap();
        assert_eq!(ids.len(), spec.max_len);
        assert_eq!(ids.get_ids().last(), Some(&eot));
        let full = tok.encode(long.as_str(), true).unwrap();
        assert_eq!(
            ids.get_ids()[..spec.max_len - 1],
            full.get_ids()[..spec.max_len - 1]
        );
    }

    /// Gemma 3 (GemmaTokenizer): `<bos> … <eos>` from the file's
    /// post-processor, byte fallback for characters outside the vocabulary.
    #[test]
    fn gemma3_folder_gives_sentence_transformers_ids() {
        let dir = models().join("gemma3-st");
        let spec = folder_spec(&dir);
        assert_eq!(spec.class, TokenizerClass::Gemma);
        let (tok, notes) = build(&spec).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        let truncated = assert_reference_ids(&dir, &tok, spec.max_len);
        assert!(truncated >= 3, "the folder has over-long rows");
        let (bos, eos) = (
            tok.token_to_id("<bos>").unwrap(),
            tok.token_to_id("<eos>").unwrap(),
        );
        let trunc = truncating(&tok, spec.max_len);
        for (case, text, _, _) in reference(&dir) {
            let ids = trunc.encode(text.as_str(), true).unwrap();
            let ids = ids.get_ids();
            assert_eq!((ids[0], ids[ids.len() - 1]), (bos, eos), "{case}");
        }
    }

    /// A copy of `folder`'s tokenizer.json, edited by `edit`, with the
    /// folder's spec pointing at it.
    fn edited(folder: &str, edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, TokenizerSpec) {
        let dir = models().join(folder);
        let mut spec = folder_spec(&dir);
        let mut file: Value =
            serde_json::from_str(&std::fs::read_to_string(&spec.path).unwrap()).unwrap();
        edit(&mut file);
        let tmp = tempfile::tempdir().unwrap();
        spec.path = tmp.path().join("tokenizer.json");
        std::fs::write(&spec.path, file.to_string()).unwrap();
        (tmp, spec)
    }

    /// A Qwen2 file whose pre-tokenizer differs from the class's (GPT-2's
    /// ByteLevel with its own regex and a prefix space) gets the class's,
    /// reported; ByteLevel's `trim_offsets` (offsets only, `false` in the
    /// real Qwen3 files) is not a difference, nor is an empty vs null
    /// subword prefix.
    #[test]
    fn qwen2_pretokenizer_that_differs_is_rebuilt_and_reported() {
        let (_tmp, spec) = edited("qwen3-st", |f| {
            f["pre_tokenizer"] = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        });
        let raw = Tokenizer::from_file(&spec.path).unwrap();
        let (tok, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("pre_tokenizer rebuilt as Qwen2Tokenizer"),
            "{notes:?}"
        );
        let dir = models().join("qwen3-st");
        assert_reference_ids(&dir, &tok, spec.max_len);
        let text = "Hello World";
        assert_ne!(
            raw.encode(text, true).unwrap().get_ids(),
            tok.encode(text, true).unwrap().get_ids(),
            "the file's pre-tokenizer gives other ids"
        );

        let (_tmp, spec) = edited("qwen3-st", |f| {
            f["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = json!(false);
            f["model"]["continuing_subword_prefix"] = Value::Null;
            f["model"].as_object_mut().unwrap().remove("ignore_merges");
        });
        let (_, notes) = build(&spec).unwrap();
        assert!(notes.is_empty(), "{notes:?}");

        // The class's own model flags: a byte-fallback, unk-carrying BPE is
        // set back (and said so).
        let (_tmp, spec) = edited("qwen3-st", |f| {
            f["model"]["byte_fallback"] = json!(true);
            f["normalizer"] = Value::Null;
        });
        let (_, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes.iter().any(|n| n.contains("normalizer rebuilt")),
            "{notes:?}"
        );
        assert!(
            notes
                .iter()
                .any(|n| n.contains("model.byte_fallback set to false")),
            "{notes:?}"
        );
    }

    /// `add_prefix_space: true` in tokenizer_config.json goes into Qwen2's
    /// ByteLevel (a file without it is rebuilt).
    #[test]
    fn qwen2_add_prefix_space_comes_from_tokenizer_config() {
        let (_tmp, mut spec) = edited("qwen3-st", |_| {});
        spec.settings = ClassSettings::read(
            TokenizerClass::Qwen2,
            &json!({"add_prefix_space": true, "eos_token": "<|im_end|>", "bos_token": null, "unk_token": null}),
            Path::new("tokenizer_config.json"),
        )
        .unwrap();
        let (tok, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("pretokenizers[1].add_prefix_space: true (the file had false)"),
            "{notes:?}"
        );
        let (plain, _) = build(&folder_spec(&models().join("qwen3-st"))).unwrap();
        assert_ne!(
            tok.encode("hello", true).unwrap().get_ids(),
            plain.encode("hello", true).unwrap().get_ids()
        );
    }

    /// The post-processor of the decoder classes is the file's:
    /// transformers 5 drops tokenizer_config.json's `add_bos_token` /
    /// `add_eos_token` whenever a tokenizer.json exists, so they never
    /// rebuild it; a file without one adds nothing (the class's rebuilt
    /// template is `$A` / `$A $B`).
    #[test]
    fn decoder_post_processor_is_the_files() {
        for (folder, extra) in [
            (
                "qwen3-st",
                json!({"add_eos_token": false, "add_bos_token": true}),
            ),
            (
                "gemma3-st",
                json!({"add_bos_token": false, "add_eos_token": false}),
            ),
        ] {
            let dir = models().join(folder);
            let mut spec = folder_spec(&dir);
            let mut tc: Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap(),
            )
            .unwrap();
            for (k, v) in extra.as_object().unwrap() {
                tc[k] = v.clone();
            }
            spec.settings = ClassSettings::read(spec.class, &tc, &dir.join("x")).unwrap();
            let (tok, notes) = build(&spec).unwrap();
            assert!(notes.is_empty(), "{folder}: {notes:?}");
            assert_reference_ids(&dir, &tok, spec.max_len);

            let (_tmp, spec) = edited(folder, |f| f["post_processor"] = Value::Null);
            let (tok, notes) = build(&spec).unwrap();
            assert!(notes.is_empty(), "{folder}: {notes:?}");
            let ids = tok.encode("a", true).unwrap();
            assert_eq!(ids.get_special_tokens_mask(), &[0], "{folder}");
        }
    }

    /// GemmaTokenizer's own components: a Gemma-1-style normalizer
    /// (Prepend + Replace, no pre-tokenizer) and a BPE without byte
    /// fallback are rebuilt, each reported, and give the reference ids.
    #[test]
    fn gemma_components_that_differ_are_rebuilt_and_reported() {
        let (_tmp, spec) = edited("gemma3-st", |f| {
            f["normalizer"] = json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
            f["pre_tokenizer"] = Value::Null;
            f["model"]["byte_fallback"] = json!(false);
        });
        let (tok, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 3, "{notes:?}");
        for what in [
            "normalizer rebuilt",
            "pre_tokenizer rebuilt",
            "model.byte_fallback set to true",
        ] {
            assert!(notes.iter().any(|n| n.contains(what)), "{what}: {notes:?}");
        }
        assert_reference_ids(&models().join("gemma3-st"), &tok, spec.max_len);
    }

    /// Qwen2Tokenizer re-adds its special tokens with plain flags: a file's
    /// `lstrip` on `<|im_start|>` is dropped (transformers 5.24 keeps the
    /// space before it), reported. GemmaTokenizer keeps the file's flags.
    #[test]
    fn qwen2_special_token_flags_are_the_classs() {
        let set_lstrip = |name: &'static str| {
            move |f: &mut Value| {
                for t in f["added_tokens"].as_array_mut().unwrap() {
                    if t["content"] == name {
                        t["lstrip"] = json!(true);
                    }
                }
            }
        };
        let (_tmp, spec) = edited("qwen3-st", set_lstrip("<|im_start|>"));
        let (tok, notes) = build(&spec).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("<|im_start|>") && notes[0].contains("lstrip"),
            "{notes:?}"
        );
        let ids = tok.encode("a <|im_start|>b", false).unwrap();
        let start = tok.token_to_id("<|im_start|>").unwrap();
        assert_eq!(
            ids.get_tokens()[1],
            "\u{120}",
            "the space stays: {:?}",
            ids.get_tokens()
        );
        assert_eq!(ids.get_ids()[2], start);

        let (_tmp, spec) = edited("gemma3-st", set_lstrip("<mask>"));
        let (tok, notes) = build(&spec).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        let ids = tok.encode("a <mask>b", false).unwrap();
        assert_eq!(
            ids.get_ids()[1],
            tok.token_to_id("<mask>").unwrap(),
            "lstrip kept"
        );
    }

    /// Each class's special tokens: its defaults, explicit nulls (Qwen3's
    /// `bos_token` / `unk_token`), `extra_special_tokens` (or the older
    /// `additional_special_tokens`) and model-specific `*_token` keys.
    #[test]
    fn decoder_class_settings() {
        let p = Path::new("tokenizer_config.json");
        let q = ClassSettings::read(TokenizerClass::Qwen2, &json!({}), p).unwrap();
        assert_eq!(q.special_tokens, vec!["<|endoftext|>".to_string()]);
        assert_eq!(
            (q.cls_token.as_deref(), q.unk_token.as_deref()),
            (None, Some("<|endoftext|>"))
        );
        assert!(!q.add_prefix_space);
        let q = ClassSettings::read(
            TokenizerClass::Qwen2,
            &json!({"unk_token": null, "bos_token": null, "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>", "add_prefix_space": null,
                    "extra_special_tokens": ["<|im_start|>"],
                    "additional_special_tokens": ["<|ignored|>"]}),
            p,
        )
        .unwrap();
        assert_eq!(q.unk_token, None);
        assert_eq!(
            q.special_tokens,
            ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
        );
        let g = ClassSettings::read(TokenizerClass::Gemma, &json!({}), p).unwrap();
        assert_eq!(
            g.special_tokens,
            ["<bos>", "<eos>", "<mask>", "<pad>", "<unk>"]
        );
        let g = ClassSettings::read(
            TokenizerClass::Gemma,
            &json!({"additional_special_tokens": ["<start_of_turn>"], "boi_token": "<start_of_image>",
                    "image_token_index": 5, "add_bos_token": true}),
            p,
        )
        .unwrap();
        assert!(g.special_tokens.contains(&"<start_of_turn>".to_string()));
        assert!(g.special_tokens.contains(&"<start_of_image>".to_string()));
        assert_eq!(g.special_tokens.len(), 7);
        let e = ClassSettings::read(TokenizerClass::Gemma, &json!({"unk_token": null}), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unk_token"), "{e}");
        // A registered token missing from the file is named.
        let dir = models().join("gemma3-st");
        let mut spec = folder_spec(&dir);
        spec.settings = ClassSettings::read(
            TokenizerClass::Gemma,
            &json!({"boi_token": "<start_of_image>"}),
            p,
        )
        .unwrap();
        let e = build(&spec).unwrap_err().to_string();
        assert!(
            e.contains("<start_of_image>") && e.contains("GemmaTokenizer"),
            "{e}"
        );
    }
}
