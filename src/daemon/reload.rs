//! `replayctl reload` (and `systemctl reload`): re-read the config file the
//! daemon was started with and apply what can change while it serves.
//!
//! **What a reload applies**: the batching window and queue limits
//! (`batching.*`, `eager.max_queue`) and each model's grid (`batching`,
//! `batch_buckets`, `seq_buckets`, `token_budgets`, `max_seqs_per_batch`).
//! Anything else (a model added, removed or changed otherwise, devices,
//! endpoints, any other `[server]` key, `[metrics]`) needs a restart: such a
//! reload is refused as a whole, naming every key, and nothing changes.
//!
//! **A grid change, without dropping or failing a request:**
//!
//! 1. The new config is written to the runtime directory
//!    (`config-<pid>-<n>.toml`) and every device actor is told that workers
//!    started from now on read it — a worker that restarts mid-reload comes
//!    up with the new grid.
//! 2. One graph device at a time, the worker captures the new grid's
//!    buckets *beside* its current graphs (buckets in both grids are kept,
//!    not captured again). Batches keep running on the old graphs between
//!    captures; on the device being captured they wait in its queue.
//! 3. Once every ready device has the new graphs, the batcher switches: its
//!    queued items move to the new grid's lanes (in order, keeping their
//!    age) and new batches use the new buckets.
//! 4. The old buckets' graphs are released. Batches formed under the old
//!    grid that are still in flight finish on their graphs first (the
//!    worker collects what it launched before it drops a graph, and the
//!    release is queued behind them). A batch that meets a worker without
//!    its bucket (retried after a worker death) runs in the smallest bucket
//!    that holds it (see [`super::device`]).
//!
//! If a capture fails (e.g. out of device memory), the new graphs are
//! released, workers go back to the old config file, and the reload is
//! refused with the reason; the old grid stays in force. systemd hears
//! `RELOADING=1` at the start and `READY=1` at the end either way.

use super::admission::Admission;
use super::batcher::shards::Batchers;
use super::messages::DeviceMsg;
use super::metrics::Metrics;
use super::stats::{ReloadReport, ReloadedModel};
use super::supervisor::SupervisorMsg;
use crate::bucket::Grid;
use crate::config::Config;
use ractor::rpc::CallResult;
use ractor::ActorRef;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Keys a reload applies (outside `[[models]]`).
const LIVE_KEYS: [&str; 5] = [
    "batching.max_wait_us",
    "batching.max_queue",
    "batching.max_inflight_per_device",
    "batching.max_attempts",
    "eager.max_queue",
];

/// Keys of a `[[models]]` entry a reload applies: its grid.
const LIVE_MODEL_KEYS: [&str; 5] = [
    "batching",
    "batch_buckets",
    "seq_buckets",
    "token_budgets",
    "max_seqs_per_batch",
];

/// The keys whose values differ between two configs, as dotted paths
/// (`batching.max_wait_us`, `models[0].seq_buckets`; `models` when the
/// number of models differs).
pub fn changed_keys(old: &Config, new: &Config) -> Vec<String> {
    let a = toml::Value::try_from(old).unwrap_or(toml::Value::Table(Default::default()));
    let b = toml::Value::try_from(new).unwrap_or(toml::Value::Table(Default::default()));
    let mut out = Vec::new();
    walk("", &a, &b, &mut out);
    out
}

fn walk(path: &str, a: &toml::Value, b: &toml::Value, out: &mut Vec<String>) {
    use toml::Value::{Array, Table};
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match (a, b) {
        (Table(x), Table(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                match (x.get(k), y.get(k)) {
                    (Some(p), Some(q)) => walk(&join(k), p, q, out),
                    _ => out.push(join(k)),
                }
            }
        }
        (Array(x), Array(y)) if x.iter().chain(y).all(toml::Value::is_table) => {
            if x.len() != y.len() {
                out.push(path.to_string());
            } else {
                for (i, (p, q)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), p, q, out);
                }
            }
        }
        (p, q) => {
            if p != q {
                out.push(path.to_string());
            }
        }
    }
}

/// Whether a reload can apply a change of `key`.
pub fn is_live(key: &str) -> bool {
    if LIVE_KEYS.contains(&key) {
        return true;
    }
    key.strip_prefix("models[")
        .and_then(|rest| rest.split_once("]."))
        .is_some_and(|(_, k)| LIVE_MODEL_KEYS.contains(&k))
}

/// Writes `config` where workers read it; returns the path.
pub fn write_snapshot(config: &Config, dir: &Path, seq: u64) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("config-{}-{seq}.toml", std::process::id()));
    let text = format!(
        "# The configuration replayd {} serves with (its workers read this file).\n{}",
        std::process::id(),
        toml::to_string(config)?
    );
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

struct State {
    config: Config,
    snapshot: PathBuf,
    previous: Option<PathBuf>,
    seq: u64,
}

/// Applies reloads (one at a time).
pub struct Reloader {
    config_path: PathBuf,
    state: tokio::sync::Mutex<State>,
    supervisor: ActorRef<SupervisorMsg>,
    batchers: Batchers,
    metrics: Arc<Metrics>,
    admission: Arc<Admission>,
    /// Set once every device was ready for the first time: before that a
    /// reload is refused (its `READY=1` would come too early).
    pub ready: Arc<AtomicBool>,
}

impl Reloader {
    pub fn new(
        config_path: PathBuf,
        config: Config,
        snapshot: PathBuf,
        supervisor: ActorRef<SupervisorMsg>,
        batchers: Batchers,
        metrics: Arc<Metrics>,
        admission: Arc<Admission>,
    ) -> Self {
        Reloader {
            config_path,
            state: tokio::sync::Mutex::new(State {
                config,
                snapshot,
                previous: None,
                seq: 0,
            }),
            supervisor,
            batchers,
            metrics,
            admission,
            ready: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Re-reads the config file and applies it, or says why not.
    pub async fn reload(&self) -> Result<ReloadReport, String> {
        if !self.ready.load(Ordering::Acquire) {
            return Err("the daemon is still starting (capturing); reload once it is ready".into());
        }
        let Ok(mut state) = self.state.try_lock() else {
            return Err("a reload is already in progress".into());
        };
        super::notify::reloading();
        let result = self.apply(&mut state).await;
        match &result {
            Ok(v) => {
                tracing::info!(changed = ?v.changed, "reload applied");
                super::notify::notify("READY=1\nSTATUS=ready (reloaded)");
            }
            Err(e) => {
                tracing::warn!("reload refused: {e}");
                super::notify::notify("READY=1\nSTATUS=ready (a reload was refused; the previous configuration is in force)");
            }
        }
        result
    }

    async fn apply(&self, state: &mut State) -> Result<ReloadReport, String> {
        let new = Config::load(&self.config_path).map_err(|e| e.to_string())?;
        let old = &state.config;
        let changed = changed_keys(old, &new);
        if changed.is_empty() {
            return Ok(ReloadReport {
                message: Some("nothing changed".into()),
                ..Default::default()
            });
        }
        let fixed: Vec<&String> = changed.iter().filter(|k| !is_live(k)).collect();
        if !fixed.is_empty() {
            let keys: Vec<String> = fixed.iter().map(|k| format!("`{k}`")).collect();
            return Err(format!(
                "{} cannot change while the daemon runs (restart it to apply: systemctl restart replayd); nothing was changed",
                keys.join(", ")
            ));
        }
        let grids: Vec<(usize, Grid)> = old
            .models
            .iter()
            .zip(&new.models)
            .enumerate()
            .filter_map(|(i, (a, b))| {
                let g = b.grid();
                (a.grid() != g).then_some((i, g))
            })
            .collect();
        let old_grids: Vec<(usize, Grid)> = grids
            .iter()
            .map(|(i, _)| (*i, old.models[*i].grid()))
            .collect();
        let mut captured = 0;
        let mut snapshot = None;
        let devices = if grids.is_empty() {
            Vec::new()
        } else {
            self.call_supervisor().await?
        };
        if !grids.is_empty() {
            let dir = &new.server.runtime_dir;
            let path = write_snapshot(&new, dir, state.seq + 1)
                .map_err(|e| format!("cannot write the new config for the workers: {e:#}"))?;
            for d in &devices {
                let _ = d.cast(DeviceMsg::SetWorkerConfig(path.clone()));
            }
            let timeout =
                Duration::from_millis(new.devices.start_timeout_ms) + Duration::from_secs(10);
            let labels = self.metrics.device_labels();
            for (slot, d) in devices.iter().enumerate() {
                let label = labels
                    .get(slot)
                    .cloned()
                    .unwrap_or_else(|| slot.to_string());
                super::notify::notify(&format!(
                    "STATUS=reloading: capturing the new grid on {label}"
                ));
                let grids = grids.clone();
                let result = d
                    .call(|port| DeviceMsg::Capture { grids, port }, Some(timeout))
                    .await;
                let error = match result {
                    Ok(CallResult::Success(Ok(n))) => {
                        captured += n;
                        continue;
                    }
                    Ok(CallResult::Success(Err(e))) => e,
                    Ok(CallResult::Timeout) => format!("{label}: no answer within {timeout:?}"),
                    Ok(CallResult::SenderError) | Err(_) => format!("{label}: its actor stopped"),
                };
                // Roll back: the old config file, the old grids' graphs only.
                for d in &devices {
                    let _ = d.cast(DeviceMsg::SetWorkerConfig(state.snapshot.clone()));
                    let _ = d.cast(DeviceMsg::Release {
                        grids: old_grids.clone(),
                    });
                }
                let _ = std::fs::remove_file(&path);
                return Err(format!(
                    "capturing the new grid failed ({error}); the old grid stays in force"
                ));
            }
            snapshot = Some(path);
        }
        let config = scheduler_config(&new);
        let taken = self
            .batchers
            .reconfigure(
                config,
                new.batching.max_attempts,
                grids.clone(),
                Duration::from_secs(30),
            )
            .await;
        if !taken {
            return Err("the batcher did not take the new configuration".into());
        }
        self.admission.set_limit(new.batching.max_queue);
        for d in &devices {
            let _ = d.cast(DeviceMsg::Release {
                grids: grids.clone(),
            });
        }
        for (i, grid) in &grids {
            self.metrics.set_model_grid(&new.models[*i].name, grid);
        }
        if let Some(path) = snapshot {
            if let Some(old) = state.previous.take() {
                let _ = std::fs::remove_file(old);
            }
            state.previous = Some(std::mem::replace(&mut state.snapshot, path));
            state.seq += 1;
        }
        state.config = new;
        self.metrics.reloaded();
        Ok(ReloadReport {
            changed,
            models: grids
                .iter()
                .map(|(i, g)| ReloadedModel {
                    model: state.config.models[*i].name.clone(),
                    batching: g.batching().into(),
                    grid: g.describe(),
                })
                .collect(),
            graphs_captured: captured as u64,
            message: None,
        })
    }

    async fn call_supervisor(&self) -> Result<Vec<ActorRef<DeviceMsg>>, String> {
        match self
            .supervisor
            .call(SupervisorMsg::Devices, Some(Duration::from_secs(5)))
            .await
        {
            Ok(CallResult::Success(d)) => Ok(d),
            _ => Err("the supervisor did not answer".into()),
        }
    }
}

/// The batcher's limits from the config (start-up and reloads).
pub fn scheduler_config(config: &Config) -> super::messages::SchedulerConfig {
    super::messages::SchedulerConfig {
        max_wait: std::time::Duration::from_micros(config.batching.max_wait_us),
        max_queue: config.batching.max_queue,
        max_inflight: config.batching.max_inflight_per_device,
        eager_max_queue: config.eager.max_queue,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[batching]
max_wait_us = 500

[[models]]
name = "enc"
kind = "bert"
path = "x"
batching = "padded"
seq_buckets = [16, 32]
"#;

    #[test]
    fn changed_keys_are_named_and_classified() {
        let old = Config::parse(BASE).unwrap();
        let same = Config::parse(BASE).unwrap();
        assert!(changed_keys(&old, &same).is_empty());
        let new = Config::parse(
            &BASE
                .replace("max_wait_us = 500", "max_wait_us = 900")
                .replace("[16, 32]", "[16, 24, 32]"),
        )
        .unwrap();
        let keys = changed_keys(&old, &new);
        assert_eq!(keys, vec!["batching.max_wait_us", "models[0].seq_buckets"]);
        assert!(keys.iter().all(|k| is_live(k)));
        let new =
            Config::parse(&BASE.replace("path = \"x\"", "path = \"y\"\ndtype = \"f16\"")).unwrap();
        let keys = changed_keys(&old, &new);
        assert_eq!(keys, vec!["models[0].dtype", "models[0].path"]);
        assert!(keys.iter().all(|k| !is_live(k)));
        let new = Config::parse(&format!(
            "{BASE}\n[server]\nendpoint = \"tcp://127.0.0.1:7777\"\n"
        ))
        .unwrap();
        assert_eq!(changed_keys(&old, &new), vec!["server.endpoint"]);
        let two = format!("{BASE}\n[[models]]\nname = \"b\"\nkind = \"bert\"\npath = \"x\"\n");
        let new = Config::parse(&two).unwrap();
        assert_eq!(changed_keys(&old, &new), vec!["models"]);
        assert!(!is_live("models"));
        assert!(!is_live("server.shutdown_grace_ms"));
    }

    #[test]
    fn a_snapshot_reads_back_as_the_same_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::parse(&format!(
            "{BASE}\n[devices]\ngpus = [0, 1]\nbackend = \"cpu\"\n"
        ))
        .unwrap();
        let path = write_snapshot(&config, dir.path(), 3).unwrap();
        let back = Config::load(&path).unwrap();
        assert_eq!(back, config);
    }
}
