//! `replayctl`: inspect and operate a running replayd over its control
//! socket. See `replayctl --help` and `replayctl COMMAND --help`.
//!
//! Exit status: 0 done (`health`: every device ready), 1 the daemon answered
//! but refused or is not healthy, 2 no answer (not running, wrong socket,
//! permission denied, timeout) or a usage error.

use clap::{Args, Parser, Subcommand};
use replayd::daemon::control::{self, CallError, ControlRequest};
use replayd::daemon::stats::{
    table, BucketsReport, DeviceStats, DevicesReport, Health, HealthStatus, ReloadReport, Stats,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
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

impl From<CallError> for Failure {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Unreachable(e) => Failure::Unreachable(e),
            CallError::Refused(e) => Failure::Refused(e),
        }
    }
}

impl Conn {
    /// Sends a command; the daemon's `result` as a `T`, or why not.
    fn call<T: DeserializeOwned>(&self, request: &ControlRequest) -> Result<T, Failure> {
        Ok(self
            .runtime
            .block_on(control::call(&self.endpoint, request, self.timeout))?)
    }

    fn cmd<T: DeserializeOwned>(&self, cmd: &str) -> Result<T, Failure> {
        self.call(&ControlRequest::new(cmd))
    }

    /// A device command (drain, undrain, restart); the daemon's message.
    fn on_device(&self, cmd: &str, device: &str) -> Result<String, Failure> {
        let mut r = ControlRequest::new(cmd);
        r.device = Some(device.to_string());
        self.call(&r)
    }

    /// The device's entry in `devices`, by label or number.
    fn device(&self, label: &str) -> Result<DeviceStats, Failure> {
        let devices: DevicesReport = self.cmd("devices")?;
        devices
            .devices
            .into_iter()
            .enumerate()
            .find(|(i, d)| d.label == label || label.parse::<usize>().ok() == Some(*i))
            .map(|(_, d)| d)
            .ok_or_else(|| Failure::Refused(format!("no device {label:?}")))
    }
}

fn print_json(v: &impl Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// Prints `value` as JSON (`--json`), or the text `text` makes of it.
fn show<T: Serialize>(json: bool, value: &T, text: impl FnOnce(&T) -> String) {
    if json {
        print_json(value);
    } else {
        print!("{}", text(value));
    }
}

/// What `drain`, `undrain`, `restart` and `inject-fault` print with `--json`.
#[derive(Serialize)]
struct DeviceAnswer {
    message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<DeviceStats>,
}

/// Prints a device command's `--json` answer (the daemon's message, and the
/// device's entry once it settled).
fn print_answer(message: String, device: Option<DeviceStats>) {
    print_json(&DeviceAnswer { message, device });
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
            let h: Health = conn.cmd("health")?;
            show(json, &h, table::health);
            Ok(if h.status == HealthStatus::Ok { 0 } else { 1 })
        }
        Command::Stats { json, watch } => {
            let Some(every) = watch else {
                let s: Stats = conn.cmd("stats")?;
                show(json.json, &s, |s| table::stats(s, None));
                return Ok(0);
            };
            let every = Duration::from_secs_f64(every.max(0.2));
            let mut prev: Option<(Stats, Instant)> = None;
            loop {
                let s: Stats = conn.cmd("stats")?;
                let now = Instant::now();
                if json.json {
                    println!("{}", serde_json::to_string(&s).unwrap_or_default());
                } else {
                    let delta = prev
                        .as_ref()
                        .map(|(p, t)| (p, now.duration_since(*t).as_secs_f64()));
                    // Home and clear, then the frame: redrawn in place.
                    print!("\x1b[H\x1b[2J{}", table::stats(&s, delta));
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
            let d: DevicesReport = conn.cmd("devices")?;
            show(json, &d, |d| table::devices(&d.devices));
            Ok(0)
        }
        Command::Buckets { json, model } => {
            let mut b: BucketsReport = conn.cmd("buckets")?;
            if let Some(name) = &model {
                b.models.retain(|m| &m.name == name);
                if b.models.is_empty() {
                    return Err(Failure::Refused(format!("no model {name:?}")));
                }
            }
            show(json.json, &b, table::buckets);
            Ok(0)
        }
        Command::Drain {
            device,
            json,
            no_wait,
        } => {
            let message = conn.on_device("drain", &device)?;
            if !json.json {
                println!("{message}");
            }
            let mut d = conn.device(&device)?;
            if !no_wait {
                let deadline = Instant::now() + conn.timeout.max(Duration::from_secs(60));
                while d.inflight > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(100));
                    d = conn.device(&device)?;
                }
                if d.inflight > 0 {
                    return Err(Failure::Refused(format!(
                        "{device} still holds {} batches",
                        d.inflight
                    )));
                }
                if !json.json {
                    println!(
                        "{}: drained ({} batches in flight, state {})",
                        d.label,
                        d.inflight,
                        d.state.as_str()
                    );
                }
            }
            if json.json {
                print_answer(message, Some(d));
            }
            Ok(0)
        }
        Command::Undrain { device, json } => {
            let message = conn.on_device("undrain", &device)?;
            if json.json {
                print_answer(message, None);
            } else {
                println!("{message}");
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
            let message = conn.on_device("restart", &device)?;
            if !json.json {
                println!("{message}");
            }
            let mut d = before.clone();
            if !no_wait {
                let deadline = Instant::now() + Duration::from_secs(wait);
                loop {
                    std::thread::sleep(Duration::from_millis(100));
                    d = conn.device(&device)?;
                    if d.state.is_up() && d.restarts > before.restarts {
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err(Failure::Refused(format!(
                            "{device} is not ready again after {wait} s (state {})",
                            d.state.as_str()
                        )));
                    }
                }
                if !json.json {
                    println!(
                        "{}: {} again, worker pid {}, {} graphs",
                        d.label,
                        d.state.as_str(),
                        d.worker_pid.map_or("-".into(), |p| p.to_string()),
                        d.graphs.len()
                    );
                }
            }
            if json.json {
                print_answer(message, Some(d));
            }
            Ok(0)
        }
        Command::Reload(Json { json }) => {
            let r: ReloadReport = conn.cmd("reload")?;
            show(json, &r, table::reload);
            Ok(0)
        }
        Command::InjectFault { device, kind, json } => {
            let mut r = ControlRequest::new("inject_fault");
            r.device = Some(device);
            r.kind = Some(match kind {
                FaultArg::Corrupt => replayd::worker::link::FaultKind::Corrupt,
                FaultArg::Hang => replayd::worker::link::FaultKind::Hang,
            });
            let message: String = conn.call(&r)?;
            if json.json {
                print_answer(message, None);
            } else {
                println!("{message}");
            }
            Ok(0)
        }
    }
}
