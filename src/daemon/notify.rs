//! systemd notification (`Type=notify`, `NotifyAccess=main`; a no-op
//! outside systemd):
//!
//! * `STATUS=` lines from [`status_loop`]: which devices are loading or
//!   capturing (`capturing: cuda:0 40/72, cuda:1 36/72 graphs`), then
//!   `ready: …`, and later any device that is not ready (a restart, a drain).
//! * `READY=1` once every device has captured every graph (the server's
//!   `announce_ready`); `RELOADING=1` … `READY=1` around a reload
//!   ([`super::reload`]); `STOPPING=1` when SIGTERM starts the drain.
//! * `WATCHDOG=1` every half `$WATCHDOG_USEC` from [`watchdog_loop`], and
//!   only while its probe passes: the batcher actor answers and the frontend
//!   loop has turned recently. A GPU worker that dies or restarts is not a
//!   watchdog matter (the daemon restarts it and serves on), so the probe
//!   never looks at workers.
//!
//! Worker processes never speak for the service: the daemon removes
//! `NOTIFY_SOCKET` and `WATCHDOG_*` from their environment.

use super::messages::DeviceStatus;
use super::metrics::{DeviceStats, Metrics};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Sends `state` to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let result = if let Some(abstract_name) = path.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
            .and_then(|addr| sock.send_to_addr(state.as_bytes(), &addr))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = result {
        tracing::warn!("sd_notify({state}) to {path}: {e}");
    }
}

/// `RELOADING=1` with the `MONOTONIC_USEC=` systemd asks to come with it.
pub fn reloading() {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let usec = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000;
    notify(&format!(
        "RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS=reloading the configuration"
    ));
}

/// How often to send `WATCHDOG=1`: half of `$WATCHDOG_USEC`, when systemd
/// set it for this process (`$WATCHDOG_PID` absent or ours).
pub fn watchdog_interval() -> Option<Duration> {
    std::env::var_os("NOTIFY_SOCKET")?;
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// The status line for these devices.
pub fn status_line(devices: &[DeviceStats]) -> String {
    let up = devices.iter().filter(|d| d.state.is_up()).count();
    let graphs: usize = devices.iter().map(|d| d.graphs.len()).sum();
    let describe = |d: &DeviceStats| match (d.state, d.capture) {
        (DeviceStatus::Capturing, Some((done, total))) => {
            format!("{} {done}/{total}", d.label)
        }
        (DeviceStatus::Capturing, None) => format!("{} capturing", d.label),
        (DeviceStatus::Starting | DeviceStatus::Restarting, _) if d.compiling_kernels.is_some() => {
            format!(
                "{} compiling kernels for {}",
                d.label,
                d.compiling_kernels.as_deref().unwrap_or_default()
            )
        }
        (s @ (DeviceStatus::Starting | DeviceStatus::Restarting), _) => {
            format!("{} {} (loading)", d.label, s.as_str())
        }
        (s, _) => format!("{} {}", d.label, s.as_str()),
    };
    let others: Vec<String> = devices
        .iter()
        .filter(|d| d.state != DeviceStatus::Ready)
        .map(describe)
        .collect();
    if others.is_empty() {
        format!("ready: {} devices, {graphs} graphs", devices.len())
    } else if up == 0
        || devices
            .iter()
            .any(|d| d.state.is_coming_up() && d.restarts == 0)
    {
        let capturing = devices.iter().any(|d| d.state == DeviceStatus::Capturing);
        format!(
            "{}: {}{}",
            if capturing { "capturing" } else { "starting" },
            others.join(", "),
            if capturing { " graphs" } else { "" }
        )
    } else {
        format!(
            "degraded: {up}/{} devices ready; {}",
            devices.len(),
            others.join(", ")
        )
    }
}

/// Sends `STATUS=` whenever the devices' summary changes, until the task is
/// dropped (every 250 ms while some device is not ready, else every second).
pub async fn status_loop(metrics: Arc<Metrics>) {
    let mut last = String::new();
    loop {
        let devices = metrics.devices();
        let line = status_line(&devices);
        if line != last {
            notify(&format!("STATUS={line}"));
            last = line;
        }
        let settled = devices.iter().all(|d| d.state == DeviceStatus::Ready);
        tokio::time::sleep(Duration::from_millis(if settled { 1000 } else { 250 })).await;
    }
}

/// Sends `WATCHDOG=1` every `interval` while `probe` passes within it; a
/// failing probe is logged once per episode and nothing is sent, so systemd
/// restarts a wedged daemon.
pub async fn watchdog_loop<F, Fut>(interval: Duration, probe: F)
where
    F: Fn(Duration) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let mut failing = false;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match tokio::time::timeout(interval, probe(interval)).await {
            Ok(Ok(())) => {
                if failing {
                    tracing::info!("health loop: the daemon answers again; feeding the watchdog");
                }
                failing = false;
                notify("WATCHDOG=1");
            }
            Ok(Err(why)) => {
                if !failing {
                    tracing::error!("health loop: {why}; not feeding the systemd watchdog");
                }
                failing = true;
            }
            Err(_) => {
                if !failing {
                    tracing::error!(
                        "health loop: no answer within {interval:?}; not feeding the systemd watchdog"
                    );
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        // SAFETY: single-threaded use of the variable inside this test.
        unsafe { std::env::set_var("NOTIFY_SOCKET", &path) };
        super::notify("READY=1");
        unsafe { std::env::set_var("WATCHDOG_USEC", "3000000") };
        unsafe { std::env::set_var("WATCHDOG_PID", "1") };
        let other_pid = watchdog_interval();
        unsafe { std::env::set_var("WATCHDOG_PID", std::process::id().to_string()) };
        let ours = watchdog_interval();
        unsafe { std::env::remove_var("WATCHDOG_PID") };
        unsafe { std::env::remove_var("WATCHDOG_USEC") };
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        assert_eq!(other_pid, None);
        assert_eq!(ours, Some(Duration::from_millis(1500)));
    }

    #[test]
    fn status_lines_say_what_each_device_is_doing() {
        let dev = |label: &str, state, capture, restarts| DeviceStats {
            label: label.into(),
            state,
            capture,
            restarts,
            ..Default::default()
        };
        let s = status_line(&[
            dev("cuda:0", DeviceStatus::Capturing, Some((40, 72)), 0),
            dev("cuda:1", DeviceStatus::Capturing, Some((36, 72)), 0),
        ]);
        assert_eq!(s, "capturing: cuda:0 40/72, cuda:1 36/72 graphs");
        let s = status_line(&[dev("cpu:0", DeviceStatus::Starting, None, 0)]);
        assert_eq!(s, "starting: cpu:0 starting (loading)");
        let s = status_line(&[
            dev("cuda:0", DeviceStatus::Ready, None, 0),
            dev("cuda:1", DeviceStatus::Restarting, None, 1),
        ]);
        assert_eq!(
            s,
            "degraded: 1/2 devices ready; cuda:1 restarting (loading)"
        );
        let s = status_line(&[dev("cuda:0", DeviceStatus::Ready, None, 0)]);
        assert_eq!(s, "ready: 1 devices, 0 graphs");
        // A worker that compiles its kernels says so until it captures.
        let compiling = DeviceStats {
            compiling_kernels: Some("Cubin(89)".into()),
            ..dev("cuda:1", DeviceStatus::Starting, None, 0)
        };
        let s = status_line(&[dev("cuda:0", DeviceStatus::Ready, None, 0), compiling]);
        assert_eq!(s, "starting: cuda:1 compiling kernels for Cubin(89)");
    }
}
