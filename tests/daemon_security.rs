//! Who may reach the daemon and what it leaves on disk: CURVE on the client
//! socket, its key files, and the permissions of its run-time files.

mod common;

use common::{mlp_cpu_config, Daemon};
use replayd::protocol::{decode_reply, encode_request, InputKind, Payload, RequestHeader, Status};
use replayd::tensor::HostTensor;
use replayd::transport::{z85_encode, CurveKeyPair, Dealer, Security};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

fn mlp_config() -> String {
    mlp_cpu_config(0, &[1, 4])
}

#[test]
fn runtime_files_are_owner_only_whatever_the_umask() {
    let daemon = Daemon::start_full(&mlp_config(), "", Some(0o000));
    let run = daemon.dir.path().join("run");
    let mode = std::fs::metadata(&run).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o700, "runtime dir mode {mode:o}");
    let sockets: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        !sockets.is_empty(),
        "worker sockets live in the runtime dir"
    );
    for s in sockets {
        let mode = std::fs::metadata(&s).unwrap().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{} has mode {mode:o}", s.display());
    }
}

#[test]
fn a_runtime_dir_others_can_write_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
    let (status, log) = Daemon::start_failing(&format!(
        "[server]\nendpoint = \"tcp://127.0.0.1:0\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\nruntime_dir = \"{}\"\n{}",
        run.display(),
        mlp_config()
    ));
    assert!(!status.success());
    assert!(
        log.contains("server.runtime_dir") && log.contains("writable by every user"),
        "{log}"
    );
}

/// One MLP request over a DEALER with `security`; the reply's status, or
/// None if no reply came within two seconds.
fn one_request(endpoint: &str, security: &Security) -> Option<Status> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let limits = replayd::protocol::client::client_limits();
        let (mut rx, tx) = Dealer::connect(endpoint, &limits, security)
            .await
            .unwrap()
            .split();
        let mut header = RequestHeader::new(7, "mlp", InputKind::Tensor);
        let input = HostTensor::from_f32(vec![1, 128], &[0.25; 128]);
        header.dtype = Some(input.dtype);
        header.shape = Some(vec![1, 128]);
        tx.send(encode_request(&header, &Payload::Tensor(input)))
            .unwrap();
        let m = tokio::time::timeout(Duration::from_secs(2), rx.recv())
            .await
            .ok()?
            .ok()?;
        Some(decode_reply(&m.frames).unwrap().0.status)
    })
}

fn write_owner_only(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[test]
fn curve_lets_in_the_listed_client_keys_only() {
    let keys_dir = tempfile::tempdir().unwrap();
    let server = CurveKeyPair::generate().unwrap();
    // Z85 text may contain '#': the allowed key does, so the file's comment
    // syntax is checked against it.
    let allowed = std::iter::repeat_with(|| CurveKeyPair::generate().unwrap())
        .find(|k| z85_encode(&k.public).contains('#'))
        .unwrap();
    let stranger = CurveKeyPair::generate().unwrap();
    let secret = keys_dir.path().join("curve.secret");
    let clients = keys_dir.path().join("curve.clients");
    write_owner_only(&secret, &z85_encode(&server.secret));
    write_owner_only(
        &clients,
        &format!("# operators\n{}  # alice\n", z85_encode(&allowed.public)),
    );
    let daemon = Daemon::start_with(
        &mlp_config(),
        &format!(
            "curve_secret_key_file = \"{}\"\ncurve_allowed_clients_file = \"{}\"",
            secret.display(),
            clients.display()
        ),
    );
    let as_client = |keys: &CurveKeyPair| Security::CurveClient {
        server_public: server.public,
        keys: keys.clone(),
    };
    assert_eq!(
        one_request(&daemon.endpoint, &as_client(&allowed)),
        Some(Status::Ok)
    );
    assert_eq!(one_request(&daemon.endpoint, &as_client(&stranger)), None);
    assert_eq!(one_request(&daemon.endpoint, &Security::None), None);
    let t = daemon.wait_for("refusals counted", Duration::from_secs(5), |s| {
        s["transport"]["client"]["auth_failures"].as_u64() >= Some(1)
            // The plain client: a protocol failure, or a handshake failure
            // when it hangs up first.
            && s["transport"]["client"]["protocol_failures"].as_u64().unwrap()
                + s["transport"]["client"]["handshake_failures"].as_u64().unwrap()
                >= 1
    });
    assert_eq!(t["transport"]["client"]["connections_established"], 1);
}

#[test]
fn a_curve_secret_key_others_can_read_is_refused_at_start() {
    let keys_dir = tempfile::tempdir().unwrap();
    let server = CurveKeyPair::generate().unwrap();
    let secret = keys_dir.path().join("curve.secret");
    let clients = keys_dir.path().join("curve.clients");
    write_owner_only(&secret, &z85_encode(&server.secret));
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    write_owner_only(&clients, &z85_encode(&server.public));
    let (status, log) = Daemon::start_failing(&format!(
        "[server]\nendpoint = \"tcp://127.0.0.1:0\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\n\
         curve_secret_key_file = \"{}\"\ncurve_allowed_clients_file = \"{}\"\n{}",
        secret.display(),
        clients.display(),
        mlp_config()
    ));
    assert!(!status.success());
    assert!(
        log.contains("server.curve_secret_key_file") && log.contains("readable by every user"),
        "{log}"
    );
}
