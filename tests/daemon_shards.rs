//! The client endpoint served by several ROUTER shards
//! (`server.client_sockets`): one tcp endpoint, connections spread over the
//! shards by the kernel, every reply on the connection its request came in
//! on, the stats summed as one socket's.

mod common;

use common::{data, mlp_cpu_config, rel_err, Daemon, MlpReference, Rng};
use replayd::protocol::{
    decode_reply, encode_request, InputKind, Payload, ReplyData, RequestHeader, Status,
};
use replayd::tensor::HostTensor;
use replayd::transport::{Dealer, Security};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

fn mlp_config(cpu_devices: usize) -> String {
    mlp_cpu_config(cpu_devices, &[1, 4, 16])
}

const CONNECTIONS: usize = 16;
const REQUESTS: usize = 12;

/// `CONNECTIONS` DEALERs, each with its own TCP connection, each sending
/// `REQUESTS` pipelined requests of 1–3 random rows with ids unique over all
/// of them; every reply must come back on its own connection, with its id,
/// shape `[rows, 10]` and the reference's values.
async fn many_connections(endpoint: &str, security: &Security) {
    let reference = std::sync::Arc::new(MlpReference::load(&data("mlp_seed.safetensors")));
    let limits = replayd::protocol::client::client_limits();
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let (mut rx, tx) = Dealer::connect(endpoint, &limits, security)
            .await
            .unwrap()
            .split();
        let reference = reference.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(c as u64 + 1);
            let mut sent: HashMap<u64, (usize, Vec<f32>)> = HashMap::new();
            for r in 0..REQUESTS {
                let id = (c * 1000 + r + 1) as u64;
                let rows = rng.range(1, 4);
                let x: Vec<f32> = (0..rows * 128).map(|_| rng.normal()).collect();
                let input = HostTensor::from_f32(vec![rows, 128], &x);
                let mut header = RequestHeader::new(id, "mlp", InputKind::Tensor);
                header.dtype = Some(input.dtype);
                header.shape = Some(vec![rows as u64, 128]);
                tx.send(encode_request(&header, &Payload::Tensor(input)))
                    .unwrap();
                sent.insert(id, (rows, x));
            }
            for _ in 0..REQUESTS {
                let m = tokio::time::timeout(Duration::from_secs(30), rx.recv())
                    .await
                    .unwrap_or_else(|_| panic!("connection {c}: a reply is missing"))
                    .unwrap();
                let (header, tensor) = decode_reply(&m.frames).unwrap();
                assert_eq!(header.status, Status::Ok, "{header:?}");
                let (rows, x) = sent.remove(&header.id).unwrap_or_else(|| {
                    panic!("connection {c}: reply id {} not sent here", header.id)
                });
                assert_eq!(header.shape, Some(vec![rows as u64, 10]));
                let out = tensor
                    .and_then(ReplyData::dense)
                    .unwrap()
                    .to_f32_vec()
                    .unwrap();
                let err = rel_err(&out, &reference.forward(&x, rows));
                assert!(
                    err < 1e-4,
                    "connection {c}, id {}: rel err {err}",
                    header.id
                );
            }
            assert!(sent.is_empty());
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn shards(stats: &Value) -> Vec<Value> {
    stats["transport"]["client"]["shards"]
        .as_array()
        .expect("transport.client.shards")
        .clone()
}

#[test]
fn connections_spread_over_four_shards_of_one_endpoint_and_every_reply_is_right() {
    let daemon = Daemon::start_with(&mlp_config(2), "client_sockets = 4");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(many_connections(&daemon.endpoint, &Security::None));
    let s = daemon.wait_for("every connection counted", Duration::from_secs(5), |s| {
        s["transport"]["client"]["connections_established"].as_u64() >= Some(CONNECTIONS as u64)
    });
    let client = &s["transport"]["client"];
    let per_shard = shards(&s);
    assert_eq!(per_shard.len(), 4, "{client}");
    let field = |name: &str| -> Vec<u64> {
        per_shard
            .iter()
            .map(|sh| sh[name].as_u64().unwrap())
            .collect()
    };
    // The sum is the one socket's figure that the stats always reported.
    for name in [
        "connections_accepted",
        "connections_established",
        "messages_received",
        "messages_sent",
        "busy_us",
    ] {
        assert_eq!(
            field(name).iter().sum::<u64>(),
            client[name].as_u64().unwrap(),
            "{name}: {client}"
        );
    }
    let established = field("connections_established");
    assert_eq!(established.iter().sum::<u64>(), CONNECTIONS as u64);
    assert!(
        established.iter().filter(|&&n| n > 0).count() > 1,
        "the kernel put every connection on one shard: {established:?}"
    );
    assert_eq!(
        client["messages_received"].as_u64(),
        Some((CONNECTIONS * REQUESTS) as u64)
    );
    assert_eq!(client["dropped_sends"], 0);
    assert_eq!(client["unroutable_sends"], 0);
    // Each shard that took connections answered on them.
    for (got, sent) in field("messages_received")
        .iter()
        .zip(field("messages_sent"))
    {
        assert_eq!(*got, sent, "{per_shard:?}");
    }
    let log = daemon.log();
    assert!(log.contains("client_sockets=4"), "{log}");
}

#[test]
fn one_client_socket_is_the_single_router_of_before() {
    let daemon = Daemon::start_with(&mlp_config(1), "client_sockets = 1");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(many_connections(&daemon.endpoint, &Security::None));
    let s = daemon.wait_for("every connection counted", Duration::from_secs(5), |s| {
        s["transport"]["client"]["connections_established"].as_u64() >= Some(CONNECTIONS as u64)
    });
    let per_shard = shards(&s);
    assert_eq!(per_shard.len(), 1);
    assert_eq!(per_shard[0]["connections_established"], CONNECTIONS as u64);
}

#[test]
fn prometheus_reports_the_summed_client_socket_only() {
    let daemon = Daemon::start_with(
        &format!("[metrics]\nendpoint = \"127.0.0.1:0\"\n{}", mlp_config(1)),
        "client_sockets = 3",
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(many_connections(&daemon.endpoint, &Security::None));
    let s = daemon.wait_for("every connection counted", Duration::from_secs(5), |s| {
        s["transport"]["client"]["connections_established"].as_u64() >= Some(CONNECTIONS as u64)
    });
    let url = daemon.metrics.clone().expect("metrics endpoint");
    let address = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    let (status, body) = common::http(address, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(!text.contains("shards"), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("replayd_transport_messages_received_total{socket=\"client\"}"))
        .unwrap_or_else(|| panic!("no client messages_received in:\n{text}"));
    let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(
        value
            >= s["transport"]["client"]["messages_received"]
                .as_f64()
                .unwrap(),
        "{line}"
    );
    assert!(value >= (CONNECTIONS * REQUESTS) as f64, "{line}");
}

#[test]
fn curve_authenticates_on_every_shard() {
    use replayd::transport::{z85_encode, CurveKeyPair};
    use std::os::unix::fs::PermissionsExt;
    let keys_dir = tempfile::tempdir().unwrap();
    let server = CurveKeyPair::generate().unwrap();
    let allowed = CurveKeyPair::generate().unwrap();
    let stranger = CurveKeyPair::generate().unwrap();
    let write = |name: &str, text: String| {
        let path = keys_dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let secret = write("curve.secret", z85_encode(&server.secret));
    let clients = write("curve.clients", z85_encode(&allowed.public));
    let daemon = Daemon::start_with(
        &mlp_config(1),
        &format!(
            "client_sockets = 4\ncurve_secret_key_file = \"{}\"\ncurve_allowed_clients_file = \"{}\"",
            secret.display(),
            clients.display()
        ),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let as_client = |keys: &CurveKeyPair| Security::CurveClient {
        server_public: server.public,
        keys: keys.clone(),
    };
    // 16 authenticated connections, spread over the shards: each shard's
    // own ZAP handler lets the key in.
    rt.block_on(many_connections(&daemon.endpoint, &as_client(&allowed)));
    // Strangers on as many connections: refused, whichever shard they reach.
    rt.block_on(async {
        let limits = replayd::protocol::client::client_limits();
        let mut strangers = Vec::new();
        for _ in 0..8 {
            let (rx, tx) = Dealer::connect(&daemon.endpoint, &limits, &as_client(&stranger))
                .await
                .unwrap()
                .split();
            let mut header = RequestHeader::new(1, "mlp", InputKind::Tensor);
            let input = HostTensor::from_f32(vec![1, 128], &[0.5; 128]);
            header.dtype = Some(input.dtype);
            header.shape = Some(vec![1, 128]);
            tx.send(encode_request(&header, &Payload::Tensor(input)))
                .unwrap();
            strangers.push((rx, tx));
        }
        for (mut rx, _tx) in strangers {
            assert!(
                tokio::time::timeout(Duration::from_millis(500), rx.recv())
                    .await
                    .is_err(),
                "a stranger got a reply"
            );
        }
    });
    let s = daemon.wait_for("refusals counted", Duration::from_secs(5), |s| {
        s["transport"]["client"]["auth_failures"].as_u64() >= Some(8)
    });
    let per_shard = shards(&s);
    let established: Vec<u64> = per_shard
        .iter()
        .map(|sh| sh["connections_established"].as_u64().unwrap())
        .collect();
    assert_eq!(established.iter().sum::<u64>(), CONNECTIONS as u64);
    assert!(
        established.iter().filter(|&&n| n > 0).count() > 1,
        "{established:?}"
    );
}

#[test]
fn a_second_daemon_on_a_sharded_port_is_refused() {
    let port = common::free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let first = Daemon::start_on(&endpoint, &mlp_config(1));
    assert_eq!(first.endpoint, endpoint);
    let (status, log) = Daemon::start_failing(&format!(
        "[server]\nendpoint = \"{endpoint}\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\nruntime_dir = \"{}\"\n{}",
        first.dir.path().join("run2").display(),
        mlp_config(1)
    ));
    assert!(!status.success());
    assert!(
        log.contains("cannot bind server.endpoint") && log.contains("in use"),
        "{log}"
    );
    // The first still serves.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(many_connections(&first.endpoint, &Security::None));
}
