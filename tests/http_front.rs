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

    // base64: little-endian f32, as the OpenAI SDK decodes it.
    let (status, v) = http_json(
        &addr,
        "/v1/embeddings",
        &json!({"input": TEXTS[0], "model": "minilm", "encoding_format": "base64", "dimensions": 384}),
    );
    assert_eq!(status, 200, "{v}");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let b64: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    same("HTTP base64 vs typed client", &[b64], &typed[..1]);

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

    let (status, body) = http(&addr, "GET", "/health", None);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((status, v["status"].as_str()), (200, Some("ok")), "{v}");
    let (status, body) = http(&addr, "GET", "/v1/models", None);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["data"][0]["id"], "minilm");
}

fn error(addr: &str, path: &str, body: &Value) -> (u16, String, String) {
    let (status, v) = http_json(addr, path, body);
    let (code, message) = if path == "/embed" {
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
            json!({"input": "x", "model": "minilm", "dimensions": 100}),
            "dimensions",
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
    // Unknown routes and methods: JSON errors too.
    for (method, path, want) in [
        ("GET", "/v2/embeddings", 404),
        ("GET", "/v1/embeddings", 405),
    ] {
        let (status, body) = http(&addr, method, path, None);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(status, want, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(path),
            "{v}"
        );
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
