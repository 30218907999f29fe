//! The batcher actor: owns every accepted request until it is answered.
//!
//! * [`queue`] — the scheduling state machine (queues, buckets, dispatch
//!   rules, deadlines, retries), pure and unit-tested.
//! * This module — the actor around it: it accepts [`Submission`]s from the
//!   frontend, turns the scheduler's actions into [`Batch`]es sent to device
//!   actors, splits finished batches into replies, and re-dispatches the
//!   batches of a device whose worker died. It holds each request's reply
//!   channel, so every accepted request gets exactly one reply.
//!
//! Handlers only move data between maps and channels; nothing here blocks.
//! [`tests`](self) drives the actor against fake device actors: outputs split
//! by request, stale attempts ignored, re-dispatch after a worker dies,
//! failure after `max_attempts`, abort answering everything.

pub mod queue;
#[cfg(test)]
mod tests;

use super::messages::{Batch, BatchOutput, BatcherMsg, DeviceMsg, Submission};
use super::metrics::{EagerReason, Metrics};
use crate::bucket::BucketGrid;
use crate::model::BatchRows;
use crate::protocol::{ErrorCode, Reply};
use crate::tensor::{DType, HostTensor};
use crate::worker::link::WorkerError;
use queue::{
    Action, BatchId, BatchPlan, DeviceId, DeviceKind, QueuedRequest, Rejection, RequestId,
    Scheduler, SchedulerConfig,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What the batcher needs to know about each model.
#[derive(Clone, Debug)]
pub struct ModelSlot {
    pub name: String,
    pub grid: BucketGrid,
}

pub struct BatcherArgs {
    pub models: Vec<ModelSlot>,
    /// One entry per device slot: its kind and label (e.g. "cuda:0").
    pub devices: Vec<(DeviceKind, String)>,
    pub config: SchedulerConfig,
    pub max_attempts: u32,
    pub metrics: Arc<Metrics>,
}

struct Pending {
    client_id: u64,
    input: Arc<BatchRows>,
    received: Instant,
    dispatched: Option<Instant>,
    output_dtype: DType,
    reply: oneshot::Sender<Reply>,
}

struct Inflight {
    device: DeviceId,
    attempt: u32,
    batch: Arc<Batch>,
}

pub struct BatcherState {
    scheduler: Scheduler,
    models: Vec<ModelSlot>,
    device_labels: Vec<String>,
    device_kinds: Vec<DeviceKind>,
    device_refs: Vec<Option<ActorRef<DeviceMsg>>>,
    pending: HashMap<RequestId, Pending>,
    inflight: HashMap<BatchId, Inflight>,
    next_request: RequestId,
    next_batch: BatchId,
    timer_at: Option<Instant>,
    drain_waiters: Vec<RpcReplyPort<()>>,
    max_attempts: u32,
    metrics: Arc<Metrics>,
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
        let mut scheduler = Scheduler::new(args.config, grids);
        for (kind, _) in &args.devices {
            scheduler.add_device(*kind);
        }
        Ok(BatcherState {
            scheduler,
            device_labels: args.devices.iter().map(|(_, l)| l.clone()).collect(),
            device_kinds: args.devices.iter().map(|(k, _)| *k).collect(),
            device_refs: vec![None; args.devices.len()],
            models: args.models,
            pending: HashMap::new(),
            inflight: HashMap::new(),
            next_request: 1,
            next_batch: 1,
            timer_at: None,
            drain_waiters: Vec::new(),
            max_attempts: args.max_attempts,
            metrics: args.metrics,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: BatcherMsg,
        state: &mut BatcherState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match msg {
            BatcherMsg::Submit(sub) => state.submit(sub),
            BatcherMsg::Tick => {
                if state.timer_at.is_some_and(|t| t <= now) {
                    state.timer_at = None;
                }
            }
            BatcherMsg::AttachDevice { device, actor } => state.device_refs[device] = Some(actor),
            BatcherMsg::DeviceUp { device } => {
                tracing::info!(device = %state.device_labels[device], "device ready");
                state.scheduler.set_healthy(device, true);
            }
            BatcherMsg::DeviceDown { device, reason } => state.device_down(device, &reason),
            BatcherMsg::BatchDone {
                device,
                batch,
                attempt,
                output,
            } => state.batch_done(device, batch, attempt, output),
            BatcherMsg::BatchFailed {
                device,
                batch,
                attempt,
                error,
            } => state.batch_failed(device, batch, attempt, &error),
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
        }
        state.run_actions(Instant::now());
        state.arm_timer(&myself);
        state.publish_depths();
        if state.pending.is_empty() && state.scheduler.is_draining() {
            for port in state.drain_waiters.drain(..) {
                let _ = port.send(());
            }
        }
        Ok(())
    }
}

impl BatcherState {
    fn submit(&mut self, sub: Submission) {
        let model = sub.model;
        let slot = &self.models[model];
        let id = self.next_request;
        self.next_request += 1;
        let (rows, len) = (sub.input.rows(), sub.input.max_len());
        let queued = QueuedRequest {
            id,
            model,
            rows,
            len,
            priority: sub.priority,
            arrived: sub.received,
            deadline: sub.deadline,
        };
        if sub.deadline.is_some_and(|d| d <= Instant::now()) {
            return self.reject(
                sub,
                ErrorCode::DeadlineExceeded,
                "the deadline had passed on arrival".into(),
            );
        }
        match self.scheduler.enqueue(queued) {
            Ok(placement) => {
                self.metrics.request_accepted();
                if placement == queue::Placement::Eager {
                    let reason = if rows > slot.grid.max_batch() {
                        EagerReason::BatchTooLarge
                    } else {
                        EagerReason::SeqTooLong
                    };
                    self.metrics.eager_request(&slot.name, reason);
                }
                self.pending.insert(
                    id,
                    Pending {
                        client_id: sub.client_id,
                        input: Arc::new(sub.input),
                        received: sub.received,
                        dispatched: None,
                        output_dtype: sub.output_dtype,
                        reply: sub.reply,
                    },
                );
            }
            Err(Rejection::Overloaded { limit }) => {
                let msg = format!(
                    "model {} has {limit} requests queued; retry later",
                    slot.name
                );
                self.reject(sub, ErrorCode::Overloaded, msg)
            }
            Err(Rejection::TooLarge { rows, len, largest }) => {
                let msg = format!(
                    "{rows} rows of {len} tokens exceed the largest bucket {largest} and no eager worker is configured"
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

    fn reject(&self, sub: Submission, code: ErrorCode, message: String) {
        self.metrics.error(code);
        let _ = sub.reply.send(Reply::error(sub.client_id, code, message));
    }

    /// Answers a held request with an error.
    fn fail(&mut self, id: RequestId, code: ErrorCode, message: &str) {
        if let Some(p) = self.pending.remove(&id) {
            self.metrics.error(code);
            let _ = p.reply.send(Reply::error(p.client_id, code, message));
        }
    }

    fn run_actions(&mut self, now: Instant) {
        for action in self.scheduler.poll(now) {
            match action {
                Action::Expire(id) => self.fail(
                    id,
                    ErrorCode::DeadlineExceeded,
                    "the deadline passed while the request was queued",
                ),
                Action::Dispatch { device, plan } => self.dispatch(device, plan, now),
                Action::Redispatch { device, batch } => {
                    if let Some(f) = self.inflight.get_mut(&batch) {
                        f.device = device;
                        f.attempt += 1;
                        let (b, attempt) = (f.batch.clone(), f.attempt);
                        self.metrics.batch_retried();
                        self.send_to_device(device, b, attempt);
                    } else {
                        // Its requests were answered meanwhile (e.g. aborted).
                        self.scheduler.completed(device);
                    }
                }
            }
        }
    }

    fn dispatch(&mut self, device: DeviceId, plan: BatchPlan, now: Instant) {
        let id = self.next_batch;
        self.next_batch += 1;
        let parts = plan
            .requests
            .iter()
            .filter_map(|rid| {
                let p = self.pending.get_mut(rid)?;
                p.dispatched = Some(now);
                Some((*rid, p.input.clone()))
            })
            .collect();
        let batch = Arc::new(Batch {
            id,
            model: plan.model,
            bucket: plan.bucket,
            parts,
            rows: plan.rows,
        });
        self.inflight.insert(
            id,
            Inflight {
                device,
                attempt: 1,
                batch: batch.clone(),
            },
        );
        self.send_to_device(device, batch, 1);
    }

    fn send_to_device(&mut self, device: DeviceId, batch: Arc<Batch>, attempt: u32) {
        match &self.device_refs[device] {
            Some(actor) => {
                // A send to a stopped actor fails; the DeviceDown that follows re-dispatches.
                let _ = actor.cast(DeviceMsg::Run { batch, attempt });
            }
            None => tracing::error!(device, "dispatch to a device with no actor"),
        }
    }

    fn batch_done(&mut self, device: DeviceId, batch: BatchId, attempt: u32, output: BatchOutput) {
        let BatchOutput {
            data: output,
            output_dim,
            compute_us,
        } = output;
        let Some(f) = self.inflight.get(&batch) else {
            return;
        };
        if f.device != device || f.attempt != attempt {
            return; // a stale report from an attempt that was already re-dispatched
        }
        let f = self.inflight.remove(&batch).expect("present");
        self.scheduler.completed(device);
        let b = &f.batch;
        let model_name = self.models[b.model].name.clone();
        let row_bytes = output_dim * 4;
        if output.len() != b.rows * row_bytes {
            let msg = format!(
                "worker returned {} bytes for {} rows of {output_dim}",
                output.len(),
                b.rows
            );
            for (rid, _) in &b.parts {
                self.fail(*rid, ErrorCode::Internal, &msg);
            }
            return;
        }
        if let Some(bucket) = b.bucket {
            let tokens: usize = b.parts.iter().map(|(_, i)| i.tokens()).sum();
            self.metrics.bucket_batch(
                &model_name,
                bucket,
                b.parts.len() as u64,
                b.rows as u64,
                tokens as u64,
            );
        }
        let bucket_label = b.bucket.map_or("eager".to_string(), |bk| bk.to_string());
        let device_label = self.device_labels[device].clone();
        let now = Instant::now();
        let mut offset = 0;
        for (rid, input) in &b.parts {
            let rows = input.rows();
            let slice = output.slice(offset * row_bytes..(offset + rows) * row_bytes);
            offset += rows;
            let Some(p) = self.pending.remove(rid) else {
                continue;
            };
            let tensor = HostTensor {
                dtype: DType::F32,
                shape: vec![rows, output_dim],
                data: slice,
            };
            let tensor = match p.output_dtype {
                DType::F32 => tensor,
                other => tensor.convert_float(other).unwrap_or(tensor),
            };
            let queued_us = p
                .dispatched
                .map_or(0, |d| d.duration_since(p.received).as_micros() as u64);
            let total_us = now.duration_since(p.received).as_micros() as u64;
            self.metrics.reply_ok(total_us, queued_us, compute_us);
            let _ = p.reply.send(Reply::Ok {
                id: p.client_id,
                output: tensor,
                bucket: bucket_label.clone(),
                device: device_label.clone(),
                queued_us,
                compute_us,
                total_us,
            });
        }
    }

    fn batch_failed(
        &mut self,
        device: DeviceId,
        batch: BatchId,
        attempt: u32,
        error: &WorkerError,
    ) {
        let Some(f) = self.inflight.get(&batch) else {
            return;
        };
        if f.device != device || f.attempt != attempt {
            return;
        }
        let f = self.inflight.remove(&batch).expect("present");
        self.scheduler.completed(device);
        tracing::error!(batch, device = %self.device_labels[device], "batch failed: {error}");
        let msg = format!("the worker failed to run the batch: {error}");
        for (rid, _) in &f.batch.parts {
            self.fail(*rid, error.code(), &msg);
        }
    }

    fn device_down(&mut self, device: DeviceId, reason: &str) {
        tracing::warn!(device = %self.device_labels[device], "device down: {reason}");
        self.scheduler.set_healthy(device, false);
        let lost: Vec<BatchId> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.device == device)
            .map(|(id, _)| *id)
            .collect();
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
                for (rid, _) in &f.batch.parts {
                    self.fail(*rid, ErrorCode::Internal, &msg);
                }
            } else {
                self.scheduler.retry(id, self.device_kinds[device]);
            }
        }
    }

    /// Answers everything still held with `unavailable`.
    fn abort_all(&mut self) -> usize {
        let ids: Vec<RequestId> = self.pending.keys().copied().collect();
        for id in &ids {
            self.scheduler.remove(*id);
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
        let Some(at) = self.scheduler.next_wakeup() else {
            return;
        };
        if self.timer_at.is_some_and(|t| t <= at) {
            return;
        }
        self.timer_at = Some(at);
        let delay = at.saturating_duration_since(Instant::now()) + Duration::from_micros(1);
        myself.send_after(delay, || BatcherMsg::Tick);
    }

    fn publish_depths(&self) {
        for (i, m) in self.models.iter().enumerate() {
            self.metrics
                .set_queue_depth(&m.name, self.scheduler.queued_for_model(i) as u64);
        }
        self.metrics
            .set_eager_queue_depth(self.scheduler.queued_eager() as u64);
    }
}
