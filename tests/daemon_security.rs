//! What reaches the daemon from outside, and what it leaves on disk: hostile
//! input on its sockets, and the permissions of its run-time files.

mod common;

use common::{data, Daemon};
use std::os::unix::fs::{MetadataExt, PermissionsExt};

fn mlp_config() -> String {
    format!(
        r#"
[devices]
backend = "cpu"
cpu_threads = 1

[eager]
workers = 0

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
batch_buckets = [1, 4]
"#,
        data("mlp_seed.safetensors").display()
    )
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
