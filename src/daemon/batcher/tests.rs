//! The batcher actor against fake devices: real actor, real messages; the
//! device side is a test actor that hands every `Run` to the test, which
//! answers as a worker would (or does not). A device can also have a real
//! shared-memory ring on its route ([`TestRing`]), whose worker end the test
//! plays with the link's real messages.

use super::*;
use crate::bucket::{BucketGrid, TokenGrid};
use crate::daemon::fast_link::{self, FastLink};
use crate::daemon::messages::{BatchOutput, DeviceMsg, DeviceStatus};
use crate::daemon::report::{Reporter, Via};
use crate::daemon::watchdog::Watchdog;
use crate::protocol::Reply;
use crate::worker::link::{FromWorker, ToWorker};
use crate::worker::shm::{self, Ring, RingSpec, SlotRows};
use ractor::ActorRef;
use std::os::fd::{AsRawFd, OwnedFd};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

/// A device actor that forwards every batch it is asked to run.
struct FakeDevice;

impl Actor for FakeDevice {
    type Msg = DeviceMsg;
    type State = mpsc::UnboundedSender<(Arc<Batch>, u32)>;
    type Arguments = mpsc::UnboundedSender<(Arc<Batch>, u32)>;

    async fn pre_start(
        &self,
        _myself: ActorRef<DeviceMsg>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle(
        &self,
        _myself: ActorRef<DeviceMsg>,
        msg: DeviceMsg,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let DeviceMsg::Run { batch, attempt } = msg {
            let _ = tx.send((batch, attempt));
        }
        Ok(())
    }
}

struct Harness {
    batcher: ActorRef<BatcherMsg>,
    submissions: Arc<SubmitQueue>,
    runs: Vec<mpsc::UnboundedReceiver<(Arc<Batch>, u32)>>,
    routes: Vec<Arc<DeviceRoute>>,
    metrics: Arc<Metrics>,
}

/// Model 0, "m": MLP-like (batch buckets 1, 2, 4; no seq axis; 2 features).
const MLP: usize = 0;
/// Model 1, "enc": packed (budgets 8, 16, 32 tokens; at most 4 sequences).
const PACKED: usize = 1;
/// Model 2, "pad": padded text (batch 1, 2, 4 × seq 8, 16).
const PADDED: usize = 2;

/// A batcher over the three models above, `devices` fake graph devices and
/// `eager` fake eager devices, all up (graph devices first).
async fn harness_with(devices: usize, eager: usize, max_attempts: u32) -> Harness {
    harness_waiting(devices, eager, max_attempts, Duration::from_micros(100)).await
}

/// The same with a batching window of `max_wait` (long enough, where a test
/// needs requests submitted one after the other to share a batch).
async fn harness_waiting(
    devices: usize,
    eager: usize,
    max_attempts: u32,
    max_wait: Duration,
) -> Harness {
    let metrics = Arc::new(Metrics::new());
    let submissions = Arc::new(SubmitQueue::default());
    let mut slots: Vec<(DeviceKind, String)> = (0..devices)
        .map(|i| (DeviceKind::Graph, format!("fake:{i}")))
        .collect();
    slots.extend((0..eager).map(|i| (DeviceKind::Eager, format!("eager:{i}"))));
    let routes: Vec<Arc<DeviceRoute>> = slots.iter().map(|_| Arc::default()).collect();
    let (batcher, _) = Actor::spawn(
        None,
        BatcherActor,
        BatcherArgs {
            models: vec![
                ModelSlot {
                    name: "m".into(),
                    grid: Grid::Padded(BucketGrid::new(vec![1, 2, 4], vec![1])),
                },
                ModelSlot {
                    name: "enc".into(),
                    grid: Grid::Packed(TokenGrid::new(vec![8, 16, 32], 4)),
                },
                ModelSlot {
                    name: "pad".into(),
                    grid: Grid::Padded(BucketGrid::new(vec![1, 2, 4], vec![8, 16])),
                },
            ],
            devices: slots,
            routes: routes.clone(),
            config: SchedulerConfig {
                max_wait,
                max_queue: 64,
                max_inflight: 2,
                eager_max_queue: 4,
            },
            max_attempts,
            metrics: metrics.clone(),
            submissions: submissions.clone(),
            shard: 0,
            load: Default::default(),
        },
    )
    .await
    .unwrap();
    let mut runs = Vec::new();
    for (device, route) in routes.iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (actor, _) = Actor::spawn(None, FakeDevice, tx).await.unwrap();
        route.attach(actor);
        batcher.cast(BatcherMsg::DeviceUp { device }).unwrap();
        runs.push(rx);
    }
    Harness {
        batcher,
        submissions,
        runs,
        routes,
        metrics,
    }
}

async fn harness(devices: usize, max_attempts: u32) -> Harness {
    harness_with(devices, 0, max_attempts).await
}

fn submit_input(
    h: &Harness,
    model: usize,
    client_id: u64,
    input: BatchRows,
    deadline: Option<Instant>,
) -> oneshot::Receiver<Reply> {
    let (tx, rx) = oneshot::channel();
    let queued = h.submissions.submit(
        &h.batcher,
        Submission {
            model,
            client_id,
            input,
            priority: 0,
            received: Instant::now(),
            deadline,
            output: crate::daemon::output::OutputForm::default(),
            reply: tx,
            stamps: Default::default(),
        },
    );
    assert!(queued, "the batcher stopped");
    rx
}

fn features(rows: usize, tag: f32) -> BatchRows {
    let data = (0..rows).flat_map(|r| [tag + r as f32, 0.0]).collect();
    BatchRows::Features { features: 2, data }
}

/// Submits a request of `rows` feature rows of width 2 (row `r` is
/// `[tag + r, 0]`) to the MLP; returns its reply channel.
fn submit(h: &Harness, client_id: u64, rows: usize, tag: f32) -> oneshot::Receiver<Reply> {
    submit_input(h, MLP, client_id, features(rows, tag), None)
}

/// Token sequences whose first id is `tag + i` and whose lengths are `lens`.
/// Submits `rows` MLP rows (tag 0) due `ms` milliseconds from now.
fn submit_due(h: &Harness, client_id: u64, rows: usize, ms: u64) -> oneshot::Receiver<Reply> {
    let deadline = Instant::now() + Duration::from_millis(ms);
    submit_input(h, MLP, client_id, features(rows, 0.0), Some(deadline))
}

/// Device 0's worker is gone (`reason`), as its device actor reports it.
fn device_down(h: &Harness, reason: &str) {
    let reason = reason.into();
    h.batcher
        .cast(BatcherMsg::DeviceDown { device: 0, reason })
        .unwrap();
}

/// One more request goes out to device 0 and is answered: the batcher
/// still serves.
async fn still_serves(h: &mut Harness) {
    let r = submit(h, 999, 1, 1.0);
    let (b, a) = next_run(&mut h.runs[0]).await;
    h.batcher.cast(done(0, &b, a)).unwrap();
    assert_eq!(ok_values(reply(r).await), vec![2.0]);
}

fn texts(lens: &[usize], tag: u32) -> BatchRows {
    BatchRows::Tokens(
        lens.iter()
            .enumerate()
            .map(|(i, &l)| (0..l as u32).map(|k| tag + i as u32 + k * 1000).collect())
            .collect(),
    )
}

/// What a worker would return: each row's first feature (or first token
/// id), doubled (output_dim 1).
fn output_for(batch: &Batch) -> BatchOutput {
    let values: Vec<f32> = batch
        .parts
        .iter()
        .flat_map(|part| match part.rows.as_ref() {
            BatchRows::Features { data, .. } => {
                data.chunks(2).map(|r| 2.0 * r[0]).collect::<Vec<_>>()
            }
            BatchRows::Tokens(seqs) => seqs
                .iter()
                .map(|s| 2.0 * s.first().copied().unwrap_or(0) as f32)
                .collect(),
        })
        .collect();
    BatchOutput {
        data: crate::tensor::f32s_to_le(&values),
        output_dim: 1,
        compute_us: 7,
        started_ns: 0,
        finished_ns: 0,
        replayed: true,
    }
}

async fn next_run(rx: &mut mpsc::UnboundedReceiver<(Arc<Batch>, u32)>) -> (Arc<Batch>, u32) {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a batch within 5 s")
        .expect("device channel open")
}

/// A worker's report on (`batch`, `attempt`) from `device`.
fn report(device: DeviceId, batch: &Batch, attempt: u32, outcome: BatchOutcome) -> BatcherMsg {
    BatcherMsg::Report {
        device,
        report: BatchReport {
            batch: batch.id,
            attempt,
            outcome,
        },
    }
}

fn done(device: DeviceId, batch: &Batch, attempt: u32) -> BatcherMsg {
    report(
        device,
        batch,
        attempt,
        BatchOutcome::Done(output_for(batch)),
    )
}

fn ok_values(reply: Reply) -> Vec<f32> {
    match reply {
        Reply::Ok { output, .. } => crate::tensor::f32s_from_le(&output.data),
        Reply::Error { code, message, .. } => panic!("{code}: {message}"),
    }
}

async fn reply(rx: oneshot::Receiver<Reply>) -> Reply {
    tokio::time::timeout(Duration::from_secs(5), rx)
        .await
        .expect("a reply within 5 s")
        .expect("the batcher answers")
}

async fn outstanding(h: &Harness) -> usize {
    h.batcher
        .call(BatcherMsg::Outstanding, Some(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap()
}

fn bucket_stats(h: &Harness, label: &str) -> crate::daemon::stats::BucketReport {
    h.metrics
        .snapshot()
        .buckets
        .into_iter()
        .find(|b| b.bucket == label)
        .unwrap_or_else(|| panic!("no bucket {label}"))
}

#[tokio::test]
async fn outputs_are_split_by_request_in_row_order() {
    let mut h = harness(1, 3).await;
    // The idle device takes the first request at once; the next two queue
    // behind it and go out together.
    let r1 = submit(&h, 11, 1, 100.0);
    let (b1, a1) = next_run(&mut h.runs[0]).await;
    let r2 = submit(&h, 12, 2, 200.0);
    let r3 = submit(&h, 13, 1, 300.0);
    let (b2, a2) = next_run(&mut h.runs[0]).await;
    h.batcher.cast(done(0, &b1, a1)).unwrap();
    let mut rest = vec![b2.clone()];
    if b2.rows < 3 {
        let (b3, a3) = next_run(&mut h.runs[0]).await;
        h.batcher.cast(done(0, &b3, a3)).unwrap();
        rest.push(b3);
    }
    h.batcher.cast(done(0, &b2, a2)).unwrap();
    assert_eq!(ok_values(reply(r1).await), vec![200.0]);
    assert_eq!(ok_values(reply(r2).await), vec![400.0, 402.0]);
    assert_eq!(ok_values(reply(r3).await), vec![600.0]);
    let sent: usize = rest.iter().map(|b| b.rows).sum();
    assert_eq!(sent, 3);
    let stats = h.metrics.snapshot();
    assert_eq!(stats.requests.ok, 3);
}

#[tokio::test]
async fn a_request_larger_than_every_bucket_is_split_and_reassembled_in_order() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 5, 10, 100.0);
    // 4 + 4 rows at once (the device holds two batches), the last 2 after.
    let (b1, a1) = next_run(&mut h.runs[0]).await;
    let (b2, a2) = next_run(&mut h.runs[0]).await;
    assert_eq!(b1.bucket, Some(Bucket::new(4, 1)));
    assert_eq!(b1.parts[0].items, vec![0, 1, 2, 3]);
    assert_eq!(b2.parts[0].items, vec![4, 5, 6, 7]);
    // Finish them out of order.
    h.batcher.cast(done(0, &b2, a2)).unwrap();
    let (b3, a3) = next_run(&mut h.runs[0]).await;
    assert_eq!(
        (b3.bucket, b3.parts[0].items.clone()),
        (Some(Bucket::new(2, 1)), vec![8, 9])
    );
    h.batcher.cast(done(0, &b3, a3)).unwrap();
    h.batcher.cast(done(0, &b1, a1)).unwrap();
    match reply(r).await {
        Reply::Ok {
            id,
            output,
            sparse: None,
            bucket,
            batches,
            compute_us,
            ..
        } => {
            assert_eq!(id, 5);
            assert_eq!(output.shape, vec![10, 1]);
            let want: Vec<f32> = (0..10).map(|i| 2.0 * (100 + i) as f32).collect();
            assert_eq!(crate::tensor::f32s_from_le(&output.data), want);
            // The largest shape it ran in, and all its batches' time.
            assert_eq!((bucket.as_str(), batches, compute_us), ("4x1", 3, 21));
        }
        e => panic!("{e:?}"),
    }
    let stats = h.metrics.snapshot();
    assert_eq!(stats.requests.split, 1);
    assert_eq!(stats.eager.requests, 0);
    let b4 = bucket_stats(&h, "4x1");
    assert_eq!((b4.requests, b4.parts), (1, 2));
    let b2 = bucket_stats(&h, "2x1");
    assert_eq!((b2.requests, b2.parts), (0, 1));
    assert_eq!(outstanding(&h).await, 0);
}

#[tokio::test]
async fn packed_batches_fill_the_smallest_budget_and_replies_keep_order() {
    let mut h = harness(1, 3).await;
    // Budget 32, at most 4 sequences: 10 + 10 + 10 fit; the fourth 10 and
    // the two 3s do not fit the 2 tokens left, and go next, in budget 16.
    let r = submit_input(&h, PACKED, 8, texts(&[10, 10, 10, 10, 3, 3], 1), None);
    let (b1, a1) = next_run(&mut h.runs[0]).await;
    assert_eq!(b1.bucket, Some(Bucket::packed(32, 4)));
    assert_eq!((b1.rows, b1.tokens), (3, 30));
    assert_eq!(b1.parts[0].items, vec![0, 1, 2]);
    h.batcher.cast(done(0, &b1, a1)).unwrap();
    let (b2, a2) = next_run(&mut h.runs[0]).await;
    assert_eq!(b2.bucket, Some(Bucket::packed(16, 4)));
    assert_eq!((b2.rows, b2.tokens), (3, 16));
    h.batcher.cast(done(0, &b2, a2)).unwrap();
    match reply(r).await {
        Reply::Ok {
            output,
            bucket,
            batches,
            ..
        } => {
            let want: Vec<f32> = (1..=6).map(|i| 2.0 * i as f32).collect();
            assert_eq!(crate::tensor::f32s_from_le(&output.data), want);
            assert_eq!((bucket.as_str(), batches), ("32t", 2));
        }
        e => panic!("{e:?}"),
    }
    let b = bucket_stats(&h, "32t");
    assert_eq!((b.tokens, b.computed_tokens), (30, 32));
    assert_eq!(b.seq_fill, 0.75);
}

#[tokio::test]
async fn texts_too_long_for_every_graph_run_eagerly_beside_the_rest() {
    let mut h = harness_with(1, 1, 3).await;
    // Seq buckets 8 and 16: the 30-token text goes to the eager worker, the
    // others to graphs in their own seq buckets.
    let r = submit_input(&h, PADDED, 3, texts(&[5, 30, 12], 10), None);
    let (e, ea) = next_run(&mut h.runs[1]).await;
    assert_eq!((e.bucket, e.parts[0].items.clone()), (None, vec![1]));
    let (g1, a1) = next_run(&mut h.runs[0]).await;
    let (g2, a2) = next_run(&mut h.runs[0]).await;
    let mut graph_buckets = vec![g1.bucket.unwrap(), g2.bucket.unwrap()];
    graph_buckets.sort();
    assert_eq!(graph_buckets, vec![Bucket::new(1, 8), Bucket::new(1, 16)]);
    h.batcher.cast(done(0, &g1, a1)).unwrap();
    h.batcher.cast(done(0, &g2, a2)).unwrap();
    h.batcher.cast(done(1, &e, ea)).unwrap();
    match reply(r).await {
        Reply::Ok {
            output,
            bucket,
            device,
            batches,
            ..
        } => {
            assert_eq!(
                crate::tensor::f32s_from_le(&output.data),
                vec![20.0, 22.0, 24.0]
            );
            assert_eq!(
                (bucket.as_str(), device.as_str(), batches),
                ("eager", "eager:0", 3)
            );
        }
        e => panic!("{e:?}"),
    }
    let stats = h.metrics.snapshot();
    assert_eq!(stats.eager.requests, 1);
    assert_eq!(stats.eager.sequences, 1);
    assert_eq!(stats.eager.by_reason[&EagerReason::SeqTooLong], 1);
}

#[tokio::test]
async fn a_stale_report_from_an_old_attempt_is_ignored() {
    let mut h = harness(2, 3).await;
    let r = submit(&h, 1, 1, 5.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    assert_eq!(attempt, 1);
    // Device 0 dies: the batch goes to device 1 as attempt 2.
    device_down(&h, "killed");
    let (again, attempt2) = next_run(&mut h.runs[1]).await;
    assert_eq!((again.id, attempt2), (batch.id, 2));
    // A late report of attempt 1 (its worker's last words) must not answer
    // the request, nor free device 1's slot.
    let mut wrong = output_for(&batch);
    wrong.data = crate::tensor::f32s_to_le(&[-1.0]);
    h.batcher
        .cast(report(0, &batch, 1, BatchOutcome::Done(wrong)))
        .unwrap();
    h.batcher.cast(done(1, &again, attempt2)).unwrap();
    assert_eq!(ok_values(reply(r).await), vec![10.0]);
    assert_eq!(h.metrics.snapshot().retried_batches, 1);
}

#[tokio::test]
async fn retried_batches_holding_parts_of_several_requests_answer_each_once() {
    let mut h = harness_waiting(1, 0, 3, Duration::from_millis(30)).await;
    let ra = submit(&h, 1, 1, 10.0);
    let (b1, _) = next_run(&mut h.runs[0]).await;
    // The device is busy: B (3 rows) waits, C (3 rows) makes a full batch of
    // all of B and C's first row; C's other two rows wait.
    let rb = submit(&h, 2, 3, 20.0);
    let rc = submit(&h, 3, 3, 30.0);
    let (b2, _) = next_run(&mut h.runs[0]).await;
    assert_eq!(b2.parts.len(), 2);
    assert_eq!(
        (b2.parts[0].items.clone(), b2.parts[1].items.clone()),
        (vec![0, 1, 2], vec![0])
    );
    // The worker dies holding both batches and comes back.
    device_down(&h, "killed");
    h.batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    let mut again = HashMap::new();
    for _ in 0..2 {
        let (b, a) = next_run(&mut h.runs[0]).await;
        assert_eq!(a, 2);
        again.insert(b.id, b);
    }
    assert!(again.contains_key(&b1.id) && again.contains_key(&b2.id));
    // The dead worker's last words about attempt 1 change nothing.
    h.batcher.cast(done(0, &b2, 1)).unwrap();
    h.batcher.cast(done(0, &again[&b2.id], 2)).unwrap();
    assert_eq!(ok_values(reply(rb).await), vec![40.0, 42.0, 44.0]);
    let (b3, a3) = next_run(&mut h.runs[0]).await;
    assert_eq!(b3.parts[0].items, vec![1, 2]);
    h.batcher.cast(done(0, &b3, a3)).unwrap();
    h.batcher.cast(done(0, &again[&b1.id], 2)).unwrap();
    assert_eq!(ok_values(reply(rc).await), vec![60.0, 62.0, 64.0]);
    assert_eq!(ok_values(reply(ra).await), vec![20.0]);
    let stats = h.metrics.snapshot();
    assert_eq!(stats.retried_batches, 2);
    assert_eq!(stats.requests.ok, 3);
    assert_eq!(outstanding(&h).await, 0);
}

#[tokio::test]
async fn batches_of_a_dead_worker_run_again_when_it_is_back() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 1, 2, 1.0);
    let (batch, _) = next_run(&mut h.runs[0]).await;
    device_down(&h, "worker exited");
    // Nothing is sent while the only device is down.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(h.runs[0].try_recv().is_err());
    h.batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    let (again, attempt) = next_run(&mut h.runs[0]).await;
    assert_eq!((again.id, attempt), (batch.id, 2));
    h.batcher.cast(done(0, &again, attempt)).unwrap();
    assert_eq!(ok_values(reply(r).await), vec![2.0, 4.0]);
}

#[tokio::test]
async fn a_batch_lost_max_attempts_times_fails_its_requests() {
    let mut h = harness(1, 2).await;
    let r = submit(&h, 9, 1, 1.0);
    for attempt in 1..=2 {
        let (_, a) = next_run(&mut h.runs[0]).await;
        assert_eq!(a, attempt);
        device_down(&h, "crashed");
        h.batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    }
    match reply(r).await {
        Reply::Error { id, code, message } => {
            assert_eq!((id, code), (9, ErrorCode::Internal));
            assert!(message.contains("2 times"), "{message}");
        }
        ok => panic!("{ok:?}"),
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(h.runs[0].try_recv().is_err(), "no third attempt");
}

#[tokio::test]
async fn a_deadline_is_answered_at_the_deadline_while_the_batch_is_in_flight() {
    let mut h = harness_waiting(1, 0, 3, Duration::from_millis(30)).await;
    let rx = submit(&h, 1, 1, 1.0);
    let (b1, a1) = next_run(&mut h.runs[0]).await;
    // Y (with a deadline) and Z (without) go out together.
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(150);
    let ry = submit_input(&h, MLP, 2, features(1, 10.0), Some(deadline));
    let rz = submit(&h, 3, 1, 20.0);
    let (b2, a2) = next_run(&mut h.runs[0]).await;
    assert_eq!(b2.parts.len(), 2);
    // The worker is slow: nothing comes back before the deadline.
    match reply(ry).await {
        Reply::Error { id, code, message } => {
            assert_eq!((id, code), (2, ErrorCode::DeadlineExceeded));
            assert!(message.contains("running"), "{message}");
        }
        ok => panic!("{ok:?}"),
    }
    let at = t0.elapsed();
    assert!(
        at >= Duration::from_millis(150) && at < Duration::from_millis(650),
        "answered after {at:?}"
    );
    // When the batch does come back, Z is answered and Y's row ignored.
    h.batcher.cast(done(0, &b2, a2)).unwrap();
    h.batcher.cast(done(0, &b1, a1)).unwrap();
    assert_eq!(ok_values(reply(rz).await), vec![40.0]);
    assert_eq!(ok_values(reply(rx).await), vec![2.0]);
    let stats = h.metrics.snapshot();
    assert_eq!(stats.requests.errors[&ErrorCode::DeadlineExceeded], 1);
    assert_eq!(stats.requests.ok, 2);
    assert_eq!(outstanding(&h).await, 0);
}

#[tokio::test]
async fn a_split_request_past_its_deadline_gets_one_reply_and_its_rest_never_runs() {
    let mut h = harness(1, 3).await;
    let t0 = Instant::now();
    let r = submit_due(&h, 4, 10, 150);
    // Two batches of 4 in flight; 2 rows still queued behind them.
    let (b1, a1) = next_run(&mut h.runs[0]).await;
    let (b2, a2) = next_run(&mut h.runs[0]).await;
    assert_eq!(reply(r).await.code(), Some(ErrorCode::DeadlineExceeded));
    assert!(t0.elapsed() >= Duration::from_millis(150));
    // Its batches come back late: no second reply, and its queued rows were
    // dropped, so nothing more is sent.
    h.batcher.cast(done(0, &b1, a1)).unwrap();
    h.batcher.cast(done(0, &b2, a2)).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(h.runs[0].try_recv().is_err(), "the dropped rows ran");
    let stats = h.metrics.snapshot();
    assert_eq!(stats.requests.errors[&ErrorCode::DeadlineExceeded], 1);
    assert_eq!(stats.requests.ok, 0);
    assert_eq!(outstanding(&h).await, 0);
    // The batcher still serves.
    still_serves(&mut h).await;
}

#[tokio::test]
async fn a_retry_of_a_batch_whose_requests_all_expired_is_not_sent() {
    let mut h = harness(1, 3).await;
    let r = submit_due(&h, 1, 1, 50);
    let _ = next_run(&mut h.runs[0]).await;
    assert_eq!(reply(r).await.code(), Some(ErrorCode::DeadlineExceeded));
    device_down(&h, "killed");
    h.batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(h.runs[0].try_recv().is_err(), "nothing left to retry");
    assert_eq!(h.metrics.snapshot().retried_batches, 0);
    // The device slot was freed: new work still goes out.
    still_serves(&mut h).await;
}

#[tokio::test]
async fn a_failed_batch_answers_with_the_workers_error_code() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 4, 1, 1.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    let error = WorkerError::InvalidBatch("rows of 3 features".into());
    h.batcher
        .cast(report(0, &batch, attempt, BatchOutcome::Failed(error)))
        .unwrap();
    assert_eq!(reply(r).await.code(), Some(ErrorCode::BadRequest));
}

#[tokio::test]
async fn abort_answers_everything_still_held() {
    let mut h = harness(1, 3).await;
    // Two in flight (the device's limit), the rest queued.
    let replies: Vec<_> = (0..6).map(|i| submit(&h, i, 4, 0.0)).collect();
    let _ = next_run(&mut h.runs[0]).await;
    let _ = next_run(&mut h.runs[0]).await;
    let n = h
        .batcher
        .call(BatcherMsg::Abort, Some(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, 6);
    for r in replies {
        assert_eq!(reply(r).await.code(), Some(ErrorCode::Unavailable));
    }
    assert_eq!(outstanding(&h).await, 0);
}

#[tokio::test]
async fn a_reply_of_the_wrong_size_fails_the_batch_not_the_daemon() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 2, 2, 1.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    let short = BatchOutput {
        data: crate::tensor::f32s_to_le(&[1.0]),
        output_dim: 1,
        compute_us: 1,
        started_ns: 0,
        finished_ns: 0,
        replayed: true,
    };
    h.batcher
        .cast(report(0, &batch, attempt, BatchOutcome::Done(short)))
        .unwrap();
    assert_eq!(reply(r).await.code(), Some(ErrorCode::Internal));
    // The batcher still serves.
    still_serves(&mut h).await;
}

/// A real shared-memory ring opened on a device's route, read by the
/// daemon's real reader task into a real [`Reporter`]; the test is the
/// worker at the other end.
struct TestRing {
    worker: Ring,
    doorbell: AsyncFd<OwnedFd>,
    reporter: Arc<Reporter>,
    metrics_index: usize,
    _dir: tempfile::TempDir,
}

/// The device's end of a feature batch sent through a ring: what the
/// worker reads from the doorbell and the slot.
struct RingRun {
    batch: u64,
    attempt: u32,
    slot: u32,
    rows: BatchRows,
}

impl TestRing {
    async fn open(h: &Harness, device: DeviceId, slots: u32) -> TestRing {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("test.ring");
        let spec = RingSpec {
            slots,
            input_bytes: 4096,
            output_bytes: 4096,
        };
        let ring = Ring::create(&path, spec).unwrap();
        let worker = Ring::open(&path).unwrap();
        let (ours, theirs) = shm::doorbell_pair().unwrap();
        // SAFETY: F_GETFL/F_SETFL on a socket we own.
        unsafe {
            let flags = libc::fcntl(theirs.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(theirs.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        let (_, status) = tokio::sync::watch::channel(DeviceStatus::Ready);
        let metrics_index = h.metrics.add_device(Default::default(), status);
        let reporter = Arc::new(Reporter::new(
            device,
            super::shards::Batchers::over(
                h.batcher.clone(),
                &vec![DeviceKind::Graph; h.routes.len()],
            ),
            h.metrics.clone(),
            metrics_index,
            Watchdog::new(Duration::from_secs(60), 1.0, Instant::now()),
        ));
        let link = FastLink::new(ring, ours, reporter.clone()).unwrap();
        tokio::spawn(fast_link::serve(link.clone(), h.metrics.clone()));
        h.routes[device].open_ring(link);
        TestRing {
            worker,
            // SAFETY: the AsyncFd owns the socket, so the fd is deregistered
            // before it is closed.
            doorbell: unsafe { AsyncFd::register(theirs) }.unwrap(),
            reporter,
            metrics_index,
            _dir: dir,
        }
    }

    /// The next batch the daemon put in the ring.
    async fn next_run(&self) -> RingRun {
        let mut buf = vec![0u8; shm::MAX_DOORBELL_MESSAGE];
        let msg = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let mut ready = self.doorbell.readable().await.unwrap();
                match shm::ring_recv(self.doorbell.get_ref().as_raw_fd(), &mut buf).unwrap() {
                    Some(n) => break rmp_serde::from_slice::<ToWorker>(&buf[..n]).unwrap(),
                    None => ready.clear_ready(),
                }
            }
        })
        .await
        .expect("a batch in the ring within 5 s");
        let ToWorker::RunShm {
            batch,
            attempt,
            slot,
            rows,
            ..
        } = msg
        else {
            panic!("not a ring batch: {msg:?}");
        };
        assert!(matches!(rows, SlotRows::Features { .. }), "{rows:?}");
        let rows = self.worker.read_rows(slot, rows).unwrap();
        RingRun {
            batch,
            attempt,
            slot,
            rows,
        }
    }

    /// Answers `run` with `values` (one per row) as a worker does: the
    /// output into its slot, the `Done` that hands the slot back on the doorbell.
    fn answer(&self, run: &RingRun, values: &[f32]) {
        self.worker.write_output(run.slot, values).unwrap();
        let done = FromWorker::Done {
            batch: run.batch,
            attempt: run.attempt,
            rows: values.len(),
            output_dim: 1,
            compute_us: 5,
            replayed: true,
            slot: Some(run.slot),
            started_ns: 0,
            finished_ns: 0,
        };
        let bytes = rmp_serde::to_vec_named(&done).unwrap();
        shm::ring_send(self.doorbell.get_ref().as_raw_fd(), &bytes, false).unwrap();
    }

    fn stats(&self, h: &Harness) -> crate::daemon::metrics::DeviceStats {
        h.metrics.devices().swap_remove(self.metrics_index)
    }
}

/// What [`output_for`] computes, from rows the worker read out of a slot.
fn doubled_first_features(rows: &BatchRows) -> Vec<f32> {
    match rows {
        BatchRows::Features { data, .. } => data.chunks(2).map(|r| 2.0 * r[0]).collect(),
        BatchRows::Tokens(_) => panic!("feature rows expected"),
    }
}

/// A batch goes through the ring while it has a free slot, else to the
/// device actor (the socket); the two answers come back by one route: both
/// requests are answered, the device counts each batch once under its
/// transport, and the ring's batch counts as in flight until it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_and_socket_answers_come_back_by_one_route() {
    let mut h = harness(1, 3).await;
    let ring = TestRing::open(&h, 0, 1).await;

    let r1 = submit(&h, 1, 1, 10.0);
    let in_ring = ring.next_run().await;
    assert_eq!(in_ring.rows, features(1, 10.0));
    assert_eq!(ring.stats(&h).inflight, 1, "the ring's batch is in flight");
    // The ring's only slot is taken: the next batch takes the socket.
    let r2 = submit(&h, 2, 2, 20.0);
    let (by_socket, attempt) = next_run(&mut h.runs[0]).await;
    assert_eq!(by_socket.rows, 2);
    // The device actor registers what it sends and reports what comes
    // back through the same reporter.
    ring.reporter.sent(&by_socket, attempt, by_socket.tokens);
    assert_eq!(ring.stats(&h).inflight, 2);

    ring.answer(&in_ring, &doubled_first_features(&in_ring.rows));
    assert_eq!(ok_values(reply(r1).await), vec![20.0]);
    let report = BatchReport {
        batch: by_socket.id,
        attempt,
        outcome: BatchOutcome::Done(output_for(&by_socket)),
    };
    assert_eq!(ring.reporter.report(report, Via::Socket), 0);
    assert_eq!(ok_values(reply(r2).await), vec![40.0, 42.0]);

    let d = ring.stats(&h);
    assert_eq!(
        (d.batches, d.shm_batches, d.socket_batches, d.graph_replays),
        (2, 1, 1, 2)
    );
    assert_eq!((d.inflight, d.shm_slots_free), (0, 1));
    // The slot is free again: the next batch takes the ring.
    let r3 = submit(&h, 3, 1, 30.0);
    let again = ring.next_run().await;
    ring.answer(&again, &doubled_first_features(&again.rows));
    assert_eq!(ok_values(reply(r3).await), vec![60.0]);
}

/// A dead worker's ring reader may still hand over an answer after the
/// batcher re-dispatched the batch: that late answer of the old attempt is
/// ignored, and the request gets the answer of the attempt it waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_ring_answer_from_a_redispatched_attempt_is_ignored() {
    let h = harness(1, 3).await;
    let ring = TestRing::open(&h, 0, 2).await;
    let r = submit(&h, 1, 1, 10.0);
    let first = ring.next_run().await;
    assert_eq!(first.attempt, 1);
    // The worker dies holding it; the device comes back (here on the same
    // ring, so that both answers leave through one reader, in order).
    ring.reporter.worker_gone("killed".into());
    h.batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    let second = ring.next_run().await;
    assert_eq!((second.batch, second.attempt), (first.batch, 2));
    assert_ne!(second.slot, first.slot);
    ring.answer(&first, &[-1.0]);
    ring.answer(&second, &doubled_first_features(&second.rows));
    assert_eq!(ok_values(reply(r).await), vec![20.0]);
    assert_eq!(h.metrics.snapshot().retried_batches, 1);
}
