//! One clock for timings that cross processes: `CLOCK_MONOTONIC` in
//! nanoseconds, the same in the daemon and its workers on one host (a
//! `std::time::Instant` is that clock too, but cannot be sent to another
//! process). The per-hop timings of a reply are differences of these.

/// Nanoseconds of `CLOCK_MONOTONIC` (about 20 ns to read, no syscall on Linux).
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC
    // always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Microseconds from `from` to `to` (0 if `to` is earlier), both [`mono_ns`].
pub fn us_between(from: u64, to: u64) -> u64 {
    to.saturating_sub(from) / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_and_in_step_with_instant() {
        let (a, i) = (mono_ns(), std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(2));
        let (b, d) = (mono_ns(), i.elapsed());
        assert!(b > a);
        let diff = (b - a) as i128 - d.as_nanos() as i128;
        assert!(diff.abs() < 1_000_000, "{diff} ns apart");
        assert_eq!(us_between(b, a), 0);
        assert_eq!(us_between(1_000, 5_999), 4);
    }
}
