//! The HTTP front (`[http]`) against a real daemon: the same embeddings as
//! the ZeroMQ clients, and an HTTP status for every error code that can be
//! provoked.

mod common;

use base64::Engine as _;
use common::{cosine, freeze, http, http_json, minilm_dir, Daemon};
use replayd::protocol::client::{Client, RawClient};
use replayd::protocol::{encode_request, InputKind, Payload, RequestHeader, Status};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(120);

fn config(extra: &str, http_extra: &str) -> String {
    format!(
        r#"
[devices]
backend = "cpu"
cpu_devices = 1
{extra}

[eager]
workers = 0

[http]
enabled = true
listen = "127.0.0.1:0"
{http_extra}

[[models]]
name = "minilm"
kind = "bert"
path = "{}"
batching = "padded"
batch_buckets = [1, 8]
seq_buckets = [16, 64, 256]

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
batch_buckets = [1]
"#,
        minilm_dir().display(),
        common::data("mlp_seed.safetensors").display()
    )
}

const TEXTS: [&str; 4] = [
    "replay the graph",
    "pad to the bucket",
    "A man is eating food.",
    "héllo wörld, ünïcode",
];

fn rows_of(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

fn same(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what} row {i}");
        let diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0, f32::max);
        assert!(
            diff < 1e-5 && cosine(x, y) > 0.999999,
            "{what} row {i}: max diff {diff}"
        );
    }
}

/// The typed Rust client, a raw DEALER, the low-level request(), and the
/// HTTP routes (float and base64; OpenAI and TEI shapes) give the same
/// embeddings for the same texts from one daemon; clients holding every
/// `http.max_concurrency` slot make the next request 429 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_client_gets_the_same_embeddings() {
    let daemon = Daemon::start(&config("", "max_concurrency = 2"));
    let addr = daemon
        .http
        .clone()
        .expect("the ready file names the HTTP address");
    let client = Client::connect(&daemon.endpoint).await.unwrap();
    let typed = client.embed_texts("minilm", &TEXTS).await.unwrap();
    assert_eq!((typed.rows, typed.cols), (4, 384));
    let typed: Vec<Vec<f32>> = typed.iter_rows().map(<[f32]>::to_vec).collect();

    let mut raw = RawClient::connect(&daemon.endpoint).await.unwrap();
    let header = RequestHeader::new(5, "minilm", InputKind::Texts);
    let payload = Payload::Texts(TEXTS.iter().map(|t| t.to_string()).collect());
    raw.send(encode_request(&header, &payload)).await.unwrap();
    let r = raw.recv_reply(T).await.unwrap();
    assert_eq!((r.header.id, r.header.status), (5, Status::Ok));
    let m = r.output.unwrap().to_f32_vec().unwrap();
    let raw_rows: Vec<Vec<f32>> = m.chunks(384).map(<[f32]>::to_vec).collect();
    same("raw DEALER vs typed client", &raw_rows, &typed);

    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": TEXTS, "model": "minilm"}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "minilm");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 4);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            (d["object"].as_str(), d["index"].as_u64()),
            (Some("embedding"), Some(i as u64))
        );
    }
    let http_rows = rows_of(&Value::Array(
        data.iter().map(|d| d["embedding"].clone()).collect(),
    ));
    same("HTTP /v1/embeddings vs typed client", &http_rows, &typed);
    // usage counts the tokens the daemon's tokenizer made, [CLS] and [SEP] included.
    let tokenizer = replayd::daemon::tokenize::TextTokenizer::load(&minilm_dir(), 256).unwrap();
    let tokens: usize = tokenizer
        .encode(&TEXTS, true)
        .unwrap()
        .iter()
        .map(Vec::len)
        .sum();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": tokens, "total_tokens": tokens})
    );

    // base64: little-endian f32, as the OpenAI SDK decodes it: the float
    // reply's values.
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": TEXTS, "model": "minilm", "encoding_format": "base64"}),
    );
    assert_eq!(status, 200, "{v}");
    let b64: Vec<Vec<f32>> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(d["embedding"].as_str().unwrap())
                .unwrap();
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect();
    same("HTTP base64 vs the float reply", &b64, &http_rows);

    // Token ids in, as OpenAI allows.
    let ids = tokenizer.encode(&TEXTS[..2], true).unwrap();
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": ids, "model": "minilm"}),
    );
    assert_eq!(status, 200, "{v}");
    let id_rows = rows_of(&Value::Array(
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["embedding"].clone())
            .collect(),
    ));
    same("HTTP token ids vs typed client", &id_rows, &typed[..2]);

    // TEI's /embed (the default model is the first encoder).
    let (status, v) = http_json(&addr, "/embed", &json!({"inputs": TEXTS}));
    assert_eq!(status, 200, "{v}");
    same("HTTP /embed vs typed client", &rows_of(&v), &typed);
    let (status, v) = http_json(
        &addr,
        "/embed",
        &json!({"inputs": TEXTS[1], "normalize": false}),
    );
    assert_eq!(status, 200, "{v}");
    same("HTTP /embed one string", &rows_of(&v), &typed[1..2]);

    // Matryoshka on both routes: the first 48 values, normalised again
    // (MiniLM normalises); out of range is 400 in each route's shape.
    let cut: Vec<Vec<f32>> = typed
        .iter()
        .map(|row| {
            let n = row[..48].iter().map(|x| x * x).sum::<f32>().sqrt();
            row[..48].iter().map(|x| x / n).collect()
        })
        .collect();
    let (status, v) = http_json(&addr, "/embed", &json!({"inputs": TEXTS, "dimensions": 48}));
    assert_eq!(status, 200, "{v}");
    same("HTTP /embed dimensions 48", &rows_of(&v), &cut);
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": TEXTS, "dimensions": 48, "model": "minilm"}),
    );
    assert_eq!(status, 200, "{v}");
    let rows: Vec<Vec<f32>> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect();
    same("HTTP /v1/embeddings dimensions 48", &rows, &cut);
    for (path, body) in [
        ("/embed", json!({"inputs": "x", "dimensions": 0})),
        ("/v1/embeddings", json!({"input": "x", "dimensions": 385})),
    ] {
        let (status, v) = http_json(&addr, path, &body);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(v.to_string().contains("ask for 1 to 384"), "{path}: {v}");
    }

    let (status, body) = http(&addr, "GET", "/health", None);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, v["status"].as_str()), (200, Some("ok")), "{v}");
    let (status, body) = http(&addr, "GET", "/v1/models", None);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["data"][0]["id"], "minilm");
}

/// TEI's routes answer errors in TEI's shape, the others in OpenAI's.
fn tei_shaped(path: &str) -> bool {
    ["/embed", "/rerank", "/tokenize", "/info"].contains(&path)
}

fn error(addr: &str, path: &str, body: &Value) -> (u16, String, String) {
    let (status, v) = http_json(addr, path, body);
    let (code, message) = if tei_shaped(path) {
        (v["error_type"].as_str(), v["error"].as_str())
    } else {
        (v["error"]["code"].as_str(), v["error"]["message"].as_str())
    };
    (
        status,
        code.unwrap_or_else(|| panic!("no code: {v}")).to_string(),
        message.unwrap_or_default().to_string(),
    )
}

fn worker_pid(daemon: &Daemon) -> i32 {
    daemon.device("cpu:0")["worker_pid"].as_i64().unwrap() as i32
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a process this test started.
    unsafe { libc::kill(pid, sig) };
}

/// Every error code that can be provoked over HTTP, with its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_error_code_has_its_http_status() {
    let mut daemon = Daemon::start(&config(
        "hang_timeout_ms = 120000\n\n[batching]\nmax_queue = 2\nmax_attempts = 1",
        "max_body_bytes = 8192\nrequest_timeout_ms = 1500",
    ));
    let addr = daemon.http.clone().unwrap();
    let ok = |body: Value| {
        let (status, v) = http_json(&addr, "/v1/embeddings", &body);
        assert_eq!(status, 200, "{v}");
    };
    ok(json!({"input": "fine", "model": "minilm"}));

    // 400 bad_request
    for (body, needle) in [
        (
            json!({"input": "x", "model": "minilm", "colour": 1}),
            "colour",
        ),
        (
            json!({"input": "x", "model": "minilm", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (json!({"input": [], "model": "minilm"}), "no input"),
        (
            json!({"input": [[101, 999999, 102]], "model": "minilm"}),
            "outside the vocabulary",
        ),
        (json!({"input": "x", "model": "mlp"}), "encoder models"),
        (json!({"input": 5, "model": "minilm"}), "invalid JSON"),
    ] {
        let (status, code, message) = error(&addr, "/v1/embeddings", &body);
        assert_eq!(
            (status, code.as_str()),
            (400, "bad_request"),
            "{body}: {message}"
        );
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (status, body) = http(&addr, "POST", "/v1/embeddings", Some(b"{not json"));
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    // Unknown routes and methods: JSON errors too (TEI's shape on its routes).
    for (method, path, want) in [
        ("GET", "/v2/embeddings", 404),
        ("GET", "/v1/embeddings", 405),
        ("GET", "/rerank", 405),
        ("POST", "/info", 405),
    ] {
        let (status, body) = http(&addr, method, path, None);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status, want, "{v}");
        let message = if tei_shaped(path) {
            &v["error"]
        } else {
            &v["error"]["message"]
        };
        assert!(message.as_str().unwrap().contains(path), "{v}");
        if want == 404 {
            for route in ["/embed", "/rerank", "/tokenize", "/info"] {
                assert!(message.as_str().unwrap().contains(route), "{v}");
            }
        }
    }
    // 404 unknown_model
    let (status, code, message) = error(
        &addr,
        "/v1/embeddings",
        &json!({"input": "x", "model": "nope"}),
    );
    assert_eq!((status, code.as_str()), (404, "unknown_model"));
    assert!(message.contains("minilm"), "{message}");
    // 413: a body over http.max_body_bytes, and too_long.
    let big = json!({"input": "word ".repeat(3000), "model": "minilm"});
    let (status, code, _) = error(&addr, "/v1/embeddings", &big);
    assert_eq!((status, code.as_str()), (413, "bad_request"));
    let long = "word ".repeat(400);
    let (status, code, message) =
        error(&addr, "/embed", &json!({"inputs": long, "truncate": false}));
    assert_eq!((status, code.as_str()), (413, "too_long"), "{message}");
    let (status, code, _) = error(
        &addr,
        "/v1/embeddings",
        &json!({"input": [vec![1000u32; 300]], "model": "minilm"}),
    );
    assert_eq!((status, code.as_str()), (413, "too_long"));
    // ... and with truncate = true the long text is fine.
    let (status, _) = http_json(&addr, "/embed", &json!({"inputs": long, "truncate": true}));
    assert_eq!(status, 200);

    // 500 internal: the batch is lost with its worker and max_attempts = 1.
    let in_background = |text: &'static str| {
        let addr = addr.clone();
        std::thread::spawn(move || {
            error(
                &addr,
                "/v1/embeddings",
                &json!({"input": text, "model": "minilm"}),
            )
        })
    };
    let worker = worker_pid(&daemon);
    freeze(worker);
    let c = in_background("lost with its worker");
    std::thread::sleep(Duration::from_millis(400));
    signal(worker, libc::SIGKILL);
    let (status, code, message) = c.join().unwrap();
    assert_eq!((status, code.as_str()), (500, "internal"), "{message}");
    let ready = |s: &Value| {
        s["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["state"] == "ready")
    };
    daemon.wait_for("the worker back", T, ready);

    // With the worker frozen: 429, then 504.
    let worker = worker_pid(&daemon);
    freeze(worker);
    let t0 = Instant::now();
    let a = in_background("first");
    let b = in_background("second");
    std::thread::sleep(Duration::from_millis(400));
    // 429 overloaded: batching.max_queue = 2 requests admitted already.
    let (status, code, message) = error(
        &addr,
        "/v1/embeddings",
        &json!({"input": "third", "model": "minilm"}),
    );
    assert_eq!((status, code.as_str()), (429, "overloaded"), "{message}");
    // 504 deadline_exceeded, at http.request_timeout_ms.
    for h in [a, b] {
        let (status, code, _) = h.join().unwrap();
        assert_eq!((status, code.as_str()), (504, "deadline_exceeded"));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t0.elapsed()
    );
    signal(worker, libc::SIGCONT);

    // 503 unavailable: a request after SIGTERM, while the drain waits for one in flight.
    let worker = worker_pid(&daemon);
    freeze(worker);
    let held = {
        let addr = addr.clone();
        std::thread::spawn(move || http_json(&addr, "/embed", &json!({"inputs": "held"})).0)
    };
    std::thread::sleep(Duration::from_millis(300));
    daemon.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(200));
    let (status, code, _) = error(&addr, "/embed", &json!({"inputs": "after SIGTERM"}));
    assert_eq!((status, code.as_str()), (503, "unavailable"));
    signal(worker, libc::SIGCONT);
    let held = held.join().unwrap();
    assert!(held == 200 || held == 504, "the held request: {held}");
    assert!(daemon.wait(T).success());
}

/// `http.max_concurrency` slots are taken before a body is read: two
/// clients still sending their bodies hold both, the next request gets 429.
///
/// The daemon reads each connection's request head in its own task, in no
/// set order, so a probe sent right after the slow heads can be admitted
/// before the second slow head is read: that slow request is then the one
/// refused (429 at once), holds no slot, and every later probe gets 200. A
/// slow connection that was answered is therefore opened again, until two
/// unanswered ones hold the slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_bodies_hold_the_slots_and_the_next_request_gets_429() {
    use std::io::{ErrorKind, Read, Write};
    let daemon = Daemon::start(&config("", "max_concurrency = 2"));
    let addr = daemon.http.clone().expect("the HTTP address");
    // 429 from http.max_concurrency = 2: clients still sending their bodies
    // hold the slots (taken before a body is read, so slow or huge bodies
    // cannot pile up in memory); /health is not held up by them.
    let open_slow = || {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let head = format!(
            "POST /v1/embeddings HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"input\""
        );
        s.write_all(head.as_bytes()).unwrap();
        s
    };
    // Whether the daemon has answered (or closed) a slow connection: it
    // was refused, so it holds no slot.
    let answered = |s: &mut std::net::TcpStream| {
        s.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        let r = s.peek(&mut byte);
        s.set_nonblocking(false).unwrap();
        match r {
            Ok(_) => true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => false,
            Err(e) => panic!("a slow connection: {e}"),
        }
    };
    let mut slow: Vec<std::net::TcpStream> = (0..2).map(|_| open_slow()).collect();
    let mut reopened = 0;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        for s in &mut slow {
            if answered(s) {
                // Its reply's head (the daemon may keep the connection
                // open, waiting for the rest of the body).
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut reply = [0u8; 64];
                let n = s.read(&mut reply).unwrap_or(0);
                let reply = String::from_utf8_lossy(&reply[..n]);
                assert!(
                    reply.starts_with("HTTP/1.1 429"),
                    "a slow request: {reply:?}"
                );
                *s = open_slow();
                reopened += 1;
            }
        }
        let (status, v) = http_json(
            &addr,
            "/v1/embeddings",
            &json!({"input": "fourth", "model": "minilm"}),
        );
        if status == 429 {
            assert_eq!(v["error"]["code"], "overloaded", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("http.max_concurrency"),
                "{v}"
            );
            break;
        }
        // Not both slots taken yet: the request went through.
        assert_eq!(status, 200, "{v}");
        assert!(
            Instant::now() < until,
            "the slow bodies never took the slots (slow connections opened again: {reopened})"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("slow connections opened again after their 429: {reopened}");
    // The slots were held by the slow requests, which are still unanswered.
    for s in &mut slow {
        assert!(!answered(s), "a slow request was answered");
    }
    let (status, _) = http(&addr, "GET", "/health", None);
    assert_eq!(status, 200);
    drop(slow);
}

/// A test model folder (tests/data/models).
fn test_model(name: &str) -> std::path::PathBuf {
    common::data("models").join(name)
}

/// One `[[models]]` entry, padded batching.
fn model_toml(name: &str, path: &std::path::Path, seq_buckets: &str) -> String {
    format!(
        "[[models]]\nname = \"{name}\"\nkind = \"bert\"\npath = \"{}\"\nbatching = \"padded\"\nbatch_buckets = [1, 8]\nseq_buckets = {seq_buckets}\n\n",
        path.display()
    )
}

/// The row of a test folder's reference.jsonl for `case`.
fn reference_row(folder: &str, case: &str) -> Value {
    std::fs::read_to_string(test_model(folder).join("reference.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["case"] == case)
        .unwrap_or_else(|| panic!("{folder}: no case {case}"))
}

fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(a) => a.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        x => vec![x.as_f64().unwrap() as f32],
    }
}

/// The rows a ZeroMQ request gets (texts or pairs, with `prompt_name`).
async fn zmq_rows(
    client: &Client,
    model: &str,
    payload: Payload,
    prompt_name: Option<&str>,
) -> Vec<Vec<f32>> {
    let kind = match payload {
        Payload::Pairs(_) => InputKind::Pairs,
        _ => InputKind::Texts,
    };
    let items = payload.items();
    let mut header = RequestHeader::new(client.next_id(), model, kind);
    header.prompt_name = prompt_name.map(str::to_string);
    let r = client.request(&header, &payload, T).await.unwrap();
    assert_eq!(
        r.header.status,
        Status::Ok,
        "{model}: {:?}",
        r.header.message
    );
    let data = r.output.unwrap().to_f32_vec().unwrap();
    data.chunks(data.len() / items)
        .map(<[f32]>::to_vec)
        .collect()
}

/// text-embeddings-inference's routes against the ZeroMQ protocol and the
/// reference folders: /embed (prompt_name, truncation from the left),
/// /rerank (a cross-encoder's pair scores, best first), /tokenize (the ids
/// the model embeds, offsets, special tokens), /info (the config's values),
/// and the errors each gives in TEI's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tei_routes_answer_as_text_embeddings_inference() {
    let models = [
        model_toml("minilm", &minilm_dir(), "[16, 64, 256]"),
        model_toml("st-new", &test_model("bert-st-new"), "[32, 128]"),
        model_toml("ce-sigmoid", &test_model("bert-cross-encoder"), "[16, 64]"),
        model_toml(
            "ce-identity",
            &test_model("bert-cross-encoder-legacy"),
            "[16, 64]",
        ),
        model_toml("qwen3", &test_model("qwen3-st"), "[16, 64]"),
    ]
    .concat();
    let config = format!(
        "[devices]\nbackend = \"cpu\"\ncpu_devices = 1\n\n[eager]\nworkers = 0\n\n[http]\nenabled = true\nlisten = \"127.0.0.1:0\"\nmax_concurrency = 7\n\n{models}"
    );
    let daemon = Daemon::start_with(
        &config,
        "max_items_per_request = 64\nmax_request_bytes = 4194304\ntokenizer_threads = 2",
    );
    let addr = daemon.http.clone().expect("the HTTP address");
    let client = Client::connect(&daemon.endpoint).await.unwrap();
    let bad = |path: &str, body: Value, needles: &[&str]| {
        let (status, code, message) = error(&addr, path, &body);
        assert_eq!(
            (status, code.as_str()),
            (400, "bad_request"),
            "{body}: {message}"
        );
        for n in needles {
            assert!(message.contains(n), "{body}: {message} (expected {n:?})");
        }
    };

    // /embed with prompt_name: the ZeroMQ request's embedding with the same
    // prompt_name, and sentence-transformers' (include_prompt = false: the
    // prompt's tokens are not pooled).
    let fox = "The quick brown fox jumps over the lazy dog.";
    let (status, v) = http_json(
        &addr,
        "/embed",
        &json!({"inputs": [fox, TEXTS[0]], "model": "st-new", "prompt_name": "instruct"}),
    );
    assert_eq!(status, 200, "{v}");
    let instruct = rows_of(&v);
    let want = zmq_rows(
        &client,
        "st-new",
        Payload::Texts(vec![fox.into(), TEXTS[0].into()]),
        Some("instruct"),
    )
    .await;
    same("/embed prompt_name vs ZeroMQ prompt_name", &instruct, &want);
    let st = reference_row("bert-st-new", "prompt-instruct-ordinary-1");
    assert!(cosine(&instruct[0], &floats(&st["embedding"])) >= 0.9999);
    // No prompt_name: the folder's default prompt ("query: ").
    let (status, v) = http_json(&addr, "/embed", &json!({"inputs": fox, "model": "st-new"}));
    assert_eq!(status, 200, "{v}");
    let query = rows_of(&v);
    let st = reference_row("bert-st-new", "prompt-query-ordinary-1");
    assert!(cosine(&query[0], &floats(&st["embedding"])) >= 0.9999);
    assert!(
        cosine(&query[0], &instruct[0]) < 0.9999,
        "the prompt changed nothing"
    );
    bad(
        "/embed",
        json!({"inputs": "x", "model": "st-new", "prompt_name": "nope"}),
        &["nope", "instruct"],
    );
    // OpenAI's route on the same model: the default prompt too, and usage
    // counts its tokens.
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": fox, "model": "st-new"}),
    );
    assert_eq!(status, 200, "{v}");
    same(
        "/v1/embeddings st-new",
        &rows_of(&json!([v["data"][0]["embedding"]])),
        &query,
    );
    assert_eq!(
        v["usage"]["prompt_tokens"],
        st["ids"].as_array().unwrap().len()
    );

    // truncation_direction "left": [CLS], the text's last tokens, [SEP];
    // as the same ids sent to OpenAI's route.
    let tokenizer = replayd::daemon::tokenize::TextTokenizer::load(&minilm_dir(), 256).unwrap();
    let long: String = (0..300).map(|i| format!("w{i} ")).collect();
    let full = replayd::daemon::tokenize::TextTokenizer::load(&minilm_dir(), 4096)
        .unwrap()
        .encode(&[long.as_str()], false)
        .unwrap()
        .remove(0);
    assert!(full.len() > 256);
    let mut left = vec![full[0]];
    left.extend(&full[full.len() - 255..]);
    let (status, v) = http_json(
        &addr,
        "/embed",
        &json!({"inputs": long, "truncate": true, "truncation_direction": "left"}),
    );
    assert_eq!(status, 200, "{v}");
    let left_row = rows_of(&v);
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": [left], "model": "minilm"}),
    );
    assert_eq!(status, 200, "{v}");
    same(
        "/embed left cut vs its ids",
        &left_row,
        &rows_of(&json!([v["data"][0]["embedding"]])),
    );
    let (status, v) = http_json(&addr, "/embed", &json!({"inputs": long, "truncate": true}));
    assert_eq!(status, 200, "{v}");
    let right_row = &rows_of(&v)[0];
    let diff = right_row
        .iter()
        .zip(&left_row[0])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff > 1e-3, "left and right cuts gave the same embedding");
    // A prompt kept out of pooling cannot be cut from the left.
    bad(
        "/embed",
        json!({"inputs": fox, "model": "st-new", "truncate": true, "truncation_direction": "left"}),
        &["truncation_direction", "include_prompt"],
    );
    bad(
        "/embed",
        json!({"inputs": fox, "truncation_direction": "up"}),
        &["truncation_direction"],
    );
    bad("/embed", json!({"inputs": []}), &["inputs"]);
    bad(
        "/embed",
        json!({"inputs": "x", "model": "ce-sigmoid"}),
        &["ce-sigmoid", "/rerank"],
    );

    // /rerank: the cross-encoder's pair scores (the default model is the
    // first cross-encoder), best first, each with its text's index.
    let relevant = reference_row("bert-cross-encoder", "relevant");
    let irrelevant = reference_row("bert-cross-encoder", "irrelevant");
    let query_text = relevant["pair"][0].as_str().unwrap();
    assert_eq!(irrelevant["pair"][0], query_text);
    let passages = [
        "replay the graph",
        relevant["pair"][1].as_str().unwrap(),
        "Paris is the capital and largest city of France.",
        irrelevant["pair"][1].as_str().unwrap(),
    ];
    let pairs = |model: &'static str| {
        let payload = Payload::Pairs(
            passages
                .iter()
                .map(|p| (query_text.to_string(), p.to_string()))
                .collect(),
        );
        let client = &client;
        async move {
            zmq_rows(client, model, payload, None)
                .await
                .iter()
                .map(|r| r[0])
                .collect::<Vec<f32>>()
        }
    };
    let sigmoid = pairs("ce-sigmoid").await;
    for (i, case) in [(1, &relevant), (3, &irrelevant)] {
        assert!(
            (sigmoid[i] - floats(&case["score"])[0]).abs() <= 1e-4,
            "{}",
            case["case"]
        );
    }
    let check = |v: &Value, want: &[f32], with_text: bool| {
        let ranks = v.as_array().unwrap_or_else(|| panic!("{v}"));
        assert_eq!(ranks.len(), passages.len(), "{v}");
        let mut seen = vec![false; passages.len()];
        let mut last = f32::INFINITY;
        for r in ranks {
            let i = r["index"].as_u64().unwrap() as usize;
            seen[i] = true;
            let score = r["score"].as_f64().unwrap() as f32;
            assert!(
                (score - want[i]).abs() <= 1e-5,
                "text {i}: {score} vs {}",
                want[i]
            );
            assert!(score <= last, "not best first: {v}");
            last = score;
            match with_text {
                true => assert_eq!(r["text"], passages[i], "{v}"),
                false => assert!(r.get("text").is_none(), "{v}"),
            }
        }
        assert!(seen.iter().all(|s| *s), "{v}");
    };
    let (status, v) = http_json(
        &addr,
        "/rerank",
        &json!({"query": query_text, "texts": passages, "return_text": true}),
    );
    assert_eq!(status, 200, "{v}");
    check(&v, &sigmoid, true);
    let (status, v) = http_json(
        &addr,
        "/rerank",
        &json!({"query": query_text, "texts": passages, "model": "ce-sigmoid"}),
    );
    assert_eq!(status, 200, "{v}");
    check(&v, &sigmoid, false);
    // raw_scores: the identity model's scores are raw already; the sigmoid
    // model's raw scores are not available.
    let identity = pairs("ce-identity").await;
    let (status, v) = http_json(
        &addr,
        "/rerank",
        &json!({"query": query_text, "texts": passages, "model": "ce-identity", "raw_scores": true}),
    );
    assert_eq!(status, 200, "{v}");
    check(&v, &identity, false);
    bad(
        "/rerank",
        json!({"query": query_text, "texts": passages, "raw_scores": true}),
        &["raw scores", "ce-sigmoid", "Sigmoid"],
    );
    bad("/rerank", json!({"query": "q", "texts": []}), &["texts"]);
    bad(
        "/rerank",
        json!({"query": "q", "texts": ["t"], "model": "minilm"}),
        &["minilm", "cross-encoder"],
    );
    bad(
        "/rerank",
        json!({"query": "q", "texts": ["t"], "truncate": true, "truncation_direction": "left"}),
        &["truncation_direction"],
    );

    // /tokenize: the ids the model embeds, [CLS] and [SEP] flagged special,
    // byte offsets that slice the input back to each token's text.
    let (status, v) = http_json(&addr, "/tokenize", &json!({"inputs": TEXTS}));
    assert_eq!(status, 200, "{v}");
    let want = tokenizer.encode(&TEXTS, true).unwrap();
    let lists = v.as_array().unwrap();
    assert_eq!(lists.len(), TEXTS.len());
    for (i, tokens) in lists.iter().enumerate() {
        let tokens = tokens.as_array().unwrap();
        let ids: Vec<u32> = tokens
            .iter()
            .map(|t| t["id"].as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ids, want[i], "{}", TEXTS[i]);
        let last = tokens.len() - 1;
        for (k, t) in tokens.iter().enumerate() {
            let special = k == 0 || k == last;
            assert_eq!(t["special"], special, "{t}");
            if special {
                assert_eq!(
                    (&t["start"], &t["stop"]),
                    (&Value::Null, &Value::Null),
                    "{t}"
                );
                assert_eq!(t["text"], if k == 0 { "[CLS]" } else { "[SEP]" });
            } else {
                let (a, b) = (
                    t["start"].as_u64().unwrap() as usize,
                    t["stop"].as_u64().unwrap() as usize,
                );
                assert_eq!(t["text"], TEXTS[i][a..b], "{t}");
            }
        }
    }
    assert_eq!(
        lists[0][1],
        json!({"id": want[0][1], "text": "replay", "special": false, "start": 0, "stop": 6})
    );
    let (status, v) = http_json(
        &addr,
        "/tokenize",
        &json!({"inputs": TEXTS[0], "add_special_tokens": false}),
    );
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u64> = v[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let inner: Vec<u64> = want[0][1..want[0].len() - 1]
        .iter()
        .map(|&i| i as u64)
        .collect();
    assert_eq!(ids, inner);
    // Cut at the model's maximum, as it is embedded.
    let (status, v) = http_json(&addr, "/tokenize", &json!({"inputs": long}));
    assert_eq!(status, 200);
    let cut = tokenizer.encode(&[long.as_str()], true).unwrap().remove(0);
    let ids: Vec<u32> = v[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!((ids.len(), &ids), (256, &cut));
    // With a prompt: sentence-transformers' ids, offsets into prompt + text.
    let st = reference_row("bert-st-new", "prompt-instruct-ordinary-1");
    let (status, v) = http_json(
        &addr,
        "/tokenize",
        &json!({"inputs": fox, "model": "st-new", "prompt_name": "instruct"}),
    );
    assert_eq!(status, 200, "{v}");
    let prompted = format!("{}{fox}", st["prompt"].as_str().unwrap());
    let tokens = v[0].as_array().unwrap();
    let ids: Vec<u64> = tokens.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(json!(ids), st["ids"]);
    for t in tokens.iter().filter(|t| t["special"] == false) {
        let (a, b) = (
            t["start"].as_u64().unwrap() as usize,
            t["stop"].as_u64().unwrap() as usize,
        );
        assert_eq!(t["text"], prompted[a..b], "{t}");
    }
    let (status, v) = http_json(
        &addr,
        "/tokenize",
        &json!({"inputs": fox, "model": "st-new"}),
    );
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u64> = v[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    assert_eq!(
        json!(ids),
        reference_row("bert-st-new", "prompt-query-ordinary-1")["ids"]
    );
    bad(
        "/tokenize",
        json!({"inputs": vec!["x"; 65]}),
        &["server.max_items_per_request"],
    );
    bad("/tokenize", json!({"inputs": []}), &["inputs"]);

    // /info: TEI's Info from the config, for the default model and each.
    let (status, body) = http(&addr, "GET", "/info", None);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200, "{v}");
    let server = json!({
        "max_concurrent_requests": 7,
        "max_client_batch_size": 64,
        "max_request_bytes": 4194304,
        "tokenization_workers": 2,
        "auto_truncate": false,
        "version": env!("CARGO_PKG_VERSION"),
    });
    let expect = |got: &Value, name: &str, model_type: Value, max_len: u64, max_seq: u64| {
        for (k, want) in server.as_object().unwrap() {
            assert_eq!(&got[k], want, "{name} {k}: {got}");
        }
        assert_eq!(got["model_id"], name, "{got}");
        assert_eq!(got["model_sha"], Value::Null, "{got}");
        assert_eq!(got["model_dtype"], "float32", "{got}");
        assert_eq!(got["model_type"], model_type, "{got}");
        assert_eq!(got["max_input_length"], max_len, "{got}");
        assert_eq!(got["max_batch_requests"], 8, "{got}");
        assert_eq!(got["max_batch_tokens"], 8 * max_seq, "{got}");
    };
    expect(
        &v,
        "minilm",
        json!({"embedding": {"pooling": "mean"}}),
        256,
        256,
    );
    let models = v["models"].as_array().unwrap();
    assert_eq!(models.len(), 5, "{v}");
    expect(
        &models[0],
        "minilm",
        json!({"embedding": {"pooling": "mean"}}),
        256,
        256,
    );
    expect(
        &models[1],
        "st-new",
        json!({"embedding": {"pooling": "cls"}}),
        128,
        128,
    );
    let reranker = |a: &str| json!({"reranker": {"num_labels": 1, "activation": a}});
    expect(&models[2], "ce-sigmoid", reranker("Sigmoid"), 64, 64);
    expect(&models[3], "ce-identity", reranker("Identity"), 512, 64);
    // sentence-transformers' `lasttoken` in TEI's spelling.
    expect(
        &models[4],
        "qwen3",
        json!({"embedding": {"pooling": "last_token"}}),
        64,
        64,
    );
}
