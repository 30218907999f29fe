//! The batcher actor: owns every accepted request until it is answered.
//!
//! * [`queue`] — the scheduling state machine (lanes, batch formation,
//!   dispatch rules, fairness, deadlines, retries), pure and unit-tested.
//! * This module — the actor around it: it accepts [`Submission`]s from the
//!   frontend (through the [`SubmitQueue`]), turns the scheduler's actions
//!   into [`Batch`]es sent on each device's [`DeviceRoute`] (the worker's
//!   ring, else its socket), takes every batch's outcome as one
//!   [`BatcherMsg::Report`] whichever way it went, puts each finished
//!   batch's rows back into their requests and
//!   answers a request, in row order, once its last row is back; it
//!   re-dispatches the batches of a device whose worker died, and answers
//!   `deadline_exceeded` at a request's deadline even while some of its rows
//!   are in flight (their rows are then ignored when they come back). It
//!   holds each request's reply channel, so every accepted request gets
//!   exactly one reply.
//!
//! A reply's `bucket` and `device` are those of the largest shape that ran
//! any of its rows (`"eager"` above every bucket); `compute_us` adds up its
//! batches' worker time, `queued_us` runs until its first batch was sent.
//!
//! Handlers only move data between maps and channels; nothing here blocks.
//! [`tests`](self) drives the actor against fake device actors.

pub mod queue;
pub mod shards;
pub mod start;
#[cfg(test)]
mod tests;

use super::messages::{
    Batch, BatchOutcome, BatchOutput, BatchPart, BatchReport, BatcherMsg, Stamps, Submission,
};
use super::metrics::{EagerReason, Ledger, Metrics, Observation};
use super::output::{non_finite_row, OutputForm};
use super::route::DeviceRoute;
use crate::bucket::{Bucket, Grid};
use crate::clock::{mono_ns, us_between};
use crate::model::BatchRows;
use crate::protocol::{ErrorCode, Hops, Reply};
use crate::worker::link::WorkerError;
use bytes::Bytes;
use queue::{
    Action, BatchId, BatchPlan, DeviceId, DeviceKind, QueuedRequest, Rejection, RequestId,
    Scheduler, SchedulerConfig,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
pub use shards::SubmitQueue;
use shards::{first_batch_id, load_of, ShardLoad};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What the batcher needs to know about each model.
#[derive(Clone, Debug)]
pub struct ModelSlot {
    pub name: String,
    pub grid: Grid,
}

pub struct BatcherArgs {
    pub models: Vec<ModelSlot>,
    /// One entry per device slot: its kind and label (e.g. "cuda:0").
    pub devices: Vec<(DeviceKind, String)>,
    /// The way to each device slot, in the order of `devices`.
    pub routes: Vec<Arc<DeviceRoute>>,
    pub config: SchedulerConfig,
    pub max_attempts: u32,
    pub metrics: Arc<Metrics>,
    /// The frontend's submissions ([`BatcherMsg::SubmitQueued`]).
    pub submissions: Arc<SubmitQueue>,
    /// This batcher's index among the shards ([`shards`]): its batch ids
    /// carry it, and its queue depths are published under it.
    pub shard: usize,
    /// Its load as the frontend routes by: each request's tokens leave it
    /// when the request is answered.
    pub load: Arc<ShardLoad>,
}

/// The shape that ran some of a request's rows; the reply names the largest.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Shape {
    /// Eager runs rank above every bucket (they hold what no bucket could).
    eager: bool,
    tokens: usize,
    rows: usize,
    bucket: Option<Bucket>,
    device: DeviceId,
}

impl Shape {
    fn of(bucket: Option<Bucket>, device: DeviceId) -> Self {
        Shape {
            eager: bucket.is_none(),
            tokens: bucket.map_or(0, Bucket::tokens),
            rows: bucket.map_or(0, Bucket::rows),
            bucket,
            device,
        }
    }
}

struct Pending {
    model: usize,
    /// Its weight in the shard's load ([`load_of`]).
    load: u64,
    client_id: u64,
    input: Arc<BatchRows>,
    received: Instant,
    /// When its first batch was sent.
    dispatched: Option<Instant>,
    form: OutputForm,
    reply: oneshot::Sender<Reply>,
    /// Rows not yet back from a device.
    remaining: usize,
    /// The output, once known: all of it from one batch, or assembled row
    /// by row from several.
    output: Output,
    output_dim: usize,
    compute_us: u64,
    batches: u32,
    shown: Option<Shape>,
    stamps: Stamps,
    /// The hop stamps of the batch that brought its last rows.
    last: BatchStamps,
}

/// When a batch passed each point after the batcher ([`mono_ns`]).
#[derive(Clone, Copy, Debug, Default)]
struct BatchStamps {
    dispatched_ns: u64,
    started_ns: u64,
    finished_ns: u64,
    back_ns: u64,
}

impl Pending {
    /// Where its time went, from its stamps and its last batch's.
    fn hops(&self) -> Hops {
        let (s, b) = (&self.stamps, &self.last);
        if s.received_ns == 0 {
            return Hops::default();
        }
        // The worker's stamps are missing on old workers: put its whole
        // round trip under `device` then.
        let (started, finished) = if b.started_ns == 0 {
            (b.dispatched_ns, b.back_ns)
        } else {
            (b.started_ns, b.finished_ns)
        };
        Hops {
            decode: us_between(s.received_ns, s.decoded_ns),
            tokenize: us_between(s.decoded_ns, s.submitted_ns),
            wait: us_between(s.submitted_ns, b.dispatched_ns),
            to_worker: us_between(b.dispatched_ns, started),
            device: us_between(started, finished),
            back: us_between(finished, b.back_ns),
            reply: 0,
        }
    }
}

enum Output {
    None,
    /// Every row, in order, from one batch (no copy).
    Whole(Bytes),
    /// `rows · output_dim` f32 being filled in from several batches.
    Assembling(Vec<u8>),
}

impl Pending {
    fn rows(&self) -> usize {
        self.input.rows()
    }

    /// Takes a part's output rows (`data`: `items.len()` rows of `dim`).
    /// Returns false when they do not fit what came before (a worker bug).
    fn absorb(&mut self, items: &[u32], data: Bytes, dim: usize) -> bool {
        let n = self.rows();
        if matches!(self.output, Output::None) {
            self.output_dim = dim;
        } else if dim != self.output_dim {
            return false;
        }
        let row_bytes = dim * 4;
        if items.len() == n && self.remaining == n {
            self.output = Output::Whole(data);
        } else {
            if let Output::None = self.output {
                self.output = Output::Assembling(vec![0; n * row_bytes]);
            }
            let Output::Assembling(buf) = &mut self.output else {
                return false; // a whole output already came: rows twice
            };
            for (k, &i) in items.iter().enumerate() {
                let i = i as usize;
                buf[i * row_bytes..(i + 1) * row_bytes]
                    .copy_from_slice(&data[k * row_bytes..(k + 1) * row_bytes]);
            }
        }
        self.remaining -= items.len();
        true
    }
}

struct Inflight {
    device: DeviceId,
    attempt: u32,
    batch: Arc<Batch>,
    /// When its current attempt was sent ([`mono_ns`]).
    dispatched_ns: u64,
}

pub struct BatcherState {
    scheduler: Scheduler,
    models: Vec<ModelSlot>,
    device_labels: Vec<String>,
    device_kinds: Vec<DeviceKind>,
    routes: Vec<Arc<DeviceRoute>>,
    /// Queue depths as last published (published again only when they change).
    published: Vec<u64>,
    published_eager: u64,
    pending: HashMap<RequestId, Pending>,
    inflight: HashMap<BatchId, Inflight>,
    next_request: RequestId,
    next_batch: BatchId,
    timer_at: Option<Instant>,
    drain_waiters: Vec<RpcReplyPort<()>>,
    max_attempts: u32,
    metrics: Arc<Metrics>,
    /// This turn's observations, recorded into `metrics` at its end.
    ledger: Ledger,
    /// This turn's replies, sent once `ledger` is recorded: a client that
    /// has its reply finds it counted in the stats.
    outbox: Vec<(oneshot::Sender<Reply>, Reply)>,
    submissions: Arc<SubmitQueue>,
    shard: usize,
    load: Arc<ShardLoad>,
}

pub struct BatcherActor;

impl Actor for BatcherActor {
    type Msg = BatcherMsg;
    type State = BatcherState;
    type Arguments = BatcherArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: BatcherArgs,
    ) -> Result<BatcherState, ActorProcessingErr> {
        let grids = args.models.iter().map(|m| m.grid.clone()).collect();
        if args.routes.len() != args.devices.len() {
            return Err(format!(
                "{} device routes for {} devices",
                args.routes.len(),
                args.devices.len()
            )
            .into());
        }
        let mut scheduler = Scheduler::new(args.config, grids);
        for (kind, _) in &args.devices {
            scheduler.add_device(*kind);
        }
        Ok(BatcherState {
            scheduler,
            device_labels: args.devices.iter().map(|(_, l)| l.clone()).collect(),
            device_kinds: args.devices.iter().map(|(k, _)| *k).collect(),
            routes: args.routes,
            published: vec![u64::MAX; args.models.len()],
            published_eager: u64::MAX,
            models: args.models,
            pending: HashMap::new(),
            inflight: HashMap::new(),
            next_request: 1,
            next_batch: first_batch_id(args.shard),
            timer_at: None,
            drain_waiters: Vec::new(),
            max_attempts: args.max_attempts,
            metrics: args.metrics,
            ledger: Ledger::default(),
            outbox: Vec::new(),
            submissions: args.submissions,
            shard: args.shard,
            load: args.load,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut BatcherState,
    ) -> Result<(), ActorProcessingErr> {
        // Submissions queued after the last pass get their reply channels
        // dropped, which their handlers answer ("the request was dropped").
        drop(state.submissions.take());
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: BatcherMsg,
        state: &mut BatcherState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        let began = crate::clock::mono_ns();
        match msg {
            BatcherMsg::SubmitQueued => {
                for sub in state.submissions.take() {
                    state
                        .metrics
                        .stages
                        .batcher_mailbox
                        .add_since(sub.stamps.submitted_ns);
                    state.submit(sub);
                }
            }
            BatcherMsg::Tick => {
                if state.timer_at.is_some_and(|t| t <= now) {
                    state.timer_at = None;
                }
            }
            BatcherMsg::DeviceUp { device } => {
                tracing::info!(device = %state.device_labels[device], "device ready");
                state.scheduler.set_healthy(device, true);
            }
            BatcherMsg::DeviceDown { device, reason } => state.device_down(device, &reason),
            BatcherMsg::Report { device, report } => state.report(device, report),
            BatcherMsg::Drain(port) => {
                state.scheduler.start_draining();
                state.drain_waiters.push(port);
            }
            BatcherMsg::Abort(port) => {
                let n = state.abort_all();
                let _ = port.send(n);
            }
            BatcherMsg::Outstanding(port) => {
                let _ = port.send(state.pending.len());
            }
            BatcherMsg::SetDrained { device, drained } => {
                state.scheduler.set_drained(device, drained);
            }
            BatcherMsg::Reconfigure {
                config,
                max_attempts,
                grids,
                port,
            } => {
                state.reconfigure(config, max_attempts, grids);
                let _ = port.send(());
            }
            BatcherMsg::CutGrid { model, dropped } => state.cut_grid(model, &dropped),
        }
        state.run_actions(Instant::now());
        state.arm_timer(&myself);
        state.publish_depths();
        state.flush();
        if state.pending.is_empty() && state.scheduler.is_draining() {
            for port in state.drain_waiters.drain(..) {
                let _ = port.send(());
            }
        }
        state.metrics.stages.batcher.add_since(began);
        Ok(())
    }
}

/// The rows of `items` (increasing indices) of `input`.
fn select_rows(input: &BatchRows, items: &[u32]) -> BatchRows {
    match input {
        BatchRows::Features { features, data } => BatchRows::Features {
            features: *features,
            data: items
                .iter()
                .flat_map(|&i| {
                    let i = i as usize;
                    data[i * features..(i + 1) * features].iter().copied()
                })
                .collect(),
        },
        BatchRows::Tokens(seqs) => {
            BatchRows::Tokens(items.iter().map(|&i| seqs[i as usize].clone()).collect())
        }
    }
}

/// Tokens of each row, as the scheduler counts them (1 per feature row).
fn item_lens(input: &BatchRows) -> Vec<u32> {
    match input {
        BatchRows::Features { .. } => vec![1; input.rows()],
        BatchRows::Tokens(seqs) => seqs.iter().map(|s| s.len() as u32).collect(),
    }
}

impl BatcherState {
    fn submit(&mut self, sub: Submission) {
        let model = sub.model;
        let id = self.next_request;
        self.next_request += 1;
        if sub.input.rows() == 0 {
            return self.reject(sub, ErrorCode::BadRequest, "the request has no rows".into());
        }
        if sub.deadline.is_some_and(|d| d <= Instant::now()) {
            return self.reject(
                sub,
                ErrorCode::DeadlineExceeded,
                "the deadline had passed on arrival".into(),
            );
        }
        let queued = QueuedRequest {
            id,
            model,
            lens: item_lens(&sub.input),
            priority: sub.priority,
            arrived: sub.received,
            deadline: sub.deadline,
        };
        let lens = queued.lens.clone();
        let load = load_of(&sub.input);
        match self.scheduler.enqueue(queued) {
            Ok(placement) => {
                self.ledger.accepted(model, &lens);
                if placement.eager > 0 {
                    self.ledger.push(Observation::Eager {
                        model,
                        reason: EagerReason::SeqTooLong,
                    });
                }
                let rows = sub.input.rows();
                self.pending.insert(
                    id,
                    Pending {
                        model,
                        load,
                        client_id: sub.client_id,
                        input: Arc::new(sub.input),
                        received: sub.received,
                        dispatched: None,
                        form: sub.output,
                        reply: sub.reply,
                        remaining: rows,
                        output: Output::None,
                        output_dim: 0,
                        compute_us: 0,
                        batches: 0,
                        shown: None,
                        stamps: sub.stamps,
                        last: BatchStamps::default(),
                    },
                );
            }
            Err(Rejection::Overloaded { limit }) => {
                let name = &self.models[model].name;
                let msg = format!("model {name} has {limit} requests queued; retry later");
                self.reject(sub, ErrorCode::Overloaded, msg)
            }
            Err(Rejection::TooLong { item, len, largest }) => {
                let msg = format!(
                    "item {item} has {len} tokens, more than the largest bucket {largest} holds, and no eager worker is configured"
                );
                self.reject(sub, ErrorCode::TooLong, msg)
            }
            Err(Rejection::Draining) => self.reject(
                sub,
                ErrorCode::Unavailable,
                "the daemon is shutting down".into(),
            ),
        }
    }

    fn reject(&mut self, sub: Submission, code: ErrorCode, message: String) {
        self.load.done(load_of(&sub.input));
        self.ledger.push(Observation::ModelError {
            model: sub.model,
            code,
        });
        self.outbox
            .push((sub.reply, Reply::error(sub.client_id, code, message)));
    }

    /// Answers a held request with an error (once; later calls do nothing).
    fn fail(&mut self, id: RequestId, code: ErrorCode, message: &str) {
        self.scheduler.finish(id);
        if let Some(p) = self.pending.remove(&id) {
            self.load.done(p.load);
            self.ledger.push(Observation::ModelError {
                model: p.model,
                code,
            });
            self.outbox
                .push((p.reply, Reply::error(p.client_id, code, message)));
        }
    }

    fn run_actions(&mut self, now: Instant) {
        for action in self.scheduler.poll(now) {
            match action {
                Action::Expire {
                    request,
                    dispatched,
                } => self.fail(
                    request,
                    ErrorCode::DeadlineExceeded,
                    if dispatched {
                        "the deadline passed while the request was running"
                    } else {
                        "the deadline passed while the request was queued"
                    },
                ),
                Action::Dispatch { device, plan } => self.dispatch(device, plan, now),
                Action::Redispatch { device, batch } => {
                    let live = self.inflight.get(&batch).is_some_and(|f| {
                        f.batch
                            .parts
                            .iter()
                            .any(|p| self.pending.contains_key(&p.request))
                    });
                    if live {
                        let f = self.inflight.get_mut(&batch).expect("present");
                        f.device = device;
                        f.attempt += 1;
                        f.dispatched_ns = mono_ns();
                        let (b, attempt) = (f.batch.clone(), f.attempt);
                        self.ledger.push(Observation::Retried);
                        self.send_to_device(device, b, attempt);
                    } else {
                        // Its requests were answered meanwhile (expired, aborted).
                        self.inflight.remove(&batch);
                        self.scheduler.completed(device);
                    }
                }
            }
        }
    }

    fn dispatch(&mut self, device: DeviceId, plan: BatchPlan, now: Instant) {
        let id = self.next_batch;
        self.next_batch += 1;
        let mut rows = 0;
        let mut tokens = 0;
        let parts: Vec<BatchPart> = plan
            .parts
            .into_iter()
            .filter_map(|part| {
                let p = self.pending.get_mut(&part.request)?;
                p.dispatched.get_or_insert(now);
                let rows_of = if part.items.len() == p.input.rows() {
                    p.input.clone()
                } else {
                    Arc::new(select_rows(&p.input, &part.items))
                };
                rows += rows_of.rows();
                tokens += rows_of.tokens();
                Some(BatchPart {
                    request: part.request,
                    items: part.items,
                    rows: rows_of,
                })
            })
            .collect();
        debug_assert_eq!(rows, plan.rows, "every planned request is pending");
        let batch = Arc::new(Batch {
            id,
            model: plan.model,
            bucket: plan.bucket,
            parts,
            rows,
            tokens,
        });
        self.inflight.insert(
            id,
            Inflight {
                device,
                attempt: 1,
                batch: batch.clone(),
                dispatched_ns: mono_ns(),
            },
        );
        self.send_to_device(device, batch, 1);
    }

    /// Through the device's shared-memory ring when it takes the batch, else
    /// through its device actor (and the worker's socket).
    fn send_to_device(&mut self, device: DeviceId, batch: Arc<Batch>, attempt: u32) {
        if !self.routes[device].send(batch, attempt) {
            tracing::error!(device, "dispatch to a device with no actor");
        }
    }

    /// What became of a batch, whichever transport carried it. Only the
    /// attempt now in flight on that device counts: a report from an
    /// attempt that was re-dispatched (its worker died) or from a device
    /// that no longer holds the batch is stale and changes nothing.
    fn report(&mut self, device: DeviceId, report: BatchReport) {
        let back_ns = mono_ns();
        let current = self
            .inflight
            .get(&report.batch)
            .is_some_and(|f| f.device == device && f.attempt == report.attempt);
        if !current {
            return;
        }
        let f = self.inflight.remove(&report.batch).expect("present");
        self.scheduler.completed(device);
        match report.outcome {
            BatchOutcome::Done(output) => self.batch_done(device, f, output, back_ns),
            BatchOutcome::Failed(error) => self.batch_failed(device, f, &error),
        }
    }

    fn batch_done(&mut self, device: DeviceId, f: Inflight, output: BatchOutput, back_ns: u64) {
        let BatchOutput {
            data: output,
            output_dim,
            compute_us,
            started_ns,
            finished_ns,
            replayed: _,
        } = output;
        let stamps = BatchStamps {
            dispatched_ns: f.dispatched_ns,
            started_ns,
            finished_ns,
            back_ns,
        };
        let b = &f.batch;
        let row_bytes = output_dim * 4;
        if output.len() != b.rows * row_bytes {
            let msg = format!(
                "worker returned {} bytes for {} rows of {output_dim}",
                output.len(),
                b.rows
            );
            for part in &b.parts {
                self.fail(part.request, ErrorCode::Internal, &msg);
            }
            return;
        }
        match b.bucket {
            Some(bucket) => self.ledger.push(Observation::BucketBatch {
                model: b.model,
                bucket,
                parts: b.parts.len() as u64,
                rows: b.rows as u64,
                tokens: b.tokens as u64,
            }),
            None => self.ledger.push(Observation::EagerBatch {
                rows: b.rows as u64,
                tokens: b.tokens as u64,
            }),
        }
        let shape = Shape::of(b.bucket, device);
        let mut offset = 0;
        let mut finished = Vec::new();
        for part in &b.parts {
            let n = part.items.len();
            let slice = output.slice(offset * row_bytes..(offset + n) * row_bytes);
            offset += n;
            // Gone: answered already (deadline, failure elsewhere, abort).
            let Some(p) = self.pending.get_mut(&part.request) else {
                continue;
            };
            if !p.absorb(&part.items, slice, output_dim) {
                finished.push((part.request, false));
                continue;
            }
            p.compute_us += compute_us;
            p.batches += 1;
            p.last = stamps;
            if p.shown.as_ref().is_none_or(|s| shape > *s) {
                p.shown = Some(shape.clone());
            }
            if p.remaining == 0 {
                finished.push((part.request, true));
            }
        }
        for (id, ok) in finished {
            if ok {
                self.answer(id);
            } else {
                self.fail(
                    id,
                    ErrorCode::Internal,
                    "the worker returned rows that do not match the request's others",
                );
            }
        }
    }

    /// Sends the assembled reply of a request whose rows are all back.
    fn answer(&mut self, id: RequestId) {
        // An overflow (f16 past 65504, say) gives NaN or infinity: an error
        // for the request, never an embedding.
        let bad_row = self.pending.get(&id).and_then(|p| match &p.output {
            Output::Whole(b) => non_finite_row(b, p.output_dim),
            Output::Assembling(v) => non_finite_row(v, p.output_dim),
            Output::None => None,
        });
        if let Some(row) = bad_row {
            let name = self
                .pending
                .get(&id)
                .map_or("", |p| &self.models[p.model].name);
            let message = format!(
                "model {name} produced a non-finite value (NaN or infinity) for item {row}: an overflow in its arithmetic; serving it in bf16 or f32 instead of f16 avoids one"
            );
            self.fail(id, ErrorCode::Internal, &message);
            return;
        }
        self.scheduler.finish(id);
        let Some(p) = self.pending.remove(&id) else {
            return;
        };
        self.load.done(p.load);
        let rows = p.rows();
        let hops = p.hops();
        let data = match p.output {
            Output::Whole(b) => b,
            Output::Assembling(v) => Bytes::from(v),
            Output::None => Bytes::new(),
        };
        let tensor = p.form.apply(rows, p.output_dim, data);
        let shown = p.shown.expect("a finished request ran somewhere");
        let (bucket, device) = (
            shown.bucket.map_or("eager".to_string(), |b| b.to_string()),
            self.device_labels[shown.device].clone(),
        );
        let now = Instant::now();
        let queued_us = p
            .dispatched
            .map_or(0, |d| d.duration_since(p.received).as_micros() as u64);
        let total_us = now.duration_since(p.received).as_micros() as u64;
        self.ledger.push(Observation::Reply {
            model: p.model,
            bucket: shown.bucket,
            total_us,
            queued_us,
            compute_us: p.compute_us,
            batches: p.batches,
        });
        let reply = Reply::Ok {
            id: p.client_id,
            output: tensor,
            sparse: p.form.sparse,
            bucket,
            device,
            queued_us,
            compute_us: p.compute_us,
            total_us,
            batches: p.batches,
            hops,
        };
        self.outbox.push((p.reply, reply));
    }

    fn batch_failed(&mut self, device: DeviceId, f: Inflight, error: &WorkerError) {
        let batch = f.batch.id;
        tracing::error!(batch, device = %self.device_labels[device], "batch failed: {error}");
        let msg = format!("the worker failed to run the batch: {error}");
        for part in &f.batch.parts {
            self.fail(part.request, error.code(), &msg);
        }
    }

    fn device_down(&mut self, device: DeviceId, reason: &str) {
        let held = self
            .inflight
            .values()
            .filter(|f| f.device == device)
            .count();
        if self.scheduler.is_draining() && held == 0 {
            // A clean stop (daemon shutdown): nothing to say.
            tracing::debug!(device = %self.device_labels[device], "device down: {reason}");
        } else if held == 0 {
            tracing::info!(device = %self.device_labels[device], "device down: {reason}");
        } else {
            tracing::warn!(
                device = %self.device_labels[device],
                batches = held,
                "device down: {reason}; re-dispatching its batches"
            );
        }
        self.scheduler.set_healthy(device, false);
        let mut lost: Vec<BatchId> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.device == device)
            .map(|(id, _)| *id)
            .collect();
        lost.sort_unstable();
        for id in lost {
            let f = self.inflight.get_mut(&id).expect("present");
            // Park it on no device until the scheduler re-dispatches it.
            f.device = usize::MAX;
            if f.attempt >= self.max_attempts {
                let f = self.inflight.remove(&id).expect("present");
                let msg = format!(
                    "the batch was lost with its worker {} times (last: {reason})",
                    f.attempt
                );
                for part in &f.batch.parts {
                    self.fail(part.request, ErrorCode::Internal, &msg);
                }
            } else {
                self.scheduler.retry(id, self.device_kinds[device]);
            }
        }
    }

    /// A reload: new limits, and new grids whose queued items move lanes.
    fn reconfigure(
        &mut self,
        config: SchedulerConfig,
        max_attempts: u32,
        grids: Vec<(usize, Grid)>,
    ) {
        self.scheduler.set_config(config);
        self.max_attempts = max_attempts;
        self.set_grids(grids);
    }

    /// A device could not hold `dropped`'s graphs: the model's grid loses
    /// them (a grid with nothing left stays, its batches running eagerly).
    fn cut_grid(&mut self, model: usize, dropped: &[Bucket]) {
        let Some(m) = self.models.get(model) else {
            return;
        };
        if !dropped.iter().any(|&b| m.grid.contains(b)) {
            return;
        }
        match m.grid.without(dropped) {
            Some(grid) => self.set_grids(vec![(model, grid)]),
            None => {
                tracing::warn!(model = %m.name, "a device's memory holds none of the model's graphs: its batches run eagerly")
            }
        }
    }

    /// Puts new grids in force (queued items move to the new lanes).
    fn set_grids(&mut self, grids: Vec<(usize, Grid)>) {
        for (model, grid) in grids {
            let largest = {
                let failed = self.scheduler.set_grid(model, grid.clone());
                let largest = self.scheduler.largest(model);
                for id in failed {
                    self.fail(
                        id,
                        ErrorCode::TooLong,
                        &format!(
                            "after a grid change (a reload, or a device whose memory holds fewer graphs), an item is longer than the largest bucket {largest} holds, and no eager worker is configured"
                        ),
                    );
                }
                largest
            };
            tracing::info!(model = %self.models[model].name, grid = %grid.describe(), %largest, "new grid in force");
            self.models[model].grid = grid;
        }
    }

    /// Answers everything still held with `unavailable`.
    fn abort_all(&mut self) -> usize {
        // Queued submissions are accepted first, so they are answered too.
        for sub in self.submissions.take() {
            self.submit(sub);
        }
        let ids: Vec<RequestId> = self.pending.keys().copied().collect();
        for id in &ids {
            self.fail(
                *id,
                ErrorCode::Unavailable,
                "the daemon shut down before the request could run",
            );
        }
        self.inflight.clear();
        ids.len()
    }

    fn arm_timer(&mut self, myself: &ActorRef<BatcherMsg>) {
        let now = Instant::now();
        let Some(at) = self.scheduler.next_wakeup(now) else {
            return;
        };
        if self.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        self.timer_at = Some(at);
        let delay = at.saturating_duration_since(now) + Duration::from_micros(1);
        myself.send_after(delay, || BatcherMsg::Tick);
    }

    /// Records this turn's observations, then sends its replies.
    fn flush(&mut self) {
        let models = &self.models;
        self.metrics
            .record(&mut self.ledger, |i| models[i].name.as_str());
        for (port, reply) in self.outbox.drain(..) {
            let _ = port.send(reply);
        }
    }

    /// Publishes the queue depths that changed since the last message.
    fn publish_depths(&mut self) {
        for (i, m) in self.models.iter().enumerate() {
            let depth = self.scheduler.queued_for_model(i) as u64;
            if self.published[i] != depth {
                self.published[i] = depth;
                self.metrics.set_queue_depth(self.shard, &m.name, depth);
            }
        }
        let eager = self.scheduler.queued_eager() as u64;
        if self.published_eager != eager {
            self.published_eager = eager;
            self.metrics.set_eager_queue_depth(self.shard, eager);
        }
    }
}
