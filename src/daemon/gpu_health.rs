//! GPU health in the daemon process, through NVML: live samples (memory,
//! temperature, utilisation) for `replayctl stats`, and a watcher that kills
//! a device's worker when NVML reports a critical Xid or an uncorrectable
//! ECC error on its GPU (the worker restarts and re-captures; its batches are
//! re-dispatched). Without NVML this is a no-op with a warning.

use super::metrics::Metrics;
use super::stats::{GpuReading, GpuSample};
use super::supervisor::SupervisorMsg;
use crate::gpu::nvml::{self, GpuEvent, GpuInfo, XidWatcher};
use ractor::ActorRef;
use std::sync::Arc;
use std::time::Duration;

/// Xids that report a fault of one application's context (13: engine
/// exception, 31: MMU fault such as an illegal address, 43: stopped
/// processing, 45: preemptive cleanup). The faulting worker sees a sticky
/// error and exits by itself; the GPU and other processes on it are fine.
const APPLICATION_XIDS: [u64; 4] = [13, 31, 43, 45];

/// How often GPU samples are refreshed.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// A device slot served by a GPU.
pub struct GpuSlot {
    pub slot: usize,
    pub metrics_index: usize,
    pub ordinal: usize,
}

/// Keeps the watcher alive; dropping it stops watching and sampling.
pub struct GpuHealth {
    _watcher: Option<XidWatcher>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Drop for GpuHealth {
    fn drop(&mut self) {
        self.sampler.abort();
    }
}

/// Starts sampling and Xid watching for the given device slots.
pub fn start(
    slots: Vec<GpuSlot>,
    metrics: Arc<Metrics>,
    supervisor: ActorRef<SupervisorMsg>,
) -> GpuHealth {
    let mut gpus: Vec<(GpuSlot, GpuInfo)> = Vec::new();
    for s in slots {
        match nvml::for_cuda_ordinal(s.ordinal) {
            Ok(info) => gpus.push((s, info)),
            Err(e) => tracing::warn!("NVML: no health data for cuda:{}: {e}", s.ordinal),
        }
    }
    let mut uuids: Vec<String> = gpus.iter().map(|(_, g)| g.uuid.clone()).collect();
    uuids.sort();
    uuids.dedup();
    let by_uuid: Vec<(String, usize)> =
        gpus.iter().map(|(s, g)| (g.uuid.clone(), s.slot)).collect();
    let watcher = if uuids.is_empty() {
        None
    } else {
        let sup = supervisor.clone();
        match XidWatcher::start(uuids, move |uuid, event| {
            let slots: Vec<usize> = by_uuid
                .iter()
                .filter(|(u, _)| *u == uuid)
                .map(|(_, s)| *s)
                .collect();
            if let GpuEvent::CriticalXid(Some(x)) = event {
                if APPLICATION_XIDS.contains(&x) {
                    tracing::warn!("NVML: Xid {x} on {uuid} (an application fault; its worker restarts itself)");
                    return;
                }
            }
            let reason = match event {
                GpuEvent::CriticalXid(Some(x)) => format!("NVML: critical Xid {x} on {uuid}"),
                GpuEvent::CriticalXid(None) => format!("NVML: critical Xid on {uuid}"),
                GpuEvent::DoubleBitEcc => format!("NVML: uncorrectable ECC error on {uuid}"),
            };
            tracing::error!("{reason}");
            let _ = sup.cast(SupervisorMsg::Kill { slots, reason });
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("NVML Xid watcher not running: {e}");
                None
            }
        }
    };
    let sampler = tokio::spawn(async move {
        let gpus = Arc::new(gpus);
        loop {
            let g = gpus.clone();
            let samples = tokio::task::spawn_blocking(move || {
                g.iter()
                    .map(|(s, info)| (s.metrics_index, info.clone(), nvml::sample(info)))
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            for (index, info, sample) in samples {
                let reading = match sample {
                    Ok(s) => GpuReading::Sample(GpuSample {
                        uuid: info.uuid,
                        pci_bus_id: info.pci_bus_id,
                        memory_used_bytes: s.memory_used,
                        memory_total_bytes: s.memory_total,
                        temperature_c: s.temperature_c,
                        utilization_pct: s.utilization_gpu_pct,
                    }),
                    Err(e) => GpuReading::Unreadable {
                        uuid: info.uuid,
                        error: e,
                    },
                };
                metrics.update_device(index, |d| d.gpu = Some(reading));
            }
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    });
    GpuHealth {
        _watcher: watcher,
        sampler,
    }
}
