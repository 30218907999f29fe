//! Model folders of every family served by the daemon on the CPU backend,
//! checked against the sentence-transformers references committed beside
//! them (`tests/data/models/*/reference.jsonl`, made by
//! `scripts/models/make-test-models.py`; what each folder exercises is in
//! `tests/data/models/README.md`).
//!
//! * Token ids (and token types) from the tokenizer the daemon builds are
//!   identical to sentence-transformers', truncation and prompts included.
//! * Texts sent over the socket (with the reference's `prompt_name`) give
//!   embeddings with cosine ≥ 0.9999; the same folders served with
//!   `normalize = false` give the un-normalised vector (`pooled`, or
//!   `dense` after a Dense module) within relative L2 1e-3.
//! * Cross-encoder `pairs` give the folder's scores within 1e-4.
//! * Folders with an unsupported architecture or module fail start-up with
//!   a message naming it.

mod common;

use common::{cosine, crate_dir, Daemon};
use replayd::daemon::tokenize::{PromptUse, TextInput, TextTokenizer};
use replayd::model::batch::{token_id, token_type, unpooled_prefix};
use replayd::model::{inspect, ModelInfo};
use replayd::protocol::client::Client;
use replayd::protocol::{InputKind, Payload, RequestHeader, Status};
use replayd::tensor::DType;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(300);

/// The sentence-embedding folders.
const EMBEDDERS: [&str; 13] = [
    "bert-st-old",
    "bert-st-new",
    "xlmr-st",
    "mpnet-st",
    "distilbert-st",
    "modernbert-st",
    "gte-st",
    "gte-hub-st",
    "nomic-st",
    "nomic-hub-st",
    "nomic-ntk-hub-st",
    "qwen3-st",
    "gemma3-st",
];
/// The cross-encoder folders (new, legacy and 4.x formats; BERT and XLM-R).
const CROSS_ENCODERS: [&str; 4] = [
    "bert-cross-encoder",
    "bert-cross-encoder-legacy",
    "bert-cross-encoder-v4",
    "xlmr-cross-encoder",
];

fn folder(name: &str) -> PathBuf {
    crate_dir().join("tests/data/models").join(name)
}

fn reference(name: &str) -> Vec<Value> {
    std::fs::read_to_string(folder(name).join("reference.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        x => vec![x.as_f64().unwrap() as f32],
    }
}

fn u32s(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// ‖a − b‖ / ‖b‖
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (d / n.max(1e-30)).sqrt()
}

/// What `inspect` says about a folder, as the daemon reads it.
fn info(name: &str) -> ModelInfo {
    let config = replayd::config::Config::parse(&models_toml(&[name], false, "")).unwrap();
    inspect(&config.models[0].spec()).unwrap()
}

/// `[[models]]` entries for `names` (each also as `<name>-raw` with
/// `normalize = false` when `raw`), padded batching with small buckets so
/// that longer texts take the eager path, or `batching` lines.
fn models_toml(names: &[&str], raw: bool, batching: &str) -> String {
    let batching = if batching.is_empty() {
        "batching = \"padded\"\nbatch_buckets = [1, 4]\nseq_buckets = [16, 64]"
    } else {
        batching
    };
    let mut s = String::new();
    for name in names {
        let path = folder(name);
        s.push_str(&format!(
            "[[models]]\nname = \"{name}\"\nkind = \"bert\"\npath = \"{}\"\n{batching}\n\n",
            path.display()
        ));
        if raw {
            s.push_str(&format!(
                "[[models]]\nname = \"{name}-raw\"\nkind = \"bert\"\npath = \"{}\"\nnormalize = false\n{batching}\n\n",
                path.display()
            ));
        }
    }
    s
}

fn daemon_config(models: &str) -> String {
    format!(
        "[batching]\nmax_wait_us = 1000\n\n[devices]\nbackend = \"cpu\"\ncpu_devices = 1\n\n[eager]\nworkers = 1\n\n{models}"
    )
}

/// The prompt the reference applied to a row (its `prompt_name`, else the
/// folder's default), as the frontend resolves it.
fn prompt_use(info: &ModelInfo, row: &Value) -> Option<PromptUse> {
    let p = info.prompts.resolve(row["prompt_name"].as_str()).unwrap()?;
    Some(PromptUse {
        text: p.text.clone(),
        unpooled: info.prompts.exclude_from_pooling.then(|| p.tokens.unwrap()),
    })
}

async fn request(client: &Client, model: &str, payload: Payload, prompt: Option<&str>) -> Vec<f32> {
    let kind = match payload {
        Payload::Pairs(_) => InputKind::Pairs,
        Payload::Ids(_) => InputKind::Ids,
        _ => InputKind::Texts,
    };
    let mut header = RequestHeader::new(client.next_id(), model, kind);
    header.output_dtype = Some(DType::F32);
    header.prompt_name = prompt.map(str::to_string);
    let r = client.request(&header, &payload, T).await.unwrap();
    assert_eq!(
        r.header.status,
        Status::Ok,
        "{model}: {:?}",
        r.header.message
    );
    r.output.unwrap().to_f32_vec().unwrap()
}

/// Token ids, types and prompt lengths of every reference row, from the
/// tokenizer the daemon builds for the folder.
#[test]
fn token_ids_match_sentence_transformers() {
    for name in EMBEDDERS {
        let info = info(name);
        let tok = TextTokenizer::from_spec(info.tokenizer.as_ref().unwrap()).unwrap();
        for row in reference(name) {
            let case = row["case"].as_str().unwrap();
            let text = row["text"].as_str().unwrap().to_string();
            let prompt = prompt_use(&info, &row);
            assert_eq!(
                prompt.as_ref().map(|p| p.text.as_str()),
                row["prompt"].as_str(),
                "{name} {case}: prompt"
            );
            let got = tok
                .encode_request(&TextInput::Texts(vec![text]), true, prompt.as_ref())
                .unwrap()
                .remove(0);
            let ids: Vec<u32> = got.iter().map(|&t| token_id(t)).collect();
            assert_eq!(ids, u32s(&row["ids"]), "{name} {case}: ids");
            assert!(got.iter().all(|&t| token_type(t) == 0), "{name} {case}");
            if info.prompts.exclude_from_pooling {
                let want = row["prompt_length"].as_u64().map_or(0, |n| n as usize);
                let want = if row["prompt"].is_null() { 0 } else { want };
                assert_eq!(unpooled_prefix(&got), want, "{name} {case}: prompt_length");
            }
        }
    }
    for name in CROSS_ENCODERS {
        let info = info(name);
        let tok = TextTokenizer::from_spec(info.tokenizer.as_ref().unwrap()).unwrap();
        for row in reference(name) {
            let case = row["case"].as_str().unwrap();
            let pair = (
                row["pair"][0].as_str().unwrap().to_string(),
                row["pair"][1].as_str().unwrap().to_string(),
            );
            let got = tok
                .encode_request(&TextInput::Pairs(vec![pair]), true, None)
                .unwrap()
                .remove(0);
            let ids: Vec<u32> = got.iter().map(|&t| token_id(t)).collect();
            assert_eq!(ids, u32s(&row["ids"]), "{name} {case}: ids");
            let types: Vec<u32> = got.iter().map(|&t| token_type(t)).collect();
            match row.get("type_ids") {
                Some(t) => assert_eq!(types, u32s(t), "{name} {case}: type_ids"),
                None => assert!(types.iter().all(|&t| t == 0), "{name} {case}"),
            }
        }
    }
}

/// What `inspect` resolved, checked against the README's "Resolved" lines.
#[test]
fn folders_resolve_as_sentence_transformers_does() {
    use replayd::model::{InputSpec, Task};
    let max = |i: &ModelInfo| match i.input {
        InputSpec::Tokens { max_seq_len, .. } => max_seq_len,
        _ => panic!("not a token model"),
    };
    for (name, len, dim) in [
        ("bert-st-old", 256, 32),
        ("bert-st-new", 128, 24),
        ("xlmr-st", 512, 32),
        ("mpnet-st", 384, 32),
        ("distilbert-st", 96, 32),
        ("modernbert-st", 96, 32),
        ("qwen3-st", 64, 32),
        ("gemma3-st", 64, 32),
    ] {
        let i = info(name);
        assert_eq!(
            (max(&i), i.output_dim, i.task),
            (len, dim, Task::Embed),
            "{name}"
        );
    }
    for (name, len, labels) in [
        ("bert-cross-encoder", 64, 1),
        ("bert-cross-encoder-legacy", 512, 1),
        ("bert-cross-encoder-v4", 512, 1),
        ("xlmr-cross-encoder", 512, 3),
    ] {
        let i = info(name);
        assert_eq!(
            (max(&i), i.output_dim, i.task),
            (len, labels, Task::Score { labels }),
            "{name}"
        );
    }
    let new = info("bert-st-new");
    let summary = new.derived_summary();
    for needle in [
        "max_seq_len=128 (tokenizer_config.json model_max_length)",
        "pooling=cls",
        "include_prompt=false",
        "dense=32→24 with bias, torch.nn.modules.activation.Tanh",
        "normalize=L2",
        "default query",
    ] {
        assert!(summary.contains(needle), "{needle:?} not in {summary}");
    }
    assert_eq!(new.prompts.prompts["query"].tokens, Some(3));
    assert_eq!(new.prompts.prompts["instruct"].tokens, Some(18));
    let old = info("bert-st-old").derived_summary();
    for needle in [
        "max_seq_len=256 (sentence_bert_config.json max_seq_length)",
        "lowercase=true",
        "no such folder",
    ] {
        assert!(old.contains(needle), "{needle:?} not in {old}");
    }
    let xlmr = info("xlmr-st").derived_summary();
    assert!(
        xlmr.contains("bounded") || xlmr.contains("max_seq_len=512"),
        "{xlmr}"
    );
    let legacy = info("bert-cross-encoder-legacy").derived_summary();
    assert!(
        legacy.contains("activation=Identity (config.json sbert_ce_default_activation_function)"),
        "{legacy}"
    );
}

/// Every embedding reference row through the daemon (texts with their
/// prompt name), normalised and not; token-id requests where the ids alone
/// determine the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embeddings_match_sentence_transformers_through_the_daemon() {
    let daemon = Daemon::start(&daemon_config(&models_toml(&EMBEDDERS, true, "")));
    let log = daemon.log();
    assert!(
        log.contains("max_seq_len=128 (tokenizer_config.json model_max_length)"),
        "the start-up log says what was read:\n{log}"
    );
    // The stats report the same, per model.
    let stats = daemon.stats();
    let folder = stats["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "bert-st-new")
        .map(|m| m["folder"].clone())
        .unwrap();
    assert!(
        folder
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["key"] == "max_seq_len"
                && d["value"] == "128"
                && d["from"] == "tokenizer_config.json model_max_length"),
        "{folder:#}"
    );
    let client = daemon.client().await;
    for name in EMBEDDERS {
        let info = info(name);
        let rows = reference(name);
        for row in &rows {
            let case = row["case"].as_str().unwrap();
            let text = row["text"].as_str().unwrap().to_string();
            let prompt = row["prompt_name"].as_str();
            let want = floats(&row["embedding"]);
            let got = request(&client, name, Payload::Texts(vec![text.clone()]), prompt).await;
            let c = cosine(&got, &want);
            assert!(c >= 0.9999, "{name} {case}: cosine {c}");
            let raw_want = floats(if row.get("dense").is_some() {
                &row["dense"]
            } else {
                &row["pooled"]
            });
            let raw = request(
                &client,
                &format!("{name}-raw"),
                Payload::Texts(vec![text]),
                prompt,
            )
            .await;
            let (c, e) = (cosine(&raw, &raw_want), rel_l2(&raw, &raw_want));
            assert!(
                c >= 0.9999 && e <= 1e-3,
                "{name} {case} un-normalised: cosine {c}, relative L2 {e}"
            );
            // Ids carry no prompt exclusion: only where none applies.
            if !info.prompts.exclude_from_pooling || row["prompt"].is_null() {
                let got = request(&client, name, Payload::Ids(vec![u32s(&row["ids"])]), None).await;
                let c = cosine(&got, &want);
                assert!(c >= 0.9999, "{name} {case} (ids): cosine {c}");
            }
        }
        // All rows of one prompt in one request: batched (padded buckets
        // and the eager path together), in order.
        let plain: Vec<&Value> = rows.iter().filter(|r| r["prompt_name"].is_null()).collect();
        let texts: Vec<String> = plain
            .iter()
            .map(|r| r["text"].as_str().unwrap().to_string())
            .collect();
        let got = request(&client, name, Payload::Texts(texts), None).await;
        let dim = got.len() / plain.len();
        for (row, got) in plain.iter().zip(got.chunks(dim)) {
            let c = cosine(got, &floats(&row["embedding"]));
            assert!(c >= 0.9999, "{name} {} (batched): cosine {c}", row["case"]);
        }
    }
}

/// The same folders in packed batches (the default for encoders).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn packed_batches_match_too() {
    let daemon = Daemon::start(&daemon_config(&models_toml(
        &EMBEDDERS,
        false,
        "batching = \"packed\"\ntoken_budgets = [64, 256]\nmax_seqs_per_batch = 32",
    )));
    let client = daemon.client().await;
    for name in EMBEDDERS {
        for prompt in [None, Some("query"), Some("document")] {
            let rows: Vec<Value> = reference(name)
                .into_iter()
                .filter(|r| r["prompt_name"].as_str() == prompt)
                .collect();
            if rows.is_empty() {
                continue;
            }
            let texts = rows
                .iter()
                .map(|r| r["text"].as_str().unwrap().to_string())
                .collect();
            let got = request(&client, name, Payload::Texts(texts), prompt).await;
            let dim = got.len() / rows.len();
            for (row, got) in rows.iter().zip(got.chunks(dim)) {
                let c = cosine(got, &floats(&row["embedding"]));
                assert!(c >= 0.9999, "{name} {} (packed): cosine {c}", row["case"]);
            }
        }
    }
}

/// Cross-encoder pairs → scores (the folder's activation applied), one by
/// one and all in one request; bad requests get clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cross_encoder_scores_match_sentence_transformers() {
    let mut models = models_toml(&CROSS_ENCODERS, false, "");
    models.push_str(&models_toml(&["bert-st-old"], false, ""));
    let daemon = Daemon::start(&daemon_config(&models));
    let client = daemon.client().await;
    for name in CROSS_ENCODERS {
        let rows = reference(name);
        let pair = |r: &Value| {
            (
                r["pair"][0].as_str().unwrap().to_string(),
                r["pair"][1].as_str().unwrap().to_string(),
            )
        };
        for row in &rows {
            let got = request(&client, name, Payload::Pairs(vec![pair(row)]), None).await;
            let want = floats(&row["score"]);
            assert_eq!(got.len(), want.len(), "{name} {}", row["case"]);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-4,
                    "{name} {}: {got:?} vs {want:?}",
                    row["case"]
                );
            }
        }
        let all = request(
            &client,
            name,
            Payload::Pairs(rows.iter().map(pair).collect()),
            None,
        )
        .await;
        let labels = all.len() / rows.len();
        for (row, got) in rows.iter().zip(all.chunks(labels)) {
            for (g, w) in got.iter().zip(&floats(&row["score"])) {
                assert!((g - w).abs() <= 1e-4, "{name} {} (batched)", row["case"]);
            }
        }
    }
    // Wrong input kinds and unknown prompt names are refused by name.
    let refuse = |model: &str, payload: Payload, prompt: Option<&str>| {
        let kind = match payload {
            Payload::Pairs(_) => InputKind::Pairs,
            _ => InputKind::Texts,
        };
        let mut header = RequestHeader::new(client.next_id(), model, kind);
        header.prompt_name = prompt.map(str::to_string);
        let client = &client;
        async move {
            let r = client.request(&header, &payload, T).await.unwrap();
            assert_ne!(r.header.status, Status::Ok);
            r.header.message.unwrap_or_default()
        }
    };
    let m = refuse("bert-cross-encoder", Payload::Texts(vec!["a".into()]), None).await;
    assert!(m.contains("cross-encoder") && m.contains("pairs"), "{m}");
    let m = refuse(
        "bert-st-old",
        Payload::Pairs(vec![("a".into(), "b".into())]),
        None,
    )
    .await;
    assert!(m.contains("pairs"), "{m}");
    let m = refuse(
        "bert-st-old",
        Payload::Texts(vec!["a".into()]),
        Some("nope"),
    )
    .await;
    assert!(m.contains("nope") && m.contains("query"), "{m}");
}

/// Folders replayd cannot serve exactly fail start-up, naming the
/// architecture or module and the file.
#[test]
fn unsupported_folders_fail_at_startup_naming_what() {
    for (name, needles) in [
        (
            "unsupported-arch",
            &["gpt2", "GPT2Model", "config.json"][..],
        ),
        ("unsupported-module", &["LayerNorm", "modules.json"][..]),
        ("gemma3-f16", &["f16", "Gemma 3", "bf16"][..]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let models = match name {
            // Gemma 3's activations overflow f16: refused with the reason.
            "gemma3-f16" => format!(
                "[[models]]\nname = \"g\"\nkind = \"bert\"\npath = \"{}\"\ndtype = \"f16\"\n",
                folder("gemma3-st").display()
            ),
            _ => models_toml(&[name], false, ""),
        };
        let config = format!(
            "[server]\nendpoint = \"tcp://127.0.0.1:0\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\nruntime_dir = \"{}\"\n{}",
            dir.path().join("run").display(),
            daemon_config(&models)
        );
        let (status, log) = Daemon::start_failing(&config);
        assert!(!status.success(), "{name} started");
        for needle in needles {
            assert!(log.contains(needle), "{name}: {needle:?} not in\n{log}");
        }
    }
}

/// A DistilBERT cross-encoder's head (pre_classifier + ReLU) is not BERT's
/// tanh pooler: refused by name rather than run as if it were.
#[test]
fn distilbert_cross_encoders_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(folder("distilbert-st")).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(folder("distilbert-st").join("config.json")).unwrap(),
    )
    .unwrap();
    config["architectures"] = serde_json::json!(["DistilBertForSequenceClassification"]);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let toml = format!(
        "[[models]]\nname = \"d\"\nkind = \"bert\"\npath = \"{}\"\n",
        dir.path().display()
    );
    let parsed = replayd::config::Config::parse(&toml).unwrap();
    let e = inspect(&parsed.models[0].spec()).unwrap_err().to_string();
    assert!(
        e.contains("DistilBertForSequenceClassification") && e.contains("not served"),
        "{e}"
    );
}

/// nomic-embed-text's Matryoshka recipe for NomicBERT folders: LayerNorm
/// without affine over the whole embedding, then the cut, then L2 (the
/// LayerNorm's scale is undone by the L2, so the reference is computed from
/// the normalised embedding); other families only cut (and re-normalise).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nomic_dimensions_follow_its_recipe() {
    let daemon = Daemon::start(&daemon_config(&models_toml(
        &["nomic-st", "gte-st"],
        false,
        "",
    )));
    let client = daemon.client().await;
    for name in ["nomic-st", "gte-st"] {
        for row in reference(name)
            .iter()
            .filter(|r| r["prompt_name"].is_null())
            .take(6)
        {
            let mut header = RequestHeader::new(client.next_id(), name, InputKind::Texts);
            header.dimensions = Some(16);
            let payload = Payload::Texts(vec![row["text"].as_str().unwrap().to_string()]);
            let r = client.request(&header, &payload, T).await.unwrap();
            assert_eq!(r.header.status, Status::Ok, "{:?}", r.header.message);
            let got = r.output.unwrap().to_f32_vec().unwrap();
            assert_eq!(got.len(), 16);
            let full = floats(&row["embedding"]);
            let mean = if name == "nomic-st" {
                full.iter().map(|v| *v as f64).sum::<f64>() / full.len() as f64
            } else {
                0.0
            };
            let cut: Vec<f32> = full[..16]
                .iter()
                .map(|v| (*v as f64 - mean) as f32)
                .collect();
            let c = cosine(&got, &cut);
            assert!(c >= 0.9999, "{name} {}: cosine {c}", row["case"]);
            let norm: f64 = got.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{name}: norm {norm}");
        }
    }
}

/// EmbeddingGemma's Matryoshka dimensions: the first values of the
/// embedding, normalised again (sentence-transformers' `truncate_dim`, the
/// reference's `truncated`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gemma_dimensions_match_sentence_transformers_truncation() {
    let name = "gemma3-st";
    let daemon = Daemon::start(&daemon_config(&models_toml(&[name], false, "")));
    let client = daemon.client().await;
    let rows: Vec<Value> = reference(name)
        .into_iter()
        .filter(|r| r.get("truncated").is_some())
        .collect();
    assert!(!rows.is_empty(), "the reference has truncated rows");
    for row in &rows {
        for (dims, want) in row["truncated"].as_object().unwrap() {
            let dims: usize = dims.parse().unwrap();
            let mut header = RequestHeader::new(client.next_id(), name, InputKind::Texts);
            header.dimensions = Some(dims as u32);
            header.prompt_name = row["prompt_name"].as_str().map(str::to_string);
            let payload = Payload::Texts(vec![row["text"].as_str().unwrap().to_string()]);
            let r = client.request(&header, &payload, T).await.unwrap();
            assert_eq!(r.header.status, Status::Ok, "{:?}", r.header.message);
            let got = r.output.unwrap().to_f32_vec().unwrap();
            assert_eq!(got.len(), dims);
            let c = cosine(&got, &floats(want));
            assert!(c >= 0.9999, "{} at {dims}: cosine {c}", row["case"]);
        }
    }
}

/// A decoder's (causal, last-token) embedding of a text does not depend on
/// its batch-mates: alone, and padded or packed beside longer and shorter
/// texts, within 1e-5.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decoder_embeddings_do_not_depend_on_batch_mates() {
    let mut toml = models_toml(&["qwen3-st"], false, "");
    toml.push_str(&models_toml(&["gemma3-st"], false, ""));
    let packed = "batching = \"packed\"\ntoken_budgets = [64, 256]\nmax_seqs_per_batch = 32";
    toml.push_str(
        &models_toml(&["qwen3-st"], false, packed)
            .replace("\"qwen3-st\"\nkind", "\"qwen3-packed\"\nkind"),
    );
    toml.push_str(
        &models_toml(&["gemma3-st"], false, packed)
            .replace("\"gemma3-st\"\nkind", "\"gemma3-packed\"\nkind"),
    );
    let daemon = Daemon::start(&daemon_config(&toml));
    let client = daemon.client().await;
    for (model, folder_name) in [
        ("qwen3-st", "qwen3-st"),
        ("gemma3-st", "gemma3-st"),
        ("qwen3-packed", "qwen3-st"),
        ("gemma3-packed", "gemma3-st"),
    ] {
        let texts: Vec<String> = reference(folder_name)
            .iter()
            .filter(|r| r["prompt_name"].is_null())
            .map(|r| r["text"].as_str().unwrap().to_string())
            .collect();
        let all = request(&client, model, Payload::Texts(texts.clone()), None).await;
        let dim = all.len() / texts.len();
        for (i, text) in texts.iter().enumerate() {
            let alone = request(&client, model, Payload::Texts(vec![text.clone()]), None).await;
            let diff = alone
                .iter()
                .zip(&all[i * dim..(i + 1) * dim])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-5, "{model} text {i}: moved {diff} beside others");
        }
    }
}

/// NomicBERT's dynamic NTK is decided per sequence: a short text's
/// embedding is the same (≤ 1e-5) alone and padded or packed beside a long
/// one, whose own length would give a different base.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamic_ntk_does_not_depend_on_batch_mates() {
    let name = "nomic-ntk-hub-st";
    let mut toml = models_toml(
        &[name],
        false,
        "batching = \"padded\"\nbatch_buckets = [1, 2]\nseq_buckets = [96]",
    );
    toml.push_str(
        &models_toml(
            &[name],
            false,
            "batching = \"packed\"\ntoken_budgets = [256]\nmax_seqs_per_batch = 8",
        )
        .replacen(&format!("name = \"{name}\""), "name = \"packed\"", 1),
    );
    let daemon = Daemon::start(&daemon_config(&toml));
    let client = daemon.client().await;
    let rows = reference(name);
    let short = rows.iter().find(|r| r["case"] == "ordinary-1").unwrap();
    let long = rows
        .iter()
        .find(|r| r["case"] == "exactly-max-length")
        .unwrap();
    let text = |r: &Value| r["text"].as_str().unwrap().to_string();
    for model in [name, "packed"] {
        let alone = request(&client, model, Payload::Texts(vec![text(short)]), None).await;
        let both = request(
            &client,
            model,
            Payload::Texts(vec![text(short), text(long)]),
            None,
        )
        .await;
        let dim = alone.len();
        let diff = alone
            .iter()
            .zip(&both[..dim])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff <= 1e-5,
            "{model}: the short text moved by {diff} beside a long one"
        );
        let c = cosine(&both[dim..], &floats(&long["embedding"]));
        assert!(c >= 0.9999, "{model}: the long text: cosine {c}");
    }
}
