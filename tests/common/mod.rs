//! Test harness: starts the real `replayd` binary with a config written to a
//! temporary directory (ports chosen by the kernel, worker sockets in the
//! temporary directory), waits for its ready file, and talks to it over real
//! ZeroMQ sockets. Dropping a [`Daemon`] kills it (its workers die with it).

#![allow(dead_code)]

use replayd::protocol::client::Client;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn data(name: &str) -> PathBuf {
    crate_dir().join("tests/data").join(name)
}

/// The `[devices]`, `[eager]` and `[[models]]` sections most daemon tests
/// start from: the seed MLP (tests/data/mlp_seed.safetensors, 128 → 256 →
/// 10) with these batch buckets, on `cpu_devices` single-threaded CPU
/// devices (0: the backend's default of one), no eager worker.
pub fn mlp_cpu_config(cpu_devices: usize, buckets: &[usize]) -> String {
    let devices = if cpu_devices > 0 {
        format!("cpu_devices = {cpu_devices}\n")
    } else {
        String::new()
    };
    format!(
        r#"
[devices]
backend = "cpu"
{devices}cpu_threads = 1

[eager]
workers = 0

[[models]]
name = "mlp"
kind = "mlp"
path = "{}"
batch_buckets = {buckets:?}
"#,
        data("mlp_seed.safetensors").display()
    )
}

/// The default model folder; tests need it fetched (`scripts/dev/fetch-model.sh`).
pub fn minilm_dir() -> PathBuf {
    let dir = crate_dir().join("models/all-MiniLM-L6-v2");
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run scripts/dev/fetch-model.sh (the README's test command does)",
        dir.display()
    );
    dir
}

pub struct Daemon {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub endpoint: String,
    pub control: String,
    /// `http://HOST:PORT/metrics` when `[metrics] endpoint` was set.
    pub metrics: Option<String>,
    /// The HTTP front's `HOST:PORT`, when the config enables it.
    pub http: Option<String>,
    pub config_path: PathBuf,
}

impl Daemon {
    /// Starts replayd with `[server]` settings filled in and `rest` (the
    /// remaining TOML: batching, devices, eager, models) appended.
    pub fn start(rest: &str) -> Daemon {
        Self::start_with(rest, "")
    }

    /// Like [`Daemon::start`], with extra `[server]` keys.
    pub fn start_with(rest: &str, server_extra: &str) -> Daemon {
        Self::start_full(rest, server_extra, None)
    }

    /// Like [`Daemon::start_with`], started under `umask` when given.
    pub fn start_full(rest: &str, server_extra: &str, umask: Option<u32>) -> Daemon {
        Self::start_env(rest, server_extra, umask, &[])
    }

    /// Like [`Daemon::start_full`], with extra environment variables.
    pub fn start_env(
        rest: &str,
        server_extra: &str,
        umask: Option<u32>,
        env: &[(&str, &str)],
    ) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = format!(
            "[server]\nendpoint = \"tcp://127.0.0.1:0\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\nruntime_dir = \"{}\"\n{server_extra}\n{rest}",
            dir.path().join("run").display()
        );
        let config_path = dir.path().join("replayd.toml");
        std::fs::write(&config_path, config).unwrap();
        let ready = dir.path().join("ready.json");
        let log = std::fs::File::create(dir.path().join("replayd.log")).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_replayd"));
        if let Some(mask) = umask {
            use std::os::unix::process::CommandExt;
            // SAFETY: umask is async-signal-safe; nothing else runs in the child yet.
            unsafe {
                command.pre_exec(move || {
                    libc::umask(mask as libc::mode_t);
                    Ok(())
                });
            }
        }
        let child = command
            .arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready)
            .current_dir(crate_dir())
            .env("REPLAYD_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start replayd");
        let mut daemon = Daemon {
            child: Some(child),
            dir,
            endpoint: String::new(),
            control: String::new(),
            metrics: None,
            http: None,
            config_path,
        };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let v: Value = serde_json::from_str(&text).unwrap();
                daemon.endpoint = v["endpoint"].as_str().unwrap().to_string();
                daemon.control = v["control_endpoint"].as_str().unwrap().to_string();
                daemon.metrics = v["metrics_endpoint"].as_str().map(str::to_string);
                daemon.http = v["http"].as_str().map(str::to_string);
                return daemon;
            }
            if let Some(status) = daemon.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("replayd exited before ready ({status}):\n{}", daemon.log());
            }
            assert!(
                Instant::now() < deadline,
                "replayd not ready in time:\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts replayd listening on `endpoint` (e.g. a fixed port, so that a
    /// restarted daemon is found again by connected clients).
    pub fn start_on(endpoint: &str, rest: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = format!(
            "[server]\nendpoint = \"{endpoint}\"\ncontrol_endpoint = \"tcp://127.0.0.1:0\"\nruntime_dir = \"{}\"\n{rest}",
            dir.path().join("run").display()
        );
        let config_path = dir.path().join("replayd.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut daemon = Daemon {
            child: None,
            dir,
            endpoint: String::new(),
            control: String::new(),
            metrics: None,
            http: None,
            config_path,
        };
        daemon.relaunch();
        daemon
    }

    /// SIGKILLs the daemon (its workers die with it) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the daemon again on the same config (after [`Daemon::kill`]
    /// or an exit) and waits until it is ready.
    pub fn relaunch(&mut self) {
        self.kill();
        let ready = self.dir.path().join("ready.json");
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("replayd.log"))
            .unwrap();
        self.child = Some(
            Command::new(env!("CARGO_BIN_EXE_replayd"))
                .arg("--config")
                .arg(&self.config_path)
                .arg("--ready-file")
                .arg(&ready)
                .current_dir(crate_dir())
                .env("REPLAYD_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start replayd"),
        );
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let v: Value = serde_json::from_str(&text).unwrap();
                self.endpoint = v["endpoint"].as_str().unwrap().to_string();
                self.control = v["control_endpoint"].as_str().unwrap().to_string();
                self.metrics = v["metrics_endpoint"].as_str().map(str::to_string);
                self.http = v["http"].as_str().map(str::to_string);
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("replayd exited before ready ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "replayd not ready in time:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts replayd with a config that is expected to fail; returns its
    /// exit status and log.
    pub fn start_failing(config: &str) -> (ExitStatus, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("replayd.toml");
        std::fs::write(&path, config).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_replayd"))
            .arg("--config")
            .arg(&path)
            .current_dir(crate_dir())
            .output()
            .unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("replayd.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.endpoint).await.expect("connect")
    }

    /// Runs replayctl against this daemon.
    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_replayctl"))
            .arg("--control")
            .arg(&self.control)
            .args(args)
            .output()
            .expect("run replayctl")
    }

    /// `replayctl stats --json`, parsed.
    pub fn stats(&self) -> Value {
        let out = self.ctl(&["stats", "--json"]);
        assert!(
            out.status.success(),
            "replayctl stats failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("stats JSON")
    }

    pub fn device(&self, label: &str) -> Value {
        self.stats()["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["label"] == label)
            .cloned()
            .unwrap_or_else(|| panic!("no device {label}"))
    }

    /// Waits until `cond(stats)` holds.
    pub fn wait_for(&self, what: &str, timeout: Duration, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.stats();
            if cond(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {s:#}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn signal(&self, signal: i32) {
        unsafe {
            libc::kill(self.pid() as i32, signal);
        }
    }

    /// Waits for the daemon to exit.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "replayd did not exit:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SIGSTOPs `pid` and waits until every thread of it has stopped. kill()
/// returns before a multi-threaded process is stopped: one of its threads
/// must first be scheduled to take the signal and stop the others, and
/// until then they run on (on a loaded machine, for milliseconds: a worker
/// can still answer a batch sent after kill() has returned).
pub fn freeze(pid: i32) {
    // SAFETY: signalling a process the test started (a daemon or its worker).
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !all_threads_stopped(pid) {
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether every thread of `pid` is stopped (or gone).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    threads.flatten().all(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // The state is the field after the command name, which is in parentheses.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        matches!(state, None | Some("T" | "t" | "Z" | "X"))
    })
}

/// A small deterministic generator for test inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo) as u64) as usize
    }

    /// Roughly standard normal.
    pub fn normal(&mut self) -> f32 {
        let s: f64 = (0..12)
            .map(|_| (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
            .sum();
        (s - 6.0) as f32
    }
}

/// The seed MLP (`Linear(128,256) → ReLU → Linear(256,10)`) in float64, for
/// references on random inputs.
pub struct MlpReference {
    layers: Vec<(Vec<f64>, Vec<f64>, usize, usize)>,
}

impl MlpReference {
    pub fn load(path: &Path) -> Self {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let get = |name: &str| -> (Vec<f64>, Vec<usize>) {
            let t = st.tensor(name).unwrap();
            let v = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect();
            (v, t.shape().to_vec())
        };
        let mut layers = Vec::new();
        for i in [0, 2] {
            let (w, shape) = get(&format!("{i}.weight"));
            let (b, _) = get(&format!("{i}.bias"));
            layers.push((w, b, shape[0], shape[1]));
        }
        MlpReference { layers }
    }

    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f64> {
        let mut cur: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (li, (w, b, out, inp)) in self.layers.iter().enumerate() {
            let mut next = vec![0.0; rows * out];
            for r in 0..rows {
                for o in 0..*out {
                    let mut acc = b[o];
                    for i in 0..*inp {
                        acc += cur[r * inp + i] * w[o * inp + i];
                    }
                    next[r * out + o] = if li + 1 < self.layers.len() {
                        acc.max(0.0)
                    } else {
                        acc
                    };
                }
            }
            cur = next;
        }
        cur
    }
}

/// max |a - b| / max |b|
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
        / scale
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`):
/// the status and the body. Enough for testing the HTTP front.
pub fn http(address: &str, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(address).expect("connect to the HTTP front");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    if let Some(b) = body {
        // A body the server refuses early may not be read whole.
        let _ = s.write_all(b);
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text_end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP response head");
    let head = String::from_utf8_lossy(&out[..text_end]).to_string();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = out[text_end + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut plain = Vec::new();
        let mut rest = &body[..];
        loop {
            let line_end = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n =
                usize::from_str_radix(std::str::from_utf8(&rest[..line_end]).unwrap().trim(), 16)
                    .unwrap();
            if n == 0 {
                break;
            }
            plain.extend_from_slice(&rest[line_end + 2..line_end + 2 + n]);
            rest = &rest[line_end + 2 + n + 2..];
        }
        body = plain;
    }
    (status, body)
}

/// [`http`] with a JSON body, and the reply parsed as JSON.
pub fn http_json(address: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, bytes) = http(address, "POST", path, Some(body.to_string().as_bytes()));
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "{path}: not JSON ({e}): {}",
            String::from_utf8_lossy(&bytes)
        )
    });
    (status, v)
}

/// A TCP port that was free a moment ago (for a daemon restarted on the same address).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
