//! The way from the batcher to one device slot's worker.
//!
//! A [`DeviceRoute`] is made per device slot when the daemon starts and
//! outlives any one device actor or worker. The device actor takes it over
//! as it starts ([`DeviceRoute::attach`]), opens its worker's shared-memory
//! ring on it once the worker is ready ([`DeviceRoute::open_ring`]) and
//! closes the ring when the worker exits ([`DeviceRoute::close_ring`]), before
//! it tells the batcher that the device went down. The batcher only calls
//! [`DeviceRoute::send`]: into the ring when it takes the batch, else to the
//! device actor, which carries it over the worker's socket. Either way the
//! outcome comes back through the device's [`super::report::Reporter`].
//!
//! The batcher sends only to devices it counts as up, so a ring opened
//! for a new worker before the batcher has heard of the old one's death is
//! harmless: a batch it carries runs on the new worker, and the old
//! attempt's re-dispatch makes its report stale.

use super::fast_link::FastLink;
use super::messages::{Batch, DeviceMsg};
use ractor::ActorRef;
use std::sync::{Arc, Mutex, MutexGuard};

/// See the module docs.
#[derive(Default)]
pub struct DeviceRoute {
    actor: Mutex<Option<ActorRef<DeviceMsg>>>,
    ring: Mutex<Option<Arc<FastLink>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DeviceRoute {
    /// `actor` serves this slot from now on (a new device actor, or the
    /// supervisor's replacement of a failed one).
    pub fn attach(&self, actor: ActorRef<DeviceMsg>) {
        *lock(&self.actor) = Some(actor);
    }

    /// Batches go through `ring` while it takes them.
    pub fn open_ring(&self, ring: Arc<FastLink>) {
        *lock(&self.ring) = Some(ring);
    }

    /// The worker behind the ring is gone.
    pub fn close_ring(&self) {
        *lock(&self.ring) = None;
    }

    /// The ring now open, if any.
    pub fn ring(&self) -> Option<Arc<FastLink>> {
        lock(&self.ring).clone()
    }

    /// Sends `batch` on its way: through the ring when it takes it, else to
    /// the device actor. False when the slot has no device actor (a bug).
    /// A batch sent to a worker that is gone, or to a stopped actor, is not
    /// lost: the device's `DeviceDown` re-dispatches it.
    pub fn send(&self, batch: Arc<Batch>, attempt: u32) -> bool {
        if self.ring().is_some_and(|ring| ring.send(&batch, attempt)) {
            return true;
        }
        match &*lock(&self.actor) {
            Some(actor) => {
                let _ = actor.cast(DeviceMsg::Run { batch, attempt });
                true
            }
            None => false,
        }
    }
}
