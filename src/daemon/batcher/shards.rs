//! The batcher, sharded: several [`super::BatcherActor`]s, each owning a group of
//! the graph devices, so that no single actor is on every request's way.
//!
//! * **Partition.** Graph devices are dealt to the shards in turn (device
//!   `j` of the graph devices to shard `j % shards`), so a GPU's several
//!   workers (`devices.workers_per_gpu`) land in different shards. Eager
//!   devices serve every shard: each shard sends its eager batches to them
//!   under its own local id. `batching.shards = 0` (the default) gives one
//!   shard per two graph devices, at least one and at most
//!   [`MAX_SHARDS`]: every shard then has a spare device while one of its
//!   workers restarts.
//! * **Routing a request.** [`Batchers::submit`] puts it into the shard with
//!   the fewest outstanding tokens per routable graph device (up and not
//!   drained); shards with none routable are skipped while another has one.
//!   Ties rotate per thread, so the choice takes a few atomic loads and no
//!   lock. The shard takes the request whole: its rows, its reply, its
//!   deadline and priority stay with one scheduler, which is why every
//!   promise of [`super::queue`] holds per shard unchanged.
//! * **Routing the rest.** A batch id carries its shard in its top bits
//!   ([`shard_of_batch`]), so a device's report goes to the shard that sent
//!   the batch; device up, down, drained and grid cuts go to every shard the
//!   device serves, under the id that shard knows it by. Drain, abort,
//!   outstanding and reconfigure ask every shard and combine the answers.
//!
//! Per-model isolation and prompt `overloaded` are the frontend's
//! admission gates ([`super::super::admission`]), which count across
//! shards; each shard's own `max_queue` stays as a backstop.

use super::queue::{BatchId, DeviceId, DeviceKind, SchedulerConfig};
use crate::bucket::{Bucket, Grid};
use crate::daemon::messages::{BatchReport, BatcherMsg, Submission};
use crate::model::BatchRows;
use ractor::rpc::CallResult;
use ractor::ActorRef;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The most shards `batching.shards = 0` picks.
pub const MAX_SHARDS: usize = 8;

/// Bits of a batch id below its shard's index.
const SHARD_SHIFT: u32 = 48;

/// The first batch id of `shard` (its ids count up from there).
pub fn first_batch_id(shard: usize) -> BatchId {
    ((shard as BatchId) << SHARD_SHIFT) + 1
}

/// The shard that sent batch `id`.
pub fn shard_of_batch(id: BatchId) -> usize {
    (id >> SHARD_SHIFT) as usize
}

/// What a request weighs in its shard's load: its tokens (a feature row
/// counts one).
pub fn load_of(input: &BatchRows) -> u64 {
    input.tokens().max(input.rows()) as u64
}

/// How many shards serve `graph_devices` graph devices when the config asks
/// for `wanted` (0: automatic). Never more than there are graph devices,
/// never fewer than one.
pub fn shard_count(wanted: usize, graph_devices: usize) -> usize {
    let most = graph_devices.max(1);
    if wanted == 0 {
        (graph_devices / 2).clamp(1, MAX_SHARDS)
    } else {
        wanted.min(most)
    }
}

/// Submissions on their way to the batcher, which takes them all at once:
/// under load one mailbox message and one scheduling pass serve every
/// request that arrived meanwhile, where a message each made the batcher
/// the daemon's busiest serial stage. [`SubmitQueue::submit`] wakes the
/// batcher ([`BatcherMsg::SubmitQueued`]) only when the queue was empty; the
/// batcher always empties it, so none waits for a wake that was not sent.
/// It is the one way in for requests.
#[derive(Default)]
pub struct SubmitQueue {
    items: std::sync::Mutex<Vec<Submission>>,
}

impl SubmitQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Submission>> {
        self.items.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a submission for `batcher`, waking it when the queue was
    /// empty. False when the batcher has stopped: nothing will take the
    /// queue then, so it is emptied here and the reply channels it held are
    /// dropped (their handlers answer "the request was dropped").
    pub fn submit(&self, batcher: &ActorRef<BatcherMsg>, submission: Submission) -> bool {
        let was_empty = {
            let mut items = self.lock();
            items.push(submission);
            items.len() == 1
        };
        if was_empty && batcher.cast(BatcherMsg::SubmitQueued).is_err() {
            drop(self.take());
            return false;
        }
        true
    }

    /// Everything queued, in order.
    pub fn take(&self) -> Vec<Submission> {
        std::mem::take(&mut *self.lock())
    }
}

/// A shard's load as the frontend sees it.
#[derive(Default)]
pub struct ShardLoad {
    /// Tokens of the requests submitted to it and not yet answered.
    outstanding_tokens: AtomicU64,
    /// Its graph devices that are up and not drained.
    routable: AtomicUsize,
}

impl ShardLoad {
    /// A request of `tokens` left the shard (answered, failed or refused).
    pub fn done(&self, tokens: u64) {
        self.outstanding_tokens.fetch_sub(tokens, Ordering::Relaxed);
    }

    pub fn outstanding_tokens(&self) -> u64 {
        self.outstanding_tokens.load(Ordering::Relaxed)
    }
}

pub(super) struct Shard {
    pub(super) actor: ActorRef<BatcherMsg>,
    pub(super) submissions: Arc<SubmitQueue>,
    pub(super) load: Arc<ShardLoad>,
}

/// One device slot as the shards know it.
pub(super) struct DeviceLinks {
    kind: DeviceKind,
    /// (shard, the id that shard knows the device by).
    pub(super) links: Vec<(usize, DeviceId)>,
    up: AtomicBool,
    drained: AtomicBool,
}

impl DeviceLinks {
    /// A slot of `kind`, down until its worker is ready.
    pub(super) fn new(kind: DeviceKind) -> Self {
        DeviceLinks {
            kind,
            links: Vec::new(),
            up: AtomicBool::new(false),
            drained: AtomicBool::new(false),
        }
    }
}

impl DeviceLinks {
    fn routable(&self) -> bool {
        self.kind == DeviceKind::Graph
            && self.up.load(Ordering::Relaxed)
            && !self.drained.load(Ordering::Relaxed)
    }
}

struct Inner {
    shards: Vec<Shard>,
    devices: Vec<DeviceLinks>,
    /// Serialises the recount of routable devices (device events are rare).
    recount: Mutex<()>,
}

/// The daemon's way to its batchers (cheap to clone). See the module docs.
#[derive(Clone)]
pub struct Batchers {
    inner: Arc<Inner>,
}

/// Which slots each shard serves: `plan[s]` lists shard `s`'s slots in
/// the order of its local ids.
pub(super) fn partition(kinds: &[DeviceKind], shards: usize) -> Vec<Vec<DeviceId>> {
    let mut plan = vec![Vec::new(); shards];
    let graph = kinds
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == DeviceKind::Graph);
    for (j, (slot, _)) in graph.enumerate() {
        plan[j % shards].push(slot);
    }
    for (slot, kind) in kinds.iter().enumerate() {
        if *kind == DeviceKind::Eager {
            for p in &mut plan {
                p.push(slot);
            }
        }
    }
    plan
}

thread_local! {
    /// Where this thread's next tie-break starts.
    static ROTOR: Cell<usize> = const { Cell::new(0) };
}

impl Batchers {
    /// One shard that is an actor started elsewhere, serving every slot of
    /// `kinds` under its own id (the device benchmark's stand-in batcher).
    pub fn over(actor: ActorRef<BatcherMsg>, kinds: &[DeviceKind]) -> Batchers {
        let devices = kinds
            .iter()
            .enumerate()
            .map(|(slot, &kind)| DeviceLinks {
                links: vec![(0, slot)],
                ..DeviceLinks::new(kind)
            })
            .collect();
        let shard = Shard {
            actor,
            submissions: Arc::default(),
            load: Arc::default(),
        };
        Batchers::of(vec![shard], devices)
    }

    /// The handle over started shards and the slots' links to them.
    pub(super) fn of(shards: Vec<Shard>, devices: Vec<DeviceLinks>) -> Batchers {
        Batchers {
            inner: Arc::new(Inner {
                shards,
                devices,
                recount: Mutex::new(()),
            }),
        }
    }

    /// How many shards there are.
    pub fn shards(&self) -> usize {
        self.inner.shards.len()
    }

    /// Each device slot's shard (the first that serves it: eager slots
    /// serve them all).
    pub fn shard_of_device(&self, device: DeviceId) -> Option<usize> {
        self.inner.devices.get(device)?.links.first().map(|l| l.0)
    }

    /// Each shard's outstanding tokens, in shard order.
    pub fn loads(&self) -> Vec<u64> {
        self.inner
            .shards
            .iter()
            .map(|s| s.load.outstanding_tokens())
            .collect()
    }

    /// The shard with the least outstanding tokens per routable device.
    fn pick(&self) -> usize {
        let shards = &self.inner.shards;
        let n = shards.len();
        if n == 1 {
            return 0;
        }
        let start = ROTOR.with(|r| {
            let v = r.get();
            r.set(v.wrapping_add(1));
            v
        });
        // Best as (tokens, routable devices); compare by cross-multiplying.
        let mut best: Option<(usize, u64, u64)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            let load = &shards[i].load;
            let routable = load.routable.load(Ordering::Relaxed) as u64;
            let tokens = load.outstanding_tokens();
            let better = match best {
                None => true,
                Some((_, bt, br)) => match (routable, br) {
                    (0, _) => false,
                    (_, 0) => true,
                    _ => {
                        u128::from(tokens) * u128::from(br) < u128::from(bt) * u128::from(routable)
                    }
                },
            };
            if better {
                best = Some((i, tokens, routable));
            }
        }
        best.map_or(0, |b| b.0)
    }

    /// Hands a submission to a shard (see the module docs). False when the
    /// batchers have stopped (its reply channel is dropped then).
    pub fn submit(&self, submission: Submission) -> bool {
        let shard = &self.inner.shards[self.pick()];
        shard
            .load
            .outstanding_tokens
            .fetch_add(load_of(&submission.input), Ordering::Relaxed);
        shard.submissions.submit(&shard.actor, submission)
    }

    /// Recounts each shard's routable devices after a device changed.
    fn recount(&self) {
        let _one_at_a_time = self.inner.recount.lock().unwrap_or_else(|p| p.into_inner());
        let mut counts = vec![0; self.inner.shards.len()];
        for d in self.inner.devices.iter().filter(|d| d.routable()) {
            for &(s, _) in &d.links {
                counts[s] += 1;
            }
        }
        for (shard, n) in self.inner.shards.iter().zip(counts) {
            shard.load.routable.store(n, Ordering::Relaxed);
        }
    }

    /// Sends `msg(local id)` to every shard `device` serves.
    fn to_device_shards(&self, device: DeviceId, msg: impl Fn(DeviceId) -> BatcherMsg) {
        let Some(d) = self.inner.devices.get(device) else {
            tracing::error!(device, "a message for a device slot that does not exist");
            return;
        };
        for &(s, local) in &d.links {
            let _ = self.inner.shards[s].actor.cast(msg(local));
        }
    }

    /// The device's worker captured every graph and takes work.
    pub fn device_up(&self, device: DeviceId) {
        if let Some(d) = self.inner.devices.get(device) {
            d.up.store(true, Ordering::Relaxed);
            self.recount();
        }
        self.to_device_shards(device, |device| BatcherMsg::DeviceUp { device });
    }

    /// The device's worker is gone: its shards re-dispatch what it held.
    pub fn device_down(&self, device: DeviceId, reason: &str) {
        if let Some(d) = self.inner.devices.get(device) {
            d.up.store(false, Ordering::Relaxed);
            self.recount();
        }
        self.to_device_shards(device, |device| BatcherMsg::DeviceDown {
            device,
            reason: reason.to_string(),
        });
    }

    /// Send no new batches to the device (`true`), or take it back.
    pub fn set_drained(&self, device: DeviceId, drained: bool) {
        if let Some(d) = self.inner.devices.get(device) {
            d.drained.store(drained, Ordering::Relaxed);
            self.recount();
        }
        self.to_device_shards(device, |device| BatcherMsg::SetDrained { device, drained });
    }

    /// A device's memory holds none of `dropped`'s graphs of `model`: every
    /// shard's grid loses them (the grid is the model's, not the device's).
    pub fn cut_grid(&self, model: usize, dropped: &[Bucket]) {
        for shard in &self.inner.shards {
            let _ = shard.actor.cast(BatcherMsg::CutGrid {
                model,
                dropped: dropped.to_vec(),
            });
        }
    }

    /// What became of a batch `device` ran: to the shard that sent it.
    pub fn report(&self, device: DeviceId, report: BatchReport) {
        let shard = shard_of_batch(report.batch);
        let local = self
            .inner
            .devices
            .get(device)
            .and_then(|d| d.links.iter().find(|l| l.0 == shard))
            .map(|l| l.1);
        match local {
            Some(device) => {
                let _ = self.inner.shards[shard]
                    .actor
                    .cast(BatcherMsg::Report { device, report });
            }
            // No shard of this device sent it: stale, or a worker bug.
            None => tracing::warn!(
                device,
                batch = report.batch,
                "a report for a batch no shard of this device sent; ignored"
            ),
        }
    }

    /// Stops accepting and waits until every shard has answered everything
    /// (true), or `grace` passed (false).
    pub async fn drain(&self, grace: Duration) -> bool {
        let calls = self
            .inner
            .shards
            .iter()
            .map(|s| s.actor.call(BatcherMsg::Drain, Some(grace)));
        futures::future::join_all(calls)
            .await
            .into_iter()
            .all(|r| matches!(r, Ok(CallResult::Success(()))))
    }

    /// Answers everything still held with `unavailable`; the number
    /// answered (None when a shard did not answer within `within`).
    pub async fn abort(&self, within: Duration) -> Option<usize> {
        let calls = self
            .inner
            .shards
            .iter()
            .map(|s| s.actor.call(BatcherMsg::Abort, Some(within)));
        sum(futures::future::join_all(calls).await)
    }

    /// Requests accepted and not yet answered, over every shard (None when
    /// a shard did not answer within `within`: the health probe).
    pub async fn outstanding(&self, within: Duration) -> Option<usize> {
        let calls = self
            .inner
            .shards
            .iter()
            .map(|s| s.actor.call(BatcherMsg::Outstanding, Some(within)));
        sum(futures::future::join_all(calls).await)
    }

    /// A reload: every shard takes the new limits and grids; true once all did.
    pub async fn reconfigure(
        &self,
        config: SchedulerConfig,
        max_attempts: u32,
        grids: Vec<(usize, Grid)>,
        within: Duration,
    ) -> bool {
        let calls = self.inner.shards.iter().map(|s| {
            let (config, grids) = (config.clone(), grids.clone());
            s.actor.call(
                move |port| BatcherMsg::Reconfigure {
                    config,
                    max_attempts,
                    grids,
                    port,
                },
                Some(within),
            )
        });
        futures::future::join_all(calls)
            .await
            .into_iter()
            .all(|r| matches!(r, Ok(CallResult::Success(()))))
    }

    /// Stops every shard.
    pub fn stop(&self) {
        for s in &self.inner.shards {
            s.actor.stop(None);
        }
    }
}

fn sum<E>(answers: Vec<Result<CallResult<usize>, E>>) -> Option<usize> {
    answers.into_iter().try_fold(0, |acc, r| match r {
        Ok(CallResult::Success(n)) => Some(acc + n),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeviceKind::{Eager, Graph};

    #[test]
    fn automatic_count_gives_each_shard_two_graph_devices() {
        assert_eq!(shard_count(0, 0), 1);
        assert_eq!(shard_count(0, 1), 1);
        assert_eq!(shard_count(0, 3), 1);
        assert_eq!(shard_count(0, 4), 2);
        assert_eq!(shard_count(0, 8), 4);
        assert_eq!(shard_count(0, 64), MAX_SHARDS);
        // Asked for: at most one per graph device.
        assert_eq!(shard_count(3, 8), 3);
        assert_eq!(shard_count(8, 2), 2);
        assert_eq!(shard_count(2, 0), 1);
    }

    #[test]
    fn graph_devices_are_dealt_in_turn_and_eager_ones_serve_every_shard() {
        let kinds = [Graph, Graph, Graph, Graph, Graph, Eager];
        assert_eq!(partition(&kinds, 2), vec![vec![0, 2, 4, 5], vec![1, 3, 5]]);
        assert_eq!(partition(&kinds, 1), vec![vec![0, 1, 2, 3, 4, 5]]);
        // Eager slots in the middle keep their place after the graph ones.
        assert_eq!(
            partition(&[Graph, Eager, Graph], 2),
            vec![vec![0, 1], vec![2, 1]]
        );
    }

    #[test]
    fn batch_ids_name_their_shard() {
        for shard in [0, 1, 7] {
            let id = first_batch_id(shard);
            assert_eq!(shard_of_batch(id), shard);
            assert_eq!(shard_of_batch(id + 1_000_000), shard);
        }
        assert_eq!(first_batch_id(0), 1);
    }
}
