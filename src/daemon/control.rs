//! The operator socket that `replayctl` talks to: a ZeroMQ ROUTER on
//! `server.control_endpoint`. Requests and replies are single JSON frames:
//! `{"cmd": "health" | "stats" | "inject_fault", "device": "cuda:0", "kind":
//! "corrupt" | "hang"}` →
//! `{"ok": true, "result": …}` or `{"ok": false, "error": "…"}`.

use super::messages::{DeviceMsg, DeviceStatus, SupervisorMsg};
use super::metrics::Metrics;
use crate::worker::link::FaultKind;
use bytes::Bytes;
use ractor::ActorRef;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

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

pub struct Control {
    pub metrics: Arc<Metrics>,
    pub supervisor: ActorRef<SupervisorMsg>,
}

impl Control {
    pub async fn handle(&self, frame: &[u8]) -> Value {
        let request: ControlRequest = match serde_json::from_slice(frame) {
            Ok(r) => r,
            Err(e) => {
                return json!({"ok": false, "error": format!("malformed control request: {e}")})
            }
        };
        match request.cmd.as_str() {
            "health" => json!({"ok": true, "result": health(&self.metrics)}),
            "stats" => json!({"ok": true, "result": self.metrics.snapshot()}),
            "inject_fault" => match self
                .inject_fault(
                    request.device.as_deref(),
                    request.kind.unwrap_or(FaultKind::Corrupt),
                )
                .await
            {
                Ok(msg) => json!({"ok": true, "result": msg}),
                Err(e) => json!({"ok": false, "error": e}),
            },
            other => json!({"ok": false, "error": format!(
                "unknown command {other:?} (health, stats, inject_fault)"
            )}),
        }
    }

    async fn inject_fault(&self, device: Option<&str>, kind: FaultKind) -> Result<String, String> {
        let device = device.ok_or("inject_fault needs a \"device\"")?;
        let labels: Vec<String> = self
            .metrics
            .devices()
            .into_iter()
            .map(|d| d.label)
            .collect();
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
            .call(
                |port| DeviceMsg::InjectFault(kind, port),
                Some(Duration::from_secs(30)),
            )
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

/// `ok` when every device is ready, `degraded` when some are, `starting`
/// while none is ready yet but some are starting, else `down`.
pub fn health(metrics: &Metrics) -> Value {
    let devices = metrics.devices();
    let ready = devices
        .iter()
        .filter(|d| d.state == DeviceStatus::Ready)
        .count();
    let starting = devices
        .iter()
        .filter(|d| d.state == DeviceStatus::Starting)
        .count();
    let status = if ready == devices.len() && ready > 0 {
        "ok"
    } else if ready > 0 {
        "degraded"
    } else if starting > 0 {
        "starting"
    } else {
        "down"
    };
    json!({
        "status": status,
        "devices": devices.iter().map(|d| json!({
            "device": d.label,
            "role": d.role,
            "state": d.state,
            "restarts": d.restarts,
            "last_error": d.last_error,
        })).collect::<Vec<_>>(),
    })
}

/// Serves the control socket until `shutdown` resolves.
pub async fn run(socket: RouterSocket, control: Arc<Control>, shutdown: impl Future<Output = ()>) {
    let (send, mut recv) = socket.split();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = recv.recv() => {
                let Ok(msg) = msg else { continue };
                let control = control.clone();
                let mut send = send.clone();
                tokio::spawn(async move {
                    let (mut envelope, frames) = crate::protocol::split_envelope(msg.into_vec());
                    let reply = match frames.as_slice() {
                        [frame] => control.handle(frame).await,
                        _ => json!({"ok": false, "error": "expected one JSON frame"}),
                    };
                    envelope.push(Bytes::from(reply.to_string()));
                    if let Ok(m) = ZmqMessage::try_from(envelope) {
                        let _ = tokio::time::timeout(Duration::from_secs(5), send.send(m)).await;
                    }
                });
            }
        }
    }
}
