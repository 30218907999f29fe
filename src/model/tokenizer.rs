//! The tokenizer of a model folder, built as transformers 5 builds it.
//!
//! transformers 5 does not use a BERT, MPNet or XLM-R folder's
//! `tokenizer.json` as is: the tokenizer class (`tokenizer_config.json`
//! `tokenizer_class`, else the `model_type`'s) takes only the vocabulary
//! (and the file's truncation direction) from the file and builds its own
//! normalizer, pre-tokenizer and post-processor from `tokenizer_config.json`
//! (see `docs/notes/sentence-transformers-folders.md` §3). [`build`] does
//! the same with the `tokenizers` crate: it reads the file as JSON, computes
//! the components the class would build, compares them with the file's
//! (ids-relevant fields only) and replaces those that differ, then loads
//! the result. Every replacement is reported (the start-up log and the
//! model's `derived` settings say so), so a folder whose file disagrees with
//! its config is visible. `TokenizersBackend` / `PreTrainedTokenizerFast`
//! folders are loaded whole, as transformers does; any other class is
//! refused by name.
//!
//! On top, as sentence-transformers does: an old folder's
//! `sentence_bert_config.json` `do_lower_case: true` puts a `Lowercase`
//! normalizer in front (unless the normalizer already has one), and the
//! file's own truncation and padding are dropped (the caller truncates at
//! the resolved maximum, `longest_first`, and never pads).

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
    /// `TokenizersBackend` / `PreTrainedTokenizerFast`: the file as is.
    File,
}

impl TokenizerClass {
    /// The class transformers uses for `tokenizer_class` (or, when absent,
    /// for the `model_type`).
    pub fn resolve(tokenizer_class: Option<&str>, model_type: &str) -> Result<Self, String> {
        let name = match tokenizer_class {
            Some(n) => n.strip_suffix("Fast").unwrap_or(n).to_string(),
            None => match model_type {
                "bert" | "distilbert" => "BertTokenizer".into(),
                "mpnet" => "MPNetTokenizer".into(),
                "xlm-roberta" => "XLMRobertaTokenizer".into(),
                other => {
                    return Err(format!(
                        "no tokenizer_class, and model_type {other:?} has no known tokenizer"
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
            "TokenizersBackend" | "PreTrainedTokenizer" => TokenizerClass::File,
            other => {
                return Err(format!(
                    "unsupported tokenizer_class {other:?} (replayd rebuilds BertTokenizer, MPNetTokenizer and XLMRobertaTokenizer as transformers 5 does, and loads TokenizersBackend / PreTrainedTokenizerFast files whole)"
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            TokenizerClass::Bert => "BertTokenizer",
            TokenizerClass::MpNet => "MPNetTokenizer",
            TokenizerClass::XlmRoberta => "XLMRobertaTokenizer",
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
    pub add_prefix_space: bool,
    pub cls_token: String,
    pub sep_token: String,
    pub unk_token: String,
    /// Special tokens the class registers (cls, sep, pad, mask, unk, bos,
    /// eos, additional): each must be an added special token of the file.
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

impl ClassSettings {
    /// The settings `class` reads from `tokenizer_config.json` (`config`,
    /// an empty object when the file is absent). Errors name the key.
    pub fn read(class: TokenizerClass, config: &Value, path: &Path) -> Result<Self, ModelError> {
        let err = |m: String| ModelError::file(path, m);
        let boolean = |key: &str, default: bool| -> Result<bool, ModelError> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(err(format!("`{key}` is {v}, expected true or false"))),
            }
        };
        let token = |key: &str, default: &str| -> Result<String, ModelError> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(default.to_string()),
                Some(v) => token_string(v)
                    .ok_or_else(|| err(format!("`{key}` is {v}, expected a token string"))),
            }
        };
        let (cls, sep, unk, pad, mask) = match class {
            TokenizerClass::Bert => ("[CLS]", "[SEP]", "[UNK]", "[PAD]", "[MASK]"),
            TokenizerClass::MpNet => ("<s>", "</s>", "[UNK]", "<pad>", "<mask>"),
            _ => ("<s>", "</s>", "<unk>", "<pad>", "<mask>"),
        };
        if matches!(class, TokenizerClass::Bert | TokenizerClass::MpNet) {
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
        let settings = ClassSettings {
            do_lower_case: boolean("do_lower_case", true)?,
            strip_accents,
            tokenize_chinese_chars: boolean("tokenize_chinese_chars", true)?,
            add_prefix_space: boolean("add_prefix_space", true)?,
            cls_token: token("cls_token", cls)?,
            sep_token: token("sep_token", sep)?,
            unk_token: token("unk_token", unk)?,
            special_tokens: {
                let mut v = Vec::new();
                for (key, default) in [
                    ("cls_token", Some(cls)),
                    ("sep_token", Some(sep)),
                    ("unk_token", Some(unk)),
                    ("pad_token", Some(pad)),
                    ("mask_token", Some(mask)),
                    ("bos_token", None),
                    ("eos_token", None),
                ] {
                    let t = match (config.get(key), default) {
                        (None | Some(Value::Null), Some(d)) if class != TokenizerClass::File => {
                            Some(d.to_string())
                        }
                        (None | Some(Value::Null), _) => None,
                        (Some(v), _) => Some(token_string(v).ok_or_else(|| {
                            err(format!("`{key}` is {v}, expected a token string"))
                        })?),
                    };
                    v.extend(t);
                }
                if let Some(extra) = config.get("additional_special_tokens") {
                    for t in extra.as_array().into_iter().flatten() {
                        v.extend(token_string(t));
                    }
                }
                v.sort();
                v.dedup();
                v
            },
        };
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
/// one the class builds (RobertaProcessing's offset flags change offsets
/// only).
fn ids_relevant(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        if m.get("type").and_then(Value::as_str) == Some("RobertaProcessing") {
            m.remove("trim_offsets");
            m.remove("add_prefix_space");
        }
    }
    v
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
        let cls = (s.cls_token.as_str(), id_of(&s.cls_token)?);
        let sep = (s.sep_token.as_str(), id_of(&s.sep_token)?);
        // XLMRobertaTokenizer's Unigram takes the unknown token's id.
        let xlmr_unk = match class {
            TokenizerClass::XlmRoberta => Some(id_of(&s.unk_token)?),
            _ => None,
        };
        let bert_normalizer = json!({
            "type": "BertNormalizer",
            "clean_text": true,
            "handle_chinese_chars": s.tokenize_chinese_chars,
            "strip_accents": s.strip_accents,
            "lowercase": s.do_lower_case,
        });
        let (normalizer, pre, post) = match class {
            TokenizerClass::Bert => (
                bert_normalizer,
                json!({"type": "BertPreTokenizer"}),
                template(cls, sep, false),
            ),
            TokenizerClass::MpNet => (
                bert_normalizer,
                json!({"type": "BertPreTokenizer"}),
                json!({"type": "RobertaProcessing", "sep": [sep.0, sep.1], "cls": [cls.0, cls.1],
                       "trim_offsets": true, "add_prefix_space": false}),
            ),
            TokenizerClass::XlmRoberta => (
                file.get("normalizer")
                    .and_then(precompiled)
                    .unwrap_or(Value::Null),
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "WhitespaceSplit"},
                    {"type": "Metaspace", "replacement": "\u{2581}",
                     "prepend_scheme": if s.add_prefix_space { "always" } else { "never" },
                     "split": true}]}),
                template(cls, sep, true),
            ),
            TokenizerClass::File => unreachable!(),
        };
        for (key, want) in [
            ("normalizer", normalizer),
            ("pre_tokenizer", pre),
            ("post_processor", post),
        ] {
            let have = file.get(key).cloned().unwrap_or(Value::Null);
            if ids_relevant(&have) != ids_relevant(&want) {
                let brief = |v: &Value| -> String {
                    let t = v.to_string();
                    if t.len() > 160 {
                        format!(
                            "{}…",
                            &t[..t.char_indices().nth(160).map_or(t.len(), |c| c.0)]
                        )
                    } else {
                        t
                    }
                };
                notes.push(format!(
                    "{key} rebuilt as {} does from tokenizer_config.json: {} (the file had {})",
                    class.name(),
                    brief(&want),
                    brief(&have)
                ));
                file[key] = want;
            }
        }
        // The model: the unknown token (and WordPiece's fixed settings).
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
        match (class, kind.as_str()) {
            (TokenizerClass::Bert | TokenizerClass::MpNet, "WordPiece") => {
                want.push(("unk_token", json!(s.unk_token)));
                want.push(("continuing_subword_prefix", json!("##")));
                want.push(("max_input_chars_per_word", json!(100)));
            }
            (TokenizerClass::XlmRoberta, "Unigram") => {}
            (c, k) => {
                return Err(err(format!(
                    "{} builds a {} model, the file has {k:?}",
                    c.name(),
                    if c == TokenizerClass::XlmRoberta {
                        "Unigram"
                    } else {
                        "WordPiece"
                    }
                )))
            }
        }
        for (key, v) in want {
            if model.get(key) != Some(&v) {
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
}
