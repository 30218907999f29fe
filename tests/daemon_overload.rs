//! Overload: a flood of slow requests on one model is refused at once
//! (`overloaded`, before tokenization), never grows a queue without bound,
//! and does not stop another model's requests from being admitted.

mod common;

use common::{data, minilm_dir, Daemon};
use replayd::protocol::client::RawClient;
use replayd::protocol::{encode_request, ErrorCode, InputKind, Payload, RequestHeader, Status};
use replayd::tensor::HostTensor;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_one_model_is_refused_at_once_and_spares_the_other() {
    let daemon = Daemon::start(&format!(
        r#"
[batching]
max_queue = 4

[devices]
backend = "cpu"
cpu_threads = 1

[eager]
workers = 0

[[models]]
name = "minilm"
kind = "bert"
path = "{}"
batching = "padded"
batch_buckets = [1, 4]
seq_buckets = [256]

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
batch_buckets = [1]
"#,
        minilm_dir().display(),
        data("mlp_seed.safetensors").display()
    ));
    // 200 requests of 4 texts of ~250 tokens each, sent without waiting,
    // and their replies timed as they arrive.
    let long = "replay the captured graph for every bucket ".repeat(30);
    let mut flood = RawClient::connect(&daemon.endpoint).await.unwrap();
    let flood_task = tokio::spawn(async move {
        let mut sent_at = HashMap::new();
        for id in 1..=200u64 {
            let header = RequestHeader::new(id, "minilm", InputKind::Texts);
            let payload = Payload::Texts(vec![long.clone(); 4]);
            sent_at.insert(id, Instant::now());
            flood.send(encode_request(&header, &payload)).await.unwrap();
        }
        let mut replies = Vec::new();
        for _ in 0..200 {
            let reply = flood.recv_reply(Duration::from_secs(120)).await.unwrap();
            let waited = sent_at[&reply.header.id].elapsed();
            replies.push((reply, waited));
        }
        replies
    });
    // Meanwhile, the other model is still admitted and answered.
    let client = daemon.client().await;
    let t0 = Instant::now();
    let r = client
        .infer(
            "mlp",
            &HostTensor::from_f32(vec![1, 128], &[0.25; 128]),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(r.header.status, Status::Ok, "{:?}", r.header);
    let mlp_ms = t0.elapsed().as_secs_f64() * 1e3;

    let (mut ok, mut refused, mut refusal_us) = (0, 0, Vec::new());
    for (reply, waited) in flood_task.await.unwrap() {
        match reply.header.code {
            None => ok += 1,
            Some(ErrorCode::Overloaded) => {
                refused += 1;
                refusal_us.push(waited.as_micros() as u64);
                assert!(
                    reply
                        .header
                        .message
                        .as_deref()
                        .unwrap()
                        .contains("admitted"),
                    "{:?}",
                    reply.header.message
                );
            }
            Some(code) => panic!("unexpected {code}: {:?}", reply.header.message),
        }
    }
    // At most the gate's size plus what finished meanwhile ran; the rest
    // was refused, and every request got exactly one reply.
    assert_eq!(ok + refused, 200);
    assert!(ok >= 1 && refused >= 150, "ok {ok}, refused {refused}");
    refusal_us.sort_unstable();
    let p99 = refusal_us[refusal_us.len() * 99 / 100];
    println!(
        "overloaded replies: {refused}, p50 {} us, p99 {p99} us (from send, one client); \
         mlp request during the flood: {mlp_ms:.1} ms; accepted {ok}",
        refusal_us[refusal_us.len() / 2]
    );
}
