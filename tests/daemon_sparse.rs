//! SPLADE sparse encoders (`SparseEncoder` folders) served by the daemon on
//! the CPU backend, against the sentence-transformers references beside
//! them (`tests/data/models/splade-*/reference.jsonl`):
//!
//! * every case's non-zero entries: the same indices wherever the value
//!   exceeds 1e-3 of the row's largest, values within 1e-3 relative — one
//!   text a request, all in one request (padded buckets and the eager path),
//!   and in packed batches; a text's row does not depend on its batch-mates;
//! * `top_k` keeps each row's largest entries;
//! * the errors a sparse model gives (`dimensions`, `top_k = 0`, a dense
//!   call) and the one a dense model gives for `top_k`;
//! * `POST /embed_sparse` (TEI's shape) and `/info`'s model type, and the
//!   OpenAI route's refusal.

mod common;

use common::{http_json, Daemon};
use replayd::protocol::client::{Call, Client};
use replayd::protocol::{ErrorCode, InputKind, Payload, RequestHeader, SparseRows, Status};
use replayd::tensor::DType;
use serde_json::{json, Value};
use std::time::Duration;

const T: Duration = Duration::from_secs(300);
const FOLDERS: [&str; 2] = ["splade-st", "splade-distilbert-st"];

fn reference(name: &str) -> Vec<Value> {
    std::fs::read_to_string(common::data("models").join(name).join("reference.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn model_toml(name: &str, batching: &str) -> String {
    format!(
        "[[models]]\nname = \"{name}\"\nkind = \"bert\"\npath = \"{}\"\n{batching}\n\n",
        common::data("models").join(name).display()
    )
}

/// Checks one row against a reference row (the rule for sparse
/// outputs), returning a description of the first difference.
fn check(got: (&[u32], &[f32]), want: &Value) -> Result<(), String> {
    let w_idx: Vec<u32> = serde_json::from_value(want["indices"].clone()).unwrap();
    let w_val: Vec<f32> = serde_json::from_value(want["values"].clone()).unwrap();
    let max = w_val.iter().cloned().fold(0.0f32, f32::max);
    let (g_idx, g_val) = got;
    let big = |idx: &[u32], val: &[f32]| -> Vec<u32> {
        idx.iter()
            .zip(val)
            .filter(|(_, v)| **v > 1e-3 * max)
            .map(|(i, _)| *i)
            .collect()
    };
    // Entries near the threshold may fall either side of it.
    let near = |i: u32| {
        let v = w_idx.iter().position(|&x| x == i).map_or(0.0, |p| w_val[p]);
        (v - 1e-3 * max).abs() <= 2e-3 * max
    };
    let (gb, wb) = (big(g_idx, g_val), big(&w_idx, &w_val));
    if let Some(i) = gb
        .iter()
        .chain(&wb)
        .find(|i| gb.contains(i) != wb.contains(i) && !near(**i))
    {
        return Err(format!(
            "index {i} is above 1e-3 of the maximum in one row only"
        ));
    }
    for (i, v) in g_idx.iter().zip(g_val) {
        if let Some(p) = w_idx.iter().position(|x| x == i) {
            let rel = (v - w_val[p]).abs() / w_val[p].max(1e-3 * max);
            if rel > 1e-3 {
                return Err(format!(
                    "index {i}: {v} against {} ({rel:.2e} relative)",
                    w_val[p]
                ));
            }
        } else if *v > 1e-3 * max {
            return Err(format!("index {i}: {v}, absent from the reference"));
        }
    }
    Ok(())
}

async fn sparse(
    client: &Client,
    model: &str,
    texts: Vec<String>,
    top_k: Option<u32>,
) -> SparseRows {
    let mut call = Call::texts(model, texts);
    if let Some(k) = top_k {
        call = call.top_k(k);
    }
    client.call_sparse(call.timeout(T)).await.unwrap().rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sparse_rows_match_sentence_transformers() {
    let padded = "batching = \"padded\"\nbatch_buckets = [1, 4]\nseq_buckets = [16, 64]";
    let packed = "batching = \"packed\"\ntoken_budgets = [64, 256]\nmax_seqs_per_batch = 32";
    let mut models = String::new();
    for name in FOLDERS {
        models.push_str(&model_toml(name, padded));
        models.push_str(&model_toml(name, packed).replacen(
            &format!("name = \"{name}\""),
            &format!("name = \"{name}-packed\""),
            1,
        ));
    }
    let daemon = Daemon::start(&format!(
        "[batching]\nmax_wait_us = 1000\n\n[devices]\nbackend = \"cpu\"\ncpu_devices = 1\n\n[eager]\nworkers = 1\n\n{models}"
    ));
    let client = daemon.client().await;
    for name in FOLDERS {
        let rows = reference(name);
        let texts: Vec<String> = rows
            .iter()
            .map(|r| r["text"].as_str().unwrap().to_string())
            .collect();
        // One text a request.
        for (row, text) in rows.iter().zip(&texts) {
            let got = sparse(&client, name, vec![text.clone()], None).await;
            assert_eq!(got.rows(), 1);
            check(got.row(0), row).unwrap_or_else(|e| panic!("{name} {}: {e}", row["case"]));
        }
        // All in one request, padded (and eager) then packed: the same rows.
        for model in [name.to_string(), format!("{name}-packed")] {
            let got = sparse(&client, &model, texts.clone(), None).await;
            assert_eq!(got.rows(), rows.len());
            for (r, row) in rows.iter().enumerate() {
                check(got.row(r), row)
                    .unwrap_or_else(|e| panic!("{model} {} (batched): {e}", row["case"]));
            }
        }
        // top_k: the k largest entries of the reference, in index order.
        let k = 5;
        let got = sparse(&client, name, vec![texts[0].clone()], Some(k)).await;
        let (idx, _) = got.row(0);
        assert_eq!(idx.len(), k as usize);
        let w_idx: Vec<u32> = serde_json::from_value(rows[0]["indices"].clone()).unwrap();
        let w_val: Vec<f32> = serde_json::from_value(rows[0]["values"].clone()).unwrap();
        let mut order: Vec<usize> = (0..w_idx.len()).collect();
        order.sort_by(|&a, &b| w_val[b].total_cmp(&w_val[a]));
        let mut want: Vec<u32> = order[..k as usize].iter().map(|&p| w_idx[p]).collect();
        want.sort();
        assert_eq!(idx, &want[..], "{name}: top_k {k}");
        // f16 values: the same entries, rounded.
        let mut call = Call::texts(name, vec![texts[0].clone()]).output_dtype(DType::F16);
        call = call.timeout(T);
        let half = client.call_sparse(call).await.unwrap();
        assert_eq!(half.header.dtype, Some(DType::F16));
        let (hi, hv) = half.rows.row(0);
        assert_eq!(hi, &w_idx[..], "{name}: f16 reply's indices");
        for (v, w) in hv.iter().zip(&w_val) {
            assert!(
                (v - w).abs() <= 1e-3 * w.abs().max(1e-3),
                "{name} f16: {v} vs {w}"
            );
        }
    }

    // Errors.
    let name = FOLDERS[0];
    let bad = |header: RequestHeader, needle: &'static str| {
        let client = &client;
        async move {
            let payload = Payload::Texts(vec!["a text".into()]);
            let r = client.request(&header, &payload, T).await.unwrap();
            assert_eq!(r.header.status, Status::Error);
            assert_eq!(r.header.code, Some(ErrorCode::BadRequest));
            let m = r.header.message.unwrap_or_default();
            assert!(m.contains(needle), "{m} (expected {needle:?})");
        }
    };
    let mut h = RequestHeader::new(client.next_id(), name, InputKind::Texts);
    h.dimensions = Some(8);
    bad(h, "sparse encoder").await;
    let mut h = RequestHeader::new(client.next_id(), name, InputKind::Texts);
    h.top_k = Some(0);
    bad(h, "`top_k` = 0").await;
    let e = client
        .call(Call::texts(name, ["a text"]).timeout(T))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("call_sparse"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embed_sparse_over_http() {
    let models = [
        model_toml(
            "splade-st",
            "batching = \"padded\"\nbatch_buckets = [1, 4]\nseq_buckets = [16, 128]",
        )
        .replacen("name = \"splade-st\"", "name = \"splade\"", 1),
        format!(
            "[[models]]\nname = \"dense\"\nkind = \"bert\"\npath = \"{}\"\nbatching = \"padded\"\nbatch_buckets = [1, 4]\nseq_buckets = [16, 128]\n\n",
            common::data("models").join("distilbert-st").display()
        ),
    ]
    .concat();
    let daemon = Daemon::start(&format!(
        "[devices]\nbackend = \"cpu\"\ncpu_devices = 1\n\n[eager]\nworkers = 0\n\n[http]\nenabled = true\nlisten = \"127.0.0.1:0\"\n\n{models}"
    ));
    let addr = daemon.http.clone().expect("the HTTP address");
    let rows = reference("splade-st");
    let texts: Vec<&str> = rows[..3]
        .iter()
        .map(|r| r["text"].as_str().unwrap())
        .collect();
    let (status, body) = http_json(
        &addr,
        "/embed_sparse",
        &json!({"inputs": texts, "truncate": true}),
    );
    assert_eq!(status, 200, "{body}");
    let got = body.as_array().unwrap();
    assert_eq!(got.len(), 3);
    for (entries, row) in got.iter().zip(&rows) {
        let idx: Vec<u32> = entries
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["index"].as_u64().unwrap() as u32)
            .collect();
        let val: Vec<f32> = entries
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["value"].as_f64().unwrap() as f32)
            .collect();
        check((&idx, &val), row).unwrap_or_else(|e| panic!("/embed_sparse {}: {e}", row["case"]));
    }
    let (status, body) = http_json(
        &addr,
        "/embed_sparse",
        &json!({"inputs": texts[0], "top_k": 3, "model": "splade"}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0].as_array().unwrap().len(), 3);
    // A dense model on the sparse route, and the sparse one on the dense routes.
    let (status, body) = http_json(
        &addr,
        "/embed_sparse",
        &json!({"inputs": "x", "model": "dense"}),
    );
    assert_eq!(status, 400);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("/embed_sparse needs a sparse encoder"),
        "{body}"
    );
    let (status, body) = http_json(&addr, "/embed", &json!({"inputs": "x", "model": "splade"}));
    assert_eq!(status, 400);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("use /embed_sparse"),
        "{body}"
    );
    let (status, body) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": "x", "model": "splade"}),
    );
    assert_eq!(status, 400);
    assert!(body.to_string().contains("use /embed_sparse"), "{body}");
    // /info: TEI's model type for SPLADE.
    let (status, info) = common::http(&addr, "GET", "/info", None);
    assert_eq!(status, 200);
    let info: Value = serde_json::from_slice(&info).unwrap();
    let splade = info["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["model_id"] == "splade")
        .unwrap();
    assert_eq!(
        splade["model_type"],
        json!({"embedding": {"pooling": "splade"}})
    );
}
