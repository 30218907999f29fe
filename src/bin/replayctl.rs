//! `replayctl`: inspect and operate a running replayd. See `replayctl --help`.

use anyhow::{anyhow, bail, Context};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use replayd::daemon::control::ControlRequest;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Operator CLI for replayd: health, per-bucket statistics, fault injection.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The daemon's control endpoint.
    #[arg(long, env = "REPLAYD_CONTROL", default_value = "tcp://127.0.0.1:5556")]
    control: String,

    /// Read the control endpoint from this replayd config file instead.
    #[arg(long, env = "REPLAYD_CONFIG")]
    config: Option<PathBuf>,

    /// Seconds to wait for the daemon's answer.
    #[arg(long, default_value_t = 10)]
    timeout: u64,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Overall health and each device's state (exit status 1 unless "ok").
    Health {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Counters: per-bucket use and padding, eager requests, errors, queues,
    /// latency percentiles, devices and their graphs.
    Stats {
        /// Print the raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make a device's worker break its device (needs devices.fault_injection = true).
    InjectFault {
        /// Device label (e.g. cuda:0, cpu:1) or number.
        #[arg(long)]
        device: String,
        /// corrupt: a sticky error (the worker exits); hang: the device stops
        /// making progress (the watchdog must find it).
        #[arg(long, value_enum, default_value = "corrupt")]
        kind: FaultArg,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum FaultArg {
    Corrupt,
    Hang,
}

fn main() {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("replayctl: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let endpoint = match &cli.config {
        Some(path) => replayd::config::Config::load(path)?.server.control_endpoint,
        None => cli.control.clone(),
    };
    let request = match &cli.command {
        Command::Health { .. } => ControlRequest {
            cmd: "health".into(),
            device: None,
            kind: None,
        },
        Command::Stats { .. } => ControlRequest {
            cmd: "stats".into(),
            device: None,
            kind: None,
        },
        Command::InjectFault { device, kind } => ControlRequest {
            cmd: "inject_fault".into(),
            device: Some(device.clone()),
            kind: Some(match kind {
                FaultArg::Corrupt => replayd::worker::link::FaultKind::Corrupt,
                FaultArg::Hang => replayd::worker::link::FaultKind::Hang,
            }),
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let reply = runtime.block_on(call(&endpoint, &request, Duration::from_secs(cli.timeout)))?;
    if reply["ok"] != Value::Bool(true) {
        bail!(
            "{}",
            reply["error"]
                .as_str()
                .unwrap_or("the daemon reported an error")
        );
    }
    let result = &reply["result"];
    match cli.command {
        Command::Health { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(result)?);
            } else {
                println!("status: {}", result["status"].as_str().unwrap_or("?"));
                for d in result["devices"].as_array().into_iter().flatten() {
                    println!(
                        "  {:<10} {:<6} {:<9} restarts {}{}",
                        d["device"].as_str().unwrap_or("?"),
                        d["role"].as_str().unwrap_or("?"),
                        d["state"].as_str().unwrap_or("?"),
                        d["restarts"],
                        d["last_error"]
                            .as_str()
                            .map(|e| format!("  last error: {e}"))
                            .unwrap_or_default()
                    );
                }
            }
            Ok(if result["status"] == "ok" { 0 } else { 1 })
        }
        Command::Stats { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(result)?);
            } else {
                print_stats(result);
            }
            Ok(0)
        }
        Command::InjectFault { .. } => {
            println!("{}", result.as_str().unwrap_or("done"));
            Ok(0)
        }
    }
}

async fn call(
    endpoint: &str,
    request: &ControlRequest,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let mut socket = zeromq::DealerSocket::new();
    tokio::time::timeout(timeout, socket.connect(endpoint))
        .await
        .map_err(|_| anyhow!("cannot connect to {endpoint}: timed out"))?
        .with_context(|| format!("cannot connect to {endpoint}"))?;
    let frame = Bytes::from(serde_json::to_vec(request)?);
    socket.send(ZmqMessage::from(frame)).await?;
    let reply = tokio::time::timeout(timeout, socket.recv())
        .await
        .map_err(|_| anyhow!("no answer from {endpoint} within {timeout:?}"))??;
    let frame = reply
        .into_vec()
        .pop()
        .ok_or_else(|| anyhow!("empty answer"))?;
    serde_json::from_slice(&frame).context("malformed answer")
}

fn print_stats(s: &Value) {
    let req = &s["requests"];
    println!(
        "uptime {:.0} s   requests accepted {}   ok {}",
        s["uptime_s"].as_f64().unwrap_or(0.0),
        req["accepted"],
        req["ok"]
    );
    let errors: Vec<String> = req["errors"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| v.as_u64() != Some(0))
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "errors: {}",
        if errors.is_empty() {
            "none".into()
        } else {
            errors.join(", ")
        }
    );
    let lat = &s["latency"]["total"];
    println!(
        "latency (receipt → reply): p50 {} µs  p90 {} µs  p99 {} µs  max {} µs",
        lat["p50_us"], lat["p90_us"], lat["p99_us"], lat["max_us"]
    );
    println!(
        "requests split over several batches: {}",
        req["split"].as_u64().unwrap_or(0)
    );
    println!();
    for m in s["models"].as_array().into_iter().flatten() {
        let p = &m["padding"];
        println!(
            "model {}: {} batching {}   tokens {} computed {}  padding waste {:.1}%",
            m["name"].as_str().unwrap_or("?"),
            m["batching"].as_str().unwrap_or("?"),
            m["grid"],
            p["tokens"],
            p["computed_tokens"],
            100.0 * p["padding_waste"].as_f64().unwrap_or(0.0),
        );
    }
    let p = &s["padding"];
    println!(
        "all models: tokens {} computed {}  padding waste {:.1}%",
        p["tokens"],
        p["computed_tokens"],
        100.0 * p["padding_waste"].as_f64().unwrap_or(0.0)
    );
    println!();
    println!(
        "{:<22} {:>8} {:>8} {:>8} {:>6} {:>9} {:>8} {:>8} {:>10} {:>10} {:>8} {:>8}",
        "model/bucket",
        "requests",
        "parts",
        "batches",
        "hit %",
        "seqs",
        "seqs/b",
        "seq fill",
        "tokens",
        "computed",
        "tok fill",
        "pad wst"
    );
    let buckets = s["buckets"].as_array().cloned().unwrap_or_default();
    let total_batches: u64 = buckets.iter().filter_map(|b| b["batches"].as_u64()).sum();
    for b in &buckets {
        let batches = b["batches"].as_u64().unwrap_or(0);
        let pct = |k: &str| 100.0 * b[k].as_f64().unwrap_or(0.0);
        println!(
            "{:<22} {:>8} {:>8} {:>8} {:>5.1}% {:>9} {:>8.1} {:>7.1}% {:>10} {:>10} {:>7.1}% {:>7.1}%",
            format!(
                "{}/{}",
                b["model"].as_str().unwrap_or("?"),
                b["bucket"].as_str().unwrap_or("?")
            ),
            b["requests"].as_u64().unwrap_or(0),
            b["parts"].as_u64().unwrap_or(0),
            batches,
            100.0 * batches as f64 / total_batches.max(1) as f64,
            b["rows"].as_u64().unwrap_or(0),
            b["seqs_per_batch"].as_f64().unwrap_or(0.0),
            pct("seq_fill"),
            b["tokens"].as_u64().unwrap_or(0),
            b["computed_tokens"].as_u64().unwrap_or(0),
            pct("token_fill"),
            pct("padding_waste"),
        );
    }
    let eager = &s["eager"];
    println!(
        "eager: requests {} {}  batches {}  sequences {}",
        eager["requests"], eager["by_reason"], eager["batches"], eager["sequences"]
    );
    println!("queue depth: {}", s["queue_depth"]);
    println!();
    for d in s["devices"].as_array().into_iter().flatten() {
        let graphs = d["graphs"].as_array().map_or(0, Vec::len);
        let mem: u64 = d["graphs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|g| g["memory_bytes"].as_u64())
            .sum();
        println!(
            "{:<10} {:<6} {:<9} {:<20} pid {:<8} restarts {} faults {} batches {} graphs {} ({:.1} MiB)",
            d["label"].as_str().unwrap_or("?"),
            d["role"].as_str().unwrap_or("?"),
            d["state"].as_str().unwrap_or("?"),
            d["name"].as_str().unwrap_or(""),
            d["worker_pid"],
            d["restarts"],
            d["device_faults"],
            d["batches"],
            graphs,
            mem as f64 / (1 << 20) as f64
        );
    }
}
