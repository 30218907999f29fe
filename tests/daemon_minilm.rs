//! Sentence embeddings served by the daemon on the CPU backend, checked
//! against the sentence-transformers reference (`tests/data/minilm_set_a.jsonl`).

mod common;

use bytes::Bytes;
use common::{cosine, crate_dir, data, minilm_dir, Daemon, Rng};
use replayd::protocol::client::{Client, RawClient};
use replayd::protocol::{ErrorCode, InputKind, Payload, RequestHeader, Status};
use replayd::tensor::DType;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(300);

struct Line {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn reference() -> Vec<Line> {
    std::fs::read_to_string(data("minilm_set_a.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            Line {
                text: v["text"].as_str().unwrap().to_string(),
                ids: serde_json::from_value(v["ids"].clone()).unwrap(),
                embedding: serde_json::from_value(v["embedding"].clone()).unwrap(),
            }
        })
        .collect()
}

/// Seq buckets stop at 128 so texts of 129..256 tokens take the eager path.
/// Padded batching, whatever the default (these tests are about its buckets).
fn config(extra: &str) -> String {
    config_batched("batching = \"padded\"", extra)
}

/// The same daemon with `batching` lines of the caller's choosing.
fn config_batched(batching: &str, extra: &str) -> String {
    format!(
        r#"
[batching]
max_wait_us = 2000

[devices]
backend = "cpu"
cpu_devices = 1

[eager]
workers = 1

[[models]]
name = "minilm"
kind = "bert"
path = "{}"
batch_buckets = [1, 2, 4, 8, 16, 32]
seq_buckets = [16, 32, 64, 128]
{batching}
{extra}
"#,
        minilm_dir().display()
    )
}

/// Whether this build can capture packed MiniLM graphs (the backend half of
/// padding-free batching); until it can, the tests written for packed
/// batching run padded and check what holds in both modes.
fn packed_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let cfg = replayd::config::Config::parse(&config("")).unwrap();
        let model = replayd::model::Model::load(&cfg.models[0].spec()).unwrap();
        let ok = model
            .program_for(replayd::bucket::Bucket::packed(64, 64))
            .is_ok();
        eprintln!("packed MiniLM programs available: {ok}");
        ok
    })
}

/// Packed batching when this build has it (small budgets, so that capture
/// on the CPU is quick), padded otherwise.
fn packed_or_padded() -> (bool, &'static str) {
    if packed_available() {
        (
            true,
            "batching = \"packed\"\ntoken_budgets = [64, 256, 1024]\nmax_seqs_per_batch = 256",
        )
    } else {
        (false, "batching = \"padded\"")
    }
}

async fn embed(client: &Client, texts: &[&str]) -> Vec<Vec<f32>> {
    let r = client.embed("minilm", texts, DType::F32, T).await.unwrap();
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header.message);
    let out = r.output.unwrap();
    assert_eq!(out.shape, vec![texts.len(), 384]);
    out.to_f32_vec()
        .unwrap()
        .chunks(384)
        .map(<[f32]>::to_vec)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Every reference text, served over the socket through the batcher, in
/// several groupings: ids identical, cosine ≥ 0.9999 with sentence-transformers,
/// and the same embedding (1e-5) whatever the grouping or bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reference_set_matches_sentence_transformers_in_every_grouping() {
    let lines = Arc::new(reference());
    let daemon = Daemon::start(&config(""));
    let client = Arc::new(daemon.client().await);

    // Token ids, through the daemon's own tokenizer (ids requests echo nothing,
    // so check via the tokenizer the daemon loads).
    let tokenizer = replayd::daemon::tokenize::TextTokenizer::load(&minilm_dir(), 256).unwrap();
    for (i, line) in lines.iter().enumerate() {
        let ids = tokenizer.encode(&[line.text.as_str()], true).unwrap();
        assert_eq!(ids[0], line.ids, "line {i}: {:?}", line.text);
    }

    // Grouping 1: one request per text, all pipelined.
    let mut tasks = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let client = client.clone();
        let text = line.text.clone();
        tasks.push(tokio::spawn(async move {
            (i, embed(&client, &[&text]).await.remove(0))
        }));
    }
    let mut single: HashMap<usize, Vec<f32>> = HashMap::new();
    for t in tasks {
        let (i, e) = t.await.unwrap();
        single.insert(i, e);
    }
    let mut worst = 1.0f64;
    for (i, line) in lines.iter().enumerate() {
        let c = cosine(&single[&i], &line.embedding);
        worst = worst.min(c);
        assert!(c >= 0.9999, "line {i} {:?}: cosine {c}", line.text);
    }
    eprintln!("worst cosine over {} texts: {worst:.7}", lines.len());

    // Grouping 2: requests of 8 texts in order.
    for (chunk_i, chunk) in lines.chunks(8).enumerate() {
        let texts: Vec<&str> = chunk.iter().map(|l| l.text.as_str()).collect();
        for (j, e) in embed(&client, &texts).await.iter().enumerate() {
            let i = chunk_i * 8 + j;
            let d = max_abs_diff(e, &single[&i]);
            assert!(d <= 1e-5, "line {i} differs by {d} when grouped by 8");
        }
    }

    // Grouping 3: shuffled, in requests of random size, mixed with long texts.
    let mut rng = Rng::new(11);
    let mut order: Vec<usize> = (0..lines.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i + 1));
    }
    let long = "a much longer sentence about graphs and buckets and padding ".repeat(12);
    let mut pos = 0;
    while pos < order.len() {
        let n = rng.range(1, 6).min(order.len() - pos);
        let idx = &order[pos..pos + n];
        let mut texts: Vec<&str> = idx.iter().map(|&i| lines[i].text.as_str()).collect();
        texts.push(&long);
        let out = embed(&client, &texts).await;
        for (k, &i) in idx.iter().enumerate() {
            let d = max_abs_diff(&out[k], &single[&i]);
            assert!(
                d <= 1e-5,
                "line {i} differs by {d} when shuffled with a long text"
            );
        }
        pos += n;
    }

    let stats = daemon.stats();
    assert!(
        stats["eager"]["requests"].as_u64().unwrap() > 0,
        "long texts went eager"
    );
    let buckets: Vec<&str> = stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["bucket"].as_str().unwrap())
        .collect();
    assert!(buckets.len() >= 4, "several buckets were used: {buckets:?}");
}

/// Texts longer than the largest seq bucket (128 here) but within the
/// model's 256 run eagerly with the same accuracy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_texts_take_the_eager_path_accurately() {
    let lines = reference();
    let daemon = Daemon::start(&config(""));
    let client = daemon.client().await;
    let long: Vec<&Line> = lines.iter().filter(|l| l.ids.len() > 128).collect();
    assert!(!long.is_empty());
    for line in long.iter().take(6) {
        let r = client
            .embed("minilm", &[&line.text], DType::F32, T)
            .await
            .unwrap();
        assert_eq!(r.header.bucket.as_deref(), Some("eager"));
        let e = r.output.unwrap().to_f32_vec().unwrap();
        let c = cosine(&e, &line.embedding);
        assert!(c >= 0.9999, "{} tokens: cosine {c}", line.ids.len());
    }
    let stats = daemon.stats();
    assert_eq!(
        stats["eager"]["by_reason"]["seq_too_long"]
            .as_u64()
            .unwrap(),
        long.len().min(6) as u64
    );
}

/// f16 output on request; pre-tokenized ids give the same embedding as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_requests_and_f16_output() {
    let lines = reference();
    let daemon = Daemon::start(&config(""));
    let client = daemon.client().await;
    let line = &lines[5];
    let mut h = RequestHeader::new(1, "minilm", InputKind::Ids);
    h.output_dtype = Some(DType::F16);
    let r = client
        .request(&h, &Payload::Ids(vec![line.ids.clone()]), T)
        .await
        .unwrap();
    let out = r.output.unwrap();
    assert_eq!((out.dtype, out.shape.clone()), (DType::F16, vec![1, 384]));
    assert!(cosine(&out.to_f32_vec().unwrap(), &line.embedding) >= 0.9999);
}

async fn expect(raw: &mut RawClient, frames: Vec<Bytes>, code: ErrorCode, needle: &str) {
    raw.send(frames).await.unwrap();
    let r = raw.recv_reply(T).await.unwrap();
    assert_eq!(r.header.code, Some(code), "{:?}", r.header.message);
    let msg = r.header.message.unwrap_or_default();
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
}

fn head(h: &RequestHeader) -> Bytes {
    Bytes::from(rmp_serde::to_vec_named(h).unwrap())
}

/// Bad text inputs get clear errors; the daemon keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_text_inputs_get_clear_errors() {
    let daemon = Daemon::start_with(&config(""), "max_items_per_request = 4");
    let mut raw = RawClient::connect(&daemon.endpoint).await.unwrap();
    let texts = RequestHeader::new(1, "minilm", InputKind::Texts);
    expect(
        &mut raw,
        vec![
            head(&texts),
            Bytes::from_static(b"fine"),
            Bytes::from_static(b"\xc3\x28"),
        ],
        ErrorCode::BadRequest,
        "text 1 is not valid UTF-8",
    )
    .await;
    expect(
        &mut raw,
        vec![head(&texts)],
        ErrorCode::BadRequest,
        "no texts",
    )
    .await;
    expect(
        &mut raw,
        vec![head(&texts); 6]
            .into_iter()
            .enumerate()
            .map(|(i, h)| if i == 0 { h } else { Bytes::from_static(b"x") })
            .collect(),
        ErrorCode::BadRequest,
        "limit of 4",
    )
    .await;
    let ids = RequestHeader::new(2, "minilm", InputKind::Ids);
    let bad_id: Vec<u8> = [101u32, 40000, 102]
        .iter()
        .flat_map(|i| i.to_le_bytes())
        .collect();
    expect(
        &mut raw,
        vec![head(&ids), Bytes::from(bad_id)],
        ErrorCode::BadRequest,
        "outside the vocabulary",
    )
    .await;
    let mut strict = RequestHeader::new(3, "minilm", InputKind::Texts);
    strict.truncate = false;
    let long = "word ".repeat(400);
    expect(
        &mut raw,
        vec![head(&strict), Bytes::from(long)],
        ErrorCode::TooLong,
        "maximum of 256",
    )
    .await;
    let mut tensor = RequestHeader::new(4, "minilm", InputKind::Tensor);
    tensor.dtype = Some(DType::F32);
    tensor.shape = Some(vec![1, 4]);
    expect(
        &mut raw,
        vec![head(&tensor), Bytes::from(vec![0u8; 16])],
        ErrorCode::BadRequest,
        "takes input \"texts\" or \"ids\"",
    )
    .await;

    raw.send(vec![head(&texts), Bytes::from_static(b"still serving")])
        .await
        .unwrap();
    assert_eq!(raw.recv_reply(T).await.unwrap().header.status, Status::Ok);
}

/// A model folder with a missing or corrupt file fails start-up with a
/// message naming the file.
#[test]
fn broken_model_folders_fail_at_startup_naming_the_file() {
    let src = minilm_dir();
    for (broken, needle) in [
        ("tokenizer.json", "tokenizer.json"),
        ("model.safetensors", "model.safetensors"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "modules.json",
            "sentence_bert_config.json",
            // modules.json lists the Pooling module: its config must exist.
            "1_Pooling",
        ] {
            std::os::unix::fs::symlink(src.join(f), dir.path().join(f)).unwrap();
        }
        std::fs::remove_file(dir.path().join(broken)).unwrap();
        if broken == "model.safetensors" {
            // Corrupt rather than missing: a truncated file.
            let bytes = std::fs::read(src.join(broken)).unwrap();
            std::fs::write(dir.path().join(broken), &bytes[..1000]).unwrap();
        }
        let cfg = config("").replace(
            &minilm_dir().display().to_string(),
            &dir.path().display().to_string(),
        );
        let (status, log) = Daemon::start_failing(&cfg);
        assert!(!status.success());
        assert!(log.contains(needle), "{broken}: {log}");
    }
}

/// The README's fetch step, on a machine that has never seen the model:
/// fetch into an empty folder, then serve from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_script_fetches_a_model_that_then_serves() {
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("all-MiniLM-L6-v2");
    let status = std::process::Command::new(crate_dir().join("scripts/dev/fetch-model.sh"))
        .arg(&dest)
        .status()
        .unwrap();
    assert!(status.success());
    let cfg = config("").replace(
        &minilm_dir().display().to_string(),
        &dest.display().to_string(),
    );
    let daemon = Daemon::start(&cfg);
    let client = daemon.client().await;
    let lines = reference();
    let e = embed(&client, &[&lines[3].text]).await;
    assert!(cosine(&e[0], &lines[3].embedding) >= 0.9999);
}

/// One request of 1,000 texts (more than 30 of the largest batch) runs in
/// graph batches, not eagerly, and its reply has every embedding in request
/// order. Packed when this build can capture packed graphs, else padded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_texts_in_one_request_run_in_graph_batches_in_order() {
    let lines = reference();
    let (packed, batching) = packed_or_padded();
    let daemon = Daemon::start(&config_batched(batching, ""));
    let client = daemon.client().await;
    // Short texts (at most 16 tokens) keep the 2-core CPU busy for seconds.
    let short: Vec<&Line> = lines.iter().filter(|l| l.ids.len() <= 16).collect();
    let picked: Vec<&Line> = (0..1000).map(|i| short[(i * 7) % short.len()]).collect();
    let texts: Vec<&str> = picked.iter().map(|l| l.text.as_str()).collect();
    let r = client.embed("minilm", &texts, DType::F32, T).await.unwrap();
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header.message);
    let batches = r.header.batches.unwrap() as usize;
    // At most 32 texts (padded) or 1024 tokens (packed) per batch.
    let tokens: usize = picked.iter().map(|l| l.ids.len()).sum();
    let least = if packed {
        tokens.div_ceil(1024)
    } else {
        1000usize.div_ceil(32)
    };
    assert!(batches >= least, "{batches} batches");
    let bucket = r.header.bucket.clone().unwrap();
    assert_ne!(bucket, "eager");
    assert_eq!(bucket.ends_with('t'), packed, "{bucket}");
    let out = r.output.unwrap();
    assert_eq!(out.shape, vec![1000, 384]);
    for (i, (row, line)) in out
        .to_f32_vec()
        .unwrap()
        .chunks(384)
        .zip(&picked)
        .enumerate()
    {
        let c = cosine(row, &line.embedding);
        assert!(c >= 0.9999, "row {i} ({:?}): cosine {c}", line.text);
    }
    let stats = daemon.stats();
    assert_eq!(stats["eager"]["requests"], 0);
    assert_eq!(stats["eager"]["sequences"], 0);
    assert_eq!(daemon.device("eager:0")["batches"], 0);
    let rows: u64 = stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["rows"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 1000);
    assert_eq!(stats["requests"]["split"], 1);
    assert_eq!(
        stats["models"][0]["batching"],
        if packed { "packed" } else { "padded" }
    );
    let waste = stats["padding"]["padding_waste"].as_f64().unwrap();
    eprintln!("1000 texts: {batches} batches, padding waste {waste:.3}");
    if packed {
        assert!(waste < 0.1, "packed padding waste {waste}");
    }
}

/// The texts of one request are not padded to its longest: each runs in the
/// seq bucket that holds it (padded), and the reply names the largest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_text_of_a_request_runs_in_its_own_seq_bucket() {
    let lines = reference();
    let daemon = Daemon::start(&config(""));
    let client = daemon.client().await;
    let pick = |lo: usize, hi: usize| {
        lines
            .iter()
            .find(|l| (lo..=hi).contains(&l.ids.len()))
            .unwrap()
    };
    let chosen = [pick(3, 16), pick(33, 64), pick(17, 32), pick(4, 16)];
    let texts: Vec<&str> = chosen.iter().map(|l| l.text.as_str()).collect();
    let r = client.embed("minilm", &texts, DType::F32, T).await.unwrap();
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header.message);
    assert_eq!(r.header.bucket.as_deref(), Some("1x64"));
    assert_eq!(r.header.batches, Some(3));
    let out = r.output.unwrap().to_f32_vec().unwrap();
    for (row, line) in out.chunks(384).zip(chosen) {
        assert!(cosine(row, &line.embedding) >= 0.9999);
    }
    let stats = daemon.stats();
    let mut used: Vec<(String, u64)> = stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["bucket"].as_str().unwrap().to_string(),
                b["rows"].as_u64().unwrap(),
            )
        })
        .collect();
    used.sort();
    assert_eq!(
        used,
        vec![("1x32".into(), 1), ("1x64".into(), 1), ("2x16".into(), 2)]
    );
    // Computed tokens: 2·16 + 32 + 64, not 4·64.
    let computed: u64 = stats["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["computed_tokens"].as_u64().unwrap())
        .sum();
    assert_eq!(computed, 128);
}

/// The reference embedding cut to `d` values and normalised again.
fn cut(line: &Line, d: usize) -> Vec<f32> {
    let v = &line.embedding[..d];
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / norm).collect()
}

/// Matryoshka: `dimensions` keeps the first values of each embedding and
/// normalises them again (MiniLM normalises); a folder's `truncate_dim` is
/// the default a request can widen; widths out of range are bad requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dimensions_cut_and_renormalise_embeddings() {
    use replayd::protocol::client::{Call, Error};
    let lines = reference();
    // MiniLM again, its folder saying truncate_dim = 128.
    let folder = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(minilm_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config_sentence_transformers.json" {
            std::os::unix::fs::symlink(entry.path(), folder.path().join(entry.file_name()))
                .unwrap();
        }
    }
    let st = minilm_dir().join("config_sentence_transformers.json");
    let mut st: Value = serde_json::from_str(&std::fs::read_to_string(st).unwrap()).unwrap();
    st["truncate_dim"] = 128.into();
    std::fs::write(
        folder.path().join("config_sentence_transformers.json"),
        st.to_string(),
    )
    .unwrap();
    let second = format!(
        "\n[[models]]\nname = \"minilm-128\"\nkind = \"bert\"\npath = \"{}\"\nbatch_buckets = [1, 4]\nseq_buckets = [16, 64, 128]\n",
        folder.path().display()
    );
    let daemon = Daemon::start(&config(&second));
    let client = daemon.client().await;
    let some = &lines[10..14];
    let texts = || some.iter().map(|l| l.text.clone()).collect::<Vec<_>>();
    let rows = |out: &replayd::tensor::HostTensor| {
        let v = out.to_f32_vec().unwrap();
        let w = out.shape[1];
        v.chunks(w).map(<[f32]>::to_vec).collect::<Vec<_>>()
    };
    for (model, dims, want) in [
        ("minilm", Some(64), 64),
        ("minilm", Some(1), 1),
        ("minilm-128", None, 128),
        ("minilm-128", Some(384), 384),
        ("minilm-128", Some(16), 16),
    ] {
        let mut call = Call::texts(model, texts());
        if let Some(d) = dims {
            call = call.dimensions(d);
        }
        let out = client.call(call).await.unwrap().tensor;
        assert_eq!(out.shape, vec![some.len(), want], "{model} {dims:?}");
        for (row, line) in rows(&out).iter().zip(some) {
            let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{model} {dims:?}: norm {norm}");
            let c = cosine(row, &cut(line, want));
            assert!(c >= 0.9999, "{model} {dims:?}: cosine {c}");
        }
    }
    for d in [0, 385] {
        let e = client
            .call(Call::texts("minilm", texts()).dimensions(d))
            .await
            .unwrap_err();
        match e {
            Error::Server { code, message, .. } => {
                assert_eq!(code, ErrorCode::BadRequest);
                assert!(message.contains("ask for 1 to 384"), "{message}");
            }
            other => panic!("dimensions {d}: {other}"),
        }
    }
}
