//! `replayd-hostbench`: CPU-only micro-benchmarks of each stage of replayd's
//! host path, one table of figures at the end (and JSON with `--json`).
//! Needs no GPU; the link stage starts real `replayd worker` processes on
//! the null backend (which computes nothing), so only the host path is timed.
//!
//! ```sh
//! scripts/dev/fetch-model.sh                      # the tokenizer and model config
//! cargo build --release --bins
//! target/release/replayd-hostbench            # every stage, ~1 minute
//! target/debug/replayd-hostbench --seconds 0.25 --iters 300   # what CI runs (seconds)
//! target/release/replayd-hostbench --only link,transport --seconds 2 --json /tmp/hb.json
//! ```
//!
//! Stages (each figure is per one core unless it says otherwise):
//! * `protocol` — decode a one-text request, encode its 384-float reply.
//! * `tokenize` — one 12–16-token text inline, and one corpus-like text
//!   (as `scripts/bench/make-corpus.py` makes them, ~27 tokens), each through the
//!   daemon's path (the WordPiece fast path for ASCII text) and through the
//!   HF tokenizer alone; the pool round trip (sequential latency) and the
//!   pool's throughput from 256 tasks.
//! * `scheduler` — the batcher's state machine alone: enqueue, form the
//!   batch, complete, finish, per one-text request (packed, default ladder).
//! * `batcher` — the batcher actor with instant fake devices: one-text
//!   requests from 256 tasks, replies/s (its mailbox, scheduling, replies).
//! * `link` — the daemon ↔ worker round trip of a one-text batch and of a
//!   256-text batch, through the shared-memory ring and through the socket
//!   (sequential latency, and throughput with two batches in flight).
//! * `transport` — a ROUTER echo over tcp loopback with one-text requests and
//!   384-float replies: one client one at a time, and 8 clients × 32 in flight.

use clap::Parser;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use replayd::bucket::{Bucket, Grid, TokenGrid};
use replayd::daemon::batcher::queue::{
    Action, DeviceKind, QueuedRequest, Scheduler, SchedulerConfig,
};
use replayd::daemon::batcher::shards::Batchers;
use replayd::daemon::batcher::{BatcherActor, BatcherArgs, ModelSlot, SubmitQueue};
use replayd::daemon::device::{DeviceActor, DeviceArgs, WorkerCommand};
use replayd::daemon::messages::{
    Batch, BatchOutcome, BatchOutput, BatchPart, BatchReport, BatcherMsg, DeviceMsg, DeviceStatus,
    Stamps, Submission,
};
use replayd::daemon::metrics::Metrics;
use replayd::daemon::route::DeviceRoute;
use replayd::daemon::tokenize::{TextTokenizer, TokenizerPool};
use replayd::model::BatchRows;
use replayd::protocol::{
    decode_reply, decode_request, encode_reply, encode_request, DecodeLimits, Hops, InputKind,
    Payload, Reply, RequestHeader,
};
use replayd::tensor::HostTensor;
use replayd::transport::{Dealer, Router, Security, TransportLimits};
use replayd::worker::WorkerBackend;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

#[derive(Parser, Debug, Clone)]
#[command(about = "CPU-only micro-benchmarks of replayd's host path")]
struct Args {
    /// The model folder (tokenizer.json, config.json, model.safetensors).
    #[arg(long, default_value = "models/all-MiniLM-L6-v2")]
    model: PathBuf,
    /// The `replayd` executable for the link stage (default: beside this one).
    #[arg(long)]
    replayd: Option<PathBuf>,
    /// Comma-separated stages to run (default: all).
    #[arg(long)]
    only: Option<String>,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 5000)]
    iters: usize,
    /// Write the figures here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A 14-token text (12 words + `[CLS]` and `[SEP]`), as in target 1.
const TEXT: &str = "the quick brown fox jumps over the lazy dog by the river";
const DIM: usize = 384;

struct Table {
    rows: Vec<(String, String, String, String)>,
    json: serde_json::Map<String, Value>,
}

impl Table {
    fn add(&mut self, stage: &str, what: &str, value: f64, unit: &str) {
        let shown = if value >= 100.0 {
            format!("{value:.0}")
        } else {
            format!("{value:.2}")
        };
        eprintln!("  {stage:<10} {what:<58} {shown:>12} {unit}");
        self.rows
            .push((stage.into(), what.into(), shown, unit.into()));
        self.json.insert(
            format!("{stage}.{what}"),
            json!({"value": value, "unit": unit}),
        );
    }

    fn lat(&mut self, stage: &str, what: &str, mut ns: Vec<u64>) {
        ns.sort_unstable();
        let q = |p: f64| ns[((ns.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0;
        self.add(stage, &format!("{what} p50"), q(0.5), "µs");
        self.add(stage, &format!("{what} p99"), q(0.99), "µs");
    }
}

/// ns per call of `f`, over `n` calls.
fn per_call(n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..n.min(1000) {
        f();
    }
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

fn request_frames(id: u64) -> Vec<bytes::Bytes> {
    let h = RequestHeader::new(id, "all-MiniLM-L6-v2", InputKind::Texts);
    encode_request(&h, &Payload::Texts(vec![TEXT.into()]))
}

fn ok_reply(id: u64) -> Reply {
    Reply::Ok {
        id,
        output: HostTensor::from_f32(vec![1, DIM], &[0.05; DIM]),
        sparse: None,
        bucket: "64t".into(),
        device: "cuda:0".into(),
        queued_us: 3,
        compute_us: 100,
        total_us: 150,
        batches: 1,
        hops: Hops {
            decode: 5,
            tokenize: 10,
            wait: 3,
            to_worker: 8,
            device: 100,
            back: 8,
            reply: 16,
        },
    }
}

fn protocol(t: &mut Table, args: &Args) {
    let n = args.iters * 40;
    let frames = request_frames(7);
    let limits = DecodeLimits::default();
    let ns = per_call(n, || {
        std::hint::black_box(decode_request(std::hint::black_box(&frames), &limits).unwrap());
    });
    t.add("protocol", "decode a one-text request", ns / 1000.0, "µs");
    let reply = ok_reply(7);
    let ns = per_call(n, || {
        std::hint::black_box(encode_reply(std::hint::black_box(&reply)));
    });
    t.add(
        "protocol",
        "encode a 384-float reply (with hops)",
        ns / 1000.0,
        "µs",
    );
    let encoded = encode_reply(&reply);
    let ns = per_call(n, || {
        std::hint::black_box(decode_reply(std::hint::black_box(&encoded)).unwrap());
    });
    t.add(
        "protocol",
        "decode that reply (client side)",
        ns / 1000.0,
        "µs",
    );
}

async fn tokenize(t: &mut Table, args: &Args) {
    let tok = Arc::new(TextTokenizer::load(&args.model, 512).expect("tokenizer"));
    let n = tok.encode(&[TEXT], true).unwrap()[0].len();
    assert!((12..=16).contains(&n), "{n} tokens");
    if let Err(why) = tok.fast_path() {
        eprintln!(
            "hostbench: no tokenizer fast path for {}: {why}",
            args.model.display()
        );
    }
    // The daemon's path (the fast WordPiece path where it applies), and
    // beside it the HF tokenizer alone on the same texts.
    let ns = per_call(args.iters * 4, || {
        std::hint::black_box(tok.encode(&[TEXT], true).unwrap());
    });
    t.add(
        "tokenize",
        &format!("one {n}-token text, inline"),
        ns / 1000.0,
        "µs",
    );
    let ns = per_call(args.iters * 4, || {
        std::hint::black_box(tok.encode_reference(&[TEXT], true).unwrap());
    });
    t.add(
        "tokenize",
        &format!("one {n}-token text, inline, HF tokenizer only"),
        ns / 1000.0,
        "µs",
    );
    let corpus = corpus_like(&args.model.join("vocab.txt"), 1000);
    let mean = corpus
        .iter()
        .map(|c| tok.encode(&[c.as_str()], true).unwrap()[0].len())
        .sum::<usize>() as f64
        / corpus.len() as f64;
    for (reference, what) in [(false, ""), (true, ", HF tokenizer only")] {
        let mut i = 0;
        let ns = per_call(args.iters * 4, || {
            let text = [corpus[i % corpus.len()].as_str()];
            i += 1;
            std::hint::black_box(if reference {
                tok.encode_reference(&text, true).unwrap()
            } else {
                tok.encode(&text, true).unwrap()
            });
        });
        t.add(
            "tokenize",
            &format!("one corpus-like text (mean {mean:.1} tokens), inline{what}"),
            ns / 1000.0,
            "µs",
        );
    }
    let pool = TokenizerPool::new(tok.clone(), 0);
    let mut lat = Vec::new();
    for i in 0..args.iters.min(5000) + 200 {
        let t0 = Instant::now();
        pool.encode(vec![TEXT.into()], true).await.unwrap();
        if i >= 200 {
            lat.push(t0.elapsed().as_nanos() as u64);
        }
    }
    t.lat("tokenize", "pool round trip (one text)", lat);
    for inline in [false, true] {
        let done = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs_f64(args.seconds);
        let tasks: Vec<_> = (0..256)
            .map(|_| {
                let (pool, done) = (pool.clone(), done.clone());
                tokio::spawn(async move {
                    while Instant::now() < until {
                        if inline {
                            std::hint::black_box(pool.tokenizer().encode(&[TEXT], true).unwrap());
                            tokio::task::yield_now().await;
                        } else {
                            pool.encode(vec![TEXT.into()], true).await.unwrap();
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let what = if inline {
            "inline on the runtime's threads, 256 tasks"
        } else {
            "through the pool, 256 tasks"
        };
        t.add(
            "tokenize",
            &format!("texts/s {what} (all cores)"),
            done.load(Ordering::Relaxed) as f64 / args.seconds,
            "texts/s",
        );
    }
}

/// Texts as `scripts/bench/make-corpus.py` makes them (alphabetic vocabulary
/// words of three or more characters, 3–200 per text, log-normal count with
/// mean about 25: about 27 tokens), from a fixed seed.
fn corpus_like(vocab: &std::path::Path, count: usize) -> Vec<String> {
    let vocab = std::fs::read_to_string(vocab).expect("the model's vocab.txt");
    let words: Vec<&str> = vocab
        .lines()
        .filter(|w| w.chars().count() > 2 && w.chars().all(char::is_alphabetic))
        .collect();
    let mut state = 7u64;
    let mut next = move || {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..count)
        .map(|_| {
            // exp(N(3.0, 0.7)), N from the sum of 12 uniforms.
            let n = (0..12)
                .map(|_| next() as f64 / u64::MAX as f64)
                .sum::<f64>()
                - 6.0;
            let k = ((3.0 + 0.7 * n).exp() as usize).clamp(3, 200);
            (0..k)
                .map(|_| words[(next() % words.len() as u64) as usize])
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

fn default_grid() -> TokenGrid {
    TokenGrid::new(vec![64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], 256)
}

fn scheduler(t: &mut Table, args: &Args) {
    for (label, queued) in [("one request at a time", 1usize), ("256 queued", 256)] {
        let mut s = Scheduler::new(
            SchedulerConfig {
                max_wait: Duration::from_micros(500),
                max_queue: 1 << 20,
                max_inflight: 2,
                eager_max_queue: 16,
            },
            vec![Grid::Packed(default_grid())],
        );
        let dev = s.add_device(DeviceKind::Graph);
        s.set_healthy(dev, true);
        let now = Instant::now();
        let mut id = 0u64;
        let total = args.iters * 40;
        let t0 = Instant::now();
        while (id as usize) < total {
            for _ in 0..queued {
                id += 1;
                s.enqueue(QueuedRequest {
                    id,
                    model: 0,
                    lens: vec![14],
                    priority: 0,
                    arrived: now,
                    deadline: None,
                })
                .unwrap();
            }
            loop {
                let actions = s.poll(now);
                if actions.is_empty() {
                    break;
                }
                for a in actions {
                    if let Action::Dispatch { device, plan } = a {
                        for r in plan.requests() {
                            s.finish(r);
                        }
                        s.completed(device);
                    }
                }
            }
        }
        let ns = t0.elapsed().as_nanos() as f64 / total as f64;
        t.add(
            "scheduler",
            &format!("per one-text request, {label}"),
            ns / 1000.0,
            "µs",
        );
    }
}

/// A device that answers every batch at once with zeros.
struct InstantDevice;

impl Actor for InstantDevice {
    type Msg = DeviceMsg;
    type State = ActorRef<BatcherMsg>;
    type Arguments = ActorRef<BatcherMsg>;

    async fn pre_start(
        &self,
        _: ActorRef<DeviceMsg>,
        batcher: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(batcher)
    }

    async fn handle(
        &self,
        _: ActorRef<DeviceMsg>,
        msg: DeviceMsg,
        batcher: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let DeviceMsg::Run { batch, attempt } = msg {
            let output = BatchOutput {
                data: bytes::Bytes::from(vec![0u8; batch.rows * DIM * 4]),
                output_dim: DIM,
                compute_us: 1,
                started_ns: 0,
                finished_ns: 0,
                replayed: true,
            };
            let _ = batcher.cast(BatcherMsg::Report {
                device: 0,
                report: BatchReport {
                    batch: batch.id,
                    attempt,
                    outcome: BatchOutcome::Done(output),
                },
            });
        }
        Ok(())
    }
}

async fn batcher(t: &mut Table, args: &Args) {
    let metrics = Arc::new(Metrics::new());
    // Submitted as the frontend does: into the queue, waking the batcher
    // when it was empty.
    let queue = Arc::new(SubmitQueue::default());
    let route = Arc::new(DeviceRoute::default());
    let (batcher, _) = Actor::spawn(
        None,
        BatcherActor,
        BatcherArgs {
            models: vec![ModelSlot {
                name: "all-MiniLM-L6-v2".into(),
                grid: Grid::Packed(default_grid()),
            }],
            devices: vec![(DeviceKind::Graph, "fake:0".into())],
            routes: vec![route.clone()],
            config: SchedulerConfig {
                max_wait: Duration::from_micros(500),
                max_queue: 1 << 20,
                max_inflight: 2,
                eager_max_queue: 16,
            },
            max_attempts: 3,
            metrics: metrics.clone(),
            submissions: queue.clone(),
            shard: 0,
            load: Default::default(),
        },
    )
    .await
    .unwrap();
    let (device, _) = Actor::spawn(None, InstantDevice, batcher.clone())
        .await
        .unwrap();
    route.attach(device);
    batcher.cast(BatcherMsg::DeviceUp { device: 0 }).unwrap();
    let ids: Vec<u32> = (0..14).map(|i| 1000 + i).collect();
    fn submit(
        batcher: &ActorRef<BatcherMsg>,
        queue: &SubmitQueue,
        ids: &[u32],
    ) -> oneshot::Receiver<replayd::protocol::Reply> {
        let (tx, rx) = oneshot::channel();
        let queued = queue.submit(
            batcher,
            Submission {
                model: 0,
                client_id: 1,
                input: BatchRows::Tokens(vec![ids.to_vec()]),
                priority: 0,
                received: Instant::now(),
                deadline: None,
                output: replayd::daemon::output::OutputForm::default(),
                reply: tx,
                stamps: Stamps::default(),
            },
        );
        assert!(queued, "the batcher stopped");
        rx
    }
    let mut lat = Vec::new();
    for i in 0..args.iters + 200 {
        let t0 = Instant::now();
        submit(&batcher, &queue, &ids).await.unwrap();
        if i >= 200 {
            lat.push(t0.elapsed().as_nanos() as u64);
        }
    }
    t.lat("batcher", "submit → reply, one request at a time", lat);
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(args.seconds);
    let tasks: Vec<_> = (0..256)
        .map(|_| {
            let (batcher, done, ids) = (batcher.clone(), done.clone(), ids.clone());
            let queue = queue.clone();
            tokio::spawn(async move {
                while Instant::now() < until {
                    submit(&batcher, &queue, &ids).await.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let s = metrics.snapshot();
    let batches: u64 = s.buckets.iter().map(|b| b.batches).sum();
    let replies = done.load(Ordering::Relaxed);
    t.add(
        "batcher",
        "one-text requests/s from 256 tasks (instant device)",
        replies as f64 / args.seconds,
        "req/s",
    );
    t.add(
        "batcher",
        "  texts per batch meanwhile",
        replies as f64 / batches.max(1) as f64,
        "texts",
    );
    batcher.stop(None);
}

/// The batcher's side of the link bench: what the device actor tells it.
enum Heard {
    Up,
    Done(u64, usize),
}

struct FakeBatcher;

impl Actor for FakeBatcher {
    type Msg = BatcherMsg;
    type State = mpsc::UnboundedSender<Heard>;
    type Arguments = mpsc::UnboundedSender<Heard>;

    async fn pre_start(
        &self,
        _: ActorRef<BatcherMsg>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle(
        &self,
        _: ActorRef<BatcherMsg>,
        msg: BatcherMsg,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let _ = match msg {
            BatcherMsg::DeviceUp { .. } => tx.send(Heard::Up),
            BatcherMsg::Report { report, .. } => match report.outcome {
                BatchOutcome::Done(output) => tx.send(Heard::Done(report.batch, output.data.len())),
                BatchOutcome::Failed(error) => panic!("batch failed: {error}"),
            },
            _ => Ok(()),
        };
        Ok(())
    }
}

fn worker_config(dir: &std::path::Path, model: &std::path::Path) -> PathBuf {
    let path = dir.join("hostbench.toml");
    std::fs::write(
        &path,
        format!(
            "[devices]\nbackend = \"null\"\n\n[[models]]\nname = \"all-MiniLM-L6-v2\"\nkind = \"bert\"\npath = \"{}\"\nbatching = \"packed\"\n",
            std::fs::canonicalize(model).expect("model folder").display()
        ),
    )
    .unwrap();
    path
}

fn batch_of(id: u64, texts: usize) -> Arc<Batch> {
    let ids: Vec<u32> = (0..14).map(|i| 1000 + i).collect();
    let rows = Arc::new(BatchRows::Tokens(vec![ids; texts]));
    let bucket: Bucket = default_grid().bucket_for(14 * texts, texts).unwrap();
    Arc::new(Batch {
        id,
        model: 0,
        bucket: Some(bucket),
        parts: vec![BatchPart {
            request: id,
            items: (0..texts as u32).collect(),
            rows,
        }],
        rows: texts,
        tokens: 14 * texts,
    })
}

async fn link(t: &mut Table, args: &Args) {
    let exe = args.replayd.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .unwrap()
            .parent()
            .unwrap()
            .join("replayd")
    });
    let dir = std::env::temp_dir().join(format!("replayd-hostbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = worker_config(&dir, &args.model);
    let runtime_dir = dir.join("run");
    replayd::daemon::runtime_dir::prepare(&runtime_dir, None).unwrap();
    for shm in [true, false] {
        let (tx, mut heard) = mpsc::unbounded_channel();
        let (fake, _) = Actor::spawn(None, FakeBatcher, tx).await.unwrap();
        let metrics = Arc::new(Metrics::new());
        let (status, status_rx) = tokio::sync::watch::channel(DeviceStatus::Starting);
        let index = metrics.add_device(Default::default(), status_rx);
        let route = Arc::new(DeviceRoute::default());
        let ring = shm.then_some(replayd::worker::shm::RingSpec {
            slots: 3,
            input_bytes: 4 * (256 + 16384),
            output_bytes: (4 * 256 * DIM) as u64,
        });
        let (device, handle) = Actor::spawn(
            None,
            DeviceActor,
            DeviceArgs {
                device: 0,
                metrics_index: index,
                label: "null:0".into(),
                worker: WorkerCommand {
                    exe: exe.clone(),
                    config_path: config_path.clone(),
                    backend: WorkerBackend::Null,
                    ordinal: 0,
                    threads: 1,
                    eager: false,
                    spin_us: None,
                },
                runtime_dir: runtime_dir.clone(),
                batchers: Batchers::over(fake.clone(), &[DeviceKind::Graph]),
                route: route.clone(),
                metrics: metrics.clone(),
                status: Arc::new(status),
                model_names: vec!["all-MiniLM-L6-v2".into()],
                backoff_initial: Duration::from_millis(100),
                backoff_max: Duration::from_secs(1),
                start_timeout: Duration::from_secs(60),
                stop_timeout: Duration::from_secs(5),
                fault_injection: false,
                hang_timeout: Duration::from_secs(10),
                heartbeat: Duration::from_millis(100),
                cold_us_per_token: 20.0,
                ring,
            },
        )
        .await
        .unwrap();
        loop {
            match tokio::time::timeout(Duration::from_secs(60), heard.recv()).await {
                Ok(Some(Heard::Up)) => break,
                Ok(Some(Heard::Done(..))) => {}
                _ => panic!("the null worker did not start ({})", exe.display()),
            }
        }
        let fast = route.ring();
        assert_eq!(fast.is_some(), shm, "ring link");
        let path = if shm { "shared-memory ring" } else { "socket" };
        let send = |b: &Arc<Batch>| match &fast {
            Some(l) => assert!(l.send(b, 1), "the ring took it"),
            None => device
                .cast(DeviceMsg::Run {
                    batch: b.clone(),
                    attempt: 1,
                })
                .unwrap(),
        };
        let mut next_id = 1u64;
        for texts in [1usize, 256] {
            let mut lat = Vec::new();
            let n = if texts == 1 {
                args.iters
            } else {
                args.iters / 5
            };
            for i in 0..n + 100 {
                let b = batch_of(next_id, texts);
                next_id += 1;
                let t0 = Instant::now();
                send(&b);
                match heard.recv().await {
                    Some(Heard::Done(id, bytes)) => {
                        assert_eq!((id, bytes), (b.id, texts * DIM * 4))
                    }
                    _ => panic!("no answer"),
                }
                if i >= 100 {
                    lat.push(t0.elapsed().as_nanos() as u64);
                }
            }
            t.lat(
                "link",
                &format!("{path}: {texts}-text batch round trip"),
                lat,
            );
            // Two in flight, as max_inflight_per_device allows.
            let until = Instant::now() + Duration::from_secs_f64(args.seconds);
            let mut done = 0u64;
            let mut outstanding = 0;
            while Instant::now() < until || outstanding > 0 {
                while outstanding < 2 && Instant::now() < until {
                    send(&batch_of(next_id, texts));
                    next_id += 1;
                    outstanding += 1;
                }
                match heard.recv().await {
                    Some(Heard::Done(..)) => {
                        outstanding -= 1;
                        done += 1;
                    }
                    _ => panic!("no answer"),
                }
            }
            t.add(
                "link",
                &format!("{path}: {texts}-text batches/s, 2 in flight"),
                done as f64 / args.seconds,
                "batches/s",
            );
        }
        let d = &metrics.devices()[0];
        eprintln!(
            "    ({path}: {} batches through the ring, {} through the socket)",
            d.shm_batches, d.socket_batches
        );
        drop(fast);
        let _ = device
            .call(DeviceMsg::Stop, Some(Duration::from_secs(10)))
            .await;
        device.stop(None);
        let _ = handle.await;
        fake.stop(None);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

async fn transport(t: &mut Table, args: &Args) {
    let limits = TransportLimits::default();
    let router = Router::bind("tcp://127.0.0.1:0", &limits, &Security::None)
        .await
        .unwrap();
    let endpoint = router.endpoint().to_string();
    let (mut rx, tx) = router.split();
    let reply = Arc::new(encode_reply(&ok_reply(1)));
    let server = tokio::spawn(async move {
        while let Ok(m) = rx.recv().await {
            let (tx, reply) = (tx.clone(), reply.clone());
            tokio::spawn(async move {
                let _ = tx.send(&m.peer, (*reply).clone());
                drop(m.permit);
            });
        }
    });
    let client_limits = replayd::protocol::client::client_limits();
    let frames = request_frames(1);
    {
        let (mut crx, ctx) = Dealer::connect(&endpoint, &client_limits, &Security::None)
            .await
            .unwrap()
            .split();
        let mut lat = Vec::new();
        for i in 0..args.iters + 500 {
            let t0 = Instant::now();
            ctx.send(frames.clone()).unwrap();
            crx.recv().await.unwrap();
            if i >= 500 {
                lat.push(t0.elapsed().as_nanos() as u64);
            }
        }
        t.lat(
            "transport",
            "tcp round trip, one client, one at a time",
            lat,
        );
    }
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs_f64(args.seconds);
    let mut clients = Vec::new();
    for _ in 0..8 {
        let (mut crx, ctx) = Dealer::connect(&endpoint, &client_limits, &Security::None)
            .await
            .unwrap()
            .split();
        let (frames, done) = (frames.clone(), done.clone());
        clients.push(tokio::spawn(async move {
            for _ in 0..32 {
                ctx.send(frames.clone()).unwrap();
            }
            while Instant::now() < until {
                if crx.recv().await.is_err() {
                    break;
                }
                done.fetch_add(1, Ordering::Relaxed);
                ctx.send(frames.clone()).unwrap();
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    t.add(
        "transport",
        "tcp replies/s, 8 clients × 32 in flight (all cores)",
        done.load(Ordering::Relaxed) as f64 / args.seconds,
        "replies/s",
    );
    server.abort();
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let wanted = |stage: &str| {
        args.only
            .as_deref()
            .is_none_or(|o| o.split(',').any(|s| s.trim() == stage))
    };
    let mut t = Table {
        rows: Vec::new(),
        json: serde_json::Map::new(),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("replayd-hostbench: {cores} cores");
    if wanted("protocol") {
        protocol(&mut t, &args);
    }
    if wanted("tokenize") {
        tokenize(&mut t, &args).await;
    }
    if wanted("scheduler") {
        scheduler(&mut t, &args);
    }
    if wanted("batcher") {
        batcher(&mut t, &args).await;
    }
    if wanted("link") {
        link(&mut t, &args).await;
    }
    if wanted("transport") {
        transport(&mut t, &args).await;
    }
    println!("| stage | figure | value | unit |");
    println!("|---|---|---|---|");
    for (stage, what, value, unit) in &t.rows {
        println!("| {stage} | {what} | {value} | {unit} |");
    }
    if let Some(path) = &args.json {
        t.json.insert("cores".into(), json!(cores));
        std::fs::write(
            path,
            serde_json::to_string_pretty(&Value::Object(t.json)).unwrap(),
        )
        .expect("write --json");
    }
}
