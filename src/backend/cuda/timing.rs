//! GPU-side timing with CUDA events (autotuning and per-step profiles).

use cudarc::driver::{result, sys, DriverError};

/// Timing events, destroyed on drop (errors ignored).
pub struct Events {
    events: Vec<sys::CUevent>,
}

impl Events {
    /// `n` events with timing enabled. The context must be current.
    pub fn new(n: usize) -> Result<Events, DriverError> {
        let mut events = Vec::with_capacity(n);
        for _ in 0..n {
            match result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
                Ok(e) => events.push(e),
                Err(e) => {
                    // Drop the ones made so far.
                    drop(Events { events });
                    return Err(e);
                }
            }
        }
        Ok(Events { events })
    }

    /// Records event `i` on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context.
    pub unsafe fn record(&self, i: usize, stream: sys::CUstream) -> Result<(), DriverError> {
        result::event::record(self.events[i], stream)
    }

    /// Milliseconds between events `a` and `b` (waits for `b`).
    pub fn elapsed_ms(&self, a: usize, b: usize) -> Result<f32, DriverError> {
        // SAFETY: live events.
        unsafe {
            sys::cuEventSynchronize(self.events[b]).result()?;
            result::event::elapsed(self.events[a], self.events[b])
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for &e in &self.events {
            // SAFETY: created once; errors ignored.
            let _ = unsafe { result::event::destroy(e) };
        }
    }
}
