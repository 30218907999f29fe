//! The batcher's scheduling state machine: queues, bucket choice, dispatch
//! rules, deadlines and retries. Pure and synchronous — time comes in as an
//! argument — so every rule is unit-tested below; the actor in
//! [`super`] owns one and turns its [`Action`]s into messages.
//!
//! Rules:
//! * Requests queue per (model, seq bucket), ordered by priority (higher
//!   first), then arrival.
//! * A request with more rows than the largest batch bucket, or tokens beyond
//!   the largest seq bucket, goes to the eager queue (or is rejected as too
//!   long when there are no eager workers).
//! * A queue is dispatched when it holds rows for the largest batch bucket,
//!   when its oldest request has waited `max_wait`, at once when a device is
//!   idle, and always while draining. A batch takes requests in queue order
//!   while they fit the largest batch bucket and is padded to the smallest
//!   batch bucket that holds it.
//! * Batches go to the least-loaded healthy device with room (`max_inflight`).
//! * Batches whose worker died are retried before anything else.
//! * A queued request whose deadline passes is expired, never run.
//! * A full queue rejects at once (`overloaded`).

use crate::bucket::{Bucket, BucketGrid};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// The batcher's id for an accepted request (not the client's id).
pub type RequestId = u64;
/// The batcher's id for a dispatched batch.
pub type BatchId = u64;
/// Index of a device slot in the scheduler.
pub type DeviceId = usize;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_wait: Duration,
    /// Queued requests per model.
    pub max_queue: usize,
    /// Batches in flight per device.
    pub max_inflight: usize,
    /// Queued eager requests (all models).
    pub eager_max_queue: usize,
}

/// A request as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct QueuedRequest {
    pub id: RequestId,
    pub model: usize,
    pub rows: usize,
    /// Longest sequence in tokens (1 for models without a sequence axis).
    pub len: usize,
    pub priority: u8,
    pub arrived: Instant,
    pub deadline: Option<Instant>,
}

/// Where an accepted request will run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Queued for a graph with this seq bucket.
    Bucketed { seq: usize },
    /// Queued for an eager worker.
    Eager,
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    Overloaded {
        limit: usize,
    },
    /// Larger than every bucket and no eager worker is configured.
    TooLarge {
        rows: usize,
        len: usize,
        largest: Bucket,
    },
    Draining,
}

/// Whether a device replays graphs or runs eager requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Graph,
    Eager,
}

/// A batch to form: requests in row order, and the bucket to pad into.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPlan {
    pub model: usize,
    /// `None` for the eager path (exact shape).
    pub bucket: Option<Bucket>,
    pub requests: Vec<RequestId>,
    pub rows: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send a new batch to a device.
    Dispatch { device: DeviceId, plan: BatchPlan },
    /// Send an already-formed batch again (its first worker died).
    Redispatch { device: DeviceId, batch: BatchId },
    /// The request's deadline passed while queued: answer `deadline_exceeded`.
    Expire(RequestId),
}

#[derive(Clone, Debug)]
struct DeviceSlot {
    kind: DeviceKind,
    healthy: bool,
    inflight: usize,
    /// Batches ever sent, to spread ties evenly over devices.
    dispatched: u64,
}

type QueueKey = (Reverse<u8>, u64);

#[derive(Debug, Default)]
struct Queue {
    /// Ordered by priority (higher first), then arrival sequence number.
    entries: BTreeMap<QueueKey, QueuedRequest>,
    /// Arrival sequence numbers, for the oldest request's age.
    arrivals: BTreeMap<u64, Instant>,
    rows: usize,
}

impl Queue {
    fn insert(&mut self, key: QueueKey, req: QueuedRequest) {
        self.rows += req.rows;
        self.arrivals.insert(key.1, req.arrived);
        self.entries.insert(key, req);
    }

    fn remove(&mut self, key: &QueueKey) -> Option<QueuedRequest> {
        let req = self.entries.remove(key)?;
        self.rows -= req.rows;
        self.arrivals.remove(&key.1);
        Some(req)
    }

    fn oldest(&self) -> Option<Instant> {
        self.arrivals.values().next().copied()
    }

    fn head_key(&self) -> Option<QueueKey> {
        self.entries.keys().next().copied()
    }
}

/// Where a queued request sits, for removal by id.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Bucketed {
        model: usize,
        seq: usize,
        key: QueueKey,
    },
    Eager {
        key: QueueKey,
    },
}

/// The scheduling state machine.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    grids: Vec<BucketGrid>,
    /// Per model: seq bucket → queue.
    queues: Vec<BTreeMap<usize, Queue>>,
    queued_per_model: Vec<usize>,
    eager: Queue,
    index: HashMap<RequestId, Slot>,
    deadlines: BTreeSet<(Instant, RequestId)>,
    retries: VecDeque<(BatchId, DeviceKind)>,
    devices: Vec<DeviceSlot>,
    next_seq: u64,
    draining: bool,
}

impl Scheduler {
    /// `grids[m]` is model `m`'s bucket grid.
    pub fn new(config: SchedulerConfig, grids: Vec<BucketGrid>) -> Self {
        let n = grids.len();
        Self {
            config,
            grids,
            queues: (0..n).map(|_| BTreeMap::new()).collect(),
            queued_per_model: vec![0; n],
            eager: Queue::default(),
            index: HashMap::new(),
            deadlines: BTreeSet::new(),
            retries: VecDeque::new(),
            devices: Vec::new(),
            next_seq: 0,
            draining: false,
        }
    }

    pub fn grid(&self, model: usize) -> &BucketGrid {
        &self.grids[model]
    }

    /// Adds a device (initially unhealthy until [`Self::set_healthy`]).
    pub fn add_device(&mut self, kind: DeviceKind) -> DeviceId {
        self.devices.push(DeviceSlot {
            kind,
            healthy: false,
            inflight: 0,
            dispatched: 0,
        });
        self.devices.len() - 1
    }

    /// Marks a device ready (after its worker captured every graph) or not.
    /// A device that goes down loses its in-flight count: the caller retries
    /// its batches with [`Self::retry`].
    pub fn set_healthy(&mut self, device: DeviceId, healthy: bool) {
        let slot = &mut self.devices[device];
        slot.healthy = healthy;
        if !healthy {
            slot.inflight = 0;
        }
    }

    pub fn has_eager_devices(&self) -> bool {
        self.devices.iter().any(|d| d.kind == DeviceKind::Eager)
    }

    /// A batch sent to `device` finished (successfully or not).
    pub fn completed(&mut self, device: DeviceId) {
        let slot = &mut self.devices[device];
        slot.inflight = slot.inflight.saturating_sub(1);
    }

    /// Queues a formed batch to be sent again, ahead of new work.
    pub fn retry(&mut self, batch: BatchId, kind: DeviceKind) {
        self.retries.push_back((batch, kind));
    }

    /// From now on every queue is dispatched at once and new requests are refused.
    pub fn start_draining(&mut self) {
        self.draining = true;
    }

    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Requests waiting (not yet dispatched).
    pub fn queued(&self) -> usize {
        self.index.len()
    }

    pub fn queued_for_model(&self, model: usize) -> usize {
        self.queued_per_model[model]
    }

    pub fn queued_eager(&self) -> usize {
        self.eager.entries.len()
    }

    /// Batches waiting to be retried.
    pub fn pending_retries(&self) -> usize {
        self.retries.len()
    }

    pub fn inflight(&self, device: DeviceId) -> usize {
        self.devices[device].inflight
    }

    /// Accepts a request into its queue, or says why not.
    pub fn enqueue(&mut self, req: QueuedRequest) -> Result<Placement, Rejection> {
        if self.draining {
            return Err(Rejection::Draining);
        }
        let grid = &self.grids[req.model];
        let fits = req.rows <= grid.max_batch() && req.len <= grid.max_seq();
        let seq = self.next_seq;
        let key = (Reverse(req.priority), seq);
        let (placement, slot) = if fits {
            if self.queued_per_model[req.model] >= self.config.max_queue {
                return Err(Rejection::Overloaded {
                    limit: self.config.max_queue,
                });
            }
            let seq_bucket = grid.seq_bucket(req.len).expect("fits the grid");
            (
                Placement::Bucketed { seq: seq_bucket },
                Slot::Bucketed {
                    model: req.model,
                    seq: seq_bucket,
                    key,
                },
            )
        } else {
            if !self.has_eager_devices() {
                return Err(Rejection::TooLarge {
                    rows: req.rows,
                    len: req.len,
                    largest: Bucket::new(grid.max_batch(), grid.max_seq()),
                });
            }
            if self.eager.entries.len() >= self.config.eager_max_queue {
                return Err(Rejection::Overloaded {
                    limit: self.config.eager_max_queue,
                });
            }
            (Placement::Eager, Slot::Eager { key })
        };
        self.next_seq += 1;
        if let Some(deadline) = req.deadline {
            self.deadlines.insert((deadline, req.id));
        }
        self.index.insert(req.id, slot);
        match slot {
            Slot::Bucketed { model, seq, key } => {
                self.queued_per_model[model] += 1;
                self.queues[model].entry(seq).or_default().insert(key, req);
            }
            Slot::Eager { key } => self.eager.insert(key, req),
        }
        Ok(placement)
    }

    /// Removes a queued request (e.g. expired); returns it if it was queued.
    pub fn remove(&mut self, id: RequestId) -> Option<QueuedRequest> {
        let slot = self.index.remove(&id)?;
        let req = match slot {
            Slot::Bucketed { model, seq, key } => {
                let queues = &mut self.queues[model];
                let queue = queues.get_mut(&seq)?;
                let req = queue.remove(&key)?;
                if queue.entries.is_empty() {
                    queues.remove(&seq);
                }
                self.queued_per_model[model] -= 1;
                req
            }
            Slot::Eager { key } => self.eager.remove(&key)?,
        };
        if let Some(deadline) = req.deadline {
            self.deadlines.remove(&(deadline, id));
        }
        Some(req)
    }

    /// Everything that should happen now: expiries first, then retries, then
    /// new batches for as long as devices have room.
    pub fn poll(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.remove(id);
            actions.push(Action::Expire(id));
        }
        // Retries first, each to the least-loaded healthy device of its kind.
        while let Some(&(batch, kind)) = self.retries.front() {
            let Some(device) = self.pick_device(kind) else {
                break;
            };
            self.retries.pop_front();
            self.mark_dispatched(device);
            actions.push(Action::Redispatch { device, batch });
        }
        while let Some(device) = self.pick_device(DeviceKind::Eager) {
            let Some(key) = self.eager.head_key() else {
                break;
            };
            let req = self.eager.remove(&key).expect("head exists");
            self.index.remove(&req.id);
            if let Some(deadline) = req.deadline {
                self.deadlines.remove(&(deadline, req.id));
            }
            self.mark_dispatched(device);
            actions.push(Action::Dispatch {
                device,
                plan: BatchPlan {
                    model: req.model,
                    bucket: None,
                    requests: vec![req.id],
                    rows: req.rows,
                },
            });
        }
        while let Some(device) = self.pick_device(DeviceKind::Graph) {
            let idle = self.devices[device].inflight == 0;
            let Some((model, seq)) = self.best_queue(now, idle) else {
                break;
            };
            let plan = self.take_batch(model, seq);
            self.mark_dispatched(device);
            actions.push(Action::Dispatch { device, plan });
        }
        actions
    }

    /// When [`Self::poll`] should next be called if nothing else happens:
    /// the earliest deadline or batching-window end among queued requests.
    pub fn next_wakeup(&self) -> Option<Instant> {
        let deadline = self.deadlines.first().map(|&(d, _)| d);
        let window = self
            .queues
            .iter()
            .flat_map(|qs| qs.values())
            .filter_map(Queue::oldest)
            .min()
            .map(|oldest| oldest + self.config.max_wait);
        match (deadline, window) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn mark_dispatched(&mut self, device: DeviceId) {
        let slot = &mut self.devices[device];
        slot.inflight += 1;
        slot.dispatched += 1;
    }

    /// The healthy device of `kind` with room and the fewest batches in
    /// flight; ties go to the one that has had the fewest batches overall.
    fn pick_device(&self, kind: DeviceKind) -> Option<DeviceId> {
        self.devices
            .iter()
            .enumerate()
            .filter(|(_, d)| d.kind == kind && d.healthy && d.inflight < self.config.max_inflight)
            .min_by_key(|(i, d)| (d.inflight, d.dispatched, *i))
            .map(|(i, _)| i)
    }

    /// The queue to dispatch next, if any is due: the best head (priority,
    /// then age) among queues that are full, have waited long enough, or any
    /// queue when the device is idle or we are draining.
    fn best_queue(&self, now: Instant, device_idle: bool) -> Option<(usize, usize)> {
        let mut best: Option<(QueueKey, usize, usize)> = None;
        for (model, queues) in self.queues.iter().enumerate() {
            let max_batch = self.grids[model].max_batch();
            for (&seq, queue) in queues {
                let Some(head) = queue.head_key() else {
                    continue;
                };
                let due = self.draining
                    || device_idle
                    || queue.rows >= max_batch
                    || queue
                        .oldest()
                        .is_some_and(|t| now.saturating_duration_since(t) >= self.config.max_wait);
                if due && best.is_none_or(|(k, _, _)| head < k) {
                    best = Some((head, model, seq));
                }
            }
        }
        best.map(|(_, model, seq)| (model, seq))
    }

    /// Takes requests in queue order while they fit the largest batch bucket.
    fn take_batch(&mut self, model: usize, seq: usize) -> BatchPlan {
        let max_batch = self.grids[model].max_batch();
        let queues = &mut self.queues[model];
        let queue = queues.get_mut(&seq).expect("queue exists");
        let mut requests = Vec::new();
        let mut rows = 0;
        let keys: Vec<QueueKey> = queue.entries.keys().copied().collect();
        for key in keys {
            let r = queue.entries[&key].rows;
            if rows + r > max_batch {
                break;
            }
            let req = queue.remove(&key).expect("key exists");
            rows += r;
            self.index.remove(&req.id);
            if let Some(deadline) = req.deadline {
                self.deadlines.remove(&(deadline, req.id));
            }
            requests.push(req.id);
        }
        if queue.entries.is_empty() {
            queues.remove(&seq);
        }
        self.queued_per_model[model] -= requests.len();
        let batch = self.grids[model]
            .batch_bucket(rows)
            .expect("rows fit the largest batch bucket");
        BatchPlan {
            model,
            bucket: Some(Bucket::new(batch, seq)),
            requests,
            rows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            max_wait: Duration::from_micros(500),
            max_queue: 4,
            max_inflight: 2,
            eager_max_queue: 2,
        }
    }

    /// Model 0: an MLP-like grid (seq 1); model 1: a text grid.
    fn scheduler() -> Scheduler {
        Scheduler::new(
            config(),
            vec![
                BucketGrid::new(vec![1, 2, 4, 8], vec![1]),
                BucketGrid::new(vec![1, 2, 4], vec![16, 32, 64]),
            ],
        )
    }

    fn req(id: RequestId, model: usize, rows: usize, len: usize, at: Instant) -> QueuedRequest {
        QueuedRequest {
            id,
            model,
            rows,
            len,
            priority: 0,
            arrived: at,
            deadline: None,
        }
    }

    fn dispatched(actions: &[Action]) -> Vec<(DeviceId, BatchPlan)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Dispatch { device, plan } => Some((*device, plan.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn idle_device_takes_work_at_once_padded_to_smallest_bucket() {
        let mut s = scheduler();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let t0 = Instant::now();
        assert_eq!(
            s.enqueue(req(1, 0, 3, 1, t0)),
            Ok(Placement::Bucketed { seq: 1 })
        );
        let out = dispatched(&s.poll(t0));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(4, 1)));
        assert_eq!((out[0].1.rows, out[0].1.requests.clone()), (3, vec![1]));
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn seq_bucket_is_chosen_from_token_count() {
        let mut s = scheduler();
        let t0 = Instant::now();
        assert_eq!(
            s.enqueue(req(1, 1, 1, 16, t0)),
            Ok(Placement::Bucketed { seq: 16 })
        );
        assert_eq!(
            s.enqueue(req(2, 1, 1, 17, t0)),
            Ok(Placement::Bucketed { seq: 32 })
        );
        assert_eq!(
            s.enqueue(req(3, 1, 1, 64, t0)),
            Ok(Placement::Bucketed { seq: 64 })
        );
    }

    #[test]
    fn busy_devices_wait_for_a_full_batch_or_the_window() {
        let mut s = scheduler();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let t0 = Instant::now();
        // Occupy the device so it is not idle.
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        assert_eq!(dispatched(&s.poll(t0)).len(), 1);
        // Not full, not old: stays queued.
        s.enqueue(req(2, 0, 3, 1, t0)).unwrap();
        assert!(dispatched(&s.poll(t0)).is_empty());
        assert_eq!(s.next_wakeup(), Some(t0 + Duration::from_micros(500)));
        // After the window it goes, padded to 4.
        let t1 = t0 + Duration::from_micros(500);
        let out = dispatched(&s.poll(t1));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(4, 1)));
        // A full batch (8 rows) goes at once even on a busy device... but the
        // device is now at max_inflight (2), so it waits for a completion.
        s.enqueue(req(3, 0, 4, 1, t1)).unwrap();
        s.enqueue(req(4, 0, 4, 1, t1)).unwrap();
        assert!(dispatched(&s.poll(t1)).is_empty());
        s.completed(d);
        let out = dispatched(&s.poll(t1));
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
        assert_eq!(out[0].1.requests, vec![3, 4]);
    }

    #[test]
    fn full_queue_dispatches_on_a_busy_device() {
        let mut s = scheduler();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        s.poll(t0);
        s.enqueue(req(2, 0, 8, 1, t0)).unwrap();
        let out = dispatched(&s.poll(t0));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
    }

    #[test]
    fn batches_never_exceed_the_largest_bucket_and_keep_order() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 5, 1, t0)).unwrap();
        s.enqueue(req(2, 0, 4, 1, t0)).unwrap();
        s.enqueue(req(3, 0, 1, 1, t0)).unwrap();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let out = dispatched(&s.poll(t0));
        // Device idle: first batch takes request 1 only (1+2 would be 9 rows).
        assert_eq!(out[0].1.requests, vec![1]);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
        // Second slot (busy device now) still dispatches: 5 rows queued is not
        // full and not old, so nothing until the window passes.
        assert_eq!(out.len(), 1);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out[0].1.requests, vec![2, 3]);
        assert_eq!(out[0].1.rows, 5);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
    }

    #[test]
    fn priority_then_age() {
        let mut s = scheduler();
        let t0 = Instant::now();
        let mut low = req(1, 0, 4, 1, t0);
        low.priority = 0;
        let mut high = req(2, 0, 4, 1, t0 + Duration::from_micros(10));
        high.priority = 5;
        let later = req(3, 0, 4, 1, t0 + Duration::from_micros(20));
        s.enqueue(low).unwrap();
        s.enqueue(high).unwrap();
        s.enqueue(later).unwrap();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out[0].1.requests, vec![2, 1]);
        assert_eq!(out[1].1.requests, vec![3]);
    }

    #[test]
    fn across_queues_the_best_head_goes_first() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 1, 1, 40, t0)).unwrap();
        let mut urgent = req(2, 1, 1, 10, t0 + Duration::from_micros(5));
        urgent.priority = 9;
        s.enqueue(urgent).unwrap();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.requests, vec![2]);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(1, 16)));
    }

    #[test]
    fn deadlines_expire_queued_requests_only() {
        let mut s = scheduler();
        let t0 = Instant::now();
        let mut r = req(1, 0, 1, 1, t0);
        r.deadline = Some(t0 + Duration::from_micros(100));
        s.enqueue(r).unwrap();
        let mut r2 = req(2, 0, 1, 1, t0);
        r2.deadline = Some(t0 + Duration::from_secs(10));
        s.enqueue(r2).unwrap();
        assert_eq!(s.next_wakeup(), Some(t0 + Duration::from_micros(100)));
        let actions = s.poll(t0 + Duration::from_micros(100));
        assert_eq!(actions, vec![Action::Expire(1)]);
        assert_eq!(s.queued(), 1);
        // Request 2 is dispatched once a device exists, and then cannot expire.
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let out = dispatched(&s.poll(t0 + Duration::from_micros(200)));
        assert_eq!(out[0].1.requests, vec![2]);
        assert!(s.poll(t0 + Duration::from_secs(20)).is_empty());
    }

    #[test]
    fn full_queue_is_overloaded() {
        let mut s = scheduler();
        let t0 = Instant::now();
        for id in 0..4 {
            s.enqueue(req(id, 0, 1, 1, t0)).unwrap();
        }
        assert_eq!(
            s.enqueue(req(9, 0, 1, 1, t0)),
            Err(Rejection::Overloaded { limit: 4 })
        );
        // Another model's queue is separate.
        assert!(s.enqueue(req(10, 1, 1, 5, t0)).is_ok());
    }

    #[test]
    fn oversize_goes_eager_or_is_too_large() {
        let mut s = scheduler();
        let t0 = Instant::now();
        assert_eq!(
            s.enqueue(req(1, 0, 9, 1, t0)),
            Err(Rejection::TooLarge {
                rows: 9,
                len: 1,
                largest: Bucket::new(8, 1)
            })
        );
        let e = s.add_device(DeviceKind::Eager);
        s.set_healthy(e, true);
        let g = s.add_device(DeviceKind::Graph);
        s.set_healthy(g, true);
        assert_eq!(s.enqueue(req(2, 0, 9, 1, t0)), Ok(Placement::Eager));
        assert_eq!(s.enqueue(req(3, 1, 1, 100, t0)), Ok(Placement::Eager));
        assert_eq!(
            s.enqueue(req(4, 1, 1, 100, t0)),
            Err(Rejection::Overloaded { limit: 2 })
        );
        let out = dispatched(&s.poll(t0));
        // Eager requests go one per batch, exact shape, only to the eager device.
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|(d, p)| *d == e && p.bucket.is_none()));
        assert_eq!(out[0].1.requests, vec![2]);
    }

    #[test]
    fn least_loaded_healthy_device_and_retries_first() {
        let mut s = scheduler();
        let a = s.add_device(DeviceKind::Graph);
        let b = s.add_device(DeviceKind::Graph);
        s.set_healthy(a, true);
        s.set_healthy(b, true);
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 8, 1, t0)).unwrap();
        s.enqueue(req(2, 0, 8, 1, t0)).unwrap();
        let out = dispatched(&s.poll(t0));
        assert_eq!(out.iter().map(|(d, _)| *d).collect::<Vec<_>>(), vec![a, b]);
        // Device a dies: its batch is retried on b before new work.
        s.set_healthy(a, false);
        s.retry(77, DeviceKind::Graph);
        s.enqueue(req(3, 0, 8, 1, t0)).unwrap();
        let actions = s.poll(t0);
        assert_eq!(
            actions[0],
            Action::Redispatch {
                device: b,
                batch: 77
            }
        );
        // b is now at max_inflight (2): request 3 waits.
        assert_eq!(dispatched(&actions).len(), 0);
        assert_eq!(s.queued(), 1);
        // No healthy device: the retry waits too.
        s.set_healthy(b, false);
        s.retry(78, DeviceKind::Graph);
        assert!(s.poll(t0).is_empty());
        assert_eq!(s.pending_retries(), 1);
        s.set_healthy(a, true);
        assert_eq!(
            s.poll(t0)[0],
            Action::Redispatch {
                device: a,
                batch: 78
            }
        );
    }

    #[test]
    fn idle_ties_are_spread_over_devices() {
        let mut s = scheduler();
        let a = s.add_device(DeviceKind::Graph);
        let b = s.add_device(DeviceKind::Graph);
        s.set_healthy(a, true);
        s.set_healthy(b, true);
        let t0 = Instant::now();
        let mut used = Vec::new();
        for id in 0..4 {
            s.enqueue(req(id, 0, 1, 1, t0)).unwrap();
            let out = dispatched(&s.poll(t0));
            let device = out[0].0;
            s.completed(device);
            used.push(device);
        }
        assert_eq!(used, vec![a, b, a, b]);
    }

    #[test]
    fn draining_refuses_new_and_flushes_queued() {
        let mut s = scheduler();
        let d = s.add_device(DeviceKind::Graph);
        s.set_healthy(d, true);
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        s.poll(t0);
        s.enqueue(req(2, 0, 1, 1, t0)).unwrap();
        assert!(dispatched(&s.poll(t0)).is_empty());
        s.start_draining();
        assert_eq!(s.enqueue(req(3, 0, 1, 1, t0)), Err(Rejection::Draining));
        assert_eq!(dispatched(&s.poll(t0)).len(), 1);
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn removing_a_request_updates_counts() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 2, 1, t0)).unwrap();
        assert_eq!(s.queued_for_model(0), 1);
        assert!(s.remove(1).is_some());
        assert!(s.remove(1).is_none());
        assert_eq!((s.queued(), s.queued_for_model(0)), (0, 0));
        assert_eq!(s.next_wakeup(), None);
    }
}
