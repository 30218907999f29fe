//! The batcher's scheduling state machine: queues, batch formation, dispatch
//! rules, fairness, deadlines and retries. Pure and synchronous — time comes
//! in as an argument — so every rule is unit-tested below; the actor in
//! [`super`] owns one and turns its [`Action`]s into messages.
//!
//! The unit of scheduling is the **item** — one sequence (text) of a token
//! model, one feature row of an MLP — not the request: a request's items may
//! run in different batches, on different devices, and the actor assembles
//! its reply, in request order, when the last one is back.
//!
//! Rules:
//! * Each model has **lanes**: a padded model one per seq bucket (an item
//!   goes to the lane of the smallest seq bucket that holds it; MLP rows all
//!   to the one lane of seq 1), a packed model a single lane for every
//!   sequence; and an eager lane. An item no graph can run (longer than the
//!   largest seq bucket or token budget) goes to the eager lane, or the
//!   request is rejected as too long when there are no eager workers. A
//!   request is never sent eagerly for its number of items alone.
//! * Within a lane, items wait in request order by priority (higher first),
//!   then arrival.
//! * **Padded batches** take items in that order up to the largest batch
//!   bucket, splitting the last request if it does not fit whole (a batch is
//!   filled exactly), and go in the smallest batch bucket that holds them.
//! * **Packed batches** take items in that order while their tokens fit the
//!   largest token budget, up to the grid's sequence cap; an item that does
//!   not fit the tokens left is passed over (at most [`LOOKAHEAD`] of them)
//!   for later items that do. The batch goes in the smallest budget that
//!   holds its tokens and sequences ([`crate::bucket::TokenGrid::bucket_for`]). The lane's
//!   first item always fits, so the head of a lane is never passed over.
//! * A lane is due when it holds a full batch (the largest batch bucket's
//!   rows; the largest budget's tokens or the sequence cap), when its oldest
//!   item has waited `max_wait`, at once when a device is idle, and always
//!   while draining. Eager lanes are always due; an eager batch takes one
//!   model's eager items in order, up to the grid's largest batch (padded) or
//!   sequence cap (packed), and runs at its exact shape (`bucket: None`).
//! * **Fairness between models**: priority orders requests within a model
//!   only. Among the models with a due lane, the one that was sent a batch
//!   least recently goes first (round robin), so a long queue of one model —
//!   or a flood of high-priority requests to it — delays another model's
//!   due batch by at most one batch per other busy model. Within a model the
//!   lane with the best head (priority, then age) goes first.
//! * **Fairness within a lane**: a request that fills a whole batch by
//!   itself and still has items left moves behind the requests of its
//!   priority queued at that moment (keeping its age for the `max_wait`
//!   rule). So a huge request advances by at least one batch per round and
//!   the small requests queued behind it get the next batch instead of
//!   waiting for all of it; requests arriving later still queue behind it.
//! * Batches go to the least-loaded healthy device with room (`max_inflight`)
//!   that is not drained (a drained device finishes what it holds; queued
//!   work is the model's, not the device's, so it goes elsewhere).
//! * A reload may replace a model's grid ([`Scheduler::set_grid`]): its
//!   queued items move, in their order and keeping their age, to the lanes
//!   of the new grid.
//! * Batches whose worker died are retried before anything else.
//! * A request's deadline holds until it is answered: at the deadline its
//!   queued items are dropped and [`Action::Expire`] says so, whether or not
//!   some of its items are in flight (the actor ignores their rows when they
//!   come back).
//! * A full queue rejects at once (`overloaded`): `max_queue` requests with
//!   items waiting per model, `eager_max_queue` requests with eager items
//!   waiting over all models.

use crate::bucket::{Bucket, Grid};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::time::{Duration, Instant};

/// The batcher's id for an accepted request (not the client's id).
pub type RequestId = u64;
/// The batcher's id for a dispatched batch.
pub type BatchId = u64;
/// Index of a device slot in the scheduler.
pub type DeviceId = usize;

/// Items a packed batch passes over, because their tokens do not fit what
/// is left of the budget, before it stops looking for ones that do.
pub const LOOKAHEAD: usize = 64;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_wait: Duration,
    /// Requests with items queued, per model.
    pub max_queue: usize,
    /// Batches in flight per device.
    pub max_inflight: usize,
    /// Requests with eager items queued (all models).
    pub eager_max_queue: usize,
}

/// A request as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct QueuedRequest {
    pub id: RequestId,
    pub model: usize,
    /// Tokens of each item, in request order (1 per row for models without
    /// a sequence axis). Never empty.
    pub lens: Vec<u32>,
    pub priority: u8,
    pub arrived: Instant,
    pub deadline: Option<Instant>,
}

/// Where an accepted request's items will run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Items queued for graphs.
    pub graph: usize,
    /// Items queued for an eager worker (too long for every graph).
    pub eager: usize,
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    Overloaded {
        limit: usize,
    },
    /// An item is longer than every graph holds and no eager worker is configured.
    TooLong {
        /// Index of the first such item in the request.
        item: usize,
        len: usize,
        largest: Bucket,
    },
    Draining,
}

/// Whether a device replays graphs or runs eager batches (the stats call
/// it the device's `role`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Graph,
    Eager,
}

impl DeviceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Graph => "graph",
            DeviceKind::Eager => "eager",
        }
    }
}

/// The items of one request that a batch holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanPart {
    pub request: RequestId,
    /// Indices into the request's items, increasing.
    pub items: Vec<u32>,
}

/// A batch to form: request parts in row order, and its bucket.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPlan {
    pub model: usize,
    /// `None` for the eager path (exact shape).
    pub bucket: Option<Bucket>,
    pub parts: Vec<PlanPart>,
    /// Items (rows, sequences) over all parts.
    pub rows: usize,
    /// Tokens over all parts, as the budget counts them (an empty sequence counts 1).
    pub tokens: usize,
}

impl BatchPlan {
    /// The requests with items in this batch, in row order.
    pub fn requests(&self) -> Vec<RequestId> {
        self.parts.iter().map(|p| p.request).collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send a new batch to a device.
    Dispatch { device: DeviceId, plan: BatchPlan },
    /// Send an already-formed batch again (its first worker died).
    Redispatch { device: DeviceId, batch: BatchId },
    /// The request's deadline passed: answer `deadline_exceeded`. Its queued
    /// items are gone; `dispatched` says whether some had been sent (their
    /// rows are to be ignored when they come back).
    Expire {
        request: RequestId,
        dispatched: bool,
    },
}

#[derive(Clone, Debug)]
struct DeviceSlot {
    kind: DeviceKind,
    healthy: bool,
    /// Drained by the operator: no new batches (what it holds finishes).
    drained: bool,
    inflight: usize,
    /// Batches ever sent, to spread ties evenly over devices.
    dispatched: u64,
}

/// A model's queue of items of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Lane {
    /// Padded model: items of this seq bucket (1 without a sequence axis).
    Seq(usize),
    /// Packed model: every item a token budget holds.
    Packed,
    /// Items no graph holds.
    Eager,
}

type QueueKey = (Reverse<u8>, u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Item {
    index: u32,
    len: u32,
}

impl Item {
    /// Token slots the item takes in a packed batch.
    fn cost(self) -> usize {
        (self.len as usize).max(1)
    }
}

/// One request's items waiting in one lane.
#[derive(Debug)]
struct Entry {
    request: RequestId,
    arrived: Instant,
    items: Vec<Item>,
    tokens: usize,
}

#[derive(Debug, Default)]
struct Queue {
    /// Ordered by priority (higher first), then arrival sequence number.
    entries: BTreeMap<QueueKey, Entry>,
    /// (arrival, sequence number) of every entry, for the oldest one's age.
    arrivals: BTreeSet<(Instant, u64)>,
    items: usize,
    tokens: usize,
}

impl Queue {
    fn insert(&mut self, key: QueueKey, entry: Entry) {
        self.items += entry.items.len();
        self.tokens += entry.tokens;
        self.arrivals.insert((entry.arrived, key.1));
        self.entries.insert(key, entry);
    }

    fn remove(&mut self, key: &QueueKey) -> Option<Entry> {
        let entry = self.entries.remove(key)?;
        self.items -= entry.items.len();
        self.tokens -= entry.tokens;
        self.arrivals.remove(&(entry.arrived, key.1));
        Some(entry)
    }

    fn oldest(&self) -> Option<Instant> {
        self.arrivals.first().map(|&(t, _)| t)
    }

    fn head_key(&self) -> Option<QueueKey> {
        self.entries.keys().next().copied()
    }
}

/// What the scheduler keeps of an accepted request until it is answered.
#[derive(Debug)]
struct RequestState {
    model: usize,
    deadline: Option<Instant>,
    /// The lanes holding its queued items, and their keys there.
    slots: Vec<(Lane, QueueKey)>,
    /// Some of its items were sent to a device.
    dispatched: bool,
}

impl RequestState {
    fn graph_slots(&self) -> usize {
        self.slots.iter().filter(|(l, _)| *l != Lane::Eager).count()
    }
}

/// How to fill one batch from a lane.
struct Fill {
    max_items: usize,
    max_tokens: usize,
    /// Pass over items whose tokens do not fit (packed batches).
    skip: bool,
}

/// The scheduling state machine.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    grids: Vec<Grid>,
    /// Per model: lane → queue (lanes with nothing queued are removed).
    queues: Vec<BTreeMap<Lane, Queue>>,
    /// Requests with graph items queued, per model.
    queued_per_model: Vec<usize>,
    /// Requests with eager items queued.
    queued_eager: usize,
    requests: HashMap<RequestId, RequestState>,
    deadlines: BTreeSet<(Instant, RequestId)>,
    retries: VecDeque<(BatchId, DeviceKind)>,
    devices: Vec<DeviceSlot>,
    /// Per model, per device kind (graph, eager): when it last got a batch.
    last_served: Vec<[u64; 2]>,
    clock: u64,
    next_seq: u64,
    draining: bool,
}

fn kind_index(kind: DeviceKind) -> usize {
    match kind {
        DeviceKind::Graph => 0,
        DeviceKind::Eager => 1,
    }
}

impl Scheduler {
    /// `grids[m]` is model `m`'s grid (padded buckets or packed budgets).
    pub fn new(config: SchedulerConfig, grids: Vec<Grid>) -> Self {
        let n = grids.len();
        Self {
            config,
            grids,
            queues: (0..n).map(|_| BTreeMap::new()).collect(),
            queued_per_model: vec![0; n],
            queued_eager: 0,
            requests: HashMap::new(),
            deadlines: BTreeSet::new(),
            retries: VecDeque::new(),
            devices: Vec::new(),
            last_served: vec![[0; 2]; n],
            clock: 0,
            next_seq: 0,
            draining: false,
        }
    }

    pub fn grid(&self, model: usize) -> &Grid {
        &self.grids[model]
    }

    /// Adds a device (initially unhealthy until [`Self::set_healthy`]).
    pub fn add_device(&mut self, kind: DeviceKind) -> DeviceId {
        self.devices.push(DeviceSlot {
            kind,
            healthy: false,
            drained: false,
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

    /// Drains a device (no new batches, retries included) or takes it back.
    /// Unlike [`Self::set_healthy`] this keeps its in-flight count: what it
    /// holds finishes there.
    pub fn set_drained(&mut self, device: DeviceId, drained: bool) {
        self.devices[device].drained = drained;
    }

    /// Replaces the scheduling limits (a reload).
    pub fn set_config(&mut self, config: SchedulerConfig) {
        self.config = config;
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Replaces a model's grid (a reload). Its queued items move to the
    /// lanes of the new grid in their order, each request keeping its place
    /// (priority, then arrival) and its age. Returns the requests that now
    /// hold an item no graph of the new grid holds while there is no eager
    /// worker: they are forgotten here and the caller answers them `too_long`.
    pub fn set_grid(&mut self, model: usize, grid: Grid) -> Vec<RequestId> {
        self.grids[model] = grid;
        let old = std::mem::take(&mut self.queues[model]);
        // Every queued entry of the model, merged per request.
        let mut moved: BTreeMap<RequestId, (QueueKey, Instant, Vec<Item>)> = BTreeMap::new();
        for (_, queue) in old {
            for (key, entry) in queue.entries {
                let e = moved
                    .entry(entry.request)
                    .or_insert((key, entry.arrived, Vec::new()));
                e.0 = e.0.min(key);
                e.2.extend(entry.items);
            }
        }
        let mut failed = Vec::new();
        for (id, (key, arrived, mut items)) in moved {
            let Some(r) = self.requests.get_mut(&id) else {
                continue;
            };
            if r.graph_slots() > 0 {
                self.queued_per_model[model] -= 1;
            }
            if r.slots.iter().any(|(lane, _)| *lane == Lane::Eager) {
                self.queued_eager -= 1;
            }
            r.slots.clear();
            items.sort_by_key(|i| i.index);
            let mut lanes: BTreeMap<Lane, Vec<Item>> = BTreeMap::new();
            for item in items {
                let lane = self.lane_for(model, item.len as usize);
                lanes.entry(lane).or_default().push(item);
            }
            if lanes.contains_key(&Lane::Eager) && !self.has_eager_devices() {
                self.finish(id);
                failed.push(id);
                continue;
            }
            let mut slots = Vec::new();
            for (lane, items) in lanes {
                let tokens = items.iter().map(|i| i.cost()).sum();
                self.queues[model].entry(lane).or_default().insert(
                    key,
                    Entry {
                        request: id,
                        arrived,
                        items,
                        tokens,
                    },
                );
                slots.push((lane, key));
            }
            if slots.iter().any(|(lane, _)| *lane != Lane::Eager) {
                self.queued_per_model[model] += 1;
            }
            if slots.iter().any(|(lane, _)| *lane == Lane::Eager) {
                self.queued_eager += 1;
            }
            if let Some(r) = self.requests.get_mut(&id) {
                r.slots = slots;
            }
        }
        failed
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

    /// Requests with items waiting (not yet all dispatched).
    pub fn queued(&self) -> usize {
        self.requests
            .values()
            .filter(|r| !r.slots.is_empty())
            .count()
    }

    /// Requests accepted and not yet [finished](Self::finish) or expired.
    pub fn live(&self) -> usize {
        self.requests.len()
    }

    /// Requests of `model` with items waiting for a graph.
    pub fn queued_for_model(&self, model: usize) -> usize {
        self.queued_per_model[model]
    }

    /// Items of `model` waiting for a graph.
    pub fn queued_items(&self, model: usize) -> usize {
        self.queues[model]
            .iter()
            .filter(|(lane, _)| **lane != Lane::Eager)
            .map(|(_, q)| q.items)
            .sum()
    }

    /// Requests with items waiting for an eager worker.
    pub fn queued_eager(&self) -> usize {
        self.queued_eager
    }

    /// Batches waiting to be retried.
    pub fn pending_retries(&self) -> usize {
        self.retries.len()
    }

    pub fn inflight(&self, device: DeviceId) -> usize {
        self.devices[device].inflight
    }

    /// The largest shape a model's graphs hold (for error messages).
    pub fn largest(&self, model: usize) -> Bucket {
        match &self.grids[model] {
            Grid::Padded(g) => Bucket::new(g.max_batch(), g.max_seq()),
            Grid::Packed(g) => Bucket::packed(g.max_tokens(), g.max_seqs()),
        }
    }

    fn lane_for(&self, model: usize, len: usize) -> Lane {
        match &self.grids[model] {
            Grid::Padded(g) => g.seq_bucket(len).map_or(Lane::Eager, Lane::Seq),
            Grid::Packed(g) if len <= g.max_tokens() => Lane::Packed,
            Grid::Packed(_) => Lane::Eager,
        }
    }

    fn next_key(&mut self, priority: u8) -> QueueKey {
        self.next_seq += 1;
        (Reverse(priority), self.next_seq)
    }

    /// Accepts a request, its items into their lanes, or says why not.
    pub fn enqueue(&mut self, req: QueuedRequest) -> Result<Placement, Rejection> {
        if self.draining {
            return Err(Rejection::Draining);
        }
        assert!(!req.lens.is_empty(), "a request has at least one item");
        debug_assert!(!self.requests.contains_key(&req.id), "request id reused");
        let mut lanes: BTreeMap<Lane, Vec<Item>> = BTreeMap::new();
        for (i, &len) in req.lens.iter().enumerate() {
            let lane = self.lane_for(req.model, len as usize);
            lanes.entry(lane).or_default().push(Item {
                index: i as u32,
                len,
            });
        }
        let eager = lanes.get(&Lane::Eager).map_or(0, Vec::len);
        let graph = req.lens.len() - eager;
        if let Some(first) = lanes.get(&Lane::Eager).and_then(|items| items.first()) {
            if !self.has_eager_devices() {
                return Err(Rejection::TooLong {
                    item: first.index as usize,
                    len: first.len as usize,
                    largest: self.largest(req.model),
                });
            }
            if self.queued_eager >= self.config.eager_max_queue {
                return Err(Rejection::Overloaded {
                    limit: self.config.eager_max_queue,
                });
            }
        }
        if graph > 0 && self.queued_per_model[req.model] >= self.config.max_queue {
            return Err(Rejection::Overloaded {
                limit: self.config.max_queue,
            });
        }
        let mut slots = Vec::with_capacity(lanes.len());
        for (lane, items) in lanes {
            let key = self.next_key(req.priority);
            let tokens = items.iter().map(|i| i.cost()).sum();
            self.queues[req.model].entry(lane).or_default().insert(
                key,
                Entry {
                    request: req.id,
                    arrived: req.arrived,
                    items,
                    tokens,
                },
            );
            slots.push((lane, key));
        }
        if graph > 0 {
            self.queued_per_model[req.model] += 1;
        }
        if eager > 0 {
            self.queued_eager += 1;
        }
        if let Some(deadline) = req.deadline {
            self.deadlines.insert((deadline, req.id));
        }
        self.requests.insert(
            req.id,
            RequestState {
                model: req.model,
                deadline: req.deadline,
                slots,
                dispatched: false,
            },
        );
        Ok(Placement { graph, eager })
    }

    /// Forgets a request: it was answered (or failed, or aborted). Its
    /// queued items are dropped and its deadline no longer applies. Returns
    /// whether it was known.
    pub fn finish(&mut self, id: RequestId) -> bool {
        let Some(r) = self.requests.remove(&id) else {
            return false;
        };
        if let Some(deadline) = r.deadline {
            self.deadlines.remove(&(deadline, id));
        }
        let queues = &mut self.queues[r.model];
        for (lane, key) in &r.slots {
            if let Some(queue) = queues.get_mut(lane) {
                queue.remove(key);
                if queue.entries.is_empty() {
                    queues.remove(lane);
                }
            }
        }
        if r.graph_slots() > 0 {
            self.queued_per_model[r.model] -= 1;
        }
        if r.slots.iter().any(|(lane, _)| *lane == Lane::Eager) {
            self.queued_eager -= 1;
        }
        true
    }

    /// A request's entry in `lane` has no items left.
    fn slot_emptied(&mut self, id: RequestId, lane: Lane) {
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        let graph_before = r.graph_slots();
        r.slots.retain(|(l, _)| *l != lane);
        if lane == Lane::Eager {
            self.queued_eager -= 1;
        } else if graph_before == 1 {
            self.queued_per_model[r.model] -= 1;
        }
    }

    /// Everything that should happen now: expiries first, then retries, then
    /// new batches for as long as devices have room.
    pub fn poll(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            let dispatched = self.requests.get(&id).is_some_and(|r| r.dispatched);
            if !self.finish(id) {
                self.deadlines.remove(&(deadline, id));
                continue;
            }
            actions.push(Action::Expire {
                request: id,
                dispatched,
            });
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
        for kind in [DeviceKind::Eager, DeviceKind::Graph] {
            while let Some(device) = self.pick_device(kind) {
                let idle = self.devices[device].inflight == 0;
                let Some((model, lane)) = self.next_lane(now, idle, kind) else {
                    break;
                };
                let plan = self.take(model, lane);
                self.mark_dispatched(device);
                self.clock += 1;
                self.last_served[model][kind_index(kind)] = self.clock;
                actions.push(Action::Dispatch { device, plan });
            }
        }
        actions
    }

    /// When [`Self::poll`] should next be called if nothing else happens:
    /// the earliest deadline of a live request, or the earliest end of a
    /// batching window after `now` (a lane whose window has passed is due
    /// already and goes out when a device reports back).
    pub fn next_wakeup(&self, now: Instant) -> Option<Instant> {
        let deadline = self.deadlines.first().map(|&(d, _)| d);
        let window = self
            .queues
            .iter()
            .flat_map(|lanes| lanes.iter())
            .filter(|(lane, _)| **lane != Lane::Eager)
            .filter_map(|(_, q)| q.oldest())
            .map(|oldest| oldest + self.config.max_wait)
            .filter(|&end| end > now)
            .min();
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
            .filter(|(_, d)| {
                d.kind == kind && d.healthy && !d.drained && d.inflight < self.config.max_inflight
            })
            .min_by_key(|(i, d)| (d.inflight, d.dispatched, *i))
            .map(|(i, _)| i)
    }

    /// Whether the lane holds a whole batch of the largest bucket.
    fn holds_full_batch(&self, model: usize, queue: &Queue) -> bool {
        match &self.grids[model] {
            Grid::Padded(g) => queue.items >= g.max_batch(),
            Grid::Packed(g) => queue.tokens >= g.max_tokens() || queue.items >= g.max_seqs(),
        }
    }

    fn due(&self, model: usize, queue: &Queue, now: Instant, device_idle: bool) -> bool {
        self.draining
            || device_idle
            || self.holds_full_batch(model, queue)
            || queue
                .oldest()
                .is_some_and(|t| now.saturating_duration_since(t) >= self.config.max_wait)
    }

    /// The lane to dispatch next to a device of `kind`, if any is due: among
    /// the models with a due lane the least recently served, and within it
    /// the lane with the best head (priority, then age).
    fn next_lane(
        &self,
        now: Instant,
        device_idle: bool,
        kind: DeviceKind,
    ) -> Option<(usize, Lane)> {
        let eager = kind == DeviceKind::Eager;
        let mut best: Option<(u64, usize, Lane)> = None;
        for (model, lanes) in self.queues.iter().enumerate() {
            let mut head: Option<(QueueKey, Lane)> = None;
            for (&lane, queue) in lanes {
                if (lane == Lane::Eager) != eager {
                    continue;
                }
                let Some(key) = queue.head_key() else {
                    continue;
                };
                if !eager && !self.due(model, queue, now, device_idle) {
                    continue;
                }
                if head.is_none_or(|(k, _)| key < k) {
                    head = Some((key, lane));
                }
            }
            if let Some((_, lane)) = head {
                let served = self.last_served[model][kind_index(kind)];
                if best.is_none_or(|(s, _, _)| served < s) {
                    best = Some((served, model, lane));
                }
            }
        }
        best.map(|(_, model, lane)| (model, lane))
    }

    /// Forms the next batch from a lane (see the module's rules).
    fn take(&mut self, model: usize, lane: Lane) -> BatchPlan {
        let fill = match (&self.grids[model], lane) {
            (Grid::Padded(g), _) => Fill {
                max_items: g.max_batch(),
                max_tokens: usize::MAX,
                skip: false,
            },
            (Grid::Packed(g), Lane::Eager) => Fill {
                max_items: g.max_seqs(),
                max_tokens: usize::MAX,
                skip: false,
            },
            (Grid::Packed(g), _) => Fill {
                max_items: g.max_seqs(),
                max_tokens: g.max_tokens(),
                skip: true,
            },
        };
        let (parts, rows, tokens) = self.fill(model, lane, &fill);
        let bucket = match (&self.grids[model], lane) {
            (_, Lane::Eager) => None,
            (Grid::Padded(g), Lane::Seq(seq)) => Some(Bucket::new(
                g.batch_bucket(rows)
                    .expect("rows fit the largest batch bucket"),
                seq,
            )),
            (Grid::Packed(g), Lane::Packed) => Some(
                g.bucket_for(tokens, rows)
                    .expect("tokens and sequences fit the largest budget"),
            ),
            (grid, lane) => unreachable!("lane {lane:?} in grid {grid:?}"),
        };
        BatchPlan {
            model,
            bucket,
            parts,
            rows,
            tokens,
        }
    }

    /// Takes items from a lane in queue order within `fill`'s limits; see
    /// the module's rules for splitting, passing over and requeueing.
    fn fill(&mut self, model: usize, lane: Lane, fill: &Fill) -> (Vec<PlanPart>, usize, usize) {
        let queue = self.queues[model].get_mut(&lane).expect("lane has items");
        let mut parts: Vec<PlanPart> = Vec::new();
        let (mut rows, mut tokens, mut misses) = (0usize, 0usize, 0usize);
        let mut stop = false;
        let mut emptied = Vec::new();
        let mut first_key = None;
        let mut cursor: Option<QueueKey> = None;
        while !stop && rows < fill.max_items && tokens < fill.max_tokens {
            let next = match cursor {
                None => queue.entries.keys().next(),
                Some(k) => queue
                    .entries
                    .range((Bound::Excluded(k), Bound::Unbounded))
                    .next()
                    .map(|(k, _)| k),
            };
            let Some(&key) = next else {
                break;
            };
            cursor = Some(key);
            first_key.get_or_insert(key);
            let entry = queue.entries.get_mut(&key).expect("key exists");
            let mut took = Vec::new();
            let mut took_tokens = 0;
            let mut rest = Vec::new();
            let mut items = std::mem::take(&mut entry.items).into_iter();
            while let Some(item) = items.next() {
                let full =
                    rows + took.len() >= fill.max_items || tokens + took_tokens >= fill.max_tokens;
                if stop || full {
                    rest.push(item);
                    rest.extend(items.by_ref());
                    break;
                }
                if tokens + took_tokens + item.cost() <= fill.max_tokens {
                    took.push(item.index);
                    took_tokens += item.cost();
                } else {
                    rest.push(item);
                    misses += 1;
                    stop = !fill.skip || misses > LOOKAHEAD;
                }
            }
            entry.items = rest;
            entry.tokens -= took_tokens;
            let request = entry.request;
            let left = entry.items.len();
            queue.items -= took.len();
            queue.tokens -= took_tokens;
            rows += took.len();
            tokens += took_tokens;
            if !took.is_empty() {
                parts.push(PlanPart {
                    request,
                    items: took,
                });
            }
            if left == 0 {
                queue.remove(&key);
                emptied.push(request);
            }
        }
        // A request that filled the batch by itself yields to those behind it.
        let mut requeued = None;
        if let ([only], Some(key)) = (parts.as_slice(), first_key) {
            if queue
                .entries
                .get(&key)
                .is_some_and(|e| e.request == only.request)
            {
                let entry = queue.remove(&key).expect("present");
                self.next_seq += 1;
                let new_key = (key.0, self.next_seq);
                queue.insert(new_key, entry);
                requeued = Some((only.request, new_key));
            }
        }
        if queue.entries.is_empty() {
            self.queues[model].remove(&lane);
        }
        if let Some((request, new_key)) = requeued {
            if let Some(r) = self.requests.get_mut(&request) {
                for slot in r.slots.iter_mut().filter(|(l, _)| *l == lane) {
                    slot.1 = new_key;
                }
            }
        }
        for request in emptied {
            self.slot_emptied(request, lane);
        }
        for part in &parts {
            if let Some(r) = self.requests.get_mut(&part.request) {
                r.dispatched = true;
            }
        }
        (parts, rows, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{BucketGrid, TokenGrid};

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            max_wait: Duration::from_micros(500),
            max_queue: 4,
            max_inflight: 2,
            eager_max_queue: 2,
        }
    }

    /// Model 0: an MLP-like grid (seq 1); model 1: a padded text grid;
    /// model 2: a packed text grid (budgets 16, 32, 64; at most 4 sequences).
    fn scheduler() -> Scheduler {
        Scheduler::new(
            config(),
            vec![
                Grid::Padded(BucketGrid::new(vec![1, 2, 4, 8], vec![1])),
                Grid::Padded(BucketGrid::new(vec![1, 2, 4], vec![16, 32, 64])),
                Grid::Packed(TokenGrid::new(vec![16, 32, 64], 4)),
            ],
        )
    }

    /// A request of `rows` items of `len` tokens each.
    fn req(id: RequestId, model: usize, rows: usize, len: usize, at: Instant) -> QueuedRequest {
        seqs(id, model, &vec![len as u32; rows], at)
    }

    /// A request of items of these lengths.
    fn seqs(id: RequestId, model: usize, lens: &[u32], at: Instant) -> QueuedRequest {
        QueuedRequest {
            id,
            model,
            lens: lens.to_vec(),
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

    fn part(request: RequestId, items: impl IntoIterator<Item = u32>) -> PlanPart {
        PlanPart {
            request,
            items: items.into_iter().collect(),
        }
    }

    fn graph(n: usize) -> Placement {
        Placement { graph: n, eager: 0 }
    }

    fn with_device(s: &mut Scheduler, kind: DeviceKind) -> DeviceId {
        let d = s.add_device(kind);
        s.set_healthy(d, true);
        d
    }

    /// `r` at `priority`.
    fn with_priority(r: QueuedRequest, priority: u8) -> QueuedRequest {
        QueuedRequest { priority, ..r }
    }

    /// `r` due at `deadline`.
    fn with_deadline(r: QueuedRequest, deadline: Instant) -> QueuedRequest {
        QueuedRequest {
            deadline: Some(deadline),
            ..r
        }
    }

    /// A scheduler with one graph device, busy with one batch since `t0`.
    fn busy_device(t0: Instant) -> Scheduler {
        let mut s = scheduler();
        with_device(&mut s, DeviceKind::Graph);
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        s.poll(t0);
        s
    }

    #[test]
    fn idle_device_takes_work_at_once_padded_to_smallest_bucket() {
        let mut s = scheduler();
        with_device(&mut s, DeviceKind::Graph);
        let t0 = Instant::now();
        assert_eq!(s.enqueue(req(1, 0, 3, 1, t0)), Ok(graph(3)));
        let out = dispatched(&s.poll(t0));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(4, 1)));
        assert_eq!((out[0].1.rows, out[0].1.requests()), (3, vec![1]));
        assert_eq!(out[0].1.parts, vec![part(1, 0..3)]);
        assert_eq!(s.queued(), 0);
        // Still live (its deadline, if any, holds) until finished.
        assert_eq!(s.live(), 1);
        assert!(s.finish(1));
        assert_eq!(s.live(), 0);
    }

    #[test]
    fn each_text_goes_to_its_own_seq_bucket() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // One request of a 16-, a 40- and a 17-token text: no text is padded
        // to the request's longest.
        assert_eq!(s.enqueue(seqs(1, 1, &[16, 40, 17], t0)), Ok(graph(3)));
        let d = with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        let mut got: Vec<(Option<Bucket>, Vec<PlanPart>)> =
            out.into_iter().map(|(_, p)| (p.bucket, p.parts)).collect();
        // The device takes two batches (max_inflight); the third waits.
        assert_eq!(got.len(), 2);
        s.completed(d);
        got.extend(
            dispatched(&s.poll(t0 + Duration::from_millis(1)))
                .into_iter()
                .map(|(_, p)| (p.bucket, p.parts)),
        );
        got.sort_by_key(|(b, _)| *b);
        assert_eq!(
            got,
            vec![
                (Some(Bucket::new(1, 16)), vec![part(1, [0])]),
                (Some(Bucket::new(1, 32)), vec![part(1, [2])]),
                (Some(Bucket::new(1, 64)), vec![part(1, [1])]),
            ]
        );
    }

    #[test]
    fn busy_devices_wait_for_a_full_batch_or_the_window() {
        let mut s = scheduler();
        let d = with_device(&mut s, DeviceKind::Graph);
        let t0 = Instant::now();
        // Occupy the device so it is not idle.
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        assert_eq!(dispatched(&s.poll(t0)).len(), 1);
        // Not full, not old: stays queued.
        s.enqueue(req(2, 0, 3, 1, t0)).unwrap();
        assert!(dispatched(&s.poll(t0)).is_empty());
        assert_eq!(s.next_wakeup(t0), Some(t0 + Duration::from_micros(500)));
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
        // A passed window needs no timer: the completion polls.
        assert_eq!(s.next_wakeup(t1 + Duration::from_millis(1)), None);
        s.completed(d);
        let out = dispatched(&s.poll(t1));
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
        assert_eq!(out[0].1.requests(), vec![3, 4]);
    }

    #[test]
    fn full_queue_dispatches_on_a_busy_device() {
        let t0 = Instant::now();
        let mut s = busy_device(t0);
        s.enqueue(req(2, 0, 8, 1, t0)).unwrap();
        let out = dispatched(&s.poll(t0));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
    }

    #[test]
    fn batches_are_filled_exactly_by_splitting_the_last_request() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 5, 1, t0)).unwrap();
        s.enqueue(req(2, 0, 4, 1, t0)).unwrap();
        s.enqueue(req(3, 0, 1, 1, t0)).unwrap();
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        // 5 + 3 of request 2's 4 rows: exactly the largest bucket.
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.parts, vec![part(1, 0..5), part(2, 0..3)]);
        assert_eq!(
            (out[0].1.rows, out[0].1.bucket),
            (8, Some(Bucket::new(8, 1)))
        );
        // The rest (2 rows) waits for the window on the busy device, then goes
        // with request 2's last row first.
        assert!(dispatched(&s.poll(t0 + Duration::from_micros(100))).is_empty());
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out[0].1.parts, vec![part(2, [3]), part(3, [0])]);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(2, 1)));
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn a_request_larger_than_every_bucket_is_split_over_graph_batches() {
        let mut s = scheduler();
        let d = with_device(&mut s, DeviceKind::Graph);
        with_device(&mut s, DeviceKind::Eager);
        let t0 = Instant::now();
        assert_eq!(s.enqueue(req(1, 0, 20, 1, t0)), Ok(graph(20)));
        let mut items = Vec::new();
        let mut buckets = Vec::new();
        for _ in 0..3 {
            for (device, plan) in dispatched(&s.poll(t0)) {
                assert_eq!(device, d, "never the eager device");
                assert_eq!(plan.requests(), vec![1]);
                items.extend(plan.parts[0].items.clone());
                buckets.push(plan.bucket.unwrap());
                s.completed(d);
            }
        }
        assert_eq!(items, (0..20).collect::<Vec<_>>(), "in order, each once");
        assert_eq!(
            buckets,
            vec![Bucket::new(8, 1), Bucket::new(8, 1), Bucket::new(4, 1)]
        );
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn a_huge_request_yields_to_the_requests_queued_behind_it() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 30, 1, t0)).unwrap();
        s.enqueue(req(2, 0, 2, 1, t0 + Duration::from_micros(1)))
            .unwrap();
        s.enqueue(req(3, 0, 1, 1, t0 + Duration::from_micros(2)))
            .unwrap();
        let d = with_device(&mut s, DeviceKind::Graph);
        let mut plans = Vec::new();
        while s.queued() > 0 {
            for (_, plan) in dispatched(&s.poll(t0 + Duration::from_millis(1))) {
                plans.push(plan.parts);
                s.completed(d);
            }
        }
        assert_eq!(
            plans,
            vec![
                // Request 1 fills the first batch alone, then yields...
                vec![part(1, 0..8)],
                // ...so 2 and 3 go in the next, topped up with request 1...
                vec![part(2, 0..2), part(3, [0]), part(1, 8..13)],
                vec![part(1, 13..21)],
                vec![part(1, 21..29)],
                vec![part(1, [29])],
            ]
        );
        // A request arriving after it was requeued queues behind it (for
        // one batch: then it yields again).
        s.enqueue(req(4, 0, 30, 1, t0)).unwrap();
        s.enqueue(req(5, 0, 1, 1, t0)).unwrap();
        let out: Vec<_> = dispatched(&s.poll(t0))
            .into_iter()
            .map(|(_, p)| p.parts)
            .collect();
        assert_eq!(
            out,
            vec![vec![part(4, 0..8)], vec![part(5, [0]), part(4, 8..15)]]
        );
        s.enqueue(req(6, 0, 1, 1, t0)).unwrap();
        s.completed(d);
        s.completed(d);
        let out: Vec<_> = dispatched(&s.poll(t0))
            .into_iter()
            .map(|(_, p)| p.parts)
            .collect();
        assert_eq!(
            out,
            vec![vec![part(4, 15..23)], vec![part(6, [0]), part(4, 23..30)]]
        );
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
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out[0].1.requests(), vec![2, 1]);
        assert_eq!(out[1].1.requests(), vec![3]);
    }

    #[test]
    fn a_high_priority_request_overtakes_the_rest_of_a_split_one() {
        let mut s = scheduler();
        let d = with_device(&mut s, DeviceKind::Graph);
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 20, 1, t0)).unwrap();
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.parts, vec![part(1, 0..8)]);
        assert_eq!(out[1].1.parts, vec![part(1, 8..16)]);
        s.enqueue(with_priority(
            req(2, 0, 3, 1, t0 + Duration::from_micros(5)),
            9,
        ))
        .unwrap();
        s.completed(d);
        s.completed(d);
        let out = dispatched(&s.poll(t0 + Duration::from_micros(5)));
        assert_eq!(out[0].1.parts, vec![part(2, 0..3), part(1, 16..20)]);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(8, 1)));
    }

    #[test]
    fn across_lanes_the_best_head_goes_first() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(req(1, 1, 1, 40, t0)).unwrap();
        s.enqueue(with_priority(
            req(2, 1, 1, 10, t0 + Duration::from_micros(5)),
            9,
        ))
        .unwrap();
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.requests(), vec![2]);
        assert_eq!(out[0].1.bucket, Some(Bucket::new(1, 16)));
    }

    #[test]
    fn packed_batches_go_in_the_smallest_budget_that_holds_them() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // 5 + 7 = 12 tokens: budget 16.
        s.enqueue(seqs(1, 2, &[5, 7], t0)).unwrap();
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.bucket, Some(Bucket::packed(16, 4)));
        assert_eq!((out[0].1.rows, out[0].1.tokens), (2, 12));
        assert_eq!(out[0].1.parts, vec![part(1, [0, 1])]);
        // 17 tokens: budget 32; exactly 32: still 32; 33: 64.
        for (lens, budget) in [(&[17u32][..], 32), (&[16, 16], 32), (&[16, 17], 64)] {
            let mut s = scheduler();
            with_device(&mut s, DeviceKind::Graph);
            s.enqueue(seqs(1, 2, lens, t0)).unwrap();
            let out = dispatched(&s.poll(t0));
            assert_eq!(out[0].1.bucket, Some(Bucket::packed(budget, 4)), "{lens:?}");
        }
    }

    #[test]
    fn packed_batches_fill_the_budget_exactly_and_respect_the_sequence_cap() {
        let t0 = Instant::now();
        // Exact fill: 40 + 24 = 64, the largest budget; the third text waits.
        let mut s = scheduler();
        s.enqueue(seqs(1, 2, &[40, 24, 3], t0)).unwrap();
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.parts, vec![part(1, [0, 1])]);
        assert_eq!(
            (out[0].1.tokens, out[0].1.bucket),
            (64, Some(Bucket::packed(64, 4)))
        );
        // The sequence cap: 6 texts of 2 tokens go 4 + 2, though 12 tokens fit 16.
        let mut s = scheduler();
        s.enqueue(seqs(1, 2, &[2; 6], t0)).unwrap();
        let d = with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.parts, vec![part(1, 0..4)]);
        assert_eq!(out[0].1.bucket, Some(Bucket::packed(16, 4)));
        s.completed(d);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out.last().unwrap().1.parts, vec![part(1, 4..6)]);
        // A lane is full (due on a busy device) at the sequence cap.
        let mut s = scheduler();
        with_device(&mut s, DeviceKind::Graph);
        s.enqueue(seqs(1, 2, &[2], t0)).unwrap();
        s.poll(t0);
        s.enqueue(seqs(2, 2, &[2; 3], t0)).unwrap();
        assert!(dispatched(&s.poll(t0)).is_empty());
        s.enqueue(seqs(3, 2, &[2], t0)).unwrap();
        assert_eq!(dispatched(&s.poll(t0))[0].1.requests(), vec![2, 3]);
    }

    #[test]
    fn packed_batches_pass_over_texts_that_do_not_fit_but_never_the_head() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // Budget 64: 50 fits; 30 does not fit the 14 left and is passed
        // over; 10 and 4 fill it exactly; 1 waits.
        s.enqueue(seqs(1, 2, &[50, 30], t0)).unwrap();
        s.enqueue(seqs(2, 2, &[10, 4, 1], t0)).unwrap();
        let d = with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0));
        assert_eq!(out[0].1.parts, vec![part(1, [0]), part(2, [0, 1])]);
        assert_eq!(out[0].1.tokens, 64);
        // The passed-over 30-token text leads the next batch.
        s.completed(d);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out[0].1.parts, vec![part(1, [1]), part(2, [2])]);
        assert_eq!(out[0].1.bucket, Some(Bucket::packed(32, 4)));
    }

    #[test]
    fn items_longer_than_every_graph_go_eager_the_rest_to_graphs() {
        let mut s = scheduler();
        let t0 = Instant::now();
        let g = with_device(&mut s, DeviceKind::Graph);
        let e = with_device(&mut s, DeviceKind::Eager);
        // Padded text model: the 100-token text goes eager, the others to graphs.
        assert_eq!(
            s.enqueue(seqs(1, 1, &[10, 100, 20], t0)),
            Ok(Placement { graph: 2, eager: 1 })
        );
        // Packed: longer than the largest budget (64).
        assert_eq!(
            s.enqueue(seqs(2, 2, &[65, 64], t0)),
            Ok(Placement { graph: 1, eager: 1 })
        );
        let out = dispatched(&s.poll(t0));
        let eager: Vec<_> = out.iter().filter(|(d, _)| *d == e).collect();
        assert_eq!(eager.len(), 2);
        assert!(eager.iter().all(|(_, p)| p.bucket.is_none()));
        assert_eq!(eager[0].1.parts, vec![part(1, [1])]);
        assert_eq!(eager[1].1.parts, vec![part(2, [0])]);
        assert!(out
            .iter()
            .filter(|(d, _)| *d == g)
            .all(|(_, p)| p.bucket.is_some()));
    }

    #[test]
    fn oversize_is_too_long_without_eager_workers_and_eager_has_its_limit() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // More rows than any bucket is never a reason to refuse or go eager.
        assert_eq!(s.enqueue(req(1, 0, 9, 1, t0)), Ok(graph(9)));
        assert_eq!(
            s.enqueue(seqs(2, 1, &[5, 100], t0)),
            Err(Rejection::TooLong {
                item: 1,
                len: 100,
                largest: Bucket::new(4, 64)
            })
        );
        assert_eq!(
            s.enqueue(seqs(3, 2, &[65], t0)),
            Err(Rejection::TooLong {
                item: 0,
                len: 65,
                largest: Bucket::packed(64, 4)
            })
        );
        with_device(&mut s, DeviceKind::Eager);
        assert!(s.enqueue(seqs(4, 1, &[100], t0)).is_ok());
        assert!(s.enqueue(seqs(5, 1, &[100, 200], t0)).is_ok());
        assert_eq!(
            s.enqueue(seqs(6, 1, &[100], t0)),
            Err(Rejection::Overloaded { limit: 2 })
        );
        assert_eq!(s.queued_eager(), 2);
    }

    #[test]
    fn eager_batches_take_one_models_items_in_order_up_to_its_largest_batch() {
        let mut s = scheduler();
        let t0 = Instant::now();
        let e = with_device(&mut s, DeviceKind::Eager);
        s.enqueue(seqs(1, 1, &[100, 100, 100], t0)).unwrap();
        s.enqueue(seqs(2, 1, &[100, 100], t0)).unwrap();
        let out = dispatched(&s.poll(t0));
        // Model 1's largest batch is 4: 3 + 1, then the last one.
        assert_eq!(out[0].1.parts, vec![part(1, 0..3), part(2, [0])]);
        assert_eq!(out[1].1.parts, vec![part(2, [1])]);
        assert!(out.iter().all(|(d, p)| *d == e && p.bucket.is_none()));
    }

    #[test]
    fn deadlines_hold_while_queued_and_while_in_flight() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.enqueue(with_deadline(
            req(1, 0, 1, 1, t0),
            t0 + Duration::from_micros(100),
        ))
        .unwrap();
        s.enqueue(with_deadline(
            req(2, 0, 1, 1, t0),
            t0 + Duration::from_secs(10),
        ))
        .unwrap();
        assert_eq!(s.next_wakeup(t0), Some(t0 + Duration::from_micros(100)));
        let actions = s.poll(t0 + Duration::from_micros(100));
        assert_eq!(
            actions,
            vec![Action::Expire {
                request: 1,
                dispatched: false
            }]
        );
        assert_eq!(s.queued(), 1);
        // Request 2 is dispatched once a device exists; its deadline still
        // holds while it is in flight.
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0 + Duration::from_micros(200)));
        assert_eq!(out[0].1.requests(), vec![2]);
        assert_eq!(s.next_wakeup(t0), Some(t0 + Duration::from_secs(10)));
        assert_eq!(
            s.poll(t0 + Duration::from_secs(10)),
            vec![Action::Expire {
                request: 2,
                dispatched: true
            }]
        );
        assert!(s.poll(t0 + Duration::from_secs(20)).is_empty());
        // A request answered in time has no deadline left.
        s.enqueue(with_deadline(
            req(3, 0, 1, 1, t0),
            t0 + Duration::from_secs(30),
        ))
        .unwrap();
        assert!(s.finish(3));
        assert!(s.poll(t0 + Duration::from_secs(40)).is_empty());
    }

    #[test]
    fn a_split_request_expires_once_and_its_queued_rest_never_runs() {
        let mut s = scheduler();
        let d = with_device(&mut s, DeviceKind::Graph);
        let t0 = Instant::now();
        s.enqueue(with_deadline(
            req(1, 0, 20, 1, t0),
            t0 + Duration::from_millis(5),
        ))
        .unwrap();
        // Two batches of 8 in flight (the device's limit), 4 rows queued.
        assert_eq!(dispatched(&s.poll(t0)).len(), 2);
        s.enqueue(req(2, 0, 1, 1, t0)).unwrap();
        let at = t0 + Duration::from_millis(5);
        let actions = s.poll(at - Duration::from_micros(1));
        assert!(actions.is_empty(), "not before the deadline: {actions:?}");
        let actions = s.poll(at);
        assert_eq!(
            actions,
            vec![Action::Expire {
                request: 1,
                dispatched: true
            }]
        );
        // Its 4 queued rows are gone: the next batch holds only request 2.
        s.completed(d);
        let out = dispatched(&s.poll(at));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.parts, vec![part(2, [0])]);
        assert!(s.poll(at + Duration::from_secs(1)).is_empty());
        assert_eq!(s.queued_for_model(0), 0);
    }

    #[test]
    fn a_long_queue_of_one_model_does_not_starve_another() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // Model 0: 4 requests of 8 rows, old and at high priority.
        for id in 0..4 {
            s.enqueue(with_priority(req(id, 0, 8, 1, t0), 200)).unwrap();
        }
        // Model 2 (packed): one text, queued later at priority 0.
        s.enqueue(seqs(10, 2, &[5], t0 + Duration::from_millis(1)))
            .unwrap();
        let d = with_device(&mut s, DeviceKind::Graph);
        let mut order = Vec::new();
        let now = t0 + Duration::from_millis(2);
        while s.queued() > 0 {
            for (_, plan) in dispatched(&s.poll(now)) {
                order.push(plan.model);
            }
            s.completed(d);
        }
        // Model 0 goes first (never served, lower index), then model 2 at
        // once, not after all of model 0.
        assert_eq!(order, vec![0, 2, 0, 0, 0]);
    }

    #[test]
    fn models_take_turns_when_both_are_due() {
        let mut s = scheduler();
        let t0 = Instant::now();
        for id in 0..3 {
            s.enqueue(req(id, 0, 8, 1, t0)).unwrap();
            s.enqueue(seqs(100 + id, 2, &[60], t0)).unwrap();
        }
        let d = with_device(&mut s, DeviceKind::Graph);
        let mut order = Vec::new();
        while s.queued() > 0 {
            for (_, plan) in dispatched(&s.poll(t0)) {
                order.push(plan.model);
            }
            s.completed(d);
            s.completed(d);
        }
        assert_eq!(order, vec![0, 2, 0, 2, 0, 2]);
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
        // A request spread over three lanes counts once.
        assert!(s.enqueue(seqs(11, 1, &[5, 20, 40], t0)).is_ok());
        assert_eq!(s.queued_for_model(1), 2);
        assert_eq!(s.queued_items(1), 4);
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
        let a = with_device(&mut s, DeviceKind::Graph);
        let b = with_device(&mut s, DeviceKind::Graph);
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
        let t0 = Instant::now();
        let mut s = busy_device(t0);
        s.enqueue(req(2, 0, 1, 1, t0)).unwrap();
        assert!(dispatched(&s.poll(t0)).is_empty());
        s.start_draining();
        assert_eq!(s.enqueue(req(3, 0, 1, 1, t0)), Err(Rejection::Draining));
        assert_eq!(dispatched(&s.poll(t0)).len(), 1);
        assert_eq!(s.queued(), 0);
    }

    #[test]
    fn finishing_a_request_updates_counts() {
        let mut s = scheduler();
        let t0 = Instant::now();
        with_device(&mut s, DeviceKind::Eager);
        s.enqueue(seqs(1, 1, &[5, 20, 100], t0)).unwrap();
        assert_eq!((s.queued_for_model(1), s.queued_eager()), (1, 1));
        assert!(s.finish(1));
        assert!(!s.finish(1));
        assert_eq!(
            (
                s.queued(),
                s.queued_for_model(1),
                s.queued_eager(),
                s.queued_items(1)
            ),
            (0, 0, 0, 0)
        );
        assert_eq!(s.next_wakeup(t0), None);
    }

    #[test]
    fn a_drained_device_gets_no_new_batches_and_keeps_its_count() {
        let mut s = scheduler();
        let a = with_device(&mut s, DeviceKind::Graph);
        let b = with_device(&mut s, DeviceKind::Graph);
        let t0 = Instant::now();
        s.enqueue(req(1, 0, 1, 1, t0)).unwrap();
        assert_eq!(dispatched(&s.poll(t0))[0].0, a);
        s.set_drained(a, true);
        assert_eq!(s.inflight(a), 1);
        for id in 2..6 {
            s.enqueue(req(id, 0, 1, 1, t0)).unwrap();
        }
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert!(out.iter().all(|(d, _)| *d == b), "{out:?}");
        // Retries avoid it too.
        s.retry(99, DeviceKind::Graph);
        s.completed(b);
        s.completed(b);
        let acts = s.poll(t0 + Duration::from_millis(1));
        assert!(
            acts.contains(&Action::Redispatch {
                device: b,
                batch: 99
            }),
            "{acts:?}"
        );
        // Undrained, it takes work again.
        s.set_drained(a, false);
        s.completed(a);
        s.enqueue(req(7, 0, 8, 1, t0)).unwrap();
        assert!(dispatched(&s.poll(t0 + Duration::from_millis(2)))
            .iter()
            .any(|(d, _)| *d == a));
    }

    #[test]
    fn a_new_grid_moves_queued_items_to_its_lanes_in_order() {
        let mut s = scheduler();
        let t0 = Instant::now();
        // Model 1 (padded, seq 16/32/64): no device yet, so everything queues.
        s.enqueue(seqs(1, 1, &[10, 30, 60], t0)).unwrap();
        s.enqueue(seqs(2, 1, &[20], t0 + Duration::from_micros(1)))
            .unwrap();
        assert_eq!(s.queued_for_model(1), 2);
        // The new grid: seq 24 and 64; batch 1, 2, 4.
        let failed = s.set_grid(
            1,
            Grid::Padded(BucketGrid::new(vec![1, 2, 4], vec![24, 64])),
        );
        assert!(failed.is_empty());
        assert_eq!((s.queued_for_model(1), s.queued_items(1)), (2, 4));
        with_device(&mut s, DeviceKind::Graph);
        let mut got = Vec::new();
        for _ in 0..4 {
            for (_, plan) in dispatched(&s.poll(t0 + Duration::from_millis(1))) {
                got.push((plan.bucket, plan.parts));
            }
            s.completed(0);
            s.completed(0);
        }
        got.sort_by_key(|(b, _)| *b);
        assert_eq!(
            got,
            vec![
                (Some(Bucket::new(2, 24)), vec![part(1, [0]), part(2, [0])]),
                (Some(Bucket::new(2, 64)), vec![part(1, [1, 2])]),
            ]
        );
        assert_eq!(s.queued(), 0);
        // Items that no longer fit any graph: too long without eager workers.
        s.enqueue(seqs(3, 1, &[50], t0)).unwrap();
        let failed = s.set_grid(1, Grid::Padded(BucketGrid::new(vec![1], vec![16])));
        assert_eq!(failed, vec![3]);
        assert_eq!((s.queued(), s.live(), s.queued_for_model(1)), (0, 2, 0));
    }

    #[test]
    fn a_packed_grid_change_moves_eager_items_back_to_graphs() {
        let mut s = scheduler();
        let t0 = Instant::now();
        with_device(&mut s, DeviceKind::Eager);
        // 100 tokens: above the largest budget (64), so eager.
        s.enqueue(seqs(1, 2, &[10, 100], t0)).unwrap();
        assert_eq!((s.queued_for_model(2), s.queued_eager()), (1, 1));
        let failed = s.set_grid(2, Grid::Packed(TokenGrid::new(vec![32, 128], 4)));
        assert!(failed.is_empty());
        assert_eq!((s.queued_for_model(2), s.queued_eager()), (1, 0));
        with_device(&mut s, DeviceKind::Graph);
        let out = dispatched(&s.poll(t0 + Duration::from_millis(1)));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1.bucket, Some(Bucket::packed(128, 4)));
        assert_eq!(out[0].1.parts, vec![part(1, [0, 1])]);
    }
}
