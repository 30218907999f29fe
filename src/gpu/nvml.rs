//! NVML: device discovery, health samples, and a watcher for critical Xid and
//! double-bit ECC events.
//!
//! NVML numbers GPUs in PCI bus order, CUDA in its own order (fastest first by
//! default), so the two are matched by PCI bus id (or UUID), never by index.
//! Everything here returns an error where NVML is missing (no driver, a
//! container without the NVML library); nothing panics.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

use super::normalize_pci_bus_id;

/// One GPU as NVML sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index (PCI bus order).
    pub index: u32,
    pub name: String,
    /// `GPU-xxxxxxxx-…`.
    pub uuid: String,
    /// Normalised `00000000:00:06.0` (see [`normalize_pci_bus_id`]).
    pub pci_bus_id: String,
    pub memory_total: u64,
}

/// A health sample.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub memory_used: u64,
    pub memory_total: u64,
    pub temperature_c: Option<u32>,
    pub utilization_gpu_pct: Option<u32>,
}

/// A device health event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuEvent {
    /// A critical Xid error (`None` when NVML did not say which).
    /// Xid 31 (MMU fault) is what an illegal address in a kernel produces;
    /// 48, 63, 64, 74, 79, 92, 94, 95, 119, 120 and similar mean the device
    /// itself needs attention.
    CriticalXid(Option<u64>),
    /// An uncorrectable (double-bit) ECC error.
    DoubleBitEcc,
}

fn open() -> Result<Nvml, String> {
    match Nvml::init() {
        Ok(n) => Ok(n),
        Err(first) => Nvml::builder()
            .lib_path(OsStr::new("libnvidia-ml.so"))
            .init()
            .map_err(|e| format!("NVML unavailable: {first} (and with libnvidia-ml.so: {e})")),
    }
}

fn catch<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(format!("{what}: NVML panicked")))
}

/// Process-wide NVML handle for [`discover`] and [`sample`] (initialised on
/// first use; retried if that failed).
static SESSION: Mutex<Option<Nvml>> = Mutex::new(None);

fn with_nvml<T>(what: &str, f: impl FnOnce(&Nvml) -> Result<T, String>) -> Result<T, String> {
    catch(what, || {
        let mut guard = SESSION
            .lock()
            .map_err(|_| "NVML session lock poisoned".to_string())?;
        if guard.is_none() {
            *guard = Some(open()?);
        }
        let nvml = guard.as_ref().ok_or("NVML not initialised")?;
        f(nvml)
    })
}

/// Every GPU NVML sees.
pub fn discover() -> Result<Vec<GpuInfo>, String> {
    with_nvml("discover", |nvml| {
        let n = nvml
            .device_count()
            .map_err(|e| format!("nvmlDeviceGetCount: {e}"))?;
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let d = nvml
                .device_by_index(i)
                .map_err(|e| format!("nvmlDeviceGetHandleByIndex({i}): {e}"))?;
            out.push(GpuInfo {
                index: i,
                name: d.name().unwrap_or_else(|e| format!("<{e}>")),
                uuid: d.uuid().map_err(|e| format!("GPU {i} uuid: {e}"))?,
                pci_bus_id: normalize_pci_bus_id(
                    &d.pci_info()
                        .map_err(|e| format!("GPU {i} PCI info: {e}"))?
                        .bus_id,
                ),
                memory_total: d.memory_info().map(|m| m.total).unwrap_or(0),
            });
        }
        Ok(out)
    })
}

/// Memory, temperature and utilisation of one GPU (found by UUID).
pub fn sample(gpu: &GpuInfo) -> Result<GpuSample, String> {
    with_nvml("sample", |nvml| {
        let d = nvml
            .device_by_uuid(gpu.uuid.as_str())
            .map_err(|e| format!("{}: {e}", gpu.uuid))?;
        let mem = d
            .memory_info()
            .map_err(|e| format!("{} memory: {e}", gpu.uuid))?;
        Ok(GpuSample {
            memory_used: mem.used,
            memory_total: mem.total,
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
            utilization_gpu_pct: d.utilization_rates().ok().map(|u| u.gpu),
        })
    })
}

/// The NVML device with this PCI bus id or UUID (either may be absent).
pub fn find<'a>(
    gpus: &'a [GpuInfo],
    pci_bus_id: Option<&str>,
    uuid: Option<&str>,
) -> Option<&'a GpuInfo> {
    if let Some(p) = pci_bus_id {
        let p = normalize_pci_bus_id(p);
        if let Some(g) = gpus.iter().find(|g| g.pci_bus_id == p) {
            return Some(g);
        }
    }
    uuid.and_then(|u| gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(u)))
}

/// The PCI bus id of CUDA device `ordinal` (driver API, no context created).
pub fn cuda_pci_bus_id(ordinal: usize) -> Result<String, String> {
    use cudarc::driver::{result, sys};
    super::libs::ensure(super::libs::CudaLib::Driver)?;
    catch("cuDeviceGetPCIBusId", || {
        result::init().map_err(|e| format!("cuInit: {:?}", e.0))?;
        let dev = result::device::get(ordinal as i32)
            .map_err(|e| format!("cuDeviceGet({ordinal}): {:?}", e.0))?;
        let mut bus = [0 as std::ffi::c_char; 32];
        // SAFETY: 32-byte buffer, NUL-terminated by the driver.
        unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, dev) }
            .result()
            .map_err(|e| format!("cuDeviceGetPCIBusId: {:?}", e.0))?;
        // SAFETY: NUL-terminated above.
        let s = unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok(normalize_pci_bus_id(&s))
    })
}

/// The NVML device of CUDA device `ordinal`, matched by PCI bus id.
pub fn for_cuda_ordinal(ordinal: usize) -> Result<GpuInfo, String> {
    let pci = cuda_pci_bus_id(ordinal)?;
    let gpus = discover()?;
    find(&gpus, Some(&pci), None)
        .cloned()
        .ok_or_else(|| format!("no NVML device has PCI bus id {pci} (CUDA device {ordinal})"))
}

/// How often the watcher thread checks for a stop request.
const POLL_MS: u32 = 250;

/// Waits for critical Xid and double-bit ECC events on a set of GPUs in its
/// own thread, and reports each as `(uuid, event)` through a callback.
/// Stops (and joins its thread) on [`XidWatcher::stop`] or drop.
pub struct XidWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// UUIDs events are registered for.
    pub watching: Vec<String>,
}

impl XidWatcher {
    /// Starts watching the GPUs with these UUIDs. Fails if NVML is missing or
    /// no GPU could be registered; GPUs that cannot be are skipped with a warning.
    pub fn start<F>(uuids: Vec<String>, on_event: F) -> Result<XidWatcher, String>
    where
        F: Fn(String, GpuEvent) + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::sync_channel::<Result<Vec<String>, String>>(1);
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("replayd-xid".into())
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    watch(uuids, on_event, &stop2, &tx)
                }));
                if r.is_err() {
                    let _ = tx.try_send(Err("the Xid watcher panicked".into()));
                }
            })
            .map_err(|e| format!("cannot start the Xid watcher thread: {e}"))?;
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(watching)) => Ok(XidWatcher {
                stop,
                thread: Some(thread),
                watching,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                Err("the Xid watcher did not start within 30 s".into())
            }
        }
    }

    /// Stops the thread and waits for it (at most one poll interval).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for XidWatcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn watch<F>(
    uuids: Vec<String>,
    on_event: F,
    stop: &AtomicBool,
    ready: &mpsc::SyncSender<Result<Vec<String>, String>>,
) where
    F: Fn(String, GpuEvent),
{
    let nvml = match open() {
        Ok(n) => n,
        Err(e) => {
            let _ = ready.try_send(Err(e));
            return;
        }
    };
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.try_send(Err(format!("nvmlEventSetCreate: {e}")));
            return;
        }
    };
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    let mut watching = Vec::new();
    let mut problems = Vec::new();
    for uuid in &uuids {
        let dev = match nvml.device_by_uuid(uuid.as_str()) {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("{uuid}: {e}"));
                continue;
            }
        };
        let events = dev
            .supported_event_types()
            .map(|s| s & wanted)
            .unwrap_or(wanted);
        if events.is_empty() {
            problems.push(format!("{uuid}: supports neither Xid nor ECC events"));
            continue;
        }
        match dev.register_events(events, set) {
            Ok(s) => {
                set = s;
                watching.push(uuid.clone());
            }
            Err(e) => {
                // The set was released; start a new one and re-register the others.
                problems.push(format!("{uuid}: nvmlDeviceRegisterEvents: {e:?}"));
                set = match nvml.create_event_set() {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = ready.try_send(Err(format!("nvmlEventSetCreate: {e}")));
                        return;
                    }
                };
                let mut again = Vec::new();
                for u in &watching {
                    if let Ok(d) = nvml.device_by_uuid(u.as_str()) {
                        if let Ok(s) = d.register_events(wanted, set) {
                            set = s;
                            again.push(u.clone());
                            continue;
                        }
                        set = match nvml.create_event_set() {
                            Ok(s) => s,
                            Err(_) => return,
                        };
                    }
                }
                watching = again;
            }
        }
    }
    for p in &problems {
        tracing::warn!(target: "replayd::nvml", "Xid watcher: {p}");
    }
    if watching.is_empty() {
        let _ = ready.try_send(Err(format!(
            "no GPU could be watched for Xid events: {}",
            problems.join("; ")
        )));
        return;
    }
    let _ = ready.try_send(Ok(watching));
    while !stop.load(Ordering::Relaxed) {
        match set.wait(POLL_MS) {
            Ok(ev) => {
                let uuid = ev.device.uuid().unwrap_or_else(|_| "unknown".into());
                if ev.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    on_event(uuid.clone(), GpuEvent::DoubleBitEcc);
                }
                if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let xid = match ev.event_data {
                        Some(nvml_wrapper::enums::event::XidError::Value(v)) => Some(v),
                        _ => None,
                    };
                    on_event(uuid, GpuEvent::CriticalXid(xid));
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::debug!(target: "replayd::nvml", "nvmlEventSetWait: {e}");
                std::thread::sleep(Duration::from_millis(POLL_MS as u64));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_by_pci_bus_id_then_uuid() {
        let gpus = vec![
            GpuInfo {
                index: 0,
                name: "A".into(),
                uuid: "GPU-aaaa".into(),
                pci_bus_id: "00000000:06:00.0".into(),
                memory_total: 1,
            },
            GpuInfo {
                index: 1,
                name: "B".into(),
                uuid: "GPU-bbbb".into(),
                pci_bus_id: "00000000:1a:00.0".into(),
                memory_total: 1,
            },
        ];
        assert_eq!(find(&gpus, Some("0000:1A:00.0"), None).unwrap().index, 1);
        assert_eq!(
            find(&gpus, Some("0000:99:00.0"), Some("gpu-AAAA"))
                .unwrap()
                .index,
            0
        );
        assert!(find(&gpus, None, None).is_none());
    }

    #[test]
    fn missing_nvml_is_an_error() {
        // Here (no driver) every entry point reports an error; on a GPU
        // machine they succeed. Neither panics.
        match discover() {
            Ok(g) => eprintln!("{} GPUs", g.len()),
            Err(e) => {
                assert!(!e.is_empty());
                let gpu = GpuInfo {
                    index: 0,
                    name: String::new(),
                    uuid: "GPU-x".into(),
                    pci_bus_id: String::new(),
                    memory_total: 0,
                };
                assert!(sample(&gpu).is_err());
                assert!(XidWatcher::start(vec!["GPU-x".into()], |_, _| {}).is_err());
                assert!(for_cuda_ordinal(0).is_err());
            }
        }
    }
}
