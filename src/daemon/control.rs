//! The operator socket that `replayctl` talks to: a ZeroMQ ROUTER on
//! `server.control_endpoint` (default `ipc://<runtime_dir>/control.sock`).
//! Requests and replies are single JSON frames:
//! `{"cmd": CMD, "device": "cuda:0", "kind": "corrupt" | "hang"}` →
//! `{"ok": true, "result": …}` or `{"ok": false, "error": "…"}`, where CMD is
//!
//! * `health` — [`Health`](super::stats::Health): `ok` | `degraded` |
//!   `starting` | `down`, and each device;
//! * `stats` — [`Stats`](super::stats::Stats) ([`Metrics::snapshot`]):
//!   everything `replayctl stats` shows;
//! * `devices` — [`DevicesReport`](super::stats::DevicesReport): each device
//!   slot's state, worker, graphs, GPU samples;
//! * `buckets` — [`BucketsReport`](super::stats::BucketsReport)
//!   ([`Metrics::buckets_report`]): grids, histograms, suggestions;
//! * `drain` / `undrain` (`device`) — stop or resume sending it batches;
//! * `restart` (`device`) — a fresh worker that re-captures, nothing lost;
//! * `reload` — re-read the config file ([`super::reload`]); answered
//!   ([`ReloadReport`](super::stats::ReloadReport)) once applied or refused;
//! * `inject_fault` (`device`, `kind`; only with `devices.fault_injection`).
//!
//! The results are the typed values of [`super::stats`] as JSON; [`call`]
//! reads one back into its type (`replayctl`).

use super::messages::DeviceMsg;
use super::metrics::Metrics;
use super::reload::Reloader;
use super::supervisor::SupervisorMsg;
use crate::transport::{Dealer, Router, Security, TransportError, TransportLimits};
use crate::worker::link::FaultKind;
use bytes::Bytes;
use ractor::ActorRef;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Every command the socket takes.
pub const COMMANDS: [&str; 9] = [
    "health",
    "stats",
    "devices",
    "buckets",
    "drain",
    "undrain",
    "restart",
    "reload",
    "inject_fault",
];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlRequest {
    pub cmd: String,
    /// A device label (`"cuda:0"`, `"cpu:1"`, `"eager:0"`) or slot number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// `inject_fault`: `"corrupt"` (default) or `"hang"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<FaultKind>,
}

impl ControlRequest {
    /// A command without arguments.
    pub fn new(cmd: &str) -> Self {
        ControlRequest {
            cmd: cmd.into(),
            device: None,
            kind: None,
        }
    }
}

pub struct Control {
    pub metrics: Arc<Metrics>,
    pub supervisor: ActorRef<SupervisorMsg>,
    pub reloader: Arc<Reloader>,
}

fn answer<T: Serialize>(result: Result<T, String>) -> Value {
    match result.and_then(|v| serde_json::to_value(v).map_err(|e| e.to_string())) {
        Ok(v) => json!({"ok": true, "result": v}),
        Err(e) => json!({"ok": false, "error": e}),
    }
}

impl Control {
    pub async fn handle(&self, frame: &[u8]) -> Value {
        let request: ControlRequest = match serde_json::from_slice(frame) {
            Ok(r) => r,
            Err(e) => {
                return json!({"ok": false, "error": format!("malformed control request: {e}")})
            }
        };
        let device = request.device.as_deref();
        match request.cmd.as_str() {
            "health" => answer(Ok(self.metrics.health())),
            "stats" => answer(Ok(self.metrics.snapshot())),
            "devices" => answer(Ok(self.metrics.devices_report())),
            "buckets" => answer(Ok(self.metrics.buckets_report())),
            "drain" | "undrain" => {
                let drain = request.cmd == "drain";
                answer(
                    self.device_call(device, &request.cmd, move |port| {
                        DeviceMsg::Drain(drain, port)
                    })
                    .await,
                )
            }
            "restart" => answer(
                self.device_call(device, "restart", DeviceMsg::Restart)
                    .await,
            ),
            "reload" => answer(self.reloader.reload().await),
            "inject_fault" => {
                let kind = request.kind.unwrap_or(FaultKind::Corrupt);
                answer(
                    self.device_call(device, "inject_fault", move |port| {
                        DeviceMsg::InjectFault(kind, port)
                    })
                    .await,
                )
            }
            other => answer::<()>(Err(format!(
                "unknown command {other:?} ({})",
                COMMANDS.join(", ")
            ))),
        }
    }

    /// Sends a message that answers `Result<String, String>` to one device's actor.
    async fn device_call(
        &self,
        device: Option<&str>,
        cmd: &str,
        msg: impl FnOnce(ractor::RpcReplyPort<Result<String, String>>) -> DeviceMsg,
    ) -> Result<String, String> {
        let device = device.ok_or_else(|| format!("{cmd} needs a \"device\""))?;
        let labels = self.metrics.device_labels();
        let slot = labels
            .iter()
            .position(|l| l == device)
            .or_else(|| device.parse::<usize>().ok().filter(|&i| i < labels.len()))
            .ok_or_else(|| format!("no device {device:?} (devices: {})", labels.join(", ")))?;
        let actors = self
            .supervisor
            .call(SupervisorMsg::Devices, Some(Duration::from_secs(5)))
            .await
            .map_err(|e| e.to_string())?
            .into_result()?;
        let actor = actors.get(slot).ok_or("device actor missing")?;
        actor
            .call(msg, Some(Duration::from_secs(30)))
            .await
            .map_err(|e| e.to_string())?
            .into_result()?
    }
}

trait CallResultExt<T> {
    fn into_result(self) -> Result<T, String>;
}

impl<T> CallResultExt<T> for ractor::rpc::CallResult<T> {
    fn into_result(self) -> Result<T, String> {
        match self {
            ractor::rpc::CallResult::Success(v) => Ok(v),
            ractor::rpc::CallResult::Timeout => Err("timed out".into()),
            ractor::rpc::CallResult::SenderError => Err("the actor stopped".into()),
        }
    }
}

/// Checks that something listens at `endpoint` before the ZeroMQ exchange,
/// so a stopped daemon, a wrong path or a permission problem is said plainly
/// and at once rather than as a timeout.
async fn preflight(endpoint: &str, timeout: Duration) -> Result<(), String> {
    use std::io::ErrorKind;
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        let hint = "is replayd running, and is this its runtime directory? (replayctl --config, $REPLAYD_CONFIG or --control)";
        match std::fs::metadata(path) {
            Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                return Err(format!(
                    "cannot connect to {endpoint}: permission denied (the directory is not open to this user: join the daemon's group, e.g. `usermod -aG replayd $USER`, or use sudo)"
                ))
            }
            Err(_) => return Err(format!("cannot connect to {endpoint}: no socket at {path}: {hint}")),
            Ok(m) => {
                use std::os::unix::fs::FileTypeExt;
                if !m.file_type().is_socket() {
                    return Err(format!("cannot connect to {endpoint}: {path} is not a socket"));
                }
            }
        }
        return match tokio::net::UnixStream::connect(path).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == ErrorKind::PermissionDenied => Err(format!(
                "cannot connect to {endpoint}: permission denied (join the daemon's group, e.g. `usermod -aG replayd $USER`, or use sudo)"
            )),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => Err(format!(
                "cannot connect to {endpoint}: nothing listens on {path} (a socket left by a daemon that is no longer running?)"
            )),
            Err(e) => Err(format!("cannot connect to {endpoint}: {e}")),
        };
    }
    if let Some(addr) = endpoint.strip_prefix("tcp://") {
        return match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => Err(format!(
                "cannot connect to {endpoint}: nothing listens there (is replayd running, with this server.control_endpoint?)"
            )),
            Ok(Err(e)) => Err(format!("cannot connect to {endpoint}: {e}")),
            Err(_) => Err(format!("cannot connect to {endpoint} within {timeout:?}")),
        };
    }
    Err(format!(
        "{endpoint:?} is not a control endpoint (ipc:///PATH or tcp://HOST:PORT)"
    ))
}

/// Sends one command to a daemon's control socket and returns its answer
/// (`{"ok": …, "result"|"error": …}`), for `replayctl` and tools. Fails
/// plainly when nothing answers within `timeout` (a stopped daemon, a wrong
/// endpoint, a socket this user may not open).
pub async fn request(
    endpoint: &str,
    request: &ControlRequest,
    timeout: Duration,
) -> Result<Value, String> {
    preflight(endpoint, timeout).await?;
    let limits = TransportLimits {
        max_message_bytes: 64 << 20,
        heartbeat: None,
        ..TransportLimits::default()
    };
    let socket = Dealer::connect(endpoint, &limits, &Security::None)
        .await
        .map_err(|e| format!("cannot connect to {endpoint}: {e}"))?;
    let (mut recv, send) = socket.split();
    let frame = Bytes::from(serde_json::to_vec(request).map_err(|e| e.to_string())?);
    send.send(vec![frame]).map_err(|e| e.to_string())?;
    let reply = tokio::time::timeout(timeout, recv.recv())
        .await
        .map_err(|_| {
            format!("no answer from {endpoint} within {timeout:?}: is it a replayd control socket, and is the daemon responsive?")
        })?
        .map_err(|e| e.to_string())?;
    let frame = reply.frames.last().ok_or("empty answer")?;
    serde_json::from_slice(frame).map_err(|e| format!("malformed answer: {e}"))
}

/// Why a [`call`] has no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// No answer: not running, wrong socket, permission denied, timeout.
    Unreachable(String),
    /// The daemon answered with an error (or an answer this build cannot read).
    Refused(String),
}

/// Sends one command and reads its `result` into `T` (a type of
/// [`super::stats`], or `String` for the device commands).
pub async fn call<T: DeserializeOwned>(
    endpoint: &str,
    command: &ControlRequest,
    timeout: Duration,
) -> Result<T, CallError> {
    let reply = request(endpoint, command, timeout)
        .await
        .map_err(CallError::Unreachable)?;
    #[derive(Deserialize)]
    struct Reply {
        ok: bool,
        #[serde(default)]
        result: Value,
        #[serde(default)]
        error: Option<String>,
    }
    let reply: Reply = serde_json::from_value(reply)
        .map_err(|e| CallError::Unreachable(format!("malformed answer: {e}")))?;
    if !reply.ok {
        return Err(CallError::Refused(
            reply
                .error
                .unwrap_or_else(|| "the daemon reported an error".into()),
        ));
    }
    serde_json::from_value(reply.result).map_err(|e| {
        CallError::Refused(format!(
            "cannot read the daemon's answer to {:?}: {e} (is replayctl of the daemon's version?)",
            command.cmd
        ))
    })
}

/// Serves the control socket until `shutdown` resolves.
pub async fn run(socket: Router, control: Arc<Control>, shutdown: impl Future<Output = ()>) {
    let (mut recv, send) = socket.split();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = recv.recv() => {
                let incoming = match msg {
                    Ok(m) => m,
                    Err(TransportError::Closed) => break,
                    Err(TransportError::Rejected { peer, reason }) => {
                        let reply = json!({"ok": false, "error": format!("message refused: {reason}")});
                        let _ = send.send(&peer, vec![Bytes::from(reply.to_string())]);
                        continue;
                    }
                    Err(e) => {
                        tracing::error!("control socket: {e}");
                        continue;
                    }
                };
                let control = control.clone();
                let send = send.clone();
                tokio::spawn(async move {
                    let (delimiter, frames) = crate::protocol::split_delimiter(&incoming.frames);
                    let reply = match frames {
                        [frame] => control.handle(frame).await,
                        _ => json!({"ok": false, "error": "expected one JSON frame"}),
                    };
                    let mut out: Vec<Bytes> = delimiter.into_iter().collect();
                    out.push(Bytes::from(reply.to_string()));
                    let _ = send.send(&incoming.peer, out);
                });
            }
        }
    }
}
