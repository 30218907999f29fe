//! The batcher actor against fake devices: real actor, real messages; the
//! device side is a test actor that hands every `Run` to the test, which
//! answers as a worker would (or does not).

use super::*;
use crate::daemon::messages::BatchOutput;
use crate::protocol::Reply;
use ractor::ActorRef;
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
    runs: Vec<mpsc::UnboundedReceiver<(Arc<Batch>, u32)>>,
    metrics: Arc<Metrics>,
}

/// A batcher over one MLP-like model (batch buckets 1, 2, 4; no seq axis)
/// and `devices` fake graph devices, all up.
async fn harness(devices: usize, max_attempts: u32) -> Harness {
    let metrics = Arc::new(Metrics::new());
    let (batcher, _) = Actor::spawn(
        None,
        BatcherActor,
        BatcherArgs {
            models: vec![ModelSlot {
                name: "m".into(),
                grid: BucketGrid::new(vec![1, 2, 4], vec![1]),
            }],
            devices: (0..devices)
                .map(|i| (DeviceKind::Graph, format!("fake:{i}")))
                .collect(),
            config: SchedulerConfig {
                max_wait: Duration::from_micros(100),
                max_queue: 64,
                max_inflight: 2,
                eager_max_queue: 4,
            },
            max_attempts,
            metrics: metrics.clone(),
        },
    )
    .await
    .unwrap();
    let mut runs = Vec::new();
    for device in 0..devices {
        let (tx, rx) = mpsc::unbounded_channel();
        let (actor, _) = Actor::spawn(None, FakeDevice, tx).await.unwrap();
        batcher
            .cast(BatcherMsg::AttachDevice { device, actor })
            .unwrap();
        batcher.cast(BatcherMsg::DeviceUp { device }).unwrap();
        runs.push(rx);
    }
    Harness {
        batcher,
        runs,
        metrics,
    }
}

/// Submits a request of `rows` feature rows of width 2 (row `r` is
/// `[tag + r, 0]`); returns its reply channel.
fn submit(h: &Harness, client_id: u64, rows: usize, tag: f32) -> oneshot::Receiver<Reply> {
    let (tx, rx) = oneshot::channel();
    let data = (0..rows).flat_map(|r| [tag + r as f32, 0.0]).collect();
    h.batcher
        .cast(BatcherMsg::Submit(Submission {
            model: 0,
            client_id,
            input: BatchRows::Features { features: 2, data },
            priority: 0,
            received: Instant::now(),
            deadline: None,
            output_dtype: DType::F32,
            reply: tx,
        }))
        .unwrap();
    rx
}

/// What a worker would return: each row's first feature, doubled (output_dim 1).
fn output_for(batch: &Batch) -> BatchOutput {
    let values: Vec<f32> = batch
        .parts
        .iter()
        .flat_map(|(_, rows)| match rows.as_ref() {
            BatchRows::Features { data, .. } => {
                data.chunks(2).map(|r| 2.0 * r[0]).collect::<Vec<_>>()
            }
            BatchRows::Tokens(_) => unreachable!(),
        })
        .collect();
    BatchOutput {
        data: crate::tensor::f32s_to_le(&values),
        output_dim: 1,
        compute_us: 7,
    }
}

async fn next_run(rx: &mut mpsc::UnboundedReceiver<(Arc<Batch>, u32)>) -> (Arc<Batch>, u32) {
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a batch within 5 s")
        .expect("device channel open")
}

fn done(device: DeviceId, batch: &Batch, attempt: u32) -> BatcherMsg {
    BatcherMsg::BatchDone {
        device,
        batch: batch.id,
        attempt,
        output: output_for(batch),
    }
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
    assert_eq!(stats["requests"]["ok"], 3);
}

#[tokio::test]
async fn a_stale_report_from_an_old_attempt_is_ignored() {
    let mut h = harness(2, 3).await;
    let r = submit(&h, 1, 1, 5.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    assert_eq!(attempt, 1);
    // Device 0 dies: the batch goes to device 1 as attempt 2.
    h.batcher
        .cast(BatcherMsg::DeviceDown {
            device: 0,
            reason: "killed".into(),
        })
        .unwrap();
    let (again, attempt2) = next_run(&mut h.runs[1]).await;
    assert_eq!((again.id, attempt2), (batch.id, 2));
    // A late report of attempt 1 (its worker's last words) must not answer
    // the request, nor free device 1's slot.
    let mut wrong = output_for(&batch);
    wrong.data = crate::tensor::f32s_to_le(&[-1.0]);
    h.batcher
        .cast(BatcherMsg::BatchDone {
            device: 0,
            batch: batch.id,
            attempt: 1,
            output: wrong,
        })
        .unwrap();
    h.batcher.cast(done(1, &again, attempt2)).unwrap();
    assert_eq!(ok_values(reply(r).await), vec![10.0]);
    assert_eq!(h.metrics.snapshot()["retried_batches"], 1);
}

#[tokio::test]
async fn batches_of_a_dead_worker_run_again_when_it_is_back() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 1, 2, 1.0);
    let (batch, _) = next_run(&mut h.runs[0]).await;
    h.batcher
        .cast(BatcherMsg::DeviceDown {
            device: 0,
            reason: "worker exited".into(),
        })
        .unwrap();
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
        h.batcher
            .cast(BatcherMsg::DeviceDown {
                device: 0,
                reason: "crashed".into(),
            })
            .unwrap();
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
async fn a_failed_batch_answers_with_the_workers_error_code() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 4, 1, 1.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    h.batcher
        .cast(BatcherMsg::BatchFailed {
            device: 0,
            batch: batch.id,
            attempt,
            error: WorkerError::InvalidBatch("rows of 3 features".into()),
        })
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
    let left = h
        .batcher
        .call(BatcherMsg::Outstanding, Some(Duration::from_secs(5)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, 0);
}

#[tokio::test]
async fn a_reply_of_the_wrong_size_fails_the_batch_not_the_daemon() {
    let mut h = harness(1, 3).await;
    let r = submit(&h, 2, 2, 1.0);
    let (batch, attempt) = next_run(&mut h.runs[0]).await;
    h.batcher
        .cast(BatcherMsg::BatchDone {
            device: 0,
            batch: batch.id,
            attempt,
            output: BatchOutput {
                data: crate::tensor::f32s_to_le(&[1.0]),
                output_dim: 1,
                compute_us: 1,
            },
        })
        .unwrap();
    assert_eq!(reply(r).await.code(), Some(ErrorCode::Internal));
    // The batcher still serves.
    let r = submit(&h, 3, 1, 1.0);
    let (b, a) = next_run(&mut h.runs[0]).await;
    h.batcher.cast(done(0, &b, a)).unwrap();
    assert_eq!(ok_values(reply(r).await), vec![2.0]);
}
