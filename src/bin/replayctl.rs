//! `replayctl`: inspect and operate a running replayd over its control
//! socket. See `replayctl --help` and `replayctl COMMAND --help`.
//!
//! Exit status: 0 done (`health`: every device ready), 1 the daemon answered
//! but refused or is not healthy, 2 no answer (not running, wrong socket,
//! permission denied, timeout) or a usage error.

use clap::{Args, Parser, Subcommand};
use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
use replayd::daemon::control::ControlRequest;
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Operator CLI for replayd: health, statistics per bucket, devices, the
/// bucket grid and its tuning, drain/undrain, restart and reload.
///
/// The control socket is `--control`, else `server.control_endpoint` of
/// `--config` ($REPLAYD_CONFIG), else the daemon's default
/// (ipc://$XDG_RUNTIME_DIR/replayd/control.sock, or the systemd unit's
/// ipc:///run/replayd/control.sock when only that one exists).
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    /// The daemon's control endpoint (ipc:///PATH or tcp://127.0.0.1:PORT).
    #[arg(long, env = "REPLAYD_CONTROL", global = true)]
    control: Option<String>,

    /// Read the control endpoint from this replayd config file.
    #[arg(long, env = "REPLAYD_CONFIG", global = true)]
    config: Option<PathBuf>,

    /// Seconds to wait for each answer from the daemon.
    #[arg(long, default_value_t = 10, global = true)]
    timeout: u64,

    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug, Clone, Copy)]
struct Json {
    /// Print the daemon's answer as JSON (for scripts).
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// ok | degraded | starting | down, and each device's state. Exit status
    /// 0 only for ok (every device ready), 1 otherwise, 2 without an answer.
    Health(Json),
    /// Per model and bucket: requests, batches, graph hit rate, fill,
    /// padding waste, p50/p99; eager requests by reason; errors by code;
    /// queues; latency.
    Stats {
        #[command(flatten)]
        json: Json,
        /// Redraw every SECS seconds (default 2), with rates over the interval.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
    },
    /// Each device: state, worker, graphs and their memory, batches in
    /// flight, restarts, hangs, last error, and GPU memory, utilisation and
    /// temperature (NVML).
    Devices(Json),
    /// The bucket grid of each model with capture time and memory per
    /// graph, the observed length (or token-count) histogram, and a
    /// suggested grid of as many graphs that would pad less.
    Buckets {
        #[command(flatten)]
        json: Json,
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// Stop sending new batches to DEVICE; what it holds finishes, queued
    /// work goes to the other devices. Waits until it holds nothing.
    Drain {
        /// Device label (e.g. cuda:3, cpu:0) or number.
        device: String,
        #[command(flatten)]
        json: Json,
        /// Return at once instead of waiting for its batches to finish.
        #[arg(long)]
        no_wait: bool,
    },
    /// Let DEVICE take batches again.
    Undrain {
        device: String,
        #[command(flatten)]
        json: Json,
    },
    /// Drain DEVICE, stop its worker once it holds nothing and start a
    /// fresh one, which re-captures every graph. Nothing is lost. Waits
    /// until it is ready again.
    Restart {
        device: String,
        #[command(flatten)]
        json: Json,
        /// Return once the restart has begun.
        #[arg(long)]
        no_wait: bool,
        /// Longest wait for the device to be ready again, in seconds.
        #[arg(long, default_value_t = 600)]
        wait: u64,
    },
    /// Re-read the daemon's config file and apply the batching window,
    /// queue limits and bucket grids (new graphs are captured beside the old
    /// ones; no request is dropped). Refused, naming the key, if anything
    /// else changed. Exit status 0 only if the new configuration was taken.
    Reload(Json),
    /// Make a device's worker break its device (needs devices.fault_injection = true).
    InjectFault {
        /// Device label (e.g. cuda:0, cpu:1) or number.
        #[arg(long)]
        device: String,
        /// corrupt: a sticky error (the worker exits); hang: the device stops
        /// making progress (the watchdog must find it).
        #[arg(long, value_enum, default_value = "corrupt")]
        kind: FaultArg,
        #[command(flatten)]
        json: Json,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum FaultArg {
    Corrupt,
    Hang,
}

/// How a command ended.
enum Failure {
    /// The daemon answered with an error (exit 1).
    Refused(String),
    /// No answer, or a usage problem (exit 2).
    Unreachable(String),
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(Failure::Refused(e)) => {
            eprintln!("replayctl: {e}");
            1
        }
        Err(Failure::Unreachable(e)) => {
            eprintln!("replayctl: {e}");
            2
        }
    };
    std::process::exit(code);
}

/// Where to find the control socket (see the command's help).
fn endpoint(cli: &Cli) -> Result<String, Failure> {
    if let Some(c) = &cli.control {
        return Ok(c.clone());
    }
    if let Some(path) = &cli.config {
        return replayd::config::Config::load(path)
            .map(|c| c.server.control_endpoint)
            .map_err(|e| Failure::Unreachable(e.to_string()));
    }
    let default = replayd::config::ServerConfig::default().control_endpoint;
    let unit = "ipc:///run/replayd/control.sock";
    let exists = |e: &str| {
        e.strip_prefix("ipc://")
            .is_some_and(|p| std::path::Path::new(p).exists())
    };
    Ok(if !exists(&default) && exists(unit) {
        unit.to_string()
    } else {
        default
    })
}

struct Conn {
    endpoint: String,
    timeout: Duration,
    runtime: tokio::runtime::Runtime,
}

impl Conn {
    /// Sends a command; the daemon's `result`, or why not.
    fn call(&self, request: &ControlRequest) -> Result<Value, Failure> {
        let reply = self
            .runtime
            .block_on(replayd::daemon::control::request(
                &self.endpoint,
                request,
                self.timeout,
            ))
            .map_err(Failure::Unreachable)?;
        if reply["ok"] != Value::Bool(true) {
            return Err(Failure::Refused(
                reply["error"]
                    .as_str()
                    .unwrap_or("the daemon reported an error")
                    .to_string(),
            ));
        }
        Ok(reply["result"].clone())
    }

    fn cmd(&self, cmd: &str) -> Result<Value, Failure> {
        self.call(&ControlRequest::new(cmd))
    }

    fn on_device(&self, cmd: &str, device: &str) -> Result<Value, Failure> {
        let mut r = ControlRequest::new(cmd);
        r.device = Some(device.to_string());
        self.call(&r)
    }

    /// The device's entry in `devices`.
    fn device(&self, label: &str) -> Result<Value, Failure> {
        let devices = self.cmd("devices")?;
        let found = arr(&devices["devices"])
            .iter()
            .enumerate()
            .find(|(i, d)| d["label"] == label || label.parse::<usize>().ok() == Some(*i))
            .map(|(_, d)| d.clone());
        found.ok_or_else(|| Failure::Refused(format!("no device {label:?}")))
    }
}

fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn run(cli: Cli) -> Result<i32, Failure> {
    let endpoint = endpoint(&cli)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Unreachable(e.to_string()))?;
    let conn = Conn {
        endpoint,
        timeout: Duration::from_secs(cli.timeout.max(1)),
        runtime,
    };
    match cli.command {
        Command::Health(Json { json }) => {
            let h = conn.cmd("health")?;
            if json {
                print_json(&h);
            } else {
                print!("{}", render_health(&h));
            }
            Ok(if h["status"] == "ok" { 0 } else { 1 })
        }
        Command::Stats { json, watch } => {
            let Some(every) = watch else {
                let s = conn.cmd("stats")?;
                if json.json {
                    print_json(&s);
                } else {
                    print!("{}", render_stats(&s, None));
                }
                return Ok(0);
            };
            let every = Duration::from_secs_f64(every.max(0.2));
            let mut prev: Option<(Value, Instant)> = None;
            loop {
                let s = conn.cmd("stats")?;
                let now = Instant::now();
                if json.json {
                    println!("{}", serde_json::to_string(&s).unwrap_or_default());
                } else {
                    let delta = prev
                        .as_ref()
                        .map(|(p, t)| (p, now.duration_since(*t).as_secs_f64()));
                    // Home and clear, then the frame: redrawn in place.
                    print!("\x1b[H\x1b[2J{}", render_stats(&s, delta));
                    println!(
                        "(every {:.1} s; rates over the interval; Ctrl-C to stop)",
                        every.as_secs_f64()
                    );
                }
                prev = Some((s, now));
                std::thread::sleep(every);
            }
        }
        Command::Devices(Json { json }) => {
            let d = conn.cmd("devices")?;
            if json {
                print_json(&d);
            } else {
                print!("{}", render_devices(arr(&d["devices"])));
            }
            Ok(0)
        }
        Command::Buckets { json, model } => {
            let mut b = conn.cmd("buckets")?;
            if let Some(name) = &model {
                let models: Vec<Value> = arr(&b["models"])
                    .iter()
                    .filter(|m| m["name"] == name.as_str())
                    .cloned()
                    .collect();
                if models.is_empty() {
                    return Err(Failure::Refused(format!("no model {name:?}")));
                }
                b["models"] = Value::Array(models);
            }
            if json.json {
                print_json(&b);
            } else {
                print!("{}", render_buckets(&b));
            }
            Ok(0)
        }
        Command::Drain {
            device,
            json,
            no_wait,
        } => {
            let msg = conn.on_device("drain", &device)?;
            if !json.json {
                println!("{}", msg.as_str().unwrap_or_default());
            }
            let mut d = conn.device(&device)?;
            if !no_wait {
                let deadline = Instant::now() + conn.timeout.max(Duration::from_secs(60));
                while d["inflight"].as_u64().unwrap_or(0) > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(100));
                    d = conn.device(&device)?;
                }
                if d["inflight"].as_u64().unwrap_or(0) > 0 {
                    return Err(Failure::Refused(format!(
                        "{device} still holds {} batches",
                        d["inflight"]
                    )));
                }
                if !json.json {
                    println!(
                        "{}: drained ({} batches in flight, state {})",
                        d["label"].as_str().unwrap_or(&device),
                        d["inflight"],
                        d["state"].as_str().unwrap_or("?")
                    );
                }
            }
            if json.json {
                print_json(&serde_json::json!({"message": msg, "device": d}));
            }
            Ok(0)
        }
        Command::Undrain { device, json } => {
            let msg = conn.on_device("undrain", &device)?;
            if json.json {
                print_json(&serde_json::json!({"message": msg}));
            } else {
                println!("{}", msg.as_str().unwrap_or_default());
            }
            Ok(0)
        }
        Command::Restart {
            device,
            json,
            no_wait,
            wait,
        } => {
            let before = conn.device(&device)?;
            let msg = conn.on_device("restart", &device)?;
            if !json.json {
                println!("{}", msg.as_str().unwrap_or_default());
            }
            let mut d = before.clone();
            if !no_wait {
                let deadline = Instant::now() + Duration::from_secs(wait);
                let restarts = before["restarts"].as_u64().unwrap_or(0);
                loop {
                    std::thread::sleep(Duration::from_millis(100));
                    d = conn.device(&device)?;
                    let up = matches!(d["state"].as_str(), Some("ready" | "draining"));
                    if up && d["restarts"].as_u64().unwrap_or(0) > restarts {
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err(Failure::Refused(format!(
                            "{device} is not ready again after {wait} s (state {})",
                            d["state"]
                        )));
                    }
                }
                if !json.json {
                    println!(
                        "{}: {} again, worker pid {}, {} graphs",
                        d["label"].as_str().unwrap_or(&device),
                        d["state"].as_str().unwrap_or("?"),
                        d["worker_pid"],
                        arr(&d["graphs"]).len()
                    );
                }
            }
            if json.json {
                print_json(&serde_json::json!({"message": msg, "device": d}));
            }
            Ok(0)
        }
        Command::Reload(Json { json }) => {
            let r = conn.cmd("reload")?;
            if json {
                print_json(&r);
            } else {
                print!("{}", render_reload(&r));
            }
            Ok(0)
        }
        Command::InjectFault { device, kind, json } => {
            let mut r = ControlRequest::new("inject_fault");
            r.device = Some(device);
            r.kind = Some(match kind {
                FaultArg::Corrupt => replayd::worker::link::FaultKind::Corrupt,
                FaultArg::Hang => replayd::worker::link::FaultKind::Hang,
            });
            let msg = conn.call(&r)?;
            if json.json {
                print_json(&serde_json::json!({"message": msg}));
            } else {
                println!("{}", msg.as_str().unwrap_or("done"));
            }
            Ok(0)
        }
    }
}

// ---- rendering (pure: JSON in, text out) ------------------------------------

fn arr(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn st(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// 1234567 → "1,234,567".
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn micros(us: u64) -> String {
    match us {
        0 => "-".into(),
        u if u < 1_000 => format!("{u} µs"),
        u if u < 1_000_000 => format!("{:.2} ms", u as f64 / 1e3),
        u => format!("{:.2} s", u as f64 / 1e6),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// A table with a header, numeric columns (from `right_from` on) right-aligned.
fn table(header: &[&str], right_from: usize) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    for i in right_from..header.len() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

fn grid_text(m: &Value) -> String {
    let g = &m["grid"];
    let list = |v: &Value| {
        arr(v)
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if g["token_budgets"].is_array() {
        format!(
            "token budgets [{}], at most {} sequences",
            list(&g["token_budgets"]),
            g["max_seqs_per_batch"]
        )
    } else if arr(&g["seq_buckets"]).len() == 1 && g["seq_buckets"][0] == 1 {
        format!("batch buckets [{}]", list(&g["batch_buckets"]))
    } else {
        format!(
            "batch buckets [{}] × seq buckets [{}]",
            list(&g["batch_buckets"]),
            list(&g["seq_buckets"])
        )
    }
}

fn render_health(h: &Value) -> String {
    let mut out = format!("status: {}\n", st(&h["status"]));
    let mut t = table(&["device", "role", "state", "restarts", "last error"], 3);
    for d in arr(&h["devices"]) {
        t.add_row(vec![
            st(&d["device"]).to_string(),
            st(&d["role"]).to_string(),
            st(&d["state"]).to_string(),
            u(&d["restarts"]).to_string(),
            st(&d["last_error"]).to_string(),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

/// The stats screen; `prev` (an earlier snapshot and the seconds since)
/// adds rates over that interval.
fn render_stats(s: &Value, prev: Option<(&Value, f64)>) -> String {
    let mut out = String::new();
    let req = &s["requests"];
    let lat = &s["latency"];
    out.push_str(&format!(
        "uptime {:.0} s   requests accepted {}, ok {}, split over batches {}   reloads {}\n",
        f(&s["uptime_s"]),
        thousands(u(&req["accepted"])),
        thousands(u(&req["ok"])),
        thousands(u(&req["split"])),
        u(&s["reloads"]),
    ));
    out.push_str(&format!(
        "latency p50/p99: total {} / {}   queued {} / {}   on the device {} / {}\n\n",
        micros(u(&lat["total"]["p50_us"])),
        micros(u(&lat["total"]["p99_us"])),
        micros(u(&lat["queued"]["p50_us"])),
        micros(u(&lat["queued"]["p99_us"])),
        micros(u(&lat["compute"]["p50_us"])),
        micros(u(&lat["compute"]["p99_us"])),
    ));
    let rate = |path: &dyn Fn(&Value) -> u64| -> Option<String> {
        let (p, dt) = prev?;
        let now = path(s);
        let then = path(p);
        Some(format!(
            "{:.1}",
            now.saturating_sub(then) as f64 / dt.max(1e-3)
        ))
    };
    let find = |list: &Value, key: &[(&str, &Value)]| -> Option<Value> {
        arr(list)
            .iter()
            .find(|x| key.iter().all(|(k, v)| &x[*k] == *v))
            .cloned()
    };

    // Models.
    let mut header = vec![
        "model",
        "batching",
        "requests",
        "graph hit rate",
        "eager",
        "errors",
        "tokens",
        "computed",
        "padding",
        "queued",
    ];
    if prev.is_some() {
        header.push("req/s");
    }
    let mut t = table(&header, 2);
    for m in arr(&s["models"]) {
        let name = st(&m["name"]);
        let errors: u64 = m["requests"]["errors"]
            .as_object()
            .map_or(0, |e| e.values().map(u).sum());
        let mut row = vec![
            name.to_string(),
            st(&m["batching"]).to_string(),
            thousands(u(&m["requests"]["ok"])),
            pct(f(&m["graph_hit_rate"])),
            thousands(u(&m["requests"]["eager"])),
            thousands(errors),
            thousands(u(&m["padding"]["tokens"])),
            thousands(u(&m["padding"]["computed_tokens"])),
            pct(f(&m["padding"]["padding_waste"])),
            u(&s["queue_depth"]["by_model"][name]).to_string(),
        ];
        if prev.is_some() {
            let name = m["name"].clone();
            row.push(
                rate(&|x: &Value| {
                    find(&x["models"], &[("name", &name)]).map_or(0, |m| u(&m["requests"]["ok"]))
                })
                .unwrap_or_default(),
            );
        }
        t.add_row(row);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    for m in arr(&s["models"]) {
        out.push_str(&format!("  {}: {}\n", st(&m["name"]), grid_text(m)));
    }
    out.push('\n');

    // Buckets.
    let mut header = vec![
        "model",
        "bucket",
        "requests",
        "batches",
        "seqs/batch",
        "seq fill",
        "tokens",
        "computed",
        "token fill",
        "padding",
        "p50",
        "p99",
    ];
    if prev.is_some() {
        header.extend(["batch/s", "padding now"]);
    }
    let mut t = table(&header, 2);
    for b in arr(&s["buckets"]) {
        let bucket = format!(
            "{}{}",
            st(&b["bucket"]),
            if b["in_grid"] == false { " (old)" } else { "" }
        );
        let mut row = vec![
            st(&b["model"]).to_string(),
            bucket,
            thousands(u(&b["requests"])),
            thousands(u(&b["batches"])),
            format!("{:.1}", f(&b["seqs_per_batch"])),
            pct(f(&b["seq_fill"])),
            thousands(u(&b["tokens"])),
            thousands(u(&b["computed_tokens"])),
            pct(f(&b["token_fill"])),
            pct(f(&b["padding_waste"])),
            micros(u(&b["p50_us"])),
            micros(u(&b["p99_us"])),
        ];
        if let Some((p, _)) = prev {
            let key = [("model", &b["model"]), ("bucket", &b["bucket"])];
            let then = find(&p["buckets"], &key);
            row.push(
                rate(&|x: &Value| find(&x["buckets"], &key).map_or(0, |b| u(&b["batches"])))
                    .unwrap_or_default(),
            );
            let (pad0, comp0) = then.map_or((0, 0), |t| {
                (u(&t["padded_tokens"]), u(&t["computed_tokens"]))
            });
            let dpad = u(&b["padded_tokens"]).saturating_sub(pad0);
            let dcomp = u(&b["computed_tokens"]).saturating_sub(comp0);
            row.push(if dcomp == 0 {
                "-".into()
            } else {
                pct(dpad as f64 / dcomp as f64)
            });
        }
        t.add_row(row);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out.push_str(
        "(seq fill: real sequences over the bucket's rows; token fill: real tokens over computed; \
padding: 1 − token fill; p50/p99: latency of the requests named after the bucket)\n\n",
    );

    // Eager work and errors.
    let eager = &s["eager"];
    let reasons: Vec<String> = eager["by_reason"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k} {}", thousands(u(v))))
        .collect();
    out.push_str(&format!(
        "eager requests: {}{}   batches {}, sequences {}, tokens {}   queued {}\n",
        thousands(u(&eager["requests"])),
        if reasons.is_empty() {
            String::new()
        } else {
            format!(" ({})", reasons.join(", "))
        },
        thousands(u(&eager["batches"])),
        thousands(u(&eager["sequences"])),
        thousands(u(&eager["tokens"])),
        u(&s["queue_depth"]["eager"]),
    ));
    let errors: Vec<String> = req["errors"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| u(v) > 0)
        .map(|(k, v)| format!("{k} {}", thousands(u(v))))
        .collect();
    out.push_str(&format!(
        "errors by code: {}   retried batches {}\n\n",
        if errors.is_empty() {
            "none".into()
        } else {
            errors.join(", ")
        },
        u(&s["retried_batches"]),
    ));

    // Devices, short.
    let mut t = table(
        &[
            "device",
            "role",
            "state",
            "batches",
            "in flight",
            "graphs",
            "restarts",
        ],
        3,
    );
    for d in arr(&s["devices"]) {
        t.add_row(vec![
            st(&d["label"]).to_string(),
            st(&d["role"]).to_string(),
            st(&d["state"]).to_string(),
            thousands(u(&d["batches"])),
            u(&d["inflight"]).to_string(),
            arr(&d["graphs"]).len().to_string(),
            u(&d["restarts"]).to_string(),
        ]);
    }
    out.push_str(&t.to_string());
    out.push('\n');
    out
}

fn render_devices(devices: &[Value]) -> String {
    let mut t = table(
        &[
            "device",
            "role",
            "state",
            "name",
            "pid",
            "graphs",
            "graph memory",
            "batches",
            "in flight",
            "restarts",
            "faults",
            "hangs",
            "GPU memory",
            "GPU util",
            "GPU temp",
        ],
        4,
    );
    let mut errors = Vec::new();
    for d in devices {
        let graphs = arr(&d["graphs"]);
        let memory: u64 = graphs.iter().map(|g| u(&g["memory_bytes"])).sum();
        let gpu = &d["gpu"];
        let (gmem, util, temp) = if gpu["memory_total_bytes"].is_u64() {
            (
                format!(
                    "{} / {}",
                    mib(u(&gpu["memory_used_bytes"])),
                    mib(u(&gpu["memory_total_bytes"]))
                ),
                format!("{}%", u(&gpu["utilization_pct"])),
                format!("{} °C", u(&gpu["temperature_c"])),
            )
        } else {
            ("-".into(), "-".into(), "-".into())
        };
        let mut state = st(&d["state"]).to_string();
        if let (Some(done), Some(total)) = (d["capture"][0].as_u64(), d["capture"][1].as_u64()) {
            state = format!("{state} {done}/{total}");
        }
        if d["drained"] == true && !state.starts_with("draining") {
            state.push_str(" (drained)");
        }
        t.add_row(vec![
            st(&d["label"]).to_string(),
            st(&d["role"]).to_string(),
            state,
            st(&d["name"]).to_string(),
            d["worker_pid"]
                .as_u64()
                .map_or("-".into(), |p| p.to_string()),
            graphs.len().to_string(),
            mib(memory),
            thousands(u(&d["batches"])),
            u(&d["inflight"]).to_string(),
            u(&d["restarts"]).to_string(),
            u(&d["device_faults"]).to_string(),
            u(&d["hangs"]).to_string(),
            gmem,
            util,
            temp,
        ]);
        if let Some(e) = d["last_error"].as_str() {
            errors.push(format!("  {}: {e}", st(&d["label"])));
        }
    }
    let mut out = t.to_string();
    out.push('\n');
    if !errors.is_empty() {
        out.push_str("last errors:\n");
        out.push_str(&errors.join("\n"));
        out.push('\n');
    }
    out
}

/// A text bar chart of (upper bound, count) bins.
fn bars(bins: &[Value], unit: &str) -> String {
    let max = bins.iter().map(|b| u(&b[1])).max().unwrap_or(0).max(1);
    let mut out = String::new();
    let mut lower = 0;
    for b in bins {
        let (hi, n) = (u(&b[0]), u(&b[1]));
        let width = (40 * n).div_ceil(max) as usize;
        out.push_str(&format!(
            "    {:>13} {unit} {:>9} {}\n",
            if lower + 1 >= hi {
                hi.to_string()
            } else {
                format!("{}–{hi}", lower + 1)
            },
            thousands(n),
            "#".repeat(width)
        ));
        lower = hi;
    }
    out
}

fn list(v: &Value) -> String {
    format!(
        "[{}]",
        arr(v)
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn render_buckets(b: &Value) -> String {
    let mut out = String::new();
    for m in arr(&b["models"]) {
        out.push_str(&format!(
            "model {} ({}): {}\n",
            st(&m["name"]),
            st(&m["batching"]),
            grid_text(m)
        ));
        let mut t = table(
            &[
                "bucket", "devices", "capture", "memory", "requests", "batches", "padding",
            ],
            1,
        );
        let (mut capture, mut memory) = (0, 0);
        for g in arr(&m["graphs"]) {
            capture += u(&g["capture_us"]);
            memory += u(&g["memory_bytes"]);
            t.add_row(vec![
                st(&g["bucket"]).to_string(),
                u(&g["devices"]).to_string(),
                micros(u(&g["capture_us"])),
                mib(u(&g["memory_bytes"])),
                thousands(u(&g["requests"])),
                thousands(u(&g["batches"])),
                pct(f(&g["padding_waste"])),
            ]);
        }
        out.push_str(&t.to_string());
        out.push('\n');
        out.push_str(&format!(
            "  {} graphs per device: capture {} in all, {} of static buffers\n",
            arr(&m["graphs"]).len(),
            micros(capture),
            mib(memory)
        ));
        let packed = m["batching"] == "packed";
        let (hist, what, unit) = if packed {
            (&m["batch_tokens"], "tokens per batch", "tok")
        } else if m["grid"]["seq_buckets"] == serde_json::json!([1]) {
            (&m["batch_rows"], "rows per batch", "rows")
        } else {
            (&m["lengths"], "tokens per text", "tok")
        };
        let summary = |h: &Value| {
            format!(
                "n {}, mean {:.1}, p50 {}, p90 {}, p99 {}, max {}",
                thousands(u(&h["count"])),
                f(&h["mean"]),
                h["p50"],
                h["p90"],
                h["p99"],
                h["max"]
            )
        };
        if packed || m["grid"]["seq_buckets"] != serde_json::json!([1]) {
            out.push_str(&format!("  texts: {}\n", summary(&m["lengths"])));
        }
        if u(&hist["count"]) == 0 {
            out.push_str("  observed: nothing yet (send traffic, then look again)\n\n");
            continue;
        }
        out.push_str(&format!("  observed {what}: {}\n", summary(hist)));
        out.push_str(&bars(arr(&hist["bins"]), unit));
        for sg in arr(&m["suggestions"]) {
            let key = st(&sg["key"]);
            let (cur, new) = (&sg["current_cost"], &sg["suggested_cost"]);
            let unit = if key == "batch_buckets" {
                "rows"
            } else {
                "tokens"
            };
            if sg["current"] == sg["suggested"] {
                out.push_str(&format!(
                    "  {key} = {}: already the least padding for {} sizes on what was observed ({} {unit} padding)\n",
                    list(&sg["current"]),
                    arr(&sg["current"]).len(),
                    pct(f(&cur["waste"]))
                ));
            } else {
                out.push_str(&format!(
                    "  suggested {key} = {}\n    instead of {}: {unit} padding {} → {} on what was observed (same {} sizes; {} above the largest stay as they are)\n",
                    list(&sg["suggested"]),
                    list(&sg["current"]),
                    pct(f(&cur["waste"])),
                    pct(f(&new["waste"])),
                    arr(&sg["current"]).len(),
                    thousands(u(&cur["above"])),
                ));
            }
        }
        if let Some(cap) = m["seq_cap"].as_object() {
            let (cur, sug) = (u(&cap["current"]), u(&cap["suggested"]));
            out.push_str(&format!(
                "  max_seqs_per_batch = {cur}: {} of batches stopped at it{}\n",
                pct(f(&cap["share_at_cap"])),
                if sug != cur {
                    format!("; suggested {sug}, so that a full budget of short texts fits")
                } else {
                    "; keep it".into()
                }
            ));
        }
        out.push('\n');
    }
    out.push_str("Apply a grid by editing the config file, then `replayctl reload` (no restart, no request lost).\n");
    out
}

fn render_reload(r: &Value) -> String {
    let changed = arr(&r["changed"]);
    if changed.is_empty() {
        return "reload: nothing changed\n".into();
    }
    let mut out = format!(
        "reload applied: {}\n",
        changed
            .iter()
            .map(|k| st(k).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for m in arr(&r["models"]) {
        out.push_str(&format!(
            "  {}: now {} ({})\n",
            st(&m["model"]),
            grid_text(m),
            st(&m["batching"])
        ));
    }
    if u(&r["graphs_captured"]) > 0 {
        out.push_str(&format!(
            "  {} new graphs captured beside the old ones; the old ones are released\n",
            u(&r["graphs_captured"])
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use replayd::bucket::{Bucket, BucketGrid, Grid, TokenGrid};
    use replayd::daemon::metrics::{Metrics, ModelStats};

    /// A known state: a long-named packed model and a short-named MLP.
    fn known() -> Value {
        let m = Metrics::new();
        let long = "sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets";
        let grid = Grid::Packed(TokenGrid::new(vec![64, 256], 16));
        let mlp = Grid::Padded(BucketGrid::new(vec![1, 8], vec![1]));
        m.set_models(vec![
            ModelStats {
                name: long.into(),
                batching: "packed".into(),
                grid: grid.describe(),
                folder: Vec::new(),
            },
            ModelStats {
                name: "mlp".into(),
                batching: "padded".into(),
                grid: mlp.describe(),
                folder: Vec::new(),
            },
        ]);
        m.set_model_grid(long, &grid);
        m.set_model_grid("mlp", &mlp);
        m.observe_items(long, &[20, 40]);
        m.bucket_batch(long, Bucket::packed(64, 16), 1, 2, 60);
        m.model_reply(long, Some(Bucket::packed(64, 16)), 1500);
        m.observe_items(long, &[300]);
        m.eager_request(long, replayd::daemon::metrics::EagerReason::SeqTooLong);
        m.eager_batch(1, 300);
        m.model_reply(long, None, 9000);
        for _ in 0..3 {
            m.observe_items("mlp", &[1; 5]);
            m.bucket_batch("mlp", Bucket::new(8, 1), 1, 5, 5);
            m.model_reply("mlp", Some(Bucket::new(8, 1)), 250);
        }
        m.model_error("mlp", replayd::protocol::ErrorCode::Overloaded);
        let mut s = m.snapshot();
        s["uptime_s"] = serde_json::json!(12.0);
        s
    }

    #[test]
    fn the_stats_table_is_aligned_for_long_model_names() {
        let text = render_stats(&known(), None);
        let expected = r#"uptime 12 s   requests accepted 5, ok 0, split over batches 0   reloads 0
latency p50/p99: total - / -   queued - / -   on the device - / -

| model                                                            | batching | requests | graph hit rate | eager | errors | tokens | computed | padding | queued |
|------------------------------------------------------------------|----------|----------|----------------|-------|--------|--------|----------|---------|--------|
| sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets | packed   |        2 |          50.0% |     1 |      0 |     60 |       64 |    6.2% |      0 |
| mlp                                                              | padded   |        3 |         100.0% |     0 |      1 |     15 |       24 |   37.5% |      0 |
  sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets: token budgets [64, 256], at most 16 sequences
  mlp: batch buckets [1, 8]

| model                                                            | bucket | requests | batches | seqs/batch | seq fill | tokens | computed | token fill | padding |     p50 |     p99 |
|------------------------------------------------------------------|--------|----------|---------|------------|----------|--------|----------|------------|---------|---------|---------|
| mlp                                                              | 8x1    |        3 |       3 |        5.0 |    62.5% |     15 |       24 |      62.5% |   37.5% |  250 µs |  250 µs |
| sentence-transformers-all-MiniLM-L6-v2-finetuned-support-tickets | 64t    |        1 |       1 |        2.0 |    12.5% |     60 |       64 |      93.8% |    6.2% | 1.50 ms | 1.50 ms |
(seq fill: real sequences over the bucket's rows; token fill: real tokens over computed; padding: 1 − token fill; p50/p99: latency of the requests named after the bucket)

eager requests: 1 (seq_too_long 1)   batches 1, sequences 1, tokens 300   queued 0
errors by code: overloaded 1   retried batches 0

| device | role | state | batches | in flight | graphs | restarts |
|--------|------|-------|---------|-----------|--------|----------|
"#;
        assert_eq!(text, expected, "got:\n{text}");
        // Every line of a table has the same width as its header.
        for block in text.split("\n\n") {
            let rows: Vec<&str> = block.lines().filter(|l| l.starts_with('|')).collect();
            if let Some(first) = rows.first() {
                for r in &rows {
                    assert_eq!(r.chars().count(), first.chars().count(), "{r}");
                }
            }
        }
    }

    #[test]
    fn watch_adds_rates_over_the_interval() {
        let before = known();
        let mut after = before.clone();
        after["buckets"][0]["batches"] = serde_json::json!(13);
        after["buckets"][0]["padded_tokens"] = serde_json::json!(9 + 30);
        after["buckets"][0]["computed_tokens"] = serde_json::json!(24 + 80);
        let text = render_stats(&after, Some((&before, 2.0)));
        let row = text.lines().find(|l| l.contains(" 8x1 ")).unwrap();
        assert!(row.contains("|     5.0 |"), "{row}");
        assert!(row.contains("37.5%"), "{row}");
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(thousands(12), "12");
        assert_eq!(micros(999), "999 µs");
        assert_eq!(micros(1500), "1.50 ms");
        assert_eq!(micros(2_500_000), "2.50 s");
    }
}
