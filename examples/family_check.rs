//! Checks a running daemon against the sentence-transformers references
//! committed beside the test model folders (`tests/data/models/*/reference.jsonl`,
//! see that folder's README): what `scripts/gpu/gpu-families.sh` runs through
//! the real daemon on the GPU machine (and on the CPU backend as a dry run).
//!
//! ```sh
//! family_check --endpoint ipc:///tmp/x.sock --model mpnet=tests/data/models/mpnet-st \
//!     --min-cosine 0.999 --score-tol 1e-2 --json out.json
//! ```
//!
//! For each `NAME=FOLDER`: every sentence-encoder row is sent as a text with
//! the row's `prompt_name` (so prompts and `include_prompt = false` run as
//! in the daemon), compared with `embedding` by cosine; every cross-encoder
//! row is sent as a (query, passage) pair, compared with `score` (the
//! folder's activation applied) by |got − want| ≤ tol · max(1, |want|).
//! Then the same rows again, all of one prompt in one request (batches of
//! several rows, padded buckets or packed budgets and the eager path as the
//! config has them). Exit status 1 when any row fails.

use clap::Parser;
use replayd::protocol::client::Client;
use replayd::protocol::{InputKind, Payload, RequestHeader, Status};
use replayd::tensor::DType;
use serde::Serialize;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// The daemon's endpoint.
    #[arg(long)]
    endpoint: String,
    /// A served model and its folder, `NAME=FOLDER` (repeatable).
    #[arg(long = "model", value_parser = parse_model)]
    models: Vec<(String, PathBuf)>,
    /// Smallest cosine an embedding may have with its reference.
    #[arg(long, default_value_t = 0.9999)]
    min_cosine: f64,
    /// Score tolerance (cross-encoders): |got − want| ≤ tol · max(1, |want|).
    #[arg(long, default_value_t = 1e-4)]
    score_tol: f64,
    /// Write the results here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
}

fn parse_model(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => Ok((n.to_string(), PathBuf::from(p))),
        _ => Err(format!("expected NAME=FOLDER, got {s:?}")),
    }
}

#[derive(Serialize, Default)]
struct ModelResult {
    name: String,
    folder: PathBuf,
    kind: &'static str,
    rows: usize,
    /// Sentence encoders: the smallest cosine (one by one and batched).
    min_cosine: Option<f64>,
    /// Cross-encoders: the largest |got − want| and the largest relative to max(1, |want|).
    max_score_abs_err: Option<f64>,
    max_score_rel_err: Option<f64>,
    failures: Vec<String>,
    error: Option<String>,
    pass: bool,
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    if na == 0.0 && nb == 0.0 {
        return 1.0;
    }
    let c = dot / (na * nb).max(1e-30);
    if c.is_nan() {
        f64::NEG_INFINITY
    } else {
        c
    }
}

fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
            .collect(),
        x => vec![x.as_f64().unwrap_or(f64::NAN) as f32],
    }
}

async fn request(
    client: &Client,
    model: &str,
    payload: Payload,
    prompt: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<Vec<f32>> {
    let kind = match payload {
        Payload::Pairs(_) => InputKind::Pairs,
        _ => InputKind::Texts,
    };
    let mut header = RequestHeader::new(client.next_id(), model, kind);
    header.output_dtype = Some(DType::F32);
    header.prompt_name = prompt.map(str::to_string);
    let r = client.request(&header, &payload, timeout).await?;
    anyhow::ensure!(
        r.header.status == Status::Ok,
        "{model}: {:?} {:?}",
        r.header.status,
        r.header.message
    );
    r.output
        .ok_or_else(|| anyhow::anyhow!("{model}: no output"))?
        .to_f32_vec()
        .map_err(|e| anyhow::anyhow!("{model}: {e}"))
}

async fn check(
    client: &Client,
    args: &Args,
    name: &str,
    folder: &std::path::Path,
) -> anyhow::Result<ModelResult> {
    let timeout = Duration::from_secs_f64(args.timeout);
    let text = std::fs::read_to_string(folder.join("reference.jsonl"))?;
    let rows: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let cross = rows.first().is_some_and(|r| r.get("pair").is_some());
    let mut res = ModelResult {
        name: name.to_string(),
        folder: folder.to_path_buf(),
        kind: if cross { "cross-encoder" } else { "embedder" },
        rows: rows.len(),
        ..ModelResult::default()
    };
    let case = |r: &Value| r["case"].as_str().unwrap_or("?").to_string();
    if cross {
        let pair = |r: &Value| {
            (
                r["pair"][0].as_str().unwrap_or_default().to_string(),
                r["pair"][1].as_str().unwrap_or_default().to_string(),
            )
        };
        let (mut abs, mut rel) = (0f64, 0f64);
        let mut score = |res: &mut ModelResult, what: String, got: &[f32], want: &[f32]| {
            if got.len() != want.len() {
                res.failures
                    .push(format!("{what}: {} scores, want {}", got.len(), want.len()));
                return;
            }
            for (g, w) in got.iter().zip(want) {
                let d = (*g as f64 - *w as f64).abs();
                let d = if d.is_nan() { f64::INFINITY } else { d };
                let r = d / (*w as f64).abs().max(1.0);
                abs = abs.max(d);
                rel = rel.max(r);
                if r > args.score_tol {
                    res.failures.push(format!("{what}: {got:?} vs {want:?}"));
                    return;
                }
            }
        };
        for row in &rows {
            let got = request(client, name, Payload::Pairs(vec![pair(row)]), None, timeout).await?;
            score(&mut res, case(row), &got, &floats(&row["score"]));
        }
        let all = request(
            client,
            name,
            Payload::Pairs(rows.iter().map(pair).collect()),
            None,
            timeout,
        )
        .await?;
        let labels = all.len() / rows.len().max(1);
        for (row, got) in rows.iter().zip(all.chunks(labels.max(1))) {
            score(
                &mut res,
                format!("{} (batched)", case(row)),
                got,
                &floats(&row["score"]),
            );
        }
        res.max_score_abs_err = Some(abs);
        res.max_score_rel_err = Some(rel);
    } else {
        let mut min_cos = 1f64;
        let mut cos = |res: &mut ModelResult, what: String, got: &[f32], want: &[f32]| {
            let c = if got.len() == want.len() {
                cosine(got, want)
            } else {
                f64::NEG_INFINITY
            };
            min_cos = min_cos.min(c);
            if c < args.min_cosine {
                res.failures.push(format!("{what}: cosine {c}"));
            }
        };
        for row in &rows {
            let text = row["text"].as_str().unwrap_or_default().to_string();
            let prompt = row["prompt_name"].as_str();
            let got = request(client, name, Payload::Texts(vec![text]), prompt, timeout).await?;
            cos(&mut res, case(row), &got, &floats(&row["embedding"]));
        }
        let mut prompts: Vec<Option<&str>> =
            rows.iter().map(|r| r["prompt_name"].as_str()).collect();
        prompts.sort();
        prompts.dedup();
        for prompt in prompts {
            let group: Vec<&Value> = rows
                .iter()
                .filter(|r| r["prompt_name"].as_str() == prompt)
                .collect();
            let texts = group
                .iter()
                .map(|r| r["text"].as_str().unwrap_or_default().to_string())
                .collect();
            let got = request(client, name, Payload::Texts(texts), prompt, timeout).await?;
            let dim = got.len() / group.len().max(1);
            for (row, got) in group.iter().zip(got.chunks(dim.max(1))) {
                cos(
                    &mut res,
                    format!("{} (batched)", case(row)),
                    got,
                    &floats(&row["embedding"]),
                );
            }
        }
        res.min_cosine = Some(min_cos);
    }
    res.pass = res.failures.is_empty();
    Ok(res)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let client = Client::connect(&args.endpoint).await?;
    let mut results = Vec::new();
    for (name, folder) in &args.models {
        let r = match check(&client, &args, name, folder).await {
            Ok(r) => r,
            Err(e) => ModelResult {
                name: name.clone(),
                folder: folder.clone(),
                error: Some(format!("{e:#}")),
                ..ModelResult::default()
            },
        };
        println!(
            "{} {}: {} rows, {}{}{}",
            if r.pass { "PASS" } else { "FAIL" },
            r.name,
            r.rows,
            r.min_cosine
                .map(|c| format!("min cosine {c:.7}"))
                .unwrap_or_default(),
            r.max_score_abs_err
                .map(|e| format!(
                    "max score error {e:.2e} (relative {:.2e})",
                    r.max_score_rel_err.unwrap_or(0.0)
                ))
                .unwrap_or_default(),
            r.error
                .as_ref()
                .map(|e| format!("error: {e}"))
                .unwrap_or_default(),
        );
        for f in r.failures.iter().take(5) {
            println!("    {f}");
        }
        results.push(r);
    }
    let pass = results.iter().all(|r| r.pass);
    if let Some(path) = &args.json {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&serde_json::json!({ "pass": pass, "models": results }))?,
        )?;
    }
    std::process::exit(if pass { 0 } else { 1 });
}
